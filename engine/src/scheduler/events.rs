//! What the engine's steps produce ([`Event`]), why a step's requests fail ([`StepError`]),
//! and why a request is refused or the engine cannot be built ([`EngineError`]).

use super::{HandoffError, PromptState, StateWrite, Usage};
use crate::{
    grammar::GrammarError,
    paged::layout::LayoutError,
    pool::PoolError,
    sampling::{FinishReason, Sampled, SamplingError},
};

/// What a step produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request's `index`-th generated token.
    Token {
        id: u64,
        index: usize,
        sampled: Sampled,
    },
    Finished {
        id: u64,
        reason: FinishReason,
        usage: Usage,
    },
    Cancelled {
        id: u64,
    },
    /// The request failed inside the engine; its pages are released.
    Failed {
        id: u64,
        error: String,
    },
    /// The log-probabilities of a request's prompt tokens after the first (asked for with
    /// `SamplingParams::prompt_logprobs`), in order: sent once, just before its first `Token`.
    PromptLogprobs {
        id: u64,
        entries: Vec<Sampled>,
    },
    /// Part of a prefill-only request's state that is final: sent while the prompt is still
    /// being computed (every layer's rows of a chunk right after that layer's attention, and
    /// prefix-cached pages before the first chunk). A write may be repeated by a later part
    /// with more rows filled in (a chunk that ends inside a page): apply parts in order.
    StatePart {
        id: u64,
        writes: Vec<StateWrite>,
    },
    /// A prefill-only request ([`super::Engine::add_prefill`]) computed its prompt and sampled its
    /// first token (reported just before as `Token` index 0): its state, exported in this
    /// engine's layout for a decode worker. Its pages are released.
    Prefilled {
        id: u64,
        state: PromptState,
        /// The seed of its random stream (decode continues it).
        seed: u64,
        /// Prompt tokens taken from the prefix cache.
        cached_tokens: usize,
        /// Set when the first token already ends the request.
        finish: Option<FinishReason>,
    },
}

impl Event {
    /// The request it is about.
    pub fn id(&self) -> u64 {
        match self {
            Self::Token { id, .. }
            | Self::Finished { id, .. }
            | Self::Cancelled { id }
            | Self::Failed { id, .. }
            | Self::PromptLogprobs { id, .. }
            | Self::StatePart { id, .. }
            | Self::Prefilled { id, .. } => *id,
        }
    }

    /// `events` by request, each request's in order: what stays the same when the steps that
    /// produced them change (other chunkings, a device that steps prompts).
    pub fn by_request(events: &[Self]) -> std::collections::BTreeMap<u64, Vec<Self>> {
        let mut out = std::collections::BTreeMap::<u64, Vec<Self>>::new();
        for e in events {
            out.entry(e.id()).or_default().push(e.clone());
        }
        out
    }
}

/// Why one request failed inside a step: it ends with [`Event::Failed`] and its pages are
/// released; the other requests of the step go on.
#[derive(Debug, Clone, thiserror::Error)]
pub(super) enum StepError {
    /// Its pages could not be read or written.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Its next token could not be sampled (e.g. non-finite logits).
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The forward pass of the step failed (for every request in it).
    #[error("{0}")]
    Forward(String),
}

/// Why a request is refused or the engine cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error("{0}")]
    Layout(#[from] LayoutError),
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("request {0} already exists")]
    DuplicateId(u64),
    #[error("request needs {needed} pages ({tokens} tokens) but the pool has {total}")]
    TooLarge {
        needed: usize,
        tokens: usize,
        total: usize,
    },
    #[error("{tokens} tokens exceed the model's context of {limit}")]
    TooLong { tokens: usize, limit: usize },
    #[error("page pool: {0}")]
    Pool(PoolError),
    #[error("handoff: {0}")]
    Handoff(#[from] HandoffError),
    /// The decode device cannot serve this engine as configured.
    #[error("decode device {0}")]
    Device(String),
    /// A request whose prompt would compute here, on an engine that only decodes.
    #[error("this engine decodes only: requests arrive with their prompt's state")]
    DecodeOnly,
}
