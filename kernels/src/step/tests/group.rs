//! Expert-parallel ranks stepping on their devices (`device_group`): each rank a thread with
//! its own engine, requests and step device (over the kernels' references), holding `1/N` of
//! every layer's routed experts; every step the ranks meet at each MoE layer to exchange their
//! pairs, a rank without work of a phase taking part with an idle step. Every request's events
//! equal the one-rank host engine's, at 2 and 4 ranks, with prompts on the device or on the
//! host, though each rank's copies of the experts it does not hold are wrong on purpose.

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

use crate::step::{decoder::StepDecoder, emulated::EmulatedKernels};

fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    generate(&GenerateOptions {
        preset: Preset::Tiny,
        seed: 17,
        experts: ExpertFormat::Nvfp4,
        out: dir.path().to_path_buf(),
        tokenizer_dir: None,
    })
    .unwrap();
    dir
}

fn requests() -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(2, "ep-device-requests");
    [3usize, 70, 40, 1, 33, 29, 9]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerationRequest {
            id: i as u64 + 1,
            prompt: (0..len).map(|_| (rng.next_u64() % 1000) as u32).collect(),
            sampling: SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                seed: Some(i as u64 * 7),
                logprobs: true,
                top_logprobs: 2,
                prompt_logprobs: (i == 2).then_some(1),
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
        num_pages: 24,
        max_running: 3,
        max_batch_tokens: 48,
        ..EngineConfig::default()
    }
}

/// The requests' events on `ranks` expert-parallel ranks, each stepping on the emulated
/// device (prompt chunks of `chunk` tokens there too, or none: prompts on the host), by
/// request.
fn on_ranks(dir: &std::path::Path, ranks: usize, chunk: usize) -> BTreeMap<u64, Vec<Event>> {
    let experts = Model::load(dir).unwrap().config.n_routed_experts;
    let group = InProcessGroup::new(ranks, Duration::from_secs(30));
    // The ranks agree before each step whether any of them has work.
    let control = InProcessGroup::new(ranks, Duration::from_secs(30));
    let got: Vec<Vec<Event>> = thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .zip(control)
            .map(|(rank, mut control)| {
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
                    let tokens = config().num_pages as usize * config().page_size;
                    let kernels = EmulatedKernels::new(&engine.model().config);
                    let mut device = StepDecoder::new(
                        "emulated",
                        kernels,
                        engine.model(),
                        (3, tokens),
                        |_, _| Ok(()),
                    )
                    .unwrap();
                    if chunk > 0 {
                        device = device.with_prompts(chunk, |_, _| Ok(())).unwrap();
                    }
                    engine.set_step_device(Box::new(device)).unwrap();
                    for r in requests()
                        .into_iter()
                        .filter(|r| r.id as usize % ranks == me)
                    {
                        engine.add(r).unwrap();
                    }
                    let mut events = Vec::new();
                    for _ in 0..10_000 {
                        let busy = control
                            .all_gather(vec![f32::from(u8::from(!engine.is_idle()))])
                            .unwrap();
                        if busy.iter().all(|b| b[0] == 0.0) {
                            return events;
                        }
                        events.extend(engine.step());
                    }
                    panic!("rank {me} made no progress");
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    Event::by_request(&got.concat())
}

#[test]
fn expert_parallel_ranks_on_their_devices_give_the_one_rank_events() {
    let dir = checkpoint();
    let mut one = Engine::new(Model::load(dir.path()).unwrap(), config(), "ep").unwrap();
    for r in requests() {
        one.add(r).unwrap();
    }
    let want = Event::by_request(&one.run_to_completion());
    assert_eq!(want.len(), requests().len());
    assert!(
        want.values()
            .flatten()
            .all(|e| !matches!(e, Event::Failed { .. })),
        "{want:?}"
    );
    for (ranks, chunk) in [(2usize, 16usize), (2, 0), (4, 7)] {
        let got = on_ranks(dir.path(), ranks, chunk);
        assert_eq!(got, want, "{ranks} ranks, prompt chunks of {chunk}");
    }
}
