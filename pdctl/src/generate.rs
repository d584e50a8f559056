//! `pdctl generate`: single-process generation with the engine's CPU model — the colocated
//! reference a cluster's answers are compared against.

use std::path::PathBuf;

use engine::{
    model::Model,
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
};

use crate::PdctlError;

/// Arguments of `pdctl generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Checkpoint folder (with tokenizer.json for --prompt).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Prompt text (tokenized with the checkpoint's tokenizer, no chat template).
    #[arg(long, conflicts_with = "ids", required_unless_present = "ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print a JSON object (ids, text, finish reason, usage) instead of plain text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `pdctl generate`.
#[expect(clippy::print_stdout, reason = "CLI output")]
pub fn run(args: &GenerateArgs) -> Result<(), PdctlError> {
    let err = |e: &dyn std::fmt::Display| PdctlError::Model(e.to_string());
    let tokenizer_path = args.model.join("tokenizer.json");
    let tokenizer = if args.prompt.is_some() || tokenizer_path.is_file() {
        Some(
            tokenizers::Tokenizer::from_file(&tokenizer_path)
                .map_err(|e| err(&format!("{}: {e}", tokenizer_path.display())))?,
        )
    } else {
        None
    };
    let prompt: Vec<u32> = match (&args.prompt, &args.ids, &tokenizer) {
        (Some(text), _, Some(tok)) => tok
            .encode(text.as_str(), false)
            .map_err(|e| err(&e))?
            .get_ids()
            .to_vec(),
        (_, Some(ids), _) => ids.clone(),
        _ => return Err(err(&"give --prompt or --ids")),
    };
    let model = Model::load(&args.model).map_err(|e| err(&e))?;
    let eos = model.config.eos_token_ids.clone();
    let mut engine = Engine::new(model, EngineConfig::default(), "local").map_err(|e| err(&e))?;
    engine
        .add(GenerationRequest {
            id: 0,
            prompt: prompt.clone(),
            sampling: SamplingParams {
                temperature: args.temperature,
                top_p: args.top_p,
                top_k: args.top_k,
                seed: args.seed,
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: args.max_tokens,
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: args.ignore_eos,
                eos_token_ids: eos,
            },
        })
        .map_err(|e| err(&e))?;
    let mut ids = Vec::new();
    let mut finish = None;
    for event in engine.run_to_completion() {
        match event {
            Event::Token { sampled, .. } => ids.push(sampled.token),
            Event::Finished { reason, usage, .. } => finish = Some((reason, usage)),
            Event::Failed { error, .. } => return Err(err(&error)),
            Event::Cancelled { .. } => {}
            Event::Prefilled { .. } | Event::StatePart { .. } => {
                return Err(err(&"unexpected prefill handoff"));
            }
            Event::PromptLogprobs { .. } => {
                return Err(err(&"prompt log-probabilities that were not asked for"));
            }
        }
    }
    let text = match &tokenizer {
        Some(tok) => tok.decode(&ids, false).map_err(|e| err(&e))?,
        None => String::new(),
    };
    if args.json {
        let (reason, usage) = finish.unwrap_or_default_parts();
        let doc = serde_json::json!({
            "prompt_ids": prompt,
            "ids": ids,
            "text": text,
            "finish_reason": reason,
            "usage": {"prompt_tokens": usage.0, "cached_tokens": usage.1, "completion_tokens": usage.2},
        });
        println!("{doc}");
    } else if tokenizer.is_some() {
        println!("{text}");
    } else {
        println!(
            "{}",
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        );
    }
    Ok(())
}

trait FinishParts {
    fn unwrap_or_default_parts(self) -> (&'static str, (usize, usize, usize));
}

impl FinishParts for Option<(engine::sampling::FinishReason, engine::scheduler::Usage)> {
    fn unwrap_or_default_parts(self) -> (&'static str, (usize, usize, usize)) {
        match self {
            Some((reason, u)) => (
                match reason {
                    engine::sampling::FinishReason::Stop => "stop",
                    engine::sampling::FinishReason::Length => "length",
                },
                (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            ),
            None => ("unknown", (0, 0, 0)),
        }
    }
}
