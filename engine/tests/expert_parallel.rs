//! Expert parallelism with data-parallel attention on CPU ranks: each rank is a thread with its
//! own engine (its own requests, pages and scheduler) and its own compute pool, the routed
//! experts divided among the ranks by whole experts; every step all ranks step together (a rank
//! without work runs an idle forward for the others' experts). Every request's tokens equal
//! the one-rank engine's, at 2 and 4 ranks, though each rank's copies of the experts it does
//! not hold are replaced by wrong ones.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{collections::BTreeMap, sync::Arc, thread, time::Duration};

use engine::{
    config::ExpertFormat,
    model::Model,
    parallel::{
        collective::{Collective, InProcessGroup},
        expert::ExpertParallel,
    },
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 17, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    dir
}

fn requests() -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(2, "ep-requests");
    [3usize, 70, 150, 1, 33, 129, 9]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerationRequest {
            id: i as u64 + 1,
            prompt: (0..len)
                .map(|_| (rng.next_u64() % 129_280) as u32)
                .collect(),
            sampling: SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                seed: Some(i as u64 * 7),
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: 3 + (i as u32 % 4),
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                eos_token_ids: vec![1],
            },
        })
        .collect()
}

fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        max_batch_tokens: 48,
        ..EngineConfig::default()
    }
}

fn tokens(events: &[Event]) -> BTreeMap<u64, Vec<u32>> {
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for e in events {
        match e {
            Event::Token { id, sampled, .. } => out.entry(*id).or_default().push(sampled.token),
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
            _ => {}
        }
    }
    out
}

#[test]
fn expert_parallel_ranks_give_the_one_rank_tokens() {
    let dir = checkpoint();
    let mut one = Engine::new(Model::load(dir.path()).unwrap(), config(), "ep").unwrap();
    for r in requests() {
        one.add(r).unwrap();
    }
    let want = tokens(&one.run_to_completion());
    assert_eq!(want.len(), requests().len());

    for ranks in [2usize, 4] {
        let experts = one.model().config.n_routed_experts;
        let group = InProcessGroup::new(ranks, Duration::from_secs(30));
        // The ranks agree before each step whether any of them has work.
        let control = InProcessGroup::new(ranks, Duration::from_secs(30));
        let got: Vec<BTreeMap<u64, Vec<u32>>> = thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .zip(control)
                .map(|(rank, mut control)| {
                    let dir = dir.path();
                    s.spawn(move || {
                        let me = rank.rank();
                        let mut model = Model::load(dir).unwrap();
                        let ep = ExpertParallel::new(Box::new(rank), experts).unwrap();
                        // This rank's copies of the other ranks' experts are wrong on purpose:
                        // only the experts it holds may be used here.
                        let held = ep.split().held_by(me);
                        for layer in &mut model.weights.layers {
                            let stand_in = layer.moe.experts[held.start].clone();
                            for (e, expert) in layer.moe.experts.iter_mut().enumerate() {
                                if !held.contains(&e) {
                                    *expert = stand_in.clone();
                                }
                            }
                        }
                        model.set_expert_parallel(Arc::new(ep));
                        let mut engine = Engine::new(model, config(), "ep").unwrap();
                        for r in requests()
                            .into_iter()
                            .filter(|r| r.id as usize % ranks == me)
                        {
                            engine.add(r).unwrap();
                        }
                        // Its own pool: a rank waiting in an exchange must not hold a thread
                        // another rank's step needs.
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(1)
                            .build()
                            .unwrap();
                        let mut events = Vec::new();
                        for _ in 0..10_000 {
                            let busy = control
                                .all_gather(vec![f32::from(u8::from(!engine.is_idle()))])
                                .unwrap();
                            if busy.iter().all(|b| b[0] == 0.0) {
                                return tokens(&events);
                            }
                            events.extend(pool.install(|| engine.step()));
                        }
                        panic!("rank {me} made no progress");
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut merged = BTreeMap::new();
        for g in got {
            merged.extend(g);
        }
        assert_eq!(merged, want, "{ranks} ranks");
    }
}
