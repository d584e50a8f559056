//! Test harness: spawns the real pdserve binaries on loopback with ephemeral ports, reads
//! their readiness line, and stops them with real signals. Every wait is bounded.
#![allow(
    clippy::expect_used,
    clippy::panic,
    reason = "test harness: a failed step is a failed test"
)]

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
        if key.to_string_lossy().starts_with("PDSERVE_") && key != "PDSERVE_CACHE_DIR" {
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
}

impl Service {
    /// Starts `cmd` and waits for its readiness line.
    pub fn start(mut cmd: Command) -> Self {
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
                    if let Some(fields) = common::cli::parse_ready(&line) {
                        return Self {
                            child,
                            ready: fields.into_iter().collect(),
                            stderr: err_rx,
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
