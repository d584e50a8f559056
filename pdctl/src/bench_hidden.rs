//! The share of prompt-state transfer time hidden behind prefill compute. A real decode worker
//! and two prefill workers (this workspace's binaries, on loopback) serve the same prompts: one
//! streams each layer's state while the prompt is computed, the other (`--stream-state
//! false`) sends it all after the forward passes. Each `PrefillResponse` says how much transfer
//! time came after the forward passes ended (the exposed part, which delays the first token).
//! Sent afterwards, all of the transfer is exposed; so the share hidden by streaming is
//! 1 - exposed(streamed) / exposed(afterwards), summed over the requests of a row.

use std::{path::PathBuf, time::Duration};

use proto::v1::{
    CancelRequest, InfoRequest, PrefillRequest, RequestId, ReserveRequest, SamplingParams,
    StopConditions, Timings, TransportKind, decode_client::DecodeClient,
    prefill_client::PrefillClient, worker_client::WorkerClient,
};

use crate::{
    PdctlError,
    cluster::{self, EPHEMERAL, Proc},
};

/// What to measure.
#[derive(Debug, Clone)]
pub struct HiddenPlan {
    /// Checkpoint folder (default: the embedded tiny model).
    pub model: Option<PathBuf>,
    /// Prompt lengths, tokens.
    pub prompt_tokens: Vec<u32>,
    /// Requests per transport and length (distinct prompts: no prefix-cache hits).
    pub requests: u32,
    /// The prefill worker's tokens per forward step (its default when `None`).
    pub max_batch_tokens: Option<u32>,
}

fn failed(what: &str, e: impl std::fmt::Display) -> PdctlError {
    PdctlError::Unhealthy {
        what: what.to_owned(),
        reason: e.to_string(),
    }
}

/// One row's sums.
#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    bytes: u64,
    forward_ns: u64,
    busy_ns: u64,
    exposed_ns: u64,
}

impl Sums {
    fn add(&mut self, t: &Timings, bytes: u64) {
        self.bytes += bytes;
        self.forward_ns += t.forward_ns;
        self.busy_ns += t.transfer_ns;
        self.exposed_ns += t.exposed_transfer_ns;
    }
}

/// Deterministic token ids below `limit` for request `n` (distinct per request).
fn prompt(n: u64, len: u32, limit: u32) -> Vec<u32> {
    let mut x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(limit)) as u32
        })
        .collect()
}

/// Spawns the two workers, runs the plan, prints the table, stops the workers.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(plan: &HiddenPlan) -> Result<(), PdctlError> {
    let bin_dir = cluster::default_bin_dir()?;
    let model = match &plan.model {
        Some(dir) => dir.clone(),
        None => cluster::default_model()?,
    };
    let model_arg = model.display().to_string();
    let mut procs: Vec<Proc> = Vec::new();
    let result = async {
        let common = [
            "--grpc-listen",
            EPHEMERAL,
            "--model-dir",
            model_arg.as_str(),
        ];
        procs
            .push(cluster::spawn(&bin_dir.join("pdserve-decode"), "decode".into(), &common).await?);
        let batch = plan.max_batch_tokens.map(|n| n.to_string());
        for stream in ["true", "false"] {
            let mut prefill_args = common.to_vec();
            prefill_args.extend(["--stream-state", stream]);
            if let Some(n) = &batch {
                prefill_args.extend(["--max-batch-tokens", n.as_str()]);
            }
            procs.push(
                cluster::spawn(
                    &bin_dir.join("pdserve-prefill"),
                    format!("prefill-stream-{stream}"),
                    &prefill_args,
                )
                .await?,
            );
        }
        let decode = procs[0].addr("grpc")?;
        let prefills = [procs[1].addr("grpc")?, procs[2].addr("grpc")?];
        measure(plan, decode, prefills).await
    }
    .await;
    while let Some(proc) = procs.pop() {
        let _ = cluster::stop(proc).await;
    }
    let rows = result?;
    println!(
        "\n{:<10} {:>8} {:>10} {:>11} {:>11} {:>14} {:>14} {:>8}",
        "transport",
        "prompt",
        "state MiB",
        "forward ms",
        "transfer ms",
        "exposed ms",
        "exposed ms",
        "hidden"
    );
    println!(
        "{:<10} {:>8} {:>10} {:>11} {:>11} {:>14} {:>14} {:>8}",
        "", "tokens", "", "(streamed)", "(streamed)", "(afterwards)", "(streamed)", ""
    );
    for (kind, len, n, [streamed, afterwards]) in &rows {
        let per = |ns: u64| ns as f64 / 1e6 / f64::from(*n);
        let hidden = if afterwards.exposed_ns == 0 {
            0.0
        } else {
            100.0 * (1.0 - streamed.exposed_ns as f64 / afterwards.exposed_ns as f64)
        };
        println!(
            "{:<10} {len:>8} {:>10.2} {:>11.1} {:>11.2} {:>14.2} {:>14.2} {hidden:>7.1}%",
            kind.as_str_name().trim_start_matches("TRANSPORT_KIND_"),
            streamed.bytes as f64 / f64::from(*n) / 1_048_576.0,
            per(streamed.forward_ns),
            per(streamed.busy_ns),
            per(afterwards.exposed_ns),
            per(streamed.exposed_ns),
        );
    }
    println!(
        "(per request, mean of {}; exposed = transfer time after the forward passes ended, which \
         delays the first token; transfer = time the transport was busy)",
        plan.requests
    );
    Ok(())
}

/// Transport, prompt length, requests, and the sums streamed and sent afterwards.
type Row = (TransportKind, u32, u32, [Sums; 2]);

async fn measure(
    plan: &HiddenPlan,
    decode_addr: std::net::SocketAddr,
    prefill_addrs: [std::net::SocketAddr; 2],
) -> Result<Vec<Row>, PdctlError> {
    let channel = |addr: std::net::SocketAddr| {
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map(|e| e.timeout(Duration::from_secs(300)))
            .map_err(|e| failed("endpoint", e))
    };
    let mut info = None;
    let decode_channel = channel(decode_addr)?
        .connect()
        .await
        .map_err(|e| failed("decode worker", e))?;
    let mut prefills = Vec::new();
    for addr in prefill_addrs {
        let prefill_channel = channel(addr)?
            .connect()
            .await
            .map_err(|e| failed("prefill worker", e))?;
        prefills.push(PrefillClient::new(prefill_channel.clone()));
        if prefills.len() == 1 {
            info = Some(
                WorkerClient::new(prefill_channel)
                    .info(InfoRequest {})
                    .await
                    .map_err(|e| failed("prefill info", e))?
                    .into_inner(),
            );
        }
    }
    let info = info.unwrap_or_default();
    let mut decode = DecodeClient::new(decode_channel);
    let vocab_limit = 30_000;
    let mut rows = Vec::new();
    let mut n = 0u64;
    for kind in [TransportKind::Ucx, TransportKind::Tcp] {
        if !info.transports.contains(&i32::from(kind)) {
            continue;
        }
        for &len in &plan.prompt_tokens {
            let mut sums = [Sums::default(); 2];
            // One untimed request per row: connections, endpoints, page faults. Both workers
            // get the same prompts; no prompt repeats across rows (no prefix-cache hits).
            for (i, w) in (0..=plan.requests).flat_map(|i| [(i, 0), (i, 1)]) {
                n += 1;
                let seed = (kind as u64) << 48 | u64::from(len) << 16 | u64::from(i);
                let request_id = RequestId {
                    id: format!("bench-hidden-{n}"),
                    attempt: 1,
                };
                let destination = decode
                    .reserve(ReserveRequest {
                        request_id: Some(request_id.clone()),
                        prompt_tokens: len,
                        max_new_tokens: 1,
                        lease_ms: 120_000,
                        queue_timeout_ms: 60_000,
                        prefill_layout: info.layout.clone(),
                        transports: vec![kind.into()],
                        decode_rank: None,
                    })
                    .await
                    .map_err(|e| failed("reserve", e.message()))?
                    .into_inner()
                    .destination;
                let response = prefills[w]
                    .prefill(PrefillRequest {
                        request_id: Some(request_id.clone()),
                        prompt_token_ids: prompt(seed, len, vocab_limit),
                        sampling: Some(SamplingParams {
                            top_p: 1.0,
                            repetition_penalty: 1.0,
                            ..SamplingParams::default()
                        }),
                        stop: Some(StopConditions {
                            max_tokens: 1,
                            ignore_eos: true,
                            ..StopConditions::default()
                        }),
                        destination,
                        decode_address: decode_addr.to_string(),
                        checksums: false,
                        deadline_ms: 0,
                        prefill_rank: None,
                    })
                    .await
                    .map_err(|e| failed("prefill", e.message()))?
                    .into_inner();
                let _ = decode
                    .cancel(CancelRequest {
                        request_id: Some(request_id),
                        reason: "bench".to_owned(),
                    })
                    .await;
                if i > 0 {
                    sums[w].add(
                        &response.timings.unwrap_or_default(),
                        response.transferred_bytes,
                    );
                }
            }
            rows.push((kind, len, plan.requests, sums));
        }
    }
    Ok(rows)
}
