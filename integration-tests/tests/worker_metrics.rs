//! Each worker's own `/metrics` (on `--metrics-listen`), read while a disaggregated cluster
//! serves: `n: 3` computes its prompt once on the prefill worker (the other two choices take
//! it from the prefix cache, computing only its last partial page) and decodes three times.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    http,
    pd::{post, router_over, worker},
};
use serde_json::json;

/// The value of `name{role="<role>"}` on a worker's /metrics.
fn metric(addr: SocketAddr, role: &str, name: &str) -> u64 {
    let r = http(addr, "GET", "/metrics", &[], b"", Duration::from_secs(10));
    assert_eq!(r.status, 200, "{}", r.body);
    let key = format!("{name}{{role=\"{role}\"}} ");
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("{key} missing from:\n{}", r.body))
        .parse()
        .unwrap()
}

/// Waits (bounded) until `name` has grown by `by` from `from`, and says by how much it grew.
fn grown(addr: SocketAddr, role: &str, name: &str, from: u64, by: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = metric(addr, role, name) - from;
        if now >= by || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn three_choices_compute_the_prompt_once() {
    let metrics = ["--metrics-listen", "127.0.0.1:0"];
    let prefill = worker("pdserve-prefill", &metrics);
    let decode = worker("pdserve-decode", &metrics);
    let router = router_over(&decode, &prefill, &[]);
    let (p, d) = (prefill.addr("metrics"), decode.addr("metrics"));
    let names = [
        "pdserve_engine_prompt_tokens_computed_total",
        "pdserve_engine_prompt_tokens_cached_total",
        "pdserve_engine_prompts_total",
        "pdserve_engine_state_transfers_total",
    ];
    let before: Vec<u64> = names.iter().map(|n| metric(p, "prefill", n)).collect();
    let decoded = metric(d, "decode", "pdserve_engine_decode_tokens_total");
    // 150 prompt tokens at 64 per page: 2 full pages cached after the first choice.
    let prompt: Vec<u32> = (1000..1150).collect();
    let r = post(
        router.addr("http"),
        "/v1/completions",
        &json!({"model": "deepseek-v4-flash", "prompt": prompt, "n": 3, "max_tokens": 4,
            "ignore_eos": true, "temperature": 1.0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 150, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    let want = [150 + 2 * 22, 2 * 128, 3, 3];
    for ((name, from), by) in names.iter().zip(&before).zip(want) {
        assert_eq!(grown(p, "prefill", name, *from, by), by, "{name}");
    }
    // Each choice's first token came from the prefill; its other three were decoded.
    assert_eq!(
        grown(
            d,
            "decode",
            "pdserve_engine_decode_tokens_total",
            decoded,
            9
        ),
        9
    );
    assert!(metric(d, "decode", "pdserve_engine_steps_total") > 0);
}
