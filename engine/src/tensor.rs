//! The few dense f32 primitives the CPU reference needs. Every reduction runs in a fixed order
//! per output element, so a token's result never depends on what else is computed with it
//! (batch invariance) or on how a prompt was chunked.

mod gemm;
pub mod rows;
mod weight;

pub use gemm::{dot, dots, dots_source};
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
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `torch.nn.functional.softplus` with beta 1 and threshold 20.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    // Element-wise (a multiply, then an add: no fused multiply-add), so the vector width does
    // not change any bit; the AVX2 build of the same loop is only faster.
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { axpy_avx2(y, a, x) };
            return;
        }
    }
    axpy_portable(y, a, x);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_portable(y, a, x);
}

#[expect(
    clippy::inline_always,
    reason = "must inline into the AVX2 wrapper to be compiled with its features"
)]
#[inline(always)]
fn axpy_portable(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
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
