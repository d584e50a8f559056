//! `moe_align.cu` and `nvfp4_gemm.cu` `nvfp4_grouped_gemm_bf16` / `mxfp4_grouped_gemm_bf16` on
//! the CPU: the grouping of the
//! pairs by expert with the atomics' arrival order as a parameter ([`crate::moe_group::group`]),
//! then every tile's row maps (token rows in, pair rows out) and expert slices around the same
//! `gemm_tile` model as the plain GEMM (or, for the sm_90a `_wgmma` kernels, the same
//! `gemm_tile_wgmma` model).

use super::{
    wgmma_sm90::{TilePlant, Tiles},
    wmma_bf16::{BM, Plant, gemm_tile, gemm_tile_wgmma},
};
use crate::moe_group::{TILE_ROWS, group};

/// A deliberate error in the grouped kernel's own index math, for the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GroupPlant {
    None,
    /// Output rows indexed by token instead of pair.
    StoreByToken,
    /// The weights of the next expert.
    NextExpert,
}

/// Stacked FP4 experts `[experts, n, k]`: codes and scales; NVFP4 (e4m3 scales per 16, one
/// global scale each in `scale_2`) or MXFP4 (ue8m0 scales per 32, `scale_2` `None`).
#[derive(Debug, Clone, Copy)]
pub struct StackedExperts<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub scale_2: Option<&'a [f32]>,
    pub experts: usize,
    pub n: usize,
    pub k: usize,
}

pub(super) fn grouped_with(
    a: &[f32],
    pair_token: &[i32],
    pair_expert: &[i32],
    w: StackedExperts<'_>,
    arrival: &[usize],
    (tiles, plant): (Tiles, GroupPlant),
) -> Result<Vec<f32>, String> {
    let (n, k) = (w.n, w.k);
    let experts = w.experts;
    let mut c = vec![f32::NAN; pair_token.len() * n];
    let g = group(pair_expert, experts, arrival);
    assert_eq!(BM, TILE_ROWS);
    for (tile, &e) in g.tile_expert.iter().enumerate() {
        let e = if plant == GroupPlant::NextExpert {
            (e + 1) % experts
        } else {
            e
        };
        let slots = &g.sorted_pair[tile * TILE_ROWS..(tile + 1) * TILE_ROWS];
        let a_rows: [Option<usize>; BM] =
            std::array::from_fn(|r| slots[r].map(|p| pair_token[p] as usize));
        let c_rows: [Option<usize>; BM] = if plant == GroupPlant::StoreByToken {
            a_rows
        } else {
            std::array::from_fn(|r| slots[r])
        };
        // `grouped_tile`'s expert offsets: scales per 16 (NVFP4) or per 32 (MXFP4).
        let block = if w.scale_2.is_some() { 16 } else { 32 };
        let (code_bytes, scale_bytes) = (n * k / 2, n * k / block);
        let weights = (
            &w.packed[e * code_bytes..(e + 1) * code_bytes],
            &w.scales[e * scale_bytes..(e + 1) * scale_bytes],
            w.scale_2.map(|s| s[e]),
        );
        for col0 in (0..n).step_by(64) {
            let (a_rows, c_rows) = (&a_rows, &c_rows);
            match tiles {
                Tiles::Wmma => {
                    gemm_tile(
                        a,
                        a_rows,
                        weights,
                        (n, k),
                        col0,
                        &mut c,
                        c_rows,
                        Plant::None,
                    );
                }
                Tiles::Wgmma => {
                    let plant = TilePlant::None;
                    gemm_tile_wgmma(a, a_rows, weights, (n, k), col0, &mut c, c_rows, plant)?;
                }
            }
        }
    }
    Ok(c)
}

/// The grouped GEMM as the kernels compute it, the atomics arriving in `arrival` order:
/// `[pairs, n]`, NaN rows for pairs whose expert is outside the stack.
pub fn moe_grouped_gemm(
    a: &[f32],
    pair_token: &[i32],
    pair_expert: &[i32],
    w: StackedExperts<'_>,
    arrival: &[usize],
) -> Vec<f32> {
    grouped_with(
        a,
        pair_token,
        pair_expert,
        w,
        arrival,
        (Tiles::Wmma, GroupPlant::None),
    )
    .unwrap_or_else(|e| unreachable!("the WMMA tiles do not fail: {e}"))
}

/// The same with `nvfp4_grouped_gemm_bf16_wgmma` / `mxfp4_grouped_gemm_bf16_wgmma` (sm_90a);
/// an error where the warpgroup-MMA model refuses what the kernel asks.
pub fn moe_grouped_gemm_wgmma(
    a: &[f32],
    pair_token: &[i32],
    pair_expert: &[i32],
    w: StackedExperts<'_>,
    arrival: &[usize],
) -> Result<Vec<f32>, String> {
    grouped_with(
        a,
        pair_token,
        pair_expert,
        w,
        arrival,
        (Tiles::Wgmma, GroupPlant::None),
    )
}

#[cfg(test)]
mod tests;
