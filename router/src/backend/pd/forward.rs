//! The decode leg's token stream, as backend events.

use proto::{
    request::{FinishReason, token_from_wire},
    v1::TokenBatch,
};
use tokio::sync::{mpsc, watch};

use crate::backend::{BackendError, BackendEvent, GeneratedToken};

/// Decode's token batches as backend events; a stream that breaks or ends without a finish is
/// a failure, never a short answer.
pub(super) async fn forward(
    mut stream: tonic::Streaming<TokenBatch>,
    tx: mpsc::UnboundedSender<BackendEvent>,
    cached_tokens: usize,
    mut alive: watch::Receiver<bool>,
) {
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            // A worker that stops answering polls fails its requests now rather than leaving
            // them hanging on a connection that may never close.
            dead = async { alive.wait_for(|a| !*a).await.is_ok() } => {
                if dead {
                    let _ = tx.send(BackendEvent::Failed(BackendError::unavailable(
                        "the decode worker stopped answering",
                    )));
                    return;
                }
                stream.message().await
            }
        };
        let batch = match message {
            Ok(Some(batch)) => batch,
            Ok(None) => {
                let _ = tx.send(BackendEvent::Failed(BackendError::unavailable(
                    "the decode stream ended without a finish",
                )));
                return;
            }
            Err(status) => {
                let _ = tx.send(BackendEvent::Failed(BackendError::from_status(
                    "decode worker",
                    &status,
                )));
                return;
            }
        };
        if !batch.tokens.is_empty() {
            let tokens = batch
                .tokens
                .iter()
                .map(|t| GeneratedToken::from(token_from_wire(t)))
                .collect();
            if tx.send(BackendEvent::Tokens(tokens)).is_err() {
                return;
            }
        }
        let reason = proto::v1::FinishReason::try_from(batch.finish_reason)
            .unwrap_or(proto::v1::FinishReason::Error);
        let end = match reason {
            proto::v1::FinishReason::Unspecified => continue,
            proto::v1::FinishReason::Stop | proto::v1::FinishReason::Length => {
                let mut usage = proto::request::usage_from_wire(&batch.usage.unwrap_or_default());
                usage.cached_tokens = cached_tokens;
                BackendEvent::Finished {
                    reason: if reason == proto::v1::FinishReason::Stop {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    },
                    usage,
                }
            }
            proto::v1::FinishReason::Cancelled => BackendEvent::Failed(BackendError::new(
                proto::v1::ErrorKind::Cancelled,
                "the request was cancelled on the decode worker",
            )),
            proto::v1::FinishReason::Error => BackendEvent::Failed(BackendError::from_info(
                "decode worker",
                &batch.error.unwrap_or_default(),
            )),
        };
        let _ = tx.send(end);
        return;
    }
}
