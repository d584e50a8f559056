//! Compiles `pdserve/v1/*.proto` with protox (pure Rust, no system protoc) and tonic-prost-build.

use std::{path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    match compile() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Build scripts report through stderr; cargo shows it on failure.
            #[expect(clippy::print_stderr, reason = "build script error output")]
            {
                eprintln!("proto build failed: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

fn compile() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from("pdserve/v1");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    let fds = protox::compile(&files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptor set lets tests (and reflection tools) enumerate every message.
    std::fs::write(
        out.join("pdserve_v1_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    let mut config = tonic_prost_build::Config::new();
    // `prost::Name` impls give every message its full proto name (tests, error details).
    config.enable_type_names();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds_with_config(fds, config)?;
    Ok(())
}
