//! The GPU tests, one binary: every test binary embeds every fatbin, so one binary keeps the
//! stripped copies that `kernels/gpu-check.sh --stage` carries to a lent device small. Each
//! module tests one kernel family on the device against its CPU reference (bit for bit for the
//! exact kernels, within the stated bound for the fast ones). Without the `cuda` feature the
//! modules are empty; without a device the tests skip, and fail under `PDSERVE_REQUIRE_GPU=1`
//! (`kernels::gpu_test`), as `gpu-check.sh` sets it.

mod attn_decode;
mod attn_decode_fp8;
mod attn_exact;
mod compress;
mod cuda_backend;
mod decoder;
mod dense_gemm;
mod device_pages;
mod exact_gemv;
mod fp4_gemv;
mod hyper;
mod indexer;
mod kv_rows;
mod moe_exact;
mod moe_grouped;
mod nvfp4_gemm;
mod nvfp4_gemm_sm100;
mod nvfp4_quant;
mod step;
mod step_kernels;

/// The bf16 GEMM tiles' instructions a device runs, each to be tested: on sm_90 the warpgroup
/// MMA it uses (its start-up check passed) and `mma.sync`, elsewhere `mma.sync` (and the
/// warpgroup MMA refused).
#[cfg(feature = "cuda")]
#[expect(clippy::unwrap_used, reason = "test code")]
fn bf16_mmas(gpu: &mut kernels::cuda::Gpu) -> Vec<kernels::arch::Bf16Mma> {
    use kernels::arch::Bf16Mma;
    let (major, minor) = gpu.ctx.compute_capability().unwrap();
    if kernels::arch::bf16_mma(major, minor) == Bf16Mma::Wgmma {
        assert_eq!(
            gpu.wgmma_fault(),
            None,
            "the start-up check of the warpgroup MMA"
        );
    }
    match gpu.bf16_mma() {
        Bf16Mma::Wgmma => vec![Bf16Mma::Wgmma, Bf16Mma::MmaSync],
        Bf16Mma::MmaSync => {
            assert!(
                gpu.set_bf16_mma(Bf16Mma::Wgmma).is_err(),
                "the warpgroup MMA is refused off sm_90"
            );
            vec![Bf16Mma::MmaSync]
        }
    }
}
