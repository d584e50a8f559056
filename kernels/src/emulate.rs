//! The CUDA kernels' own index math and reduction steps, ported to Rust and run on the CPU, so
//! that CI (which has no GPU) checks what the device code does, not only what it should do.
//! Each function follows its kernel line by line: the same split of work, the same f32
//! operations in the same order per thread, the same treatment of NaN, infinities and empty
//! ranges. The tests compare them with the f64 references of [`crate::cpu`] at awkward shapes.
//!
//! - [`split_range`], [`attn_decode`]: `attn_decode.cu` (`attn_decode_partial` then
//!   `attn_decode_merge`).
//! - [`topk_radix`]: `indexer.cu` `indexer_topk` (radix select) over one request's scores;
//!   [`indexer_scores_mma`]: its tensor-core scores (heads as the M side of `mma.sync`).
//! - [`nvfp4_gemm_w4a4_sm120`]: `nvfp4_gemm_sm120.cu`, its loads and stores around a model of
//!   the block-scaled FP4 `mma.sync` fragments.
//! - [`nvfp4_gemm_w4a4_sm100`]: `nvfp4_gemm_sm100.cu`, its shared-memory layout, descriptors,
//!   Tensor Memory columns and epilogue around a model of `tcgen05.cp` and the block-scaled
//!   `tcgen05.mma`.
//! - [`attn_decode_fp8`]: `attn_decode_fp8.cu` (plan, heads-batched partials on a model of
//!   bf16 `mma.sync.m16n8k16`, combine).
//! - [`exact_dots`]: `exact_gemv.cu` (the engine's dot product definition, eight threads as its
//!   eight lanes).
//! - [`moe_grouped_gemm`]: `moe_align.cu` then `nvfp4_gemm.cu` `nvfp4_grouped_gemm_bf16`
//!   (the routed experts of a prefill chunk grouped by expert, one tile model with the GEMM).
//! - [`nvfp4_gemm_bf16`]: `nvfp4_gemm.cu` (the sm_90 path: FP4 dequantized to bf16 in shared
//!   memory, WMMA bf16 tensor cores), its staging, fragment origins and masked store around a
//!   model of the WMMA API; [`fp4_gemm_bf16_wgmma`] and [`moe_grouped_gemm_wgmma`]: its sm_90a
//!   tiles on the warpgroup-MMA model.
//! - [`dense_gemm`]: `dense_gemm.cu` (bf16 and FP8-block weights dequantized to bf16 on WMMA
//!   tensor cores, K split over grid z and summed in split order), on the same WMMA model;
//!   [`dense_gemm_wgmma`]: its sm_90a tiles (`wgmma.cuh`: core-matrix layout, descriptors,
//!   double buffer) on a model of Hopper's warpgroup MMA (`emulate/wgmma_sm90.rs`).

mod attn_fp8;
mod dense_gemm;
mod exact_dots;
mod indexer_mma;
mod mma_bf16;
mod mma_sm120;
mod moe_grouped;
mod tcgen05_sm100;
mod topk_radix;
mod wgmma_sm90;
mod wmma_bf16;

pub use attn_fp8::{Mma, Tamper, attn_decode_fp8};
pub use dense_gemm::{dense_gemm, dense_gemm_wgmma};
pub use exact_dots::exact_dots;
pub use indexer_mma::indexer_scores_mma;
pub use mma_sm120::nvfp4_gemm_w4a4_sm120;
pub use moe_grouped::{StackedExperts, moe_grouped_gemm, moe_grouped_gemm_wgmma};
pub use tcgen05_sm100::nvfp4_gemm_w4a4_sm100;
pub use topk_radix::topk_radix;
pub use wmma_bf16::{fp4_gemm_bf16_wgmma, mxfp4_gemm_bf16, nvfp4_gemm_bf16};

/// Threads per block of `attn_decode_partial`.
const ATTN_THREADS: usize = crate::cuda_constants::attn_decode::THREADS;

/// The rows `[lo, hi)` of split `split` of a request whose rows are `first..first + count`
/// (`attn_decode_partial`): `splits` parts of `ceil(count / splits)` rows, the last ones
/// possibly short or empty. 64-bit throughout, as row indices into a pool are.
pub fn split_range(first: i64, count: i64, splits: i64, split: i64) -> (i64, i64) {
    let per_split = (count + splits - 1) / splits;
    let lo = first + split * per_split;
    let hi = (first + count).min(lo + per_split);
    (lo, hi)
}

/// One split's running state (`attn_decode_partial`): max score `m`, sum `l` of
/// `exp(s - m)`, unnormalised accumulator.
struct Partial {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

/// `q · row` as the block computes it: thread `t` sums dims `t, t + 128, ...` in order, then a
/// tree reduction over the 128 partial sums.
fn block_dot(q: &[f32], row: &[f32]) -> f32 {
    let mut red = [0.0f32; ATTN_THREADS];
    for (t, r) in red.iter_mut().enumerate() {
        let mut partial = 0.0f32;
        let mut d = t;
        while d < q.len() {
            partial += q[d] * row[d];
            d += ATTN_THREADS;
        }
        *r = partial;
    }
    let mut stride = ATTN_THREADS / 2;
    while stride > 0 {
        for t in 0..stride {
            red[t] += red[t + stride];
        }
        stride /= 2;
    }
    red[0]
}

/// `attn_decode_partial` for one (request, head, split). A NaN score makes `m` NaN for good
/// (`fmaxf` alone would drop it); a `-inf` score adds nothing, even to an empty state.
fn partial(q: &[f32], rows: &[Vec<f32>], scale: f32) -> Partial {
    let dim = q.len();
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    let mut acc = vec![0.0f32; dim];
    for row in rows {
        let s = block_dot(q, row) * scale;
        let m_new = if s.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(s)
        };
        let carry = if m == f32::NEG_INFINITY {
            0.0
        } else {
            (m - m_new).exp()
        };
        let w = if s == f32::NEG_INFINITY {
            0.0
        } else {
            (s - m_new).exp()
        };
        l = l * carry + w;
        for (a, &v) in acc.iter_mut().zip(row) {
            *a = *a * carry + w * v;
        }
        m = m_new;
    }
    Partial { m, l, acc }
}

/// `attn_decode_merge` for one (request, head): the splits' log-sum-exp with the sink in the
/// denominator. Empty splits (`m = -inf`) contribute nothing; a NaN anywhere (sink, a split's
/// `m` or `l`) makes the whole head NaN, as the f64 reference gives.
fn merge(parts: &[Partial], sink: f32, dim: usize) -> Vec<f32> {
    let poisoned = sink.is_nan() || parts.iter().any(|p| p.m.is_nan() || p.l.is_nan());
    if poisoned {
        return vec![f32::NAN; dim];
    }
    let big = parts.iter().fold(sink, |b, p| b.max(p.m));
    let mut denom = (sink - big).exp();
    for p in parts.iter().filter(|p| p.m != f32::NEG_INFINITY) {
        denom += p.l * (p.m - big).exp();
    }
    (0..dim)
        .map(|d| {
            let mut v = 0.0f32;
            for p in parts.iter().filter(|p| p.m != f32::NEG_INFINITY) {
                v += p.acc[d] * (p.m - big).exp();
            }
            v / denom
        })
        .collect()
}

/// Split-KV decode attention as the two kernels compute it, with the arguments of
/// [`crate::cpu::attn_decode`] plus the number of splits per (request, head).
pub fn attn_decode(
    q: &[f32],
    rows: &[Vec<f32>],
    starts: &[usize],
    sinks: &[f32],
    dim: usize,
    scale: f32,
    splits: usize,
) -> Vec<f32> {
    let heads = sinks.len();
    let batch = starts.len().saturating_sub(1);
    let mut out = Vec::with_capacity(batch * heads * dim);
    for b in 0..batch {
        let (first, count) = (starts[b] as i64, (starts[b + 1] - starts[b]) as i64);
        for (h, &sink) in sinks.iter().enumerate() {
            let qv = &q[(b * heads + h) * dim..(b * heads + h + 1) * dim];
            let parts: Vec<Partial> = (0..splits as i64)
                .map(|split| {
                    let (lo, hi) = split_range(first, count, splits as i64, split);
                    let mine = if lo < hi {
                        &rows[lo as usize..hi as usize]
                    } else {
                        &[]
                    };
                    partial(qv, mine, scale)
                })
                .collect();
            out.extend(merge(&parts, sink, dim));
        }
    }
    out
}

/// The index `indexer_topk` writes in every slot of a request whose visible scores include a
/// NaN: its selection is undefined, and the caller must not read rows by it.
pub const TOPK_POISONED: i32 = -2;
/// The index `indexer_topk` writes in the slots past `min(k, visible)`.
pub const TOPK_EMPTY: i32 = -1;

/// The checks `Gpu::indexer_topk` makes before a launch, as a pure function: every length
/// agrees with the batch, `heads`, `dim` and `k` are not zero, and every request's visible
/// keys lie inside `keys` (the kernel reads them without bounds checks).
pub fn check_indexer_batch(
    q_len: usize,
    w_len: usize,
    keys_len: usize,
    key_starts: &[i64],
    visible: &[i32],
    (heads, dim, top_k): (usize, usize, usize),
) -> Result<(), String> {
    let n = visible.len();
    if heads == 0 || dim == 0 || top_k == 0 {
        return Err(format!(
            "indexer_topk: heads {heads}, dim {dim} and top_k {top_k} must not be zero"
        ));
    }
    if q_len != n * heads * dim || w_len != n * heads || key_starts.len() != n {
        return Err(format!(
            "indexer_topk: {n} requests need {} query values, {} weights and {n} key starts \
             (got {q_len}, {w_len}, {})",
            n * heads * dim,
            n * heads,
            key_starts.len()
        ));
    }
    let rows = (keys_len / dim) as i64;
    if !keys_len.is_multiple_of(dim) {
        return Err(format!(
            "indexer_topk: {keys_len} key values are not rows of {dim}"
        ));
    }
    for (b, (&start, &count)) in key_starts.iter().zip(visible).enumerate() {
        if start < 0 || count < 0 || start + i64::from(count) > rows {
            return Err(format!(
                "indexer_topk: request {b} reads keys {start}..{} of {rows}",
                start + i64::from(count)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
