use engine::synth::Rng;

use super::*;
use crate::indexer_mma::{SyntheticScores, bound, mismatches, reference};

/// The tensor-core scores equal the reference within its bound at awkward shapes: heads and
/// dims not whole tiles, key counts not whole tiles or groups, a token with no keys, one with
/// keys over several blocks; a NaN key poisons its score only, a NaN query its token's.
#[test]
fn the_tensor_core_scores_are_the_references() {
    let mut rng = Rng::for_tensor(61, "emulate-indexer-mma");
    let mut poisoned = 0;
    for (heads, dim, visible) in [
        (1usize, 16usize, vec![1usize]),
        (3, 24, vec![7, 0, 70]),
        (16, 32, vec![64, 65]),
        (20, 48, vec![300, 3]),
        (64, 128, vec![130, 257]),
    ] {
        let s = SyntheticScores::new(&mut rng, (heads, dim), &visible, true);
        let (x, sp) = (s.inputs(), s.spec);
        let got = indexer_scores_mma(&x, &sp);
        let want = reference(&x, &sp).unwrap();
        let limit = bound(&x, &sp).unwrap();
        let what = format!("{heads} heads x {dim}, {visible:?}");
        assert_eq!(
            mismatches(&got, &want, &limit, &s.visible, &sp),
            0,
            "{what}"
        );
        if s.poisoned {
            poisoned += 1;
            assert!(s.poison_shows(&got), "{what}: NaN in, NaN out");
        }
    }
    assert!(poisoned >= 3);
}

/// The check is sharp: each planted error gives scores outside the bound.
#[test]
fn a_wrong_indexer_mma_index_is_caught() {
    let mut rng = Rng::for_tensor(62, "emulate-indexer-mma-plant");
    let mut s = SyntheticScores::new(&mut rng, (24, 40), &[90, 33], false);
    // One NaN key, for the ReLU's plant.
    s.keys[(s.starts[1] as usize + 2) * 40] = f32::NAN;
    let (x, sp) = (s.inputs(), s.spec);
    let want = reference(&x, &sp).unwrap();
    let limit = bound(&x, &sp).unwrap();
    let clean = indexer_scores_mma(&x, &sp);
    assert_eq!(mismatches(&clean, &want, &limit, &s.visible, &sp), 0);
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
            mismatches(&got, &want, &limit, &s.visible, &sp) > 0,
            "{plant:?} went unnoticed"
        );
    }
}
