//! The engine against `transformers` (the external oracle). Fixtures in `tests/golden/` were
//! written by `tools/golden/golden.py` from checkpoints made by `pdctl gen-model`; this test
//! regenerates each checkpoint, checks its bytes are the ones the fixture was made from, runs
//! the prompts through the CPU model and compares: max |ours - reference| over the stored
//! logits / max |reference| <= 1e-4 at every stored position, and the same top-1 token wherever
//! the reference's top two are not a near-tie.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    reason = "test code"
)]

use std::{collections::BTreeMap, path::Path};

use engine::{
    config::ExpertFormat,
    model::{Logits, Model},
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, generate},
};
use serde_json::Value;
use sha2::{Digest, Sha256};

const TOLERANCE: f32 = 1e-4;

fn parse_dir_name(name: &str) -> (Preset, ExpertFormat, u64) {
    let parts: Vec<&str> = name.split('-').collect();
    assert_eq!(
        parts.len(),
        3,
        "dir_name {name} is not <preset>-<experts>-seed<N>"
    );
    let preset = Preset::parse(parts[0]).expect("preset");
    let experts = match parts[1] {
        "bf16" => ExpertFormat::Bf16,
        "mxfp4" => ExpertFormat::Mxfp4,
        "nvfp4" => ExpertFormat::Nvfp4,
        other => panic!("experts {other}"),
    };
    let seed = parts[2]
        .strip_prefix("seed")
        .expect("seed")
        .parse()
        .unwrap();
    (preset, experts, seed)
}

fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .fold(String::new(), |mut s, b| {
            use std::fmt::Write as _;
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ints(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn engine_matches_transformers_golden_logits() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut fixtures: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/golden exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    fixtures.sort();
    assert!(
        fixtures.len() >= 3,
        "expected at least 3 golden fixtures in {}",
        dir.display()
    );
    let mut longest = 0;
    let mut checked_positions = 0;
    let mut greedy_checked = 0;
    let mut models: BTreeMap<String, (tempfile::TempDir, Model)> = BTreeMap::new();
    for path in &fixtures {
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let name = fixture["model"]["dir_name"].as_str().unwrap().to_owned();
        if !models.contains_key(&name) {
            let (preset, experts, seed) = parse_dir_name(&name);
            let tmp = tempfile::tempdir().unwrap();
            let options = GenerateOptions::new(preset, seed, experts, tmp.path());
            generate(&options).unwrap();
            for (file, want) in fixture["model"]["safetensors_sha256"].as_object().unwrap() {
                assert_eq!(
                    sha256(&tmp.path().join(file)),
                    want.as_str().unwrap(),
                    "{name}/{file}: the generator no longer produces the bytes this fixture was made from; regenerate the fixtures (tools/golden/README.md)"
                );
            }
            let model = Model::load(tmp.path()).unwrap();
            models.insert(name.clone(), (tmp, model));
        }
        let model = &models[&name].1;
        let mut worst = 0.0f32;
        for prompt in fixture["prompts"].as_array().unwrap() {
            let ids: Vec<u32> = ints(&prompt["ids"]).into_iter().map(|i| i as u32).collect();
            longest = longest.max(ids.len());
            let mut state = model.new_state();
            let logits = model.forward(&mut state, &ids, Logits::All).unwrap();
            let subset = ints(&prompt["subset_ids"]);
            let positions = ints(&prompt["positions"]);
            for (i, &pos) in positions.iter().enumerate() {
                let ours = &logits[pos];
                let reference = floats(&prompt["logits"][i]);
                let max_abs = prompt["max_abs"][i].as_f64().unwrap() as f32;
                let diff = subset
                    .iter()
                    .zip(&reference)
                    .fold(0.0f32, |m, (&id, &r)| m.max((ours[id] - r).abs()));
                let rel = diff / max_abs;
                worst = worst.max(rel);
                assert!(
                    rel <= TOLERANCE,
                    "{}: prompt len {} position {pos}: max diff {diff} / max |ref| {max_abs} = {rel}",
                    path.display(),
                    ids.len()
                );
                let our_max = ours.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((our_max - max_abs).abs() / max_abs <= TOLERANCE);
                let gap = prompt["top2_gap"][i].as_f64().unwrap() as f32;
                if gap > 1e-5 * max_abs {
                    let our_top = ours
                        .iter()
                        .enumerate()
                        .fold(
                            (0, f32::NEG_INFINITY),
                            |b, (j, &v)| if v > b.1 { (j, v) } else { b },
                        )
                        .0;
                    assert_eq!(
                        our_top,
                        prompt["argmax"][i].as_u64().unwrap() as usize,
                        "{}: top-1 differs at position {pos}",
                        path.display()
                    );
                }
                checked_positions += 1;
            }
        }
        println!("{}: worst relative diff {worst:.3e}", path.display());
        greedy_matches(model, path, &fixture, &mut greedy_checked);
    }
    assert!(
        greedy_checked >= 9,
        "every fixture prompt records a greedy continuation"
    );
    assert!(
        longest >= 300,
        "one golden prompt must have at least 300 tokens"
    );
    println!(
        "{} fixtures, {checked_positions} positions checked, {greedy_checked} greedy continuations equal",
        fixtures.len()
    );
}

/// The serving engine's greedy generation (the path `pdctl generate` takes) equals the
/// continuation `transformers` recorded, token for token.
fn greedy_matches(model: &Model, path: &Path, fixture: &Value, checked: &mut usize) {
    let prompts = fixture["prompts"].as_array().unwrap();
    let with_greedy: Vec<&Value> = prompts
        .iter()
        .filter(|p| p.get("greedy").is_some())
        .collect();
    if with_greedy.is_empty() {
        return;
    }
    let copy = Model::new(model.config.clone(), model.weights.clone());
    let mut engine = Engine::new(copy, EngineConfig::default(), "golden").unwrap();
    let mut want = BTreeMap::new();
    for (id, prompt) in with_greedy.iter().enumerate() {
        let expected: Vec<u32> = ints(&prompt["greedy"])
            .into_iter()
            .map(|t| t as u32)
            .collect();
        engine
            .add(GenerationRequest {
                id: id as u64,
                prompt: ints(&prompt["ids"]).into_iter().map(|t| t as u32).collect(),
                sampling: SamplingParams::default(),
                stop: StopConditions {
                    max_tokens: expected.len() as u32,
                    min_tokens: 0,
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                    eos_token_ids: model.config.eos_token_ids.clone(),
                },
            })
            .unwrap();
        want.insert(id as u64, expected);
    }
    let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for event in engine.run_to_completion() {
        if let Event::Token { id, sampled, .. } = event {
            got.entry(id).or_default().push(sampled.token);
        }
    }
    assert_eq!(
        got,
        want,
        "{}: greedy continuation differs from transformers",
        path.display()
    );
    *checked += want.len();
}
