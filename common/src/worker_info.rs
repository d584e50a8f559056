//! The `Worker` gRPC service (Info, Drain) shared by prefill and decode workers.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use proto::v1::{
    Ack, DrainRequest, InfoRequest, Load, LoadProgress, Role, WorkerInfo, WorkerState,
    worker_server::Worker,
};
use tokio::sync::{Notify, RwLock};
use tonic::{Request, Response, Status};

/// A new unique worker id: role and a time-ordered UUID.
pub fn new_worker_id(role: Role) -> String {
    let role = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Unspecified => "worker",
    };
    format!("{role}-{}", uuid::Uuid::now_v7())
}

/// Shared, updatable description of this worker.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    info: Arc<RwLock<WorkerInfo>>,
    drain: Arc<Notify>,
    /// Deadline asked for by the latest `Drain` call, in milliseconds (0: the configured one).
    drain_deadline_ms: Arc<Mutex<u64>>,
    draining: DrainingFlag,
    /// When the engine last reported its load (it answers between steps, so a stale report
    /// means a wedged engine).
    last_load: Arc<Mutex<Option<Instant>>>,
    /// Reads the model load's progress (atomics the loading thread updates), so `Info` is
    /// exact at every call without a task copying it.
    progress: Arc<Mutex<Option<ProgressSource>>>,
}

/// A function giving the model load's progress now.
#[derive(Clone)]
pub struct ProgressSource(pub Arc<dyn Fn() -> LoadProgress + Send + Sync>);

impl std::fmt::Debug for ProgressSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressSource")
    }
}

/// Whether the worker is draining: set once, read by the services on every new request.
#[derive(Debug, Clone, Default)]
pub struct DrainingFlag(Arc<AtomicBool>);

impl DrainingFlag {
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// The error a draining worker answers new requests with (the router tries another).
    pub fn refusal(&self) -> Status {
        proto::error::to_status(&proto::v1::ErrorInfo {
            kind: proto::v1::ErrorKind::Unavailable.into(),
            message: "the worker is draining; it takes no new requests".to_owned(),
            ..Default::default()
        })
    }
}

impl WorkerHandle {
    pub fn new(info: WorkerInfo) -> Self {
        Self {
            info: Arc::new(RwLock::new(info)),
            drain: Arc::new(Notify::new()),
            drain_deadline_ms: Arc::default(),
            draining: DrainingFlag::default(),
            last_load: Arc::default(),
            progress: Arc::default(),
        }
    }

    /// Reports the model load's progress from `source` in every `Info` (and registration)
    /// from now on.
    pub fn set_progress_source(&self, source: ProgressSource) {
        *self.progress.lock().unwrap_or_else(PoisonError::into_inner) = Some(source);
    }

    /// The flag services check before taking new work.
    pub fn draining(&self) -> DrainingFlag {
        self.draining.clone()
    }

    pub async fn snapshot(&self) -> WorkerInfo {
        let mut info = self.info.read().await.clone();
        let source = self
            .progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(source) = source {
            info.load_progress = Some((source.0)());
        }
        info
    }

    pub async fn set_state(&self, state: WorkerState) {
        if state == WorkerState::Draining {
            self.draining.0.store(true, Ordering::Relaxed);
        }
        self.info.write().await.state = state.into();
    }

    /// Records the served model: its name (here, the fingerprint) and state layout, and the
    /// transports the worker offers.
    pub async fn set_model(
        &self,
        model_name: String,
        layout: proto::v1::StateLayout,
        transports: &[proto::v1::TransportKind],
    ) {
        let mut info = self.info.write().await;
        info.model_name = model_name;
        info.layout = Some(layout);
        info.transports = transports.iter().map(|&t| t.into()).collect();
    }

    /// Records how the model is spread over the worker's ranks.
    pub async fn set_group(&self, group: proto::v1::GroupLayout) {
        self.info.write().await.group = Some(group);
    }

    /// What computes the worker's steps (set once its model is loaded).
    pub async fn set_compute(&self, compute: proto::v1::Compute) {
        self.info.write().await.compute = Some(compute);
    }

    pub async fn set_load(&self, load: Load) {
        *self
            .last_load
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        self.info.write().await.load = Some(load);
    }

    /// False when an engine reported its load before but not within `max_age`.
    pub fn engine_responsive(&self, max_age: Duration) -> bool {
        self.last_load
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|at| at.elapsed() <= max_age)
    }

    /// Requests still on this worker: running, queued, and reserved but not yet committed.
    pub async fn work_left(&self) -> u64 {
        let load = self.info.read().await.load.clone().unwrap_or_default();
        u64::from(load.running_requests)
            + u64::from(load.queued_requests)
            + u64::from(load.reservations)
    }

    /// Resolves when a drain was requested over gRPC, with the deadline it asked for.
    pub async fn drain_requested(&self) -> Option<Duration> {
        self.drain.notified().await;
        let ms = *self
            .drain_deadline_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (ms > 0).then(|| Duration::from_millis(ms))
    }
}

/// gRPC adapter.
#[derive(Debug, Clone)]
pub struct WorkerService {
    handle: WorkerHandle,
    /// The longest drain this worker runs (its shutdown grace: the service manager's stop
    /// timeout is set above it, so a longer drain could be killed half way).
    grace: std::time::Duration,
}

impl WorkerService {
    pub fn new(handle: WorkerHandle, grace: std::time::Duration) -> Self {
        Self { handle, grace }
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(&self, _request: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.handle.snapshot().await))
    }

    async fn drain(&self, request: Request<DrainRequest>) -> Result<Response<Ack>, Status> {
        let asked = request.get_ref().deadline_ms;
        let grace = self.grace.as_millis();
        if u128::from(asked) > grace {
            return Err(Status::invalid_argument(format!(
                "a drain deadline of {asked} ms is longer than this worker's shutdown grace \
                 ({grace} ms; raise shutdown_grace_ms, and the unit's stop timeout above it)"
            )));
        }
        *self
            .handle
            .drain_deadline_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = u64::from(request.get_ref().deadline_ms);
        self.handle.set_state(WorkerState::Draining).await;
        // notify_one stores a permit, so a drain requested before anyone waits is not lost.
        self.handle.drain.notify_one();
        Ok(Response::new(Ack {}))
    }
}
