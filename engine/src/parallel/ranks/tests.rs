use std::{collections::BTreeMap, sync::Arc, time::Duration};

use super::*;
use crate::{
    config::ExpertFormat,
    model::Model,
    parallel::{collective::InProcessGroup, expert::ExpertParallel},
    sampling::{SamplingParams, StopConditions},
    scheduler::{EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
};

fn checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("dir");
    let options = GenerateOptions::new(Preset::Tiny, 23, ExpertFormat::Nvfp4, dir.path());
    generate(&options).expect("generate");
    dir
}

fn request(id: u64, len: usize, max_tokens: u32) -> GenerationRequest {
    let mut rng = Rng::for_tensor(id, "ranks");
    GenerationRequest {
        id,
        prompt: (0..len)
            .map(|_| (rng.next_u64() % 129_280) as u32)
            .collect(),
        sampling: SamplingParams {
            temperature: 0.7,
            seed: Some(id),
            ..SamplingParams::default()
        },
        stop: StopConditions {
            max_tokens,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            eos_token_ids: vec![1],
        },
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        ..EngineConfig::default()
    }
}

/// `ranks` engines over the checkpoint, experts split among them, started in lockstep with a
/// control timeout of `timeout`: their runners.
fn ranks(dir: &std::path::Path, ranks: usize, timeout: Duration) -> Vec<Runner> {
    group(dir, ranks, timeout).runners().to_vec()
}

/// [`ranks`], as the group.
fn group(dir: &std::path::Path, ranks: usize, timeout: Duration) -> crate::parallel::group::Ranks {
    let experts_group = InProcessGroup::new(ranks, timeout);
    let control: Vec<Box<dyn Collective>> = InProcessGroup::new(ranks, timeout)
        .into_iter()
        .map(|r| Box::new(r) as Box<dyn Collective>)
        .collect();
    let engines: Vec<Engine> = experts_group
        .into_iter()
        .map(|rank| {
            let mut model = Model::load(dir).expect("load");
            let experts = model.config.n_routed_experts;
            let ep = ExpertParallel::new(Box::new(rank), experts).expect("split");
            model.set_expert_parallel(Arc::new(ep));
            Engine::new(model, config(), "ranks").expect("engine")
        })
        .collect();
    crate::parallel::group::Ranks::start(engines, control, "test", 1, false).expect("start")
}

/// Adds `req` on `runner` and gathers its events until its end.
async fn generate_on(runner: &Runner, req: GenerationRequest) -> Result<Vec<u32>, String> {
    let id = req.id;
    let mut events = runner
        .call(move |engine, subs| {
            engine.add(req).expect("add");
            subs.subscribe(id)
        })
        .await
        .expect("runner");
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token { sampled, .. } => tokens.push(sampled.token),
            Event::Finished { .. } => return Ok(tokens),
            Event::Failed { error, .. } => return Err(error),
            other => return Err(format!("unexpected {other:?}")),
        }
    }
    Err("the stream ended".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_in_lockstep_give_the_one_rank_tokens() {
    let dir = checkpoint();
    let reqs = [
        (1u64, 40usize, 5u32),
        (2, 3, 4),
        (3, 90, 3),
        (4, 17, 6),
        (5, 1, 2),
    ];
    let mut one =
        Engine::new(Model::load(dir.path()).expect("load"), config(), "one").expect("engine");
    for &(id, len, max) in &reqs {
        one.add(request(id, len, max)).expect("add");
    }
    let mut want: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for e in one.run_to_completion() {
        if let Event::Token { id, sampled, .. } = e {
            want.entry(id).or_default().push(sampled.token);
        }
    }
    for n in [2usize, 4] {
        let runners = ranks(dir.path(), n, Duration::from_secs(20));
        // Requests arrive at their ranks at once; rank 0 of 4 gets none of its own.
        let mut jobs = tokio::task::JoinSet::new();
        for &(id, len, max) in &reqs {
            let runner = runners[id as usize % n].clone();
            jobs.spawn(async move { (id, generate_on(&runner, request(id, len, max)).await) });
        }
        let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        while let Some(joined) = jobs.join_next().await {
            let (id, tokens) = joined.expect("task");
            got.insert(id, tokens.expect("generated"));
        }
        assert_eq!(got, want, "{n} ranks");
        // Idle again, then one more request: the group wakes for it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let again = generate_on(&runners[1], request(2, 3, 4))
            .await
            .expect("again");
        assert_eq!(again, want[&2]);
    }
}

/// A rank stalled past the control timeout: the other ranks' requests fail with an error
/// naming the lost lockstep within about the timeout, and later requests fail at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_rank_fails_the_others_requests_within_the_timeout() {
    let dir = checkpoint();
    let runners = ranks(dir.path(), 2, Duration::from_millis(800));
    // Rank 1 stalls for 3 s inside a job.
    runners[1]
        .post(|_, _| std::thread::sleep(Duration::from_secs(3)))
        .expect("post");
    let started = std::time::Instant::now();
    let result = generate_on(&runners[0], request(7, 30, 50)).await;
    let waited = started.elapsed();
    let error = result.expect_err("must fail");
    assert!(error.contains("lost lockstep"), "{error}");
    assert!(waited < Duration::from_secs(2), "failed after {waited:?}");
    let later = generate_on(&runners[0], request(8, 5, 2)).await;
    assert!(later.expect_err("must fail").contains("lost lockstep"));
}

/// A rank whose thread dies (a panic in its engine, as a crashed GPU context would end it):
/// the other ranks' requests fail within the timeout, and its own callers get an error rather
/// than waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_fails_the_group_within_the_timeout() {
    let dir = checkpoint();
    let runners = ranks(dir.path(), 2, Duration::from_millis(800));
    let started = std::time::Instant::now();
    let survivor = tokio::spawn({
        let runner = runners[0].clone();
        async move { generate_on(&runner, request(9, 30, 200)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    runners[1]
        .post(|_, _| panic!("rank 1 dies (test)"))
        .expect("post");
    let error = survivor.await.expect("task").expect_err("must fail");
    assert!(error.contains("lost lockstep"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The dead rank's callers are told at once.
    let dead = runners[1].call(|engine, _| engine.is_idle()).await;
    assert!(dead.is_err(), "a dead rank must not answer");
}

/// A rank's expert exchange failed (its step failed on its device, or here, and failed the
/// group's collective for its peers): the others' requests fail with that error at once, the
/// group reports itself failed (the worker stops serving) without waiting for the control
/// timeout, and later requests fail at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_expert_exchange_stops_the_group_at_once() {
    let dir = checkpoint();
    let group = group(dir.path(), 2, Duration::from_secs(30));
    let runners = group.runners().to_vec();
    runners[1]
        .call(|engine, _| {
            if let Some(ep) = engine.model().expert_parallel() {
                ep.fail("a planted device failure");
            }
        })
        .await
        .expect("call");
    let started = std::time::Instant::now();
    let error = generate_on(&runners[0], request(11, 30, 20))
        .await
        .expect_err("must fail");
    assert!(error.contains("a planted device failure"), "{error}");
    let reason = tokio::time::timeout(Duration::from_secs(5), group.failed())
        .await
        .expect("the group reports itself failed");
    assert!(
        reason.contains("expert-parallel exchanges failed"),
        "{reason}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let later = generate_on(&runners[0], request(12, 5, 2)).await;
    assert!(later.expect_err("must fail").contains("failed"));
}
