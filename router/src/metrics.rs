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

use crate::{api_error::ApiError, backend::BackendEvent};

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

/// Every metric name, for documentation and tests.
pub const ALL: [&str; 11] = [
    REQUESTS_TOTAL,
    REQUEST_DURATION_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    GENERATED_TOKENS_TOTAL,
    PROMPT_TOKENS_TOTAL,
    RUNNING_REQUESTS,
    TRANSFERS_TOTAL,
    TRANSFER_BYTES_TOTAL,
    TRANSFER_SECONDS_TOTAL,
    TRANSFER_EXPOSED_SECONDS_TOTAL,
    PREFILL_RETRIES_TOTAL,
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

    /// The outcome of an error answer.
    pub fn of(error: &ApiError) -> Self {
        if error.parts().0.is_server_error() {
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

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, x: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| x <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += x;
    }

    fn render(&self, out: &mut String, name: &str, label: &str) {
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count;
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), ToString::to_string);
            let _ = writeln!(out, "{name}_bucket{{{label}le=\"{le}\"}} {cumulative}");
        }
        let braces = if label.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", label.trim_end_matches(','))
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

#[derive(Debug)]
struct Registry {
    requests: [[AtomicU64; 4]; ENDPOINTS],
    duration: Mutex<[Histogram; ENDPOINTS]>,
    ttft: Mutex<[Histogram; ENDPOINTS]>,
    generated: AtomicU64,
    prompt: AtomicU64,
    running: AtomicI64,
    /// Per transport (UCX, TCP, NCCL): transfers, bytes, busy and exposed nanoseconds.
    transfers: [[AtomicU64; 4]; 3],
    prefill_retries: AtomicU64,
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

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry {
    requests: Default::default(),
    duration: Mutex::new(std::array::from_fn(|_| Histogram::new(&DURATION_BUCKETS))),
    ttft: Mutex::new(std::array::from_fn(|_| Histogram::new(&TTFT_BUCKETS))),
    generated: AtomicU64::new(0),
    prompt: AtomicU64::new(0),
    running: AtomicI64::new(0),
    transfers: Default::default(),
    prefill_retries: AtomicU64::new(0),
});

fn index(endpoint: Endpoint) -> usize {
    match endpoint {
        Endpoint::ChatCompletions => 0,
        Endpoint::Completions => 1,
        Endpoint::Messages => 2,
        Endpoint::Responses => 3,
    }
}

/// The metrics in the Prometheus text format (version 0.0.4).
pub fn render() -> String {
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
    let _ = writeln!(out, "# HELP {RUNNING_REQUESTS} Requests in flight.");
    let _ = writeln!(out, "# TYPE {RUNNING_REQUESTS} gauge");
    let _ = writeln!(
        out,
        "{RUNNING_REQUESTS} {}",
        r.running.load(Ordering::Relaxed).max(0)
    );
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
    out
}

/// One request's metrics: counts it running from creation, records its outcome and duration
/// when dropped (`cancelled` unless told otherwise).
#[derive(Debug)]
pub struct Tracker {
    endpoint: Endpoint,
    start: Instant,
    outcome: Option<Outcome>,
    first_token: bool,
}

impl Tracker {
    pub fn new(endpoint: Endpoint) -> Self {
        REGISTRY.running.fetch_add(1, Ordering::Relaxed);
        Self {
            endpoint,
            start: Instant::now(),
            outcome: None,
            first_token: false,
        }
    }

    /// Prompt tokens submitted.
    pub fn prompt(&self, tokens: usize) {
        REGISTRY.prompt.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Tokens generated (the first call records the time to first token).
    pub fn generated(&mut self, tokens: usize) {
        if tokens == 0 {
            return;
        }
        if !self.first_token {
            self.first_token = true;
            if let Ok(mut h) = REGISTRY.ttft.lock() {
                h[index(self.endpoint)].observe(self.start.elapsed().as_secs_f64());
            }
        }
        REGISTRY
            .generated
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    pub fn succeeded(&mut self) {
        self.outcome.get_or_insert(Outcome::Success);
    }

    pub fn failed(&mut self, error: &ApiError) {
        self.outcome.get_or_insert(Outcome::of(error));
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

/// A backend token stream that reports to a [`Tracker`] (dropped with the stream).
#[derive(Debug)]
pub struct Tracked<S> {
    inner: S,
    tracker: Option<Tracker>,
}

/// Wraps `inner` so that its tokens, end and early drop are recorded.
pub fn track<S>(inner: S, tracker: Tracker) -> Tracked<S> {
    Tracked {
        inner,
        tracker: Some(tracker),
    }
}

impl<S: Stream<Item = BackendEvent> + Unpin> Stream for Tracked<S> {
    type Item = BackendEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(event) = &polled {
            let ends = !matches!(event, Some(BackendEvent::Tokens(_)));
            if let Some(tracker) = self.tracker.as_mut() {
                match event {
                    Some(BackendEvent::Tokens(batch)) => tracker.generated(batch.len()),
                    Some(BackendEvent::Finished { .. }) => tracker.succeeded(),
                    Some(BackendEvent::Failed(_)) | None => tracker.server_error(),
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
        let text = render();
        for name in ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
        }
        assert!(text.contains(
            "pdserve_time_to_first_token_seconds_bucket{endpoint=\"completions\",le=\"+Inf\"}"
        ));
        assert!(text.contains("pdserve_request_duration_seconds_count{endpoint=\"completions\"}"));
    }
}
