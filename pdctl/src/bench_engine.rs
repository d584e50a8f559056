//! `pdctl bench-engine`: throughput of the CPU engine (prefill tokens/s, decode tokens/s at
//! several batch sizes), bytes of request state per token per layer kind, the drift of FP8
//! K=V storage against f32, the per-step cost of structured-output masks, and optionally `transformers` timed on the same checkpoint in the
//! same run (the ratio is what the engine is judged by).

use std::{path::PathBuf, process::Command, time::Instant};

use engine::{
    config::ExpertFormat,
    grammar::TokenTableSource,
    model::{Logits, Model},
    paged::{
        layout::{KvStorage, StateLayout},
        store::PagedStore,
    },
    sampling::{Grammar, OutputConstraint, SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
    synth::{self, GenerateOptions, Preset, Rng},
};

use crate::PdctlError;

/// Arguments of `pdctl bench-engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchEngineArgs {
    /// Checkpoint folder; default: a generated `small` checkpoint with MXFP4 experts.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Decode steps per request in the decode measurements.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: u32,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Python with torch + transformers (tools/golden/setup-venv.sh) to time transformers on
    /// the same checkpoint in this run.
    #[arg(long, value_name = "PYTHON")]
    pub transformers_python: Option<PathBuf>,
    /// Timed runs of prefill and of batch-1 decode (each side, engine and transformers); the
    /// fastest is reported, which keeps a noisy neighbour from deciding the ratio.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Skip the FP8 and bf16 K=V drift measurements.
    #[arg(long)]
    pub no_kv_drift: bool,
    /// Masked decode steps per grammar in the structured-output cost measurement.
    #[arg(long, default_value_t = 300)]
    pub mask_steps: usize,
}

fn err(e: &dyn std::fmt::Display) -> PdctlError {
    PdctlError::Model(e.to_string())
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        id,
        prompt,
        sampling: SamplingParams::default(),
        stop: StopConditions {
            max_tokens,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            eos_token_ids: Vec::new(),
        },
    }
}

/// Decode tokens/s with `batch` requests decoding together (prefill excluded), each under
/// `constrained`'s grammar when given.
fn decode_rate(
    model: Model,
    batch: usize,
    steps: u32,
    rng: &mut Rng,
    constrained: Option<(&TokenTableSource, &OutputConstraint)>,
) -> Result<(f64, Model), PdctlError> {
    let vocab = model.config.vocab_size;
    let config = EngineConfig {
        max_running: batch.max(1),
        num_pages: 4096,
        max_batch_tokens: 64 * batch.max(1),
        prefix_cache: false,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, config, "bench").map_err(|e| err(&e))?;
    if let Some((table, _)) = constrained {
        engine.set_token_table(table.clone());
    }
    for id in 0..batch {
        let mut req = request(id as u64, random_tokens(rng, 64, vocab), steps + 1);
        req.sampling.constraint = constrained.map(|(_, c)| c.clone());
        engine.add(req).map_err(|e| err(&e))?;
    }
    let rate = timed_decode(&mut engine, batch);
    Ok((rate, engine.into_model()))
}

/// Steps `engine` (holding `batch` requests) until every request has its first token, untimed,
/// then to the end: decode tokens per second of the timed part.
pub(crate) fn timed_decode(engine: &mut Engine, batch: usize) -> f64 {
    let mut first = 0;
    while first < batch {
        first += engine
            .step()
            .iter()
            .filter(|e| matches!(e, Event::Token { index: 0, .. }))
            .count();
    }
    let started = Instant::now();
    let mut tokens = 0usize;
    while !engine.is_idle() {
        tokens += engine
            .step()
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
    }
    tokens as f64 / started.elapsed().as_secs_f64()
}

/// Mean KL(f32 ‖ kv) of next-token distributions and top-1 agreement over a fixed prompt set:
/// the first half of each prompt is prefilled, the rest decoded token by token through a page
/// store of `kv` rows (the rounding model rounds each K=V row as it computes it, as an engine
/// with that `kv_cache_dtype` does).
fn kv_drift(model: &Model, kv: KvStorage) -> Result<Option<(f64, f64, usize)>, PdctlError> {
    let c = &model.config;
    let mut rounding = model.replica();
    rounding.set_kv_storage(kv);
    let Ok(layout) = StateLayout::new(c, 64, kv, "drift") else {
        return Ok(None);
    };
    let mut store = PagedStore::new(c, layout, 64, 1);
    let mut rng = Rng::for_tensor(7, "kv-drift");
    let (mut kl_sum, mut agree, mut n) = (0.0f64, 0usize, 0usize);
    for _ in 0..6 {
        let prompt = random_tokens(&mut rng, 192, c.vocab_size);
        let mut reference = model.new_state();
        let mut seq = store.open().map_err(|e| err(&e))?;
        let mut prompt_done = 0usize;
        for (i, chunk) in [&prompt[..96]]
            .into_iter()
            .chain(prompt[96..].chunks(1))
            .enumerate()
        {
            let want = model
                .forward(&mut reference, chunk, Logits::Last)
                .map_err(|e| err(&e))?;
            store
                .reserve(&mut seq, prompt_done + chunk.len())
                .map_err(|e| err(&e))?;
            let mut state = store.gather(&seq).map_err(|e| err(&e))?;
            let got = rounding
                .forward(&mut state, chunk, Logits::Last)
                .map_err(|e| err(&e))?;
            store.scatter(&mut seq, &state).map_err(|e| err(&e))?;
            prompt_done += chunk.len();
            if i == 0 {
                continue;
            }
            let (p, q) = (log_softmax(&want[0]), log_softmax(&got[0]));
            kl_sum += p
                .iter()
                .zip(&q)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>();
            agree += usize::from(argmax(&want[0]) == argmax(&got[0]));
            n += 1;
        }
        store.release(seq).map_err(|e| err(&e))?;
    }
    Ok(Some((kl_sum / n as f64, agree as f64 / n as f64, n)))
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = x.iter().map(|&v| f64::from(v - max).exp()).sum();
    x.iter().map(|&v| f64::from(v - max) - sum.ln()).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}

/// Runs `golden.py time` and returns (prefill tok/s, decode tok/s) parsed from its output.
fn transformers_rates(
    python: &PathBuf,
    dir: &std::path::Path,
    prompt: usize,
    steps: u32,
    repeat: u32,
) -> Result<(f64, f64), PdctlError> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/golden/golden.py");
    let out = Command::new(python)
        .arg(&script)
        .args(["time", "--model"])
        .arg(dir)
        .args([
            "--prompt-len",
            &prompt.to_string(),
            "--decode-steps",
            &steps.to_string(),
            "--repeat",
            &repeat.to_string(),
        ])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = |label: &str| {
        text.lines()
            .find(|l| l.starts_with(label))
            .and_then(|l| l.split("= ").nth(1))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|r| r.parse::<f64>().ok())
    };
    match (rate("prefill:"), rate("decode:")) {
        (Some(p), Some(d)) => Ok((p, d)),
        _ => Err(err(&format!(
            "transformers timing failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        ))),
    }
}

/// Runs `pdctl bench-engine` and prints tables.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub fn run(args: &BenchEngineArgs) -> Result<(), PdctlError> {
    let tmp;
    let dir = if let Some(dir) = &args.model {
        dir.clone()
    } else {
        tmp = tempfile::tempdir()?;
        // With the tokenizer (as `gen-model` writes it): the structured-output rows need it.
        let tokenizer = common::assets::deepseek_v4_tokenizer().map_err(|e| err(&e))?;
        synth::generate(&GenerateOptions {
            preset: Preset::Small,
            seed: 0,
            experts: ExpertFormat::Mxfp4,
            out: tmp.path().to_path_buf(),
            tokenizer_dir: tokenizer.parent().map(std::path::Path::to_path_buf),
        })
        .map_err(|e| err(&e))?;
        tmp.path().to_path_buf()
    };
    let mut model = Model::load(&dir).map_err(|e| err(&e))?;
    let mut rng = Rng::for_tensor(1, "bench");
    let threads = rayon::current_num_threads();
    println!("model: {} ({threads} threads)", dir.display());

    let prompt = random_tokens(&mut rng, args.prompt_len.max(1), model.config.vocab_size);
    let mut warm = model.new_state();
    model
        .forward(&mut warm, &prompt[..prompt.len().min(8)], Logits::Last)
        .map_err(|e| err(&e))?;
    let (mut prefill, mut single_decode) = (0.0f64, 0.0f64);
    for _ in 0..args.repeat {
        let mut state = model.new_state();
        let started = Instant::now();
        let mut last = model
            .forward(&mut state, &prompt, Logits::Last)
            .map_err(|e| err(&e))?;
        prefill = prefill.max(prompt.len() as f64 / started.elapsed().as_secs_f64());
        let started = Instant::now();
        for _ in 0..args.decode_steps {
            let next = argmax(&last.pop().unwrap_or_default()) as u32;
            last = model
                .forward(&mut state, &[next], Logits::Last)
                .map_err(|e| err(&e))?;
        }
        single_decode =
            single_decode.max(f64::from(args.decode_steps) / started.elapsed().as_secs_f64());
    }

    println!(
        "\n{:<28} {:>12}   (best of {} runs)",
        "measurement", "tokens/s", args.repeat
    );
    println!(
        "{:<28} {:>12.1}",
        format!("prefill ({} tokens)", prompt.len()),
        prefill
    );
    println!(
        "{:<28} {:>12.1}",
        format!("decode after prefill (b=1)"),
        single_decode
    );
    for &batch in &args.batches {
        let (rate, back) = decode_rate(model, batch, args.decode_steps, &mut rng, None)?;
        model = back;
        println!("{:<28} {:>12.1}", format!("decode, batch {batch}"), rate);
    }
    // The largest batch again with every request under a grammar, beside a run without: what
    // the masks (computed side by side) cost a step.
    if let Some(&batch) = args.batches.iter().max() {
        let table =
            TokenTableSource::from_dir(&dir, model.config.vocab_size, &model.config.eos_token_ids);
        table.get().map_err(|e| err(&e))?;
        let regex = OutputConstraint {
            grammar: Grammar::Regex("[A-Za-z ,]+".to_owned()),
            start_after_token: None,
            whitespace_flexible: false,
        };
        let (free, back) = decode_rate(model, batch, args.decode_steps, &mut rng, None)?;
        let (masked, back) = decode_rate(
            back,
            batch,
            args.decode_steps,
            &mut rng,
            Some((&table, &regex)),
        )?;
        model = back;
        println!(
            "{:<28} {:>12.1}   ({:.2}x of {free:.1} without, same run)",
            format!("decode, batch {batch}, regex"),
            masked,
            masked / free
        );
    }
    let per_token = model
        .weights
        .decode_bytes_per_token(model.config.experts_per_token) as f64;
    let achieved = per_token * single_decode / 1e9;
    let probe = crate::bench_roofline::read_bandwidth_gbs(5);
    println!(
        "\nweights held {:.1} MB; a decode token reads {:.1} MB of them",
        model.weights.held_bytes() as f64 / 1e6,
        per_token / 1e6
    );
    println!(
        "decode b=1: {achieved:.2} GB/s of weights; read-bandwidth probe {probe:.2} GB/s \
         ({threads} threads, same run); {:.0}% of the roofline",
        100.0 * achieved / probe
    );
    if let Some(python) = &args.transformers_python {
        let (tp, td) =
            transformers_rates(python, &dir, prompt.len(), args.decode_steps, args.repeat)?;
        println!("{:<28} {:>12.1}", "transformers prefill", tp);
        println!("{:<28} {:>12.1}", "transformers decode (b=1)", td);
        println!(
            "ratio engine/transformers: prefill {:.2}x, decode {:.2}x",
            prefill / tp,
            single_decode / td
        );
    }

    println!("\nstate bytes per token (all layers), page size 64");
    print!("{:<26}", "region");
    for kv in KvStorage::ALL {
        print!(" {:>12}", format!("{} k=v", kv.name()));
    }
    println!();
    let layouts = KvStorage::ALL
        .into_iter()
        .map(|kv| StateLayout::new(&model.config, 64, kv, "b").map_err(|e| err(&e)))
        .collect::<Result<Vec<_>, _>>()?;
    let per_token: Vec<_> = layouts.iter().map(StateLayout::bytes_per_token).collect();
    for (kind, _) in &per_token[0] {
        print!("{:<26}", format!("{kind:?}"));
        for rows in &per_token {
            let bytes = rows
                .iter()
                .find(|(k, _)| k == kind)
                .map_or(0.0, |(_, b)| *b);
            print!(" {bytes:>12.1}");
        }
        println!();
    }
    print!("{:<26}", "slot (per request)");
    for layout in &layouts {
        print!(" {:>12}", layout.slot_bytes);
    }
    println!();

    for kv in [KvStorage::Fp8, KvStorage::Bf16] {
        if !args.no_kv_drift
            && let Some((kl, top1, n)) = kv_drift(&model, kv)?
        {
            println!(
                "\n{} K=V storage vs f32 ({n} decode positions): mean KL {kl:.3e} nats, top-1 agreement {:.1}%",
                kv.name(),
                top1 * 100.0
            );
        }
    }

    let (table_ms, costs) = crate::bench_mask::measure(
        &dir,
        model.config.vocab_size,
        &model.config.eos_token_ids,
        args.mask_steps,
    )?;
    println!(
        "\nstructured outputs: token table of {} tokens built in {table_ms:.0} ms (once per process)",
        model.config.vocab_size
    );
    println!(
        "{:<30} {:>10} {:>7} {:>10} {:>9} {:>9} {:>9}",
        "grammar", "compile ms", "steps", "mask mean", "p50", "p99", "max"
    );
    for c in costs {
        println!(
            "{:<30} {:>10.2} {:>7} {:>8.1}us {:>7.1}us {:>7.1}us {:>7.1}us",
            c.grammar, c.compile_ms, c.steps, c.mean_us, c.p50_us, c.p99_us, c.max_us
        );
    }
    Ok(())
}
