//! One side of a pair's two-rank NCCL communicator ([`Link`]): joining it, staging bytes
//! through the device buffer, sends and receives whose every wait is bounded by
//! [`super::TIMEOUT`]; the pair's thread that owns it ([`spawn_pair`]).

use std::{
    ffi::c_char,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use cudarc::{
    driver::{CudaContext, CudaSlice, CudaStream, DriverError},
    nccl::{Comm, Id, result::NcclError},
};
use tokio::sync::oneshot;

use super::{DECODE_RANK, ID_BYTES, POLL, PREFILL_RANK, RANKS, TIMEOUT, unavailable};
use crate::TransferError;

pub(super) fn id_bytes(id: &Id) -> Vec<u8> {
    id.internal().iter().map(|c| c.to_ne_bytes()[0]).collect()
}

pub(super) fn id_from_bytes(bytes: &[u8]) -> Option<Id> {
    let bytes: &[u8; ID_BYTES] = bytes.try_into().ok()?;
    Some(Id::uninit(bytes.map(|b| c_char::from_ne_bytes([b]))))
}

/// Why a pair's thread could not join or move a transfer (a [`TransferError::Failed`]
/// message for the caller).
#[derive(Debug, Clone, thiserror::Error)]
pub(super) enum LinkError {
    /// A CUDA or NCCL call failed: `call` names it (with what it was for), `message` says why.
    #[error("{call}: {message}")]
    Cuda { call: String, message: String },
    /// The pair was marked broken or closed while this step waited.
    #[error("the NCCL connection was closed")]
    Closed,
    /// The peer did not finish its side of a transfer within [`TIMEOUT`].
    #[error("the peer did not complete the transfer within {TIMEOUT:?} (gone?)")]
    Timeout,
    /// The prefill side's thread got transfer `seq` while `next` was due.
    #[error("transfer {seq} queued out of order ({next} next)")]
    OutOfOrder { seq: u64, next: u64 },
    /// The decode side's pair was replaced by a newer one or shut down.
    #[error("the NCCL connection was replaced or closed")]
    Replaced,
    /// The decode side's queue of announcements closed.
    #[error("the NCCL connection closed")]
    Disconnected,
    /// A later transfer waited [`TIMEOUT`] for this one's announcement.
    #[error("transfer {0} was not announced within {TIMEOUT:?}")]
    NotAnnounced(u64),
    /// The same transfer was announced twice.
    #[error("transfer {0} announced twice")]
    AnnouncedTwice(u64),
}

impl LinkError {
    /// The error of a failed CUDA driver call.
    fn cuda(call: impl Into<String>) -> impl FnOnce(DriverError) -> Self {
        move |e| Self::Cuda {
            call: call.into(),
            message: e.to_string(),
        }
    }

    /// The error of a failed NCCL call.
    fn nccl(call: &'static str) -> impl FnOnce(NcclError) -> Self {
        move |e| Self::Cuda {
            call: call.to_owned(),
            message: format!("{:?}", e.0),
        }
    }
}

/// One side of a pair's communicator, owned by the pair's thread (communicators must not be
/// used from two threads at once). Fields drop in order: the communicator is aborted before
/// the buffer it may still be using is freed.
pub(super) struct Link {
    comm: Comm,
    buffer: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
}

impl Link {
    /// Joins the communicator `id` as `rank` (blocks until the other rank joined too).
    pub(super) fn join(device: usize, rank: i32, id: Id) -> Result<Self, LinkError> {
        let ctx =
            CudaContext::new(device).map_err(LinkError::cuda(format!("CUDA device {device}")))?;
        // A stream of its own: NCCL's kernels on the legacy default stream would serialise
        // with every other pair's work on this device.
        let stream = ctx.new_stream().map_err(LinkError::cuda("CUDA stream"))?;
        let comm = Comm::from_rank(Arc::clone(&stream), rank as usize, RANKS, id)
            .map_err(LinkError::nccl("ncclCommInitRank"))?;
        let mut link = Self {
            comm,
            buffer: None,
            stream,
        };
        // NCCL connects the two ranks' point-to-point channel on their first send/recv, inside
        // the host call and waiting for the peer; one byte now does that while joining, so a
        // transfer's host calls return at once and only its (bounded) completion waits.
        let never = AtomicBool::new(false);
        if rank == PREFILL_RANK {
            link.send(&[vec![0]], &never)?;
        } else {
            link.recv(1, &never)?;
        }
        Ok(link)
    }

    /// The staging buffer, at least `len` bytes.
    fn staging<'a>(
        buffer: &'a mut Option<CudaSlice<u8>>,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<&'a mut CudaSlice<u8>, LinkError> {
        if buffer.as_ref().is_some_and(|b| b.len() < len) {
            // Free the old buffer before allocating the larger one.
            *buffer = None;
        }
        match buffer {
            Some(b) => Ok(b),
            None => Ok(buffer.insert(
                stream
                    .alloc_zeros::<u8>(len)
                    .map_err(LinkError::cuda(format!("device buffer of {len} bytes")))?,
            )),
        }
    }

    /// Waits until the work queued on `stream` so far completed, the deadline passed or
    /// `abort` was set.
    fn wait(stream: &CudaStream, deadline: Instant, abort: &AtomicBool) -> Result<(), LinkError> {
        let event = stream
            .record_event(None)
            .map_err(LinkError::cuda("CUDA event"))?;
        loop {
            if event.try_is_complete().map_err(LinkError::cuda("CUDA"))? {
                return Ok(());
            }
            if abort.load(Ordering::Acquire) {
                return Err(LinkError::Closed);
            }
            if Instant::now() > deadline {
                return Err(LinkError::Timeout);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Sends `pieces`, concatenated, to the decode rank; returns once they left.
    pub(super) fn send(&mut self, pieces: &[Vec<u8>], abort: &AtomicBool) -> Result<(), LinkError> {
        let total: usize = pieces.iter().map(Vec::len).sum();
        if total == 0 {
            // The decode side skips empty transfers too.
            return Ok(());
        }
        let deadline = Instant::now() + TIMEOUT;
        let buffer = Self::staging(&mut self.buffer, &self.stream, total)?;
        let mut at = 0;
        for piece in pieces.iter().filter(|p| !p.is_empty()) {
            self.stream
                .memcpy_htod(
                    piece.as_slice(),
                    &mut buffer.slice_mut(at..at + piece.len()),
                )
                .map_err(LinkError::cuda("copy to the device"))?;
            at += piece.len();
        }
        self.comm
            .send(&buffer.slice(0..total), DECODE_RANK)
            .map_err(LinkError::nccl("ncclSend"))?;
        Self::wait(&self.stream, deadline, abort)
    }

    /// Receives `total` bytes from the prefill rank into host memory.
    pub(super) fn recv(&mut self, total: usize, abort: &AtomicBool) -> Result<Vec<u8>, LinkError> {
        if total == 0 {
            return Ok(Vec::new());
        }
        let deadline = Instant::now() + TIMEOUT;
        let buffer = Self::staging(&mut self.buffer, &self.stream, total)?;
        self.comm
            .recv(&mut buffer.slice_mut(0..total), PREFILL_RANK)
            .map_err(LinkError::nccl("ncclRecv"))?;
        // Bounded wait before the copy: a copy queued behind a receive that never completes
        // would block this thread without a timeout.
        Self::wait(&self.stream, deadline, abort)?;
        let mut host = vec![0u8; total];
        self.stream
            .memcpy_dtoh(&buffer.slice(0..total), host.as_mut_slice())
            .map_err(LinkError::cuda("copy from the device"))?;
        self.stream.synchronize().map_err(LinkError::cuda("CUDA"))?;
        Ok(host)
    }
}

/// Starts a pair's thread: it joins `id` as `rank`, reports that on `ready`, then runs `work`
/// with the communicator.
pub(super) fn spawn_pair<F>(
    name: &str,
    device: usize,
    rank: i32,
    id: Id,
    ready: oneshot::Sender<Result<(), LinkError>>,
    work: F,
) -> Result<(), TransferError>
where
    F: FnOnce(Link) + Send + 'static,
{
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || match Link::join(device, rank, id) {
            Ok(link) => {
                // When the caller gave up waiting, the link is dropped (aborted) right away.
                if ready.send(Ok(())).is_ok() {
                    work(link);
                }
            }
            Err(e) => {
                let _ = ready.send(Err(e));
            }
        })
        .map(drop)
        .map_err(|e| unavailable(format!("NCCL thread: {e}")))
}
