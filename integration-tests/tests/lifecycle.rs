//! A worker's life under an operator: systemd notifications (`READY=1` only once the model is
//! loaded and the worker registered, `WATCHDOG=1` while serving, `STOPPING=1` on SIGTERM)
//! checked against a fake `NOTIFY_SOCKET`; graceful drain by SIGTERM mid-stream (the stream
//! finishes whole, new requests go to the other worker, the worker deregisters and exits 0)
//! and by `pdctl drain`.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    io::{Read, Write},
    net::SocketAddr,
    os::unix::net::UnixDatagram,
    path::Path,
    time::{Duration, Instant},
};

use integration_tests::{
    Service, command,
    pd::{self, T},
    run_to_exit, start_router,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// A fake systemd notification socket.
struct NotifySocket {
    socket: UnixDatagram,
    path: String,
}

impl NotifySocket {
    fn new(dir: &Path, name: &str) -> Self {
        let path = dir.join(name);
        let socket = UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        Self {
            socket,
            path: path.display().to_string(),
        }
    }

    /// Every message received so far (bounded wait of 100 ms for the first).
    fn drain(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = self.socket.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        out
    }

    /// Waits (bounded) for a message starting with `prefix`; returns the messages before it
    /// and it.
    fn wait_for(&self, prefix: &str, within: Duration) -> Vec<String> {
        let until = Instant::now() + within;
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = self.socket.recv(&mut buf) {
                let message = String::from_utf8_lossy(&buf[..n]).into_owned();
                let found = message.starts_with(prefix);
                seen.push(message);
                if found {
                    return seen;
                }
            }
            assert!(
                Instant::now() < until,
                "no {prefix:?} within {within:?}; got {seen:?}"
            );
        }
    }
}

fn router_with_registry() -> Service {
    let model = pd::model_arg();
    start_router(&["--model-dir", &model, "--backend", "pd"], false)
}

fn registered_worker(binary: &str, router: SocketAddr, env: &[(&str, &str)]) -> Service {
    let mut cmd = command(binary);
    cmd.args([
        "--grpc-listen",
        "127.0.0.1:0",
        "--model-dir",
        &pd::model_arg(),
        "--page-size",
        "16",
        "--router",
        &router.to_string(),
    ]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Service::start(cmd)
}

/// Waits until the router lists `n` workers, every one ready: a worker registers while it
/// loads and the router sees it ready only at its next poll, after the worker itself is up.
fn wait_listed(http: SocketAddr, n: usize) {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let listed = pd::listed(http);
        if listed.len() == n && listed.iter().all(|w| w["state"] == "ready") {
            return;
        }
        assert!(Instant::now() < until, "{listed:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn state_of(http: SocketAddr, address: &str) -> Option<String> {
    pd::listed(http)
        .into_iter()
        .find(|w| w["address"] == address)
        .map(|w| w["state"].as_str().unwrap().to_owned())
}

#[test]
fn systemd_hears_ready_after_registration_watchdog_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let router_socket = NotifySocket::new(dir.path(), "router");
    let mut cmd = command("pdserve-router");
    cmd.args([
        "--http-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--model-dir",
        &pd::model_arg(),
        "--backend",
        "pd",
    ])
    .env("NOTIFY_SOCKET", &router_socket.path)
    .env("WATCHDOG_USEC", "2000000");
    let mut router = Service::start(cmd);
    let http = router.addr("http");
    let seen = router_socket.wait_for("READY=1", Duration::from_secs(30));
    // READY comes only once the model is loaded: the router then reports ready.
    let ready = integration_tests::http(http, "GET", "/v1/models", &[], b"", T);
    assert_eq!(ready.status, 200, "{seen:?}");
    assert!(
        seen.last()
            .unwrap()
            .contains("STATUS=serving deepseek-v4-flash"),
        "{seen:?}"
    );

    let worker_socket = NotifySocket::new(dir.path(), "decode");
    let mut worker = registered_worker(
        "pdserve-decode",
        router.addr("grpc"),
        &[
            ("NOTIFY_SOCKET", &worker_socket.path),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    worker_socket.wait_for("READY=1", Duration::from_secs(30));
    // Sent only after the router accepted the registration.
    let address = worker.addr("grpc").to_string();
    assert!(
        state_of(http, &address).is_some(),
        "READY before registration"
    );
    // The watchdog is pinged every 500 ms (a quarter of 2 s) while the engine answers.
    worker_socket.drain();
    router_socket.drain();
    std::thread::sleep(Duration::from_millis(1600));
    let pings = worker_socket
        .drain()
        .iter()
        .filter(|m| *m == "WATCHDOG=1")
        .count();
    assert!((2..=5).contains(&pings), "{pings} watchdog pings in 1.6 s");
    let pings = router_socket
        .drain()
        .iter()
        .filter(|m| *m == "WATCHDOG=1")
        .count();
    assert!(
        (2..=5).contains(&pings),
        "router: {pings} watchdog pings in 1.6 s"
    );

    let exit = worker.terminate().expect("worker exits");
    assert!(exit.success(), "{exit:?} {}", worker.stderr());
    let after = worker_socket.drain();
    assert!(
        after.iter().any(|m| m.starts_with("STOPPING=1")),
        "{after:?}"
    );
    assert!(
        state_of(http, &address).is_none(),
        "still listed after exit"
    );
    let exit = router.terminate().expect("router exits");
    assert!(exit.success(), "{exit:?}");
    let after = router_socket.drain();
    assert!(
        after.iter().any(|m| m.starts_with("STOPPING=1")),
        "{after:?}"
    );
}

/// Reads an SSE response to its end (`data: [DONE]`); returns everything read.
fn read_to_done(mut stream: std::net::TcpStream, mut seen: String) -> String {
    let mut buf = [0u8; 8192];
    while !seen.contains("data: [DONE]") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed before [DONE]: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let _ = stream.flush();
    seen
}

#[test]
fn sigterm_drains_a_decode_worker_without_losing_its_stream() {
    let router = router_with_registry();
    let http = router.addr("http");
    let grpc = router.addr("grpc");
    let _prefill = registered_worker("pdserve-prefill", grpc, &[]);
    let first = registered_worker("pdserve-decode", grpc, &[]);
    let second = registered_worker("pdserve-decode", grpc, &[]);
    wait_listed(http, 3);
    pd::wait_ready(http, 200);

    // A stream long enough to still run when the worker is told to stop.
    let mut body = pd::chat(20, 5, 0.0, 1500);
    body["stream"] = json!(true);
    body["logprobs"] = json!(false);
    body.as_object_mut().unwrap().remove("top_logprobs");
    let (stream, seen) = pd::open_stream(http, &body);
    let mut decoders = vec![first, second];
    // Loads are reported every 100 ms.
    let until = Instant::now() + Duration::from_secs(2);
    let i = loop {
        if let Some(i) = decoders.iter().position(|w| pd::busy(w.addr("grpc")).1 > 0) {
            break i;
        }
        assert!(Instant::now() < until, "no decode worker runs the stream");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut busy = decoders.swap_remove(i);
    let other = decoders.pop().unwrap();
    let busy_addr = busy.addr("grpc").to_string();
    busy.signal(Signal::SIGTERM);
    check_drain(stream, seen, http, &busy_addr, &other);
    let exit = busy.wait(Duration::from_secs(30)).expect("worker exits");
    assert!(exit.success(), "{exit:?}: {}", busy.stderr());
    assert!(
        state_of(http, &busy_addr).is_none(),
        "still listed after exit"
    );
}

/// While `busy_addr` drains: the router lists it as draining, a new request is served by the
/// other worker, and the stream that was running on it ends whole.
fn check_drain(
    stream: std::net::TcpStream,
    seen: String,
    http: SocketAddr,
    busy_addr: &str,
    other: &Service,
) {
    let until = Instant::now() + Duration::from_secs(5);
    while state_of(http, busy_addr).as_deref() != Some("draining") {
        assert!(
            Instant::now() < until,
            "not listed as draining: {:?}",
            pd::listed(http)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = pd::post(http, "/v1/chat/completions", &pd::chat(10, 1, 0.0, 4));
    assert_eq!(r.status, 200, "{}", r.body);
    pd::wait_idle(other.addr("grpc"), "the other decode worker");
    let text = read_to_done(stream, seen);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "an error in the stream"
    );
    let finish = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish.len(), 1, "{finish:?}");
    assert!(["length", "stop"].contains(&finish[0]), "{finish:?}");
    let pieces = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["content"].is_string())
        .count();
    if finish[0] == "length" {
        assert!(pieces > 100, "only {pieces} content events");
    }
}

#[test]
fn pdctl_drain_removes_a_worker_from_the_router() {
    let router = router_with_registry();
    let http = router.addr("http");
    let grpc = router.addr("grpc");
    let mut worker = registered_worker("pdserve-prefill", grpc, &[]);
    wait_listed(http, 1);
    let address = worker.addr("grpc").to_string();
    // A deadline beyond the worker's shutdown grace is refused, not cut short: the worker
    // goes on serving.
    let mut cmd = command("pdctl");
    cmd.args(["drain", &address, "--deadline-ms", "999999999"]);
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(40));
    assert!(!status.success(), "{stdout}");
    assert!(
        stderr.contains("longer than this worker's shutdown grace"),
        "{stderr}"
    );
    wait_listed(http, 1);
    let mut cmd = command("pdctl");
    cmd.args([
        "drain",
        &address,
        "--url",
        &http.to_string(),
        "--wait-s",
        "30",
    ]);
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(40));
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("drained and gone from the router"),
        "{stdout}"
    );
    let exit = worker.wait(Duration::from_secs(10)).expect("worker exits");
    assert!(exit.success(), "{exit:?}");

    // `pdctl status` now reports a cluster that cannot serve.
    let mut cmd = command("pdctl");
    cmd.args(["status", "--url", &http.to_string()]);
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(20));
    assert!(!status.success(), "{stdout}");
    assert!(
        stdout.contains("ready workers: 0 prefill, 0 decode"),
        "{stdout}"
    );
    assert!(stderr.contains("cannot serve"), "{stderr}");
}

#[test]
fn a_wedged_engine_stops_the_watchdog_pings() {
    let dir = tempfile::tempdir().unwrap();
    let socket = NotifySocket::new(dir.path(), "decode");
    let mut cmd = command("pdserve-decode");
    cmd.args([
        "--grpc-listen",
        "127.0.0.1:0",
        "--model-dir",
        &pd::model_arg(),
    ])
    .env("NOTIFY_SOCKET", &socket.path)
    .env("WATCHDOG_USEC", "800000")
    .env("PDSERVE_INJECT_FAULT", "stall-engine");
    let mut worker = Service::start(cmd);
    socket.wait_for("READY=1", Duration::from_secs(30));
    socket.wait_for("WATCHDOG=1", Duration::from_secs(2));
    // The engine stalls 1 s after start; pings stop within half the timeout after that, so
    // systemd would restart the worker.
    std::thread::sleep(Duration::from_millis(1800));
    socket.drain();
    std::thread::sleep(Duration::from_millis(1000));
    let late = socket.drain();
    assert!(
        !late.iter().any(|m| m == "WATCHDOG=1"),
        "pinged while wedged: {late:?}"
    );
    worker.signal(Signal::SIGKILL);
    let _ = worker.wait(Duration::from_secs(5));
}
