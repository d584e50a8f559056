use engine::synth::Rng;

use super::*;
use crate::{
    cpu,
    emulate::wgmma_sm90::Tiles,
    moe_group::{SyntheticMoe, synthetic_moe, synthetic_mxfp4_moe},
};

fn stacked(m: &SyntheticMoe) -> StackedExperts<'_> {
    StackedExperts {
        packed: &m.packed,
        scales: &m.scales,
        scale_2: Some(&m.scale_2),
        experts: m.experts,
        n: m.n,
        k: m.k,
    }
}

fn reference(m: &SyntheticMoe) -> Vec<f32> {
    cpu::grouped_gemm(
        &m.a,
        &m.pair_token,
        &m.pair_expert,
        (&m.packed, &m.scales, &m.scale_2),
        (m.n, m.k),
    )
    .unwrap()
}

fn shuffled(rng: &mut Rng, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// (tokens, top-k, experts), (n, k), a pair to a missing expert every so often.
type Case = ((usize, usize, usize), (usize, usize), usize);

const CASES: [Case; 6] = [
    ((0, 2, 3), (8, 16), 0),
    ((1, 1, 1), (1, 16), 0),
    ((5, 2, 3), (65, 48), 4),
    ((40, 3, 5), (130, 32), 0),
    ((70, 2, 17), (64, 64), 9),
    ((33, 6, 8), (20, 256), 0),
];

#[test]
fn grouped_gemm_matches_the_reference_at_awkward_shapes() {
    let mut rng = Rng::for_tensor(41, "emulate-moe-grouped");
    for (route, nk, bad) in CASES {
        let m = synthetic_moe(&mut rng, route, nk, bad).unwrap();
        let arrival = shuffled(&mut rng, m.pair_token.len());
        let wmma = moe_grouped_gemm(&m.a, &m.pair_token, &m.pair_expert, stacked(&m), &arrival);
        let wgmma =
            moe_grouped_gemm_wgmma(&m.a, &m.pair_token, &m.pair_expert, stacked(&m), &arrival)
                .unwrap();
        for (tiles, got) in [("wmma", wmma), ("wgmma", wgmma)] {
            let w = m.worst(&got, &reference(&m));
            assert!(w <= 1.0, "{tiles} {route:?} {nk:?}: {w} of the bound");
            if bad > 0 && m.pair_token.len() >= bad {
                assert!(got[(bad - 1) * m.n..bad * m.n].iter().all(|v| v.is_nan()));
            }
        }
    }
}

/// A pair's output does not depend on where the atomics put it, nor on the other pairs: two
/// arrival orders, and each pair alone, give the same bits.
#[test]
fn a_pairs_row_is_the_same_in_any_order_and_alone() {
    let mut rng = Rng::for_tensor(42, "emulate-moe-order");
    let m = synthetic_moe(&mut rng, (50, 3, 4), (72, 48), 0).unwrap();
    let pairs = m.pair_token.len();
    let run =
        |order: &[usize]| moe_grouped_gemm(&m.a, &m.pair_token, &m.pair_expert, stacked(&m), order);
    let first = run(&(0..pairs).collect::<Vec<_>>());
    let second = run(&shuffled(&mut rng, pairs));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first), bits(&second));
    for p in [0, 7, pairs - 1] {
        let alone = moe_grouped_gemm(
            &m.a,
            &m.pair_token[p..=p],
            &m.pair_expert[p..=p],
            stacked(&m),
            &[0],
        );
        assert_eq!(
            bits(&alone),
            bits(&first[p * m.n..(p + 1) * m.n]),
            "pair {p}"
        );
    }
}

#[test]
fn planted_errors_in_the_grouping_are_caught() {
    let mut rng = Rng::for_tensor(43, "emulate-moe-plants");
    let m = synthetic_moe(&mut rng, (30, 2, 4), (64, 32), 0).unwrap();
    let arrival: Vec<usize> = (0..m.pair_token.len()).collect();
    let want = reference(&m);
    for plant in [GroupPlant::StoreByToken, GroupPlant::NextExpert] {
        let got = grouped_with(
            &m.a,
            &m.pair_token,
            &m.pair_expert,
            stacked(&m),
            &arrival,
            (Tiles::Wmma, plant),
        )
        .unwrap();
        let w = m.worst(&got, &want);
        assert!(w.is_nan() || w > 1.0, "{plant:?} not caught ({w})");
    }
}

/// MXFP4 experts (`mxfp4_grouped_gemm_bf16` and its sm_90a twin): every pair's row within `1e-4 · Σ|a·w|` of
/// `cpu::mxfp4_gemm` of its token and expert (a skewed routing: the first expert over several
/// tiles; pairs outside the stack NaN rows), in a shuffled arrival order; the next expert's weights
/// are caught.
#[test]
fn mxfp4_experts_group_and_multiply_as_the_reference() {
    let mut rng = Rng::for_tensor(43, "emulate-moe-mxfp4");
    let m = synthetic_mxfp4_moe(&mut rng, (200, 2, 5), (70, 96), 11).unwrap();
    let stack = StackedExperts {
        packed: &m.packed,
        scales: &m.scales,
        scale_2: None,
        experts: m.experts,
        n: m.n,
        k: m.k,
    };
    let want = m.reference().unwrap();
    let arrival = shuffled(&mut rng, m.pair_token.len());
    let wmma = moe_grouped_gemm(&m.a, &m.pair_token, &m.pair_expert, stack, &arrival);
    let wgmma =
        moe_grouped_gemm_wgmma(&m.a, &m.pair_token, &m.pair_expert, stack, &arrival).unwrap();
    for got in [wmma, wgmma] {
        assert!(m.worst(&got, &want) <= 1.0, "{}", m.worst(&got, &want));
        assert!(
            got[10 * m.n..11 * m.n].iter().all(|v| v.is_nan()),
            "a pair outside the stack"
        );
    }
    let planted = grouped_with(
        &m.a,
        &m.pair_token,
        &m.pair_expert,
        stack,
        &arrival,
        (Tiles::Wmma, GroupPlant::NextExpert),
    )
    .unwrap();
    assert!(
        m.worst(&planted, &want) > 1.0,
        "the next expert's weights went unnoticed"
    );
}
