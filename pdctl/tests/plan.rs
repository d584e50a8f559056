//! `pdctl plan` on the shipped DeepSeek-V4-Flash configs (engine/tests/configs): its JSON
//! agrees with the engine's sizing, the fit arithmetic holds, and bad input is refused.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{path::PathBuf, process::Command};

use engine::{config::ModelConfig, paged::layout::KvStorage, plan};
use serde_json::Value;

fn configs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/configs")
}

fn plan_json(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pdctl"))
        .arg("plan")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn json_agrees_with_the_engine_and_the_fit_adds_up() {
    let dir = configs().join("deepseek-v4-flash-nvfp4");
    let v = plan_json(&[
        "--config",
        dir.to_str().unwrap(),
        "--gpu-memory",
        "141GB",
        "--gpus",
        "4",
        "--kv",
        "fp8",
        "--context",
        "32768",
    ]);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let weights = plan::weights(&config);
    assert_eq!(v["expert_format"], "nvfp4", "hf_quant_config.json was read");
    assert_eq!(v["weight_bytes"], weights.total);
    assert_eq!(v["weights"]["total_bytes"], weights.total);
    assert_eq!(v["weights"]["served_bytes"], weights.served);
    let classes = v["weights"]["classes"].as_array().unwrap();
    let sum: u64 = classes.iter().map(|c| c["bytes"].as_u64().unwrap()).sum();
    assert_eq!(sum, weights.total);

    let fp8 = plan::state(&config, 64, KvStorage::Fp8).unwrap();
    assert_eq!(v["state"]["fp8"]["page_bytes"], fp8.page_bytes);
    assert_eq!(v["state"]["fp8"]["request_bytes"], fp8.request_bytes(32768));

    let fit = &v["fit"];
    let usable = fit["usable_bytes"].as_u64().unwrap();
    assert_eq!(usable, (141e9 * 4.0 * 0.9) as u64);
    assert_eq!(fit["free_bytes"].as_u64().unwrap(), usable - weights.served);
    let pages = fit["pages"].as_u64().unwrap();
    assert_eq!(pages, (usable - weights.served) / fp8.page_bytes);
    assert_eq!(fit["tokens"].as_u64().unwrap(), pages * 64);
    assert!(fit["weights_fit"].as_bool().unwrap());
    let requests = fit["requests_at_context"].as_u64().unwrap();
    assert!(requests * fp8.request_bytes(32768) <= usable - weights.served);
    assert!((requests + 1) * fp8.request_bytes(32768) > usable - weights.served);
}

#[test]
fn a_group_too_small_for_the_weights_says_so() {
    let file = configs().join("deepseek-v4-flash/config.json");
    let v = plan_json(&["--config", file.to_str().unwrap(), "--gpu-memory", "80GiB"]);
    assert_eq!(v["fit"]["weights_fit"], false);
    assert_eq!(v["fit"]["pages"], 0);
    let text = Command::new(env!("CARGO_BIN_EXE_pdctl"))
        .args([
            "plan",
            "--config",
            file.to_str().unwrap(),
            "--gpu-memory",
            "80GiB",
        ])
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("do NOT fit"), "{text}");
    assert!(text.contains("routed_experts"), "{text}");
}

#[test]
fn bad_input_is_refused() {
    let dir = configs().join("deepseek-v4-flash");
    for args in [
        vec!["--config", "/nonexistent/config.json"],
        vec!["--config", dir.to_str().unwrap(), "--gpu-memory", "lots"],
        vec!["--config", dir.to_str().unwrap(), "--utilization", "1.5"],
        vec!["--config", dir.to_str().unwrap(), "--kv", "int4"],
        vec!["--config", dir.to_str().unwrap(), "--page-size", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pdctl"))
            .arg("plan")
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty(), "{args:?} failed without a message");
    }
}
