//! The cost of structured outputs per decode step, as `pdctl bench-engine` prints it: the
//! token table built from the checkpoint's `tokenizer.json` (or the cached V4 tokenizer), then
//! grammars of the kinds requests use, each driven over random logits while the time of every
//! step's mask is recorded.

use std::{path::Path, time::Instant};

use engine::{
    grammar::TokenTable,
    sampling::{Grammar, OutputConstraint, Sampler, SamplingParams, StopConditions},
    synth::Rng,
};
use serde_json::json;

use crate::PdctlError;

/// Mask time per step of one grammar.
#[derive(Debug, Clone)]
pub struct MaskCost {
    pub grammar: &'static str,
    pub compile_ms: f64,
    pub steps: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

fn grammars() -> Vec<(&'static str, Grammar)> {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "format": "email"},
            "level": {"type": "string", "enum": ["low", "medium", "high"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
            "owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                      "required": ["id"]}
        },
        "required": ["name", "email", "level", "tags", "owner"]
    });
    vec![
        (
            "json_schema (5 keys, nested)",
            Grammar::JsonSchema(schema.to_string()),
        ),
        ("json_object", Grammar::JsonObject),
        (
            "regex [A-Za-z ,]{1,200}",
            Grammar::Regex("[A-Za-z ,]{1,200}".to_owned()),
        ),
    ]
}

/// Runs each grammar for up to `steps` sampled tokens (restarting when it completes).
pub fn measure(
    dir: &Path,
    vocab_size: usize,
    eos: &[u32],
    steps: usize,
) -> Result<(f64, Vec<MaskCost>), PdctlError> {
    let err = |e: &dyn std::fmt::Display| PdctlError::Model(e.to_string());
    let own = dir.join("tokenizer.json");
    let path = if own.is_file() {
        own
    } else {
        common::assets::deepseek_v4_tokenizer().map_err(|e| err(&e))?
    };
    let text = std::fs::read(&path)?;
    let started = Instant::now();
    let table = TokenTable::from_tokenizer_json(&text, vocab_size, eos).map_err(|e| err(&e))?;
    let table_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut rng = Rng::for_tensor(7, "mask-bench");
    let mut out = Vec::new();
    for (name, grammar) in grammars() {
        let constraint = OutputConstraint {
            grammar,
            start_after_token: None,
            whitespace_flexible: false,
        };
        let mut times: Vec<f64> = Vec::with_capacity(steps);
        let mut compile_ms = 0.0;
        let mut compiles = 0;
        let mut logits = vec![0.0f32; vocab_size];
        while times.len() < steps {
            let started = Instant::now();
            let mut c = table.compile(&constraint).map_err(|e| err(&e))?;
            compile_ms += started.elapsed().as_secs_f64() * 1e3;
            compiles += 1;
            let params = SamplingParams {
                temperature: 1.0,
                seed: Some(compiles),
                ..SamplingParams::default()
            };
            let stop = StopConditions {
                max_tokens: 400,
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: false,
                eos_token_ids: eos.to_vec(),
            };
            let mut sampler =
                Sampler::new(params, stop, &[0], vocab_size, compiles).map_err(|e| err(&e))?;
            while times.len() < steps {
                for l in &mut logits {
                    *l = (rng.uniform() - 0.5) * 16.0;
                }
                let started = Instant::now();
                c.mask(&mut logits).map_err(|e| err(&e))?;
                times.push(started.elapsed().as_secs_f64() * 1e6);
                let token = sampler.sample(&logits).map_err(|e| err(&e))?.token;
                c.consume_sampled(token).map_err(|e| err(&e))?;
                if c.is_complete() || sampler.finish().is_some() {
                    break;
                }
            }
        }
        times.sort_by(f64::total_cmp);
        let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
        out.push(MaskCost {
            grammar: name,
            compile_ms: compile_ms / f64::from(u32::try_from(compiles).unwrap_or(u32::MAX)),
            steps: times.len(),
            mean_us: times.iter().sum::<f64>() / times.len() as f64,
            p50_us: at(0.5),
            p99_us: at(0.99),
            max_us: times.last().copied().unwrap_or(0.0),
        });
    }
    Ok((table_ms, out))
}
