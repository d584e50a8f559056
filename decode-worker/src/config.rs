//! Settings of the decode worker: the shared worker settings (worker-core) and nothing of its
//! own yet. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

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
    #[command(flatten)]
    #[serde(skip)]
    pub config: common::cli::ConfigFileArg,
    #[command(flatten)]
    #[serde(flatten)]
    pub worker: WorkerFlags,
}
