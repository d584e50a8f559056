//! The dense-weight GEMM of `dense_gemm.cu` (the fast path of the attention, shared-expert and
//! output-head linears): the weight forms it reads, its CPU reference, its error bound and the
//! host's split-K plan, which the CUDA wrapper, the emulation ([`crate::emulate::dense_gemm`])
//! and the decode step share.

use engine::formats::{bf16_to_f32, e4m3_to_f32, f32_to_bf16};

/// Rows per block tile (activation rows) and columns per block tile (weight rows).
pub const TILE: usize = crate::cuda_constants::dense_gemm::BM;
/// The K slice a block stages at a time; a split covers whole slices.
pub const SLICE: usize = crate::cuda_constants::dense_gemm::BK;
// The warpgroup tiles (`wgmma.cuh`, what sm_90 runs) cut the work as the WMMA tiles do.
const _: () = assert!(
    TILE == crate::cuda_constants::dense_gemm::BN
        && TILE == crate::cuda_constants::wgmma::TILE
        && SLICE == crate::cuda_constants::wgmma::SLICE
);
/// The fewest K columns a split covers (below that a split's fixed cost outweighs its reads).
pub const MIN_SPLIT_COLS: usize = 512;

/// Blocks per multiprocessor the split plan aims for (the kernel does not pipeline its loads:
/// other blocks hide their latency).
pub const BLOCKS_PER_SM: usize = 4;

/// A dense weight with `k` columns as the engine stores it.
#[derive(Debug, Clone, Copy)]
pub enum DenseRows<'a> {
    /// bf16 bits, little-endian: two bytes a value.
    Bf16(&'a [u8]),
    /// e4m3 codes and the f32 scale of each 128 x 128 tile (`[ceil(rows/128), ceil(k/128)]`).
    Fp8Block { codes: &'a [u8], scales: &'a [f32] },
}

impl<'a> DenseRows<'a> {
    /// The engine weight's bytes as the GEMM reads them: bf16 or FP8-block rows (`None` for
    /// the other forms).
    pub fn of(w: &'a engine::tensor::Weight) -> Option<Self> {
        match w.form() {
            engine::tensor::WeightForm::Bf16(bytes) => Some(Self::Bf16(bytes.as_slice())),
            engine::tensor::WeightForm::Fp8Block { codes, scales } => Some(Self::Fp8Block {
                codes: codes.as_slice(),
                scales,
            }),
            _ => None,
        }
    }

    /// The rows it holds at `k` columns, or `None` when its bytes or scales do not fit.
    pub fn rows(&self, k: usize) -> Option<usize> {
        if k == 0 {
            return None;
        }
        match *self {
            Self::Bf16(bytes) => {
                (bytes.len().is_multiple_of(2 * k)).then_some(bytes.len() / (2 * k))
            }
            Self::Fp8Block { codes, scales } => {
                let rows = codes.len() / k;
                (codes.len() == rows * k && scales.len() == rows.div_ceil(128) * k.div_ceil(128))
                    .then_some(rows)
            }
        }
    }

    /// W(r, c) as the GEMM multiplies it: a bf16 value (the stored bf16, or
    /// `bf16(f32(e4m3 * scale))`, exact when the scale is a power of two).
    pub fn value(&self, r: usize, c: usize, k: usize) -> f32 {
        match *self {
            Self::Bf16(bytes) => {
                let at = 2 * (r * k + c);
                bf16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
            }
            Self::Fp8Block { codes, scales } => {
                let scale = scales[(r / 128) * k.div_ceil(128) + c / 128];
                bf16(e4m3_to_f32(codes[r * k + c]) * scale)
            }
        }
    }
}

/// `v` rounded to bf16 (round-to-nearest-even), as an f32.
pub fn bf16(v: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(v))
}

/// How the kernel splits K for an `m x n x k` product on a device of `sms` multiprocessors:
/// `(splits, columns a split covers)`. Enough splits that the grid has about [`BLOCKS_PER_SM`] blocks per
/// multiprocessor, each split at least [`MIN_SPLIT_COLS`] columns and a whole number of
/// slices, no split empty. A function of the shape alone, so a replayed step sums its
/// partials in the same order.
pub fn splits(m: usize, n: usize, k: usize, sms: usize) -> (usize, usize) {
    let tiles = m.div_ceil(TILE).max(1) * n.div_ceil(TILE).max(1);
    let wanted = (BLOCKS_PER_SM * sms).div_ceil(tiles).max(1);
    let most = (k / MIN_SPLIT_COLS).max(1);
    let per = k
        .div_ceil(wanted.min(most))
        .next_multiple_of(SLICE)
        .max(SLICE);
    (k.div_ceil(per).max(1), per)
}

/// `C = bf16(A) · W[row0..row0 + n]ᵀ` for f32 activations `A` (`[m, k]`) in f64 over the
/// bf16 operands ([`DenseRows::value`]): the reference of `dense_gemm_bf16` /
/// `dense_gemm_fp8_block`. Returns `[m, n]`; an error when the weight does not hold the rows.
pub fn reference(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f32>, String> {
    check(a, w, row0, (m, n, k))?;
    let rows: Vec<Vec<f64>> = (0..m)
        .map(|i| {
            a[i * k..(i + 1) * k]
                .iter()
                .map(|&v| f64::from(bf16(v)))
                .collect()
        })
        .collect();
    let mut c = vec![0f32; m * n];
    let mut weight = vec![0f64; k];
    for j in 0..n {
        for (x, v) in weight.iter_mut().enumerate() {
            *v = f64::from(w.value(row0 + j, x, k));
        }
        for (i, row) in rows.iter().enumerate() {
            let sum: f64 = row.iter().zip(&weight).map(|(a, b)| a * b).sum();
            c[i * n + j] = sum as f32;
        }
    }
    Ok(c)
}

/// Each output's error bound against [`reference()`]: the kernel sums in f32 (in slices, then
/// splits), so `|got - want| <= k * 2^-23 * Σ_k |bf16(a) · w|` (twice the worst case of a
/// sequential f32 sum of exact products), plus the smallest normal f32 for sums of zeros.
pub fn bound(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f64>, String> {
    check(a, w, row0, (m, n, k))?;
    let per = k.max(1) as f64 * f64::from(f32::EPSILON);
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let mag: f64 = (0..k)
                .map(|x| f64::from((bf16(a[i * k + x]) * w.value(row0 + j, x, k)).abs()))
                .sum();
            out.push(per * mag + f64::from(f32::MIN_POSITIVE));
        }
    }
    Ok(out)
}

/// How many outputs are outside their bound (or NaN where the reference is not, or the
/// reverse).
pub fn mismatches(got: &[f32], want: &[f32], bound: &[f64]) -> usize {
    got.iter()
        .zip(want)
        .zip(bound)
        .filter(|((g, w), b)| {
            if g.is_nan() || w.is_nan() {
                g.is_nan() != w.is_nan()
            } else {
                f64::from((**g - **w).abs()) > **b
            }
        })
        .count()
        + got.len().abs_diff(want.len())
}

fn check(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
) -> Result<(), String> {
    let held = if m * n == 0 {
        Some(usize::MAX)
    } else {
        w.rows(k)
    };
    if a.len() != m * k || held.is_none_or(|rows| row0 + n > rows) {
        return Err(format!(
            "dense gemm {m}x{n}x{k} at row {row0}: {} activations, a weight of {held:?} rows",
            a.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_k_in_whole_slices_and_depend_on_the_shape_alone() {
        for (m, n, k, sms) in [
            (1usize, 1024usize, 4096usize, 132usize),
            (32, 2048, 4096, 132),
            (32, 32768, 1024, 132),
            (2048, 4096, 4096, 132),
            (3, 7, 0, 132),
            (5, 70, 33, 1),
            (64, 129_280, 4096, 170),
        ] {
            let (splits, per) = splits(m, n, k, sms);
            assert!(splits >= 1 && per.is_multiple_of(SLICE), "{m}x{n}x{k}");
            assert!(
                splits * per >= k && (splits - 1) * per < k.max(1),
                "{m}x{n}x{k}"
            );
            assert!(splits == 1 || per >= MIN_SPLIT_COLS, "{m}x{n}x{k}");
            assert_eq!((splits, per), super::splits(m, n, k, sms));
        }
        // A decode step of a small linear splits (few tiles); a prefill chunk does not.
        assert!(splits(32, 1024, 4096, 132).0 > 1);
        assert_eq!(splits(2048, 4096, 4096, 132).0, 1);
    }

    #[test]
    fn the_reference_reads_both_forms_and_refuses_a_short_weight() {
        // W = [[1, 2], [3, -4]] as bf16; as FP8 codes 1.0 = 0x38, 2.0 = 0x40 with scale 0.5.
        let bf: Vec<u8> = [1.0f32, 2.0, 3.0, -4.0]
            .iter()
            .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
            .collect();
        let a = [1.0f32, 1.0, 2.0, -1.0];
        let c = reference(&a, DenseRows::Bf16(&bf), 0, (2, 2, 2)).unwrap();
        assert_eq!(c, vec![3.0, -1.0, 0.0, 10.0]);
        let codes = [0x38u8, 0x40, 0x40, 0x38];
        let fp8 = DenseRows::Fp8Block {
            codes: &codes,
            scales: &[0.5],
        };
        assert_eq!(reference(&a, fp8, 1, (2, 1, 2)).unwrap(), vec![1.5, 1.5]);
        assert!(reference(&a, fp8, 1, (2, 2, 2)).is_err());
        assert!(reference(&a[..3], fp8, 0, (2, 1, 2)).is_err());
        // NaN in, NaN out.
        let nan = [f32::NAN, 0.0];
        assert!(reference(&nan, fp8, 0, (1, 1, 2)).unwrap()[0].is_nan());
    }
}
