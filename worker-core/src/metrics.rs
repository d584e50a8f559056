//! A worker's own Prometheus metrics, served as `GET /metrics` on `metrics_listen` (off unless
//! configured): what its engine's steps did (time, batch size, prompt tokens computed and taken
//! from the prefix cache, tokens decoded), its pool and requests, and the state it sent. The
//! router's /metrics has the request-level families (vLLM's names among them); these are the
//! worker-side ones, labelled with the worker's role. Registry and encoding: `prometheus-client`.

use std::{borrow::Cow, net::SocketAddr, sync::Arc};

use axum::{Router, http::header, response::IntoResponse, routing::get};
use engine::scheduler::{StepObserver, StepRecord};
use prometheus_client::{
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// Every family's name as exposed (counters with their `_total`), for docs and dashboards.
pub const NAMES: &[&str] = &[
    "pdserve_engine_step_seconds",
    "pdserve_engine_step_batch_requests",
    "pdserve_engine_steps_total",
    "pdserve_engine_prompts_total",
    "pdserve_engine_prompt_tokens_computed_total",
    "pdserve_engine_prompt_tokens_cached_total",
    "pdserve_engine_decode_tokens_total",
    "pdserve_engine_requests_running",
    "pdserve_engine_requests_waiting",
    "pdserve_engine_pages",
    "pdserve_engine_pages_used",
    "pdserve_engine_pages_cached",
    "pdserve_engine_reservations",
    "pdserve_engine_state_transfers_total",
    "pdserve_engine_state_transfer_bytes_total",
    "pdserve_engine_state_transfer_seconds",
    "pdserve_engine_rank_requests_running",
    "pdserve_engine_rank_pages",
    "pdserve_engine_rank_pages_used",
    "pdserve_engine_device_steps_total",
    "pdserve_engine_device_argmax_tokens_total",
];

/// The `rank` label of a worker's per-rank families.
#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
struct RankLabel {
    rank: u32,
}

/// The `how` label of the device steps: `DeviceRun::name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
struct RunLabel {
    how: &'static str,
}

/// One worker's metric families.
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    step_seconds: Histogram,
    step_requests: Histogram,
    steps: Counter,
    prompts: Counter,
    prompt_tokens_computed: Counter,
    prompt_tokens_cached: Counter,
    decode_tokens: Counter,
    running: Gauge,
    queued: Gauge,
    pages_total: Gauge,
    pages_used: Gauge,
    pages_cached: Gauge,
    reservations: Gauge,
    transfers: Counter,
    transfer_bytes: Counter,
    transfer_seconds: Histogram,
    rank_running: Family<RankLabel, Gauge>,
    rank_pages_total: Family<RankLabel, Gauge>,
    rank_pages_used: Family<RankLabel, Gauge>,
    device_steps: Family<RunLabel, Counter>,
    argmax_tokens: Counter,
}

impl WorkerMetrics {
    /// The families of a worker of `role` (`prefill`, `decode`), all zero.
    pub fn new(role: &'static str) -> Arc<Self> {
        let mut registry = Registry::with_prefix_and_labels(
            "pdserve_engine",
            [(Cow::Borrowed("role"), Cow::Borrowed(role))].into_iter(),
        );
        // 0.5 ms to about 33 s.
        let step_seconds = Histogram::new(exponential_buckets(0.000_5, 2.0, 17));
        let step_requests = Histogram::new(exponential_buckets(1.0, 2.0, 13));
        let transfer_seconds = Histogram::new(exponential_buckets(0.000_1, 2.0, 18));
        let metrics = Self {
            step_seconds,
            step_requests,
            transfer_seconds,
            steps: Counter::default(),
            prompts: Counter::default(),
            prompt_tokens_computed: Counter::default(),
            prompt_tokens_cached: Counter::default(),
            decode_tokens: Counter::default(),
            running: Gauge::default(),
            queued: Gauge::default(),
            pages_total: Gauge::default(),
            pages_used: Gauge::default(),
            pages_cached: Gauge::default(),
            reservations: Gauge::default(),
            transfers: Counter::default(),
            transfer_bytes: Counter::default(),
            rank_running: Family::default(),
            rank_pages_total: Family::default(),
            rank_pages_used: Family::default(),
            device_steps: Family::default(),
            argmax_tokens: Counter::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "step_seconds",
            "Wall time of one engine step (admission, forward pass, sampling)",
            metrics.step_seconds.clone(),
        );
        r.register(
            "step_batch_requests",
            "Requests in one engine step's batch",
            metrics.step_requests.clone(),
        );
        r.register("steps", "Engine steps run", metrics.steps.clone());
        r.register(
            "prompts",
            "Prompts admitted into the engine",
            metrics.prompts.clone(),
        );
        r.register(
            "prompt_tokens_computed",
            "Prompt tokens computed by forward passes",
            metrics.prompt_tokens_computed.clone(),
        );
        r.register(
            "prompt_tokens_cached",
            "Prompt tokens taken from the prefix cache instead of computed",
            metrics.prompt_tokens_cached.clone(),
        );
        r.register(
            "decode_tokens",
            "Tokens generated by decode steps (a prompt's first token is counted with it)",
            metrics.decode_tokens.clone(),
        );
        r.register(
            "requests_running",
            "Requests being prefilled or decoded",
            metrics.running.clone(),
        );
        r.register(
            "requests_waiting",
            "Requests waiting for admission",
            metrics.queued.clone(),
        );
        r.register("pages", "Pages in the pool", metrics.pages_total.clone());
        r.register(
            "pages_used",
            "Pages held by requests, reservations or the prefix cache",
            metrics.pages_used.clone(),
        );
        r.register(
            "pages_cached",
            "Pages held only by the prefix cache (evictable)",
            metrics.pages_cached.clone(),
        );
        r.register(
            "reservations",
            "Live, uncommitted reservations",
            metrics.reservations.clone(),
        );
        r.register(
            "state_transfers",
            "Prompt states sent to decode workers",
            metrics.transfers.clone(),
        );
        r.register(
            "state_transfer_bytes",
            "Bytes of prompt state sent to decode workers",
            metrics.transfer_bytes.clone(),
        );
        r.register(
            "state_transfer_seconds",
            "Time the transport was busy sending one prompt's state",
            metrics.transfer_seconds.clone(),
        );
        r.register(
            "rank_requests_running",
            "Requests running on each rank of a worker over several ranks",
            metrics.rank_running.clone(),
        );
        r.register(
            "rank_pages",
            "Pages in each rank's pool (a worker over several ranks)",
            metrics.rank_pages_total.clone(),
        );
        r.register(
            "rank_pages_used",
            "Pages held on each rank (a worker over several ranks)",
            metrics.rank_pages_used.clone(),
        );
        r.register(
            "device_steps",
            "Decode steps on the device, by how they ran: as_it_came, replayed (a recorded graph), \
             recorded (captured, then replayed), launch_pass (plans, then launches, where the \
             device records no graphs), fell_back (a failed capture, then as it came)",
            metrics.device_steps.clone(),
        );
        r.register(
            "device_argmax_tokens",
            "Tokens the decode device sent back as their argmax instead of their logits",
            metrics.argmax_tokens.clone(),
        );
        Arc::new(Self {
            registry,
            ..metrics
        })
    }

    /// Records one engine step.
    pub fn step(&self, record: &StepRecord) {
        let n = |x: usize| x as u64;
        self.step_seconds.observe(record.seconds);
        self.step_requests.observe(record.requests as f64);
        self.steps.inc();
        self.prompts.inc_by(n(record.admitted));
        self.prompt_tokens_computed.inc_by(n(record.prompt_tokens));
        self.prompt_tokens_cached.inc_by(n(record.cached_tokens));
        self.decode_tokens.inc_by(n(record.decode_tokens));
        if let Some(run) = record.device_run {
            self.device_steps
                .get_or_create(&RunLabel { how: run.name() })
                .inc();
        }
        if record.device_prompts {
            self.device_steps
                .get_or_create(&RunLabel {
                    how: "prompt_chunks",
                })
                .inc();
        }
        self.argmax_tokens.inc_by(n(record.argmax_tokens));
    }

    /// The engine observer that records every step here.
    pub fn observer(self: &Arc<Self>) -> StepObserver {
        let metrics = Arc::clone(self);
        StepObserver(Box::new(move |record| metrics.step(record)))
    }

    /// The engine's current occupancy.
    pub fn set_load(&self, load: &proto::v1::Load) {
        let g = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        self.running.set(g(load.running_requests.into()));
        self.queued.set(g(load.queued_requests.into()));
        self.pages_total.set(g(load.pages_total));
        self.pages_used.set(g(load.pages_used));
        self.pages_cached.set(g(load.pages_cached));
        self.reservations.set(g(load.reservations.into()));
        for (rank, l) in load.ranks.iter().enumerate() {
            let label = RankLabel {
                rank: u32::try_from(rank).unwrap_or(u32::MAX),
            };
            self.rank_running
                .get_or_create(&label)
                .set(g(l.running_requests.into()));
            self.rank_pages_total
                .get_or_create(&label)
                .set(g(l.pages_total));
            self.rank_pages_used
                .get_or_create(&label)
                .set(g(l.pages_used));
        }
    }

    /// One prompt's state sent: its bytes and the transport's busy time.
    pub fn transfer(&self, bytes: u64, seconds: f64) {
        self.transfers.inc();
        self.transfer_bytes.inc_by(bytes);
        self.transfer_seconds.observe(seconds);
    }

    /// The text exposition (OpenMetrics).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<WorkerMetrics>) {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let body = metrics.render();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    body,
                )
                    .into_response()
            }
        }),
    );
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, ?addr, "the metrics listener stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_load_and_transfers_are_rendered_with_the_role() {
        let m = WorkerMetrics::new("prefill");
        m.step(&StepRecord {
            seconds: 0.01,
            requests: 2,
            prompt_tokens: 70,
            decode_tokens: 1,
            admitted: 2,
            cached_tokens: 64,
            device_run: Some(engine::scheduler::DeviceRun::Replayed),
            device_prompts: true,
            argmax_tokens: 1,
        });
        let rank = |used| proto::v1::Load {
            pages_total: 512,
            pages_used: used,
            running_requests: 1,
            ..proto::v1::Load::default()
        };
        m.set_load(&proto::v1::Load {
            pages_total: 1024,
            pages_used: 5,
            ranks: vec![rank(2), rank(3)],
            ..proto::v1::Load::default()
        });
        m.transfer(4096, 0.002);
        let text = m.render();
        let families = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(families, NAMES.len(), "{text}");
        for name in NAMES {
            let family = name.strip_suffix("_total").unwrap_or(name);
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{name}:\n{text}"
            );
            assert!(text.contains(name), "{name}:\n{text}");
        }
        for line in [
            "pdserve_engine_prompt_tokens_computed_total{role=\"prefill\"} 70",
            "pdserve_engine_prompt_tokens_cached_total{role=\"prefill\"} 64",
            "pdserve_engine_prompts_total{role=\"prefill\"} 2",
            "pdserve_engine_decode_tokens_total{role=\"prefill\"} 1",
            "pdserve_engine_steps_total{role=\"prefill\"} 1",
            "pdserve_engine_pages{role=\"prefill\"} 1024",
            "pdserve_engine_pages_used{role=\"prefill\"} 5",
            "pdserve_engine_rank_pages_used{role=\"prefill\",rank=\"1\"} 3",
            "pdserve_engine_rank_pages{role=\"prefill\",rank=\"0\"} 512",
            "pdserve_engine_state_transfer_bytes_total{role=\"prefill\"} 4096",
            "pdserve_engine_step_seconds_count{role=\"prefill\"} 1",
            "pdserve_engine_step_batch_requests_sum{role=\"prefill\"} 2.0",
            "# TYPE pdserve_engine_state_transfer_seconds histogram",
            "pdserve_engine_device_steps_total{role=\"prefill\",how=\"replayed\"} 1",
            "pdserve_engine_device_steps_total{role=\"prefill\",how=\"prompt_chunks\"} 1",
            "pdserve_engine_device_argmax_tokens_total{role=\"prefill\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
