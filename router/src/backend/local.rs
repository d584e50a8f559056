//! The engine in this process (development and tests): one OS thread owns it, steps while there
//! is work and blocks on its command channel when idle.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    mpsc as std_mpsc,
};

use engine::{
    model::Model,
    scheduler::{Engine, EngineConfig, EngineError, Event, GenerationRequest},
};
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

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

enum Command {
    Submit {
        request: GenerationRequest,
        events: mpsc::UnboundedSender<BackendEvent>,
        /// Whether the engine took the request (or why it refused it).
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Cancel(u64),
    Stats(oneshot::Sender<EngineStats>),
}

/// The engine in this process: one OS thread owns it, drains a command channel, steps while
/// there is work, and blocks on the channel when idle. Dropping the backend stops the thread
/// once every request has ended.
#[derive(Debug)]
pub struct LocalBackend {
    commands: std_mpsc::Sender<Command>,
    next_id: AtomicU64,
}

impl LocalBackend {
    /// Starts the engine thread over `model`.
    pub fn start(model: Model, config: EngineConfig, fingerprint: &str) -> std::io::Result<Self> {
        let engine = Engine::new(model, config, fingerprint)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let (commands, receiver) = std_mpsc::channel();
        std::thread::Builder::new()
            .name("pdserve-engine".to_owned())
            .spawn(move || engine_loop(engine, &receiver))?;
        Ok(Self {
            commands,
            next_id: AtomicU64::new(1),
        })
    }

    /// Current occupancy (`None` when the engine thread is gone).
    pub async fn stats(&self) -> Option<EngineStats> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Stats(tx)).ok()?;
        rx.await.ok()
    }
}

impl Backend for LocalBackend {
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>> {
        Box::pin(async move {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (events_tx, events_rx) = mpsc::unbounded_channel();
            let (reply_tx, reply_rx) = oneshot::channel();
            let request = GenerationRequest {
                id,
                prompt: request.prompt,
                sampling: request.sampling,
                stop: request.stop,
            };
            let gone = || BackendError::unavailable("the engine thread stopped");
            self.commands
                .send(Command::Submit {
                    request,
                    events: events_tx,
                    reply: reply_tx,
                })
                .map_err(|_| gone())?;
            let commands = self.commands.clone();
            // Built before awaiting, so a caller dropped during the wait still cancels.
            let stream = TokenStream::new(events_rx, move || {
                let _ = commands.send(Command::Cancel(id));
            });
            match reply_rx.await {
                Ok(Ok(())) => Ok(stream),
                Ok(Err(refused)) => Err(BackendError::invalid(refused.to_string())),
                Err(_) => Err(gone()),
            }
        })
    }

    fn is_ready(&self) -> bool {
        true
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

fn engine_loop(mut engine: Engine, commands: &std_mpsc::Receiver<Command>) {
    let mut streams: std::collections::HashMap<u64, mpsc::UnboundedSender<BackendEvent>> =
        std::collections::HashMap::new();
    loop {
        if engine.is_idle() {
            let Ok(command) = commands.recv() else {
                return;
            };
            handle(&mut engine, &mut streams, command);
        }
        loop {
            match commands.try_recv() {
                Ok(command) => handle(&mut engine, &mut streams, command),
                Err(std_mpsc::TryRecvError::Disconnected) if engine.is_idle() => return,
                Err(_) => break,
            }
        }
        if engine.is_idle() {
            continue;
        }
        let mut batches: Vec<(u64, Vec<GeneratedToken>)> = Vec::new();
        let mut ends: Vec<(u64, BackendEvent)> = Vec::new();
        for event in engine.step() {
            match event {
                Event::Token { id, sampled, .. } => {
                    let token = GeneratedToken {
                        id: sampled.token,
                        logprob: sampled.logprob,
                        top_logprobs: sampled.top_logprobs,
                    };
                    match batches.iter_mut().find(|(rid, _)| *rid == id) {
                        Some((_, batch)) => batch.push(token),
                        None => batches.push((id, vec![token])),
                    }
                }
                Event::Finished { id, reason, usage } => {
                    ends.push((id, BackendEvent::Finished { reason, usage }));
                }
                Event::Failed { id, error } => {
                    ends.push((id, BackendEvent::Failed(BackendError::internal(error))));
                }
                Event::Cancelled { id } => {
                    streams.remove(&id);
                }
                // This backend never queues prefill-only requests.
                Event::Prefilled { id, .. } | Event::StatePart { id, .. } => ends.push((
                    id,
                    BackendEvent::Failed(BackendError::internal("unexpected prefill handoff")),
                )),
            }
        }
        for (id, batch) in batches {
            let delivered = streams
                .get(&id)
                .is_some_and(|tx| tx.send(BackendEvent::Tokens(batch)).is_ok());
            if !delivered && streams.remove(&id).is_some() {
                // The client is gone: free its pages now.
                engine.cancel(id);
            }
        }
        for (id, end) in ends {
            if let Some(tx) = streams.remove(&id) {
                let _ = tx.send(end);
            }
        }
    }
}

fn handle(
    engine: &mut Engine,
    streams: &mut std::collections::HashMap<u64, mpsc::UnboundedSender<BackendEvent>>,
    command: Command,
) {
    match command {
        Command::Submit {
            request,
            events,
            reply,
        } => {
            let id = request.id;
            match engine.add(request) {
                Ok(()) => {
                    streams.insert(id, events);
                    if reply.send(Ok(())).is_err() {
                        streams.remove(&id);
                        engine.cancel(id);
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            }
        }
        Command::Cancel(id) => {
            if streams.remove(&id).is_some() {
                engine.cancel(id);
            }
        }
        Command::Stats(reply) => {
            let _ = reply.send(stats_of(engine));
        }
    }
}
