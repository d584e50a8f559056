//! NVFP4 tensor-core GEMM (bf16 activations, exactly dequantized weights, f32 accumulation)
//! against the f64 CPU reference over the same bf16 activations, at shapes that are not tile
//! multiples (m and n not multiples of 64, k not a multiple of 32, single rows and columns,
//! empty), output poisoned with NaN. Bound per element: |gpu - ref| <= 1e-4 * Σ_k |a·w| (f32
//! accumulation inside the tensor cores, whose rounding of partial sums may truncate).
//! On sm_90 both tile instructions run (`nvfp4_gemm_bf16_wgmma`, `nvfp4_gemm_bf16`). Skips
//! without a GPU; fails instead under `PDSERVE_REQUIRE_GPU=1` (gpu-check.sh).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{formats, quant, synth::Rng};
use kernels::{cpu, cuda::Gpu};

#[test]
fn gpu_gemm_matches_reference() {
    let Some(mut gpu) = Gpu::for_test("gpu_gemm_matches_reference") else {
        return;
    };
    for mma in super::bf16_mmas(&mut gpu) {
        gpu.set_bf16_mma(mma).unwrap();
        eprintln!("{mma:?}");
        gemm_matches_reference(&gpu);
    }
}

fn gemm_matches_reference(gpu: &Gpu) {
    let mut rng = Rng::for_tensor(5, "gemm");
    for (m, n, k) in [
        (1usize, 1usize, 16usize),
        (3, 5, 48),
        (64, 64, 64),
        (65, 130, 1040),
        (200, 77, 4096),
        (17, 300, 7168),
        (0, 8, 32),
        (9, 0, 32),
    ] {
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() * 3.0).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let (packed, scales, scale_2) = quant::quant_nvfp4(&w, n, k).unwrap();
        let want = cpu::nvfp4_gemm(&a, &packed, &scales, scale_2, m, n, k).unwrap();
        let got = gpu
            .nvfp4_gemm(&a, &packed, &scales, scale_2, m, n, k)
            .unwrap();
        assert_eq!(got.len(), m * n);
        let deq = quant::dequant_nvfp4(&packed, &scales, scale_2, n, k).unwrap();
        let a16: Vec<f32> = a
            .iter()
            .map(|&v| formats::bf16_to_f32(formats::f32_to_bf16(v)))
            .collect();
        for i in 0..m {
            for j in 0..n {
                let mag: f32 = a16[i * k..(i + 1) * k]
                    .iter()
                    .zip(&deq[j * k..(j + 1) * k])
                    .map(|(x, y)| (x * y).abs())
                    .sum();
                let (g, r) = (got[i * n + j], want[i * n + j]);
                assert!(
                    (g - r).abs() <= 1e-4 * mag + 1e-30,
                    "{m}x{n}x{k} at ({i}, {j}): gpu {g} ref {r}"
                );
            }
        }
    }
}

/// W4A4 on sm_120 FP4 tensor cores: activations quantized by the GPU quantizer (the serving
/// path), weights by the ModelOpt recipe; compared with the f64 product of the dequantized
/// operands. Products are exact, so the bound is the f32 accumulation: 1e-4 · Σ|a·w|. Runs only
/// on sm_120 devices; elsewhere the wrapper must refuse (checked).
#[test]
fn gpu_w4a4_gemm_matches_reference_on_sm120() {
    let Some(gpu) = Gpu::for_test("gpu_w4a4_gemm_matches_reference_on_sm120") else {
        return;
    };
    let (major, minor) = gpu.ctx.compute_capability().unwrap();
    let mut rng = Rng::for_tensor(6, "w4a4");
    if kernels::arch::fp4_mma(major, minor) != Ok(kernels::arch::Fp4Mma::Sm120MmaSync) {
        let refused = gpu.nvfp4_gemm_w4a4(
            (&[0; 32], &[0; 4], 1.0),
            (&[0; 32], &[0; 4], 1.0),
            (1, 1, 64),
        );
        assert!(
            matches!(refused, Err(kernels::cuda::KernelError::Unsupported(_))),
            "sm_{major}{minor} must refuse the sm_120 kernel"
        );
        eprintln!("skipping the W4A4 comparison: sm_{major}{minor} is not sm_120");
        return;
    }
    for (m, n, k) in [
        (1usize, 1usize, 64usize),
        (16, 8, 64),
        (17, 9, 128),
        (64, 64, 256),
        (100, 130, 1024),
        (3, 257, 7168),
        (0, 8, 64),
    ] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.normal() * 2.0).collect();
        let a_scale_2 = x.iter().fold(0.0f32, |acc, v| acc.max(v.abs())) / (6.0 * 448.0);
        let a_scale_2 = if a_scale_2 > 0.0 { a_scale_2 } else { 1.0 };
        let (a_codes, a_scales) = gpu.nvfp4_quantize_rows(&x, m, k, a_scale_2, 0xAB).unwrap();
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let (w_codes, w_scales, w_scale_2) = quant::quant_nvfp4(&w, n, k).unwrap();
        let a = (&a_codes[..], &a_scales[..], a_scale_2);
        let wq = (&w_codes[..], &w_scales[..], w_scale_2);
        let want = cpu::nvfp4_gemm_w4a4(a, wq, m, n, k).unwrap();
        let got = gpu.nvfp4_gemm_w4a4(a, wq, (m, n, k)).unwrap();
        assert_eq!(got.len(), m * n);
        let da = quant::dequant_nvfp4(&a_codes, &a_scales, a_scale_2, m, k).unwrap();
        let dw = quant::dequant_nvfp4(&w_codes, &w_scales, w_scale_2, n, k).unwrap();
        for i in 0..m {
            for j in 0..n {
                let mag: f32 = da[i * k..(i + 1) * k]
                    .iter()
                    .zip(&dw[j * k..(j + 1) * k])
                    .map(|(x, y)| (x * y).abs())
                    .sum();
                let (g, r) = (got[i * n + j], want[i * n + j]);
                assert!(
                    (g - r).abs() <= 1e-4 * mag + 1e-30,
                    "{m}x{n}x{k} at ({i}, {j}): gpu {g} ref {r}"
                );
            }
        }
    }
}
