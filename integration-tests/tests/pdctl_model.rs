//! `pdctl gen-model`, `logits` and `generate` as a user runs them: a checkpoint written by one
//! command loads in the others, the same seed writes the same bytes, and greedy generation is
//! reproducible and consistent with the logits command.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::Duration;

use integration_tests::{command, run_to_exit};

fn pdctl(args: &[&str]) -> String {
    let mut cmd = command("pdctl");
    cmd.args(args);
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(120));
    assert!(status.success(), "pdctl {args:?}: {stderr}");
    stdout
}

#[test]
fn generated_checkpoint_serves_logits_and_generation() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    for out in [&a, &b] {
        pdctl(&[
            "gen-model",
            "--preset",
            "tiny",
            "--seed",
            "5",
            "--experts",
            "nvfp4",
            "--out",
            out.to_str().unwrap(),
        ]);
    }
    for file in [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "hf_quant_config.json",
    ] {
        assert_eq!(
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
            "{file}"
        );
    }
    assert!(
        a.join("tokenizer.json").is_file(),
        "tokenizer copied from the setup cache"
    );

    let model = a.to_str().unwrap();
    let logits: serde_json::Value = serde_json::from_str(&pdctl(&[
        "logits", "--model", model, "--ids", "10,20,30", "--out", "-",
    ]))
    .unwrap();
    let last = logits["logits"][0].as_array().unwrap();
    assert_eq!(last.len(), 129_280);
    let argmax = last
        .iter()
        .enumerate()
        .fold((0, f64::MIN), |b, (i, v)| {
            let v = v.as_f64().unwrap();
            if v > b.1 { (i, v) } else { b }
        })
        .0;

    let run = || -> serde_json::Value {
        serde_json::from_str(&pdctl(&[
            "generate",
            "--model",
            model,
            "--ids",
            "10,20,30",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ]))
        .unwrap()
    };
    let first = run();
    assert_eq!(first, run(), "greedy generation is reproducible");
    assert_eq!(first["ids"].as_array().unwrap().len(), 5);
    assert_eq!(
        first["ids"][0].as_u64().unwrap() as usize,
        argmax,
        "first token is the logits argmax"
    );
    assert_eq!(first["finish_reason"], "length");

    let text = pdctl(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "Hello",
        "--max-tokens",
        "3",
        "--json",
    ]);
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(doc["prompt_ids"].as_array().is_some_and(|p| !p.is_empty()));
    assert!(doc["text"].is_string());
}
