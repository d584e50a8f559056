//! The few dense f32 primitives the CPU reference needs. Every reduction runs in a fixed order
//! per output element, so a token's result never depends on what else is computed with it
//! (batch invariance) or on how a prompt was chunked.

mod exp;
mod gemm;
mod log1p;
pub mod rows;
mod weight;

pub use exp::{exp, exp_in_place};
pub use gemm::{dot, dots, dots_source};
pub use log1p::ln_1p;
pub use weight::{SharedBytes, Weight, WeightForm};

/// Multiply-adds below which a product runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// A row-major f32 matrix; linear weights are `[out, in]` as in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    /// A matrix from data of length `rows * cols` (checked by the caller that built it).
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        Self { rows, cols, data }
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self::new(rows, cols, vec![0.0; rows * cols])
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// `out = self · x` (`x` has `cols` elements, `out` has `rows`).
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.rows);
        let y = self.rows_times(0, self.rows, &[x]);
        out.copy_from_slice(&y);
    }

    /// `self · x` for several vectors at once (each weight row is read once per block of
    /// vectors). Each output is the same [`dot`] whatever else is computed with it, so results
    /// are bit-identical to one-at-a-time.
    pub fn apply_many<V: AsRef<[f32]> + Sync>(&self, xs: &[V]) -> Vec<Vec<f32>> {
        self.apply_rows_many(0, self.rows, xs)
    }

    /// Rows `r0..r0+n` of `self` times each of `xs` (grouped projections).
    pub fn apply_rows_many<V: AsRef<[f32]> + Sync>(
        &self,
        r0: usize,
        n: usize,
        xs: &[V],
    ) -> Vec<Vec<f32>> {
        let refs: Vec<&[f32]> = xs.iter().map(AsRef::as_ref).collect();
        let flat = self.rows_times(r0, n, &refs);
        if n == 0 {
            return vec![Vec::new(); xs.len()];
        }
        flat.chunks_exact(n).map(<[f32]>::to_vec).collect()
    }

    /// `self · x` as a new vector.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        self.rows_times(0, self.rows, &[x])
    }

    /// `out = self[rows r0..r0+n] · x`: a slice of output rows (grouped projections).
    pub fn matvec_rows(&self, r0: usize, x: &[f32], out: &mut [f32]) {
        let y = self.rows_times(r0, out.len(), &[x]);
        out.copy_from_slice(&y);
    }

    /// Rows `r0..r0+n` times every vector, vector-major (`out[v * n + r]`).
    fn rows_times(&self, r0: usize, n: usize, xs: &[&[f32]]) -> Vec<f32> {
        let src = rows::F32Rows {
            rows: |r| self.row(r),
            cols: self.cols,
        };
        rows_times(&src, r0, n, xs)
    }
}

/// Rows `r0..r0+n` of `src` times every vector, vector-major (`out[v * n + r]`). Large
/// products are split into (rows × vectors) tiles over threads; the split does not change any
/// output.
pub(crate) fn rows_times<S: rows::RowSource>(
    src: &S,
    r0: usize,
    n: usize,
    xs: &[&[f32]],
) -> Vec<f32> {
    use rayon::prelude::*;
    for x in xs {
        assert_eq!(x.len(), src.cols(), "vector length vs matrix columns");
    }
    let mut out = vec![0.0f32; n * xs.len()];
    if n * xs.len() * src.cols() < PARALLEL_MIN_WORK {
        dots_source(src, r0, n, xs, &mut out);
        return out;
    }
    let (rows_per_task, vectors_per_task) = gemm::task_shape();
    let tiles: Vec<(usize, usize)> = (0..n)
        .step_by(rows_per_task)
        .flat_map(|r| (0..xs.len()).step_by(vectors_per_task).map(move |v| (r, v)))
        .collect();
    let results: Vec<Vec<f32>> = tiles
        .par_iter()
        .map(|&(r, v)| {
            let nr = rows_per_task.min(n - r);
            let vs = &xs[v..xs.len().min(v + vectors_per_task)];
            let mut tile = vec![0.0f32; nr * vs.len()];
            dots_source(src, r0 + r, nr, vs, &mut tile);
            tile
        })
        .collect();
    for (&(r, v), tile) in tiles.iter().zip(&results) {
        let nr = rows_per_task.min(n - r);
        for (j, part) in tile.chunks_exact(nr).enumerate() {
            out[(v + j) * n + r..(v + j) * n + r + nr].copy_from_slice(part);
        }
    }
    out
}

/// `x * rsqrt(mean(x²) + eps)`, the weightless RMS norm, in place.
pub fn rms_norm_unweighted(x: &mut [f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// `weight ⊙ (x * rsqrt(mean(x²) + eps))`, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), weight.len());
    let scale = rms_scale(x, eps);
    for (v, w) in x.iter_mut().zip(weight) {
        *v = w * (*v * scale);
    }
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mean = dot(x, x) / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `torch.nn.functional.softplus` with beta 1 and threshold 20, from the engine's own `exp`
/// and `ln_1p` (so a device computes the same bits).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { ln_1p(exp(x)) }
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = exp(*v - max);
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_many(y, &[a], |_| x);
}

/// `y += Σ_k a[k] * x(k)`: for every element, the products added one at a time in key order,
/// each a multiply and then an add (no fused multiply-add), exactly as one [`axpy`] per key
/// gives. The vector build keeps a block of `y` in registers across all keys, so the vector
/// width and the blocking do not change any bit.
pub fn axpy_many<'x>(y: &mut [f32], a: &[f32], x: impl Fn(usize) -> &'x [f32]) {
    for k in 0..a.len() {
        assert_eq!(x(k).len(), y.len(), "row {k} length");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); every row has y.len()
            // elements (checked above).
            unsafe { axpy_many_avx2(y, a, &x) };
            return;
        }
    }
    for (k, &ak) in a.iter().enumerate() {
        for (yi, xi) in y.iter_mut().zip(x(k)) {
            *yi += ak * xi;
        }
    }
}

/// [`axpy_many`] on 256-bit registers, 64 elements of `y` at a time, then 8 at a time.
///
/// # Safety
/// The CPU supports AVX2 and every `x(k)` has `y.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn axpy_many_avx2<'x>(y: &mut [f32], a: &[f32], x: &impl Fn(usize) -> &'x [f32]) {
    let n = y.len();
    let mut c0 = 0;
    while c0 + 64 <= n {
        // SAFETY: c0 + 64 <= n (loop condition); AVX2 (this function's features).
        unsafe { axpy_block_avx2::<8>(y, c0, a, x) };
        c0 += 64;
    }
    while c0 + 8 <= n {
        // SAFETY: c0 + 8 <= n (loop condition); AVX2 (this function's features).
        unsafe { axpy_block_avx2::<1>(y, c0, a, x) };
        c0 += 8;
    }
    for (k, &ak) in a.iter().enumerate() {
        for (yi, xi) in y[c0..].iter_mut().zip(&x(k)[c0..]) {
            *yi += ak * xi;
        }
    }
}

/// Elements `c0..c0 + 8 * R` of [`axpy_many`], held in `R` registers across every key.
///
/// # Safety
/// The CPU supports AVX2, `c0 + 8 * R <= y.len()` and every `x(k)` has `y.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn axpy_block_avx2<'x, const R: usize>(
    y: &mut [f32],
    c0: usize,
    a: &[f32],
    x: &impl Fn(usize) -> &'x [f32],
) {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_storeu_ps,
    };
    debug_assert!(c0 + 8 * R <= y.len());
    let mut acc: [__m256; R] = [_mm256_set1_ps(0.0); R];
    for (j, acc) in acc.iter_mut().enumerate() {
        // SAFETY: c0 + 8 * (j + 1) <= y.len() (caller); unaligned load.
        *acc = unsafe { _mm256_loadu_ps(y.as_ptr().add(c0 + 8 * j)) };
    }
    for (k, &ak) in a.iter().enumerate() {
        let (scale, row) = (_mm256_set1_ps(ak), x(k).as_ptr());
        for (j, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the row has y.len() elements (caller); unaligned load.
            let v = unsafe { _mm256_loadu_ps(row.add(c0 + 8 * j)) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(scale, v));
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: as for the loads.
        unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(c0 + 8 * j), *acc) };
    }
}

/// Equal bits, or both NaN whatever their payloads: how tests compare a fast path with its
/// definition.
#[cfg(test)]
pub(crate) fn same_value(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Indices of the `k` largest values, best first; ties go to the lower index so the choice is
/// deterministic.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The register-blocked sum gives what one portable `y += a * x` per key gives, bit for
    /// bit, at lengths around its 8- and 64-element blocks; NaN in a row gives NaN there.
    #[test]
    fn axpy_many_matches_one_axpy_per_key() {
        for n in [0usize, 3, 8, 13, 64, 67, 130, 512] {
            let rows: Vec<Vec<f32>> = (0..9)
                .map(|k| {
                    (0..n)
                        .map(|i| ((i * 7 + k * 3) as f32 * 0.37).sin())
                        .collect()
                })
                .collect();
            let a: Vec<f32> = (0..9).map(|k| (k as f32 * 1.3).cos() / 3.0).collect();
            let start: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            let mut expected = start.clone();
            for (k, row) in rows.iter().enumerate() {
                for (y, x) in expected.iter_mut().zip(row) {
                    *y += a[k] * x;
                }
            }
            let mut got = start.clone();
            axpy_many(&mut got, &a, |k| &rows[k]);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&expected), "n {n}");
            if n > 0 {
                let mut poisoned = rows.clone();
                poisoned[4][n - 1] = f32::NAN;
                let mut got = start.clone();
                axpy_many(&mut got, &a, |k| &poisoned[k]);
                assert!(got[n - 1].is_nan() && got[..n - 1].iter().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn norms_and_activations() {
        let mut x = vec![3.0, 4.0];
        rms_norm_unweighted(&mut x, 0.0);
        let rms = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / rms).abs() < 1e-6 && (x[1] - 4.0 / rms).abs() < 1e-6);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert!((softplus(30.0) - 30.0).abs() < f32::EPSILON);
        let mut s = vec![1.0, 1.0, f32::NEG_INFINITY];
        softmax(&mut s);
        assert_eq!(s, vec![0.5, 0.5, 0.0]);
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0], 3), vec![1, 2, 3]);
    }
}
