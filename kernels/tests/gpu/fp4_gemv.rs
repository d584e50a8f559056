//! NVFP4 GEMV on the GPU against the f64 CPU reference at awkward shapes, output poisoned with
//! NaN. Bound: |gpu - ref| <= 1e-5 * (sum_c |W[r][c] * x[c]| + 1e-30) per row (f32 accumulation
//! of at most a few thousand products). Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{quant, synth::Rng};
use kernels::{cpu, cuda::Gpu};

#[test]
fn gpu_gemv_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_gemv_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(2, "gemv");
    for (rows, cols) in [
        (1usize, 16usize),
        (5, 48),
        (33, 1040),
        (257, 4096),
        (3, 7168),
        (0, 64),
    ] {
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
        let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
        let (packed, scales, scale_2) = quant::quant_nvfp4(&w, rows, cols).unwrap();
        let want = cpu::nvfp4_gemv(&packed, &scales, scale_2, &x, rows, cols).unwrap();
        let got = gpu
            .nvfp4_gemv(&packed, &scales, scale_2, &x, rows, cols)
            .unwrap();
        let deq = quant::dequant_nvfp4(&packed, &scales, scale_2, rows, cols).unwrap();
        for r in 0..rows {
            let mag: f32 = deq[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(a, b)| (a * b).abs())
                .sum();
            assert!(
                (got[r] - want[r]).abs() <= 1e-5 * mag + 1e-30,
                "{rows}x{cols} row {r}: gpu {} ref {}",
                got[r],
                want[r]
            );
        }
    }
}

/// `Σ |w·x|` per output: the scale of the f32 rounding a sum of these products can suffer.
fn magnitudes(w: &[f32], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| (a * b).abs())
                .sum()
        })
        .collect()
}

#[test]
fn gpu_mxfp4_gemv_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_mxfp4_gemv_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(3, "mxfp4 gemv");
    for (rows, cols) in [(1usize, 32usize), (7, 96), (33, 1056), (129, 4096), (0, 64)] {
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
        let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
        let (packed, scales) = quant::quant_mxfp4(&w, rows, cols).unwrap();
        let want = cpu::mxfp4_gemv(&packed, &scales, &x, rows, cols).unwrap();
        let got = gpu.mxfp4_gemv(&packed, &scales, &x, rows, cols).unwrap();
        let deq = quant::dequant_mxfp4(&packed, &scales, rows, cols).unwrap();
        let mag = magnitudes(&deq, &x, rows, cols);
        assert_eq!(got.len(), rows);
        for r in 0..rows {
            assert!(
                (got[r] - want[r]).abs() <= 1e-5 * mag[r] + 1e-30,
                "{rows}x{cols} row {r}: gpu {} ref {}",
                got[r],
                want[r]
            );
        }
    }
}

/// The routed experts of a decode step: repeated experts, a token with several experts, a
/// token with none, the last expert (the largest offsets), and no pairs at all.
#[test]
fn gpu_grouped_gemv_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_grouped_gemv_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(4, "grouped gemv");
    let (experts, rows, cols, tokens) = (6usize, 37usize, 1088usize, 4usize);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.normal()).collect();
    let mut nv_packed = Vec::new();
    let mut nv_scales = Vec::new();
    let mut nv_scale_2 = Vec::new();
    let mut mx_packed = Vec::new();
    let mut mx_scales = Vec::new();
    let mut deq_nv = Vec::new();
    let mut deq_mx = Vec::new();
    for e in 0..experts {
        let spread = 1.0 + e as f32;
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * spread).collect();
        let (p, s, s2) = quant::quant_nvfp4(&w, rows, cols).unwrap();
        deq_nv.extend(quant::dequant_nvfp4(&p, &s, s2, rows, cols).unwrap());
        nv_packed.extend(p);
        nv_scales.extend(s);
        nv_scale_2.push(s2);
        let (p, s) = quant::quant_mxfp4(&w, rows, cols).unwrap();
        deq_mx.extend(quant::dequant_mxfp4(&p, &s, rows, cols).unwrap());
        mx_packed.extend(p);
        mx_scales.extend(s);
    }
    let pair_token = [0usize, 0, 1, 3, 3, 3, 1];
    let pair_expert = [5usize, 2, 2, 0, 5, 1, 5];
    let cases = [
        (
            cpu::Experts::Nvfp4 {
                packed: &nv_packed,
                scales: &nv_scales,
                scale_2: &nv_scale_2,
            },
            &deq_nv,
        ),
        (
            cpu::Experts::Mxfp4 {
                packed: &mx_packed,
                scales: &mx_scales,
            },
            &deq_mx,
        ),
    ];
    for (weights, deq) in cases {
        let want = cpu::grouped_gemv(weights, &x, &pair_token, &pair_expert, rows, cols).unwrap();
        let got = gpu
            .grouped_gemv(weights, &x, &pair_token, &pair_expert, rows, cols)
            .unwrap();
        assert_eq!(got.len(), pair_token.len() * rows);
        for (p, (&t, &e)) in pair_token.iter().zip(&pair_expert).enumerate() {
            let w = &deq[e * rows * cols..(e + 1) * rows * cols];
            let mag = magnitudes(w, &x[t * cols..(t + 1) * cols], rows, cols);
            for r in 0..rows {
                let (g, want) = (got[p * rows + r], want[p * rows + r]);
                assert!(
                    (g - want).abs() <= 1e-5 * mag[r] + 1e-30,
                    "pair {p} (token {t}, expert {e}) row {r}: gpu {g} ref {want}"
                );
            }
        }
        let none = gpu.grouped_gemv(weights, &x, &[], &[], rows, cols).unwrap();
        assert!(none.is_empty());
        // An expert index beyond the stack is refused before anything runs.
        assert!(
            gpu.grouped_gemv(weights, &x, &[0], &[experts], rows, cols)
                .is_err()
        );
    }
}
