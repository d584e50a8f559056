//! Tensor-parallel attention on CPU ranks: each rank computes its share of the query heads and
//! output groups and the ranks all-gather the groups before the replicated `wo_b`. Every rank
//! runs every request; each one's tokens and log-probabilities must equal the one-rank
//! engine's bit for bit (2 ranks of the tiny model, 2 and 4 of the small one), chunked prefill
//! and mixed batches included, also with the experts split over the same ranks (TP + EP). Each
//! rank's copy of the other ranks' query and output rows is replaced by wrong ones, so a rank
//! that read outside its share would show.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{sync::Arc, thread, time::Duration};

use engine::{
    model::Model,
    parallel::{collective::InProcessGroup, expert::ExpertParallel, tensor::TensorParallel},
    scheduler::{Engine, GenerationRequest},
    synth::{Preset, Rng},
};
use ranks_common::{bits, checkpoint, config, outputs, spoil_outside};

mod ranks_common;

/// Every token event's request, token and log-probabilities (as bits), in order.
type Output = (u64, u32, Vec<u32>);

/// Greedy and sampled requests with log-probabilities.
fn requests() -> Vec<GenerationRequest> {
    ranks_common::requests(&mut Rng::for_tensor(4, "tp-requests"), true)
}

fn run_ranks(dir: &std::path::Path, ranks: usize, with_ep: bool) -> Vec<Vec<Output>> {
    let heads_group = InProcessGroup::new(ranks, Duration::from_secs(30));
    let mut experts_group = with_ep.then(|| InProcessGroup::new(ranks, Duration::from_secs(30)));
    thread::scope(|s| {
        let handles: Vec<_> = heads_group
            .into_iter()
            .map(|heads| {
                let experts = experts_group.as_mut().map(|g| g.remove(0));
                s.spawn(move || {
                    let mut model = Model::load(dir).unwrap();
                    let c = model.config.clone();
                    let tp = TensorParallel::new(Box::new(heads), &c).unwrap();
                    let (hd, lora) = (c.head_dim, c.o_lora_rank);
                    let (mine, groups) = (tp.heads(), tp.groups());
                    for layer in &mut model.weights.layers {
                        let a = &mut layer.attn;
                        a.wq_b = spoil_outside(&a.wq_b, mine.start * hd..mine.end * hd);
                        a.wo_a = spoil_outside(&a.wo_a, groups.start * lora..groups.end * lora);
                    }
                    model.set_tensor_parallel(Arc::new(tp));
                    if let Some(rank) = experts {
                        let n = c.n_routed_experts;
                        model.set_expert_parallel(Arc::new(
                            ExpertParallel::new(Box::new(rank), n).unwrap(),
                        ));
                    }
                    let mut engine = Engine::new(model, config(), "tp").unwrap();
                    // The same requests in the same order: every rank schedules the same steps.
                    for r in requests() {
                        engine.add(r).unwrap();
                    }
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(1)
                        .build()
                        .unwrap();
                    bits(&outputs(&pool.install(|| engine.run_to_completion())))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn one_rank(dir: &std::path::Path) -> Vec<Output> {
    let mut engine = Engine::new(Model::load(dir).unwrap(), config(), "tp").unwrap();
    for r in requests() {
        engine.add(r).unwrap();
    }
    bits(&outputs(&engine.run_to_completion()))
}

#[test]
fn tensor_parallel_attention_is_bit_identical_to_one_rank() {
    for (preset, ranks) in [(Preset::Tiny, vec![2]), (Preset::Small, vec![2, 4])] {
        let dir = checkpoint(preset, 29);
        let want = one_rank(dir.path());
        assert!(want.len() >= 15, "{want:?}");
        for n in ranks {
            for with_ep in [false, true] {
                for (rank, got) in run_ranks(dir.path(), n, with_ep).iter().enumerate() {
                    assert_eq!(
                        got, &want,
                        "{preset:?}, tp {n}, ep {with_ep}: rank {rank} differs"
                    );
                }
            }
        }
    }
}

/// A rank whose wrong rows were read would change the answer: the test can fail.
#[test]
fn spoiled_rows_change_the_one_rank_answer() {
    let dir = checkpoint(Preset::Tiny, 29);
    let want = one_rank(dir.path());
    let mut model = Model::load(dir.path()).unwrap();
    let hd = model.config.head_dim;
    for layer in &mut model.weights.layers {
        layer.attn.wq_b = spoil_outside(&layer.attn.wq_b, 0..hd);
    }
    let mut engine = Engine::new(model, config(), "tp").unwrap();
    for r in requests() {
        engine.add(r).unwrap();
    }
    assert_ne!(bits(&outputs(&engine.run_to_completion())), want);
}
