//! pdserve's CUDA kernels and the CPU references they are checked against.
//!
//! `build.rs` compiles `cuda/*.cu` with nvcc into fatbins for sm_90a, sm_100a and sm_120a
//! (plus compute_90 PTX) when nvcc is available; [`compiled`] says whether it was. The launch
//! wrappers (feature `cuda`) load cudarc dynamically and never panic on a machine without a
//! driver: `cuda::Gpu::open` returns `Ok(None)` there. Every launch goes through a typed
//! launcher the build writes from the kernel's own parameter list (`build/signatures.rs`,
//! checked against the compiled PTX's `.entry` lists): an argument of the wrong type or width,
//! or one too many or too few, does not compile.
//!
//! Kernels and their references:
//! - `nvfp4_quant.cu` `nvfp4_quantize_rows` — [`cpu::nvfp4_quantize_rows`]
//!   (`engine::quant::quant_nvfp4_activation` row by row).
//! - `fp4_gemv.cu` `nvfp4_gemv`, `mxfp4_gemv` — [`cpu::nvfp4_gemv`], [`cpu::mxfp4_gemv`]
//!   (dequantize path, every architecture); `nvfp4_grouped_gemv`, `mxfp4_grouped_gemv` — the
//!   routed experts of a decode step in one launch, [`cpu::grouped_gemv`].
//! - `nvfp4_gemm.cu` `nvfp4_gemm_bf16` — [`cpu::nvfp4_gemm`] (tensor cores through WMMA on
//!   bf16 activations and exactly dequantized weights; sm_90 and later).
//! - `nvfp4_gemm_sm120.cu` `nvfp4_gemm_w4a4_sm120` — [`cpu::nvfp4_gemm_w4a4`] (NVFP4
//!   activations and weights on sm_120 FP4 tensor cores, block-scaled `mma.sync`; a trapping
//!   stub elsewhere, and the wrapper refuses other architectures).
//! - `nvfp4_gemm_sm100.cu` `nvfp4_gemm_w4a4_sm100` — [`cpu::nvfp4_gemm_w4a4`] (the same W4A4
//!   GEMM on sm_100 5th-generation tensor cores: `tcgen05.mma` block-scaled, accumulator and
//!   scales in Tensor Memory; compiled but not yet run on a device, its index math emulated in
//!   CI by [`emulate::nvfp4_gemm_w4a4_sm100`]; a trapping stub elsewhere, and the wrapper
//!   refuses other architectures).
//!
//! - `attn_decode.cu` `attn_decode_partial` + `attn_decode_merge` — [`cpu::attn_decode`]
//!   (split-KV decode attention with sinks over rows at 64-bit pool offsets).
//! - `attn_decode_fp8.cu` `attn_fp8_plan` + `attn_fp8_partial` + `attn_fp8_combine` —
//!   [`cpu::attn_decode_fp8`] (decode attention over the engine's FP8 K=V rows with all heads
//!   of a request against each tile of rows at once: bf16 `mma.sync` tensor cores, a split plan
//!   computed on the device; shapes in [`attn_fp8`], emulated in CI by
//!   [`emulate::attn_decode_fp8`]).
//! - `attn_exact.cu` `attn_exact` — `engine::model::attention::attend` bit for bit (the
//!   reference-exact decode attention a device forward uses in exact mode; CUDA cores).
//! - `indexer.cu` `indexer_scores` + `indexer_topk` — [`cpu::indexer_topk`] (lightning indexer
//!   with the causal rule; top-k by radix select, linear in the keys; ties to the lower index).
//! - `moe_align.cu` + `nvfp4_gemm.cu` `nvfp4_grouped_gemm_bf16` — [`cpu::grouped_gemm`] (the
//!   routed experts of a prefill chunk: pairs grouped by expert on the device, one WMMA GEMM
//!   over every expert's tiles; grouping in [`moe_group`], emulated by
//!   [`emulate::moe_grouped_gemm`]).
//! - `kv_rows.cu` `norm_rope_rows`, `fp8_kv_encode`, `fp8_kv_round` — [`rows::norm_rope_rows`]
//!   (per-head norm and RoPE of query heads, K=V rows and attention outputs, bit for bit),
//!   [`rows::fp8_kv_encode`] (`engine::paged::codec::encode` into pages, bit for bit) and
//!   [`rows::fp8_kv_round`] (`engine::paged::codec::round` in place: K=V rows as the engine
//!   rounds them when it computes them).
//! - `exact_gemv.cu` `exact_gemv_{f32,bf16,fp8_block,nvfp4,mxfp4}` — `engine::tensor::
//!   dots_source` bit for bit (the engine's one dot-product definition, eight threads as its
//!   eight lanes), emulated by [`emulate::exact_dots`]: every linear on the device can give the
//!   CPU reference's bits. `exact_pairs_*` (the routed experts' projections per pair),
//!   `moe_combine` (the weighted sum) and `moe_route` (`engine::model::moe::route_logits`: the
//!   sqrt-softplus scores with the engine's own `exp` and `ln_1p`, hash or top-k) likewise.
//! - `compress.cu` `compress_pool` — `engine::model::compressor::pool_window` bit for bit (a
//!   closed window's row before its norm and rotation, CSA with overlap and HCA without).
//! - `hyper.cu` `hyper_pre`, `hyper_post`, `hyper_head` — `engine::model::hyper` (the
//!   hyper-connections' mixing from the mixing projections' outputs, bit for bit: `exact.cuh`
//!   ports the engine's own `exp`, and no multiply-add is contracted).
//! - `moe_act.cu` `swiglu_clamp` — [`cpu::swiglu_clamp`] (the experts' clamped SwiGLU).
//! - `step.cu` `embed_rows`, `copy_rows`, `add_periodic`, `sum_blocks`, `held_ids`,
//!   `clear_unheld_rows`, `scale_values`, `chosen_offsets` —
//!   [`step::emulated`] (the device decode step's data movement between activations and state).
//! - `dense_gemv.cu` `bf16_gemv_many`, `fp8_block_gemv_many` — [`cpu::bf16_gemv`],
//!   [`cpu::fp8_block_gemv`] (dense weights, several vectors, a block of rows: the output head,
//!   the shared expert, attention's linears).
//! - `dense_gemm.cu` `dense_gemm_bf16`, `dense_gemm_fp8_block`, `sum_splits` —
//!   [`dense_gemm::reference`] (the same dense weights on WMMA bf16 tensor cores, each weight
//!   byte read once per 64 activation rows, K split by [`dense_gemm::splits`]; emulated in CI
//!   by [`emulate::dense_gemm`]).
//!
//! [`step`] is the decode step written once over the device ops it needs, its state in
//! per-layer arenas; over the engine's own ops ([`step::cpu_ops`]) it is `Model::forward` bit
//! for bit. [`step::device_ops`] is those ops as kernel launches ([`step::kernels::Kernels`]:
//! the exact kernels above and `step.cu`'s data movement), tested in CI over the kernels' CPU
//! references ([`step::emulated`]) and on a GPU as `cuda::CudaStepOps`.
//!
//! `cuda::CudaBackend` is the engine's CUDA backend: the routed experts of every layer on the
//! device in their stored FP4 form, run as grouped GEMVs, the shared expert, attention's
//! linears and core, and the bf16 output head (see `engine::backend`); the other ops of the forward pass stay on the CPU,
//! so it runs in the engine's explicit hybrid mode. From [`prefill_gemm::GEMM_ROWS`] tokens (a
//! prompt chunk) its dense linears and routed experts run as the dense and grouped GEMMs
//! ([`prefill_gemm::GemmReference`] is that rule over the CPU references). `cuda::DevicePages` is the device page
//! pool.
//! [`backend::open`] picks the backend a worker's configuration names.
//!
//! The GPU tests (`tests/`, feature `cuda`) skip on a machine without a GPU and fail there
//! under `PDSERVE_REQUIRE_GPU=1` ([`gpu_test`]), which `gpu-check.sh` sets. Which compiled
//! tensor-core kernel a device may run is decided by [`arch`].
//!
//! Without a GPU, CI still checks the device code: [`emulate`] runs the kernels' own index math
//! and reduction steps on the CPU (decode attention's splits and merge, the heads-batched FP8
//! attention's plan and MMA fragments, the indexer's radix select, the grouped GEMM's grouping,
//! the exact GEMV's lanes, the FP4 MMAs' register loads and stores through their fragment
//! layouts) against the references, and `build.rs` refuses register spills, local memory and
//! tensor-core kernels whose SASS lacks their architecture's MMA instruction.
//!
//! Two kinds of kernels: fast ones (tensor cores, FP8 rows) checked against f64 references
//! within a stated bound, and exact ones (`exact.cuh` and the kernels built on it) that give
//! the engine's own bits, so a device forward can be compared with the CPU bit for bit
//! (`docs/architecture.md`, "The CPU engine's numbers").

pub mod arch;
pub mod attn_fp8;
pub mod backend;
pub mod compare;
pub mod compose;
pub mod cost;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense_gemm;
pub mod emulate;
pub mod gpu_test;
pub mod indexer_mma;
pub mod moe_group;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod poll;
pub mod prefill_gemm;
pub mod rows;
pub mod step;

/// The integer constants of the kernel sources (`cuda/*.cu`, `cuda/*.cuh`: tile sizes,
/// thread counts, layouts), written by the build script (`build/constants.rs`): the launch
/// shapes and the CPU emulations of the kernels' index math take theirs from here.
#[allow(
    clippy::unreadable_literal,
    reason = "the values as the kernel sources write them"
)]
pub mod cuda_constants {
    include!(concat!(env!("OUT_DIR"), "/kernel_constants.rs"));
}

/// The kernels' constants as the build script reads them (tested here).
#[cfg(test)]
#[path = "../build/constants.rs"]
mod constants;

/// The kernels' parameter lists as the build script reads them (tested here; the build
/// writes `cuda::kernel` from them).
#[cfg(test)]
#[path = "../build/signatures.rs"]
mod signatures;

/// Embedded fatbins (empty when built without nvcc).
pub mod fatbins {
    include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));
}

/// Whether the CUDA kernels were compiled into this build.
pub fn compiled() -> bool {
    cfg!(kernels_compiled)
}

#[cfg(test)]
mod tests {
    /// Where the test command demands kernels, they are really in the binary: a CUDA fatbin
    /// (magic 0xBA55ED50) for every `.cu` file.
    #[test]
    fn kernels_are_embedded_when_required() {
        if std::env::var("PDSERVE_REQUIRE_CUDA_KERNELS").as_deref() != Ok("1") {
            return;
        }
        assert!(super::compiled());
        for fatbin in [
            super::fatbins::NVFP4_QUANT,
            super::fatbins::FP4_GEMV,
            super::fatbins::NVFP4_GEMM,
            super::fatbins::NVFP4_GEMM_SM120,
            super::fatbins::NVFP4_GEMM_SM100,
            super::fatbins::ATTN_DECODE,
            super::fatbins::ATTN_DECODE_FP8,
            super::fatbins::ATTN_EXACT,
            super::fatbins::INDEXER,
            super::fatbins::MOE_ACT,
            super::fatbins::MOE_ALIGN,
            super::fatbins::KV_ROWS,
            super::fatbins::HYPER,
            super::fatbins::EXACT_GEMV,
            super::fatbins::COMPRESS,
            super::fatbins::DENSE_GEMV,
            super::fatbins::STEP,
        ] {
            assert!(fatbin.len() > 16);
            assert_eq!(&fatbin[..4], &0xBA55_ED50u32.to_le_bytes());
        }
    }
}
