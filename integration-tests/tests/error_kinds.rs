//! A worker's error kind reaches the client as its own status, OpenAI `type` and `code`,
//! through real processes: the kind is made by a real worker, carried across gRPC, and mapped
//! once by the router. The body says which worker side failed and why, and carries neither the
//! prompt nor a worker's id.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use integration_tests::{
    HttpResponse, Service,
    pd::{chat, cluster_full, post, router_over, worker, worker_command},
};
use serde_json::Value;

const CHAT: &str = "/v1/chat/completions";

/// The status, `type` and `code` of an error answer; panics on a success.
fn error_of(r: &HttpResponse) -> (u16, String, String, String) {
    let body: Value = r.json();
    let e = &body["error"];
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    (r.status, s(&e["type"]), s(&e["code"]), s(&e["message"]))
}

/// Checks that an error message says where it came from and leaks nothing of the request or
/// the workers' identities (ids are `prefill-<uuid>` / `decode-<uuid>`).
fn clean(message: &str, prompt: &str) {
    assert!(message.contains("worker"), "{message}");
    assert!(!message.contains(prompt), "the prompt leaked: {message}");
    for role in ["prefill-", "decode-"] {
        for (at, _) in message.match_indices(role) {
            let id = &message[at + role.len()..];
            let uuid_like = id.len() >= 9
                && id[..8].chars().all(|c| c.is_ascii_hexdigit())
                && id[8..].starts_with('-');
            assert!(!uuid_like, "a worker id leaked: {message}");
        }
    }
}

/// LAYOUT_MISMATCH from the decode worker's handshake: 503 `layout_mismatch`. The decode
/// worker pages by 16 tokens, the prefill worker by 64: the handshake refuses, and the client
/// gets an error naming the difference, not an answer.
#[test]
fn layout_mismatch_is_503_layout_mismatch() {
    let decode = worker("pdserve-decode", &["--page-size", "16"]);
    let prefill = worker("pdserve-prefill", &["--page-size", "64"]);
    let router = router_over(&decode, &prefill, &[]);
    let body = chat(5, 1, 0.0, 3);
    let (status, kind, code, message) = error_of(&post(router.addr("http"), CHAT, &body));
    assert_eq!(
        (status, kind.as_str(), code.as_str()),
        (503, "service_unavailable_error", "layout_mismatch"),
        "{message}"
    );
    assert!(message.contains("page_size_tokens"), "{message}");
    let prompt = body["messages"][0]["content"].as_str().unwrap();
    clean(&message, prompt);
}

/// OVERLOADED from a decode worker with no room and no queueing: 503 `overloaded`, while the
/// requests that got room succeed.
#[test]
fn a_full_decode_worker_is_503_overloaded() {
    let cluster = cluster_full(1, 1, &["--queue-timeout-ms", "0"], &["--max-running", "1"]);
    let router = cluster.router.addr("http");
    let answers: Vec<(HttpResponse, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|i| {
                s.spawn(move || {
                    let body = chat(10 + i, 1, 0.0, 64);
                    let prompt = body["messages"][0]["content"].as_str().unwrap().to_owned();
                    (post(router, CHAT, &body), prompt)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(answers.iter().any(|(r, _)| r.status == 200));
    let refused: Vec<_> = answers.iter().filter(|(r, _)| r.status != 200).collect();
    assert!(!refused.is_empty(), "without a queue some are refused");
    for (r, prompt) in refused {
        let (status, kind, code, message) = error_of(r);
        assert_eq!(
            (status, kind.as_str(), code.as_str()),
            (503, "service_unavailable_error", "overloaded"),
            "{message}"
        );
        clean(&message, prompt);
    }
}

/// TRANSFER_FAILED from a checksum mismatch (a prefill worker that flips a byte of what it
/// sends, a router that asks for checksums): 502 `state_transfer_failed`.
#[test]
fn corrupted_state_is_502_state_transfer_failed() {
    let decode = worker("pdserve-decode", &["--page-size", "16"]);
    let mut cmd = worker_command("pdserve-prefill", &["--page-size", "16"]);
    cmd.env("PDSERVE_INJECT_FAULT", "flip-page-byte");
    let prefill = Service::start(cmd);
    let router = router_over(&decode, &prefill, &["--transfer-checksums", "true"]);
    let body = chat(40, 1, 0.0, 4);
    let (status, kind, code, message) = error_of(&post(router.addr("http"), CHAT, &body));
    assert_eq!(
        (status, kind.as_str(), code.as_str()),
        (502, "internal_error", "state_transfer_failed"),
        "{message}"
    );
    assert!(message.contains("checksum"), "{message}");
    let prompt = body["messages"][0]["content"].as_str().unwrap();
    clean(&message, prompt);
}
