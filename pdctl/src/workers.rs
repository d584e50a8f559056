//! Operating a running cluster through its router: `pdctl workers` (the worker table),
//! `pdctl status` (router readiness, model, traffic and errors, then the worker table; exits
//! non-zero when the cluster cannot serve) and `pdctl drain` (drain one worker gracefully).

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, time::Duration};

use proto::v1::{DrainRequest, worker_client::WorkerClient};
use serde_json::Value;

use crate::PdctlError;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Arguments of `pdctl workers` and `pdctl status`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkersArgs {
    /// The router's HTTP address (host:port).
    #[arg(long, value_name = "ADDR")]
    pub url: SocketAddr,
    /// API key, when the router requires one.
    #[arg(long, env = common::env::API_KEY, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Print the JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `pdctl drain`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrainArgs {
    /// The worker's gRPC address (host:port, as `pdctl workers` lists it).
    #[arg(value_name = "WORKER")]
    pub worker: String,
    /// The router's HTTP address: wait until it no longer lists the worker.
    #[arg(long, value_name = "ADDR")]
    pub url: Option<SocketAddr>,
    /// API key for the router, when it requires one.
    #[arg(long, env = common::env::API_KEY, value_name = "KEY")]
    pub api_key: Option<String>,
    /// The cluster's secret file (the workers' `cluster_secret_file`).
    #[arg(long, env = "PDSERVE_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster's TLS files, when its processes use mutual TLS.
    #[command(flatten)]
    pub tls: common::internal_tls::TlsFlags,
    /// Milliseconds the worker may take to finish its requests (0: its `shutdown_grace_ms`;
    /// more than that is refused).
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub deadline_ms: u32,
    /// Seconds to wait for the worker to leave the router (with --url).
    #[arg(long, default_value_t = 660, value_name = "S")]
    pub wait_s: u64,
}

fn err(message: String) -> PdctlError {
    PdctlError::Unhealthy {
        what: "router".to_owned(),
        reason: message,
    }
}

/// `GET path` on the router; the status and the body as JSON (or as a string).
async fn get(
    url: SocketAddr,
    path: &str,
    api_key: Option<&str>,
) -> Result<(u16, Value), PdctlError> {
    let bearer = api_key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer
        .as_deref()
        .map(|b| vec![("authorization", b)])
        .unwrap_or_default();
    let response = common::http_client::request_with(url, "GET", path, &headers, None, TIMEOUT)
        .await
        .map_err(|e| err(format!("GET {path}: {e}")))?;
    let body = serde_json::from_slice(&response.body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&response.body).into_owned()));
    Ok((response.status, body))
}

async fn listing(url: SocketAddr, api_key: Option<&str>) -> Result<Value, PdctlError> {
    let (status, body) = get(url, "/workers", api_key).await?;
    if status != 200 {
        return Err(err(format!("GET /workers: HTTP {status}: {body}")));
    }
    Ok(body)
}

/// Runs `pdctl workers`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(args: &WorkersArgs) -> Result<(), PdctlError> {
    let body = listing(args.url, args.api_key.as_deref()).await?;
    if args.json {
        println!("{body:#}");
    } else {
        print_table(&body);
    }
    Ok(())
}

#[expect(clippy::print_stdout, reason = "CLI output")]
fn print_table(body: &Value) {
    println!(
        "{:<8} {:<22} {:<12} {:<10} {:>8} {:>8} {:>8} {:>8} {:>14}  id",
        "role",
        "address",
        "state",
        "source",
        "inflight",
        "running",
        "queued",
        "reserv",
        "pages used/all"
    );
    for w in body["workers"].as_array().into_iter().flatten() {
        let text = |k: &str| w[k].as_str().unwrap_or("").to_owned();
        let num = |k: &str| w[k].as_u64().unwrap_or(0);
        let progress = load_progress(&w["load_progress"]);
        let state = match &progress {
            Some(p) => format!("{} {}%", text("state"), p.percent()),
            None => text("state"),
        };
        println!(
            "{:<8} {:<22} {:<12} {:<10} {:>8} {:>8} {:>8} {:>8} {:>14}  {}",
            text("role"),
            text("address"),
            state,
            if w["registered"].as_bool() == Some(true) {
                "registered"
            } else {
                "static"
            },
            num("in_flight"),
            num("running_requests"),
            num("queued_requests"),
            num("reservations"),
            format!("{}/{}", num("pages_used"), num("pages_total")),
            text("id"),
        );
        if let Some(p) = progress {
            println!("{:<8} loading: {p}", "");
        }
        if let Some(compute) = compute_line(&w["compute"]) {
            println!("{:<8} compute: {compute}", "");
        }
    }
}

/// A listing's `compute` object in a line: backend, K=V rows, and the settings that leave the
/// reference's bits (or `exact`).
fn compute_line(c: &Value) -> Option<String> {
    let backend = c["backend"].as_str()?;
    let fast: Vec<&str> = c["fast_kernels"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let kernels = if fast.is_empty() {
        "exact kernels".to_owned()
    } else {
        format!("within stated bounds: {}", fast.join(", "))
    };
    Some(format!(
        "{backend}, kv {}, {kernels}",
        c["kv_cache_dtype"].as_str().unwrap_or("?")
    ))
}

/// A listing's `load_progress` object (present while the worker loads its model).
fn load_progress(v: &Value) -> Option<proto::v1::LoadProgress> {
    let n = |k: &str| v[k].as_u64();
    Some(proto::v1::LoadProgress {
        bytes_done: n("bytes_done")?,
        bytes_total: n("bytes_total")?,
        shards_done: u32::try_from(n("shards_done")?).ok()?,
        shards_total: u32::try_from(n("shards_total")?).ok()?,
        elapsed_ms: n("elapsed_ms").unwrap_or(0),
        done: v["done"].as_bool().unwrap_or(false),
    })
}

/// Sums of the samples of each metric in a Prometheus text, by name and label set.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(series, v)| Some((series.to_owned(), v.parse::<f64>().ok()?)))
        .collect()
}

/// Runs `pdctl status`: fails when the router is not ready or a role has no ready worker.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn status(args: &WorkersArgs) -> Result<(), PdctlError> {
    let key = args.api_key.as_deref();
    let (ready_status, ready_body) = get(args.url, "/health/ready", key).await?;
    let (_, models) = get(args.url, "/v1/models", key).await?;
    let workers = listing(args.url, key).await?;
    let (_, metrics) = get(args.url, "/metrics", key).await?;
    let metrics = samples(metrics.as_str().unwrap_or(""));
    let sum = |prefix: &str| -> f64 {
        metrics
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    };
    let model = models["data"][0]["id"].as_str().unwrap_or("-").to_owned();
    let ready = ready_status == 200;
    let errors: Vec<String> = metrics
        .iter()
        .filter_map(|(k, v)| {
            let kind = k
                .strip_prefix("pdserve_errors_total{kind=\"")?
                .strip_suffix("\"}")?;
            (*v > 0.0).then(|| format!("{kind} {v}"))
        })
        .collect();
    let list = workers["workers"].as_array().cloned().unwrap_or_default();
    let ready_of = |role: &str| {
        list.iter()
            .filter(|w| w["role"] == role && w["state"] == "ready")
            .count()
    };
    let (prefill_ready, decode_ready) = (ready_of("prefill"), ready_of("decode"));
    let loading = list.iter().filter(|w| w["state"] == "loading").count();
    if args.json {
        let summary = serde_json::json!({
            "router": args.url.to_string(),
            "ready": ready,
            "model": model,
            "requests_running": sum("pdserve_running_requests"),
            "requests_queued": sum("pdserve_queued_requests"),
            "errors": sum("pdserve_errors_total"),
            "workers": list,
        });
        println!("{summary:#}");
    } else {
        println!(
            "router {}  {}  model {model}",
            args.url,
            if ready {
                "ready".to_owned()
            } else {
                format!("NOT READY ({ready_body})")
            }
        );
        println!(
            "requests: {} running, {} waiting for decode room, {} answered, {} errors{}",
            sum("pdserve_running_requests"),
            sum("pdserve_queued_requests"),
            sum("pdserve_requests_total"),
            sum("pdserve_errors_total"),
            if errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", errors.join(", "))
            }
        );
        println!(
            "ready workers: {prefill_ready} prefill, {decode_ready} decode{}\n",
            if loading > 0 {
                format!(" ({loading} still loading the model)")
            } else {
                String::new()
            }
        );
        print_table(&workers);
    }
    if !ready || prefill_ready == 0 || decode_ready == 0 {
        return Err(err(format!(
            "cannot serve: router {}, {prefill_ready} ready prefill and {decode_ready} ready \
             decode workers",
            if ready { "ready" } else { "not ready" }
        )));
    }
    Ok(())
}

/// Runs `pdctl drain`: asks the worker to drain, then (with `--url`) waits until the router no
/// longer lists it.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn drain(args: &DrainArgs) -> Result<(), PdctlError> {
    let worker_err = |reason: String| PdctlError::Unhealthy {
        what: args.worker.clone(),
        reason,
    };
    let security = common::cluster_auth::Security::load(
        args.cluster_secret_file.as_deref(),
        &args.tls.settings(),
    )
    .map_err(|e| worker_err(format!("{}: {}", e.key, e.reason)))?;
    let credentials = security.credentials();
    let channel = credentials
        .endpoint(&args.worker)
        .map_err(|e| worker_err(e.to_string()))?
        .connect_timeout(TIMEOUT)
        .connect()
        .await
        .map_err(|e| worker_err(e.to_string()))?;
    WorkerClient::new(credentials.channel(channel))
        .drain(DrainRequest {
            deadline_ms: args.deadline_ms,
        })
        .await
        .map_err(|s| worker_err(s.message().to_owned()))?;
    println!("{}: draining", args.worker);
    let Some(url) = args.url else {
        return Ok(());
    };
    let until = tokio::time::Instant::now() + Duration::from_secs(args.wait_s);
    let mut last = String::new();
    loop {
        let body = listing(url, args.api_key.as_deref()).await?;
        let entry = body["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|w| w["address"] == args.worker.as_str())
            .cloned();
        let Some(entry) = entry else {
            println!("{}: drained and gone from the router", args.worker);
            return Ok(());
        };
        let now = format!(
            "{}: {}, {} running, {} reserved",
            args.worker,
            entry["state"].as_str().unwrap_or("?"),
            entry["running_requests"],
            entry["reservations"]
        );
        if now != last {
            println!("{now}");
            last = now;
        }
        if tokio::time::Instant::now() >= until {
            return Err(worker_err(format!(
                "still listed by the router after {} s",
                args.wait_s
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_samples_parse() {
        let m = samples("# TYPE x counter\nx{kind=\"a\"} 2\nx{kind=\"b\"} 0\ny 1.5\nbroken\n");
        assert_eq!(m.get("x{kind=\"a\"}"), Some(&2.0));
        assert_eq!(m.get("y"), Some(&1.5));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn listing_progress_parses_and_reads() {
        let v = serde_json::json!({
            "bytes_done": 67_200_000_000_u64, "bytes_total": 160_000_000_000_u64,
            "shards_done": 19, "shards_total": 46, "elapsed_ms": 56_000, "done": false,
        });
        let p = load_progress(&v).unwrap();
        assert_eq!(
            p.to_string(),
            "42% (67.2 of 160.0 GB, 1.20 GB/s, ETA 1m18s), 19 of 46 shards"
        );
        assert!(load_progress(&Value::Null).is_none());
        assert!(load_progress(&serde_json::json!({"bytes_done": 1})).is_none());
    }
}
