//! The decode worker: serves `pdserve.v1.Decode` and `StateTransfer`, reserves pages for
//! incoming prompt state, admits committed requests into its running batch and streams tokens.
//! Today it serves identity (`Worker`) and gRPC health; decoding arrives with the PD data path
//! work.

pub mod config;

use std::time::Duration;

use common::worker_server::{ListenOptions, ServeError, WorkerServer};
pub use config::{Cli, DecodeConfig};
use proto::v1::Role;

/// Binds the decode worker's listener.
pub async fn bind(config: &DecodeConfig) -> Result<WorkerServer, ServeError> {
    WorkerServer::bind(
        Role::Decode,
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
    config: DecodeConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    bind(&config)
        .await?
        .run_until_signal("decode", |routes| routes, &[], signal)
        .await
}
