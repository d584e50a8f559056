use engine::synth::Rng;

use super::*;
use crate::indexer_mma::{bound, mismatches, reference};

/// Random operands: `(q, w, keys, starts, visible)` for `visible` keys per token, each
/// token's rows after a gap, NaN planted in one key and one query where asked.
type Operands = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i64>, Vec<i32>);

fn operands(rng: &mut Rng, heads: usize, dim: usize, visible: &[usize], nan: bool) -> Operands {
    let tokens = visible.len();
    let q: Vec<f32> = (0..tokens * heads * dim).map(|_| rng.normal()).collect();
    let w: Vec<f32> = (0..tokens * heads).map(|_| rng.normal() * 0.3).collect();
    let mut starts = Vec::new();
    let mut rows = 0usize;
    for &v in visible {
        rows += 3;
        starts.push(rows as i64);
        rows += v;
    }
    let mut keys: Vec<f32> = (0..rows * dim).map(|_| rng.normal()).collect();
    let mut q = q;
    if nan && tokens > 1 && visible[0] > 5 {
        keys[(starts[0] as usize + 5) * dim + dim / 2] = f32::NAN;
        q[heads * dim + 1] = f32::NAN;
    }
    let visible = visible.iter().map(|&v| v as i32).collect();
    (q, w, keys, starts, visible)
}

fn spec(tokens: usize, heads: usize, dim: usize, max_keys: usize) -> ScoreSpec {
    ScoreSpec {
        tokens,
        heads,
        dim,
        scale: 1.0 / (dim as f32).sqrt(),
        max_keys,
        tensor_cores: true,
    }
}

/// The tensor-core scores equal the reference within its bound at awkward shapes: heads and
/// dims not whole tiles, key counts not whole tiles or groups, a token with no keys, one with
/// keys over several blocks; a NaN key poisons its score only, a NaN query its token's.
#[test]
fn the_tensor_core_scores_are_the_references() {
    let mut rng = Rng::for_tensor(61, "emulate-indexer-mma");
    for (heads, dim, visible) in [
        (1usize, 16usize, vec![1usize]),
        (3, 24, vec![7, 0, 70]),
        (16, 32, vec![64, 65]),
        (20, 48, vec![300, 3]),
        (64, 128, vec![130, 257]),
    ] {
        let max_keys = visible.iter().copied().max().unwrap_or(0).max(1);
        let sp = spec(visible.len(), heads, dim, max_keys);
        let (q, w, keys, starts, seen) = operands(&mut rng, heads, dim, &visible, true);
        let x = ScoreInputs {
            q: &q,
            w: &w,
            keys: &keys,
            starts: &starts,
            visible: &seen,
        };
        let got = indexer_scores_mma(&x, &sp);
        let want = reference(&x, &sp).unwrap();
        let limit = bound(&x, &sp).unwrap();
        assert_eq!(
            mismatches(&got, &want, &limit, &seen, &sp),
            0,
            "{heads} heads x {dim}, {visible:?}"
        );
        if visible.len() > 1 && visible[0] > 5 {
            assert!(got[5].is_nan(), "the NaN key's score");
            assert!(!got[4].is_nan(), "another key's score");
            let second = &got[max_keys..max_keys + visible[1]];
            assert!(second.iter().all(|v| v.is_nan()), "the NaN query's token");
        }
    }
}

/// The check is sharp: each planted error gives scores outside the bound.
#[test]
fn a_wrong_indexer_mma_index_is_caught() {
    let mut rng = Rng::for_tensor(62, "emulate-indexer-mma-plant");
    let (heads, dim, visible) = (24, 40, vec![90usize, 33]);
    let sp = spec(2, heads, dim, 90);
    let (q, w, mut keys, starts, seen) = operands(&mut rng, heads, dim, &visible, false);
    // One NaN key, for the ReLU's plant.
    keys[(starts[1] as usize + 2) * dim] = f32::NAN;
    let x = ScoreInputs {
        q: &q,
        w: &w,
        keys: &keys,
        starts: &starts,
        visible: &seen,
    };
    let want = reference(&x, &sp).unwrap();
    let limit = bound(&x, &sp).unwrap();
    assert_eq!(
        mismatches(&indexer_scores_mma(&x, &sp), &want, &limit, &seen, &sp),
        0
    );
    for plant in [
        Plant::AHalvesSwapped,
        Plant::BSecondPairFar,
        Plant::OneWeight,
        Plant::ShortReduction,
        Plant::ReluDropsNan,
    ] {
        let mut got = vec![f32::NAN; 2 * 90];
        scores_with(&x, &sp, &mut got, plant);
        assert!(
            mismatches(&got, &want, &limit, &seen, &sp) > 0,
            "{plant:?} went unnoticed"
        );
    }
}
