//! A gRPC service that exists before its implementation does. A worker serves health and
//! `Worker.Info` while its model loads, but tonic fixes a server's routes when it starts; so
//! the role services are routed from the start through a [`Pending`] slot, which refuses
//! every call as UNAVAILABLE until the loaded service is put in it.

use std::{
    convert::Infallible,
    sync::{Arc, OnceLock},
    task::{Context, Poll},
};

use tonic::{
    body::Body,
    codegen::{BoxFuture, http},
    server::NamedService,
};
use tower::{Service, ServiceExt as _};

/// Routes to `S` once [`Pending::set`] was called; until then answers UNAVAILABLE.
#[derive(Debug)]
pub struct Pending<S> {
    slot: Arc<OnceLock<S>>,
}

impl<S> Clone for Pending<S> {
    fn clone(&self) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
        }
    }
}

impl<S> Default for Pending<S> {
    fn default() -> Self {
        Self {
            slot: Arc::default(),
        }
    }
}

impl<S> Pending<S> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts the loaded service in place; calls from now on reach it. A second call is ignored
    /// (the first service stays).
    pub fn set(&self, service: S) {
        let _ = self.slot.set(service);
    }
}

impl<S: NamedService> NamedService for Pending<S> {
    const NAME: &'static str = S::NAME;
}

/// What a call to a service that is not loaded yet gets: the standard UNAVAILABLE error
/// detail, so a caller tries another worker.
fn not_loaded() -> tonic::Status {
    proto::error::to_status(&proto::v1::ErrorInfo {
        kind: proto::v1::ErrorKind::Unavailable.into(),
        message: "the worker is still loading its model".to_owned(),
        ..Default::default()
    })
}

impl<S> Service<http::Request<Body>> for Pending<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness of the inner service is awaited per call (it may appear between calls).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        match self.slot.get() {
            Some(service) => {
                let service = service.clone();
                Box::pin(service.oneshot(request))
            }
            None => Box::pin(async { Ok(not_loaded().into_http()) }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;

    async fn call<S>(pending: &Pending<S>) -> http::Response<Body>
    where
        Pending<S>:
            Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    {
        pending
            .clone()
            .call(http::Request::new(Body::empty()))
            .await
            .unwrap()
    }

    /// Refused as UNAVAILABLE (with the error detail callers branch on) until set, then every
    /// call reaches the service.
    #[tokio::test]
    async fn refuses_until_set_then_forwards() {
        let pending = Pending::new();
        let refused = call(&pending).await;
        let status = tonic::Status::from_header_map(refused.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        let detail = proto::error::from_status(&status);
        assert_eq!(detail.kind, i32::from(proto::v1::ErrorKind::Unavailable));
        assert!(detail.message.contains("loading"), "{detail:?}");

        pending.set(tower::service_fn(|_: http::Request<Body>| async {
            Ok::<_, Infallible>(
                http::Response::builder()
                    .status(204)
                    .body(Body::empty())
                    .unwrap(),
            )
        }));
        assert_eq!(call(&pending).await.status(), 204);
    }
}
