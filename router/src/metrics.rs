//! Prometheus metrics of the router: every name is defined here, once. A small hand-written
//! registry (fixed label sets, so no user-controlled value ever becomes a label) rendered in
//! the Prometheus text exposition format by `GET /metrics`.

use std::{
    fmt::Write as _,
    pin::Pin,
    sync::{
        LazyLock, Mutex,
        atomic::{AtomicI64, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Instant,
};

use futures::Stream;

mod cluster;
mod histogram;
mod vllm;

/// vLLM's metric names, exported beside pdserve's.
pub use vllm::ALL as VLLM_ALL;

use histogram::Histogram;

use crate::{backend::BackendEvent, workers::Workers};

/// Requests by endpoint and outcome (counter).
pub const REQUESTS_TOTAL: &str = "pdserve_requests_total";
/// Time from a request's arrival to its last byte of generation (histogram, seconds).
pub const REQUEST_DURATION_SECONDS: &str = "pdserve_request_duration_seconds";
/// Time from a request's arrival to its first generated token (histogram, seconds).
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "pdserve_time_to_first_token_seconds";
/// Generated tokens (counter).
pub const GENERATED_TOKENS_TOTAL: &str = "pdserve_generated_tokens_total";
/// Prompt tokens submitted to the backend (counter).
pub const PROMPT_TOKENS_TOTAL: &str = "pdserve_prompt_tokens_total";
/// Requests in flight (gauge).
pub const RUNNING_REQUESTS: &str = "pdserve_running_requests";

/// Prompt states moved from prefill to decode workers, by transport (counter).
pub const TRANSFERS_TOTAL: &str = "pdserve_transfers_total";
/// Bytes of prompt state moved, by transport (counter).
pub const TRANSFER_BYTES_TOTAL: &str = "pdserve_transfer_bytes_total";
/// Seconds prefill workers spent writing prompt state, by transport (counter).
pub const TRANSFER_SECONDS_TOTAL: &str = "pdserve_transfer_seconds_total";
/// Of those seconds, the part after the prefill's forward passes ended (not hidden behind
/// compute: it delays the first token), by transport (counter).
pub const TRANSFER_EXPOSED_SECONDS_TOTAL: &str = "pdserve_transfer_exposed_seconds_total";
/// Prefills retried on another worker after a failure (counter).
pub const PREFILL_RETRIES_TOTAL: &str = "pdserve_prefill_retries_total";
/// Time between consecutive generated tokens of a request (histogram, seconds; a batch of n
/// tokens that arrives after t counts as n gaps of t/n).
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "pdserve_inter_token_latency_seconds";
/// Requests waiting for a decode worker's reservation (room in its slots and pages) (gauge).
pub const QUEUED_REQUESTS: &str = "pdserve_queued_requests";
/// Error answers and backend failures, by kind (counter; see [`ERROR_KINDS`]).
pub const ERRORS_TOTAL: &str = "pdserve_errors_total";
/// Workers known to this router, by role and state (ready, starting, loading, draining,
/// unreachable) (gauge).
pub const WORKERS: &str = "pdserve_workers";
/// Per worker (`role`, `worker` = its gRPC address), from its last report (gauges).
pub const WORKER_RUNNING_REQUESTS: &str = "pdserve_worker_running_requests";
pub const WORKER_QUEUED_REQUESTS: &str = "pdserve_worker_queued_requests";
pub const WORKER_PAGES_TOTAL: &str = "pdserve_worker_pages_total";
pub const WORKER_PAGES_USED: &str = "pdserve_worker_pages_used";
pub const WORKER_PAGES_CACHED: &str = "pdserve_worker_pages_cached";
pub const WORKER_RESERVATIONS: &str = "pdserve_worker_reservations";
/// Always 1, with the router's version as a label (gauge).
pub const BUILD_INFO: &str = "pdserve_build_info";
/// 1 while a model is served, with its name as a label (gauge).
pub const MODEL_INFO: &str = "pdserve_model_info";

/// Every metric name, for documentation and tests.
pub const ALL: [&str; 23] = [
    REQUESTS_TOTAL,
    REQUEST_DURATION_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    GENERATED_TOKENS_TOTAL,
    PROMPT_TOKENS_TOTAL,
    RUNNING_REQUESTS,
    QUEUED_REQUESTS,
    ERRORS_TOTAL,
    TRANSFERS_TOTAL,
    TRANSFER_BYTES_TOTAL,
    TRANSFER_SECONDS_TOTAL,
    TRANSFER_EXPOSED_SECONDS_TOTAL,
    PREFILL_RETRIES_TOTAL,
    WORKERS,
    WORKER_RUNNING_REQUESTS,
    WORKER_QUEUED_REQUESTS,
    WORKER_PAGES_TOTAL,
    WORKER_PAGES_USED,
    WORKER_PAGES_CACHED,
    WORKER_RESERVATIONS,
    BUILD_INFO,
    MODEL_INFO,
];

/// Values of the `kind` label of [`ERRORS_TOTAL`]: one per kind of error answer
/// (`ApiError::metric_kind`), and `backend_failed` for a request the backend failed after
/// admitting it (worker lost, transfer failed, ...). The kinds are not exclusive: a
/// non-streaming request that fails in the backend is also answered with an error of its own
/// kind, while a stream that already began ends with an error event.
pub const ERROR_KINDS: [&str; 12] = [
    "invalid_json",
    "invalid_param",
    "invalid_request",
    "unknown_model",
    "context_length",
    "payload_too_large",
    "unauthorized",
    "too_many_requests",
    "not_found",
    "unavailable",
    "internal",
    "backend_failed",
];

/// The endpoints recorded (the `endpoint` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    /// Anthropic Messages.
    Messages,
    /// OpenAI Responses.
    Responses,
}

impl Endpoint {
    const ALL: [Self; ENDPOINTS] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Messages,
        Self::Responses,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Messages => "messages",
            Self::Responses => "responses",
        }
    }
}

/// Number of [`Endpoint`]s.
const ENDPOINTS: usize = 4;

/// How a request ended (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    ClientError,
    ServerError,
    /// The client went away before the end.
    Cancelled,
}

impl Outcome {
    const ALL: [Self; 4] = [
        Self::Success,
        Self::ClientError,
        Self::ServerError,
        Self::Cancelled,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::ClientError => "client_error",
            Self::ServerError => "server_error",
            Self::Cancelled => "cancelled",
        }
    }

    /// The outcome of an error answer with HTTP `status`.
    pub fn of_error(status: axum::http::StatusCode) -> Self {
        if status.is_server_error() {
            Self::ServerError
        } else {
            Self::ClientError
        }
    }
}

const DURATION_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const TTFT_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const ITL_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5,
];

#[derive(Debug)]
struct Registry {
    requests: [[AtomicU64; 4]; ENDPOINTS],
    duration: Mutex<[Histogram; ENDPOINTS]>,
    ttft: Mutex<[Histogram; ENDPOINTS]>,
    itl: Mutex<[Histogram; ENDPOINTS]>,
    generated: AtomicU64,
    prompt: AtomicU64,
    running: AtomicI64,
    queued: AtomicI64,
    errors: [AtomicU64; ERROR_KINDS.len()],
    /// Per transport (UCX, TCP, NCCL): transfers, bytes, busy and exposed nanoseconds.
    transfers: [[AtomicU64; 4]; 3],
    prefill_retries: AtomicU64,
    /// Prompt tokens of finished requests, and of those the ones taken from a prefix cache.
    cache_queries: AtomicU64,
    cache_hits: AtomicU64,
}

/// The transports transfers are counted by (the `transport` label).
const TRANSPORT_LABELS: [&str; 3] = ["ucx", "tcp", "nccl"];

/// Records one prompt-state transfer over `transport`.
pub fn transfer(transport: proto::v1::TransportKind, bytes: u64, busy_ns: u64, exposed_ns: u64) {
    let index = match transport {
        proto::v1::TransportKind::Ucx => 0,
        proto::v1::TransportKind::Nccl => 2,
        _ => 1,
    };
    let t = &REGISTRY.transfers[index];
    t[0].fetch_add(1, Ordering::Relaxed);
    t[1].fetch_add(bytes, Ordering::Relaxed);
    t[2].fetch_add(busy_ns, Ordering::Relaxed);
    t[3].fetch_add(exposed_ns, Ordering::Relaxed);
}

/// Records a prefill retried on another worker.
pub fn prefill_retry() {
    REGISTRY.prefill_retries.fetch_add(1, Ordering::Relaxed);
}

/// Records an error of `kind` (one of [`ERROR_KINDS`]; others count as `internal`).
pub fn error(kind: &str) {
    let i = ERROR_KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(ERROR_KINDS.len() - 2);
    REGISTRY.errors[i].fetch_add(1, Ordering::Relaxed);
}

/// A request waiting for a decode reservation; counted in [`QUEUED_REQUESTS`] until dropped.
#[derive(Debug)]
pub struct Queued(());

impl Queued {
    pub fn enter() -> Self {
        REGISTRY.queued.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        REGISTRY.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry {
    requests: Default::default(),
    duration: Mutex::new(std::array::from_fn(|_| Histogram::new(&DURATION_BUCKETS))),
    ttft: Mutex::new(std::array::from_fn(|_| Histogram::new(&TTFT_BUCKETS))),
    itl: Mutex::new(std::array::from_fn(|_| Histogram::new(&ITL_BUCKETS))),
    generated: AtomicU64::new(0),
    prompt: AtomicU64::new(0),
    running: AtomicI64::new(0),
    queued: AtomicI64::new(0),
    errors: Default::default(),
    transfers: Default::default(),
    prefill_retries: AtomicU64::new(0),
    cache_queries: AtomicU64::new(0),
    cache_hits: AtomicU64::new(0),
});

fn index(endpoint: Endpoint) -> usize {
    match endpoint {
        Endpoint::ChatCompletions => 0,
        Endpoint::Completions => 1,
        Endpoint::Messages => 2,
        Endpoint::Responses => 3,
    }
}

/// The metrics in the Prometheus text format (version 0.0.4), with the state of `workers`
/// and the name of the served model, if one is loaded.
pub fn render(workers: &Workers, model: Option<&str>) -> String {
    let r = &*REGISTRY;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP {REQUESTS_TOTAL} Requests by endpoint and outcome."
    );
    let _ = writeln!(out, "# TYPE {REQUESTS_TOTAL} counter");
    for endpoint in Endpoint::ALL {
        for (j, outcome) in Outcome::ALL.iter().enumerate() {
            let n = r.requests[index(endpoint)][j].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{REQUESTS_TOTAL}{{endpoint=\"{}\",outcome=\"{}\"}} {n}",
                endpoint.label(),
                outcome.label()
            );
        }
    }
    for (name, help, hists) in [
        (
            REQUEST_DURATION_SECONDS,
            "Seconds from a request's arrival to its end.",
            &r.duration,
        ),
        (
            TIME_TO_FIRST_TOKEN_SECONDS,
            "Seconds from a request's arrival to its first generated token.",
            &r.ttft,
        ),
        (
            INTER_TOKEN_LATENCY_SECONDS,
            "Seconds between consecutive generated tokens of a request.",
            &r.itl,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        if let Ok(hists) = hists.lock() {
            for endpoint in Endpoint::ALL {
                let label = format!("endpoint=\"{}\",", endpoint.label());
                hists[index(endpoint)].render(&mut out, name, &label);
            }
        }
    }
    for (name, help, value) in [
        (
            GENERATED_TOKENS_TOTAL,
            "Tokens generated.",
            r.generated.load(Ordering::Relaxed),
        ),
        (
            PROMPT_TOKENS_TOTAL,
            "Prompt tokens submitted.",
            r.prompt.load(Ordering::Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name} {value}");
    }
    for (name, help, value) in [
        (RUNNING_REQUESTS, "Requests in flight.", &r.running),
        (
            QUEUED_REQUESTS,
            "Requests waiting for a decode worker's reservation.",
            &r.queued,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed).max(0));
    }
    let _ = writeln!(
        out,
        "# HELP {ERRORS_TOTAL} Error answers and backend failures by kind."
    );
    let _ = writeln!(out, "# TYPE {ERRORS_TOTAL} counter");
    for (kind, n) in ERROR_KINDS.iter().zip(&r.errors) {
        let _ = writeln!(
            out,
            "{ERRORS_TOTAL}{{kind=\"{kind}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
    for (k, (name, help, kind)) in [
        (
            TRANSFERS_TOTAL,
            "Prompt states moved to decode workers.",
            "counter",
        ),
        (
            TRANSFER_BYTES_TOTAL,
            "Bytes of prompt state moved.",
            "counter",
        ),
        (
            TRANSFER_SECONDS_TOTAL,
            "Seconds prefill workers spent writing prompt state.",
            "counter",
        ),
        (
            TRANSFER_EXPOSED_SECONDS_TOTAL,
            "Seconds of prompt-state writing after the prefill compute ended.",
            "counter",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let _ = writeln!(out, "# HELP {name} {help} By transport.");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (t, label) in TRANSPORT_LABELS.iter().enumerate() {
            let v = r.transfers[t][k].load(Ordering::Relaxed);
            if k >= 2 {
                let _ = writeln!(out, "{name}{{transport=\"{label}\"}} {}", v as f64 / 1e9);
            } else {
                let _ = writeln!(out, "{name}{{transport=\"{label}\"}} {v}");
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP {PREFILL_RETRIES_TOTAL} Prefills retried on another worker."
    );
    let _ = writeln!(out, "# TYPE {PREFILL_RETRIES_TOTAL} counter");
    let _ = writeln!(
        out,
        "{PREFILL_RETRIES_TOTAL} {}",
        r.prefill_retries.load(Ordering::Relaxed)
    );
    cluster::render(&mut out, workers, model);
    vllm::render(&mut out, workers, model);
    out
}

/// One request's metrics: counts it running from creation, records its outcome and duration
/// when dropped (`cancelled` unless told otherwise).
#[derive(Debug)]
pub struct Tracker {
    endpoint: Endpoint,
    start: Instant,
    outcome: Option<Outcome>,
    /// When the latest tokens arrived.
    last_tokens: Option<Instant>,
}

impl Tracker {
    pub fn new(endpoint: Endpoint) -> Self {
        REGISTRY.running.fetch_add(1, Ordering::Relaxed);
        Self {
            endpoint,
            start: Instant::now(),
            outcome: None,
            last_tokens: None,
        }
    }

    /// Prompt tokens submitted.
    pub fn prompt(&self, tokens: usize) {
        REGISTRY.prompt.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Tokens generated (the first call records the time to first token, later ones the
    /// gaps between tokens).
    pub fn generated(&mut self, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_tokens.replace(now) {
            None => {
                if let Ok(mut h) = REGISTRY.ttft.lock() {
                    h[index(self.endpoint)].observe((now - self.start).as_secs_f64());
                }
            }
            Some(last) => {
                let gap = (now - last).as_secs_f64() / tokens as f64;
                if let Ok(mut h) = REGISTRY.itl.lock() {
                    h[index(self.endpoint)].observe_n(gap, tokens as u64);
                }
            }
        }
        REGISTRY
            .generated
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    pub fn succeeded(&mut self) {
        self.outcome.get_or_insert(Outcome::Success);
    }

    /// The request was answered with an error of HTTP `status`.
    pub fn failed(&mut self, status: axum::http::StatusCode) {
        self.outcome.get_or_insert(Outcome::of_error(status));
    }

    pub fn server_error(&mut self) {
        self.outcome.get_or_insert(Outcome::ServerError);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let r = &*REGISTRY;
        r.running.fetch_sub(1, Ordering::Relaxed);
        let outcome = self.outcome.unwrap_or(Outcome::Cancelled);
        let j = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(3);
        r.requests[index(self.endpoint)][j].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = r.duration.lock() {
            h[index(self.endpoint)].observe(self.start.elapsed().as_secs_f64());
        }
    }
}

/// Tokens generated for a request's further choices (`n` > 1): counted, while the request's
/// [`Tracker`] times its first choice.
pub fn count_generated(tokens: usize) {
    REGISTRY
        .generated
        .fetch_add(tokens as u64, Ordering::Relaxed);
}

/// A backend token stream that reports to a [`Tracker`] (dropped with the stream).
#[derive(Debug)]
pub struct Tracked<S> {
    inner: S,
    tracker: Option<Tracker>,
}

/// Wraps `inner` so that its tokens, end and early drop are recorded.
pub fn track<S>(inner: S, tracker: Tracker) -> Tracked<S> {
    track_choice(inner, Some(tracker))
}

/// Wraps one choice's stream: the first choice's with the request's tracker, a further
/// choice's (`None`) counting its tokens only.
pub fn track_choice<S>(inner: S, tracker: Option<Tracker>) -> Tracked<S> {
    Tracked { inner, tracker }
}

impl<S: Stream<Item = BackendEvent> + Unpin> Stream for Tracked<S> {
    type Item = BackendEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(event) = &polled {
            let ends = !matches!(
                event,
                Some(BackendEvent::Tokens(_) | BackendEvent::PromptLogprobs(_))
            );
            if self.tracker.is_none()
                && let Some(BackendEvent::Tokens(batch)) = event
            {
                // A further choice of a request whose tracker watches its first.
                count_generated(batch.len());
            }
            if let Some(tracker) = self.tracker.as_mut() {
                match event {
                    Some(BackendEvent::Tokens(batch)) => tracker.generated(batch.len()),
                    Some(BackendEvent::PromptLogprobs(_)) => {}
                    Some(BackendEvent::Finished { usage, .. }) => {
                        REGISTRY
                            .cache_queries
                            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
                        REGISTRY
                            .cache_hits
                            .fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
                        tracker.succeeded();
                    }
                    Some(BackendEvent::Failed(_)) | None => {
                        error("backend_failed");
                        tracker.server_error();
                    }
                }
            }
            if ends {
                self.tracker = None;
            }
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_name_with_fixed_labels() {
        {
            let mut t = Tracker::new(Endpoint::Completions);
            t.prompt(3);
            t.generated(2);
            t.succeeded();
        }
        let workers = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async { Workers::new(&[], &[], &proto::auth::Credentials::none()).unwrap() });
        let text = render(&workers, Some("m"));
        for name in ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
        }
        assert!(text.contains(
            "pdserve_time_to_first_token_seconds_bucket{endpoint=\"completions\",le=\"+Inf\"}"
        ));
        assert!(text.contains("pdserve_request_duration_seconds_count{endpoint=\"completions\"}"));
        // vLLM's names beside ours, with their own label; the pool fraction has a sample only
        // where decode workers report a pool (none here).
        for name in vllm::ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
        }
        assert!(!text.contains("vllm:kv_cache_usage_perc{"));
        assert!(
            text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"}")
        );
        assert!(text.contains("vllm:e2e_request_latency_seconds_count{model_name=\"m\"}"));
        assert!(text.contains("vllm:prompt_tokens_total{model_name=\"m\"}"));
    }
}
