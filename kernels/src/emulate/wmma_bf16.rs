//! `nvfp4_gemm.cu` (`nvfp4_gemm_bf16`, the dequantize-to-bf16 path that sm_90 runs, having no
//! FP4 tensor cores) on the CPU: the kernel's own staging of A (rounded to bf16) and of the
//! dequantized W into its shared tiles, its warps' fragment origins, and its masked store
//! through the per-warp stage, around a model of the WMMA API as CUDA documents it (layout-
//! agnostic: `load_matrix_sync` reads a 16 x 16 tile at `ptr` with leading dimension `ldm`,
//! row-major `ptr[r * ldm + c]` or column-major `ptr[c * ldm + r]`; `mma_sync` is
//! `D = A B + C` with f32 accumulation; `store_matrix_sync` writes row-major with `ldm`).
//!
//! The sm_90a tiles (`gemm_tile_wgmma`) stage the same values into `wgmma.cuh`'s layout and run
//! on the warpgroup-MMA model of [`super::wgmma_sm90`].
//!
//! If the kernel staged a value in the wrong place, gave a warp the wrong fragment origin,
//! declared W's fragment with the wrong major-ness or stored to the wrong place, this
//! emulation disagrees with [`crate::cpu::nvfp4_gemm`]; the tests plant such errors.

use engine::formats::{bf16_to_f32, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, f32_to_bf16};

use super::wgmma_sm90::{self, CHUNK, TilePlant, Tiles, put_chunk, stage_rows};

pub(super) const BM: usize = crate::cuda_constants::nvfp4_gemm::BM;
const BN: usize = crate::cuda_constants::nvfp4_gemm::BN;
const BK: usize = crate::cuda_constants::nvfp4_gemm::BK;
pub(super) const LDS: usize = crate::cuda_constants::nvfp4_gemm::LDS;
const THREADS: usize = crate::cuda_constants::nvfp4_gemm::THREADS;

/// A deliberate error in the kernel's index math, to show the emulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// W's fragments declared row-major (W is `[n, k]`: the B operand is column-major).
    WRowMajor,
    /// Every warp given the other half's fragment origin along n (its store stays right).
    WarpOrigin,
    /// The second NVFP4 block of a W row staged over the first.
    WBlockOffset,
    /// MXFP4 scales indexed without the row's offset.
    MxScaleWithoutRow,
}

/// The WMMA model's 16 x 16 tile of `tile` (rows of `LDS` bf16 values) at (`row`, `col`):
/// element (r, c) of the fragment, row- or column-major.
pub(super) fn load(
    tile: &[[f32; LDS]],
    row: usize,
    col: usize,
    column_major: bool,
) -> [[f32; 16]; 16] {
    let flat = |i: usize| tile[row + i / LDS][col + i % LDS];
    let mut out = [[0.0f32; 16]; 16];
    for (r, line) in out.iter_mut().enumerate() {
        for (c, v) in line.iter_mut().enumerate() {
            *v = if column_major {
                flat(c * LDS + r)
            } else {
                flat(r * LDS + c)
            };
        }
    }
    out
}

/// `mma_sync`: `acc += a b` (a is 16 x K=16 by rows, b is K x 16 by rows), products exact,
/// summed in f64 per step then added in f32 (the tensor cores' partial-sum rounding is within
/// the tests' bound).
pub(super) fn mma(acc: &mut [[f32; 16]; 16], a: &[[f32; 16]; 16], b: &[[f32; 16]; 16]) {
    for (i, row) in acc.iter_mut().enumerate() {
        for (j, d) in row.iter_mut().enumerate() {
            let sum: f64 = (0..16)
                .map(|kk| f64::from(a[i][kk]) * f64::from(b[kk][j]))
                .sum();
            *d += sum as f32;
        }
    }
}

/// `w_block`: the 16 values of W's block at (row `gn`, columns `gk..`), dequantized to bf16
/// (NVFP4: an e4m3 scale per 16; MXFP4, `mx`: a ue8m0 scale per 32); zeros past n or k.
pub(super) fn w_block(
    (packed, scales, mx): (&[u8], &[u8], bool),
    (n, k): (usize, usize),
    (gn, gk): (usize, usize),
    plant: Plant,
) -> [f32; 16] {
    let bf16 = |v: f32| bf16_to_f32(f32_to_bf16(v));
    let mut out = [0.0f32; 16];
    if gn < n && gk < k {
        let s = match mx {
            false => e4m3_to_f32(scales[gn * (k / 16) + gk / 16]),
            true if plant == Plant::MxScaleWithoutRow => e8m0_to_f32(scales[gk / 32]),
            true => e8m0_to_f32(scales[gn * (k / 32) + gk / 32]),
        };
        let codes = &packed[gn * (k / 2) + gk / 2..];
        for i in 0..8 {
            let byte = codes[i];
            out[2 * i] = bf16(e2m1_to_f32(byte & 0xF) * s);
            out[2 * i + 1] = bf16(e2m1_to_f32(byte >> 4) * s);
        }
    }
    out
}

/// `gemm_tile`: the block's 64 x 64 tile of C at columns `col0..` for A rows `a_row[r]` (None:
/// a zero row), stored to rows `c_row[r]` of C (None: not stored), with `plant` in its index
/// math.
#[expect(
    clippy::too_many_arguments,
    reason = "the device function's parameters"
)]
pub(super) fn gemm_tile(
    a: &[f32],
    a_row: &[Option<usize>; BM],
    (packed, scales, scale_2): (&[u8], &[u8], Option<f32>),
    (n, k): (usize, usize),
    col0: usize,
    c: &mut [f32],
    c_row: &[Option<usize>; BM],
    plant: Plant,
) {
    let bf16 = |v: f32| bf16_to_f32(f32_to_bf16(v));
    // Each warp's 2 x 2 accumulator fragments.
    let mut accs = [[[[[0.0f32; 16]; 16]; 2]; 2]; THREADS / 32];
    for k0 in (0..k).step_by(BK) {
        let mut tile_a = vec![[0.0f32; LDS]; BM];
        let mut tile_w = vec![[0.0f32; LDS]; BN];
        for tid in 0..THREADS {
            for e in (tid..BM * BK).step_by(THREADS) {
                let (r, kk) = (e / BK, e % BK);
                let gk = k0 + kk;
                let v = match a_row[r] {
                    Some(gr) if gk < k => a[gr * k + gk],
                    _ => 0.0,
                };
                tile_a[r][kk] = bf16(v);
            }
            let (r, blk) = (tid / 2, tid % 2);
            let at = if plant == Plant::WBlockOffset {
                0
            } else {
                blk * 16
            };
            let mx = scale_2.is_none();
            let block = w_block(
                (packed, scales, mx),
                (n, k),
                (col0 + r, k0 + blk * 16),
                plant,
            );
            tile_w[r][at..at + 16].copy_from_slice(&block);
        }
        for (warp, acc) in accs.iter_mut().enumerate() {
            let warp_m = warp / 2;
            let warp_n = if plant == Plant::WarpOrigin {
                1 - warp % 2
            } else {
                warp % 2
            };
            for kk in (0..BK).step_by(16) {
                let fa: Vec<_> = (0..2)
                    .map(|i| load(&tile_a, warp_m * 32 + i * 16, kk, false))
                    .collect();
                // The fragment model is indexed (K, n): the column-major B operand reads W's
                // row n, column kk + K.
                let fb: Vec<_> = (0..2)
                    .map(|i| load(&tile_w, warp_n * 32 + i * 16, kk, plant != Plant::WRowMajor))
                    .collect();
                for i in 0..2 {
                    for j in 0..2 {
                        mma(&mut acc[i][j], &fa[i], &fb[j]);
                    }
                }
            }
        }
    }
    // The store through the per-warp stage, masked at the edges.
    for (warp, acc) in accs.iter().enumerate() {
        let (warp_m, warp_n) = (warp / 2, warp % 2);
        let mut stage = [[0.0f32; 32]; 32];
        for i in 0..2 {
            for j in 0..2 {
                for r in 0..16 {
                    for col in 0..16 {
                        stage[i * 16 + r][j * 16 + col] = acc[i][j][r][col];
                    }
                }
            }
        }
        for e in 0..32 * 32 {
            let (r, col) = (e / 32, e % 32);
            let gc = col0 + warp_n * 32 + col;
            if let Some(gr) = c_row[warp_m * 32 + r]
                && gc < n
            {
                c[gr * n + gc] = stage[r][col] * scale_2.unwrap_or(1.0);
            }
        }
    }
}

/// `nvfp4_gemm_bf16` over the whole grid with `plant` in its index math (MXFP4 staging where
/// `w` has no `scale_2`, as `mxfp4_grouped_gemm_bf16`'s tiles do). Output poisoned with NaN
/// first, as the wrapper does.
pub(super) fn gemm_with(
    a: &[f32],
    w: (&[u8], &[u8], Option<f32>),
    (m, n, k): (usize, usize, usize),
    plant: Plant,
) -> Vec<f32> {
    tiles_with(a, w, (m, n, k), Tiles::Wmma, plant)
        .unwrap_or_else(|e| unreachable!("the WMMA tiles do not fail: {e}"))
}

/// `nvfp4_gemm_bf16` (or its `_wgmma` twin, `tiles`) over the whole grid.
fn tiles_with(
    a: &[f32],
    w: (&[u8], &[u8], Option<f32>),
    (m, n, k): (usize, usize, usize),
    tiles: Tiles,
    plant: Plant,
) -> Result<Vec<f32>, String> {
    let mut c = vec![f32::NAN; m * n];
    for block_y in 0..m.div_ceil(BM) {
        let rows: [Option<usize>; BM] = std::array::from_fn(|r| {
            let gr = block_y * BM + r;
            (gr < m).then_some(gr)
        });
        for block_x in 0..n.div_ceil(BN) {
            let col0 = block_x * BN;
            match tiles {
                Tiles::Wmma => gemm_tile(a, &rows, w, (n, k), col0, &mut c, &rows, plant),
                Tiles::Wgmma => {
                    gemm_tile_wgmma(a, &rows, w, (n, k), col0, &mut c, &rows, TilePlant::None)?;
                }
            }
        }
    }
    Ok(c)
}

/// `gemm_tile_wgmma` (sm_90a): the same values staged in `wgmma.cuh`'s layout, run by its main
/// loop on the warpgroup-MMA model, `plant` in `wgmma.cuh`'s index math.
#[expect(
    clippy::too_many_arguments,
    reason = "the device function's parameters"
)]
pub(super) fn gemm_tile_wgmma(
    a: &[f32],
    a_row: &[Option<usize>; BM],
    (packed, scales, scale_2): (&[u8], &[u8], Option<f32>),
    (n, k): (usize, usize),
    col0: usize,
    c: &mut [f32],
    c_row: &[Option<usize>; BM],
    plant: TilePlant,
) -> Result<(), String> {
    let stage = |smem: &mut [u8], k0: usize, (base_a, base_w): (usize, usize)| {
        stage_rows(smem, base_a, a, (k, k0, k), |r| a_row[r]);
        for tid in 0..THREADS {
            let (r, blk) = (tid / 2, tid % 2);
            let w = (packed, scales, scale_2.is_none());
            let v = w_block(w, (n, k), (col0 + r, k0 + blk * 16), Plant::None);
            put_chunk(smem, base_w, r, 2 * blk, &v[..CHUNK]);
            put_chunk(smem, base_w, r, 2 * blk + 1, &v[CHUNK..]);
        }
    };
    let store = |r: usize, col: usize, value: f32| {
        let gc = col0 + col;
        if let Some(gr) = c_row[r]
            && gc < n
        {
            c[gr * n + gc] = value * scale_2.unwrap_or(1.0);
        }
    };
    wgmma_sm90::tile((0, k), stage, store, plant)
}

/// `nvfp4_gemm_bf16` as the kernel computes it (arguments of [`crate::cpu::nvfp4_gemm`]).
pub fn nvfp4_gemm_bf16(
    a: &[f32],
    w: (&[u8], &[u8], f32),
    shape: (usize, usize, usize),
) -> Vec<f32> {
    gemm_with(a, (w.0, w.1, Some(w.2)), shape, Plant::None)
}

/// The same tiles over MXFP4 weights (codes, ue8m0 scales per 32), as the grouped GEMM's
/// MXFP4 kernel stages them (arguments of [`crate::cpu::mxfp4_gemm`]).
pub fn mxfp4_gemm_bf16(a: &[f32], w: (&[u8], &[u8]), shape: (usize, usize, usize)) -> Vec<f32> {
    gemm_with(a, (w.0, w.1, None), shape, Plant::None)
}

/// `nvfp4_gemm_bf16_wgmma` (sm_90a) as the kernel computes it; MXFP4 staging where `scale_2`
/// is `None`. An error where the warpgroup-MMA model refuses what the kernel asks.
pub fn fp4_gemm_bf16_wgmma(
    a: &[f32],
    w: (&[u8], &[u8], Option<f32>),
    shape: (usize, usize, usize),
) -> Result<Vec<f32>, String> {
    tiles_with(a, w, shape, Tiles::Wgmma, Plant::None)
}
