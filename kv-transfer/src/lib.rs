//! Moving request state between processes, and the handshake that makes sure both sides read
//! the same bytes the same way.
//!
//! - [`handshake`]: layout comparison (model fingerprint, page size, every region) and transport
//!   negotiation; a mismatch is an error naming every difference.
//! - [`sink`]: the decode side of every transport: [`sink::StateSink`] (what the decode worker
//!   does with received state) and the `StateTransfer` gRPC service over it.
//! - [`tcp`]: the plain-TCP transport: the prefill side streams `PageWrite` frames to the
//!   decode side's `StateTransfer` service, which applies them through its sink.
//! - [`ucx`]: one-sided puts into the decode worker's registered page pool, flushed before the
//!   commit.
//! - `nccl` (cargo feature `nccl`): `ncclSend`/`ncclRecv` between the workers' GPUs through
//!   device staging buffers, one communicator per worker pair; the decode side applies the
//!   bytes through its [`sink::StateSink`] before it confirms a transfer.
//! - [`stream`]: one request's state moved piece by piece, in order, while its prompt is
//!   still being computed (over UCX, NCCL or TCP).

pub mod checksum;
pub mod handshake;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod sink;
pub mod stream;
pub mod tcp;
pub mod ucx;

use proto::v1::{ErrorInfo, ErrorKind};

/// A transfer that did not complete. Any of these fails the request: a partially written
/// state must never be committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The two sides' layouts differ.
    #[error("state layouts differ: {0}")]
    LayoutMismatch(String),
    /// The descriptor cannot be used by this transport.
    #[error("bad transfer descriptor: {0}")]
    Descriptor(String),
    /// The peer refused or the connection failed.
    #[error("transfer to {peer} failed: {message}")]
    Failed { peer: String, message: String },
}

impl TransferError {
    /// The wire error for this failure.
    pub fn info(&self, worker_id: &str) -> ErrorInfo {
        let kind = match self {
            Self::LayoutMismatch(_) => ErrorKind::LayoutMismatch,
            Self::Descriptor(_) => ErrorKind::InvalidArgument,
            Self::Failed { .. } => ErrorKind::TransferFailed,
        };
        ErrorInfo {
            kind: kind.into(),
            message: self.to_string(),
            worker_id: worker_id.to_owned(),
        }
    }
}
