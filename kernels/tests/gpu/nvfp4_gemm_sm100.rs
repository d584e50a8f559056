//! W4A4 NVFP4 GEMM on sm_100 5th-generation tensor cores (`tcgen05.mma` block-scaled, Tensor
//! Memory) against the f64 CPU reference over the dequantized operands, at shapes that are not
//! tile multiples (the tile is 128 x 128, K steps of 64 in stages of 256): single rows and
//! columns, one short of and one past a tile, a partial last K stage, empty operands; output
//! poisoned with NaN. Activations quantized by the GPU quantizer (the serving path), weights by
//! the ModelOpt recipe. Products are exact, so the bound is the f32 accumulation:
//! |gpu - ref| <= 1e-4 · Σ_k |a·w|, as for the sm_120 kernel. Runs only on compute capability
//! 10.0; elsewhere the wrapper must refuse (checked). Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{quant, synth::Rng};
use kernels::{cpu, cuda::Gpu};

#[test]
fn gpu_w4a4_gemm_matches_reference_on_sm100() {
    let Some(gpu) = Gpu::for_test("gpu_w4a4_gemm_matches_reference_on_sm100") else {
        return;
    };
    let (major, minor) = gpu.ctx.compute_capability().unwrap();
    if kernels::arch::fp4_mma(major, minor) != Ok(kernels::arch::Fp4Mma::Sm100Tcgen05) {
        let refused = gpu.nvfp4_gemm_w4a4_sm100(
            (&[0; 32], &[0; 4], 1.0),
            (&[0; 32], &[0; 4], 1.0),
            (1, 1, 64),
        );
        assert!(
            matches!(refused, Err(kernels::cuda::KernelError::Unsupported(_))),
            "sm_{major}{minor} must refuse the sm_100 kernel"
        );
        eprintln!("skipping the sm_100 W4A4 comparison: sm_{major}{minor} is not sm_100");
        return;
    }
    let mut rng = Rng::for_tensor(7, "w4a4-sm100");
    for (m, n, k) in [
        (1usize, 1usize, 64usize),
        (127, 129, 128),
        (128, 64, 64),
        (128, 128, 256),
        (300, 77, 512),
        (129, 257, 320),
        (5, 300, 7168),
        (0, 5, 64),
        (5, 0, 64),
        (3, 4, 0),
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
        let got = gpu.nvfp4_gemm_w4a4_sm100(a, wq, (m, n, k)).unwrap();
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
