//! Lightning-indexer selection on the GPU is exactly the CPU reference's (the engine's scores bit
//! for bit, its rule: ties to the lower index): ragged key counts, fewer visible keys than k, k
//! larger than any count, heads with negative weights (so many exact-zero scores); the
//! tensor-core scores within their bound. Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::synth::Rng;
use kernels::{
    cpu,
    cuda::{Gpu, IndexerBatch},
};

#[test]
fn gpu_indexer_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_indexer_matches_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(4, "indexer");
    for (visible, heads, dim, k) in [
        (vec![0i32, 1, 5, 37], 4usize, 16usize, 4usize),
        (vec![300, 2, 1000], 8, 32, 16),
        (vec![16_384], 64, 128, 512),
        (vec![7, 9], 2, 16, 64),
    ] {
        let n = visible.len();
        let mut key_starts = Vec::new();
        let mut keys = Vec::new();
        let mut rows: Vec<Vec<Vec<f32>>> = Vec::new();
        for &v in &visible {
            key_starts.push((keys.len() / dim) as i64);
            let mine: Vec<Vec<f32>> = (0..v)
                .map(|_| (0..dim).map(|_| rng.normal()).collect())
                .collect();
            keys.extend(mine.iter().flatten());
            rows.push(mine);
        }
        let q: Vec<f32> = (0..n * heads * dim).map(|_| rng.normal()).collect();
        let w: Vec<f32> = (0..n * heads).map(|_| rng.normal()).collect();
        let scale = 1.0 / (dim as f32).sqrt();
        let got = gpu
            .indexer_topk(&IndexerBatch {
                q: &q,
                w: &w,
                keys: &keys,
                key_starts: &key_starts,
                visible: &visible,
                heads,
                dim,
                scale,
                top_k: k,
            })
            .unwrap();
        for b in 0..n {
            let want = cpu::indexer_topk(
                &q[b * heads * dim..(b + 1) * heads * dim],
                &w[b * heads..(b + 1) * heads],
                &rows[b],
                visible[b] as usize,
                scale,
                k,
            )
            .expect("finite scores");
            // The scores are the engine's bits (its dot, the heads summed in order), so the
            // choice is exactly the engine's.
            assert_eq!(got[b].as_ref(), Some(&want), "request {b} of {visible:?}");
        }
    }
}

/// A NaN in one request's keys gives that request no selection (on the device and in the
/// reference), not indices picked around a NaN; the other requests are unaffected.
#[test]
fn gpu_indexer_poisons_a_request_with_a_nan_score() {
    let Some(gpu) = Gpu::for_test("gpu_indexer_poisons_a_request_with_a_nan_score") else {
        return;
    };
    let mut rng = Rng::for_tensor(5, "indexer-nan");
    let (heads, dim, k) = (4usize, 16usize, 4usize);
    let visible = [9i32, 9, 0];
    let mut keys: Vec<f32> = (0..18 * dim).map(|_| rng.normal()).collect();
    keys[(9 + 5) * dim + 3] = f32::NAN; // request 1, key 5
    let q: Vec<f32> = (0..3 * heads * dim).map(|_| rng.normal()).collect();
    let w: Vec<f32> = (0..3 * heads).map(|_| rng.normal()).collect();
    let got = gpu
        .indexer_topk(&IndexerBatch {
            q: &q,
            w: &w,
            keys: &keys,
            key_starts: &[0, 9, 18],
            visible: &visible,
            heads,
            dim,
            scale: 0.25,
            top_k: k,
        })
        .unwrap();
    let rows: Vec<Vec<f32>> = keys.chunks(dim).map(<[f32]>::to_vec).collect();
    let want = |b: usize| {
        cpu::indexer_topk(
            &q[b * heads * dim..(b + 1) * heads * dim],
            &w[b * heads..(b + 1) * heads],
            &rows[9 * b..9 * b + visible[b] as usize],
            visible[b] as usize,
            0.25,
            k,
        )
    };
    assert_eq!(want(1), None);
    assert_eq!(got[1], None);
    assert_eq!(got[0].as_ref().map(Vec::len), Some(k));
    assert_eq!(got[2], Some(Vec::new()));
}

/// With one head of one dim, a query of 1 and a weight of 1, each key's score is exactly
/// `max(key, 0)`: long rows (past one block, 2 of them past 8K keys) with heavy ties and k up to
/// 512 give exactly the reference's choice from the radix select.
#[test]
fn gpu_topk_selects_exactly_on_long_tied_rows() {
    let Some(gpu) = Gpu::for_test("gpu_topk_selects_exactly_on_long_tied_rows") else {
        return;
    };
    let mut rng = Rng::for_tensor(6, "indexer-ties");
    let visible = vec![0i32, 255, 256, 257, 3000, 8193, 20_000];
    for k in [1usize, 64, 255, 512] {
        let mut keys = Vec::new();
        let mut key_starts = Vec::new();
        for &v in &visible {
            key_starts.push(keys.len() as i64);
            keys.extend((0..v).map(|_| match rng.next_u64() % 4 {
                0 => -1.0,
                1 => [0.5f32, 1.0, 2.0][(rng.next_u64() % 3) as usize],
                _ => rng.normal(),
            }));
        }
        let n = visible.len();
        let got = gpu
            .indexer_topk(&IndexerBatch {
                q: &vec![1.0; n],
                w: &vec![1.0; n],
                keys: &keys,
                key_starts: &key_starts,
                visible: &visible,
                heads: 1,
                dim: 1,
                scale: 1.0,
                top_k: k,
            })
            .unwrap();
        for b in 0..n {
            let start = key_starts[b] as usize;
            let scores: Vec<f32> = keys[start..start + visible[b] as usize]
                .iter()
                .map(|v| v.max(0.0))
                .collect();
            assert_eq!(
                got[b],
                cpu::topk_of_scores(&scores, k),
                "request {b} ({} keys), k {k}",
                visible[b]
            );
        }
    }
}

/// The tensor-core scores (`indexer_scores_mma`, the fast attention's indexer) within
/// `indexer_mma::bound` of their f64 reference over the bf16 operands, and equal to the
/// kernel's CI emulation within the same bound: heads and dims not whole tiles, key counts not
/// whole tiles or groups, a token with no keys, V4-Flash's 64 heads of 128 over 5000 keys;
/// a NaN key poisons its score only, a NaN query its token's.
#[test]
fn gpu_tensor_core_scores_match_reference() {
    use kernels::{
        emulate::indexer_scores_mma,
        indexer_mma::{SyntheticScores, bound, mismatches, reference},
    };
    let Some(gpu) = Gpu::for_test("gpu_tensor_core_scores_match_reference") else {
        return;
    };
    let mut rng = Rng::for_tensor(6, "indexer-mma");
    for (heads, dim, visible) in [
        (1usize, 16usize, vec![1usize]),
        (3, 24, vec![7, 0, 70]),
        (20, 48, vec![300, 3]),
        (64, 128, vec![5000, 257]),
    ] {
        let s = SyntheticScores::new(&mut rng, (heads, dim), &visible, true);
        let (x, sp) = (s.inputs(), s.spec);
        let got = gpu.indexer_scores_mma(&x, sp).unwrap();
        let limit = bound(&x, &sp).unwrap();
        let want = reference(&x, &sp).unwrap();
        let what = format!("{heads} heads x {dim}, {visible:?}");
        assert_eq!(
            mismatches(&got, &want, &limit, &s.visible, &sp),
            0,
            "{what}"
        );
        let emulated = indexer_scores_mma(&x, &sp);
        let vs_emulation = mismatches(&got, &emulated, &limit, &s.visible, &sp);
        assert_eq!(vs_emulation, 0, "{what}: emulation");
        assert!(
            !s.poisoned || s.poison_shows(&got),
            "{what}: NaN in, NaN out"
        );
    }
}
