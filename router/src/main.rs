//! `pdserve-router`: the router process.

use std::process::ExitCode;

use clap::Parser;
use router::{Cli, RouterConfig};

fn main() -> ExitCode {
    let cli = Cli::parse();
    common::cli::run_service::<RouterConfig, _, _, _>(
        "pdserve-router",
        cli.config.path.as_deref(),
        &cli,
        router::run,
    )
}
