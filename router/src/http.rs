//! The HTTP surface. Today: liveness and an OpenAI-style 404; the API arrives with the
//! OpenAI API work.

use axum::{
    Json, Router,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Serialize;

/// OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

/// The inner OpenAI error object.
#[derive(Debug, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}

fn error(status: StatusCode, kind: &'static str, message: String) -> Response {
    (
        status,
        Json(ErrorBody {
            error: ErrorObject {
                message,
                kind,
                param: None,
                code: None,
            },
        }),
    )
        .into_response()
}

/// All HTTP routes.
pub fn routes(max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .fallback(|uri: axum::http::Uri| async move {
            error(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("no route for {}", uri.path()),
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
}
