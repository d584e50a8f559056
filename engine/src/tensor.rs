//! The few dense f32 primitives the CPU reference needs. Every reduction runs in a fixed order
//! per output element, so a token's result never depends on what else is computed with it
//! (batch invariance) or on how a prompt was chunked.

/// Matrices at least this large (elements) compute their rows on several threads.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 20;
/// Rows per parallel task.
const ROWS_PER_TASK: usize = 256;

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

    /// `out = self · x` (`x` has `cols` elements, `out` has `rows`). Large matrices split
    /// their rows over threads; each output is still one `dot` in the same order, so the result
    /// does not depend on the split.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        use rayon::prelude::*;
        debug_assert_eq!(x.len(), self.cols);
        debug_assert_eq!(out.len(), self.rows);
        if self.cols == 0 {
            out.fill(0.0);
            return;
        }
        if self.data.len() >= PARALLEL_MIN_ELEMENTS {
            out.par_chunks_mut(ROWS_PER_TASK)
                .zip(self.data.par_chunks(ROWS_PER_TASK * self.cols))
                .for_each(|(o, rows)| {
                    for (oi, row) in o.iter_mut().zip(rows.chunks_exact(self.cols)) {
                        *oi = dot(row, x);
                    }
                });
        } else {
            for (o, row) in out.iter_mut().zip(self.data.chunks_exact(self.cols)) {
                *o = dot(row, x);
            }
        }
    }

    /// `self · x` for several vectors at once, reading each weight row once for all of them
    /// (the big output head is memory-bound). Each output is the same `dot` as in `matvec`, so
    /// results are bit-identical to one-at-a-time.
    pub fn apply_many(&self, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        use rayon::prelude::*;
        if xs.len() <= 1 {
            return xs.iter().map(|x| self.apply(x)).collect();
        }
        let mut out = vec![0.0f32; xs.len() * self.rows];
        // out is row-major [rows][xs]: chunks of ROWS_PER_TASK weight rows per task.
        out.par_chunks_mut(ROWS_PER_TASK * xs.len())
            .enumerate()
            .for_each(|(task, chunk)| {
                let r0 = task * ROWS_PER_TASK;
                for (i, o) in chunk.chunks_exact_mut(xs.len()).enumerate() {
                    let row = self.row(r0 + i);
                    for (oi, x) in o.iter_mut().zip(xs) {
                        *oi = dot(row, x);
                    }
                }
            });
        (0..xs.len())
            .map(|t| (0..self.rows).map(|r| out[r * xs.len() + t]).collect())
            .collect()
    }

    /// `self · x` as a new vector.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; self.rows];
        self.matvec(x, &mut out);
        out
    }

    /// `out = self[rows r0..r0+n] · x`: a slice of output rows (grouped projections).
    pub fn matvec_rows(&self, r0: usize, x: &[f32], out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = dot(self.row(r0 + i), x);
        }
    }
}

/// Dot product with eight independent accumulators (vectorizes; fixed summation order). On
/// x86-64 with AVX2 the same code is compiled for 256-bit registers: the arithmetic per lane and
/// the summation order are identical (no fused multiply-add), so both paths give the same bits.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let chunks = n / 32;
    let mut acc: [__m256; 4] = [_mm256_setzero_ps(); 4];
    for i in 0..chunks {
        for (v, lane) in acc.iter_mut().enumerate() {
            let at = i * 32 + v * 8;
            // SAFETY: at + 8 <= chunks * 32 <= n, within both slices; unaligned loads.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(at)),
                    _mm256_loadu_ps(b.as_ptr().add(at)),
                )
            };
            // Multiply then add, as the portable lanes do (no fused multiply-add).
            *lane = _mm256_add_ps(*lane, _mm256_mul_ps(x, y));
        }
    }
    // The portable reduction's first two halvings, lane for lane: 0-15 += 16-31, 0-7 += 8-15.
    let low = _mm256_add_ps(acc[0], acc[2]);
    let high = _mm256_add_ps(acc[1], acc[3]);
    let sum8 = _mm256_add_ps(low, high);
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds exactly 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum8) };
    let mut tail = 0.0f32;
    for i in chunks * 32..n {
        tail += a[i] * b[i];
    }
    let mut width = 8;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
    }
    lanes[0] + tail
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    // 32 independent accumulators (four 8-lane vectors): one accumulator chain would stall on
    // the add latency. The order of every addition is fixed, whatever the vector width.
    const LANES: usize = 32;
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES;
    for i in 0..chunks {
        let (x, y) = (
            &a[i * LANES..(i + 1) * LANES],
            &b[i * LANES..(i + 1) * LANES],
        );
        for k in 0..LANES {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * LANES..a.len() {
        tail += a[i] * b[i];
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0] + tail
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
    fn dot_matches_naive_at_awkward_lengths() {
        for n in [0usize, 1, 7, 8, 9, 31, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            assert!((f64::from(dot(&a, &b)) - naive).abs() < 1e-5, "{n}");
        }
    }

    #[test]
    fn vector_and_portable_paths_agree_bit_for_bit() {
        for n in [1usize, 8, 13, 64, 1000] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 1.37).sin() * 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.71).cos() / 7.0).collect();
            assert_eq!(dot(&a, &b).to_bits(), dot_portable(&a, &b).to_bits(), "{n}");
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
