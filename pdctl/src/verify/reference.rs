//! The reference check of `pdctl verify`: the cluster's greedy answers against this process's
//! single-process engine on the same checkpoint and the same prompt token ids (rendered by the
//! router's `/tokenize`), every token's logprob bit for bit.

use std::path::Path;

use engine::{
    model::Model,
    sampling::{FinishReason, SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest},
};
use serde_json::json;

use super::{answer::Client, chat_body, error::VerifyError, prompt_text};

/// Prompts: short, past the sliding window, and long enough for several compression blocks
/// and the indexer's top-k.
const PROMPTS: [(u64, usize); 3] = [(11, 3), (12, 90), (13, 700)];

/// What the local engine generated for one prompt.
struct Local {
    logprobs: Vec<f32>,
    finish: Option<FinishReason>,
}

/// Compares the cluster with the local engine; `Ok` describes what was compared.
pub(super) async fn compare(client: &Client, dir: &Path, n: u32) -> Result<String, VerifyError> {
    let mut prompts = Vec::new();
    for (seed, words) in PROMPTS {
        let body = chat_body(client.model(), &prompt_text(seed, words), n);
        let rendered = client
            .post_json(
                "/tokenize",
                &json!({"model": client.model(), "messages": body["messages"],
                        "reasoning_effort": "none"}),
            )
            .await?;
        let ids: Vec<u32> = rendered["tokens"]
            .as_array()
            .ok_or_else(|| VerifyError::NoTokens {
                reply: rendered.clone(),
            })?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or(VerifyError::NonIntegerToken)?;
        prompts.push((body, ids));
    }
    let dir = dir.to_path_buf();
    let inputs: Vec<Vec<u32>> = prompts.iter().map(|(_, ids)| ids.clone()).collect();
    let local = tokio::task::spawn_blocking(move || run_local(&dir, &inputs, n))
        .await
        .map_err(VerifyError::EngineTask)??;
    let mut compared = 0usize;
    for ((body, ids), want) in prompts.iter().zip(local) {
        let got = client.chat(body).await?;
        if got.prompt_tokens != ids.len() as u64 {
            return Err(VerifyError::Mismatch(format!(
                "prompt of {} tokens counted as {} by the cluster",
                ids.len(),
                got.prompt_tokens
            )));
        }
        // The router prints each f32 logprob exactly (shortest round-trip form).
        let cluster: Vec<f32> = got.logprobs.iter().map(|(_, l)| *l as f32).collect();
        if let Some(i) = cluster
            .iter()
            .zip(&want.logprobs)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err(VerifyError::Mismatch(format!(
                "prompt of {} tokens: token {i} has logprob {} in the cluster, {} in the \
                 single-process engine (a worker with a fast kernel differs within its bound, \
                 not bit for bit: verify with the exact kernels)",
                ids.len(),
                cluster[i],
                want.logprobs[i]
            )));
        }
        if cluster.len() != want.logprobs.len() {
            return Err(VerifyError::Mismatch(format!(
                "prompt of {} tokens: the cluster generated {} tokens, the engine {}",
                ids.len(),
                cluster.len(),
                want.logprobs.len()
            )));
        }
        let finish = match want.finish {
            Some(FinishReason::Length) => "length",
            Some(_) => "stop",
            None => "",
        };
        if got.finish != finish {
            return Err(VerifyError::Mismatch(format!(
                "prompt of {} tokens: finish {:?} vs the engine's {finish:?}",
                ids.len(),
                got.finish
            )));
        }
        compared += cluster.len();
    }
    let lengths: Vec<usize> = prompts.iter().map(|(_, ids)| ids.len()).collect();
    Ok(format!(
        "prompts of {lengths:?} tokens, {compared} tokens' logprobs bit-identical"
    ))
}

/// Greedy generation of every prompt in one engine (answers do not depend on the batch).
fn run_local(dir: &Path, prompts: &[Vec<u32>], n: u32) -> Result<Vec<Local>, VerifyError> {
    let model = Model::load(dir).map_err(|source| VerifyError::ModelLoad {
        dir: dir.to_path_buf(),
        source,
    })?;
    let eos = model.config.eos_token_ids.clone();
    let mut engine = Engine::new(model, EngineConfig::default(), "verify")?;
    for (id, prompt) in prompts.iter().enumerate() {
        engine.add(GenerationRequest {
            id: id as u64,
            prompt: prompt.clone(),
            sampling: SamplingParams {
                logprobs: true,
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: n,
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: false,
                eos_token_ids: eos.clone(),
            },
        })?;
    }
    let mut out: Vec<Local> = (0..prompts.len())
        .map(|_| Local {
            logprobs: Vec::new(),
            finish: None,
        })
        .collect();
    for event in engine.run_to_completion() {
        match event {
            Event::Token { id, sampled, .. } => {
                out[id as usize]
                    .logprobs
                    .push(sampled.logprob.unwrap_or(f32::NAN));
            }
            Event::Finished { id, reason, .. } => out[id as usize].finish = Some(reason),
            Event::Failed { error, .. } => return Err(VerifyError::EngineFailed(error)),
            _ => {}
        }
    }
    Ok(out)
}
