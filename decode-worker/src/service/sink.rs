//! The decode worker as the receiving end of `StateTransfer`: the layout hello and page
//! writes into a live reservation's pages (on the rank that holds it).

use futures::future::BoxFuture;
use kv_transfer::{handshake, sink::StateSink};
use proto::v1::{ErrorKind, PageWrite, TransferHello, TransferHelloReply, TransportKind};
use tonic::Status;

use super::DecodeWorker;

impl StateSink for DecodeWorker {
    fn hello(&self, hello: TransferHello) -> BoxFuture<'_, Result<TransferHelloReply, Status>> {
        Box::pin(async move {
            handshake::check_layouts(self.layout(), &hello.layout.unwrap_or_default())
                .map_err(|e| proto::error::to_status(&e.info(&self.worker_id)))?;
            let transport = handshake::negotiate(&hello.transports, &self.offered.kinds)
                .unwrap_or(TransportKind::Unspecified);
            Ok(TransferHelloReply {
                worker_id: self.worker_id.clone(),
                layout: Some(self.layout().clone()),
                transport: transport.into(),
            })
        })
    }

    fn write(&self, frame: PageWrite) -> BoxFuture<'_, Result<u64, Status>> {
        Box::pin(async move {
            let (engine_id, rank, index) = {
                let map = self.lock();
                let r = map.get(&frame.reservation_id).ok_or_else(|| {
                    self.err(
                        ErrorKind::NotFound,
                        format!("no live reservation {:?}", frame.reservation_id),
                    )
                })?;
                if frame.request_id.as_ref() != Some(&r.request) {
                    return Err(self.err(
                        ErrorKind::InvalidArgument,
                        "the frame's request does not own the reservation",
                    ));
                }
                if r.commit.is_some() || r.started {
                    return Err(self.err(
                        ErrorKind::InvalidArgument,
                        "the reservation is already committed",
                    ));
                }
                let index = if frame.slot {
                    None
                } else {
                    let page = frame.page.map(|p| p.page).ok_or_else(|| {
                        self.err(ErrorKind::InvalidArgument, "a page frame needs a page")
                    })?;
                    Some(r.pages.iter().position(|&p| p == page).ok_or_else(|| {
                        self.err(
                            ErrorKind::InvalidArgument,
                            format!("page {page} is not part of the reservation"),
                        )
                    })?)
                };
                (r.engine_id, r.rank, index)
            };
            let offset = usize::try_from(frame.offset_bytes).unwrap_or(usize::MAX);
            let bytes = frame.data.len() as u64;
            self.engine
                .ranks
                .call(rank, move |engine, _| {
                    engine.write_state(engine_id, index, offset, &frame.data)
                })
                .await
                .map_err(|_| self.stopped())?
                .map_err(|e| self.err(ErrorKind::TransferFailed, e.to_string()))?;
            Ok(bytes)
        })
    }

    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<&kv_transfer::nccl::NcclReceiver> {
        self.nccl.as_ref()
    }
}
