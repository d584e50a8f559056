//! The prefill/decode handoff between two engines: a prompt prefilled on one engine, its state
//! exported as page bytes and written into pages another engine reserved, continues there with
//! exactly the tokens and logprobs of a one-engine run. Prompt lengths are not multiples of the
//! compression ratios (4, 128), exceed the sliding window (16), and reach past the indexer's
//! top-k, so every kind of state (window rows, compressed rows, indexer keys, unfinished
//! compressor windows) must cross.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use engine::{
    config::ExpertFormat,
    model::Model,
    paged::layout::KvStorage,
    sampling::{FinishReason, Sampled, SamplingParams, StopConditions},
    scheduler::{
        Engine, EngineConfig, EngineError, Event, GenerationRequest, HandoffError, HostStepDevice,
        StateWrite,
    },
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn model() -> Model {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 5, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    Model::load(dir.path()).unwrap()
}

fn engine(kv: KvStorage, page_size: usize) -> Engine {
    let config = EngineConfig {
        page_size,
        num_pages: 256,
        max_running: 8,
        max_batch_tokens: 48,
        kv,
        prefix_cache: true,
    };
    Engine::new(model(), config, "handoff-test").unwrap()
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, temperature: f32) -> GenerationRequest {
    GenerationRequest {
        id,
        prompt,
        sampling: SamplingParams {
            temperature,
            top_p: 0.95,
            top_k: 40,
            presence_penalty: 0.3,
            repetition_penalty: 1.1,
            seed: (temperature > 0.0).then_some(id * 7 + 1),
            logprobs: true,
            top_logprobs: 3,
            ..SamplingParams::default()
        },
        stop: StopConditions {
            max_tokens,
            min_tokens: 0,
            stop_token_ids: vec![],
            ignore_eos: true,
            eos_token_ids: vec![1],
        },
    }
}

fn sampled_of(events: &[Event], id: u64) -> Vec<Sampled> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id: i, sampled, .. } if *i == id => Some(sampled.clone()),
            _ => None,
        })
        .collect()
}

/// Prefill on `p`, hand over to `d`, decode to the end; returns every sampled token.
fn handoff(p: &mut Engine, d: &mut Engine, req: &GenerationRequest) -> Vec<Sampled> {
    p.add_prefill(req.clone()).unwrap();
    let events = p.run_to_completion();
    let first = sampled_of(&events, req.id);
    assert_eq!(first.len(), 1, "a prefill-only request samples one token");
    let (state, seed, finish, cached) = events
        .iter()
        .find_map(|e| match e {
            Event::Prefilled {
                id,
                state,
                seed,
                finish,
                cached_tokens,
            } if *id == req.id => Some((state.clone(), *seed, *finish, *cached_tokens)),
            _ => None,
        })
        .expect("Prefilled event");
    if req.prompt.len() == 307 {
        assert!(
            cached >= 256,
            "the extended prompt reuses cached pages ({cached})"
        );
    }
    assert_eq!(state.prompt_len, req.prompt.len());
    assert!(
        finish.is_none(),
        "these requests decode more than one token"
    );
    assert_eq!(p.store().pages().used_count(), p.store().prefix().len());
    let reservation = d
        .reserve(req.id, req.prompt.len(), req.stop.max_tokens as usize)
        .unwrap();
    assert_eq!(
        reservation.pages.len(),
        (req.prompt.len() + req.stop.max_tokens as usize).div_ceil(d.store().layout.page_size)
    );
    // The decode side gets the state the way a transport delivers it: the parts streamed
    // during the forward pass, in order, then the slot. Assembled on zeroed pages, the parts
    // are the exported pages byte for byte.
    let parts: Vec<&StateWrite> = events
        .iter()
        .filter_map(|e| match e {
            Event::StatePart { id, writes } if *id == req.id => Some(writes),
            _ => None,
        })
        .flatten()
        .collect();
    let prefilled_at = events
        .iter()
        .position(|e| matches!(e, Event::Prefilled { .. }))
        .unwrap();
    assert!(
        events[prefilled_at..]
            .iter()
            .all(|e| !matches!(e, Event::StatePart { .. })),
        "every part precedes the end of the prefill"
    );
    let page_bytes = p.store().layout.page_bytes;
    let mut assembled = vec![vec![0u8; page_bytes]; state.pages.len()];
    let mut slot = Vec::new();
    for w in &parts {
        let target = if let Some(i) = w.page {
            &mut assembled[i]
        } else {
            slot.resize(w.bytes.len(), 0);
            &mut slot
        };
        target[w.offset..w.offset + w.bytes.len()].copy_from_slice(&w.bytes);
        d.write_state(req.id, w.page, w.offset, &w.bytes).unwrap();
    }
    assert!(
        assembled == state.pages,
        "streamed parts differ from the exported pages (prompt {})",
        req.prompt.len()
    );
    assert!(slot == state.slot, "the streamed slot differs");
    assert_eq!(d.commit(req.clone(), first[0].token, seed).unwrap(), None);
    let rest = d.run_to_completion();
    assert!(rest.iter().any(
        |e| matches!(e, Event::Finished { id, reason: FinishReason::Length, .. } if *id == req.id)
    ));
    [first, sampled_of(&rest, req.id)].concat()
}

/// A prefill engine whose prompts step on a device (the reference device, chunks of `chunk`
/// tokens): what it streams is stored from the device's deltas.
fn device_prefill(kv: KvStorage, page_size: usize, chunk: usize) -> Engine {
    let mut engine = engine(kv, page_size);
    let mut model = model();
    model.set_kv_storage(kv);
    let device = HostStepDevice::new(model, 8, 256 * page_size).with_prompts(chunk);
    engine.set_step_device(Box::new(device)).unwrap();
    engine
}

#[test]
fn handoff_continues_bit_exactly() {
    // A prompt chunk of 0: prompts on the host.
    for (kv, page_size, chunk) in [
        (KvStorage::F32, 16, 0),
        (KvStorage::Fp8, 64, 0),
        (KvStorage::F32, 4, 0),
        (KvStorage::F32, 16, 16),
        (KvStorage::Fp8, 64, 24),
        (KvStorage::F32, 4, 7),
        (KvStorage::Bf16, 16, 0),
        (KvStorage::Bf16, 16, 9),
    ] {
        let mut solo = engine(kv, page_size);
        let mut prefill = if chunk == 0 {
            engine(kv, page_size)
        } else {
            device_prefill(kv, page_size, chunk)
        };
        // A decode worker's engine: requests arrive with their prompts' state only.
        let mut decode = engine(kv, page_size);
        decode.set_decode_only();
        let refused = decode.add(request(99, vec![1, 2, 3], 2, 0.0)).unwrap_err();
        assert!(matches!(refused, EngineError::DecodeOnly), "{refused}");
        let mut rng = Rng::for_tensor(page_size as u64, "handoff");
        let mut previous: Vec<u32> = Vec::new();
        for (i, len) in [1usize, 3, 5, 17, 63, 130, 131, 262, 301, 307]
            .into_iter()
            .enumerate()
        {
            // The last prompt extends the one before: its leading pages come from the prefix
            // cache and are streamed before its first chunk.
            let prompt: Vec<u32> = if len == 307 {
                let mut p = previous.clone();
                p.extend((0..6).map(|_| (rng.next_u64() % 129_280) as u32));
                p
            } else {
                (0..len)
                    .map(|_| (rng.next_u64() % 129_280) as u32)
                    .collect()
            };
            previous.clone_from(&prompt);
            let temperature = if i % 2 == 0 { 0.0 } else { 0.8 };
            let req = request(i as u64 + 1, prompt, 9, temperature);
            solo.add(req.clone()).unwrap();
            let want = sampled_of(&solo.run_to_completion(), req.id);
            let got = handoff(&mut prefill, &mut decode, &req);
            assert_eq!(
                got, want,
                "{kv:?} page {page_size} chunk {chunk} prompt {len}"
            );
        }
        assert_eq!(decode.reservations(), 0);
        assert_eq!(
            decode.store().pages().used_count(),
            decode.store().prefix().len(),
            "decode pages return to the pool (cached blocks aside)"
        );
    }
}

#[test]
fn reservations_are_bounded_checked_and_released() {
    let mut d = engine(KvStorage::F32, 16);
    let free = d.store().pages().free_count();
    let r = d.reserve(1, 20, 10).unwrap();
    assert_eq!(r.pages.len(), 2);
    assert!(matches!(
        d.reserve(1, 5, 1),
        Err(EngineError::DuplicateId(1))
    ));
    let page_bytes = d.store().layout.page_bytes;
    // Writes past the page or the reservation are refused, not clamped.
    assert!(matches!(
        d.write_state(1, Some(0), page_bytes - 1, &[0, 0]),
        Err(HandoffError::OutOfBounds(_))
    ));
    assert!(matches!(
        d.write_state(1, Some(2), 0, &[0]),
        Err(HandoffError::OutOfBounds(_))
    ));
    assert!(matches!(
        d.write_state(9, Some(0), 0, &[0]),
        Err(HandoffError::UnknownReservation(9))
    ));
    // A commit that does not fit what was reserved is refused and keeps the reservation.
    let too_long = request(1, vec![7; 20], 30, 0.0);
    assert!(matches!(
        d.commit(too_long, 3, 0),
        Err(EngineError::Handoff(HandoffError::Mismatch(_)))
    ));
    assert_eq!(d.reservations(), 1);
    // Cancel releases a reservation like a request.
    assert_eq!(d.cancel(1), Some(Event::Cancelled { id: 1 }));
    assert_eq!(d.reservations(), 0);
    assert_eq!(d.store().pages().free_count(), free);
    // Pool exhaustion is an error, and nothing stays allocated.
    assert!(d.reserve(2, 16 * 300, 0).is_err());
    assert_eq!(d.store().pages().free_count(), free);
    // A first token that already ends the request finishes at commit.
    d.reserve(3, 4, 1).unwrap();
    let one = request(3, vec![5, 6, 7, 8], 1, 0.0);
    assert!(matches!(
        d.commit(one, 42, 0).unwrap(),
        Some(Event::Finished {
            reason: FinishReason::Length,
            ..
        })
    ));
    assert_eq!(d.store().pages().free_count(), free);
}

/// The slot (the compressors' unfinished windows) is part of the state: dropping it changes
/// the continuation, so the bit-exact comparison above really covers it.
#[test]
fn forgetting_the_slot_changes_the_answer() {
    let mut solo = engine(KvStorage::F32, 16);
    let mut p = engine(KvStorage::F32, 16);
    let mut d = engine(KvStorage::F32, 16);
    let mut rng = Rng::for_tensor(77, "slot");
    let prompt: Vec<u32> = (0..131)
        .map(|_| (rng.next_u64() % 129_280) as u32)
        .collect();
    let req = request(1, prompt, 12, 0.0);
    solo.add(req.clone()).unwrap();
    let want = sampled_of(&solo.run_to_completion(), 1);
    p.add_prefill(req.clone()).unwrap();
    let events = p.run_to_completion();
    let first = sampled_of(&events, 1)[0].token;
    let Some(Event::Prefilled { state, seed, .. }) = events
        .into_iter()
        .find(|e| matches!(e, Event::Prefilled { .. }))
    else {
        panic!("no Prefilled event");
    };
    d.reserve(1, 131, 12).unwrap();
    for (i, page) in state.pages.iter().enumerate() {
        d.write_state(1, Some(i), 0, page).unwrap();
    }
    d.commit(req, first, seed).unwrap();
    assert_eq!(
        first, want[0].token,
        "the first token comes from the prefill"
    );
    let got = sampled_of(&d.run_to_completion(), 1);
    assert_eq!(got.len(), want.len() - 1);
    assert_ne!(
        got.iter().map(|s| s.token).collect::<Vec<_>>(),
        want[1..].iter().map(|s| s.token).collect::<Vec<_>>(),
        "without the slot the decode must diverge"
    );
}
