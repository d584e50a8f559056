//! Request checks shared by the conversation APIs (the parameters DeepSeek's official
//! converter passes through, drops or does not know), and the adapter from backend token batches
//! to the stream processor's inference chunks. The protocols themselves are in
//! [`crate::api::protocol`].

use std::{collections::VecDeque, sync::Arc};

use deepseek_recipe::stream::{
    InferenceChunk, InferenceFinishReason, InferenceTokenLogprob, PromptUsage,
};
use engine::sampling::FinishReason;
use futures::{Stream, StreamExt};
use serde_json::{Map, Value, json};

use crate::{
    api::error::ApiError,
    backend::{BackendError, BackendEvent, GeneratedToken},
    served::Served,
};

/// Sampling settings the official converter validates and drops, or does not know; the
/// router passes them to the backend itself.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// The request's own temperature and top-p (validated), which win over the converter's:
    /// in thinking mode it samples at DeepSeek's recipe values whatever the request says.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// (token id, bias) pairs; ids are checked against the vocabulary by the backend.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's stop extras: the least number of tokens before a stop or eos may end the
    /// request, ids that end it besides eos, and whether eos is ignored.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// vLLM's constraint extras (`guided_*`, `structured_outputs`) and the key that gave it.
    pub guided: Option<(engine::sampling::Grammar, &'static str)>,
    /// Choices to generate (`n`, and vLLM's `best_of` when equal to it).
    pub n: u32,
    /// vLLM's `return_token_ids` (chat; /v1/completions reads its own).
    pub return_token_ids: bool,
}

impl Extras {
    /// Settings that change nothing (no top-k, min-p, penalties or bias).
    pub fn neutral() -> Self {
        Self {
            repetition_penalty: 1.0,
            n: 1,
            ..Self::default()
        }
    }
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

pub fn in_range(
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

pub fn integer(
    obj: &Map<String, Value>,
    key: &str,
    lo: i64,
    hi: i64,
) -> Result<Option<i64>, ApiError> {
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
    effort_path: &[&str],
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
        // V4's template reads the thinking switch only: any other key would change nothing.
        if let Some((key, _)) = kwargs
            .iter()
            .find(|(k, v)| !v.is_null() && !["thinking", "enable_thinking"].contains(&k.as_str()))
        {
            return Err(ApiError::param(
                format!("chat_template_kwargs.{key}"),
                format!(
                    "`chat_template_kwargs.{key}` is not read by this model's template (it reads \
                     `thinking` / `enable_thinking`)"
                ),
            ));
        }
        let mut thinking = None;
        for key in ["thinking", "enable_thinking"] {
            match kwargs.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Bool(b)) if thinking.is_some_and(|t| t != *b) => {
                    return Err(ApiError::param(
                        format!("chat_template_kwargs.{key}"),
                        "`chat_template_kwargs.thinking` and `.enable_thinking` disagree",
                    ));
                }
                Some(Value::Bool(b)) => thinking = Some(*b),
                Some(_) => {
                    return Err(ApiError::param(
                        format!("chat_template_kwargs.{key}"),
                        format!("`chat_template_kwargs.{key}` must be a boolean"),
                    ));
                }
            }
        }
        if let Some(on) = thinking {
            let kind = if on { "enabled" } else { "disabled" };
            match obj.get("thinking").filter(|t| !t.is_null()) {
                None => {
                    obj.insert("thinking".to_owned(), json!({ "type": kind }));
                }
                // Both given: they must agree (one would otherwise be dropped).
                Some(t) if t.get("type").and_then(Value::as_str) != Some(kind) => {
                    return Err(ApiError::param(
                        "chat_template_kwargs",
                        format!(
                            "`chat_template_kwargs` says thinking {kind} but `thinking` is {t}"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
    }
    check_effort(obj, effort_path, effort_map)
}

/// The reasoning effort at `path` (e.g. `reasoning_effort`, `reasoning.effort`): mapped by the
/// deployment's table, and refused with the accepted values if this model does not take it.
fn check_effort(
    obj: &mut Map<String, Value>,
    path: &[&str],
    effort_map: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
    let Some((last, parents)) = path.split_last() else {
        return Ok(());
    };
    let name = path.join(".");
    let mut at = obj;
    for key in parents {
        match at.get_mut(*key) {
            Some(Value::Object(inner)) => at = inner,
            _ => return Ok(()),
        }
    }
    match at.get(*last) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(effort)) => {
            let mapped = effort_map.get(effort).unwrap_or(effort).clone();
            if !crate::config::ACCEPTED_EFFORTS.contains(&mapped.as_str()) {
                let mut accepted: Vec<&str> = crate::config::ACCEPTED_EFFORTS.to_vec();
                accepted.extend(effort_map.keys().map(String::as_str));
                return Err(ApiError::param(
                    name.clone(),
                    format!(
                        "`{name}` = {effort:?} is not accepted by this model; accepted values: {}",
                        accepted.join(", ")
                    ),
                ));
            }
            at.insert((*last).to_owned(), Value::String(mapped));
            Ok(())
        }
        Some(_) => Err(ApiError::param(
            name.clone(),
            format!("`{name}` must be a string"),
        )),
    }
}

/// Validates and extracts the sampling parameters (ranges as the engine accepts them).
pub fn check_sampling(obj: &mut Map<String, Value>) -> Result<Extras, ApiError> {
    // `max_completion_tokens` is OpenAI's newer name for `max_tokens`: checked like it, and
    // the two may not disagree.
    integer(obj, "max_completion_tokens", 1, i64::from(u32::MAX))?;
    match (
        obj.get("max_tokens").filter(|v| !v.is_null()),
        obj.get("max_completion_tokens").filter(|v| !v.is_null()),
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::param(
                "max_completion_tokens",
                "`max_tokens` and `max_completion_tokens` differ; give one of them",
            ));
        }
        _ => {}
    }
    if let Some(v) = obj.remove("max_completion_tokens")
        && obj.get("max_tokens").is_none_or(Value::is_null)
    {
        obj.insert("max_tokens".to_owned(), v);
    }
    integer(obj, "max_tokens", 1, i64::from(u32::MAX))?;
    let n = choices(obj)?;
    integer(obj, "top_logprobs", 0, 20)?;
    integer(obj, "seed", 0, i64::MAX)?;
    in_range(obj, "temperature", 0.0, 2.0, false)?;
    in_range(obj, "top_p", 0.0, 1.0, true)?;
    let presence = in_range(obj, "presence_penalty", -2.0, 2.0, false)?;
    let frequency = in_range(obj, "frequency_penalty", -2.0, 2.0, false)?;
    let repetition = in_range(obj, "repetition_penalty", 0.0, 2.0, true)?;
    let min_p = in_range(obj, "min_p", 0.0, 1.0, false)?;
    let top_k = integer(obj, "top_k", -1, i64::from(u32::MAX))?;
    let logit_bias = logit_bias(obj)?;
    let min_tokens = integer(obj, "min_tokens", 0, i64::from(u32::MAX))?;
    let ignore_eos = match obj.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::param(
                "ignore_eos",
                "`ignore_eos` must be a boolean",
            ));
        }
    };
    let guided = crate::api::structured::guided(obj)?;
    Ok(Extras {
        n,
        return_token_ids: false,
        guided,
        logit_bias,
        min_tokens: min_tokens.map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
        stop_token_ids: token_ids(obj, "stop_token_ids")?,
        ignore_eos,
        top_k: top_k.map_or(0, |k| u32::try_from(k).unwrap_or(0)),
        min_p: min_p.unwrap_or(0.0) as f32,
        repetition_penalty: repetition.unwrap_or(1.0) as f32,
        presence_penalty: presence.unwrap_or(0.0) as f32,
        frequency_penalty: frequency.unwrap_or(0.0) as f32,
        temperature: None,
        top_p: None,
    })
}

/// `n`, the choices to generate (1 unless asked), and vLLM's `best_of`, accepted when it
/// equals `n` (every generated choice is returned, none is picked). Both are taken out of
/// `obj`: the official converter refuses `n` > 1, and the router generates the choices.
fn choices(obj: &mut Map<String, Value>) -> Result<u32, ApiError> {
    let n = integer(obj, "n", 1, i64::from(crate::backend::MAX_CHOICES))?;
    let n = n.map_or(1, |n| u32::try_from(n).unwrap_or(1));
    match obj.get("best_of") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(u64::from(n)) => {}
        Some(_) => {
            return Err(ApiError::param(
                "best_of",
                format!(
                    "`best_of` other than `n` ({n}) is not supported: every generated choice \
                     is returned, none is picked"
                ),
            ));
        }
    }
    obj.remove("n");
    obj.remove("best_of");
    Ok(n)
}

/// A list of token ids (`stop_token_ids`): non-negative integers below 2^32.
fn token_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, ApiError> {
    let items = match obj.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::param(
                key,
                format!("`{key}` must be an array of token ids"),
            ));
        }
    };
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::param(key, format!("`{key}` holds {v}, which is not a token id"))
                })
        })
        .collect()
}

/// Chat Completions' `tool_choice`: a function it names must be one of `tools`.
pub fn check_tool_choice(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Object(choice)) = obj.get("tool_choice") else {
        return Ok(());
    };
    let Some(name) = choice
        .get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
    else {
        return Err(ApiError::param(
            "tool_choice",
            "`tool_choice` must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
        ));
    };
    let declared = obj
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("function")?.get("name")?.as_str());
    if declared.clone().any(|n| n == name) {
        return Ok(());
    }
    let names: Vec<&str> = declared.collect();
    Err(ApiError::param(
        "tool_choice",
        format!(
            "`tool_choice` names function {name:?}, which is not in `tools` ({})",
            if names.is_empty() {
                "none declared".to_owned()
            } else {
                names.join(", ")
            }
        ),
    ))
}

/// `logit_bias`: an object of token id (a decimal string, as OpenAI's API sends it) to a bias
/// in [-100, 100]. Removed from the body: the converter does not read it.
fn logit_bias(obj: &mut Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match obj.remove("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::param(
                "logit_bias",
                "`logit_bias` must be an object of token id to bias",
            ));
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token: u32 = key.trim().parse().map_err(|_| {
            ApiError::param(
                "logit_bias",
                format!("`logit_bias` key {key:?} is not a token id"),
            )
        })?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::param(
                    "logit_bias",
                    format!("`logit_bias` of token {token} must be a number in [-100, 100]"),
                )
            })?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(token, _)| token);
    Ok(out)
}

/// Past tool-call `arguments` given as a JSON object (as many clients send them) become the
/// JSON string the converter reads; the encoder parses them, so both spellings render the same
/// prompt. `items` is the conversation array, `calls` picks each item's tool calls.
pub fn normalize_tool_arguments(
    obj: &mut Map<String, Value>,
    items_key: &str,
    calls: impl Fn(&mut Value) -> Vec<&mut Value>,
) {
    let Some(Value::Array(items)) = obj.get_mut(items_key) else {
        return;
    };
    for item in items {
        for call in calls(item) {
            if let Some(arguments) = call.get_mut("arguments")
                && (arguments.is_object() || arguments.is_array())
            {
                *arguments = Value::String(arguments.to_string());
            }
        }
    }
}

/// Chat Completions: `messages[].tool_calls[].function`.
pub fn chat_tool_calls(message: &mut Value) -> Vec<&mut Value> {
    match message.get_mut("tool_calls") {
        Some(Value::Array(calls)) => calls
            .iter_mut()
            .filter_map(|c| c.get_mut("function"))
            .collect(),
        _ => Vec::new(),
    }
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

struct Adapter<S> {
    tokens: S,
    out: VecDeque<InferenceChunk>,
    held: Option<GeneratedToken>,
    logprobs: bool,
    ended: bool,
    failure: Failure,
    /// The model's eos ids (counted, not decoded, when generated mid-output).
    eos_token_ids: Vec<u32>,
    /// Eos and stop ids: a `Stop` request's last token is dropped when it is one of them. A
    /// request whose grammar completed ends on a token of its output, which is kept.
    stop_ids: Vec<u32>,
    /// The tokenizer the stream processor decodes with, to know which tokens its decoder
    /// still holds (`None`: not tracked).
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// Tokens passed to the processor whose text it has not produced yet: the end of a
    /// character split across tokens. Its decoder buffers them until the character is complete
    /// and never flushes them at the finish, so they would not be counted in `usage`.
    undecoded: Vec<u32>,
    /// Where the ids of the output's tokens go, when the response lists them
    /// (`return_token_ids`).
    ids: Option<TokenIds>,
}

/// The ids of a choice's output tokens as the stream passes them on (the stop or eos id that
/// ended it excluded, as its text is); readers take what has arrived.
pub type TokenIds = Arc<std::sync::Mutex<Vec<u32>>>;

/// Takes the ids that arrived since the last call.
pub fn take_ids(ids: &TokenIds) -> Vec<u32> {
    std::mem::take(
        &mut *ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// Set when the backend fails or its stream ends without a finish: the response must then be
/// an error, never the truncated text as if it were complete.
pub type Failure = Arc<std::sync::Mutex<Option<BackendError>>>;

fn record(failure: &Failure, error: BackendError) {
    if let Ok(mut slot) = failure.lock() {
        slot.get_or_insert(error);
    }
}

pub fn failed(failure: &Failure) -> Option<BackendError> {
    failure.lock().ok().and_then(|slot| slot.clone())
}

impl<S> Adapter<S> {
    /// Follows the processor's decoder over `chunks` (the same rule: plain tokens stay
    /// buffered while their text is empty or ends in an incomplete character; an added token
    /// forces them out).
    fn track(&mut self, chunks: &[InferenceChunk]) {
        let Some(tokenizer) = &self.tokenizer else {
            return;
        };
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        for chunk in chunks {
            let InferenceChunk::Tokens { token_ids, .. } = chunk else {
                continue;
            };
            for &id in token_ids {
                if added.contains_key(&id) {
                    self.undecoded.clear();
                } else {
                    self.undecoded.push(id);
                }
            }
            let complete = tokenizer
                .decode(&self.undecoded, false)
                .is_ok_and(|t| !t.is_empty() && !t.ends_with('\u{FFFD}'));
            if complete {
                self.undecoded.clear();
            }
        }
    }

    /// At the finish: the tokens the processor's decoder still holds, counted (as no text).
    fn count_undecoded(&mut self) {
        if !self.undecoded.is_empty() {
            self.out.push_back(InferenceChunk::Text {
                content: String::new(),
                token_count: std::mem::take(&mut self.undecoded).len(),
            });
        }
    }

    /// The chunks of `tokens`. An eos id inside the output (generated under `ignore_eos`) is
    /// counted but not decoded: the stream processor would read it as the end of the text.
    fn chunks(&self, tokens: &[GeneratedToken]) -> Vec<InferenceChunk> {
        if let Some(ids) = &self.ids {
            ids.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(tokens.iter().map(|t| t.id));
        }
        let is_eos = |t: &GeneratedToken| self.eos_token_ids.contains(&t.id);
        let mut out = Vec::new();
        for run in tokens.chunk_by(|a, b| is_eos(a) == is_eos(b)) {
            if run.first().is_some_and(is_eos) {
                out.push(InferenceChunk::Text {
                    content: String::new(),
                    token_count: run.len(),
                });
                continue;
            }
            let logprobs = self.logprobs.then(|| {
                run.iter()
                    .map(|t| InferenceTokenLogprob {
                        logprob: t.logprob.unwrap_or(0.0),
                        top_logprobs: t.top_logprobs.clone(),
                    })
                    .collect()
            });
            out.push(InferenceChunk::Tokens {
                token_ids: run.iter().map(|t| t.id).collect(),
                logprobs,
            });
        }
        out
    }
}

/// Backend events as the stream processor's inference chunks: a `Ready` first, and the stop
/// or eos id that ended a `Stop` request held back and dropped (the library's contract).
/// `stop_ids` are the request's stop ids besides the model's eos ids.
#[expect(
    clippy::too_many_arguments,
    reason = "the stream and what the adapter must know of the request and its tokenizer"
)]
pub fn inference_stream(
    tokens: impl Stream<Item = BackendEvent> + Send + Unpin + 'static,
    prompt_tokens: usize,
    fingerprint: String,
    logprobs: bool,
    failure: Failure,
    eos_token_ids: Vec<u32>,
    stop_ids: &[u32],
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    ids: Option<TokenIds>,
) -> impl Stream<Item = InferenceChunk> + Send + 'static {
    let stop_ids: Vec<u32> = eos_token_ids.iter().chain(stop_ids).copied().collect();
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
        eos_token_ids,
        stop_ids,
        tokenizer,
        undecoded: Vec::new(),
        ids,
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
                    let chunks = st.chunks(&all);
                    st.track(&chunks);
                    st.out.extend(chunks);
                }
                Some(BackendEvent::Finished { reason, .. }) => {
                    let finish_reason = match reason {
                        FinishReason::Length => {
                            if let Some(last) = st.held.take() {
                                let chunks = st.chunks(&[last]);
                                st.track(&chunks);
                                st.out.extend(chunks);
                            }
                            InferenceFinishReason::Length
                        }
                        FinishReason::Stop => {
                            match st.held.take() {
                                // The stop or eos id that ended the request: no text, but a
                                // generated token, counted in usage as vLLM and the
                                // completions endpoint count it.
                                Some(last) if st.stop_ids.contains(&last.id) => {
                                    st.out.push_back(InferenceChunk::Text {
                                        content: String::new(),
                                        token_count: 1,
                                    });
                                }
                                Some(last) => {
                                    let chunks = st.chunks(&[last]);
                                    st.track(&chunks);
                                    st.out.extend(chunks);
                                }
                                None => {}
                            }
                            InferenceFinishReason::Stop
                        }
                    };
                    st.count_undecoded();
                    st.out.push_back(InferenceChunk::Finish { finish_reason });
                    st.ended = true;
                }
                Some(BackendEvent::Failed(error)) => {
                    tracing::error!(%error, "backend request failed");
                    record(&st.failure, error.clone());
                    st.ended = true;
                }
                // Chat never asks for them: a backend that sends them is broken.
                Some(BackendEvent::PromptLogprobs(_)) => {
                    record(
                        &st.failure,
                        BackendError::internal("prompt log-probabilities that were not asked for"),
                    );
                    st.ended = true;
                }
                None => {
                    record(
                        &st.failure,
                        BackendError::internal(
                            "the backend stream ended before the request finished",
                        ),
                    );
                    st.ended = true;
                }
            }
        }
    })
}

#[cfg(test)]
mod failure_tests;

#[cfg(test)]
mod parse_props;
