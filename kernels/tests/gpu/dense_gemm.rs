//! The dense GEMM (bf16 and FP8-block weights on bf16 tensor cores, K split for this GPU)
//! against its f64 reference within `kernels::dense_gemm::bound`, at decode and prefill shapes
//! that are not tile multiples, rows from an offset that crosses scale tiles, NaN in and NaN
//! out; a weight too short for the rows asked is refused. On an sm_90 device both tile
//! instructions run (the warpgroup MMA the device uses, and `mma.sync`); elsewhere the warpgroup
//! MMA is refused. Skips without a GPU; fails instead under `PDSERVE_REQUIRE_GPU=1`
//! (gpu-check.sh).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{formats, synth::Rng};
use kernels::{
    cuda::Gpu,
    dense_gemm::{DenseRows, bound, mismatches, reference},
};

fn weight(rng: &mut Rng, fp8: bool, rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    if !fp8 {
        let bytes = (0..rows * k)
            .flat_map(|_| formats::f32_to_bf16(rng.normal()).to_le_bytes())
            .collect();
        return (bytes, Vec::new());
    }
    let codes = (0..rows * k)
        .map(|_| match (rng.next_u64() % 256) as u8 {
            0x7F | 0xFF => 0x38,
            code => code,
        })
        .collect();
    let scales = (0..rows.div_ceil(128) * k.div_ceil(128))
        .map(|_| 2f32.powi((rng.next_u64() % 9) as i32 - 12))
        .collect();
    (codes, scales)
}

#[test]
fn gpu_dense_gemm_matches_reference() {
    let Some(mut gpu) = Gpu::for_test("gpu_dense_gemm_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(22, "dense-gemm");
    let mut split = 0;
    let mmas = super::bf16_mmas(&mut gpu);
    for (mma, fp8) in mmas.iter().flat_map(|&mma| [(mma, false), (mma, true)]) {
        gpu.set_bf16_mma(mma).unwrap();
        for (m, n, k, row0) in [
            (1usize, 1usize, 16usize, 0usize),
            (3, 5, 48, 7),
            (1, 1024, 4096, 0),
            (32, 512, 4096, 100),
            (33, 2048, 1024, 128),
            (64, 130, 7168, 0),
            (200, 77, 1000, 3),
            (0, 8, 32, 0),
            (9, 0, 32, 0),
        ] {
            let (bytes, scales) = weight(&mut rng, fp8, row0 + n + 1, k);
            let w = if fp8 {
                DenseRows::Fp8Block {
                    codes: &bytes,
                    scales: &scales,
                }
            } else {
                DenseRows::Bf16(&bytes)
            };
            let mut a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
            if m > 1 {
                a[k + 1] = f32::NAN;
            }
            split += usize::from(gpu.dense_gemm_plan((m, n, k)).0 > 1);
            let got = gpu.dense_gemm(w, row0, &a, (m, n, k)).unwrap();
            let want = reference(&a, w, row0, (m, n, k)).unwrap();
            let limit = bound(&a, w, row0, (m, n, k)).unwrap();
            assert_eq!(
                mismatches(&got, &want, &limit),
                0,
                "{mma:?} fp8 {fp8} {m}x{n}x{k} at row {row0}"
            );
        }
        let short = DenseRows::Bf16(&[0; 64]);
        assert!(gpu.dense_gemm(short, 1, &[0.0; 32], (1, 1, 32)).is_err());
    }
    assert!(split > 0, "no shape split K on this GPU");
}
