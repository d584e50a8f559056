//! `pdserve-decode`: the decode worker process.

use std::process::ExitCode;

use clap::Parser;
use decode_worker::{Cli, DecodeConfig};

fn main() -> ExitCode {
    let cli = Cli::parse();
    common::cli::run_service::<DecodeConfig, _, _, _>(
        "pdserve-decode",
        cli.config.path.as_deref(),
        &cli,
        decode_worker::run,
    )
}
