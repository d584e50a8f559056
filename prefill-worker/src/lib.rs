//! The prefill worker: serves `pdserve.v1.Prefill`, runs engine prefill and writes the prompt
//! state into decode reservations. Today it serves identity (`Worker`) and gRPC health; the
//! prefill path arrives with the PD data path work.

pub mod config;

use std::time::Duration;

use common::worker_server::{ListenOptions, ServeError, WorkerServer};
pub use config::{Cli, PrefillConfig};
use proto::v1::Role;

/// Binds the prefill worker's listener.
pub async fn bind(config: &PrefillConfig) -> Result<WorkerServer, ServeError> {
    WorkerServer::bind(
        Role::Prefill,
        ListenOptions {
            key: "grpc_listen",
            listen: config.grpc_listen,
            advertise: config.advertise_address.clone(),
            grace: Duration::from_millis(config.shutdown_grace_ms),
        },
    )
    .await
}

/// Runs the worker as a process until SIGTERM/SIGINT.
pub async fn run(
    config: PrefillConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    bind(&config)
        .await?
        .run_until_signal("prefill", |routes| routes, &[], signal)
        .await
}
