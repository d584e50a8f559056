//! A worker's membership in a router: register (with retries), heartbeat with the current state
//! and load at the interval the router asks for, register again when the router no longer
//! knows it (it restarted, or dropped the worker after missed heartbeats), deregister at the
//! end of a drain.

use std::time::Duration;

use proto::{
    auth::{AuthChannel, Credentials},
    v1::{DeregisterRequest, HeartbeatRequest, RegisterRequest, registry_client::RegistryClient},
};

use crate::worker_info::WorkerHandle;

/// Pause between failed registration attempts.
const RETRY: Duration = Duration::from_millis(500);

/// Keeps the worker registered with the router at `router` (its gRPC host:port): registers,
/// heartbeats its state and load (a draining worker keeps heartbeating as draining, so the
/// router sends it nothing new but still lists it), registers again when the router forgot
/// it. Sends on `registered` after the first successful registration. Runs until aborted;
/// [`deregister`] ends the membership.
pub async fn keep_registered(
    handle: WorkerHandle,
    router: String,
    credentials: Credentials,
    registered: tokio::sync::oneshot::Sender<()>,
) {
    let Some(mut client) = client(&router, &credentials) else {
        return;
    };
    let mut registered = Some(registered);
    loop {
        let interval = register(&mut client, &handle, &router).await;
        if let Some(tx) = registered.take() {
            let _ = tx.send(());
        }
        loop {
            tokio::time::sleep(interval).await;
            let info = handle.snapshot().await;
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

/// Tells the router at `router` that worker `worker_id` is leaving (bounded: a router that
/// does not answer within 2 s drops the worker anyway once its heartbeats stop).
pub async fn deregister(router: &str, credentials: &Credentials, worker_id: String) {
    let Some(mut client) = client(router, credentials) else {
        return;
    };
    let call = client.deregister(DeregisterRequest { worker_id });
    match tokio::time::timeout(Duration::from_secs(2), call).await {
        Ok(Ok(_)) => tracing::info!(%router, "deregistered from the router"),
        Ok(Err(status)) => {
            tracing::warn!(%router, error = %status.message(), "deregistration failed");
        }
        Err(_) => tracing::warn!(%router, "deregistration timed out"),
    }
}

fn client(router: &str, credentials: &Credentials) -> Option<RegistryClient<AuthChannel>> {
    match credentials.endpoint(router) {
        Ok(e) => Some(RegistryClient::new(
            credentials.channel(e.connect_timeout(Duration::from_secs(2)).connect_lazy()),
        )),
        Err(e) => {
            tracing::error!(%router, error = %e, "bad router address; not registering");
            None
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
