//! Choosing a worker's compute backend from its configuration
//! (`backend = "cpu" | "cuda" | "emulated"`). The CPU backend is the engine's reference code;
//! the CUDA backend exists only in builds with the `cuda` feature, and asking for it elsewhere,
//! or on a machine without a device, is an error at start rather than a silent fall back to
//! the CPU. The emulated backend is a decode worker's GPU decode step with each kernel computed
//! by its CPU reference: the device path of a deployment, checkable without a GPU (slow).

use std::{path::Path, sync::Arc};

use engine::{
    backend::{Backend, BackendError},
    config::ModelConfig,
};

/// A compute backend a worker can be configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Everything on the CPU reference.
    Cpu,
    /// The GPU: one rank without hybrid runs whole steps there (decode steps, and prompt
    /// chunks for an engine that computes prompts), and so does each rank of a
    /// tensor-parallel group (its experts whole, split or sliced over the ranks) or of an
    /// expert-parallel group with data-parallel attention; hybrid runs the per-op path
    /// (routed experts, linears, attention core and head on the GPU, the rest on the CPU),
    /// for debugging.
    Cuda,
    /// The whole steps as on a GPU (state in arenas, the same launches), each kernel computed
    /// by its CPU reference: one rank or a group's ranks, without hybrid.
    Emulated,
}

impl BackendKind {
    /// Parses a configuration value.
    pub fn parse(value: &str) -> Result<Self, UnknownBackend> {
        match value {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            "emulated" => Ok(Self::Emulated),
            other => Err(UnknownBackend(other.to_owned())),
        }
    }

    /// The configuration value naming this backend.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Emulated => "emulated",
        }
    }

    /// Whether this build can run the backend at all.
    pub fn built_in(self) -> bool {
        match self {
            Self::Cpu | Self::Emulated => true,
            Self::Cuda => cfg!(feature = "cuda"),
        }
    }
}

/// A configuration named a backend that does not exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?} (expected cpu, cuda or emulated)")]
pub struct UnknownBackend(pub String);

/// A backend is written in configuration as its name.
impl serde::Serialize for BackendKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for BackendKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Self::parse(&name).map_err(serde::de::Error::custom)
    }
}

/// Opens the backend for the checkpoint at `dir`: `Ok(None)` for the CPU (nothing to attach).
pub fn open(
    kind: BackendKind,
    dir: &Path,
    config: &ModelConfig,
) -> Result<Option<Arc<dyn Backend>>, BackendError> {
    open_rank(kind, dir, config, RankDevice::ONE)
}

/// Which device a rank's backend opens, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankDevice {
    /// The device ordinal (rank r on GPU r of those the process sees).
    pub ordinal: usize,
    /// Whether the routed experts go on the device (not when the rank's expert group or
    /// expert slicing computes them).
    pub routed: bool,
}

impl RankDevice {
    /// The only rank of a worker: device 0, everything on it.
    pub const ONE: Self = Self {
        ordinal: 0,
        routed: true,
    };
}

/// Bytes of the weights the CUDA backend puts on a rank's GPU from the checkpoint `stored`
/// (each layer's attention linears that exist, its shared expert, the routed experts when
/// `routed`, and the output head), counted before uploading so a GPU without room refuses
/// with the numbers instead of failing an allocation halfway.
pub fn device_weight_bytes(
    stored: &engine::weights::stored::StoredWeights,
    config: &ModelConfig,
    routed: bool,
) -> Result<usize, engine::weights::LoadError> {
    let mut bytes = stored.bf16("head.weight")?.len();
    for layer in 0..config.num_layers() {
        if routed {
            let experts = stored.fp4_layer(layer)?;
            bytes += [&experts.w1, &experts.w2, &experts.w3]
                .iter()
                .map(|s| s.stored_bytes())
                .sum::<usize>();
        }
        let prefix = engine::schema::layer(layer);
        for w in ["w1", "w2", "w3"] {
            let name = format!("{prefix}ffn.shared_experts.{w}");
            bytes += linear_device_bytes(&stored.linear(&name)?);
        }
        for which in engine::backend::LinearId::ALL {
            let name = which.tensor(layer);
            if stored.contains(&name) {
                bytes += linear_device_bytes(&stored.linear(&name)?);
            }
        }
    }
    Ok(bytes)
}

/// Bytes a dense linear takes on the device: as stored, plus an f32 copy of an FP8 linear's
/// tile scales (the dense GEMM's form of them).
pub fn linear_device_bytes(w: &engine::weights::stored::StoredLinear<'_>) -> usize {
    match w {
        engine::weights::stored::StoredLinear::Fp8Block { scales, .. } => {
            w.stored_bytes() + 4 * scales.len()
        }
        engine::weights::stored::StoredLinear::Bf16 { .. } => w.stored_bytes(),
    }
}

/// Refuses a rank whose weights (`needed` bytes) do not fit the `free` bytes of its GPU
/// (`total` in all), with the numbers.
pub fn check_device_room(
    ordinal: usize,
    needed: usize,
    (free, total): (usize, usize),
) -> Result<(), String> {
    let gb = |b: usize| b as f64 / 1e9;
    if needed > free {
        return Err(format!(
            "GPU {ordinal}: this rank's weights need {:.2} GB and {:.2} GB of its {:.2} GB are \
             free; spread the routed experts over the group (--ep or --moe-tp) or use more GPUs \
             (pdctl plan shows a group's bytes per GPU)",
            gb(needed),
            gb(free),
            gb(total)
        ));
    }
    Ok(())
}

/// [`open`] for one rank of a group.
pub fn open_rank(
    kind: BackendKind,
    dir: &Path,
    config: &ModelConfig,
    rank: RankDevice,
) -> Result<Option<Arc<dyn Backend>>, BackendError> {
    match kind {
        BackendKind::Cpu => Ok(None),
        BackendKind::Cuda => open_cuda(dir, config, rank),
        BackendKind::Emulated => Err(BackendError::Unavailable {
            backend: "emulated".to_owned(),
            reason: "it runs whole steps on the device, without hybrid, of one rank or of \
                     expert-parallel ranks with data-parallel attention; hybrid or another \
                     group layout uses cpu or cuda"
                .to_owned(),
        }),
    }
}

/// The CUDA backend cannot start here, for `reason`.
fn cuda_unavailable(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Unavailable {
        backend: "cuda".to_owned(),
        reason: reason.to_string(),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(
    dir: &Path,
    config: &ModelConfig,
    rank: RankDevice,
) -> Result<Option<Arc<dyn Backend>>, BackendError> {
    match crate::cuda::CudaBackend::load_on(dir, config, rank.ordinal, rank.routed) {
        Ok(Some(backend)) => Ok(Some(Arc::new(backend))),
        Ok(None) => Err(cuda_unavailable("no CUDA driver or device is present")),
        Err(e) => Err(cuda_unavailable(e)),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(
    _: &Path,
    _: &ModelConfig,
    _: RankDevice,
) -> Result<Option<Arc<dyn Backend>>, BackendError> {
    Err(cuda_unavailable(
        "this binary was built without the CUDA backend (cargo feature `cuda`)",
    ))
}

/// What a worker's engine computes: prompts and decode tokens, or only decode tokens (a decode
/// worker: every request arrives with its prompt's state), then with the device step's fast
/// attention (`attn_decode_fp8`) and its steps replayed as graphs when asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineWork {
    /// Prompts and decode tokens; on the device step, the fast attention (`fast_attention`),
    /// the prompt chunks' linears by the dense GEMM (`fast_linears`) and routed experts by the
    /// grouped GEMM (`gemm_experts`) where asked for.
    All {
        fast_attention: bool,
        fast_linears: bool,
        gemm_experts: bool,
    },
    DecodeOnly {
        fast_attention: bool,
        fast_experts: bool,
        fast_linears: bool,
        graphs: bool,
    },
}

/// Loads the checkpoint at `dir` into an engine thread per rank of `group` on backend `kind`,
/// `hybrid` letting ops the backend does not run stay on the CPU. An engine of one rank on
/// `cuda` (or `emulated`) without `hybrid`, or each rank of an expert-parallel group with
/// data-parallel attention (rank r on GPU r, its pairs exchanged over the group at every MoE
/// layer: `crate::step::device_group`), runs whole steps on the GPU
/// ([`crate::step::decoder::StepDecoder`]: weights and state on the device, tokens in, logits
/// out): every decode step, and an engine that computes prompts (not decode-only) its prompt
/// chunks too, [`PROMPT_CHUNK_MOST`] tokens of a sequence at a time; `hybrid` keeps the per-op
/// path, for debugging. On GPUs, rank r opens GPU r of those
/// the process sees (`CUDA_VISIBLE_DEVICES`), holds the routed experts only when its group does
/// not spread them (expert parallelism or slicing computes them), and its groups exchange over
/// NCCL. How far the weights check is shows in `progress` while this runs.
pub fn start_engine(
    dir: &Path,
    config: engine::scheduler::EngineConfig,
    thread_name: &str,
    (kind, work): (BackendKind, EngineWork),
    hybrid: bool,
    group: engine::parallel::group::GroupSpec,
    progress: &Arc<engine::weights::LoadProgress>,
) -> Result<engine::start::LoadedEngine, engine::start::StartError> {
    let spread = group.parallel.ep > 1 || group.parallel.moe_tp;
    let open = |dir: &Path, model: &ModelConfig, rank: usize| {
        let device = RankDevice {
            ordinal: rank,
            routed: !spread,
        };
        open_rank(kind, dir, model, device)
    };
    let ordinals: Vec<usize> = (0..group.ranks()).collect();
    let gpu_collectives = move |n: usize, timeout: std::time::Duration| {
        if n != ordinals.len() {
            return Err(format!("{n} collectives for {} GPUs", ordinals.len()));
        }
        gpu_group(&ordinals, timeout)
    };
    let (decode_only, step) = match work {
        EngineWork::All {
            fast_attention,
            fast_linears,
            gemm_experts,
        } => (
            false,
            StepOptions {
                fast_attention,
                fast_linears,
                gemm_experts,
                ..StepOptions::default()
            },
        ),
        EngineWork::DecodeOnly {
            fast_attention,
            fast_experts,
            fast_linears,
            graphs,
        } => (
            true,
            StepOptions {
                fast_attention,
                fast_experts,
                fast_linears,
                graphs,
                gemm_experts: false,
            },
        ),
    };
    // One rank without hybrid on a device runs whole steps there: decode tokens, and the
    // prompt chunks of an engine that computes prompts; so does each rank of an
    // expert-parallel group with data-parallel attention (its pairs exchanged at every MoE
    // layer) and of a tensor-parallel group (the attention's output groups gathered at every
    // layer; with sliced experts, every expert's partial outputs summed over the group).
    let device_step = !hybrid && group.parallel.steps_whole_on_devices();
    let prompts = (!decode_only).then_some(PROMPT_CHUNK_MOST);
    refuse_off_the_device_step(kind, step, (decode_only, device_step))?;
    let cuda_decode =
        |model: &engine::model::Model, config: &engine::scheduler::EngineConfig, rank: usize| {
            open_cuda_decode(model, config, step, (prompts, rank))
        };
    let emulated_decode =
        |model: &engine::model::Model, config: &engine::scheduler::EngineConfig, _rank: usize| {
            open_emulated_decode(model, config, step, prompts)
        };
    let devices = engine::start::RankDevices {
        open: &open,
        hybrid,
        collectives: match kind {
            BackendKind::Cuda if group.ranks() > 1 => Some(&gpu_collectives),
            _ => None,
        },
        decode: match kind {
            BackendKind::Cuda if device_step => Some(&cuda_decode),
            BackendKind::Emulated if device_step => Some(&emulated_decode),
            _ => None,
        },
        decode_only,
    };
    engine::start::start_with_backend(dir, config, thread_name, devices, group, progress)
}

/// Refuses what only the device step runs (`step`'s options) where it does not run: off the
/// cpu backend, one rank without hybrid (`device_step`), and each option in the step of its
/// engine's work (`decode_only`: a decode worker's options; otherwise a prefill worker's).
/// Never accepted and then run another way.
fn refuse_off_the_device_step(
    kind: BackendKind,
    step: StepOptions,
    (decode_only, device_step): (bool, bool),
) -> Result<(), engine::start::StartError> {
    let decode = [
        (step.fast_attention, "fast decode attention"),
        (step.fast_experts, "fast decode experts"),
        (step.fast_linears, "fast decode linears"),
        (step.graphs, "decode graphs"),
    ];
    let prefill = [
        (step.fast_attention, "fast prefill attention"),
        (step.fast_linears, "fast prefill linears"),
        (step.gemm_experts, "fast prefill experts"),
    ];
    let (place, asked): (_, &[(bool, &str)]) = if decode_only {
        (
            "the device decode step of a decode worker (one rank, or a group's ranks)",
            &decode,
        )
    } else {
        (
            "the device step of an engine that computes prompts (one rank, or a group's ranks)",
            &prefill,
        )
    };
    let runs = device_step && kind != BackendKind::Cpu;
    match asked.iter().find(|(asked, _)| *asked) {
        Some((_, what)) if !runs => Err(engine::start::StartError::Backend(
            BackendError::Unavailable {
                backend: kind.name().to_owned(),
                reason: format!("{what} run in {place} on cuda or emulated, without hybrid"),
            },
        )),
        _ => Ok(()),
    }
}

/// What a device decode step does beyond the exact step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent switches of the device step, each a worker setting of its own"
)]
struct StepOptions {
    /// `attn_decode_fp8` instead of `attn_exact`.
    fast_attention: bool,
    /// The grouped FP4 GEMV instead of `exact_pairs`.
    fast_experts: bool,
    /// The dense GEMM instead of `exact_gemv` for the bf16 and FP8 linears.
    fast_linears: bool,
    /// The grouped GEMM instead of `exact_pairs` for the routed experts (prompt chunks).
    gemm_experts: bool,
    /// Steps replayed as graphs (`crate::step::replay`).
    graphs: bool,
}

/// The most prompt tokens of a sequence an engine's device step takes at once (fewer steps for
/// a long prompt, each reading the weights once), with the prefix cache or without: the blocks
/// inside a chunk are cached without their slots, so a later prompt resumes at a chunk's end.
/// Each slot's window ring holds this many rows more than the sliding window.
pub const PROMPT_CHUNK_MOST: usize = 256;

/// Tokens a decode slot holds: the longest request the engine's page pool and the model admit.
pub fn slot_tokens(model: &ModelConfig, config: &engine::scheduler::EngineConfig) -> usize {
    (config.num_pages as usize * config.page_size).min(model.max_position_embeddings)
}

/// Refuses a GPU whose `free` bytes (of `total`) cannot hold the decode arenas (`needed`).
pub fn check_arena_room(needed: usize, (free, total): (usize, usize)) -> Result<(), String> {
    let gb = |b: usize| b as f64 / 1e9;
    if needed > free {
        return Err(format!(
            "the decode state of max_running requests of engine_num_pages x page_size tokens \
             needs {:.2} GB on the GPU and {:.2} GB of its {:.2} GB are free after the weights; \
             lower max_running or engine_num_pages",
            gb(needed),
            gb(free),
            gb(total)
        ));
    }
    Ok(())
}

/// The whole decode step for `model` over the kernels' CPU references, arenas for
/// `config.max_running` sequences of [`slot_tokens`] tokens (in host memory, which the engine's
/// start checked for its pools; the arenas are as large as a GPU's would be).
fn open_emulated_decode(
    model: &engine::model::Model,
    config: &engine::scheduler::EngineConfig,
    step: StepOptions,
    prompts: Option<usize>,
) -> Result<Box<dyn engine::scheduler::StepDevice>, BackendError> {
    use crate::step::{decoder::StepDecoder, emulated::EmulatedKernels};
    let unavailable = |e: String| BackendError::Unavailable {
        backend: "emulated".to_owned(),
        reason: e,
    };
    let kernels = EmulatedKernels::new(&model.config);
    let shape = (config.max_running, slot_tokens(&model.config, config));
    let mut decoder = StepDecoder::new("emulated", kernels, model, shape, |_, _| Ok(()))
        .map_err(|e| unavailable(e.to_string()))?;
    if let Some(chunk) = prompts {
        decoder = decoder
            .with_prompts(chunk, |_, _| Ok(()))
            .map_err(|e| unavailable(e.to_string()))?;
    }
    if step.fast_attention {
        decoder = decoder
            .with_fast_attention()
            .map_err(|e| unavailable(e.to_string()))?;
    }
    if step.fast_experts {
        decoder = decoder.with_fast_experts();
    }
    if step.fast_linears {
        decoder = decoder.with_fast_linears();
    }
    if step.gemm_experts {
        decoder = decoder.with_gemm_experts();
    }
    if step.graphs {
        decoder = decoder
            .with_graphs(|_, _| Ok(()))
            .map_err(|e| unavailable(e.to_string()))?;
    }
    Ok(Box::new(decoder))
}

/// The whole decode step on GPU 0 for `model`: its weights uploaded, arenas for
/// `config.max_running` sequences of [`slot_tokens`] tokens.
#[cfg(feature = "cuda")]
fn open_cuda_decode(
    model: &engine::model::Model,
    config: &engine::scheduler::EngineConfig,
    step: StepOptions,
    (prompts, ordinal): (Option<usize>, usize),
) -> Result<Box<dyn engine::scheduler::StepDevice>, BackendError> {
    use crate::{
        cuda::{CudaKernels, Gpu},
        step::decoder::StepDecoder,
    };
    let gpu = match Gpu::open_on(ordinal) {
        Ok(Some(gpu)) => Arc::new(gpu),
        Ok(None) => return Err(cuda_unavailable("no CUDA driver or device is present")),
        Err(e) => return Err(cuda_unavailable(e)),
    };
    // The weights first, before any is uploaded; then the arenas against what they left free.
    let needed = crate::step::device_model::weight_bytes(model);
    let memory = gpu.memory().map_err(cuda_unavailable)?;
    crate::step::device_model::check_weight_room(ordinal, needed, memory)
        .map_err(cuda_unavailable)?;
    let (slots, tokens) = (config.max_running, slot_tokens(&model.config, config));
    // The arenas are checked against what the weights left free, before they are allocated.
    let room = |k: &CudaKernels, bytes: usize| {
        let memory = k.gpu.memory()?;
        check_arena_room(bytes, memory).map_err(crate::cuda::KernelError::from)
    };
    let mut decoder = StepDecoder::new("cuda", CudaKernels::new(gpu), model, (slots, tokens), room)
        .map_err(cuda_unavailable)?;
    if let Some(chunk) = prompts {
        // What the chunk's longer rings add, checked as the arenas were.
        let room = |k: &CudaKernels, bytes: usize| {
            let memory = k.gpu.memory()?;
            check_arena_room(bytes, memory).map_err(crate::cuda::KernelError::from)
        };
        decoder = decoder
            .with_prompts(chunk, room)
            .map_err(cuda_unavailable)?;
    }
    if step.fast_attention {
        decoder = decoder.with_fast_attention().map_err(cuda_unavailable)?;
    }
    if step.fast_experts {
        decoder = decoder.with_fast_experts();
    }
    if step.fast_linears {
        decoder = decoder.with_fast_linears();
    }
    if step.gemm_experts {
        decoder = decoder.with_gemm_experts();
    }
    if step.graphs {
        // The graphs' shared slot, checked as the arenas were.
        let room = |k: &CudaKernels, bytes: usize| {
            let memory = k.gpu.memory()?;
            check_arena_room(bytes, memory).map_err(crate::cuda::KernelError::from)
        };
        decoder = decoder.with_graphs(room).map_err(cuda_unavailable)?;
    }
    Ok(Box::new(decoder))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda_decode(
    _: &engine::model::Model,
    _: &engine::scheduler::EngineConfig,
    _: StepOptions,
    _: (Option<usize>, usize),
) -> Result<Box<dyn engine::scheduler::StepDevice>, BackendError> {
    Err(cuda_unavailable(
        "this binary was built without the CUDA backend (cargo feature `cuda`)",
    ))
}

/// A group's collectives over the GPUs `ordinals`: one NCCL communicator per rank.
#[cfg(feature = "nccl")]
fn gpu_group(
    ordinals: &[usize],
    timeout: std::time::Duration,
) -> Result<Vec<Box<dyn engine::parallel::collective::Collective>>, String> {
    Ok(crate::nccl::group(ordinals, timeout)?
        .into_iter()
        .map(|r| Box::new(r) as Box<dyn engine::parallel::collective::Collective>)
        .collect())
}

#[cfg(not(feature = "nccl"))]
fn gpu_group(
    ordinals: &[usize],
    _: std::time::Duration,
) -> Result<Vec<Box<dyn engine::parallel::collective::Collective>>, String> {
    Err(format!(
        "a group of {} GPU ranks exchanges over NCCL: this binary was built without it (cargo \
         feature `nccl`)",
        ordinals.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes a rank's backend uploads: every routed expert's stored bytes more with the
    /// routed experts than without, no more than the checkpoint serves; a GPU without the room
    /// is refused with the numbers.
    #[test]
    fn a_ranks_device_bytes_are_counted_before_uploading() {
        use engine::{
            config::{ExpertFormat, ModelConfig},
            synth::{GenerateOptions, Preset, generate},
            weights::stored::StoredWeights,
        };
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 3, ExpertFormat::Nvfp4, dir.path());
        generate(&options).unwrap();
        let config = ModelConfig::from_dir(dir.path()).unwrap();
        let stored = StoredWeights::open(dir.path(), &config).unwrap();
        let all = device_weight_bytes(&stored, &config, true).unwrap();
        let spread = device_weight_bytes(&stored, &config, false).unwrap();
        let routed: usize = (0..config.num_layers())
            .map(|l| {
                let e = stored.fp4_layer(l).unwrap();
                e.w1.stored_bytes() + e.w2.stored_bytes() + e.w3.stored_bytes()
            })
            .sum();
        assert_eq!(all, spread + routed);
        assert!(all as u64 <= engine::plan::weights(&config).served);
        assert!(
            spread >= 2 * config.vocab_size * config.hidden_size,
            "the head at least"
        );
        assert_eq!(check_device_room(1, all, (all, 2 * all)), Ok(()));
        let refused =
            check_device_room(1, 3_000_000_000, (2_000_000_000, 96_000_000_000)).unwrap_err();
        assert!(
            refused.contains("GPU 1") && refused.contains("3.00 GB"),
            "{refused}"
        );
        assert!(
            refused.contains("2.00 GB") && refused.contains("96.00 GB"),
            "{refused}"
        );
    }

    /// Fast decode attention or decode graphs where the device step does not run (the cpu
    /// backend, a prefill engine, hybrid, a group) are refused before anything loads, never
    /// run as exact or eager.
    #[test]
    fn fast_attention_outside_the_device_step_is_refused() {
        use engine::{parallel::group::GroupSpec, scheduler::EngineConfig, weights::LoadProgress};
        let progress = Arc::new(LoadProgress::new());
        let dir = std::env::temp_dir();
        let fast = EngineWork::DecodeOnly {
            fast_attention: true,
            fast_experts: false,
            fast_linears: false,
            graphs: false,
        };
        let graphs = EngineWork::DecodeOnly {
            fast_attention: false,
            fast_experts: false,
            fast_linears: false,
            graphs: true,
        };
        let experts = EngineWork::DecodeOnly {
            fast_attention: false,
            fast_experts: true,
            fast_linears: false,
            graphs: false,
        };
        let linears = EngineWork::DecodeOnly {
            fast_attention: false,
            fast_experts: false,
            fast_linears: true,
            graphs: false,
        };
        for (kind, work, hybrid) in [
            (BackendKind::Cpu, fast, false),
            (BackendKind::Emulated, fast, true),
            (BackendKind::Cpu, graphs, false),
            (BackendKind::Emulated, graphs, true),
            (BackendKind::Cpu, experts, false),
            (BackendKind::Emulated, experts, true),
            (BackendKind::Cpu, linears, false),
            (BackendKind::Emulated, linears, true),
        ] {
            let start = (kind, work);
            let refused = start_engine(
                &dir,
                EngineConfig::default(),
                "t",
                start,
                hybrid,
                GroupSpec::SINGLE,
                &progress,
            )
            .unwrap_err();
            let what = if work == fast {
                "fast decode attention"
            } else if work == graphs {
                "decode graphs"
            } else if work == linears {
                "fast decode linears"
            } else {
                "fast decode experts"
            };
            assert!(refused.to_string().contains(what), "{refused}");
        }
    }

    /// The prompt chunks' GEMMs where no prompt-computing device step runs (the cpu backend,
    /// hybrid, a decode-only engine) are refused before anything loads.
    #[test]
    fn prefill_gemms_outside_the_device_step_are_refused() {
        use engine::{parallel::group::GroupSpec, scheduler::EngineConfig, weights::LoadProgress};
        let progress = Arc::new(LoadProgress::new());
        let dir = std::env::temp_dir();
        let work = |fast_attention, fast_linears, gemm_experts| EngineWork::All {
            fast_attention,
            fast_linears,
            gemm_experts,
        };
        let (attention, linears, experts) = (
            work(true, false, false),
            work(false, true, false),
            work(false, false, true),
        );
        for (kind, work, hybrid, what) in [
            (BackendKind::Cpu, attention, false, "fast prefill attention"),
            (
                BackendKind::Emulated,
                attention,
                true,
                "fast prefill attention",
            ),
            (BackendKind::Cpu, linears, false, "fast prefill linears"),
            (BackendKind::Emulated, linears, true, "fast prefill linears"),
            (BackendKind::Cpu, experts, false, "fast prefill experts"),
            (BackendKind::Emulated, experts, true, "fast prefill experts"),
        ] {
            let refused = start_engine(
                &dir,
                EngineConfig::default(),
                "t",
                (kind, work),
                hybrid,
                GroupSpec::SINGLE,
                &progress,
            )
            .unwrap_err();
            assert!(refused.to_string().contains(what), "{refused}");
        }
    }

    #[test]
    fn parses_known_backends_only() {
        assert_eq!(BackendKind::parse("cpu"), Ok(BackendKind::Cpu));
        assert_eq!(BackendKind::parse("cuda"), Ok(BackendKind::Cuda));
        assert_eq!(BackendKind::parse("emulated"), Ok(BackendKind::Emulated));
        let err = BackendKind::parse("CUDA").unwrap_err();
        assert!(
            err.to_string().contains("expected cpu, cuda or emulated"),
            "{err}"
        );
        assert!(BackendKind::Cpu.built_in());
        assert_eq!(BackendKind::Cuda.built_in(), cfg!(feature = "cuda"));
    }

    /// Without the feature, or without a device, asking for CUDA is an error, never the CPU.
    #[test]
    fn cuda_without_a_device_is_an_error() {
        let config = engine::synth::Preset::Tiny.config(engine::config::ExpertFormat::Nvfp4);
        let dir = std::env::temp_dir();
        #[cfg(feature = "cuda")]
        if matches!(crate::cuda::Gpu::open(), Ok(Some(_))) {
            return;
        }
        let err = open(BackendKind::Cuda, &dir, &config).unwrap_err();
        assert!(
            matches!(&err, BackendError::Unavailable { backend, .. } if backend == "cuda"),
            "{err}"
        );
        assert!(err.to_string().starts_with("cuda backend: "), "{err}");
        assert!(open(BackendKind::Cpu, &dir, &config).unwrap().is_none());
    }
}
