//! The settings every worker has, whatever its role: listening, identity, the model and its
//! pool, the router it registers with, transports, backend and security. A role's settings
//! embed [`WorkerSettings`] flattened (the TOML table, `PDSERVE_*` names and flags stay flat)
//! and add their own keys; [`WorkerFlags`] is the matching command line.

use std::{net::SocketAddr, path::PathBuf};

use common::config::{Invalid, check_advertise, check_host_port, check_range};
use engine::{
    paged::layout::KvStorage, parallel::group::GroupSpec, plan::shard::Parallel,
    scheduler::EngineConfig,
};
use kernels::backend::BackendKind;
use proto::v1::TransportKind;
use serde::{Deserialize, Serialize};

mod kernel_choice;

pub use kernel_choice::{
    DecodeAttention, DecodeExperts, DecodeLinears, PrefillAttention, PrefillExperts, PrefillLinears,
};

/// A state transport, written in configuration as its name (`ucx`, `tcp`, `nccl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transport(pub TransportKind);

impl Serialize for Transport {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(kv_transfer::handshake::transport_name(self.0))
    }
}

impl<'de> Deserialize<'de> for Transport {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        kv_transfer::handshake::parse_transport(&name)
            .map(Self)
            .map_err(serde::de::Error::custom)
    }
}

/// How a worker stores the attention K=V rows of requests (vLLM's `--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    /// The exact form, f32 (what `auto` means here: the reference arithmetic).
    Auto,
    F32,
    /// DeepSeek's per-token FP8 rows (lossy, 3.6x smaller; `pdctl bench-engine` prints the
    /// drift against f32).
    Fp8,
    /// bf16 rows (lossy, 2x smaller: every value rounded to nearest even bf16; also spelled
    /// `bfloat16`, as vLLM does).
    #[serde(alias = "bfloat16")]
    #[value(alias = "bfloat16")]
    Bf16,
}

impl KvCacheDtype {
    pub fn storage(self) -> KvStorage {
        match self {
            Self::Auto | Self::F32 => KvStorage::F32,
            Self::Fp8 => KvStorage::Fp8,
            Self::Bf16 => KvStorage::Bf16,
        }
    }
}

/// `--enable-prefix-caching` / `--no-enable-prefix-caching` (vLLM's spellings), as the one
/// setting `enable_prefix_caching`.
#[derive(Debug, Default, clap::Args)]
pub struct PrefixCachingFlags {
    /// Reuse the state of prompt blocks already computed (the default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Compute every prompt in full.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
}

impl Serialize for PrefixCachingFlags {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        // The later flag wins (clap's `overrides_with` clears the earlier one).
        if self.no_enable_prefix_caching {
            map.serialize_entry("enable_prefix_caching", &false)?;
        } else if self.enable_prefix_caching {
            map.serialize_entry("enable_prefix_caching", &true)?;
        }
        map.end()
    }
}

/// Settings shared by both worker roles (validated by [`WorkerSettings::validate`]). Each
/// role's defaults start from [`WorkerSettings::listening_on`] its own port, and
/// `common::config::load` fills every key from them and refuses unknown keys (no
/// `deny_unknown_fields` here: serde does not allow it beside `flatten`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "each is an on/off key of the configuration file, named as operators write it"
)]
pub struct WorkerSettings {
    /// Where the gRPC server (the role's service, Worker, health) listens. Port 0 picks a free
    /// port.
    pub grpc_listen: SocketAddr,
    /// host:port that routers and the other role's workers use to reach this worker.
    /// Default: the bound listen address.
    pub advertise_address: Option<String>,
    /// Milliseconds in-flight calls may take to finish after SIGTERM.
    pub shutdown_grace_ms: u64,
    /// Where the worker serves its own Prometheus metrics (`GET /metrics`: engine steps, pool,
    /// state transfers). Port 0 picks a free port (named on the readiness line). Unset: no
    /// metrics listener.
    pub metrics_listen: Option<SocketAddr>,
    /// Checkpoint folder (`config.json`, weights). Unset: the worker serves only identity and
    /// health, and its role's calls fail with UNAVAILABLE.
    pub model_dir: Option<PathBuf>,
    /// Tokens per state page. Prefill and decode workers must agree (the layout handshake
    /// refuses to pair them otherwise).
    pub page_size: u32,
    /// Pages in the worker's pool.
    pub engine_num_pages: u32,
    /// Requests in the engine at once (also its state slots).
    pub max_running: u32,
    /// Tokens per forward step.
    pub max_batch_tokens: u32,
    /// Storage of the attention K=V rows: `auto` (= `f32`, exact), `fp8` or `bf16`. Prefill and decode
    /// workers must agree (the layout handshake refuses to pair them otherwise).
    pub kv_cache_dtype: KvCacheDtype,
    /// Reuse the state of prompt blocks computed before (prefix cache).
    pub enable_prefix_caching: bool,
    /// host:port of a router's gRPC server to register with (and heartbeat to). Unset: the
    /// worker is listed statically in the router's configuration.
    pub router: Option<String>,
    /// State transports this worker offers, in order of preference: `ucx` (one-sided puts into
    /// registered memory), `tcp` (page frames over gRPC), `nccl` (GPU to GPU; builds with the
    /// `nccl` feature). A pair uses the first transport of the prefill worker's list that the
    /// decode worker also offers.
    pub transports: Vec<Transport>,
    /// Compute backend: `cpu` (the reference forward pass), `cuda` (builds with the `cuda`
    /// feature: a one-GPU worker without `hybrid` runs whole steps on the GPU, a decode
    /// worker its decode steps, a prefill worker its prompts in chunks of a page (256 tokens
    /// without the prefix cache); with `hybrid`
    /// or a group of GPUs, the per-op path), or `emulated` (the same GPU steps with each kernel
    /// computed by its CPU reference: slow, for checking the device path without a GPU; one
    /// rank without hybrid).
    pub backend: BackendKind,
    /// Let the ops the backend does not run fall back to the CPU (logged at start). Off: a
    /// partial backend is an error, so a slow half-CPU deployment is always a choice.
    pub hybrid: bool,
    /// How a decode worker's device step attends: `exact` (the reference's bits) or `fast`
    /// (tensor cores over FP8 or bf16 rows and for the indexer's scores, within stated bounds;
    /// needs `kv_cache_dtype` fp8 or bf16 and the cuda or emulated backend).
    pub decode_attention: DecodeAttention,
    /// How a decode worker's device step runs the routed experts: `exact` (the reference's
    /// bits) or `fast` (the grouped FP4 GEMV, within its bound; the cuda or emulated backend).
    pub decode_experts: DecodeExperts,
    /// How a decode worker's device step runs its bf16 and FP8 linears: `exact` (the
    /// reference's bits) or `fast` (the dense GEMM on tensor cores, within its bound; the
    /// cuda or emulated backend).
    pub decode_linears: DecodeLinears,
    /// Replay a decode worker's device steps as CUDA graphs: a step whose launches (kernels,
    /// buffers, shapes) a recorded graph has runs as that graph after the host writes its
    /// plans; others run as they come. Same results as without (checked over the kernels'
    /// references on `emulated`); the cuda or emulated backend without hybrid, one rank (or a
    /// tensor-parallel group's ranks on emulated: their collectives run in the launch pass).
    pub decode_graphs: bool,
    /// How a prefill worker's device step attends for its prompt chunks: `exact` (the
    /// reference's bits) or `fast` (tensor cores over FP8 rows and for the indexer's scores,
    /// within stated bounds; needs `kv_cache_dtype` fp8 or bf16; the cuda or emulated backend, one
    /// rank or a group's ranks, without hybrid).
    pub prefill_attention: PrefillAttention,
    /// How a prefill worker's device step runs its prompt chunks' bf16 and FP8 linears:
    /// `exact` (the reference's bits) or `fast` (the dense GEMM on tensor cores, within its
    /// bound; the cuda or emulated backend, one rank or a group's ranks, without hybrid).
    pub prefill_linears: PrefillLinears,
    /// How a prefill worker's device step runs its prompt chunks' routed experts: `exact` (the
    /// reference's bits) or `fast` (the grouped GEMM, within its bound; the cuda or emulated
    /// backend, one rank or a group's ranks, without hybrid).
    pub prefill_experts: PrefillExperts,
    /// Attention tensor parallelism: ranks sharing each request's heads (every rank runs every
    /// request and holds a copy of its state; bit-identical to one rank). Experts are then
    /// replicated (`expert_parallel_size` 1) or split over the same ranks (equal sizes).
    pub tensor_parallel_size: u32,
    /// Expert parallelism: the worker runs this many ranks (one per GPU of its group; CPU
    /// ranks on the cpu backend), each holding `1/N` of the routed experts. Each rank has its
    /// own pool of `engine_num_pages` pages and `max_running` requests.
    pub expert_parallel_size: u32,
    /// Attention by requests (data-parallel attention): each rank runs whole requests and holds
    /// their pages. Required for a group of ranks without attention TP.
    pub dp_attention: bool,
    /// With `tensor_parallel_size` N (and `expert_parallel_size` 1): every routed expert sliced
    /// over the N ranks (`1/N` of its intermediate dimension each), what SGLang's and vLLM's
    /// `--tp` does to the experts. Not bit-identical to one rank (the partial sums are added
    /// in rank order): deterministic, within a stated bound, the same greedy tokens in tests.
    pub moe_tensor_parallel: bool,
    /// Milliseconds a rank waits in a collective for the others before the worker fails its
    /// requests and reports itself failed (a rank that died or hangs).
    pub rank_timeout_ms: u64,
    /// File holding the cluster's shared secret (a line of 32+ visible characters, not
    /// readable by other users; further lines are secrets also accepted, for rotation). Every
    /// internal gRPC call carries it and calls without it are refused; all roles of a cluster
    /// must name the same secret. Unset: no authentication.
    pub cluster_secret_file: Option<PathBuf>,
    /// Mutual TLS between the cluster's processes (`[tls]`: `cert_file`, `key_file`,
    /// `ca_file`, optional `server_name`); unset: plain connections.
    pub tls: common::internal_tls::TlsSettings,
}

impl WorkerSettings {
    /// The built-in settings of a worker listening on `port` of loopback by default.
    pub fn listening_on(port: u16) -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], port)),
            advertise_address: None,
            shutdown_grace_ms: 30_000,
            metrics_listen: None,
            model_dir: None,
            page_size: 64,
            engine_num_pages: 1024,
            max_running: 32,
            max_batch_tokens: 512,
            kv_cache_dtype: KvCacheDtype::Auto,
            enable_prefix_caching: true,
            router: None,
            transports: vec![Transport(TransportKind::Ucx), Transport(TransportKind::Tcp)],
            backend: BackendKind::Cpu,
            hybrid: false,
            decode_attention: DecodeAttention::Exact,
            decode_experts: DecodeExperts::Exact,
            decode_linears: DecodeLinears::Exact,
            decode_graphs: false,
            prefill_attention: PrefillAttention::Exact,
            prefill_linears: PrefillLinears::Exact,
            prefill_experts: PrefillExperts::Exact,
            tensor_parallel_size: 1,
            expert_parallel_size: 1,
            dp_attention: false,
            moe_tensor_parallel: false,
            rank_timeout_ms: 30_000,
            cluster_secret_file: None,
            tls: common::internal_tls::TlsSettings::default(),
        }
    }

    /// Range and cross-field checks of the shared keys (run once, after all layers).
    pub fn validate(&self) -> Result<(), Invalid> {
        check_advertise("advertise_address", self.advertise_address.as_deref())?;
        let page_size = u64::from(self.page_size);
        if !page_size.is_power_of_two() || !(4..=4096).contains(&page_size) {
            return Err(Invalid::new(
                "page_size",
                "must be a power of two between 4 and 4096",
            ));
        }
        check_range(
            "engine_num_pages",
            u64::from(self.engine_num_pages),
            1,
            1 << 24,
        )?;
        check_range("max_running", u64::from(self.max_running), 1, 4096)?;
        check_range(
            "max_batch_tokens",
            u64::from(self.max_batch_tokens),
            1,
            1 << 20,
        )?;
        kv_transfer::handshake::check_transports(&self.transport_kinds())
            .map_err(|e| Invalid::new("transports", e.to_string()))?;
        if !self.backend.built_in() {
            return Err(Invalid::new(
                "backend",
                "this binary was built without the CUDA backend (cargo feature `cuda`)",
            ));
        }
        // Nothing falls back from the CPU reference: the switch would change nothing.
        if self.hybrid && self.backend == BackendKind::Cpu {
            return Err(Invalid::new(
                "hybrid",
                "lets ops a device backend does not run fall back to the CPU; the cpu backend \
                 runs them all",
            ));
        }
        // The whole step on the device: one rank, or each rank of a tensor-parallel group or of
        // an expert-parallel group with data-parallel attention.
        let device_step = self.device_step();
        if self.decode_attention == DecodeAttention::Fast {
            if !device_step {
                return Err(Invalid::new(
                    "decode_attention",
                    "fast attention runs in the device decode step: backend cuda or emulated, \
                     one rank or a group (tensor-parallel ranks, or expert-parallel ranks with \
                     dp_attention), without hybrid",
                ));
            }
            if !matches!(self.kv_cache_dtype, KvCacheDtype::Fp8 | KvCacheDtype::Bf16) {
                return Err(Invalid::new(
                    "decode_attention",
                    "fast attention reads FP8 or bf16 K=V rows: set kv_cache_dtype = \"fp8\" or \"bf16\"",
                ));
            }
        }
        if let Some(why) = self.graphs_refused() {
            return Err(Invalid::new("decode_graphs", why));
        }
        if self.decode_experts == DecodeExperts::Fast && !device_step {
            return Err(Invalid::new(
                "decode_experts",
                "fast experts run in the device decode step: backend cuda or emulated, one \
                 rank or a group (tensor-parallel ranks, or expert-parallel ranks with \
                 dp_attention), without hybrid",
            ));
        }
        if self.prefill_attention == PrefillAttention::Fast {
            if !device_step {
                return Err(Invalid::new(
                    "prefill_attention",
                    "fast attention runs in the device step: backend cuda or emulated, one \
                     rank or a group (tensor-parallel ranks, or expert-parallel ranks with \
                     dp_attention), without hybrid",
                ));
            }
            if !matches!(self.kv_cache_dtype, KvCacheDtype::Fp8 | KvCacheDtype::Bf16) {
                return Err(Invalid::new(
                    "prefill_attention",
                    "fast attention reads FP8 or bf16 K=V rows: set kv_cache_dtype = \"fp8\" or \"bf16\"",
                ));
            }
        }
        if self.prefill_linears == PrefillLinears::Fast && !device_step {
            return Err(Invalid::new(
                "prefill_linears",
                "fast linears run in the device step: backend cuda or emulated, one rank \
                 or a group (tensor-parallel ranks, or expert-parallel ranks with dp_attention), \
                 without hybrid",
            ));
        }
        if self.prefill_experts == PrefillExperts::Fast && !device_step {
            return Err(Invalid::new(
                "prefill_experts",
                "fast experts run in the device step: backend cuda or emulated, one rank \
                 or a group (tensor-parallel ranks, or expert-parallel ranks with dp_attention), \
                 without hybrid",
            ));
        }
        if self.decode_linears == DecodeLinears::Fast && !device_step {
            return Err(Invalid::new(
                "decode_linears",
                "fast linears run in the device decode step: backend cuda or emulated, one \
                 rank or a group (tensor-parallel ranks, or expert-parallel ranks with \
                 dp_attention), without hybrid",
            ));
        }
        self.check_group()?;
        common::cluster_auth::Security::load(self.cluster_secret_file.as_deref(), &self.tls)?;
        if let Some(router) = &self.router {
            check_host_port("router", router)?;
        }
        check_range("shutdown_grace_ms", self.shutdown_grace_ms, 0, 600_000)
    }

    /// The group checks that need no model (the model's own run when it loads).
    fn check_group(&self) -> Result<(), Invalid> {
        check_range(
            "tensor_parallel_size",
            u64::from(self.tensor_parallel_size),
            1,
            64,
        )?;
        check_range(
            "expert_parallel_size",
            u64::from(self.expert_parallel_size),
            1,
            64,
        )?;
        check_range("rank_timeout_ms", self.rank_timeout_ms, 100, 3_600_000)?;
        let spec = self.group_spec();
        let refusal = |key: &'static str, e: String| Err(Invalid::new(key, e));
        let p = spec.parallel;
        if p.tp > 1 && self.dp_attention {
            return refusal(
                "dp_attention",
                format!(
                    "attention runs either by requests (dp_attention) or by heads \
                     (tensor_parallel_size {}), not both",
                    p.tp
                ),
            );
        }
        if self.moe_tensor_parallel && (p.tp < 2 || p.ep != 1) {
            return refusal(
                "moe_tensor_parallel",
                format!(
                    "moe_tensor_parallel slices the experts over the tensor-parallel ranks: it \
                     needs tensor_parallel_size > 1 and expert_parallel_size 1 (got {} and {})",
                    p.tp, p.ep
                ),
            );
        }
        if p.tp > 1 && p.ep > 1 && p.ep != p.tp {
            return refusal(
                "expert_parallel_size",
                format!(
                    "with tensor_parallel_size {} the experts are split over the same ranks: \
                     expert_parallel_size must be 1 or {}",
                    p.tp, p.tp
                ),
            );
        }
        if spec.ranks() > 1 && p.tp == 1 && !self.dp_attention {
            return refusal(
                "dp_attention",
                format!(
                    "a group of {} ranks with tensor_parallel_size 1 runs attention by \
                     requests: set dp_attention (--dp-attention)",
                    spec.ranks()
                ),
            );
        }
        Ok(())
    }

    /// How the worker spreads its model over ranks; CPU ranks share the machine's cores.
    pub fn group_spec(&self) -> GroupSpec {
        let parallel = Parallel {
            tp: self.tensor_parallel_size as usize,
            ep: self.expert_parallel_size as usize,
            dp_attention: self.dp_attention,
            moe_tp: self.moe_tensor_parallel,
        };
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        GroupSpec {
            parallel,
            timeout: std::time::Duration::from_millis(self.rank_timeout_ms),
            threads_per_rank: (cores / parallel.gpus().max(1)).max(1),
        }
    }

    /// Why `decode_graphs` is refused, if it is asked for and cannot run: off the device
    /// step, over expert-parallel ranks with their own requests (their exchanges' sizes follow
    /// the routing), over a GPU group (its NCCL collectives are not recorded).
    fn graphs_refused(&self) -> Option<&'static str> {
        let group = self.group_spec().ranks() > 1;
        let own_requests = self.dp_attention && self.expert_parallel_size > 1;
        if !self.decode_graphs {
            None
        } else if !self.device_step() {
            Some(
                "graphs replay the device decode step: backend cuda or emulated, without \
                 hybrid",
            )
        } else if group && own_requests {
            Some(
                "graphs replay steps without host work, and expert-parallel ranks with \
                 dp_attention read back their dispatch messages' counts at every MoE layer \
                 (their sizes follow the routing); a tensor-parallel group replays its steps \
                 (its exchanges' sizes are the batch's)",
            )
        } else if group && self.backend == BackendKind::Cuda {
            Some(
                "a GPU group's collectives are not recorded into graphs (NCCL runs on its own \
                 stream and each call waits on the host for the group's timeout): graphs \
                 replay one GPU's steps, or a group's on the emulated backend",
            )
        } else {
            None
        }
    }

    /// The transports offered, in order of preference.
    pub fn transport_kinds(&self) -> Vec<TransportKind> {
        self.transports.iter().map(|t| t.0).collect()
    }

    /// The engine settings of this worker.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            page_size: self.page_size as usize,
            num_pages: self.engine_num_pages,
            max_running: self.max_running as usize,
            max_batch_tokens: self.max_batch_tokens as usize,
            kv: self.kv_cache_dtype.storage(),
            prefix_cache: self.enable_prefix_caching,
        }
    }
}

/// The command line of the shared settings; every flag overrides the setting of the same name.
#[derive(Debug, Default, clap::Args, Serialize)]
pub struct WorkerFlags {
    /// gRPC listen address (default 127.0.0.1:8101 for prefill, 127.0.0.1:8201 for decode;
    /// port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_listen: Option<SocketAddr>,
    #[command(flatten)]
    #[serde(flatten)]
    pub host_port: common::cli::HostPortFlags,
    /// host:port other processes use to reach this worker.
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<String>,
    /// Milliseconds in-flight calls may take after SIGTERM.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_ms: Option<u64>,
    /// Serve the worker's Prometheus metrics (`GET /metrics`) on this address.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Checkpoint folder served by this worker (`--model`: vLLM's spelling).
    #[arg(long, visible_alias = "model", value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_dir: Option<PathBuf>,
    /// Tokens per state page (must match the other role's workers).
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub page_size: Option<u32>,
    /// Pages in the worker's pool.
    #[arg(long, value_name = "PAGES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_num_pages: Option<u32>,
    /// Requests in the engine at once (`--max-num-seqs`: vLLM's spelling).
    #[arg(long, visible_alias = "max-num-seqs", value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Tokens per forward step.
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<u32>,
    /// Storage of the K=V rows: auto (= f32) or fp8.
    #[arg(long, value_enum, value_name = "DTYPE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    #[command(flatten)]
    #[serde(flatten)]
    pub prefix_caching: PrefixCachingFlags,
    /// Register with the router at this gRPC host:port.
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<String>,
    /// A state transport to offer (ucx, tcp), in order of preference; repeat for several.
    #[arg(long = "transport", value_name = "NAME")]
    #[serde(rename = "transports", skip_serializing_if = "Vec::is_empty")]
    pub transports: Vec<String>,
    /// Compute backend: cpu, cuda or emulated (one rank, without hybrid).
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Let ops the backend does not run fall back to the CPU.
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<bool>,
    /// A decode worker's device attention: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_attention: Option<DecodeAttention>,
    /// A decode worker's device routed experts: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_experts: Option<DecodeExperts>,
    /// A decode worker's device bf16 and FP8 linears: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_linears: Option<DecodeLinears>,
    /// Replay a decode worker's device steps as CUDA graphs.
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_graphs: Option<bool>,
    /// A prefill worker's device attention for prompt chunks: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_attention: Option<PrefillAttention>,
    /// A prefill worker's device bf16 and FP8 linears for prompt chunks: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_linears: Option<PrefillLinears>,
    /// A prefill worker's device routed experts for prompt chunks: exact or fast.
    #[arg(long, value_enum, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_experts: Option<PrefillExperts>,
    /// Attention tensor parallelism: ranks sharing each request's heads (`--tp`).
    #[arg(long, visible_alias = "tp", value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_parallel_size: Option<u32>,
    /// Ranks holding disjoint routed experts, one per GPU of the group (`--ep`).
    #[arg(long, visible_alias = "ep", value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_parallel_size: Option<u32>,
    /// Attention by requests: each rank runs whole requests (`--enable-dp-attention`:
    /// SGLang's spelling).
    #[arg(long, visible_alias = "enable-dp-attention")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub dp_attention: bool,
    /// With `--tp N`: every routed expert sliced over the N ranks (`--moe-tp`).
    #[arg(long, visible_alias = "moe-tp")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub moe_tensor_parallel: bool,
    /// Milliseconds a rank waits for the others in a collective before the worker fails.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_timeout_ms: Option<u64>,
    #[command(flatten)]
    #[serde(flatten)]
    pub security: common::cluster_auth::SecurityFlags,
}

#[cfg(test)]
mod tests;
