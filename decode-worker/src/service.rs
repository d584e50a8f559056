//! The decode side of a request: `Reserve` (pages under a lease), `StateTransfer` writes into
//! them, `Commit` (first token and seed from the prefill) and `Generate` (the token stream),
//! in either order of the last two. A reservation has one owner (the router that reserved it)
//! and a deadline; an uncommitted one expires and frees its pages, and a stream that goes away
//! cancels its request.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use worker_core::transports::{Offered, start_offered};

use common::fault::Fault;
use engine::{
    runner::Runner,
    scheduler::{EngineError, Event, GenerationRequest, HandoffError},
    start::LoadedEngine,
};
use kv_transfer::{
    handshake,
    ucx::{Exporter, Region},
};
use proto::v1::{
    Ack, CancelRequest, CommitRequest, ErrorInfo, ErrorKind, GenerateRequest, GeneratedToken,
    PageRef, RequestId, ReserveRequest, ReserveResponse, StateLayout, TcpTarget, TokenBatch,
    TransferDescriptor, TransportKind, decode_server::Decode, transfer_descriptor::Target,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Leases are clamped to this range (milliseconds).
const LEASE_MS: (u32, u32) = (100, 600_000);

fn error(kind: ErrorKind, message: impl Into<String>, worker: &str) -> Status {
    proto::error::to_status(&ErrorInfo {
        kind: kind.into(),
        message: message.into(),
        worker_id: worker.to_owned(),
    })
}

/// A started request: its first token and the engine's events for the rest.
struct Started {
    first: GeneratedToken,
    events: mpsc::UnboundedReceiver<Event>,
}

struct Reservation {
    engine_id: u64,
    /// The rank whose pages hold the request (its engine runs it).
    rank: usize,
    request: RequestId,
    prompt_len: usize,
    /// Pool page numbers in sequence order.
    pages: Vec<u64>,
    commit: Option<(GeneratedToken, u64)>,
    generate: Option<(GenerateRequest, oneshot::Sender<Result<Started, Status>>)>,
    started: bool,
}

/// The decode worker's request handling.
pub struct DecodeWorker {
    engine: LoadedEngine,
    worker_id: String,
    /// host:port peers dial for `StateTransfer`.
    address: String,
    next_id: AtomicU64,
    reservations: Mutex<HashMap<String, Reservation>>,
    /// Transports offered, in order of preference, and the UCX endpoint.
    offered: Offered<Exporter>,
    /// The NCCL receiver, when NCCL is offered.
    #[cfg(feature = "nccl")]
    nccl: Option<kv_transfer::nccl::NcclReceiver>,
    /// Reservations waiting for room, first come first served.
    admission: crate::admission::Admission,
    /// A deliberate corruption (tests of `pdctl verify` only).
    fault: Option<Fault>,
    /// Set when the worker drains: new requests are refused.
    draining: common::worker_info::DrainingFlag,
    /// For [`Fault::ReorderBatch`]: the last token streamed, and to which engine request.
    last_token: Mutex<Option<(u64, GeneratedToken)>>,
    /// For [`Fault::StallRank`]: the rank has been stalled.
    stalled: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for DecodeWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWorker")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl worker_core::RoleWorker for DecodeWorker {
    type Ucx = Exporter;
    fn offered(&self) -> &Offered<Exporter> {
        &self.offered
    }
}

impl DecodeWorker {
    /// The worker over `engine`, offering `transports`. Offering UCX registers every rank's
    /// page and slot pools for remote writes (rank `r`'s as regions `2r` and `2r + 1`); if UCX
    /// cannot start here the worker offers the rest (with a warning).
    pub async fn new(
        engine: LoadedEngine,
        worker_id: String,
        address: String,
        mut transports: Vec<TransportKind>,
    ) -> Self {
        let mut regions = Ok(Vec::new());
        if transports.contains(&TransportKind::Ucx) {
            for runner in engine.ranks.runners() {
                let memory = runner.call(|engine, _| engine.state_memory()).await;
                if let (Ok(all), Ok(memory)) = (regions.as_mut(), memory) {
                    all.extend(memory.map(|(base, length)| Region { base, length }));
                } else {
                    regions = Err(());
                }
            }
        }
        let ucx = start_offered(&mut transports, TransportKind::Ucx, || match regions {
            Ok(regions) => Exporter::start(regions).map_err(|e| e.to_string()),
            Err(()) => Err("the engine stopped".to_owned()),
        });
        // Device 0: a worker sees its own GPU (CUDA_VISIBLE_DEVICES).
        #[cfg(feature = "nccl")]
        let nccl = start_offered(&mut transports, TransportKind::Nccl, || {
            kv_transfer::nccl::NcclReceiver::start(worker_id.clone(), 0)
        });
        worker_core::transports::without_unbuilt_nccl(&mut transports, cfg!(feature = "nccl"));
        Self {
            engine,
            worker_id,
            address,
            next_id: AtomicU64::new(1),
            reservations: Mutex::new(HashMap::new()),
            offered: Offered {
                kinds: transports,
                ucx,
            },
            #[cfg(feature = "nccl")]
            nccl,
            admission: crate::admission::Admission::default(),
            fault: None,
            draining: common::worker_info::DrainingFlag::default(),
            last_token: Mutex::new(None),
            stalled: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Makes this worker corrupt what it streams, on purpose (see `common::fault`).
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

    /// The token to stream for engine request `id`: under [`Fault::ReorderBatch`], the one
    /// streamed just before for a different request, if there was one.
    fn mix_up(&self, id: u64, token: GeneratedToken) -> GeneratedToken {
        if self.fault != Some(Fault::ReorderBatch) {
            return token;
        }
        let mut last = self
            .last_token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let out = match last.take() {
            Some((other, theirs)) if other != id => theirs,
            _ => token.clone(),
        };
        *last = Some((id, token));
        out
    }

    pub fn layout(&self) -> &StateLayout {
        &self.engine.layout
    }

    /// The runner of `rank` (a rank this worker has: reservations only name those).
    fn runner(&self, rank: usize) -> &Runner {
        self.engine
            .ranks
            .get(rank)
            .unwrap_or_else(|| self.engine.ranks.first())
    }

    fn err(&self, kind: ErrorKind, message: impl Into<String>) -> Status {
        error(kind, message, &self.worker_id)
    }

    fn stopped(&self) -> Status {
        self.err(ErrorKind::Internal, "the engine thread stopped")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Reservation>> {
        // A panic while holding the lock leaves the map consistent (every update is one
        // insert or remove), so a poisoned lock is still usable.
        self.reservations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts the request once both its commit and its generate call have arrived.
    async fn try_start(self: &Arc<Self>, reservation_id: &str) {
        let ready = {
            let mut map = self.lock();
            let Some(r) = map.get_mut(reservation_id) else {
                return;
            };
            if r.started || r.commit.is_none() || r.generate.is_none() {
                return;
            }
            r.started = true;
            match (r.commit.take(), r.generate.take()) {
                (Some(commit), Some(generate)) => {
                    Some((r.engine_id, r.rank, r.prompt_len, commit, generate))
                }
                _ => None,
            }
        };
        let Some((engine_id, rank, prompt_len, (first, seed), (request, reply))) = ready else {
            return;
        };
        let sampling = proto::request::sampling_from_wire(&request.sampling.unwrap_or_default());
        let stop = proto::request::stop_from_wire(
            &request.stop.unwrap_or_default(),
            &self.engine.eos_token_ids,
        );
        let prompt = request.prompt_token_ids;
        let result = if let Err(e) = &sampling {
            Err(self.err(ErrorKind::InvalidArgument, e.to_string()))
        } else if prompt.len() == prompt_len
            && let Ok(sampling) = sampling
        {
            let req = GenerationRequest {
                id: engine_id,
                prompt,
                sampling,
                stop,
            };
            let token = first.token_id;
            self.engine
                .ranks
                .call(rank, move |engine, subs| {
                    match engine.commit(req.clone(), token, seed) {
                        Ok(None) => Ok(subs.subscribe(engine_id)),
                        Ok(Some(done)) => {
                            let (tx, rx) = mpsc::unbounded_channel();
                            let _ = tx.send(done);
                            Ok(rx)
                        }
                        Err(e) => {
                            engine.release_reservation(engine_id);
                            Err(e)
                        }
                    }
                })
                .await
                .map_err(|_| self.stopped())
                .and_then(|r| r.map_err(|e| self.engine_error(&e)))
        } else {
            Err(self.err(
                ErrorKind::InvalidArgument,
                format!(
                    "generate sent {} prompt tokens; the reservation holds {prompt_len}",
                    prompt.len()
                ),
            ))
        };
        if result.is_err() {
            self.lock().remove(reservation_id);
            let _ = self
                .engine
                .ranks
                .call(rank, move |engine, _| engine.release_reservation(engine_id))
                .await;
        } else if self.fault == Some(Fault::StallRank) {
            self.stall_rank(rank);
        }
        let _ = reply.send(result.map(|events| Started { first, events }));
    }

    fn engine_error(&self, e: &EngineError) -> Status {
        let kind = match e {
            EngineError::Pool(_) => ErrorKind::Overloaded,
            EngineError::Handoff(HandoffError::Pool(_)) => ErrorKind::Internal,
            _ => ErrorKind::InvalidArgument,
        };
        self.err(kind, e.to_string())
    }

    /// Under [`Fault::StallRank`]: `rank` (the first request's) stops answering, once, as if
    /// its GPU hung mid-decode: it sends that request nothing more, and its peers time out.
    fn stall_rank(&self, rank: usize) {
        if self.stalled.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(rank, "fault stall-rank: the rank stops answering");
        let _ = self.runner(rank).post(|_, _| {
            loop {
                std::thread::park();
            }
        });
    }

    /// Drops the bookkeeping of a request whose stream ended.
    fn forget(&self, engine_id: u64) {
        self.lock().retain(|_, r| r.engine_id != engine_id);
        self.admission.freed();
        // A finished request's token is not handed to later ones: the fault mixes up only
        // requests that run at the same time.
        let mut last = self
            .last_token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.as_ref().is_some_and(|(id, _)| *id == engine_id) {
            *last = None;
        }
    }

    /// Expires `reservation_id` after `lease` unless it has started by then.
    fn arm_lease(self: &Arc<Self>, reservation_id: String, lease: Duration) {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            let expired = {
                let mut map = this.lock();
                match map.get(&reservation_id) {
                    Some(r) if !r.started => map.remove(&reservation_id),
                    _ => None,
                }
            };
            if let Some(r) = expired {
                tracing::warn!(reservation = %reservation_id, "reservation lease expired");
                let id = r.engine_id;
                let _ = this
                    .engine
                    .ranks
                    .call(r.rank, move |engine, _| engine.release_reservation(id))
                    .await;
                this.admission.freed();
                if let Some((_, reply)) = r.generate {
                    let _ = reply.send(Err(this.err(
                        ErrorKind::DeadlineExceeded,
                        "the reservation expired before it was committed",
                    )));
                }
            }
        });
    }

    /// Checks a call's reservation and request id; returns the engine id and its rank.
    fn check(
        &self,
        reservation_id: &str,
        request: Option<&RequestId>,
    ) -> Result<(u64, usize), Status> {
        let map = self.lock();
        let r = map.get(reservation_id).ok_or_else(|| {
            self.err(
                ErrorKind::NotFound,
                format!("no live reservation {reservation_id:?} (expired, cancelled or unknown)"),
            )
        })?;
        if request != Some(&r.request) {
            return Err(self.err(
                ErrorKind::InvalidArgument,
                format!("reservation {reservation_id:?} belongs to another request"),
            ));
        }
        Ok((r.engine_id, r.rank))
    }

    /// Reserves pages for a request on `rank` (on every rank of a replicated group, which
    /// must all give the same pages: their pools saw the same calls in the same order).
    async fn reserve_on(
        &self,
        rank: usize,
        engine_id: u64,
        prompt: usize,
        max_new: usize,
    ) -> Result<Result<engine::scheduler::Reservation, EngineError>, Status> {
        let reserve = move |engine: &mut engine::scheduler::Engine, _: &mut _| {
            engine.reserve(engine_id, prompt, max_new)
        };
        let ranks = &self.engine.ranks;
        if !ranks.is_replicated() {
            return ranks.call(rank, reserve).await.map_err(|_| self.stopped());
        }
        let all = ranks
            .call_each(rank, reserve)
            .await
            .map_err(|_| self.stopped())?;
        let mut all = all.into_iter();
        let first = all.next().ok_or_else(|| self.stopped())?;
        let same =
            |other: &Result<engine::scheduler::Reservation, EngineError>| match (&first, other) {
                (Ok(a), Ok(b)) => a.pages == b.pages && a.slot == b.slot,
                (Err(_), Err(_)) => true,
                _ => false,
            };
        if all.all(|other| same(&other)) {
            Ok(first)
        } else {
            Err(self.err(
                ErrorKind::Internal,
                "the worker's ranks reserved different pages for the same request",
            ))
        }
    }

    /// The ranks to try for a new reservation, best first: the one the caller named, or every
    /// rank by free pages.
    async fn candidate_ranks(&self, named: Option<u32>) -> Result<Vec<usize>, Status> {
        let ranks = &self.engine.ranks;
        if let Some(rank) = named {
            let rank = rank as usize;
            if rank >= ranks.placeable() {
                return Err(self.err(
                    ErrorKind::InvalidArgument,
                    format!(
                        "decode_rank {rank}: this worker places requests on {} rank(s)",
                        ranks.placeable()
                    ),
                ));
            }
            return Ok(vec![rank]);
        }
        if ranks.placeable() == 1 {
            return Ok(vec![0]);
        }
        let loads = ranks.loads().await.map_err(|_| self.stopped())?;
        Ok(engine::parallel::group::ranks_by_room(&loads))
    }
}

/// The gRPC adapter (the worker itself is shared with the `StateTransfer` sink).
#[derive(Debug, Clone)]
pub struct DecodeService(pub Arc<DecodeWorker>);

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        let w = &self.0;
        if w.draining.is_set() {
            return Err(w.draining.refusal());
        }
        let client_id = proto::request_id_of(&request).to_owned();
        let req = request.into_inner();
        let request_id = req
            .request_id
            .clone()
            .ok_or_else(|| w.err(ErrorKind::InvalidArgument, "request_id is required"))?;
        let theirs = req.prefill_layout.clone().unwrap_or_default();
        handshake::check_layouts(w.layout(), &theirs)
            .map_err(|e| proto::error::to_status(&e.info(&w.worker_id)))?;
        // Only a transport this worker offers (NCCL may be compiled in but not started).
        let transport =
            handshake::negotiate(&req.transports, &w.offered.kinds).ok_or_else(|| {
                w.err(
                    ErrorKind::InvalidArgument,
                    format!(
                        "no transport in common (this worker offers {:?})",
                        w.offered.kinds
                    ),
                )
            })?;
        if let Some(reason) = w.engine.ranks.failure() {
            return Err(w.err(ErrorKind::Unavailable, reason));
        }
        let engine_id = w.next_id.fetch_add(1, Ordering::Relaxed);
        let (prompt, max_new) = (req.prompt_tokens as usize, req.max_new_tokens as usize);
        // A full worker: wait in line (first come, first served) as long as the caller allows.
        let until = Instant::now() + Duration::from_millis(u64::from(req.queue_timeout_ms));
        let mut ticket = w.admission.ticket();
        let (rank, reservation) = 'placed: loop {
            if ticket.may_try() {
                let ranks = w.candidate_ranks(req.decode_rank).await?;
                let last = ranks.len() - 1;
                for (i, rank) in ranks.into_iter().enumerate() {
                    let tried = w.reserve_on(rank, engine_id, prompt, max_new).await?;
                    match tried {
                        Ok(reservation) => break 'placed (rank, reservation),
                        // Another rank may have room (each rank has its own pool).
                        Err(EngineError::Pool(_)) if i < last || Instant::now() < until => {}
                        Err(e) => return Err(w.engine_error(&e)),
                    }
                }
            }
            if !ticket.wait(until).await {
                return Err(w.err(
                    ErrorKind::Overloaded,
                    format!(
                        "no room for the request within {} ms (request slots and pages in use)",
                        req.queue_timeout_ms
                    ),
                ));
            }
        };
        drop(ticket);
        let reservation_id = format!("{}-{engine_id}", w.worker_id);
        let lease_ms = req.lease_ms.clamp(LEASE_MS.0, LEASE_MS.1);
        // Rank r's pages and slots are UCX regions 2r and 2r + 1.
        let region = u32::try_from(2 * rank).unwrap_or(u32::MAX);
        let destination = TransferDescriptor {
            decode_rank: u32::try_from(rank).unwrap_or(u32::MAX),
            // A replicated group (tensor parallelism) holds a copy of the state on every rank.
            replicas: if w.engine.ranks.is_replicated() {
                u32::try_from(w.engine.ranks.len()).unwrap_or(u32::MAX)
            } else {
                1
            },
            transport: transport.into(),
            reservation_id: reservation_id.clone(),
            decode_worker_id: w.worker_id.clone(),
            layout: Some(w.layout().clone()),
            pages: reservation
                .pages
                .iter()
                .map(|&(page, offset)| PageRef {
                    region,
                    page: u64::from(page),
                    offset_bytes: offset,
                })
                .collect(),
            // Pages live in the rank's page pool, the slot in its slot pool.
            slot: Some(PageRef {
                region: region + 1,
                page: u64::from(reservation.slot.0),
                offset_bytes: reservation.slot.1,
            }),
            target: Some(match (transport, &w.offered.ucx) {
                (TransportKind::Ucx, Some(ucx)) => Target::Ucx(ucx.target().clone()),
                #[cfg(feature = "nccl")]
                (TransportKind::Nccl, _) if w.nccl.is_some() => {
                    Target::Nccl(kv_transfer::nccl::target(&w.address))
                }
                _ => Target::Tcp(TcpTarget {
                    address: w.address.clone(),
                }),
            }),
        };
        tracing::info!(
            request = %client_id,
            internal = %request_id.id,
            attempt = request_id.attempt,
            pages = reservation.pages.len(),
            rank,
            "reserved pages for the prompt's state"
        );
        w.lock().insert(
            reservation_id.clone(),
            Reservation {
                engine_id,
                rank,
                request: request_id,
                prompt_len: prompt,
                pages: reservation
                    .pages
                    .iter()
                    .map(|&(p, _)| u64::from(p))
                    .collect(),
                commit: None,
                generate: None,
                started: false,
            },
        );
        w.arm_lease(reservation_id, Duration::from_millis(u64::from(lease_ms)));
        Ok(Response::new(ReserveResponse {
            destination: Some(destination),
            lease_ms,
        }))
    }

    async fn commit(&self, request: Request<CommitRequest>) -> Result<Response<Ack>, Status> {
        let w = &self.0;
        let req = request.into_inner();
        w.check(&req.reservation_id, req.request_id.as_ref())?;
        if !req.checksums.is_empty() {
            let (engine_id, rank) = w.check(&req.reservation_id, req.request_id.as_ref())?;
            let checksums = req.checksums.clone();
            // Every copy of the state is checked (each rank of a replicated group holds one).
            let verified = w
                .engine
                .ranks
                .call_each(rank, move |engine, _| {
                    kv_transfer::checksum::verify(&checksums, |page| {
                        engine.reserved_bytes(engine_id, page).ok()
                    })
                })
                .await
                .map_err(|_| w.stopped())?
                .into_iter()
                .collect::<Result<Vec<()>, _>>();
            if let Err(e) = verified {
                // The state is wrong: the request fails on both legs, its pages are freed.
                let removed = w.lock().remove(&req.reservation_id);
                let _ = w
                    .engine
                    .ranks
                    .call(rank, move |engine, _| engine.release_reservation(engine_id))
                    .await;
                let status = proto::error::to_status(&e.info(&w.worker_id));
                if let Some((_, reply)) = removed.and_then(|r| r.generate) {
                    let _ = reply.send(Err(status.clone()));
                }
                return Err(status);
            }
        }
        let first = req
            .first_token
            .ok_or_else(|| w.err(ErrorKind::InvalidArgument, "first_token is required"))?;
        {
            let mut map = w.lock();
            let Some(r) = map.get_mut(&req.reservation_id) else {
                return Err(w.err(ErrorKind::NotFound, "the reservation expired"));
            };
            if r.prompt_len != req.prompt_tokens as usize {
                return Err(w.err(
                    ErrorKind::InvalidArgument,
                    format!(
                        "commit for {} prompt tokens; the reservation holds {}",
                        req.prompt_tokens, r.prompt_len
                    ),
                ));
            }
            if r.commit.is_some() || r.started {
                return Err(w.err(ErrorKind::InvalidArgument, "already committed"));
            }
            r.commit = Some((first, req.seed));
        }
        w.try_start(&req.reservation_id).await;
        Ok(Response::new(Ack {}))
    }

    type GenerateStream = ReceiverStream<Result<TokenBatch, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let w = Arc::clone(&self.0);
        let span = tracing::info_span!("request", id = %proto::request_id_of(&request));
        common::logging::join_trace(request.metadata(), &span);
        let req = request.into_inner();
        let (engine_id, rank) = w.check(&req.reservation_id, req.request_id.as_ref())?;
        let reservation_id = req.reservation_id.clone();
        let request_id = req.request_id.clone();
        let (started_tx, started_rx) = oneshot::channel();
        {
            let mut map = w.lock();
            let Some(r) = map.get_mut(&reservation_id) else {
                return Err(w.err(ErrorKind::NotFound, "the reservation expired"));
            };
            if r.generate.is_some() || r.started {
                return Err(w.err(ErrorKind::InvalidArgument, "already generating"));
            }
            r.generate = Some((req, started_tx));
        }
        w.try_start(&reservation_id).await;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(
            stream_tokens(w, (engine_id, rank), request_id, started_rx, tx).instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<Ack>, Status> {
        let w = &self.0;
        let req = request.into_inner();
        let found = {
            let mut map = w.lock();
            let key = map
                .iter()
                .find(|(_, r)| Some(&r.request) == req.request_id.as_ref())
                .map(|(k, _)| k.clone());
            key.and_then(|k| map.remove(&k))
        };
        if let Some(r) = found {
            if let Some((_, reply)) = r.generate {
                let _ = reply.send(Err(w.err(ErrorKind::Cancelled, req.reason.clone())));
            }
            // Releases the reservation, or stops the running request (its stream then ends
            // with FINISH_REASON_CANCELLED).
            let id = r.engine_id;
            let _ = w
                .engine
                .ranks
                .call(r.rank, move |engine, subs| {
                    if let Some(event) = engine.cancel(id) {
                        subs.deliver(event);
                    }
                })
                .await;
            w.admission.freed();
        }
        Ok(Response::new(Ack {}))
    }
}

mod feed;
mod sink;

use feed::stream_tokens;
