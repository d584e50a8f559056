//! The decode side of a state transfer: [`StateSink`], what the decode worker does with the
//! state it receives whatever the transport, and [`StateTransferService`], the `StateTransfer`
//! gRPC service over a sink. The service takes TCP `PageWrite` frames and answers the NCCL
//! transport's calls (in builds with the `nccl` feature); both end in [`StateSink::write`],
//! so every byte passes the same checks.

use std::sync::Arc;

use futures::future::BoxFuture;
use proto::v1::{
    Ack, NcclConnectRequest, NcclExpectReply, NcclExpectRequest, PageWrite, PageWriteSummary,
    TransferHello, TransferHelloReply, state_transfer_server,
};
use tonic::{Request, Response, Status, Streaming};

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
                .expect(|frame| self.sink.write(frame), request.into_inner())
                .await
                .map(Response::new);
        }
        let _ = request;
        Err(no_nccl())
    }
}

#[cfg(test)]
mod tests {
    use proto::v1::state_transfer_server::StateTransfer;

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
}
