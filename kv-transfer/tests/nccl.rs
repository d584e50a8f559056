//! The NCCL transport end to end on two GPUs of one host: a prefill-side sender (device 0) and
//! a decode-side receiver (device 1, NCCL refuses two ranks on one device) behind a real
//! `StateTransfer` server, moving pages into a host buffer. Skips, with a message, where CUDA,
//! NCCL or a second device is missing.
#![cfg(feature = "nccl")]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::future::BoxFuture;
use kv_transfer::{
    nccl::{self, NcclReceiver, NcclSender, Segment},
    sink::{StateSink, StateTransferService},
    stream::{Initiators, Piece, StateStream},
};
use proto::auth::Credentials;
use proto::v1::{
    PageRef, PageWrite, RequestId, TransferDescriptor, TransferHello, TransferHelloReply,
    TransportKind, state_transfer_server::StateTransferServer, transfer_descriptor::Target,
};
use tonic::Status;

const PAGE: usize = 64 << 10;
const PAGES: usize = 4;
const SLOT: usize = 4096;

/// Why the test cannot run here, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: only probes whether the shared libraries can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("no CUDA driver library".to_owned());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Some("no NCCL library (libnccl.so)".to_owned());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n >= 2 => None,
        Ok(n) => Some(format!("{n} CUDA device(s); two are needed")),
        Err(e) => Some(format!("CUDA: {e}")),
    }
}

/// A decode side over host memory: one reservation `r1` of [`PAGES`] pages and a slot.
struct HostSink {
    request: RequestId,
    pages: Mutex<Vec<u8>>,
    slot: Mutex<Vec<u8>>,
    receiver: NcclReceiver,
}

impl StateSink for HostSink {
    fn hello(&self, _: TransferHello) -> BoxFuture<'_, Result<TransferHelloReply, Status>> {
        Box::pin(async { Err(Status::unimplemented("not needed here")) })
    }

    fn write(&self, frame: PageWrite) -> BoxFuture<'_, Result<u64, Status>> {
        Box::pin(async move {
            if frame.reservation_id != "r1" || frame.request_id.as_ref() != Some(&self.request) {
                return Err(Status::not_found("no such reservation"));
            }
            let offset = frame.offset_bytes as usize;
            let end = offset + frame.data.len();
            let (mut memory, base, limit) = if frame.slot {
                (lock(&self.slot), 0, SLOT)
            } else {
                let page = frame.page.map_or(usize::MAX, |p| p.page as usize);
                if page >= PAGES {
                    return Err(Status::invalid_argument("page outside the reservation"));
                }
                (lock(&self.pages), page * PAGE, PAGE)
            };
            if end > limit {
                return Err(Status::invalid_argument("write past the end"));
            }
            memory[base + offset..base + end].copy_from_slice(&frame.data);
            Ok(frame.data.len() as u64)
        })
    }

    fn nccl(&self) -> Option<&NcclReceiver> {
        Some(&self.receiver)
    }
}

fn lock(memory: &Mutex<Vec<u8>>) -> MutexGuard<'_, Vec<u8>> {
    memory.lock().unwrap_or_else(PoisonError::into_inner)
}

fn bytes(len: usize, salt: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 13) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pages_cross_between_two_gpus() {
    if let Some(why) = missing() {
        println!("skipping the NCCL test: {why}");
        return;
    }
    let request = RequestId {
        id: "q".into(),
        attempt: 0,
    };
    let sink = Arc::new(HostSink {
        request: request.clone(),
        pages: Mutex::new(vec![0; PAGES * PAGE]),
        slot: Mutex::new(vec![0; SLOT]),
        receiver: NcclReceiver::start("decode".into(), 1).unwrap(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(StateTransferServer::new(StateTransferService::new(
                Arc::clone(&sink),
            )))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let sender = NcclSender::start("prefill".into(), 0, Credentials::none()).unwrap();

    // Through a state stream, as the prefill worker sends: pieces in several groups, a page
    // sent again complete after a partial first version, the slot last.
    let descriptor = TransferDescriptor {
        decode_rank: 0,
        transport: TransportKind::Nccl.into(),
        reservation_id: "r1".into(),
        pages: (0..PAGES as u64)
            .map(|p| PageRef {
                region: 0,
                page: p,
                offset_bytes: p * PAGE as u64,
            })
            .collect(),
        slot: Some(PageRef {
            region: 1,
            page: 0,
            offset_bytes: 0,
        }),
        target: Some(Target::Nccl(nccl::target(&address))),
        ..TransferDescriptor::default()
    };
    let page = |i: usize| bytes(PAGE, i as u32);
    let slot = bytes(SLOT, 99);
    let credentials = Credentials::none();
    let stream = StateStream::open(
        &descriptor,
        &request,
        &[TransportKind::Nccl],
        &Initiators::new(&credentials, None).with_nccl(Some(&sender)),
    )
    .unwrap();
    stream
        .send(vec![
            Piece {
                page: Some(0),
                offset: 0,
                data: page(0),
            },
            Piece {
                page: Some(1),
                offset: 0,
                data: vec![7; PAGE / 2],
            },
        ])
        .unwrap();
    stream
        .send(vec![
            Piece {
                page: Some(1),
                offset: 0,
                data: page(1),
            },
            Piece {
                page: Some(3),
                offset: 100,
                data: page(3)[100..].to_vec(),
            },
        ])
        .unwrap();
    let report = stream
        .finish(vec![Piece {
            page: None,
            offset: 0,
            data: slot.clone(),
        }])
        .await
        .unwrap();
    assert_eq!(
        report.bytes,
        (PAGE + PAGE / 2 + PAGE + (PAGE - 100) + SLOT) as u64
    );
    {
        let pages = sink.pages.lock().unwrap();
        assert_eq!(&pages[..PAGE], &page(0)[..]);
        assert_eq!(&pages[PAGE..2 * PAGE], &page(1)[..]);
        assert!(pages[2 * PAGE..3 * PAGE].iter().all(|&b| b == 0));
        assert!(pages[3 * PAGE..3 * PAGE + 100].iter().all(|&b| b == 0));
        assert_eq!(&pages[3 * PAGE + 100..], &page(3)[100..]);
        assert_eq!(*sink.slot.lock().unwrap(), slot);
    }

    // A transfer the decode side refuses (unknown reservation) fails, and the pair carries
    // the next one.
    let segment = |page: u64, data: Vec<u8>| Segment {
        page: PageRef {
            region: 0,
            page,
            offset_bytes: page * PAGE as u64,
        },
        slot: false,
        offset: 0,
        data,
    };
    let refused = sender
        .send(&address, "r2", &request, vec![segment(2, page(20))])
        .await;
    assert!(refused.is_err(), "{refused:?}");
    // Concurrent transfers share the communicator, in sequence order.
    let (a, b) = tokio::join!(
        sender.send(&address, "r1", &request, vec![segment(2, page(2))]),
        sender.send(&address, "r1", &request, vec![segment(3, page(3))]),
    );
    assert_eq!((a.unwrap(), b.unwrap()), (PAGE as u64, PAGE as u64));
    let pages = sink.pages.lock().unwrap();
    assert_eq!(&pages[2 * PAGE..3 * PAGE], &page(2)[..]);
    assert_eq!(&pages[3 * PAGE..], &page(3)[..]);
}
