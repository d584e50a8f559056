//! What goes wrong in `pdctl verify`. An error's text is the detail the report prints for the
//! failed check (or, from `connect`, why the router is not healthy), so each message is worded
//! for that table.

use std::path::PathBuf;

use common::http_client::HttpError;
use engine::{scheduler::EngineError, weights::LoadError};
use serde_json::Value;

/// Why a check failed, or the router could not be checked at all.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VerifyError {
    /// A request got no response (connect, send, read or timeout).
    #[error("{method} {path}: {source}")]
    Request {
        method: &'static str,
        path: String,
        source: HttpError,
    },
    /// `/health/ready` answered, but not 200.
    #[error("not ready: HTTP {status}: {body}")]
    NotReady { status: u16, body: String },
    /// `/v1/models` lists no model to send requests to.
    #[error("/v1/models lists no model: {listing}")]
    NoModel { listing: Value },
    /// A JSON endpoint answered with a status other than 200.
    #[error("{path}: HTTP {status}: {body}")]
    Http {
        path: String,
        status: u16,
        body: String,
    },
    /// A JSON endpoint answered 200 with a body that is not JSON.
    #[error("{path}: not JSON ({source}): {body}")]
    Json {
        path: String,
        source: serde_json::Error,
        body: String,
    },
    /// `/tokenize` answered without a token list.
    #[error("/tokenize gave no tokens: {reply}")]
    NoTokens { reply: Value },
    /// `/tokenize` listed something that is not a token id.
    #[error("/tokenize gave a non-integer token")]
    NonIntegerToken,
    /// A streamed completion answered with a status other than 200.
    #[error("stream: HTTP {status}: {body}")]
    StreamHttp { status: u16, body: String },
    /// A streamed completion whose body is not UTF-8.
    #[error("stream: not UTF-8")]
    StreamNotUtf8,
    /// A `data:` event of the stream that is not JSON.
    #[error("stream event {data:?}: {source}")]
    StreamEvent {
        data: String,
        source: serde_json::Error,
    },
    /// The stream carried an error event.
    #[error("stream error event: {data}")]
    StreamErrorEvent { data: String },
    /// The stream ended without `data: [DONE]`.
    #[error("the stream ended without [DONE]")]
    StreamUnterminated,
    /// Answers that must be identical differ (or disagree on a count); the text says where.
    #[error("{0}")]
    Mismatch(String),
    /// Workers whose settings make their results differ from the reference's bits within
    /// stated bounds (each `role address: keys`): a bit-for-bit comparison does not apply.
    #[error(
        "{}: their fast kernels are within stated bounds of the reference, not its bits; \
         compare a cluster of exact kernels",
        .0.join("; ")
    )]
    FastKernels(Vec<String>),
    /// The router runs with `transfer_checksums` off.
    #[error("off: set transfer_checksums = true in the router")]
    ChecksumsOff,
    /// The router's `/workers` does not say whether transfers are checksummed.
    #[error("the router does not report transfer_checksums")]
    ChecksumsUnreported,
    /// A truncated JSON request did not get a 400 with an OpenAI error object.
    #[error("truncated JSON got HTTP {status}: {body}")]
    BadInputAccepted { status: u16, body: String },
    /// The checkpoint for the local reference engine cannot be loaded.
    #[error("{}: {source}", dir.display())]
    ModelLoad { dir: PathBuf, source: LoadError },
    /// The local reference engine refused its configuration or a request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The blocking task running the local reference engine failed (panicked).
    #[error("local engine: {0}")]
    EngineTask(#[source] tokio::task::JoinError),
    /// The local reference engine failed a request while generating.
    #[error("local engine: {0}")]
    EngineFailed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts are the report's details, word for word as before the errors were typed.
    #[test]
    fn messages_are_the_report_details() {
        let not_json = || serde_json::from_str::<Value>("{").unwrap_err();
        let cases = [
            (
                VerifyError::NotReady {
                    status: 503,
                    body: "loading".into(),
                },
                "not ready: HTTP 503: loading".to_owned(),
            ),
            (
                VerifyError::NoModel {
                    listing: serde_json::json!({"data": []}),
                },
                r#"/v1/models lists no model: {"data":[]}"#.to_owned(),
            ),
            (
                VerifyError::Http {
                    path: "/workers".into(),
                    status: 404,
                    body: "no".into(),
                },
                "/workers: HTTP 404: no".to_owned(),
            ),
            (
                VerifyError::Json {
                    path: "/tokenize".into(),
                    source: not_json(),
                    body: "{".into(),
                },
                format!("/tokenize: not JSON ({}): {{", not_json()),
            ),
            (
                VerifyError::StreamEvent {
                    data: "{".into(),
                    source: not_json(),
                },
                format!("stream event \"{{\": {}", not_json()),
            ),
            (
                VerifyError::StreamUnterminated,
                "the stream ended without [DONE]".to_owned(),
            ),
            (
                VerifyError::Mismatch("prompt 2: content \"a\" vs \"b\"".into()),
                "prompt 2: content \"a\" vs \"b\"".to_owned(),
            ),
            (
                VerifyError::ModelLoad {
                    dir: "/ckpt".into(),
                    source: LoadError::Missing("w".into()),
                },
                "/ckpt: missing tensor w".to_owned(),
            ),
            (
                VerifyError::EngineFailed("out of pages".into()),
                "local engine: out of pages".to_owned(),
            ),
        ];
        for (error, text) in cases {
            assert_eq!(error.to_string(), text);
        }
    }
}
