//! Manifold-constrained hyper-connections: `hc` residual streams collapsed into one sublayer
//! input (`pre`), the sublayer output expanded back (`post`), and the streams mixed by a
//! Sinkhorn-normalised doubly-stochastic matrix (`comb`).

use crate::{
    config::ModelConfig,
    tensor::{dot, rms_norm_unweighted, sigmoid, softmax},
    weights::{HeadWeights, HyperWeights},
};

/// Mixing weights computed from one token's streams.
#[derive(Debug, Clone)]
pub struct Mix {
    /// `[hc]`: weight of each stream in the expanded sublayer output.
    pub post: Vec<f32>,
    /// `[hc][hc]` row-major: `comb[j][k]` is how much input stream j feeds output stream k.
    pub comb: Vec<f32>,
}

/// Computes (mix, collapsed input) for the streams `x` (`hc * D`, stream-major).
pub fn pre(x: &[f32], w: &HyperWeights, c: &ModelConfig) -> (Mix, Vec<f32>) {
    let mut flat = x.to_vec();
    rms_norm_unweighted(&mut flat, c.rms_norm_eps);
    let mixes = w.mix.apply(&flat);
    pre_from_mixes(x, &mixes, w, c)
}

/// [`pre`] for every token of a batch (bit-identical; the mixing projection reads each weight
/// row once per block of tokens).
pub fn pre_many(xs: &[Vec<f32>], w: &HyperWeights, c: &ModelConfig) -> Vec<(Mix, Vec<f32>)> {
    use rayon::prelude::*;
    let flats: Vec<Vec<f32>> = xs
        .par_iter()
        .map(|x| {
            let mut flat = x.clone();
            rms_norm_unweighted(&mut flat, c.rms_norm_eps);
            flat
        })
        .collect();
    let mixes = w.mix.apply_many(&flats);
    xs.par_iter()
        .zip(&mixes)
        .map(|(x, m)| pre_from_mixes(x, m, w, c))
        .collect()
}

/// [`pre`] from the mixing projection's outputs `mixes` (`(2 + hc) * hc` values) of the normed streams.
pub fn pre_from_mixes(
    x: &[f32],
    mixes: &[f32],
    w: &HyperWeights,
    c: &ModelConfig,
) -> (Mix, Vec<f32>) {
    let hc = c.hc_mult;
    let d = x.len() / hc;
    let eps = c.hc_eps;
    let pre: Vec<f32> = (0..hc)
        .map(|i| sigmoid(mixes[i] * w.scale[0] + w.base[i]) + eps)
        .collect();
    let post: Vec<f32> = (0..hc)
        .map(|i| 2.0 * sigmoid(mixes[hc + i] * w.scale[1] + w.base[hc + i]))
        .collect();
    let mut comb: Vec<f32> = (0..hc * hc)
        .map(|i| mixes[2 * hc + i] * w.scale[2] + w.base[2 * hc + i])
        .collect();
    for row in comb.chunks_exact_mut(hc) {
        softmax(row);
        for v in row.iter_mut() {
            *v += eps;
        }
    }
    if hc == 4 {
        sinkhorn4(&mut comb, eps, c.hc_sinkhorn_iters);
    } else {
        normalize_columns(&mut comb, hc, eps);
        for _ in 1..c.hc_sinkhorn_iters {
            normalize_rows(&mut comb, hc, eps);
            normalize_columns(&mut comb, hc, eps);
        }
    }
    let mut collapsed = vec![0.0f32; d];
    for (i, stream) in x.chunks_exact(d).enumerate() {
        for (o, v) in collapsed.iter_mut().zip(stream) {
            *o += pre[i] * v;
        }
    }
    (Mix { post, comb }, collapsed)
}

/// The column, then `iters - 1` times row and column normalisations of a 4x4 `comb`, as
/// [`normalize_rows`] and [`normalize_columns`] do them (the same sums in the same order, the
/// same divisions), on fixed-size arrays so that a column's four divisions are one vector
/// division: the Sinkhorn loop is most of a token's mixing cost.
fn sinkhorn4(comb: &mut [f32], eps: f32, iters: usize) {
    let mut m = [[0.0f32; 4]; 4];
    for (row, values) in m.iter_mut().zip(comb.chunks_exact(4)) {
        row.copy_from_slice(values);
    }
    let columns = |m: &mut [[f32; 4]; 4]| {
        let sums: [f32; 4] =
            std::array::from_fn(|col| m.iter().map(|row| row[col]).sum::<f32>() + eps);
        for row in m.iter_mut() {
            for (v, sum) in row.iter_mut().zip(sums) {
                *v /= sum;
            }
        }
    };
    columns(&mut m);
    for _ in 1..iters {
        for row in &mut m {
            let sum = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= sum;
            }
        }
        columns(&mut m);
    }
    for (values, row) in comb.chunks_exact_mut(4).zip(m) {
        values.copy_from_slice(&row);
    }
}

fn normalize_rows(m: &mut [f32], hc: usize, eps: f32) {
    for row in m.chunks_exact_mut(hc) {
        let sum: f32 = row.iter().sum::<f32>() + eps;
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
}

fn normalize_columns(m: &mut [f32], hc: usize, eps: f32) {
    for col in 0..hc {
        let sum: f32 = (0..hc).map(|r| m[r * hc + col]).sum::<f32>() + eps;
        for r in 0..hc {
            m[r * hc + col] /= sum;
        }
    }
}

/// New streams: `out[k] = post[k] * y + Σ_j comb[j][k] * x[j]`.
pub fn post(x: &[f32], y: &[f32], mix: &Mix, hc: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; hc * y.len()];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU supports AVX (checked just above).
            unsafe { post_avx(x, y, mix, hc, &mut out) };
            return out;
        }
    }
    post_into(x, y, mix, hc, &mut out);
    out
}

/// [`post_into`] compiled for 256-bit registers (element-wise, so the same bits).
///
/// # Safety
/// The CPU supports AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn post_avx(x: &[f32], y: &[f32], mix: &Mix, hc: usize, out: &mut [f32]) {
    post_into(x, y, mix, hc, out);
}

#[allow(clippy::inline_always, reason = "must inline into its AVX caller")]
#[inline(always)]
fn post_into(x: &[f32], y: &[f32], mix: &Mix, hc: usize, out: &mut [f32]) {
    let d = y.len();
    for k in 0..hc {
        let o = &mut out[k * d..(k + 1) * d];
        for (oi, yi) in o.iter_mut().zip(y) {
            *oi = mix.post[k] * yi;
        }
        for j in 0..hc {
            let c = mix.comb[j * hc + k];
            for (oi, xi) in o.iter_mut().zip(&x[j * d..(j + 1) * d]) {
                *oi += c * xi;
            }
        }
    }
}

/// The final collapse of the streams (before the output norm).
pub fn head(x: &[f32], w: &HeadWeights, c: &ModelConfig) -> Vec<f32> {
    let hc = c.hc_mult;
    let d = x.len() / hc;
    let mut flat = x.to_vec();
    rms_norm_unweighted(&mut flat, c.rms_norm_eps);
    let mut out = vec![0.0f32; d];
    for (i, stream) in x.chunks_exact(d).enumerate() {
        let m = dot(w.mix.row(i), &flat);
        let p = sigmoid(m * w.scale + w.base[i]) + c.hc_eps;
        for (o, v) in out.iter_mut().zip(stream) {
            *o += p * v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 4x4 Sinkhorn gives the generic loop's bits, including NaN where an entry is NaN.
    #[test]
    fn sinkhorn4_matches_the_generic_normalisation() {
        for seed in 0..50u32 {
            let mut m: Vec<f32> = (0..16)
                .map(|i| ((i * 7 + seed * 13) as f32 * 0.61).sin().abs() + 1e-3)
                .collect();
            if seed == 7 {
                m[5] = f32::NAN;
            }
            let (eps, iters) = (1e-6, 1 + seed as usize % 20);
            let mut generic = m.clone();
            normalize_columns(&mut generic, 4, eps);
            for _ in 1..iters {
                normalize_rows(&mut generic, 4, eps);
                normalize_columns(&mut generic, 4, eps);
            }
            sinkhorn4(&mut m, eps, iters);
            for (a, b) in m.iter().zip(&generic) {
                assert!(crate::tensor::same_value(*a, *b), "seed {seed}");
            }
            assert_eq!(seed == 7, m.iter().any(|v| v.is_nan()));
        }
    }
}
