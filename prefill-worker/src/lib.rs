//! The prefill worker: serves `pdserve.v1.Prefill`, runs engine prefill and writes the prompt
//! state into decode reservations. Start-up, loading, registration and draining are
//! worker-core's; this crate holds the prefill service and its settings. Without a configured
//! model it serves identity (`Worker`) and gRPC health only.

pub mod config;
pub mod service;

use std::sync::Arc;

use common::{pending::Pending, worker_server::ServeError};
pub use config::{Cli, PrefillConfig};
use proto::v1::{Role, prefill_server::PrefillServer};
use service::{PrefillService, PrefillWorker};
use worker_core::{Loaded, RoleSpec};

/// The prefill role, for the shared start-up.
pub const ROLE: RoleSpec = RoleSpec {
    role: Role::Prefill,
    name: "prefill",
    engine_thread: "pdserve-prefill",
    services: &[proto::service_names::PREFILL],
};

/// Runs the worker as a process until SIGTERM/SIGINT (see [`worker_core::run`]); the Prefill
/// service answers once the model is loaded.
pub async fn run(
    config: PrefillConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    let pending = Pending::new();
    let slot = pending.clone();
    let stream_state = config.stream_state;
    let routes = |routes: tonic::service::Routes| routes.add_service(pending);
    worker_core::run(
        &config.worker,
        ROLE,
        signal,
        routes,
        |loaded: Loaded| async move {
            let worker = Arc::new(
                PrefillWorker::new(
                    loaded.engine,
                    loaded.worker_id,
                    loaded.transports,
                    stream_state,
                    loaded.credentials,
                )
                .with_fault(loaded.fault)
                .with_draining(loaded.draining)
                .with_metrics(loaded.metrics),
            );
            slot.set(PrefillServer::new(PrefillService(Arc::clone(&worker))));
            Ok(worker)
        },
    )
    .await
}
