//! The HTTP surface: OpenAI-compatible API, vLLM-style tokenize/detokenize, health and
//! Prometheus metrics (`/metrics`, like health outside the API-key check).

use std::{
    collections::BTreeMap,
    sync::{Arc, OnceLock},
};

use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{Request, State, rejection::BytesRejection},
    http::{StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use deepseek_recipe::{
    anthropic::MessagesRequest,
    openai::{ChatCompletionRequest, ResponsesRequest},
    request::ProtocolRequest,
};
use deepseek_recipe_encoding::PromptEncoding;
use serde::Deserialize;
use serde_json::{Value, json};

pub use crate::api::error::{ErrorBody, ErrorObject};
use crate::{
    api::{
        chat, completions,
        error::{ApiError, ErrorStyle},
        protocol::{self, Protocol},
        request_id::{self, RequestId},
    },
    metrics::{self, Endpoint, Tracker},
    served::Served,
};

/// Shared state of the HTTP handlers.
#[derive(Debug)]
pub struct AppState {
    /// Set once the model and backend are loaded.
    pub served: OnceLock<Arc<Served>>,
    /// Why loading failed, when it did.
    pub load_error: OnceLock<String>,
    pub api_keys: Vec<String>,
    pub effort_map: BTreeMap<String, String>,
    pub max_body_bytes: u64,
    /// Prefill and decode workers (static and registered).
    pub workers: Arc<crate::backend::workers::Workers>,
    /// Whether decode workers verify transferred state against the prefill's checksums.
    pub transfer_checksums: bool,
    /// Requests in flight per API key, when bounded.
    pub key_limits: Option<Arc<crate::api::key_limit::KeyLimits>>,
}

impl AppState {
    pub fn new(
        config: &crate::RouterConfig,
        workers: Arc<crate::backend::workers::Workers>,
    ) -> Self {
        Self {
            workers,
            served: OnceLock::new(),
            load_error: OnceLock::new(),
            api_keys: config.api_keys.clone(),
            effort_map: config.effort_map().unwrap_or_default(),
            max_body_bytes: config.max_body_bytes,
            transfer_checksums: config.transfer_checksums,
            key_limits: (config.max_concurrent_per_key > 0)
                .then(|| crate::api::key_limit::KeyLimits::new(config.max_concurrent_per_key)),
        }
    }

    fn served(&self) -> Result<Arc<Served>, ApiError> {
        if let Some(served) = self.served.get() {
            return Ok(Arc::clone(served));
        }
        Err(ApiError::Unavailable(match self.load_error.get() {
            Some(e) => format!("the model failed to load: {e}"),
            None => "no model is loaded yet (configure model_dir)".to_owned(),
        }))
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
        body.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(self.max_body_bytes)
            } else {
                ApiError::InvalidJson(rejection.body_text())
            }
        })
    }
}

type Shared = State<Arc<AppState>>;

/// All HTTP routes.
pub fn routes(state: Arc<AppState>) -> Router {
    let max_body = usize::try_from(state.max_body_bytes).unwrap_or(usize::MAX);
    let api = Router::new()
        .route(
            "/v1/chat/completions",
            post(conversation::<ChatCompletionRequest>),
        )
        .route("/v1/messages", post(conversation::<MessagesRequest>))
        .route("/v1/responses", post(conversation::<ResponsesRequest>))
        .route("/v1/completions", post(legacy_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/workers", get(workers))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), auth));
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/health/ready", get(ready))
        .route("/metrics", get(prometheus))
        .merge(api)
        .fallback(|uri: axum::http::Uri| async move { ApiError::NotFound(uri.path().to_owned()) })
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn(request_id::assign))
        .with_state(state)
}

async fn auth(State(state): Shared, request: Request, next: Next) -> Response {
    if state.api_keys.is_empty() {
        return next.run(request).await;
    }
    // OpenAI clients send `Authorization: Bearer`, Anthropic clients `x-api-key`.
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let style = if request.uri().path().starts_with("/v1/messages") {
        ErrorStyle::Anthropic
    } else {
        ErrorStyle::OpenAi
    };
    let accepted = |key: Option<&str>| {
        key.filter(|key| state.api_keys.iter().any(|k| k == key))
            .map(str::to_owned)
    };
    let Some(key) = accepted(bearer).or_else(|| accepted(x_api_key)) else {
        return ApiError::Unauthorized.into_styled_response(style);
    };
    let Some(limits) = &state.key_limits else {
        return next.run(request).await;
    };
    let Some(slot) = limits.acquire(&key) else {
        return ApiError::TooManyRequests(limits.limit()).into_styled_response(style);
    };
    let (parts, body) = next.run(request).await.into_parts();
    Response::from_parts(parts, crate::api::key_limit::hold(body, slot))
}

/// `GET /workers`: every prefill and decode worker with its liveness and load.
async fn workers(State(state): Shared) -> Response {
    Json(json!({
        "workers": state.workers.listing(),
        "transfer_checksums": state.transfer_checksums,
    }))
    .into_response()
}

/// `GET /health/ready`: 200 once the model is loaded and the backend can serve, else 503 with
/// the reason. Probes poll it during start-up, so a 503 here is an answer, not an error: it is
/// neither logged nor counted in the error metrics.
async fn ready(State(state): Shared) -> Response {
    let not_ready = match state.served() {
        Ok(served) if served.backend.is_ready() => return "ready".into_response(),
        Ok(_) => ApiError::Unavailable("the backend is not ready".to_owned()),
        Err(e) => e,
    };
    let (status, ..) = not_ready.parts();
    (
        status,
        axum::Json(not_ready.body_json(crate::api::error::ErrorStyle::OpenAi)),
    )
        .into_response()
}

async fn prometheus(State(state): Shared) -> Response {
    let model = state.served.get().map(|served| served.name.clone());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&state.workers, model.as_deref()),
    )
        .into_response()
}

/// `POST /v1/chat/completions`, `/v1/messages`, `/v1/responses`: one handler, one protocol
/// each.
async fn conversation<P: Protocol>(
    State(state): Shared,
    Extension(id): Extension<RequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Response
where
    protocol::ChunkOf<P>: serde::Serialize + Send + 'static,
{
    let mut tracker = Tracker::new(P::ENDPOINT);
    let prepared = state.body(body).and_then(|body| {
        let served = state.served()?;
        let prepared = protocol::prepare::<P>(&body, &served, &state.effort_map)?;
        Ok((prepared, served))
    });
    let result = match prepared {
        Ok((prepared, served)) => protocol::respond::<P>(prepared, served, tracker, &id).await,
        Err(e) => {
            tracker.failed(e.parts().0);
            Err(e)
        }
    };
    result.unwrap_or_else(|e| e.into_styled_response(P::ERRORS))
}

async fn legacy_completions(
    State(state): Shared,
    Extension(id): Extension<RequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut tracker = Tracker::new(Endpoint::Completions);
    let prepared = state.body(body).and_then(|body| {
        let served = state.served()?;
        let prepared = completions::prepare(&body, &served)?;
        Ok((prepared, served))
    });
    match prepared {
        Ok((prepared, served)) => completions::respond(prepared, served, tracker, &id).await,
        Err(e) => {
            tracker.failed(e.parts().0);
            Err(e)
        }
    }
}

async fn models(State(state): Shared) -> Result<Response, ApiError> {
    let served = state.served()?;
    let data: Vec<Value> = served
        .names
        .iter()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "root": served.root,
                "parent": null,
                "max_model_len": served.max_model_len(),
            })
        })
        .collect();
    Ok(Json(json!({ "object": "list", "data": data })).into_response())
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

fn check_optional_model(model: Option<&str>, served: &Served) -> Result<(), ApiError> {
    match model {
        Some(m) if !served.accepts(m) => Err(ApiError::UnknownModel {
            model: m.to_owned(),
            served: served.names.join(", "),
        }),
        _ => Ok(()),
    }
}

async fn tokenize(
    State(state): Shared,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = state.body(body)?;
    let served = state.served()?;
    let mut obj = chat::parse_object(&body)?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(ApiError::param("model", "`model` must be a string")),
    };
    check_optional_model(model.as_deref(), &served)?;
    let add_special = match obj.get("add_special_tokens") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(ApiError::param(
                "add_special_tokens",
                "`add_special_tokens` must be a boolean",
            ));
        }
    };
    let token_strs = match obj.get("return_token_strs") {
        None | Some(Value::Null | Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(ApiError::param(
                "return_token_strs",
                "`return_token_strs` must be a boolean",
            ));
        }
    };
    let tokens: Vec<u32> = match (obj.get("prompt"), obj.get("messages")) {
        (Some(Value::String(_)), None) => {
            // vLLM's completion-tokenize fields; any other would be ignored here.
            if let Some(key) = obj.keys().find(|k| {
                !["model", "prompt", "add_special_tokens", "return_token_strs"]
                    .contains(&k.as_str())
            }) {
                return Err(ApiError::param(
                    key.clone(),
                    format!("`{key}` is not read when tokenizing a prompt"),
                ));
            }
            let Some(Value::String(prompt)) = obj.get("prompt") else {
                return Err(ApiError::param("prompt", "`prompt` must be a string"));
            };
            served
                .tokenizer
                .encode(prompt.as_str(), add_special.unwrap_or(true))
                .map_err(|e| ApiError::Internal(e.to_string()))?
                .get_ids()
                .to_vec()
        }
        (Some(_), None) => return Err(ApiError::param("prompt", "`prompt` must be a string")),
        (None, Some(_)) => {
            // The chat encoding renders BOS itself: more special tokens are not added.
            if add_special == Some(true) {
                return Err(ApiError::param(
                    "add_special_tokens",
                    "`add_special_tokens: true` does not apply to messages: the chat \
                     encoding writes its own special tokens",
                ));
            }
            obj.insert("model".to_owned(), Value::String(served.name.clone()));
            obj.remove("add_special_tokens");
            obj.remove("return_token_strs");
            // The fields a chat request takes, as /v1/chat/completions checks them.
            crate::api::fields::check(&obj, crate::api::fields::CHAT_FIELDS)?;
            chat::check_common(
                &mut obj,
                &served,
                &state.effort_map,
                <ChatCompletionRequest as Protocol>::EFFORT,
            )?;
            chat::normalize_tool_arguments(&mut obj, "messages", chat::chat_tool_calls);
            chat::check_sampling(&mut obj)?;
            let request: ChatCompletionRequest = chat::deserialize(obj)?;
            let converted = request
                .convert(served.conversion_options())
                .map_err(|e| ApiError::conversion(&e))?;
            served
                .encoding
                .encode(&converted.conversation)
                .map_err(|e| ApiError::Internal(e.to_string()))?
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "exactly one of `prompt` or `messages` is required".to_owned(),
            ));
        }
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": served.max_model_len(),
        "token_strs": token_strs.then(|| {
            tokens
                .iter()
                .map(|&t| served.tokenizer.id_to_token(t))
                .collect::<Vec<_>>()
        }),
        "tokens": tokens,
    }))
    .into_response())
}

async fn detokenize(
    State(state): Shared,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = state.body(body)?;
    let served = state.served()?;
    let request: DetokenizeRequest = chat::deserialize(chat::parse_object(&body)?)?;
    check_optional_model(request.model.as_deref(), &served)?;
    if let Some(bad) = request
        .tokens
        .iter()
        .find(|&&t| t as usize >= served.vocab_size)
    {
        return Err(ApiError::param(
            "tokens",
            format!(
                "token id {bad} is outside the vocabulary (size {})",
                served.vocab_size
            ),
        ));
    }
    let prompt = served
        .tokenizer
        .decode(&request.tokens, false)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}
