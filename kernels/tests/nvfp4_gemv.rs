//! NVFP4 GEMV on the GPU against the f64 CPU reference at awkward shapes, output poisoned with
//! NaN. Bound: |gpu - ref| <= 1e-5 * (sum_c |W[r][c] * x[c]| + 1e-30) per row (f32 accumulation
//! of at most a few thousand products). Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{quant, synth::Rng};
use kernels::{cpu, cuda::Gpu};

#[test]
fn gpu_gemv_matches_reference() {
    let Some(gpu) = Gpu::open().unwrap() else {
        eprintln!("skipping gpu_gemv_matches_reference: no CUDA driver or device");
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
