//! A scheduler decoding on the GPU (`StepDecoder` over `CudaKernels`: what a decode worker
//! with `backend = "cuda"` runs) gives the events of one decoding with the engine's host
//! forward: every token, its log-probabilities, the finishes, with requests arriving while
//! others decode and slots reused. The same check over the kernels' CPU references runs in CI
//! (`step::decoder`), so a failure here is a kernel that differs from its reference; and steps
//! replayed as CUDA graphs give the eager steps' bits. With the prompts stepped on the GPU too
//! (a prefill worker on cuda), each request's events are the host forward's. Skips without a GPU (fails under
//! `PDSERVE_REQUIRE_GPU=1`).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code")]

use std::sync::Arc;

use engine::{
    config::ExpertFormat,
    model::Model,
    paged::layout::KvStorage,
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
};
use kernels::{
    cuda::{CudaKernels, Gpu},
    step::decoder::StepDecoder,
};

fn run(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Event> {
    let mut events = Vec::new();
    for r in &requests[..3] {
        engine.add(r.clone()).unwrap();
    }
    for _ in 0..3 {
        events.extend(engine.step());
    }
    for r in &requests[3..] {
        engine.add(r.clone()).unwrap();
    }
    events.extend(engine.run_to_completion());
    events
}

/// [`run`] over all but the last request, then the last one alone (its prompt extends an
/// earlier one's: its first blocks come from the prefix cache).
fn run_then_last(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Event> {
    let (last, first) = requests.split_last().unwrap();
    let mut events = run(engine, first);
    engine.add(last.clone()).unwrap();
    events.extend(engine.run_to_completion());
    events
}

#[test]
fn gpu_decoding_engine_gives_the_host_forwards_events() {
    let Some(gpu) = Gpu::for_test("gpu_decoding_engine_gives_the_host_forwards_events") else {
        return;
    };
    let gpu = Arc::new(gpu);
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 4, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let config = EngineConfig {
        page_size: 16,
        num_pages: 32,
        max_running: 3,
        max_batch_tokens: 64,
        kv: KvStorage::F32,
        prefix_cache: true,
    };
    let mut rng = Rng::for_tensor(9, "gpu-decoder");
    let requests: Vec<GenerationRequest> = (0..5u64)
        .map(|id| GenerationRequest {
            id,
            prompt: (0..[2, 21, 7, 40, 130][id as usize])
                .map(|_| (rng.next_u64() % model.config.vocab_size as u64) as u32)
                .collect(),
            sampling: SamplingParams {
                temperature: [0.0, 0.9][id as usize % 2],
                seed: Some(id + 3),
                logprobs: true,
                top_logprobs: 2,
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: [6, 3, 9, 5, 12][id as usize],
                min_tokens: 0,
                stop_token_ids: vec![],
                ignore_eos: true,
                eos_token_ids: vec![],
            },
        })
        .collect();
    // The last request's prompt extends the fourth's: its first blocks from the prefix cache.
    let mut requests = requests;
    let mut longer = requests[3].clone();
    longer.id = 5;
    longer.prompt.extend([5, 6, 7]);
    longer.sampling.prompt_logprobs = Some(2);
    requests.push(longer);
    let mut host = Engine::new(model.replica(), config.clone(), "t").unwrap();
    let want = run_then_last(&mut host, &requests);
    let tokens = config.num_pages as usize * config.page_size;
    // And with its steps replayed as CUDA graphs; and with its prompts stepped on the GPU too
    // (chunks of a page, what a prefill worker on cuda runs): then the steps differ from the
    // host's, and each request's events are compared.
    for (graphs, prompts) in [(false, false), (true, false), (false, true)] {
        let kernels = CudaKernels::new(Arc::clone(&gpu));
        let mut decoder =
            StepDecoder::new("cuda", kernels, &model, (3, tokens), |_, _| Ok(())).unwrap();
        if graphs {
            decoder = decoder.with_graphs(|_, _| Ok(())).unwrap();
        }
        if prompts {
            decoder = decoder.with_prompts(16, |_, _| Ok(())).unwrap();
        }
        let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
        engine.set_step_device(Box::new(decoder)).unwrap();
        let got = run_then_last(&mut engine, &requests);
        assert_eq!(got.len(), want.len());
        if prompts {
            assert_eq!(
                Event::by_request(&got),
                Event::by_request(&want),
                "prompts on the GPU"
            );
        } else {
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g, w, "graphs {graphs}");
            }
        }
    }
    assert!(want.iter().all(|e| !matches!(e, Event::Failed { .. })));
}

/// Steps replayed as CUDA graphs (`graph_step`: a signature's second sighting recorded by
/// stream capture, later ones replayed after their plan pass) give the eager steps' logits bit
/// for bit, for 2 sequences from their first token over 80 steps (window closes on the way);
/// prints both step times.
#[test]
fn gpu_graph_steps_give_the_eager_steps_bits() {
    let Some(gpu) = Gpu::for_test("gpu_graph_steps_give_the_eager_steps_bits") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 12, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let stats = crate::step::graphs_against_eager(&Arc::new(gpu), &model, "tiny", &[0, 0], 80);
    assert!(
        stats.captured > 0 && stats.replayed > stats.captured,
        "{stats:?}"
    );
}

/// Expert-parallel ranks stepping on the GPU (`device_group`), both ranks on this one GPU with
/// their own contexts' streams and the in-process collectives: every request's events equal
/// the one-rank host engine's (each rank holds half of every layer's experts, its copies of
/// the others' wrong on purpose), with prompts on the GPU and on the host; and so do
/// tensor-parallel ranks (half the heads each), and ranks with every expert sliced between them
/// equal the host forward's sliced group. The same runs over the kernels' references are
/// CI's (`step::tests::group`).
#[test]
fn gpu_expert_parallel_ranks_give_the_one_rank_events() {
    use kernels::step::group_runs::{
        Split, on_group, on_group_host, on_ranks, one_rank, slot_tokens,
    };
    let Some(gpu) = Gpu::for_test("gpu_expert_parallel_ranks_give_the_one_rank_events") else {
        return;
    };
    drop(gpu);
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 17, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let want = one_rank(dir.path()).unwrap();
    for chunk in [16usize, 0] {
        let open = |model: &Model, _rank: usize| {
            let gpu = Gpu::open_on(0)
                .map_err(|e| e.to_string())?
                .ok_or("no GPU")?;
            let kernels = CudaKernels::new(Arc::new(gpu));
            let mut device =
                StepDecoder::new("cuda", kernels, model, (3, slot_tokens()), |_, _| Ok(()))
                    .map_err(|e| e.to_string())?;
            if chunk > 0 {
                device = device
                    .with_prompts(chunk, |_, _| Ok(()))
                    .map_err(|e| e.to_string())?;
            }
            Ok(Box::new(device) as Box<dyn engine::scheduler::StepDevice>)
        };
        let got = on_ranks(dir.path(), 2, &open).unwrap();
        assert_eq!(got, want, "2 ranks on one GPU, prompt chunks of {chunk}");
        // Tensor-parallel ranks: half the heads each, experts whole or split between them.
        for experts in [false, true] {
            let split = Split::Heads { experts };
            let got = on_group(dir.path(), (2, split), &open).unwrap();
            assert_eq!(got, want, "{split:?} on one GPU, prompt chunks of {chunk}");
        }
        // Every expert sliced between them: the host forward's sliced group, bit for bit.
        let sliced = on_group_host(dir.path(), (2, Split::Sliced)).unwrap();
        let got = on_group(dir.path(), (2, Split::Sliced), &open).unwrap();
        assert_eq!(
            got, sliced,
            "sliced experts on one GPU, prompt chunks of {chunk}"
        );
    }
}
