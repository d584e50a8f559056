//! `nvfp4_gemm_sm120.cu` on the CPU: the kernel's own index math (which bytes each lane loads
//! into which register, where each accumulator is stored) around a model of the block-scaled
//! `mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64` that reads its
//! operands through the fragment layout the kernel's header documents:
//!
//! - `a0`/`a1` hold K nibbles `[8 t0, 8 t0 + 8)` of rows `t1` / `t1 + 8`, `a2`/`a3` the same
//!   rows at K nibbles `32 + [8 t0, 8 t0 + 8)`; `b0`/`b1` those K ranges of column `t1`
//!   (lane = `4 t1 + t0`, 8 codes per register, the lowest nibble first);
//! - `sfa` of lane (`t1`, `t0` in {0, 1}) is the 4 e4m3 scales (K blocks of 16) of row
//!   `t1 + 8 t0`; `sfb` of lane (`t1`, 0) those of column `t1` (selectors 0);
//! - `d0, d1` are row `t1`, columns `2 t0, 2 t0 + 1`; `d2, d3` row `t1 + 8`.
//!
//! If the kernel loaded a register from the wrong row, K offset or scale byte, or stored an
//! accumulator to the wrong place, this emulation disagrees with [`crate::cpu::nvfp4_gemm_w4a4`];
//! the tests show it does when two lanes or the scale order are swapped. Whether the hardware
//! really lays fragments out this way is what the GPU test establishes on an sm_120 device.

use engine::formats::{e2m1_to_f32, e4m3_to_f32};

/// Rows and columns of the output a block computes; 4 warps of 16 rows by 64 columns.
const BLOCK_TILE: usize = 64;
const WARPS: usize = crate::cuda_constants::nvfp4_gemm_sm120::THREADS / 32;
/// n8 MMA tiles per warp along n.
const WARP_N_TILES: usize = crate::cuda_constants::nvfp4_gemm_sm120::WARP_N_TILES;
// The block's tile as the kernel writes it (64): 16 rows a warp, n8 tiles along the columns.
const _: () = assert!(BLOCK_TILE == WARPS * 16 && BLOCK_TILE == WARP_N_TILES * 8);

/// What one lane hands to one MMA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct LaneRegs {
    pub a: [u32; 4],
    pub b: [u32; 2],
    pub sfa: u32,
    pub sfb: u32,
}

/// Nibble `i` (0..8) of a register: the lowest first.
fn nibble(reg: u32, i: usize) -> u8 {
    ((reg >> (4 * i)) & 0xF) as u8
}

/// Byte `i` (0..4) of a register, little-endian as the loads assemble it.
fn byte(reg: u32, i: usize) -> u8 {
    reg.to_le_bytes()[i]
}

/// The MMA model: `acc[lane]` (`d0..d3`) += A · B over 64 K values, each operand value
/// `e2m1 · e4m3 scale` of its 16-wide K block, read through the documented layout.
fn mma_m16n8k64(lanes: &[LaneRegs; 32], acc: &mut [[f32; 4]; 32]) {
    let lane = |t1: usize, t0: usize| &lanes[4 * t1 + t0];
    let a = |r: usize, kk: usize| -> f64 {
        let half = kk / 32; // a0/a1 or a2/a3
        let reg = lane(r % 8, (kk % 32) / 8).a[2 * half + r / 8];
        let scale = byte(lane(r % 8, r / 8).sfa, kk / 16);
        f64::from(e2m1_to_f32(nibble(reg, kk % 8))) * f64::from(e4m3_to_f32(scale))
    };
    let b = |kk: usize, col: usize| -> f64 {
        let reg = lane(col, (kk % 32) / 8).b[kk / 32];
        let scale = byte(lane(col, 0).sfb, kk / 16);
        f64::from(e2m1_to_f32(nibble(reg, kk % 8))) * f64::from(e4m3_to_f32(scale))
    };
    for r in 0..16 {
        for col in 0..8 {
            let sum: f64 = (0..64).map(|kk| a(r, kk) * b(kk, col)).sum();
            let d = &mut acc[4 * (r % 8) + col / 2][2 * (r / 8) + col % 2];
            *d += sum as f32;
        }
    }
}

/// The kernel's `load_u32`: 4 bytes of row `row` at `offset`, or 0 past the last row.
fn load_u32(base: &[u8], row: usize, rows: usize, offset: usize, stride: usize) -> u32 {
    if row >= rows {
        return 0;
    }
    let at = row * stride + offset;
    u32::from_le_bytes([base[at], base[at + 1], base[at + 2], base[at + 3]])
}

/// `nvfp4_gemm_w4a4_sm120` over the whole grid; `tamper` may alter each MMA's registers (the
/// tests use it to show that a wrong layout is caught). Output poisoned with NaN first, as the
/// wrapper does. `k` must be a multiple of 64.
pub(super) fn gemm_with(
    (a_codes, a_scales, a_scale_2): (&[u8], &[u8], f32),
    (w_codes, w_scales, w_scale_2): (&[u8], &[u8], f32),
    (m, n, k): (usize, usize, usize),
    tamper: &dyn Fn(&mut [LaneRegs; 32]),
) -> Vec<f32> {
    let mut c = vec![f32::NAN; m * n];
    let (row_bytes, row_scales) = (k / 2, k / 16);
    for block_y in 0..m.div_ceil(BLOCK_TILE) {
        for block_x in 0..n.div_ceil(BLOCK_TILE) {
            for warp in 0..WARPS {
                let row_base = block_y * BLOCK_TILE + warp * 16;
                let col_base = block_x * BLOCK_TILE;
                let mut acc = [[[0.0f32; 4]; 32]; WARP_N_TILES];
                for k0 in (0..k).step_by(64) {
                    let kb = k0 / 2;
                    for (j, tile) in acc.iter_mut().enumerate() {
                        let mut lanes = [LaneRegs::default(); 32];
                        for (lane, regs) in lanes.iter_mut().enumerate() {
                            let (t1, t0) = (lane / 4, lane % 4);
                            let r_lo = row_base + t1;
                            let r_hi = r_lo + 8;
                            let r_scale = row_base + t1 + 8 * (t0 & 1);
                            let col = col_base + j * 8 + t1;
                            *regs = LaneRegs {
                                a: [
                                    load_u32(a_codes, r_lo, m, kb + 4 * t0, row_bytes),
                                    load_u32(a_codes, r_hi, m, kb + 4 * t0, row_bytes),
                                    load_u32(a_codes, r_lo, m, kb + 16 + 4 * t0, row_bytes),
                                    load_u32(a_codes, r_hi, m, kb + 16 + 4 * t0, row_bytes),
                                ],
                                b: [
                                    load_u32(w_codes, col, n, kb + 4 * t0, row_bytes),
                                    load_u32(w_codes, col, n, kb + 16 + 4 * t0, row_bytes),
                                ],
                                sfa: load_u32(a_scales, r_scale, m, k0 / 16, row_scales),
                                sfb: load_u32(w_scales, col, n, k0 / 16, row_scales),
                            };
                        }
                        tamper(&mut lanes);
                        mma_m16n8k64(&lanes, tile);
                    }
                }
                let scale = a_scale_2 * w_scale_2;
                for (j, tile) in acc.iter().enumerate() {
                    for (lane, d) in tile.iter().enumerate() {
                        let (t1, t0) = (lane / 4, lane % 4);
                        let col = col_base + j * 8 + 2 * t0;
                        for half in 0..2 {
                            let row = row_base + t1 + 8 * half;
                            if row >= m {
                                continue;
                            }
                            if col < n {
                                c[row * n + col] = d[2 * half] * scale;
                            }
                            if col + 1 < n {
                                c[row * n + col + 1] = d[2 * half + 1] * scale;
                            }
                        }
                    }
                }
            }
        }
    }
    c
}

/// `nvfp4_gemm_w4a4_sm120` as the kernel computes it (arguments of
/// [`crate::cpu::nvfp4_gemm_w4a4`]).
pub fn nvfp4_gemm_w4a4_sm120(
    a: (&[u8], &[u8], f32),
    w: (&[u8], &[u8], f32),
    (m, n, k): (usize, usize, usize),
) -> Vec<f32> {
    gemm_with(a, w, (m, n, k), &|_| {})
}
