//! `pdctl soak`: a local CPU cluster under constant streaming load for a fixed time. Prints,
//! every sample interval, the requests answered, errors, tokens/s and every process's resident
//! memory; at the end, whether every worker's pages returned to baseline. Fails on any error,
//! or when pages stay in use. A benchmark, not a test: it runs for minutes.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use proto::{
    auth::Credentials,
    v1::{InfoRequest, worker_client::WorkerClient},
};
use serde_json::json;

use crate::{
    PdctlError,
    cluster::{self, Proc},
    verify::prompt_text,
};

/// Arguments of `pdctl soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// Streams kept open at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// How long to run, seconds.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub duration_s: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub sample_s: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_tokens: u32,
    /// Prefill and decode workers.
    #[arg(long, default_value_t = 1)]
    pub prefill: u16,
    #[arg(long, default_value_t = 1)]
    pub decode: u16,
    /// Checkpoint (default: the embedded tiny model).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
}

#[derive(Debug, Default)]
struct Counters {
    ok: AtomicU64,
    errors: AtomicU64,
    tokens: AtomicU64,
}

/// Resident memory of `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// One client: streams requests back to back until `until`.
async fn client(http: SocketAddr, i: u32, args: SoakArgs, until: Instant, c: Arc<Counters>) {
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let words = 4 + ((u64::from(i) * 31 + n * 7) % 120) as usize;
        let body = json!({
            "model": "deepseek-v4-flash",
            "messages": [{"role": "user", "content": prompt_text(u64::from(i) << 32 | n, words)}],
            "max_tokens": args.max_tokens,
            "stream": true,
            // Greedy: the CPU engine's temperature sampling sorts the whole vocabulary per
            // token, which would make the load about sampling speed instead of serving.
            "temperature": 0,
            "reasoning_effort": "none",
        });
        let response = common::http_client::request(
            http,
            "POST",
            "/v1/chat/completions",
            Some(("application/json", body.to_string().into_bytes())),
            Duration::from_secs(300),
        )
        .await;
        let ok = match &response {
            Ok(r) if r.status == 200 => {
                let text = String::from_utf8_lossy(&r.body);
                let done = text.contains("data: [DONE]");
                let failed = text.contains("\"error\"");
                if done && !failed {
                    let chunks = text
                        .lines()
                        .filter(|l| l.starts_with("data: {") && l.contains("\"delta\""))
                        .count();
                    c.tokens.fetch_add(chunks as u64, Ordering::Relaxed);
                }
                done && !failed
            }
            _ => false,
        };
        if ok {
            c.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            c.errors.fetch_add(1, Ordering::Relaxed);
            if c.errors.load(Ordering::Relaxed) <= 3 {
                tracing::warn!(response = ?response.map(|r| (r.status, String::from_utf8_lossy(&r.body).chars().take(300).collect::<String>())), "soak request failed");
            }
        }
    }
}

/// (pages held for requests, requests, reservations) of a worker.
async fn busy(addr: SocketAddr, credentials: &Credentials) -> Result<(u64, u32, u32), PdctlError> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| PdctlError::Model(e.to_string()))?
        .connect()
        .await
        .map_err(|e| PdctlError::Unhealthy {
            what: addr.to_string(),
            reason: e.to_string(),
        })?;
    let mut client = WorkerClient::new(credentials.channel(channel));
    let load = client
        .info(InfoRequest {})
        .await
        .map_err(|e| PdctlError::Unhealthy {
            what: addr.to_string(),
            reason: e.message().to_owned(),
        })?
        .into_inner()
        .load
        .unwrap_or_default();
    Ok((
        load.pages_used - load.pages_cached,
        load.running_requests + load.queued_requests,
        load.reservations,
    ))
}

/// Runs `pdctl soak`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(args: &SoakArgs) -> Result<(), PdctlError> {
    let dir = cluster::default_bin_dir()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => cluster::default_model()?,
    };
    let mut procs: Vec<Proc> = Vec::new();
    let secret = cluster::LocalSecret::generate()?;
    let result = async {
        cluster::start(
            &dir,
            &model,
            (args.prefill, args.decode),
            (&[], &[]),
            SocketAddr::from(([127, 0, 0, 1], 0)),
            &secret,
            &mut procs,
            cluster::LOAD_TIMEOUT,
        )
        .await?;
        let http = procs
            .iter()
            .find(|p| p.name == "router")
            .map(|p| p.addr("http"))
            .transpose()?
            .ok_or_else(|| PdctlError::Model("no router".into()))?;
        soak(args, http, &procs, &secret.credentials()).await
    }
    .await;
    while let Some(proc) = procs.pop() {
        let _ = cluster::stop(proc).await;
    }
    let (errors, leftover) = result?;
    if errors > 0 || !leftover.is_empty() {
        return Err(PdctlError::Unhealthy {
            what: "soak".into(),
            reason: format!("{errors} errors; pages or requests left: {leftover:?}"),
        });
    }
    println!("soak passed: no errors, every worker back to baseline");
    Ok(())
}

/// The load and the samples; returns the errors and the workers not back to baseline.
#[expect(clippy::print_stdout, reason = "CLI output")]
async fn soak(
    args: &SoakArgs,
    http: SocketAddr,
    procs: &[Proc],
    credentials: &Credentials,
) -> Result<(u64, Vec<String>), PdctlError> {
    let started = Instant::now();
    let until = started + Duration::from_secs(args.duration_s);
    let counters = Arc::new(Counters::default());
    let clients: Vec<_> = (0..args.concurrency)
        .map(|i| tokio::spawn(client(http, i, args.clone(), until, Arc::clone(&counters))))
        .collect();
    print!(
        "{:>6} {:>9} {:>7} {:>9}",
        "t (s)", "answered", "errors", "tok/s"
    );
    for p in procs {
        print!(" {:>12}", format!("{} MiB", p.name));
    }
    println!();
    let mut last = (Instant::now(), 0u64);
    let mut rss_first: Vec<u64> = Vec::new();
    let mut rss_last: Vec<u64> = Vec::new();
    loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        tokio::time::sleep(Duration::from_secs(args.sample_s).min(until - now)).await;
        let tokens = counters.tokens.load(Ordering::Relaxed);
        let rate = (tokens - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), tokens);
        let rss: Vec<u64> = procs.iter().map(|p| p.pid().map_or(0, rss_kib)).collect();
        print!(
            "{:>6} {:>9} {:>7} {rate:>9.1}",
            started.elapsed().as_secs(),
            counters.ok.load(Ordering::Relaxed),
            counters.errors.load(Ordering::Relaxed)
        );
        for r in &rss {
            print!(" {:>12.1}", *r as f64 / 1024.0);
        }
        println!();
        if rss_first.is_empty() {
            rss_first.clone_from(&rss);
        }
        rss_last = rss;
    }
    for c in clients {
        let _ = c.await;
    }
    // Every worker back to baseline (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut leftover = Vec::new();
    for p in procs.iter().filter(|p| p.name != "router") {
        let addr = p.addr("grpc")?;
        loop {
            let now = busy(addr, credentials).await?;
            if now == (0, 0, 0) {
                break;
            }
            if Instant::now() >= deadline {
                leftover.push(format!("{}: {now:?}", p.name));
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    println!(
        "\n{} requests answered, {} errors, {} streams for {} s",
        counters.ok.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
        args.concurrency,
        args.duration_s
    );
    for ((p, first), last) in procs.iter().zip(&rss_first).zip(&rss_last) {
        println!(
            "{:<10} RSS {:>8.1} MiB at the first sample, {:>8.1} MiB at the last ({:+.1}%)",
            p.name,
            *first as f64 / 1024.0,
            *last as f64 / 1024.0,
            100.0 * (*last as f64 - *first as f64) / (*first).max(1) as f64
        );
    }
    Ok((counters.errors.load(Ordering::Relaxed), leftover))
}
