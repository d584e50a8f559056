//! One request's state on its way into a decode reservation while the prompt is still being
//! computed: the prefill side hands over pieces (a layer's rows of the pages a chunk touched,
//! prefix-cached pages, finally the slot) as they become final, and a task moves them in
//! order over the negotiated transport. Order matters: a page a chunk left half-filled is sent
//! again, complete, by the next chunk, so a piece must never land before one queued earlier.
//!
//! - UCX: the pieces queued while the previous puts were in flight go out together and are
//!   flushed before the next group, so a group never overtakes the one before it.
//! - TCP: one `StateTransfer` client stream for the request; the decode side applies frames
//!   in the order they were sent. The slot is the last piece: the stream ends with it.
//! - NCCL (builds with the `nccl` feature): the pieces queued while the previous transfer was
//!   in flight go out as the next transfer(s), each confirmed in place before the next.

use std::time::{Duration, Instant};

use proto::{
    auth::Credentials,
    v1::{
        PageRef, PageWrite, PageWriteSummary, RequestId, TransferDescriptor, TransportKind,
        UcxTarget, transfer_descriptor::Target,
    },
};
use tokio::{sync::mpsc, task::JoinHandle};

#[cfg(feature = "nccl")]
use crate::nccl::{MAX_TRANSFER_BYTES, NcclSender, Segment, batches};
use crate::{
    TransferError,
    tcp::FRAME_BYTES,
    ucx::{Put, Putter},
};

/// Bytes for the reservation's `page`-th page (`None`: its state slot) at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub page: Option<usize>,
    pub offset: u64,
    pub data: Vec<u8>,
}

/// What moving one request's state cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamReport {
    /// Bytes the decode side confirmed.
    pub bytes: u64,
    /// Time the transport was busy with this request's pieces (UCX: puts until flushed; TCP:
    /// handing frames to the stream under its flow control, and the final confirmation; NCCL:
    /// transfers until confirmed).
    pub busy: Duration,
    /// When the last piece was confirmed in place.
    pub done: Instant,
}

/// A running transfer of one request's state. Dropping it abandons the transfer (nothing is
/// committed, so the decode side's lease frees the pages).
#[derive(Debug)]
pub struct StateStream {
    pieces: mpsc::UnboundedSender<Vec<Piece>>,
    task: JoinHandle<Result<StreamReport, TransferError>>,
}

/// This side's initiators of the transports that need one: the credentials of gRPC calls to
/// the decode side (TCP), the UCX putter, and (builds with `nccl`) the NCCL sender.
#[derive(Debug, Clone, Copy)]
pub struct Initiators<'a> {
    credentials: &'a Credentials,
    ucx: Option<&'a Putter>,
    #[cfg(feature = "nccl")]
    nccl: Option<&'a NcclSender>,
}

impl<'a> Initiators<'a> {
    pub fn new(credentials: &'a Credentials, ucx: Option<&'a Putter>) -> Self {
        Self {
            credentials,
            ucx,
            #[cfg(feature = "nccl")]
            nccl: None,
        }
    }

    /// With this side's NCCL sender, for descriptors that name NCCL.
    #[cfg(feature = "nccl")]
    #[must_use]
    pub fn with_nccl(mut self, nccl: Option<&'a NcclSender>) -> Self {
        self.nccl = nccl;
        self
    }
}

impl StateStream {
    /// Starts moving pieces into `destination` with its transport, if `offered` includes it
    /// and this side has its initiator. The one way to open a state stream, whatever the
    /// transport.
    pub fn open(
        destination: &TransferDescriptor,
        request_id: &RequestId,
        offered: &[TransportKind],
        initiators: &Initiators<'_>,
    ) -> Result<Self, TransferError> {
        Self::start(destination, request_id, offered, initiators)
    }

    fn start(
        destination: &TransferDescriptor,
        request_id: &RequestId,
        offered: &[TransportKind],
        initiators: &Initiators<'_>,
    ) -> Result<Self, TransferError> {
        let slot = destination
            .slot
            .ok_or_else(|| TransferError::Descriptor("no state slot".to_owned()))?;
        let pages = Pages {
            pages: destination.pages.clone(),
            slot,
        };
        let kind = TransportKind::try_from(destination.transport).ok();
        let (tx, rx) = mpsc::unbounded_channel();
        let task = match (kind, &destination.target) {
            (Some(k @ TransportKind::Ucx), Some(Target::Ucx(target))) if offered.contains(&k) => {
                let putter = initiators.ucx.cloned().ok_or_else(|| {
                    TransferError::Descriptor("this worker does not offer UCX".to_owned())
                })?;
                tokio::spawn(run_ucx(
                    putter,
                    target.clone(),
                    pages,
                    destination.replicas,
                    rx,
                ))
            }
            #[cfg(feature = "nccl")]
            (Some(k @ TransportKind::Nccl), Some(Target::Nccl(target))) if offered.contains(&k) => {
                let sender = initiators.nccl.cloned().ok_or_else(|| {
                    TransferError::Descriptor("this worker does not offer NCCL".to_owned())
                })?;
                tokio::spawn(run_nccl(
                    sender,
                    target.address.clone(),
                    destination.reservation_id.clone(),
                    request_id.clone(),
                    pages,
                    rx,
                ))
            }
            (Some(k @ TransportKind::Tcp), Some(Target::Tcp(target))) if offered.contains(&k) => {
                let frame = PageWrite {
                    reservation_id: destination.reservation_id.clone(),
                    request_id: Some(request_id.clone()),
                    ..PageWrite::default()
                };
                tokio::spawn(run_tcp(
                    target.address.clone(),
                    initiators.credentials.clone(),
                    frame,
                    pages,
                    rx,
                ))
            }
            (kind, _) => {
                return Err(TransferError::Descriptor(format!(
                    "transport {kind:?} is not offered by this worker or lacks its target"
                )));
            }
        };
        Ok(Self { pieces: tx, task })
    }

    /// Queues pieces behind those already queued. Fails once the transfer has failed (the
    /// error itself comes from [`Self::finish`]).
    pub fn send(&self, pieces: Vec<Piece>) -> Result<(), TransferError> {
        self.pieces.send(pieces).map_err(|_| TransferError::Failed {
            peer: "decode".to_owned(),
            message: "the transfer already stopped".to_owned(),
        })
    }

    /// Queues the last pieces (if any) and waits until everything is in place.
    pub async fn finish(self, rest: Vec<Piece>) -> Result<StreamReport, TransferError> {
        if !rest.is_empty() {
            // A send error means the task already ended; its result says why.
            let _ = self.pieces.send(rest);
        }
        drop(self.pieces);
        self.task.await.map_err(|e| TransferError::Failed {
            peer: "decode".to_owned(),
            message: format!("transfer task: {e}"),
        })?
    }
}

/// The reservation's pages and slot, to turn piece indices into remote locations.
struct Pages {
    pages: Vec<PageRef>,
    slot: PageRef,
}

impl Pages {
    fn get(&self, page: Option<usize>) -> Result<PageRef, TransferError> {
        match page {
            None => Ok(self.slot),
            Some(i) => self.pages.get(i).copied().ok_or_else(|| {
                TransferError::Descriptor(format!(
                    "page {i} of the state but {} pages reserved",
                    self.pages.len()
                ))
            }),
        }
    }
}

/// Splits queued pieces into groups that may be in flight together (puts issued together
/// complete in any order): a piece for exactly the place of an earlier one in the group
/// replaces it (it holds everything the earlier one held, and more); a piece that overlaps an
/// earlier one differently starts a new group.
fn groups(pieces: Vec<Piece>) -> Vec<Vec<Piece>> {
    let mut out: Vec<Vec<Piece>> = Vec::new();
    for piece in pieces {
        let end = piece.offset + piece.data.len() as u64;
        let Some(group) = out.last_mut() else {
            out.push(vec![piece]);
            continue;
        };
        let overlapping = group.iter().position(|p| {
            p.page == piece.page && p.offset < end && piece.offset < p.offset + p.data.len() as u64
        });
        match overlapping {
            None => group.push(piece),
            Some(i)
                if group[i].offset == piece.offset && group[i].data.len() == piece.data.len() =>
            {
                group[i] = piece;
            }
            Some(_) => out.push(vec![piece]),
        }
    }
    out
}

async fn run_ucx(
    putter: Putter,
    target: UcxTarget,
    pages: Pages,
    replicas: u32,
    mut rx: mpsc::UnboundedReceiver<Vec<Piece>>,
) -> Result<StreamReport, TransferError> {
    let (mut bytes, mut busy, mut done) = (0u64, Duration::ZERO, Instant::now());
    while let Some(mut group) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            group.extend(more);
        }
        for group in groups(group) {
            // Each copy of the state (one per replica rank) lives two regions further on.
            let mut puts = Vec::with_capacity(group.len() * replicas.max(1) as usize);
            for piece in group {
                let at = pages.get(piece.page)?;
                for copy in 1..replicas.max(1) {
                    puts.push(Put {
                        region: (at.region + 2 * copy) as usize,
                        offset: at.offset_bytes + piece.offset,
                        data: piece.data.clone(),
                    });
                }
                puts.push(Put {
                    region: at.region as usize,
                    offset: at.offset_bytes + piece.offset,
                    data: piece.data,
                });
            }
            let started = Instant::now();
            bytes += putter.put(target.clone(), puts).await?;
            done = Instant::now();
            busy += done - started;
        }
    }
    Ok(StreamReport { bytes, busy, done })
}

#[cfg(feature = "nccl")]
async fn run_nccl(
    sender: NcclSender,
    address: String,
    reservation_id: String,
    request_id: RequestId,
    pages: Pages,
    mut rx: mpsc::UnboundedReceiver<Vec<Piece>>,
) -> Result<StreamReport, TransferError> {
    let (mut bytes, mut busy, mut done) = (0u64, Duration::ZERO, Instant::now());
    while let Some(mut group) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            group.extend(more);
        }
        // The decode side applies a transfer's pieces one after another, in order, so pieces
        // for the same place may share a transfer.
        let segments = group
            .into_iter()
            .map(|piece| {
                Ok(Segment {
                    page: pages.get(piece.page)?,
                    slot: piece.page.is_none(),
                    offset: piece.offset,
                    data: piece.data,
                })
            })
            .collect::<Result<Vec<_>, TransferError>>()?;
        for batch in batches(segments, MAX_TRANSFER_BYTES) {
            let started = Instant::now();
            bytes += sender
                .send(&address, &reservation_id, &request_id, batch)
                .await?;
            done = Instant::now();
            busy += done - started;
        }
    }
    Ok(StreamReport { bytes, busy, done })
}

async fn run_tcp(
    peer: String,
    credentials: Credentials,
    frame: PageWrite,
    pages: Pages,
    mut rx: mpsc::UnboundedReceiver<Vec<Piece>>,
) -> Result<StreamReport, TransferError> {
    let failed = |message: String| TransferError::Failed {
        peer: peer.clone(),
        message,
    };
    let mut client = crate::tcp::connect(&peer, &credentials)
        .await
        .map_err(|e| failed(e.to_string()))?
        .max_decoding_message_size(FRAME_BYTES * 2)
        .max_encoding_message_size(FRAME_BYTES * 2);
    // A few frames in flight; beyond that, sending waits for the stream (flow control).
    let (frames, frames_rx) = mpsc::channel::<PageWrite>(8);
    let call = tokio::spawn(async move {
        client
            .write(tokio_stream::wrappers::ReceiverStream::new(frames_rx))
            .await
    });
    let (mut sent_bytes, mut sent_frames, mut busy) = (0u64, 0u64, Duration::ZERO);
    let mut slot_sent = false;
    'pieces: while let Some(group) = rx.recv().await {
        for piece in group {
            if slot_sent {
                return Err(TransferError::Descriptor(
                    "state queued after the slot (the slot comes last)".to_owned(),
                ));
            }
            slot_sent = piece.page.is_none();
            let at = pages.get(piece.page)?;
            for (i, chunk) in piece.data.chunks(FRAME_BYTES).enumerate() {
                let started = Instant::now();
                let sent = frames
                    .send(PageWrite {
                        page: Some(at),
                        slot: piece.page.is_none(),
                        offset_bytes: piece.offset + (i * FRAME_BYTES) as u64,
                        data: chunk.to_vec(),
                        ..frame.clone()
                    })
                    .await;
                busy += started.elapsed();
                if sent.is_err() {
                    // The call ended early: its status says why.
                    break 'pieces;
                }
                sent_bytes += chunk.len() as u64;
                sent_frames += 1;
            }
        }
        if slot_sent {
            // The slot is the last piece: end the stream now for the confirmation, without
            // waiting for the caller to finish.
            break;
        }
    }
    drop(frames);
    let started = Instant::now();
    let summary: PageWriteSummary = call
        .await
        .map_err(|e| failed(e.to_string()))?
        .map_err(|status| failed(proto::error::from_status(&status).message))?
        .into_inner();
    let done = Instant::now();
    busy += done - started;
    if rx.recv().await.is_some() {
        return Err(TransferError::Descriptor(
            "state queued after the slot (the slot comes last)".to_owned(),
        ));
    }
    if summary.bytes != sent_bytes || summary.frames != sent_frames {
        return Err(failed(format!(
            "the decode side applied {} bytes in {} frames; {sent_bytes} bytes in \
             {sent_frames} frames were sent",
            summary.bytes, summary.frames
        )));
    }
    Ok(StreamReport {
        bytes: summary.bytes,
        busy,
        done,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(page: Option<usize>, offset: u64, fill: u8) -> Piece {
        Piece {
            page,
            offset,
            data: vec![fill; 8],
        }
    }

    #[test]
    fn pieces_in_flight_together_never_overlap() {
        let out = groups(vec![
            piece(Some(0), 0, 1),
            piece(Some(0), 64, 2),
            piece(Some(1), 0, 3),
            piece(Some(0), 0, 4),
            piece(None, 0, 5),
            piece(Some(1), 4, 6),
            piece(Some(2), 0, 7),
        ]);
        assert_eq!(
            out,
            vec![
                vec![
                    piece(Some(0), 0, 4),
                    piece(Some(0), 64, 2),
                    piece(Some(1), 0, 3),
                    piece(None, 0, 5),
                ],
                vec![piece(Some(1), 4, 6), piece(Some(2), 0, 7)],
            ]
        );
    }

    #[test]
    fn pieces_outside_the_reservation_are_refused() {
        let pages = Pages {
            pages: vec![PageRef::default(); 2],
            slot: PageRef::default(),
        };
        assert!(pages.get(Some(1)).is_ok());
        assert!(matches!(
            pages.get(Some(2)),
            Err(TransferError::Descriptor(_))
        ));
        assert!(pages.get(None).is_ok());
    }
}
