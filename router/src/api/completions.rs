//! `POST /v1/completions` (OpenAI legacy completions): a raw prompt (text or token ids, no chat
//! template), incremental detokenization that never emits half a character, and stop strings
//! held back until resolved. Streamed and non-streamed answers come from the same text pieces,
//! so their texts are equal.

use std::{collections::VecDeque, convert::Infallible, sync::Arc, time::SystemTime};

use axum::response::{
    IntoResponse, Response,
    sse::{Event as SseEvent, Sse},
};
use engine::sampling::{FinishReason, SamplingParams, StopConditions};
use futures::{Stream, StreamExt};
use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

use crate::{
    api::chat::{self, Extras},
    api::error::ApiError,
    backend::{BackendEvent, BackendRequest, GeneratedToken, TokenStream},
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

/// Incremental detokenization with stop strings. Decodes a short window of the growing id
/// list (the previous read position onwards, as vLLM does, so the work per token stays
/// constant and tokenizers that treat a leading token specially still decode alike) and takes
/// only the new complete text: never text ending in U+FFFD (half a character) nor a tail that
/// may begin a stop string.
#[derive(Debug)]
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    stop: Vec<String>,
    ids: Vec<u32>,
    /// The decoding window starts here; `read` is where the decoded text ends.
    prefix: usize,
    read: usize,
    /// Complete text of `ids[..read]`.
    text: String,
    /// Bytes of `text` already released.
    sent: usize,
    /// Special tokens are left out of the text (vLLM's `skip_special_tokens`).
    skip_special: bool,
}

/// The tokenizer failed to decode the generated ids (its message as it gave it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DetokenizeError(#[source] tokenizers::Error);

/// What [`Detokenizer::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string matched: the text ends before it and generation is over.
    pub stopped: bool,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Self {
        Self {
            tokenizer,
            stop,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            sent: 0,
            skip_special: true,
        }
    }

    /// Keeps special tokens in the text (`skip_special_tokens: false`).
    #[must_use]
    pub fn keeping_special_tokens(mut self, keep: bool) -> Self {
        self.skip_special = !keep;
        self
    }

    /// The text of `ids`; special tokens (eos under `ignore_eos`, markers) left out unless
    /// kept, as vLLM's `skip_special_tokens` says.
    fn decode(&self, ids: &[u32]) -> Result<String, DetokenizeError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(ids, self.skip_special)
            .map_err(DetokenizeError)
    }

    /// Extends `text` with the newly complete text (all of it with `last`).
    fn advance(&mut self, last: bool) -> Result<(), DetokenizeError> {
        if self.read == self.ids.len() {
            return Ok(());
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let window = self.decode(&self.ids[self.prefix..])?;
        let complete = !window.ends_with('\u{FFFD}');
        if (complete || last)
            && window.len() >= before.len()
            && window.is_char_boundary(before.len())
        {
            self.text.push_str(&window[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(())
    }

    /// Adds tokens; returns the text that is now final. With `last`, everything left is
    /// released (a trailing U+FFFD included: the tokens really end mid-character).
    pub fn push(&mut self, ids: &[u32], last: bool) -> Result<Released, DetokenizeError> {
        self.ids.extend_from_slice(ids);
        self.advance(last)?;
        let full = &self.text;
        // A match may start in released text only if it ends in new text; released text never
        // ended with the start of a stop string, so searching from `sent` minus the longest
        // stop string is enough.
        let search_from = floor_boundary(
            full,
            self.sent
                .saturating_sub(self.stop.iter().map(String::len).max().unwrap_or(0)),
        );
        let hit = self
            .stop
            .iter()
            .filter_map(|s| {
                full[search_from..]
                    .find(s.as_str())
                    .map(|p| search_from + p)
            })
            .min();
        if let Some(at) = hit {
            let text = full.get(self.sent..at).unwrap_or_default().to_owned();
            self.sent = at.max(self.sent);
            return Ok(Released {
                text,
                stopped: true,
            });
        }
        let mut safe = full.len();
        if !last {
            // A tail that may begin a stop string: wait until resolved.
            safe -= self
                .stop
                .iter()
                .map(|s| partial_suffix(full, s))
                .max()
                .unwrap_or(0);
        }
        if safe <= self.sent || !full.is_char_boundary(self.sent) {
            return Ok(Released {
                text: String::new(),
                stopped: false,
            });
        }
        let text = full[self.sent..safe].to_owned();
        self.sent = safe;
        Ok(Released {
            text,
            stopped: false,
        })
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .filter(|&n| stop.is_char_boundary(n))
        .find(|&n| text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

/// One step of a completion.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The log-probabilities of the prompt's tokens after the first (`echo` with `logprobs`),
    /// before any other piece.
    Prompt(Vec<GeneratedToken>),
    Text(String),
    /// The tokens (with their log-probabilities) of the text that follows (or, before the
    /// finish, of tokens whose text is empty); only when `logprobs` was asked for.
    Tokens(Vec<GeneratedToken>),
    Finish {
        reason: &'static str,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

struct Run {
    tokens: Option<TokenStream>,
    tracker: Option<Tracker>,
    detok: Detokenizer,
    held: Option<GeneratedToken>,
    generated: usize,
    out: VecDeque<Piece>,
    /// `logprobs` asked for: tokens go through the detokenizer one by one, each listed with
    /// the text it completes.
    logprobs: bool,
    /// Tokens released into the detokenizer whose text has not come out yet.
    pending: Vec<GeneratedToken>,
    /// Eos and stop ids: a `Stop` request's last token is dropped only when it is one (a
    /// completed grammar ends on a token of the output).
    stop_ids: Vec<u32>,
}

impl Run {
    fn release_ids(&mut self, ids: &[u32], last: bool) -> Result<bool, DetokenizeError> {
        let released = self.detok.push(ids, last)?;
        if !released.text.is_empty() {
            if !self.pending.is_empty() {
                self.out
                    .push_back(Piece::Tokens(std::mem::take(&mut self.pending)));
            }
            self.out.push_back(Piece::Text(released.text));
        }
        Ok(released.stopped)
    }

    /// Releases `tokens` (one by one when their log-probabilities are listed, so each is
    /// listed with its own text and none past a stop string); whether a stop string ended it.
    fn release(
        &mut self,
        tokens: Vec<GeneratedToken>,
        last: bool,
    ) -> Result<bool, DetokenizeError> {
        if !self.logprobs {
            let ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
            return self.release_ids(&ids, last);
        }
        let n = tokens.len();
        for (i, token) in tokens.into_iter().enumerate() {
            let id = token.id;
            self.pending.push(token);
            if self.release_ids(&[id], last && i + 1 == n)? {
                return Ok(true);
            }
        }
        if last && n == 0 {
            return self.release_ids(&[], true);
        }
        Ok(false)
    }

    fn finish(&mut self, reason: &'static str) {
        if !self.pending.is_empty() {
            self.out
                .push_back(Piece::Tokens(std::mem::take(&mut self.pending)));
        }
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.succeeded();
        }
        self.out.push_back(Piece::Finish {
            reason,
            completion_tokens: self.generated,
        });
        self.end();
    }

    fn fail(&mut self, error: ApiError) {
        tracing::error!(%error, "completion failed");
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.server_error();
        }
        self.out.push_back(Piece::Failed(error));
        self.end();
    }

    /// Drops the backend stream (cancelling it if still running) and the tracker.
    fn end(&mut self) {
        self.tokens = None;
        self.tracker = None;
    }
}

/// Backend events as completion pieces: text, then exactly one `Finish` or `Failed`.
pub fn pieces(
    tokens: TokenStream,
    tracker: Option<Tracker>,
    detok: Detokenizer,
    stop_ids: Vec<u32>,
    logprobs: bool,
) -> impl Stream<Item = Piece> + Send + 'static {
    let run = Run {
        stop_ids,
        logprobs,
        pending: Vec::new(),
        tokens: Some(tokens),
        tracker,
        detok,
        held: None,
        generated: 0,
        out: VecDeque::new(),
    };
    futures::stream::unfold(run, |mut run| async move {
        loop {
            if let Some(piece) = run.out.pop_front() {
                return Some((piece, run));
            }
            let tokens = run.tokens.as_mut()?;
            let event = tokens.next().await;
            if let Some(BackendEvent::Tokens(batch)) = &event {
                match run.tracker.as_mut() {
                    Some(tracker) => tracker.generated(batch.len()),
                    None => crate::metrics::count_generated(batch.len()),
                }
            }
            match event {
                Some(BackendEvent::Tokens(batch)) => {
                    run.generated += batch.len();
                    // The last token is held back: it is the eos that ends a `Stop` request.
                    let mut toks: Vec<GeneratedToken> = run.held.take().into_iter().collect();
                    toks.extend(batch);
                    run.held = toks.pop();
                    match run.release(toks, false) {
                        Ok(true) => run.finish("stop"),
                        Ok(false) => {}
                        Err(e) => run.fail(ApiError::Internal(e.to_string())),
                    }
                }
                Some(BackendEvent::Finished { reason, .. }) => {
                    let (toks, reason): (Vec<GeneratedToken>, _) = match reason {
                        FinishReason::Length => (run.held.take().into_iter().collect(), "length"),
                        FinishReason::Stop => (
                            run.held
                                .take()
                                .filter(|t| !run.stop_ids.contains(&t.id))
                                .into_iter()
                                .collect(),
                            "stop",
                        ),
                    };
                    match run.release(toks, true) {
                        Ok(_) => run.finish(reason),
                        Err(e) => run.fail(ApiError::Internal(e.to_string())),
                    }
                }
                Some(BackendEvent::PromptLogprobs(entries)) => {
                    run.out.push_back(Piece::Prompt(entries));
                }
                Some(BackendEvent::Failed(error)) => run.fail(ApiError::from(error)),
                None => run.fail(ApiError::Internal(
                    "the backend stream ended before the request finished".into(),
                )),
            }
        }
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

#[cfg(test)]
mod tests {
    use tokenizers::{models::bpe::BPE, pre_tokenizers::byte_level::ByteLevel};

    use super::*;
    use crate::backend::BackendError;

    /// A byte-level tokenizer with one token per byte: multi-byte characters always span
    /// several tokens.
    fn byte_tokenizer() -> Arc<Tokenizer> {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let vocab: tokenizers::models::bpe::Vocab = alphabet
            .iter()
            .zip(0_u32..)
            .map(|(c, i)| (c.to_string(), i))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .unwrap();
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
        Arc::new(tokenizer)
    }

    fn ids(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// Feeds `text` one token at a time; returns the released pieces and whether it stopped.
    fn feed(text: &str, stop: &[&str]) -> (Vec<String>, bool) {
        let tokenizer = byte_tokenizer();
        let ids = ids(&tokenizer, text);
        assert_eq!(ids.len(), text.len(), "one token per byte");
        let mut detok = Detokenizer::new(tokenizer, stop.iter().map(|s| (*s).to_owned()).collect());
        let mut out = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let r = detok.push(&[*id], i + 1 == ids.len()).unwrap();
            if !r.text.is_empty() {
                out.push(r.text);
            }
            if r.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn never_emits_half_a_character() {
        let text = "héllo ünïcødé 你好 🦀!";
        let (pieces, stopped) = feed(text, &[]);
        assert!(!stopped);
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "{pieces:?}");
        }
        assert_eq!(pieces.concat(), text);
        assert!(pieces.len() > 10, "released incrementally: {pieces:?}");
    }

    #[test]
    fn stop_strings_spanning_tokens_are_held_back() {
        let (pieces, stopped) = feed("hello STOP world", &["STOP"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "hello ");
        assert!(pieces.iter().all(|p| !p.contains('S')), "{pieces:?}");
        // A partial match that does not complete is released.
        let (pieces, stopped) = feed("a STx STOq", &["STOP"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "a STx STOq");
        // Multi-byte stop string; the earliest of several wins.
        let (pieces, stopped) = feed("x 你好 y end", &["end", "好"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "x 你");
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 96, ..Default::default() })]

        /// Any text, cut into any chunks, with any stop strings: the released pieces are the
        /// text up to the earliest stop match (all of it without one), never half a character.
        #[test]
        fn released_text_equals_one_shot_decoding(
            text in "[a-zé你🦀 ]{0,40}",
            cuts in proptest::collection::vec(1usize..6, 0..40),
            stop in proptest::collection::vec("[a-zé你 ]{1,3}", 0..3),
        ) {
            let tokenizer = byte_tokenizer();
            let all = ids(&tokenizer, &text);
            let mut detok = Detokenizer::new(Arc::clone(&tokenizer), stop.clone());
            let (mut out, mut stopped, mut at) = (String::new(), false, 0);
            let mut cuts = cuts.into_iter().cycle().chain(std::iter::repeat(1));
            while at < all.len() && !stopped {
                let end = (at + cuts.next().unwrap_or(1)).min(all.len());
                let r = detok.push(&all[at..end], end == all.len()).unwrap();
                proptest::prop_assert!(!r.text.contains('\u{FFFD}'), "{:?}", r.text);
                out.push_str(&r.text);
                stopped = r.stopped;
                at = end;
            }
            let first_stop = stop.iter().filter_map(|s| text.find(s.as_str())).min();
            if let Some(i) = first_stop {
                proptest::prop_assert!(stopped);
                proptest::prop_assert_eq!(out, &text[..i]);
            } else {
                proptest::prop_assert!(!stopped);
                proptest::prop_assert_eq!(out, text);
            }
        }
    }

    #[test]
    fn last_push_releases_a_dangling_partial_character() {
        let tokenizer = byte_tokenizer();
        let all = ids(&tokenizer, "é");
        let mut detok = Detokenizer::new(Arc::clone(&tokenizer), Vec::new());
        assert_eq!(detok.push(&all[..1], false).unwrap().text, "");
        assert_eq!(detok.push(&[], true).unwrap().text, "\u{FFFD}");
    }

    async fn drive(events: Vec<BackendEvent>, stop: &[&str]) -> Vec<Piece> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        drop(tx);
        let detok = Detokenizer::new(
            byte_tokenizer(),
            stop.iter().map(|s| (*s).to_owned()).collect(),
        );
        let tracker = Tracker::new(crate::metrics::Endpoint::Completions);
        // `Z` stands for the eos id.
        let eos = ids(&byte_tokenizer(), "Z");
        pieces(
            TokenStream::new(rx, || {}),
            Some(tracker),
            detok,
            eos,
            false,
        )
        .collect()
        .await
    }

    fn tokens(text: &str) -> BackendEvent {
        let tokenizer = byte_tokenizer();
        BackendEvent::Tokens(
            ids(&tokenizer, text)
                .into_iter()
                .map(|id| crate::backend::GeneratedToken {
                    id,
                    logprob: None,
                    top_logprobs: Vec::new(),
                })
                .collect(),
        )
    }

    #[tokio::test]
    async fn backend_failure_ends_with_failed_not_finish() {
        let pieces = drive(
            vec![
                tokens("abc"),
                BackendEvent::Failed(BackendError::unavailable("boom")),
            ],
            &[],
        )
        .await;
        assert_eq!(
            pieces.last(),
            Some(&Piece::Failed(ApiError::from(BackendError::unavailable(
                "boom"
            ))))
        );
        assert!(!pieces.iter().any(|p| matches!(p, Piece::Finish { .. })));
        let pieces = drive(vec![tokens("abc")], &[]).await;
        assert!(
            matches!(pieces.last(), Some(Piece::Failed(e)) if e.to_string().contains("ended before"))
        );
    }

    #[tokio::test]
    async fn eos_is_dropped_and_length_keeps_the_last_token() {
        let usage = engine::scheduler::Usage::default();
        let stop = BackendEvent::Finished {
            reason: FinishReason::Stop,
            usage,
        };
        let pieces = drive(vec![tokens("ab"), tokens("cZ"), stop], &[]).await;
        assert_eq!(pieces.first(), Some(&Piece::Text("a".into())));
        let text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "abc", "the eos (last token) is not text");
        assert_eq!(
            pieces.last(),
            Some(&Piece::Finish {
                reason: "stop",
                completion_tokens: 4
            })
        );
        // A `Stop` whose last token is no stop id (a completed grammar) keeps it.
        let stop = BackendEvent::Finished {
            reason: FinishReason::Stop,
            usage,
        };
        let pieces = drive(vec![tokens("abc"), stop], &[]).await;
        let kept: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(kept, "abc");
        let length = BackendEvent::Finished {
            reason: FinishReason::Length,
            usage,
        };
        let pieces = drive(vec![tokens("abc"), length], &[]).await;
        assert!(pieces.contains(&Piece::Text("c".into())), "{pieces:?}");
        // A stop string ends the request early with finish `stop`.
        let pieces = drive(vec![tokens("xxENDyy")], &["END"]).await;
        assert_eq!(
            pieces,
            vec![
                Piece::Text("xx".into()),
                Piece::Finish {
                    reason: "stop",
                    completion_tokens: 7
                }
            ]
        );
    }
}
