//! The NCCL transport: `ncclSend`/`ncclRecv` between the prefill and the decode worker's GPUs.
//!
//! The engines keep their pages in host memory, and NCCL moves device memory, so both sides
//! stage the bytes through a device buffer: the prefill side copies a transfer's pieces to its
//! GPU and sends them; the decode side receives them on its GPU, copies them back to the host
//! and applies them through the same [`crate::sink::StateSink::write`] path (and checks) as
//! TCP frames.
//!
//! One two-rank communicator per (prefill worker, decode worker) pair carries every transfer
//! between them: rank 0 is the prefill side ([`NcclSender`]), rank 1 the decode side
//! ([`NcclReceiver`]). The prefill side opens it on its first transfer to a decode worker: it
//! creates the `ncclUniqueId` and calls `NcclConnect`, and both sides join concurrently
//! (joining is collective). Each transfer is announced with `NcclExpect` (its pieces and its
//! sequence number on the communicator) while the bytes are sent; NCCL matches sends and
//! receives by order, so the decode side receives announced transfers strictly in sequence
//! order and answers `NcclExpect` only once the bytes are applied. When the answer arrives the
//! state is in place, as after a UCX flush.
//!
//! A communicator is used from one thread per side (the pair's thread), which owns the
//! device context, stream, staging buffer and communicator. Every wait for the peer is bounded
//! by [`TIMEOUT`]; a transfer that fails on the wire aborts the communicator on that side, and
//! the next transfer opens a new one. Joining is the exception: `ncclCommInitRank` (and the
//! first send/recv, which connects the ranks and is done while joining) cannot be interrupted,
//! so a peer that never joins leaves that thread blocked inside NCCL (the caller still gets an
//! error after [`TIMEOUT`], and the next transfer starts a fresh pair).
//!
//! CUDA and NCCL are loaded at run time. cudarc looks for NCCL as `libnccl.so` (and a few
//! versioned names, not `libnccl.so.2`): on hosts with only the runtime package, install the
//! development package or add that link. Without the libraries or the device, starting either
//! side returns an error and the worker does not offer NCCL.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant, SystemTime},
};

use cudarc::{driver::CudaContext, nccl::Id};
use proto::auth::{AuthChannel, Credentials};
use proto::v1::{
    NcclConnectRequest, NcclExpectReply, NcclExpectRequest, NcclPiece, NcclTarget, PageRef,
    PageWrite, RequestId, state_transfer_client::StateTransferClient,
};
use tokio::sync::oneshot;
use tonic::Status;

use crate::TransferError;

mod link;

use link::{Link, LinkError, id_bytes, id_from_bytes, spawn_pair};

/// Longest wait for the peer in any one step: joining the communicator, one transfer's bytes,
/// the answer to an announcement, an announcement the decode side is missing.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Largest transfer: both sides hold a device buffer this large per pair at most. Longer
/// groups of pieces go as several transfers ([`batches`]).
pub const MAX_TRANSFER_BYTES: usize = 64 << 20;

/// `ncclUniqueId` size.
const ID_BYTES: usize = 128;
const PREFILL_RANK: i32 = 0;
const DECODE_RANK: i32 = 1;
const RANKS: usize = 2;

/// How often a pair's thread checks whether the stream finished.
const POLL: Duration = Duration::from_micros(20);

/// How long the prefill side waits for its send to complete after the decode side answered
/// first (see [`NcclSender::send`]).
const GRACE: Duration = Duration::from_millis(200);

/// The rendezvous part of a descriptor for the decode worker serving `StateTransfer` at
/// `address` (the pair's id travels in `NcclConnect`, not here).
pub fn target(address: &str) -> NcclTarget {
    NcclTarget {
        unique_id: Vec::new(),
        prefill_rank: PREFILL_RANK as u32,
        decode_rank: DECODE_RANK as u32,
        address: address.to_owned(),
    }
}

/// Bytes for one range of a destination page or of the slot (what a `PageWrite` carries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Destination page (the descriptor's slot reference for the slot).
    pub page: PageRef,
    /// True for the per-request state slot.
    pub slot: bool,
    /// Byte offset within the page or slot.
    pub offset: u64,
    pub data: Vec<u8>,
}

/// Splits segments, in order, into transfers of at most `max` bytes (a longer segment becomes
/// consecutive ranges).
pub fn batches(segments: Vec<Segment>, max: usize) -> Vec<Vec<Segment>> {
    let max = max.max(1);
    let mut out: Vec<Vec<Segment>> = Vec::new();
    let mut size = 0usize;
    let mut push = |part: Segment, out: &mut Vec<Vec<Segment>>| {
        if out.is_empty() || size + part.data.len() > max {
            out.push(Vec::new());
            size = 0;
        }
        size += part.data.len();
        if let Some(last) = out.last_mut() {
            last.push(part);
        }
    };
    for segment in segments {
        if segment.data.len() <= max {
            push(segment, &mut out);
            continue;
        }
        for (i, chunk) in segment.data.chunks(max).enumerate() {
            let part = Segment {
                page: segment.page,
                slot: segment.slot,
                offset: segment.offset + (i * max) as u64,
                data: chunk.to_vec(),
            };
            push(part, &mut out);
        }
    }
    out
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single insert, remove or increment, so a poisoned
    // lock still guards consistent data.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unavailable(message: impl Into<String>) -> TransferError {
    TransferError::Failed {
        peer: "nccl".to_owned(),
        message: message.into(),
    }
}

/// Fails unless the CUDA driver and NCCL can be loaded and device `device` exists. Nothing
/// else in cudarc may be called before this passed: it panics when a library is missing.
fn check_available(device: usize) -> Result<i32, TransferError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda) is not present",
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(unavailable("the NCCL library (libnccl.so) is not present"));
    }
    let count = CudaContext::device_count().map_err(|e| unavailable(format!("CUDA: {e}")))?;
    if usize::try_from(count).unwrap_or(0) <= device {
        return Err(unavailable(format!(
            "no CUDA device {device} ({count} present)"
        )));
    }
    cudarc::nccl::result::get_nccl_version()
        .map_err(|e| unavailable(format!("ncclGetVersion: {:?}", e.0)))
}

// ---------------------------------------------------------------------------------------------
// Prefill side.

struct SendJob {
    seq: u64,
    pieces: Vec<Vec<u8>>,
    done: oneshot::Sender<Result<(), LinkError>>,
}

/// The next sequence number and the thread's queue, locked together so that jobs reach the
/// thread in sequence order.
struct Queue {
    next: u64,
    jobs: mpsc::Sender<SendJob>,
}

/// An open communicator to one decode worker.
struct SendPeer {
    connection: u64,
    client: StateTransferClient<AuthChannel>,
    queue: Mutex<Queue>,
    /// Set when the communicator is out of step or failed: its thread stops, and the next
    /// transfer opens a new pair.
    broken: Arc<AtomicBool>,
}

impl SendPeer {
    fn break_off(&self) {
        self.broken.store(true, Ordering::Release);
    }
}

/// The outcome of an `NcclExpect` call run as a task.
type Joined = Result<Result<tonic::Response<NcclExpectReply>, Status>, tokio::task::JoinError>;

/// A decode worker's slot: opening its pair holds the slot's lock, so concurrent first
/// transfers wait for one `NcclConnect` instead of racing.
type PeerSlot = Arc<tokio::sync::Mutex<Option<Arc<SendPeer>>>>;

struct SenderInner {
    worker_id: String,
    device: usize,
    /// What its calls to decode workers carry.
    credentials: Credentials,
    peers: Mutex<HashMap<String, PeerSlot>>,
    /// Connection numbers, seeded from the clock so a restarted worker does not reuse one.
    connections: AtomicU64,
}

/// The prefill side: one communicator per decode worker, opened on the first transfer there.
#[derive(Clone)]
pub struct NcclSender {
    inner: Arc<SenderInner>,
}

impl std::fmt::Debug for NcclSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclSender")
            .field("worker_id", &self.inner.worker_id)
            .field("device", &self.inner.device)
            .finish_non_exhaustive()
    }
}

impl NcclSender {
    /// The sender of prefill worker `worker_id`, on CUDA device `device`. Fails (without
    /// touching the GPU) when CUDA, NCCL or the device is missing here. Its calls to decode
    /// workers carry `credentials`.
    pub fn start(
        worker_id: String,
        device: usize,
        credentials: Credentials,
    ) -> Result<Self, TransferError> {
        let version = check_available(device)?;
        tracing::info!(version, device, "NCCL transport ready (prefill side)");
        let seed = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Ok(Self {
            inner: Arc::new(SenderInner {
                worker_id,
                device,
                credentials,
                peers: Mutex::new(HashMap::new()),
                connections: AtomicU64::new(seed),
            }),
        })
    }

    /// Moves `segments` (at most [`MAX_TRANSFER_BYTES`] in all) into reservation
    /// `reservation_id` of the decode worker whose `StateTransfer` service is at `address`;
    /// returns the bytes it applied, once they are in place.
    pub async fn send(
        &self,
        address: &str,
        reservation_id: &str,
        request_id: &RequestId,
        segments: Vec<Segment>,
    ) -> Result<u64, TransferError> {
        let failed = |message: String| TransferError::Failed {
            peer: address.to_owned(),
            message,
        };
        let total: u64 = segments.iter().map(|s| s.data.len() as u64).sum();
        if total > MAX_TRANSFER_BYTES as u64 {
            return Err(TransferError::Descriptor(format!(
                "an NCCL transfer of {total} bytes (at most {MAX_TRANSFER_BYTES})"
            )));
        }
        let peer = self.peer(address).await?;
        let mut request = NcclExpectRequest {
            prefill_worker_id: self.inner.worker_id.clone(),
            connection: peer.connection,
            seq: 0,
            reservation_id: reservation_id.to_owned(),
            request_id: Some(request_id.clone()),
            pieces: segments
                .iter()
                .map(|s| NcclPiece {
                    page: Some(s.page),
                    slot: s.slot,
                    offset_bytes: s.offset,
                    length: s.data.len() as u64,
                })
                .collect(),
        };
        let pieces: Vec<Vec<u8>> = segments.into_iter().map(|s| s.data).collect();
        let (done, mut sent) = oneshot::channel();
        let mut rpc = {
            let mut queue = lock(&peer.queue);
            let seq = queue.next;
            request.seq = seq;
            // The announcement goes out without waiting for it: the decode side answers only
            // after it received the bytes the thread is about to send.
            let mut client = peer.client.clone();
            let rpc = tokio::spawn(async move { client.nccl_expect(request).await });
            if queue.jobs.send(SendJob { seq, pieces, done }).is_err() {
                rpc.abort();
                peer.break_off();
                return Err(failed("the NCCL thread stopped".to_owned()));
            }
            queue.next += 1;
            rpc
        };
        let answer = |joined: Joined| match joined {
            Ok(Ok(reply)) => {
                let bytes = reply.into_inner().bytes;
                if bytes == total {
                    Ok(bytes)
                } else {
                    Err(failed(format!(
                        "the decode side applied {bytes} bytes; {total} were sent"
                    )))
                }
            }
            Ok(Err(status)) => Err(failed(proto::error::from_status(&status).message)),
            Err(e) => Err(failed(format!("NcclExpect: {e}"))),
        };
        tokio::select! {
            result = &mut sent => {
                match result {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        // The thread already marked the pair broken.
                        rpc.abort();
                        return Err(failed(e.to_string()));
                    }
                    Err(_) => {
                        rpc.abort();
                        peer.break_off();
                        return Err(failed("the NCCL thread stopped".to_owned()));
                    }
                }
                // The bytes left; the decode side answers once it applied them. The pair is
                // in step whatever the answer says.
                if let Ok(joined) = tokio::time::timeout(TIMEOUT, &mut rpc).await {
                    answer(joined)
                } else {
                    rpc.abort();
                    Err(failed(format!(
                        "no answer to NcclExpect within {TIMEOUT:?} after the bytes left"
                    )))
                }
            }
            joined = &mut rpc => {
                // An answer before this side saw its send complete: the decode side refused
                // the announcement before receiving (then it will never receive these bytes
                // and the pair is out of step), or the answer overtook the completion check.
                let answer = answer(joined);
                match tokio::time::timeout(GRACE, &mut sent).await {
                    Ok(Ok(Ok(()))) => answer,
                    Ok(Ok(Err(e))) => Err(answer.err().unwrap_or_else(|| failed(e.to_string()))),
                    Ok(Err(_)) | Err(_) => {
                        peer.break_off();
                        Err(answer.err().unwrap_or_else(|| {
                            failed("the bytes did not leave".to_owned())
                        }))
                    }
                }
            }
        }
    }

    /// The open pair to `address`, opened now if there is none (or it broke).
    async fn peer(&self, address: &str) -> Result<Arc<SendPeer>, TransferError> {
        let slot = {
            let mut peers = lock(&self.inner.peers);
            Arc::clone(peers.entry(address.to_owned()).or_default())
        };
        let mut slot = slot.lock().await;
        if let Some(peer) = slot.as_ref()
            && !peer.broken.load(Ordering::Acquire)
        {
            return Ok(Arc::clone(peer));
        }
        *slot = None;
        let peer = Arc::new(self.open(address).await?);
        *slot = Some(Arc::clone(&peer));
        Ok(peer)
    }

    /// Opens a communicator with the decode worker at `address`: rank 0 joins here while the
    /// decode side joins as rank 1 in its `NcclConnect` handler.
    async fn open(&self, address: &str) -> Result<SendPeer, TransferError> {
        let failed = |message: String| TransferError::Failed {
            peer: address.to_owned(),
            message,
        };
        let endpoint = self
            .inner
            .credentials
            .endpoint(address)
            .map_err(|e| TransferError::Descriptor(format!("NCCL target {address:?}: {e}")))?
            .connect_timeout(TIMEOUT);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut client = StateTransferClient::new(self.inner.credentials.channel(channel));
        // ncclGetUniqueId sets up NCCL's bootstrap (network interfaces, a listening socket).
        let id = tokio::task::spawn_blocking(Id::new)
            .await
            .map_err(|e| failed(format!("ncclGetUniqueId: {e}")))?
            .map_err(|e| failed(format!("ncclGetUniqueId: {:?}", e.0)))?;
        let connection = self.inner.connections.fetch_add(1, Ordering::Relaxed);
        let (jobs, jobs_rx) = mpsc::channel::<SendJob>();
        let broken = Arc::new(AtomicBool::new(false));
        let (ready, joined) = oneshot::channel();
        let thread_broken = Arc::clone(&broken);
        spawn_pair(
            "pdserve-nccl-send",
            self.inner.device,
            PREFILL_RANK,
            id,
            ready,
            move |link| send_thread(link, &jobs_rx, &thread_broken),
        )?;
        let connect = client.nccl_connect(NcclConnectRequest {
            prefill_worker_id: self.inner.worker_id.clone(),
            connection,
            unique_id: id_bytes(&id),
        });
        let (joined, connected) = tokio::join!(
            tokio::time::timeout(TIMEOUT, joined),
            tokio::time::timeout(TIMEOUT, connect)
        );
        let result = match (joined, connected) {
            (Ok(Ok(Ok(()))), Ok(Ok(_))) => Ok(()),
            (_, Ok(Err(status))) => Err(format!(
                "NcclConnect: {}",
                proto::error::from_status(&status).message
            )),
            (_, Err(_)) => Err(format!("NcclConnect: no answer within {TIMEOUT:?}")),
            (Ok(Ok(Err(e))), _) => Err(e.to_string()),
            (Ok(Err(_)), _) => Err("the NCCL thread stopped".to_owned()),
            (Err(_), _) => Err(format!("joining the communicator took over {TIMEOUT:?}")),
        };
        if let Err(message) = result {
            broken.store(true, Ordering::Release);
            return Err(failed(message));
        }
        tracing::debug!(%address, connection, "NCCL pair open");
        Ok(SendPeer {
            connection,
            client,
            queue: Mutex::new(Queue { next: 0, jobs }),
            broken,
        })
    }
}

/// The prefill side of a pair: sends queued jobs in order until the queue closes or a send
/// fails (then the communicator is aborted: the pair is out of step).
fn send_thread(mut link: Link, jobs: &mpsc::Receiver<SendJob>, broken: &AtomicBool) {
    let mut next = 0u64;
    while let Ok(job) = jobs.recv() {
        let result = if broken.load(Ordering::Acquire) {
            Err(LinkError::Closed)
        } else if job.seq != next {
            Err(LinkError::OutOfOrder { seq: job.seq, next })
        } else {
            link.send(&job.pieces, broken)
        };
        next += 1;
        let ok = result.is_ok();
        if !ok {
            broken.store(true, Ordering::Release);
        }
        let _ = job.done.send(result);
        if !ok {
            break;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode side.

struct Expectation {
    seq: u64,
    total: usize,
    reply: oneshot::Sender<Result<Vec<u8>, LinkError>>,
}

/// An open communicator with one prefill worker.
struct RecvPeer {
    connection: u64,
    expectations: mpsc::Sender<Expectation>,
    closed: Arc<AtomicBool>,
}

impl Drop for RecvPeer {
    fn drop(&mut self) {
        // Replaced or shut down: the thread stops waiting and aborts the communicator.
        self.closed.store(true, Ordering::Release);
    }
}

/// The decode side: the communicators prefill workers opened with this worker, and the
/// handling of `NcclConnect` and `NcclExpect`.
pub struct NcclReceiver {
    worker_id: String,
    device: usize,
    peers: Mutex<HashMap<String, RecvPeer>>,
}

impl std::fmt::Debug for NcclReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclReceiver")
            .field("worker_id", &self.worker_id)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl NcclReceiver {
    /// The receiver of decode worker `worker_id`, on CUDA device `device`. Fails (without
    /// touching the GPU) when CUDA, NCCL or the device is missing here.
    pub fn start(worker_id: String, device: usize) -> Result<Self, TransferError> {
        let version = check_available(device)?;
        tracing::info!(version, device, "NCCL transport ready (decode side)");
        Ok(Self {
            worker_id,
            device,
            peers: Mutex::new(HashMap::new()),
        })
    }

    fn status(&self, error: &TransferError) -> Status {
        proto::error::to_status(&error.info(&self.worker_id))
    }

    /// `NcclConnect`: joins the prefill worker's new communicator as rank 1 (replacing its
    /// previous one) and returns once joined.
    pub async fn connect(&self, request: NcclConnectRequest) -> Result<(), Status> {
        let peer_name = request.prefill_worker_id.clone();
        let failed = |message: String| TransferError::Failed {
            peer: peer_name.clone(),
            message,
        };
        let id = id_from_bytes(&request.unique_id).ok_or_else(|| {
            self.status(&TransferError::Descriptor(format!(
                "an ncclUniqueId has {ID_BYTES} bytes, not {}",
                request.unique_id.len()
            )))
        })?;
        let (expectations, expectations_rx) = mpsc::channel();
        let closed = Arc::new(AtomicBool::new(false));
        let (ready, joined) = oneshot::channel();
        let thread_closed = Arc::clone(&closed);
        spawn_pair(
            "pdserve-nccl-recv",
            self.device,
            DECODE_RANK,
            id,
            ready,
            move |link| recv_thread(link, &expectations_rx, &thread_closed),
        )
        .map_err(|e| self.status(&e))?;
        // The previous pair (if any) is dropped here, which stops its thread.
        lock(&self.peers).insert(
            request.prefill_worker_id.clone(),
            RecvPeer {
                connection: request.connection,
                expectations,
                closed,
            },
        );
        let result = match tokio::time::timeout(TIMEOUT, joined).await {
            Ok(Ok(Ok(()))) => return Ok(()),
            Ok(Ok(Err(e))) => e.to_string(),
            Ok(Err(_)) => "the NCCL thread stopped".to_owned(),
            Err(_) => format!("joining the communicator took over {TIMEOUT:?}"),
        };
        self.forget(&request.prefill_worker_id, request.connection);
        Err(self.status(&failed(result)))
    }

    /// Drops the pair if it is still `connection`.
    fn forget(&self, prefill_worker_id: &str, connection: u64) {
        let mut peers = lock(&self.peers);
        if peers
            .get(prefill_worker_id)
            .is_some_and(|p| p.connection == connection)
        {
            peers.remove(prefill_worker_id);
        }
    }

    /// `NcclExpect`: receives the announced transfer (in sequence order on its communicator)
    /// and applies its pieces through `write` (the service passes its sink's
    /// [`crate::sink::StateSink::write`], so they get the TCP frames' checks); answers once they
    /// are in place.
    pub async fn expect<W, F>(
        &self,
        write: W,
        request: NcclExpectRequest,
    ) -> Result<NcclExpectReply, Status>
    where
        W: Fn(PageWrite) -> F,
        F: std::future::Future<Output = Result<u64, Status>>,
    {
        let peer_name = request.prefill_worker_id.clone();
        let failed = |message: String| TransferError::Failed {
            peer: peer_name.clone(),
            message,
        };
        let total = request
            .pieces
            .iter()
            .try_fold(0u64, |sum, p| sum.checked_add(p.length))
            .filter(|&t| t <= MAX_TRANSFER_BYTES as u64)
            .map(|t| t as usize);
        let Some(total) = total else {
            // The prefill side is sending these bytes regardless: the pair is out of step.
            self.forget(&request.prefill_worker_id, request.connection);
            return Err(self.status(&TransferError::Descriptor(format!(
                "an NCCL transfer longer than {MAX_TRANSFER_BYTES} bytes"
            ))));
        };
        let (reply, received) = oneshot::channel();
        {
            let peers = lock(&self.peers);
            let peer = peers
                .get(&request.prefill_worker_id)
                .filter(|p| p.connection == request.connection)
                .ok_or_else(|| {
                    self.status(&failed(format!(
                        "no NCCL connection {} from this worker (replaced or closed; the \
                         next transfer reconnects)",
                        request.connection
                    )))
                })?;
            peer.expectations
                .send(Expectation {
                    seq: request.seq,
                    total,
                    reply,
                })
                .map_err(|_| self.status(&failed("the NCCL connection closed".to_owned())))?;
        }
        let data = received
            .await
            .map_err(|_| self.status(&failed("the NCCL connection closed".to_owned())))?
            .map_err(|e| self.status(&failed(e.to_string())))?;
        let mut bytes = 0u64;
        let mut at = 0usize;
        for piece in request.pieces {
            let end = at + piece.length as usize;
            let frame = PageWrite {
                reservation_id: request.reservation_id.clone(),
                request_id: request.request_id.clone(),
                page: piece.page,
                slot: piece.slot,
                offset_bytes: piece.offset_bytes,
                data: data.get(at..end).map(<[u8]>::to_vec).unwrap_or_default(),
            };
            at = end;
            bytes += write(frame).await?;
        }
        Ok(NcclExpectReply { bytes })
    }
}

/// The decode side of a pair: receives announced transfers strictly in sequence order (an
/// announcement that arrives early waits for the earlier ones) until the pair is closed or a
/// receive fails.
fn recv_thread(mut link: Link, expectations: &mpsc::Receiver<Expectation>, closed: &AtomicBool) {
    let mut pending: BTreeMap<u64, Expectation> = BTreeMap::new();
    let mut next = 0u64;
    // Since when a later transfer has been waiting for transfer `next` to be announced.
    let mut gap_since: Option<Instant> = None;
    let end = loop {
        if closed.load(Ordering::Acquire) {
            break LinkError::Replaced;
        }
        if let Some(e) = pending.remove(&next) {
            gap_since = None;
            next += 1;
            let received = link.recv(e.total, closed);
            let error = received.as_ref().err().cloned();
            let _ = e.reply.send(received);
            if let Some(error) = error {
                break error;
            }
            continue;
        }
        let message = if pending.is_empty() {
            match expectations.recv() {
                Ok(m) => m,
                Err(_) => break LinkError::Disconnected,
            }
        } else {
            // NCCL delivers the bytes in send order: nothing later can be received before
            // transfer `next`, which may have been lost with its announcement.
            let since = *gap_since.get_or_insert_with(Instant::now);
            let left = (since + TIMEOUT).saturating_duration_since(Instant::now());
            match expectations.recv_timeout(left) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    break LinkError::NotAnnounced(next);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break LinkError::Disconnected,
            }
        };
        if message.seq < next || pending.contains_key(&message.seq) {
            let error = LinkError::AnnouncedTwice(message.seq);
            let _ = message.reply.send(Err(error.clone()));
            break error;
        }
        pending.insert(message.seq, message);
    };
    closed.store(true, Ordering::Release);
    for (_, e) in pending {
        let _ = e.reply.send(Err(end.clone()));
    }
    // Dropping `link` aborts the communicator.
}

#[cfg(test)]
mod tests;
