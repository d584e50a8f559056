//! The workers the router knows: static ones from its configuration and dynamic ones that
//! registered over gRPC (`Registry`). Every worker is polled (`Info`) for liveness and load; a
//! dynamic one that misses its heartbeats is dropped. Requests pick a live worker by policy.

use std::{
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use proto::auth::{AuthChannel, Credentials};
use proto::v1::{
    Ack, DeregisterRequest, HeartbeatRequest, HeartbeatResponse, InfoRequest, Load, LoadProgress,
    RegisterRequest, RegisterResponse, Role, StateLayout, WorkerState, registry_server::Registry,
    worker_client::WorkerClient,
};
use serde::Serialize;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::{backend::BackendError, config::Policy};

/// How often the router asks each worker for its `Info` (liveness and load).
const POLL_EVERY: Duration = Duration::from_millis(250);
/// A worker that does not answer `Info` within this is considered dead.
const POLL_TIMEOUT: Duration = Duration::from_millis(1000);
/// Heartbeat interval asked of registered workers.
pub const HEARTBEAT_MS: u32 = 500;
/// A registered worker whose last heartbeat is older than this is dropped.
pub const EXPIRY_MS: u32 = 2000;

/// Why a worker cannot be added to the registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Its address makes no endpoint (not host:port, or the TLS settings do not apply).
    #[error("worker address {address}: {source}")]
    Address {
        address: String,
        source: tonic::transport::Error,
    },
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One worker as the router sees it.
#[derive(Debug)]
pub struct Worker {
    /// Its id (`WorkerInfo.worker_id`; for static workers, the address until a poll says).
    pub id: Mutex<String>,
    pub address: String,
    /// Calls on it carry the cluster's credentials.
    pub channel: AuthChannel,
    /// Whether its last `Info` poll succeeded; in-flight streams watch it.
    pub alive: watch::Sender<bool>,
    /// Its lifecycle state as it last reported it (a draining worker gets no new requests).
    pub state: Mutex<WorkerState>,
    /// Its last reported load.
    pub load: Mutex<Load>,
    /// How far its model load is, from its last `Info` (listed while it is loading).
    pub load_progress: Mutex<Option<LoadProgress>>,
    /// What computes its steps, from `Info` (once its model is loaded).
    pub compute: Mutex<Option<proto::v1::Compute>>,
    /// Requests this router has in flight on it (exact, unlike the polled load).
    pub in_flight: Arc<AtomicUsize>,
    /// Its state layout, from `Info`.
    pub layout: Mutex<Option<StateLayout>>,
    /// Transports it offers, in its order of preference (`TransportKind` values), from `Info`.
    pub transports: Mutex<Vec<i32>>,
    /// Registered over gRPC (dropped when its heartbeats stop) rather than configured.
    pub dynamic: bool,
    pub last_heartbeat: Mutex<Instant>,
}

impl Worker {
    /// `state` is what the router assumes until the worker's first `Info` answers.
    fn new(
        address: &str,
        id: String,
        dynamic: bool,
        state: WorkerState,
        credentials: &Credentials,
    ) -> Result<Arc<Self>, RegistryError> {
        let channel = credentials
            .endpoint(address)
            .map(|e| credentials.channel(e.connect_timeout(POLL_TIMEOUT).connect_lazy()))
            .map_err(|source| RegistryError::Address {
                address: address.to_owned(),
                source,
            })?;
        Ok(Arc::new(Self {
            id: Mutex::new(id),
            address: address.to_owned(),
            channel,
            // Assumed alive until a poll says otherwise, so the first request after start does
            // not wait for a poll.
            alive: watch::Sender::new(true),
            state: Mutex::new(state),
            load: Mutex::new(Load::default()),
            load_progress: Mutex::new(None),
            compute: Mutex::new(None),
            in_flight: Arc::new(AtomicUsize::new(0)),
            layout: Mutex::new(None),
            transports: Mutex::new(Vec::new()),
            dynamic,
            last_heartbeat: Mutex::new(Instant::now()),
        }))
    }

    pub fn is_alive(&self) -> bool {
        *self.alive.borrow()
    }

    /// Alive and ready (neither starting, loading its model nor draining): it may take new
    /// requests.
    pub fn takes_requests(&self) -> bool {
        self.is_alive() && *lock(&self.state) == WorkerState::Ready
    }

    /// Alive and past loading (ready or draining).
    fn is_up(&self) -> bool {
        self.is_alive()
            && matches!(
                *lock(&self.state),
                WorkerState::Ready | WorkerState::Draining
            )
    }

    /// `ready`, `draining`, `starting`, `loading`, `failed` or `unreachable`, for listings and
    /// metrics.
    pub fn state_label(&self) -> &'static str {
        if !self.is_alive() {
            return "unreachable";
        }
        match *lock(&self.state) {
            WorkerState::Draining => "draining",
            WorkerState::Starting | WorkerState::Unspecified => "starting",
            WorkerState::Loading => "loading",
            WorkerState::Ready => "ready",
            WorkerState::Failed => "failed",
        }
    }

    /// Load order: requests this router has in flight there, then pages held on its emptiest
    /// rank (a request lives whole on one rank, so a worker with one free rank beats one whose
    /// free pages are spread thin; a one-rank worker is its own emptiest rank).
    fn score(&self) -> (usize, std::cmp::Reverse<u64>) {
        let load = lock(&self.load);
        let room = load
            .ranks
            .iter()
            .map(engine::parallel::group::free_pages)
            .max()
            .unwrap_or_else(|| engine::parallel::group::free_pages(&load));
        (
            self.in_flight.load(Ordering::Relaxed),
            std::cmp::Reverse(room),
        )
    }

    /// Polls `Info` until the worker leaves its pool.
    fn monitor(self: &Arc<Self>) {
        let worker = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(w) = worker.upgrade() else { return };
                let mut client = WorkerClient::new(w.channel.clone());
                let polled = tokio::time::timeout(POLL_TIMEOUT, client.info(InfoRequest {})).await;
                match polled {
                    Ok(Ok(info)) => {
                        let info = info.into_inner();
                        *lock(&w.load) = info.load.unwrap_or_default();
                        *lock(&w.load_progress) = info.load_progress;
                        if info.compute.is_some() {
                            *lock(&w.compute) = info.compute;
                        }
                        if let Ok(state) = WorkerState::try_from(info.state) {
                            *lock(&w.state) = state;
                        }
                        if info.layout.is_some() {
                            *lock(&w.layout) = info.layout;
                        }
                        if !info.worker_id.is_empty() {
                            *lock(&w.id) = info.worker_id;
                        }
                        if !info.transports.is_empty() {
                            *lock(&w.transports) = info.transports;
                        }
                        w.alive.send_if_modified(|a| !std::mem::replace(a, true));
                    }
                    _ => {
                        if w.alive.send_if_modified(|a| std::mem::replace(a, false)) {
                            tracing::warn!(worker = %w.address, "worker stopped answering");
                        }
                    }
                }
                drop(w);
                tokio::time::sleep(POLL_EVERY).await;
            }
        });
    }
}

/// Requests this router has in flight on one worker; the guard decrements on drop.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub fn new(worker: &Worker) -> Self {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(&worker.in_flight))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Workers of one role.
#[derive(Debug)]
pub struct Pool {
    role: &'static str,
    workers: RwLock<Vec<Arc<Worker>>>,
    next: AtomicUsize,
    credentials: Credentials,
}

impl Pool {
    /// A pool of the static `addresses`; starts polling them (call within a Tokio runtime).
    pub fn new(
        role: &'static str,
        addresses: &[String],
        credentials: &Credentials,
    ) -> Result<Self, RegistryError> {
        // Starting until the first poll answers: a static worker may still be loading its
        // model, and a request must never reach a worker that is.
        let workers = addresses
            .iter()
            .map(|a| Worker::new(a, a.clone(), false, WorkerState::Starting, credentials))
            .collect::<Result<Vec<_>, _>>()?;
        for w in &workers {
            w.monitor();
        }
        Ok(Self {
            role,
            workers: RwLock::new(workers),
            next: AtomicUsize::new(0),
            credentials: credentials.clone(),
        })
    }

    pub fn snapshot(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Adds or refreshes a registered worker (by id; a new address replaces the old entry) in
    /// the `state` it registered with.
    fn register(&self, id: &str, address: &str, state: WorkerState) -> Result<(), RegistryError> {
        let mut workers = self
            .workers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(w) = workers
            .iter()
            .find(|w| *lock(&w.id) == id && w.address == address)
        {
            *lock(&w.last_heartbeat) = Instant::now();
            return Ok(());
        }
        workers.retain(|w| !(w.dynamic && *lock(&w.id) == id) && w.address != address);
        let worker = Worker::new(address, id.to_owned(), true, state, &self.credentials)?;
        worker.monitor();
        workers.push(worker);
        tracing::info!(role = self.role, worker = id, address, "worker registered");
        Ok(())
    }

    /// Records a heartbeat; false if the worker is unknown (it must register again).
    fn heartbeat(&self, id: &str, state: Option<WorkerState>, load: Option<Load>) -> bool {
        self.snapshot()
            .iter()
            .find(|w| w.dynamic && *lock(&w.id) == id)
            .is_some_and(|w| {
                *lock(&w.last_heartbeat) = Instant::now();
                if let Some(state) = state {
                    *lock(&w.state) = state;
                }
                if let Some(load) = load {
                    *lock(&w.load) = load;
                }
                true
            })
    }

    /// Drops a registered worker; true if it was known.
    fn deregister(&self, id: &str) -> bool {
        let mut workers = self
            .workers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = workers.len();
        workers.retain(|w| !(w.dynamic && *lock(&w.id) == id));
        let removed = workers.len() < before;
        if removed {
            tracing::info!(role = self.role, worker = id, "worker deregistered");
        }
        removed
    }

    /// Drops registered workers whose heartbeats stopped; marks them dead first so streams on
    /// them fail now.
    fn expire(&self, expiry: Duration) {
        let mut workers = self
            .workers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.retain(|w| {
            let stale = w.dynamic && lock(&w.last_heartbeat).elapsed() > expiry;
            if stale {
                w.alive.send_replace(false);
                tracing::warn!(role = self.role, worker = %w.address, "worker missed its heartbeats; dropped");
            }
            !stale
        });
    }

    /// A live worker other than `exclude`, chosen by `policy`; `preferred` (an id) is the
    /// prefix-affinity candidate, taken unless it has more than `slack` requests in flight
    /// beyond the least loaded.
    pub fn pick(
        &self,
        policy: Policy,
        exclude: Option<&Arc<Worker>>,
        preferred: Option<&str>,
        slack: usize,
    ) -> Result<Arc<Worker>, BackendError> {
        let all = self.snapshot();
        let n = all.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let candidates: Vec<&Arc<Worker>> = (0..n)
            .map(|k| &all[(start + k) % n.max(1)])
            .filter(|w| w.takes_requests() && exclude.is_none_or(|x| !Arc::ptr_eq(x, w)))
            .collect();
        let least = candidates.iter().copied().min_by_key(|w| w.score());
        let chosen = match policy {
            Policy::RoundRobin => candidates.first().copied(),
            Policy::LeastLoaded => least,
            Policy::PowerOfTwo => match candidates.len() {
                0 => None,
                1 => Some(candidates[0]),
                len => {
                    // Two distinct pseudo-random live workers (a multiplicative hash of the
                    // turn counter), the less loaded of them.
                    let h = (start as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16;
                    let first = (h % len as u64) as usize;
                    let second = (first + 1 + ((h >> 24) % (len as u64 - 1)) as usize) % len;
                    let (a, b) = (candidates[first], candidates[second]);
                    Some(if b.score() < a.score() { b } else { a })
                }
            },
            Policy::PrefixAffinity => {
                let favourite = preferred
                    .and_then(|id| candidates.iter().copied().find(|w| *lock(&w.id) == id));
                match (favourite, least) {
                    (Some(f), Some(l)) if f.score().0 <= l.score().0 + slack => Some(f),
                    _ => least,
                }
            }
        };
        chosen.cloned().ok_or_else(|| {
            let loading = all.iter().filter(|w| w.state_label() == "loading").count();
            BackendError::unavailable(if loading > 0 {
                format!(
                    "no ready {} worker ({loading} still loading the model)",
                    self.role
                )
            } else {
                format!("no live {} worker", self.role)
            })
        })
    }

    /// Some worker is alive and has its model loaded (ready or draining).
    pub fn any_alive(&self) -> bool {
        self.snapshot().iter().any(|w| w.is_up())
    }

    /// Tokens the largest page pool among the workers that are up holds (pages times page
    /// size, from their last `Info`); `None` before any reported both.
    pub fn largest_pool_tokens(&self) -> Option<u64> {
        self.snapshot()
            .iter()
            .filter(|w| w.is_up())
            .filter_map(|w| {
                let page_size = lock(&w.layout).as_ref()?.page_size_tokens;
                // A request's state lives on one rank: its pool is what bounds a request.
                let load = lock(&w.load);
                let pages = load
                    .ranks
                    .iter()
                    .map(|r| r.pages_total)
                    .max()
                    .unwrap_or(load.pages_total);
                (pages > 0 && page_size > 0).then(|| pages.saturating_mul(u64::from(page_size)))
            })
            .max()
    }
}

/// Prefill and decode pools, shared by the PD backend and the `Registry` service.
#[derive(Debug)]
pub struct Workers {
    pub prefill: Pool,
    pub decode: Pool,
}

impl Workers {
    /// The configured static workers; starts the heartbeat expiry task. Calls to every worker
    /// carry `credentials`.
    pub fn new(
        prefill: &[String],
        decode: &[String],
        credentials: &Credentials,
    ) -> Result<Arc<Self>, RegistryError> {
        let workers = Arc::new(Self {
            prefill: Pool::new("prefill", prefill, credentials)?,
            decode: Pool::new("decode", decode, credentials)?,
        });
        let weak = Arc::downgrade(&workers);
        tokio::spawn(async move {
            let expiry = Duration::from_millis(u64::from(EXPIRY_MS));
            loop {
                tokio::time::sleep(POLL_EVERY).await;
                let Some(w) = weak.upgrade() else { return };
                w.prefill.expire(expiry);
                w.decode.expire(expiry);
            }
        });
        Ok(workers)
    }

    fn pool(&self, role: Role) -> Option<&Pool> {
        match role {
            Role::Prefill => Some(&self.prefill),
            Role::Decode => Some(&self.decode),
            Role::Unspecified => None,
        }
    }

    /// Every worker with its state, for `GET /workers`.
    pub fn listing(&self) -> Vec<WorkerListing> {
        [("prefill", &self.prefill), ("decode", &self.decode)]
            .into_iter()
            .flat_map(|(role, pool)| {
                pool.snapshot().into_iter().map(move |w| {
                    let load = lock(&w.load).clone();
                    // Only while loading: a ready worker's listing shows its load instead.
                    let loading = (w.state_label() == "loading")
                        .then(|| *lock(&w.load_progress))
                        .flatten();
                    WorkerListing {
                        id: lock(&w.id).clone(),
                        role,
                        address: w.address.clone(),
                        alive: w.is_alive(),
                        state: w.state_label(),
                        registered: w.dynamic,
                        in_flight: w.in_flight.load(Ordering::Relaxed),
                        running_requests: load.running_requests,
                        queued_requests: load.queued_requests,
                        reservations: load.reservations,
                        pages_used: load.pages_used,
                        pages_cached: load.pages_cached,
                        pages_total: load.pages_total,
                        ranks: load
                            .ranks
                            .iter()
                            .map(|r| RankListing {
                                running_requests: r.running_requests,
                                queued_requests: r.queued_requests,
                                reservations: r.reservations,
                                pages_used: r.pages_used,
                                pages_cached: r.pages_cached,
                                pages_total: r.pages_total,
                            })
                            .collect(),
                        compute: lock(&w.compute).as_ref().map(|c| ComputeListing {
                            backend: c.backend.clone(),
                            plan: c.plan.clone(),
                            kv_cache_dtype: c.kv_cache_dtype.clone(),
                            fast_kernels: c.fast_kernels.clone(),
                        }),
                        load_progress: loading.map(|p| LoadProgressListing {
                            bytes_done: p.bytes_done,
                            bytes_total: p.bytes_total,
                            shards_done: p.shards_done,
                            shards_total: p.shards_total,
                            elapsed_ms: p.elapsed_ms,
                            done: p.done,
                        }),
                    }
                })
            })
            .collect()
    }
}

/// One row of `GET /workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerListing {
    pub id: String,
    pub role: &'static str,
    pub address: String,
    pub alive: bool,
    /// `ready`, `draining`, `starting`, `loading`, `failed` or `unreachable`.
    pub state: &'static str,
    pub registered: bool,
    pub in_flight: usize,
    pub running_requests: u32,
    pub queued_requests: u32,
    pub reservations: u32,
    pub pages_used: u64,
    pub pages_cached: u64,
    pub pages_total: u64,
    /// A worker over several ranks: each rank's load (the fields above are their sums).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankListing>,
    /// What computes its steps (absent until its model is loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute: Option<ComputeListing>,
    /// How far a loading worker's model load is (absent once loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_progress: Option<LoadProgressListing>,
}

/// What computes a worker's steps in `GET /workers`: `WorkerInfo.compute` as it came.
#[derive(Debug, Clone, Serialize)]
pub struct ComputeListing {
    /// `cpu`, `cuda` or `emulated`.
    pub backend: String,
    /// Where its steps run, as its start-up log says (empty on the CPU reference).
    pub plan: String,
    /// `f32`, `fp8` or `bf16`.
    pub kv_cache_dtype: String,
    /// The settings that make its results differ from the reference's bits within stated
    /// bounds; empty: the reference's bits.
    pub fast_kernels: Vec<String>,
}

/// One rank's load in `GET /workers`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RankListing {
    pub running_requests: u32,
    pub queued_requests: u32,
    pub reservations: u32,
    pub pages_used: u64,
    pub pages_cached: u64,
    pub pages_total: u64,
}

/// A loading worker's progress in `GET /workers`: `WorkerInfo.load_progress` as it came.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoadProgressListing {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub shards_done: u32,
    pub shards_total: u32,
    pub elapsed_ms: u64,
    /// Every tensor is checked (the worker may still be starting its engine).
    pub done: bool,
}

/// The `Registry` gRPC service over [`Workers`].
#[derive(Debug, Clone)]
pub struct RegistryService(pub Arc<Workers>);

#[tonic::async_trait]
impl Registry for RegistryService {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let info = request
            .into_inner()
            .worker
            .ok_or_else(|| Status::invalid_argument("worker is required"))?;
        let role = Role::try_from(info.role).unwrap_or(Role::Unspecified);
        let pool = self
            .0
            .pool(role)
            .ok_or_else(|| Status::invalid_argument("worker role must be prefill or decode"))?;
        if info.worker_id.is_empty() || info.address.is_empty() {
            return Err(Status::invalid_argument(
                "worker_id and address are required",
            ));
        }
        // A worker registers while it loads its model; it gets requests once it reports
        // READY (in a heartbeat or an `Info` poll). A state it did not say is not READY.
        let state = WorkerState::try_from(info.state).unwrap_or(WorkerState::Starting);
        pool.register(&info.worker_id, &info.address, state)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(RegisterResponse {
            heartbeat_interval_ms: HEARTBEAT_MS,
            expiry_ms: EXPIRY_MS,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let req = request.into_inner();
        let state = WorkerState::try_from(req.state).ok();
        let known = self
            .0
            .prefill
            .heartbeat(&req.worker_id, state, req.load.clone())
            || self.0.decode.heartbeat(&req.worker_id, state, req.load);
        Ok(Response::new(HeartbeatResponse { known }))
    }

    async fn deregister(
        &self,
        request: Request<DeregisterRequest>,
    ) -> Result<Response<Ack>, Status> {
        let id = request.into_inner().worker_id;
        let _ = self.0.prefill.deregister(&id) || self.0.decode.deregister(&id);
        Ok(Response::new(Ack {}))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;

    /// Only a ready worker is picked: one starting (static, not polled yet), loading its
    /// model or draining never gets a request, under every policy.
    #[tokio::test]
    async fn only_ready_workers_are_picked() {
        // A current-thread runtime: the monitor task cannot run (and change the worker)
        // between the steps below, which never await.
        let pool = Pool::new("decode", &["127.0.0.1:9".to_owned()], &Credentials::none()).unwrap();
        let worker = pool.snapshot()[0].clone();
        let policies = [
            Policy::RoundRobin,
            Policy::LeastLoaded,
            Policy::PowerOfTwo,
            Policy::PrefixAffinity,
        ];
        let picked = |pool: &Pool| {
            policies
                .iter()
                .map(|&p| pool.pick(p, None, Some("127.0.0.1:9"), 0).is_ok())
                .collect::<Vec<_>>()
        };
        assert_eq!(worker.state_label(), "starting");
        assert!(!pool.any_alive());
        assert_eq!(picked(&pool), [false; 4]);
        *lock(&worker.state) = WorkerState::Loading;
        assert_eq!(worker.state_label(), "loading");
        assert_eq!(picked(&pool), [false; 4]);
        assert!(
            !pool.any_alive(),
            "a loading worker does not make the router ready"
        );
        *lock(&worker.state) = WorkerState::Ready;
        assert_eq!(picked(&pool), [true; 4]);
        assert!(pool.any_alive());
        *lock(&worker.state) = WorkerState::Draining;
        assert_eq!(picked(&pool), [false; 4]);
    }

    /// A worker registering while it loads is listed as loading and gets nothing until a
    /// heartbeat says it is ready.
    #[tokio::test]
    async fn a_worker_registered_while_loading_waits_for_ready() {
        let pool = Pool::new("prefill", &[], &Credentials::none()).unwrap();
        pool.register("prefill-1", "127.0.0.1:9", WorkerState::Loading)
            .unwrap();
        assert_eq!(pool.snapshot()[0].state_label(), "loading");
        match pool.pick(Policy::RoundRobin, None, None, 0) {
            Err(e) if e.kind == proto::v1::ErrorKind::Unavailable => assert_eq!(
                e.message,
                "no ready prefill worker (1 still loading the model)"
            ),
            other => panic!("picked a loading worker: {other:?}"),
        }
        assert!(pool.heartbeat("prefill-1", Some(WorkerState::Ready), None));
        assert!(pool.pick(Policy::RoundRobin, None, None, 0).is_ok());
    }

    /// A registration whose address makes no endpoint is refused, naming the address.
    #[tokio::test]
    async fn a_bad_address_is_refused() {
        let pool = Pool::new("prefill", &[], &Credentials::none()).unwrap();
        let e = pool
            .register("prefill-1", "not an address", WorkerState::Loading)
            .unwrap_err();
        assert!(
            matches!(&e, RegistryError::Address { address, .. } if address == "not an address")
        );
        assert!(
            e.to_string().starts_with("worker address not an address: "),
            "{e}"
        );
        assert!(pool.snapshot().is_empty());
    }
}
