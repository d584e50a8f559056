//! `POST /v1/completions` (OpenAI legacy completions): a raw prompt (text or token ids, no chat
//! template), its text from [`crate::api::detokenize`]'s pieces (incremental detokenization
//! that never emits half a character, stop strings held back until resolved). Streamed and
//! non-streamed answers come from the same text pieces, so their texts are equal.

use std::{convert::Infallible, sync::Arc, time::SystemTime};

use axum::response::{
    IntoResponse, Response,
    sse::{Event as SseEvent, Sse},
};
use engine::sampling::{SamplingParams, StopConditions};
use futures::{Stream, StreamExt};
use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

use crate::{
    api::chat::{self, Extras},
    api::detokenize::{Detokenizer, Piece, pieces},
    api::error::ApiError,
    backend::{BackendRequest, GeneratedToken},
    metrics::Tracker,
    served::Served,
};

/// OpenAI's default `max_tokens` for legacy completions.
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// At most this many stop strings.
pub const MAX_STOP: usize = 16;

/// A validated completions request.
#[derive(Debug, Clone)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent request flags (stream, usage, eos, token ids), each read once"
)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub sampling: SamplingParams,
    /// `min_tokens`, `stop_token_ids` and `ignore_eos`.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `logprobs`: how many alternatives per token, when asked for.
    pub logprobs: Option<u32>,
    /// `echo`: the prompt's text, put before the completion.
    pub echo: Option<String>,
    /// vLLM's `return_token_ids`: the prompt's and the completion's token ids in the answer.
    pub return_token_ids: bool,
    /// vLLM's `skip_special_tokens` (default true): special tokens left out of the text.
    pub skip_special_tokens: bool,
    /// Choices to generate (`n`).
    pub n: u32,
}

fn prompt_ids(obj: &Map<String, Value>, served: &Served) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::param(
            "prompt",
            "`prompt` must be a string or a list of token ids (one prompt per request)",
        )
    };
    let ids_of = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| {
                let id = v
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(bad)?;
                if id as usize >= served.vocab_size {
                    return Err(ApiError::param(
                        "prompt",
                        format!(
                            "token id {id} is outside the vocabulary (size {})",
                            served.vocab_size
                        ),
                    ));
                }
                Ok(id)
            })
            .collect()
    };
    let encode = |text: &str| -> Result<Vec<u32>, ApiError> {
        Ok(served
            .tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .get_ids()
            .to_vec())
    };
    let ids = match obj.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::param("prompt", "`prompt` is required")),
        Some(Value::String(text)) => encode(text)?,
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(text)] => encode(text)?,
            [Value::Array(inner)] => ids_of(inner)?,
            items if items.iter().all(Value::is_number) => ids_of(items)?,
            _ => {
                return Err(ApiError::param(
                    "prompt",
                    "`prompt` must be a single prompt: a list of prompts is not supported",
                ));
            }
        },
        Some(_) => return Err(bad()),
    };
    if ids.is_empty() {
        return Err(ApiError::param("prompt", "`prompt` must not be empty"));
    }
    Ok(ids)
}

fn stop_strings(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::param(
            "stop",
            format!("`stop` must be a non-empty string or a list of at most {MAX_STOP} of them"),
        )
    };
    let stop: Vec<String> = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(bad))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(bad());
    }
    Ok(stop)
}

fn boolean(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::param(key, format!("`{key}` must be a boolean"))),
    }
}

/// Validates the body and tokenizes the prompt.
pub fn prepare(body: &[u8], served: &Served) -> Result<Prepared, ApiError> {
    let mut obj = chat::parse_object(body)?;
    crate::api::fields::check(&obj, crate::api::fields::COMPLETIONS_FIELDS)?;
    match obj.get("model") {
        Some(Value::String(model)) if served.accepts(model) => {}
        Some(Value::String(model)) => {
            return Err(ApiError::UnknownModel {
                model: model.clone(),
                served: served.names.join(", "),
            });
        }
        None | Some(Value::Null) => return Err(ApiError::param("model", "`model` is required")),
        Some(_) => return Err(ApiError::param("model", "`model` must be a string")),
    }
    let Extras {
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        min_tokens,
        stop_token_ids,
        ignore_eos,
        guided,
        n,
        ..
    } = chat::check_sampling(&mut obj)?;
    let format = crate::api::structured::completions_response_format(&obj)?;
    let constraint = crate::api::structured::resolve(format, guided, None)?;
    let number = |key: &str| obj.get(key).and_then(Value::as_f64);
    let temperature = number("temperature").unwrap_or(1.0) as f32;
    let top_p = number("top_p").unwrap_or(1.0) as f32;
    let seed = obj.get("seed").and_then(Value::as_u64);
    let stream = boolean(&obj, "stream")?.unwrap_or(false);
    crate::api::protocol::only_keys(&obj, "stream_options", &["include_usage"])?;
    if !stream && obj.get("stream_options").is_some_and(|v| !v.is_null()) {
        // As chat: the options of a stream, without one.
        return Err(ApiError::param(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(opts)) => boolean(opts, "include_usage")
            .map_err(|_| {
                ApiError::param(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::param(
                "stream_options",
                "`stream_options` must be an object",
            ));
        }
    };
    let logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                ApiError::param("logprobs", "`logprobs` must be an integer in [0, 20]")
            })?;
            if !(0..=20).contains(&n) {
                return Err(ApiError::param(
                    "logprobs",
                    format!("`logprobs` = {n} is out of range: accepted [0, 20]"),
                ));
            }
            Some(u32::try_from(n).unwrap_or(0))
        }
    };
    let echo = boolean(&obj, "echo")? == Some(true);
    let return_token_ids = boolean(&obj, "return_token_ids")? == Some(true);
    let skip_special_tokens = boolean(&obj, "skip_special_tokens")?.unwrap_or(true);
    if obj.get("suffix").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::param("suffix", "`suffix` is not supported"));
    }
    let stop = stop_strings(&obj)?;
    let prompt = prompt_ids(&obj, served)?;
    let echo = if echo {
        Some(match obj.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            _ => served
                .tokenizer
                .decode(&prompt, false)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
        })
    } else {
        None
    };
    let requested = obj
        .get("max_tokens")
        .and_then(Value::as_u64)
        .map(|x| u32::try_from(x).unwrap_or(u32::MAX));
    let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    let room = served.max_model_len().saturating_sub(prompt_len);
    if room == 0 {
        return Err(ApiError::ContextLength {
            param: "prompt".to_owned(),
            message: format!(
                "the prompt has {prompt_len} tokens; this model's context is {} tokens",
                served.max_model_len()
            ),
        });
    }
    let max_tokens = match requested {
        Some(m) if m > room => {
            return Err(ApiError::ContextLength {
                param: "max_tokens".to_owned(),
                message: format!(
                    "`max_tokens` = {m} plus the prompt's {prompt_len} tokens exceed this \
                     model's context of {} tokens",
                    served.max_model_len()
                ),
            });
        }
        Some(m) => m,
        None => DEFAULT_MAX_TOKENS.min(room),
    };
    check_min_tokens(min_tokens, max_tokens)?;
    Ok(Prepared {
        prompt,
        max_tokens,
        stop,
        stream,
        include_usage,
        min_tokens,
        stop_token_ids,
        ignore_eos,
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            logprobs: logprobs.is_some(),
            top_logprobs: logprobs.unwrap_or(0),
            constraint,
            // The echoed prompt is listed with its tokens' log-probabilities.
            prompt_logprobs: logprobs.filter(|_| echo.is_some()),
        },
        logprobs,
        echo,
        return_token_ids,
        skip_special_tokens,
        n,
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

fn error_json(e: &ApiError) -> String {
    serde_json::to_string(&e.body()).unwrap_or_default()
}

/// OpenAI's legacy `logprobs` object for consecutive tokens of one completion: each token's
/// text (decoded alone), its log-probability, its best alternatives (text to log-probability)
/// and the character offset where its text starts in the completion.
struct TokenList {
    tokenizer: Arc<Tokenizer>,
    /// Characters of the completion's listed tokens so far.
    offset: usize,
}

impl TokenList {
    fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            offset: 0,
        }
    }

    fn text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    fn json(&mut self, tokens: &[GeneratedToken]) -> Value {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        for t in tokens {
            let text = self.text(t.id);
            offsets.push(self.offset);
            self.offset += text.chars().count();
            texts.push(text);
        }
        let top: Vec<Value> = tokens
            .iter()
            .map(|t| {
                // The prompt's first token has no log-probability and no alternatives.
                if t.logprob.is_none() {
                    return Value::Null;
                }
                let mut m = Map::new();
                for &(id, lp) in &t.top_logprobs {
                    m.entry(self.text(id)).or_insert(json!(lp));
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": texts,
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

/// `min_tokens` may not exceed the `max_tokens` the request ends up with (its own or the
/// default).
pub fn check_min_tokens(min_tokens: u32, max_tokens: u32) -> Result<(), ApiError> {
    if min_tokens > max_tokens {
        return Err(ApiError::param(
            "min_tokens",
            format!("`min_tokens` = {min_tokens} exceeds `max_tokens` = {max_tokens}"),
        ));
    }
    Ok(())
}

/// What every choice of one completion shares when it is written out.
struct Writer {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    /// The prompt's ids, when `return_token_ids` asked for them.
    prompt_ids: Option<Vec<u32>>,
    /// `echo` with `logprobs`: the prompt's first token, listed (with no log-probability)
    /// before the entries of the others.
    echo_head: Option<u32>,
}

impl Writer {
    /// The echoed prompt's listed tokens: its first token, then `entries`.
    fn prompt_tokens(&self, entries: Vec<GeneratedToken>) -> Vec<GeneratedToken> {
        let head = self.echo_head.map(|id| GeneratedToken {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        });
        head.into_iter().chain(entries).collect()
    }

    fn chunk(&self, index: usize, text: &str, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": finish}],
        })
    }

    /// Adds `tokens` (their logprobs, their ids) to the one choice of `body`; the prompt's
    /// ids go with a choice's first tokens (`first`).
    fn with_tokens(
        &self,
        mut body: Value,
        listed: &mut TokenList,
        tokens: &[GeneratedToken],
        first: bool,
    ) -> Value {
        if self.logprobs {
            body["choices"][0]["logprobs"] = listed.json(tokens);
        }
        if let Some(ids) = &self.prompt_ids {
            body["choices"][0]["token_ids"] =
                json!(tokens.iter().map(|t| t.id).collect::<Vec<_>>());
            if first {
                body["choices"][0]["prompt_token_ids"] = json!(ids);
            }
        }
        body
    }
}

/// One choice's pieces as SSE data: (choice index, data, completion tokens once it finished).
/// The text of `echo` comes first.
fn choice_events(
    index: usize,
    pieces: impl Stream<Item = Piece> + Send + 'static,
    writer: Arc<Writer>,
    mut listed: TokenList,
    echo: Option<String>,
) -> impl Stream<Item = (String, Option<Result<usize, ()>>)> + Send + 'static {
    // With `logprobs` the echo waits for the prompt's log-probabilities and is listed with
    // them; without, it goes first at once.
    let (first, mut echo) = if writer.echo_head.is_some() {
        (None, echo)
    } else {
        (
            echo.map(|e| (writer.chunk(index, &e, None).to_string(), None)),
            None,
        )
    };
    // Tokens are listed with the text that follows them (or with the finish).
    let mut waiting: Vec<GeneratedToken> = Vec::new();
    let mut first_tokens = true;
    let events = pieces.flat_map(move |piece| {
        let mut with_tokens = |body: Value, waiting: &mut Vec<GeneratedToken>| {
            let tokens = std::mem::take(waiting);
            let body = writer.with_tokens(body, &mut listed, &tokens, first_tokens);
            first_tokens = false;
            body.to_string()
        };
        let data: Vec<(String, Option<Result<usize, ()>>)> = match piece {
            Piece::Prompt(entries) => {
                waiting.extend(writer.prompt_tokens(entries));
                let text = echo.take().unwrap_or_default();
                vec![(
                    with_tokens(writer.chunk(index, &text, None), &mut waiting),
                    None,
                )]
            }
            Piece::Tokens(tokens) => {
                waiting.extend(tokens);
                Vec::new()
            }
            Piece::Text(text) => vec![(
                with_tokens(writer.chunk(index, &text, None), &mut waiting),
                None,
            )],
            Piece::Finish {
                reason,
                completion_tokens,
            } => vec![(
                with_tokens(writer.chunk(index, "", Some(reason)), &mut waiting),
                Some(Ok(completion_tokens)),
            )],
            Piece::Failed(error) => vec![(error_json(&error), Some(Err(())))],
        };
        futures::stream::iter(data)
    });
    futures::stream::iter(first).chain(events)
}

/// One choice's pieces gathered into its JSON (and its completion tokens).
async fn collect_choice(
    index: usize,
    pieces: impl Stream<Item = Piece>,
    writer: &Writer,
    mut listed: TokenList,
    echo: Option<String>,
) -> Result<(Value, usize), ApiError> {
    let mut text = echo.unwrap_or_default();
    let mut all: Vec<GeneratedToken> = Vec::new();
    let mut pieces = std::pin::pin!(pieces);
    while let Some(piece) = pieces.next().await {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            // Sent first, so the prompt's tokens lead the list.
            Piece::Prompt(entries) => all.extend(writer.prompt_tokens(entries)),
            Piece::Tokens(tokens) => all.extend(tokens),
            Piece::Finish {
                reason,
                completion_tokens,
            } => {
                let body = writer.with_tokens(
                    writer.chunk(index, &text, Some(reason)),
                    &mut listed,
                    &all,
                    true,
                );
                return Ok((body["choices"][0].clone(), completion_tokens));
            }
            Piece::Failed(error) => return Err(error),
        }
    }
    Err(ApiError::Internal(
        "the completion ended without a finish".to_owned(),
    ))
}

/// Runs a prepared request and answers it (JSON or SSE). Its `n` choices are generated
/// side by side ([`crate::backend::submit_choices`]); a choice that fails fails the request.
pub async fn respond(
    prepared: Prepared,
    served: Arc<Served>,
    mut tracker: Tracker,
    request_id: &crate::api::request_id::RequestId,
) -> Result<Response, ApiError> {
    let Prepared {
        prompt,
        max_tokens,
        stop,
        stream,
        include_usage,
        sampling,
        min_tokens,
        stop_token_ids,
        ignore_eos,
        logprobs,
        echo,
        return_token_ids,
        skip_special_tokens,
        n,
    } = prepared;
    let prompt_len = prompt.len();
    let writer = Arc::new(Writer {
        id: format!("cmpl-{}", request_id.as_str()),
        created: now(),
        model: served.name.clone(),
        logprobs: logprobs.is_some(),
        prompt_ids: return_token_ids.then(|| prompt.clone()),
        echo_head: sampling
            .prompt_logprobs
            .and_then(|_| prompt.first().copied()),
    });
    let request = BackendRequest {
        request_id: request_id.as_str().to_owned(),
        prompt,
        sampling,
        stop: StopConditions {
            max_tokens,
            min_tokens,
            stop_token_ids,
            ignore_eos,
            eos_token_ids: served.eos_token_ids.clone(),
        },
    };
    tracker.prompt(prompt_len);
    let stop_ids: Vec<u32> = request
        .stop
        .eos_token_ids
        .iter()
        .chain(&request.stop.stop_token_ids)
        .copied()
        .collect();
    let streams = match crate::backend::submit_choices(served.backend.as_ref(), request, n).await {
        Ok(streams) => streams,
        Err(e) => {
            let e = ApiError::from(e);
            tracker.failed(e.parts().0);
            return Err(e);
        }
    };
    let mut tracker = Some(tracker);
    let choices: Vec<_> = streams
        .into_iter()
        .map(|tokens| {
            pieces(
                tokens,
                tracker.take(),
                Detokenizer::new(Arc::clone(&served.tokenizer), stop.clone())
                    .keeping_special_tokens(!skip_special_tokens),
                stop_ids.clone(),
                logprobs.is_some() || return_token_ids,
            )
        })
        .collect();
    let listed = || TokenList::new(Arc::clone(&served.tokenizer));
    if stream {
        let streams = choices.into_iter().enumerate().map(|(i, pieces)| {
            choice_events(i, pieces, Arc::clone(&writer), listed(), echo.clone()).boxed()
        });
        let merged = futures::stream::select_all(streams);
        // Usage and `[DONE]` follow the last choice's finish; a failure ends the stream at
        // once with its error and no `[DONE]` (the other choices are cancelled).
        let state = (choices_len(n), 0usize, false);
        let events = merged
            .scan(state, move |(open, completion, ended), (data, end)| {
                if *ended {
                    return futures::future::ready(None);
                }
                let mut out = vec![data];
                match end {
                    Some(Ok(tokens)) => {
                        *completion += tokens;
                        *open -= 1;
                        if *open == 0 {
                            if include_usage {
                                let mut last = writer.chunk(0, "", None);
                                last["choices"] = json!([]);
                                last["usage"] = usage(prompt_len, *completion);
                                out.push(last.to_string());
                            }
                            out.push("[DONE]".to_owned());
                        }
                    }
                    Some(Err(())) => *ended = true,
                    None => {}
                }
                futures::future::ready(Some(out))
            })
            .flat_map(|out| {
                futures::stream::iter(
                    out.into_iter()
                        .map(|d| Ok::<_, Infallible>(SseEvent::default().data(d))),
                )
            });
        return Ok(Sse::new(events).into_response());
    }
    // The first failed choice ends the request; the others are dropped (cancelled) with it.
    let collected = futures::future::try_join_all(
        choices
            .into_iter()
            .enumerate()
            .map(|(i, pieces)| collect_choice(i, pieces, &writer, listed(), echo.clone())),
    )
    .await?;
    let mut bodies = Vec::with_capacity(collected.len());
    let mut completion = 0;
    for (body, tokens) in collected {
        completion += tokens;
        bodies.push(body);
    }
    let mut body = writer.chunk(0, "", None);
    body["choices"] = Value::Array(bodies);
    body["usage"] = usage(prompt_len, completion);
    Ok(axum::Json(body).into_response())
}

/// The number of choices as a count of streams.
fn choices_len(n: u32) -> usize {
    usize::try_from(n.max(1)).unwrap_or(1)
}
