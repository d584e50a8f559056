//! The scheduler's side of a decode device: with one attached, requests produce exactly the
//! events they produce without (tokens, log-probabilities, finishes, usage), the decode tokens
//! step on the device, slots and pages come back, a failing device fails its requests with its
//! words, and what a device cannot serve is refused at attach.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use engine::{
    config::ExpertFormat,
    model::{Model, SequenceState},
    paged::layout::{KvStorage, RowFormat},
    sampling::{SamplingParams, StopConditions},
    scheduler::{
        DecodeSeat, DeviceError, Engine, EngineConfig, EngineError, Event, GenerationRequest,
        HostStepDevice, PromptChunk, PromptOut, StepDevice,
    },
    synth::{GenerateOptions, Preset, Rng, generate},
};

/// The tiny checkpoint every test here uses.
fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 21, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    dir
}

fn model() -> Model {
    Model::load(checkpoint().path()).unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        num_pages: 96,
        max_running: 3,
        max_batch_tokens: 64,
        kv: KvStorage::F32,
        prefix_cache: true,
    }
}

/// The reference device, counting the sequences it stepped and failing from step `fail_at`.
#[derive(Debug)]
struct Counted {
    inner: HostStepDevice,
    seats: Arc<AtomicUsize>,
    steps: usize,
    fail_at: Option<usize>,
    /// A slot whose logits come back NaN.
    nan_slot: Option<usize>,
    /// Prompt tokens it stepped.
    prompt_tokens: Arc<AtomicUsize>,
}

impl StepDevice for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens()
    }
    fn kv_rows(&self) -> RowFormat {
        self.inner.kv_rows()
    }
    fn load(&mut self, slot: usize, state: &SequenceState) -> Result<(), DeviceError> {
        self.inner.load(slot, state)
    }
    fn step(&mut self, seats: &[DecodeSeat]) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.steps += 1;
        if self.fail_at.is_some_and(|n| self.steps >= n) {
            return Err(DeviceError::device(
                "launch failed: unspecified launch failure",
            ));
        }
        self.seats.fetch_add(seats.len(), Ordering::Relaxed);
        let mut out = self.inner.step(seats)?;
        for (seat, row) in seats.iter().zip(&mut out) {
            if Some(seat.slot) == self.nan_slot {
                row[7] = f32::NAN;
            }
        }
        Ok(out)
    }
    fn read(&mut self, slot: usize, len: usize) -> Result<SequenceState, DeviceError> {
        self.inner.read(slot, len)
    }
    fn prompt_chunk(&self) -> usize {
        self.inner.prompt_chunk()
    }
    fn prompt_step(&mut self, chunks: &[PromptChunk<'_>]) -> Result<Vec<PromptOut>, DeviceError> {
        self.steps += 1;
        if self.fail_at.is_some_and(|n| self.steps >= n) {
            return Err(DeviceError::device(
                "launch failed: an illegal memory access",
            ));
        }
        let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        self.prompt_tokens.fetch_add(tokens, Ordering::Relaxed);
        let mut out = self.inner.prompt_step(chunks)?;
        for (chunk, o) in chunks.iter().zip(&mut out) {
            if Some(chunk.slot) == self.nan_slot
                && let Some(row) = o.logits.last_mut()
            {
                row[7] = f32::NAN;
            }
        }
        Ok(out)
    }
}

fn counted(model: &Model, config: &EngineConfig) -> (Counted, Arc<AtomicUsize>) {
    let seats = Arc::new(AtomicUsize::new(0));
    (counting_into(model, config, &seats), seats)
}

/// The reference device for `config`'s engine, counting its stepped sequences into `seats`.
fn counting_into(model: &Model, config: &EngineConfig, seats: &Arc<AtomicUsize>) -> Counted {
    let tokens = config.num_pages as usize * config.page_size;
    Counted {
        inner: HostStepDevice::new(model.replica(), config.max_running, tokens),
        seats: Arc::clone(seats),
        steps: 0,
        fail_at: None,
        nan_slot: None,
        prompt_tokens: Arc::default(),
    }
}

fn requests() -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(5, "device");
    let mut draw =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % 129_280) as u32).collect() };
    let shared = draw(40);
    (0..7u64)
        .map(|id| {
            let mut prompt = draw([3, 30, 1, 17, 50, 9, 33][id as usize]);
            if id % 3 == 1 {
                // The prefix cache in play: a shared prompt start.
                prompt = [&shared[..], &prompt[..]].concat();
            }
            let sampling = SamplingParams {
                temperature: [0.0, 0.8, 1.3][id as usize % 3],
                top_p: 0.9,
                seed: Some(id * 7 + 1),
                logprobs: id % 2 == 0,
                top_logprobs: if id == 4 { 3 } else { 0 },
                prompt_logprobs: (id == 2).then_some(2),
                ..SamplingParams::default()
            };
            GenerationRequest {
                id,
                prompt,
                sampling,
                stop: StopConditions {
                    max_tokens: [12, 5, 20, 9, 14, 1, 25][id as usize],
                    min_tokens: 0,
                    stop_token_ids: if id == 6 { vec![77] } else { vec![] },
                    ignore_eos: true,
                    eos_token_ids: vec![1],
                },
            }
        })
        .collect()
}

/// Runs `requests` (two at first, the rest arriving while those decode) to completion.
fn run(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Event> {
    let mut events = Vec::new();
    for r in &requests[..2] {
        engine.add(r.clone()).unwrap();
    }
    for _ in 0..3 {
        events.extend(engine.step());
    }
    for r in &requests[2..] {
        engine.add(r.clone()).unwrap();
    }
    events.extend(engine.run_to_completion());
    events
}

#[test]
fn a_decode_device_gives_the_events_of_the_host_forward() {
    for kv in KvStorage::ALL {
        decode_device_gives_the_events_of_the_host_forward(kv);
    }
}

fn decode_device_gives_the_events_of_the_host_forward(kv: KvStorage) {
    let mut model = model();
    // The device rounds K=V rows as the engine stores them.
    model.set_kv_storage(kv);
    let config = EngineConfig { kv, ..config() };
    let mut host = Engine::new(model.replica(), config.clone(), "t").unwrap();
    let mut on_device = Engine::new(model.replica(), config.clone(), "t").unwrap();
    let (device, seats) = counted(&model, &config);
    on_device.set_step_device(Box::new(device)).unwrap();
    assert_eq!(on_device.step_device(), Some("counted"));
    let requests = requests();
    let want = run(&mut host, &requests);
    let got = run(&mut on_device, &requests);
    assert_eq!(got, want);
    let tokens = want
        .iter()
        .filter(|e| matches!(e, Event::Token { .. }))
        .count();
    let finished = want
        .iter()
        .filter(|e| matches!(e, Event::Finished { .. }))
        .count();
    assert_eq!(finished, requests.len(), "{want:?}");
    // Every token but each request's first (sampled from its prompt's logits) was decoded
    // on the device; 7 requests through 3 slots: the slots came back.
    assert_eq!(seats.load(Ordering::Relaxed), tokens - requests.len());
    let store = on_device.store();
    assert_eq!(store.pages().used_count(), store.prefix().len());
}

/// A device that steps prompt chunks too gives every request the events of the host forward
/// (its tokens, log-probabilities, prompt log-probabilities, finish and usage, prefix-cache
/// hits counted the same), whatever its chunk against the page size: every prompt token the
/// cache did not supply stepped on the device, and the pages it stored hold the prompts as the
/// host's do (a later request finds them in the prefix cache).
#[test]
fn a_device_stepping_prompts_gives_each_request_the_host_forwards_events() {
    let mut model = model();
    // Chunks of a page, shorter, and longer (64 tokens over pages of 16), with the prefix cache
    // and without.
    for (kv, chunk, prefix_cache) in [
        (KvStorage::F32, 16, true),
        (KvStorage::Fp8, 5, true),
        (KvStorage::F32, 64, true),
        (KvStorage::F32, 64, false),
        (KvStorage::Bf16, 7, true),
    ] {
        model.set_kv_storage(kv);
        let config = EngineConfig {
            kv,
            prefix_cache,
            ..config()
        };
        let mut host = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let mut on_device = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let (mut device, seats) = counted(&model, &config);
        device.inner = HostStepDevice::new(model.replica(), 3, 96 * 16).with_prompts(chunk);
        let prompt_tokens = Arc::clone(&device.prompt_tokens);
        on_device.set_step_device(Box::new(device)).unwrap();
        // Each step that stepped prompt chunks on the device says so (the metrics count it).
        let prompt_steps = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&prompt_steps);
        on_device.set_step_observer(engine::scheduler::StepObserver(Box::new(move |r| {
            counted.fetch_add(usize::from(r.device_prompts), Ordering::Relaxed);
        })));
        let requests = requests();
        let want = run(&mut host, &requests);
        let got = run(&mut on_device, &requests);
        let (want, got) = (Event::by_request(&want), Event::by_request(&got));
        assert_eq!(want.len(), requests.len());
        let usage = |events: &[Event]| match events.last() {
            Some(Event::Finished { usage, .. }) => *usage,
            other => panic!("{other:?}"),
        };
        // Chunks longer than a page cache the blocks inside them without a resumable state:
        // a later prompt resumes at a chunk's end, so fewer of its tokens may come from the
        // cache than on the host; everything else is the host's.
        let inner_blocks = prefix_cache && chunk > config.page_size;
        let uncached = |events: &[Event]| -> Vec<Event> {
            let mut events = events.to_vec();
            if let Some(Event::Finished { usage, .. }) = events.last_mut()
                && inner_blocks
            {
                usage.cached_tokens = 0;
            }
            events
        };
        for (id, events) in &want {
            let got = got.get(id).map(|e| uncached(e));
            assert_eq!(
                got,
                Some(uncached(events)),
                "{kv:?}, chunk {chunk}: request {id}"
            );
            assert!(usage(&got.unwrap_or_default()).cached_tokens <= usage(events).cached_tokens);
        }
        let computed: usize = got
            .values()
            .map(|e| usage(e).prompt_tokens - usage(e).cached_tokens)
            .sum();
        let cached: usize = want.values().map(|e| usage(e).cached_tokens).sum();
        assert_eq!(cached > 0, prefix_cache, "the prefix cache in play");
        assert_eq!(prompt_tokens.load(Ordering::Relaxed), computed);
        let steps = prompt_steps.load(Ordering::Relaxed);
        assert!(steps >= computed.div_ceil(64), "{steps} prompt steps");
        let decoded: usize = want.values().map(|e| usage(e).completion_tokens - 1).sum();
        assert_eq!(seats.load(Ordering::Relaxed), decoded);
        let store = on_device.store();
        assert_eq!(store.pages().used_count(), store.prefix().len());
    }
}

/// A failing prompt step fails the requests of it with the device's words; a NaN in a
/// chunk's logits fails that request alone; nothing leaks.
#[test]
fn a_failing_prompt_step_fails_its_requests() {
    let model = model();
    let config = config();
    let requests = requests();
    for (fail_at, nan_slot) in [(Some(2), None), (None, Some(2))] {
        let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let (mut device, _) = counted(&model, &config);
        device.inner = HostStepDevice::new(model.replica(), 3, 96 * 16).with_prompts(16);
        (device.fail_at, device.nan_slot) = (fail_at, nan_slot);
        engine.set_step_device(Box::new(device)).unwrap();
        let events = run(&mut engine, &requests);
        let failed: Vec<&String> = events
            .iter()
            .filter_map(|e| match e {
                Event::Failed { error, .. } => Some(error),
                _ => None,
            })
            .collect();
        assert!(!failed.is_empty());
        let words = if fail_at.is_some() {
            "counted prompt step: launch failed: an illegal memory access"
        } else {
            "counted prompt step: non-finite logit at 7"
        };
        assert!(failed.iter().any(|e| e.contains(words)), "{failed:?}");
        if nan_slot.is_some() {
            assert!(
                failed.len() < requests.len(),
                "only the NaN slot's requests"
            );
        }
        let ended = events
            .iter()
            .filter(|e| matches!(e, Event::Finished { .. } | Event::Failed { .. }))
            .count();
        assert_eq!(ended, requests.len());
        let store = engine.store();
        assert_eq!(store.pages().used_count(), store.prefix().len());
    }
}

#[test]
fn a_handed_over_state_decodes_on_the_device() {
    let model = model();
    let config = config();
    let req = &requests()[4];
    let mut outcomes = Vec::new();
    for with_device in [false, true] {
        let mut prefill = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let mut decode = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let (device, seats) = counted(&model, &config);
        if with_device {
            decode.set_step_device(Box::new(device)).unwrap();
        }
        prefill.add_prefill(req.clone()).unwrap();
        let events = prefill.run_to_completion();
        let (state, seed) = events
            .iter()
            .find_map(|e| match e {
                Event::Prefilled { state, seed, .. } => Some((state.clone(), *seed)),
                _ => None,
            })
            .unwrap();
        let first = events
            .iter()
            .find_map(|e| match e {
                Event::Token { sampled, .. } => Some(sampled.token),
                _ => None,
            })
            .unwrap();
        decode
            .reserve(req.id, req.prompt.len(), req.stop.max_tokens as usize)
            .unwrap();
        decode.import(req.id, &state).unwrap();
        assert!(decode.commit(req.clone(), first, seed).unwrap().is_none());
        let mut events = decode.step();
        events.extend(decode.step());
        if with_device {
            // The committed prompt plus the first token and one decoded token, on the device.
            let held = decode.device_state(req.id).unwrap().unwrap();
            assert_eq!(held.len, req.prompt.len() + 2);
        } else {
            assert!(decode.device_state(req.id).is_none());
        }
        events.extend(decode.run_to_completion());
        let decoded = events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
        assert_eq!(decoded, req.stop.max_tokens as usize - 1);
        let on_device = if with_device { decoded } else { 0 };
        assert_eq!(seats.load(Ordering::Relaxed), on_device);
        let store = decode.store();
        assert_eq!(store.pages().used_count(), store.prefix().len());
        outcomes.push(events);
    }
    assert_eq!(outcomes[1], outcomes[0]);
}

#[test]
fn a_failing_device_fails_its_requests_with_its_words() {
    let model = model();
    let config = config();
    let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
    let (mut device, _) = counted(&model, &config);
    device.fail_at = Some(3);
    engine.set_step_device(Box::new(device)).unwrap();
    let requests = requests();
    let events = run(&mut engine, &requests);
    let failed: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            Event::Failed { error, .. } => Some(error),
            _ => None,
        })
        .collect();
    assert!(!failed.is_empty());
    for error in &failed {
        assert!(
            error.contains("counted decode step: launch failed"),
            "{error}"
        );
    }
    // Request 5 asks for one token: its prompt's logits give it, it never decodes.
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Finished { id: 5, .. }))
    );
    let store = engine.store();
    assert_eq!(store.pages().used_count(), store.prefix().len());
    assert!(engine.is_idle());
}

#[test]
fn non_finite_logits_fail_only_their_request() {
    let model = model();
    let config = config();
    let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
    let (mut device, _) = counted(&model, &config);
    // Slots are handed out from 0: the first request to decode gets slot 0.
    device.nan_slot = Some(0);
    engine.set_step_device(Box::new(device)).unwrap();
    let requests = requests();
    engine.add(requests[0].clone()).unwrap();
    engine.add(requests[3].clone()).unwrap();
    let events = engine.run_to_completion();
    let failed: Vec<(u64, &String)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Failed { id, error } => Some((*id, error)),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].1.contains("finite"), "{}", failed[0].1);
    let other = if failed[0].0 == 0 { 3 } else { 0 };
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Finished { id, .. } if *id == other))
    );
}

#[test]
fn what_a_device_cannot_serve_is_refused_at_attach() {
    let model = model();
    let config = config();
    let refused = |config: &EngineConfig, slots: usize, tokens: usize| -> String {
        let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
        let device = HostStepDevice::new(model.replica(), slots, tokens);
        match engine.set_step_device(Box::new(device)) {
            Err(e @ EngineError::Device(_)) => e.to_string(),
            other => panic!("{other:?}"),
        }
    };
    let pool = config.num_pages as usize * config.page_size;
    let e = refused(&config, 2, pool);
    assert!(e.contains("2 slots for max_running 3"), "{e}");
    let e = refused(&config, 3, pool - 1);
    assert!(e.contains(&format!("may reach {pool}")), "{e}");
    // A device whose model keeps f32 rows, for an engine that stores FP8 rows.
    let fp8 = EngineConfig {
        kv: KvStorage::Fp8,
        ..config.clone()
    };
    let e = refused(&fp8, 3, pool);
    assert!(
        e.contains("rounds K=V rows to F32") && e.contains("kv_cache_dtype"),
        "{e}"
    );
    // Attached only to an idle engine.
    let mut engine = Engine::new(model.replica(), config.clone(), "t").unwrap();
    engine.add(requests()[0].clone()).unwrap();
    let _ = engine.step();
    let device = HostStepDevice::new(model.replica(), 3, pool);
    let e = engine.set_step_device(Box::new(device)).unwrap_err();
    assert!(e.to_string().contains("requests are running"), "{e}");
}

/// A worker's engine started with a decode device (`RankDevices::decode`): no backend attached,
/// the device attached and named in the plan, requests served through the runner with the host
/// forward's tokens; a group of ranks is refused a device that does not exchange over it.
#[test]
fn a_runner_starts_an_engine_decoding_on_its_device() {
    use engine::{
        backend::BackendError,
        parallel::group::GroupSpec,
        start::{RankDevices, StartError, start_with_backend},
        weights::LoadProgress,
    };
    let dir = checkpoint();
    let seats = Arc::new(AtomicUsize::new(0));
    let opened_with = Arc::clone(&seats);
    let open = move |model: &Model, config: &EngineConfig, _rank: usize| {
        let device = counting_into(model, config, &opened_with);
        Ok::<Box<dyn StepDevice>, BackendError>(Box::new(device))
    };
    let devices = RankDevices {
        decode: Some(&open),
        ..RankDevices::CPU
    };
    let progress = Arc::new(LoadProgress::new());
    let loaded = start_with_backend(
        dir.path(),
        config(),
        "decode-device",
        devices,
        GroupSpec::SINGLE,
        &progress,
    )
    .unwrap();
    let plan = loaded.backend_plan.as_ref().unwrap();
    assert!(!plan.is_hybrid());
    assert!(
        plan.to_string()
            .starts_with("counted (the whole decode step on the device) backend runs"),
        "{plan}"
    );
    let req = requests()[0].clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let job = req.clone();
    let (named, events) = runtime
        .block_on(loaded.ranks.first().call(move |engine, _| {
            engine.add(job).unwrap();
            (
                engine.step_device().map(str::to_owned),
                engine.run_to_completion(),
            )
        }))
        .unwrap();
    assert_eq!(named.as_deref(), Some("counted"));
    let mut host = Engine::new(model(), config(), "t").unwrap();
    host.add(req.clone()).unwrap();
    assert_eq!(events, host.run_to_completion());
    assert_eq!(
        seats.load(Ordering::Relaxed),
        req.stop.max_tokens as usize - 1
    );

    let mut group = GroupSpec::SINGLE;
    group.parallel.ep = 2;
    group.parallel.dp_attention = true;
    let refused = start_with_backend(
        dir.path(),
        config(),
        "decode-device",
        devices,
        group,
        &progress,
    )
    .unwrap_err();
    // A device that does not exchange its routed experts' pairs cannot step a rank of an
    // expert-parallel group.
    assert!(matches!(&refused, StartError::Group(_)), "{refused}");
    assert!(
        refused.to_string().contains(
            "does not exchange over an expert-parallel group and this engine's model is a rank"
        ),
        "{refused}"
    );
}
