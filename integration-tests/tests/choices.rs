//! `n` > 1 end to end on the real `pdserve-router` binary with the in-process engine: every
//! choice equals the single-choice request with its own seed (the request's seed + its
//! index), streamed choices equal the non-streamed ones, and usage counts the prompt once and
//! every choice's completion.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use integration_tests::{HttpResponse, http, start_router, tiny_model_dir};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

/// An SSE stream's chunks (without `[DONE]`, which must end it).
fn chunks(r: &HttpResponse) -> Vec<Value> {
    assert_eq!(r.status, 200, "{}", r.body);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Per choice index: its text and finish reason.
type Folded = BTreeMap<u64, (String, Option<String>)>;

/// Per choice index, the concatenation of `field(choice)` over a stream's chunks and the
/// finish reason; and the usage chunks.
fn fold(chunks: &[Value], field: impl Fn(&Value) -> Option<&str>) -> (Folded, Vec<Value>) {
    let mut choices = Folded::new();
    let mut usages = Vec::new();
    for c in chunks {
        for choice in c["choices"].as_array().unwrap() {
            let entry = choices
                .entry(choice["index"].as_u64().unwrap())
                .or_default();
            if let Some(s) = field(choice) {
                entry.0.push_str(s);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                entry.1 = Some(f.to_owned());
            }
        }
        if c["usage"].is_object() {
            usages.push(c["usage"].clone());
        }
    }
    (choices, usages)
}

fn expect_400(r: &HttpResponse, param: &str) {
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
}

#[test]
fn completions_choices_are_the_seeded_single_requests() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let path = "/v1/completions";
    let body = |n: u64, seed: u64| {
        json!({"model": "deepseek-v4-flash", "prompt": "Once upon a time, ünïcødé",
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": n})
    };
    let all = post(addr, path, &body(3, 5));
    assert_eq!(all.status, 200, "{}", all.body);
    let all = all.json();
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{all}");
    let mut completion = 0;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{all}");
        let one = post(addr, path, &body(1, 5 + i as u64)).json();
        assert_eq!(one["choices"][0]["text"], choice["text"], "choice {i}");
        assert_eq!(
            one["choices"][0]["finish_reason"], choice["finish_reason"],
            "choice {i}"
        );
        assert_eq!(one["usage"]["prompt_tokens"], all["usage"]["prompt_tokens"]);
        completion += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(all["usage"]["completion_tokens"], completion, "{all}");
    assert_eq!(
        all["usage"]["total_tokens"].as_u64().unwrap(),
        all["usage"]["prompt_tokens"].as_u64().unwrap() + completion
    );
    assert!(
        choices[0]["text"] != choices[1]["text"] || choices[1]["text"] != choices[2]["text"],
        "different seeds gave three equal choices: {all}"
    );

    let mut streamed = body(3, 5);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chunks(&post(addr, path, &streamed));
    let (folded, usages) = fold(&chunks, |c| c["text"].as_str());
    assert_eq!(folded.len(), 3);
    for (i, choice) in choices.iter().enumerate() {
        let (text, finish) = &folded[&(i as u64)];
        assert_eq!(text, choice["text"].as_str().unwrap(), "choice {i}");
        assert_eq!(finish.as_deref(), choice["finish_reason"].as_str());
    }
    assert_eq!(
        usages,
        vec![all["usage"].clone()],
        "one usage, the request's"
    );

    expect_400(&post(addr, path, &body(17, 1)), "n");
    expect_400(&post(addr, path, &body(0, 1)), "n");
    let mut best_of = body(2, 1);
    best_of["best_of"] = json!(3);
    expect_400(&post(addr, path, &best_of), "best_of");
    best_of["best_of"] = json!(2);
    assert_eq!(post(addr, path, &best_of).status, 200);
}

#[test]
fn chat_choices_are_the_seeded_single_requests() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let path = "/v1/chat/completions";
    let body = |n: u64, seed: u64| {
        json!({"model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": "Say something about 你好"}],
            "thinking": {"type": "disabled"},
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": n})
    };
    let all = post(addr, path, &body(3, 11));
    assert_eq!(all.status, 200, "{}", all.body);
    let all = all.json();
    assert_eq!(all["object"], "chat.completion");
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{all}");
    let mut completion = 0;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{all}");
        let one = post(addr, path, &body(1, 11 + i as u64)).json();
        assert_eq!(
            one["choices"][0]["message"], choice["message"],
            "choice {i}"
        );
        assert_eq!(
            one["choices"][0]["finish_reason"], choice["finish_reason"],
            "choice {i}"
        );
        completion += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(all["usage"]["completion_tokens"], completion, "{all}");
    assert_eq!(
        all["usage"]["total_tokens"].as_u64().unwrap(),
        all["usage"]["prompt_tokens"].as_u64().unwrap() + completion
    );

    let mut streamed = body(3, 11);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chunks(&post(addr, path, &streamed));
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let (folded, usages) = fold(&chunks, |c| c["delta"]["content"].as_str());
    assert_eq!(folded.len(), 3);
    for (i, choice) in choices.iter().enumerate() {
        let (text, finish) = &folded[&(i as u64)];
        let content = choice["message"]["content"].as_str().unwrap_or_default();
        assert_eq!(text, content, "choice {i}");
        assert_eq!(finish.as_deref(), choice["finish_reason"].as_str());
    }
    assert_eq!(
        usages,
        vec![all["usage"].clone()],
        "one usage, the request's"
    );

    expect_400(&post(addr, path, &body(17, 1)), "n");
    let mut best_of = body(2, 1);
    best_of["best_of"] = json!(1);
    expect_400(&post(addr, path, &best_of), "best_of");
}

#[test]
fn chat_lists_prompt_and_output_token_ids() {
    let router = start_router(&["--model-dir", &model_arg()], true);
    let addr = router.addr("http");
    let path = "/v1/chat/completions";
    let messages = json!([{"role": "user", "content": "List the ids, ünïcødé"}]);
    let body = |n: u64, seed: u64| {
        json!({"model": "deepseek-v4-flash", "messages": messages,
            "thinking": {"type": "disabled"}, "return_token_ids": true, "ignore_eos": true,
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": n})
    };
    let prompt = post(
        addr,
        "/tokenize",
        &json!({"model": "deepseek-v4-flash", "messages": messages,
            "thinking": {"type": "disabled"}}),
    )
    .json()["tokens"]
        .clone();
    let one = post(addr, path, &body(1, 8));
    assert_eq!(one.status, 200, "{}", one.body);
    let one = one.json();
    assert_eq!(one["prompt_token_ids"], prompt, "{one}");
    let ids = one["choices"][0]["token_ids"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 12, "{one}");
    assert_eq!(one["usage"]["completion_tokens"], 12);

    let mut streamed = body(1, 8);
    streamed["stream"] = json!(true);
    let chunks = chunks(&post(addr, path, &streamed));
    assert_eq!(chunks[0]["prompt_token_ids"], prompt);
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c.get("prompt_token_ids").is_none())
    );
    let listed: Vec<Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap().clone())
        .flat_map(|choice| choice["token_ids"].as_array().unwrap().clone())
        .collect();
    assert_eq!(listed, ids, "the stream lists the same ids");

    let two = post(addr, path, &body(2, 7)).json();
    assert_eq!(two["prompt_token_ids"], prompt);
    assert_eq!(
        two["choices"][1]["token_ids"],
        json!(ids),
        "choice 1 is seed 8"
    );

    // Without return_token_ids, no ids; the eos that ends a request is counted, not listed.
    let mut eos = body(1, 1);
    eos["ignore_eos"] = json!(false);
    eos["logit_bias"] = json!({"1": 100});
    let r = post(addr, path, &eos).json();
    assert_eq!(r["choices"][0]["token_ids"], json!([]), "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 1);
    eos["return_token_ids"] = json!(false);
    let r = post(addr, path, &eos).json();
    assert!(r.get("prompt_token_ids").is_none(), "{r}");
    assert!(r["choices"][0].get("token_ids").is_none(), "{r}");
    eos["return_token_ids"] = json!("yes");
    expect_400(&post(addr, path, &eos), "return_token_ids");
}
