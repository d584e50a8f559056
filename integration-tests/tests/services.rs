//! Each service binary starts on ephemeral loopback ports, serves gRPC health, and exits 0 on
//! SIGTERM; bad configuration is a one-line error naming the key and exit status 2.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{io::Write, process::Command, time::Duration};

use integration_tests::{SERVING, Service, command, grpc_health, run_to_exit};
use proto::v1::{DrainRequest, InfoRequest, Role, WorkerState, worker_client::WorkerClient};

const EPHEMERAL: &str = "127.0.0.1:0";

fn router() -> Command {
    let mut cmd = command("pdserve-router");
    cmd.args(["--http-listen", EPHEMERAL, "--grpc-listen", EPHEMERAL]);
    cmd
}

fn worker(bin: &str) -> Command {
    let mut cmd = command(bin);
    cmd.args(["--grpc-listen", EPHEMERAL]);
    cmd
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn router_serves_health_and_stops_on_sigterm() {
    let mut svc = Service::start(router());
    assert_eq!(svc.ready["role"], "router");
    let rt = runtime();
    let status = rt.block_on(grpc_health(svc.addr("grpc"), "")).unwrap();
    assert_eq!(status, SERVING);
    let http = rt
        .block_on(common::http_client::get(
            svc.addr("http"),
            "/health",
            Duration::from_secs(5),
        ))
        .unwrap();
    assert_eq!(http.status, 200);
    let missing = rt
        .block_on(common::http_client::get(
            svc.addr("http"),
            "/v1/nope",
            Duration::from_secs(5),
        ))
        .unwrap();
    assert_eq!(missing.status, 404);
    let body = String::from_utf8_lossy(&missing.body);
    assert!(
        body.contains("\"error\"") && body.contains("/v1/nope"),
        "{body}"
    );
    drop(rt);
    let exit = svc.terminate().expect("router exits after SIGTERM");
    assert!(exit.success(), "{exit:?}: {}", svc.stderr());
}

fn check_worker(bin: &str, role: Role) {
    let mut svc = Service::start(worker(bin));
    let addr = svc.addr("grpc");
    let rt = runtime();
    assert_eq!(rt.block_on(grpc_health(addr, "")).unwrap(), SERVING);
    assert_eq!(
        rt.block_on(grpc_health(addr, proto::service_names::WORKER))
            .unwrap(),
        SERVING
    );
    // A service the worker does not serve is NOT_FOUND, not silently healthy.
    let unknown = rt.block_on(grpc_health(addr, "pdserve.v1.Nothing"));
    assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);
    let info = rt
        .block_on(async {
            let mut client = WorkerClient::connect(format!("http://{addr}")).await?;
            Ok::<_, Box<dyn std::error::Error>>(client.info(InfoRequest {}).await?.into_inner())
        })
        .unwrap();
    assert_eq!(info.role, i32::from(role));
    assert_eq!(info.state, i32::from(WorkerState::Ready));
    assert_eq!(info.address, addr.to_string());
    assert!(!info.worker_id.is_empty());
    // Close the client connections first: an idle HTTP/2 connection of a runtime that is not
    // being driven would hold graceful shutdown open until the grace period ends.
    drop(rt);
    let exit = svc.terminate().expect("worker exits after SIGTERM");
    assert!(exit.success(), "{exit:?}: {}", svc.stderr());
}

#[test]
fn prefill_worker_serves_health_info_and_stops_on_sigterm() {
    check_worker("pdserve-prefill", Role::Prefill);
}

#[test]
fn decode_worker_serves_health_info_and_stops_on_sigterm() {
    check_worker("pdserve-decode", Role::Decode);
}

#[test]
fn drain_request_stops_a_worker() {
    let mut svc = Service::start(worker("pdserve-decode"));
    let addr = svc.addr("grpc");
    runtime()
        .block_on(async {
            let mut client = WorkerClient::connect(format!("http://{addr}")).await?;
            client.drain(DrainRequest { deadline_ms: 0 }).await?;
            Ok::<_, Box<dyn std::error::Error>>(())
        })
        .unwrap();
    let exit = svc
        .wait(Duration::from_secs(15))
        .expect("worker exits after drain");
    assert!(exit.success(), "{exit:?}");
}

/// Runs a binary that must refuse to start; returns its stderr.
fn refused(cmd: Command) -> String {
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(2),
        "stdout {stdout:?} stderr {stderr:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stdout.contains("PDSERVE_READY"), "{stdout}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected: {stderr:?}");
    stderr
}

#[test]
fn unknown_key_in_config_file_is_refused() {
    for bin in ["pdserve-router", "pdserve-prefill", "pdserve-decode"] {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "grpc_listen = \"127.0.0.1:0\"\ngrpc_lisen = 5").unwrap();
        let mut cmd = command(bin);
        cmd.arg("--config").arg(file.path());
        let err = refused(cmd);
        assert!(err.contains("unknown key `grpc_lisen`"), "{bin}: {err}");
    }
}

#[test]
fn wrong_type_is_refused_naming_key_and_source() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "shutdown_grace_ms = \"soon\"").unwrap();
    let mut cmd = command("pdserve-prefill");
    cmd.arg("--config").arg(file.path());
    let err = refused(cmd);
    assert!(err.contains("`shutdown_grace_ms` from file"), "{err}");

    let mut cmd = command("pdserve-decode");
    cmd.env("PDSERVE_GRPC_LISTEN", "not-an-address");
    let err = refused(cmd);
    assert!(
        err.contains("`grpc_listen` from env PDSERVE_GRPC_LISTEN"),
        "{err}"
    );

    let mut cmd = command("pdserve-router");
    cmd.env("PDSERVE_HTTP_LISTN", "127.0.0.1:0");
    let err = refused(cmd);
    assert!(err.contains("PDSERVE_HTTP_LISTN"), "{err}");
}

#[test]
fn invalid_value_is_refused() {
    let mut cmd = router();
    cmd.args(["--prefill-worker", "not a host"]);
    let err = refused(cmd);
    assert!(err.contains("`prefill_workers`"), "{err}");
}

/// The compute backend is checked at start: an unknown name, or `cuda` in a binary built
/// without it, is refused naming the key; it never silently runs on the CPU instead.
#[test]
fn compute_backend_is_checked_at_start() {
    let mut cmd = command("pdserve-decode");
    cmd.args(["--backend", "gpu"]);
    let err = refused(cmd);
    assert!(
        err.contains("`backend`") && err.contains("expected cpu, cuda or emulated"),
        "{err}"
    );
    for role in ["pdserve-prefill", "pdserve-decode"] {
        let mut cmd = command(role);
        cmd.env("PDSERVE_BACKEND", "cuda");
        let err = refused(cmd);
        assert!(
            err.contains("`backend`") && err.contains("built without the CUDA backend"),
            "{role}: {err}"
        );
    }
}

#[test]
fn port_in_use_is_refused_naming_key() {
    let taken = std::net::TcpListener::bind(EPHEMERAL).unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let mut cmd = command("pdserve-decode");
    cmd.args(["--grpc-listen", &port]);
    let err = refused(cmd);
    assert!(err.contains("`grpc_listen`: cannot listen on"), "{err}");

    let mut cmd = command("pdserve-router");
    cmd.args(["--grpc-listen", EPHEMERAL, "--http-listen", &port]);
    let err = refused(cmd);
    assert!(err.contains("`http_listen`: cannot listen on"), "{err}");
}

#[test]
fn layers_apply_in_order_file_env_cli() {
    // The file asks for one port, env for another, the flag for the ephemeral one: the flag
    // must win (the service starts on an ephemeral port although both others are taken).
    let taken_a = std::net::TcpListener::bind(EPHEMERAL).unwrap();
    let taken_b = std::net::TcpListener::bind(EPHEMERAL).unwrap();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "grpc_listen = \"{}\"", taken_a.local_addr().unwrap()).unwrap();
    let mut cmd = command("pdserve-prefill");
    cmd.arg("--config").arg(file.path()).env(
        "PDSERVE_GRPC_LISTEN",
        taken_b.local_addr().unwrap().to_string(),
    );
    let err = refused(cmd);
    assert!(
        err.contains(&taken_b.local_addr().unwrap().to_string()),
        "env beats file: {err}"
    );

    let mut cmd = command("pdserve-prefill");
    cmd.arg("--config")
        .arg(file.path())
        .env(
            "PDSERVE_GRPC_LISTEN",
            taken_b.local_addr().unwrap().to_string(),
        )
        .args(["--grpc-listen", EPHEMERAL]);
    let mut svc = Service::start(cmd);
    assert!(svc.terminate().expect("exits").success());
}
