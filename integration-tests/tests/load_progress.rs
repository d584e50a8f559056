//! A worker answers health and `Worker.Info` while it loads its model: state LOADING with the
//! load's progress, its role services NOT_SERVING and refusing calls as unavailable, then READY
//! and SERVING once loaded. A router lists a loading worker as loading and routes nothing to it
//! until it is ready; then the cluster answers as a single process does. The `slow-load` fault
//! pauses after each shard, so the loading state lasts long enough to be seen whatever the disk
//! speed. `pdctl up --start-timeout` gives up on a worker that loads for too long.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    SERVING, Service, command, grpc_health, http,
    pd::{T, chat, essence, listed, model_arg, post, wait_ready},
    run_to_exit, start_router,
};
use proto::v1::{
    ErrorKind, InfoRequest, LoadProgress, PrefillRequest, ReserveRequest, WorkerInfo, WorkerState,
    decode_client::DecodeClient, prefill_client::PrefillClient, worker_client::WorkerClient,
};

/// `tonic_health` serving status value for NOT_SERVING.
const NOT_SERVING: i32 = 2;
/// How long a slow-loading worker may take to be ready (two pauses and the load).
const LOAD_LIMIT: Duration = Duration::from_secs(60);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn info(addr: SocketAddr) -> WorkerInfo {
    let mut client = WorkerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    client.info(InfoRequest {}).await.unwrap().into_inner()
}

/// A generation call on the worker's role service, answered or refused.
async fn role_call(addr: SocketAddr, decode: bool) -> Result<(), tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    if decode {
        DecodeClient::new(channel)
            .reserve(ReserveRequest::default())
            .await
            .map(drop)
    } else {
        PrefillClient::new(channel)
            .prefill(PrefillRequest::default())
            .await
            .map(drop)
    }
}

/// A slow-loading worker's command (`--router` and other flags in `extra`).
fn slow_worker(bin: &str, extra: &[&str]) -> Service {
    let mut cmd = command(bin);
    cmd.args([
        "--grpc-listen",
        "127.0.0.1:0",
        "--page-size",
        "16",
        "--model-dir",
        &model_arg(),
    ])
    .args(extra)
    .env(common::env::INJECT_FAULT, "slow-load")
    // The per-shard lines are info.
    .env("PDSERVE_LOG", "info");
    Service::start_listening(cmd)
}

fn check_loading(bin: &str, role_services: &[&str]) {
    let decode = bin == "pdserve-decode";
    let mut svc = slow_worker(bin, &[]);
    let addr = svc.addr("grpc");
    let rt = runtime();

    // Every answer while loading, until the last shard is done (bounded in time and count).
    let deadline = Instant::now() + LOAD_LIMIT;
    let mut seen: Vec<LoadProgress> = Vec::new();
    let mut refused = None;
    for _ in 0..2000 {
        let now = rt.block_on(info(addr));
        if now.state != i32::from(WorkerState::Loading) {
            break;
        }
        assert!(now.layout.is_none(), "no layout before the model is loaded");
        let progress = now
            .load_progress
            .expect("a loading worker reports progress");
        if progress.shards_done >= 1 && refused.is_none() {
            // Within the pause after a shard: health says what is up and what is not, and a
            // generation call is refused as unavailable, not left waiting.
            assert_eq!(
                rt.block_on(grpc_health(addr, proto::service_names::WORKER))
                    .unwrap(),
                SERVING
            );
            assert_eq!(rt.block_on(grpc_health(addr, "")).unwrap(), NOT_SERVING);
            for service in role_services {
                assert_eq!(
                    rt.block_on(grpc_health(addr, service)).unwrap(),
                    NOT_SERVING,
                    "{service} while loading"
                );
            }
            refused = Some(rt.block_on(role_call(addr, decode)).unwrap_err());
        }
        // Counted from the moment the load knows its totals; one entry per change.
        let step = |p: &LoadProgress| (p.bytes_done, p.shards_done, p.done);
        if progress.bytes_total > 0 && seen.last().map(step) != Some(step(&progress)) {
            seen.push(progress);
        }
        if progress.shards_done == progress.shards_total && progress.shards_total > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "still loading: {seen:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused = refused.unwrap_or_else(|| panic!("never seen loading with a shard: {seen:?}"));
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let detail = proto::error::from_status(&refused);
    assert_eq!(detail.kind, i32::from(ErrorKind::Unavailable), "{detail:?}");
    assert!(detail.message.contains("loading"), "{detail:?}");

    // The counters grow towards totals that do not change.
    let last = *seen.last().unwrap();
    assert_eq!(last.shards_total, 2, "{seen:?}");
    assert!(last.bytes_total > 0, "{seen:?}");
    for pair in seen.windows(2) {
        assert!(pair[0].bytes_done <= pair[1].bytes_done, "{seen:?}");
        assert!(pair[0].shards_done <= pair[1].shards_done, "{seen:?}");
        assert_eq!(pair[0].bytes_total, pair[1].bytes_total, "{seen:?}");
    }
    let shards: Vec<u32> = seen.iter().map(|p| p.shards_done).collect();
    assert!(
        shards.contains(&1) && shards.contains(&2),
        "each shard seen done in turn: {seen:?}"
    );

    assert!(
        svc.wait_ready_line(LOAD_LIMIT),
        "no readiness line after loading: {}",
        svc.stderr()
    );
    let ready = rt.block_on(info(addr));
    assert_eq!(ready.state, i32::from(WorkerState::Ready), "{ready:?}");
    assert!(ready.layout.is_some());
    let done = ready.load_progress.unwrap();
    assert!(done.done, "{done:?}");
    assert_eq!(done.bytes_done, done.bytes_total);
    assert_eq!(done.shards_done, done.shards_total);
    let pauses = 2 * common::fault::SLOW_LOAD_PER_SHARD.as_millis() as u64;
    assert!(
        done.elapsed_ms >= pauses,
        "two pauses are in the load: {done:?}"
    );
    assert_eq!(rt.block_on(grpc_health(addr, "")).unwrap(), SERVING);
    for service in role_services {
        assert_eq!(rt.block_on(grpc_health(addr, service)).unwrap(), SERVING);
    }
    // The same empty call now reaches the service, which judges the request itself.
    if let Err(answered) = rt.block_on(role_call(addr, decode)) {
        assert!(!answered.message().contains("loading"), "{answered:?}");
    }
    drop(rt);
    let exit = svc.terminate().expect("worker exits after SIGTERM");
    assert!(exit.success(), "{exit:?}");
    let log = svc.stderr();
    assert_eq!(
        log.matches("loaded shard ").count(),
        2,
        "one line per shard: {log}"
    );
    assert!(log.contains(" of 2 shards"), "{log}");
}

#[test]
fn decode_worker_reports_loading_then_ready() {
    check_loading(
        "pdserve-decode",
        &[
            proto::service_names::DECODE,
            proto::service_names::STATE_TRANSFER,
        ],
    );
}

#[test]
fn prefill_worker_reports_loading_then_ready() {
    check_loading("pdserve-prefill", &[proto::service_names::PREFILL]);
}

/// The `pdserve_workers` sample for `role` and `state` in a Prometheus text.
fn workers_gauge(metrics: &str, role: &str, state: &str) -> Option<f64> {
    let name = format!("pdserve_workers{{role=\"{role}\",state=\"{state}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.trim().parse().ok())
}

/// Workers registering while they load are listed as loading, with their progress, in the
/// listing, the metrics and `pdctl workers`; requests are refused with a clear 503 meanwhile;
/// once they are ready the cluster answers exactly as a single-process engine does.
#[test]
fn router_routes_nothing_to_loading_workers_then_answers_correctly() {
    let router = start_router(&["--model-dir", &model_arg(), "--backend", "pd"], false);
    let (http_addr, grpc) = (router.addr("http"), router.addr("grpc").to_string());
    // The router's own model is loaded (its readiness waits for workers only): any refusal
    // from here on is about the workers.
    let deadline = Instant::now() + LOAD_LIMIT;
    loop {
        let r = http(http_addr, "GET", "/health/ready", &[], b"", T);
        if r.body.contains("the backend is not ready") {
            break;
        }
        assert!(Instant::now() < deadline, "router: {} {}", r.status, r.body);
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut decode = slow_worker("pdserve-decode", &["--router", &grpc]);
    let mut prefill = slow_worker("pdserve-prefill", &["--router", &grpc]);

    // Both registered and polled while they load.
    let deadline = Instant::now() + LOAD_LIMIT;
    let workers = loop {
        let workers = listed(http_addr);
        let loading = |w: &serde_json::Value| {
            w["state"] == "loading" && w["load_progress"]["shards_done"].as_u64() >= Some(1)
        };
        if workers.len() == 2 && workers.iter().all(loading) {
            break workers;
        }
        assert!(
            !workers.iter().any(|w| w["state"] == "ready"),
            "ready before a loading state was seen: {workers:?}"
        );
        assert!(
            Instant::now() < deadline,
            "never listed loading: {workers:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    for w in &workers {
        let p = &w["load_progress"];
        assert_eq!(p["shards_total"], 2, "{w}");
        assert!(p["bytes_done"].as_u64() <= p["bytes_total"].as_u64(), "{w}");
        assert!(p["bytes_total"].as_u64() > Some(0), "{w}");
    }
    let metrics = http(http_addr, "GET", "/metrics", &[], b"", T).body;
    for role in ["prefill", "decode"] {
        assert_eq!(
            workers_gauge(&metrics, role, "loading"),
            Some(1.0),
            "{role}"
        );
        assert_eq!(workers_gauge(&metrics, role, "ready"), Some(0.0), "{role}");
    }
    let r = http(http_addr, "GET", "/health/ready", &[], b"", T);
    assert_eq!(r.status, 503, "{}", r.body);
    let body = chat(20, 7, 0.0, 6);
    let refused = post(http_addr, "/v1/chat/completions", &body);
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(
        refused.body.contains("still loading the model"),
        "{}",
        refused.body
    );
    let mut cmd = command("pdctl");
    cmd.args(["workers", "--url", &http_addr.to_string()]);
    let (status, out, err) = run_to_exit(cmd, T);
    assert!(status.success(), "{err}");
    assert!(
        out.contains("loading ") && out.contains(" of 2 shards"),
        "{out}"
    );
    let mut cmd = command("pdctl");
    cmd.args(["status", "--url", &http_addr.to_string()]);
    let (status, out, _) = run_to_exit(cmd, T);
    assert!(
        !status.success(),
        "a cluster still loading cannot serve: {out}"
    );
    assert!(out.contains("2 still loading the model"), "{out}");

    for w in [&mut decode, &mut prefill] {
        assert!(w.wait_ready_line(LOAD_LIMIT), "{}", w.stderr());
    }
    wait_ready(http_addr, 200);
    let local = start_router(&["--model-dir", &model_arg()], true);
    assert_eq!(
        essence(&post(http_addr, "/v1/chat/completions", &body)),
        essence(&post(local.addr("http"), "/v1/chat/completions", &body))
    );
    let workers = listed(http_addr);
    assert!(
        workers
            .iter()
            .all(|w| w["state"] == "ready" && w.get("load_progress").is_none()),
        "{workers:?}"
    );
}

/// A worker stopped while it loads exits promptly and cleanly, without finishing the load.
#[test]
fn sigterm_during_the_load_stops_the_worker() {
    let mut svc = slow_worker("pdserve-decode", &[]);
    let started = Instant::now();
    let exit = svc.terminate().expect("worker exits after SIGTERM");
    assert!(exit.success(), "{exit:?}: {}", svc.stderr());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "stopping waited for the load"
    );
}

/// `pdctl up` gives up on a worker still loading after `--start-timeout`, naming it and how
/// far it got.
#[test]
fn pdctl_up_start_timeout_names_the_loading_worker() {
    let mut cmd = command("pdctl");
    cmd.args([
        "up",
        "--smoke",
        "--http-listen",
        "127.0.0.1:0",
        "--model",
        &model_arg(),
        "--start-timeout",
        "1",
    ])
    .env(common::env::INJECT_FAULT, "slow-load");
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(60));
    assert!(!status.success(), "stdout {stdout}\nstderr {stderr}");
    assert!(
        stderr.contains("decode-0") && stderr.contains("--start-timeout"),
        "{stderr}"
    );
    assert!(stderr.contains("loading"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// With time to load, `pdctl up --smoke` waits for slow-loading workers, prints their
/// progress meanwhile, and passes.
#[test]
fn pdctl_up_smoke_waits_for_loading_workers() {
    let mut cmd = command("pdctl");
    cmd.args([
        "up",
        "--smoke",
        "--http-listen",
        "127.0.0.1:0",
        "--model",
        &model_arg(),
    ])
    .env(common::env::INJECT_FAULT, "slow-load");
    let (status, stdout, stderr) = run_to_exit(cmd, Duration::from_secs(120));
    assert!(status.success(), "stdout {stdout}\nstderr {stderr}");
    assert!(stdout.contains("smoke: all processes"), "{stdout}");
    // Each worker's own /metrics is up and listed.
    assert_eq!(stdout.matches("/metrics").count(), 2, "{stdout}");
    assert!(
        stdout.contains("decode-0 loading ") && stdout.contains(" of 2 shards"),
        "{stdout}"
    );
}
