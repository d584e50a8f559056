//! Rotary position embedding as DeepSeek-V4 uses it: interleaved pairs `(2i, 2i+1)` on the
//! trailing `rope_dim` dims of a vector, one table per rope kind. "main" (sliding-only layers)
//! is plain RoPE at `rope_theta`; "compress" (CSA/HCA layers, their compressors and the
//! indexer) uses `compress_rope_theta` with YaRN and attention factor 1. Frequencies are
//! computed in f32 the way `transformers` computes them, so angles agree to the last bits.

use crate::config::{ModelConfig, Yarn};

/// Inverse frequencies of one rope kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Plain RoPE: `1 / base^(2i/dim)`.
    pub fn plain(base: f64, dim: usize) -> Self {
        Self {
            inv_freq: pos_freqs(base, dim).iter().map(|p| 1.0 / p).collect(),
        }
    }

    /// YaRN-blended frequencies (`transformers`' `_compute_yarn_parameters`, truncate = true).
    pub fn yarn(base: f64, dim: usize, yarn: &Yarn) -> Self {
        let pos = pos_freqs(base, dim);
        let correction_dim = |rotations: f64| {
            (dim as f64
                * (yarn.original_max_position_embeddings
                    / (rotations * 2.0 * std::f64::consts::PI))
                    .ln())
                / (2.0 * base.ln())
        };
        let low = correction_dim(yarn.beta_fast).floor().max(0.0);
        let mut high = correction_dim(yarn.beta_slow).ceil().min(dim as f64 - 1.0);
        if (high - low).abs() < f64::EPSILON {
            high += 0.001;
        }
        let factor = yarn.factor as f32;
        let inv_freq = pos
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extrapolation_factor = 1.0 - ramp;
                let interpolation = 1.0 / (factor * p);
                let extrapolation = 1.0 / p;
                interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
            })
            .collect();
        Self { inv_freq }
    }

    /// The two tables of a model: (main, compress).
    pub fn tables(config: &ModelConfig) -> (Rope, Rope) {
        let main = Rope::plain(config.rope_theta, config.rope_dim);
        let compress = match &config.yarn {
            Some(yarn) => Rope::yarn(config.compress_rope_theta, config.rope_dim, yarn),
            None => Rope::plain(config.compress_rope_theta, config.rope_dim),
        };
        (main, compress)
    }

    pub fn rope_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Rotates the trailing `rope_dim` dims of `x` to `position` (`inverse`: by `-position`,
    /// i.e. with `-sin`, which undoes a rotation).
    pub fn apply(&self, x: &mut [f32], position: usize, inverse: bool) {
        self.at(position).apply(x, inverse);
    }

    /// The rotation for one position, to apply to many vectors (every head of a token) without
    /// recomputing its sines and cosines.
    pub fn at(&self, position: usize) -> RopeAt {
        let pos = position as f32;
        RopeAt {
            sin_cos: self
                .inv_freq
                .iter()
                .map(|&inv| {
                    let angle = pos * inv;
                    (angle.sin(), angle.cos())
                })
                .collect(),
        }
    }
}

/// One position's rotation (see [`Rope::at`]).
#[derive(Debug, Clone)]
pub struct RopeAt {
    sin_cos: Vec<(f32, f32)>,
}

impl RopeAt {
    /// The (sin, cos) of each rotated pair's angle (a device rotates with these values).
    pub fn sin_cos(&self) -> &[(f32, f32)] {
        &self.sin_cos
    }

    /// Rotates the trailing dims of `x` (`inverse`: backwards).
    pub fn apply(&self, x: &mut [f32], inverse: bool) {
        let start = x.len() - self.sin_cos.len() * 2;
        for (i, &(sin, cos)) in self.sin_cos.iter().enumerate() {
            let sin = if inverse { -sin } else { sin };
            let (a, b) = (x[start + 2 * i], x[start + 2 * i + 1]);
            x[start + 2 * i] = a * cos - b * sin;
            x[start + 2 * i + 1] = b * cos + a * sin;
        }
    }
}

/// `base ** (arange(0, dim, 2) / dim)` in f32.
fn pos_freqs(base: f64, dim: usize) -> Vec<f32> {
    let base = base as f32;
    (0..dim / 2)
        .map(|i| base.powf((2 * i) as f32 / dim as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_then_inverse_is_identity_and_norm_preserving() {
        let rope = Rope::plain(10_000.0, 8);
        let orig: Vec<f32> = (0..12).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut x = orig.clone();
        rope.apply(&mut x, 1234, false);
        assert_eq!(x[..4], orig[..4], "leading dims untouched");
        let n0: f32 = orig[4..].iter().map(|v| v * v).sum();
        let n1: f32 = x[4..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        rope.apply(&mut x, 1234, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    #[test]
    fn position_zero_is_identity_and_pairs_are_interleaved() {
        let rope = Rope::plain(10_000.0, 4);
        let mut x = vec![1.0, 0.0, 1.0, 0.0];
        rope.apply(&mut x, 0, false);
        assert_eq!(x, vec![1.0, 0.0, 1.0, 0.0]);
        // First pair rotates at inv_freq 1: angle = position.
        rope.apply(&mut x, 1, false);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_scales_low_ones() {
        let yarn = Yarn {
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let plain = Rope::plain(160_000.0, 64);
        let scaled = Rope::yarn(160_000.0, 64, &yarn);
        assert!((scaled.inv_freq[0] - plain.inv_freq[0]).abs() < 1e-9);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 16.0).abs() < 1e-12);
    }
}
