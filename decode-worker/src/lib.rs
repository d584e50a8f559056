//! The decode worker: serves `pdserve.v1.Decode` and `StateTransfer`, reserves pages for
//! incoming prompt state, admits committed requests into its running batch and streams tokens.
//! Start-up, loading, registration and draining are worker-core's; this crate holds the
//! decode services and their settings. Without a configured model it serves identity
//! (`Worker`) and gRPC health only.

pub mod admission;
pub mod config;
pub mod service;

use std::{sync::Arc, time::Duration};

use common::{fault::Fault, pending::Pending, worker_server::ServeError};
pub use config::{Cli, DecodeConfig};
use kv_transfer::sink::StateTransferService;
use proto::v1::{Role, decode_server::DecodeServer, state_transfer_server::StateTransferServer};
use service::{DecodeService, DecodeWorker};
use worker_core::{Loaded, RoleSpec};

/// The decode role, for the shared start-up.
pub const ROLE: RoleSpec = RoleSpec {
    role: Role::Decode,
    name: "decode",
    engine_thread: "pdserve-decode",
    services: &[
        proto::service_names::DECODE,
        proto::service_names::STATE_TRANSFER,
    ],
};

/// Runs the worker as a process until SIGTERM/SIGINT (see [`worker_core::run`]); Decode and
/// StateTransfer answer once the model is loaded.
pub async fn run(
    config: DecodeConfig,
    signal: common::shutdown::ShutdownSignal,
) -> Result<(), ServeError> {
    let (decode_slot, transfer_slot) = (Pending::new(), Pending::new());
    let (decode_pending, transfer_pending) = (decode_slot.clone(), transfer_slot.clone());
    let routes = |routes: tonic::service::Routes| {
        routes
            .add_service(decode_pending)
            .add_service(transfer_pending)
    };
    worker_core::run(
        &config.worker,
        ROLE,
        signal,
        routes,
        |loaded: Loaded| async move {
            if loaded.fault == Some(Fault::StallEngine) {
                stall_engine(loaded.engine.ranks.first().clone());
            }
            let (fault, draining) = (loaded.fault, loaded.draining);
            let worker = Arc::new(
                DecodeWorker::new(
                    loaded.engine,
                    loaded.worker_id,
                    loaded.address,
                    loaded.transports,
                )
                .await
                .with_fault(fault)
                .with_draining(draining),
            );
            decode_slot.set(DecodeServer::new(DecodeService(Arc::clone(&worker))));
            transfer_slot.set(
                StateTransferServer::new(StateTransferService::new(Arc::clone(&worker)))
                    .max_decoding_message_size(kv_transfer::tcp::FRAME_BYTES * 2),
            );
            Ok(worker)
        },
    )
    .await
}

/// Under [`Fault::StallEngine`] the engine thread stops a second after start, forever.
fn stall_engine(runner: engine::runner::Runner) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = runner.post(|_, _| {
            loop {
                std::thread::park();
            }
        });
    });
}
