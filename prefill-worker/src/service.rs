//! The prefill side of a request: run the prompt on this worker's engine (chunked, batched with
//! other prompts, prefix-cached), sample the first token, write the prompt state into the
//! decode reservation, and commit it there. Any failure is an error to the caller and nothing
//! is committed; a caller that goes away cancels the prompt's computation.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use tracing::Instrument;
use worker_core::transports::{Offered, start_offered};

use common::fault::Fault;
use engine::{
    scheduler::{Event, GenerationRequest, PromptState},
    start::LoadedEngine,
};
use kv_transfer::{
    TransferError, handshake,
    stream::{Initiators, Piece, StateStream},
    ucx::Putter,
};
use proto::auth::Credentials;
use proto::v1::{
    Ack, CancelRequest, CommitRequest, ErrorInfo, ErrorKind, PrefillRequest, PrefillResponse,
    RequestId, Timings, TransportKind, Usage, decode_client::DecodeClient, prefill_server::Prefill,
};
use tonic::{Request, Response, Status};

/// The prefill worker's request handling.
pub struct PrefillWorker {
    engine: LoadedEngine,
    worker_id: String,
    next_id: AtomicU64,
    /// Engine ids of running prefills and their ranks, by (request id, attempt).
    running: Mutex<HashMap<(String, u32), (u64, usize)>>,
    /// Transports offered, in order of preference, and the UCX endpoint.
    offered: Offered<Putter>,
    /// The NCCL sender, when NCCL is offered.
    #[cfg(feature = "nccl")]
    nccl: Option<kv_transfer::nccl::NcclSender>,
    /// Send state parts as the engine produces them (else all after the forward passes).
    stream_state: bool,
    /// What calls to decode workers carry.
    credentials: Credentials,
    /// A deliberate corruption (tests of `pdctl verify` only).
    fault: Option<Fault>,
    /// Set when the worker drains: new requests are refused.
    draining: common::worker_info::DrainingFlag,
    /// The worker's own metrics (state transfers are recorded there).
    metrics: Option<Arc<worker_core::metrics::WorkerMetrics>>,
}

impl std::fmt::Debug for PrefillWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillWorker")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl worker_core::RoleWorker for PrefillWorker {
    type Ucx = Putter;
    fn offered(&self) -> &Offered<Putter> {
        &self.offered
    }
}

/// Cancels the engine request when the RPC is dropped before it finished.
struct CancelOnDrop {
    ranks: engine::parallel::group::Ranks,
    rank: usize,
    engine_id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let id = self.engine_id;
            let _ = self.ranks.post(self.rank, move |engine, subs| {
                subs.unsubscribe(id);
                engine.cancel(id);
            });
        }
    }
}

/// What the engine produced for one prompt.
struct Prefilled {
    first: engine::sampling::Sampled,
    state: PromptState,
    seed: u64,
    cached_tokens: usize,
    /// The slot already went with the state parts.
    slot_sent: bool,
    /// The prompt's log-probabilities, when they were asked for.
    prompt_logprobs: Vec<engine::sampling::Sampled>,
}

impl PrefillWorker {
    /// The worker over `engine`, offering `transports` (UCX is dropped, with a warning, when
    /// it cannot start here).
    pub fn new(
        engine: LoadedEngine,
        worker_id: String,
        mut transports: Vec<TransportKind>,
        stream_state: bool,
        credentials: Credentials,
    ) -> Self {
        let ucx = start_offered(&mut transports, TransportKind::Ucx, Putter::start);
        // Device 0: a worker sees its own GPU (CUDA_VISIBLE_DEVICES).
        #[cfg(feature = "nccl")]
        let nccl = start_offered(&mut transports, TransportKind::Nccl, || {
            kv_transfer::nccl::NcclSender::start(worker_id.clone(), 0, credentials.clone())
        });
        worker_core::transports::without_unbuilt_nccl(&mut transports, cfg!(feature = "nccl"));
        Self {
            engine,
            worker_id,
            next_id: AtomicU64::new(1),
            running: Mutex::new(HashMap::new()),
            offered: Offered {
                kinds: transports,
                ucx,
            },
            #[cfg(feature = "nccl")]
            nccl,
            stream_state,
            credentials,
            fault: None,
            draining: common::worker_info::DrainingFlag::default(),
            metrics: None,
        }
    }

    /// Records state transfers in `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<worker_core::metrics::WorkerMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Makes this worker corrupt what it sends, on purpose (see `common::fault`).
    #[must_use]
    pub fn with_fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    /// Refuses new requests once `draining` is set.
    #[must_use]
    pub fn with_draining(mut self, draining: common::worker_info::DrainingFlag) -> Self {
        self.draining = draining;
        self
    }

    /// Applies the injected fault, if any, to pieces about to be sent for a prompt of
    /// `prompt_len` tokens.
    fn corrupt(&self, pieces: &mut Vec<Piece>, prompt_len: usize) {
        match self.fault {
            Some(Fault::FlipPageByte) => {
                let page_size = (self.engine.layout.page_size_tokens as usize).max(1);
                let last = (prompt_len.max(1) - 1) / page_size;
                for p in pieces.iter_mut().filter(|p| p.page == Some(last)) {
                    // The high byte of an f32 in the middle of the piece: a large change.
                    let at = (p.data.len() / 8) * 4 + 3;
                    if let Some(b) = p.data.get_mut(at) {
                        *b ^= 0x40;
                    }
                }
            }
            Some(Fault::DropSlot) => pieces.retain(|p| p.page.is_some()),
            Some(Fault::SwapPages) => {
                for p in pieces.iter_mut() {
                    p.page = match p.page {
                        Some(0) => Some(1),
                        Some(1) => Some(0),
                        other => other,
                    };
                }
            }
            Some(Fault::ReorderBatch | Fault::StallEngine | Fault::StallRank | Fault::SlowLoad)
            | None => {}
        }
    }

    /// The rank to compute `prompt` on: the one the caller named, or by
    /// [`engine::parallel::group::prompt_rank`] (where its prefix is cached, else the least
    /// busy).
    async fn pick_rank(&self, named: Option<u32>, prompt: &[u32]) -> Result<usize, Status> {
        let ranks = &self.engine.ranks;
        if let Some(reason) = ranks.failure() {
            return Err(self.err(ErrorKind::Unavailable, reason));
        }
        if let Some(rank) = named {
            return if (rank as usize) < ranks.placeable() {
                Ok(rank as usize)
            } else {
                Err(self.err(
                    ErrorKind::InvalidArgument,
                    format!(
                        "prefill_rank {rank}: this worker places prompts on {} rank(s)",
                        ranks.placeable()
                    ),
                ))
            };
        }
        if ranks.placeable() == 1 {
            return Ok(0);
        }
        let page_size = self.engine.layout.page_size_tokens as usize;
        let keys = std::sync::Arc::new(engine::paged::prefix::block_keys(prompt, page_size.max(1)));
        let mut loads = Vec::with_capacity(ranks.len());
        let mut cached = Vec::with_capacity(ranks.len());
        for rank in 0..ranks.len() {
            let keys = std::sync::Arc::clone(&keys);
            let (load, blocks) = ranks
                .call(rank, move |engine, _| {
                    (
                        engine::runner::Runner::load_of(engine),
                        engine.store().prefix().cached_blocks(&keys),
                    )
                })
                .await
                .map_err(|_| self.err(ErrorKind::Internal, "the engine thread stopped"))?;
            loads.push(load);
            cached.push(blocks);
        }
        Ok(engine::parallel::group::prompt_rank(&loads, &cached))
    }

    fn err(&self, kind: ErrorKind, message: impl Into<String>) -> Status {
        proto::error::to_status(&ErrorInfo {
            kind: kind.into(),
            message: message.into(),
            worker_id: self.worker_id.clone(),
        })
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u32), (u64, usize)>> {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs the prompt, streaming its state into `stream` as it becomes final, and waits for
    /// its first token and exported state.
    async fn compute(
        &self,
        rank: usize,
        request: GenerationRequest,
        stream: &StateStream,
    ) -> Result<Prefilled, Status> {
        let (id, prompt_len) = (request.id, request.prompt.len());
        let mut events = self
            .engine
            .ranks
            .call(rank, move |engine, subs| {
                engine.add_prefill(request.clone())?;
                Ok::<_, engine::scheduler::EngineError>(subs.subscribe(id))
            })
            .await
            .map_err(|_| self.err(ErrorKind::Internal, "the engine thread stopped"))?
            .map_err(|e| self.err(ErrorKind::InvalidArgument, e.to_string()))?;
        let mut first = None;
        let mut prompt_logprobs = Vec::new();
        // Parts held back until the forward passes end, when not streaming.
        let mut held: Vec<Piece> = Vec::new();
        let mut slot_sent = false;
        // Made once, not per event: it resolves when the worker's ranks lose lockstep.
        let group_failed = self.engine.ranks.failed();
        tokio::pin!(group_failed);
        loop {
            let event = tokio::select! {
                event = events.recv() => event,
                // A hung rank sends nothing more: the group's failure ends its prompts.
                reason = &mut group_failed => Some(Event::Failed { id, error: reason }),
            };
            match event {
                Some(Event::Token { sampled, .. }) => first = Some(sampled),
                Some(Event::PromptLogprobs { entries, .. }) => prompt_logprobs = entries,
                Some(Event::StatePart { writes, .. }) => {
                    let pieces = writes
                        .into_iter()
                        .map(|w| Piece {
                            page: w.page,
                            offset: w.offset as u64,
                            data: w.bytes,
                        })
                        .collect::<Vec<_>>();
                    slot_sent |= pieces.iter().any(|p| p.page.is_none());
                    let mut pieces = pieces;
                    self.corrupt(&mut pieces, prompt_len);
                    if !self.stream_state {
                        held.extend(pieces);
                    } else if stream.send(pieces).is_err() {
                        // The transfer failed; finishing it reports why.
                        return Err(self.err(ErrorKind::TransferFailed, "state transfer stopped"));
                    }
                }
                Some(Event::Prefilled {
                    state,
                    seed,
                    cached_tokens,
                    ..
                }) => {
                    let first = first.ok_or_else(|| {
                        self.err(ErrorKind::Internal, "prefill ended without a first token")
                    })?;
                    if !held.is_empty() && stream.send(held).is_err() {
                        return Err(self.err(ErrorKind::TransferFailed, "state transfer stopped"));
                    }
                    return Ok(Prefilled {
                        first,
                        state,
                        seed,
                        cached_tokens,
                        slot_sent,
                        prompt_logprobs,
                    });
                }
                Some(Event::Failed { error, .. }) => {
                    return Err(self.err(ErrorKind::Internal, error));
                }
                Some(Event::Cancelled { .. }) => {
                    return Err(self.err(ErrorKind::Cancelled, "prefill cancelled"));
                }
                Some(Event::Finished { .. }) | None => {
                    return Err(self.err(
                        ErrorKind::Internal,
                        "the engine ended the prefill without its state",
                    ));
                }
            }
        }
    }
}

/// The gRPC adapter.
#[derive(Debug, Clone)]
pub struct PrefillService(pub Arc<PrefillWorker>);

#[tonic::async_trait]
impl Prefill for PrefillService {
    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        // Every line about this request carries the client's id.
        let span = tracing::info_span!("request", id = %proto::request_id_of(&request));
        common::logging::join_trace(request.metadata(), &span);
        async move {
            let w = &self.0;
            if w.draining.is_set() {
                return Err(w.draining.refusal());
            }
            let started = Instant::now();
            let req = request.into_inner();
            let request_id = req
                .request_id
                .clone()
                .ok_or_else(|| w.err(ErrorKind::InvalidArgument, "request_id is required"))?;
            if req.prompt_token_ids.is_empty() {
                return Err(w.err(ErrorKind::InvalidArgument, "the prompt is empty"));
            }
            let destination = req
                .destination
                .clone()
                .ok_or_else(|| w.err(ErrorKind::InvalidArgument, "destination is required"))?;
            handshake::check_layouts(
                &w.engine.layout,
                &destination.layout.clone().unwrap_or_default(),
            )
            .map_err(|e| proto::error::to_status(&e.info(&w.worker_id)))?;
            let sampling =
                proto::request::sampling_from_wire(&req.sampling.clone().unwrap_or_default())
                    .map_err(|e| w.err(ErrorKind::InvalidArgument, e.to_string()))?;
            let rank = w.pick_rank(req.prefill_rank, &req.prompt_token_ids).await?;
            let engine_id = w.next_id.fetch_add(1, Ordering::Relaxed);
            let key = (request_id.id.clone(), request_id.attempt);
            w.running().insert(key.clone(), (engine_id, rank));
            let mut guard = CancelOnDrop {
                ranks: w.engine.ranks.clone(),
                rank,
                engine_id,
                armed: true,
            };
            let generation = GenerationRequest {
                id: engine_id,
                prompt: req.prompt_token_ids.clone(),
                sampling,
                stop: proto::request::stop_from_wire(
                    &req.stop.clone().unwrap_or_default(),
                    &w.engine.eos_token_ids,
                ),
            };
            let work = async {
                let transfer_error =
                    |e: TransferError| proto::error::to_status(&e.info(&w.worker_id));
                let initiators = Initiators::new(&w.credentials, w.offered.ucx.as_ref());
                #[cfg(feature = "nccl")]
                let initiators = initiators.with_nccl(w.nccl.as_ref());
                let opened =
                    StateStream::open(&destination, &request_id, &w.offered.kinds, &initiators);
                let stream = opened.map_err(transfer_error)?;
                let computed = w.compute(rank, generation, &stream).await;
                let forward_end = Instant::now();
                let prefilled = match computed {
                    Ok(p) => p,
                    Err(status) => {
                        let stopped = proto::error::from_status(&status).kind
                            == i32::from(ErrorKind::TransferFailed);
                        if stopped && let Err(e) = stream.finish(Vec::new()).await {
                            // The transfer's own error says what went wrong.
                            return Err(transfer_error(e));
                        }
                        return Err(status);
                    }
                };
                let forward_ns = (forward_end - started).as_nanos();
                let report = stream
                    .finish(if prefilled.slot_sent || w.fault == Some(Fault::DropSlot) {
                        Vec::new()
                    } else {
                        vec![Piece {
                            page: None,
                            offset: 0,
                            data: prefilled.state.slot.clone(),
                        }]
                    })
                    .await
                    .map_err(transfer_error)?;
                let transferred = report.bytes;
                let transfer_ns = report.busy.as_nanos();
                if let Some(metrics) = &w.metrics {
                    metrics.transfer(transferred, report.busy.as_secs_f64());
                }
                let exposed_ns = report
                    .done
                    .saturating_duration_since(forward_end)
                    .as_nanos();
                let first_token = proto::request::token_to_wire(&prefilled.first);
                let channel = w
                    .credentials
                    .endpoint(&req.decode_address)
                    .map_err(|e| w.err(ErrorKind::InvalidArgument, e.to_string()))?
                    .connect()
                    .await
                    .map_err(|e| {
                        w.err(
                            ErrorKind::Unavailable,
                            format!("decode worker {}: {e}", req.decode_address),
                        )
                    })?;
                let mut decode = DecodeClient::new(w.credentials.channel(channel));
                decode
                    .commit(CommitRequest {
                        reservation_id: destination.reservation_id.clone(),
                        request_id: Some(request_id.clone()),
                        first_token: Some(first_token.clone()),
                        prompt_tokens: u32::try_from(req.prompt_token_ids.len())
                            .unwrap_or(u32::MAX),
                        seed: prefilled.seed,
                        checksums: if req.checksums {
                            kv_transfer::checksum::of_state(
                                &destination,
                                &prefilled.state.pages,
                                &prefilled.state.slot,
                            )
                        } else {
                            Vec::new()
                        },
                        transferred_bytes: transferred,
                    })
                    .await?;
                let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
                Ok::<_, Status>(PrefillResponse {
                    prefill_rank: u32::try_from(rank).unwrap_or(u32::MAX),
                    request_id: Some(request_id.clone()),
                    first_token: Some(first_token),
                    seed: prefilled.seed,
                    usage: Some(Usage {
                        prompt_tokens: n(req.prompt_token_ids.len()),
                        cached_prompt_tokens: n(prefilled.cached_tokens),
                        completion_tokens: 1,
                    }),
                    transferred_bytes: transferred,
                    prompt_logprobs: prefilled
                        .prompt_logprobs
                        .iter()
                        .map(proto::request::token_to_wire)
                        .collect(),
                    timings: Some(Timings {
                        forward_ns: u64::try_from(forward_ns).unwrap_or(u64::MAX),
                        transfer_ns: u64::try_from(transfer_ns).unwrap_or(u64::MAX),
                        exposed_transfer_ns: u64::try_from(exposed_ns).unwrap_or(u64::MAX),
                        total_ns: u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                        ..Timings::default()
                    }),
                    worker_id: w.worker_id.clone(),
                })
            };
            let result = if req.deadline_ms > 0 {
                tokio::time::timeout(Duration::from_millis(u64::from(req.deadline_ms)), work)
                    .await
                    .unwrap_or_else(|_| {
                        Err(w.err(
                            ErrorKind::DeadlineExceeded,
                            "prefill did not finish within its deadline",
                        ))
                    })
            } else {
                work.await
            };
            w.running().remove(&key);
            // The engine request has ended (state exported) unless this failed early.
            guard.armed = result.is_err();
            match &result {
                Ok(r) => tracing::info!(
                    internal = %request_id.id,
                    attempt = request_id.attempt,
                    prompt_tokens = req.prompt_token_ids.len(),
                    cached = r.usage.map_or(0, |u| u.cached_prompt_tokens),
                    rank,
                    transferred_bytes = r.transferred_bytes,
                    ms = started.elapsed().as_millis(),
                    "prefilled and handed over"
                ),
                Err(status) => tracing::warn!(
                    internal = %request_id.id,
                    attempt = request_id.attempt,
                    error = %status.message(),
                    "prefill failed"
                ),
            }
            result.map(Response::new)
        }
        .instrument(span)
        .await
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<Ack>, Status> {
        let w = &self.0;
        let req = request.into_inner();
        let Some(RequestId { id, attempt }) = req.request_id else {
            return Ok(Response::new(Ack {}));
        };
        let ids: Vec<(u64, usize)> = w
            .running()
            .iter()
            .filter(|((i, a), _)| *i == id && (*a == attempt || attempt == 0))
            .map(|(_, &e)| e)
            .collect();
        for (engine_id, rank) in ids {
            let _ = w.engine.ranks.post(rank, move |engine, subs| {
                if let Some(event) = engine.cancel(engine_id) {
                    subs.deliver(event);
                }
            });
        }
        Ok(Response::new(Ack {}))
    }
}
