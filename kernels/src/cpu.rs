//! CPU references of the kernels, with semantics identical to the CUDA code.

use engine::quant::{self, QuantError};

/// NVFP4 activation quantization of a row-major `[rows, cols]` matrix: returns the packed
/// e2m1 codes (`rows * cols / 2` bytes) and the e4m3 block scales (`rows * cols / 16`).
pub fn nvfp4_quantize_rows(
    x: &[f32],
    rows: usize,
    cols: usize,
    global_scale: f32,
) -> Result<(Vec<u8>, Vec<u8>), QuantError> {
    let mut packed = Vec::with_capacity(x.len() / 2);
    let mut scales = Vec::with_capacity(x.len() / 16);
    if cols == 0 {
        return Ok((packed, scales));
    }
    for row in x.chunks(cols).take(rows) {
        let (p, s) = quant::quant_nvfp4_activation(row, global_scale)?;
        packed.extend(p);
        scales.extend(s);
    }
    Ok((packed, scales))
}

/// `y = W · x` for an NVFP4 weight `[rows, cols]` (packed codes, e4m3 block scales, global
/// scale), computed in f64 from the exactly dequantized weights: the reference the GPU GEMV's
/// f32 result is compared with.
pub fn nvfp4_gemv(
    packed: &[u8],
    scales: &[u8],
    scale_2: f32,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_nvfp4(packed, scales, scale_2, rows, cols)?;
    Ok((0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32
        })
        .collect())
}

/// Decode attention with sinks over gathered rows (f64 reference of `attn_decode.cu`):
/// `q` is `[batch, heads, dim]`; request `b`'s rows are `rows[starts[b]..starts[b+1]]`, each
/// `dim` values (K = V). Returns `[batch, heads, dim]`.
pub fn attn_decode(
    q: &[f32],
    rows: &[Vec<f32>],
    starts: &[usize],
    sinks: &[f32],
    dim: usize,
    scale: f32,
) -> Vec<f32> {
    let heads = sinks.len();
    let batch = starts.len().saturating_sub(1);
    let mut out = vec![0.0f32; batch * heads * dim];
    for b in 0..batch {
        let mine = &rows[starts[b]..starts[b + 1]];
        for h in 0..heads {
            let qv = &q[(b * heads + h) * dim..(b * heads + h + 1) * dim];
            let scores: Vec<f64> = mine
                .iter()
                .map(|r| {
                    f64::from(scale)
                        * r.iter()
                            .zip(qv)
                            .map(|(a, c)| f64::from(*a) * f64::from(*c))
                            .sum::<f64>()
                })
                .collect();
            let sink = f64::from(sinks[h]);
            let max = scores.iter().copied().fold(sink, f64::max);
            let denom: f64 =
                scores.iter().map(|s| (s - max).exp()).sum::<f64>() + (sink - max).exp();
            for d in 0..dim {
                let v: f64 = scores
                    .iter()
                    .zip(mine)
                    .map(|(s, r)| (s - max).exp() * f64::from(r[d]))
                    .sum();
                out[(b * heads + h) * dim + d] = (v / denom) as f32;
            }
        }
    }
    out
}

/// Lightning-indexer selection for one decode query (reference of `indexer.cu`): scores the
/// first `visible` keys by `Σ_h w_h · ReLU(q_h · k) · scale` and returns the indices of the
/// `min(k, visible)` best, ties to the lower index, in ascending index order.
pub fn indexer_topk(
    q: &[f32],
    w: &[f32],
    keys: &[Vec<f32>],
    visible: usize,
    scale: f32,
    k: usize,
) -> Vec<usize> {
    let dim = keys.first().map_or(0, Vec::len);
    let scores: Vec<f32> = keys[..visible]
        .iter()
        .map(|key| {
            q.chunks_exact(dim.max(1))
                .zip(w)
                .map(|(qh, wh)| engine::tensor::dot(qh, key).max(0.0) * scale * wh)
                .sum()
        })
        .collect();
    let mut chosen = engine::tensor::top_k(&scores, k.min(visible));
    chosen.sort_unstable();
    chosen
}
