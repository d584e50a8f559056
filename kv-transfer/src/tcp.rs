//! The plain-TCP transport: `PageWrite` frames over a client stream to the decode worker's
//! `StateTransfer` service. Baseline and fallback: it works everywhere, and the decode side
//! checks every frame against the reservation before a byte is written. The same service
//! answers the NCCL transport's calls (see `nccl`, in builds with the `nccl` feature).

use std::sync::Arc;

use futures::future::BoxFuture;
use proto::auth::{AuthChannel, Credentials};
use proto::v1::{
    Ack, NcclConnectRequest, NcclExpectReply, NcclExpectRequest, PageRef, PageWrite,
    PageWriteSummary, RequestId, TransferDescriptor, TransferHello, TransferHelloReply,
    state_transfer_client::StateTransferClient, state_transfer_server, transfer_descriptor::Target,
};
use tonic::{Request, Response, Status, Streaming};

use crate::TransferError;

/// Largest data payload of one frame.
pub const FRAME_BYTES: usize = 1 << 20;

/// What the decode side does with the frames (implemented by the decode worker over its page
/// pool).
pub trait StateSink: Send + Sync + 'static {
    /// The handshake: compare layouts, pick a transport.
    fn hello(&self, hello: TransferHello) -> BoxFuture<'_, Result<TransferHelloReply, Status>>;
    /// Applies one frame to its reservation; returns the bytes written.
    fn write(&self, frame: PageWrite) -> BoxFuture<'_, Result<u64, Status>>;
    /// The NCCL receiver that serves `NcclConnect` and `NcclExpect` for this sink (its pieces
    /// are applied through [`Self::write`]); `None` when this worker does not offer NCCL.
    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<&crate::nccl::NcclReceiver> {
        None
    }
}

/// Why this build or worker answers the NCCL calls with an error.
#[cfg(not(feature = "nccl"))]
fn no_nccl() -> Status {
    Status::unimplemented("this worker was built without NCCL (cargo feature `nccl`)")
}
#[cfg(feature = "nccl")]
fn no_nccl() -> Status {
    Status::failed_precondition("this worker does not offer the NCCL transport")
}

/// The `StateTransfer` gRPC service over a [`StateSink`].
#[derive(Debug)]
pub struct StateTransferService<S> {
    sink: Arc<S>,
}

impl<S> StateTransferService<S> {
    pub fn new(sink: Arc<S>) -> Self {
        Self { sink }
    }
}

#[tonic::async_trait]
impl<S: StateSink> state_transfer_server::StateTransfer for StateTransferService<S> {
    async fn hello(
        &self,
        request: Request<TransferHello>,
    ) -> Result<Response<TransferHelloReply>, Status> {
        self.sink
            .hello(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn write(
        &self,
        request: Request<Streaming<PageWrite>>,
    ) -> Result<Response<PageWriteSummary>, Status> {
        let mut frames = request.into_inner();
        let mut summary = PageWriteSummary::default();
        while let Some(frame) = frames.message().await? {
            summary.bytes += self.sink.write(frame).await?;
            summary.frames += 1;
        }
        Ok(Response::new(summary))
    }

    async fn nccl_connect(
        &self,
        request: Request<NcclConnectRequest>,
    ) -> Result<Response<Ack>, Status> {
        #[cfg(feature = "nccl")]
        if let Some(receiver) = self.sink.nccl() {
            receiver.connect(request.into_inner()).await?;
            return Ok(Response::new(Ack {}));
        }
        let _ = request;
        Err(no_nccl())
    }

    async fn nccl_expect(
        &self,
        request: Request<NcclExpectRequest>,
    ) -> Result<Response<NcclExpectReply>, Status> {
        #[cfg(feature = "nccl")]
        if let Some(receiver) = self.sink.nccl() {
            return receiver
                .expect(self.sink.as_ref(), request.into_inner())
                .await
                .map(Response::new);
        }
        let _ = request;
        Err(no_nccl())
    }
}

/// Frames that write `pages` (in sequence order, to the descriptor's pages) and `slot`.
pub fn frames(
    descriptor: &TransferDescriptor,
    request_id: &RequestId,
    pages: &[Vec<u8>],
    slot: &[u8],
) -> Result<Vec<PageWrite>, TransferError> {
    if pages.len() > descriptor.pages.len() {
        return Err(TransferError::Descriptor(format!(
            "{} pages of state but {} reserved",
            pages.len(),
            descriptor.pages.len()
        )));
    }
    let slot_ref = descriptor
        .slot
        .ok_or_else(|| TransferError::Descriptor("no state slot".to_owned()))?;
    let mut out = Vec::new();
    let targets = pages
        .iter()
        .zip(&descriptor.pages)
        .map(|(bytes, page)| (bytes.as_slice(), *page, false))
        .chain(std::iter::once((slot, slot_ref, true)));
    for (bytes, page, is_slot) in targets {
        for (i, chunk) in bytes.chunks(FRAME_BYTES).enumerate() {
            out.push(PageWrite {
                reservation_id: descriptor.reservation_id.clone(),
                request_id: Some(request_id.clone()),
                page: Some(PageRef { ..page }),
                slot: is_slot,
                offset_bytes: (i * FRAME_BYTES) as u64,
                data: chunk.to_vec(),
            });
        }
    }
    Ok(out)
}

/// A `StateTransfer` client for the decode worker at `peer` (host:port) whose calls carry
/// `credentials`.
pub async fn connect(
    peer: &str,
    credentials: &Credentials,
) -> Result<StateTransferClient<AuthChannel>, tonic::transport::Error> {
    let channel = credentials.endpoint(peer)?.connect().await?;
    Ok(StateTransferClient::new(credentials.channel(channel)))
}

/// Writes a prompt's state into the reservation `descriptor` names; returns the bytes the
/// decode side confirmed. A short count is an error.
pub async fn send_state(
    descriptor: &TransferDescriptor,
    request_id: &RequestId,
    pages: &[Vec<u8>],
    slot: &[u8],
    credentials: &Credentials,
) -> Result<u64, TransferError> {
    let Some(Target::Tcp(target)) = &descriptor.target else {
        return Err(TransferError::Descriptor(
            "the descriptor has no TCP target".to_owned(),
        ));
    };
    let peer = target.address.clone();
    let failed = |message: String| TransferError::Failed {
        peer: peer.clone(),
        message,
    };
    let frames = frames(descriptor, request_id, pages, slot)?;
    let expected: u64 = frames.iter().map(|f| f.data.len() as u64).sum();
    let expected_frames = frames.len() as u64;
    let mut client = connect(&peer, credentials)
        .await
        .map_err(|e| failed(e.to_string()))?
        .max_decoding_message_size(FRAME_BYTES * 2)
        .max_encoding_message_size(FRAME_BYTES * 2);
    let summary = client
        .write(tokio_stream::iter(frames))
        .await
        .map_err(|status| failed(proto::error::from_status(&status).message))?
        .into_inner();
    if summary.bytes != expected || summary.frames != expected_frames {
        return Err(failed(format!(
            "the decode side applied {} bytes in {} frames; {expected} bytes in \
             {expected_frames} frames were sent",
            summary.bytes, summary.frames
        )));
    }
    Ok(summary.bytes)
}

#[cfg(test)]
mod tests {
    use proto::v1::{TcpTarget, state_transfer_server::StateTransfer};

    use super::*;

    /// A sink that offers no NCCL.
    struct Plain;

    impl StateSink for Plain {
        fn hello(&self, _: TransferHello) -> BoxFuture<'_, Result<TransferHelloReply, Status>> {
            Box::pin(async { Err(Status::unimplemented("hello")) })
        }

        fn write(&self, frame: PageWrite) -> BoxFuture<'_, Result<u64, Status>> {
            Box::pin(async move { Ok(frame.data.len() as u64) })
        }
    }

    #[tokio::test]
    async fn nccl_calls_without_nccl_are_refused_with_a_reason() {
        let service = StateTransferService::new(Arc::new(Plain));
        let connect = service
            .nccl_connect(Request::new(NcclConnectRequest::default()))
            .await
            .unwrap_err();
        let expect = service
            .nccl_expect(Request::new(NcclExpectRequest::default()))
            .await
            .unwrap_err();
        let code = if cfg!(feature = "nccl") {
            tonic::Code::FailedPrecondition
        } else {
            tonic::Code::Unimplemented
        };
        for status in [connect, expect] {
            assert_eq!(status.code(), code);
            assert!(status.message().contains("NCCL"), "{}", status.message());
        }
    }

    #[test]
    fn frames_cover_every_page_and_the_slot_in_bounded_pieces() {
        let descriptor = TransferDescriptor {
            reservation_id: "r1".into(),
            pages: (0..3)
                .map(|p| PageRef {
                    region: 0,
                    page: 10 + p,
                    offset_bytes: (10 + p) * 4096,
                })
                .collect(),
            slot: Some(PageRef {
                region: 0,
                page: 2,
                offset_bytes: 0,
            }),
            target: Some(Target::Tcp(TcpTarget {
                address: "127.0.0.1:1".into(),
            })),
            ..TransferDescriptor::default()
        };
        let id = RequestId {
            id: "q".into(),
            attempt: 0,
        };
        let pages = vec![vec![1u8; 10], vec![2u8; FRAME_BYTES + 5]];
        let slot = vec![3u8; 7];
        let frames = frames(&descriptor, &id, &pages, &slot).unwrap();
        assert_eq!(frames.len(), 4);
        assert_eq!(frames[0].page.unwrap().page, 10);
        assert_eq!(frames[1].page.unwrap().page, 11);
        assert_eq!(frames[2].offset_bytes, FRAME_BYTES as u64);
        assert_eq!(frames[2].data.len(), 5);
        assert!(frames[3].slot && frames[3].data == slot);
        let total: usize = frames.iter().map(|f| f.data.len()).sum();
        assert_eq!(total, 10 + FRAME_BYTES + 5 + 7);
        let too_many = vec![vec![0u8; 1]; 4];
        assert!(matches!(
            super::frames(&descriptor, &id, &too_many, &slot),
            Err(TransferError::Descriptor(_))
        ));
    }
}
