//! The MoE feed-forward: sqrt-softplus scores, hash or top-k routing (the bias only selects),
//! normalised weights times the routed scaling factor, clamped SwiGLU experts plus the shared
//! expert.

pub use super::expert::{expert, expert_many, swiglu};
use crate::{
    backend::{Attached, BackendError, ExpertBatch},
    config::ModelConfig,
    tensor::{softplus, top_k},
    weights::MoeWeights,
};

/// The experts chosen for one token and their weights.
pub fn route(w: &MoeWeights, x: &[f32], token: u32, c: &ModelConfig) -> (Vec<usize>, Vec<f32>) {
    route_logits(w, &w.gate.apply(x), token, c)
}

/// Routing from the gate's logits for one token: the chosen experts in slot order and their
/// weights.
pub fn route_logits(
    w: &MoeWeights,
    logits: &[f32],
    token: u32,
    c: &ModelConfig,
) -> (Vec<usize>, Vec<f32>) {
    route_scores(
        logits,
        w.bias.as_deref(),
        w.tid2eid.as_deref(),
        token,
        (c.experts_per_token, c.routed_scaling_factor),
    )
}

/// [`route_logits`] from the routing's parts: the selection `bias` (top-k layers) or the hash
/// `table` (`[vocab, k]`, taking precedence), `k` experts a token, weights times `scaling`.
pub fn route_scores(
    logits: &[f32],
    bias: Option<&[f32]>,
    table: Option<&[u32]>,
    token: u32,
    (k, scaling): (usize, f32),
) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&l| softplus(l).sqrt()).collect();
    let chosen: Vec<usize> = match (table, bias) {
        (Some(table), _) => {
            let row = token as usize * k;
            table[row..row + k].iter().map(|&e| e as usize).collect()
        }
        (None, Some(bias)) => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            top_k(&biased, k)
        }
        (None, None) => top_k(&scores, k),
    };
    let picked: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
    let sum: f32 = picked.iter().sum::<f32>() + 1e-20;
    let weights = picked.iter().map(|s| s / sum * scaling).collect();
    (chosen, weights)
}

/// The MoE output for one token.
pub fn forward(w: &MoeWeights, x: &[f32], token: u32, c: &ModelConfig) -> Vec<f32> {
    let (chosen, weights) = route(w, x, token, c);
    let mut out = vec![0.0f32; x.len()];
    for (&e, &weight) in chosen.iter().zip(&weights) {
        let y = expert(&w.experts[e], x, c.swiglu_limit);
        for (o, v) in out.iter_mut().zip(&y) {
            *o += v * weight;
        }
    }
    let shared = expert(&w.shared, x, c.swiglu_limit);
    for (o, v) in out.iter_mut().zip(&shared) {
        *o += v;
    }
    out
}

/// Where a layer's routed experts run besides the CPU reference: a backend that runs them
/// (with this layer's index), or the ranks of an expert-parallel group (which takes
/// precedence: each rank's share runs where that rank computes).
#[derive(Debug, Clone, Copy, Default)]
pub struct Routed<'a> {
    pub backend: Option<(&'a Attached, usize)>,
    pub expert_parallel: Option<&'a crate::parallel::expert::ExpertParallel>,
    /// Every rank of the expert group holds the same tokens (tensor-parallel attention): each
    /// product is computed on one rank only and the outputs are gathered.
    pub replicated_tokens: bool,
    /// Every expert sliced over the ranks (which hold the same tokens): each rank computes its
    /// slice of every pair and the partials are summed in rank order. Takes precedence.
    pub sliced: Option<&'a crate::parallel::sliced::SlicedExperts>,
}

/// The MoE outputs for many tokens at once, expert-major: each expert's weights are read once
/// for all the tokens routed to it (the weights of all experts do not fit in cache, so the
/// token-major order spends its time fetching them). Every token's result is bit-identical to
/// [`forward`]: the same `expert` call per (token, expert) and the same order of additions.
///
/// With a backend that runs the routed experts (`routed`: the backend and this layer's index),
/// the (token, expert) pairs go to it in one call; with one that runs the shared expert
/// (`shared_on`), all tokens' shared expert does. The weighted sum stays here.
pub fn forward_many(
    w: &MoeWeights,
    xs: &[Vec<f32>],
    tokens: &[u32],
    c: &ModelConfig,
    routed: Routed<'_>,
    shared_on: Option<(&Attached, usize)>,
) -> Result<Vec<Vec<f32>>, BackendError> {
    use rayon::prelude::*;
    let routes: Vec<(Vec<usize>, Vec<f32>)> = w
        .gate
        .apply_many(xs)
        .par_iter()
        .zip(tokens)
        .map(|(logits, &t)| route_logits(w, logits, t, c))
        .collect();
    let mut per_token: Vec<Vec<Option<Vec<f32>>>> = routes
        .iter()
        .map(|(chosen, _)| vec![None; chosen.len()])
        .collect();
    // Every (token, expert) pair in token and slot order, for the ranks or the backend.
    let pairs: Vec<(usize, usize)> = routes
        .iter()
        .enumerate()
        .flat_map(|(t, (chosen, _))| chosen.iter().map(move |&e| (t, e)))
        .collect();
    let elsewhere = if let Some(sliced) = routed.sliced {
        Some(
            sliced
                .routed(&w.experts, c.swiglu_limit, xs, &pairs)
                .map_err(|e| crate::model::expert_failure(&e))?,
        )
    } else if let Some(ep) = routed.expert_parallel {
        Some(
            if routed.replicated_tokens {
                ep.routed_replicated(&w.experts, c.swiglu_limit, xs, &pairs)
            } else {
                ep.routed(&w.experts, c.swiglu_limit, xs, &pairs)
            }
            .map_err(|e| crate::model::expert_failure(&e))?,
        )
    } else if let Some((backend, layer)) = routed.backend {
        let width = xs.first().map_or(0, Vec::len);
        Some(backend.routed_experts(
            ExpertBatch {
                layer,
                xs,
                pairs: &pairs,
            },
            width,
        )?)
    } else {
        None
    };
    if let Some(ys) = elsewhere {
        let mut ys = ys.into_iter();
        for slots in &mut per_token {
            for slot in slots.iter_mut() {
                *slot = ys.next();
            }
        }
    } else {
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); w.experts.len()];
        for (t, (chosen, _)) in routes.iter().enumerate() {
            for (slot, &e) in chosen.iter().enumerate() {
                by_expert[e].push((t, slot));
            }
        }
        let computed: Vec<Vec<(usize, usize, Vec<f32>)>> = by_expert
            .par_iter()
            .enumerate()
            .map(|(e, list)| {
                let inputs: Vec<&[f32]> = list.iter().map(|&(t, _)| xs[t].as_slice()).collect();
                let ys = expert_many(&w.experts[e], &inputs, c.swiglu_limit);
                list.iter()
                    .zip(ys)
                    .map(|(&(t, slot), y)| (t, slot, y))
                    .collect()
            })
            .collect();
        for (t, slot, y) in computed.into_iter().flatten() {
            per_token[t][slot] = Some(y);
        }
    }
    let shared = match shared_on {
        Some((backend, layer)) if !xs.is_empty() => {
            backend.shared_expert(layer, xs, xs[0].len())?
        }
        _ => {
            let all: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
            expert_many(&w.shared, &all, c.swiglu_limit)
        }
    };
    Ok(per_token
        .into_par_iter()
        .zip(routes.par_iter())
        .zip(shared.par_iter())
        .map(|((ys, (_, weights)), shared)| {
            let mut out = vec![0.0f32; shared.len()];
            for (y, &weight) in ys.iter().zip(weights) {
                if let Some(y) = y {
                    for (o, v) in out.iter_mut().zip(y) {
                        *o += v * weight;
                    }
                }
            }
            for (o, v) in out.iter_mut().zip(shared) {
                *o += v;
            }
            out
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::silu;

    /// The row-at-a-time activation equals the element-at-a-time definition bit for bit, at
    /// lengths around the vector width, with values past the limit and NaN (NaN in `up` gives
    /// NaN out; a NaN gate is clamped by `min`, as the definition's `min` does).
    #[test]
    fn swiglu_matches_the_elementwise_definition() {
        let limit = 10.0;
        for n in [0usize, 1, 7, 8, 9, 33, 128] {
            let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 1.7).sin() * 14.0).collect();
            let mut up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.9).cos() * 12.0).collect();
            if n > 2 {
                up[n / 2] = f32::NAN;
            }
            let mut out = vec![0.0f32; n];
            swiglu(&gate, &up, limit, &mut out);
            for i in 0..n {
                let expected = silu(gate[i].min(limit)) * up[i].clamp(-limit, limit);
                assert!(
                    crate::tensor::same_value(out[i], expected),
                    "n {n} at {i}: {} vs {expected}",
                    out[i]
                );
            }
            if n > 2 {
                assert!(out[n / 2].is_nan());
            }
        }
    }
}
