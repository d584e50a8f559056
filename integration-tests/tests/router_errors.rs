//! The router's API errors: OpenAI error objects with the right status and `param`.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{net::SocketAddr, time::Duration};

use integration_tests::{HttpResponse, http, start_router, tiny_model_dir};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> HttpResponse {
    http(addr, "POST", path, &[], body, T)
}

/// Asserts an OpenAI error object with `status` and `param`; returns the message.
fn expect_error(r: &HttpResponse, status: u16, param: Option<&str>) -> String {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json();
    let obj = e["error"].as_object().unwrap_or_else(|| panic!("{e}"));
    for key in ["message", "type", "param", "code"] {
        assert!(obj.contains_key(key), "{key} missing in {e}");
    }
    assert_eq!(e["error"]["param"].as_str(), param, "{e}");
    e["error"]["message"].as_str().unwrap().to_owned()
}

fn chat(extra: &Value) -> Vec<u8> {
    let mut body = json!({
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string().into_bytes()
}

#[test]
fn router_chat_validation_errors() {
    let model = tiny_model_dir().display().to_string();
    let router = start_router(
        &[
            "--model-dir",
            &model,
            "--max-model-len",
            "256",
            "--max-body-bytes",
            "4096",
        ],
        true,
    );
    let addr = router.addr("http");
    let path = "/v1/chat/completions";

    expect_error(&post_raw(addr, path, b"{not json"), 400, None);
    expect_error(&post_raw(addr, path, b"[1, 2]"), 400, None);
    let m = expect_error(
        &post_raw(addr, path, &chat(&json!({"model": "gpt-4"}))),
        400,
        Some("model"),
    );
    assert!(m.contains("deepseek-v4-flash"), "{m}");
    expect_error(
        &post_raw(addr, path, &chat(&json!({"model": 7}))),
        400,
        Some("model"),
    );
    expect_error(
        &post_raw(addr, path, &chat(&json!({"messages": []}))),
        400,
        Some("messages"),
    );
    expect_error(
        &post_raw(addr, path, &chat(&json!({"messages": "hi"}))),
        400,
        Some("messages"),
    );
    for (param, value) in [
        ("temperature", json!("hot")),
        ("temperature", json!(2.5)),
        ("temperature", json!(-1)),
        ("top_p", json!(0)),
        ("top_p", json!(1.5)),
        ("max_tokens", json!(0)),
        ("max_tokens", json!(-3)),
        ("max_tokens", json!("many")),
        ("n", json!(17)),
        ("n", json!(0)),
        ("presence_penalty", json!(3)),
        ("frequency_penalty", json!(-2.5)),
        ("top_logprobs", json!(21)),
        ("seed", json!(-1)),
        ("top_k", json!(-2)),
        ("min_p", json!(1.5)),
        ("repetition_penalty", json!(0)),
        ("reasoning_effort", json!("medium")),
        ("reasoning_effort", json!(3)),
        ("stream", json!("yes")),
    ] {
        let r = post_raw(addr, path, &chat(&json!({ param: value })));
        expect_error(&r, 400, Some(param));
    }
    // max_tokens beyond the context, and a prompt longer than the context.
    let m = expect_error(
        &post_raw(addr, path, &chat(&json!({"max_tokens": 100_000}))),
        400,
        Some("max_tokens"),
    );
    assert!(m.contains("maximum context length is 256"), "{m}");
    let long = "word ".repeat(400);
    let r = post_raw(
        addr,
        path,
        &chat(&json!({"messages": [{"role": "user", "content": long}], "max_tokens": null})),
    );
    expect_error(&r, 400, Some("messages"));
    // Oversized body: 413 with an OpenAI error object.
    let big = "x".repeat(8192);
    let r = post_raw(
        addr,
        path,
        &chat(&json!({"messages": [{"role": "user", "content": big}]})),
    );
    expect_error(&r, 413, None);
    // Unknown route: 404 error object.
    expect_error(&http(addr, "GET", "/v1/nothing", &[], b"", T), 404, None);
    // Tokenize errors.
    expect_error(
        &post_raw(addr, "/tokenize", br#"{"model": "nope", "prompt": "x"}"#),
        400,
        Some("model"),
    );
    expect_error(
        &post_raw(addr, "/tokenize", br#"{"prompt": 5}"#),
        400,
        Some("prompt"),
    );
    expect_error(
        &post_raw(addr, "/detokenize", br#"{"tokens": "abc"}"#),
        400,
        Some("tokens"),
    );
    // The router still serves after all of that.
    let ok = post_raw(addr, path, &chat(&json!({})));
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[test]
fn router_api_keys() {
    let model = tiny_model_dir().display().to_string();
    let router = start_router(
        &["--model-dir", &model, "--api-key", "k1", "--api-key", "k2"],
        true,
    );
    let addr = router.addr("http");
    let body = chat(&json!({}));
    let path = "/v1/chat/completions";
    expect_error(&http(addr, "POST", path, &[], &body, T), 401, None);
    let wrong = [("Authorization", "Bearer nope")];
    expect_error(&http(addr, "POST", path, &wrong, &body, T), 401, None);
    expect_error(&http(addr, "GET", "/v1/models", &[], b"", T), 401, None);
    let right = [("Authorization", "Bearer k2")];
    assert_eq!(http(addr, "POST", path, &right, &body, T).status, 200);
    assert_eq!(http(addr, "GET", "/v1/models", &right, b"", T).status, 200);
    // Health needs no key.
    assert_eq!(http(addr, "GET", "/health", &[], b"", T).status, 200);
    assert_eq!(http(addr, "GET", "/health/ready", &[], b"", T).status, 200);
}

/// `max_concurrent_per_key`: a key at its limit gets 429 (an OpenAI error object) while its
/// stream runs, other keys are served, and the slot comes back when the stream's client goes.
#[test]
fn router_limits_requests_in_flight_per_key() {
    use std::io::{Read, Write};
    let model = tiny_model_dir().display().to_string();
    let router = start_router(
        &[
            "--model-dir",
            &model,
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--max-concurrent-per-key",
            "1",
        ],
        true,
    );
    let addr = router.addr("http");
    let path = "/v1/chat/completions";
    // A stream far larger than the socket buffers, not read: it stays in flight.
    let long = chat(&json!({"stream": true, "max_tokens": 3000, "reasoning_effort": "none"}));
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    write!(
        conn,
        "POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        long.len()
    )
    .unwrap();
    conn.write_all(&long).unwrap();
    let mut first = [0u8; 64];
    conn.set_read_timeout(Some(T)).unwrap();
    let n = conn.read(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    let body = chat(&json!({}));
    let k1 = [("Authorization", "Bearer k1")];
    let k2 = [("Authorization", "Bearer k2")];
    let r = http(addr, "POST", path, &k1, &body, T);
    let m = expect_error(&r, 429, None);
    assert!(m.contains("in flight"), "{m}");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(http(addr, "POST", path, &k2, &body, T).status, 200);
    // The client goes away: its slot is freed (bounded wait).
    drop(conn);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = http(addr, "POST", path, &k1, &body, T);
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429, "{}", r.body);
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was not freed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn router_not_ready_without_model() {
    let router = start_router(&[], false);
    let addr = router.addr("http");
    assert_eq!(http(addr, "GET", "/health", &[], b"", T).status, 200);
    expect_error(&http(addr, "GET", "/health/ready", &[], b"", T), 503, None);
    expect_error(
        &post_raw(addr, "/v1/chat/completions", &chat(&json!({}))),
        503,
        None,
    );
}

#[test]
fn router_client_disconnect_keeps_serving() {
    use std::io::{Read, Write};
    let model = tiny_model_dir().display().to_string();
    // A pool of 8 pages x 64 tokens: one request reserving most of it blocks the next one
    // until it ends, so the second request finishing quickly shows the first was cancelled.
    let router = start_router(&["--model-dir", &model, "--engine-num-pages", "8"], true);
    let addr = router.addr("http");
    let body = chat(&json!({"max_tokens": 400, "stream": true, "thinking": {"type": "disabled"}}));
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    let mut buf = [0_u8; 2048];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200"));
    drop(s);
    // The same-size request must be admitted: it can only be once the first is gone.
    let start = std::time::Instant::now();
    let r = post_raw(
        addr,
        "/v1/chat/completions",
        &chat(&json!({"max_tokens": 400, "thinking": {"type": "disabled"}})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(start.elapsed() < T);
}
