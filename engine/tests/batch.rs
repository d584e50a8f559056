//! Batch invariance: a sequence's logits are bit-identical whatever else shares its forward
//! steps — random arrival times, random chunk sizes, prefill chunks mixed with decode tokens.
#![allow(clippy::unwrap_used, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::{Logits, Model, Step},
    synth::{GenerateOptions, Preset, Rng, generate},
};

#[test]
fn logits_do_not_depend_on_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 21, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let mut rng = Rng::for_tensor(5, "batch");
    let lengths = [1usize, 9, 40, 133, 150, 70];
    let sequences: Vec<Vec<u32>> = lengths
        .iter()
        .map(|&n| (0..n).map(|_| (rng.next_u64() % 129_280) as u32).collect())
        .collect();

    // Each sequence alone, in one chunk.
    let solo: Vec<Vec<Vec<f32>>> = sequences
        .iter()
        .map(|tokens| {
            let mut state = model.new_state();
            model.forward(&mut state, tokens, Logits::All).unwrap()
        })
        .collect();

    for round in 0..3 {
        let arrival: Vec<usize> = sequences
            .iter()
            .map(|_| (rng.next_u64() % 6) as usize)
            .collect();
        let mut states: Vec<_> = sequences.iter().map(|_| model.new_state()).collect();
        let mut done = vec![0usize; sequences.len()];
        let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); sequences.len()];
        for step_no in 0..500 {
            let mut chunks = Vec::new();
            for (s, tokens) in sequences.iter().enumerate() {
                if step_no >= arrival[s] && done[s] < tokens.len() {
                    let n = 1 + (rng.next_u64() % 17) as usize;
                    let n = n.min(tokens.len() - done[s]);
                    chunks.push((s, done[s]..done[s] + n));
                    done[s] += n;
                }
            }
            if chunks.is_empty() && done.iter().zip(&sequences).all(|(d, t)| *d == t.len()) {
                break;
            }
            let mut batch: Vec<Step<'_>> = Vec::new();
            let mut order = Vec::new();
            for (state, (s, tokens)) in states.iter_mut().zip(sequences.iter().enumerate()) {
                if let Some((_, range)) = chunks.iter().find(|(i, _)| *i == s) {
                    batch.push(Step {
                        state,
                        tokens: &tokens[range.clone()],
                        logits: Logits::All,
                    });
                    order.push(s);
                }
            }
            let out = model.forward_batch(&mut batch).unwrap();
            for (s, logits) in order.into_iter().zip(out) {
                got[s].extend(logits);
            }
        }
        for (s, logits) in got.iter().enumerate() {
            assert_eq!(logits.len(), sequences[s].len(), "round {round} seq {s}");
            assert!(
                *logits == solo[s],
                "round {round}: sequence {s} differs in a batch"
            );
        }
    }
}

#[test]
fn expert_major_moe_equals_token_major() {
    use engine::model::moe;
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 2, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let c = &model.config;
    let mut rng = Rng::for_tensor(9, "moe");
    let xs: Vec<Vec<f32>> = (0..37)
        .map(|_| (0..c.hidden_size).map(|_| rng.normal()).collect())
        .collect();
    let tokens: Vec<u32> = (0..37).map(|_| (rng.next_u64() % 129_280) as u32).collect();
    for layer in &model.weights.layers {
        let many =
            moe::forward_many(&layer.moe, &xs, &tokens, c, moe::Routed::default(), None).unwrap();
        for ((x, &t), got) in xs.iter().zip(&tokens).zip(&many) {
            assert!(moe::forward(&layer.moe, x, t, c) == *got);
        }
    }
}

/// A NaN in a CSA layer's indexer keys (a poisoned state page) is not read as a score of 0:
/// the tokens that attend through that layer's indexer get NaN, which the engine reports,
/// rather than logits computed from rows picked by a NaN.
#[test]
fn a_nan_indexer_key_makes_nan_not_a_plausible_answer() {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 4, ExpertFormat::Bf16, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919) % 129_280).collect();
    let mut state = model.new_state();
    model
        .forward(&mut state, &prompt, engine::model::Logits::Last)
        .unwrap();
    let csa = model
        .config
        .layers
        .iter()
        .position(|l| matches!(l.attention, engine::config::Attention::Csa { .. }))
        .unwrap();
    let mut clean = state.clone();
    let finite = model
        .forward(&mut clean, &[5], engine::model::Logits::Last)
        .unwrap();
    assert!(finite[0].iter().all(|v| v.is_finite()));
    let rows = &mut state.layers[csa].indexer.as_mut().unwrap().rows;
    assert!(
        rows.len() > 4 * model.config.index_head_dim,
        "more rows than the top-k"
    );
    rows[model.config.index_head_dim + 3] = f32::NAN;
    match model.forward(&mut state, &[5], engine::model::Logits::Last) {
        Ok(logits) => assert!(logits[0].iter().all(|v| v.is_nan()), "a plausible answer"),
        Err(e) => assert!(e.to_string().contains("finite"), "{e}"),
    }
}
