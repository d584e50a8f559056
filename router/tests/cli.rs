//! `pdserve-router --help` and `--version` work (and `cargo test` builds the binary for the
//! integration tests).

use std::process::Command;

#[test]
fn help_and_version() {
    let help = Command::new(env!("CARGO_BIN_EXE_pdserve-router"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8(help.stdout).unwrap();
    assert!(text.contains("Usage: pdserve-router"), "{text}");
    let version = Command::new(env!("CARGO_BIN_EXE_pdserve-router"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(version.status.success());
    assert!(
        String::from_utf8(version.stdout)
            .unwrap()
            .starts_with("pdserve-router ")
    );
}
