//! vLLM's metric families, so dashboards and autoscalers written for vLLM read pdserve as they
//! are: the same names, types and units (seconds, tokens, a 0-1 fraction), labelled
//! `model_name`, rendered from the same measurements as the `pdserve_` families beside them.

use std::{fmt::Write as _, sync::atomic::Ordering};

use super::{REGISTRY, histogram::Histogram};
use crate::backend::workers::Workers;

pub(super) const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub(super) const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub(super) const PROMPT_TOKENS_TOTAL: &str = "vllm:prompt_tokens_total";
pub(super) const GENERATION_TOKENS_TOTAL: &str = "vllm:generation_tokens_total";
pub(super) const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
pub(super) const INTER_TOKEN_LATENCY_SECONDS: &str = "vllm:inter_token_latency_seconds";
pub(super) const E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
pub(super) const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
pub(super) const PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
pub(super) const PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";

/// Every vLLM family, for documentation and tests.
pub const ALL: [&str; 10] = [
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    KV_CACHE_USAGE_PERC,
    PREFIX_CACHE_QUERIES_TOTAL,
    PREFIX_CACHE_HITS_TOTAL,
];

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

pub(super) fn render(out: &mut String, workers: &Workers, model: Option<&str>) {
    let r = &*REGISTRY;
    let label = format!("model_name=\"{}\"", model.unwrap_or_default());
    for (name, help, value) in [
        (
            NUM_REQUESTS_RUNNING,
            "Requests in flight (pdserve_running_requests).",
            &r.running,
        ),
        (
            NUM_REQUESTS_WAITING,
            "Requests waiting for room on a decode worker (pdserve_queued_requests).",
            &r.queued,
        ),
    ] {
        head(out, name, "gauge", help);
        let _ = writeln!(
            out,
            "{name}{{{label}}} {}",
            value.load(Ordering::Relaxed).max(0)
        );
    }
    for (name, help, value) in [
        (PROMPT_TOKENS_TOTAL, "Prompt tokens submitted.", &r.prompt),
        (GENERATION_TOKENS_TOTAL, "Tokens generated.", &r.generated),
        (
            PREFIX_CACHE_QUERIES_TOTAL,
            "Prompt tokens of finished requests looked up in a prefix cache.",
            &r.cache_queries,
        ),
        (
            PREFIX_CACHE_HITS_TOTAL,
            "Of those, tokens whose state came from a prefix cache.",
            &r.cache_hits,
        ),
    ] {
        head(out, name, "counter", help);
        let _ = writeln!(out, "{name}{{{label}}} {}", value.load(Ordering::Relaxed));
    }
    for (name, help, hists) in [
        (
            TIME_TO_FIRST_TOKEN_SECONDS,
            "Seconds from a request's arrival to its first generated token, all endpoints.",
            &r.ttft,
        ),
        (
            INTER_TOKEN_LATENCY_SECONDS,
            "Seconds between consecutive generated tokens, all endpoints.",
            &r.itl,
        ),
        (
            E2E_REQUEST_LATENCY_SECONDS,
            "Seconds from a request's arrival to its end, all endpoints.",
            &r.duration,
        ),
    ] {
        head(out, name, "histogram", help);
        if let Ok(hists) = hists.lock()
            && let Some(all) = Histogram::merged(hists.iter())
        {
            all.render(out, name, &format!("{label},"));
        }
    }
    // The decode workers' pools hold the state of running requests (and their prefix cache);
    // without decode workers (the in-process engine) there is no pool to report: no sample.
    let decode: Vec<_> = workers
        .listing()
        .into_iter()
        .filter(|w| w.role == "decode" && w.pages_total > 0)
        .collect();
    head(
        out,
        KV_CACHE_USAGE_PERC,
        "gauge",
        "Fraction of the decode workers' state pages in use (1 = full).",
    );
    if !decode.is_empty() {
        let used: u64 = decode.iter().map(|w| w.pages_used).sum();
        let total: u64 = decode.iter().map(|w| w.pages_total).sum();
        let _ = writeln!(
            out,
            "{KV_CACHE_USAGE_PERC}{{{label}}} {}",
            used as f64 / total as f64
        );
    }
}
