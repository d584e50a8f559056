//! The grouped routed-expert GEMM of a prefill chunk on the GPU (`moe_align.cu` then
//! `nvfp4_grouped_gemm_bf16`) against the f64 reference (`cpu::grouped_gemm`, bound
//! `1e-4 · Σ|a·w|`) and its emulation: awkward token counts, experts with no pairs and with
//! several tiles, n and k not multiples of the tile, pairs routed outside the stack (NaN rows);
//! a pair's row is the same bits alone and in any batch; bad inputs refused; MXFP4 experts
//! (`mxfp4_grouped_gemm_bf16`) against `cpu::mxfp4_gemm` per pair. Skips without a GPU (fails
//! under `PDSERVE_REQUIRE_GPU=1`).
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
    let Some(gpu) = Gpu::for_test("gpu_grouped_gemm_matches_reference") else {
        return;
    };
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
        let got = on_gpu(&gpu, &m, 0..pairs);
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
            experts: m.scale_2.len(),
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
/// against `cpu::mxfp4_gemm` of its token and expert within `1e-4 · Σ|a·w|`, experts with no
/// pairs and with several tiles, k of whole 32-blocks only, a pair routed outside the stack a
/// NaN row.
#[test]
fn gpu_mxfp4_grouped_gemm_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_mxfp4_grouped_gemm_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(52, "gpu-moe-grouped-mxfp4");
    let (tokens, experts, n, k) = (90usize, 5usize, 70usize, 96usize);
    let a: Vec<f32> = (0..tokens * k).map(|_| rng.normal() * 3.0).collect();
    let (mut packed, mut scales, mut dequant) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..experts {
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
        let (p, s) = engine::quant::quant_mxfp4(&w, n, k).unwrap();
        dequant.push(engine::quant::dequant_mxfp4(&p, &s, n, k).unwrap());
        packed.extend(p);
        scales.extend(s);
    }
    // Expert 4 gets no pair, expert 0 several tiles; the last pair's expert is outside.
    let mut pair_token: Vec<i32> = Vec::new();
    let mut pair_expert: Vec<i32> = Vec::new();
    for t in 0..tokens {
        for e in [0, 1 + t % 3] {
            pair_token.push(t as i32);
            pair_expert.push(e as i32);
        }
    }
    pair_token.push(7);
    pair_expert.push(experts as i32);
    let got = gpu
        .mxfp4_grouped_gemm(
            &a,
            (&pair_token, &pair_expert),
            (&packed, &scales, experts),
            (tokens, n, k),
        )
        .unwrap();
    let (code_bytes, scale_bytes) = (n * k / 2, n * k / 32);
    for (p, (&t, &e)) in pair_token.iter().zip(&pair_expert).enumerate() {
        let row = &got[p * n..(p + 1) * n];
        let Some(e) = usize::try_from(e).ok().filter(|&e| e < experts) else {
            assert!(
                row.iter().all(|v| v.is_nan()),
                "pair {p}: outside the stack"
            );
            continue;
        };
        let x = &a[t as usize * k..(t as usize + 1) * k];
        let want = kernels::cpu::mxfp4_gemm(
            x,
            &packed[e * code_bytes..(e + 1) * code_bytes],
            &scales[e * scale_bytes..(e + 1) * scale_bytes],
            (1, n, k),
        )
        .unwrap();
        for (j, (g, w)) in row.iter().zip(&want).enumerate() {
            let mag: f32 = x
                .iter()
                .zip(&dequant[e][j * k..(j + 1) * k])
                .map(|(a, w)| (kernels::dense_gemm::bf16(*a) * w).abs())
                .sum();
            assert!(
                (g - w).abs() <= 1e-4 * mag + 1e-30,
                "pair {p} row {j}: {g} vs {w}"
            );
        }
    }
    let refused = gpu.mxfp4_grouped_gemm(
        &a[..tokens * 48],
        (&pair_token[..1], &pair_expert[..1]),
        (&packed, &scales, experts),
        (tokens, n, 48),
    );
    assert!(refused.is_err(), "k of 48 is not whole MXFP4 blocks");
}
