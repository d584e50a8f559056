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
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 8101)),
            advertise_address: None,
            shutdown_grace_ms: 30_000,
        }
    }
}

impl ServiceConfig for PrefillConfig {
    const ROLE: &'static str = "prefill-worker";

    fn validate(&self) -> Result<(), Invalid> {
        common::config::check_advertise("advertise_address", self.advertise_address.as_deref())?;
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
