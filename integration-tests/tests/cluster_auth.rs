//! Authentication between roles: with `cluster_secret_file` set, every internal gRPC call
//! carries the shared secret, a cluster whose roles share it serves requests, and every
//! service refuses calls without it or with another secret (except standard health). A worker
//! with another secret cannot join the router, and a secret file that is unsafe or malformed
//! stops a process at start.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    io::Write,
    net::SocketAddr,
    os::unix::fs::PermissionsExt,
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{
    SERVING, command, grpc_health,
    pd::{self, Cluster},
    run_to_exit,
};
use proto::{
    auth::{ClusterSecret, Credentials},
    v1::{
        InfoRequest, PrefillRequest, RegisterRequest, ReserveRequest, TransferHello, WorkerInfo,
        decode_client::DecodeClient, prefill_client::PrefillClient,
        registry_client::RegistryClient, state_transfer_client::StateTransferClient,
        worker_client::WorkerClient,
    },
};
use tonic::Code;

const SECRET: &str = "6f1d9c3a2b7e48d5a0c4f2e19b8d7a6c5e4f3a2b1c0d9e8f";
const OTHER: &str = "0000000000000000000000000000000000000000000000000";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn secret_file(dir: &Path, name: &str, text: &str, mode: u32) -> String {
    let path = dir.join(name);
    let mut file = std::fs::File::create(&path).unwrap();
    writeln!(file, "{text}").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

fn credentials(secret: Option<&str>) -> Credentials {
    Credentials::new(secret.map(|s| ClusterSecret::new(s).unwrap()).as_ref())
}

/// The gRPC status code of one call of every internal service at `addr` (the ones it
/// serves), made with `credentials`; `Ok` where the call got past authentication (any answer
/// but UNAUTHENTICATED counts, since these probes carry no real request).
async fn probe(
    addr: SocketAddr,
    credentials: &Credentials,
    services: &[&str],
) -> Vec<(String, Code)> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let channel = credentials.channel(channel);
    let code = |r: Result<(), tonic::Status>| r.map_or_else(|s| s.code(), |()| Code::Ok);
    let mut codes = Vec::new();
    for service in services {
        let result = match *service {
            "Worker" => WorkerClient::new(channel.clone())
                .info(InfoRequest {})
                .await
                .map(drop),
            "Decode" => DecodeClient::new(channel.clone())
                .reserve(ReserveRequest::default())
                .await
                .map(drop),
            "StateTransfer" => StateTransferClient::new(channel.clone())
                .hello(TransferHello::default())
                .await
                .map(drop),
            "Prefill" => PrefillClient::new(channel.clone())
                .prefill(PrefillRequest::default())
                .await
                .map(drop),
            "Registry" => RegistryClient::new(channel.clone())
                .register(RegisterRequest {
                    worker: Some(WorkerInfo::default()),
                })
                .await
                .map(drop),
            other => panic!("no probe for {other}"),
        };
        codes.push(((*service).to_owned(), code(result)));
    }
    codes
}

fn secured_cluster(secret: &str) -> Cluster {
    // TCP carries the state over the StateTransfer gRPC service, so the transfer itself is
    // authenticated here (UCX runs in `pdctl up`, which always uses a secret).
    pd::cluster_full(
        1,
        1,
        &["--cluster-secret-file", secret],
        &["--cluster-secret-file", secret, "--transport", "tcp"],
    )
}

#[test]
fn roles_sharing_the_secret_serve_and_refuse_everyone_else() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", SECRET, 0o600);
    let cluster = secured_cluster(&secret);
    let http = cluster.router.addr("http");

    // Requests flow through every authenticated leg: router -> prefill, router -> decode,
    // prefill -> decode (state over TCP, then Commit).
    for seed in 0..3 {
        let r = pd::post(http, "/v1/chat/completions", &pd::chat(40, seed, 0.0, 6));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let listed = pd::listed(http);
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.iter().all(|w| w["alive"] == true), "{listed:?}");

    let decode = cluster.workers[0].addr("grpc");
    let prefill = cluster.workers[1].addr("grpc");
    let router = cluster.router.addr("grpc");
    let targets: [(SocketAddr, &[&str]); 3] = [
        (decode, &["Worker", "Decode", "StateTransfer"]),
        (prefill, &["Worker", "Prefill"]),
        (router, &["Registry"]),
    ];
    let rt = runtime();
    for (addr, services) in targets {
        for wrong in [None, Some(OTHER), Some(&SECRET[..SECRET.len() - 1])] {
            let codes = rt.block_on(probe(addr, &credentials(wrong), services));
            assert!(
                codes.iter().all(|(_, c)| *c == Code::Unauthenticated),
                "{addr} with {wrong:?}: {codes:?}"
            );
        }
        let codes = rt.block_on(probe(addr, &credentials(Some(SECRET)), services));
        assert!(
            codes.iter().all(|(_, c)| *c != Code::Unauthenticated),
            "{addr} with the secret: {codes:?}"
        );
        // Health stays open to probes without credentials.
        assert_eq!(rt.block_on(grpc_health(addr, "")).unwrap(), SERVING);
    }
    // The refused calls changed nothing: the cluster still serves.
    let r = pd::post(http, "/v1/chat/completions", &pd::chat(12, 9, 0.0, 4));
    assert_eq!(r.status, 200, "{}", r.body);
    drop(rt);
}

#[test]
fn a_worker_with_another_secret_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path(), "secret", SECRET, 0o600);
    let other = secret_file(dir.path(), "other", OTHER, 0o600);
    let cluster = secured_cluster(&secret);
    let http = cluster.router.addr("http");
    let router_grpc = cluster.router.addr("grpc").to_string();

    let mut intruder = pd::worker(
        "pdserve-prefill",
        &[
            "--page-size",
            "16",
            "--router",
            &router_grpc,
            "--cluster-secret-file",
            &other,
        ],
    );
    // A worker with the right secret registers within a heartbeat or two; give the intruder
    // several times that.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let listed = pd::listed(http);
        assert_eq!(listed.len(), 2, "an intruder joined: {listed:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
    intruder.terminate();
    let log = intruder.stderr();
    assert!(log.contains("registration failed"), "{log}");
    assert!(log.contains("cluster secret"), "{log}");

    // The same worker with the right secret does join.
    let _joined = pd::worker(
        "pdserve-prefill",
        &[
            "--page-size",
            "16",
            "--router",
            &router_grpc,
            "--cluster-secret-file",
            &secret,
        ],
    );
    let until = Instant::now() + Duration::from_secs(10);
    while pd::listed(http).len() < 3 {
        assert!(
            Instant::now() < until,
            "the worker with the secret never joined"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn unsafe_or_malformed_secret_files_stop_every_role_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let readable = secret_file(dir.path(), "readable", SECRET, 0o644);
    let short = secret_file(dir.path(), "short", "hunter2", 0o600);
    let missing = dir.path().join("missing").display().to_string();
    for bin in ["pdserve-router", "pdserve-prefill", "pdserve-decode"] {
        for (file, why) in [
            (&readable, "chmod 600"),
            (&short, "7 characters"),
            (&missing, "No such file"),
        ] {
            let mut cmd = command(bin);
            cmd.args([
                "--grpc-listen",
                "127.0.0.1:0",
                "--cluster-secret-file",
                file,
            ]);
            if bin == "pdserve-router" {
                cmd.args(["--http-listen", "127.0.0.1:0"]);
            }
            let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(20));
            assert_eq!(status.code(), Some(2), "{bin} {file}: {stdout} {stderr}");
            assert!(
                stderr.contains("cluster_secret_file") && stderr.contains(why),
                "{bin} {file}: {stderr}"
            );
            assert!(
                !stderr.contains(SECRET),
                "{bin} printed the secret: {stderr}"
            );
        }
    }
}

/// Midway through a rotation the processes present different secrets but accept both (one per
/// line, the first presented): router -> workers and prefill -> decode calls all pass.
#[test]
fn processes_midway_through_a_secret_rotation_still_talk() {
    let dir = tempfile::tempdir().unwrap();
    let old_first = secret_file(
        dir.path(),
        "old-first",
        &format!("{SECRET}\n{OTHER}"),
        0o600,
    );
    let new_first = secret_file(
        dir.path(),
        "new-first",
        &format!("{OTHER}\n{SECRET}"),
        0o600,
    );
    let decode = pd::worker(
        "pdserve-decode",
        &[
            "--page-size",
            "16",
            "--transport",
            "tcp",
            "--cluster-secret-file",
            &old_first,
        ],
    );
    let prefill = pd::worker(
        "pdserve-prefill",
        &[
            "--page-size",
            "16",
            "--transport",
            "tcp",
            "--cluster-secret-file",
            &new_first,
        ],
    );
    let model = pd::model_arg();
    let (d, p) = (
        decode.addr("grpc").to_string(),
        prefill.addr("grpc").to_string(),
    );
    let router = integration_tests::start_router(
        &[
            "--model-dir",
            &model,
            "--decode-worker",
            &d,
            "--prefill-worker",
            &p,
            "--cluster-secret-file",
            &new_first,
        ],
        true,
    );
    let http = router.addr("http");
    for seed in 0..2 {
        let r = pd::post(http, "/v1/chat/completions", &pd::chat(25, seed, 0.0, 5));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // A client presenting only the old secret is still accepted by both workers.
    let rt = runtime();
    for addr in [decode.addr("grpc"), prefill.addr("grpc")] {
        let codes = rt.block_on(probe(addr, &credentials(Some(SECRET)), &["Worker"]));
        assert_eq!(codes[0].1, Code::Ok, "{addr}");
    }
}
