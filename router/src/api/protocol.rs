//! The three conversation APIs (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses)
//! on DeepSeek's official converter, encoder and stream processor. What differs between them
//! is the [`Protocol`] trait: the field names the router checks before the converter, the
//! id prefix, the error body, and how a stream that failed half-way is ended. Everything else
//! (encoding, context check, backend request, streaming, accumulation) is one code path.

use std::{collections::BTreeMap, convert::Infallible, sync::Arc, time::SystemTime};

use axum::response::{
    IntoResponse, Response,
    sse::{Event as SseEvent, Sse},
};
use deepseek_recipe::{
    anthropic::MessagesRequest,
    openai::{ChatCompletionRequest, ResponsesRequest},
    request::{ConversationRequest, ProtocolRequest},
    response::{Accumulate, ProtocolResponse},
    stream::{ChunkGenerator, StreamProcessor},
};
use deepseek_recipe_encoding::PromptEncoding;
use engine::sampling::{OutputConstraint, SamplingParams, StopConditions};
use futures::StreamExt;
use serde_json::{Map, Value, json};

use crate::{
    api::chat::{
        self, Extras, Failure, check_common, check_sampling, deserialize, in_range,
        inference_stream, integer, parse_object,
    },
    api::error::{ApiError, ErrorStyle},
    api::request_id::RequestId,
    api::structured,
    backend::BackendRequest,
    metrics::{Endpoint, Tracker},
    served::Served,
};

/// The stream chunk type of protocol `P` (an SSE event of its API).
pub type ChunkOf<P> = <<<P as ProtocolRequest>::Response as ProtocolResponse>::ChunkGenerator as ChunkGenerator>::Chunk;

/// What differs between the conversation APIs.
pub trait Protocol: ProtocolRequest + serde::de::DeserializeOwned {
    /// The metrics label of the endpoint.
    const ENDPOINT: Endpoint;
    /// Prefix of response ids.
    const ID_PREFIX: &'static str;
    /// The error body clients of this API parse.
    const ERRORS: ErrorStyle;
    /// The field holding the conversation.
    const INPUT: &'static str;
    /// The field naming the output-token limit (for context-length errors).
    const MAX_TOKENS: &'static str;
    /// Where the request names a reasoning effort (a path of object keys).
    const EFFORT: &'static [&'static str];
    /// Every field of the request and what is done with it (`None`: not checked field by
    /// field yet).
    const FIELDS: crate::api::fields::Tables;

    /// Checks the parameters the converter passes through, drops or does not know (ranges,
    /// required fields) and returns the settings the router hands the backend itself.
    fn check(obj: &mut Map<String, Value>) -> Result<Extras, ApiError>;

    /// The SSE event (name, data) that ends a stream whose backend failed: an error the client
    /// recognises, and no end-of-stream marker, so no partial text passes for a whole answer.
    fn stream_error(error: &ApiError) -> (Option<&'static str>, String);
}

impl Protocol for ChatCompletionRequest {
    const ENDPOINT: Endpoint = Endpoint::ChatCompletions;
    const ID_PREFIX: &'static str = "chatcmpl";
    const ERRORS: ErrorStyle = ErrorStyle::OpenAi;
    const INPUT: &'static str = "messages";
    const MAX_TOKENS: &'static str = "max_tokens";
    const EFFORT: &'static [&'static str] = &["reasoning_effort"];
    const FIELDS: crate::api::fields::Tables = crate::api::fields::CHAT_FIELDS;

    fn check(obj: &mut Map<String, Value>) -> Result<Extras, ApiError> {
        require_non_empty_array(obj, Self::INPUT)?;
        chat::normalize_tool_arguments(obj, Self::INPUT, chat::chat_tool_calls);
        chat::check_tool_choice(obj)?;
        // The converter reads `include_usage` only (vLLM's `continuous_usage_stats` and
        // others would be dropped).
        only_keys(obj, "stream_options", &["include_usage"])?;
        let mut extras = check_sampling(obj)?;
        // vLLM's extra: the converter does not know it; the router lists the ids itself.
        extras.return_token_ids = match obj.remove("return_token_ids") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(ApiError::param(
                    "return_token_ids",
                    "`return_token_ids` must be a boolean",
                ));
            }
        };
        Ok(extras)
    }

    fn stream_error(error: &ApiError) -> (Option<&'static str>, String) {
        (None, error.body_json(ErrorStyle::OpenAi).to_string())
    }
}

impl Protocol for MessagesRequest {
    const ENDPOINT: Endpoint = Endpoint::Messages;
    const ID_PREFIX: &'static str = "msg";
    const ERRORS: ErrorStyle = ErrorStyle::Anthropic;
    const INPUT: &'static str = "messages";
    const MAX_TOKENS: &'static str = "max_tokens";
    const EFFORT: &'static [&'static str] = &["output_config", "effort"];
    const FIELDS: crate::api::fields::Tables = crate::api::fields::MESSAGES_FIELDS;

    fn check(obj: &mut Map<String, Value>) -> Result<Extras, ApiError> {
        require_non_empty_array(obj, Self::INPUT)?;
        // Required by the Messages API.
        if obj.get("max_tokens").is_none_or(Value::is_null) {
            return Err(ApiError::param("max_tokens", "`max_tokens` is required"));
        }
        integer(obj, "max_tokens", 1, i64::from(u32::MAX))?;
        in_range(obj, "temperature", 0.0, 1.0, false)?;
        in_range(obj, "top_p", 0.0, 1.0, true)?;
        // The converter reads only `output_config.effort`; any other key would be dropped.
        only_keys(obj, "output_config", &["effort"])?;
        let top_k = integer(obj, "top_k", 0, i64::from(u32::MAX))?;
        // The converter does not read `top_k`; the backend applies it.
        obj.remove("top_k");
        Ok(Extras {
            top_k: top_k.map_or(0, |k| u32::try_from(k).unwrap_or(0)),
            ..Extras::neutral()
        })
    }

    fn stream_error(error: &ApiError) -> (Option<&'static str>, String) {
        (
            Some("error"),
            error.body_json(ErrorStyle::Anthropic).to_string(),
        )
    }
}

impl Protocol for ResponsesRequest {
    const ENDPOINT: Endpoint = Endpoint::Responses;
    const ID_PREFIX: &'static str = "resp";
    const ERRORS: ErrorStyle = ErrorStyle::OpenAi;
    const INPUT: &'static str = "input";
    const MAX_TOKENS: &'static str = "max_output_tokens";
    const EFFORT: &'static [&'static str] = &["reasoning", "effort"];
    const FIELDS: crate::api::fields::Tables = crate::api::fields::RESPONSES_FIELDS;

    fn check(obj: &mut Map<String, Value>) -> Result<Extras, ApiError> {
        crate::api::content::refuse_skipped_responses_parts(obj)?;
        match obj.get("input") {
            Some(Value::String(s)) if s.is_empty() => {
                return Err(ApiError::param("input", "`input` must not be empty"));
            }
            Some(Value::Array(a)) if a.is_empty() => {
                return Err(ApiError::param("input", "`input` must not be empty"));
            }
            Some(Value::String(_) | Value::Array(_)) => {}
            None | Some(Value::Null) => {
                return Err(ApiError::param("input", "`input` is required"));
            }
            Some(_) => {
                return Err(ApiError::param(
                    "input",
                    "`input` must be a string or an array of input items",
                ));
            }
        }
        // Keys the converter would read and drop: summaries are not produced, and the
        // verbosity is the model's own.
        for key in ["summary", "generate_summary"] {
            if obj
                .get("reasoning")
                .and_then(|r| r.get(key))
                .is_some_and(|v| !v.is_null())
            {
                return Err(ApiError::param(
                    format!("reasoning.{key}"),
                    format!(
                        "`reasoning.{key}` is not supported: reasoning summaries are not \
                         produced (the reasoning itself is returned)"
                    ),
                ));
            }
        }
        if let Some(v) = obj.get("text").and_then(|t| t.get("verbosity"))
            && !v.is_null()
            && v != "medium"
        {
            return Err(ApiError::param(
                "text.verbosity",
                format!("`text.verbosity` = {v} is not supported: accepted \"medium\""),
            ));
        }
        // `function_call` input items carry their arguments directly.
        chat::normalize_tool_arguments(obj, Self::INPUT, |item| {
            if item.get("type").and_then(Value::as_str) == Some("function_call") {
                vec![item]
            } else {
                Vec::new()
            }
        });
        integer(obj, "max_output_tokens", 1, i64::from(u32::MAX))?;
        integer(obj, "top_logprobs", 0, 20)?;
        in_range(obj, "temperature", 0.0, 2.0, false)?;
        in_range(obj, "top_p", 0.0, 1.0, true)?;
        Ok(Extras::neutral())
    }

    fn stream_error(error: &ApiError) -> (Option<&'static str>, String) {
        let (_, kind, param, code) = error.parts();
        let data = json!({
            "type": "error",
            "code": code.unwrap_or(kind),
            "message": error.to_string(),
            "param": param,
        });
        (Some("error"), data.to_string())
    }
}

fn require_non_empty_array(obj: &Map<String, Value>, key: &str) -> Result<(), ApiError> {
    match obj.get(key) {
        Some(Value::Array(m)) if m.is_empty() => {
            Err(ApiError::param(key, format!("`{key}` must not be empty")))
        }
        Some(Value::Array(_)) => Ok(()),
        None | Some(Value::Null) => Err(ApiError::param(key, format!("`{key}` is required"))),
        Some(_) => Err(ApiError::param(key, format!("`{key}` must be an array"))),
    }
}

/// A request ready for the backend.
#[derive(Debug)]
pub struct Prepared {
    pub converted: ConversationRequest,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub extras: Extras,
    /// The grammar the output must follow, if any (structured outputs).
    pub constraint: Option<OutputConstraint>,
}

/// Everything from the body to the prompt token ids and the resolved output limit.
pub fn prepare<P: Protocol>(
    body: &[u8],
    served: &Served,
    effort_map: &BTreeMap<String, String>,
) -> Result<Prepared, ApiError> {
    let mut obj = parse_object(body)?;
    crate::api::fields::check(&obj, P::FIELDS)?;
    crate::api::content::refuse_unreadable(&obj, P::INPUT)?;
    check_common(&mut obj, served, effort_map, P::EFFORT)?;
    let mut extras = P::check(&mut obj)?;
    // Checked for its range by `P::check`; the converter would put its own in thinking mode.
    let asked = |key: &str| obj.get(key).and_then(Value::as_f64).map(|v| v as f32);
    extras.temperature = asked("temperature");
    extras.top_p = asked("top_p");
    // Chat's `parallel_tool_calls: false` and Messages' `disable_parallel_tool_use: true`.
    let parallel_tool_calls = obj.get("parallel_tool_calls") != Some(&Value::Bool(false))
        && obj
            .get("tool_choice")
            .and_then(|c| c.get("disable_parallel_tool_use"))
            != Some(&Value::Bool(true));
    let written = structured::written_schema(&obj);
    let requested_max = obj.get(P::MAX_TOKENS).is_some_and(|v| !v.is_null());
    // Beyond the context whatever the prompt: said as such, before the converter's own bound
    // on output lengths speaks.
    if let Some(m) = obj
        .get(P::MAX_TOKENS)
        .and_then(Value::as_u64)
        .filter(|&m| m > u64::from(served.max_model_len()))
    {
        return Err(ApiError::ContextLength {
            param: P::MAX_TOKENS.to_owned(),
            message: format!(
                "This model's maximum context length is {} tokens. However, you requested {m} \
                 output tokens (`{}`), more than the whole context.",
                served.max_model_len(),
                P::MAX_TOKENS
            ),
        });
    }
    let request: P = deserialize(obj)?;
    let converted = request
        .convert(served.conversion_options())
        .map_err(|e| ApiError::conversion(&e))?;
    let prompt = served
        .encoding
        .encode(&converted.conversation)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    let max_tokens = converted
        .resolve_max_tokens(prompt_len, served.max_model_len())
        .map_err(|e| ApiError::ContextLength {
            param: if requested_max {
                P::MAX_TOKENS
            } else {
                P::INPUT
            }
            .to_owned(),
            message: e.to_string(),
        })?;
    // Without an explicit limit, the deployment's default cap applies (the library's default
    // in thinking mode, 65536 tokens, would reserve most of a worker's pages for one request).
    let max_tokens = if requested_max {
        max_tokens
    } else {
        max_tokens.min(served.default_max_tokens)
    };
    crate::api::completions::check_min_tokens(extras.min_tokens, max_tokens)?;
    let from_request = structured::requested(
        converted.inference_options.output_constraint.as_ref(),
        written,
        parallel_tool_calls,
        served.dsml_token,
    )?;
    let start_after = if converted.conversation.thinking_mode {
        served.think_end_token
    } else {
        None
    };
    let constraint = structured::resolve(from_request, extras.guided.take(), start_after)?;
    Ok(Prepared {
        converted,
        prompt,
        max_tokens,
        extras,
        constraint,
    })
}

/// The backend request of a prepared request.
/// Refuses keys of the object `obj[field]` other than `keys` (null values aside), naming the
/// key: the converter would drop them without a word.
pub(crate) fn only_keys(
    obj: &Map<String, Value>,
    field: &str,
    keys: &[&str],
) -> Result<(), ApiError> {
    if let Some(Value::Object(inner)) = obj.get(field) {
        for (key, value) in inner {
            if !value.is_null() && !keys.contains(&key.as_str()) {
                return Err(ApiError::param(
                    format!("{field}.{key}"),
                    format!(
                        "`{field}.{key}` is not supported: only {} is read",
                        keys.iter()
                            .map(|k| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
    }
    Ok(())
}

pub fn backend_request(
    prepared: &Prepared,
    served: &Served,
    request_id: &RequestId,
) -> BackendRequest {
    let opts = &prepared.converted.inference_options;
    BackendRequest {
        request_id: request_id.as_str().to_owned(),
        prompt: prepared.prompt.clone(),
        sampling: SamplingParams {
            // What the request gives is used as given, in thinking mode too (DeepSeek's API
            // ignores it there without a word); without it, the converter's value: in thinking
            // mode DeepSeek's recipe (temperature 1; top-p 0.95 with tools, 1 without).
            temperature: prepared
                .extras
                .temperature
                .or(opts.temperature)
                .unwrap_or(1.0),
            top_p: prepared.extras.top_p.or(opts.top_p).unwrap_or(1.0),
            top_k: prepared.extras.top_k,
            min_p: prepared.extras.min_p,
            seed: opts.seed,
            presence_penalty: prepared.extras.presence_penalty,
            frequency_penalty: prepared.extras.frequency_penalty,
            repetition_penalty: prepared.extras.repetition_penalty,
            logit_bias: prepared.extras.logit_bias.clone(),
            logprobs: opts.logprobs,
            top_logprobs: u32::from(opts.top_logprobs.unwrap_or(0)),
            constraint: prepared.constraint.clone(),
            prompt_logprobs: None,
        },
        stop: StopConditions {
            max_tokens: prepared.max_tokens,
            min_tokens: prepared.extras.min_tokens,
            stop_token_ids: prepared.extras.stop_token_ids.clone(),
            ignore_eos: prepared.extras.ignore_eos,
            eos_token_ids: served.eos_token_ids.clone(),
        },
    }
}

/// Runs a prepared request on the backend and answers it (JSON or SSE).
pub async fn respond<P: Protocol>(
    prepared: Prepared,
    served: Arc<Served>,
    mut tracker: Tracker,
    request_id: &RequestId,
) -> Result<Response, ApiError>
where
    ChunkOf<P>: serde::Serialize + Send + 'static,
{
    let request = backend_request(&prepared, &served, request_id);
    let stop_ids = request.stop.stop_token_ids.clone();
    tracker.prompt(prepared.prompt.len());
    let n = prepared.extras.n;
    let streams = match crate::backend::submit_choices(served.backend.as_ref(), request, n).await {
        Ok(streams) => streams,
        Err(e) => {
            let e = ApiError::from(e);
            tracker.failed(e.parts().0);
            return Err(e);
        }
    };
    let return_token_ids = prepared.extras.return_token_ids;
    let Prepared {
        mut converted,
        prompt,
        ..
    } = prepared;
    let id = format!("{}-{}", P::ID_PREFIX, request_id.as_str());
    let logprobs = converted.inference_options.logprobs;
    let stream = std::mem::take(&mut converted.stream);
    // One failure record for every choice: any choice's failure fails the request.
    let failure: Failure = Arc::default();
    let mut tracker = Some(tracker);
    let listing = prepared_listing(return_token_ids, streams.len(), &prompt);
    let choices: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(i, tokens)| {
            let tokens = crate::metrics::track_choice(tokens, tracker.take());
            let generator = P::chunk_generator(&converted, id.clone(), served.name.clone());
            let processor = StreamProcessor::new(generator, converted.parsing_options.clone())
                .with_tokenizer(Arc::clone(&served.tokenizer));
            let inference = inference_stream(
                tokens,
                prompt.len(),
                served.fingerprint.clone(),
                logprobs,
                Arc::clone(&failure),
                served.eos_token_ids.clone(),
                &stop_ids,
                Some(Arc::clone(&served.tokenizer)),
                listing.as_ref().map(|l| Arc::clone(&l.ids[i])),
            );
            processor.into_protocol_stream(inference)
        })
        .collect();
    // Several choices, or token ids to list: the chunks are rewritten as JSON.
    if choices.len() > 1 || listing.is_some() {
        let prompt_len = prompt.len();
        return respond_choices::<P, _, _>(
            choices, stream, failure, id, &served, prompt_len, listing,
        )
        .await;
    }
    let Some(chunks) = choices.into_iter().next() else {
        return Err(ApiError::Internal("no choice was generated".to_owned()));
    };
    if stream {
        let tail_failure = Arc::clone(&failure);
        // The stream processor closes a stream that ends early with a finish chunk of its own:
        // after a failure that would read as a normal end, so nothing follows a failure but
        // its error event.
        let events = chunks
            .take_while(move |_| futures::future::ready(chat::failed(&failure).is_none()))
            .map(|item| Ok::<_, Infallible>(chunk_event::<P, _>(item)))
            .chain(futures::stream::iter(
                std::iter::from_fn(move || Some(stream_end::<P>(&tail_failure)))
                    .take(1)
                    .flatten()
                    .map(Ok::<_, Infallible>),
            ));
        return Ok(Sse::new(events).into_response());
    }
    let mut response =
        <P::Response as ProtocolResponse>::new(id, served.name.clone(), now(), prompt.len(), 0);
    let mut chunks = std::pin::pin!(chunks);
    while let Some(item) = chunks.next().await {
        let chunk = item.map_err(|e| ApiError::Internal(e.to_string()))?;
        response.accumulate(chunk);
    }
    if let Some(error) = chat::failed(&failure) {
        return Err(ApiError::from(error));
    }
    Ok(axum::Json(response).into_response())
}

/// Answers a request of several choices (`n` > 1, chat only): each choice's chunks or
/// response come from its own stream processor and are put together as OpenAI does, choice
/// `i` with `index: i`, one usage for the request (the prompt once, the completions summed).
/// Any choice's failure fails the request.
async fn respond_choices<P, S, E>(
    choices: Vec<S>,
    stream: bool,
    failure: Failure,
    id: String,
    served: &Served,
    prompt_len: usize,
    listing: Option<Listing>,
) -> Result<Response, ApiError>
where
    P: Protocol,
    ChunkOf<P>: serde::Serialize + Send + 'static,
    S: futures::Stream<Item = Result<ChunkOf<P>, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    if stream {
        let indexed = choices
            .into_iter()
            .enumerate()
            .map(|(i, chunks)| chunks.map(move |item| (i, item)).boxed());
        let usage: Arc<std::sync::Mutex<Option<Value>>> = Arc::default();
        let (summed, tail_failure) = (Arc::clone(&usage), Arc::clone(&failure));
        let mut prompt_ids = listing.as_ref().map(|l| l.prompt.clone());
        let events = futures::stream::select_all(indexed)
            .take_while(move |_| futures::future::ready(chat::failed(&failure).is_none()))
            .filter_map(move |(i, item)| {
                let event = match item {
                    Ok(chunk) => {
                        let name = <P::Response as ProtocolResponse>::sse_event_name(&chunk);
                        serde_json::to_value(&chunk)
                            .map_err(|e| ApiError::Internal(e.to_string()))
                            .map(|mut body| {
                                with_index(&mut body, i);
                                let usage = body.get_mut("usage").map(Value::take);
                                if let Some(u) = usage.filter(|u| !u.is_null()) {
                                    add_usage(&summed, &body, &u);
                                }
                                let empty = body["choices"].as_array().is_some_and(Vec::is_empty);
                                if let Some(listing) = listing.as_ref().filter(|_| !empty) {
                                    body["choices"][0]["token_ids"] =
                                        json!(chat::take_ids(&listing.ids[i]));
                                    if let Some(ids) = prompt_ids.take() {
                                        body["prompt_token_ids"] = json!(ids);
                                    }
                                }
                                (!empty).then(|| named(name, body.to_string()))
                            })
                    }
                    Err(e) => Err(ApiError::Internal(e.to_string())),
                };
                futures::future::ready(match event {
                    Ok(event) => event,
                    Err(e) => Some(error_event::<P>(&e)),
                })
            })
            .chain(futures::stream::iter(
                std::iter::from_fn(move || {
                    let usage = chat::failed(&tail_failure)
                        .is_none()
                        .then(|| lock_usage(&usage).take())
                        .flatten()
                        .map(|u| named(None, u.to_string()));
                    Some(usage.into_iter().chain(stream_end::<P>(&tail_failure)))
                })
                .take(1)
                .flatten(),
            ))
            .map(Ok::<_, Infallible>);
        return Ok(Sse::new(events).into_response());
    }
    let answered = futures::future::join_all(choices.into_iter().map(|chunks| async {
        let mut response = <P::Response as ProtocolResponse>::new(
            id.clone(),
            served.name.clone(),
            now(),
            prompt_len,
            0,
        );
        let mut chunks = std::pin::pin!(chunks);
        while let Some(item) = chunks.next().await {
            response.accumulate(item.map_err(|e| ApiError::Internal(e.to_string()))?);
        }
        serde_json::to_value(&response).map_err(|e| ApiError::Internal(e.to_string()))
    }))
    .await;
    if let Some(error) = chat::failed(&failure) {
        return Err(ApiError::from(error));
    }
    let mut merged: Option<Value> = None;
    let mut all_choices = Vec::new();
    let mut completion = 0;
    for (i, answer) in answered.into_iter().enumerate() {
        let mut answer = answer?;
        with_index(&mut answer, i);
        if let Some(listing) = &listing {
            answer["choices"][0]["token_ids"] = json!(chat::take_ids(&listing.ids[i]));
        }
        if let Some(Value::Array(choices)) = answer.get_mut("choices").map(Value::take) {
            all_choices.extend(choices);
        }
        completion += answer["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        let reasoning = &answer["usage"]["completion_tokens_details"]["reasoning_tokens"];
        if let (Some(m), Some(r)) = (merged.as_mut(), reasoning.as_u64()) {
            let into = &mut m["usage"]["completion_tokens_details"]["reasoning_tokens"];
            *into = json!(into.as_u64().unwrap_or(0) + r);
        }
        merged.get_or_insert(answer);
    }
    let mut merged = merged.ok_or_else(|| ApiError::Internal("no choice".to_owned()))?;
    merged["choices"] = Value::Array(all_choices);
    if let Some(listing) = listing {
        merged["prompt_token_ids"] = json!(listing.prompt);
    }
    if merged.get("usage").is_some_and(Value::is_object) {
        let prompt = merged["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        merged["usage"]["completion_tokens"] = json!(completion);
        merged["usage"]["total_tokens"] = json!(prompt + completion);
    }
    Ok(axum::Json(merged).into_response())
}

/// vLLM's `return_token_ids` on chat: the prompt's ids (top level, on the first chunk of a
/// stream) and each choice's output ids (`token_ids`, per chunk when streamed).
struct Listing {
    prompt: Vec<u32>,
    /// Per choice, the ids its stream has passed on and no chunk has listed yet.
    ids: Vec<chat::TokenIds>,
}

fn prepared_listing(asked: bool, choices: usize, prompt: &[u32]) -> Option<Listing> {
    asked.then(|| Listing {
        prompt: prompt.to_vec(),
        ids: (0..choices).map(|_| Arc::default()).collect(),
    })
}

/// Sets `index: i` on every choice of a chunk or response.
fn with_index(body: &mut Value, i: usize) {
    if let Some(Value::Array(choices)) = body.get_mut("choices") {
        for choice in choices {
            choice["index"] = json!(i);
        }
    }
}

fn lock_usage(usage: &std::sync::Mutex<Option<Value>>) -> std::sync::MutexGuard<'_, Option<Value>> {
    usage
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Adds one choice's final usage `u` (of chunk `body`) to the request's: the first is kept as
/// the usage chunk (choices emptied), later ones add their completion (and reasoning) tokens.
fn add_usage(summed: &std::sync::Mutex<Option<Value>>, body: &Value, u: &Value) {
    let mut summed = lock_usage(summed);
    let Some(total) = summed.as_mut() else {
        let mut chunk = body.clone();
        chunk["choices"] = json!([]);
        chunk["usage"] = u.clone();
        *summed = Some(chunk);
        return;
    };
    let usage = &mut total["usage"];
    let add = |into: &mut Value, from: &Value| {
        if let Some(x) = from.as_u64() {
            *into = json!(into.as_u64().unwrap_or(0) + x);
        }
    };
    add(&mut usage["completion_tokens"], &u["completion_tokens"]);
    add(&mut usage["total_tokens"], &u["completion_tokens"]);
    if u["completion_tokens_details"]["reasoning_tokens"].is_u64() {
        add(
            &mut usage["completion_tokens_details"]["reasoning_tokens"],
            &u["completion_tokens_details"]["reasoning_tokens"],
        );
    }
}

/// The SSE event of one chunk of protocol `P` (or of the error that replaced it).
pub fn chunk_event<P: Protocol, E: std::fmt::Display>(item: Result<ChunkOf<P>, E>) -> SseEvent
where
    ChunkOf<P>: serde::Serialize,
{
    match item {
        Ok(chunk) => {
            let name = <P::Response as ProtocolResponse>::sse_event_name(&chunk);
            match serde_json::to_string(&chunk) {
                Ok(data) => named(name, data),
                Err(e) => error_event::<P>(&ApiError::Internal(e.to_string())),
            }
        }
        Err(e) => error_event::<P>(&ApiError::Internal(e.to_string())),
    }
}

/// The event that ends a stream: the backend's error when it failed, else the protocol's
/// end-of-stream marker (if it has one).
pub fn stream_end<P: Protocol>(failure: &Failure) -> Option<SseEvent> {
    match chat::failed(failure) {
        Some(error) => Some(error_event::<P>(&ApiError::from(error))),
        None => <P::Response as ProtocolResponse>::sse_done_data()
            .map(|data| SseEvent::default().data(data)),
    }
}

pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn named(name: Option<&'static str>, data: String) -> SseEvent {
    let event = SseEvent::default().data(data);
    match name {
        Some(name) => event.event(name),
        None => event,
    }
}

pub fn error_event<P: Protocol>(error: &ApiError) -> SseEvent {
    let (name, data) = P::stream_error(error);
    named(name, data)
}
