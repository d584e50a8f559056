//! Backends: where token ids go to be generated from. The HTTP layer submits a prompt's token
//! ids with sampling and stop parameters and receives a stream of token batches; dropping the
//! stream cancels the request. [`LocalBackend`] runs the engine in this process on one
//! dedicated OS thread (development); the prefill/decode backend is [`pd`], over the worker
//! registry and routing policies of [`workers`].

pub mod local;
pub mod pd;
pub mod workers;

pub use local::{EngineStats, LocalBackend};

use std::{
    fmt,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use engine::{
    sampling::{FinishReason, SamplingParams, StopConditions},
    scheduler::Usage,
};
use futures::{Stream, future::BoxFuture};
use tokio::sync::mpsc;

/// A request to generate from token ids.
#[derive(Debug, Clone)]
pub struct BackendRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopConditions,
}

/// One generated token with its optional log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What a request's stream yields. Every generated token appears in a `Tokens` batch (the
/// stop or eos token that ended a `Stop` request included, last); then exactly one
/// `Finished` or `Failed` ends the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendEvent {
    Tokens(Vec<GeneratedToken>),
    Finished { reason: FinishReason, usage: Usage },
    Failed(String),
}

/// Why a backend refuses a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The request itself is invalid (parameters, size); a client error.
    #[error("{0}")]
    Invalid(String),
    /// The backend cannot serve now.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

/// The token stream of one request. Dropping it before the end cancels the request.
pub struct TokenStream {
    events: mpsc::UnboundedReceiver<BackendEvent>,
    on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
    done: bool,
}

impl fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenStream")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl TokenStream {
    /// A stream over `events`; `cancel` runs when the stream is dropped before its end.
    pub fn new(
        events: mpsc::UnboundedReceiver<BackendEvent>,
        cancel: impl FnOnce() + Send + Sync + 'static,
    ) -> Self {
        Self {
            events,
            on_drop: Some(Box::new(cancel)),
            done: false,
        }
    }
}

impl Stream for TokenStream {
    type Item = BackendEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = self.events.poll_recv(cx);
        if let Poll::Ready(None | Some(BackendEvent::Finished { .. } | BackendEvent::Failed(_))) =
            &polled
        {
            self.done = true;
            self.on_drop = None;
        }
        polled
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        if let Some(cancel) = self.on_drop.take() {
            cancel();
        }
    }
}

/// Where requests are generated.
pub trait Backend: Send + Sync + 'static {
    /// Queues a request; the stream carries its tokens.
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>>;

    /// Whether the backend can serve requests now.
    fn is_ready(&self) -> bool;
}

/// A shared backend handle.
pub type SharedBackend = Arc<dyn Backend>;
