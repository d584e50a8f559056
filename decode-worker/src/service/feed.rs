//! A `Generate` stream's life: the first token, then the engine's tokens in batches, the
//! finish (or the error) last; a client that goes away cancels the request.

use proto::v1::{ErrorInfo, ErrorKind, FinishReason, GeneratedToken, RequestId, TokenBatch};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::{DecodeWorker, Started};
use engine::scheduler::Event;
use std::sync::Arc;

/// Feeds a `Generate` stream: waits for the start, sends the first token, then the engine's
/// tokens; the last batch carries the finish reason and usage. If the client goes away the
/// request is cancelled and its pages freed.
pub(super) async fn stream_tokens(
    w: Arc<DecodeWorker>,
    (engine_id, rank): (u64, usize),
    request_id: Option<RequestId>,
    started: oneshot::Receiver<Result<Started, Status>>,
    tx: mpsc::Sender<Result<TokenBatch, Status>>,
) {
    feed(&w, (engine_id, rank), request_id, started, tx).await;
    w.forget(engine_id);
}

async fn feed(
    w: &Arc<DecodeWorker>,
    (engine_id, rank): (u64, usize),
    request_id: Option<RequestId>,
    started: oneshot::Receiver<Result<Started, Status>>,
    tx: mpsc::Sender<Result<TokenBatch, Status>>,
) {
    let cancel = |w: &Arc<DecodeWorker>| {
        let _ = w.engine.ranks.post(rank, move |engine, subs| {
            if let Some(event) = engine.cancel(engine_id) {
                subs.deliver(event);
            }
        });
    };
    let started = tokio::select! {
        started = started => started,
        () = tx.closed() => {
            // The client left before the start: drop the reservation (or the request, if the
            // start raced with us).
            cancel(w);
            return;
        }
    };
    let Started { first, mut events } = match started {
        Ok(Ok(started)) => started,
        Ok(Err(status)) => {
            let _ = tx.send(Err(status)).await;
            return;
        }
        Err(_) => {
            let _ = tx.send(Err(w.stopped())).await;
            return;
        }
    };
    let batch = |tokens: Vec<GeneratedToken>| TokenBatch {
        request_id: request_id.clone(),
        tokens,
        ..TokenBatch::default()
    };
    let mut pending = vec![first];
    // Made once, not per token: it resolves when the worker's ranks lose lockstep.
    let group_failed = w.engine.ranks.failed();
    tokio::pin!(group_failed);
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            () = tx.closed() => {
                cancel(w);
                return;
            }
            // A hung rank sends nothing more: the group's failure ends its requests.
            reason = &mut group_failed => Some(Event::Failed { id: engine_id, error: reason }),
        };
        let last = match event {
            Some(Event::Token { sampled, .. }) => {
                pending.push(w.mix_up(engine_id, proto::request::token_to_wire(&sampled)));
                // Send what has accumulated whenever the engine is ahead of nobody.
                if events.is_empty()
                    && tx
                        .send(Ok(batch(std::mem::take(&mut pending))))
                        .await
                        .is_err()
                {
                    cancel(w);
                    return;
                }
                continue;
            }
            Some(Event::Finished { reason, usage, .. }) => TokenBatch {
                finish_reason: proto::request::finish_to_wire(reason).into(),
                usage: Some(proto::request::usage_to_wire(&usage)),
                ..batch(std::mem::take(&mut pending))
            },
            Some(Event::Failed { error, .. }) => TokenBatch {
                finish_reason: FinishReason::Error.into(),
                error: Some(ErrorInfo {
                    kind: ErrorKind::Internal.into(),
                    message: error,
                    worker_id: w.worker_id.clone(),
                }),
                ..batch(std::mem::take(&mut pending))
            },
            Some(Event::Cancelled { .. }) => TokenBatch {
                finish_reason: FinishReason::Cancelled.into(),
                ..batch(std::mem::take(&mut pending))
            },
            // A resumed request's prompt was computed (and its log-probabilities reported) on
            // the prefill worker: none of these can come from this engine.
            Some(
                Event::Prefilled { .. } | Event::StatePart { .. } | Event::PromptLogprobs { .. },
            )
            | None => TokenBatch {
                finish_reason: FinishReason::Error.into(),
                error: Some(ErrorInfo {
                    kind: ErrorKind::Internal.into(),
                    message: "the engine ended the request without a finish".to_owned(),
                    worker_id: w.worker_id.clone(),
                }),
                ..batch(std::mem::take(&mut pending))
            },
        };
        tracing::info!(
            internal = %request_id.as_ref().map_or("-", |r| r.id.as_str()),
            finish = ?FinishReason::try_from(last.finish_reason).unwrap_or(FinishReason::Unspecified),
            completion_tokens = last.usage.map_or(0, |u| u.completion_tokens),
            error = last.error.as_ref().map_or("", |e| e.message.as_str()),
            "generation ended"
        );
        let _ = tx.send(Ok(last)).await;
        return;
    }
}
