//! Settings of the decode worker: the shared worker settings (worker-core) and nothing of its
//! own yet. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

use std::path::PathBuf;

use clap::Parser;
use common::config::{Invalid, ServiceConfig};
use serde::{Deserialize, Serialize};
use worker_core::{WorkerFlags, WorkerSettings};

/// Default gRPC port of a decode worker.
const DEFAULT_PORT: u16 = 8201;

/// Validated settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecodeConfig {
    /// Listening, model, pool, router, transports, backend, security.
    #[serde(flatten)]
    pub worker: WorkerSettings,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            worker: WorkerSettings::listening_on(DEFAULT_PORT),
        }
    }
}

impl ServiceConfig for DecodeConfig {
    const ROLE: &'static str = "decode-worker";

    fn validate(&self) -> Result<(), Invalid> {
        self.worker.validate()
    }
}

/// Command line of `pdserve-decode`. Every flag overrides the setting of the same name.
#[derive(Debug, Parser, Serialize)]
#[command(name = "pdserve-decode", version, about = "pdserve decode worker", long_about = None)]
pub struct Cli {
    /// TOML configuration file.
    #[arg(long, env = common::env::CONFIG, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    pub worker: WorkerFlags,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct NoFlags {}

    #[test]
    fn defaults_are_valid() {
        assert!(DecodeConfig::default().validate().is_ok());
        assert_eq!(
            DecodeConfig::default().worker.grpc_listen.port(),
            DEFAULT_PORT
        );
    }

    /// The annotated example in deploy/ loads and changes every key it shows.
    #[test]
    fn deploy_example_loads() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/decode.toml");
        let loaded: DecodeConfig =
            common::config::load(Some(&path), Vec::new(), &NoFlags {}).unwrap();
        assert_ne!(loaded, DecodeConfig::default());
    }
}
