//! `pdctl bench-transfer`: page-transfer throughput between two processes on this host, over
//! UCX (one-sided puts into registered memory, flushed) and over the TCP transport (page frames
//! over gRPC), next to `ucx_perftest` on the same message size when it is installed.
//!
//! The receiving side is this same binary started as a child (`--serve-target`): it registers a
//! buffer for UCX, serves `StateTransfer` for TCP, and prints both endpoints.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use kv_transfer::{
    sink::{StateSink, StateTransferService},
    ucx::{Exporter, Put, Putter, Region},
};
use prost::Message;
use proto::auth::Credentials;
use proto::v1::{
    PageRef, PageWrite, RequestId, TcpTarget, TransferDescriptor, TransferHello,
    TransferHelloReply, TransportKind, UcxTarget, state_transfer_server::StateTransferServer,
    transfer_descriptor::Target,
};
use tonic::Status;

use crate::PdctlError;

/// Arguments of `pdctl bench-transfer`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchTransferArgs {
    /// Bytes moved per iteration, MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub size_mib: u32,
    /// Bytes per message (one page write), KiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(4..=65536))]
    pub message_kib: u32,
    /// Timed iterations (the best and the mean are reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub iterations: u32,
    /// `ucx_perftest` to compare against (default: one next to this binary, as
    /// `scripts/build-ucx-perftest` puts it, else the one on PATH).
    #[arg(long, value_name = "PATH")]
    pub perftest: Option<std::path::PathBuf>,
    /// Checkpoint for the hidden-share measurement (default: the embedded tiny model).
    #[arg(long, value_name = "DIR")]
    pub model: Option<std::path::PathBuf>,
    /// Prompt lengths for the hidden-share measurement, tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512u32, 2048])]
    pub prompt_tokens: Vec<u32>,
    /// Prefill requests per transport and prompt length.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub requests: u32,
    /// The prefill worker's tokens per forward step (default: its own default).
    #[arg(long)]
    pub max_batch_tokens: Option<u32>,
    /// Skip the hidden-share measurement (which starts a prefill and a decode worker).
    #[arg(long)]
    pub no_prefill: bool,
    /// Internal: run as the receiving side.
    #[arg(long, hide = true)]
    pub serve_target: bool,
}

fn err(message: impl Into<String>) -> PdctlError {
    PdctlError::Model(message.into())
}

/// The receiving side's memory for the TCP transport.
struct Sink {
    buffer: Mutex<Vec<u8>>,
}

impl StateSink for Sink {
    fn hello(&self, _: TransferHello) -> BoxFuture<'_, Result<TransferHelloReply, Status>> {
        Box::pin(async { Err(Status::unimplemented("bench sink")) })
    }

    fn write(&self, frame: PageWrite) -> BoxFuture<'_, Result<u64, Status>> {
        Box::pin(async move {
            let base = frame.page.map_or(0, |p| p.offset_bytes) + frame.offset_bytes;
            let start = usize::try_from(base).map_err(|_| Status::out_of_range("offset"))?;
            let mut buffer = self
                .buffer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let end = start + frame.data.len();
            if end > buffer.len() {
                return Err(Status::out_of_range("write past the buffer"));
            }
            buffer[start..end].copy_from_slice(&frame.data);
            Ok(frame.data.len() as u64)
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The child: registers memory, serves TCP, prints `TARGET <ucx target hex> <tcp address>`,
/// and runs until its stdin closes.
#[expect(clippy::print_stdout, reason = "the parent reads this line")]
async fn serve_target(bytes: usize) -> Result<(), PdctlError> {
    let mut ucx_buffer = vec![0u8; bytes];
    let exporter = Exporter::start(vec![Region {
        base: ucx_buffer.as_mut_ptr() as usize,
        length: ucx_buffer.len(),
    }])
    .map_err(|e| err(e.to_string()))?;
    let sink = Arc::new(Sink {
        buffer: Mutex::new(vec![0u8; bytes]),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let service = StateTransferServer::new(StateTransferService::new(sink))
        .max_decoding_message_size(kv_transfer::tcp::FRAME_BYTES * 2);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    println!(
        "TARGET {} {address}",
        hex(&exporter.target().encode_to_vec())
    );
    // Until the parent closes our stdin.
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
            line.clear();
        }
    })
    .await
    .map_err(|e| err(e.to_string()))?;
    drop(exporter);
    drop(ucx_buffer);
    Ok(())
}

/// (best, mean) GB/s over the timed iterations of `run`.
async fn rate<F, Fut>(iterations: u32, bytes: usize, mut run: F) -> Result<(f64, f64), PdctlError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, kv_transfer::TransferError>>,
{
    // One untimed round (connection set-up, key unpacking, page faults).
    run().await.map_err(|e| err(e.to_string()))?;
    let mut rates = Vec::new();
    for _ in 0..iterations {
        let started = Instant::now();
        let moved = run().await.map_err(|e| err(e.to_string()))?;
        if moved != bytes as u64 {
            return Err(err(format!("moved {moved} bytes, expected {bytes}")));
        }
        rates.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    let best = rates.iter().copied().fold(0.0, f64::max);
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    Ok((best, mean))
}

/// Runs `pdctl bench-transfer`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub async fn run(args: &BenchTransferArgs) -> Result<(), PdctlError> {
    let bytes = args.size_mib as usize * (1 << 20);
    let message = args.message_kib as usize * 1024;
    if args.serve_target {
        return serve_target(bytes).await;
    }
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "bench-transfer",
            "--serve-target",
            "--size-mib",
            &args.size_mib.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or_else(|| err("no child stdout"))?;
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .map_err(|e| err(e.to_string()))??;
    let mut fields = line.split_whitespace();
    let (Some("TARGET"), Some(ucx_hex), Some(tcp)) = (fields.next(), fields.next(), fields.next())
    else {
        let _ = child.kill();
        return Err(err(format!("the receiving side said {line:?}")));
    };
    let target = unhex(ucx_hex)
        .and_then(|b| UcxTarget::decode(b.as_slice()).ok())
        .ok_or_else(|| err("bad UCX target"))?;
    let tcp: SocketAddr = tcp.parse().map_err(|_| err("bad TCP address"))?;

    let messages = bytes.div_ceil(message);
    let payload: Vec<Vec<u8>> = (0..messages)
        .map(|i| vec![(i % 251) as u8; message.min(bytes - i * message)])
        .collect();
    println!(
        "{} MiB per iteration in {messages} messages of {} KiB, {} iterations, two processes on this host",
        args.size_mib, args.message_kib, args.iterations
    );
    println!(
        "\n{:<34} {:>10} {:>10}",
        "transport", "best GB/s", "mean GB/s"
    );

    let putter = Putter::start().map_err(|e| err(e.to_string()))?;
    // The puts of every round are built before timing (copying 64 MiB is not the transport's
    // time); a put owns its bytes.
    let mut rounds: Vec<Vec<Put>> = (0..=args.iterations)
        .map(|_| {
            payload
                .iter()
                .enumerate()
                .map(|(i, data)| Put {
                    region: 0,
                    offset: (i * message) as u64,
                    data: data.clone(),
                })
                .collect()
        })
        .collect();
    let (best, mean) = rate(args.iterations, bytes, || {
        let puts = rounds.pop().unwrap_or_default();
        let (putter, target) = (putter.clone(), target.clone());
        async move { putter.put(target, puts).await }
    })
    .await?;
    println!(
        "{:<34} {best:>10.2} {mean:>10.2}",
        "pdserve UCX put + flush"
    );
    let best_ucx = best;

    let descriptor = TransferDescriptor {
        decode_rank: 0,
        transport: TransportKind::Tcp.into(),
        reservation_id: "bench".to_owned(),
        pages: (0..messages)
            .map(|i| PageRef {
                region: 0,
                page: i as u64,
                offset_bytes: (i * message) as u64,
            })
            .collect(),
        slot: Some(PageRef::default()),
        target: Some(Target::Tcp(TcpTarget {
            address: tcp.to_string(),
        })),
        ..TransferDescriptor::default()
    };
    let id = RequestId::default();
    let (best, mean) = rate(args.iterations, bytes, || {
        let (descriptor, id, payload) = (&descriptor, &id, &payload);
        async move {
            kv_transfer::tcp::send_state(descriptor, id, payload, &[], &Credentials::none()).await
        }
    })
    .await?;
    println!(
        "{:<34} {best:>10.2} {mean:>10.2}",
        "pdserve TCP page frames (gRPC)"
    );
    drop(child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::task::spawn_blocking(move || child.wait()).await
    })
    .await;

    perftest(args, message, best_ucx);
    if args.no_prefill {
        return Ok(());
    }
    println!("\nshare of the state transfer hidden behind prefill compute:");
    crate::bench_hidden::run(&crate::bench_hidden::HiddenPlan {
        model: args.model.clone(),
        prompt_tokens: args.prompt_tokens.clone(),
        requests: args.requests,
        max_batch_tokens: args.max_batch_tokens,
    })
    .await
}

/// The `ucx_perftest` to run: the one given, else one next to this binary, else PATH's.
fn perftest_exe(args: &BenchTransferArgs) -> std::path::PathBuf {
    if let Some(path) = &args.perftest {
        return path.clone();
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("ucx_perftest")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| std::path::PathBuf::from("ucx_perftest"))
}

/// `ucx_perftest` put bandwidth on the same message size and with the same endpoint error
/// handling as pdserve's (peer failure detection, `-e`: without it UCX may pick transports
/// that cannot report a dead peer), next to pdserve's best.
#[expect(clippy::print_stdout, reason = "CLI output")]
fn perftest(args: &BenchTransferArgs, message: usize, ours: f64) {
    let exe = perftest_exe(args);
    let port = "13377";
    let count = ((args.size_mib as usize * (1 << 20)) / message * args.iterations as usize).max(1);
    let common = [
        "-t".to_owned(),
        "ucp_put_bw".to_owned(),
        "-s".to_owned(),
        message.to_string(),
        "-n".to_owned(),
        count.to_string(),
        "-p".to_owned(),
        port.to_owned(),
        "-e".to_owned(),
    ];
    let Ok(mut server) = Command::new(&exe)
        .args(&common)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        println!(
            "{:<34} {:>10}",
            "ucx_perftest ucp_put_bw", "not found (scripts/build-ucx-perftest builds it)"
        );
        return;
    };
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new(&exe).arg("127.0.0.1").args(&common).output();
    let _ = server.kill();
    let _ = server.wait();
    // The final summary line's bandwidth column (MB/s average, MB = 2^20 bytes) is the 6th
    // number.
    let best = client.ok().and_then(|out| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .rev()
            .find(|l| l.trim_start().starts_with("Final:"))
            .and_then(|l| l.split_whitespace().nth(6).map(str::to_owned))
    });
    match best.and_then(|v| v.parse::<f64>().ok()) {
        Some(mibps) => {
            let gbps = mibps * 1.048_576 / 1000.0;
            println!(
                "{:<34} {gbps:>10.2} {:>10}",
                "ucx_perftest ucp_put_bw -e", "-"
            );
            println!("pdserve UCX / ucx_perftest: {:.0}%", 100.0 * ours / gbps);
        }
        None => println!("{:<34} {:>10}", "ucx_perftest ucp_put_bw", "failed"),
    }
}
