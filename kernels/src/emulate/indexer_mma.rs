//! `indexer.cu` `indexer_scores_mma` on the CPU: its grid and early exits, its staging of the
//! queries and of each tile of keys (bf16, zero padding), every warp's MMA registers loaded by
//! the kernel's own index math through the `mma.sync` model of [`super::mma_bf16`], the ReLU,
//! scale and head weights of each accumulator, the shuffle reduction over the eight row groups
//! (all lanes at once, as `__shfl_xor_sync` reads the values before any is updated), the sum
//! over head tiles and the store of lanes with `g = 0`. A wrong index or step in any of them
//! makes this disagree with [`crate::indexer_mma::reference`]; the tests plant such errors.

use engine::formats::f32_to_bf16;

use super::mma_bf16::{Regs, mma_16816, pair};
use crate::{
    indexer_mma::{KEYS, ScoreInputs, THREADS, TILES, grid, padded},
    step::kernels::ScoreSpec,
};

/// A deliberate error in the kernel's index math, to show the emulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// A's registers with the row half and the column half exchanged.
    AHalvesSwapped,
    /// B's second register 16 dims on instead of 8.
    BSecondPairFar,
    /// The high row half's head weighted with the low one's weight.
    OneWeight,
    /// The shuffle reduction stopping before the last step (xor 16).
    ShortReduction,
    /// The ReLU dropping a NaN (`fmaxf` alone).
    ReluDropsNan,
}

fn relu(x: f32, plant: Plant) -> f32 {
    if x.is_nan() && plant != Plant::ReluDropsNan {
        x
    } else {
        x.max(0.0)
    }
}

/// The launch with `plant` in its index math; `scores` as the kernel leaves them (positions
/// it does not write keep their value).
pub(super) fn scores_with(x: &ScoreInputs<'_>, spec: &ScoreSpec, scores: &mut [f32], plant: Plant) {
    let (heads, dim) = (spec.heads, spec.dim);
    let (heads_p, dim_p) = padded(heads, dim);
    let lds = dim_p + 8;
    let (groups, tokens) = grid(spec);
    let bits = |v: f32| f32_to_bf16(v);
    for b in 0..tokens {
        let n = x.visible[b].max(0) as usize;
        for group in 0..groups {
            let first = group * TILES * KEYS;
            if first >= n {
                continue;
            }
            let mut sq = vec![0u16; heads_p * lds];
            for e in 0..heads_p * dim_p {
                let (h, d) = (e / dim_p, e % dim_p);
                let v = if h < heads && d < dim {
                    x.q[(b * heads + h) * dim + d]
                } else {
                    0.0
                };
                sq[h * lds + d] = bits(v);
            }
            let start = x.starts[b] as usize;
            for tile in 0..TILES {
                let s0 = first + tile * KEYS;
                if s0 >= n {
                    break;
                }
                let mut sk = vec![0u16; KEYS * lds];
                for e in 0..KEYS * dim_p {
                    let (r, d) = (e / dim_p, e % dim_p);
                    let s = s0 + r;
                    let v = if s < n && d < dim {
                        x.keys[(start + s) * dim + d]
                    } else {
                        0.0
                    };
                    sk[r * lds + d] = bits(v);
                }
                for warp in 0..THREADS / 32 {
                    let n0 = warp * 16;
                    let mut total = [[[-0.0f32; 2]; 2]; 32];
                    for mt in 0..heads_p / 16 {
                        let mut acc = [[[0.0f32; 4]; 32]; 2];
                        for ks in (0..dim_p).step_by(16) {
                            for (j, acc_j) in acc.iter_mut().enumerate() {
                                let mut regs: Regs = ([[0; 4]; 32], [[0; 2]; 32]);
                                for lane in 0..32 {
                                    let (g, t) = (lane / 4, lane % 4);
                                    regs.0[lane] = std::array::from_fn(|i| {
                                        let (row_half, col_half) = if plant == Plant::AHalvesSwapped
                                        {
                                            (i / 2, i % 2)
                                        } else {
                                            (i % 2, i / 2)
                                        };
                                        let row = mt * 16 + g + 8 * row_half;
                                        pair(&sq, row * lds + ks + 2 * t + 8 * col_half)
                                    });
                                    let key = (n0 + 8 * j + g) * lds + ks + 2 * t;
                                    let far = if plant == Plant::BSecondPairFar {
                                        16
                                    } else {
                                        8
                                    };
                                    // A far pair past the row's padding reads the next row (or
                                    // zeros at the tile's end), as shared memory would.
                                    let second = sk
                                        .get(key + far..key + far + 2)
                                        .map_or(0, |p| u32::from(p[0]) | (u32::from(p[1]) << 16));
                                    regs.1[lane] = [pair(&sk, key), second];
                                }
                                mma_16816(&regs, acc_j);
                            }
                        }
                        let mut part = [[[0.0f32; 2]; 2]; 32];
                        for (lane, out) in part.iter_mut().enumerate() {
                            let g = lane / 4;
                            let (h_lo, h_hi) = (mt * 16 + g, mt * 16 + g + 8);
                            let weight = |h: usize| {
                                if h < heads { x.w[b * heads + h] } else { 0.0 }
                            };
                            let w_lo = weight(h_lo);
                            let w_hi = if plant == Plant::OneWeight {
                                w_lo
                            } else {
                                weight(h_hi)
                            };
                            for j in 0..2 {
                                for c in 0..2 {
                                    out[j][c] = relu(acc[j][lane][c], plant) * spec.scale * w_lo
                                        + relu(acc[j][lane][2 + c], plant) * spec.scale * w_hi;
                                }
                            }
                        }
                        let last = if plant == Plant::ShortReduction {
                            16
                        } else {
                            32
                        };
                        let mut off = 4;
                        while off < last {
                            let before = part;
                            for (lane, p) in part.iter_mut().enumerate() {
                                for j in 0..2 {
                                    for c in 0..2 {
                                        p[j][c] = before[lane][j][c] + before[lane ^ off][j][c];
                                    }
                                }
                            }
                            off <<= 1;
                        }
                        for (t, p) in total.iter_mut().zip(&part) {
                            for (tj, pj) in t.iter_mut().zip(p) {
                                for (tc, pc) in tj.iter_mut().zip(pj) {
                                    *tc += pc;
                                }
                            }
                        }
                    }
                    for (lane, t) in total.iter().enumerate().filter(|(l, _)| l / 4 == 0) {
                        for (j, tj) in t.iter().enumerate() {
                            for (c, &value) in tj.iter().enumerate() {
                                let s = s0 + n0 + 8 * j + 2 * (lane % 4) + c;
                                if s < n {
                                    scores[b * spec.max_keys + s] = value;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `indexer_scores_mma` as the kernel computes it: `[tokens, max_keys]`, NaN where it writes
/// nothing (past a token's visible keys).
pub fn indexer_scores_mma(x: &ScoreInputs<'_>, spec: &ScoreSpec) -> Vec<f32> {
    let mut scores = vec![f32::NAN; spec.tokens * spec.max_keys];
    scores_with(x, spec, &mut scores, Plant::None);
    scores
}

#[cfg(test)]
mod tests;
