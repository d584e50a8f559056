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

fn pre_from_mixes(x: &[f32], mixes: &[f32], w: &HyperWeights, c: &ModelConfig) -> (Mix, Vec<f32>) {
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
    normalize_columns(&mut comb, hc, eps);
    for _ in 1..c.hc_sinkhorn_iters {
        normalize_rows(&mut comb, hc, eps);
        normalize_columns(&mut comb, hc, eps);
    }
    let mut collapsed = vec![0.0f32; d];
    for (i, stream) in x.chunks_exact(d).enumerate() {
        for (o, v) in collapsed.iter_mut().zip(stream) {
            *o += pre[i] * v;
        }
    }
    (Mix { post, comb }, collapsed)
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
    let d = y.len();
    let mut out = vec![0.0f32; hc * d];
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
    out
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
