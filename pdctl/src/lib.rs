//! pdctl: operator commands. `up` runs a local cluster from the workspace's binaries; `health`
//! probes a running service; `gen-model` writes synthetic checkpoints and `logits` prints the
//! CPU reference model's logits; `verify`, `soak` and the benches check and measure a
//! cluster; `workers`, `status` and `drain` operate a running one.

pub mod bench_engine;
pub mod bench_hidden;
pub mod bench_mask;
pub mod bench_ranks;
pub mod bench_roofline;
pub mod bench_transfer;
pub mod cluster;
pub mod generate;
pub mod health;
pub mod model_cmds;
pub mod plan;
pub mod soak;
pub mod verify;
pub mod workers;

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

/// Command line of `pdctl`.
#[derive(Debug, Parser)]
#[command(name = "pdctl", version, about = "pdserve operator CLI", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a local cluster (router, prefill and decode workers) on loopback.
    Up(UpArgs),
    /// Probe a service's gRPC or HTTP health; exit 0 when it serves.
    Health(HealthArgs),
    /// Write a deterministic synthetic checkpoint in the official DeepSeek-V4 layout.
    GenModel(model_cmds::GenModelArgs),
    /// Print reference f32 logits of a prompt from the engine's CPU model.
    Logits(model_cmds::LogitsArgs),
    /// Generate from a prompt in this process with the engine's CPU model.
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode tokens/s of the engine's CPU model.
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Measure decode tokens/s of one engine against N CPU ranks of one worker
    /// (data-parallel attention, expert-parallel MoE) in the same run.
    BenchRanks(bench_ranks::BenchRanksArgs),
    /// List a router's prefill and decode workers with their state and load.
    Workers(workers::WorkersArgs),
    /// A cluster at a glance: router readiness, model, traffic, errors and every worker's
    /// state, load and pages; exits non-zero when the cluster cannot serve.
    Status(workers::WorkersArgs),
    /// Drain a worker gracefully: it takes no new requests, finishes those in flight,
    /// deregisters and exits.
    Drain(workers::DrainArgs),
    /// Check a live cluster before it takes traffic: repeatability, streaming, concurrency,
    /// long prompts, the single-process reference (--model), checksums, tools, bad input.
    Verify(verify::VerifyArgs),
    /// Run a local CPU cluster under constant streaming load and report errors, memory and
    /// pages (a benchmark: minutes).
    Soak(soak::SoakArgs),
    /// Measure page-transfer throughput over UCX and TCP between two processes.
    BenchTransfer(bench_transfer::BenchTransferArgs),
    /// Size a deployment from a checkpoint's config.json alone: weight bytes by class, state
    /// per token and per request, and what fits beside the weights in a GPU group.
    Plan(plan::PlanArgs),
}

/// Arguments of `pdctl up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Folder with pdserve-router, pdserve-prefill and pdserve-decode (default: pdctl's own).
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Number of prefill workers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub prefill: u16,
    /// Number of decode workers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub decode: u16,
    /// Router HTTP address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8000", value_name = "ADDR")]
    pub http_listen: SocketAddr,
    /// Check the cluster end to end, stop it, and exit (0 when everything answered).
    #[arg(long)]
    pub smoke: bool,
    /// Checkpoint to serve; default: the embedded default model, a tiny synthetic DeepSeek-V4
    /// checkpoint generated once into the cache folder.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Seconds to wait for the workers to load their models and serve (they load at once; a
    /// large checkpoint takes minutes). Their progress is printed while they load.
    #[arg(long, env = common::env::START_TIMEOUT, default_value_t = 600, value_name = "SECS")]
    pub start_timeout: u64,
    /// Ranks of each prefill worker, each holding `1/N` of the routed experts, with attention
    /// by requests (`--ep N --dp-attention` on the worker; CPU ranks here).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub prefill_ep: u32,
    /// Ranks of each decode worker, as `--prefill-ep`.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub decode_ep: u32,
    /// Attention tensor parallelism of each prefill worker (`--tp N` on the worker: every rank
    /// runs every request with `1/N` of the heads).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub prefill_tp: u32,
    /// Attention tensor parallelism of each decode worker, as `--prefill-tp`.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub decode_tp: u32,
    /// With `--prefill-tp`/`--decode-tp`: every routed expert sliced over each such worker's
    /// ranks (`--moe-tp` on the worker), instead of whole experts per rank (`--*-ep` equal to
    /// `--*-tp`) or every expert on every rank.
    #[arg(long)]
    pub moe_tp: bool,
}

impl UpArgs {
    /// Refuses flags that would change nothing: `--moe-tp` slices experts over a worker's
    /// tensor-parallel ranks, so it needs `--prefill-tp` or `--decode-tp` above 1.
    pub fn check(&self) -> Result<(), PdctlError> {
        if self.moe_tp && self.prefill_tp <= 1 && self.decode_tp <= 1 {
            return Err(PdctlError::Usage(
                "--moe-tp slices every expert over a worker's tensor-parallel ranks: give \
                 --prefill-tp or --decode-tp above 1"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// The group flags of a role's workers, from its `--*-tp` and `--*-ep` and `--moe-tp`.
    pub fn group_flags(tp: u32, ep: u32, moe_tp: bool) -> Vec<String> {
        let mut flags = Vec::new();
        if tp > 1 {
            flags.extend(["--tp".to_owned(), tp.to_string()]);
            if moe_tp {
                flags.push("--moe-tp".to_owned());
            }
        }
        if ep > 1 {
            flags.extend(["--ep".to_owned(), ep.to_string()]);
            if tp <= 1 {
                flags.push("--dp-attention".to_owned());
            }
        }
        flags
    }
}

/// Arguments of `pdctl health`.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// gRPC address (host:port) to probe with grpc.health.v1.
    #[arg(
        long,
        value_name = "ADDR",
        conflicts_with = "http",
        required_unless_present = "http"
    )]
    pub grpc: Option<SocketAddr>,
    /// Service name for the gRPC probe ("" is the whole process).
    #[arg(long, default_value = "")]
    pub service: String,
    /// HTTP address (host:port) whose /health to probe.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// The cluster's TLS files, to probe gRPC health of processes that use mutual TLS.
    #[command(flatten)]
    pub tls: common::internal_tls::TlsFlags,
}

/// Failures of pdctl commands.
#[derive(Debug, thiserror::Error)]
pub enum PdctlError {
    #[error("cannot start {bin}: {source}")]
    Spawn {
        bin: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} did not become ready: {reason}")]
    NotReady { what: String, reason: String },
    #[error("{what} is not healthy: {reason}")]
    Unhealthy { what: String, reason: String },
    #[error("{what} did not exit cleanly: {reason}")]
    Stop { what: String, reason: String },
    #[error("{0}")]
    Model(String),
    /// Flags that contradict each other or would change nothing.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Runs a parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    common::logging::init_stderr();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return common::cli::fail("pdctl", &e, common::cli::EXIT_RUNTIME),
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Up(args) => cluster::up(args).await,
            Command::Health(args) => health::probe(&args).await,
            Command::GenModel(args) => model_cmds::gen_model(&args),
            Command::Logits(args) => model_cmds::logits(&args),
            Command::BenchEngine(args) => bench_engine::run(&args),
            Command::BenchRanks(args) => bench_ranks::run(&args),
            Command::Generate(args) => generate::run(&args),
            Command::Workers(args) => workers::run(&args).await,
            Command::Status(args) => workers::status(&args).await,
            Command::Drain(args) => workers::drain(&args).await,
            Command::Verify(args) => verify::run(&args).await,
            Command::Soak(args) => soak::run(&args).await,
            Command::BenchTransfer(args) => bench_transfer::run(&args).await,
            Command::Plan(args) => plan::run(&args),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => common::cli::fail("pdctl", &e, common::cli::EXIT_RUNTIME),
    }
}

#[cfg(test)]
mod up_tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Up {
        #[command(flatten)]
        up: UpArgs,
    }

    fn args(flags: &[&str]) -> UpArgs {
        Up::try_parse_from(std::iter::once("up").chain(flags.iter().copied()))
            .expect("flags")
            .up
    }

    /// `--moe-tp` without a tensor-parallel role would change nothing: refused.
    #[test]
    fn moe_tp_needs_a_tensor_parallel_role() {
        let e = args(&["--moe-tp"]).check().expect_err("no tp");
        assert!(e.to_string().contains("--prefill-tp or --decode-tp"), "{e}");
        args(&["--moe-tp", "--decode-tp", "2"])
            .check()
            .expect("decode tp");
        args(&[]).check().expect("plain");
    }
}
