//! Conversions between the engine's request types and their `proto` wire forms (the router
//! sends these to prefill and decode workers).

use proto::v1;

use crate::{
    sampling::{FinishReason, Sampled, SamplingParams, StopConditions},
    scheduler::Usage,
};

pub fn sampling_to_proto(p: &SamplingParams) -> v1::SamplingParams {
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
    }
}

pub fn sampling_from_proto(p: &v1::SamplingParams) -> SamplingParams {
    let mut logit_bias: Vec<(u32, f32)> = p.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    SamplingParams {
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
    }
}

pub fn stop_to_proto(s: &StopConditions) -> v1::StopConditions {
    v1::StopConditions {
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
    }
}

/// The wire form carries no eos ids: the worker supplies its model's.
pub fn stop_from_proto(s: &v1::StopConditions, eos_token_ids: &[u32]) -> StopConditions {
    StopConditions {
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
        eos_token_ids: eos_token_ids.to_vec(),
    }
}

pub fn token_to_proto(s: &Sampled) -> v1::GeneratedToken {
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

pub fn token_from_proto(t: &v1::GeneratedToken) -> Sampled {
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

pub fn finish_to_proto(reason: FinishReason) -> v1::FinishReason {
    match reason {
        FinishReason::Stop => v1::FinishReason::Stop,
        FinishReason::Length => v1::FinishReason::Length,
    }
}

pub fn usage_to_proto(u: &Usage) -> v1::Usage {
    let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
    v1::Usage {
        prompt_tokens: n(u.prompt_tokens),
        cached_prompt_tokens: n(u.cached_tokens),
        completion_tokens: n(u.completion_tokens),
    }
}

pub fn usage_from_proto(u: &v1::Usage) -> Usage {
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
        };
        assert_eq!(sampling_from_proto(&sampling_to_proto(&p)), p);
        let s = StopConditions {
            max_tokens: 7,
            min_tokens: 2,
            stop_token_ids: vec![4],
            ignore_eos: true,
            eos_token_ids: vec![1],
        };
        assert_eq!(stop_from_proto(&stop_to_proto(&s), &[1]), s);
        let t = Sampled {
            token: 5,
            logprob: Some(-0.5),
            top_logprobs: vec![(5, -0.5), (6, -1.0)],
        };
        assert_eq!(token_from_proto(&token_to_proto(&t)), t);
        let u = Usage {
            prompt_tokens: 3,
            cached_tokens: 1,
            completion_tokens: 2,
        };
        assert_eq!(usage_from_proto(&usage_to_proto(&u)), u);
    }
}
