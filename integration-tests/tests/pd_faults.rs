//! Faults in a running cluster: a prefill worker killed mid-prefill, the decode worker gone
//! while the prompt state is being written into it, a client that reads slowly, a router that
//! restarts under registered workers. Each time the client gets a correct answer or a clear
//! error quickly, nothing hangs, the surviving workers' pages return to baseline, and the
//! cluster serves the next request. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::{
    io::{Read, Write},
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    HttpResponse, Service, command, fold_chat_stream, http,
    pd::{T, busy, chat, cluster_full, essence, model_arg, post, wait_idle, wait_ready, worker},
    start_router,
};
use nix::sys::signal::Signal;
use serde_json::json;

const CHAT: &str = "/v1/chat/completions";

/// Waits (bounded) until one of `addrs` reports a load `want` accepts; returns its index.
fn wait_busy(addrs: &[SocketAddr], want: impl Fn((u64, u32, u32)) -> bool) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(i) = (0..addrs.len()).find(|&i| want(busy(addrs[i]))) {
            return i;
        }
        assert!(Instant::now() < deadline, "no worker got busy");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Prefill workers that take many small steps, so a long prompt is in flight for a while (about
/// 300 steps for the 1000-word prompts below: long enough that a kill after the worker reports
/// it running lands mid-prefill however fast the engine gets).
const SLOW_PREFILL: [&str; 2] = ["--max-batch-tokens", "8"];

#[test]
fn prefill_worker_killed_mid_prefill_is_replaced_and_the_answer_is_right() {
    let local = start_router(&["--model-dir", &model_arg()], true);
    let mut cluster = cluster_full(2, 1, &[], &SLOW_PREFILL);
    let router = cluster.router.addr("http");
    let body = chat(1000, 9, 0.0, 4);
    let want = essence(&post(local.addr("http"), CHAT, &body));
    let prefills = [
        cluster.workers[1].addr("grpc"),
        cluster.workers[2].addr("grpc"),
    ];
    let victim = std::thread::scope(|s| {
        let answer = s.spawn(|| post(router, CHAT, &body));
        let victim = wait_busy(&prefills, |(_, running, _)| running == 1);
        cluster.workers[1 + victim].signal(Signal::SIGKILL);
        let _ = cluster.workers[1 + victim].wait(Duration::from_secs(5));
        // Retried on the other worker from the start: the same answer as one process.
        assert_eq!(essence(&answer.join().unwrap()), want);
        victim
    });
    // It really was retried: the kill hit the prefill in flight.
    let metrics = http(router, "GET", "/metrics", &[], b"", T).body;
    assert!(
        metrics.contains("pdserve_prefill_retries_total 1"),
        "{metrics}"
    );
    wait_idle(cluster.workers[0].addr("grpc"), "decode");
    wait_idle(prefills[1 - victim], "surviving prefill");
    assert_eq!(post(router, CHAT, &chat(5, 1, 0.0, 2)).status, 200);
}

/// The decode worker that holds the reservation dies while the prefill worker is writing the
/// prompt state into it over UCX: the client gets an error within 2 s, the prefill worker
/// stops and frees its pages, and the next request is served by the other decode worker.
#[test]
fn decode_worker_gone_mid_transfer_fails_the_request_cleanly() {
    let mut cluster = cluster_full(
        1,
        2,
        &[],
        &["--transport", "ucx", "--max-batch-tokens", "8"],
    );
    let router = cluster.router.addr("http");
    let decodes = [
        cluster.workers[0].addr("grpc"),
        cluster.workers[1].addr("grpc"),
    ];
    let prefill = cluster.workers[2].addr("grpc");
    let body = chat(1000, 10, 0.0, 4);
    let (victim, killed, answer) = std::thread::scope(|s| {
        let answer = s.spawn(|| post(router, CHAT, &body));
        // The reservation exists and the prefill is running (its state is streaming).
        let victim = wait_busy(&decodes, |(_, _, reservations)| reservations == 1);
        wait_busy(&[prefill], |(_, running, _)| running == 1);
        cluster.workers[victim].signal(Signal::SIGKILL);
        let killed = Instant::now();
        let _ = cluster.workers[victim].wait(Duration::from_secs(5));
        (victim, killed, answer.join().unwrap())
    });
    let elapsed = killed.elapsed();
    assert!(
        answer.status >= 500,
        "the client must get an error: {} {}",
        answer.status,
        answer.body
    );
    assert!(
        answer.json()["error"]["message"].is_string(),
        "{}",
        answer.body
    );
    assert!(elapsed < Duration::from_secs(2), "failed after {elapsed:?}");
    wait_idle(prefill, "prefill");
    // After the router's next poll, new requests go to the survivor.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(post(router, CHAT, &chat(5, 2, 0.0, 2)).status, 200);
    wait_idle(decodes[1 - victim], "surviving decode");
}

/// A client that reads its stream slowly gets exactly the answer of a fast client, and the
/// workers' pages return to baseline afterwards.
#[test]
fn a_slow_reader_gets_the_whole_answer() {
    let cluster = cluster_full(1, 1, &[], &[]);
    let router = cluster.router.addr("http");
    let mut body = chat(40, 11, 0.7, 300);
    let whole = essence(&post(router, CHAT, &body));
    body["stream"] = json!(true);
    let payload = body.to_string();
    let mut conn = std::net::TcpStream::connect(router).unwrap();
    conn.set_read_timeout(Some(T)).unwrap();
    write!(
        conn,
        "POST {CHAT} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut raw = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let n = conn.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        assert!(Instant::now() < deadline, "the stream did not end");
        std::thread::sleep(Duration::from_millis(3));
    }
    let response = HttpResponse::parse(&raw);
    let (content, reasoning, finish, _) = fold_chat_stream(&response);
    let message = &whole["message"];
    assert_eq!(content, message["content"].as_str().unwrap_or(""));
    assert_eq!(
        reasoning,
        message["reasoning_content"].as_str().unwrap_or("")
    );
    assert_eq!(finish.as_deref(), whole["finish"].as_str());
    for w in &cluster.workers {
        wait_idle(w.addr("grpc"), "worker");
    }
}

/// The router restarts (same gRPC address): the workers registered with the old one register
/// with the new one on their next heartbeat, and requests are served again.
#[test]
fn workers_register_again_with_a_restarted_router() {
    let start = |grpc: &str| {
        let mut cmd = command("pdserve-router");
        cmd.args([
            "--http-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            grpc,
            "--model-dir",
            &model_arg(),
            "--backend",
            "pd",
        ]);
        Service::start(cmd)
    };
    let mut first = start("127.0.0.1:0");
    let grpc = first.addr("grpc").to_string();
    let _decode = worker("pdserve-decode", &["--page-size", "16", "--router", &grpc]);
    let _prefill = worker("pdserve-prefill", &["--page-size", "16", "--router", &grpc]);
    wait_ready(first.addr("http"), 200);
    let body = chat(12, 3, 0.0, 4);
    let before = essence(&post(first.addr("http"), CHAT, &body));
    first.signal(Signal::SIGKILL);
    let _ = first.wait(Duration::from_secs(5));
    let second = start(&grpc);
    let restarted = Instant::now();
    wait_ready(second.addr("http"), 200);
    assert!(
        restarted.elapsed() < Duration::from_secs(10),
        "workers took {:?} to register again",
        restarted.elapsed()
    );
    assert_eq!(essence(&post(second.addr("http"), CHAT, &body)), before);
    let r = http(second.addr("http"), "GET", "/workers", &[], b"", T);
    assert_eq!(
        r.json()["workers"].as_array().unwrap().len(),
        2,
        "{}",
        r.body
    );
}

/// More requests at once than the decode worker has request slots: the extra ones wait for
/// room (the router's queue timeout) instead of failing, and each gets its solo answer. With
/// no queueing allowed, the extra ones fail with 503 at once.
#[test]
fn requests_beyond_decode_capacity_wait_for_room() {
    let cluster = cluster_full(1, 1, &[], &["--max-running", "2"]);
    let router = cluster.router.addr("http");
    let bodies: Vec<_> = (0..6).map(|i| chat(10 + i, i as u64, 0.0, 8)).collect();
    let solo: Vec<_> = bodies
        .iter()
        .map(|b| essence(&post(router, CHAT, b)))
        .collect();
    let together: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || essence(&post(router, CHAT, b))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, solo);
    drop(cluster);

    let cluster = cluster_full(1, 1, &["--queue-timeout-ms", "0"], &["--max-running", "1"]);
    let router = cluster.router.addr("http");
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|i| s.spawn(move || post(router, CHAT, &chat(10 + i, 1, 0.0, 64)).status))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(
        statuses.contains(&503),
        "without a queue some fail: {statuses:?}"
    );
}
