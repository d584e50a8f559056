//! The plain-TCP transport, sending side: `PageWrite` frames over a client stream to the
//! decode worker's `StateTransfer` service (`crate::sink`). Baseline and fallback: it works
//! everywhere, and the decode side checks every frame against the reservation before a byte is
//! written.

use proto::auth::{AuthChannel, Credentials};
use proto::v1::{
    PageRef, PageWrite, RequestId, TransferDescriptor, state_transfer_client::StateTransferClient,
    transfer_descriptor::Target,
};

use crate::TransferError;

/// Largest data payload of one frame.
pub const FRAME_BYTES: usize = 1 << 20;

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
    use proto::v1::TcpTarget;

    use super::*;

    #[test]
    fn frames_cover_every_page_and_the_slot_in_bounded_pieces() {
        let descriptor = TransferDescriptor {
            decode_rank: 0,
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
