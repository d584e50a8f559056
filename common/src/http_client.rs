//! A minimal HTTP/1.1 client for health probes and operator tools (one request per
//! connection, bounded by a timeout). Not a general client.

use std::{net::SocketAddr, time::Duration};

use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;

/// What went wrong with a probe.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("connect {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("bad request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// A response: status code and body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Bytes,
}

/// Sends one request and reads the whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    request_with(addr, method, path, &[], body, timeout).await
}

/// [`request`] with extra headers (e.g. `authorization`).
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    tokio::time::timeout(timeout, async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| HttpError::Connect { addr, source })?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let driver = tokio::spawn(conn);
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string());
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let payload = match body {
            Some((content_type, bytes)) => {
                builder = builder.header("content-type", content_type);
                Bytes::from(bytes)
            }
            None => Bytes::new(),
        };
        let response = sender
            .send_request(builder.body(Full::new(payload))?)
            .await?;
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = response.into_body().collect().await?.to_bytes();
        driver.abort();
        Ok(HttpResponse {
            status,
            content_type,
            body,
        })
    })
    .await
    .map_err(|_| HttpError::Timeout(timeout))?
}

/// `GET path`.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    request(addr, "GET", path, None, timeout).await
}
