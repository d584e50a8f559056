//! Test harness: spawns the real pdserve binaries on loopback with ephemeral ports, reads
//! their readiness line, and stops them with real signals. Every wait is bounded.
#![allow(
    clippy::expect_used,
    clippy::panic,
    reason = "test harness: a failed step is a failed test"
)]

pub mod pd;

use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use nix::{sys::signal, unistd::Pid};

/// How long a service may take to print its readiness line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a service may take to exit after SIGTERM.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Folder holding the workspace's binaries (the test executable lives in `<dir>/deps`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test binary is in target/<profile>/deps")
        .to_path_buf()
}

/// Path of a workspace binary; panics with the fix when it has not been built.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} not built: run `cargo build --workspace --bins` (cargo test --workspace builds it)",
        path.display()
    );
    path
}

/// A `Command` for a workspace binary with a clean pdserve environment: inherited `PDSERVE_*`
/// variables would change what is being tested.
pub fn command(name: &str) -> Command {
    let mut cmd = Command::new(bin(name));
    for (key, _) in std::env::vars_os() {
        let name = key.to_string_lossy();
        // The test's own settings only; an OTLP endpoint of the machine would export traces.
        if (name.starts_with("PDSERVE_") && key != "PDSERVE_CACHE_DIR") || name.starts_with("OTEL_")
        {
            cmd.env_remove(key);
        }
    }
    cmd.env("PDSERVE_LOG", "warn");
    cmd
}

/// A running service process. Killed on drop if still running.
#[derive(Debug)]
pub struct Service {
    child: Child,
    /// Fields of the readiness line (`role`, `grpc`, `http`, ...).
    pub ready: HashMap<String, String>,
    stderr: mpsc::Receiver<String>,
    /// Stdout lines after the one `start` returned at.
    stdout: mpsc::Receiver<String>,
    /// The readiness line has been read.
    ready_seen: bool,
}

impl Service {
    /// Starts `cmd` and waits for its readiness line.
    pub fn start(cmd: Command) -> Self {
        Self::start_until(cmd, common::cli::parse_ready)
    }

    /// Starts `cmd` and waits for its listening line (a worker prints it before loading its
    /// model) or its readiness line; [`Self::wait_ready_line`] waits for the readiness line.
    pub fn start_listening(cmd: Command) -> Self {
        Self::start_until(cmd, |line| {
            common::cli::parse_listening(line).or_else(|| common::cli::parse_ready(line))
        })
    }

    /// Waits (bounded) for the readiness line; false when it did not come within `timeout`
    /// (or stdout closed). True at once if `start` already returned at it.
    pub fn wait_ready_line(&mut self, timeout: Duration) -> bool {
        if self.ready_seen {
            return true;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) if common::cli::parse_ready(&line).is_some() => {
                    self.ready_seen = true;
                    return true;
                }
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    fn start_until(
        mut cmd: Command,
        parse: impl Fn(&str) -> Option<Vec<(String, String)>>,
    ) -> Self {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn service");
        let stdout = child.stdout.take().expect("stdout piped");
        let stderr = child.stderr.take().expect("stderr piped");
        let (line_tx, line_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let (err_tx, err_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if err_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match line_rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some(fields) = parse(&line) {
                        return Self {
                            child,
                            ready: fields.into_iter().collect(),
                            stderr: err_rx,
                            stdout: line_rx,
                            ready_seen: common::cli::parse_ready(&line).is_some(),
                        };
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait().ok();
                    let err: Vec<String> = err_rx.try_iter().collect();
                    panic!(
                        "service exited before ready ({status:?}): {}",
                        err.join("\n")
                    );
                }
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                panic!("service not ready within {START_TIMEOUT:?}");
            }
        }
    }

    /// An address from the readiness line.
    pub fn addr(&self, name: &str) -> SocketAddr {
        self.ready
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in readiness line {:?}", self.ready))
            .parse()
            .expect("address")
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits"))
    }

    /// Sends a signal.
    pub fn signal(&self, sig: signal::Signal) {
        signal::kill(self.pid(), sig).expect("kill");
    }

    /// Waits (bounded) for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit status (bounded).
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        self.signal(signal::Signal::SIGTERM);
        self.wait(STOP_TIMEOUT)
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.try_iter().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs a command to completion (bounded) and returns (status, stdout, stderr).
pub fn run_to_exit(mut cmd: Command, timeout: Duration) -> (ExitStatus, String, String) {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn");
    let (tx, rx) = mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(out)) => (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ),
        Ok(Err(e)) => panic!("wait failed: {e}"),
        Err(_) => {
            let _ = signal::kill(
                Pid::from_raw(i32::try_from(pid).expect("pid")),
                signal::Signal::SIGKILL,
            );
            panic!("command did not finish within {timeout:?}");
        }
    }
}

/// gRPC health check of `service` ("" for the whole process).
pub async fn grpc_health(addr: SocketAddr, service: &str) -> Result<i32, tonic::Status> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut client = HealthClient::new(channel);
    let reply = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?;
    Ok(reply.into_inner().status)
}

/// `tonic_health` serving status value for SERVING.
pub const SERVING: i32 = 1;

/// A minimal HTTP/1.1 response read to the end (`Connection: close`), chunked bodies decoded.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d).to_owned())
            .collect()
    }

    /// The events of an SSE body, in order: (`event:` name if any, `data:` payload).
    pub fn sse_events(&self) -> Vec<(Option<String>, String)> {
        let field = |line: &str, name: &str| {
            line.strip_prefix(name)
                .map(|v| v.strip_prefix(' ').unwrap_or(v).to_owned())
        };
        self.body
            .split("\n\n")
            .filter_map(|block| {
                let mut event = None;
                let mut data = None;
                for line in block.lines() {
                    if let Some(v) = field(line, "event:") {
                        event = Some(v);
                    } else if let Some(v) = field(line, "data:") {
                        data = Some(v);
                    }
                }
                data.map(|d| (event, d))
            })
            .collect()
    }
}

/// One blocking HTTP request on loopback (bounded by `timeout`). `headers` are extra headers.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> HttpResponse {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout).expect("connect");
    stream.set_read_timeout(Some(timeout)).expect("timeout");
    stream.set_write_timeout(Some(timeout)).expect("timeout");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        for part in [k, ": ", v, "\r\n"] {
            head.push_str(part);
        }
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("write head");
    // The server may answer (413) before reading everything; ignore write errors then.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    HttpResponse::parse(&raw)
}

impl HttpResponse {
    /// Parses a whole HTTP/1.1 response (chunked bodies are reassembled).
    pub fn parse(raw: &[u8]) -> Self {
        parse_response(raw)
    }
}

fn parse_response(raw: &[u8]) -> HttpResponse {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut rest = raw[split + 4..].to_vec();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut pos = 0;
        while let Some(end) = rest[pos..].windows(2).position(|w| w == b"\r\n") {
            let size_line = String::from_utf8_lossy(&rest[pos..pos + end]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .expect("chunk size");
            pos += end + 2;
            if size == 0 || pos + size > rest.len() {
                break;
            }
            out.extend_from_slice(&rest[pos..pos + size]);
            pos += size + 2;
        }
        rest = out;
    }
    HttpResponse {
        status,
        headers,
        body: String::from_utf8(rest).expect("UTF-8 body"),
    }
}

/// A tiny synthetic DeepSeek-V4 checkpoint with the real tokenizer, generated once per target
/// folder with `pdctl gen-model` (seed 1, MXFP4 experts).
pub fn tiny_model_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| generated_tiny_model("mxfp4")).clone()
}

/// [`tiny_model_dir`] with NVFP4 experts (whose scale blocks of 16 let 2 ranks slice the tiny
/// model's 32 intermediate values on the device).
pub fn tiny_nvfp4_model_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| generated_tiny_model("nvfp4")).clone()
}

fn generated_tiny_model(experts: &str) -> PathBuf {
    let dir = bin_dir()
        .join("test-models")
        .join(format!("tiny-{experts}-seed1"));
    if dir.join("tokenizer.json").is_file() {
        return dir;
    }
    let tmp = bin_dir()
        .join("test-models")
        .join(format!("tmp-{experts}-{}", std::process::id()));
    let mut cmd = command("pdctl");
    cmd.args([
        "gen-model",
        "--preset",
        "tiny",
        "--seed",
        "1",
        "--experts",
        experts,
    ])
    .arg("--out")
    .arg(&tmp);
    let (status, _, err) = run_to_exit(cmd, Duration::from_secs(120));
    assert!(status.success(), "pdctl gen-model failed: {err}");
    assert!(
        tmp.join("tokenizer.json").is_file(),
        "the tokenizer is missing: run scripts/setup"
    );
    // Another test process may have won the race; either copy is complete.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    dir
}

/// Starts `pdserve-router` on ephemeral ports with `args` and waits until `/health/ready`
/// answers 200 (when `wait_ready`).
pub fn start_router(args: &[&str], wait_ready: bool) -> Service {
    let mut cmd = command("pdserve-router");
    cmd.args([
        "--http-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
    ])
    .args(args);
    let service = Service::start(cmd);
    if wait_ready {
        let addr = service.addr("http");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let r = http(
                addr,
                "GET",
                "/health/ready",
                &[],
                b"",
                Duration::from_secs(5),
            );
            if r.status == 200 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "router not ready: {} {}",
                r.status,
                r.body
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    service
}

/// Concatenates the deltas of an SSE chat stream: (content, reasoning, finish, usage).
pub fn fold_chat_stream(
    r: &HttpResponse,
) -> (String, String, Option<String>, Option<serde_json::Value>) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "not an event stream: {:?}",
        r.headers
    );
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {d}")))
        .collect();
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "role first: {:?}",
        chunks[0]
    );
    let (mut content, mut reasoning, mut finish, mut usage) =
        (String::new(), String::new(), None, None);
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(choice) = c["choices"].get(0) {
            if let Some(s) = choice["delta"]["content"].as_str() {
                content.push_str(s);
            }
            if let Some(s) = choice["delta"]["reasoning_content"].as_str() {
                reasoning.push_str(s);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        if c["usage"].is_object() {
            usage = Some(c["usage"].clone());
        }
    }
    (content, reasoning, finish, usage)
}
