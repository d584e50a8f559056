//! A worker process's life, the same for both roles: bind, load the model on its own thread
//! while answering health and `Worker.Info` (state LOADING, with the load's progress) and
//! registering with the router, then serve the role's services until a signal, and stop the
//! transports before the process exits.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use common::{
    fault::Fault,
    shutdown::ShutdownSignal,
    worker_info::{DrainingFlag, ProgressSource},
    worker_server::{ListenOptions, ServeError, WorkerServer, load_on_thread},
};
use engine::{start::LoadedEngine, weights::LoadProgress};
use proto::{
    auth::Credentials,
    v1::{Role, TransportKind, WorkerState},
};
use tonic::service::Routes;

use crate::settings::WorkerSettings;

/// How often the worker refreshes the load it reports in `Info`.
const LOAD_EVERY: Duration = Duration::from_millis(100);

/// What a role is, for the shared start-up.
#[derive(Debug, Clone, Copy)]
pub struct RoleSpec {
    pub role: Role,
    /// Short name in logs, the readiness line and fault selection (`prefill`, `decode`).
    pub name: &'static str,
    /// Name of the engine's thread (and of the process in its logs).
    pub engine_thread: &'static str,
    /// The role's gRPC service names (health reports them once the model is loaded).
    pub services: &'static [&'static str],
}

/// What a role builds its worker from, once the model is loaded.
#[derive(Debug)]
pub struct Loaded {
    pub engine: LoadedEngine,
    pub worker_id: String,
    /// host:port peers dial to reach this worker.
    pub address: String,
    /// The configured transports, in order of preference.
    pub transports: Vec<TransportKind>,
    /// A deliberate corruption selected by the environment (tests only).
    pub fault: Option<Fault>,
    /// Set when the worker drains: the role refuses new requests.
    pub draining: DrainingFlag,
    /// What this worker's own calls to other processes carry.
    pub credentials: Credentials,
    /// The worker's own metrics (the role records its state transfers there).
    pub metrics: Arc<crate::metrics::WorkerMetrics>,
}

/// A role's worker, as the shared start-up sees it.
pub trait RoleWorker: Send + Sync + 'static {
    /// Its UCX endpoint (exporting pages on decode, putting into them on prefill).
    type Ucx: crate::transports::Endpoint;
    /// The transports it offers and their endpoints.
    fn offered(&self) -> &crate::transports::Offered<Self::Ucx>;
}

/// Binds the worker's listener with its security settings.
pub async fn bind(settings: &WorkerSettings, role: Role) -> Result<WorkerServer, ServeError> {
    WorkerServer::bind(
        role,
        ListenOptions {
            key: "grpc_listen",
            listen: settings.grpc_listen,
            advertise: settings.advertise_address.clone(),
            grace: Duration::from_millis(settings.shutdown_grace_ms),
            security: common::cluster_auth::Security::load(
                settings.cluster_secret_file.as_deref(),
                &settings.tls,
            )
            .map_err(|e| ServeError::Startup(format!("{}: {}", e.key, e.reason)))?,
        },
    )
    .await
}

/// Runs a worker until SIGTERM/SIGINT. Without a model it serves identity and health only.
/// With one, `build` makes the role's worker from the loaded engine (and fills the services
/// `routes` added); those services answer once it returns.
pub async fn run<W, Build, Built>(
    settings: &WorkerSettings,
    spec: RoleSpec,
    signal: ShutdownSignal,
    routes: impl FnOnce(Routes) -> Routes,
    build: Build,
) -> Result<(), ServeError>
where
    W: RoleWorker,
    Build: FnOnce(Loaded) -> Built,
    Built: Future<Output = Result<Arc<W>, ServeError>>,
{
    let mut server = bind(settings, spec.role).await?;
    let metrics = crate::metrics::WorkerMetrics::new(spec.name);
    if let Some(addr) = settings.metrics_listen {
        let listener = common::listen::bind("metrics_listen", addr).await?;
        let bound = listener.local_addr()?;
        tracing::info!(addr = %bound, "metrics listening");
        server = server.announcing("metrics", bound);
        tokio::spawn(crate::metrics::serve(listener, Arc::clone(&metrics)));
    }
    let Some(dir) = settings.model_dir.clone() else {
        return server
            .run_until_signal(spec.name, |routes| routes, &[], signal)
            .await;
    };
    let fault = Fault::for_worker(spec.name).map_err(|e| ServeError::Startup(e.to_string()))?;
    // Only a worker with a model joins a router: it is the only kind that serves requests.
    let server = server.register_with(settings.router.clone());
    let handle = server.handle().clone();
    let credentials = server.credentials();
    let progress = load_progress(fault);
    let source = Arc::clone(&progress);
    handle.set_progress_source(ProgressSource(Arc::new(move || source.snapshot())));
    handle.set_state(WorkerState::Loading).await;
    let worker_slot: Arc<OnceLock<Arc<W>>> = Arc::default();
    let loaded_worker = Arc::clone(&worker_slot);
    let (engine, backend, hybrid) = (settings.engine_config(), settings.backend, settings.hybrid);
    let group = settings.group_spec();
    // A decode worker gets every prompt's state from a prefill worker: its engine only decodes.
    let work = match spec.role {
        Role::Decode => kernels::backend::EngineWork::DecodeOnly {
            fast_attention: settings.decode_attention == crate::settings::DecodeAttention::Fast,
            graphs: settings.decode_graphs,
            fast_experts: settings.decode_experts == crate::settings::DecodeExperts::Fast,
            fast_linears: settings.decode_linears == crate::settings::DecodeLinears::Fast,
        },
        _ => kernels::backend::EngineWork::All {
            fast_attention: settings.prefill_attention == crate::settings::PrefillAttention::Fast,
            fast_linears: settings.prefill_linears == crate::settings::PrefillLinears::Fast,
            gemm_experts: settings.prefill_experts == crate::settings::PrefillExperts::Fast,
        },
    };
    let transports = settings.transport_kinds();
    // What computes its steps, reported in `Info` once the plan is known.
    let mut compute = settings.compute(None);
    let loaded = async move {
        let shown = dir.display().to_string();
        let thread = spec.engine_thread;
        let loaded = load_on_thread("pdserve-load", move || {
            kernels::backend::start_engine(
                &dir,
                engine,
                thread,
                (backend, work),
                hybrid,
                group,
                &progress,
            )
        })
        .await
        .map_err(|e| ServeError::Startup(format!("model_dir {shown}: {e}")))?;
        log_backend_plan(loaded.backend_plan.as_ref());
        compute.plan = loaded
            .backend_plan
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        let info = handle.snapshot().await;
        let (fingerprint, layout) = (loaded.fingerprint.clone(), loaded.layout.clone());
        let ranks = loaded.ranks.clone();
        log_group(&loaded.group);
        // Every rank of a replicated group (TP) runs every request: its steps are counted once.
        let observed = if ranks.is_replicated() {
            1
        } else {
            ranks.len()
        };
        for runner in &ranks.runners()[..observed] {
            let observer = metrics.observer();
            runner
                .call(move |engine, _| engine.set_step_observer(observer))
                .await
                .map_err(|e| ServeError::Startup(e.to_string()))?;
        }
        let group_layout = loaded.group.to_proto();
        let worker = build(Loaded {
            engine: loaded,
            worker_id: info.worker_id,
            address: info.address,
            transports,
            fault,
            draining: handle.draining(),
            credentials,
            metrics: Arc::clone(&metrics),
        })
        .await?;
        // Before the model: a worker that reports a model reports how it computes.
        handle.set_compute(compute).await;
        handle
            .set_model(fingerprint, layout, &worker.offered().kinds)
            .await;
        handle.set_group(group_layout).await;
        // The first load goes with the model, so no `Info` of a ready worker lacks it.
        let first = ranks
            .load()
            .await
            .map_err(|e| ServeError::Startup(e.to_string()))?;
        metrics.set_load(&first);
        handle.set_load(first).await;
        tokio::spawn(report_load(ranks, handle.clone(), metrics));
        let _ = loaded_worker.set(worker);
        Ok(())
    };
    let served = server
        .run_after_load(spec.name, routes, spec.services, loaded, signal)
        .await;
    if let Some(worker) = worker_slot.get() {
        worker.offered().stop();
    }
    served
}

/// Keeps the worker's `Info` and metrics up to date with its ranks' load. Once the ranks lost
/// lockstep the worker reports itself failed (the router stops sending it requests) and stops
/// reporting load, so a systemd watchdog sees a stale engine and restarts the unit.
async fn report_load(
    ranks: engine::parallel::group::Ranks,
    handle: common::worker_info::WorkerHandle,
    metrics: Arc<crate::metrics::WorkerMetrics>,
) {
    let watched = ranks.clone();
    let failed = handle.clone();
    tokio::spawn(async move {
        let reason = watched.failed().await;
        tracing::error!(%reason, "the worker failed; restart it");
        failed.set_state(WorkerState::Failed).await;
    });
    while let Ok(load) = ranks.load().await {
        metrics.set_load(&load);
        handle.set_load(load).await;
        tokio::time::sleep(LOAD_EVERY).await;
    }
}

/// Says how the model is spread over the worker's ranks, when there are several.
fn log_group(group: &engine::parallel::group::GroupSpec) {
    if group.ranks() > 1 {
        let p = group.parallel;
        tracing::info!(
            ranks = group.ranks(),
            tp = p.tp,
            ep = p.ep,
            dp_attention = p.dp_attention,
            moe_tp = p.moe_tp,
            threads_per_rank = group.threads_per_rank,
            "model spread over ranks"
        );
    }
}

/// Where the model load counts its progress; under the `slow-load` fault it pauses after each
/// shard, so tests can watch the loading state.
fn load_progress(fault: Option<Fault>) -> Arc<LoadProgress> {
    let progress = LoadProgress::new();
    Arc::new(if fault == Some(Fault::SlowLoad) {
        progress.with_shard_hook(Box::new(|_| {
            std::thread::sleep(common::fault::SLOW_LOAD_PER_SHARD);
        }))
    } else {
        progress
    })
}

/// Says where the forward pass runs; a hybrid plan is a warning (part of it on the CPU).
fn log_backend_plan(plan: Option<&engine::backend::BackendPlan>) {
    match plan {
        None => tracing::info!("compute backend: cpu (reference forward pass)"),
        Some(plan) if plan.is_hybrid() => tracing::warn!(%plan, "compute backend in hybrid mode"),
        Some(plan) => tracing::info!(%plan, "compute backend"),
    }
}
