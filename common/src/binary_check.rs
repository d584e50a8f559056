//! The check every binary's own `tests/cli.rs` runs: `--help` and `--version` work. (Its
//! presence also makes `cargo test` build the binary for the integration tests.)

use std::{path::Path, process::Command};

/// Runs `binary --help` and `binary --version` and panics unless both succeed, the help shows
/// the usage line of `name` and the version line starts with `name`.
pub fn help_and_version(binary: impl AsRef<Path>, name: &str) {
    let binary = binary.as_ref();
    let run = |flag: &str| {
        let out = Command::new(binary)
            .arg(flag)
            .output()
            .unwrap_or_else(|e| panic!("{} {flag}: {e}", binary.display()));
        assert!(out.status.success(), "{} {flag}: {out:?}", binary.display());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let help = run("--help");
    assert!(help.contains(&format!("Usage: {name}")), "{help}");
    let version = run("--version");
    assert!(version.starts_with(&format!("{name} ")), "{version}");
}
