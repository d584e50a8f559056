//! `pdctl --help` and `--version` work (and `cargo test` builds the binary for the
//! integration tests).

#[test]
fn help_and_version() {
    common::binary_check::help_and_version(env!("CARGO_BIN_EXE_pdctl"), "pdctl");
}
