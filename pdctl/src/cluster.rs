//! `pdctl up`: a local cluster on loopback from the workspace's own binaries. Each child is
//! started with ephemeral ports (except the router's HTTP port), reports its addresses on its
//! listening line (workers, before their model is loaded) and its readiness line (once
//! serving), is health-checked, and is stopped with SIGTERM. While workers load, their
//! progress (`Worker.Info`) is printed.

use std::{
    collections::HashMap,
    fmt::Write as _,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use nix::{sys::signal, unistd::Pid};
use proto::auth::{ClusterSecret, Credentials};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::watch,
};

use crate::{PdctlError, UpArgs, health};

/// How long a process may take to print its first line (listening or ready), and the router
/// to become ready once its workers serve.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long workers may take to load their model, unless `--start-timeout` says otherwise.
pub(crate) const LOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// When the progress of loading workers is first printed (a small model is loaded before
/// then, and prints nothing), and how often after that.
const FIRST_PROGRESS: Duration = Duration::from_secs(1);
const PROGRESS_EVERY: Duration = Duration::from_secs(3);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
pub(crate) const EPHEMERAL: &str = "127.0.0.1:0";

/// The shared secret of a local cluster: random, in a private temporary file (mode 0600)
/// that is removed when this is dropped. Every process of the cluster reads it, so the
/// local cluster runs with authentication between roles like a deployment.
#[derive(Debug)]
pub(crate) struct LocalSecret {
    file: tempfile::NamedTempFile,
    secret: ClusterSecret,
}

impl LocalSecret {
    /// 32 bytes from the OS's random source, in hex.
    pub(crate) fn generate() -> Result<Self, PdctlError> {
        let mut bytes = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        let hex = bytes.iter().fold(String::new(), |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        });
        let secret = ClusterSecret::new(&hex).map_err(|e| PdctlError::Model(e.to_string()))?;
        let mut file = tempfile::Builder::new()
            .prefix("pdserve-cluster-")
            .suffix(".secret")
            .tempfile()?;
        writeln!(file, "{hex}")?;
        file.flush()?;
        Ok(Self { file, secret })
    }

    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }

    /// What this process's own calls to the cluster's workers carry.
    pub(crate) fn credentials(&self) -> Credentials {
        Credentials::new(Some(&self.secret))
    }
}

/// What a child's stdout has said so far.
#[derive(Debug, Clone)]
enum Stage {
    /// Nothing yet.
    Started,
    /// The listening line: it answers health and `Info`; its model may still be loading.
    Listening(Vec<(String, String)>),
    /// The readiness line: serving.
    Ready(Vec<(String, String)>),
    /// Stdout closed before the readiness line (the process is exiting).
    Closed,
}

/// A started child process and the addresses it announced.
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    child: Child,
    ready: HashMap<String, String>,
    stage: watch::Receiver<Stage>,
}

impl Proc {
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub(crate) fn addr(&self, key: &str) -> Result<std::net::SocketAddr, PdctlError> {
        self.ready
            .get(key)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| PdctlError::NotReady {
                what: self.name.clone(),
                reason: format!("readiness line has no {key} address"),
            })
    }
}

/// The embedded default model: `tiny` preset, MXFP4 experts, seed 0, with the real tokenizer,
/// generated into the cache folder on first use (deterministic, so every machine gets the same).
pub(crate) fn default_model() -> Result<PathBuf, PdctlError> {
    let cache = common::assets::cache_dir().map_err(|e| PdctlError::Model(e.to_string()))?;
    let dir = cache.join("models/tiny-mxfp4-seed0");
    if dir.join("model.safetensors.index.json").is_file() {
        return Ok(dir);
    }
    crate::model_cmds::gen_model(&crate::model_cmds::GenModelArgs {
        preset: "tiny".into(),
        layers: None,
        routed_experts: None,
        seed: 0,
        experts: "mxfp4".into(),
        out: dir.clone(),
        no_tokenizer: false,
    })?;
    Ok(dir)
}

/// Waits (bounded) for `/health/ready`: the router loads the model after it starts listening.
pub(crate) async fn wait_ready(http: std::net::SocketAddr) -> Result<(), PdctlError> {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        let ready = common::http_client::get(http, "/health/ready", Duration::from_secs(5)).await;
        if matches!(ready, Ok(ref r) if r.status == 200) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(PdctlError::NotReady {
                what: "router".into(),
                reason: format!("/health/ready not 200 within {START_TIMEOUT:?}"),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends one chat completion and returns the answer's text (or the error body).
async fn ask(http: std::net::SocketAddr) -> Result<String, PdctlError> {
    let body = serde_json::json!({
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "seed": 1,
        "reasoning_effort": "none",
    });
    let response = common::http_client::request(
        http,
        "POST",
        "/v1/chat/completions",
        Some(("application/json", body.to_string().into_bytes())),
        Duration::from_secs(60),
    )
    .await
    .map_err(|e| PdctlError::Unhealthy {
        what: "chat completion".into(),
        reason: e.to_string(),
    })?;
    let text = String::from_utf8_lossy(&response.body).into_owned();
    if response.status != 200 {
        return Err(PdctlError::Unhealthy {
            what: "chat completion".into(),
            reason: format!("status {}: {text}", response.status),
        });
    }
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| PdctlError::Model(e.to_string()))?;
    Ok(serde_json::to_string(&doc["choices"][0]["message"]).unwrap_or(text))
}

pub(crate) fn default_bin_dir() -> Result<PathBuf, PdctlError> {
    let exe = std::env::current_exe()?;
    Ok(exe
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf))
}

/// Starts `bin` and waits until it serves (its readiness line), at most [`LOAD_TIMEOUT`].
pub(crate) async fn spawn(bin: &Path, name: String, args: &[&str]) -> Result<Proc, PdctlError> {
    let mut procs = [launch(bin, name, args).await?];
    wait_serving(&mut procs, LOAD_TIMEOUT, &Credentials::none()).await?;
    let [proc] = procs;
    Ok(proc)
}

/// Starts `bin` and waits (at most [`START_TIMEOUT`]) for its listening or readiness line; a
/// worker may still be loading its model when this returns (see [`wait_serving`]).
pub(crate) async fn launch(bin: &Path, name: String, args: &[&str]) -> Result<Proc, PdctlError> {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // Each child reads its own PDSERVE_* settings; settings meant for one role would be
    // refused by the others, so children only get the process-wide variables.
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with(common::env::PREFIX)
            && (key_text == common::env::CONFIG || !common::env::GLOBAL.contains(&&*key_text))
        {
            cmd.env_remove(&key);
        }
    }
    let mut child = cmd.spawn().map_err(|source| PdctlError::Spawn {
        bin: bin.to_path_buf(),
        source,
    })?;
    let stdout = child.stdout.take().ok_or_else(|| PdctlError::NotReady {
        what: name.clone(),
        reason: "no stdout".into(),
    })?;
    let (tx, mut stage) = watch::channel(Stage::Started);
    // Reads stdout to its end (so the child never blocks on a full pipe), noting the lines.
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(fields) = common::cli::parse_ready(&line) {
                tx.send_replace(Stage::Ready(fields));
            } else if let Some(fields) = common::cli::parse_listening(&line) {
                tx.send_replace(Stage::Listening(fields));
            }
        }
        tx.send_if_modified(|s| {
            let open = !matches!(s, Stage::Ready(_));
            if open {
                *s = Stage::Closed;
            }
            open
        });
    });
    let first = tokio::time::timeout(
        START_TIMEOUT,
        stage.wait_for(|s| !matches!(s, Stage::Started)),
    )
    .await
    .map_err(|_| PdctlError::NotReady {
        what: name.clone(),
        reason: format!("no listening or readiness line within {START_TIMEOUT:?}"),
    })?
    .map_or(Stage::Closed, |s| s.clone());
    let fields = match first {
        Stage::Listening(f) | Stage::Ready(f) => f,
        Stage::Started | Stage::Closed => {
            let status = child.wait().await?;
            return Err(PdctlError::NotReady {
                what: name,
                reason: format!("exited with {status} (see its error above)"),
            });
        }
    };
    Ok(Proc {
        name,
        child,
        ready: fields.into_iter().collect(),
        stage,
    })
}

/// Waits until every process in `procs` serves (has printed its readiness line), printing the
/// load progress of those still loading every [`PROGRESS_EVERY`]. An error names the first
/// process that exited, or one still not serving after `timeout` with its progress then.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub(crate) async fn wait_serving(
    procs: &mut [Proc],
    timeout: Duration,
    credentials: &Credentials,
) -> Result<(), PdctlError> {
    let start = tokio::time::Instant::now();
    let deadline = start + timeout;
    let mut report_at = start + FIRST_PROGRESS;
    loop {
        let mut waiting = Vec::new();
        for proc in procs.iter_mut() {
            let stage = proc.stage.borrow().clone();
            match stage {
                Stage::Ready(fields) => proc.ready.extend(fields),
                Stage::Closed => {
                    let status = proc.child.wait().await?;
                    return Err(exited(proc, &status.to_string()));
                }
                Stage::Started | Stage::Listening(_) => {
                    if let Some(status) = proc.child.try_wait()? {
                        return Err(exited(proc, &status.to_string()));
                    }
                    waiting.push(&*proc);
                }
            }
        }
        let Some(first) = waiting.first() else {
            return Ok(());
        };
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(PdctlError::NotReady {
                what: first.name.clone(),
                reason: format!(
                    "not serving within {} s (--start-timeout): {}",
                    timeout.as_secs(),
                    describe(first, credentials).await
                ),
            });
        }
        if now >= report_at {
            for proc in &waiting {
                println!("{} {}", proc.name, describe(proc, credentials).await);
            }
            report_at = now + PROGRESS_EVERY;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn exited(proc: &Proc, status: &str) -> PdctlError {
    PdctlError::NotReady {
        what: proc.name.clone(),
        reason: format!("exited with {status} before serving (see its error above)"),
    }
}

/// What a starting worker says about itself: `loading 42% (67.2 of 160.0 GB, 1.20 GB/s, ETA
/// 1m21s)`, its state, or why it did not answer.
async fn describe(proc: &Proc, credentials: &Credentials) -> String {
    let Ok(addr) = proc.addr("grpc") else {
        return "starting (no address yet)".to_owned();
    };
    let ask = async {
        let channel = credentials
            .endpoint(&addr.to_string())
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        proto::v1::worker_client::WorkerClient::new(credentials.channel(channel))
            .info(proto::v1::InfoRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| s.message().to_owned())
    };
    match tokio::time::timeout(Duration::from_secs(2), ask).await {
        Ok(Ok(info)) => describe_info(&info),
        Ok(Err(e)) => format!("starting (Info: {e})"),
        Err(_) => "starting (Info did not answer within 2 s)".to_owned(),
    }
}

/// The state of a worker and, while it loads, how far it is.
fn describe_info(info: &proto::v1::WorkerInfo) -> String {
    let state = match proto::v1::WorkerState::try_from(info.state) {
        Ok(proto::v1::WorkerState::Loading) => "loading",
        Ok(proto::v1::WorkerState::Ready) => "ready",
        Ok(proto::v1::WorkerState::Draining) => "draining",
        _ => "starting",
    };
    match &info.load_progress {
        Some(p) if state == "loading" && p.bytes_total > 0 => format!("{state} {p}"),
        _ => state.to_owned(),
    }
}

pub(crate) async fn stop(mut proc: Proc) -> Result<(), PdctlError> {
    let failed = |reason: String| PdctlError::Stop {
        what: proc.name.clone(),
        reason,
    };
    if let Some(pid) = proc.child.id() {
        let pid = Pid::from_raw(i32::try_from(pid).map_err(|e| failed(e.to_string()))?);
        signal::kill(pid, signal::Signal::SIGTERM).map_err(|e| failed(e.to_string()))?;
    }
    match tokio::time::timeout(STOP_TIMEOUT, proc.child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => Err(failed(format!("exit status {status}"))),
        Ok(Err(e)) => Err(failed(e.to_string())),
        Err(_) => {
            let _ = proc.child.kill().await;
            Err(failed(format!(
                "still running after {STOP_TIMEOUT:?}; killed"
            )))
        }
    }
}

/// Starts `decode` decode workers, `prefill` prefill workers and a router in front of them
/// (HTTP on `http_listen`) from the binaries in `dir`, serving `model`; each started process
/// is pushed onto `procs` (so the caller stops them even when a later one fails). All of them
/// share `secret`. `groups` are the prefill and the decode workers' group flags.
#[expect(
    clippy::too_many_arguments,
    reason = "the cluster's shape, then where it runs"
)]
pub(crate) async fn start(
    dir: &Path,
    model: &Path,
    (prefill, decode): (u16, u16),
    groups: (&[String], &[String]),
    http_listen: std::net::SocketAddr,
    secret: &LocalSecret,
    procs: &mut Vec<Proc>,
    load_timeout: Duration,
) -> Result<(), PdctlError> {
    let model_arg = model.display().to_string();
    let secret_arg = secret.path().display().to_string();
    // Workers serve their own /metrics too (engine step times, cache savings).
    let worker_args = [
        "--grpc-listen",
        EPHEMERAL,
        "--metrics-listen",
        EPHEMERAL,
        "--model-dir",
        model_arg.as_str(),
        "--cluster-secret-file",
        secret_arg.as_str(),
    ];
    let with_group = |group: &[String]| -> Vec<String> {
        worker_args
            .iter()
            .map(|a| (*a).to_owned())
            .chain(group.iter().cloned())
            .collect()
    };
    let (prefill_args, decode_args) = (with_group(groups.0), with_group(groups.1));
    let prefill_args: Vec<&str> = prefill_args.iter().map(String::as_str).collect();
    let decode_args: Vec<&str> = decode_args.iter().map(String::as_str).collect();
    // Every worker is started before any is waited for: they load their models at once.
    for i in 0..decode {
        procs.push(
            launch(
                &dir.join("pdserve-decode"),
                format!("decode-{i}"),
                &decode_args,
            )
            .await?,
        );
    }
    for i in 0..prefill {
        procs.push(
            launch(
                &dir.join("pdserve-prefill"),
                format!("prefill-{i}"),
                &prefill_args,
            )
            .await?,
        );
    }
    wait_serving(procs, load_timeout, &secret.credentials()).await?;
    let mut router_args = vec![
        "--http-listen".to_owned(),
        http_listen.to_string(),
        "--grpc-listen".to_owned(),
        EPHEMERAL.to_owned(),
        "--model-dir".to_owned(),
        model_arg.clone(),
        "--cluster-secret-file".to_owned(),
        secret_arg.clone(),
    ];
    for proc in procs.iter() {
        let flag = if proc.name.starts_with("prefill") {
            "--prefill-worker"
        } else {
            "--decode-worker"
        };
        router_args.push(flag.to_owned());
        router_args.push(proc.addr("grpc")?.to_string());
    }
    let router_args: Vec<&str> = router_args.iter().map(String::as_str).collect();
    let mut router = [launch(&dir.join("pdserve-router"), "router".into(), &router_args).await?];
    wait_serving(&mut router, START_TIMEOUT, &secret.credentials()).await?;
    let [router] = router;
    procs.push(router);
    let http = procs
        .last()
        .map(|p| p.addr("http"))
        .transpose()?
        .ok_or_else(|| PdctlError::NotReady {
            what: "router".into(),
            reason: "not started".into(),
        })?;
    wait_ready(http).await
}

/// Runs `pdctl up`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn up(args: UpArgs) -> Result<(), PdctlError> {
    args.check()?;
    let dir = match args.bin_dir.clone() {
        Some(dir) => dir,
        None => default_bin_dir()?,
    };
    let mut procs = Vec::new();
    let secret = LocalSecret::generate()?;
    let result = async {
        let model = match &args.model {
            Some(dir) => dir.clone(),
            None => default_model()?,
        };
        let groups = (
            UpArgs::group_flags(args.prefill_tp, args.prefill_ep, args.moe_tp),
            UpArgs::group_flags(args.decode_tp, args.decode_ep, args.moe_tp),
        );
        start(
            &dir,
            &model,
            (args.prefill, args.decode),
            (&groups.0, &groups.1),
            args.http_listen,
            &secret,
            &mut procs,
            Duration::from_secs(args.start_timeout),
        )
        .await?;
        println!("{:<12} {:>7}  {:<28} health", "process", "pid", "address");
        for proc in &procs {
            let grpc = proc.addr("grpc")?;
            health::grpc(grpc, "", &proto::auth::Credentials::none()).await?;
            let pid = proc.child.id().unwrap_or(0);
            println!(
                "{:<12} {pid:>7}  {:<28} ok",
                proc.name,
                format!("grpc://{grpc}")
            );
            if let Ok(http) = proc.addr("http") {
                health::http(http).await?;
                println!(
                    "{:<12} {pid:>7}  {:<28} ok",
                    proc.name,
                    format!("http://{http}")
                );
            }
            if let Ok(metrics) = proc.addr("metrics") {
                let answer =
                    common::http_client::get(metrics, "/metrics", Duration::from_secs(5)).await;
                if !matches!(answer, Ok(ref r) if r.status == 200) {
                    return Err(PdctlError::NotReady {
                        what: proc.name.clone(),
                        reason: format!("GET http://{metrics}/metrics did not answer 200"),
                    });
                }
                println!(
                    "{:<12} {pid:>7}  {:<28} ok",
                    proc.name,
                    format!("http://{metrics}/metrics")
                );
            }
        }
        if let Some(router) = procs.iter().find(|p| p.name == "router") {
            let http = router.addr("http")?;
            wait_ready(http).await?;
            let answer = ask(http).await?;
            println!("chat completion: {answer}");
        }
        Ok::<_, PdctlError>(())
    }
    .await;

    if result.is_ok() && !args.smoke {
        println!("cluster up; Ctrl-C or SIGTERM stops it");
        let mut signal = common::shutdown::ShutdownSignal::install()?;
        signal.recv().await;
    }
    // Stop in reverse order: router first, so it never sees its workers vanish mid-request.
    let mut stop_result = Ok(());
    while let Some(proc) = procs.pop() {
        if let Err(e) = stop(proc).await {
            stop_result = stop_result.and(Err(e));
        }
    }
    result?;
    stop_result?;
    if args.smoke {
        println!("smoke: all processes answered health checks and stopped cleanly");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proto::v1::{LoadProgress, WorkerInfo, WorkerState};

    use super::describe_info;

    #[test]
    fn a_loading_worker_is_described_with_its_progress() {
        let progress = LoadProgress {
            bytes_done: 3_000_000,
            bytes_total: 12_000_000,
            shards_done: 1,
            shards_total: 4,
            elapsed_ms: 1_000,
            done: false,
        };
        let loading = WorkerInfo {
            state: WorkerState::Loading.into(),
            load_progress: Some(progress),
            ..WorkerInfo::default()
        };
        assert_eq!(
            describe_info(&loading),
            "loading 25% (3.0 of 12.0 MB, 3.0 MB/s, ETA 3s), 1 of 4 shards"
        );
        // Once ready the progress (kept in Info) is not news.
        let ready = WorkerInfo {
            state: WorkerState::Ready.into(),
            ..loading.clone()
        };
        assert_eq!(describe_info(&ready), "ready");
        let unknown = WorkerInfo::default();
        assert_eq!(describe_info(&unknown), "starting");
    }
}
