//! A whole MoE block of the engine on the GPU with the engine's bits: the gate's logits
//! (`exact_gemv`), every routed pair's gate, up and down projections (`exact_pairs`), the
//! clamped SwiGLU, the shared expert and the weighted sum (`moe_combine`) equal
//! `engine::model::moe::forward` for tokens of a synthetic checkpoint in both expert formats,
//! on a hash-routed and a top-k layer, the routing included (`moe_route`: sqrt-softplus with
//! the engine's own `exp` and `ln_1p`, top-k in `total_cmp` order). Skips without a GPU (fails
//! under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::{Model, moe},
    synth::{GenerateOptions, Preset, Rng, generate},
    tensor::{Weight, WeightForm},
    weights::ExpertWeights,
};
use kernels::cuda::{Gpu, Routing, StoredExperts, StoredRows};

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

fn routing<'a>(w: &'a engine::weights::MoeWeights, c: &engine::config::ModelConfig) -> Routing<'a> {
    Routing {
        experts: w.experts.len(),
        k: c.experts_per_token,
        bias: w.bias.as_deref(),
        tid2eid: w.tid2eid.as_deref(),
        scaling: c.routed_scaling_factor,
    }
}

/// Routing of awkward logits (ties, past softplus's threshold of 20, far below it, -0, NaN)
/// with and without the bias and by hash: the engine's experts and weights, bit for bit.
#[test]
fn gpu_routing_gives_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_routing_gives_the_engines_bits") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("pdserve-route-{}", std::process::id()));
    let options = GenerateOptions::new(Preset::Tiny, 5, ExpertFormat::Nvfp4, dir.clone());
    generate(&options).unwrap();
    let model = Model::load(&dir).unwrap();
    let c = &model.config;
    let mut rng = Rng::for_tensor(77, "gpu-route");
    let experts = c.n_routed_experts;
    let tokens: Vec<u32> = (0..40).map(|i| i * 37 % 1000).collect();
    let mut logits: Vec<f32> = (0..tokens.len() * experts)
        .map(|_| rng.normal() * 6.0)
        .collect();
    let specials = [20.0f32, 20.5, 25.0, -100.0, -0.0, 0.0, 1e-30];
    for i in 0..logits.len() {
        match i % 11 {
            0 => logits[i] = specials[(i / 11) % specials.len()],
            // A tie with the previous expert.
            1 | 5 => logits[i] = logits[i - 1],
            _ => {}
        }
    }
    logits[3 * experts + 1] = f32::NAN;
    for layer in [0, c.layers.len() - 1] {
        let w = &model.weights.layers[layer].moe;
        let (chosen, weights) = gpu.moe_route(&logits, &tokens, &routing(w, c)).unwrap();
        let k = c.experts_per_token;
        for (i, &token) in tokens.iter().enumerate() {
            let (want, ws) =
                moe::route_logits(w, &logits[i * experts..(i + 1) * experts], token, c);
            let want: Vec<i32> = want.iter().map(|&e| e as i32).collect();
            assert_eq!(
                &chosen[i * k..(i + 1) * k],
                &want[..],
                "layer {layer} token {i}"
            );
            for (j, (a, b)) in weights[i * k..(i + 1) * k].iter().zip(&ws).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "layer {layer} token {i} slot {j}: {a} vs the engine's {b}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
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
        let options = GenerateOptions::new(Preset::Tiny, 3, format, dir.clone());
        generate(&options).unwrap();
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
            // The gate and the routing on the device.
            let logits = linear(&gpu, &w.gate, &x, t);
            let k = c.experts_per_token;
            let (pair_expert, weights) = gpu.moe_route(&logits, &tokens, &routing(w, c)).unwrap();
            let mut pair_token = Vec::new();
            for (i, &token) in tokens.iter().enumerate() {
                let xi = &x[i * hidden..(i + 1) * hidden];
                same_bits(
                    &logits[i * w.gate.rows..(i + 1) * w.gate.rows],
                    &w.gate.apply(xi),
                    &what,
                );
                let (chosen, ws) = moe::route(w, xi, token, c);
                let mine: Vec<i32> = chosen.iter().map(|&e| e as i32).collect();
                assert_eq!(
                    &pair_expert[i * k..(i + 1) * k],
                    &mine[..],
                    "{what} token {i}"
                );
                same_bits(
                    &weights[i * k..(i + 1) * k],
                    &ws,
                    &format!("{what} weights {i}"),
                );
                pair_token.extend(std::iter::repeat_n(i as i32, k));
            }
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
