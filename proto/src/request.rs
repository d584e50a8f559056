//! The vocabulary of a request, defined once for every crate: its sampling parameters, its
//! stop conditions, what it produces (sampled tokens, the finish reason, token usage) and the
//! keys of its prompt's blocks; with the one conversion of each to and from its `v1` wire
//! form. The engine computes with these types, the router fills them from HTTP requests and the
//! workers read them off the wire.

use sha2::{Digest, Sha256};

use crate::v1;

/// Per-request sampling parameters. `Default` is greedy with every filter and penalty disabled.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; accepted range [0, 2].
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables (as does any k >= vocabulary).
    pub top_k: u32,
    /// Drop tokens below `min_p` times the best token's probability; [0, 1], 0 disables.
    pub min_p: f32,
    /// The request's seed; `None` uses the engine-supplied default seed.
    pub seed: Option<u64>,
    /// Subtracted once from every token already generated; [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a generated token; [-2, 2].
    pub frequency_penalty: f32,
    /// Divides positive / multiplies negative logits of seen tokens; (0, 2], 1 disables.
    pub repetition_penalty: f32,
    /// (token, bias) pairs added to the logits; each bias in [-100, 100]. A token listed twice
    /// gets both biases added, literally as the list says.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report the chosen token's log-probability (and `top_logprobs` alternatives).
    pub logprobs: bool,
    /// How many best alternatives to report when `logprobs` is set; [0, 20]. Ignored otherwise.
    pub top_logprobs: u32,
    /// A grammar the output must follow; `None`: free text.
    pub constraint: Option<OutputConstraint>,
    /// Report every prompt token's log-probability (after the first) under the raw model
    /// distribution, with this many best alternatives; [0, 20]. `None`: not asked for.
    pub prompt_logprobs: Option<u32>,
}

/// A structured-output constraint: the grammar and where in the output it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputConstraint {
    pub grammar: Grammar,
    /// The grammar applies from the token after this one (thinking mode: the end of the
    /// reasoning section); `None`: from the first token.
    pub start_after_token: Option<u32>,
    /// JSON only: free whitespace between JSON tokens instead of the compact form.
    pub whitespace_flexible: bool,
}

/// The grammar of an [`OutputConstraint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// A JSON Schema document, as JSON text.
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar in llguidance's dialect.
    Lark(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
            constraint: None,
            prompt_logprobs: None,
        }
    }
}

/// When a request stops generating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopConditions {
    /// Tokens to generate at most; >= 1.
    pub max_tokens: u32,
    /// Stop and eos ids are masked until this many tokens exist, so at least this many precede
    /// a stop; [0, max_tokens]. If masking would leave no token, a sampled stop id does not
    /// end the request while fewer than this many tokens exist.
    pub min_tokens: u32,
    /// Ids that end the request (in addition to eos). Ids outside the vocabulary can never be
    /// sampled, so they are accepted and have no effect.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past eos ids (stop_token_ids still stop).
    pub ignore_eos: bool,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The last token is a stop or eos id.
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// The token's log-probability under the processed logits (before temperature), when
    /// `logprobs` was requested.
    pub logprob: Option<f32>,
    /// Up to `top_logprobs` best (token, logprob) pairs, best first, ties by lower id. Masked
    /// tokens have no probability and are never listed, so fewer appear when fewer remain.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Chained block key: hash of the previous key and the block's tokens.
pub type BlockKey = [u8; 32];

/// Keys of the full blocks of `tokens`.
pub fn block_keys(tokens: &[u32], page_size: usize) -> Vec<BlockKey> {
    let mut keys = Vec::with_capacity(tokens.len() / page_size);
    let mut prev: BlockKey = [0; 32];
    for block in tokens.chunks_exact(page_size) {
        let mut h = Sha256::new();
        h.update(prev);
        for t in block {
            h.update(t.to_le_bytes());
        }
        prev = h.finalize().into();
        keys.push(prev);
    }
    keys
}

pub fn sampling_to_wire(p: &SamplingParams) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        // A token listed twice has its biases summed, as the engine applies them.
        logit_bias: p
            .logit_bias
            .iter()
            .fold(std::collections::HashMap::new(), |mut m, &(t, b)| {
                *m.entry(t).or_insert(0.0) += b;
                m
            }),
        top_logprobs: p.top_logprobs,
        return_logprobs: p.logprobs,
        constraint: p.constraint.as_ref().map(constraint_to_wire),
        prompt_logprobs: p.prompt_logprobs,
    }
}

fn constraint_to_wire(c: &OutputConstraint) -> v1::OutputConstraint {
    use v1::output_constraint::Grammar as W;
    v1::OutputConstraint {
        grammar: Some(match &c.grammar {
            Grammar::JsonSchema(s) => W::JsonSchema(s.clone()),
            Grammar::JsonObject => W::JsonObject(true),
            Grammar::Regex(s) => W::Regex(s.clone()),
            Grammar::Lark(s) => W::Lark(s.clone()),
        }),
        start_after_token: c.start_after_token,
        whitespace_flexible: c.whitespace_flexible,
    }
}

/// A constraint without a grammar (or `json_object: false`) is malformed: `None`, which the
/// worker refuses rather than generating free text.
fn constraint_from_wire(c: &v1::OutputConstraint) -> Option<OutputConstraint> {
    use v1::output_constraint::Grammar as W;
    let grammar = match c.grammar.as_ref()? {
        W::JsonSchema(s) => Grammar::JsonSchema(s.clone()),
        W::JsonObject(true) => Grammar::JsonObject,
        W::JsonObject(false) => return None,
        W::Regex(s) => Grammar::Regex(s.clone()),
        W::Lark(s) => Grammar::Lark(s.clone()),
    };
    Some(OutputConstraint {
        grammar,
        start_after_token: c.start_after_token,
        whitespace_flexible: c.whitespace_flexible,
    })
}

/// A wire `OutputConstraint` with no grammar: refused, never read as free text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the output constraint names no grammar")]
pub struct MalformedConstraint;

pub fn sampling_from_wire(p: &v1::SamplingParams) -> Result<SamplingParams, MalformedConstraint> {
    let mut logit_bias: Vec<(u32, f32)> = p.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    let constraint = match &p.constraint {
        None => None,
        Some(c) => Some(constraint_from_wire(c).ok_or(MalformedConstraint)?),
    };
    Ok(SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        logit_bias,
        logprobs: p.return_logprobs,
        top_logprobs: p.top_logprobs,
        constraint,
        prompt_logprobs: p.prompt_logprobs,
    })
}

pub fn stop_to_wire(s: &StopConditions) -> v1::StopConditions {
    v1::StopConditions {
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
    }
}

/// The wire form carries no eos ids: the worker supplies its model's.
pub fn stop_from_wire(s: &v1::StopConditions, eos_token_ids: &[u32]) -> StopConditions {
    StopConditions {
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
        eos_token_ids: eos_token_ids.to_vec(),
    }
}

pub fn token_to_wire(s: &Sampled) -> v1::GeneratedToken {
    v1::GeneratedToken {
        token_id: s.token,
        logprob: s.logprob,
        top_logprobs: s
            .top_logprobs
            .iter()
            .map(|&(token_id, logprob)| v1::TokenLogprob { token_id, logprob })
            .collect(),
    }
}

pub fn token_from_wire(t: &v1::GeneratedToken) -> Sampled {
    Sampled {
        token: t.token_id,
        logprob: t.logprob,
        top_logprobs: t
            .top_logprobs
            .iter()
            .map(|l| (l.token_id, l.logprob))
            .collect(),
    }
}

pub fn finish_to_wire(reason: FinishReason) -> v1::FinishReason {
    match reason {
        FinishReason::Stop => v1::FinishReason::Stop,
        FinishReason::Length => v1::FinishReason::Length,
    }
}

pub fn usage_to_wire(u: &Usage) -> v1::Usage {
    let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
    v1::Usage {
        prompt_tokens: n(u.prompt_tokens),
        cached_prompt_tokens: n(u.cached_tokens),
        completion_tokens: n(u.completion_tokens),
    }
}

pub fn usage_from_wire(u: &v1::Usage) -> Usage {
    Usage {
        prompt_tokens: u.prompt_tokens as usize,
        cached_tokens: u.cached_prompt_tokens as usize,
        completion_tokens: u.completion_tokens as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let p = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 5,
            min_p: 0.1,
            seed: Some(9),
            presence_penalty: 0.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.2,
            logit_bias: vec![(3, 1.0), (9, -2.0)],
            logprobs: true,
            top_logprobs: 4,
            constraint: None,
            prompt_logprobs: Some(3),
        };
        assert_eq!(sampling_from_wire(&sampling_to_wire(&p)), Ok(p.clone()));
        for grammar in [
            Grammar::JsonSchema(r#"{"type":"integer"}"#.to_owned()),
            Grammar::JsonObject,
            Grammar::Regex("a+".to_owned()),
            Grammar::Lark("start: \"x\"".to_owned()),
        ] {
            let constrained = SamplingParams {
                constraint: Some(OutputConstraint {
                    grammar,
                    start_after_token: Some(7),
                    whitespace_flexible: true,
                }),
                ..p.clone()
            };
            assert_eq!(
                sampling_from_wire(&sampling_to_wire(&constrained)),
                Ok(constrained)
            );
        }
        let mut empty = sampling_to_wire(&p);
        empty.constraint = Some(v1::OutputConstraint::default());
        assert_eq!(sampling_from_wire(&empty), Err(MalformedConstraint));
        empty.constraint = Some(v1::OutputConstraint {
            grammar: Some(v1::output_constraint::Grammar::JsonObject(false)),
            ..Default::default()
        });
        assert_eq!(sampling_from_wire(&empty), Err(MalformedConstraint));
        let s = StopConditions {
            max_tokens: 7,
            min_tokens: 2,
            stop_token_ids: vec![4],
            ignore_eos: true,
            eos_token_ids: vec![1],
        };
        assert_eq!(stop_from_wire(&stop_to_wire(&s), &[1]), s);
        let t = Sampled {
            token: 5,
            logprob: Some(-0.5),
            top_logprobs: vec![(5, -0.5), (6, -1.0)],
        };
        assert_eq!(token_from_wire(&token_to_wire(&t)), t);
        let u = Usage {
            prompt_tokens: 3,
            cached_tokens: 1,
            completion_tokens: 2,
        };
        assert_eq!(usage_from_wire(&usage_to_wire(&u)), u);
    }
}
