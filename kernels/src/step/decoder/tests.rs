//! The decode step as the engine's device: its events against the host forward's, its
//! read-backs, graphs and prompts.

use engine::{
    config::ExpertFormat,
    paged::layout::KvStorage,
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
};

use super::*;
use crate::step::emulated::EmulatedKernels;
use engine::model::Logits;

/// The tiny checkpoint of `seed`, loaded.
fn tiny(seed: u64) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, seed, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        num_pages: 24,
        max_running: 3,
        max_batch_tokens: 48,
        kv: KvStorage::F32,
        prefix_cache: true,
    }
}

fn requests(vocab: usize) -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(9, "decoder");
    (0..4u64)
        .map(|id| GenerationRequest {
            id,
            prompt: (0..[2, 21, 7, 40][id as usize])
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect(),
            sampling: SamplingParams {
                temperature: [0.0, 0.9][id as usize % 2],
                seed: Some(id + 3),
                // The first greedy without log-probabilities: its argmax on the device.
                logprobs: id != 0,
                top_logprobs: if id == 0 { 0 } else { 2 },
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: [6, 3, 9, 5][id as usize],
                min_tokens: 0,
                stop_token_ids: vec![],
                ignore_eos: true,
                eos_token_ids: vec![],
            },
        })
        .collect()
}

/// Three requests, a fourth arriving once they decode.
fn run(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Event> {
    let mut events = Vec::new();
    for r in &requests[..3] {
        engine.add(r.clone()).unwrap();
    }
    for _ in 0..3 {
        events.extend(engine.step());
    }
    engine.add(requests[3].clone()).unwrap();
    events.extend(engine.run_to_completion());
    events
}

/// A scheduler decoding on the device step (over the kernels' CPU references) produces
/// the events of one decoding with the host forward: every token, its log-probabilities,
/// the finishes; slots are reused (4 requests through 3) and the state read back from a
/// slot is the engine's.
#[test]
fn an_engine_decoding_on_the_device_step_gives_the_host_forwards_events() {
    let (_dir, mut model) = tiny(4);
    let c = config();
    let tokens = c.num_pages as usize * c.page_size;
    let requests = requests(model.config.vocab_size);
    let mut want = Vec::new();
    // FP8 and bf16 K=V rows too: the step rounds them as the engine does.
    // And with steps replayed as graphs (plan pass, then launch pass, over the references).
    for (kv, graphs) in [
        (KvStorage::Fp8, false),
        (KvStorage::F32, true),
        (KvStorage::Fp8, true),
        (KvStorage::Bf16, true),
        (KvStorage::F32, false),
    ] {
        model.set_kv_storage(kv);
        let c = EngineConfig { kv, ..c.clone() };
        let mut host = Engine::new(model.replica(), c.clone(), "t").unwrap();
        want = run(&mut host, &requests);
        let kernels = EmulatedKernels::new(&model.config);
        let mut decoder =
            StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(())).unwrap();
        if graphs {
            decoder = decoder.with_graphs(|_, _| Ok(())).unwrap();
        }
        let mut engine = Engine::new(model.replica(), c, "t").unwrap();
        engine.set_step_device(Box::new(decoder)).unwrap();
        // Each device step reports how it ran; the greedy request's tokens come back as
        // argmaxes.
        let records = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&records);
        engine.set_step_observer(engine::scheduler::StepObserver(Box::new(move |r| {
            seen.lock().unwrap().push((r.device_run, r.argmax_tokens));
        })));
        let got = run(&mut engine, &requests);
        let records = records.lock().unwrap().clone();
        let runs: Vec<DeviceRun> = records.iter().filter_map(|r| r.0).collect();
        assert!(!runs.is_empty());
        // (These short, changing batches repeat no step's launches: none is replayed.)
        assert!(
            runs.iter()
                .all(|r| *r == DeviceRun::AsItCame || (graphs && *r == DeviceRun::LaunchPass)),
            "{kv:?}: {runs:?}"
        );
        let argmaxes: usize = records.iter().map(|r| r.1).sum();
        assert!(argmaxes > 0, "{kv:?}");
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{kv:?}, graphs {graphs}");
        }
        assert!(want.iter().all(|e| !matches!(e, Event::Failed { .. })));
        let finished = want
            .iter()
            .filter(|e| matches!(e, Event::Finished { .. }))
            .count();
        assert_eq!(finished, 4);
        let store = engine.store();
        assert_eq!(store.pages().used_count(), store.prefix().len());
    }

    // Mid-run, a slot holds the state the engine's forward reached.
    let mut engine = Engine::new(model.replica(), c.clone(), "t").unwrap();
    let kernels = EmulatedKernels::new(&model.config);
    let decoder =
        StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(())).unwrap();
    engine.set_step_device(Box::new(decoder)).unwrap();
    let req = &requests[2];
    engine.add(req.clone()).unwrap();
    for _ in 0..3 {
        let _ = engine.step();
    }
    let held = engine.device_state(req.id).unwrap().unwrap();
    let mut state = model.new_state();
    let mut fed = req.prompt.clone();
    fed.extend(
        want.iter()
            .filter_map(|e| match e {
                Event::Token { id, sampled, .. } if *id == req.id => Some(sampled.token),
                _ => None,
            })
            .take(held.len - req.prompt.len()),
    );
    model
        .forward(&mut state, &fed, engine::model::Logits::None)
        .unwrap();
    assert_eq!(held, state.normalized(&model.config));
}

/// An engine stepping prompt chunks and decode tokens on the device step (over the
/// kernels' CPU references) gives every request the events of the host forward: a prompt
/// longer than several chunks, one shorter than a chunk, prompt log-probabilities, and a
/// prompt that extends another's (its first blocks from the prefix cache, stored from the
/// device's deltas); slots are reused, and the device refuses graphs beside prompts.
#[test]
fn an_engine_stepping_prompts_on_the_device_gives_the_host_forwards_events() {
    let (_dir, mut model) = tiny(4);
    let c = config();
    let tokens = c.num_pages as usize * c.page_size;
    let mut requests = requests(model.config.vocab_size);
    requests[2].sampling.prompt_logprobs = Some(2);
    let mut longer = requests[3].clone();
    longer.id = 4;
    longer.prompt.extend([5, 6, 7]);
    requests.push(longer);
    // Sharing only the first block of the fourth prompt: where that block was completed
    // inside a chunk it is not resumable, and the prompt is computed from its start.
    let mut sharing_one_block = requests[3].clone();
    sharing_one_block.id = 5;
    sharing_one_block.prompt.truncate(20);
    sharing_one_block.prompt.extend([11, 12, 13]);
    requests.push(sharing_one_block);
    // Chunks of a page, shorter (each ending on a page boundary), and longer: chunks of 36
    // over pages of 16 complete a block inside them (cached without its slot) and one at
    // their end (resumable), so the longer prompt still resumes at 32.
    for (kv, chunk) in [
        (KvStorage::Fp8, 16),
        (KvStorage::F32, 7),
        (KvStorage::Bf16, 9),
        (KvStorage::F32, 36),
    ] {
        model.set_kv_storage(kv);
        let c = EngineConfig { kv, ..c.clone() };
        let mut host = Engine::new(model.replica(), c.clone(), "t").unwrap();
        let mut want = run(&mut host, &requests[..4]);
        for r in &requests[4..] {
            host.add(r.clone()).unwrap();
            want.extend(host.run_to_completion());
        }
        let kernels = EmulatedKernels::new(&model.config);
        let decoder = StepDecoder::new("emulated", kernels, &model, (3, tokens), |_, _| Ok(()))
            .unwrap()
            .with_prompts(chunk, |_, _| Ok(()))
            .unwrap();
        assert_eq!(decoder.prompt_chunk(), chunk);
        let mut engine = Engine::new(model.replica(), c, "t").unwrap();
        engine.set_step_device(Box::new(decoder)).unwrap();
        let mut got = run(&mut engine, &requests[..4]);
        for r in &requests[4..] {
            engine.add(r.clone()).unwrap();
            got.extend(engine.run_to_completion());
        }
        // The tokens and log-probabilities are the host's; how much of a prompt came from
        // the cache is compared below (the host caches every block with its slot).
        let uncached = |events: Vec<Event>| -> Vec<Event> {
            events
                .into_iter()
                .map(|mut e| {
                    if let Event::Finished { usage, .. } = &mut e {
                        usage.cached_tokens = 0;
                    }
                    e
                })
                .collect()
        };
        let (want, got) = (Event::by_request(&want), Event::by_request(&got));
        assert_eq!(want.len(), 6);
        for (id, events) in &want {
            assert_eq!(
                got.get(id).cloned().map(uncached),
                Some(uncached(events.clone())),
                "{kv:?}, chunk {chunk}: request {id}"
            );
        }
        let cached = |events: &[Event]| match events.last() {
            Some(Event::Finished { usage, .. }) => usage.cached_tokens,
            other => panic!("{other:?}"),
        };
        assert!(
            cached(&got[&4]) >= 32,
            "the longer prompt's blocks came from the cache"
        );
        let first_block = if chunk > 16 { 0 } else { 16 };
        assert_eq!(cached(&got[&5]), first_block, "chunk {chunk}");
        let store = engine.store();
        assert_eq!(store.pages().used_count(), store.prefix().len());
    }
    let kernels = EmulatedKernels::new(&model.config);
    let mut decoder = StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(()))
        .unwrap()
        .with_prompts(8, |_, _| Ok(()))
        .unwrap();
    // A step of three chunks reads back twice: the wanted logits rows, then every delta.
    for slot in 0..3 {
        decoder.load(slot, &model.new_state()).unwrap();
    }
    let prompt: Vec<u32> = (0..8).collect();
    for (logits, reads) in [(Logits::None, 1), (Logits::Last, 2)] {
        let start = if logits == Logits::None { 0 } else { 8 };
        let chunks: Vec<PromptChunk<'_>> = (0..3)
            .map(|slot| PromptChunk {
                slot,
                start,
                tokens: &prompt[..8 - slot],
                logits,
            })
            .collect();
        decoder.kernels().take_reads();
        let outs = decoder.prompt_step(&chunks).unwrap();
        assert_eq!(decoder.kernels().take_reads().0, reads, "{logits:?}");
        for (c, out) in chunks.iter().zip(&outs) {
            assert_eq!(out.logits.len(), c.rows());
            assert_eq!(
                (out.delta.from, out.delta.to),
                (start, start + c.tokens.len())
            );
        }
        if logits == Logits::None {
            // The next chunks start where each sequence is: a whole 8 for all three.
            for slot in 1..3 {
                let rest = &prompt[8 - slot..];
                let chunk = PromptChunk {
                    slot,
                    start: 8 - slot,
                    tokens: rest,
                    logits: Logits::None,
                };
                decoder.prompt_step(&[chunk]).unwrap();
            }
        }
    }
    assert!(decoder.with_graphs(|_, _| Ok(())).is_err());
}

/// A greedy sequence without log-probabilities gets its argmax from the device: a step of
/// three sequences, two of them greedy, reads back 6 indices and one logits row, and gives
/// the argmaxes of the rows a plain step gives (and that row), with graphs or without.
#[test]
fn greedy_sequences_read_back_their_argmax_only() {
    let (_dir, model) = tiny(6);
    let vocab = model.config.vocab_size;
    let mut rng = Rng::for_tensor(2, "argmax");
    let mut random = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect()
    };
    let prompts = [random(5), random(17), random(9)];
    let open = |graphs: bool| {
        let kernels = EmulatedKernels::new(&model.config);
        let mut d = StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(())).unwrap();
        if graphs {
            d = d.with_graphs(|_, _| Ok(())).unwrap();
        }
        for (slot, prompt) in prompts.iter().enumerate() {
            let mut state = model.new_state();
            model
                .forward(&mut state, prompt, engine::model::Logits::None)
                .unwrap();
            d.load(slot, &state).unwrap();
        }
        d
    };
    let (mut plain, mut greedy, mut graphs) = (open(false), open(false), open(true));
    assert!(
        open(false).with_graphs(|_, _| Ok(())).is_err(),
        "after a load"
    );
    let argmax = [true, false, true];
    let mut runs = Vec::new();
    for step in 0..6 {
        let next = random(3);
        let seats: Vec<DecodeSeat> = (0..3)
            .map(|slot| DecodeSeat {
                slot,
                len: prompts[slot].len() + step,
                token: next[slot],
            })
            .collect();
        let rows = plain.step(&seats).unwrap();
        let want: Vec<DecodeOut> = rows
            .into_iter()
            .zip(argmax)
            .map(|(row, a)| DecodeOut::of(row, a))
            .collect();
        for d in [&mut greedy, &mut graphs] {
            d.kernels().take_reads();
            assert_eq!(
                d.step_outputs(&seats, &argmax).unwrap(),
                want,
                "step {step}"
            );
            assert_eq!(d.kernels().take_reads(), (2, 6 + vocab), "step {step}");
        }
        assert_eq!(greedy.last_run(), Some(DeviceRun::AsItCame));
        runs.push(graphs.last_run());
        assert!(matches!(want[0], DecodeOut::Argmax(_)));
    }
    // The same three sequences step after step: the later steps run as a graph would.
    assert!(runs.contains(&Some(DeviceRun::LaunchPass)), "{runs:?}");
}

/// Turning graphs on asks for the shared slot's bytes (one slot's arenas) and is refused
/// with the room's words when they do not fit.
#[test]
fn graphs_ask_room_for_their_shared_slot() {
    let (_dir, model) = tiny(6);
    let open = || {
        let kernels = EmulatedKernels::new(&model.config);
        StepDecoder::new("emulated", kernels, &model, (3, 64), |_, _| Ok(())).unwrap()
    };
    let one_slot = arena_bytes(&model.config, 1, 64, model.kv_rows());
    let refused = open()
        .with_graphs(|_, bytes| Err(crate::step::ShapeError(format!("{bytes} bytes"))))
        .unwrap_err();
    assert_eq!(refused.to_string(), format!("{one_slot} bytes"));
    let asked = std::cell::Cell::new(0);
    let d = open()
        .with_graphs(|_, bytes| {
            asked.set(bytes);
            Ok(())
        })
        .unwrap();
    assert_eq!((asked.get(), d.slots()), (one_slot, 3));
}

/// The arenas' bytes: the window ring of every layer, the compressors' rows at their
/// ratios, per slot; FP8 K=V rows take their stored bytes.
#[test]
fn arena_bytes_count_every_slot() {
    let c = Preset::Tiny.config(ExpertFormat::Nvfp4);
    let f32_rows = RowFormat::F32;
    let one = arena_bytes(&c, 1, 256, f32_rows);
    assert_eq!(arena_bytes(&c, 5, 256, f32_rows), 5 * one);
    assert!(
        arena_bytes(&c, 1, 512, f32_rows) > one,
        "compressed rows grow with length"
    );
    assert!(one >= 4 * c.layers.len() * c.sliding_window * c.head_dim);
    let fp8 = RowFormat::for_kv(&c, KvStorage::Fp8);
    let small = arena_bytes(&c, 1, 256, fp8);
    assert!(small < one, "{small} FP8 bytes, {one} f32");
    assert!(small >= c.layers.len() * c.sliding_window * fp8.row_bytes(c.head_dim));
}
