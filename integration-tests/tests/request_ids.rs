//! `X-Request-Id` through a disaggregated cluster: the client's id (or one minted for it) comes
//! back in the response header and the response `id`, and both workers' log lines about the
//! request carry it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::Duration;

use integration_tests::{
    Service, http,
    pd::{chat, router_over, worker_command},
};

/// A worker that logs at info level (its lines about each request are what is checked).
fn worker(binary: &str) -> Service {
    let mut cmd = worker_command(binary, &["--page-size", "16"]);
    cmd.env("PDSERVE_LOG", "info");
    Service::start(cmd)
}

#[test]
fn the_request_id_is_echoed_used_and_logged_by_both_workers() {
    let decode = worker("pdserve-decode");
    let prefill = worker("pdserve-prefill");
    let router = router_over(&decode, &prefill, &[]);
    let addr = router.addr("http");
    let body = serde_json::to_vec(&chat(5, 1, 0.0, 4)).unwrap();
    let post = |headers: &[(&str, &str)], path: &str| {
        http(addr, "POST", path, headers, &body, Duration::from_secs(60))
    };

    let r = post(&[("X-Request-Id", "client-req-42")], "/v1/chat/completions");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-request-id"), Some("client-req-42"));
    assert_eq!(r.json()["id"], "chatcmpl-client-req-42");
    // Both workers' lines about it name it (logged when each leg ends).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (mut p, mut d) = (String::new(), String::new());
    while std::time::Instant::now() < deadline {
        p.push_str(&prefill.stderr());
        d.push_str(&decode.stderr());
        if p.contains("client-req-42") && d.contains("generation ended") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mentions = |log: &str, what: &str| {
        log.lines()
            .any(|l| l.contains("client-req-42") && l.contains(what))
    };
    assert!(
        mentions(&p, "prefilled and handed over"),
        "prefill log:\n{p}"
    );
    assert!(mentions(&d, "reserved pages"), "decode log:\n{d}");
    assert!(mentions(&d, "generation ended"), "decode log:\n{d}");

    // Without one, an id is minted, echoed and used.
    let r = post(&[], "/v1/completions");
    let minted = r.header("x-request-id").expect("minted").to_owned();
    assert_eq!(minted.len(), 32, "{minted}");
    // (the chat body is not a completions request: the 400 still carries the id)
    assert_eq!(r.status, 400, "{}", r.body);
    let r = post(&[], "/v1/chat/completions");
    let minted = r.header("x-request-id").expect("minted").to_owned();
    assert_eq!(r.json()["id"], format!("chatcmpl-{minted}"));

    // An id that could not be carried unchanged is refused.
    let r = post(&[("X-Request-Id", "has space")], "/v1/chat/completions");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("X-Request-Id"), "{}", r.body);
}
