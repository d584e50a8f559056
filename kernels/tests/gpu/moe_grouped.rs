//! The grouped routed-expert GEMM of a prefill chunk on the GPU (`moe_align.cu` then
//! `nvfp4_grouped_gemm_bf16`) against the f64 reference (`cpu::grouped_gemm`, bound
//! `1e-4 · Σ|a·w|`) and its emulation: awkward token counts, experts with no pairs and with
//! several tiles, n and k not multiples of the tile, pairs routed outside the stack (NaN rows);
//! a pair's row is the same bits alone and in any batch; bad inputs refused; MXFP4 experts
//! (`mxfp4_grouped_gemm_bf16`) against `cpu::mxfp4_gemm` per pair. On sm_90 the accuracy cases
//! run on both tile instructions (the `_wgmma` kernels and `mma.sync`). Skips without a GPU
//! (fails under `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::synth::Rng;
use kernels::{
    cpu::grouped_gemm,
    cuda::Gpu,
    emulate::{StackedExperts, moe_grouped_gemm},
    moe_group::{SyntheticMoe, synthetic_moe},
};

fn on_gpu(gpu: &Gpu, m: &SyntheticMoe, pairs: std::ops::Range<usize>) -> Vec<f32> {
    gpu.nvfp4_grouped_gemm(
        &m.a,
        &m.pair_token[pairs.clone()],
        &m.pair_expert[pairs],
        (&m.packed, &m.scales, &m.scale_2),
        m.tokens,
        m.n,
        m.k,
    )
    .unwrap()
}

#[test]
fn gpu_grouped_gemm_matches_reference() {
    let Some(mut gpu) = Gpu::for_test("gpu_grouped_gemm_matches_reference") else {
        return;
    };
    for mma in super::bf16_mmas(&mut gpu) {
        gpu.set_bf16_mma(mma).unwrap();
        eprintln!("{mma:?}");
        grouped_gemm_matches_reference(&gpu);
    }
}

fn grouped_gemm_matches_reference(gpu: &Gpu) {
    let mut rng = Rng::for_tensor(51, "gpu-moe-grouped");
    for (route, (n, k), bad) in [
        ((1, 1, 1), (1, 16), 0),
        ((5, 2, 3), (65, 48), 4),
        ((70, 2, 17), (64, 64), 9),
        ((33, 6, 8), (20, 256), 0),
        ((300, 6, 64), (256, 512), 13),
    ] {
        let m = synthetic_moe(&mut rng, route, (n, k), bad).unwrap();
        let pairs = m.pair_token.len();
        let got = on_gpu(gpu, &m, 0..pairs);
        let want = grouped_gemm(
            &m.a,
            &m.pair_token,
            &m.pair_expert,
            (&m.packed, &m.scales, &m.scale_2),
            (n, k),
        )
        .unwrap();
        let w = m.worst(&got, &want);
        eprintln!("{route:?} {n}x{k}: {w:.3} of the bound");
        assert!(w <= 1.0, "{route:?} {n}x{k}: {w} of the bound");
        let stack = StackedExperts {
            packed: &m.packed,
            scales: &m.scales,
            scale_2: Some(&m.scale_2),
            experts: m.experts,
            n,
            k,
        };
        let order: Vec<usize> = (0..pairs).collect();
        let emulated = moe_grouped_gemm(&m.a, &m.pair_token, &m.pair_expert, stack, &order);
        assert!(m.worst(&got, &emulated) <= 1.0, "{route:?}: emulation");
    }
}

/// Batch invariance: a pair's row is the same bits computed alone as in the whole chunk.
#[test]
fn gpu_grouped_gemm_rows_do_not_depend_on_the_batch() {
    let Some(gpu) = Gpu::for_test("gpu_grouped_gemm_rows_do_not_depend_on_the_batch") else {
        return;
    };
    let mut rng = Rng::for_tensor(52, "gpu-moe-invariance");
    let m = synthetic_moe(&mut rng, (200, 4, 8), (96, 128), 0).unwrap();
    let pairs = m.pair_token.len();
    let all = on_gpu(&gpu, &m, 0..pairs);
    for p in [0, 1, pairs / 2, pairs - 1] {
        let alone = on_gpu(&gpu, &m, p..p + 1);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&alone), bits(&all[p * m.n..(p + 1) * m.n]), "pair {p}");
    }
}

#[test]
fn gpu_grouped_gemm_refuses_bad_inputs() {
    let Some(gpu) = Gpu::for_test("gpu_grouped_gemm_refuses_bad_inputs") else {
        return;
    };
    let mut rng = Rng::for_tensor(53, "gpu-moe-bad");
    let m = synthetic_moe(&mut rng, (3, 1, 2), (8, 32), 0).unwrap();
    let err = gpu
        .nvfp4_grouped_gemm(
            &m.a,
            &[0, 1, 3],
            &[0, 0, 1],
            (&m.packed, &m.scales, &m.scale_2),
            m.tokens,
            m.n,
            m.k,
        )
        .unwrap_err();
    assert!(err.to_string().contains("outside 0..3"), "{err}");
}

/// MXFP4 experts (V4-Flash's shipped format) through `mxfp4_grouped_gemm_bf16`: each pair's row
/// within `1e-4 · Σ|a·w|` of `cpu::mxfp4_gemm` of its token and expert (a skewed routing: the
/// first expert over several tiles; pairs outside the stack NaN rows); k not whole 32-blocks
/// refused.
#[test]
fn gpu_mxfp4_grouped_gemm_matches_reference() {
    let Some(mut gpu) = Gpu::for_test("gpu_mxfp4_grouped_gemm_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(52, "gpu-moe-grouped-mxfp4");
    let m = kernels::moe_group::synthetic_mxfp4_moe(&mut rng, (200, 2, 5), (70, 96), 11).unwrap();
    let stack = (m.packed.as_slice(), m.scales.as_slice(), m.experts);
    let pairs = (m.pair_token.as_slice(), m.pair_expert.as_slice());
    for mma in super::bf16_mmas(&mut gpu) {
        gpu.set_bf16_mma(mma).unwrap();
        let got = gpu
            .mxfp4_grouped_gemm(&m.a, pairs, stack, (m.tokens, m.n, m.k))
            .unwrap();
        let w = m.worst(&got, &m.reference().unwrap());
        eprintln!("MXFP4 {mma:?}: {w:.3} of the bound");
        assert!(w <= 1.0, "MXFP4 {mma:?}: {w} of the bound");
    }
    let refused = gpu.mxfp4_grouped_gemm(
        &m.a[..m.tokens * 48],
        (&m.pair_token[..1], &m.pair_expert[..1]),
        stack,
        (m.tokens, m.n, 48),
    );
    assert!(refused.is_err(), "k of 48 is not whole MXFP4 blocks");
}
