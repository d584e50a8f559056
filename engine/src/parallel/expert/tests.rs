use std::{thread, time::Duration};

use super::*;
use crate::{
    config::ExpertFormat,
    model::Model,
    parallel::collective::InProcessGroup,
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn model(experts: ExpertFormat) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("dir");
    let options = GenerateOptions::new(Preset::Tiny, 31, experts, dir.path());
    generate(&options).expect("generate");
    let model = Model::load(dir.path()).expect("load");
    (dir, model)
}

/// One rank's tokens and its (token, expert) pairs.
type RankWork = (Vec<Vec<f32>>, Vec<(usize, usize)>);

/// Each rank's own tokens and (token, expert) pairs: ragged counts, a rank with none, experts
/// on every rank and repeated within a token's list.
fn work(ranks: usize, experts: usize, width: usize) -> Vec<RankWork> {
    let mut rng = Rng::for_tensor(7, "ep-work");
    (0..ranks)
        .map(|r| {
            let tokens = [5usize, 0, 9, 2][r % 4];
            let xs: Vec<Vec<f32>> = (0..tokens)
                .map(|_| (0..width).map(|_| rng.normal()).collect())
                .collect();
            let pairs = (0..tokens)
                .flat_map(|t| (0..3).map(move |k| (t, k)))
                .map(|(t, k)| (t, (t * 5 + k * 3 + r) % experts))
                .collect();
            (xs, pairs)
        })
        .collect()
}

/// N ranks (threads) that each hold `1/N` of a layer's experts compute every rank's pairs
/// bit-identically to the one-rank expert function, in every expert format.
#[test]
fn expert_parallel_outputs_equal_the_one_rank_experts_bit_for_bit() {
    for format in [ExpertFormat::Mxfp4, ExpertFormat::Nvfp4, ExpertFormat::Bf16] {
        let (_dir, model) = model(format);
        let c = &model.config;
        let layer = &model.weights.layers[1].moe;
        let width = c.hidden_size;
        for ranks in [1usize, 2, 4] {
            let split = ExpertSplit::new(c.n_routed_experts, ranks).expect("split");
            let jobs = work(ranks, c.n_routed_experts, width);
            let group = InProcessGroup::new(ranks, Duration::from_secs(20));
            let results: Vec<Vec<Vec<f32>>> = thread::scope(|s| {
                let handles: Vec<_> = group
                    .into_iter()
                    .zip(&jobs)
                    .map(|(mut rank, (xs, pairs))| {
                        s.spawn(move || {
                            let shard = ExpertShard {
                                split,
                                experts: &layer.experts[split.held_by(rank.rank())],
                                limit: c.swiglu_limit,
                            };
                            routed_experts(&mut rank, &shard, xs, pairs).expect("ep")
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("rank"))
                    .collect()
            });
            for (r, ((xs, pairs), got)) in jobs.iter().zip(&results).enumerate() {
                assert_eq!(got.len(), pairs.len());
                for (&(t, e), y) in pairs.iter().zip(got) {
                    let want = expert::expert(&layer.experts[e], &xs[t], c.swiglu_limit);
                    assert!(
                        y.len() == want.len()
                            && y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{format:?} {ranks} ranks: rank {r} token {t} expert {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn splits_and_pairs_are_checked() {
    assert!(ExpertSplit::new(8, 3).is_err());
    assert!(ExpertSplit::new(8, 0).is_err());
    let split = ExpertSplit::new(8, 4).expect("split");
    assert_eq!((split.owner(5), split.held_by(2)), (2, 4..6));
    let (_dir, model) = model(ExpertFormat::Mxfp4);
    let layer = &model.weights.layers[1].moe;
    let mut ranks = InProcessGroup::new(1, Duration::from_secs(1));
    let one = ExpertSplit::new(layer.experts.len(), 1).expect("split");
    let shard = ExpertShard {
        split: one,
        experts: &layer.experts,
        limit: model.config.swiglu_limit,
    };
    let x = vec![vec![0.5; model.config.hidden_size]];
    for pairs in [[(1usize, 0usize)], [(0, layer.experts.len())]] {
        let e = routed_experts(&mut ranks[0], &shard, &x, &pairs).unwrap_err();
        assert!(matches!(e, ExpertError::Invalid(_)), "{e:?}");
    }
}
