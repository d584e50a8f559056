//! The in-process backend over the engine: generation, determinism, cancellation on drop.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::{Duration, Instant};

use engine::{
    config::ExpertFormat,
    model::Model,
    sampling::{FinishReason, SamplingParams, StopConditions},
    scheduler::EngineConfig,
    synth::{GenerateOptions, Preset, generate},
};
use futures::StreamExt;
use router::backend::{Backend, BackendError, BackendEvent, BackendRequest, LocalBackend};

fn backend() -> (tempfile::TempDir, LocalBackend, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 1, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let eos = model.config.eos_token_ids.clone();
    let config = EngineConfig {
        prefix_cache: false,
        num_pages: 64,
        ..EngineConfig::default()
    };
    (
        dir,
        LocalBackend::start(
            model,
            config,
            "test",
            engine::grammar::TokenTableSource::none(),
        )
        .unwrap(),
        eos,
    )
}

fn request(max_tokens: u32, seed: u64, eos: &[u32]) -> BackendRequest {
    BackendRequest {
        request_id: "test".to_owned(),
        prompt: vec![0, 128_803, 19_923, 128_804],
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        stop: StopConditions {
            max_tokens,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            eos_token_ids: eos.to_vec(),
        },
    }
}

async fn collect(backend: &LocalBackend, req: BackendRequest) -> (Vec<u32>, FinishReason) {
    let mut stream = backend.submit(req).await.unwrap();
    let mut ids = Vec::new();
    while let Some(event) = stream.next().await {
        match event {
            BackendEvent::Tokens(batch) => ids.extend(batch.iter().map(|t| t.id)),
            BackendEvent::Finished { reason, usage } => {
                assert_eq!(usage.completion_tokens, ids.len());
                return (ids, reason);
            }
            BackendEvent::Failed(e) => panic!("failed: {e}"),
            BackendEvent::PromptLogprobs(_) => panic!("prompt log-probabilities not asked for"),
        }
    }
    panic!("stream ended without Finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generates_deterministically_and_cancels_on_drop() {
    let (_dir, backend, eos) = backend();
    assert!(backend.is_ready());

    // Same seed, same tokens; concurrent requests do not disturb each other.
    let (a, b) = tokio::join!(
        collect(&backend, request(6, 7, &eos)),
        collect(&backend, request(6, 7, &eos))
    );
    assert_eq!(a, b);
    assert_eq!(a.0.len(), 6);
    assert_eq!(a.1, FinishReason::Length);

    // Invalid requests are refused up front.
    let mut bad = request(4, 1, &eos);
    bad.sampling.temperature = 9.0;
    assert!(matches!(
        backend.submit(bad).await,
        Err(BackendError {
            kind: proto::v1::ErrorKind::InvalidArgument,
            ..
        })
    ));

    // A long request: take one batch, drop the stream, the engine returns to idle.
    let mut stream = backend.submit(request(2000, 3, &eos)).await.unwrap();
    assert!(matches!(stream.next().await, Some(BackendEvent::Tokens(_))));
    let busy = backend.stats().await.unwrap();
    assert!(busy.used_pages > 0, "{busy:?}");
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stats = backend.stats().await.unwrap();
        if stats.idle && stats.used_pages == 0 && stats.running == 0 && stats.waiting == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not idle after drop: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Still serves afterwards.
    assert_eq!(collect(&backend, request(6, 7, &eos)).await, a);
}
