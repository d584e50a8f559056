//! The model fingerprint workers compare before exchanging state.
#![allow(clippy::unwrap_used, reason = "test code")]

use engine::{
    config::ExpertFormat,
    synth::{GenerateOptions, Preset, generate},
    weights::fingerprint,
};

fn checkpoint(seed: u64, experts: ExpertFormat) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, seed, experts, dir.path());
    generate(&options).unwrap();
    dir
}

#[test]
fn same_files_same_fingerprint_different_weights_differ() {
    let a = fingerprint(checkpoint(1, ExpertFormat::Mxfp4).path()).unwrap();
    let b = fingerprint(checkpoint(1, ExpertFormat::Mxfp4).path()).unwrap();
    assert_eq!(
        a, b,
        "a regenerated identical checkpoint has the same fingerprint"
    );
    assert_eq!(a.len(), 64);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    let other_seed = fingerprint(checkpoint(2, ExpertFormat::Mxfp4).path()).unwrap();
    let other_format = fingerprint(checkpoint(1, ExpertFormat::Nvfp4).path()).unwrap();
    assert_ne!(a, other_seed, "different weights");
    assert_ne!(a, other_format, "different expert storage");

    // Changing the config changes the fingerprint.
    let dir = checkpoint(1, ExpertFormat::Mxfp4);
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["rms_norm_eps"] = serde_json::json!(1e-5);
    std::fs::write(&path, config.to_string()).unwrap();
    assert_ne!(fingerprint(dir.path()).unwrap(), a);
}

#[test]
fn missing_checkpoint_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    assert!(fingerprint(dir.path()).is_err());
}
