//! `pdctl gen-model` (synthetic checkpoints in the official layout) and `pdctl logits`
//! (reference f32 logits from the engine's CPU model).

use std::{io::Write, path::PathBuf};

use engine::{
    config::ExpertFormat,
    model::{Logits, Model},
    synth::{self, GenerateOptions, Preset},
};

use crate::PdctlError;

/// Arguments of `pdctl gen-model`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenModelArgs {
    /// Model size: `tiny` and `small` are fixed small models; `flash-shape` has
    /// DeepSeek-V4-Flash's real dimensions (hidden 4096, 64 heads of 512, vocab 129280, ...)
    /// truncated to `--layers` layers and `--routed-experts` routed experts, one shard per layer.
    #[arg(long, value_parser = ["tiny", "small", "flash-shape"], default_value = "tiny")]
    pub preset: String,
    /// Layers of `flash-shape` (1-43, the first N of V4-Flash's layer pattern; default 4).
    /// Refused for the other presets.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Routed experts per layer of `flash-shape` (6-256, top-6 routing; default 16). Refused
    /// for the other presets.
    #[arg(long, value_name = "E")]
    pub routed_experts: Option<usize>,
    /// Seed of the weights; the same seed gives identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage of the routed experts.
    #[arg(long, value_parser = ["bf16", "fp8", "mxfp4", "nvfp4"], default_value = "mxfp4")]
    pub experts: String,
    /// Output folder (created).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Do not copy the tokenizer from the setup cache.
    #[arg(long)]
    pub no_tokenizer: bool,
}

/// Arguments of `pdctl logits`.
#[derive(Debug, Clone, clap::Args)]
pub struct LogitsArgs {
    /// Checkpoint folder.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Comma-separated prompt token ids.
    #[arg(long, value_name = "IDS", value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Which positions to report.
    #[arg(long, value_parser = ["all", "last"], default_value = "last")]
    pub positions: String,
    /// Output JSON file (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

fn expert_format(name: &str) -> ExpertFormat {
    match name {
        "bf16" => ExpertFormat::Bf16,
        "fp8" => ExpertFormat::Fp8Block,
        "nvfp4" => ExpertFormat::Nvfp4,
        _ => ExpertFormat::Mxfp4,
    }
}

/// Runs `pdctl gen-model`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub fn gen_model(args: &GenModelArgs) -> Result<(), PdctlError> {
    // Validate the size before touching the tokenizer cache or the output folder.
    let preset = Preset::resolve(&args.preset, args.layers, args.routed_experts)
        .map_err(|e| PdctlError::Model(e.to_string()))?;
    let tokenizer_dir = if args.no_tokenizer {
        None
    } else {
        let path = common::assets::deepseek_v4_tokenizer()
            .map_err(|e| PdctlError::Model(e.to_string()))?;
        path.parent().map(std::path::Path::to_path_buf)
    };
    let files = synth::generate(&GenerateOptions {
        preset,
        seed: args.seed,
        experts: expert_format(&args.experts),
        out: args.out.clone(),
        tokenizer_dir,
    })
    .map_err(|e| PdctlError::Model(e.to_string()))?;
    for file in files {
        println!("{}", file.display());
    }
    Ok(())
}

/// Runs `pdctl logits`.
pub fn logits(args: &LogitsArgs) -> Result<(), PdctlError> {
    let model = Model::load(&args.model).map_err(|e| PdctlError::Model(e.to_string()))?;
    let mut state = model.new_state();
    let which = if args.positions == "all" {
        Logits::All
    } else {
        Logits::Last
    };
    let logits = model
        .forward(&mut state, &args.ids, which)
        .map_err(|e| PdctlError::Model(e.to_string()))?;
    let positions: Vec<usize> = match which {
        Logits::All => (0..args.ids.len()).collect(),
        _ => vec![args.ids.len() - 1],
    };
    let doc = serde_json::json!({
        "model": args.model.display().to_string(),
        "ids": args.ids,
        "positions": positions,
        "logits": logits,
    });
    let text = serde_json::to_string(&doc).map_err(|e| PdctlError::Model(e.to_string()))?;
    if args.out.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.write_all(b"\n")?;
    } else {
        std::fs::write(&args.out, text)?;
    }
    Ok(())
}
