//! The decode worker's side of the handoff at the RPC level: reservations expire and free their
//! pages, writes outside a live reservation are refused, and a commit whose page checksums do
//! not match what landed fails (nothing is admitted).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::time::Duration;

use integration_tests::{Service, command, tiny_model_dir};
use proto::auth::Credentials;
use proto::v1::{
    CommitRequest, ErrorKind, GeneratedToken, InfoRequest, RequestId, ReserveRequest,
    TransportKind, decode_client::DecodeClient, worker_client::WorkerClient,
};

fn decode_worker() -> Service {
    let mut cmd = command("pdserve-decode");
    cmd.args([
        "--grpc-listen",
        "127.0.0.1:0",
        "--model-dir",
        &tiny_model_dir().display().to_string(),
        "--page-size",
        "16",
        "--transport",
        "tcp",
    ]);
    Service::start(cmd)
}

#[test]
fn leases_checksums_and_bounds() {
    let worker = decode_worker();
    let addr = format!("http://{}", worker.addr("grpc"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut info = WorkerClient::connect(addr.clone()).await.unwrap();
        let layout = info
            .info(InfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .layout
            .unwrap();
        let page_bytes = usize::try_from(layout.page_bytes).unwrap();
        let slot_bytes = usize::try_from(layout.slot_bytes).unwrap();
        let mut decode = DecodeClient::connect(addr.clone()).await.unwrap();
        let reserve = |id: &str, lease_ms: u32| ReserveRequest {
            request_id: Some(RequestId {
                id: id.to_owned(),
                attempt: 1,
            }),
            prompt_tokens: 20,
            max_new_tokens: 10,
            lease_ms,
            queue_timeout_ms: 0,
            prefill_layout: Some(layout.clone()),
            transports: vec![TransportKind::Tcp.into()],
            decode_rank: None,
        };
        let pages_used = |l: proto::v1::Load| (l.pages_used - l.pages_cached, l.reservations);
        let baseline = pages_used(
            info.info(InfoRequest {})
                .await
                .unwrap()
                .into_inner()
                .load
                .unwrap(),
        );

        // A lease that runs out frees its pages; the late commit finds nothing.
        let r = decode
            .reserve(reserve("a", 150))
            .await
            .unwrap()
            .into_inner();
        let dest = r.destination.unwrap();
        assert_eq!(dest.pages.len(), 2, "30 tokens in pages of 16");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let now = pages_used(
            info.info(InfoRequest {})
                .await
                .unwrap()
                .into_inner()
                .load
                .unwrap(),
        );
        assert_eq!(now, baseline, "an expired reservation holds nothing");
        let late = decode
            .commit(CommitRequest {
                reservation_id: dest.reservation_id.clone(),
                request_id: Some(RequestId {
                    id: "a".into(),
                    attempt: 1,
                }),
                first_token: Some(GeneratedToken::default()),
                prompt_tokens: 20,
                ..CommitRequest::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            proto::error::from_status(&late).kind,
            i32::from(ErrorKind::NotFound)
        );

        // Written state whose checksums do not match fails the commit and frees the pages.
        let r = decode
            .reserve(reserve("b", 30_000))
            .await
            .unwrap()
            .into_inner();
        let dest = r.destination.unwrap();
        let id = RequestId {
            id: "b".into(),
            attempt: 1,
        };
        let pages = vec![vec![7u8; page_bytes]; 2];
        let slot = vec![5u8; slot_bytes];
        let sent = kv_transfer::tcp::send_state(&dest, &id, &pages, &slot, &Credentials::none())
            .await
            .unwrap();
        assert_eq!(sent as usize, 2 * page_bytes + slot_bytes);
        let mut tampered = pages.clone();
        tampered[1][3] ^= 0x40;
        let bad = decode
            .commit(CommitRequest {
                reservation_id: dest.reservation_id.clone(),
                request_id: Some(id.clone()),
                first_token: Some(GeneratedToken::default()),
                prompt_tokens: 20,
                checksums: kv_transfer::checksum::of_state(&dest, &tampered, &slot),
                ..CommitRequest::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            proto::error::from_status(&bad).kind,
            i32::from(ErrorKind::TransferFailed),
            "{bad:?}"
        );
        assert!(
            bad.message().contains("checksum mismatch on page"),
            "{bad:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = pages_used(
            info.info(InfoRequest {})
                .await
                .unwrap()
                .into_inner()
                .load
                .unwrap(),
        );
        assert_eq!(now, baseline, "a failed commit holds nothing");

        // The right checksums commit; writes to another request's or an unknown reservation
        // are refused.
        let r = decode
            .reserve(reserve("c", 30_000))
            .await
            .unwrap()
            .into_inner();
        let dest = r.destination.unwrap();
        let id = RequestId {
            id: "c".into(),
            attempt: 1,
        };
        let stranger = RequestId {
            id: "x".into(),
            attempt: 1,
        };
        assert!(
            kv_transfer::tcp::send_state(&dest, &stranger, &pages, &slot, &Credentials::none())
                .await
                .is_err()
        );
        kv_transfer::tcp::send_state(&dest, &id, &pages, &slot, &Credentials::none())
            .await
            .unwrap();
        decode
            .commit(CommitRequest {
                reservation_id: dest.reservation_id.clone(),
                request_id: Some(id),
                first_token: Some(GeneratedToken::default()),
                prompt_tokens: 20,
                checksums: kv_transfer::checksum::of_state(&dest, &pages, &slot),
                ..CommitRequest::default()
            })
            .await
            .unwrap();
    });
}
