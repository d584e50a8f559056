//! `compress.cu` on the GPU gives the engine's bits (`engine::model::compressor::pool_window`):
//! CSA windows (ratio 4, overlap) with and without a previous window, HCA windows (ratio 128),
//! a large gate score. Skips without a GPU (fails under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    model::compressor::pool_window,
    synth::Rng,
    tensor::{Matrix, Weight},
    weights::CompressorWeights,
};
use kernels::cuda::{Gpu, Windows};

fn weights(ratio: usize, d: usize, overlap: bool) -> CompressorWeights {
    let width = if overlap { 2 * d } else { d };
    CompressorWeights {
        wkv: Weight::f32(width, 1, vec![0.0; width]).unwrap(),
        wgate: Weight::f32(width, 1, vec![0.0; width]).unwrap(),
        ape: Matrix::zeros(ratio, width),
        norm: vec![1.0; d],
        ratio,
        head_dim: d,
        overlap,
    }
}

#[test]
fn gpu_compressor_windows_give_the_engines_bits() {
    let Some(gpu) = Gpu::for_test("gpu_compressor_windows_give_the_engines_bits") else {
        return;
    };
    let mut rng = Rng::for_tensor(111, "gpu-compress");
    for (ratio, d, overlap, windows) in [
        (4usize, 512usize, true, 5usize),
        (128, 512, false, 3),
        (4, 24, true, 2),
    ] {
        let cw = weights(ratio, d, overlap);
        let width = if overlap { 2 * d } else { d };
        let kv: Vec<f32> = (0..windows * ratio * width).map(|_| rng.normal()).collect();
        let mut gate: Vec<f32> = (0..windows * ratio * width)
            .map(|_| rng.normal() * 3.0)
            .collect();
        gate[7] = 60.0;
        let prevs: Vec<(Vec<f32>, Vec<f32>)> = (0..windows)
            .map(|r| {
                if overlap && r > 0 {
                    let n = ratio * d;
                    (
                        (0..n).map(|_| rng.normal()).collect(),
                        (0..n).map(|_| rng.normal()).collect(),
                    )
                } else {
                    (Vec::new(), Vec::new())
                }
            })
            .collect();
        let prev: Vec<Option<(&[f32], &[f32])>> = prevs
            .iter()
            .map(|(k, g)| (!k.is_empty()).then_some((k.as_slice(), g.as_slice())))
            .collect();
        let got = gpu
            .compress_pool(&Windows {
                kv: &kv,
                gate: &gate,
                prev: &prev,
                ratio,
                d,
                width,
                overlap,
            })
            .unwrap();
        let per = ratio * width;
        for r in 0..windows {
            let want = pool_window(
                &cw,
                &prevs[r],
                &kv[r * per..(r + 1) * per],
                &gate[r * per..(r + 1) * per],
            );
            let got_r = &got[r * d..(r + 1) * d];
            if let Some(i) = (0..d).find(|&i| got_r[i].to_bits() != want[i].to_bits()) {
                panic!(
                    "ratio {ratio} d {d} window {r}: [{i}] {} vs the engine's {}",
                    got_r[i], want[i]
                );
            }
        }
    }
}
