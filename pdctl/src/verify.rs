//! `pdctl verify`: checks a live cluster before it takes traffic and prints a table of checks
//! with their numbers; any failed check makes the command fail. The checks compare answers
//! with each other (repeat, stream, concurrency) and, given the checkpoint, with the
//! single-process engine in this process, bit for bit (tokens and logprobs).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use serde_json::{Value, json};

use crate::PdctlError;

mod answer;
mod error;
mod reference;

use answer::{Answer, Client};
use error::VerifyError;

/// Arguments of `pdctl verify`.
#[derive(Debug, Clone, clap::Args)]
pub struct VerifyArgs {
    /// The router's HTTP address (host:port).
    #[arg(long, value_name = "ADDR")]
    pub url: SocketAddr,
    /// The checkpoint the cluster serves: answers are also compared with this process's
    /// single-process engine (default engine settings, as the workers use).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// API key, when the router requires one.
    #[arg(long, env = common::env::API_KEY, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Distinct prompts sent at once by the concurrency check.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub concurrency: u32,
    /// Tokens generated per answer.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_tokens: u32,
}

/// One check's outcome.
#[derive(Debug, Clone)]
struct Check {
    name: &'static str,
    /// `None`: skipped.
    ok: Option<bool>,
    detail: String,
}

impl Check {
    fn new(name: &'static str, result: Result<String, VerifyError>) -> Self {
        match result {
            Ok(detail) => Self {
                name,
                ok: Some(true),
                detail,
            },
            Err(e) => Self {
                name,
                ok: Some(false),
                detail: e.to_string(),
            },
        }
    }

    fn skipped(name: &'static str, why: &str) -> Self {
        Self {
            name,
            ok: None,
            detail: why.to_owned(),
        }
    }
}

/// Words the prompts are made of (a fixed list: the same prompts on every run).
const WORDS: [&str; 24] = [
    "river", "lantern", "seven", "quiet", "harbor", "copper", "winter", "orbit", "maple", "signal",
    "garden", "thunder", "pencil", "violet", "anchor", "desert", "marble", "echo", "falcon",
    "ribbon", "summit", "candle", "meadow", "puzzle",
];

/// A prompt of `words` words, different for each `seed`.
pub(crate) fn prompt_text(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(words + 1);
    out.push(format!("Case {seed}:"));
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(WORDS[(x % WORDS.len() as u64) as usize].to_owned());
    }
    out.join(" ")
}

/// A greedy chat request with logprobs, thinking off (in thinking mode the temperature is
/// ignored, as in DeepSeek's API, so greedy needs it off).
fn chat_body(model: &str, text: &str, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "reasoning_effort": "none",
        "logprobs": true,
        "top_logprobs": 2,
    })
}

/// Runs `pdctl verify`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(args: &VerifyArgs) -> Result<(), PdctlError> {
    let client = Client::connect(args.url, args.api_key.clone())
        .await
        .map_err(|e| PdctlError::Unhealthy {
            what: format!("router {}", args.url),
            reason: e.to_string(),
        })?;
    let mut checks = Vec::new();
    let n = args.max_tokens;
    checks.push(Check::new(
        "greedy determinism",
        determinism(&client, n).await,
    ));
    checks.push(Check::new(
        "stream == non-stream",
        stream_equals(&client, n).await,
    ));
    checks.push(Check::new(
        "concurrency isolation",
        concurrency(&client, args.concurrency, n).await,
    ));
    checks.push(Check::new("long prompts", long_prompts(&client, n).await));
    checks.push(match &args.model {
        Some(dir) => Check::new(
            "cluster == single-process engine",
            match exact_workers(&client).await {
                Ok(()) => reference::compare(&client, dir, n).await,
                Err(e) => Err(e),
            },
        ),
        None => Check::skipped(
            "cluster == single-process engine",
            "give --model DIR (the served checkpoint)",
        ),
    });
    checks.push(match checksums(&client).await {
        Ok(Some(detail)) => Check::new("transfer checksums", Ok(detail)),
        Ok(None) => Check::skipped("transfer checksums", "no workers: single-process router"),
        Err(e) => Check::new("transfer checksums", Err(e)),
    });
    checks.push(Check::new(
        "tool and reasoning round trip",
        tools(&client, n).await,
    ));
    checks.push(Check::new("bad input probe", bad_input(&client).await));

    let failed = checks.iter().filter(|c| c.ok == Some(false)).count();
    if args.json {
        let list: Vec<Value> = checks
            .iter()
            .map(|c| {
                json!({
                    "name": c.name,
                    "result": match c.ok { Some(true) => "pass", Some(false) => "fail", None => "skip" },
                    "detail": c.detail,
                })
            })
            .collect();
        println!("{:#}", json!({"ok": failed == 0, "checks": list}));
    } else {
        println!("{:<34} {:<6} detail", "check", "result");
        for c in &checks {
            let result = match c.ok {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "skip",
            };
            println!("{:<34} {result:<6} {}", c.name, c.detail);
        }
    }
    if failed > 0 {
        return Err(PdctlError::Unhealthy {
            what: format!("cluster at {}", args.url),
            reason: format!("{failed} of {} checks failed", checks.len()),
        });
    }
    Ok(())
}

/// The same greedy request three times gives the same answer.
async fn determinism(client: &Client, n: u32) -> Result<String, VerifyError> {
    let body = chat_body(client.model(), &prompt_text(1, 12), n);
    let first = client.chat(&body).await?;
    for round in 2..=3 {
        let again = client.chat(&body).await?;
        if let Some(diff) = first.difference(&again) {
            return Err(VerifyError::Mismatch(format!(
                "run {round} differs from run 1: {diff}"
            )));
        }
    }
    Ok(format!("3 runs, {} tokens each, identical", first.tokens()))
}

/// Streaming gives exactly the non-streamed answer.
async fn stream_equals(client: &Client, n: u32) -> Result<String, VerifyError> {
    let mut compared = 0;
    for (seed, words) in [(2, 3), (3, 40)] {
        let body = chat_body(client.model(), &prompt_text(seed, words), n);
        let whole = client.chat(&body).await?;
        let streamed = client.chat_stream(&body).await?;
        if let Some(diff) = whole.difference(&streamed) {
            return Err(VerifyError::Mismatch(format!("prompt {seed}: {diff}")));
        }
        compared += whole.tokens();
    }
    Ok(format!("2 prompts, {compared} tokens, identical"))
}

/// Distinct prompts sent at once each equal their answer alone.
async fn concurrency(client: &Client, k: u32, n: u32) -> Result<String, VerifyError> {
    let bodies: Vec<Value> = (0..k)
        .map(|i| {
            let words = 3 + (i as usize * 17) % 60;
            chat_body(client.model(), &prompt_text(100 + u64::from(i), words), n)
        })
        .collect();
    let mut solo = Vec::new();
    for body in &bodies {
        solo.push(client.chat(body).await?);
    }
    let together = futures::future::join_all(bodies.iter().map(|b| client.chat(b))).await;
    let mut mismatched = Vec::new();
    for (i, (alone, at_once)) in solo.iter().zip(together).enumerate() {
        match at_once {
            Ok(answer) => {
                if let Some(diff) = alone.difference(&answer) {
                    mismatched.push(format!("#{i}: {diff}"));
                }
            }
            Err(e) => mismatched.push(format!("#{i}: {e}")),
        }
    }
    if mismatched.is_empty() {
        Ok(format!("{k} prompts at once equal their solo answers"))
    } else {
        Err(VerifyError::Mismatch(format!(
            "{} of {k} differ: {}",
            mismatched.len(),
            mismatched.join("; ")
        )))
    }
}

/// Prompts past the sliding window, several compression blocks and the indexer's top-k:
/// repeat and stream agree, and the prompt really is long.
async fn long_prompts(client: &Client, n: u32) -> Result<String, VerifyError> {
    let mut lengths = Vec::new();
    for (seed, words) in [(7, 300), (8, 700)] {
        let body = chat_body(client.model(), &prompt_text(seed, words), n);
        let whole = client.chat(&body).await?;
        let streamed = client.chat_stream(&body).await?;
        if let Some(diff) = whole.difference(&streamed) {
            return Err(VerifyError::Mismatch(format!(
                "{words} words: stream differs: {diff}"
            )));
        }
        let again = client.chat(&body).await?;
        if let Some(diff) = whole.difference(&again) {
            return Err(VerifyError::Mismatch(format!(
                "{words} words: repeat differs: {diff}"
            )));
        }
        lengths.push(whole.prompt_tokens);
    }
    Ok(format!(
        "prompt tokens {lengths:?}: repeat and stream identical"
    ))
}

/// Refuses the bit-for-bit comparison when a worker reports settings that leave the
/// reference's bits (its `compute.fast_kernels`), naming each such worker and setting.
async fn exact_workers(client: &Client) -> Result<(), VerifyError> {
    let listing = client.get_json("/workers").await?;
    let fast: Vec<String> = listing["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| {
            let keys: Vec<&str> = w["compute"]["fast_kernels"]
                .as_array()?
                .iter()
                .filter_map(Value::as_str)
                .collect();
            (!keys.is_empty()).then(|| {
                format!(
                    "{} {}: {}",
                    w["role"].as_str().unwrap_or("?"),
                    w["address"].as_str().unwrap_or("?"),
                    keys.join(", ")
                )
            })
        })
        .collect();
    if fast.is_empty() {
        Ok(())
    } else {
        Err(VerifyError::FastKernels(fast))
    }
}

/// Decode workers verify transferred state (the router's `transfer_checksums`).
async fn checksums(client: &Client) -> Result<Option<String>, VerifyError> {
    let listing = client.get_json("/workers").await?;
    let workers = listing["workers"].as_array().map_or(0, Vec::len);
    if workers == 0 {
        return Ok(None);
    }
    match listing["transfer_checksums"].as_bool() {
        Some(true) => Ok(Some(format!(
            "on: decode workers verify every page ({workers} workers)"
        ))),
        Some(false) => Err(VerifyError::ChecksumsOff),
        None => Err(VerifyError::ChecksumsUnreported),
    }
}

/// A conversation with tools, a past tool call and its result, and past reasoning, answered in
/// thinking mode with a fixed seed: accepted, rendered, and answered identically streamed and
/// not (reasoning, content and tool calls).
async fn tools(client: &Client, n: u32) -> Result<String, VerifyError> {
    let body = json!({
        "model": client.model(),
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]},
        }}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
             "tool_calls": [{"id": "call_1", "type": "function", "function":
                {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": -3}"},
            {"role": "user", "content": "And should I wear a coat?"},
        ],
        "max_tokens": n,
        "seed": 7,
        "reasoning_effort": "high",
        "logprobs": true,
    });
    let whole = client.chat(&body).await?;
    let streamed = client.chat_stream(&body).await?;
    if let Some(diff) = whole.difference(&streamed) {
        return Err(VerifyError::Mismatch(format!("stream differs: {diff}")));
    }
    let rendered = client
        .post_json(
            "/tokenize",
            &json!({"model": client.model(), "messages": body["messages"],
                    "tools": body["tools"], "reasoning_effort": "high"}),
        )
        .await?;
    let count = rendered["count"].as_u64().unwrap_or(0);
    if count != whole.prompt_tokens {
        return Err(VerifyError::Mismatch(format!(
            "/tokenize renders {count} tokens but the answer counted {}",
            whole.prompt_tokens
        )));
    }
    Ok(format!(
        "{count} prompt tokens, stream identical, /tokenize agrees"
    ))
}

/// A malformed request gets a 400 with an OpenAI error object, and the router still serves.
async fn bad_input(client: &Client) -> Result<String, VerifyError> {
    let (status, body) = client
        .post_raw("/v1/chat/completions", b"{\"messages\": [".to_vec())
        .await?;
    let error: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if status != 400 || !error["error"]["message"].is_string() {
        return Err(VerifyError::BadInputAccepted {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    let body = chat_body(client.model(), "Still there?", 2);
    let answer: Answer = client.chat(&body).await?;
    Ok(format!(
        "HTTP 400 with an error object, then a normal answer ({} tokens)",
        answer.tokens()
    ))
}

/// How long one request may take.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
