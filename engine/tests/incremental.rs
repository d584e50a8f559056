//! Prefill then decode one token at a time, or any chunking, gives the same logits and the same
//! state as running the whole sequence at once. Prompt lengths are not multiples of 4 or 128
//! and exceed the sliding window; the CSA indexer keeps fewer rows than are visible.
#![allow(clippy::unwrap_used, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::{Logits, Model, SequenceState},
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn tiny(experts: ExpertFormat, seed: u64) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, seed, experts, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

fn prompt(len: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::for_tensor(seed, "prompt");
    (0..len)
        .map(|_| (rng.next_u64() % 129_280) as u32)
        .collect()
}

fn run_chunked(model: &Model, tokens: &[u32], chunks: &[usize]) -> (Vec<Vec<f32>>, SequenceState) {
    let mut state = model.new_state();
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while at < tokens.len() {
        let n = chunks[i % chunks.len()].min(tokens.len() - at);
        out.extend(
            model
                .forward(&mut state, &tokens[at..at + n], Logits::All)
                .unwrap(),
        );
        at += n;
        i += 1;
    }
    (out, state)
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = x
            .iter()
            .zip(y)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn chunking_never_changes_logits_or_state() {
    let (_dir, model) = tiny(ExpertFormat::Mxfp4, 3);
    let tokens = prompt(301, 11);
    let (full, full_state) = run_chunked(&model, &tokens, &[tokens.len()]);
    assert_eq!(full.len(), tokens.len());
    for chunks in [&[1usize][..], &[7], &[64], &[130, 1, 3, 29], &[255, 1]] {
        let (logits, state) = run_chunked(&model, &tokens, chunks);
        assert!(max_rel_diff(&logits, &full) <= 1e-5, "chunks {chunks:?}");
        // Stronger than the tolerance: the computation per token is identical.
        assert!(logits == full, "chunks {chunks:?}: not bit-identical");
        assert!(
            state.normalized(&model.config) == full_state.normalized(&model.config),
            "chunks {chunks:?}: state differs"
        );
    }
}

#[test]
fn prefill_then_decode_matches_full_recompute() {
    for (experts, len) in [(ExpertFormat::Nvfp4, 150), (ExpertFormat::Bf16, 133)] {
        let (_dir, model) = tiny(experts, 5);
        let tokens = prompt(len, 2);
        let prefill = 37;
        let mut state = model.new_state();
        model
            .forward(&mut state, &tokens[..prefill], Logits::None)
            .unwrap();
        let mut decoded = Vec::new();
        for &t in &tokens[prefill..] {
            decoded.extend(model.forward(&mut state, &[t], Logits::Last).unwrap());
        }
        let (full, _) = run_chunked(&model, &tokens, &[tokens.len()]);
        assert!(max_rel_diff(&decoded, &full[prefill..]) <= 1e-5);
        assert!(decoded == full[prefill..]);
    }
}

#[test]
fn compressed_state_is_what_the_layout_promises() {
    let (_dir, model) = tiny(ExpertFormat::Mxfp4, 3);
    let c = &model.config;
    let tokens = prompt(261, 4);
    let (_, state) = run_chunked(&model, &tokens, &[100]);
    let state = state.normalized(c);
    for (layer, s) in c.layers.iter().zip(&state.layers) {
        assert_eq!(s.window.len(), (c.sliding_window - 1) * c.head_dim);
        let ratio = layer.attention.ratio();
        if let Some(comp) = &s.compressor {
            assert_eq!(comp.len(c.head_dim), 261 / ratio);
            let width = if ratio == 4 {
                2 * c.head_dim
            } else {
                c.head_dim
            };
            assert_eq!(comp.pending_kv.len(), (261 % ratio) * width);
        }
        if let Some(idx) = &s.indexer {
            assert_eq!(idx.len(c.index_head_dim), 261 / ratio);
            assert_eq!(idx.prev_kv.len(), ratio * c.index_head_dim);
        }
    }
}

#[test]
fn out_of_vocabulary_token_is_an_error() {
    let (_dir, model) = tiny(ExpertFormat::Bf16, 1);
    let mut state = model.new_state();
    let err = model
        .forward(&mut state, &[1, 129_280], Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains("129280"), "{err}");
    assert_eq!(state.len, 0, "a refused chunk leaves the state untouched");
}
