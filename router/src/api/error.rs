//! Every error the HTTP API returns, and the one place that maps each to its status, OpenAI
//! error `type`, `param` and `code`.

use axum::{
    Json,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use proto::v1::ErrorKind;
use serde::Serialize;

use crate::backend::BackendError;

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

/// An API error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON (or not a JSON object).
    #[error("{0}")]
    InvalidJson(String),
    /// One parameter is invalid (wrong type, out of range, not accepted).
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// The request is invalid as a whole (e.g. the official converter refused it).
    #[error("{0}")]
    InvalidRequest(String),
    /// The `model` is not served here.
    #[error("The model `{model}` does not exist. Served models: {served}.")]
    UnknownModel { model: String, served: String },
    /// Prompt plus completion exceed the context.
    #[error("{message}")]
    ContextLength { param: String, message: String },
    /// The body exceeds `max_body_bytes`.
    #[error("request body exceeds the limit of {0} bytes")]
    PayloadTooLarge(u64),
    /// Missing or wrong API key.
    #[error("missing or invalid API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    /// The API key already has its maximum of requests in flight.
    #[error("this API key already has {0} requests in flight (the limit); retry when one ends")]
    TooManyRequests(u32),
    /// No route.
    #[error("no route for {0}")]
    NotFound(String),
    /// No backend can serve now.
    #[error("{0}")]
    Unavailable(String),
    /// A failure inside the router.
    #[error("{0}")]
    Internal(String),
    /// The backend refused or failed the request; its kind decides the status.
    #[error("{0}")]
    Backend(BackendError),
}

impl From<BackendError> for ApiError {
    fn from(error: BackendError) -> Self {
        Self::Backend(error)
    }
}

impl ApiError {
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidParam {
            param: param.into(),
            message: message.into(),
        }
    }

    /// A request the official converter refused (400). Its messages name a field as
    /// `Invalid <field> value, ...`: that field becomes the error's `param`.
    pub fn conversion(error: &impl std::fmt::Display) -> Self {
        let message = error.to_string();
        let field = message
            .strip_prefix("Invalid ")
            .and_then(|rest| rest.split_once(" value"))
            .map(|(field, _)| field)
            .filter(|f| {
                !f.is_empty()
                    && f.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            });
        match field {
            Some(field) => Self::param(field, message.clone()),
            None => Self::InvalidRequest(message),
        }
    }

    /// HTTP status, OpenAI `type`, `param` and `code` of this error.
    pub fn parts(&self) -> (StatusCode, &'static str, Option<&str>, Option<&'static str>) {
        const BAD: StatusCode = StatusCode::BAD_REQUEST;
        const INVALID: &str = "invalid_request_error";
        match self {
            Self::InvalidJson(_) => (BAD, INVALID, None, Some("invalid_json")),
            Self::InvalidParam { param, .. } => (BAD, INVALID, Some(param), Some("invalid_value")),
            Self::InvalidRequest(_) => (BAD, INVALID, None, Some("invalid_request_error")),
            Self::UnknownModel { .. } => (BAD, INVALID, Some("model"), Some("model_not_found")),
            Self::ContextLength { param, .. } => {
                (BAD, INVALID, Some(param), Some("context_length_exceeded"))
            }
            Self::PayloadTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                None,
                Some("request_too_large"),
            ),
            Self::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                None,
                Some("invalid_api_key"),
            ),
            Self::TooManyRequests(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                None,
                Some("rate_limit_exceeded"),
            ),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found_error", None, None),
            Self::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                None,
                Some("service_unavailable"),
            ),
            Self::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                None,
                Some("internal_error"),
            ),
            Self::Backend(e) => backend_parts(e.kind),
        }
    }

    /// The `kind` label of this error in `pdserve_errors_total` (one of
    /// [`crate::metrics::ERROR_KINDS`]).
    pub fn metric_kind(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::InvalidParam { .. } => "invalid_param",
            Self::InvalidRequest(_) => "invalid_request",
            Self::UnknownModel { .. } => "unknown_model",
            Self::ContextLength { .. } => "context_length",
            Self::PayloadTooLarge(_) => "payload_too_large",
            Self::Unauthorized => "unauthorized",
            Self::TooManyRequests(_) => "too_many_requests",
            Self::NotFound(_) => "not_found",
            Self::Unavailable(_) => "unavailable",
            Self::Internal(_) => "internal",
            Self::Backend(e) => match backend_parts(e.kind).0 {
                StatusCode::BAD_REQUEST => "invalid_request",
                StatusCode::SERVICE_UNAVAILABLE => "unavailable",
                _ => "internal",
            },
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        let (_, kind, param, code) = self.parts();
        ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind,
                param: param.map(str::to_owned),
                code: code.map(str::to_owned),
            },
        }
    }
}

/// HTTP status, OpenAI `type`, `param` and `code` of a backend failure of `kind`: the one place
/// a worker's error kind becomes what the client sees. Retryable conditions (no capacity, no
/// worker, cancelled by a draining worker, a lost reservation, processes of the cluster that
/// refuse to pair or to authenticate each other) are 503; an expired deadline 504; a failed
/// state transfer 502; the request's own fault 400; anything else inside a worker 500.
fn backend_parts(
    kind: ErrorKind,
) -> (
    StatusCode,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
) {
    const UNAVAILABLE: &str = "service_unavailable_error";
    match kind {
        ErrorKind::InvalidArgument => (
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            Some("invalid_request_error"),
        ),
        ErrorKind::Overloaded => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("overloaded"),
        ),
        ErrorKind::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("service_unavailable"),
        ),
        ErrorKind::Cancelled => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("cancelled"),
        ),
        ErrorKind::DeadlineExceeded => (
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            None,
            Some("timeout"),
        ),
        ErrorKind::TransferFailed => (
            StatusCode::BAD_GATEWAY,
            "internal_error",
            None,
            Some("state_transfer_failed"),
        ),
        // The cluster cannot serve as configured, or lost the reservation: not the client's
        // fault, and another try (after the operator's fix) may succeed.
        ErrorKind::NotFound => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("reservation_expired"),
        ),
        ErrorKind::LayoutMismatch => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("layout_mismatch"),
        ),
        ErrorKind::Unauthenticated => (
            StatusCode::SERVICE_UNAVAILABLE,
            UNAVAILABLE,
            None,
            Some("internal_authentication_failed"),
        ),
        ErrorKind::Internal | ErrorKind::Unspecified => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            None,
            Some("internal_error"),
        ),
    }
}

/// Which API's error body a response uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorStyle {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl ApiError {
    /// Anthropic's error `type` of this error.
    fn anthropic_type(&self) -> &'static str {
        let (status, kind, ..) = self.parts();
        match status {
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => kind,
        }
    }

    /// The error body in `style`.
    pub fn body_json(&self, style: ErrorStyle) -> serde_json::Value {
        match style {
            ErrorStyle::OpenAi => serde_json::to_value(self.body()).unwrap_or_default(),
            ErrorStyle::Anthropic => serde_json::json!({
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.to_string() },
            }),
        }
    }

    /// The HTTP response in `style`.
    pub fn into_styled_response(self, style: ErrorStyle) -> Response {
        let (status, ..) = self.parts();
        crate::metrics::error(self.metric_kind());
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        (status, Json(self.body_json(style))).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_styled_response(ErrorStyle::OpenAi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_converter_refusal_names_the_field_it_names() {
        let e = ApiError::conversion(
            &"Invalid max_tokens value, the valid range of max_tokens is [1, 393216]",
        );
        assert_eq!(e.parts().2, Some("max_tokens"));
        assert_eq!(e.parts().0, StatusCode::BAD_REQUEST);
        let e = ApiError::conversion(&"response_format should not be used with tools");
        assert_eq!(e.parts().2, None);
        assert_eq!(e.parts().0, StatusCode::BAD_REQUEST);
    }

    /// Every kind a worker can report, as the client sees it: the kind survives the gRPC
    /// status (and a stream's final error), maps to its status, OpenAI `type` and `code`, and
    /// the body carries the worker's one-line message and nothing else of the worker's.
    #[test]
    fn every_worker_error_kind_reaches_the_client_with_its_status() {
        use axum::http::StatusCode as S;
        let expected = [
            (
                ErrorKind::InvalidArgument,
                S::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request_error",
            ),
            (
                ErrorKind::Overloaded,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "overloaded",
            ),
            (
                ErrorKind::Unavailable,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "service_unavailable",
            ),
            (
                ErrorKind::Cancelled,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "cancelled",
            ),
            (
                ErrorKind::DeadlineExceeded,
                S::GATEWAY_TIMEOUT,
                "timeout_error",
                "timeout",
            ),
            (
                ErrorKind::NotFound,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "reservation_expired",
            ),
            (
                ErrorKind::LayoutMismatch,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "layout_mismatch",
            ),
            (
                ErrorKind::TransferFailed,
                S::BAD_GATEWAY,
                "internal_error",
                "state_transfer_failed",
            ),
            (
                ErrorKind::Unauthenticated,
                S::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "internal_authentication_failed",
            ),
            (
                ErrorKind::Internal,
                S::INTERNAL_SERVER_ERROR,
                "internal_error",
                "internal_error",
            ),
            (
                ErrorKind::Unspecified,
                S::INTERNAL_SERVER_ERROR,
                "internal_error",
                "internal_error",
            ),
        ];
        for (kind, status, kind_name, code) in expected {
            let info = proto::v1::ErrorInfo {
                kind: kind.into(),
                message: "out of pages (12 free, 40 needed)".to_owned(),
                worker_id: "decode-7f3a".to_owned(),
            };
            let from_call =
                BackendError::from_status("decode worker", &proto::error::to_status(&info));
            let from_stream = BackendError::from_info("decode worker", &info);
            assert_eq!(from_call, from_stream, "{kind:?}");
            let error = ApiError::from(from_call);
            let (got_status, got_kind, param, got_code) = error.parts();
            assert_eq!(
                (got_status, got_kind, param, got_code),
                (status, kind_name, None, Some(code)),
                "{kind:?}"
            );
            assert!(
                crate::metrics::ERROR_KINDS.contains(&error.metric_kind()),
                "{kind:?}"
            );
            let body = error.body_json(ErrorStyle::OpenAi);
            assert_eq!(
                body["error"]["message"],
                "decode worker: out of pages (12 free, 40 needed)"
            );
            assert_eq!(body["error"]["type"], kind_name);
            assert_eq!(body["error"]["code"], code);
            assert!(!body.to_string().contains("decode-7f3a"), "{body}");
            let anthropic = error.body_json(ErrorStyle::Anthropic);
            assert_eq!(anthropic["type"], "error");
        }
    }

    #[test]
    fn every_error_has_a_metric_kind() {
        let all = [
            ApiError::InvalidJson(String::new()),
            ApiError::param("p", "m"),
            ApiError::InvalidRequest(String::new()),
            ApiError::UnknownModel {
                model: String::new(),
                served: String::new(),
            },
            ApiError::ContextLength {
                param: String::new(),
                message: String::new(),
            },
            ApiError::PayloadTooLarge(1),
            ApiError::Unauthorized,
            ApiError::TooManyRequests(1),
            ApiError::NotFound(String::new()),
            ApiError::Unavailable(String::new()),
            ApiError::Internal(String::new()),
        ];
        let kinds: std::collections::BTreeSet<_> = all.iter().map(ApiError::metric_kind).collect();
        assert_eq!(kinds.len(), all.len(), "kinds must be distinct");
        for kind in kinds {
            assert!(crate::metrics::ERROR_KINDS.contains(&kind), "{kind}");
        }
    }

    #[test]
    fn statuses() {
        assert_eq!(
            ApiError::param("temperature", "x").parts().0,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ApiError::PayloadTooLarge(1).parts().0,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(ApiError::Unauthorized.parts().0, StatusCode::UNAUTHORIZED);
        let body = serde_json::to_value(ApiError::param("top_p", "bad").body()).unwrap();
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let anthropic = ApiError::param("top_p", "bad").body_json(ErrorStyle::Anthropic);
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "invalid_request_error");
        assert_eq!(anthropic["error"]["message"], "bad");
        let busy = ApiError::Unavailable("x".into()).body_json(ErrorStyle::Anthropic);
        assert_eq!(busy["error"]["type"], "overloaded_error");
    }
}
