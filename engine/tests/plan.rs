//! `engine::plan` against what is on disk: the weight bytes it computes from a configuration
//! equal the tensor data of a checkpoint written for that configuration, and for the shipped
//! DeepSeek-V4-Flash configurations they agree with the published checkpoint sizes.
#![allow(
    clippy::unwrap_used,
    clippy::float_cmp,
    reason = "test code; exact byte counts"
)]

use std::path::{Path, PathBuf};

use engine::{
    config::{ExpertFormat, ModelConfig},
    paged::layout::KvStorage,
    plan::{self, LayerKind, WeightClass},
    synth::{self, GenerateOptions, Preset},
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/configs")
        .join(name)
}

/// Bytes of tensor data in every shard of `dir` (file length less the 8-byte length prefix
/// and the JSON header).
fn data_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            total += bytes.len() as u64 - 8 - header;
        }
    }
    total
}

#[test]
fn weight_bytes_equal_a_written_checkpoint() {
    for experts in [
        ExpertFormat::Bf16,
        ExpertFormat::Fp8Block,
        ExpertFormat::Mxfp4,
        ExpertFormat::Nvfp4,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 3, experts, dir.path().to_owned());
        synth::generate(&options).unwrap();
        let config = ModelConfig::from_dir(dir.path()).unwrap();
        let weights = plan::weights(&config);
        assert_eq!(weights.total, data_bytes(dir.path()), "{experts:?}");
        assert_eq!(weights.served, weights.total, "tiny has no draft stages");
        let sum: u64 = weights.classes.iter().map(|c| c.bytes).sum();
        assert_eq!(sum, weights.total);
    }
}

fn class(plan: &plan::WeightPlan, class: WeightClass) -> u64 {
    plan.classes
        .iter()
        .find(|c| c.class == class)
        .map_or(0, |c| c.bytes)
}

/// The 0731 checkpoint's 48 shards, in bytes (file sizes as published).
const FLASH_0731_SHARDS: u64 = 166_886_535_336;

#[test]
fn shipped_flash_0731_agrees_with_its_shards() {
    let config = ModelConfig::from_dir(&fixture("deepseek-v4-flash-0731")).unwrap();
    assert_eq!(config.num_layers(), 43);
    assert_eq!(config.draft_layers.len(), 3);
    let weights = plan::weights(&config);
    // What is not modelled: DSpark's own projections (shapes unpublished) and the shards'
    // JSON headers; both make the files larger, never smaller.
    assert!(weights.total < FLASH_0731_SHARDS, "{}", weights.total);
    let missing = FLASH_0731_SHARDS - weights.total;
    assert!(
        (missing as f64) < 0.001 * FLASH_0731_SHARDS as f64,
        "{} bytes ({:.3}%) unaccounted for",
        missing,
        100.0 * missing as f64 / FLASH_0731_SHARDS as f64
    );
    // Three draft stages on top of the served decoder.
    assert_eq!(
        weights.served,
        weights.total - class(&weights, WeightClass::DraftStages)
    );
}

#[test]
fn shipped_flash_configs() {
    let april = ModelConfig::from_dir(&fixture("deepseek-v4-flash")).unwrap();
    let nvfp4 = ModelConfig::from_dir(&fixture("deepseek-v4-flash-nvfp4")).unwrap();
    assert_eq!(april.expert_format, ExpertFormat::Mxfp4);
    assert_eq!(nvfp4.expert_format, ExpertFormat::Nvfp4);
    let (a, n) = (plan::weights(&april), plan::weights(&nvfp4));
    // Published as "about 160 GB" and "168GB".
    assert!((a.total as f64 / 160e9 - 1.0).abs() < 0.01, "{}", a.total);
    assert!((n.total as f64 / 168e9 - 1.0).abs() < 0.01, "{}", n.total);
    // Only the routed experts differ: NVFP4 doubles the block scales (one e4m3 per 16 instead of
    // one e8m0 per 32) and adds two f32 scalars per projection.
    let experts = 43 * 256 * 3u64;
    let elements = 2048 * 4096u64;
    assert_eq!(
        class(&n, WeightClass::RoutedExperts) - class(&a, WeightClass::RoutedExperts),
        experts * (elements / 16 - elements / 32 + 8)
    );
    assert_eq!(
        n.total - class(&n, WeightClass::RoutedExperts),
        a.total - class(&a, WeightClass::RoutedExperts),
        "everything but the decoder's routed experts is stored alike"
    );
    // The embedding and head are bf16 [129280, 4096].
    assert_eq!(class(&a, WeightClass::Embedding), 129_280 * 4096 * 2);
    assert_eq!(class(&a, WeightClass::Head), 129_280 * 4096 * 2);
}

#[test]
fn shipped_flash_state() {
    let config = ModelConfig::from_dir(&fixture("deepseek-v4-flash")).unwrap();
    let fp8 = plan::state(&config, 64, KvStorage::Fp8).unwrap();
    let kinds: Vec<(LayerKind, usize)> = fp8.kinds.iter().map(|k| (k.kind, k.layers)).collect();
    assert_eq!(
        kinds,
        [
            (LayerKind::Sliding, 2),
            (LayerKind::Csa, 21),
            (LayerKind::Hca, 20)
        ]
    );
    // DeepSeek's 584-byte FP8 row: a sliding layer holds one per token.
    assert_eq!(fp8.kinds[0].bytes_per_token, 584.0);
    // A CSA layer: the window row, a quarter of a compressed row, a quarter of an f32
    // indexer key of 128 values (each region padded to 64 bytes within the page).
    let csa = &fp8.kinds[1];
    let page = |bytes: usize| bytes.next_multiple_of(64) as f64 / 64.0;
    assert_eq!(
        csa.bytes_per_token,
        page(64 * 584) + page(16 * 584) + page(16 * 512)
    );
    let f32 = plan::state(&config, 64, KvStorage::F32).unwrap();
    assert_eq!(f32.kinds[0].bytes_per_token, 2048.0);
    let sum: f64 = fp8
        .kinds
        .iter()
        .map(|k| k.layers as f64 * k.bytes_per_token)
        .sum();
    assert!((sum - fp8.bytes_per_token()).abs() < 1e-6 * sum);
}
