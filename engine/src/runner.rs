//! The engine on its own OS thread, for async services: callers send closures that run on the
//! engine (queue a request, reserve pages, write state, commit, cancel) and receive the events
//! of the requests they subscribed to. The thread steps the engine while it has work and
//! blocks on its job channel when idle; it ends when every handle is dropped and the engine is
//! idle.

use std::{collections::HashMap, sync::mpsc as std_mpsc};

use tokio::sync::{mpsc, oneshot};

use crate::scheduler::{Engine, Event};

/// Where each request's events go.
#[derive(Debug, Default)]
pub struct Subscribers {
    routes: HashMap<u64, mpsc::UnboundedSender<Event>>,
}

impl Subscribers {
    /// Sends the events of request `id` to the returned receiver until its terminal event.
    pub fn subscribe(&mut self, id: u64) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.routes.insert(id, tx);
        rx
    }

    /// Stops delivering request `id`'s events.
    pub fn unsubscribe(&mut self, id: u64) {
        self.routes.remove(&id);
    }

    /// Delivers one event; a terminal event ends the subscription.
    pub fn deliver(&mut self, event: Event) {
        let id = event_id(&event);
        let terminal = !matches!(
            event,
            Event::Token { .. } | Event::StatePart { .. } | Event::PromptLogprobs { .. }
        );
        if let Some(tx) = self.routes.get(&id) {
            let _ = tx.send(event);
        }
        if terminal {
            self.routes.remove(&id);
        }
    }
}

/// The request an event belongs to.
pub fn event_id(event: &Event) -> u64 {
    match event {
        Event::Token { id, .. }
        | Event::Finished { id, .. }
        | Event::Cancelled { id }
        | Event::Failed { id, .. }
        | Event::Prefilled { id, .. }
        | Event::PromptLogprobs { id, .. }
        | Event::StatePart { id, .. } => *id,
    }
}

pub(crate) type Job = Box<dyn FnOnce(&mut Engine, &mut Subscribers) + Send>;

/// The engine thread has stopped (it panicked or the process is ending).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine thread stopped")]
pub struct Stopped;

/// A rank group's wake-up: a counter every job bumps ([`crate::parallel::ranks`] sleeps on
/// it while no rank has work).
#[derive(Debug, Default)]
pub struct Wake {
    epoch: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
}

impl Wake {
    pub(crate) fn bump(&self) {
        *self
            .epoch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        self.changed.notify_all();
    }

    pub(crate) fn current(&self) -> u64 {
        *self
            .epoch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until a job arrived after `seen` (or `limit` passed).
    pub(crate) fn wait_past(&self, seen: u64, limit: std::time::Duration) {
        let epoch = self
            .epoch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = self
            .changed
            .wait_timeout_while(epoch, limit, |e| *e == seen)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }
}

/// A handle to the engine thread; cheap to clone.
#[derive(Debug, Clone)]
pub struct Runner {
    jobs: std_mpsc::Sender<Job>,
    /// The rank group this engine steps with, woken by every job.
    wake: Option<std::sync::Arc<Wake>>,
}

impl Runner {
    /// Starts the engine thread.
    pub fn start(engine: Engine, name: &str) -> std::io::Result<Self> {
        let (jobs, receiver) = std_mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || run(engine, &receiver))?;
        Ok(Self { jobs, wake: None })
    }

    /// A handle over `jobs` whose sends also wake `wake`'s group.
    pub(crate) fn ranked(jobs: std_mpsc::Sender<Job>, wake: std::sync::Arc<Wake>) -> Self {
        Self {
            jobs,
            wake: Some(wake),
        }
    }

    fn send(&self, job: Job) -> Result<(), Stopped> {
        self.jobs.send(job).map_err(|_| Stopped)?;
        if let Some(wake) = &self.wake {
            wake.bump();
        }
        Ok(())
    }

    /// Runs `f` on the engine thread (between steps) and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine, &mut Subscribers) -> R + Send + 'static,
    ) -> Result<R, Stopped> {
        let (tx, rx) = oneshot::channel();
        self.send(Box::new(move |engine, subs| {
            let _ = tx.send(f(engine, subs));
        }))?;
        rx.await.map_err(|_| Stopped)
    }

    /// The engine's occupancy, as workers report it.
    pub async fn load(&self) -> Result<proto::v1::Load, Stopped> {
        self.call(|engine, _| Self::load_of(engine)).await
    }

    /// `engine`'s occupancy (on its thread).
    pub fn load_of(engine: &Engine) -> proto::v1::Load {
        let (running, queued) = engine.load();
        let pages = engine.store().pages();
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        proto::v1::Load {
            running_requests: n(running),
            queued_requests: n(queued),
            pages_total: pages.total() as u64,
            pages_used: pages.used_count() as u64,
            pages_cached: engine.store().prefix().len() as u64,
            reservations: n(engine.reservations()),
            ranks: Vec::new(),
        }
    }

    /// Queues `f` without waiting for it (for cancellation from `Drop`).
    pub fn post(
        &self,
        f: impl FnOnce(&mut Engine, &mut Subscribers) + Send + 'static,
    ) -> Result<(), Stopped> {
        self.send(Box::new(f))
    }
}

fn run(mut engine: Engine, jobs: &std_mpsc::Receiver<Job>) {
    let mut subs = Subscribers::default();
    loop {
        if engine.is_idle() {
            let Ok(job) = jobs.recv() else {
                return;
            };
            job(&mut engine, &mut subs);
        }
        loop {
            match jobs.try_recv() {
                Ok(job) => job(&mut engine, &mut subs),
                Err(std_mpsc::TryRecvError::Disconnected) if engine.is_idle() => return,
                Err(_) => break,
            }
        }
        if engine.is_idle() {
            continue;
        }
        // State parts reach their subscribers during the step, the rest after it.
        let emitted = engine.step_with(&mut |event| subs.deliver(event));
        if emitted == 0 && engine.load().0 == 0 {
            // Requests are waiting for pages that reservations hold: nothing can run until a
            // job (a commit, a release) changes that, so wait for one instead of spinning.
            match jobs.recv_timeout(std::time::Duration::from_millis(5)) {
                Ok(job) => job(&mut engine, &mut subs),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;
    use crate::{
        config::ExpertFormat,
        model::Model,
        sampling::{FinishReason, SamplingParams, StopConditions},
        scheduler::{EngineConfig, GenerationRequest},
        synth::{GenerateOptions, Preset, generate},
    };

    fn runner() -> Runner {
        let dir = tempfile::tempdir().unwrap();
        let options = GenerateOptions::new(Preset::Tiny, 3, ExpertFormat::Bf16, dir.path());
        generate(&options).unwrap();
        let model = Model::load(dir.path()).unwrap();
        Runner::start(
            Engine::new(model, EngineConfig::default(), "t").unwrap(),
            "test-engine",
        )
        .unwrap()
    }

    fn request(id: u64, max_tokens: u32) -> GenerationRequest {
        GenerationRequest {
            id,
            prompt: vec![5, 6, 7],
            sampling: SamplingParams::default(),
            stop: StopConditions {
                max_tokens,
                min_tokens: 0,
                stop_token_ids: vec![],
                ignore_eos: true,
                eos_token_ids: vec![],
            },
        }
    }

    #[tokio::test]
    async fn events_reach_their_subscriber_and_cancel_frees_pages() {
        let runner = runner();
        let mut rx = runner
            .call(|engine, subs| {
                engine.add(request(1, 4)).unwrap();
                subs.subscribe(1)
            })
            .await
            .unwrap();
        let mut tokens = 0;
        loop {
            match rx.recv().await.unwrap() {
                Event::Token { .. } => tokens += 1,
                Event::Finished { reason, .. } => {
                    assert_eq!(reason, FinishReason::Length);
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(tokens, 4);
        assert!(rx.recv().await.is_none(), "the subscription ends");
        // A long request cancelled from outside ends with Cancelled and returns its pages.
        let mut rx = runner
            .call(|engine, subs| {
                engine.add(request(2, 10_000)).unwrap();
                subs.subscribe(2)
            })
            .await
            .unwrap();
        assert!(matches!(rx.recv().await, Some(Event::Token { .. })));
        runner
            .post(|engine, subs| {
                if let Some(event) = engine.cancel(2) {
                    subs.deliver(event);
                }
            })
            .unwrap();
        loop {
            match rx.recv().await {
                Some(Event::Token { .. }) => {}
                Some(Event::Cancelled { id: 2 }) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        let used = runner
            .call(|engine, _| engine.store().pages().used_count() - engine.store().prefix().len())
            .await
            .unwrap();
        assert_eq!(used, 0);
    }
}
