//! `GET /metrics`: Prometheus text after real chat and completions requests.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{collections::BTreeMap, time::Duration};

use integration_tests::{http, start_router, tiny_model_dir};
use serde_json::json;

const T: Duration = Duration::from_secs(120);

/// The documented metric names (router/src/metrics.rs, deploy/OPERATIONS.md) and their types.
const DOCUMENTED: [(&str, &str); 33] = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:prefix_cache_queries_total", "counter"),
    ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("pdserve_requests_total", "counter"),
    ("pdserve_request_duration_seconds", "histogram"),
    ("pdserve_time_to_first_token_seconds", "histogram"),
    ("pdserve_inter_token_latency_seconds", "histogram"),
    ("pdserve_generated_tokens_total", "counter"),
    ("pdserve_prompt_tokens_total", "counter"),
    ("pdserve_running_requests", "gauge"),
    ("pdserve_queued_requests", "gauge"),
    ("pdserve_errors_total", "counter"),
    ("pdserve_transfers_total", "counter"),
    ("pdserve_transfer_bytes_total", "counter"),
    ("pdserve_transfer_seconds_total", "counter"),
    ("pdserve_transfer_exposed_seconds_total", "counter"),
    ("pdserve_prefill_retries_total", "counter"),
    ("pdserve_workers", "gauge"),
    ("pdserve_worker_running_requests", "gauge"),
    ("pdserve_worker_queued_requests", "gauge"),
    ("pdserve_worker_pages_total", "gauge"),
    ("pdserve_worker_pages_used", "gauge"),
    ("pdserve_worker_pages_cached", "gauge"),
    ("pdserve_worker_reservations", "gauge"),
    ("pdserve_build_info", "gauge"),
    ("pdserve_model_info", "gauge"),
];

/// Names that have samples only when a disaggregated cluster is attached.
const PER_WORKER: [&str; 6] = [
    "pdserve_worker_running_requests",
    "pdserve_worker_queued_requests",
    "pdserve_worker_pages_total",
    "pdserve_worker_pages_used",
    "pdserve_worker_pages_cached",
    "pdserve_worker_reservations",
];

/// One sample: metric name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses the exposition format line by line, failing on any line it does not understand.
fn parse(text: &str) -> (BTreeMap<String, String>, Vec<Sample>) {
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(valid_name(name), "{line}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            types.insert(name.to_owned(), kind.to_owned());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            assert!(valid_name(rest.split(' ').next().unwrap()), "{line}");
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment: {line}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("{line}"));
                let labels = body
                    .split(',')
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{line}"));
                        assert!(valid_name(k), "{line}");
                        let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"'));
                        (
                            k.to_owned(),
                            v.unwrap_or_else(|| panic!("{line}")).to_owned(),
                        )
                    })
                    .collect();
                (name, labels)
            }
        };
        assert!(valid_name(name), "{line}");
        samples.push((name.to_owned(), labels, value));
    }
    (types, samples)
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && l.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(v))
        })
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
        .2
}

#[test]
fn router_metrics_after_chat_and_completion() {
    let model = tiny_model_dir().display().to_string();
    let router = start_router(&["--model-dir", &model], true);
    let addr = router.addr("http");
    let post = |path: &str, body: serde_json::Value| {
        http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
    };
    let chat = post(
        "/v1/chat/completions",
        json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "seed": 1,
        }),
    );
    assert_eq!(chat.status, 200, "{}", chat.body);
    let completion = post(
        "/v1/completions",
        json!({
            "model": "deepseek-v4-flash", "prompt": "Hello there", "max_tokens": 6,
            "seed": 1, "stream": true,
        }),
    );
    assert_eq!(completion.status, 200, "{}", completion.body);
    assert_eq!(completion.sse_data().last().unwrap(), "[DONE]");
    // A client error, whose user-chosen model name must not become a label.
    let bad = post(
        "/v1/completions",
        json!({"model": "evil\"name", "prompt": "x"}),
    );
    assert_eq!(bad.status, 400);

    let r = http(addr, "GET", "/metrics", &[], b"", T);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    assert!(!r.body.contains("evil"), "user input in a label");
    let (types, samples) = parse(&r.body);
    for (name, kind) in DOCUMENTED {
        assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        assert!(
            PER_WORKER.contains(&name)
                || name == "vllm:kv_cache_usage_perc"
                || samples.iter().any(|(n, ..)| n.starts_with(name)),
            "no sample of {name}"
        );
    }
    // Every sample belongs to a documented name.
    for (n, ..) in &samples {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .fold(n.as_str(), |n, suffix| n.strip_suffix(suffix).unwrap_or(n));
        assert!(
            DOCUMENTED.iter().any(|(d, _)| *d == base || *d == n),
            "undocumented metric {n}"
        );
    }
    let errors = |kind| value(&samples, "pdserve_errors_total", &[("kind", kind)]);
    assert!((errors("unknown_model") - 1.0).abs() < f64::EPSILON);
    assert!(errors("internal").abs() < f64::EPSILON);
    assert!(
        (value(
            &samples,
            "pdserve_model_info",
            &[("model", "deepseek-v4-flash")]
        ) - 1.0)
            .abs()
            < f64::EPSILON
    );
    // The stream of 6 tokens has 5 gaps (the engine may batch several tokens per event).
    let gaps = value(
        &samples,
        "pdserve_inter_token_latency_seconds_count",
        &[("endpoint", "completions")],
    );
    assert!((1.0..=5.0).contains(&gaps), "{gaps}");
    let requests = "pdserve_requests_total";
    let success = |endpoint| {
        value(
            &samples,
            requests,
            &[("endpoint", endpoint), ("outcome", "success")],
        )
    };
    assert!((success("chat_completions") - 1.0).abs() < f64::EPSILON);
    assert!((success("completions") - 1.0).abs() < f64::EPSILON);
    let client_error = value(
        &samples,
        requests,
        &[("endpoint", "completions"), ("outcome", "client_error")],
    );
    assert!((client_error - 1.0).abs() < f64::EPSILON);
    let chat_usage = chat.json()["usage"].clone();
    let chat_generated = chat_usage["completion_tokens"].as_f64().unwrap();
    let generated = value(&samples, "pdserve_generated_tokens_total", &[]);
    assert!(
        generated > chat_generated,
        "{generated} vs {chat_generated}"
    );
    assert!(generated <= 12.0 + 1.0, "{generated}");
    let prompt = value(&samples, "pdserve_prompt_tokens_total", &[]);
    assert!(
        prompt > chat_usage["prompt_tokens"].as_f64().unwrap(),
        "{prompt}"
    );
    assert!(value(&samples, "pdserve_running_requests", &[]).abs() < f64::EPSILON);
    for hist in [
        "pdserve_request_duration_seconds",
        "pdserve_time_to_first_token_seconds",
    ] {
        for endpoint in ["chat_completions", "completions"] {
            let count = value(
                &samples,
                &format!("{hist}_count"),
                &[("endpoint", endpoint)],
            );
            let sum = value(&samples, &format!("{hist}_sum"), &[("endpoint", endpoint)]);
            assert!(count >= 1.0, "{hist} {endpoint}");
            assert!(sum > 0.0 && sum < 120.0, "{hist} {endpoint}: {sum}");
            let buckets: Vec<(f64, f64)> = samples
                .iter()
                .filter(|(n, l, _)| {
                    *n == format!("{hist}_bucket")
                        && l.get("endpoint").map(String::as_str) == Some(endpoint)
                })
                .map(|(_, l, v)| {
                    let le = match l["le"].as_str() {
                        "+Inf" => f64::INFINITY,
                        x => x.parse().unwrap(),
                    };
                    (le, *v)
                })
                .collect();
            assert!(buckets.len() > 3);
            assert!(
                buckets
                    .windows(2)
                    .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1)
            );
            assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count));
        }
    }
    // The time to first token never exceeds the whole request's duration.
    let ttft = value(
        &samples,
        "pdserve_time_to_first_token_seconds_sum",
        &[("endpoint", "completions")],
    );
    let duration = value(
        &samples,
        "pdserve_request_duration_seconds_sum",
        &[("endpoint", "completions")],
    );
    assert!(ttft <= duration, "{ttft} > {duration}");
}

#[test]
fn cluster_metrics_report_every_worker() {
    let cluster = integration_tests::pd::cluster(1, 1);
    let addr = cluster.router.addr("http");
    let r = integration_tests::pd::post(
        addr,
        "/v1/chat/completions",
        &integration_tests::pd::chat(30, 1, 0.0, 5),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let listed = integration_tests::pd::listed(addr);
    let metrics = http(addr, "GET", "/metrics", &[], b"", T);
    let (_, samples) = parse(&metrics.body);
    for role in ["prefill", "decode"] {
        let ready = value(
            &samples,
            "pdserve_workers",
            &[("role", role), ("state", "ready")],
        );
        assert!((ready - 1.0).abs() < f64::EPSILON, "{role}: {ready}");
        for state in ["starting", "loading", "draining", "unreachable"] {
            let n = value(
                &samples,
                "pdserve_workers",
                &[("role", role), ("state", state)],
            );
            assert!(n.abs() < f64::EPSILON, "{role} {state}: {n}");
        }
    }
    for w in &listed {
        let labels = [
            ("role", w["role"].as_str().unwrap()),
            ("worker", w["address"].as_str().unwrap()),
        ];
        for name in PER_WORKER {
            value(&samples, name, &labels);
        }
        let total = value(&samples, "pdserve_worker_pages_total", &labels);
        assert!(total > 0.0, "{labels:?}");
        assert!(
            (total - w["pages_total"].as_f64().unwrap()).abs() < f64::EPSILON,
            "{labels:?}: {total} vs {w}"
        );
        let used = value(&samples, "pdserve_worker_pages_used", &labels);
        assert!(used <= total, "{labels:?}: {used} > {total}");
    }
    assert!(value(&samples, "pdserve_queued_requests", &[]).abs() < f64::EPSILON);
    // vLLM's names, from the same measurements.
    let model = [("model_name", "deepseek-v4-flash")];
    let usage = value(&samples, "vllm:kv_cache_usage_perc", &model);
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert!(value(&samples, "vllm:generation_tokens_total", &model) >= 1.0);
    let prompt = value(&samples, "vllm:prompt_tokens_total", &model);
    assert!(
        (prompt - value(&samples, "pdserve_prompt_tokens_total", &[])).abs() < f64::EPSILON,
        "{prompt}"
    );
    assert!(value(&samples, "vllm:prefix_cache_queries_total", &model) >= 30.0);
    assert!(value(&samples, "vllm:e2e_request_latency_seconds_count", &model) >= 1.0);
}
