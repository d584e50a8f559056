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

/// A handle to the engine thread; cheap to clone.
#[derive(Debug, Clone)]
pub struct Runner {
    jobs: std_mpsc::Sender<Job>,
    /// The rank group this engine steps with, woken by every job ([`crate::parallel::ranks`]).
    wake: Option<std::sync::Arc<crate::parallel::ranks::Wake>>,
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
    pub(crate) fn ranked(
        jobs: std_mpsc::Sender<Job>,
        wake: std::sync::Arc<crate::parallel::ranks::Wake>,
    ) -> Self {
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

/// An engine loaded for a worker: its thread, the layout it exposes to peers and the facts
/// about the model a worker needs.
#[derive(Debug, Clone)]
pub struct LoadedEngine {
    /// One runner per rank (one for a one-GPU worker).
    pub ranks: crate::parallel::group::Ranks,
    /// How the model is spread over the ranks.
    pub group: crate::parallel::group::GroupSpec,
    pub layout: proto::v1::StateLayout,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub fingerprint: String,
    /// Where the forward pass's ops run; `None`: all on the CPU reference.
    pub backend_plan: Option<crate::backend::BackendPlan>,
}

/// Why an engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The checkpoint did not load (or its fingerprint could not be computed).
    #[error(transparent)]
    Load(#[from] crate::weights::LoadError),
    /// The compute backend could not start, or cannot serve this model as configured.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// The engine refused its configuration.
    #[error(transparent)]
    Engine(#[from] crate::scheduler::EngineError),
    /// The engine thread could not be started.
    #[error("cannot start the engine thread: {0}")]
    Thread(#[from] std::io::Error),
    /// The worker's ranks could not start as configured.
    #[error("{0}")]
    Group(#[from] crate::parallel::group::GroupError),
    /// The state pools would not fit the host's memory.
    #[error("{0}")]
    Memory(String),
}

/// Loads the checkpoint at `dir`, computes its fingerprint, builds the engine and starts its
/// thread (all on the CPU reference).
pub fn start_from_dir(
    dir: &std::path::Path,
    config: crate::scheduler::EngineConfig,
    thread_name: &str,
) -> Result<LoadedEngine, StartError> {
    let progress = std::sync::Arc::new(crate::weights::LoadProgress::new());
    start_with_backend(
        dir,
        config,
        thread_name,
        RankDevices::CPU,
        crate::parallel::group::GroupSpec::SINGLE,
        &progress,
    )
}

/// Opens rank `rank`'s compute backend for a loaded model (`None`: the CPU reference only).
pub type OpenBackend<'a> = &'a dyn Fn(
    &std::path::Path,
    &crate::config::ModelConfig,
    usize,
) -> Result<
    Option<std::sync::Arc<dyn crate::backend::Backend>>,
    crate::backend::BackendError,
>;

/// Makes one collective per rank for a group of `n` ranks that waits at most the timeout.
pub type MakeCollectives<'a> =
    &'a dyn Fn(
        usize,
        std::time::Duration,
    ) -> Result<Vec<Box<dyn crate::parallel::collective::Collective>>, String>;

/// Opens the device an engine steps its decode tokens on (and its prompt chunks, where the
/// device steps them), for rank `rank`'s model (a rank of an expert-parallel group: the device
/// exchanges over the model's group) and the engine's configuration.
pub type OpenDecode<'a> =
    &'a dyn Fn(
        &crate::model::Model,
        &crate::scheduler::EngineConfig,
        usize,
    ) -> Result<Box<dyn crate::scheduler::StepDevice>, crate::backend::BackendError>;

/// Where a worker's ranks compute: each rank's backend (rank r on its own device), whether ops
/// the backend does not run may stay on the CPU (`hybrid`), the collectives of the model's
/// groups (`None`: in-process, for ranks on the CPU or sharing host memory), and the device a
/// one-rank engine decodes on (`decode`: then no backend is attached, the decode steps run
/// whole on the device and the host forward computes only prompts).
#[derive(Clone, Copy)]
pub struct RankDevices<'a> {
    pub open: OpenBackend<'a>,
    pub hybrid: bool,
    pub collectives: Option<MakeCollectives<'a>>,
    pub decode: Option<OpenDecode<'a>>,
    /// The engines take requests only with their prompts' state (a decode worker's:
    /// [`Engine::set_decode_only`]).
    pub decode_only: bool,
}

impl std::fmt::Debug for RankDevices<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankDevices")
            .field("hybrid", &self.hybrid)
            .field("collectives", &self.collectives.is_some())
            .finish_non_exhaustive()
    }
}

impl RankDevices<'static> {
    /// Every rank on the CPU reference, in-process collectives.
    pub const CPU: Self = Self {
        open: &|_, _, _| Ok(None),
        hybrid: false,
        collectives: None,
        decode: None,
        decode_only: false,
    };
}

/// [`start_from_dir`] with each rank's backend (`devices.open`) attached to its model; a
/// backend that does not run every op is refused unless `devices.hybrid` (see
/// `engine::backend`). With more than one rank in `group`, one engine per rank starts in
/// lockstep, rank r with the backend opened for r and its groups' collectives from
/// `devices.collectives`. How far the weights check is (the part of starting that takes
/// minutes on a large checkpoint) shows in `progress` while this runs.
pub fn start_with_backend(
    dir: &std::path::Path,
    config: crate::scheduler::EngineConfig,
    thread_name: &str,
    devices: RankDevices<'_>,
    group: crate::parallel::group::GroupSpec,
    progress: &std::sync::Arc<crate::weights::LoadProgress>,
) -> Result<LoadedEngine, StartError> {
    use crate::parallel::group::{self, GroupError};
    let fingerprint = crate::weights::fingerprint(dir)?;
    let mut model = crate::model::Model::load_with_progress(dir, progress)?;
    group
        .check(&model.config)
        .map_err(|e| StartError::Group(GroupError::Refused(e)))?;
    // Refused now rather than killed later, when requests fill pools the host cannot hold.
    if let Some(available) = crate::plan::host::available_memory() {
        crate::plan::host::check_pools(&model.config, &config, group.ranks(), available)
            .map_err(StartError::Memory)?;
    }
    if let Some(open_decode) = devices.decode.filter(|_| group.ranks() == 1) {
        return start_decoding_on_device(
            model,
            config,
            (dir, &fingerprint),
            thread_name,
            (group, devices.decode_only),
            open_decode,
        );
    }
    let mut backends = Vec::with_capacity(group.ranks());
    for rank in 0..group.ranks() {
        // Ranks stepping on their devices have no per-op backend.
        let backend = match devices.decode {
            Some(_) => None,
            None => (devices.open)(dir, &model.config, rank)?,
        };
        backends.push(backend);
    }
    let mut backend_plan = match backends.first().cloned().flatten() {
        Some(backend) if group.ranks() == 1 => Some(model.attach_backend(backend, devices.hybrid)?),
        Some(backend) => Some(crate::backend::BackendPlan::decide(
            backend.as_ref(),
            devices.hybrid,
        )?),
        None => None,
    };
    let eos_token_ids = model.config.eos_token_ids.clone();
    let vocab_size = model.config.vocab_size;
    let table = crate::grammar::TokenTableSource::from_dir(dir, vocab_size, &eos_token_ids);
    // Each rank's device, the first one's plan kept for the log.
    let first_plan = std::sync::Mutex::new(None);
    let open_rank =
        |model: &crate::model::Model, config: &crate::scheduler::EngineConfig, rank: usize| {
            let open = devices
                .decode
                .ok_or_else(|| crate::backend::BackendError::Unavailable {
                    backend: "step device".to_owned(),
                    reason: "none to open".to_owned(),
                })?;
            let device = open(model, config, rank)?;
            if rank == 0 {
                *first_plan
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(device_plan(
                    device.as_ref(),
                    &group.parallel.describe_ranks(),
                ));
            }
            Ok(device)
        };
    let (ranks, layout) = if group.ranks() > 1 {
        let ranks = group::RankSetup {
            backends,
            hybrid: devices.hybrid,
            collectives: devices.collectives,
            decode: devices.decode.map(|_| &open_rank as OpenDecode<'_>),
        };
        let started = group::start(
            model,
            &config,
            &fingerprint,
            (group, ranks),
            thread_name,
            &|e| {
                e.set_token_table(table.clone());
                if devices.decode_only {
                    e.set_decode_only();
                }
            },
        )?;
        if let Some(plan) = first_plan
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            backend_plan = Some(plan);
        }
        started
    } else {
        let decode_only = devices.decode_only;
        let start = (
            move |e: &mut Engine| {
                if decode_only {
                    e.set_decode_only();
                }
                Ok(())
            },
            backend_plan,
        );
        return start_single(
            model,
            config,
            (dir, &fingerprint),
            (thread_name, group),
            start,
        );
    };
    Ok(LoadedEngine {
        ranks,
        group,
        layout,
        eos_token_ids,
        vocab_size,
        fingerprint,
        backend_plan,
    })
}

/// One engine thread of `model` (its token table from `dir`), `setup` run on the engine first;
/// its plan says what the backend runs.
fn start_single(
    model: crate::model::Model,
    config: crate::scheduler::EngineConfig,
    (dir, fingerprint): (&std::path::Path, &str),
    (thread_name, group): (&str, crate::parallel::group::GroupSpec),
    (setup, backend_plan): (
        impl FnOnce(&mut Engine) -> Result<(), StartError>,
        Option<crate::backend::BackendPlan>,
    ),
) -> Result<LoadedEngine, StartError> {
    let eos_token_ids = model.config.eos_token_ids.clone();
    let vocab_size = model.config.vocab_size;
    let table = crate::grammar::TokenTableSource::from_dir(dir, vocab_size, &eos_token_ids);
    let mut engine = Engine::new(model, config, fingerprint)?;
    setup(&mut engine)?;
    engine.set_token_table(table);
    let layout = engine.store().layout.to_proto();
    Ok(LoadedEngine {
        ranks: crate::parallel::group::Ranks::single(Runner::start(engine, thread_name)?),
        group,
        layout,
        eos_token_ids,
        vocab_size,
        fingerprint: fingerprint.to_owned(),
        backend_plan,
    })
}

/// [`start_with_backend`] for an engine whose decode steps run whole on the device
/// `open_decode` opens (one rank; no backend attached: prompts compute there too where it steps
/// them, on the host reference otherwise).
fn start_decoding_on_device(
    mut model: crate::model::Model,
    config: crate::scheduler::EngineConfig,
    (dir, fingerprint): (&std::path::Path, &str),
    thread_name: &str,
    (group, decode_only): (crate::parallel::group::GroupSpec, bool),
    open_decode: OpenDecode<'_>,
) -> Result<LoadedEngine, StartError> {
    // The device rounds K=V rows as the engine will store them.
    model.set_kv_storage(config.kv);
    let device = open_decode(&model, &config, 0)?;
    let backend_plan = device_plan(device.as_ref(), "");
    let setup = move |engine: &mut Engine| {
        if decode_only {
            engine.set_decode_only();
        }
        Ok(engine.set_step_device(device)?)
    };
    start_single(
        model,
        config,
        (dir, fingerprint),
        (thread_name, group),
        (setup, Some(backend_plan)),
    )
}

/// The plan an engine stepping on `device` logs (`ranks` > 1: each rank of an expert-parallel
/// group on its own).
pub(crate) fn device_plan(
    device: &dyn crate::scheduler::StepDevice,
    group: &str,
) -> crate::backend::BackendPlan {
    let what = if device.prompt_chunk() > 0 {
        "whole steps on the device"
    } else {
        "the whole decode step on the device"
    };
    crate::backend::BackendPlan {
        backend: format!("{} ({what}{group})", device.name()),
        on_device: crate::backend::Op::ALL.to_vec(),
        on_cpu: Vec::new(),
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
