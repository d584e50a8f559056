//! Helpers for tests of a disaggregated cluster: workers, routers in front of them, requests,
//! and the load each worker reports.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test support code")]

use std::{net::SocketAddr, time::Duration};

use serde_json::{Value, json};

use crate::{HttpResponse, Service, command, http, start_router, tiny_model_dir};

pub const T: Duration = Duration::from_secs(120);

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], body.to_string().as_bytes(), T)
}

pub fn model_arg() -> String {
    tiny_model_dir().display().to_string()
}

/// The command of a worker serving the tiny model on an ephemeral loopback port, before it
/// starts (to set its environment: a fault, a log level).
pub fn worker_command(binary: &str, extra: &[&str]) -> std::process::Command {
    worker_command_on(&model_arg(), binary, extra)
}

/// [`worker_command`] serving the checkpoint at `model`.
pub fn worker_command_on(model: &str, binary: &str, extra: &[&str]) -> std::process::Command {
    let mut cmd = command(binary);
    cmd.args(["--grpc-listen", "127.0.0.1:0", "--model-dir", model])
        .args(extra);
    cmd
}

pub fn worker(binary: &str, extra: &[&str]) -> Service {
    Service::start(worker_command(binary, extra))
}

/// A router serving the tiny model over one decode and one prefill worker; `extra` are more
/// router flags.
pub fn router_over(decode: &Service, prefill: &Service, extra: &[&str]) -> Service {
    router_over_on(&model_arg(), decode, prefill, extra)
}

/// [`router_over`] serving the checkpoint at `model`.
pub fn router_over_on(model: &str, decode: &Service, prefill: &Service, extra: &[&str]) -> Service {
    let (model, decode, prefill) = (
        model.to_owned(),
        decode.addr("grpc").to_string(),
        prefill.addr("grpc").to_string(),
    );
    let mut args = vec![
        "--model-dir",
        &model,
        "--decode-worker",
        &decode,
        "--prefill-worker",
        &prefill,
    ];
    args.extend_from_slice(extra);
    start_router(&args, true)
}

/// Prefill and decode workers and a router in front of them.
#[derive(Debug)]
pub struct Cluster {
    pub router: Service,
    /// Decode workers first, then prefill workers, in start order.
    pub workers: Vec<Service>,
}

pub fn cluster(prefill: usize, decode: usize) -> Cluster {
    cluster_with(prefill, decode, &[])
}

pub fn cluster_with(prefill: usize, decode: usize, router_args: &[&str]) -> Cluster {
    cluster_full(prefill, decode, router_args, &[])
}

pub fn cluster_full(
    prefill: usize,
    decode: usize,
    router_args: &[&str],
    worker_args: &[&str],
) -> Cluster {
    let mut workers = Vec::new();
    let mut args = vec!["--model-dir".to_owned(), model_arg()];
    args.extend(router_args.iter().map(|a| (*a).to_owned()));
    for _ in 0..decode {
        let w = worker(
            "pdserve-decode",
            &[&["--page-size", "16"], worker_args].concat(),
        );
        args.push("--decode-worker".to_owned());
        args.push(w.addr("grpc").to_string());
        workers.push(w);
    }
    for _ in 0..prefill {
        let w = worker(
            "pdserve-prefill",
            &[&["--page-size", "16"], worker_args].concat(),
        );
        args.push("--prefill-worker".to_owned());
        args.push(w.addr("grpc").to_string());
        workers.push(w);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Cluster {
        router: start_router(&args, true),
        workers,
    }
}

/// A chat request whose rendered prompt grows with `words`.
pub fn chat(words: usize, seed: u64, temperature: f64, max_tokens: u32) -> Value {
    let text: Vec<String> = (0..words)
        .map(|i| format!("w{}", (i * 7919) % 1009))
        .collect();
    json!({
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": text.join(" ")}],
        "chat_template_kwargs": {"thinking": false},
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "logprobs": true,
        "top_logprobs": 3,
    })
}

/// The parts of a chat answer that must match exactly.
pub fn essence(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    json!({
        "message": v["choices"][0]["message"],
        "logprobs": v["choices"][0]["logprobs"],
        "finish": v["choices"][0]["finish_reason"],
        "usage": v["usage"],
    })
}

/// A worker's reported load (`Info`).
pub fn load(addr: SocketAddr) -> proto::v1::Load {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = proto::v1::worker_client::WorkerClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        client.info(proto::v1::InfoRequest {}).await.unwrap()
    })
    .into_inner()
    .load
    .unwrap_or_default()
}

/// Pages a worker holds for requests (its prefix cache aside), requests and reservations.
pub fn busy(addr: SocketAddr) -> (u64, u32, u32) {
    let l = load(addr);
    (
        l.pages_used - l.pages_cached,
        l.running_requests + l.queued_requests,
        l.reservations,
    )
}

/// Waits (bounded) until `addr`'s (pages, requests, reservations) satisfy `ok`.
pub fn wait_load(addr: SocketAddr, what: &str, ok: impl Fn((u64, u32, u32)) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = busy(addr);
        if ok(now) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: (pages, requests, reservations) = {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (bounded) until `addr` holds nothing for requests.
pub fn wait_idle(addr: SocketAddr, what: &str) {
    wait_load(addr, what, |now| now == (0, 0, 0));
}

/// Opens a streaming chat request and returns the connection once the first event arrived.
pub fn open_stream(addr: SocketAddr, body: &Value) -> (std::net::TcpStream, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "connection closed: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        assert!(
            !text.contains("\r\n") || text.starts_with("HTTP/1.1 200"),
            "{text}"
        );
    }
    (s, String::from_utf8_lossy(&seen).into_owned())
}

/// Reads a streamed answer (bounded: 5 s per read) until an `"error"` event or its end; the
/// text read.
pub fn read_until_error(conn: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                rest.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&rest).contains("\"error\"") {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&rest).into_owned()
}

pub fn long_request() -> Value {
    // Fits the decode pool (1024 pages of 16 tokens) and runs far longer than the test.
    let mut body = chat(20, 3, 0.8, 10_000);
    body["stream"] = json!(true);
    body["logprobs"] = json!(false);
    body.as_object_mut().unwrap().remove("top_logprobs");
    body
}

pub fn wait_ready(addr: SocketAddr, want: u16) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = http(addr, "GET", "/health/ready", &[], b"", T);
        if r.status == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ready: {} {}",
            r.status,
            r.body
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn listed(addr: SocketAddr) -> Vec<Value> {
    let r = http(addr, "GET", "/workers", &[], b"", T);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["workers"].as_array().unwrap().clone()
}
