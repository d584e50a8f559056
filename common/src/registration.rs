//! A worker's membership in a router: register (with retries), heartbeat with the current load
//! at the interval the router asks for, register again when the router no longer knows it
//! (it restarted, or dropped the worker after missed heartbeats), deregister on shutdown.

use std::time::Duration;

use proto::{
    auth::{AuthChannel, Credentials},
    v1::{
        DeregisterRequest, HeartbeatRequest, RegisterRequest, WorkerState,
        registry_client::RegistryClient,
    },
};
use tonic::transport::Endpoint;

use crate::worker_info::WorkerHandle;

/// Pause between failed registration attempts.
const RETRY: Duration = Duration::from_millis(500);

/// Keeps the worker registered with the router at `router` (its gRPC host:port) until the
/// worker starts draining; then deregisters. Runs forever otherwise (spawn it).
pub async fn keep_registered(handle: WorkerHandle, router: String, credentials: Credentials) {
    let channel = match Endpoint::from_shared(format!("http://{router}")) {
        Ok(e) => e.connect_timeout(Duration::from_secs(2)).connect_lazy(),
        Err(e) => {
            tracing::error!(%router, error = %e, "bad router address; not registering");
            return;
        }
    };
    let mut client = RegistryClient::new(credentials.channel(channel));
    loop {
        let interval = register(&mut client, &handle, &router).await;
        // Heartbeat until the router forgets us or we drain.
        loop {
            tokio::time::sleep(interval).await;
            let info = handle.snapshot().await;
            if info.state == i32::from(WorkerState::Draining) {
                let _ = client
                    .deregister(DeregisterRequest {
                        worker_id: info.worker_id,
                    })
                    .await;
                return;
            }
            let beat = client
                .heartbeat(HeartbeatRequest {
                    worker_id: info.worker_id,
                    state: info.state,
                    load: info.load,
                })
                .await;
            match beat {
                Ok(r) if r.get_ref().known => {}
                Ok(_) => {
                    tracing::warn!(%router, "the router no longer knows this worker; registering again");
                    break;
                }
                Err(status) => {
                    tracing::warn!(%router, error = %status.message(), "heartbeat failed");
                }
            }
        }
    }
}

/// Registers (retrying until it succeeds); returns the heartbeat interval.
async fn register(
    client: &mut RegistryClient<AuthChannel>,
    handle: &WorkerHandle,
    router: &str,
) -> Duration {
    loop {
        let info = handle.snapshot().await;
        match client
            .register(RegisterRequest { worker: Some(info) })
            .await
        {
            Ok(r) => {
                tracing::info!(%router, "registered with the router");
                return Duration::from_millis(u64::from(r.get_ref().heartbeat_interval_ms.max(50)));
            }
            Err(status) => {
                tracing::warn!(%router, error = %status.message(), "registration failed; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}
