//! `POST /v1/completions` end to end: the real `pdserve-router` binary with the in-process
//! engine over a tiny synthetic checkpoint (real DeepSeek-V4 tokenizer).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{net::SocketAddr, time::Duration};

use integration_tests::{HttpResponse, http, start_router, tiny_model_dir};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);
const PATH: &str = "/v1/completions";

fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

/// Concatenates an SSE completions stream: (text, finish_reason, usage).
fn fold_stream(r: &HttpResponse) -> (String, Option<String>, Option<Value>) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let (mut text, mut finish, mut usage) = (String::new(), None, None);
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        assert_eq!(c["object"], "text_completion", "{c}");
        assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
        if let Some(choice) = c["choices"].get(0) {
            let piece = choice["text"].as_str().unwrap();
            assert!(!piece.contains('\u{FFFD}'), "half a character: {c}");
            text.push_str(piece);
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        if c["usage"].is_object() {
            usage = Some(c["usage"].clone());
        }
    }
    (text, finish, usage)
}

fn expect_error(r: &HttpResponse, status: u16, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["param"].as_str(), param, "{e}");
    assert!(e["error"]["message"].is_string(), "{e}");
}

#[test]
fn completions_stream_equals_non_stream_with_seeds() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    for (seed, max_tokens, temperature) in [(1_u64, 24, 0.9), (7, 40, 1.3), (42, 8, 0.0)] {
        let mut body = json!({
            "model": "deepseek-v4-flash",
            "prompt": format!("Once upon a time {seed}, ünïcødé 你好"),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        });
        let a = post(addr, PATH, &body);
        assert_eq!(a.status, 200, "{}", a.body);
        let a = a.json();
        assert_eq!(a["object"], "text_completion");
        assert!(a["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(a["model"], "deepseek-v4-flash");
        assert!(a["created"].as_u64().unwrap() > 0);
        let choice = &a["choices"][0];
        assert_eq!(choice["index"], 0);
        assert!(choice["logprobs"].is_null());
        let finish = choice["finish_reason"].as_str().unwrap();
        assert!(["stop", "length"].contains(&finish), "{a}");
        let usage = &a["usage"];
        let completion = usage["completion_tokens"].as_u64().unwrap();
        assert!(completion <= max_tokens && completion > 0, "{a}");
        assert_eq!(
            usage["total_tokens"].as_u64().unwrap(),
            usage["prompt_tokens"].as_u64().unwrap() + completion
        );
        let b = post(addr, PATH, &body).json();
        assert_eq!(a["choices"], b["choices"], "same seed, same output");

        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (text, stream_finish, stream_usage) = fold_stream(&post(addr, PATH, &body));
        assert_eq!(text, choice["text"].as_str().unwrap(), "seed {seed}");
        assert_eq!(stream_finish.as_deref(), Some(finish), "seed {seed}");
        assert_eq!(stream_usage.as_ref(), Some(usage), "seed {seed}");

        body["stream_options"] = json!(null);
        let (text2, finish2, usage2) = fold_stream(&post(addr, PATH, &body));
        assert_eq!((text2, finish2), (text, stream_finish));
        assert!(usage2.is_none(), "usage only with include_usage");
    }
}

#[test]
fn completions_token_id_prompt_default_max_tokens_and_stop() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let prompt = "The quick brown fox";
    let tokens = post(
        addr,
        "/tokenize",
        &json!({"prompt": prompt, "add_special_tokens": false}),
    )
    .json()["tokens"]
        .clone();
    let by_text = json!({"model": "deepseek-v4-flash", "prompt": prompt, "seed": 3});
    let by_ids = json!({"model": "deepseek-v4-flash", "prompt": tokens, "seed": 3});
    let a = post(addr, PATH, &by_text).json();
    let b = post(addr, PATH, &by_ids);
    assert_eq!(b.status, 200, "{}", b.body);
    let b = b.json();
    assert_eq!(
        a["choices"], b["choices"],
        "text and token-id prompts agree"
    );
    assert_eq!(a["usage"], b["usage"]);
    assert!(
        a["usage"]["completion_tokens"].as_u64().unwrap() <= 16,
        "default max_tokens is 16: {a}"
    );
    let nested = json!({"model": "deepseek-v4-flash", "prompt": [tokens], "seed": 3});
    assert_eq!(post(addr, PATH, &nested).json()["choices"], a["choices"]);

    // A stop string taken from the middle of a longer completion ends the text before it.
    let long = json!({
        "model": "deepseek-v4-flash", "prompt": prompt, "seed": 9,
        "max_tokens": 48, "temperature": 0.8,
    });
    let full = post(addr, PATH, &long).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "need a longer completion: {full:?}");
    let stop: String = chars[8..11].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];
    let mut stopped = long.clone();
    stopped["stop"] = json!(["never-in-output-zzz", stop]);
    let r = post(addr, PATH, &stopped).json();
    assert_eq!(r["choices"][0]["text"], expected, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    stopped["stream"] = json!(true);
    let (text, finish, _) = fold_stream(&post(addr, PATH, &stopped));
    assert_eq!(text, expected);
    assert_eq!(finish.as_deref(), Some("stop"));
}

#[test]
fn completions_validation_errors() {
    let router = start_router(
        &["--model-dir", &model_arg(), "--max-model-len", "256"],
        true,
    );
    let addr = router.addr("http");
    let with = |extra: Value| {
        let mut body = json!({"model": "deepseek-v4-flash", "prompt": "Hi", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(addr, PATH, &body)
    };
    let cases = [
        (json!({"prompt": ["a", "b"]}), Some("prompt")),
        (json!({"prompt": [[1, 2], [3]]}), Some("prompt")),
        (json!({"prompt": null}), Some("prompt")),
        (json!({"prompt": 5}), Some("prompt")),
        (json!({"prompt": ""}), Some("prompt")),
        (json!({"prompt": [1, 999_999_999]}), Some("prompt")),
        (json!({"model": "gpt-4"}), Some("model")),
        (json!({"temperature": 3}), Some("temperature")),
        (json!({"temperature": "hot"}), Some("temperature")),
        (json!({"top_p": 0}), Some("top_p")),
        (json!({"seed": -1}), Some("seed")),
        (json!({"max_tokens": 0}), Some("max_tokens")),
        (json!({"max_tokens": 10_000}), Some("max_tokens")),
        (json!({"n": 2}), Some("n")),
        (json!({"stop": 5}), Some("stop")),
        (json!({"stop": [""]}), Some("stop")),
        (json!({"stream": "yes"}), Some("stream")),
        (json!({"logprobs": 2}), Some("logprobs")),
        (json!({"logprobs": 99}), Some("logprobs")),
        (json!({"echo": true}), Some("echo")),
    ];
    for (extra, param) in cases {
        expect_error(&with(extra.clone()), 400, param);
    }
    let long_prompt = "word ".repeat(400);
    expect_error(&with(json!({"prompt": long_prompt})), 400, Some("prompt"));
    expect_error(&http(addr, "POST", PATH, &[], b"{not json", T), 400, None);
    // Still serving.
    assert_eq!(with(json!({})).status, 200);
}

#[test]
fn completions_without_model_is_unavailable() {
    let router = start_router(&[], false);
    let addr = router.addr("http");
    let r = post(
        addr,
        PATH,
        &json!({"model": "deepseek-v4-flash", "prompt": "Hi"}),
    );
    expect_error(&r, 503, None);
}
