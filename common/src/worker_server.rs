//! The process skeleton both worker roles share: a bound gRPC listener, the `Worker` identity
//! service, standard health, drain and graceful shutdown. Each role adds its own services.

use std::{future::Future, net::SocketAddr, time::Duration};

use proto::{
    auth::Credentials,
    v1::{Role, WorkerInfo, WorkerState, worker_server::WorkerServer as WorkerGrpc},
};
use tokio::net::TcpListener;
use tonic::service::Routes;

use crate::{
    ConfigError,
    cli::{EXIT_RUNTIME, ExitStatus},
    cluster_auth::Security,
    grpc,
    systemd::Notifier,
    worker_info::{WorkerHandle, WorkerService, new_worker_id},
};

/// Failures of a worker process's server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The worker could not start serving (e.g. its model failed to load).
    #[error("{0}")]
    Startup(String),
}

impl ExitStatus for ServeError {
    fn exit_code(&self) -> u8 {
        match self {
            ServeError::Config(e) => e.exit_code(),
            ServeError::Transport(_) | ServeError::Io(_) | ServeError::Startup(_) => EXIT_RUNTIME,
        }
    }
}

/// Where and how a worker listens.
#[derive(Debug, Clone)]
pub struct ListenOptions {
    /// Configuration key of the listen address (for error messages).
    pub key: &'static str,
    pub listen: SocketAddr,
    /// Address others dial; default: the bound address.
    pub advertise: Option<String>,
    /// How long in-flight calls may run after shutdown begins.
    pub grace: Duration,
    /// The cluster secret and TLS of internal calls.
    pub security: Security,
}

/// A worker whose listener is bound (its address is known) but not yet serving.
#[derive(Debug)]
pub struct WorkerServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    grace: Duration,
    security: Security,
    handle: WorkerHandle,
    /// The router this worker registers with, if any.
    router: Option<String>,
    notifier: Notifier,
    /// The role named on the readiness line, when this process prints one.
    ready_line: Option<String>,
    /// Further listeners named on the listening and readiness lines (e.g. `metrics`).
    announced: Vec<(&'static str, SocketAddr)>,
}

/// How long calls still running when the drain ends (idle or deadline) may take to finish.
const AFTER_DRAIN_GRACE: Duration = Duration::from_secs(2);

impl WorkerServer {
    /// Binds the listener; "address in use" is a configuration error naming the key.
    pub async fn bind(role: Role, options: ListenOptions) -> Result<Self, ServeError> {
        let listener = crate::listen::bind(options.key, options.listen).await?;
        let local_addr = listener.local_addr()?;
        crate::cluster_auth::warn_if_open(&options.security, local_addr);
        let handle = WorkerHandle::new(WorkerInfo {
            worker_id: new_worker_id(role),
            role: role.into(),
            state: WorkerState::Starting.into(),
            address: options.advertise.unwrap_or_else(|| local_addr.to_string()),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..WorkerInfo::default()
        });
        Ok(Self {
            listener,
            local_addr,
            grace: options.grace,
            security: options.security,
            handle,
            router: None,
            notifier: Notifier::from_env(),
            ready_line: None,
            announced: Vec::new(),
        })
    }

    /// Names another listener of this process (`name=addr`) on its listening and readiness
    /// lines, after the gRPC address.
    #[must_use]
    pub fn announcing(mut self, name: &'static str, addr: SocketAddr) -> Self {
        self.announced.push((name, addr));
        self
    }

    /// Every address the listening and readiness lines name.
    fn announced_addresses(&self) -> Vec<(&'static str, SocketAddr)> {
        std::iter::once(("grpc", self.local_addr))
            .chain(self.announced.iter().copied())
            .collect()
    }

    /// Registers with the router at `router` (gRPC host:port) once serving, heartbeats, and
    /// deregisters at the end of a drain.
    #[must_use]
    pub fn register_with(mut self, router: Option<String>) -> Self {
        self.router = router;
        self
    }

    /// systemd notifications (`READY=1` once serving and registered, `STOPPING=1`,
    /// `WATCHDOG=1`).
    pub fn notifier(&self) -> &Notifier {
        &self.notifier
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn handle(&self) -> &WorkerHandle {
        &self.handle
    }

    /// What this worker's own calls to other processes carry.
    pub fn credentials(&self) -> Credentials {
        self.security.credentials()
    }

    /// Serves the identity and health services plus `role_routes` (whose names are listed in
    /// `role_services` for health) until `shutdown` resolves or a drain is requested; then
    /// drains: new role requests are refused (the router also stops sending them), requests
    /// in flight finish within the grace period (or the `Drain` call's deadline), the worker
    /// deregisters and the server stops.
    pub async fn serve(
        self,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.serve_after(
            role_routes,
            role_services,
            std::future::ready(Ok(())),
            shutdown,
        )
        .await
    }

    /// [`Self::serve`] for a worker whose role services can only work once `loaded` resolves
    /// (its model is loading): health and `Worker.Info` answer at once, the role services and
    /// the process ("") report NOT_SERVING, and the worker registers with its router at once
    /// (the router lists it, with its progress, but sends it nothing before it reports READY).
    /// Once `loaded` succeeds the role services turn SERVING, the state READY, and the
    /// readiness line is printed. A failed load stops the server and is returned; a shutdown or
    /// drain during the load stops it without waiting for the load.
    pub async fn serve_after(
        self,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        loaded: impl Future<Output = Result<(), ServeError>>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let (reporter, health) = grpc::health();
        let routes = role_routes(Routes::new(health).add_service(WorkerGrpc::new(
            WorkerService::new(self.handle.clone(), self.grace),
        )));
        let mut services = vec![proto::service_names::WORKER];
        services.extend_from_slice(role_services);
        // Until loaded only Worker answers: nothing may mistake the worker for one that serves.
        grpc::set_not_serving(&reporter, role_services).await;
        reporter
            .set_service_status(
                proto::service_names::WORKER,
                tonic_health::ServingStatus::Serving,
            )
            .await;
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let failure = std::sync::Arc::clone(&failed);
        let credentials = self.credentials();
        let handle = self.handle.clone();
        let notifier = self.notifier.clone();
        let (grace, router) = (self.grace, self.router.clone());
        let (address, ready_line) = (self.local_addr, self.ready_line.clone());
        let announced = self.announced_addresses();
        let stop = async move {
            let (registered_tx, registered) = tokio::sync::oneshot::channel();
            let registration = router.clone().map(|router| {
                tokio::spawn(crate::registration::keep_registered(
                    handle.clone(),
                    router,
                    credentials.clone(),
                    registered_tx,
                ))
            });
            tokio::pin!(shutdown);
            let outcome = tokio::select! {
                result = load_reporting(loaded, &handle, &notifier) => Some(result),
                () = &mut shutdown => {
                    tracing::info!("stopping before the model finished loading");
                    None
                }
                _ = handle.drain_requested() => {
                    tracing::info!("drain requested before the model finished loading; stopping");
                    None
                }
            };
            let mut watchdog = None;
            if let Some(Ok(())) = outcome {
                grpc::set_serving(&reporter, &services).await;
                handle.set_state(WorkerState::Ready).await;
                if let Some(role) = &ready_line {
                    crate::cli::announce_ready(role, &announced);
                }
                let ready_notifier = notifier.clone();
                let registers = registration.is_some();
                let announce = tokio::spawn(async move {
                    if registers {
                        let _ = registered.await;
                    }
                    ready_notifier.ready(&format!("serving on {address}"));
                });
                let engine_handle = handle.clone();
                let max_age = notifier.watchdog_timeout().map_or(Duration::MAX, |t| t / 2);
                watchdog =
                    Some(tokio::spawn(notifier.clone().keep_watchdog(move || {
                        engine_handle.engine_responsive(max_age)
                    })));
                let asked = tokio::select! {
                    () = &mut shutdown => None,
                    deadline = handle.drain_requested() => deadline,
                };
                announce.abort();
                handle.set_state(WorkerState::Draining).await;
                grpc::set_not_serving(&reporter, &services).await;
                notifier.stopping("draining");
                // The Drain call refused a deadline above the grace.
                let deadline = asked.map_or(grace, |d| d.min(grace));
                tracing::info!(deadline_ms = deadline.as_millis(), "worker draining");
                drain(&handle, &notifier, deadline).await;
            } else {
                handle.set_state(WorkerState::Draining).await;
                grpc::set_not_serving(&reporter, &services).await;
                notifier.stopping("stopping before the model finished loading");
                if let Some(Err(e)) = outcome {
                    *failure
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                }
            }
            if let Some(task) = registration {
                task.abort();
                if let Some(router) = router {
                    let id = handle.snapshot().await.worker_id;
                    crate::registration::deregister(&router, &credentials, id).await;
                }
            }
            if let Some(task) = watchdog {
                task.abort();
            }
            tracing::info!("worker stopping");
        };
        grpc::serve(
            self.listener,
            routes,
            &self.security,
            stop,
            AFTER_DRAIN_GRACE,
        )
        .await?;
        let failure = failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        failure.map_or(Ok(()), Err)
    }

    /// Runs as a process: announce readiness on stdout, serve until SIGTERM/SIGINT.
    pub async fn run_until_signal(
        self,
        role_name: &str,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        signal: crate::shutdown::ShutdownSignal,
    ) -> Result<(), ServeError> {
        self.run_after_load(
            role_name,
            role_routes,
            role_services,
            std::future::ready(Ok(())),
            signal,
        )
        .await
    }

    /// [`Self::run_until_signal`] for a worker loading its model (see [`Self::serve_after`]):
    /// the listening line is printed at once, the readiness line once `loaded` succeeds.
    pub async fn run_after_load(
        mut self,
        role_name: &str,
        role_routes: impl FnOnce(Routes) -> Routes,
        role_services: &[&str],
        loaded: impl Future<Output = Result<(), ServeError>>,
        mut signal: crate::shutdown::ShutdownSignal,
    ) -> Result<(), ServeError> {
        tracing::info!(addr = %self.local_addr, role = role_name, "worker listening");
        crate::cli::announce_listening(role_name, &self.announced_addresses());
        self.ready_line = Some(role_name.to_owned());
        // Boxed: the serving future is large, and callers keep it across their own awaits.
        Box::pin(
            self.serve_after(role_routes, role_services, loaded, async move {
                let name = signal.recv().await;
                tracing::info!(signal = name, "shutdown requested");
            }),
        )
        .await
    }
}

/// Runs `load` on its own OS thread (checking a large checkpoint takes minutes of CPU) and
/// resolves with its result. Not `spawn_blocking`: a runtime waits for its blocking tasks when
/// it shuts down, and a worker told to stop mid-load must not wait for the load.
pub async fn load_on_thread<T: Send + 'static, E: std::fmt::Display + Send + 'static>(
    name: &str,
    load: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, ServeError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(load());
        })?;
    rx.await
        .map_err(|_| ServeError::Startup("the model loading thread panicked".to_owned()))?
        .map_err(|e| ServeError::Startup(e.to_string()))
}

/// How often a loading worker's progress is put in its systemd status.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// Awaits `loaded`, putting the load's progress in the unit's status meanwhile (`systemctl
/// status` shows how far a start that takes minutes is).
async fn load_reporting(
    loaded: impl Future<Output = Result<(), ServeError>>,
    handle: &WorkerHandle,
    notifier: &Notifier,
) -> Result<(), ServeError> {
    tokio::pin!(loaded);
    let mut every = tokio::time::interval(STATUS_EVERY);
    loop {
        tokio::select! {
            biased;
            result = &mut loaded => return result,
            _ = every.tick() => {
                if let Some(progress) = handle.snapshot().await.load_progress {
                    notifier.status(&format!("loading the model: {progress}"));
                }
            }
        }
    }
}

/// Waits until no request is left on the worker (running, queued or reserved) or `deadline`
/// passes, reporting progress in the unit's status.
async fn drain(handle: &WorkerHandle, notifier: &Notifier, deadline: Duration) {
    let until = tokio::time::Instant::now() + deadline;
    let mut reported = None;
    loop {
        let left = handle.work_left().await;
        if left == 0 {
            tracing::info!("drained: no requests left");
            return;
        }
        if tokio::time::Instant::now() >= until {
            tracing::warn!(left, "drain deadline passed with requests still running");
            return;
        }
        if reported != Some(left) {
            notifier.status(&format!("draining: {left} requests left"));
            reported = Some(left);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
