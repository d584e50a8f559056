//! Settings of the prefill worker. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

use std::{net::SocketAddr, path::PathBuf};

use clap::Parser;
use common::config::{Invalid, ServiceConfig};
use serde::{Deserialize, Serialize};

/// Validated settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillConfig {
    /// Where the gRPC server (Prefill, Worker, health) listens. Port 0 picks a free port.
    pub grpc_listen: SocketAddr,
    /// host:port that routers and decode workers use to reach this worker.
    /// Default: the bound listen address.
    pub advertise_address: Option<String>,
    /// Milliseconds in-flight calls may take to finish after SIGTERM.
    pub shutdown_grace_ms: u64,
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
    /// host:port of a router's gRPC server to register with (and heartbeat to). Unset: the
    /// worker is listed statically in the router's configuration.
    pub router: Option<String>,
    /// State transports this worker offers, in order of preference: `ucx` (one-sided puts into
    /// registered memory), `tcp` (page frames over gRPC), `nccl` (GPU to GPU; builds with the
    /// `nccl` feature). A pair uses the first transport of the
    /// prefill worker's list that the decode worker also offers.
    pub transports: Vec<String>,
    /// Send each layer's state while the prompt is still being computed (true), or all of it
    /// after the forward passes (false: the baseline `pdctl bench-transfer` compares against;
    /// the transfer then adds its whole time to the first token).
    pub stream_state: bool,
    /// Compute backend: `cpu` (the reference forward pass) or `cuda` (builds with the `cuda`
    /// feature; the routed experts on the GPU in their FP4 form). A backend that does not run
    /// every op of the forward pass on its device refuses to start unless `hybrid` is set.
    pub backend: String,
    /// Let the ops the backend does not run fall back to the CPU (logged at start). Off: a
    /// partial backend is an error, so a slow half-CPU deployment is always a choice.
    pub hybrid: bool,
    /// File holding the cluster's shared secret (a line of 32+ visible characters, not
    /// readable by other users; further lines are secrets also accepted, for rotation). Every
    /// internal gRPC call carries it and calls without it are refused; all roles of a cluster
    /// must name the same secret. Unset: no authentication.
    pub cluster_secret_file: Option<PathBuf>,
    /// Mutual TLS between the cluster's processes (`[tls]`: `cert_file`, `key_file`,
    /// `ca_file`, optional `server_name`); unset: plain connections.
    pub tls: common::internal_tls::TlsSettings,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 8101)),
            advertise_address: None,
            shutdown_grace_ms: 30_000,
            model_dir: None,
            page_size: 64,
            engine_num_pages: 1024,
            max_running: 32,
            max_batch_tokens: 512,
            router: None,
            transports: vec!["ucx".to_owned(), "tcp".to_owned()],
            stream_state: true,
            backend: "cpu".to_owned(),
            hybrid: false,
            cluster_secret_file: None,
            tls: common::internal_tls::TlsSettings::default(),
        }
    }
}

impl ServiceConfig for PrefillConfig {
    const ROLE: &'static str = "prefill-worker";

    fn validate(&self) -> Result<(), Invalid> {
        common::config::check_advertise("advertise_address", self.advertise_address.as_deref())?;
        let page_size = u64::from(self.page_size);
        if !page_size.is_power_of_two() || !(4..=4096).contains(&page_size) {
            return Err(Invalid::new(
                "page_size",
                "must be a power of two between 4 and 4096",
            ));
        }
        common::config::check_range(
            "engine_num_pages",
            u64::from(self.engine_num_pages),
            1,
            1 << 24,
        )?;
        common::config::check_range("max_running", u64::from(self.max_running), 1, 4096)?;
        common::config::check_range(
            "max_batch_tokens",
            u64::from(self.max_batch_tokens),
            1,
            1 << 20,
        )?;
        kv_transfer::handshake::parse_transports(&self.transports)
            .map_err(|e| Invalid::new("transports", e))?;
        let backend = kernels::backend::BackendKind::parse(&self.backend)
            .map_err(|e| Invalid::new("backend", e))?;
        if !backend.built_in() {
            return Err(Invalid::new(
                "backend",
                "this binary was built without the CUDA backend (cargo feature `cuda`)",
            ));
        }
        common::cluster_auth::Security::load(self.cluster_secret_file.as_deref(), &self.tls)?;
        if let Some(router) = &self.router {
            common::config::check_host_port("router", router)?;
        }
        common::config::check_range("shutdown_grace_ms", self.shutdown_grace_ms, 0, 600_000)
    }
}

/// Command line of `pdserve-prefill`. Every flag overrides the setting of the same name.
#[derive(Debug, Parser, Serialize)]
#[command(name = "pdserve-prefill", version, about = "pdserve prefill worker", long_about = None)]
pub struct Cli {
    /// TOML configuration file.
    #[arg(long, env = common::env::CONFIG, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address, e.g. 127.0.0.1:8101 (port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_listen: Option<SocketAddr>,
    /// host:port other processes use to reach this worker.
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<String>,
    /// Milliseconds in-flight calls may take after SIGTERM.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_ms: Option<u64>,
    /// Checkpoint folder served by this worker.
    #[arg(long, value_name = "DIR")]
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
    /// Requests in the engine at once.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Tokens per forward step.
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<u32>,
    /// Register with the router at this gRPC host:port.
    #[arg(long, value_name = "HOST:PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<String>,
    /// A state transport to offer (ucx, tcp), in order of preference; repeat for several.
    #[arg(long = "transport", value_name = "NAME")]
    #[serde(rename = "transports", skip_serializing_if = "Vec::is_empty")]
    pub transports: Vec<String>,
    /// Stream the prompt state during the forward passes (true) or send it afterwards.
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_state: Option<bool>,
    /// Compute backend: cpu or cuda.
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Let ops the backend does not run fall back to the CPU.
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<bool>,
    /// File holding the cluster's shared secret (all roles must use the same).
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_secret_file: Option<PathBuf>,
    #[command(flatten)]
    #[serde(skip_serializing_if = "common::internal_tls::TlsFlags::is_empty")]
    pub tls: common::internal_tls::TlsFlags,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct NoFlags {}

    #[test]
    fn defaults_are_valid() {
        assert!(PrefillConfig::default().validate().is_ok());
    }

    /// The annotated example in deploy/ loads and changes every key it shows.
    #[test]
    fn deploy_example_loads() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/prefill.toml");
        let loaded: PrefillConfig =
            common::config::load(Some(&path), Vec::new(), &NoFlags {}).unwrap();
        assert_ne!(loaded, PrefillConfig::default());
    }
}
