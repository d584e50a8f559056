//! The decode worker: serves `pdserve.v1.Decode` and `StateTransfer`, reserves pages for
//! incoming prompt state, admits committed requests into its running batch and streams tokens.
//! Without a configured model it serves identity (`Worker`) and gRPC health only.

pub mod admission;
pub mod config;
pub mod service;

use std::{sync::Arc, time::Duration};

use common::worker_server::{ListenOptions, ServeError, WorkerServer};
pub use config::{Cli, DecodeConfig};
use engine::scheduler::EngineConfig;
use kv_transfer::tcp::StateTransferService;
use proto::v1::{Role, decode_server::DecodeServer, state_transfer_server::StateTransferServer};
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

/// Runs the worker as a process until SIGTERM/SIGINT.
pub async fn run(
    config: DecodeConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    let server = bind(&config).await?;
    let Some(dir) = &config.model_dir else {
        return server
            .run_until_signal("decode", |routes| routes, &[], signal)
            .await;
    };
    let loaded = kernels::backend::start_engine(
        dir,
        engine_config(&config),
        "pdserve-decode",
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
    let fault = common::fault::Fault::for_worker("decode").map_err(ServeError::Startup)?;
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
    let decode = DecodeServer::new(DecodeService(Arc::clone(&worker)));
    let transfer = StateTransferServer::new(StateTransferService::new(Arc::clone(&worker)))
        .max_decoding_message_size(kv_transfer::tcp::FRAME_BYTES * 2);
    let served = server
        .run_until_signal(
            "decode",
            |routes| routes.add_service(decode).add_service(transfer),
            &[
                proto::service_names::DECODE,
                proto::service_names::STATE_TRANSFER,
            ],
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
