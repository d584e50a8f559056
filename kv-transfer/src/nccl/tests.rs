//! The NCCL transport's tests.

use super::*;

fn segment(page: u64, offset: u64, len: usize, fill: u8) -> Segment {
    Segment {
        page: PageRef {
            region: 0,
            page,
            offset_bytes: page * 4096,
        },
        slot: false,
        offset,
        data: vec![fill; len],
    }
}

#[test]
fn batches_keep_order_and_bound_every_transfer() {
    let out = batches(
        vec![
            segment(0, 0, 6, 1),
            segment(1, 0, 3, 2),
            segment(2, 4, 21, 3),
            segment(3, 0, 0, 4),
        ],
        10,
    );
    let shape: Vec<Vec<(u64, u64, usize)>> = out
        .iter()
        .map(|b| {
            b.iter()
                .map(|s| (s.page.page, s.offset, s.data.len()))
                .collect()
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            vec![(0, 0, 6), (1, 0, 3)],
            vec![(2, 4, 10)],
            vec![(2, 14, 10)],
            vec![(2, 24, 1), (3, 0, 0)],
        ]
    );
    assert!(batches(Vec::new(), 10).is_empty());
}

#[test]
fn unique_ids_survive_the_wire() {
    let bytes: Vec<u8> = (0..ID_BYTES).map(|i| (i * 7 % 256) as u8).collect();
    let id = id_from_bytes(&bytes).unwrap();
    assert_eq!(id_bytes(&id), bytes);
    assert!(id_from_bytes(&bytes[..127]).is_none());
}

#[test]
fn starting_without_cuda_or_nccl_is_an_error_not_a_panic() {
    // On a GPU host with NCCL both start; elsewhere both explain what is missing.
    match NcclSender::start("p".into(), 0, Credentials::none()) {
        Ok(sender) => assert!(format!("{sender:?}").contains("NcclSender")),
        Err(e) => assert!(matches!(e, TransferError::Failed { .. }), "{e}"),
    }
    match NcclReceiver::start("d".into(), 0) {
        Ok(receiver) => assert!(format!("{receiver:?}").contains("NcclReceiver")),
        Err(e) => assert!(
            e.to_string().contains("not present") || e.to_string().contains("device"),
            "{e}"
        ),
    }
}

#[test]
fn link_errors_read_as_the_messages_callers_see() {
    let cases = [
        (
            LinkError::Cuda {
                call: "device buffer of 8 bytes".into(),
                message: "out of memory".into(),
            },
            "device buffer of 8 bytes: out of memory".to_owned(),
        ),
        (
            LinkError::Closed,
            "the NCCL connection was closed".to_owned(),
        ),
        (
            LinkError::Timeout,
            format!("the peer did not complete the transfer within {TIMEOUT:?} (gone?)"),
        ),
        (
            LinkError::OutOfOrder { seq: 3, next: 1 },
            "transfer 3 queued out of order (1 next)".to_owned(),
        ),
        (
            LinkError::Replaced,
            "the NCCL connection was replaced or closed".to_owned(),
        ),
        (
            LinkError::Disconnected,
            "the NCCL connection closed".to_owned(),
        ),
        (
            LinkError::NotAnnounced(4),
            format!("transfer 4 was not announced within {TIMEOUT:?}"),
        ),
        (
            LinkError::AnnouncedTwice(5),
            "transfer 5 announced twice".to_owned(),
        ),
    ];
    for (error, text) in cases {
        assert_eq!(error.to_string(), text);
    }
}

#[test]
fn descriptors_carry_the_address_and_no_id() {
    let t = target("10.0.0.1:7000");
    assert!(t.unique_id.is_empty());
    assert_eq!((t.prefill_rank, t.decode_rank), (0, 1));
    assert_eq!(t.address, "10.0.0.1:7000");
}
