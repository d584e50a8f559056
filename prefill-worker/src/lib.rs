//! The prefill worker: serves `pdserve.v1.Prefill`, runs engine prefill and writes the prompt
//! state into decode reservations. Without a configured model it serves identity (`Worker`)
//! and gRPC health only.

pub mod config;
pub mod service;

use std::{sync::Arc, time::Duration};

use common::worker_server::{ListenOptions, ServeError, WorkerServer};
pub use config::{Cli, PrefillConfig};
use engine::scheduler::EngineConfig;
use proto::v1::{Role, prefill_server::PrefillServer};
use service::{PrefillService, PrefillWorker};

/// How often the worker refreshes the load it reports in `Info`.
const LOAD_EVERY: Duration = Duration::from_millis(100);

/// Binds the prefill worker's listener.
pub async fn bind(config: &PrefillConfig) -> Result<WorkerServer, ServeError> {
    WorkerServer::bind(
        Role::Prefill,
        ListenOptions {
            key: "grpc_listen",
            listen: config.grpc_listen,
            advertise: config.advertise_address.clone(),
            grace: Duration::from_millis(config.shutdown_grace_ms),
            security: common::cluster_auth::Security::load(
                config.cluster_secret_file.as_deref(),
                &config.tls,
            )
            .map_err(|e| ServeError::Startup(format!("{}: {}", e.key, e.reason)))?,
        },
    )
    .await
}

/// The engine settings of a worker configuration.
pub fn engine_config(config: &PrefillConfig) -> EngineConfig {
    EngineConfig {
        page_size: config.page_size as usize,
        num_pages: config.engine_num_pages,
        max_running: config.max_running as usize,
        max_batch_tokens: config.max_batch_tokens as usize,
        ..EngineConfig::default()
    }
}

/// Runs the worker as a process until SIGTERM/SIGINT.
pub async fn run(
    config: PrefillConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    let server = bind(&config).await?;
    let Some(dir) = &config.model_dir else {
        return server
            .run_until_signal("prefill", |routes| routes, &[], signal)
            .await;
    };
    let loaded = kernels::backend::start_engine(
        dir,
        engine_config(&config),
        "pdserve-prefill",
        &config.backend,
        config.hybrid,
    )
    .map_err(|e| ServeError::Startup(format!("model_dir {}: {e}", dir.display())))?;
    log_backend_plan(loaded.backend_plan.as_ref());
    // Only a worker with a model joins a router: it is the only kind that serves requests.
    let server = server.register_with(config.router.clone());
    let info = server.handle().snapshot().await;
    let transports = kv_transfer::handshake::parse_transports(&config.transports)
        .map_err(ServeError::Startup)?;
    let (fingerprint, layout) = (loaded.fingerprint.clone(), loaded.layout.clone());
    let runner = loaded.runner.clone();
    let fault = common::fault::Fault::for_worker("prefill").map_err(ServeError::Startup)?;
    let worker = Arc::new(
        PrefillWorker::new(
            loaded,
            info.worker_id,
            transports,
            config.stream_state,
            server.credentials(),
        )
        .with_fault(fault)
        .with_draining(server.handle().draining()),
    );
    server
        .handle()
        .set_model(fingerprint, layout, worker.transports())
        .await;
    let handle = server.handle().clone();
    tokio::spawn(runner.report_load(LOAD_EVERY, move |load| {
        let handle = handle.clone();
        async move { handle.set_load(load).await }
    }));
    let prefill = PrefillServer::new(PrefillService(Arc::clone(&worker)));
    let served = server
        .run_until_signal(
            "prefill",
            |routes| routes.add_service(prefill),
            &[proto::service_names::PREFILL],
            signal,
        )
        .await;
    worker.stop_transports();
    served
}

/// Says where the forward pass runs; a hybrid plan is a warning (part of it on the CPU).
fn log_backend_plan(plan: Option<&engine::backend::BackendPlan>) {
    match plan {
        None => tracing::info!("compute backend: cpu (reference forward pass)"),
        Some(plan) if plan.is_hybrid() => tracing::warn!(%plan, "compute backend in hybrid mode"),
        Some(plan) => tracing::info!(%plan, "compute backend"),
    }
}
