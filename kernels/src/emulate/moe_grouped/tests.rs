use engine::synth::Rng;

use super::*;
use crate::{
    cpu,
    moe_group::{SyntheticMoe, synthetic_moe},
};

fn stacked(m: &SyntheticMoe) -> StackedExperts<'_> {
    StackedExperts {
        packed: &m.packed,
        scales: &m.scales,
        scale_2: Some(&m.scale_2),
        experts: m.scale_2.len(),
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
        let got = moe_grouped_gemm(&m.a, &m.pair_token, &m.pair_expert, stacked(&m), &arrival);
        let w = m.worst(&got, &reference(&m));
        assert!(w <= 1.0, "{route:?} {nk:?}: {w} of the bound");
        if bad > 0 && m.pair_token.len() >= bad {
            assert!(got[(bad - 1) * m.n..bad * m.n].iter().all(|v| v.is_nan()));
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
            plant,
        );
        let w = m.worst(&got, &want);
        assert!(w.is_nan() || w > 1.0, "{plant:?} not caught ({w})");
    }
}

/// MXFP4 experts (`mxfp4_grouped_gemm_bf16`): every pair's row is `cpu::mxfp4_gemm` of its
/// token and expert within `1e-4 · Σ|a·w|` (an expert with no pair, one of several tiles, a
/// pair outside the stack a NaN row), in any arrival order; the next expert's weights are
/// caught.
#[test]
fn mxfp4_experts_group_and_multiply_as_the_reference() {
    let mut rng = Rng::for_tensor(43, "emulate-moe-mxfp4");
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
    let (mut pair_token, mut pair_expert) = (Vec::new(), Vec::new());
    for t in 0..tokens {
        for e in [0, 1 + t % 3] {
            pair_token.push(t as i32);
            pair_expert.push(e as i32);
        }
    }
    pair_token.push(7);
    pair_expert.push(experts as i32);
    let stack = StackedExperts {
        packed: &packed,
        scales: &scales,
        scale_2: None,
        experts,
        n,
        k,
    };
    let mismatches = |got: &[f32]| {
        let mut bad = 0;
        for (p, (&t, &e)) in pair_token.iter().zip(&pair_expert).enumerate() {
            let row = &got[p * n..(p + 1) * n];
            let Some(e) = usize::try_from(e).ok().filter(|&e| e < experts) else {
                bad += usize::from(!row.iter().all(|v| v.is_nan()));
                continue;
            };
            let x = &a[t as usize * k..(t as usize + 1) * k];
            let (code_bytes, scale_bytes) = (n * k / 2, n * k / 32);
            let want = cpu::mxfp4_gemm(
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
                    .map(|(a, w)| (crate::dense_gemm::bf16(*a) * w).abs())
                    .sum();
                bad += usize::from((g - w).abs() > 1e-4 * mag + 1e-30 || g.is_nan());
            }
        }
        bad
    };
    let arrival = shuffled(&mut rng, pair_token.len());
    let got = moe_grouped_gemm(&a, &pair_token, &pair_expert, stack, &arrival);
    assert_eq!(mismatches(&got), 0);
    let planted = grouped_with(
        &a,
        &pair_token,
        &pair_expert,
        stack,
        &arrival,
        GroupPlant::NextExpert,
    );
    assert!(
        mismatches(&planted) > 0,
        "the next expert's weights went unnoticed"
    );
}
