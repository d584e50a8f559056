//! `pdctl health`: one probe, one line of output.

use std::{net::SocketAddr, time::Duration};

use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::{HealthArgs, PdctlError};

const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// gRPC health of `service` at `addr` (connecting as `credentials` say: plain or mutual TLS);
/// Ok only when SERVING.
pub async fn grpc(
    addr: SocketAddr,
    service: &str,
    credentials: &proto::auth::Credentials,
) -> Result<(), PdctlError> {
    let what = format!("gRPC {addr} service {service:?}");
    let unhealthy = |reason: String| PdctlError::Unhealthy {
        what: what.clone(),
        reason,
    };
    let check = async {
        let channel = credentials
            .endpoint(&addr.to_string())
            .map_err(|e| unhealthy(e.to_string()))?
            .connect()
            .await
            .map_err(|e| unhealthy(e.to_string()))?;
        let mut client = HealthClient::new(channel);
        let reply = client
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .map_err(|s| unhealthy(format!("{:?}: {}", s.code(), s.message())))?;
        let status = reply.into_inner().status();
        if status == tonic_health::pb::health_check_response::ServingStatus::Serving {
            Ok(())
        } else {
            Err(unhealthy(format!("status {}", status.as_str_name())))
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, check)
        .await
        .map_err(|_| unhealthy(format!("no answer within {PROBE_TIMEOUT:?}")))?
}

/// HTTP `GET /health` at `addr`; Ok only on 200.
pub async fn http(addr: SocketAddr) -> Result<(), PdctlError> {
    let response = common::http_client::get(addr, "/health", PROBE_TIMEOUT)
        .await
        .map_err(|e| PdctlError::Unhealthy {
            what: format!("http://{addr}/health"),
            reason: e.to_string(),
        })?;
    if response.status == 200 {
        Ok(())
    } else {
        Err(PdctlError::Unhealthy {
            what: format!("http://{addr}/health"),
            reason: format!("status {}", response.status),
        })
    }
}

/// Runs `pdctl health`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn probe(args: &HealthArgs) -> Result<(), PdctlError> {
    if let Some(addr) = args.grpc {
        let tls = args
            .tls
            .settings()
            .load()
            .map_err(|e| PdctlError::Unhealthy {
                what: addr.to_string(),
                reason: format!("{}: {}", e.key, e.reason),
            })?;
        let credentials = proto::auth::Credentials::none()
            .with_tls(tls.as_ref().map(common::internal_tls::InternalTls::client));
        grpc(addr, &args.service, &credentials).await?;
        println!("{addr} SERVING");
    } else if let Some(addr) = args.http {
        http(addr).await?;
        println!("http://{addr}/health ok");
    }
    Ok(())
}
