//! `pdctl bench-engine`: prefill and decode throughput of the CPU reference model.

use std::{path::PathBuf, time::Instant};

use engine::{
    config::ExpertFormat,
    model::{Logits, Model},
    synth::{self, GenerateOptions, Preset, Rng},
};

use crate::PdctlError;

/// Arguments of `pdctl bench-engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchEngineArgs {
    /// Checkpoint folder; default: a generated `small` checkpoint with MXFP4 experts.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt tokens to prefill.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
}

/// Runs `pdctl bench-engine` and prints a table.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub fn run(args: &BenchEngineArgs) -> Result<(), PdctlError> {
    let err = |e: &dyn std::fmt::Display| PdctlError::Model(e.to_string());
    let tmp;
    let dir = if let Some(dir) = &args.model {
        dir.clone()
    } else {
        tmp = tempfile::tempdir()?;
        synth::generate(&GenerateOptions {
            preset: Preset::Small,
            seed: 0,
            experts: ExpertFormat::Mxfp4,
            out: tmp.path().to_path_buf(),
            tokenizer_dir: None,
        })
        .map_err(|e| err(&e))?;
        tmp.path().to_path_buf()
    };
    let model = Model::load(&dir).map_err(|e| err(&e))?;
    let mut rng = Rng::for_tensor(1, "bench");
    let vocab = model.config.vocab_size as u64;
    let prompt: Vec<u32> = (0..args.prompt_len.max(1))
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();

    // Warm-up (page in weights).
    let mut warm = model.new_state();
    model
        .forward(&mut warm, &prompt[..prompt.len().min(8)], Logits::Last)
        .map_err(|e| err(&e))?;

    let mut state = model.new_state();
    let started = Instant::now();
    let mut logits = model
        .forward(&mut state, &prompt, Logits::Last)
        .map_err(|e| err(&e))?;
    let prefill = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for _ in 0..args.decode_steps {
        let last = logits.pop().unwrap_or_default();
        let next = last
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                if v > b.1 { (i, v) } else { b }
            })
            .0 as u32;
        logits = model
            .forward(&mut state, &[next], Logits::Last)
            .map_err(|e| err(&e))?;
    }
    let decode = started.elapsed().as_secs_f64();
    println!("model: {}", dir.display());
    println!(
        "{:<10} {:>8} {:>10} {:>10}",
        "phase", "tokens", "seconds", "tok/s"
    );
    println!(
        "{:<10} {:>8} {:>10.3} {:>10.1}",
        "prefill",
        prompt.len(),
        prefill,
        prompt.len() as f64 / prefill
    );
    if args.decode_steps > 0 {
        println!(
            "{:<10} {:>8} {:>10.3} {:>10.1}",
            "decode",
            args.decode_steps,
            decode,
            args.decode_steps as f64 / decode
        );
    }
    Ok(())
}
