//! The decode worker: serves `pdserve.v1.Decode` and `StateTransfer`, reserves pages for
//! incoming prompt state, admits committed requests into its running batch and streams tokens.
//! Without a configured model it serves identity (`Worker`) and gRPC health only.

pub mod admission;
pub mod config;
pub mod service;

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use common::{
    pending::Pending,
    worker_info::ProgressSource,
    worker_server::{ListenOptions, ServeError, WorkerServer, load_on_thread},
};
pub use config::{Cli, DecodeConfig};
use engine::{scheduler::EngineConfig, weights::LoadProgress};
use kv_transfer::sink::StateTransferService;
use proto::v1::{
    Role, WorkerState, decode_server::DecodeServer, state_transfer_server::StateTransferServer,
};
use service::{DecodeService, DecodeWorker};

/// How often the worker refreshes the load it reports in `Info`.
const LOAD_EVERY: Duration = Duration::from_millis(100);

/// Binds the decode worker's listener.
pub async fn bind(config: &DecodeConfig) -> Result<WorkerServer, ServeError> {
    WorkerServer::bind(
        Role::Decode,
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
pub fn engine_config(config: &DecodeConfig) -> EngineConfig {
    EngineConfig {
        page_size: config.page_size as usize,
        num_pages: config.engine_num_pages,
        max_running: config.max_running as usize,
        max_batch_tokens: config.max_batch_tokens as usize,
        ..EngineConfig::default()
    }
}

/// Runs the worker as a process until SIGTERM/SIGINT. With a model, the worker answers health
/// and `Worker.Info` (state LOADING, with the load's progress) and registers with its router
/// while the model loads on its own thread; Decode and StateTransfer answer only once it is
/// loaded.
pub async fn run(
    config: DecodeConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    let server = bind(&config).await?;
    let Some(dir) = config.model_dir.clone() else {
        return server
            .run_until_signal("decode", |routes| routes, &[], signal)
            .await;
    };
    let fault = common::fault::Fault::for_worker("decode").map_err(ServeError::Startup)?;
    let transports = kv_transfer::handshake::parse_transports(&config.transports)
        .map_err(ServeError::Startup)?;
    // Only a worker with a model joins a router: it is the only kind that serves requests.
    let server = server.register_with(config.router.clone());
    let handle = server.handle().clone();
    let progress = load_progress(fault);
    let source = Arc::clone(&progress);
    handle.set_progress_source(ProgressSource(Arc::new(move || source.snapshot())));
    handle.set_state(WorkerState::Loading).await;
    let (decode_slot, transfer_slot) = (Pending::new(), Pending::new());
    let (decode_pending, transfer_pending) = (decode_slot.clone(), transfer_slot.clone());
    let worker_slot: Arc<OnceLock<Arc<DecodeWorker>>> = Arc::default();
    let loaded_worker = Arc::clone(&worker_slot);
    let engine = engine_config(&config);
    let (backend, hybrid) = (config.backend.clone(), config.hybrid);
    let loaded = async move {
        let shown = dir.display().to_string();
        let loaded = load_on_thread("pdserve-load", move || {
            kernels::backend::start_engine(
                &dir,
                engine,
                "pdserve-decode",
                &backend,
                hybrid,
                &progress,
            )
        })
        .await
        .map_err(|e| ServeError::Startup(format!("model_dir {shown}: {e}")))?;
        log_backend_plan(loaded.backend_plan.as_ref());
        let info = handle.snapshot().await;
        let (fingerprint, layout) = (loaded.fingerprint.clone(), loaded.layout.clone());
        let runner = loaded.runner.clone();
        if fault == Some(common::fault::Fault::StallEngine) {
            let stalled = runner.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let _ = stalled.post(|_, _| {
                    loop {
                        std::thread::park();
                    }
                });
            });
        }
        let worker = Arc::new(
            DecodeWorker::new(loaded, info.worker_id, info.address, transports)
                .await
                .with_fault(fault)
                .with_draining(handle.draining()),
        );
        handle
            .set_model(fingerprint, layout, worker.transports())
            .await;
        let reporter = handle.clone();
        tokio::spawn(runner.report_load(LOAD_EVERY, move |load| {
            let reporter = reporter.clone();
            async move { reporter.set_load(load).await }
        }));
        decode_slot.set(DecodeServer::new(DecodeService(Arc::clone(&worker))));
        transfer_slot.set(
            StateTransferServer::new(StateTransferService::new(Arc::clone(&worker)))
                .max_decoding_message_size(kv_transfer::tcp::FRAME_BYTES * 2),
        );
        let _ = loaded_worker.set(worker);
        Ok(())
    };
    let served = server
        .run_after_load(
            "decode",
            |routes| {
                routes
                    .add_service(decode_pending)
                    .add_service(transfer_pending)
            },
            &[
                proto::service_names::DECODE,
                proto::service_names::STATE_TRANSFER,
            ],
            loaded,
            signal,
        )
        .await;
    if let Some(worker) = worker_slot.get() {
        worker.stop_transports();
    }
    served
}

/// Where the model load counts its progress; under the `slow-load` fault it pauses after each
/// shard, so tests can watch the loading state.
fn load_progress(fault: Option<common::fault::Fault>) -> Arc<LoadProgress> {
    let progress = LoadProgress::new();
    Arc::new(if fault == Some(common::fault::Fault::SlowLoad) {
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
