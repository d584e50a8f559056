//! `pdctl up`: a local cluster on loopback from the workspace's own binaries. Each child is
//! started with ephemeral ports (except the router's HTTP port), reports its addresses on its
//! readiness line, is health-checked, and is stopped with SIGTERM.

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
};

use crate::{PdctlError, UpArgs, health};

const START_TIMEOUT: Duration = Duration::from_secs(60);
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
        let secret = ClusterSecret::new(&hex).map_err(PdctlError::Model)?;
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

/// A started child process and the addresses it announced.
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    child: Child,
    ready: HashMap<String, String>,
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

pub(crate) async fn spawn(bin: &Path, name: String, args: &[&str]) -> Result<Proc, PdctlError> {
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
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(fields) = common::cli::parse_ready(&line) {
                return Ok(Some(fields));
            }
        }
        Ok::<_, std::io::Error>(None)
    })
    .await
    .map_err(|_| PdctlError::NotReady {
        what: name.clone(),
        reason: format!("no readiness line within {START_TIMEOUT:?}"),
    })??;
    let Some(fields) = ready else {
        let status = child.wait().await?;
        return Err(PdctlError::NotReady {
            what: name,
            reason: format!("exited with {status} (see its error above)"),
        });
    };
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Proc {
        name,
        child,
        ready: fields.into_iter().collect(),
    })
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
/// share `secret`.
pub(crate) async fn start(
    dir: &Path,
    model: &Path,
    (prefill, decode): (u16, u16),
    http_listen: std::net::SocketAddr,
    secret: &LocalSecret,
    procs: &mut Vec<Proc>,
) -> Result<(), PdctlError> {
    let model_arg = model.display().to_string();
    let secret_arg = secret.path().display().to_string();
    let worker_args = [
        "--grpc-listen",
        EPHEMERAL,
        "--model-dir",
        model_arg.as_str(),
        "--cluster-secret-file",
        secret_arg.as_str(),
    ];
    for i in 0..decode {
        procs.push(
            spawn(
                &dir.join("pdserve-decode"),
                format!("decode-{i}"),
                &worker_args,
            )
            .await?,
        );
    }
    for i in 0..prefill {
        procs.push(
            spawn(
                &dir.join("pdserve-prefill"),
                format!("prefill-{i}"),
                &worker_args,
            )
            .await?,
        );
    }
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
    procs.push(spawn(&dir.join("pdserve-router"), "router".into(), &router_args).await?);
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
        start(
            &dir,
            &model,
            (args.prefill, args.decode),
            args.http_listen,
            &secret,
            &mut procs,
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
