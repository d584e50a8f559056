//! A whole MoE block of the engine on the GPU with the engine's bits: the gate's logits
//! (`exact_gemv`), every routed pair's gate, up and down projections (`exact_pairs`), the
//! clamped SwiGLU, the shared expert and the weighted sum (`moe_combine`) equal
//! `engine::model::moe::forward` for tokens of a synthetic checkpoint in both expert formats,
//! on a hash-routed and a top-k layer. Routing itself stays on the host here (its sqrt-softplus
//! uses the platform's `ln_1p`). Skips without a GPU (fails under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::{Model, moe},
    synth::{GenerateOptions, Preset, Rng, generate},
    tensor::{Weight, WeightForm},
    weights::ExpertWeights,
};
use kernels::cuda::{Gpu, StoredExperts, StoredRows};

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: [{i}] {} vs the engine's {}", got[i], want[i]);
    }
}

/// `w` times each token's vector on the device.
fn linear(gpu: &Gpu, w: &Weight, x: &[f32], vectors: usize) -> Vec<f32> {
    gpu.exact_gemv(StoredRows::of(w), (w.rows, w.cols), (0, w.rows), x, vectors)
        .unwrap()
}

/// The bytes of one projection of every expert, stacked.
fn stack(
    experts: &[ExpertWeights],
    pick: fn(&ExpertWeights) -> &Weight,
) -> (Vec<u8>, Vec<u8>, Vec<f32>, bool) {
    let (mut packed, mut scales, mut scale_2, mut nv) = (Vec::new(), Vec::new(), Vec::new(), false);
    for e in experts {
        match pick(e).form() {
            WeightForm::Nvfp4 {
                packed: p,
                scales: s,
                scale_2: s2,
            } => {
                packed.extend_from_slice(p.as_slice());
                scales.extend_from_slice(s.as_slice());
                scale_2.push(*s2);
                nv = true;
            }
            WeightForm::Mxfp4 {
                packed: p,
                scales: s,
            } => {
                packed.extend_from_slice(p.as_slice());
                scales.extend_from_slice(s.as_slice());
            }
            other => panic!("routed experts stored as {other:?}"),
        }
    }
    (packed, scales, scale_2, nv)
}

fn pairs_of(
    gpu: &Gpu,
    experts: &[ExpertWeights],
    pick: fn(&ExpertWeights) -> &Weight,
    (pair_token, pair_expert): (&[i32], &[i32]),
    x: &[f32],
    tokens: usize,
) -> Vec<f32> {
    let w = pick(&experts[0]);
    let (packed, scales, scale_2, nv) = stack(experts, pick);
    let stored = if nv {
        StoredExperts::Nvfp4 {
            packed: &packed,
            scales: &scales,
            scale_2: &scale_2,
        }
    } else {
        StoredExperts::Mxfp4 {
            packed: &packed,
            scales: &scales,
        }
    };
    gpu.exact_pairs(
        stored,
        (experts.len(), w.rows, w.cols),
        pair_token,
        pair_expert,
        x,
        tokens,
    )
    .unwrap()
}

#[test]
fn gpu_moe_block_gives_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_moe_block_gives_the_engines_bits") else {
        return;
    };
    for format in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        let dir = std::env::temp_dir().join(format!(
            "pdserve-moe-exact-{}-{format:?}",
            std::process::id()
        ));
        generate(&GenerateOptions {
            preset: Preset::Tiny,
            seed: 3,
            experts: format,
            out: dir.clone(),
            tokenizer_dir: None,
        })
        .unwrap();
        let model = Model::load(&dir).unwrap();
        let c = &model.config;
        let mut rng = Rng::for_tensor(121, "gpu-moe-exact");
        // The first layer routes by hash when the config has hash layers; the last by top-k.
        for layer in [0, c.layers.len() - 1] {
            let w = &model.weights.layers[layer].moe;
            let tokens: Vec<u32> = vec![1, 7, 42, 3, 99];
            let t = tokens.len();
            let hidden = c.hidden_size;
            let x: Vec<f32> = (0..t * hidden).map(|_| rng.normal()).collect();
            let what = format!("{format:?} layer {layer}");
            // The gate on the device, the routing on the host.
            let logits = linear(&gpu, &w.gate, &x, t);
            let (mut pair_token, mut pair_expert, mut weights) =
                (Vec::new(), Vec::new(), Vec::new());
            for (i, &token) in tokens.iter().enumerate() {
                let xi = &x[i * hidden..(i + 1) * hidden];
                same_bits(
                    &logits[i * w.gate.rows..(i + 1) * w.gate.rows],
                    &w.gate.apply(xi),
                    &what,
                );
                let (chosen, ws) = moe::route(w, xi, token, c);
                for e in chosen {
                    pair_token.push(i as i32);
                    pair_expert.push(e as i32);
                }
                weights.extend(ws);
            }
            let k = c.experts_per_token;
            let pairs = (pair_token.as_slice(), pair_expert.as_slice());
            let gate = pairs_of(&gpu, &w.experts, |e| &e.w1, pairs, &x, t);
            let up = pairs_of(&gpu, &w.experts, |e| &e.w3, pairs, &x, t);
            let act = gpu.swiglu_clamp(&gate, &up, c.swiglu_limit).unwrap();
            let own: Vec<i32> = (0..pair_token.len() as i32).collect();
            let ys = pairs_of(
                &gpu,
                &w.experts,
                |e| &e.w2,
                (&own, &pair_expert),
                &act,
                own.len(),
            );
            let sg = linear(&gpu, &w.shared.w1, &x, t);
            let su = linear(&gpu, &w.shared.w3, &x, t);
            let sa = gpu.swiglu_clamp(&sg, &su, c.swiglu_limit).unwrap();
            let shared = linear(&gpu, &w.shared.w2, &sa, t);
            let out = gpu.moe_combine(&ys, &weights, &shared, k).unwrap();
            for (i, &token) in tokens.iter().enumerate() {
                let want = moe::forward(w, &x[i * hidden..(i + 1) * hidden], token, c);
                same_bits(
                    &out[i * hidden..(i + 1) * hidden],
                    &want,
                    &format!("{what} token {i}"),
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
