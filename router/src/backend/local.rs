//! The engine in this process (development and tests), on the same engine thread the workers
//! use (`engine::runner`): requests are queued on it and their events subscribed to; a
//! dropped stream cancels its request there.

use std::sync::atomic::{AtomicU64, Ordering};

use engine::{
    grammar::TokenTableSource,
    model::Model,
    runner::Runner,
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
};
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use super::{Backend, BackendError, BackendEvent, BackendRequest, GeneratedToken, TokenStream};

/// Occupancy of the in-process engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub used_pages: usize,
    pub total_pages: usize,
    pub idle: bool,
}

/// The engine in this process. Dropping the backend stops the engine thread once every
/// request has ended.
#[derive(Debug)]
pub struct LocalBackend {
    runner: Runner,
    next_id: AtomicU64,
}

impl LocalBackend {
    /// Starts the engine thread over `model`; output constraints compile against `tokens`.
    pub fn start(
        model: Model,
        config: EngineConfig,
        fingerprint: &str,
        tokens: TokenTableSource,
    ) -> std::io::Result<Self> {
        let mut engine = Engine::new(model, config, fingerprint)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        engine.set_token_table(tokens);
        Ok(Self {
            runner: Runner::start(engine, "pdserve-engine")?,
            next_id: AtomicU64::new(1),
        })
    }

    /// Current occupancy (`None` when the engine thread is gone).
    pub async fn stats(&self) -> Option<EngineStats> {
        self.runner.call(|engine, _| stats_of(engine)).await.ok()
    }
}

impl Backend for LocalBackend {
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>> {
        Box::pin(async move {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let request = GenerationRequest {
                id,
                prompt: request.prompt,
                sampling: request.sampling,
                stop: request.stop,
            };
            let (tx, rx) = mpsc::unbounded_channel();
            let cancel = self.runner.clone();
            // Built before awaiting, so a caller dropped during the wait still cancels (the
            // cancel runs on the engine thread after the request was queued).
            let stream = TokenStream::new(rx, move || {
                let _ = cancel.post(move |engine, subs| {
                    subs.unsubscribe(id);
                    engine.cancel(id);
                });
            });
            let events = self
                .runner
                .call(move |engine, subs| {
                    engine.add(request)?;
                    Ok(subs.subscribe(id))
                })
                .await
                .map_err(|_| BackendError::unavailable("the engine thread stopped"))?
                .map_err(|refused: engine::scheduler::EngineError| {
                    BackendError::invalid(refused.to_string())
                })?;
            tokio::spawn(forward(events, tx));
            Ok(stream)
        })
    }

    fn is_ready(&self) -> bool {
        true
    }
}

/// The engine's events of one request as backend events: the tokens available at once in one
/// batch, then its end. A request cancelled on the engine ends the stream without a finish
/// (the reader reports that as a failure).
async fn forward(
    mut events: mpsc::UnboundedReceiver<Event>,
    tx: mpsc::UnboundedSender<BackendEvent>,
) {
    while let Some(first) = events.recv().await {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(event) = next.take() {
            let end = match event {
                Event::Token { sampled, .. } => {
                    batch.push(GeneratedToken::from(sampled));
                    next = events.try_recv().ok();
                    continue;
                }
                // Sent before the first token, so no batch is open.
                Event::PromptLogprobs { entries, .. } => {
                    let entries = entries.into_iter().map(GeneratedToken::from).collect();
                    if tx.send(BackendEvent::PromptLogprobs(entries)).is_err() {
                        return;
                    }
                    next = events.try_recv().ok();
                    continue;
                }
                Event::Finished { reason, usage, .. } => {
                    Some(BackendEvent::Finished { reason, usage })
                }
                Event::Failed { error, .. } => {
                    Some(BackendEvent::Failed(BackendError::internal(error)))
                }
                Event::Cancelled { .. } => None,
                // This backend never queues prefill-only requests.
                Event::Prefilled { .. } | Event::StatePart { .. } => Some(BackendEvent::Failed(
                    BackendError::internal("unexpected prefill handoff"),
                )),
            };
            if !batch.is_empty()
                && tx
                    .send(BackendEvent::Tokens(std::mem::take(&mut batch)))
                    .is_err()
            {
                return;
            }
            if let Some(end) = end {
                let _ = tx.send(end);
            }
            return;
        }
        if tx.send(BackendEvent::Tokens(batch)).is_err() {
            return;
        }
    }
}

fn stats_of(engine: &Engine) -> EngineStats {
    let (running, waiting) = engine.load();
    let pages = engine.store().pages();
    EngineStats {
        running,
        waiting,
        used_pages: pages.used_count(),
        total_pages: pages.total(),
        idle: engine.is_idle(),
    }
}
