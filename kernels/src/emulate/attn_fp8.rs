//! `attn_decode_fp8.cu` on the CPU: the plan, then `attn_fp8_partial` block by block with its
//! shared memory as arrays, every warp's MMA registers loaded by the kernel's own index math and
//! multiplied through a model of `mma.sync.m16n8k16.row.col` (bf16 in, f32 out) that reads
//! them through the PTX fragment layout:
//!
//! - A (16 x 16, row-major): register `i` of lane `4 g + t` holds row `g + 8 (i % 2)`, columns
//!   `2 t + 8 (i / 2)` and the next, the lower column in the low half;
//! - B (16 x 8): register `i` holds rows `2 t + 8 i` and the next of column `g`;
//! - D (16 x 8, f32): `d0, d1` row `g`, columns `2 t, 2 t + 1`; `d2, d3` row `g + 8`;
//!
//! then `attn_fp8_combine`. A register loaded from the wrong head, row or dimension, a scale
//! taken from the wrong block or an accumulator stored to the wrong place makes this disagree
//! with [`crate::cpu::attn_decode_fp8`]; the tests plant such errors and see them caught.

use engine::formats::{bf16_to_f32, e4m3_to_f32, e8m0_to_f32, f32_to_bf16};

use super::mma_bf16::{Regs, mma_16816, pair};
use crate::attn_fp8::{Fp8AttnShape, THREADS, TILE, plan};

/// Which MMA a tamper hook sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mma {
    /// Queries times the tile's rows.
    Scores,
    /// Weights times the tile's rows.
    Output,
}

/// A deliberate error in the kernel's own math (not its fragments), for the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plant {
    None,
    /// Scale block by 32 values instead of 64.
    ScaleBlock,
    /// The softmax's two halves of the scores: only the first.
    OneHalf,
}

/// Hook that may alter a warp's registers before its MMA.
pub type Tamper<'a> = &'a dyn Fn(Mma, &mut Regs);

/// `row_value` of the kernel.
fn row_value(pool: &[u8], off: usize, d: usize, shape: &Fp8AttnShape, plant: Plant) -> f32 {
    let (nope, rope) = (shape.nope, shape.rope);
    if d < nope {
        let block = if plant == Plant::ScaleBlock {
            d / 32
        } else {
            d / 64
        };
        let scale = pool[off + nope + 2 * rope + block.min(nope.div_ceil(64) - 1)];
        return e4m3_to_f32(pool[off + d]) * e8m0_to_f32(scale);
    }
    let at = off + nope + 2 * (d - nope);
    bf16_to_f32(u16::from_le_bytes([pool[at], pool[at + 1]]))
}

/// `tile_score` of the kernel.
fn tile_score(s: &[f32], flag: &[u8; TILE], hp: usize, h: usize, j: usize, scale: f32) -> f32 {
    match flag[j] {
        1 => f32::NEG_INFINITY,
        2 => f32::NAN,
        _ => (s[h * TILE + j] + s[(hp + h) * TILE + j]) * scale,
    }
}

/// What one item leaves for the combine: per head m and l, per head and dim the accumulator.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

/// A launch's inputs (the arguments of [`crate::cpu::attn_decode_fp8`]).
pub(crate) struct Inputs<'a> {
    pub q: &'a [f32],
    pub pool: &'a [u8],
    pub row_offsets: &'a [i64],
    pub starts: &'a [i64],
    pub sinks: &'a [f32],
    pub shape: &'a Fp8AttnShape,
}

/// `attn_fp8_partial` for one item.
#[expect(
    clippy::too_many_lines,
    reason = "one kernel, phase by phase as in the .cu file"
)]
fn partial(
    inp: &Inputs<'_>,
    b: usize,
    tiles: (i64, i64),
    tamper: Tamper<'_>,
    plant: Plant,
) -> Partial {
    let shape = inp.shape;
    let (heads, dim) = (shape.heads, shape.dim());
    let (hp, dp) = (shape.padded_heads(), shape.padded_dim());
    let ldq = dp + 8;
    let ldp = TILE + 8;
    let mut q_s = vec![0u16; hp * ldq];
    let mut kv_s = vec![0u16; TILE * ldq];
    let mut s_s = vec![0f32; 2 * hp * TILE];
    let mut p_s = vec![0u16; hp * ldp];
    let mut m_s = vec![f32::NEG_INFINITY; hp];
    let mut l_s = vec![0f32; hp];
    let mut carry_s = vec![0f32; hp];
    let mut flag_s = [0u8; TILE];
    let first = inp.starts[b];
    let count = inp.starts[b + 1] - first;
    let lo = first + tiles.0 * TILE as i64;
    let hi = first + count.min(tiles.1 * TILE as i64);
    for i in 0..hp * dp {
        let (h, d) = (i / dp, i % dp);
        let v = if h < heads && d < dim {
            inp.q[(b * heads + h) * dim + d]
        } else {
            0.0
        };
        q_s[h * ldq + d] = f32_to_bf16(v);
    }
    let warps = THREADS / 32;
    let quarter = dp / 4;
    let n_tiles = dp / 32;
    // o[warp][tile][lane][k]
    let mut o = vec![vec![[[0f32; 4]; 32]; 16]; warps];
    let mut t0 = lo;
    while t0 < hi {
        let rows_here = TILE.min((hi - t0) as usize);
        for (j, flag) in flag_s.iter_mut().enumerate() {
            *flag = 1;
            if j < rows_here {
                let off = inp.row_offsets[(t0 + j as i64) as usize];
                *flag = if off >= 0 {
                    0
                } else if off == -1 {
                    1
                } else {
                    2
                };
            }
        }
        for i in 0..TILE * dp {
            let (j, d) = (i / dp, i % dp);
            let mut v = 0.0;
            if j < rows_here && d < dim {
                let off = inp.row_offsets[(t0 + j as i64) as usize];
                if off >= 0 {
                    v = row_value(inp.pool, off as usize, d, shape, plant);
                }
            }
            kv_s[j * ldq + d] = f32_to_bf16(v);
        }
        // Scores.
        for warp in 0..warps {
            let hb = warp / 4;
            if hb * 16 >= hp {
                continue;
            }
            let (nt, kh) = ((warp / 2) % 2, warp % 2);
            let mut acc = [[0f32; 4]; 32];
            let steps = dp / 32;
            for ks in kh * steps..(kh + 1) * steps {
                let mut regs: Regs = ([[0; 4]; 32], [[0; 2]; 32]);
                for lane in 0..32 {
                    let (g, tq) = (lane / 4, lane % 4);
                    let qa = (hb * 16 + g) * ldq;
                    let kb = (nt * 8 + g) * ldq;
                    let k0 = ks * 16 + 2 * tq;
                    regs.0[lane] = [
                        pair(&q_s, qa + k0),
                        pair(&q_s, qa + 8 * ldq + k0),
                        pair(&q_s, qa + k0 + 8),
                        pair(&q_s, qa + 8 * ldq + k0 + 8),
                    ];
                    regs.1[lane] = [pair(&kv_s, kb + k0), pair(&kv_s, kb + k0 + 8)];
                }
                tamper(Mma::Scores, &mut regs);
                mma_16816(&regs, &mut acc);
            }
            let half = kh * hp * TILE;
            for (lane, d) in acc.iter().enumerate() {
                let (g, tq) = (lane / 4, lane % 4);
                let (r, c) = (hb * 16 + g, nt * 8 + 2 * tq);
                s_s[half + r * TILE + c] = d[0];
                s_s[half + r * TILE + c + 1] = d[1];
                s_s[half + (r + 8) * TILE + c] = d[2];
                s_s[half + (r + 8) * TILE + c + 1] = d[3];
            }
        }
        if plant == Plant::OneHalf {
            s_s[hp * TILE..].fill(0.0);
        }
        // Online softmax, one thread per head.
        for h in 0..hp {
            let m_old = m_s[h];
            let mut m_new = m_old;
            for j in 0..TILE {
                let s = tile_score(&s_s, &flag_s, hp, h, j, shape.scale);
                m_new = if s.is_nan() || m_new.is_nan() {
                    f32::NAN
                } else {
                    m_new.max(s)
                };
            }
            let carry = if m_old == f32::NEG_INFINITY {
                0.0
            } else {
                (m_old - m_new).exp()
            };
            let mut sum = 0f32;
            for j in 0..TILE {
                let s = tile_score(&s_s, &flag_s, hp, h, j, shape.scale);
                let p = if s == f32::NEG_INFINITY {
                    0.0
                } else {
                    (s - m_new).exp()
                };
                let pb = f32_to_bf16(p);
                p_s[h * ldp + j] = pb;
                sum += bf16_to_f32(pb);
            }
            l_s[h] = l_s[h] * carry + sum;
            carry_s[h] = carry;
            m_s[h] = m_new;
        }
        // Output.
        for (warp, o_warp) in o.iter_mut().enumerate() {
            let hb = warp / 4;
            if hb * 16 >= hp {
                continue;
            }
            let col0 = (warp % 4) * quarter;
            for (i, acc) in o_warp.iter_mut().enumerate().take(n_tiles) {
                let mut regs: Regs = ([[0; 4]; 32], [[0; 2]; 32]);
                for (lane, d) in acc.iter_mut().enumerate() {
                    let (g, tq) = (lane / 4, lane % 4);
                    let (c_lo, c_hi) = (carry_s[hb * 16 + g], carry_s[hb * 16 + g + 8]);
                    let pa = (hb * 16 + g) * ldp + 2 * tq;
                    regs.0[lane] = [
                        pair(&p_s, pa),
                        pair(&p_s, pa + 8 * ldp),
                        pair(&p_s, pa + 8),
                        pair(&p_s, pa + 8 * ldp + 8),
                    ];
                    let col = col0 + i * 8 + g;
                    let v = |j: usize| u32::from(kv_s[j * ldq + col]);
                    regs.1[lane] = [
                        v(2 * tq) | (v(2 * tq + 1) << 16),
                        v(2 * tq + 8) | (v(2 * tq + 9) << 16),
                    ];
                    d[0] *= c_lo;
                    d[1] *= c_lo;
                    d[2] *= c_hi;
                    d[3] *= c_hi;
                }
                tamper(Mma::Output, &mut regs);
                mma_16816(&regs, acc);
            }
        }
        t0 += TILE as i64;
    }
    let mut acc_out = vec![f32::NAN; heads * dim];
    for (warp, o_warp) in o.iter().enumerate() {
        let hb = warp / 4;
        if hb * 16 >= hp {
            continue;
        }
        let col0 = (warp % 4) * quarter;
        for (i, tile) in o_warp.iter().enumerate().take(n_tiles) {
            for (lane, d) in tile.iter().enumerate() {
                let (g, tq) = (lane / 4, lane % 4);
                let c = col0 + i * 8 + 2 * tq;
                for (k, &v) in d.iter().enumerate() {
                    let (r, cc) = (hb * 16 + g + (k / 2) * 8, c + k % 2);
                    if r < heads && cc < dim {
                        acc_out[r * dim + cc] = v;
                    }
                }
            }
        }
    }
    Partial {
        m: m_s[..heads].to_vec(),
        l: l_s[..heads].to_vec(),
        acc: acc_out,
    }
}

/// `attn_fp8_combine` for one (request, head) over its items.
fn combine(parts: &[Partial], h: usize, sink: f32, dim: usize) -> Vec<f32> {
    if sink.is_nan() || parts.iter().any(|p| p.m[h].is_nan() || p.l[h].is_nan()) {
        return vec![f32::NAN; dim];
    }
    let live: Vec<&Partial> = parts
        .iter()
        .filter(|p| p.m[h] != f32::NEG_INFINITY)
        .collect();
    let big = parts.iter().fold(sink, |b, p| b.max(p.m[h]));
    let mut denom = (sink - big).exp();
    for p in &live {
        denom += p.l[h] * (p.m[h] - big).exp();
    }
    (0..dim)
        .map(|d| {
            let mut v = 0f32;
            for p in &live {
                v += p.acc[h * dim + d] * (p.m[h] - big).exp();
            }
            v / denom
        })
        .collect()
}

/// The three kernels with a tamper hook and a planted error (tests).
pub(crate) fn attn_with(inputs: &Inputs<'_>, tamper: Tamper<'_>, plant: Plant) -> Vec<f32> {
    let (starts, shape) = (inputs.starts, inputs.shape);
    let batch = starts.len().saturating_sub(1);
    let (items, split_starts) = plan(starts, shape.parts);
    assert!(
        items.len() <= shape.capacity(batch),
        "plan past its capacity"
    );
    let parts: Vec<Partial> = items
        .iter()
        .map(|it| partial(inputs, it.request, (it.lo, it.hi), tamper, plant))
        .collect();
    let mut out = Vec::with_capacity(batch * shape.heads * shape.dim());
    for b in 0..batch {
        let mine = &parts[split_starts[b]..split_starts[b + 1]];
        for (h, &sink) in inputs.sinks.iter().enumerate() {
            out.extend(combine(mine, h, sink, shape.dim()));
        }
    }
    out
}

/// `attn_decode_fp8.cu`'s three kernels over the arguments of [`crate::cpu::attn_decode_fp8`].
pub fn attn_decode_fp8(
    q: &[f32],
    pool: &[u8],
    row_offsets: &[i64],
    starts: &[i64],
    sinks: &[f32],
    shape: &Fp8AttnShape,
) -> Vec<f32> {
    let inputs = Inputs {
        q,
        pool,
        row_offsets,
        starts,
        sinks,
        shape,
    };
    attn_with(&inputs, &|_, _| {}, Plant::None)
}

#[cfg(test)]
mod tests;
