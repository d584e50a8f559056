//! `pdctl plan` on the shipped DeepSeek-V4-Flash configs (engine/tests/configs): its JSON
//! agrees with the engine's sizing, the fit arithmetic holds, and bad input is refused.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{path::PathBuf, process::Command};

use engine::{config::ModelConfig, paged::layout::KvStorage, plan};
use serde_json::{Value, json};

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
    let bf16 = plan::state(&config, 64, KvStorage::Bf16).unwrap();
    assert_eq!(v["state"]["bf16"]["page_bytes"], bf16.page_bytes);
    // The figures OPERATIONS.md quotes: bf16 halves the K=V rows, the indexer's keys stay f32.
    for (kv, bytes) in [("f32", 102_144.0), ("fp8", 31_066.0), ("bf16", 52_416.0)] {
        assert_eq!(
            v["state"][kv]["bytes_per_token"].as_f64(),
            Some(bytes),
            "{kv}"
        );
    }

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

/// `--tp` / `--ep` / `--dp-attention`: each GPU holds its share (whole experts by EP, heads by
/// TP, the rest replicated), the JSON agrees with the engine's shard sizing, and splits that do
/// not divide the model are refused with the reason.
#[test]
fn per_gpu_shares_follow_the_layout() {
    let dir = configs().join("deepseek-v4-flash-nvfp4");
    let dir = dir.to_str().unwrap();
    let config = ModelConfig::from_dir(std::path::Path::new(dir)).unwrap();
    let served = plan::weights(&config).served;
    let group = |extra: &[&str]| {
        let mut args = vec!["--config", dir, "--kv", "fp8", "--gpu-memory", "96GB"];
        args.extend_from_slice(extra);
        plan_json(&args)
    };
    let dp = group(&["--ep", "4", "--dp-attention"]);
    let tp = group(&["--tensor-parallel-size", "4", "--expert-parallel-size", "4"]);
    for v in [&dp, &tp] {
        assert_eq!(v["fit"]["gpus"], 4, "the group is max(tp, ep) GPUs");
        let per = v["per_gpu"]["weight_bytes"].as_u64().unwrap();
        assert!(per < served / 3 && per > served / 4, "{per} of {served}");
    }
    let p = |tp, ep, dp_attention| plan::shard::Parallel {
        moe_tp: false,
        tp,
        ep,
        dp_attention,
    };
    assert_eq!(
        dp["per_gpu"]["weight_bytes"],
        plan::shard::gpu_weights(&config, p(1, 4, true)).total
    );
    assert_eq!(
        tp["per_gpu"]["weight_bytes"],
        plan::shard::gpu_weights(&config, p(4, 4, false)).total
    );
    // Sliced experts: each GPU holds a quarter of every expert, as many bytes as TP + EP.
    let sliced = group(&["--tp", "4", "--moe-tp"]);
    assert_eq!(
        sliced["per_gpu"]["weight_bytes"],
        plan::shard::gpu_weights(
            &config,
            plan::shard::Parallel {
                moe_tp: true,
                ..p(4, 1, false)
            }
        )
        .total
    );
    assert_eq!(
        sliced["per_gpu"]["weight_bytes"],
        tp["per_gpu"]["weight_bytes"]
    );
    // Each rank's slice of every expert, on the stored form's scale blocks (GPU workers hold
    // it as an expert of its own).
    let inter = config.moe_intermediate_size as u64;
    assert_eq!(
        sliced["per_gpu"]["expert_slice"],
        json!({"values": inter / 4, "of": inter, "on_scale_blocks": true})
    );
    assert!(tp["per_gpu"]["expert_slice"].is_null());
    // Under DP-attention every rank's pool holds its own requests: 4x the tokens of TP's
    // replicated state, less the larger replicated attention.
    let tokens = |v: &Value| v["per_gpu"]["fit"]["tokens"].as_u64().unwrap();
    assert!(
        tokens(&dp) > 3 * tokens(&tp),
        "{} vs {}",
        tokens(&dp),
        tokens(&tp)
    );
    for (extra, reason) in [
        (&["--tp", "16"][..], "output groups"),
        (&["--ep", "3"][..], "routed experts"),
        (&["--tp", "2", "--dp-attention"][..], "tp must be 1"),
        (
            &["--tp", "2", "--ep", "2", "--moe-tp"][..],
            "needs tp > 1 and ep 1",
        ),
        (&["--ep", "4", "--gpus", "2"][..], "disagrees"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pdctl"))
            .args(["plan", "--config", dir])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(reason), "{extra:?}: {err}");
    }
}

/// A slice of every expert that would cut the stored form's scale blocks (the tiny model's 32
/// MXFP4 values over 2 ranks: 16 each, blocks of 32) is planned, and the plan says GPU workers
/// refuse it; NVFP4's blocks of 16 take it.
#[test]
fn a_slice_across_scale_blocks_is_named() {
    use engine::{
        config::ExpertFormat,
        synth::{GenerateOptions, Preset, generate},
    };
    for (experts, on_blocks) in [(ExpertFormat::Mxfp4, false), (ExpertFormat::Nvfp4, true)] {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 1, experts, dir.path());
        generate(&options).unwrap();
        let config = dir.path().to_str().unwrap();
        let v = plan_json(&["--config", config, "--tp", "2", "--moe-tp"]);
        assert_eq!(
            v["per_gpu"]["expert_slice"],
            json!({"values": 16, "of": 32, "on_scale_blocks": on_blocks})
        );
        let out = Command::new(env!("CARGO_BIN_EXE_pdctl"))
            .args(["plan", "--config", config, "--tp", "2", "--moe-tp"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("each rank holds 16 of every expert's 32 intermediate values"),
            "{text}"
        );
        assert_eq!(
            text.contains(
                "GPU workers refuse it (a slice of 16 cuts the stored scale blocks of 32"
            ),
            !on_blocks,
            "{text}"
        );
    }
}
