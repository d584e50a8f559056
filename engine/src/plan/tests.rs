use super::*;
use crate::{config::ExpertFormat, paged::layout::RegionKind, synth::Preset};

fn small() -> ModelConfig {
    Preset::Small.config(ExpertFormat::Nvfp4)
}

#[test]
fn classes_cover_every_tensor_once() {
    let mut c = small();
    c.draft_layers = vec![Attention::Sliding];
    let plan = weights(&c);
    let tensors = schema::tensors(&c).len() + schema::draft_tensors(&c).len();
    assert_eq!(
        plan.classes.iter().map(|c| c.tensors).sum::<usize>(),
        tensors
    );
    let draft: u64 = schema::draft_tensors(&c)
        .iter()
        .map(schema::stored_bytes)
        .sum();
    assert!(draft > 0);
    assert_eq!(plan.served + draft, plan.total);
    // Every class of a V4 model is present and named once.
    let names: std::collections::BTreeSet<_> =
        plan.classes.iter().map(|c| c.class.name()).collect();
    assert_eq!(names.len(), 9);
}

#[test]
fn tensors_fall_in_their_classes() {
    let spec = |name: &str, storage| TensorSpec {
        name: name.into(),
        shape: vec![8, 8],
        storage,
    };
    let lin = Storage::Linear(crate::config::LinearFormat::Fp8Block);
    for (name, storage, class) in [
        ("embed.weight", Storage::Bf16, WeightClass::Embedding),
        ("head.weight", Storage::Bf16, WeightClass::Head),
        ("layers.3.attn.wq_b", lin, WeightClass::AttentionLinears),
        (
            "layers.3.attn.kv_norm.weight",
            Storage::Bf16,
            WeightClass::Small,
        ),
        ("layers.3.attn.attn_sink", Storage::F32, WeightClass::Small),
        (
            "layers.2.attn.indexer.wq_b",
            lin,
            WeightClass::CompressorsAndIndexer,
        ),
        (
            "layers.2.attn.compressor.ape",
            Storage::F32,
            WeightClass::CompressorsAndIndexer,
        ),
        (
            "layers.0.ffn.gate.tid2eid",
            Storage::I32,
            WeightClass::Router,
        ),
        (
            "layers.0.ffn.shared_experts.w2",
            lin,
            WeightClass::SharedExperts,
        ),
        (
            "layers.0.ffn.experts.7.w1",
            Storage::Expert(ExpertFormat::Nvfp4),
            WeightClass::RoutedExperts,
        ),
        ("layers.0.hc_attn_fn", Storage::F32, WeightClass::Small),
        ("mtp.0.ffn.experts.1.w1", lin, WeightClass::DraftStages),
        ("mtp.0.e_proj", lin, WeightClass::DraftStages),
    ] {
        assert_eq!(WeightClass::of(&spec(name, storage)), class, "{name}");
    }
}

#[test]
fn state_matches_the_layout() {
    let c = small();
    for kv in KvStorage::ALL {
        for page_size in [4, 16, 64, 256] {
            let plan = state(&c, page_size, kv).unwrap();
            let layout = StateLayout::new(&c, page_size, kv, "x").unwrap();
            assert_eq!(plan.page_bytes, layout.page_bytes as u64);
            assert_eq!(plan.slot_bytes, layout.slot_bytes as u64);
            let layers: usize = plan.kinds.iter().map(|k| k.layers).sum();
            assert_eq!(layers, c.num_layers());
            let paged: f64 = plan
                .kinds
                .iter()
                .map(|k| k.layers as f64 * k.bytes_per_token)
                .sum();
            assert!((paged - plan.bytes_per_token()).abs() < 1e-9, "{paged}");
            let slot: u64 = plan
                .kinds
                .iter()
                .map(|k| k.layers as u64 * k.slot_bytes)
                .sum();
            assert_eq!(slot, plan.slot_bytes);
            // The layout's own per-kind figures count the same rows.
            let window: f64 = layout
                .bytes_per_token()
                .iter()
                .filter(|(k, _)| *k == RegionKind::WindowKv)
                .map(|(_, b)| b)
                .sum();
            assert!(window > 0.0 && window <= paged);
        }
    }
    assert!(state(&c, 48, KvStorage::F32).is_err());
}

#[test]
fn request_bytes_count_whole_pages_and_the_slot() {
    let plan = state(&small(), 16, KvStorage::F32).unwrap();
    let (page, slot) = (plan.page_bytes, plan.slot_bytes);
    assert_eq!(plan.request_bytes(0), page + slot);
    assert_eq!(plan.request_bytes(1), page + slot);
    assert_eq!(plan.request_bytes(16), page + slot);
    assert_eq!(plan.request_bytes(17), 2 * page + slot);
}

#[test]
fn fit_after_weights() {
    let c = small();
    let w = weights(&c);
    let s = state(&c, 16, KvStorage::F32).unwrap();
    let memory = w.served + 10 * s.page_bytes + 5;
    let f = fit(&w, &s, memory, 1, 1.0, 16);
    assert!(f.weights_fit);
    assert_eq!(f.free_bytes, 10 * s.page_bytes + 5);
    assert_eq!(f.pages, 10);
    assert_eq!(f.tokens, 160);
    assert_eq!(
        f.requests,
        (10 * s.page_bytes + 5) / (s.page_bytes + s.slot_bytes)
    );
    // Two GPUs at half utilization hold the same.
    assert_eq!(fit(&w, &s, memory, 2, 0.5, 16).pages, 10);
    let none = fit(&w, &s, w.served / 2, 1, 1.0, 16);
    assert!(!none.weights_fit);
    assert_eq!(
        (none.free_bytes, none.pages, none.tokens, none.requests),
        (0, 0, 0, 0)
    );
}
