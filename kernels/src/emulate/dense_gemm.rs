//! `dense_gemm.cu` on the CPU: its split of K over grid z, its staging of A (rounded to bf16)
//! and of the dequantized W (the kernel's own scale index) into its shared tiles, its masked
//! store and `sum_splits`' order; for `dense_tile` (WMMA) its warps' fragment origins and live
//! row bands around the WMMA model of [`super::wmma_bf16`], for `dense_tile_wgmma` (sm_90a)
//! `wgmma.cuh`'s core-matrix layout, descriptors, double buffer and fragment store around the
//! warpgroup-MMA model of [`super::wgmma_sm90`]. A wrong index in any of them makes this
//! disagree with [`crate::dense_gemm::reference`]; the tests plant such errors.

use engine::formats::e4m3_to_f32;

pub(super) use super::wgmma_sm90::Tiles;
use super::{
    wgmma_sm90::{self, CHUNK, THREADS as WARPGROUP, TilePlant, put_chunk, stage_rows},
    wmma_bf16::{LDS, load, mma},
};
use crate::dense_gemm::{DenseRows, SLICE as BK, TILE, bf16};

const BM: usize = TILE;
const BN: usize = TILE;
const THREADS: usize = crate::cuda_constants::dense_gemm::THREADS;

/// A deliberate error in the kernel's index math, to show the emulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// W's fragments declared row-major (W is `[n, k]`: the B operand is column-major).
    WRowMajor,
    /// The second 16 columns of a W row staged over the first.
    HalfOffset,
    /// The scale row taken from the tile's column (`j / 128`), not the weight's row.
    ScaleRowWithoutRow0,
    /// A warp's live bands decided by its column half, not its row half.
    LiveByColumn,
    /// Each split starting one slice late.
    SplitStartsLate,
    /// `sum_splits` leaving the last split out.
    SumSkipsLast,
    /// wgmma: an error in `wgmma.cuh`'s index math.
    #[cfg_attr(not(test), expect(dead_code, reason = "only the tests plant it"))]
    Tile(TilePlant),
    /// wgmma: a thread's two W chunks stored in each other's place.
    WChunksSwapped,
}

/// The kernel's `w_value` for an FP8 weight: its own tile count and scale index.
fn fp8_value(codes: &[u8], scales: &[f32], gn: usize, c: usize, k: usize) -> f32 {
    let tiles = k.div_ceil(128);
    e4m3_to_f32(codes[gn * k + c]) * scales[(gn / 128) * tiles + c / 128]
}

/// `stage_w`: the 16 values at (weight row `gn`, columns gk..) with zeros from `k_end` on.
fn stage_w(w: DenseRows<'_>, gn: usize, gk: usize, (k, k_end): (usize, usize)) -> [f32; 16] {
    std::array::from_fn(|i| {
        let c = gk + i;
        if c >= k_end {
            return 0.0;
        }
        match w {
            DenseRows::Bf16(bytes) => {
                let at = 2 * (gn * k + c);
                bf16(f32::from_bits(
                    u32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]])) << 16,
                ))
            }
            DenseRows::Fp8Block { codes, scales } => bf16(fp8_value(codes, scales, gn, c, k)),
        }
    })
}

/// The 16 values a thread stages for tile column `gn` (weight row `row0 + gn`) from column
/// `gk` on, with `plant`'s scale error where it is planted.
fn staged_w(
    w: DenseRows<'_>,
    row0: usize,
    gn: usize,
    gk: usize,
    (k, k_end): (usize, usize),
    plant: Plant,
) -> [f32; 16] {
    if plant != Plant::ScaleRowWithoutRow0 {
        return stage_w(w, row0 + gn, gk, (k, k_end));
    }
    let DenseRows::Fp8Block { codes, scales } = w else {
        unreachable!("planted on FP8 weights")
    };
    std::array::from_fn(|i| {
        let col = gk + i;
        if col >= k_end {
            return 0.0;
        }
        let scale = scales[(gn / 128) * k.div_ceil(128) + col / 128];
        bf16(e4m3_to_f32(codes[(row0 + gn) * k + col]) * scale)
    })
}

/// One block's tile: `dense_tile` at rows `m0..`, columns `col0..`, K in `k_range`, stored
/// into `c` (`[m, n]`).
#[expect(
    clippy::too_many_arguments,
    reason = "the device function's parameters"
)]
fn tile(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
    k_range: (usize, usize),
    (m0, col0): (usize, usize),
    c: &mut [f32],
    plant: Plant,
) {
    let (k_begin, k_end) = k_range;
    let mut accs = [[[[[0.0f32; 16]; 16]; 2]; 2]; THREADS / 32];
    for k0 in (k_begin..k_end).step_by(BK) {
        let mut tile_a = vec![[0.0f32; LDS]; BM];
        let mut tile_w = vec![[0.0f32; LDS]; BN];
        for (r, line) in tile_a.iter_mut().enumerate() {
            for (kk, v) in line.iter_mut().take(BK).enumerate() {
                let (gr, gk) = (m0 + r, k0 + kk);
                *v = bf16(if gr < m && gk < k_end {
                    a[gr * k + gk]
                } else {
                    0.0
                });
            }
        }
        for tid in 0..THREADS {
            let (r, half) = (tid / 2, tid % 2);
            let gn = col0 + r;
            let at = if plant == Plant::HalfOffset {
                0
            } else {
                half * 16
            };
            let values = if gn >= n {
                [0.0; 16]
            } else {
                staged_w(w, row0, gn, k0 + half * 16, (k, k_end), plant)
            };
            tile_w[r][at..at + 16].copy_from_slice(&values);
        }
        for (warp, acc) in accs.iter_mut().enumerate() {
            let (warp_m, warp_n) = (warp / 2, warp % 2);
            let band = if plant == Plant::LiveByColumn {
                warp_n
            } else {
                warp_m
            };
            let live: [bool; 2] = std::array::from_fn(|i| m0 + band * 32 + i * 16 < m);
            for kk in (0..BK).step_by(16) {
                let fa: Vec<_> = (0..2)
                    .map(|i| load(&tile_a, warp_m * 32 + i * 16, kk, false))
                    .collect();
                let fb: Vec<_> = (0..2)
                    .map(|i| load(&tile_w, warp_n * 32 + i * 16, kk, plant != Plant::WRowMajor))
                    .collect();
                for i in (0..2).filter(|&i| live[i]) {
                    for j in 0..2 {
                        mma(&mut acc[i][j], &fa[i], &fb[j]);
                    }
                }
            }
        }
    }
    for (warp, acc) in accs.iter().enumerate() {
        let (warp_m, warp_n) = (warp / 2, warp % 2);
        for e in 0..32 * 32 {
            let (r, col) = (e / 32, e % 32);
            let (gr, gc) = (m0 + warp_m * 32 + r, col0 + warp_n * 32 + col);
            if gr < m && gc < n {
                c[gr * n + gc] = acc[r / 16][col / 16][r % 16][col % 16];
            }
        }
    }
}

/// `dense_tile_wgmma`'s `stage`: the slice from `k0` on into the operands at `(base_a,
/// base_w)`.
#[expect(
    clippy::too_many_arguments,
    reason = "the device lambda's captures and parameters"
)]
fn stage_wgmma(
    smem: &mut [u8],
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
    (k0, k_end): (usize, usize),
    (m0, col0): (usize, usize),
    (base_a, base_w): (usize, usize),
    plant: Plant,
) {
    stage_rows(smem, base_a, a, (k, k0, k_end), |r| {
        (m0 + r < m).then_some(m0 + r)
    });
    for tid in 0..WARPGROUP {
        let (r, half) = (tid / 2, tid % 2);
        let gn = col0 + r;
        let v = if gn < n {
            staged_w(w, row0, gn, k0 + half * 16, (k, k_end), plant)
        } else {
            [0.0; 16]
        };
        for q in 0..2 {
            let to = if plant == Plant::WChunksSwapped {
                1 - q
            } else {
                q
            };
            put_chunk(smem, base_w, r, 2 * half + to, &v[q * CHUNK..]);
        }
    }
}

/// One block's tile: `dense_tile_wgmma` at rows `m0..`, columns `col0..`, K in `k_range`,
/// stored into `c` (`[m, n]`).
#[expect(
    clippy::too_many_arguments,
    reason = "the device function's parameters"
)]
fn tile_wgmma(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    shape: (usize, usize, usize),
    k_range: (usize, usize),
    origin: (usize, usize),
    c: &mut [f32],
    plant: Plant,
) -> Result<(), String> {
    let ((m, n, _), (m0, col0)) = (shape, origin);
    let tile_plant = match plant {
        Plant::Tile(p) => p,
        _ => TilePlant::None,
    };
    wgmma_sm90::tile(
        k_range,
        |smem, k0, bases| {
            stage_wgmma(
                smem,
                a,
                w,
                row0,
                shape,
                (k0, k_range.1),
                origin,
                bases,
                plant,
            );
        },
        |r, col, value| {
            let (gr, gc) = (m0 + r, col0 + col);
            if gr < m && gc < n {
                c[gr * n + gc] = value;
            }
        },
        tile_plant,
    )
}

/// The whole launch on `tiles` with `plant` in its index math: `(splits, k_split)` from the
/// host's plan, partials (poisoned with NaN as the wrapper makes them) summed by `sum_splits`.
/// An error where the warpgroup-MMA model refuses what the kernel asks of it.
pub(super) fn dense_gemm_with(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    (m, n, k): (usize, usize, usize),
    (splits, k_split): (usize, usize),
    tiles: Tiles,
    plant: Plant,
) -> Result<Vec<f32>, String> {
    let count = m * n;
    let mut parts = vec![f32::NAN; splits * count];
    for split in 0..splits {
        let late = if plant == Plant::SplitStartsLate && split > 0 {
            BK
        } else {
            0
        };
        let k_begin = split * k_split + late;
        let k_end = (split * k_split + k_split).min(k);
        let part = &mut parts[split * count..(split + 1) * count];
        for m0 in (0..m).step_by(BM) {
            for col0 in (0..n).step_by(BN) {
                let range = (k_begin, k_end);
                match tiles {
                    Tiles::Wmma => tile(a, w, row0, (m, n, k), range, (m0, col0), part, plant),
                    Tiles::Wgmma => {
                        tile_wgmma(a, w, row0, (m, n, k), range, (m0, col0), part, plant)?;
                    }
                }
            }
        }
    }
    if splits == 1 {
        return Ok(parts);
    }
    let summed = if plant == Plant::SumSkipsLast {
        splits - 1
    } else {
        splits
    };
    Ok((0..count)
        .map(|i| (1..summed).fold(parts[i], |sum, s| sum + parts[s * count + i]))
        .collect())
}

/// `dense_gemm_bf16` / `dense_gemm_fp8_block` (then `sum_splits` when K is split) as the
/// kernels compute them, with the split plan `(splits, k_split)` of
/// [`crate::dense_gemm::splits`]; arguments as [`crate::dense_gemm::reference`]'s.
pub fn dense_gemm(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    shape: (usize, usize, usize),
    plan: (usize, usize),
) -> Vec<f32> {
    dense_gemm_with(a, w, row0, shape, plan, Tiles::Wmma, Plant::None)
        .unwrap_or_else(|e| unreachable!("the WMMA tiles do not fail: {e}"))
}

/// `dense_gemm_bf16_wgmma` / `dense_gemm_fp8_block_wgmma` (what an sm_90 device runs), then
/// `sum_splits`, as [`dense_gemm`]; an error where the kernel asks the warpgroup MMA for
/// something the model refuses (a descriptor it does not model, an operand outside shared
/// memory).
pub fn dense_gemm_wgmma(
    a: &[f32],
    w: DenseRows<'_>,
    row0: usize,
    shape: (usize, usize, usize),
    plan: (usize, usize),
) -> Result<Vec<f32>, String> {
    dense_gemm_with(a, w, row0, shape, plan, Tiles::Wgmma, Plant::None)
}
