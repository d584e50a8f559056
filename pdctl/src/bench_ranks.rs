//! `pdctl bench-ranks`: decode tokens/s of one engine against N CPU ranks of one worker
//! (data-parallel attention: each rank its share of the requests; expert-parallel MoE: each
//! rank `1/N` of the routed experts), on the same checkpoint and requests, in the same run.
//! The ranks step in lockstep as `engine::parallel::ranks` runs them; each has its own compute
//! pool of `--threads-per-rank` threads. With `--tp`, tensor-parallel attention too (every rank
//! every request, the heads and experts split); with `--moe-tp`, tensor-parallel attention with
//! every expert sliced over the ranks.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use engine::{
    model::Model,
    parallel::{
        collective::{Collective, InProcessGroup},
        expert::ExpertParallel,
        sliced::SlicedExperts,
        tensor::TensorParallel,
    },
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::Rng,
};

use crate::PdctlError;

/// Arguments of `pdctl bench-ranks`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchRanksArgs {
    /// Checkpoint folder.
    #[arg(long, value_name = "DIR")]
    pub model: std::path::PathBuf,
    /// Rank counts to compare with one engine (each must divide the routed experts).
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub ranks: Vec<usize>,
    /// Requests decoding together (split evenly over the ranks).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Decode steps timed per request.
    #[arg(long, default_value_t = 8)]
    pub steps: u32,
    /// Prompt tokens per request (prefilled before the timing starts).
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Compute threads of each rank (default: the machine's cores divided by the ranks).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Also time tensor-parallel attention over the same rank counts (every rank runs every
    /// request with its share of the heads; the experts split over the same ranks).
    #[arg(long)]
    pub tp: bool,
    /// Also time tensor-parallel attention with every expert sliced over the ranks (`--tp N
    /// --moe-tp` on a worker).
    #[arg(long)]
    pub moe_tp: bool,
}

/// How the ranks share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Each rank its share of the requests, experts split (DP-attention + EP).
    DataParallel,
    /// Every rank every request, heads and experts split (TP + EP).
    TensorParallel,
    /// Every rank every request, heads split and every expert sliced (TP + MoE TP).
    SlicedExperts,
}

fn err(e: &dyn std::fmt::Display) -> PdctlError {
    PdctlError::Model(e.to_string())
}

fn requests(args: &BenchRanksArgs, vocab: usize) -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(5, "bench-ranks");
    (0..args.batch as u64)
        .map(|id| GenerationRequest {
            id,
            prompt: (0..args.prompt_len)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect(),
            sampling: SamplingParams::default(),
            stop: StopConditions {
                max_tokens: args.steps + 1,
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                eos_token_ids: Vec::new(),
            },
        })
        .collect()
}

fn config(batch: usize) -> EngineConfig {
    EngineConfig {
        max_running: batch.max(1),
        num_pages: 1024,
        prefix_cache: false,
        ..EngineConfig::default()
    }
}

/// How many of `events` are first tokens (requests whose prefill ended).
fn first_tokens(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, Event::Token { index: 0, .. }))
        .count()
}

/// One engine: decode tokens/s of the whole batch.
fn one_engine(args: &BenchRanksArgs) -> Result<f64, PdctlError> {
    let model = Model::load(&args.model).map_err(|e| err(&e))?;
    let vocab = model.config.vocab_size;
    let mut engine = Engine::new(model, config(args.batch), "bench").map_err(|e| err(&e))?;
    for r in requests(args, vocab) {
        engine.add(r).map_err(|e| err(&e))?;
    }
    Ok(crate::bench_engine::timed_decode(&mut engine, args.batch))
}

/// `ranks` ranks in lockstep: decode tokens/s of the whole batch, all ranks together.
fn ranked(
    args: &BenchRanksArgs,
    ranks: usize,
    threads: usize,
    layout: Layout,
) -> Result<f64, PdctlError> {
    let timeout = Duration::from_secs(600);
    let experts_group = InProcessGroup::new(ranks, timeout);
    let control_group = InProcessGroup::new(ranks, timeout);
    let replicated = layout != Layout::DataParallel;
    let mut heads_group = replicated.then(|| InProcessGroup::new(ranks, timeout).into_iter());
    let mut slices_group =
        (layout == Layout::SlicedExperts).then(|| InProcessGroup::new(ranks, timeout).into_iter());
    let results: Vec<Result<(usize, f64), PdctlError>> = std::thread::scope(|s| {
        let handles: Vec<_> = experts_group
            .into_iter()
            .zip(control_group)
            .map(|(rank, mut control)| {
                let heads = heads_group.as_mut().and_then(Iterator::next);
                let slices = slices_group.as_mut().and_then(Iterator::next);
                s.spawn(move || -> Result<(usize, f64), PdctlError> {
                    let me = rank.rank();
                    let mut model = Model::load(&args.model).map_err(|e| err(&e))?;
                    let (vocab, experts) = (model.config.vocab_size, model.config.n_routed_experts);
                    if let Some(slices) = slices {
                        let inter = model.config.moe_intermediate_size;
                        let sliced =
                            SlicedExperts::new(Box::new(slices), inter).map_err(|e| err(&e))?;
                        model.set_sliced_experts(Arc::new(sliced));
                    } else {
                        let ep =
                            ExpertParallel::new(Box::new(rank), experts).map_err(|e| err(&e))?;
                        model.set_expert_parallel(Arc::new(ep));
                    }
                    if let Some(heads) = heads {
                        let tp = TensorParallel::new(Box::new(heads), &model.config)
                            .map_err(|e| err(&e))?;
                        model.set_tensor_parallel(Arc::new(tp));
                    }
                    let mut engine =
                        Engine::new(model, config(args.batch), "bench").map_err(|e| err(&e))?;
                    // Under TP every rank runs every request; rank 0's tokens are counted.
                    let counted = !replicated || me == 0;
                    let mine: Vec<GenerationRequest> = requests(args, vocab)
                        .into_iter()
                        .filter(|r| replicated || r.id as usize % ranks == me)
                        .collect();
                    let expected = mine.len();
                    for r in mine {
                        engine.add(r).map_err(|e| err(&e))?;
                    }
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .map_err(|e| err(&e))?;
                    // Prefill (untimed) until every rank's requests have their first token.
                    let mut started = 0;
                    loop {
                        let done = f32::from(u8::from(started >= expected));
                        let all = control.all_gather(vec![done]).map_err(|e| err(&e))?;
                        if all.iter().all(|v| v[0] != 0.0) {
                            break;
                        }
                        started += first_tokens(&pool.install(|| engine.step()));
                    }
                    let clock = Instant::now();
                    let mut tokens = 0usize;
                    loop {
                        let busy = f32::from(u8::from(!engine.is_idle()));
                        let all = control.all_gather(vec![busy]).map_err(|e| err(&e))?;
                        if all.iter().all(|v| v[0] == 0.0) {
                            break;
                        }
                        tokens += pool
                            .install(|| engine.step())
                            .iter()
                            .filter(|e| matches!(e, Event::Token { .. }))
                            .count();
                    }
                    Ok((
                        if counted { tokens } else { 0 },
                        clock.elapsed().as_secs_f64(),
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(PdctlError::Model("a rank panicked".into())))
            })
            .collect()
    });
    let mut tokens = 0usize;
    let mut seconds = 0f64;
    for r in results {
        let (t, s) = r?;
        tokens += t;
        seconds = seconds.max(s);
    }
    Ok(tokens as f64 / seconds)
}

/// Runs `pdctl bench-ranks`.
#[expect(clippy::print_stdout, reason = "benchmark output")]
pub fn run(args: &BenchRanksArgs) -> Result<(), PdctlError> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let one = one_engine(args)?;
    println!(
        "model: {} ({cores} cores); decode, {} requests, {} steps each",
        args.model.display(),
        args.batch,
        args.steps
    );
    println!("{:<44} {:>12}", "layout", "tokens/s");
    println!("{:<44} {one:>12.1}", "one engine");
    let mut layouts = vec![(Layout::DataParallel, "DP-attention + EP")];
    if args.tp {
        layouts.push((Layout::TensorParallel, "TP + EP"));
    }
    if args.moe_tp {
        layouts.push((Layout::SlicedExperts, "TP + MoE TP"));
    }
    for &ranks in &args.ranks {
        let threads = args.threads_per_rank.unwrap_or((cores / ranks).max(1));
        for &(layout, name) in &layouts {
            let rate = ranked(args, ranks, threads, layout)?;
            println!(
                "{:<44} {rate:>12.1}   ({:.2}x of one engine, same run)",
                format!("{ranks} ranks, {name}, {threads} thread(s) each"),
                rate / one
            );
        }
    }
    Ok(())
}
