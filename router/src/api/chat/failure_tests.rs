//! How a chat stream ends: a backend failure recorded (never hidden), a stream ending without a
//! finish a failure, the listed ids without the EOS that ended it, a normal finish no failure.

use futures::StreamExt as _;
use tokio::sync::mpsc;

use super::*;
use crate::backend::TokenStream;

fn token(id: u32) -> GeneratedToken {
    GeneratedToken {
        id,
        logprob: None,
        top_logprobs: Vec::new(),
    }
}

async fn drive(events: Vec<BackendEvent>) -> (Vec<InferenceChunk>, Option<BackendError>) {
    drive_listing(events, None).await
}

async fn drive_listing(
    events: Vec<BackendEvent>,
    ids: Option<TokenIds>,
) -> (Vec<InferenceChunk>, Option<BackendError>) {
    let (tx, rx) = mpsc::unbounded_channel();
    for e in events {
        tx.send(e).unwrap();
    }
    drop(tx);
    let failure: Failure = Arc::default();
    let stream = inference_stream(
        TokenStream::new(rx, || {}),
        3,
        "fp".into(),
        false,
        Arc::clone(&failure),
        vec![1],
        &[],
        None,
        ids,
    );
    let chunks: Vec<InferenceChunk> = stream.collect().await;
    (chunks, failed(&failure))
}

#[tokio::test]
async fn backend_failure_is_recorded_not_hidden() {
    let (chunks, failure) = drive(vec![
        BackendEvent::Tokens(vec![token(5), token(6)]),
        BackendEvent::Failed(BackendError::unavailable("worker died")),
    ])
    .await;
    assert_eq!(failure, Some(BackendError::unavailable("worker died")));
    assert!(
        !chunks
            .iter()
            .any(|c| matches!(c, InferenceChunk::Finish { .. })),
        "no finish after a failure"
    );
}

#[tokio::test]
async fn stream_ending_without_finish_is_a_failure() {
    let (_, failure) = drive(vec![BackendEvent::Tokens(vec![token(5)])]).await;
    assert!(failure.is_some_and(|e| e.message.contains("ended before")));
}

#[tokio::test]
async fn listed_ids_are_the_output_without_the_eos_that_ended_it() {
    let ids: TokenIds = Arc::default();
    let (chunks, failure) = drive_listing(
        vec![
            BackendEvent::Tokens(vec![token(5), token(1)]),
            BackendEvent::Tokens(vec![token(7), token(1)]),
            BackendEvent::Finished {
                reason: FinishReason::Stop,
                usage: engine::scheduler::Usage::default(),
            },
        ],
        Some(Arc::clone(&ids)),
    )
    .await;
    assert!(failure.is_none());
    // The eos generated mid-output is listed; the one that ended the request is not (but
    // is counted).
    assert_eq!(take_ids(&ids), vec![5, 1, 7]);
    assert!(take_ids(&ids).is_empty(), "taken once");
    let counted: usize = chunks
        .iter()
        .map(|c| match c {
            InferenceChunk::Tokens { token_ids, .. } => token_ids.len(),
            InferenceChunk::Text { token_count, .. } => *token_count,
            _ => 0,
        })
        .sum();
    assert_eq!(counted, 4);
}

#[tokio::test]
async fn normal_finish_is_not_a_failure() {
    let (chunks, failure) = drive(vec![
        BackendEvent::Tokens(vec![token(5), token(6)]),
        BackendEvent::Finished {
            reason: FinishReason::Length,
            usage: engine::scheduler::Usage::default(),
        },
    ])
    .await;
    assert!(failure.is_none());
    assert!(matches!(chunks.last(), Some(InferenceChunk::Finish { .. })));
}
