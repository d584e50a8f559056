//! Mutual TLS between roles (`[tls]`): a cluster whose processes hold certificates of one CA
//! serves requests with every gRPC leg encrypted (state over TCP included); a client that
//! speaks plain gRPC, presents no certificate or one of another CA gets nothing; a worker with
//! another CA's certificate cannot join; unusable TLS files stop a process at start.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    net::SocketAddr,
    os::unix::fs::PermissionsExt,
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{command, pd, run_to_exit};
use proto::{
    auth::{ClientTls, ClusterSecret, Credentials},
    v1::{InfoRequest, worker_client::WorkerClient},
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

const SECRET: &str = "3f9a1c7e5b2d4a6f8e0c1b3d5f7a9c2e4b6d8f0a";

/// One CA's files: the CA certificate, and a leaf certificate and key for 127.0.0.1.
struct Pki {
    ca: String,
    cert: String,
    key: String,
}

fn write(dir: &Path, name: &str, text: &str, mode: u32) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

fn pki(dir: &Path, name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let mut leaf = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    leaf.subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    let leaf_key = KeyPair::generate().unwrap();
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
    Pki {
        ca: write(dir, &format!("{name}-ca.pem"), &ca_cert.pem(), 0o644),
        cert: write(dir, &format!("{name}-cert.pem"), &leaf_cert.pem(), 0o644),
        key: write(
            dir,
            &format!("{name}-key.pem"),
            &leaf_key.serialize_pem(),
            0o600,
        ),
    }
}

fn tls_args(p: &Pki) -> Vec<String> {
    [
        "--tls-cert-file",
        &p.cert,
        "--tls-key-file",
        &p.key,
        "--tls-ca-file",
        &p.ca,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

/// `Info` on `addr` over `endpoint`; the status code, or `None` when no answer came at all.
async fn info(endpoint: Endpoint, credentials: &Credentials) -> Result<(), String> {
    let channel = endpoint
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    WorkerClient::new(credentials.channel(channel))
        .info(InfoRequest {})
        .await
        .map(drop)
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

#[test]
fn a_tls_cluster_serves_and_refuses_peers_without_its_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let good = pki(dir.path(), "cluster");
    let rogue = pki(dir.path(), "rogue");
    let secret = write(dir.path(), "secret", SECRET, 0o600);
    let mut router_args = tls_args(&good);
    router_args.extend(["--cluster-secret-file".to_owned(), secret.clone()]);
    let mut worker_args = router_args.clone();
    worker_args.extend(["--transport".to_owned(), "tcp".to_owned()]);
    let router_args: Vec<&str> = router_args.iter().map(String::as_str).collect();
    let worker_args: Vec<&str> = worker_args.iter().map(String::as_str).collect();
    let cluster = pd::cluster_full(1, 1, &router_args, &worker_args);
    let http = cluster.router.addr("http");

    // Router -> prefill -> decode (state frames and commit over TLS) -> router.
    for seed in 0..2 {
        let r = pd::post(http, "/v1/chat/completions", &pd::chat(30, seed, 0.0, 5));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(pd::listed(http).iter().all(|w| w["state"] == "ready"));

    let decode: SocketAddr = cluster.workers[0].addr("grpc");
    // Probes: gRPC health needs the cluster's certificate, like every other call.
    let probe = |tls: &[String]| {
        let mut cmd = command("pdctl");
        cmd.args(["health", "--grpc", &decode.to_string()])
            .args(tls);
        run_to_exit(cmd, Duration::from_secs(20))
    };
    let (status, stdout, stderr) = probe(&tls_args(&good));
    assert!(status.success(), "{stdout} {stderr}");
    let (status, ..) = probe(&[]);
    assert!(!status.success(), "plain health probe answered");
    let secret = ClusterSecret::new(SECRET).unwrap();
    let with_secret = Credentials::new(Some(&secret));
    let client_tls = |p: &Pki| ClientTls::new(&read(&p.cert), &read(&p.key), &read(&p.ca), None);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // The cluster's own identity and secret: answered.
        let right = with_secret.clone().with_tls(Some(client_tls(&good)));
        info(right.endpoint(&decode.to_string()).unwrap(), &right)
            .await
            .unwrap();
        // The right certificate without the secret: authenticated transport, refused call.
        let no_secret = Credentials::none().with_tls(Some(client_tls(&good)));
        let refused = info(no_secret.endpoint(&decode.to_string()).unwrap(), &no_secret).await;
        assert!(refused.unwrap_err().contains("Unauthenticated"));
        // Plain gRPC to a TLS server.
        let plain = info(
            Endpoint::from_shared(format!("http://{decode}")).unwrap(),
            &with_secret,
        )
        .await;
        assert!(plain.is_err(), "plain gRPC was answered");
        // TLS without a client certificate.
        let anonymous =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&good.ca)));
        let endpoint = Endpoint::from_shared(format!("https://{decode}"))
            .unwrap()
            .tls_config(anonymous)
            .unwrap();
        assert!(
            info(endpoint, &with_secret).await.is_err(),
            "answered a client without a certificate"
        );
        // A certificate of another CA (trusting the cluster CA for the server).
        let foreign = ClientTls::new(&read(&rogue.cert), &read(&rogue.key), &read(&good.ca), None);
        let foreign = with_secret.clone().with_tls(Some(foreign));
        assert!(
            info(foreign.endpoint(&decode.to_string()).unwrap(), &foreign)
                .await
                .is_err(),
            "answered a client of another CA"
        );
        // A server of another CA is not trusted by the cluster's clients either.
        let trusting_rogue_only = Credentials::none().with_tls(Some(ClientTls::new(
            &read(&good.cert),
            &read(&good.key),
            &read(&rogue.ca),
            None,
        )));
        assert!(
            info(
                trusting_rogue_only.endpoint(&decode.to_string()).unwrap(),
                &trusting_rogue_only
            )
            .await
            .is_err()
        );
    });
    drop(rt);

    // A worker holding the secret but another CA's certificate cannot join.
    let router_grpc = cluster.router.addr("grpc").to_string();
    let mut args = vec![
        "--page-size".to_owned(),
        "16".to_owned(),
        "--router".to_owned(),
        router_grpc,
        "--cluster-secret-file".to_owned(),
        write(dir.path(), "secret2", SECRET, 0o600),
    ];
    args.extend(tls_args(&rogue));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut intruder = pd::worker("pdserve-prefill", &args);
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert_eq!(pd::listed(http).len(), 2, "a worker of another CA joined");
        std::thread::sleep(Duration::from_millis(250));
    }
    intruder.terminate();
    let r = pd::post(http, "/v1/chat/completions", &pd::chat(8, 3, 0.0, 3));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn unusable_tls_settings_stop_every_role_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let good = pki(dir.path(), "cluster");
    let open_key = write(
        dir.path(),
        "open-key.pem",
        &String::from_utf8(read(&good.key)).unwrap(),
        0o644,
    );
    let not_pem = write(dir.path(), "not.pem", "certificate", 0o600);
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec!["--tls-cert-file", &good.cert, "--tls-ca-file", &good.ca],
            "go together",
        ),
        (
            vec![
                "--tls-cert-file",
                &good.cert,
                "--tls-key-file",
                &open_key,
                "--tls-ca-file",
                &good.ca,
            ],
            "chmod 600",
        ),
        (
            vec![
                "--tls-cert-file",
                &not_pem,
                "--tls-key-file",
                &good.key,
                "--tls-ca-file",
                &good.ca,
            ],
            "not PEM",
        ),
    ];
    for bin in ["pdserve-router", "pdserve-prefill", "pdserve-decode"] {
        for (args, why) in &cases {
            let mut cmd = command(bin);
            cmd.args(["--grpc-listen", "127.0.0.1:0"]).args(args);
            if bin == "pdserve-router" {
                cmd.args(["--http-listen", "127.0.0.1:0"]);
            }
            let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(20));
            assert_eq!(status.code(), Some(2), "{bin} {args:?}: {stdout} {stderr}");
            assert!(
                stderr.contains("tls.") && stderr.contains(why),
                "{bin} {args:?}: {stderr}"
            );
            assert!(
                !stderr.contains("PRIVATE KEY"),
                "{bin} printed key material"
            );
        }
    }
}
