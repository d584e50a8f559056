//! `POST /v1/chat/completions` on DeepSeek's official converter, encoder and stream processor
//! (`deepseek-recipe`): this module only checks parameters the library passes through or
//! drops, turns backend token batches into inference chunks, and transports the chunks.

use std::{collections::VecDeque, convert::Infallible, sync::Arc, time::SystemTime};

use axum::response::{
    IntoResponse, Response,
    sse::{Event as SseEvent, Sse},
};
use deepseek_recipe::{
    openai::{ChatCompletionRequest, chat_completion::response::ChatCompletionResponse},
    request::{ConversationRequest, ProtocolRequest},
    response::{Accumulate, ProtocolResponse},
    stream::{
        InferenceChunk, InferenceFinishReason, InferenceTokenLogprob, PromptUsage, StreamProcessor,
    },
};
use deepseek_recipe_encoding::PromptEncoding;
use engine::sampling::{FinishReason, SamplingParams, StopConditions};
use futures::{Stream, StreamExt};
use serde_json::{Map, Value, json};

use crate::{
    api_error::ApiError,
    backend::{BackendError, BackendEvent, BackendRequest, GeneratedToken},
    metrics::Tracker,
    served::Served,
};

/// `reasoning_effort` values DeepSeek-V4 accepts (`none` turns thinking off).
pub const ACCEPTED_EFFORTS: [&str; 4] = ["none", "low", "high", "max"];

/// Sampling settings the official converter validates and drops, or does not know; the
/// router passes them to the backend itself.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
}

/// A request ready for the backend.
#[derive(Debug)]
pub struct Prepared {
    pub converted: ConversationRequest,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub extras: Extras,
}

/// Parses a request body into a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::InvalidJson(
            "the request body must be a JSON object".to_owned(),
        )),
        Err(e) => Err(ApiError::InvalidJson(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

fn number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must be a number"))),
    }
}

fn in_range(
    obj: &Map<String, Value>,
    key: &str,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<Option<f64>, ApiError> {
    let value = number(obj, key)?;
    if let Some(x) = value {
        let low_ok = if lo_open { x > lo } else { x >= lo };
        if !low_ok || x > hi {
            let open = if lo_open { "(" } else { "[" };
            return Err(ApiError::param(
                key,
                format!("`{key}` = {x} is out of range: accepted {open}{lo}, {hi}]"),
            ));
        }
    }
    Ok(value)
}

fn integer(obj: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v
                .as_i64()
                .ok_or_else(|| ApiError::param(key, format!("`{key}` must be an integer")))?;
            if x < lo || x > hi {
                return Err(ApiError::param(
                    key,
                    format!("`{key}` = {x} is out of range: accepted [{lo}, {hi}]"),
                ));
            }
            Ok(Some(x))
        }
    }
}

/// Checks the model name and rewrites `chat_template_kwargs.thinking` and
/// `reasoning_effort` into what the official converter reads.
pub fn check_common(
    obj: &mut Map<String, Value>,
    served: &Served,
    effort_map: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
    match obj.get("model") {
        Some(Value::String(model)) if served.accepts(model) => {}
        Some(Value::String(model)) => {
            return Err(ApiError::UnknownModel {
                model: model.clone(),
                served: served.names.join(", "),
            });
        }
        None | Some(Value::Null) => {
            return Err(ApiError::param("model", "`model` is required"));
        }
        Some(_) => return Err(ApiError::param("model", "`model` must be a string")),
    }
    if let Some(kwargs) = obj.get("chat_template_kwargs").filter(|v| !v.is_null()) {
        let Value::Object(kwargs) = kwargs else {
            return Err(ApiError::param(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object",
            ));
        };
        let mut thinking = None;
        for key in ["thinking", "enable_thinking"] {
            match kwargs.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Bool(b)) => thinking = Some(*b),
                Some(_) => {
                    return Err(ApiError::param(
                        format!("chat_template_kwargs.{key}"),
                        format!("`chat_template_kwargs.{key}` must be a boolean"),
                    ));
                }
            }
        }
        if let Some(on) = thinking
            && obj.get("thinking").is_none_or(Value::is_null)
        {
            let kind = if on { "enabled" } else { "disabled" };
            obj.insert("thinking".to_owned(), json!({ "type": kind }));
        }
    }
    match obj.get("reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(Value::String(effort)) => {
            let mapped = effort_map.get(effort).unwrap_or(effort).clone();
            if !ACCEPTED_EFFORTS.contains(&mapped.as_str()) {
                let mut accepted: Vec<&str> = ACCEPTED_EFFORTS.to_vec();
                accepted.extend(effort_map.keys().map(String::as_str));
                return Err(ApiError::param(
                    "reasoning_effort",
                    format!(
                        "`reasoning_effort` = {effort:?} is not accepted by this model; accepted \
                         values: {}",
                        accepted.join(", ")
                    ),
                ));
            }
            obj.insert("reasoning_effort".to_owned(), Value::String(mapped));
        }
        Some(_) => {
            return Err(ApiError::param(
                "reasoning_effort",
                "`reasoning_effort` must be a string",
            ));
        }
    }
    Ok(())
}

/// Validates and extracts the sampling parameters (ranges as the engine accepts them).
pub fn check_sampling(obj: &mut Map<String, Value>) -> Result<Extras, ApiError> {
    if obj.get("max_tokens").is_none_or(Value::is_null)
        && let Some(v) = obj.remove("max_completion_tokens")
    {
        obj.insert("max_tokens".to_owned(), v);
    }
    integer(obj, "max_tokens", 1, i64::from(u32::MAX))?;
    integer(obj, "n", 1, 1)?;
    integer(obj, "top_logprobs", 0, 20)?;
    integer(obj, "seed", 0, i64::MAX)?;
    in_range(obj, "temperature", 0.0, 2.0, false)?;
    in_range(obj, "top_p", 0.0, 1.0, true)?;
    let presence = in_range(obj, "presence_penalty", -2.0, 2.0, false)?;
    let frequency = in_range(obj, "frequency_penalty", -2.0, 2.0, false)?;
    let repetition = in_range(obj, "repetition_penalty", 0.0, 2.0, true)?;
    let min_p = in_range(obj, "min_p", 0.0, 1.0, false)?;
    let top_k = integer(obj, "top_k", -1, i64::from(u32::MAX))?;
    Ok(Extras {
        top_k: top_k.map_or(0, |k| u32::try_from(k).unwrap_or(0)),
        min_p: min_p.unwrap_or(0.0) as f32,
        repetition_penalty: repetition.unwrap_or(1.0) as f32,
        presence_penalty: presence.unwrap_or(0.0) as f32,
        frequency_penalty: frequency.unwrap_or(0.0) as f32,
    })
}

/// Typed deserialization that names the offending field.
pub fn deserialize<T: serde::de::DeserializeOwned>(obj: Map<String, Value>) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(Value::Object(obj)).map_err(|e| {
        let path = e.path().to_string();
        let param = if path == "." { None } else { Some(path) };
        let message = e.into_inner().to_string();
        match param {
            Some(param) => ApiError::param(param.clone(), format!("`{param}`: {message}")),
            None => ApiError::InvalidRequest(message),
        }
    })
}

/// Everything from the body to the prompt token ids and the resolved `max_tokens`.
pub fn prepare(
    body: &[u8],
    served: &Served,
    effort_map: &std::collections::BTreeMap<String, String>,
) -> Result<Prepared, ApiError> {
    let mut obj = parse_object(body)?;
    check_common(&mut obj, served, effort_map)?;
    match obj.get("messages") {
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::param("messages", "`messages` must not be empty"));
        }
        Some(Value::Array(_)) => {}
        None | Some(Value::Null) => {
            return Err(ApiError::param("messages", "`messages` is required"));
        }
        Some(_) => return Err(ApiError::param("messages", "`messages` must be an array")),
    }
    let extras = check_sampling(&mut obj)?;
    let request: ChatCompletionRequest = deserialize(obj)?;
    let requested_max = request.max_tokens;
    let converted = request
        .convert(served.conversion_options())
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let prompt = served
        .encoding
        .encode(&converted.conversation)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    let max_tokens = converted
        .resolve_max_tokens(prompt_len, served.max_model_len)
        .map_err(|e| ApiError::ContextLength {
            param: if requested_max.is_some() {
                "max_tokens"
            } else {
                "messages"
            }
            .to_owned(),
            message: e.to_string(),
        })?;
    Ok(Prepared {
        converted,
        prompt,
        max_tokens,
        extras,
    })
}

/// The backend request of a prepared request.
pub fn backend_request(prepared: &Prepared, served: &Served) -> BackendRequest {
    let opts = &prepared.converted.inference_options;
    let thinking = prepared.converted.conversation.thinking_mode;
    // As DeepSeek's API: penalties take no effect in thinking mode.
    let (presence, frequency) = if thinking {
        (0.0, 0.0)
    } else {
        (
            prepared.extras.presence_penalty,
            prepared.extras.frequency_penalty,
        )
    };
    BackendRequest {
        prompt: prepared.prompt.clone(),
        sampling: SamplingParams {
            temperature: opts.temperature.unwrap_or(1.0),
            top_p: opts.top_p.unwrap_or(1.0),
            top_k: prepared.extras.top_k,
            min_p: prepared.extras.min_p,
            seed: opts.seed,
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: prepared.extras.repetition_penalty,
            logit_bias: Vec::new(),
            logprobs: opts.logprobs,
            top_logprobs: u32::from(opts.top_logprobs.unwrap_or(0)),
        },
        stop: StopConditions {
            max_tokens: prepared.max_tokens,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            eos_token_ids: served.eos_token_ids.clone(),
        },
    }
}

/// Maps a backend refusal.
pub fn backend_error(e: BackendError) -> ApiError {
    match e {
        BackendError::Invalid(m) => ApiError::InvalidRequest(m),
        BackendError::Unavailable(m) => ApiError::Unavailable(m),
    }
}

struct Adapter<S> {
    tokens: S,
    out: VecDeque<InferenceChunk>,
    held: Option<GeneratedToken>,
    logprobs: bool,
    ended: bool,
    failure: Failure,
}

/// Set when the backend fails or its stream ends without a finish: the response must then be
/// an error, never the truncated text as if it were complete.
pub type Failure = Arc<std::sync::Mutex<Option<String>>>;

fn record(failure: &Failure, message: String) {
    if let Ok(mut slot) = failure.lock() {
        slot.get_or_insert(message);
    }
}

fn failed(failure: &Failure) -> Option<String> {
    failure.lock().ok().and_then(|slot| slot.clone())
}

impl<S> Adapter<S> {
    fn chunk(&self, tokens: &[GeneratedToken]) -> InferenceChunk {
        let logprobs = self.logprobs.then(|| {
            tokens
                .iter()
                .map(|t| InferenceTokenLogprob {
                    logprob: t.logprob.unwrap_or(0.0),
                    top_logprobs: t.top_logprobs.clone(),
                })
                .collect()
        });
        InferenceChunk::Tokens {
            token_ids: tokens.iter().map(|t| t.id).collect(),
            logprobs,
        }
    }
}

/// Backend events as the stream processor's inference chunks: a `Ready` first, and the token
/// that ended a `Stop` request held back and dropped (the library's contract).
pub fn inference_stream(
    tokens: impl Stream<Item = BackendEvent> + Send + Unpin + 'static,
    prompt_tokens: usize,
    fingerprint: String,
    logprobs: bool,
    failure: Failure,
) -> impl Stream<Item = InferenceChunk> + Send + 'static {
    let ready = InferenceChunk::Ready {
        system_fingerprint: Some(fingerprint),
        prompt_usage: PromptUsage {
            prompt_tokens,
            prompt_cache_hit_tokens: 0,
        },
    };
    let state = Adapter {
        tokens,
        out: VecDeque::from([ready]),
        held: None,
        logprobs,
        ended: false,
        failure,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(chunk) = st.out.pop_front() {
                return Some((chunk, st));
            }
            if st.ended {
                return None;
            }
            match st.tokens.next().await {
                Some(BackendEvent::Tokens(batch)) => {
                    let mut all: Vec<GeneratedToken> = st.held.take().into_iter().collect();
                    all.extend(batch);
                    st.held = all.pop();
                    if !all.is_empty() {
                        let chunk = st.chunk(&all);
                        st.out.push_back(chunk);
                    }
                }
                Some(BackendEvent::Finished { reason, .. }) => {
                    let finish_reason = match reason {
                        FinishReason::Length => {
                            if let Some(last) = st.held.take() {
                                let chunk = st.chunk(&[last]);
                                st.out.push_back(chunk);
                            }
                            InferenceFinishReason::Length
                        }
                        FinishReason::Stop => InferenceFinishReason::Stop,
                    };
                    st.out.push_back(InferenceChunk::Finish { finish_reason });
                    st.ended = true;
                }
                Some(BackendEvent::Failed(error)) => {
                    tracing::error!(%error, "backend request failed");
                    record(&st.failure, error.clone());
                    st.ended = true;
                }
                None => {
                    record(
                        &st.failure,
                        "the backend stream ended before the request finished".into(),
                    );
                    st.ended = true;
                }
            }
        }
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Response id of a new request.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7().simple())
}

/// Runs a prepared chat request on the backend and answers it (JSON or SSE).
pub async fn respond(
    prepared: Prepared,
    served: Arc<Served>,
    mut tracker: Tracker,
) -> Result<Response, ApiError> {
    let request = backend_request(&prepared, &served);
    tracker.prompt(prepared.prompt.len());
    let tokens = match served.backend.submit(request).await {
        Ok(tokens) => crate::metrics::track(tokens, tracker),
        Err(e) => {
            let e = backend_error(e);
            tracker.failed(&e);
            return Err(e);
        }
    };
    let Prepared {
        mut converted,
        prompt,
        ..
    } = prepared;
    let id = new_id("chatcmpl");
    let generator = <ChatCompletionRequest as ProtocolRequest>::chunk_generator(
        &converted,
        id.clone(),
        served.name.clone(),
    );
    let parsing = converted.parsing_options.clone();
    let logprobs = converted.inference_options.logprobs;
    let stream = std::mem::take(&mut converted.stream);
    let processor =
        StreamProcessor::new(generator, parsing).with_tokenizer(Arc::clone(&served.tokenizer));
    let failure: Failure = Arc::default();
    let inference = inference_stream(
        tokens,
        prompt.len(),
        served.fingerprint.clone(),
        logprobs,
        Arc::clone(&failure),
    );
    let chunks = processor.into_protocol_stream(inference);
    if stream {
        let tail_failure = Arc::clone(&failure);
        let events = chunks
            .map(|item| {
                let data = match item {
                    Ok(chunk) => serde_json::to_string(&chunk)
                        .unwrap_or_else(|e| error_json(&ApiError::Internal(e.to_string()))),
                    Err(e) => error_json(&ApiError::Internal(e.to_string())),
                };
                Ok::<_, Infallible>(SseEvent::default().data(data))
            })
            // A failed request ends with an error event and no `[DONE]`, so no client takes
            // the partial text for a complete answer.
            .chain(futures::stream::once(async move {
                let data = match failed(&tail_failure) {
                    Some(message) => error_json(&ApiError::Internal(message)),
                    None => ChatCompletionResponse::sse_done_data()
                        .unwrap_or_else(|| "[DONE]".to_owned()),
                };
                Ok(SseEvent::default().data(data))
            }));
        return Ok(Sse::new(events).into_response());
    }
    let mut response = ChatCompletionResponse::new(id, served.name.clone(), now(), prompt.len(), 0);
    let mut chunks = std::pin::pin!(chunks);
    while let Some(item) = chunks.next().await {
        let chunk = item.map_err(|e| ApiError::Internal(e.to_string()))?;
        response.accumulate(chunk);
    }
    if let Some(message) = failed(&failure) {
        return Err(ApiError::Internal(message));
    }
    Ok(axum::Json(response).into_response())
}

fn error_json(e: &ApiError) -> String {
    serde_json::to_string(&e.body()).unwrap_or_default()
}

#[cfg(test)]
mod failure_tests {
    use futures::StreamExt as _;
    use tokio::sync::mpsc;

    use super::*;
    use crate::backend::TokenStream;

    fn token(id: u32) -> GeneratedToken {
        GeneratedToken {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        }
    }

    async fn drive(events: Vec<BackendEvent>) -> (Vec<InferenceChunk>, Option<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        drop(tx);
        let failure: Failure = Arc::default();
        let stream = inference_stream(
            TokenStream::new(rx, || {}),
            3,
            "fp".into(),
            false,
            Arc::clone(&failure),
        );
        let chunks: Vec<InferenceChunk> = stream.collect().await;
        (chunks, failed(&failure))
    }

    #[tokio::test]
    async fn backend_failure_is_recorded_not_hidden() {
        let (chunks, failure) = drive(vec![
            BackendEvent::Tokens(vec![token(5), token(6)]),
            BackendEvent::Failed("worker died".into()),
        ])
        .await;
        assert_eq!(failure.as_deref(), Some("worker died"));
        assert!(
            !chunks
                .iter()
                .any(|c| matches!(c, InferenceChunk::Finish { .. })),
            "no finish after a failure"
        );
    }

    #[tokio::test]
    async fn stream_ending_without_finish_is_a_failure() {
        let (_, failure) = drive(vec![BackendEvent::Tokens(vec![token(5)])]).await;
        assert!(failure.is_some_and(|m| m.contains("ended before")));
    }

    #[tokio::test]
    async fn normal_finish_is_not_a_failure() {
        let (chunks, failure) = drive(vec![
            BackendEvent::Tokens(vec![token(5), token(6)]),
            BackendEvent::Finished {
                reason: FinishReason::Length,
                usage: engine::scheduler::Usage::default(),
            },
        ])
        .await;
        assert!(failure.is_none());
        assert!(matches!(chunks.last(), Some(InferenceChunk::Finish { .. })));
    }
}
