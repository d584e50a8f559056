//! The hyper-connections' mixing on the GPU (`hyper.cu`) gives the engine's bits
//! (`engine::model::hyper`) from the same mixing-projection outputs: 4 streams (the Sinkhorn
//! fast path on the CPU) and 3 (the generic loop), one and twenty Sinkhorn rounds, saturated
//! gates, NaN where a mix is NaN; and `exact::exp` equals `engine::tensor::exp` on every special
//! threshold and on a 1-in-257 sample of all 2^32 inputs. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    config::{ExpertFormat, ModelConfig},
    model::hyper,
    synth::{Preset, Rng},
    tensor::{Matrix, dot, rms_norm_unweighted},
    weights::{HeadWeights, HyperWeights},
};
use kernels::cuda::{Gpu, Streams};

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: [{i}] {g:e} ({:#010x}) vs the engine's {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn config(hc: usize, iters: usize) -> ModelConfig {
    let mut c = Preset::Tiny.config(ExpertFormat::Nvfp4);
    c.hc_mult = hc;
    c.hc_sinkhorn_iters = iters;
    c
}

#[test]
fn gpu_hyper_connections_give_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_hyper_connections_give_the_engines_bits") else {
        return;
    };
    let mut rng = Rng::for_tensor(71, "gpu-hyper");
    for (hc, dim, iters) in [
        (4usize, 4096usize, 20usize),
        (4, 7, 1),
        (3, 130, 20),
        (2, 64, 3),
    ] {
        let c = config(hc, iters);
        let width = (2 + hc) * hc;
        let tokens = 6;
        let w = HyperWeights {
            mix: Matrix::new(
                width,
                hc * dim,
                (0..width * hc * dim).map(|_| rng.normal()).collect(),
            ),
            base: (0..width).map(|_| rng.normal()).collect(),
            scale: [
                rng.uniform() + 0.5,
                rng.uniform() + 0.5,
                rng.uniform() + 0.5,
            ],
        };
        let x: Vec<f32> = (0..tokens * hc * dim).map(|_| rng.normal()).collect();
        let mut mixes = Vec::new();
        for t in 0..tokens {
            let mut flat = x[t * hc * dim..(t + 1) * hc * dim].to_vec();
            rms_norm_unweighted(&mut flat, c.rms_norm_eps);
            let mut m = w.mix.apply_many(&[flat]).pop().unwrap();
            match t {
                3 => m.iter_mut().for_each(|v| *v *= 1e4), // saturated gates, peaked softmax
                4 => m[2 * hc + 1] = f32::NAN,
                _ => {}
            }
            mixes.extend(m);
        }
        let s = Streams {
            hc,
            dim,
            eps: c.hc_eps,
            sinkhorn_iters: iters,
        };
        let got = gpu.hyper_pre(&x, &mixes, &w, s).unwrap();
        let y: Vec<f32> = (0..tokens * dim).map(|_| rng.normal()).collect();
        let post_got = gpu.hyper_post(&x, &y, &got.post, &got.comb, s).unwrap();
        for t in 0..tokens {
            let xt = &x[t * hc * dim..(t + 1) * hc * dim];
            let (mix, collapsed) =
                hyper::pre_from_mixes(xt, &mixes[t * width..(t + 1) * width], &w, &c);
            let what = format!("hc {hc} dim {dim} iters {iters} token {t}");
            same_bits(&got.collapsed[t * dim..(t + 1) * dim], &collapsed, &what);
            same_bits(&got.post[t * hc..(t + 1) * hc], &mix.post, &what);
            same_bits(&got.comb[t * hc * hc..(t + 1) * hc * hc], &mix.comb, &what);
            let yt = &y[t * dim..(t + 1) * dim];
            let device_mix = hyper::Mix {
                post: got.post[t * hc..(t + 1) * hc].to_vec(),
                comb: got.comb[t * hc * hc..(t + 1) * hc * hc].to_vec(),
            };
            same_bits(
                &post_got[t * hc * dim..(t + 1) * hc * dim],
                &hyper::post(xt, yt, &device_mix, hc),
                &format!("{what} post"),
            );
        }
        let head = HeadWeights {
            mix: Matrix::new(
                hc,
                hc * dim,
                (0..hc * hc * dim).map(|_| rng.normal()).collect(),
            ),
            base: (0..hc).map(|_| rng.normal()).collect(),
            scale: rng.uniform() + 0.5,
        };
        let mut head_mix = Vec::new();
        for t in 0..tokens {
            let mut flat = x[t * hc * dim..(t + 1) * hc * dim].to_vec();
            rms_norm_unweighted(&mut flat, c.rms_norm_eps);
            head_mix.extend((0..hc).map(|i| dot(head.mix.row(i), &flat)));
        }
        let got = gpu.hyper_head(&x, &head_mix, &head, s).unwrap();
        for t in 0..tokens {
            let want = hyper::head(&x[t * hc * dim..(t + 1) * hc * dim], &head, &c);
            same_bits(
                &got[t * dim..(t + 1) * dim],
                &want,
                &format!("head hc {hc} token {t}"),
            );
        }
    }
}

#[test]
fn gpu_exact_exp_is_the_engines_exp() {
    let Some(gpu) = Gpu::for_test("gpu_exact_exp_is_the_engines_exp") else {
        return;
    };
    let mut x: Vec<f32> = [
        0x42b1_7217u32,
        0x42b1_7218,
        0xc2cf_f1b4,
        0xc2cf_f1b5,
        0xc2ce_8ecf,
        0xc2ce_8ed0,
        0x42b0_0000,
        0xc2b0_0000,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0xffc0_0001,
        0,
        0x8000_0000,
        1,
        0x8000_0001,
    ]
    .iter()
    .map(|&b| f32::from_bits(b))
    .collect();
    x.extend((0..(1u64 << 32) / 257).map(|i| f32::from_bits((i * 257) as u32)));
    let got = gpu.exact_exp(&x).unwrap();
    let want: Vec<f32> = x.iter().map(|&v| engine::tensor::exp(v)).collect();
    same_bits(&got, &want, "exp");
}
