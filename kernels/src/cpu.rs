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
    Ok(matvec_f64(&w, x, rows, cols))
}

/// `y = W · x` for an MXFP4 weight `[rows, cols]` (packed codes, ue8m0 scales per 32), in f64
/// from the exactly dequantized weights (reference of `mxfp4_gemv`).
pub fn mxfp4_gemv(
    packed: &[u8],
    scales: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_mxfp4(packed, scales, rows, cols)?;
    Ok(matvec_f64(&w, x, rows, cols))
}

fn matvec_f64(w: &[f32], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32
        })
        .collect()
}

/// The routed experts' weights, stacked `[experts, rows, cols]` in one FP4 format.
#[derive(Debug, Clone, Copy)]
pub enum Experts<'a> {
    /// NVFP4: codes, e4m3 scales per 16, one global scale per expert.
    Nvfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        scale_2: &'a [f32],
    },
    /// MXFP4: codes, ue8m0 scales per 32.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

impl Experts<'_> {
    /// Bytes of codes and of scales per expert.
    pub fn bytes_per_expert(&self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Experts::Nvfp4 { .. } => (rows * cols / 2, rows * cols / 16),
            Experts::Mxfp4 { .. } => (rows * cols / 2, rows * cols / 32),
        }
    }
}

/// The routed-expert GEMVs of a decode step (reference of `*_grouped_gemv`): pair `p` applies
/// expert `pair_expert[p]` to token `pair_token[p]` of `x` (`[tokens, cols]`); returns
/// `[pairs, rows]`.
pub fn grouped_gemv(
    experts: Experts<'_>,
    x: &[f32],
    pair_token: &[usize],
    pair_expert: &[usize],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let (code_bytes, scale_bytes) = experts.bytes_per_expert(rows, cols);
    let mut out = Vec::with_capacity(pair_token.len() * rows);
    for (&t, &e) in pair_token.iter().zip(pair_expert) {
        let xt = &x[t * cols..(t + 1) * cols];
        let y = match experts {
            Experts::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => nvfp4_gemv(
                &packed[e * code_bytes..(e + 1) * code_bytes],
                &scales[e * scale_bytes..(e + 1) * scale_bytes],
                scale_2[e],
                xt,
                rows,
                cols,
            )?,
            Experts::Mxfp4 { packed, scales } => mxfp4_gemv(
                &packed[e * code_bytes..(e + 1) * code_bytes],
                &scales[e * scale_bytes..(e + 1) * scale_bytes],
                xt,
                rows,
                cols,
            )?,
        };
        out.extend(y);
    }
    Ok(out)
}

/// `C = bf16(A) · Wᵀ` for f32 activations `A` (`[m, k]`) and an NVFP4 weight `W` (`[n, k]`),
/// in f64 over activations rounded to bf16 (round-to-nearest-even) and exactly dequantized
/// weights: the reference of `nvfp4_gemm_bf16`. Returns `[m, n]`.
pub fn nvfp4_gemm(
    a: &[f32],
    packed: &[u8],
    scales: &[u8],
    scale_2: f32,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_nvfp4(packed, scales, scale_2, n, k)?;
    let a: Vec<f32> = a
        .iter()
        .map(|&v| engine::formats::bf16_to_f32(engine::formats::f32_to_bf16(v)))
        .collect();
    let mut c = Vec::with_capacity(m * n);
    for i in 0..m {
        c.extend(matvec_f64(&w, &a[i * k..(i + 1) * k], n, k));
    }
    Ok(c)
}

/// `C = bf16(A) · Wᵀ` for f32 activations `A` (`[m, k]`) and an MXFP4 weight `W` (`[n, k]`:
/// codes, ue8m0 scales per 32), in f64 over activations rounded to bf16 and exactly dequantized
/// weights: the reference of `mxfp4_grouped_gemm_bf16`'s tiles. Returns `[m, n]`.
pub fn mxfp4_gemm(
    a: &[f32],
    packed: &[u8],
    scales: &[u8],
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_mxfp4(packed, scales, n, k)?;
    let a: Vec<f32> = a.iter().map(|&v| crate::dense_gemm::bf16(v)).collect();
    let mut c = Vec::with_capacity(m * n);
    for i in 0..m {
        c.extend(matvec_f64(&w, &a[i * k..(i + 1) * k], n, k));
    }
    Ok(c)
}

/// The routed experts of a prefill chunk (reference of `nvfp4_grouped_gemm_bf16`): pair `p`
/// multiplies token `pair_token[p]` of `a` (`[tokens, k]`, rounded to bf16) by expert
/// `pair_expert[p]` of the stacked NVFP4 experts (`[experts, n, k]`, global scale per expert),
/// in f64; `[pairs, n]`, a NaN row for a pair whose expert is outside the stack.
pub fn grouped_gemm(
    a: &[f32],
    pair_token: &[i32],
    pair_expert: &[i32],
    (packed, scales, scale_2): (&[u8], &[u8], &[f32]),
    (n, k): (usize, usize),
) -> Result<Vec<f32>, QuantError> {
    let (code_bytes, scale_bytes) = (n * k / 2, n * k / 16);
    let mut out = Vec::with_capacity(pair_token.len() * n);
    for (&t, &e) in pair_token.iter().zip(pair_expert) {
        let Some(e) = usize::try_from(e).ok().filter(|&e| e < scale_2.len()) else {
            out.extend(std::iter::repeat_n(f32::NAN, n));
            continue;
        };
        let t = t as usize;
        out.extend(nvfp4_gemm(
            &a[t * k..(t + 1) * k],
            &packed[e * code_bytes..(e + 1) * code_bytes],
            &scales[e * scale_bytes..(e + 1) * scale_bytes],
            scale_2[e],
            1,
            n,
            k,
        )?);
    }
    Ok(out)
}

/// Rows `row0..row0 + rows` of `src` times each of the `vectors` vectors of `x` with the
/// engine's own dot products (`engine::tensor::dots_source`), vector-major: the reference of
/// the exact GEMV.
pub fn engine_dots<S: engine::tensor::rows::RowSource>(
    src: &S,
    (row0, rows): (usize, usize),
    x: &[f32],
    vectors: usize,
) -> Vec<f32> {
    let xs: Vec<&[f32]> = x.chunks_exact(src.cols()).take(vectors).collect();
    let mut out = vec![0f32; rows * vectors];
    engine::tensor::dots_source(src, row0, rows, &xs, &mut out);
    out
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

/// Decode attention over FP8 rows (f64 reference of `attn_decode_fp8.cu`): request `b`'s rows
/// are at byte offsets `row_offsets[starts[b]..starts[b + 1]]` of `pool`, each in the engine's
/// FP8 K=V format of `shape` (decoded exactly, as `engine::paged::codec::decode` does). The
/// query is rounded to bf16 as the kernel's MMA takes it; the rest is exact. Offset `-1` is an
/// empty slot (skipped); any other negative offset is an undefined choice and makes every head
/// of its request NaN. `[batch, heads, nope + rope]` out.
///
/// The kernel also rounds each tile's softmax weights to bf16 (and sums the rounded weights),
/// so its output is a convex combination of the rows within `2^-8 · max |row value|` of this.
pub fn attn_decode_fp8(
    q: &[f32],
    pool: &[u8],
    row_offsets: &[i64],
    starts: &[i64],
    sinks: &[f32],
    shape: &crate::attn_fp8::Fp8AttnShape,
) -> Vec<f32> {
    let format = engine::paged::layout::RowFormat::Fp8Kv {
        nope: shape.nope,
        rope: shape.rope,
    };
    let (heads, dim) = (shape.heads, shape.dim());
    let batch = starts.len().saturating_sub(1);
    let mut out = Vec::with_capacity(batch * heads * dim);
    for b in 0..batch {
        let mine = &row_offsets[starts[b] as usize..starts[b + 1] as usize];
        if mine.iter().any(|&o| o < crate::attn_fp8::EMPTY_SLOT) {
            out.extend(std::iter::repeat_n(f32::NAN, heads * dim));
            continue;
        }
        let rows: Vec<Vec<f32>> = mine
            .iter()
            .filter(|&&o| o >= 0)
            .map(|&o| {
                let at = o as usize;
                engine::paged::codec::decode(format, &pool[at..at + shape.row_bytes()], dim)
            })
            .collect();
        let q_bf16: Vec<f32> = q[b * heads * dim..(b + 1) * heads * dim]
            .iter()
            .map(|&v| engine::formats::bf16_to_f32(engine::formats::f32_to_bf16(v)))
            .collect();
        let starts = [0, rows.len()];
        out.extend(attn_decode(
            &q_bf16,
            &rows,
            &starts,
            sinks,
            dim,
            shape.scale,
        ));
    }
    out
}

/// Lightning-indexer selection for one decode query (reference of `indexer.cu`): scores the
/// first `visible` keys by `Σ_h w_h · ReLU(q_h · k) · scale` and returns the indices of the
/// `min(k, visible)` best, ties to the lower index, in ascending index order. `None` when a
/// score is NaN (the ReLU keeps a NaN): no selection is defined, as the engine's rule says.
pub fn indexer_topk(
    q: &[f32],
    w: &[f32],
    keys: &[Vec<f32>],
    visible: usize,
    scale: f32,
    k: usize,
) -> Option<Vec<usize>> {
    let dim = keys.first().map_or(0, Vec::len);
    let scores: Vec<f32> = keys[..visible]
        .iter()
        .map(|key| {
            q.chunks_exact(dim.max(1))
                .zip(w)
                .map(|(qh, wh)| {
                    let d = engine::tensor::dot(qh, key);
                    let relu = if d.is_nan() { d } else { d.max(0.0) };
                    relu * scale * wh
                })
                .sum()
        })
        .collect();
    topk_of_scores(&scores, k)
}

/// The `min(k, scores.len())` best indices of `scores`, ties to the lower index, ascending;
/// `None` when a score is NaN.
pub fn topk_of_scores(scores: &[f32], k: usize) -> Option<Vec<usize>> {
    if scores.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut chosen = engine::tensor::top_k(scores, k.min(scores.len()));
    chosen.sort_unstable();
    Some(chosen)
}

/// `C = A · Wᵀ` with both operands NVFP4 (`A` `[m, k]` with global scale `a_scale_2`, `W`
/// `[n, k]` with `w_scale_2`), in f64 over the exactly dequantized operands: the reference of
/// `nvfp4_gemm_w4a4_sm120` (whose products are exact and whose sums are f32).
pub fn nvfp4_gemm_w4a4(
    a: (&[u8], &[u8], f32),
    w: (&[u8], &[u8], f32),
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>, QuantError> {
    let a = quant::dequant_nvfp4(a.0, a.1, a.2, m, k)?;
    let w = quant::dequant_nvfp4(w.0, w.1, w.2, n, k)?;
    let mut c = Vec::with_capacity(m * n);
    for i in 0..m {
        c.extend(matvec_f64(&w, &a[i * k..(i + 1) * k], n, k));
    }
    Ok(c)
}

/// The clamped SwiGLU of an expert (reference of `swiglu_clamp`): `silu(min(g, limit)) *
/// clamp(u, -limit, limit)` elementwise, exactly the engine's f32 formula.
pub fn swiglu_clamp(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| engine::tensor::silu(g.min(limit)) * u.clamp(-limit, limit))
        .collect()
}

/// `y[v] = W · x[v]` for a bf16 weight `[rows, cols]` (raw bits) and `vectors` f32 inputs
/// (`x` is `[vectors, cols]`), in f64 (reference of `bf16_gemv_many`); returns `[vectors, rows]`.
pub fn bf16_gemv(w: &[u16], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let w = engine::formats::bf16_slice_to_f32(w);
    if cols == 0 {
        return Vec::new();
    }
    x.chunks_exact(cols)
        .flat_map(|xv| matvec_f64(&w, xv, rows, cols))
        .collect()
}

/// `y[v] = W · x[v]` for an FP8 e4m3 weight `[rows, cols]` with 128x128 ue8m0 block scales
/// (`engine::quant::dequant_fp8_block` layout), in f64 over the exactly dequantized weight
/// (reference of `fp8_block_gemv_many`); returns `[vectors, rows]`.
pub fn fp8_block_gemv(
    w: &[u8],
    scales: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let w = quant::dequant_fp8_block(w, scales, rows, cols)?;
    if cols == 0 {
        return Ok(Vec::new());
    }
    Ok(x.chunks_exact(cols)
        .flat_map(|xv| matvec_f64(&w, xv, rows, cols))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// e2m1 code 2 (= 1.0) in both nibbles.
    const ONES: u8 = 0x22;

    #[test]
    fn mxfp4_gemv_applies_power_of_two_scales() {
        // One row of 32 ones with scale 2^(128-127) = 2, and a second row scaled by 2^-1.
        let packed = vec![ONES; 32];
        let scales = [128u8, 126];
        let x: Vec<f32> = (1..=32).map(|v| v as f32).collect();
        let y = mxfp4_gemv(&packed, &scales, &x, 2, 32).unwrap();
        assert_eq!(y, vec![2.0 * 528.0, 0.5 * 528.0]);
    }

    #[test]
    fn nvfp4_gemm_rounds_activations_to_bf16() {
        // 1 + 2^-10 is not a bf16 and rounds to 1: the sum over 16 ones is exactly 16.
        let a = vec![1.0 + 2f32.powi(-10); 16];
        let packed = vec![ONES; 8];
        let scales = [0x38u8]; // e4m3 1.0
        let c = nvfp4_gemm(&a, &packed, &scales, 0.5, 1, 1, 16).unwrap();
        assert_eq!(c, vec![8.0]);
        let y = nvfp4_gemv(&packed, &scales, 0.5, &a, 1, 16).unwrap();
        assert!(y[0] > 8.0, "the GEMV keeps f32 activations: {}", y[0]);
    }

    #[test]
    fn grouped_gemv_is_the_chosen_experts_gemvs() {
        let (rows, cols) = (3usize, 32usize);
        let w: Vec<f32> = (0..2 * rows * cols).map(|i| (i % 7) as f32 - 3.0).collect();
        let (p0, s0) = quant::quant_mxfp4(&w[..rows * cols], rows, cols).unwrap();
        let (p1, s1) = quant::quant_mxfp4(&w[rows * cols..], rows, cols).unwrap();
        let x: Vec<f32> = (0..2 * cols).map(|i| (i as f32).sin()).collect();
        let experts = Experts::Mxfp4 {
            packed: &[p0.clone(), p1.clone()].concat(),
            scales: &[s0.clone(), s1.clone()].concat(),
        };
        let y = grouped_gemv(experts, &x, &[1, 0], &[0, 1], rows, cols).unwrap();
        let first = mxfp4_gemv(&p0, &s0, &x[cols..], rows, cols).unwrap();
        let second = mxfp4_gemv(&p1, &s1, &x[..cols], rows, cols).unwrap();
        assert_eq!(y, [first, second].concat());
    }

    #[test]
    fn swiglu_clamp_clamps_both_inputs() {
        let limit = 10.0;
        let got = super::swiglu_clamp(&[0.0, 100.0, -3.0, 2.0], &[1.0, 100.0, -100.0, 0.5], limit);
        let silu = engine::tensor::silu;
        assert_eq!(
            got,
            vec![0.0, silu(10.0) * 10.0, silu(-3.0) * -10.0, silu(2.0) * 0.5]
        );
    }

    #[test]
    fn bf16_gemv_is_one_matvec_per_vector() {
        let f = engine::formats::f32_to_bf16;
        // W = [[1, 2], [-0.5, 4]], x0 = [1, 1], x1 = [2, -1].
        let w = [f(1.0), f(2.0), f(-0.5), f(4.0)];
        let y = super::bf16_gemv(&w, &[1.0, 1.0, 2.0, -1.0], 2, 2);
        assert_eq!(y, vec![3.0, 3.5, 0.0, -5.0]);
    }

    #[test]
    fn fp8_block_gemv_applies_each_tiles_scale() {
        // 2 x 130: the second column tile (columns 128, 129) has scale 2^1, the first 2^0.
        let (rows, cols) = (2usize, 130usize);
        let one = engine::formats::f32_to_e4m3(1.0);
        let w = vec![one; rows * cols];
        let scales = [127u8, 128];
        let x: Vec<f32> = (0..cols)
            .map(|c| if c < 128 { 1.0 } else { 10.0 })
            .collect();
        let y = super::fp8_block_gemv(&w, &scales, &x, rows, cols).unwrap();
        assert_eq!(y, vec![128.0 + 2.0 * 20.0; 2]);
    }
}
