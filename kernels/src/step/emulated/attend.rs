//! The larger kernels' CPU references of [`super::EmulatedKernels`]: compressor pooling,
//! exact and fast attention, the logits' argmax.

use engine::{model::attention, paged::layout::RowFormat, tensor::exp};

use super::{KernelPlant, err, index, part, store};
use crate::step::{
    ShapeError,
    kernels::PoolSpec,
    layout::{kv_stride, unpack_kv_row},
};

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
