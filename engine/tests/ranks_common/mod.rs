//! What the tests of tensor-parallel ranks share: a synthetic checkpoint, requests of awkward
//! prompt lengths, an engine configuration whose chunks end inside pages and mix prompts with
//! decodes, every token event's output, and weights spoiled outside a rank's share (so a rank
//! that read outside it would show).

use engine::{
    config::ExpertFormat,
    sampling::{SamplingParams, StopConditions},
    scheduler::{EngineConfig, Event, GenerationRequest},
    synth::{GenerateOptions, Preset, Rng, generate},
    tensor::Weight,
};

pub fn checkpoint(preset: Preset, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(preset, seed, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    dir
}

/// Five requests with log-probabilities (prompts of 5, 70, 1, 150 and 33 tokens): greedy ones,
/// or with `sampled` every other one sampled with its own seed.
pub fn requests(rng: &mut Rng, sampled: bool) -> Vec<GenerationRequest> {
    [5usize, 70, 1, 150, 33]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerationRequest {
            id: i as u64 + 1,
            prompt: (0..len)
                .map(|_| (rng.next_u64() % 129_280) as u32)
                .collect(),
            sampling: SamplingParams {
                temperature: if sampled && i % 2 == 1 { 0.8 } else { 0.0 },
                seed: sampled.then_some(i as u64 * 11),
                logprobs: true,
                top_logprobs: 2,
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: if sampled { 3 } else { 4 } + (i as u32 % 3),
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                eos_token_ids: vec![1],
            },
        })
        .collect()
}

pub fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        // Chunks end inside pages and prompts share steps with decodes.
        max_batch_tokens: 40,
        ..EngineConfig::default()
    }
}

/// A token event's request, token and log-probabilities (its own, then the alternatives').
pub type Output = (u64, u32, Vec<f32>);

/// Every token event's output, in order; a failed request fails the test.
pub fn outputs(events: &[Event]) -> Vec<Output> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, sampled, .. } => Some((
                *id,
                sampled.token,
                sampled
                    .logprob
                    .into_iter()
                    .chain(sampled.top_logprobs.iter().map(|(_, l)| *l))
                    .collect(),
            )),
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
            _ => None,
        })
        .collect()
}

/// Outputs with their log-probabilities as bits, for exact comparison.
pub fn bits(out: &[Output]) -> Vec<(u64, u32, Vec<u32>)> {
    out.iter()
        .map(|(id, t, l)| (*id, *t, l.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

/// `w` with rows outside `keep` scaled by 3 (wrong values where a rank must not read).
pub fn spoil_outside(w: &Weight, keep: std::ops::Range<usize>) -> Weight {
    let mut m = w.to_f32();
    for r in (0..w.rows).filter(|r| !keep.contains(r)) {
        for v in &mut m[r * w.cols..(r + 1) * w.cols] {
            *v *= 3.0;
        }
    }
    Weight::f32(w.rows, w.cols, m).unwrap()
}
