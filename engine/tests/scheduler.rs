//! The serving loop: continuous batching gives every request exactly the tokens it gets when
//! running alone, under random arrivals, page pressure and prefix sharing; pages come back.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::collections::BTreeMap;

use engine::{
    config::ExpertFormat,
    model::Model,
    sampling::{FinishReason, SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, EngineError, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn load() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 12, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, temperature: f32) -> GenerationRequest {
    GenerationRequest {
        id,
        prompt,
        sampling: SamplingParams {
            temperature,
            top_p: 0.9,
            seed: Some(id * 31),
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

fn tokens_by_id(events: &[Event]) -> BTreeMap<u64, Vec<u32>> {
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for e in events {
        if let Event::Token { id, index, sampled } = e {
            let v = out.entry(*id).or_default();
            assert_eq!(*index, v.len(), "tokens arrive in order");
            v.push(sampled.token);
        }
    }
    out
}

fn engine(config: EngineConfig) -> Engine {
    let (_dir, model) = load();
    Engine::new(model, config, "test").unwrap()
}

#[test]
fn batched_requests_equal_solo_runs() {
    let mut rng = Rng::for_tensor(3, "sched");
    let shared: Vec<u32> = (0..140)
        .map(|_| (rng.next_u64() % 129_280) as u32)
        .collect();
    let requests: Vec<GenerationRequest> = (0..6u64)
        .map(|id| {
            let len = [5usize, 70, 150, 33, 129, 200][id as usize];
            let mut prompt: Vec<u32> = (0..len)
                .map(|_| (rng.next_u64() % 129_280) as u32)
                .collect();
            if id % 2 == 1 {
                // Half the requests share a long prefix (prefix cache in play).
                prompt = [&shared[..], &prompt[..]].concat();
            }
            request(
                id,
                prompt,
                6 + id as u32,
                if id % 3 == 0 { 0.0 } else { 0.8 },
            )
        })
        .collect();

    // Solo: each request alone in a fresh engine.
    let mut solo = BTreeMap::new();
    for req in &requests {
        let mut e = engine(EngineConfig::default());
        e.add(req.clone()).unwrap();
        solo.extend(tokens_by_id(&e.run_to_completion()));
    }

    // Together, with staggered arrivals, a small token budget and a tight page pool.
    let config = EngineConfig {
        page_size: 16,
        num_pages: 48,
        max_running: 3,
        max_batch_tokens: 40,
        ..EngineConfig::default()
    };
    let mut e = engine(config);
    let mut events = Vec::new();
    let mut pending = requests.clone();
    let mut steps = 0;
    while !(pending.is_empty() && e.is_idle()) {
        if !pending.is_empty() && steps % 3 == 0 {
            e.add(pending.remove(0)).unwrap();
        }
        events.extend(e.step());
        steps += 1;
        assert!(steps < 5_000, "engine made no progress");
    }
    assert!(
        !events.iter().any(|e| matches!(e, Event::Failed { .. })),
        "{events:?}"
    );
    let together = tokens_by_id(&events);
    assert_eq!(together, solo);
    for req in &requests {
        assert_eq!(together[&req.id].len(), req.stop.max_tokens as usize);
    }
    let finished: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Finished { id, reason, usage } => Some((*id, *reason, *usage)),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), requests.len());
    assert!(finished.iter().all(|(_, r, _)| *r == FinishReason::Length));
    assert!(
        finished.iter().any(|(_, _, u)| u.cached_tokens > 0),
        "the shared prefix was served from the cache"
    );
    // Every page is either free or held by the prefix cache.
    let store = e.store();
    assert_eq!(store.pages().used_count(), store.prefix().len());
    assert_eq!(store.slots().used_count(), 0);
}

#[test]
fn oversized_and_invalid_requests_are_refused() {
    let mut e = engine(EngineConfig {
        page_size: 16,
        num_pages: 4,
        ..EngineConfig::default()
    });
    let err = e.add(request(1, vec![3; 60], 10, 0.0)).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::TooLarge {
                needed: 5,
                total: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        e.add(request(2, vec![], 1, 0.0)),
        Err(EngineError::EmptyPrompt)
    ));
    let err = e.add(request(3, vec![200_000], 1, 0.0)).unwrap_err();
    assert!(err.to_string().contains("prompt"), "{err}");
    let mut bad = request(4, vec![1, 2], 1, 0.0);
    bad.sampling.top_p = 0.0;
    assert!(e.add(bad).unwrap_err().to_string().contains("top_p"));
    e.add(request(5, vec![1, 2], 1, 0.0)).unwrap();
    assert!(matches!(
        e.add(request(5, vec![1], 1, 0.0)),
        Err(EngineError::DuplicateId(5))
    ));
}

#[test]
fn cancel_releases_everything() {
    let mut e = engine(EngineConfig {
        page_size: 16,
        num_pages: 64,
        ..EngineConfig::default()
    });
    e.add(request(1, vec![7; 100], 50, 0.0)).unwrap();
    e.add(request(2, vec![8; 30], 50, 0.0)).unwrap();
    e.step();
    e.step();
    assert!(e.store().pages().used_count() > 0);
    assert_eq!(e.cancel(1), Some(Event::Cancelled { id: 1 }));
    assert_eq!(e.cancel(2), Some(Event::Cancelled { id: 2 }));
    assert_eq!(e.cancel(2), None);
    assert!(e.is_idle());
    let store = e.store();
    assert_eq!(store.pages().used_count(), store.prefix().len());
    assert_eq!(store.slots().used_count(), 0);
}

/// A prompt computed in one chunk caches every full block it completed (compressor snapshots
/// at each boundary), and a later request sharing a prefix reuses all of them, bit-exactly.
#[test]
fn one_chunk_prefill_caches_every_block() {
    let config = EngineConfig {
        page_size: 16,
        num_pages: 256,
        max_running: 4,
        max_batch_tokens: 512,
        kv: engine::paged::layout::KvStorage::F32,
        prefix_cache: true,
    };
    let mut cached = engine(config.clone());
    let mut fresh = engine(EngineConfig {
        prefix_cache: false,
        ..config
    });
    let mut rng = Rng::for_tensor(9, "one-chunk");
    let a: Vec<u32> = (0..150)
        .map(|_| (rng.next_u64() % 129_280) as u32)
        .collect();
    let mut b: Vec<u32> = a[..141].to_vec();
    b.extend((0..30).map(|_| (rng.next_u64() % 129_280) as u32));
    cached.add(request(1, a, 3, 0.0)).unwrap();
    cached.run_to_completion();
    // 150 tokens in one chunk: blocks 1..=9 (positions 16..144) complete inside it.
    assert_eq!(cached.store().prefix().len(), 9);
    cached.add(request(2, b.clone(), 6, 0.7)).unwrap();
    let events = cached.run_to_completion();
    let usage = events
        .iter()
        .find_map(|e| match e {
            Event::Finished { usage, .. } => Some(*usage),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        usage.cached_tokens, 128,
        "the 8 full blocks of the shared 141 tokens"
    );
    fresh.add(request(2, b, 6, 0.7)).unwrap();
    assert_eq!(
        tokens_by_id(&events),
        tokens_by_id(&fresh.run_to_completion()),
        "a cache hit equals a miss"
    );
}

#[test]
fn step_records_count_computed_cached_and_decoded_tokens() {
    use std::sync::{Arc, Mutex};
    let mut e = engine(EngineConfig {
        page_size: 16,
        num_pages: 256,
        max_running: 4,
        max_batch_tokens: 40,
        kv: engine::paged::layout::KvStorage::F32,
        prefix_cache: true,
    });
    let records: Arc<Mutex<Vec<engine::scheduler::StepRecord>>> = Arc::default();
    let seen = Arc::clone(&records);
    e.set_step_observer(engine::scheduler::StepObserver(Box::new(move |r| {
        seen.lock().unwrap().push(*r);
    })));
    let mut rng = Rng::for_tensor(4, "records");
    let prompt: Vec<u32> = (0..70).map(|_| (rng.next_u64() % 129_280) as u32).collect();
    e.add(request(1, prompt.clone(), 5, 0.0)).unwrap();
    e.run_to_completion();
    e.add(request(2, prompt, 5, 0.0)).unwrap();
    e.run_to_completion();
    let records = records.lock().unwrap();
    let sum = |f: fn(&engine::scheduler::StepRecord) -> usize| records.iter().map(f).sum::<usize>();
    assert_eq!(sum(|r| r.admitted), 2);
    // The second prompt finds its 4 full blocks (64 tokens) cached and computes 6.
    assert_eq!(sum(|r| r.cached_tokens), 64);
    assert_eq!(sum(|r| r.prompt_tokens), 70 + 6);
    // The first token of each comes with its prompt; 4 more are decoded each.
    assert_eq!(sum(|r| r.decode_tokens), 8);
    assert!(records.iter().all(|r| r.requests >= 1 && r.seconds >= 0.0));
    // A 40-token budget is cut at a page boundary: the first chunk is 32 tokens.
    assert_eq!(records[0].prompt_tokens, 32);
}

/// The prompt's log-probabilities, computed in chunks of a busy engine with the prefix
/// cache warm, equal log-softmax of the whole prompt's logits computed in one forward pass;
/// the first generated token is the one the same request gets without them.
#[test]
fn prompt_logprobs_are_the_whole_prompts_log_softmax() {
    let (_dir, model) = load();
    let mut rng = Rng::for_tensor(5, "prompt-logprobs");
    // Awkward length: several chunks of a 16-token page, the last one partial.
    let prompt: Vec<u32> = (0..83).map(|_| (rng.next_u64() % 129_280) as u32).collect();
    let mut state = model.new_state();
    let whole = model
        .forward(&mut state, &prompt, engine::model::Logits::All)
        .unwrap();
    let config = EngineConfig {
        page_size: 16,
        max_batch_tokens: 40,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(model, config, "test").unwrap();
    // The same prompt first without them: its blocks enter the prefix cache.
    e.add(request(1, prompt.clone(), 3, 0.0)).unwrap();
    let plain = tokens_by_id(&e.run_to_completion());
    let mut asked = request(2, prompt.clone(), 3, 0.0);
    asked.sampling.prompt_logprobs = Some(4);
    e.add(asked).unwrap();
    e.add(request(3, prompt[..50].to_vec(), 2, 0.0)).unwrap();
    let events = e.run_to_completion();
    assert_eq!(tokens_by_id(&events)[&2], plain[&1], "the same tokens");
    let entries: Vec<_> = events
        .iter()
        .filter_map(|ev| match ev {
            Event::PromptLogprobs { id: 2, entries } => Some(entries.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(entries.len(), 1, "sent once");
    let entries = &entries[0];
    assert_eq!(entries.len(), prompt.len() - 1);
    let first = events
        .iter()
        .position(|ev| {
            matches!(
                ev,
                Event::Token {
                    id: 2,
                    index: 0,
                    ..
                }
            )
        })
        .unwrap();
    let listed = events
        .iter()
        .position(|ev| matches!(ev, Event::PromptLogprobs { id: 2, .. }))
        .unwrap();
    assert!(listed < first, "before the first token");
    assert!(
        !events
            .iter()
            .any(|ev| matches!(ev, Event::PromptLogprobs { id: 1 | 3, .. })),
        "only when asked for"
    );
    for (p, entry) in entries.iter().enumerate() {
        let row = &whole[p];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = f64::from(max)
            + row
                .iter()
                .map(|&l| (f64::from(l) - f64::from(max)).exp())
                .sum::<f64>()
                .ln();
        let want = |t: u32| (f64::from(row[t as usize]) - lse) as f32;
        assert_eq!(entry.token, prompt[p + 1]);
        let got = entry.logprob.unwrap();
        assert!(
            (got - want(prompt[p + 1])).abs() <= 1e-5,
            "position {}: {got} vs {}",
            p + 1,
            want(prompt[p + 1])
        );
        assert_eq!(entry.top_logprobs.len(), 4);
        let mut ranked: Vec<u32> = (0..row.len() as u32).collect();
        ranked.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        for (k, &(t, lp)) in entry.top_logprobs.iter().enumerate() {
            assert_eq!(t, ranked[k], "position {} rank {k}", p + 1);
            assert!((lp - want(t)).abs() <= 1e-5);
        }
    }
}

#[test]
fn prompt_logprobs_above_twenty_are_refused() {
    let mut e = engine(EngineConfig::default());
    let mut req = request(1, vec![5, 6, 7], 2, 0.0);
    req.sampling.prompt_logprobs = Some(21);
    let err = e.add(req).unwrap_err().to_string();
    assert!(err.contains("prompt_logprobs"), "{err}");
}

/// Constrained requests sampled side by side in one step (their masks computed in parallel)
/// get exactly the tokens each gets alone.
#[test]
fn constrained_requests_in_one_batch_equal_solo_runs() {
    use engine::grammar::TokenTableSource;
    use engine::sampling::{Grammar, OutputConstraint};
    let path = common::assets::deepseek_v4_tokenizer().expect("run scripts/setup");
    let tokenizer_dir = path.parent().unwrap().to_path_buf();
    let table = TokenTableSource::from_dir(&tokenizer_dir, 129_280, &[1]);
    let requests: Vec<GenerationRequest> = (0..4u64)
        .map(|id| {
            let mut req = request(id, vec![7 + id as u32; 5 + 11 * id as usize], 24, 1.0);
            req.stop.ignore_eos = false;
            req.sampling.constraint = Some(OutputConstraint {
                grammar: Grammar::Regex("[a-z]{3,8}( [a-z]{2,6}){1,3}".to_owned()),
                start_after_token: None,
                whitespace_flexible: false,
            });
            req
        })
        .collect();
    let mut solo = BTreeMap::new();
    for req in &requests {
        let mut e = engine(EngineConfig::default());
        e.set_token_table(table.clone());
        e.add(req.clone()).unwrap();
        solo.extend(tokens_by_id(&e.run_to_completion()));
    }
    let mut e = engine(EngineConfig::default());
    e.set_token_table(table);
    for req in requests {
        e.add(req).unwrap();
    }
    let events = e.run_to_completion();
    assert!(
        !events.iter().any(|e| matches!(e, Event::Failed { .. })),
        "{events:?}"
    );
    assert_eq!(tokens_by_id(&events), solo);
}

/// With FP8 K=V rows a request's tokens and log-probabilities do not depend on how its prompt
/// is cut into chunks: not on the step budget, nor (through it) on the other requests of the
/// batch. Each row is rounded to its stored form as it is computed; rounding only when a
/// chunk's rows were stored gave a token its neighbours' rows exact inside its own chunk and
/// rounded across chunks, and greedy tokens that changed with the budget.
#[test]
fn fp8_rows_give_a_request_the_same_tokens_however_its_prompt_is_chunked() {
    let (_dir, model) = load();
    let mut rng = Rng::for_tensor(8, "fp8-chunks");
    let mut draw =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % 129_280) as u32).collect() };
    let mut req = request(1, draw(100), 8, 0.0);
    req.sampling.logprobs = true;
    let other = request(2, draw(90), 4, 0.0);
    let mut runs = Vec::new();
    for (budget, busy) in [(512, false), (64, false), (16, false), (40, true)] {
        let config = EngineConfig {
            page_size: 16,
            num_pages: 64,
            max_running: 2,
            max_batch_tokens: budget,
            kv: engine::paged::layout::KvStorage::Fp8,
            prefix_cache: false,
        };
        let mut engine = Engine::new(model.replica(), config, "t").unwrap();
        if busy {
            engine.add(other.clone()).unwrap();
            let _ = engine.step();
        }
        engine.add(req.clone()).unwrap();
        let sampled: Vec<_> = engine
            .run_to_completion()
            .into_iter()
            .filter_map(|e| match e {
                Event::Token { id: 1, sampled, .. } => Some(sampled),
                _ => None,
            })
            .collect();
        assert_eq!(sampled.len(), 8);
        runs.push(sampled);
    }
    for (i, run) in runs.iter().enumerate().skip(1) {
        assert_eq!(run, &runs[0], "run {i}");
    }
}
