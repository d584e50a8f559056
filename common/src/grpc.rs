//! Serving gRPC the same way in every process: standard health service, graceful shutdown,
//! listener bound beforehand (so the port is known and "address in use" is a config error).

use std::{future::Future, time::Duration};

use tokio::{net::TcpListener, sync::oneshot};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::Routes;
use tonic_health::{ServingStatus, server::HealthReporter};

use crate::cluster_auth::{RequireSecretLayer, Security};

/// The standard `grpc.health.v1.Health` service and its reporter.
pub fn health() -> (
    HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    tonic_health::server::health_reporter()
}

/// Marks the process (service name "") and each named service as serving.
pub async fn set_serving(reporter: &HealthReporter, services: &[&str]) {
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    for service in services {
        reporter
            .set_service_status(*service, ServingStatus::Serving)
            .await;
    }
}

/// Marks everything not serving (shutdown or drain has begun).
pub async fn set_not_serving(reporter: &HealthReporter, services: &[&str]) {
    reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    for service in services {
        reporter
            .set_service_status(*service, ServingStatus::NotServing)
            .await;
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves, then lets in-flight calls finish
/// for at most `grace` before returning anyway. With a secret, every call but health must
/// carry it; with TLS, every connection must present a certificate of the cluster CA.
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    security: &Security,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> Result<(), tonic::transport::Error> {
    let (stopping_tx, stopping_rx) = oneshot::channel::<()>();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &security.tls {
        builder = builder.tls_config(tls.server_config())?;
    }
    let server = builder
        .layer(RequireSecretLayer::new(security.secret.clone()))
        .add_routes(routes)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.await;
            let _ = stopping_tx.send(());
        });
    tokio::pin!(server);
    let grace_over = async move {
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        result = &mut server => result,
        () = grace_over => {
            tracing::warn!(grace_ms = grace.as_millis(), "in-flight calls outlived the grace period; closing them");
            Ok(())
        }
    }
}
