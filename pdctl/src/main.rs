//! `pdctl`: the pdserve operator CLI.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    pdctl::main(pdctl::Cli::parse())
}
