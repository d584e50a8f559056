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
use proto::v1::ErrorKind;
use tokio::sync::mpsc;

/// A request to generate from token ids.
#[derive(Debug, Clone)]
pub struct BackendRequest {
    /// The client's `X-Request-Id` (or the one minted for it): for the workers' logs.
    pub request_id: String,
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

impl From<engine::sampling::Sampled> for GeneratedToken {
    fn from(s: engine::sampling::Sampled) -> Self {
        Self {
            id: s.token,
            logprob: s.logprob,
            top_logprobs: s.top_logprobs,
        }
    }
}

/// What a request's stream yields. Every generated token appears in a `Tokens` batch (the
/// stop or eos token that ended a `Stop` request included, last); then exactly one
/// `Finished` or `Failed` ends the stream. A request that asked for its prompt's
/// log-probabilities gets them first, in one `PromptLogprobs`.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendEvent {
    /// One entry per prompt token after the first (`id` is the prompt token).
    PromptLogprobs(Vec<GeneratedToken>),
    Tokens(Vec<GeneratedToken>),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(BackendError),
}

/// Why a backend refused or failed a request: the kind of failure, as the worker that failed
/// reported it (carried across gRPC as `proto::v1::ErrorKind`) or as the router classified it,
/// and a one-line message. `crate::api::error` maps each kind to one HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BackendError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The request itself is invalid (parameters, size); a client error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// The backend cannot serve now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// A failure inside the backend.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// The structured error a worker (`what`) reported, kind kept; an unclassified one is
    /// internal.
    pub fn from_info(what: &str, info: &proto::v1::ErrorInfo) -> Self {
        let kind = match ErrorKind::try_from(info.kind) {
            Ok(ErrorKind::Unspecified) | Err(_) => ErrorKind::Internal,
            Ok(kind) => kind,
        };
        Self::new(kind, format!("{what}: {}", info.message))
    }

    /// The error of a failed call to a worker (`what`).
    pub fn from_status(what: &str, status: &tonic::Status) -> Self {
        Self::from_info(what, &proto::error::from_status(status))
    }
}

/// The token stream of one request. Dropping it before the end cancels the request.
pub struct TokenStream {
    events: mpsc::UnboundedReceiver<BackendEvent>,
    /// An event already received ([`TokenStream::started`]) and not yet yielded.
    front: Option<BackendEvent>,
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
            front: None,
            on_drop: Some(Box::new(cancel)),
            done: false,
        }
    }

    /// Waits for the request's first event (its first tokens: the prompt has been computed)
    /// and keeps it to be yielded first. A request that failed before it is an error.
    pub async fn started(&mut self) -> Result<(), BackendError> {
        if self.front.is_some() || self.done {
            return Ok(());
        }
        match self.events.recv().await {
            Some(BackendEvent::Failed(error)) => Err(error),
            None => Err(BackendError::internal(
                "the backend stream ended before its first token",
            )),
            Some(event) => {
                self.front = Some(event);
                Ok(())
            }
        }
    }
}

impl Stream for TokenStream {
    type Item = BackendEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = match self.front.take() {
            Some(event) => Poll::Ready(Some(event)),
            None => self.events.poll_recv(cx),
        };
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

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// The seed of choice `index` of a request seeded with `seed`: choices differ, and the same
/// seed gives the same choices (as vLLM's parallel sampling does).
pub fn choice_seed(seed: Option<u64>, index: u32) -> Option<u64> {
    seed.map(|s| s.wrapping_add(u64::from(index)))
}

/// Submits `n` samples of one prompt. The first is submitted alone and waited for until its
/// prompt is computed; the others follow it, so their prompts are taken from the prefix cache
/// of the worker that computed the first (the prefill router prefers that worker) and only
/// the prompt's last, partial block is computed again for each. Dropping the streams cancels
/// the choices; a choice that cannot start fails the whole request (the started ones are
/// cancelled).
pub async fn submit_choices(
    backend: &dyn Backend,
    request: BackendRequest,
    n: u32,
) -> Result<Vec<TokenStream>, BackendError> {
    let with_seed = |index: u32| {
        let mut choice = request.clone();
        choice.sampling.seed = choice_seed(request.sampling.seed, index);
        choice
    };
    let mut first = backend.submit(with_seed(0)).await?;
    if n <= 1 {
        return Ok(vec![first]);
    }
    first.started().await?;
    let rest = futures::future::join_all((1..n).map(|i| backend.submit(with_seed(i)))).await;
    let mut streams = Vec::with_capacity(n as usize);
    streams.push(first);
    for stream in rest {
        streams.push(stream?);
    }
    Ok(streams)
}
