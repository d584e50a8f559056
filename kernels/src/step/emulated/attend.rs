//! The larger kernels' CPU references of [`super::EmulatedKernels`]: compressor pooling, the
//! indexer's scores (exact and on tensor cores), its choice and the chosen rows' offsets, exact
//! and fast attention, the logits' argmax.

use engine::{model::attention, paged::layout::RowFormat, tensor::exp};

use super::{KernelPlant, err, index, part, store};
use crate::step::{
    ShapeError,
    kernels::{PoolSpec, ScoreSpec},
    layout::{kv_stride, unpack_kv_row},
};

/// `indexer_topk`: each token's `k` highest scores of its visible keys (`CHOSEN_EMPTY` in
/// the slots beyond them, `CHOSEN_POISONED` in every slot when the choice is undefined).
pub(super) fn indexer_topk(
    scores: &[f32],
    visible: &[i32],
    (tokens, max_keys, k): (usize, usize, usize),
    out: &mut [i32],
) -> Result<(), ShapeError> {
    for (t, &seen) in visible.iter().enumerate().take(tokens) {
        let n = index(i64::from(seen), "visible")?;
        let row = part(scores, t * max_keys, n, "indexer scores")?;
        let slots = out
            .get_mut(t * k..(t + 1) * k)
            .ok_or_else(|| err("indexer_topk"))?;
        match crate::cpu::topk_of_scores(&row, k) {
            None => slots.fill(crate::step::CHOSEN_POISONED),
            Some(chosen) => {
                slots.fill(crate::step::CHOSEN_EMPTY);
                for (slot, c) in slots.iter_mut().zip(chosen) {
                    *slot = c as i32;
                }
            }
        }
    }
    Ok(())
}

/// `chosen_offsets`: entry `e`'s chosen rows as byte offsets from `bases[e]`
/// (`POISONED_KEY` where the choice is poisoned or a row is negative); `shifted` plants a
/// row one past the chosen.
pub(super) fn chosen_offsets(
    (chosen, k): (&[i32], usize),
    (tokens, starts, counts, bases): (&[i32], &[i64], &[i32], &[i64]),
    (row_bytes, entries): (usize, usize),
    offsets: &mut [i64],
    shifted: bool,
) -> Result<(), ShapeError> {
    for e in 0..entries {
        let mine = part(
            chosen,
            index(i64::from(tokens[e]), "chosen")? * k,
            k,
            "chosen",
        )?;
        let poisoned = k > 0 && mine[0] == crate::step::CHOSEN_POISONED;
        let count = index(i64::from(counts[e]), "counts")?;
        for (j, &row) in mine.iter().enumerate().take(count) {
            let row = row + i32::from(shifted);
            let at = index(starts[e], "chosen slots")? + j;
            *offsets.get_mut(at).ok_or_else(|| err("chosen_offsets"))? = if poisoned || row < 0 {
                crate::step::POISONED_KEY
            } else {
                bases[e] + i64::from(row) * row_bytes as i64
            };
        }
    }
    Ok(())
}

/// `indexer_scores` (the engine's bits: `dot`, ReLU keeping a NaN, heads summed in order from
/// -0) or, with `sp.tensor_cores`, `indexer_scores_mma` by its reference.
pub(super) fn indexer_scores(
    (q, w, keys): (&[f32], &[f32], &[f32]),
    (starts, visible): (&[i64], &[i32]),
    sp: ScoreSpec,
    scores: &mut [f32],
    plant: Option<KernelPlant>,
) -> Result<(), ShapeError> {
    let (heads, dim) = (sp.heads, sp.dim);
    if sp.tensor_cores {
        let x = crate::indexer_mma::ScoreInputs {
            q,
            w,
            keys,
            starts,
            visible,
        };
        let mut want = crate::indexer_mma::reference(&x, &sp).map_err(ShapeError)?;
        if plant == Some(KernelPlant::TensorCoreScoresNegated) {
            for v in &mut want {
                *v = -*v;
            }
        }
        for (t, &seen) in visible.iter().enumerate().take(sp.tokens) {
            let seen = index(i64::from(seen), "visible")?;
            let at = t * sp.max_keys;
            store(scores, at, &want[at..at + seen])?;
        }
        return Ok(());
    }
    for t in 0..sp.tokens {
        for s in 0..index(i64::from(visible[t]), "visible")? {
            let row = index(starts[t], "indexer rows")? + s;
            let key = part(keys, row * dim, dim, "indexer keys")?;
            let mut total = -0.0f32;
            for h in 0..heads {
                let qh = part(q, (t * heads + h) * dim, dim, "indexer queries")?;
                let d = engine::tensor::dot(&key, &qh);
                let relu = if d.is_nan() { d } else { d.max(0.0) };
                total += relu * sp.scale * w[t * heads + h];
            }
            store(scores, t * sp.max_keys + s, &[total])?;
        }
    }
    Ok(())
}

pub(super) fn compress_pool(
    kv: &[f32],
    gate: &[f32],
    (prev_kv, prev_gate): (&[f32], &[f32]),
    has_prev: &[i32],
    p: PoolSpec,
    out: &mut [f32],
    plant: Option<KernelPlant>,
) -> Result<(), ShapeError> {
    let (r, d, width) = (p.ratio, p.d, p.width);
    let slots = if p.overlap { 2 * r } else { r };
    for w in 0..p.windows {
        let k = part(kv, w * r * width, r * width, "compress_pool kv")?;
        let g = part(gate, w * r * width, r * width, "compress_pool gate")?;
        let pk = part(prev_kv, w * r * d, r * d, "compress_pool prev")?;
        let pg = part(prev_gate, w * r * d, r * d, "compress_pool prev")?;
        let hp = p.overlap && has_prev[w] != 0 && plant != Some(KernelPlant::OverlapIgnored);
        for c in 0..d {
            // `compress.cu`'s slot order: (previous Ca,) this window's slots.
            let score = |s: usize| match (p.overlap, s < r) {
                (false, _) => g[s * width + c],
                (true, true) if hp => pg[s * d + c],
                (true, true) => f32::NEG_INFINITY,
                (true, false) => g[(s - r) * width + d + c],
            };
            let value = |s: usize| match (p.overlap, s < r) {
                (false, _) => Some(k[s * width + c]),
                (true, true) => hp.then(|| pk[s * d + c]),
                (true, false) => Some(k[(s - r) * width + d + c]),
            };
            let big = (0..slots).map(score).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for s in 0..slots {
                sum += exp(score(s) - big);
            }
            let mut o = 0.0f32;
            for s in 0..slots {
                let weight = exp(score(s) - big) / sum;
                if let Some(v) = value(s) {
                    o += v * weight;
                }
            }
            out[w * d + c] = o;
        }
    }
    Ok(())
}

pub(super) fn attn_exact(
    q: &[f32],
    (pool, kv): (&[f32], RowFormat),
    (offsets, starts): (&[i64], &[i64]),
    sinks: &[f32],
    (tokens, heads, dim, _most): (usize, usize, usize, usize),
    scale: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    for t in 0..tokens {
        let keys = &offsets[index(starts[t], "starts")?..index(starts[t + 1], "starts")?];
        let o = if keys.iter().any(|&o| o < 0) {
            vec![f32::NAN; heads * dim]
        } else {
            let rows: Vec<Vec<f32>> = keys
                .iter()
                .map(|&b| {
                    if b % 4 != 0 {
                        return Err(err("attn_exact: an unaligned row"));
                    }
                    let stride = kv_stride(dim, kv)?;
                    let stored =
                        part(pool, index(b / 4, "attn_exact")?, stride, "attn_exact rows")?;
                    Ok(unpack_kv_row(kv, &stored, dim))
                })
                .collect::<Result<_, _>>()?;
            let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let qt = part(q, t * heads * dim, heads * dim, "attn_exact queries")?;
            attention::attend(&qt, &rows, &sinks[..heads], scale, dim)
        };
        store(out, t * heads * dim, &o)?;
    }
    Ok(())
}

pub(super) fn attn_fast(
    q: &[f32],
    (pool, (nope, rope)): (&[f32], (usize, usize)),
    (offsets, starts): (&[i64], &[i64]),
    sinks: &[f32],
    (tokens, heads): (usize, usize),
    scale: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let shape = crate::step::kernels::fast_attention_shape(heads, (nope, rope), scale);
    shape.check()?;
    let dim = nope + rope;
    let bytes: Vec<u8> = pool
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect();
    let starts = part(starts, 0, tokens + 1, "attn_fast starts")?;
    let last = index(starts[tokens], "attn_fast starts")?;
    let offsets = part(offsets, 0, last, "attn_fast offsets")?;
    if offsets
        .iter()
        .any(|&o| o >= 0 && o as usize + shape.row_bytes() > bytes.len())
    {
        return Err(err("attn_fast: a row outside the pool"));
    }
    let q = part(q, 0, tokens * heads * dim, "attn_fast queries")?;
    let sinks = part(sinks, 0, heads, "attn_fast sinks")?;
    let o = crate::emulate::attn_decode_fp8(&q, &bytes, &offsets, &starts, &sinks, &shape);
    store(out, 0, &o)
}

pub(super) fn argmax_rows(
    x: &[f32],
    (rows, width): (usize, usize),
    out: &mut [i32],
) -> Result<(), ShapeError> {
    for r in 0..rows {
        let row = part(x, r * width, width, "argmax rows")?;
        let first_bad = row.iter().position(|v| !v.is_finite());
        // The largest finite value, as `engine::sampling::argmax` takes it from finite rows.
        let finite: Vec<f32> = row
            .iter()
            .map(|&v| if v.is_finite() { v } else { f32::NEG_INFINITY })
            .collect();
        let best = row.iter().position(|v| v.is_finite()).map_or(0, |first| {
            (first..width).fold(first, |b, i| if finite[i] > finite[b] { i } else { b })
        });
        let slots = out
            .get_mut(2 * r..2 * r + 2)
            .ok_or_else(|| err("argmax rows"))?;
        slots[0] = best as i32;
        slots[1] = first_bad.map_or(-1, |at| at as i32);
    }
    Ok(())
}
