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

use engine::{
    runner::{LoadedEngine, Runner},
    scheduler::{Event, GenerationRequest, PromptState},
    wire,
};
use kv_transfer::{
    TransferError, handshake,
    ucx::{Put, Putter},
};
use proto::v1::{
    Ack, CancelRequest, CommitRequest, ErrorInfo, ErrorKind, PrefillRequest, PrefillResponse,
    RequestId, Timings, TransferDescriptor, TransportKind, Usage, decode_client::DecodeClient,
    prefill_server::Prefill, transfer_descriptor::Target,
};
use tonic::{Request, Response, Status};

/// The prefill worker's request handling.
pub struct PrefillWorker {
    engine: LoadedEngine,
    worker_id: String,
    next_id: AtomicU64,
    /// Engine ids of running prefills, by (request id, attempt).
    running: Mutex<HashMap<(String, u32), u64>>,
    /// Transports offered, in order of preference.
    transports: Vec<TransportKind>,
    /// The UCX initiator, when UCX is offered.
    ucx: Option<Putter>,
}

impl std::fmt::Debug for PrefillWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillWorker")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

/// Cancels the engine request when the RPC is dropped before it finished.
struct CancelOnDrop {
    runner: Runner,
    engine_id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let id = self.engine_id;
            let _ = self.runner.post(move |engine, subs| {
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
}

impl PrefillWorker {
    /// The worker over `engine`, offering `transports` (UCX is dropped, with a warning, when
    /// it cannot start here).
    pub fn new(
        engine: LoadedEngine,
        worker_id: String,
        mut transports: Vec<TransportKind>,
    ) -> Self {
        let mut ucx = None;
        if transports.contains(&TransportKind::Ucx) {
            match Putter::start() {
                Ok(putter) => ucx = Some(putter),
                Err(e) => {
                    tracing::warn!(error = %e, "UCX unavailable; not offering it");
                    transports.retain(|t| *t != TransportKind::Ucx);
                }
            }
        }
        Self {
            engine,
            worker_id,
            next_id: AtomicU64::new(1),
            running: Mutex::new(HashMap::new()),
            transports,
            ucx,
        }
    }

    /// The transports this worker offers (after start-up checks).
    pub fn transports(&self) -> &[TransportKind] {
        &self.transports
    }

    /// Writes the prompt state into the destination with its negotiated transport.
    async fn write_state(
        &self,
        destination: &TransferDescriptor,
        request_id: &RequestId,
        state: &PromptState,
    ) -> Result<u64, TransferError> {
        match (
            TransportKind::try_from(destination.transport),
            &destination.target,
        ) {
            (Ok(TransportKind::Tcp), _) if self.transports.contains(&TransportKind::Tcp) => {
                kv_transfer::tcp::send_state(destination, request_id, &state.pages, &state.slot)
                    .await
            }
            (Ok(TransportKind::Ucx), Some(Target::Ucx(target))) => {
                let putter = self.ucx.as_ref().ok_or_else(|| {
                    TransferError::Descriptor("this worker does not offer UCX".to_owned())
                })?;
                let slot = destination
                    .slot
                    .ok_or_else(|| TransferError::Descriptor("no state slot".to_owned()))?;
                if state.pages.len() > destination.pages.len() {
                    return Err(TransferError::Descriptor(format!(
                        "{} pages of state but {} reserved",
                        state.pages.len(),
                        destination.pages.len()
                    )));
                }
                let mut puts: Vec<Put> = state
                    .pages
                    .iter()
                    .zip(&destination.pages)
                    .map(|(bytes, page)| Put {
                        region: page.region as usize,
                        offset: page.offset_bytes,
                        data: bytes.clone(),
                    })
                    .collect();
                puts.push(Put {
                    region: slot.region as usize,
                    offset: slot.offset_bytes,
                    data: state.slot.clone(),
                });
                putter.put(target.clone(), puts).await
            }
            (kind, _) => Err(TransferError::Descriptor(format!(
                "transport {kind:?} is not offered by this worker or lacks its target"
            ))),
        }
    }

    fn err(&self, kind: ErrorKind, message: impl Into<String>) -> Status {
        proto::error::to_status(&ErrorInfo {
            kind: kind.into(),
            message: message.into(),
            worker_id: self.worker_id.clone(),
        })
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u32), u64>> {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs the prompt and waits for its first token and exported state.
    async fn compute(&self, request: GenerationRequest) -> Result<Prefilled, Status> {
        let id = request.id;
        let mut events = self
            .engine
            .runner
            .call(move |engine, subs| {
                engine.add_prefill(request)?;
                Ok::<_, engine::scheduler::EngineError>(subs.subscribe(id))
            })
            .await
            .map_err(|_| self.err(ErrorKind::Internal, "the engine thread stopped"))?
            .map_err(|e| self.err(ErrorKind::InvalidArgument, e.to_string()))?;
        let mut first = None;
        loop {
            match events.recv().await {
                Some(Event::Token { sampled, .. }) => first = Some(sampled),
                Some(Event::Prefilled {
                    state,
                    seed,
                    cached_tokens,
                    ..
                }) => {
                    let first = first.ok_or_else(|| {
                        self.err(ErrorKind::Internal, "prefill ended without a first token")
                    })?;
                    return Ok(Prefilled {
                        first,
                        state,
                        seed,
                        cached_tokens,
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
        let w = &self.0;
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
        let engine_id = w.next_id.fetch_add(1, Ordering::Relaxed);
        let key = (request_id.id.clone(), request_id.attempt);
        w.running().insert(key.clone(), engine_id);
        let mut guard = CancelOnDrop {
            runner: w.engine.runner.clone(),
            engine_id,
            armed: true,
        };
        let generation = GenerationRequest {
            id: engine_id,
            prompt: req.prompt_token_ids.clone(),
            sampling: wire::sampling_from_proto(&req.sampling.clone().unwrap_or_default()),
            stop: wire::stop_from_proto(
                &req.stop.clone().unwrap_or_default(),
                &w.engine.eos_token_ids,
            ),
        };
        let work = async {
            let prefilled = w.compute(generation).await?;
            let forward_ns = started.elapsed().as_nanos();
            let transferred = w
                .write_state(&destination, &request_id, &prefilled.state)
                .await
                .map_err(|e| proto::error::to_status(&e.info(&w.worker_id)))?;
            let transfer_ns = started.elapsed().as_nanos() - forward_ns;
            let first_token = wire::token_to_proto(&prefilled.first);
            let mut decode = DecodeClient::connect(format!("http://{}", req.decode_address))
                .await
                .map_err(|e| {
                    w.err(
                        ErrorKind::Unavailable,
                        format!("decode worker {}: {e}", req.decode_address),
                    )
                })?;
            decode
                .commit(CommitRequest {
                    reservation_id: destination.reservation_id.clone(),
                    request_id: Some(request_id.clone()),
                    first_token: Some(first_token.clone()),
                    prompt_tokens: u32::try_from(req.prompt_token_ids.len()).unwrap_or(u32::MAX),
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
                request_id: Some(request_id.clone()),
                first_token: Some(first_token),
                seed: prefilled.seed,
                usage: Some(Usage {
                    prompt_tokens: n(req.prompt_token_ids.len()),
                    cached_prompt_tokens: n(prefilled.cached_tokens),
                    completion_tokens: 1,
                }),
                transferred_bytes: transferred,
                timings: Some(Timings {
                    forward_ns: u64::try_from(forward_ns).unwrap_or(u64::MAX),
                    transfer_ns: u64::try_from(transfer_ns).unwrap_or(u64::MAX),
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
        result.map(Response::new)
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<Ack>, Status> {
        let w = &self.0;
        let req = request.into_inner();
        let Some(RequestId { id, attempt }) = req.request_id else {
            return Ok(Response::new(Ack {}));
        };
        let ids: Vec<u64> = w
            .running()
            .iter()
            .filter(|((i, a), _)| *i == id && (*a == attempt || attempt == 0))
            .map(|(_, &e)| e)
            .collect();
        for engine_id in ids {
            let _ = w.engine.runner.post(move |engine, subs| {
                if let Some(event) = engine.cancel(engine_id) {
                    subs.deliver(event);
                }
            });
        }
        Ok(Response::new(Ack {}))
    }
}
