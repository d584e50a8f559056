//! One layer's attention for a chunk of consecutive tokens: low-rank Q with its norm and the
//! weightless per-head norm, the shared K=V head, RoPE on the trailing dims, attention over the
//! sliding window plus the compressed rows (all visible ones for HCA, the indexer's top-k for
//! CSA) with a per-head sink in the denominator, inverse RoPE on the output, and the grouped
//! low-rank output projection's first half (`wo_a`; the model applies `wo_b` to the whole
//! layer's tokens at once, after tensor-parallel ranks gathered their groups).

use rayon::prelude::*;

use super::compressor::{self, CompressorState, PendingState};
use crate::{
    backend::{AttendBatch, BackendError, LayerDevice, LinearId, Op},
    config::{Attention, ModelConfig},
    paged::{codec, layout::RowFormat},
    parallel::tensor::TensorParallel,
    rope::Rope,
    tensor::{axpy_many, dots, exp, exp_in_place, rms_norm, rms_norm_unweighted, top_k},
    weights::AttentionWeights,
};

/// A layer's attention state for one sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttentionState {
    /// K=V rows of the most recent positions, oldest first (`head_dim` each): at least the last
    /// `sliding_window - 1`, plus every row of the last chunk.
    pub window: Vec<f32>,
    /// The attention compressor (CSA and HCA layers).
    pub compressor: Option<CompressorState>,
    /// The indexer's compressor (CSA layers).
    pub indexer: Option<CompressorState>,
    /// When non-zero, a forward call records the slot part of both compressors after every
    /// position that is a multiple of this (a prefix-cache block boundary) into `boundaries`.
    pub boundary_every: usize,
    /// (sequence length, compressor, indexer) at each boundary the last call passed.
    pub boundaries: Vec<Boundary>,
}

/// The slot part of a layer's compressors at a block boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// Tokens processed at the boundary.
    pub len: usize,
    pub compressor: Option<PendingState>,
    pub indexer: Option<PendingState>,
}

impl AttentionState {
    pub fn new(kind: Attention) -> Self {
        Self {
            window: Vec::new(),
            compressor: (kind != Attention::Sliding).then(CompressorState::default),
            indexer: matches!(kind, Attention::Csa { .. }).then(CompressorState::default),
            boundary_every: 0,
            boundaries: Vec::new(),
        }
    }
}

/// The model-wide context of a layer's attention: the two RoPE tables and how K=V rows are
/// stored.
#[derive(Debug, Clone, Copy)]
pub struct Ropes<'a> {
    /// Sliding-only layers.
    pub main: &'a Rope,
    /// Compressed layers, their compressors and the indexer.
    pub compress: &'a Rope,
    /// The stored form of K=V rows (window, CSA and HCA rows): each is rounded to it as it is
    /// computed, before anything reads it, so a row's value does not depend on where a chunk
    /// ended (and storing it loses nothing more).
    pub kv_rows: RowFormat,
}

/// Per-token projections the attention step needs.
struct Projected {
    q: Vec<f32>,
    q_residual: Vec<f32>,
}

/// The grouped low-rank outputs (`wo_a`'s, `o_lora_rank` per group: the rows `wo_b` takes) for
/// tokens at positions `start..start+xs.len()`; `xs` are the sublayer inputs (after
/// `attn_norm`). Under tensor parallelism (`shard`) only this rank's heads and groups are
/// computed. The linears and the softmax over the keys run on `device`'s backend when it runs
/// them (`Op::AttentionLinears`, `Op::AttentionCore`); everything else stays here. A backend
/// failure leaves `state` partly advanced: discard it.
#[expect(
    clippy::too_many_arguments,
    reason = "the layer's weights, state, inputs and the model-wide context"
)]
pub fn forward(
    w: &AttentionWeights,
    kind: Attention,
    state: &mut AttentionState,
    xs: &[Vec<f32>],
    start: usize,
    c: &ModelConfig,
    ropes: &Ropes<'_>,
    device: LayerDevice<'_>,
    shard: Option<&TensorParallel>,
) -> Result<Vec<Vec<f32>>, BackendError> {
    let compress_rope = ropes.compress;
    let rope = if kind == Attention::Sliding {
        ropes.main
    } else {
        compress_rope
    };
    let hd = c.head_dim;
    let heads = shard.map_or(0..c.num_heads, TensorParallel::heads);
    let groups = shard.map_or(0..c.o_groups, TensorParallel::groups);
    let mut rows = std::mem::take(&mut state.window);
    // Only the last `sliding_window - 1` earlier rows can be attended to.
    let keep = (c.sliding_window - 1) * hd;
    rows.drain(..rows.len().saturating_sub(keep));
    let window_start = start - rows.len() / hd;
    // Projections of the whole chunk at once (each weight row is read once per block of
    // tokens; every output is still the same dot product as for a lone token).
    let mut q_residuals = device.linear(LinearId::QA, &w.wq_a, xs)?;
    q_residuals
        .par_iter_mut()
        .for_each(|q| rms_norm(q, &w.q_norm, c.rms_norm_eps));
    let mut qs = device.linear_rows(
        LinearId::QB,
        &w.wq_b,
        heads.start * hd..heads.end * hd,
        &q_residuals,
    )?;
    qs.par_iter_mut().enumerate().for_each(|(t, q)| {
        let rotation = rope.at(start + t);
        for head in q.chunks_exact_mut(hd) {
            rms_norm_unweighted(head, c.rms_norm_eps);
            rotation.apply(head, false);
        }
    });
    let mut kvs = device.linear(LinearId::Kv, &w.wkv, xs)?;
    kvs.par_iter_mut().enumerate().for_each(|(t, kv)| {
        rms_norm(kv, &w.kv_norm, c.rms_norm_eps);
        rope.apply(kv, start + t, false);
        codec::round(ropes.kv_rows, kv);
    });
    for kv in &kvs {
        rows.extend_from_slice(kv);
    }
    let projected: Vec<Projected> = qs
        .into_iter()
        .zip(q_residuals)
        .map(|(q, q_residual)| Projected { q, q_residual })
        .collect();

    // Block boundaries strictly inside this call (the state at the call's end is the state
    // itself): after token t when start + t + 1 is a multiple of `boundary_every`.
    let every = state.boundary_every;
    let at_boundary =
        |t: usize| every > 0 && (start + t + 1).is_multiple_of(every) && t + 1 < xs.len();
    // The attention compressor and the indexer's run side by side (separate states).
    let boundaries = &mut state.boundaries;
    let (main, index) = rayon::join(
        || -> Result<_, BackendError> {
            // Compressed rows visible to each token: after token p, exactly (p+1)/ratio
            // windows are closed, and a row is visible to p iff its window closed at or
            // before p.
            let mut visible = vec![0usize; xs.len()];
            let mut found = Vec::new();
            if let (Some(cw), Some(cs)) = (&w.compressor, state.compressor.as_mut()) {
                let ids = (LinearId::CompressorKv, LinearId::CompressorGate);
                let inputs = compressor::project_many(cw, xs, ids, device)?;
                compressor::push_many(
                    cw,
                    cs,
                    inputs,
                    c.rms_norm_eps,
                    (compress_rope, ropes.kv_rows),
                    |t, rows, cs| {
                        visible[t] = rows;
                        if at_boundary(t) {
                            found.push(Boundary {
                                len: start + t + 1,
                                compressor: Some(cs.pending()),
                                indexer: None,
                            });
                        }
                    },
                );
            }
            Ok((visible, found))
        },
        || -> Result<_, BackendError> {
            let mut found = Vec::new();
            if let (Some(iw), Some(is)) = (&w.indexer, state.indexer.as_mut()) {
                let ids = (
                    LinearId::IndexerCompressorKv,
                    LinearId::IndexerCompressorGate,
                );
                let inputs = compressor::project_many(&iw.compressor, xs, ids, device)?;
                compressor::push_many(
                    &iw.compressor,
                    is,
                    inputs,
                    c.rms_norm_eps,
                    // The indexer's keys are stored as computed (f32).
                    (compress_rope, RowFormat::F32),
                    |t, _, is| {
                        if at_boundary(t) {
                            found.push(is.pending());
                        }
                    },
                );
            }
            Ok(found)
        },
    );
    let (visible, mut found) = main?;
    let index = index?;
    // A boundary's indexer part exists only where the attention compressor recorded one (CSA
    // layers have both).
    for (b, pending) in found.iter_mut().zip(index) {
        b.indexer = Some(pending);
    }
    *boundaries = found;

    // The indexer's query and head weights of every token (CSA layers).
    let (index_qs, index_weights) = match &w.indexer {
        Some(iw) => {
            let residuals: Vec<&[f32]> =
                projected.iter().map(|p| p.q_residual.as_slice()).collect();
            (
                device.linear(LinearId::IndexerQB, &iw.wq_b, &residuals)?,
                device.linear(LinearId::IndexerWeights, &iw.weights_proj, xs)?,
            )
        }
        None => (Vec::new(), Vec::new()),
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let state_ref = &*state;
    let rows_ref = &rows;
    // Each token's keys, in the order the reference sums them: its window rows, then the
    // compressed rows it sees (all visible ones, or the indexer's choice). A token whose
    // indexer scores hold a NaN has no defined choice: its attention output is NaN.
    let (key_lists, poisoned): (Vec<Vec<Key>>, Vec<bool>) = xs
        .par_iter()
        .enumerate()
        .map(|(t, _)| {
            let pos = start + t;
            let first = (pos + 1).saturating_sub(c.sliding_window).max(window_start);
            let mut keys: Vec<Key> = (first..=pos)
                .map(|p| Key::Window(p - window_start))
                .collect();
            let mut poisoned = false;
            if w.compressor.is_some() && state_ref.compressor.is_some() {
                let chosen: Option<Vec<usize>> = match (kind, &w.indexer, &state_ref.indexer) {
                    (Attention::Csa { .. }, Some(_), Some(is)) => select(
                        is,
                        &IndexQuery {
                            q: &index_qs[t],
                            weights: &index_weights[t],
                            visible: visible[t],
                            pos,
                        },
                        c,
                        compress_rope,
                    ),
                    _ => Some((0..visible[t]).collect()),
                };
                poisoned = chosen.is_none();
                keys.extend(chosen.into_iter().flatten().map(Key::Compressed));
            }
            (keys, poisoned)
        })
        .unzip();
    let compressed_rows = w.compressor.as_ref().zip(state_ref.compressor.as_ref());
    let key_row = |key: &Key| -> &[f32] {
        match (*key, compressed_rows) {
            (Key::Window(r), _) => &rows_ref[r * hd..(r + 1) * hd],
            (Key::Compressed(i), Some((cw, cs))) => cs.row(i, cw.head_dim),
            // Compressed keys are only listed for layers with a compressor (above).
            (Key::Compressed(_), None) => &[],
        }
    };
    let cores: Vec<Vec<f32>> = match device.on(Op::AttentionCore) {
        Some(backend) => {
            // The distinct rows of the chunk, each once, and every token's keys as indices.
            let mut slot_of = std::collections::BTreeMap::<Key, usize>::new();
            let mut distinct: Vec<&[f32]> = Vec::new();
            let keys: Vec<Vec<usize>> = key_lists
                .iter()
                .map(|list| {
                    list.iter()
                        .map(|key| {
                            *slot_of.entry(*key).or_insert_with(|| {
                                distinct.push(key_row(key));
                                distinct.len() - 1
                            })
                        })
                        .collect()
                })
                .collect();
            let queries: Vec<Vec<f32>> = projected.iter().map(|p| p.q.clone()).collect();
            backend.attend(AttendBatch {
                layer: device.layer,
                heads: heads.len(),
                head_dim: hd,
                rows: &distinct,
                queries: &queries,
                keys: &keys,
                sinks: &w.sink[heads.clone()],
                scale,
            })?
        }
        None => key_lists
            .par_iter()
            .enumerate()
            .map(|(t, list)| {
                let keys: Vec<&[f32]> = list.iter().map(key_row).collect();
                attend(&projected[t].q, &keys, &w.sink[heads.clone()], scale, hd)
            })
            .collect(),
    };
    // V carries the keys' rotation; rotating back by the query position leaves only the
    // relative offset in the rope dims.
    let outputs: Vec<Vec<f32>> = cores
        .into_par_iter()
        .enumerate()
        .map(|(t, mut out)| {
            if poisoned[t] {
                out.fill(f32::NAN);
            }
            let rotation = rope.at(start + t);
            for o in out.chunks_exact_mut(hd) {
                rotation.apply(o, true);
            }
            out
        })
        .collect();
    let outputs = project_groups(w, &outputs, c, groups, device)?;
    // The whole chunk's rows stay until the next call trims them, so a paged store can copy
    // every new row into its pages.
    state.window = rows;
    Ok(outputs)
}

/// One token's attention core on the CPU: every head's logits against every key in one blocked
/// product, then per head the softmax with its sink in the denominator and the weighted sum of
/// the keys, `heads * head_dim` values. The heads' maxima and denominators are accumulated side
/// by side (one chain per head, each in key order), so the chains do not wait on each other;
/// every head sees the same operations in the same order as it would alone.
pub fn attend(q: &[f32], keys: &[&[f32]], sinks: &[f32], scale: f32, hd: usize) -> Vec<f32> {
    let heads: Vec<&[f32]> = q.chunks_exact(hd).collect();
    let (h, n) = (heads.len(), keys.len());
    // [head][key]
    let mut logits = vec![0.0f32; h * n];
    dots(|k| keys[k], n, &heads, &mut logits);
    for l in &mut logits {
        *l *= scale;
    }
    let mut max = sinks[..h].to_vec();
    for k in 0..n {
        for (head, m) in max.iter_mut().enumerate() {
            *m = m.max(logits[head * n + k]);
        }
    }
    let mut denom: Vec<f32> = sinks[..h]
        .iter()
        .zip(&max)
        .map(|(s, m)| exp(s - m))
        .collect();
    if n == 0 {
        return vec![0.0f32; h * hd];
    }
    for (row, m) in logits.chunks_exact_mut(n).zip(&max) {
        for l in row {
            *l -= m;
        }
    }
    exp_in_place(&mut logits);
    for k in 0..n {
        for (head, d) in denom.iter_mut().enumerate() {
            *d += logits[head * n + k];
        }
    }
    let mut out = vec![0.0f32; h * hd];
    for ((o, row), d) in out
        .chunks_exact_mut(hd)
        .zip(logits.chunks_exact_mut(n))
        .zip(&denom)
    {
        for l in row.iter_mut() {
            *l /= d;
        }
        axpy_many(o, row, |k| keys[k]);
    }
    out
}

/// A key row of a token: a window row (index into the chunk's row buffer) or a compressed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Window(usize),
    Compressed(usize),
}

/// The first half of the grouped low-rank output projection for every token of a chunk: each
/// head group of `groups` (the heads `outs` hold) maps to `o_lora_rank` dims with its own block
/// of `wo_a`. The second half, `wo_b`, mixes all groups (in the model, over the whole layer).
fn project_groups(
    w: &AttentionWeights,
    outs: &[Vec<f32>],
    c: &ModelConfig,
    groups: std::ops::Range<usize>,
    device: LayerDevice<'_>,
) -> Result<Vec<Vec<f32>>, BackendError> {
    let Some(first) = outs.first() else {
        return Ok(Vec::new());
    };
    let group_in = first.len() / groups.len().max(1);
    let mut lows = vec![Vec::with_capacity(groups.len() * c.o_lora_rank); outs.len()];
    for (local, g) in groups.enumerate() {
        let parts: Vec<&[f32]> = outs
            .iter()
            .map(|o| &o[local * group_in..(local + 1) * group_in])
            .collect();
        let rows = g * c.o_lora_rank..(g + 1) * c.o_lora_rank;
        let group = device.linear_rows(LinearId::OA, &w.wo_a, rows, &parts)?;
        for (low, part) in lows.iter_mut().zip(group) {
            low.extend_from_slice(&part);
        }
    }
    Ok(lows)
}

/// `max(v, 0)` that keeps a NaN (`f32::max` would turn it into 0, and a poisoned key into a
/// plausible score).
fn relu(v: f32) -> f32 {
    if v.is_nan() { v } else { v.max(0.0) }
}

/// The lightning indexer: scores every visible compressed key by
/// `Σ_h w_h · ReLU(q_h · k) / sqrt(index_head_dim)` and keeps the top `index_topk`, returned in
/// ascending row order (the order the attention sums in); `None` when a score is NaN (no
/// choice is defined, and the caller makes the token's attention NaN rather than attend to
/// rows picked by a NaN).
#[derive(Debug, Clone, Copy)]
pub struct IndexQuery<'a> {
    /// The token's indexer query (`wq_b` of its Q residual), before RoPE.
    pub q: &'a [f32],
    /// `weights_proj` of the token's input, before the head scale.
    pub weights: &'a [f32],
    /// Compressed rows the token sees.
    pub visible: usize,
    /// The token's position.
    pub pos: usize,
}

fn select(
    is: &CompressorState,
    query: &IndexQuery<'_>,
    c: &ModelConfig,
    compress_rope: &Rope,
) -> Option<Vec<usize>> {
    let di = c.index_head_dim;
    index_choice(query, |s| is.row(s, di), c, compress_rope)
}

/// The indexer's choice for one token (see [`IndexQuery`]) over the compressed indexer rows
/// `row(0..visible)`: the rows in ascending order, or `None` when a score is NaN. Public so a
/// device's decode step, which keeps the rows in its own pages, is checked against these bits.
pub fn index_choice<'r>(
    query: &IndexQuery<'_>,
    row: impl Fn(usize) -> &'r [f32] + Sync,
    c: &ModelConfig,
    compress_rope: &Rope,
) -> Option<Vec<usize>> {
    let IndexQuery {
        q,
        weights,
        visible,
        pos,
    } = *query;
    if visible == 0 {
        return Some(Vec::new());
    }
    let di = c.index_head_dim;
    let mut q = q.to_vec();
    let rotation = compress_rope.at(pos);
    for head in q.chunks_exact_mut(di) {
        rotation.apply(head, false);
    }
    let head_scale = 1.0 / (c.index_n_heads as f32).sqrt();
    let weights: Vec<f32> = weights.iter().map(|v| v * head_scale).collect();
    let softmax_scale = 1.0 / (di as f32).sqrt();
    let heads: Vec<&[f32]> = q.chunks_exact(di).collect();
    let mut head_scores = vec![0.0f32; heads.len() * visible];
    dots(row, visible, &heads, &mut head_scores);
    let scores: Vec<f32> = (0..visible)
        .map(|s| {
            (0..heads.len())
                .map(|h| relu(head_scores[h * visible + s]) * softmax_scale * weights[h])
                .sum()
        })
        .collect();
    if scores.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut chosen = top_k(&scores, c.index_topk.min(visible));
    chosen.sort_unstable();
    Some(chosen)
}
