//! The disaggregated backend: each request takes two legs. The router reserves pages on a
//! decode worker (under a lease), opens the decode stream, and asks a prefill worker to compute
//! the prompt, write its state into those pages and commit; the decode worker then streams the
//! tokens, the prefill's first token first. A failure on either leg cancels the other and ends
//! the request with an error; dropping the token stream (client gone) cancels both legs.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use engine::{
    paged::prefix::{BlockKey, block_keys},
    sampling::FinishReason,
    wire::{self, token_from_proto},
};
use futures::future::BoxFuture;
use proto::v1::{
    CancelRequest, ErrorKind, GenerateRequest, InfoRequest, Load, PrefillRequest, RequestId,
    ReserveRequest, StateLayout, TokenBatch, TransportKind, decode_client::DecodeClient,
    prefill_client::PrefillClient, worker_client::WorkerClient,
};
use tokio::sync::{mpsc, watch};
use tonic::transport::{Channel, Endpoint};

use crate::{
    RouterConfig,
    backend::{Backend, BackendError, BackendEvent, BackendRequest, GeneratedToken, TokenStream},
    config::Policy,
};

/// Milliseconds a reservation may wait for its commit.
const LEASE_MS: u32 = 30_000;

/// How often the router asks each worker for its `Info` (liveness and load).
const POLL_EVERY: Duration = Duration::from_millis(250);
/// A worker that does not answer `Info` within this is considered dead.
const POLL_TIMEOUT: Duration = Duration::from_millis(1000);

/// Requests this router has in flight on one worker; the guard decrements on drop.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One worker as the router sees it.
#[derive(Debug)]
struct Worker {
    address: String,
    channel: Channel,
    /// Whether its last `Info` poll succeeded; in-flight streams watch it.
    alive: watch::Sender<bool>,
    /// Its last reported load.
    load: Mutex<Load>,
    /// Requests this router has in flight on it (exact, unlike the polled load).
    in_flight: Arc<AtomicUsize>,
    /// Its state layout, from `Info`.
    layout: Mutex<Option<StateLayout>>,
}

/// Workers of one role: polled for liveness and load, picked least-loaded among the live ones
/// (ties in turn).
#[derive(Debug)]
struct Pool {
    role: &'static str,
    workers: Vec<Arc<Worker>>,
    next: AtomicUsize,
}

impl Pool {
    fn new(role: &'static str, addresses: &[String]) -> Result<Self, String> {
        let workers = addresses
            .iter()
            .map(|a| {
                let channel = Endpoint::from_shared(format!("http://{a}"))
                    .map(|e| e.connect_timeout(POLL_TIMEOUT).connect_lazy())
                    .map_err(|e| format!("worker address {a}: {e}"))?;
                Ok(Arc::new(Worker {
                    address: a.clone(),
                    channel,
                    // Assumed alive until a poll says otherwise, so the first request after
                    // start does not wait for a poll.
                    alive: watch::Sender::new(true),
                    load: Mutex::new(Load::default()),
                    in_flight: Arc::new(AtomicUsize::new(0)),
                    layout: Mutex::new(None),
                }))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            role,
            workers,
            next: AtomicUsize::new(0),
        })
    }

    /// Polls every worker's `Info` until the pool is dropped.
    fn monitor(self: &Arc<Self>) {
        for worker in &self.workers {
            let worker = Arc::downgrade(worker);
            tokio::spawn(async move {
                loop {
                    let Some(w) = worker.upgrade() else { return };
                    let mut client = WorkerClient::new(w.channel.clone());
                    let polled =
                        tokio::time::timeout(POLL_TIMEOUT, client.info(InfoRequest {})).await;
                    match polled {
                        Ok(Ok(info)) => {
                            let info = info.into_inner();
                            *lock(&w.load) = info.load.unwrap_or_default();
                            if info.layout.is_some() {
                                *lock(&w.layout) = info.layout;
                            }
                            w.alive.send_if_modified(|a| !std::mem::replace(a, true));
                        }
                        _ => {
                            if w.alive.send_if_modified(|a| std::mem::replace(a, false)) {
                                tracing::warn!(worker = %w.address, "worker stopped answering");
                            }
                        }
                    }
                    drop(w);
                    tokio::time::sleep(POLL_EVERY).await;
                }
            });
        }
    }

    /// Live workers other than `exclude`, starting at a rotating position (so ties take
    /// turns).
    fn candidates(&self, exclude: Option<usize>) -> Vec<usize> {
        let n = self.workers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| Some(i) != exclude && *self.workers[i].alive.borrow())
            .collect()
    }

    /// Load order: requests this router has in flight there, then pages it holds.
    fn score(&self, i: usize) -> (usize, u64) {
        let w = &self.workers[i];
        let load = lock(&w.load);
        (
            w.in_flight.load(Ordering::Relaxed),
            load.pages_used.saturating_sub(load.pages_cached),
        )
    }

    /// A live worker other than `exclude`, chosen by `policy`; `preferred` is the
    /// prefix-affinity candidate (taken unless busier than the least loaded by more than
    /// `slack` requests).
    fn pick(
        &self,
        policy: Policy,
        exclude: Option<usize>,
        preferred: Option<usize>,
        slack: usize,
    ) -> Result<(usize, Arc<Worker>), BackendError> {
        let candidates = self.candidates(exclude);
        let least = candidates.iter().copied().min_by_key(|&i| self.score(i));
        let chosen = match policy {
            Policy::RoundRobin => candidates.first().copied(),
            Policy::LeastLoaded => least,
            Policy::PowerOfTwo => {
                // Two distinct pseudo-random live workers (a multiplicative hash of the turn
                // counter), the less loaded of them.
                let n = candidates.len();
                let h = (self.next.load(Ordering::Relaxed) as u64)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    >> 16;
                match n {
                    0 => None,
                    1 => Some(candidates[0]),
                    _ => {
                        let first = (h % n as u64) as usize;
                        let second = (first + 1 + ((h >> 24) % (n as u64 - 1)) as usize) % n;
                        let (a, b) = (candidates[first], candidates[second]);
                        Some(if self.score(b) < self.score(a) { b } else { a })
                    }
                }
            }
            Policy::PrefixAffinity => match (preferred, least) {
                (Some(p), Some(l))
                    if candidates.contains(&p) && self.score(p).0 <= self.score(l).0 + slack =>
                {
                    Some(p)
                }
                _ => least,
            },
        };
        chosen
            .map(|i| (i, Arc::clone(&self.workers[i])))
            .ok_or_else(|| BackendError::Unavailable(format!("no live {} worker", self.role)))
    }

    fn any_alive(&self) -> bool {
        self.workers.iter().any(|w| *w.alive.borrow())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Blocks of prompt whose prefill-worker owner is remembered, at most.
const AFFINITY_BLOCKS: usize = 1 << 16;

/// Which prefill worker last computed each prompt block (chained block keys, as the workers'
/// prefix caches key them); bounded, oldest forgotten first.
#[derive(Debug, Default)]
struct Affinity {
    owners: HashMap<BlockKey, usize>,
    order: VecDeque<BlockKey>,
}

impl Affinity {
    /// The worker that holds the longest known prefix of `keys`.
    fn preferred(&self, keys: &[BlockKey]) -> Option<usize> {
        keys.iter().rev().find_map(|k| self.owners.get(k).copied())
    }

    fn record(&mut self, keys: &[BlockKey], worker: usize) {
        for key in keys {
            if self.owners.insert(*key, worker).is_none() {
                self.order.push_back(*key);
            }
        }
        while self.order.len() > AFFINITY_BLOCKS {
            if let Some(old) = self.order.pop_front() {
                self.owners.remove(&old);
            }
        }
    }
}

/// The two-leg backend over static prefill and decode worker lists.
#[derive(Debug)]
pub struct PdBackend {
    prefill: Arc<Pool>,
    decode: Arc<Pool>,
    prefill_policy: Policy,
    decode_policy: Policy,
    slack: usize,
    affinity: Mutex<Affinity>,
}

fn status_error(what: &str, status: &tonic::Status) -> BackendError {
    let info = proto::error::from_status(status);
    match ErrorKind::try_from(info.kind).unwrap_or(ErrorKind::Internal) {
        ErrorKind::InvalidArgument => BackendError::Invalid(info.message),
        _ => BackendError::Unavailable(format!("{what}: {}", info.message)),
    }
}

/// A failed attempt, and whether another prefill worker may be tried (the prefill leg failed
/// for a reason other than the request itself, before any token was streamed).
struct Failed {
    error: BackendError,
    retry: bool,
}

impl PdBackend {
    /// The backend over the configured workers; starts polling them (call within a Tokio
    /// runtime).
    pub fn new(config: &RouterConfig) -> Result<Self, String> {
        if config.prefill_workers.is_empty() || config.decode_workers.is_empty() {
            return Err("the PD backend needs prefill and decode workers".to_owned());
        }
        let prefill = Arc::new(Pool::new("prefill", &config.prefill_workers)?);
        let decode = Arc::new(Pool::new("decode", &config.decode_workers)?);
        prefill.monitor();
        decode.monitor();
        Ok(Self {
            prefill,
            decode,
            prefill_policy: config.prefill_policy,
            decode_policy: config.decode_policy,
            slack: config.affinity_slack as usize,
            affinity: Mutex::new(Affinity::default()),
        })
    }

    /// Block keys of `prompt` at the prefill workers' page size (none until a layout is known).
    fn block_keys(&self, prompt: &[u32]) -> Vec<BlockKey> {
        let page_size = self.prefill.workers.iter().find_map(|w| {
            lock(&w.layout)
                .as_ref()
                .map(|l| l.page_size_tokens as usize)
        });
        match page_size {
            Some(ps) if ps > 0 && self.prefill_policy == Policy::PrefixAffinity => {
                block_keys(prompt, ps)
            }
            _ => Vec::new(),
        }
    }

    async fn prefill_layout(&self, worker: &Worker) -> Result<StateLayout, BackendError> {
        if let Some(layout) = lock(&worker.layout).clone() {
            return Ok(layout);
        }
        let info = WorkerClient::new(worker.channel.clone())
            .info(InfoRequest {})
            .await
            .map_err(|s| status_error("prefill worker", &s))?
            .into_inner();
        let layout = info.layout.ok_or_else(|| {
            BackendError::Unavailable("the prefill worker serves no model".to_owned())
        })?;
        *lock(&worker.layout) = Some(layout.clone());
        Ok(layout)
    }

    async fn start(&self, request: BackendRequest) -> Result<TokenStream, BackendError> {
        let id = uuid::Uuid::now_v7().to_string();
        let keys = self.block_keys(&request.prompt);
        let preferred = lock(&self.affinity).preferred(&keys);
        let (first, prefill) =
            self.prefill
                .pick(self.prefill_policy, None, preferred, self.slack)?;
        let (used, result) = match self.attempt(&request, &id, 1, &prefill).await {
            Ok(stream) => (first, Ok(stream)),
            Err(Failed { error, retry: true }) => {
                match self
                    .prefill
                    .pick(self.prefill_policy, Some(first), None, self.slack)
                {
                    Ok((other, worker)) => {
                        tracing::warn!(%error, worker = %prefill.address, "prefill failed; retrying once on another worker");
                        (
                            other,
                            self.attempt(&request, &id, 2, &worker)
                                .await
                                .map_err(|f| f.error),
                        )
                    }
                    Err(_) => (first, Err(error)),
                }
            }
            Err(failed) => (first, Err(failed.error)),
        };
        if result.is_ok() && !keys.is_empty() {
            lock(&self.affinity).record(&keys, used);
        }
        result
    }

    /// One try: reserve on a decode worker, open its stream, prefill on `prefill`.
    async fn attempt(
        &self,
        request: &BackendRequest,
        id: &str,
        attempt: u32,
        prefill: &Arc<Worker>,
    ) -> Result<TokenStream, Failed> {
        let fail = |error: BackendError| Failed {
            error,
            retry: false,
        };
        let (_, decode) = self
            .decode
            .pick(self.decode_policy, None, None, 0)
            .map_err(fail)?;
        let decode_guard = InFlight::new(&decode.in_flight);
        let layout = self
            .prefill_layout(prefill)
            .await
            .map_err(|error| Failed { error, retry: true })?;
        let request_id = RequestId {
            id: id.to_owned(),
            attempt,
        };
        let mut decode_client = DecodeClient::new(decode.channel.clone());
        let reserved = decode_client
            .reserve(ReserveRequest {
                request_id: Some(request_id.clone()),
                prompt_tokens: u32::try_from(request.prompt.len()).unwrap_or(u32::MAX),
                max_new_tokens: request.stop.max_tokens,
                lease_ms: LEASE_MS,
                prefill_layout: Some(layout),
                transports: vec![TransportKind::Tcp.into()],
            })
            .await
            .map_err(|s| fail(status_error("decode worker", &s)))?
            .into_inner();
        let destination = reserved.destination.ok_or_else(|| {
            fail(BackendError::Unavailable(
                "the decode worker returned no destination".to_owned(),
            ))
        })?;
        let sampling = wire::sampling_to_proto(&request.sampling);
        let stop = wire::stop_to_proto(&request.stop);
        let cancel_both = {
            let (d, p) = (decode.channel.clone(), prefill.channel.clone());
            let id = request_id.clone();
            move |reason: &str| {
                let (d, p, id, reason) = (d.clone(), p.clone(), id.clone(), reason.to_owned());
                tokio::spawn(async move {
                    let req = CancelRequest {
                        request_id: Some(id),
                        reason,
                    };
                    let _ = DecodeClient::new(d).cancel(req.clone()).await;
                    let _ = PrefillClient::new(p).cancel(req).await;
                });
            }
        };
        // The decode stream first: it waits for the commit the prefill sends.
        let stream = match decode_client
            .generate(GenerateRequest {
                reservation_id: destination.reservation_id.clone(),
                request_id: Some(request_id.clone()),
                sampling: Some(sampling.clone()),
                stop: Some(stop.clone()),
                prompt_token_ids: request.prompt.clone(),
                deadline_ms: 0,
            })
            .await
        {
            Ok(s) => s.into_inner(),
            Err(s) => {
                cancel_both("decode stream refused");
                return Err(fail(status_error("decode worker", &s)));
            }
        };
        let prefill_guard = InFlight::new(&prefill.in_flight);
        let prefilled = PrefillClient::new(prefill.channel.clone())
            .prefill(PrefillRequest {
                request_id: Some(request_id.clone()),
                prompt_token_ids: request.prompt.clone(),
                sampling: Some(sampling),
                stop: Some(stop),
                destination: Some(destination),
                decode_address: decode.address.clone(),
                checksums: false,
                deadline_ms: 0,
            })
            .await;
        drop(prefill_guard);
        let prefilled = match prefilled {
            Ok(r) => r.into_inner(),
            Err(s) => {
                cancel_both("prefill failed");
                let kind = ErrorKind::try_from(proto::error::from_status(&s).kind)
                    .unwrap_or(ErrorKind::Internal);
                return Err(Failed {
                    error: status_error("prefill worker", &s),
                    // The request itself is fine and nothing was streamed yet.
                    retry: !matches!(kind, ErrorKind::InvalidArgument | ErrorKind::Cancelled),
                });
            }
        };
        let cached = prefilled
            .usage
            .map_or(0, |u| u.cached_prompt_tokens as usize);
        let (tx, rx) = mpsc::unbounded_channel();
        let alive = decode.alive.subscribe();
        let forward = tokio::spawn(async move {
            let _guard = decode_guard;
            forward(stream, tx, cached, alive).await;
        });
        Ok(TokenStream::new(rx, move || {
            forward.abort();
            cancel_both("client went away");
        }))
    }
}

/// Decode's token batches as backend events; a stream that breaks or ends without a finish is
/// a failure, never a short answer.
async fn forward(
    mut stream: tonic::Streaming<TokenBatch>,
    tx: mpsc::UnboundedSender<BackendEvent>,
    cached_tokens: usize,
    mut alive: watch::Receiver<bool>,
) {
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            // A worker that stops answering polls fails its requests now rather than leaving
            // them hanging on a connection that may never close.
            dead = async { alive.wait_for(|a| !*a).await.is_ok() } => {
                if dead {
                    let _ = tx.send(BackendEvent::Failed(
                        "the decode worker stopped answering".to_owned(),
                    ));
                    return;
                }
                stream.message().await
            }
        };
        let batch = match message {
            Ok(Some(batch)) => batch,
            Ok(None) => {
                let _ = tx.send(BackendEvent::Failed(
                    "the decode stream ended without a finish".to_owned(),
                ));
                return;
            }
            Err(status) => {
                let info = proto::error::from_status(&status);
                let _ = tx.send(BackendEvent::Failed(format!(
                    "decode worker: {}",
                    info.message
                )));
                return;
            }
        };
        if !batch.tokens.is_empty() {
            let tokens = batch
                .tokens
                .iter()
                .map(|t| {
                    let s = token_from_proto(t);
                    GeneratedToken {
                        id: s.token,
                        logprob: s.logprob,
                        top_logprobs: s.top_logprobs,
                    }
                })
                .collect();
            if tx.send(BackendEvent::Tokens(tokens)).is_err() {
                return;
            }
        }
        let reason = proto::v1::FinishReason::try_from(batch.finish_reason)
            .unwrap_or(proto::v1::FinishReason::Error);
        let end = match reason {
            proto::v1::FinishReason::Unspecified => continue,
            proto::v1::FinishReason::Stop | proto::v1::FinishReason::Length => {
                let mut usage = wire::usage_from_proto(&batch.usage.unwrap_or_default());
                usage.cached_tokens = cached_tokens;
                BackendEvent::Finished {
                    reason: if reason == proto::v1::FinishReason::Stop {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    },
                    usage,
                }
            }
            proto::v1::FinishReason::Cancelled => {
                BackendEvent::Failed("the request was cancelled on the decode worker".to_owned())
            }
            proto::v1::FinishReason::Error => BackendEvent::Failed(format!(
                "decode worker: {}",
                batch.error.map(|e| e.message).unwrap_or_default()
            )),
        };
        let _ = tx.send(end);
        return;
    }
}

impl Backend for PdBackend {
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>> {
        Box::pin(self.start(request))
    }

    fn is_ready(&self) -> bool {
        self.prefill.any_alive() && self.decode.any_alive()
    }
}
