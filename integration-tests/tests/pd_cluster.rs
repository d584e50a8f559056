//! The disaggregated cluster against the one-process engine: the real router, prefill and
//! decode binaries on loopback (state moving over the TCP transport) must answer exactly what
//! the router's in-process engine answers, token for token and logprob for logprob, for
//! prompts of many lengths (not multiples of the compression ratios 4 and 128, longer than the
//! sliding window, long enough for the indexer's top-k) and under concurrency.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{net::SocketAddr, time::Duration};

use integration_tests::{HttpResponse, Service, command, http, start_router, tiny_model_dir};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(120);

fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

fn worker(binary: &str, extra: &[&str]) -> Service {
    let mut cmd = command(binary);
    cmd.args(["--grpc-listen", "127.0.0.1:0", "--model-dir", &model_arg()])
        .args(extra);
    Service::start(cmd)
}

/// Prefill and decode workers and a router in front of them.
struct Cluster {
    router: Service,
    _workers: Vec<Service>,
}

fn cluster(prefill: usize, decode: usize) -> Cluster {
    let mut workers = Vec::new();
    let mut args = vec!["--model-dir".to_owned(), model_arg()];
    for _ in 0..decode {
        let w = worker("pdserve-decode", &["--page-size", "16"]);
        args.push("--decode-worker".to_owned());
        args.push(w.addr("grpc").to_string());
        workers.push(w);
    }
    for _ in 0..prefill {
        let w = worker("pdserve-prefill", &["--page-size", "16"]);
        args.push("--prefill-worker".to_owned());
        args.push(w.addr("grpc").to_string());
        workers.push(w);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Cluster {
        router: start_router(&args, true),
        _workers: workers,
    }
}

/// A chat request whose rendered prompt grows with `words`.
fn chat(words: usize, seed: u64, temperature: f64, max_tokens: u32) -> Value {
    let text: Vec<String> = (0..words)
        .map(|i| format!("w{}", (i * 7919) % 1009))
        .collect();
    json!({
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": text.join(" ")}],
        "chat_template_kwargs": {"thinking": false},
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "logprobs": true,
        "top_logprobs": 3,
    })
}

/// The parts of a chat answer that must match exactly.
fn essence(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    json!({
        "message": v["choices"][0]["message"],
        "logprobs": v["choices"][0]["logprobs"],
        "finish": v["choices"][0]["finish_reason"],
        "usage": v["usage"],
    })
}

#[test]
fn cluster_equals_single_process_engine_for_many_prompt_lengths() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let cluster = cluster(1, 1);
    let (a, b) = (local.addr("http"), cluster.router.addr("http"));
    let mut lengths = Vec::new();
    for (i, words) in [0usize, 1, 3, 9, 30, 61, 62, 130, 250, 400]
        .into_iter()
        .enumerate()
    {
        let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
        let body = chat(words, 100 + i as u64, temperature, 12);
        let want = essence(&post(a, "/v1/chat/completions", &body));
        let got = essence(&post(b, "/v1/chat/completions", &body));
        assert_eq!(got, want, "{words} words");
        lengths.push(want["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    // The prompts really cover the awkward cases.
    assert!(
        lengths.iter().any(|&n| n % 4 != 0 && n > 128),
        "{lengths:?}"
    );
    assert!(lengths.iter().any(|&n| n > 256), "{lengths:?}");
    assert!(lengths.iter().any(|&n| n < 16), "{lengths:?}");

    // Streaming through the cluster gives the same text.
    let mut body = chat(45, 7, 0.7, 10);
    let want = post(a, "/v1/chat/completions", &body).json();
    body["stream"] = json!(true);
    let (content, _, finish, _) =
        integration_tests::fold_chat_stream(&post(b, "/v1/chat/completions", &body));
    assert_eq!(content, want["choices"][0]["message"]["content"]);
    assert_eq!(
        finish.as_deref(),
        want["choices"][0]["finish_reason"].as_str()
    );
}

#[test]
fn concurrent_mixed_requests_each_equal_their_solo_answer() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let cluster = cluster(2, 2);
    let (a, b) = (local.addr("http"), cluster.router.addr("http"));
    let bodies: Vec<Value> = (0..32u64)
        .map(|i| {
            let words = [2usize, 40, 90, 7, 140, 23][(i % 6) as usize] + i as usize;
            let temperature = if i % 3 == 0 { 0.0 } else { 0.8 };
            chat(words, 1000 + i, temperature, 4 + (i % 5) as u32)
        })
        .collect();
    let solo: Vec<Value> = bodies
        .iter()
        .map(|body| essence(&post(a, "/v1/chat/completions", body)))
        .collect();
    let answers: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| s.spawn(move || essence(&post(b, "/v1/chat/completions", body))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in answers.iter().zip(&solo).enumerate() {
        assert_eq!(got, want, "request {i}");
    }
}

#[test]
fn mismatched_layouts_refuse_to_pair_with_a_clear_error() {
    // The decode worker pages by 16 tokens, the prefill worker by 64: the handshake must
    // refuse, and the client gets an error naming the difference, not an answer.
    let decode = worker("pdserve-decode", &["--page-size", "16"]);
    let prefill = worker("pdserve-prefill", &["--page-size", "64"]);
    let router = start_router(
        &[
            "--model-dir",
            &model_arg(),
            "--decode-worker",
            &decode.addr("grpc").to_string(),
            "--prefill-worker",
            &prefill.addr("grpc").to_string(),
        ],
        true,
    );
    let r = post(
        router.addr("http"),
        "/v1/chat/completions",
        &chat(5, 1, 0.0, 3),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("page_size_tokens"), "{message}");
}
