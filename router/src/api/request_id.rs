//! `X-Request-Id`: taken from the client when it sends one, minted (a UUID v7) when it does
//! not, echoed on the response, used in the response `id` (`chatcmpl-<id>`), sent to both
//! workers as gRPC metadata, and recorded on every log line about the request (a `request`
//! span around its handling).

use std::sync::Arc;

use axum::{
    extract::Request,
    http::HeaderValue,
    middleware::Next,
    response::{IntoResponse, Response},
};
use tracing::Instrument;

use super::error::ApiError;

/// The header (the same key is the gRPC metadata the workers read).
pub const HEADER: &str = proto::REQUEST_ID_METADATA;

/// A request's id (validated: 1 to 128 characters of `A-Z a-z 0-9 . _ : -`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub Arc<str>);

impl RequestId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A fresh id.
    pub fn mint() -> Self {
        Self(uuid::Uuid::now_v7().simple().to_string().into())
    }

    /// The client's id, if it is one this server can carry everywhere unchanged.
    pub fn parse(value: &str) -> Option<Self> {
        let ok = (1..=128).contains(&value.len())
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(&b));
        ok.then(|| Self(value.into()))
    }
}

/// Middleware: the request's id into its extensions and its response, its handling inside a
/// `request` span. An id that is not one (too long, odd characters) is a 400.
pub async fn assign(mut request: Request, next: Next) -> Response {
    let id = match request.headers().get(HEADER) {
        None => RequestId::mint(),
        Some(value) => match value.to_str().ok().and_then(RequestId::parse) {
            Some(id) => id,
            None => {
                return ApiError::InvalidRequest(
                    "the X-Request-Id header must be 1 to 128 characters of A-Z, a-z, 0-9, \
                     '.', '_', ':' and '-'"
                        .to_owned(),
                )
                .into_response();
            }
        },
    };
    request.extensions_mut().insert(id.clone());
    let span = tracing::info_span!("request", id = %id.as_str());
    let mut response = next.run(request).instrument(span).await;
    if let Ok(value) = HeaderValue::from_str(id.as_str()) {
        response.headers_mut().insert(HEADER, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        for ok in ["a", "req-42", "0197f8c2.x:y_z", &"x".repeat(128)] {
            assert!(RequestId::parse(ok).is_some(), "{ok}");
        }
        for bad in ["", "a b", "ü", "a/b", "a\nb", &"x".repeat(129)] {
            assert!(RequestId::parse(bad).is_none(), "{bad:?}");
        }
        let minted = RequestId::mint();
        assert_eq!(RequestId::parse(minted.as_str()), Some(minted));
    }
}
