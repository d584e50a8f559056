//! One routed or shared expert of the MoE feed-forward: a clamped SwiGLU
//! (`w2 · (silu(min(w1·x, L)) ⊙ clamp(w3·x, -L, L))`), for one token or many. The MoE layer
//! ([`super::moe`]) and the expert-parallel and sliced groups (`crate::parallel`) compute
//! their experts with it.

use crate::{tensor::exp_in_place, weights::ExpertWeights};

/// One expert: `w2 · (silu(min(w1·x, L)) ⊙ clamp(w3·x, -L, L))`.
pub fn expert(w: &ExpertWeights, x: &[f32], limit: f32) -> Vec<f32> {
    let gate = w.w1.apply(x);
    let up = w.w3.apply(x);
    let mut act = vec![0.0f32; gate.len()];
    swiglu(&gate, &up, limit, &mut act);
    w.w2.apply(&act)
}

/// `out = silu(min(gate, L)) * clamp(up, -L, L)` element-wise, with `silu(x) = x * (1 / (1 +
/// exp(-x)))`: the exponentials of the whole row first (eight at a time where the CPU can),
/// then the same operations in the same order as one element at a time.
pub fn swiglu(gate: &[f32], up: &[f32], limit: f32, out: &mut [f32]) {
    for (o, g) in out.iter_mut().zip(gate) {
        *o = -g.min(limit);
    }
    exp_in_place(out);
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        let x = g.min(limit);
        *o = x * (1.0 / (1.0 + *o)) * u.clamp(-limit, limit);
    }
}

/// [`expert`] for several tokens at once: bit-identical per token, each weight row read once per
/// block of tokens.
pub fn expert_many(w: &ExpertWeights, xs: &[&[f32]], limit: f32) -> Vec<Vec<f32>> {
    let width = w.w1.rows;
    let gates = w.w1.apply_many_flat(xs);
    let ups = w.w3.apply_many_flat(xs);
    let mut acts = vec![0.0f32; gates.len()];
    if width > 0 {
        for ((act, gate), up) in acts
            .chunks_exact_mut(width)
            .zip(gates.chunks_exact(width))
            .zip(ups.chunks_exact(width))
        {
            swiglu(gate, up, limit, act);
        }
    }
    let rows: Vec<&[f32]> = if width > 0 {
        acts.chunks_exact(width).collect()
    } else {
        vec![&[]; xs.len()]
    };
    w.w2.apply_many(&rows)
}
