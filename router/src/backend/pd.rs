//! The disaggregated backend: each request takes two legs. The router reserves pages on a
//! decode worker (under a lease), opens the decode stream, and asks a prefill worker to compute
//! the prompt, write its state into those pages and commit; the decode worker then streams the
//! tokens, the prefill's first token first. A failure on either leg cancels the other and ends
//! the request with an error; dropping the token stream (client gone) cancels both legs.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use proto::request::{BlockKey, block_keys};
use proto::v1::{
    ErrorKind, GenerateRequest, InfoRequest, PrefillRequest, RequestId, ReserveRequest,
    StateLayout, TransportKind, decode_client::DecodeClient, prefill_client::PrefillClient,
    worker_client::WorkerClient,
};
use tokio::sync::mpsc;

mod forward;
mod legs;

use forward::forward;
use legs::Legs;

use crate::{
    RouterConfig,
    backend::workers::{InFlight, Worker, Workers, lock},
    backend::{Backend, BackendError, BackendEvent, BackendRequest, GeneratedToken, TokenStream},
    config::Policy,
};

/// Milliseconds a reservation may wait for its commit.
const LEASE_MS: u32 = 30_000;

/// Blocks of prompt whose prefill-worker owner is remembered, at most.
const AFFINITY_BLOCKS: usize = 1 << 16;

/// Which prefill worker last computed each prompt block (chained block keys, as the workers'
/// prefix caches key them); bounded, oldest forgotten first.
#[derive(Debug, Default)]
struct Affinity {
    owners: HashMap<BlockKey, Arc<str>>,
    order: VecDeque<BlockKey>,
}

impl Affinity {
    /// The worker (id) that holds the longest known prefix of `keys`.
    fn preferred(&self, keys: &[BlockKey]) -> Option<Arc<str>> {
        keys.iter().rev().find_map(|k| self.owners.get(k).cloned())
    }

    fn record(&mut self, keys: &[BlockKey], worker: &Arc<str>) {
        for key in keys {
            if self.owners.insert(*key, Arc::clone(worker)).is_none() {
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
    workers: Arc<Workers>,
    prefill_policy: Policy,
    decode_policy: Policy,
    slack: usize,
    affinity: Mutex<Affinity>,
    checksums: bool,
    /// How long a request waits for room on a decode worker.
    queue_timeout: Duration,
}

/// A failed attempt, and whether another prefill worker may be tried (the prefill leg failed
/// for a reason other than the request itself, before any token was streamed).
struct Failed {
    error: BackendError,
    retry: bool,
}

impl Failed {
    /// A failure another prefill worker may get past.
    fn retry(error: BackendError) -> Self {
        Self { error, retry: true }
    }

    /// A failure that ends the request.
    fn final_(error: BackendError) -> Self {
        Self {
            error,
            retry: false,
        }
    }
}

impl PdBackend {
    /// The backend over `workers` (static and registered).
    pub fn new(config: &RouterConfig, workers: Arc<Workers>) -> Self {
        Self {
            workers,
            prefill_policy: config.prefill_policy,
            decode_policy: config.decode_policy,
            slack: config.affinity_slack as usize,
            affinity: Mutex::new(Affinity::default()),
            checksums: config.transfer_checksums,
            queue_timeout: Duration::from_millis(u64::from(config.queue_timeout_ms)),
        }
    }

    /// Block keys of `prompt` at the prefill workers' page size (none until a layout is known).
    fn block_keys(&self, prompt: &[u32]) -> Vec<BlockKey> {
        let page_size = self.workers.prefill.snapshot().iter().find_map(|w| {
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
            .map_err(|s| BackendError::from_status("prefill worker", &s))?
            .into_inner();
        let layout = info.layout.ok_or_else(|| {
            BackendError::unavailable("the prefill worker serves no model".to_owned())
        })?;
        *lock(&worker.layout) = Some(layout.clone());
        *lock(&worker.transports) = info.transports;
        Ok(layout)
    }

    async fn start(&self, request: BackendRequest) -> Result<TokenStream, BackendError> {
        let id = uuid::Uuid::now_v7().to_string();
        let keys = self.block_keys(&request.prompt);
        let preferred = lock(&self.affinity).preferred(&keys);
        let pool = &self.workers.prefill;
        let prefill = pool.pick(self.prefill_policy, None, preferred.as_deref(), self.slack)?;
        let (used, result) = match self.attempt(&request, &id, 1, &prefill).await {
            Ok(stream) => (prefill, Ok(stream)),
            Err(Failed { error, retry: true }) => {
                match pool.pick(self.prefill_policy, Some(&prefill), None, self.slack) {
                    Ok(other) => {
                        crate::metrics::prefill_retry();
                        tracing::warn!(%error, worker = %prefill.address, "prefill failed; retrying once on another worker");
                        let result = self
                            .attempt(&request, &id, 2, &other)
                            .await
                            .map_err(|f| f.error);
                        (other, result)
                    }
                    Err(_) => (prefill, Err(error)),
                }
            }
            Err(failed) => (prefill, Err(failed.error)),
        };
        if result.is_ok() && !keys.is_empty() {
            let id: Arc<str> = lock(&used.id).as_str().into();
            lock(&self.affinity).record(&keys, &id);
        }
        result
    }

    /// One try, in named steps: reserve pages on a decode worker, open its stream, prefill on
    /// `prefill`, then forward the decode stream. From the reservation on, both legs are held
    /// by one guard ([`Legs`]) that cancels them on every exit before the stream is handed out.
    async fn attempt(
        &self,
        request: &BackendRequest,
        id: &str,
        attempt: u32,
        prefill: &Arc<Worker>,
    ) -> Result<TokenStream, Failed> {
        let request_id = RequestId {
            id: id.to_owned(),
            attempt,
        };
        let reserve = self
            .reservation(request, &request_id, prefill)
            .await
            .map_err(Failed::retry)?;
        let (decode, reserved) = self.reserve(&reserve, &request.request_id).await?;
        let mut legs = Legs::new(&decode, prefill, &request_id);
        let decode_guard = InFlight::new(&decode);
        let transport = reserved.destination.as_ref().map_or(0, |d| d.transport);
        let decode_rank = reserved.destination.as_ref().map_or(0, |d| d.decode_rank);
        let destination = reserved.destination.ok_or_else(|| {
            Failed::final_(BackendError::unavailable(
                "the decode worker returned no destination".to_owned(),
            ))
        })?;
        let (sampling, stop) = (
            proto::request::sampling_to_wire(&request.sampling),
            proto::request::stop_to_wire(&request.stop),
        );
        // The decode stream first: it waits for the commit the prefill sends.
        legs.on_failure("decode stream refused");
        let stream = DecodeClient::new(decode.channel.clone())
            .generate(traced(
                GenerateRequest {
                    reservation_id: destination.reservation_id.clone(),
                    request_id: Some(request_id.clone()),
                    // The prompt is computed, and its log-probabilities reported, by prefill.
                    sampling: Some(proto::v1::SamplingParams {
                        prompt_logprobs: None,
                        ..sampling.clone()
                    }),
                    stop: Some(stop.clone()),
                    prompt_token_ids: request.prompt.clone(),
                    deadline_ms: 0,
                },
                &request.request_id,
            ))
            .await
            .map_err(|s| Failed::final_(BackendError::from_status("decode worker", &s)))?
            .into_inner();
        legs.on_failure("prefill failed");
        let prefilled = self
            .prefill(
                prefill,
                &request.request_id,
                PrefillRequest {
                    request_id: Some(request_id),
                    prompt_token_ids: request.prompt.clone(),
                    sampling: Some(sampling),
                    stop: Some(stop),
                    destination: Some(destination),
                    decode_address: decode.address.clone(),
                    checksums: self.checksums,
                    deadline_ms: 0,
                    // The worker places the prompt on its least busy rank (it sees its ranks
                    // now; this router's picture is a poll old) and says which in the answer.
                    prefill_rank: None,
                },
            )
            .await?;
        tracing::info!(
            internal = %id,
            attempt,
            prefill = %prefill.address,
            prefill_rank = prefilled.prefill_rank,
            decode = %decode.address,
            decode_rank,
            "prompt state handed over"
        );
        let cached = prefilled
            .usage
            .map_or(0, |u| u.cached_prompt_tokens as usize);
        let timings = prefilled.timings.unwrap_or_default();
        crate::metrics::transfer(
            TransportKind::try_from(transport).unwrap_or(TransportKind::Tcp),
            prefilled.transferred_bytes,
            timings.transfer_ns,
            timings.exposed_transfer_ns,
        );
        let (tx, rx) = mpsc::unbounded_channel();
        if request.sampling.prompt_logprobs.is_some() {
            // One entry per prompt token after the first, or the answer would be short.
            if prefilled.prompt_logprobs.len() + 1 != request.prompt.len() {
                return Err(Failed::final_(BackendError::internal(format!(
                    "the prefill worker returned {} prompt log-probabilities for {} prompt tokens",
                    prefilled.prompt_logprobs.len(),
                    request.prompt.len()
                ))));
            }
            let entries = prefilled
                .prompt_logprobs
                .iter()
                .map(|t| GeneratedToken::from(proto::request::token_from_wire(t)))
                .collect();
            let _ = tx.send(BackendEvent::PromptLogprobs(entries));
        }
        let alive = decode.alive.subscribe();
        let forward = tokio::spawn(async move {
            let _guard = decode_guard;
            forward(stream, tx, cached, alive).await;
        });
        // Handed out: from here the stream cancels both legs if it is dropped before its end.
        let cancel = legs.hand_over();
        Ok(TokenStream::new(rx, move || {
            forward.abort();
            cancel("client went away");
        }))
    }

    /// Step 1: what to reserve on a decode worker for `request` from `prefill` (its layout and
    /// its transports in order of preference).
    async fn reservation(
        &self,
        request: &BackendRequest,
        request_id: &RequestId,
        prefill: &Worker,
    ) -> Result<ReserveRequest, BackendError> {
        let layout = self.prefill_layout(prefill).await?;
        Ok(ReserveRequest {
            request_id: Some(request_id.clone()),
            prompt_tokens: u32::try_from(request.prompt.len()).unwrap_or(u32::MAX),
            max_new_tokens: request.stop.max_tokens,
            lease_ms: LEASE_MS,
            queue_timeout_ms: u32::try_from(self.queue_timeout.as_millis()).unwrap_or(u32::MAX),
            prefill_layout: Some(layout),
            // The worker places the request on its rank with the most free pages and names
            // that rank in the descriptor, which the prefill worker writes by.
            decode_rank: None,
            // The prefill worker's preference; TCP until its first `Info` says more.
            transports: {
                let offered = lock(&prefill.transports).clone();
                if offered.is_empty() {
                    vec![TransportKind::Tcp.into()]
                } else {
                    offered
                }
            },
        })
    }

    /// Step 2: pages on a decode worker. One that is full or unreachable: try one other; when
    /// every one is full, wait for room (requests finish all the time) up to the queue timeout.
    async fn reserve(
        &self,
        reserve: &ReserveRequest,
        client_id: &str,
    ) -> Result<(Arc<Worker>, proto::v1::ReserveResponse), Failed> {
        let queued = crate::metrics::Queued::enter();
        let queued_until = Instant::now() + self.queue_timeout;
        let mut backoff = Duration::from_millis(5);
        let pool = &self.workers.decode;
        let kind_of = |r: &Result<_, tonic::Status>| {
            r.as_ref().err().map(|status| {
                ErrorKind::try_from(proto::error::from_status(status).kind)
                    .unwrap_or(ErrorKind::Internal)
            })
        };
        let (decode, result) = loop {
            let mut decode = pool
                .pick(self.decode_policy, None, None, 0)
                .map_err(Failed::final_)?;
            let mut result = DecodeClient::new(decode.channel.clone())
                .reserve(traced(reserve.clone(), client_id))
                .await;
            if matches!(
                kind_of(&result),
                Some(ErrorKind::Overloaded | ErrorKind::Unavailable)
            ) && let Ok(other) = pool.pick(self.decode_policy, Some(&decode), None, 0)
            {
                decode = other;
                result = DecodeClient::new(decode.channel.clone())
                    .reserve(traced(reserve.clone(), client_id))
                    .await;
            }
            let full = kind_of(&result) == Some(ErrorKind::Overloaded);
            if !full || Instant::now() + backoff > queued_until {
                break (decode, result);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(100));
        };
        drop(queued);
        let reserved = result
            .map_err(|s| Failed::final_(BackendError::from_status("decode worker", &s)))?
            .into_inner();
        Ok((decode, reserved))
    }

    /// Step 4: the prompt on `prefill`, its state written into the reservation and committed.
    /// A failure may be retried on another prefill worker unless the request itself is at
    /// fault (nothing was streamed yet).
    async fn prefill(
        &self,
        prefill: &Arc<Worker>,
        client_id: &str,
        request: PrefillRequest,
    ) -> Result<proto::v1::PrefillResponse, Failed> {
        let _in_flight = InFlight::new(prefill);
        match PrefillClient::new(prefill.channel.clone())
            .prefill(traced(request, client_id))
            .await
        {
            Ok(response) => Ok(response.into_inner()),
            Err(s) => {
                let kind = ErrorKind::try_from(proto::error::from_status(&s).kind)
                    .unwrap_or(ErrorKind::Internal);
                // The worker's own refusal (its structured error in the details) of a bad or
                // cancelled request would come again. A call that broke in transport (no
                // details: a connection to a worker that died reads as "cancelled") may be
                // retried elsewhere.
                let reported = !s.details().is_empty();
                Err(Failed {
                    error: BackendError::from_status("prefill worker", &s),
                    retry: !(reported
                        && matches!(kind, ErrorKind::InvalidArgument | ErrorKind::Cancelled)),
                })
            }
        }
    }
}

impl Backend for PdBackend {
    fn submit(&self, request: BackendRequest) -> BoxFuture<'_, Result<TokenStream, BackendError>> {
        Box::pin(self.start(request))
    }

    fn is_ready(&self) -> bool {
        self.workers.prefill.any_alive() && self.workers.decode.any_alive()
    }
}

/// `message` as a worker call carrying the client's request id and the request's trace context.
fn traced<T>(message: T, client_id: &str) -> tonic::Request<T> {
    let mut request = proto::with_request_id(message, client_id);
    common::logging::inject_trace_context(request.metadata_mut());
    request
}
