//! `pdserve-prefill`: the prefill worker process.

use std::process::ExitCode;

use clap::Parser;
use prefill_worker::{Cli, PrefillConfig};

fn main() -> ExitCode {
    let cli = Cli::parse();
    common::cli::run_service::<PrefillConfig, _, _, _>(
        "pdserve-prefill",
        cli.config.path.as_deref(),
        &cli,
        prefill_worker::run,
    )
}
