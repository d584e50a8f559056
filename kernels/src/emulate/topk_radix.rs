//! `indexer.cu` `indexer_topk` on the CPU: the NaN check, the shortcut when every key is
//! taken, four histogram passes over one byte each of the order-preserving key (thread 0's walk
//! down the bins included), then the ordered compaction in chunks of the block's threads with
//! the two exclusive scans (ties' ranks, then output positions).

use super::{TOPK_EMPTY, TOPK_POISONED};

/// Threads of the kernel's block: the chunk of the compaction.
const THREADS: usize = crate::cuda_constants::indexer::THREADS;

/// A deliberate error in the kernel's math, for the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plant {
    None,
    /// -0 keyed as +0 (a tie, where the engine's total order puts -0 below +0).
    ZeroTie,
    /// Ties taken from the highest index.
    TiesFromTop,
    /// Thread 0's walk stops one bin early.
    BinOffByOne,
}

/// `order_key` of the kernel.
fn order_key(v: f32, plant: Plant) -> u32 {
    let mut bits = v.to_bits();
    if bits << 1 == 0 && plant == Plant::ZeroTie {
        bits = 0;
    }
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Exclusive prefix sums of `v` and their total (what `block_scan` computes).
fn block_scan(v: &[i64]) -> (Vec<i64>, i64) {
    let mut acc = 0;
    let out = v
        .iter()
        .map(|&x| {
            let before = acc;
            acc += x;
            before
        })
        .collect();
    (out, acc)
}

pub(super) fn topk_with(scores: &[f32], visible: usize, k: usize, plant: Plant) -> Vec<i32> {
    let row = &scores[..visible];
    if row.iter().any(|v| v.is_nan()) {
        return vec![TOPK_POISONED; k];
    }
    let take = k.min(visible);
    let mut slots = vec![i32::MIN; k];
    slots[take..].fill(TOPK_EMPTY);
    if take == visible {
        for (s, slot) in slots.iter_mut().enumerate().take(visible) {
            *slot = s as i32;
        }
        return slots;
    }
    let (mut prefix, mut mask, mut remaining) = (0u32, 0u32, take as i64);
    for shift in [24u32, 16, 8, 0] {
        let mut hist = [0i64; 256];
        for &v in row {
            let key = order_key(v, plant);
            if key & mask == prefix {
                hist[((key >> shift) & 0xFF) as usize] += 1;
            }
        }
        let mut above = 0;
        let mut d = 255usize;
        while d > 0 {
            if above + hist[d] >= remaining {
                break;
            }
            above += hist[d];
            d -= 1;
        }
        if plant == Plant::BinOffByOne && d < 255 && shift == 0 {
            above -= hist[d + 1];
            d += 1;
        }
        remaining -= above;
        prefix |= (d as u32) << shift;
        mask |= 0xFF << shift;
    }
    let (threshold, ties) = (prefix, remaining);
    let (mut eq_before, mut picked_before) = (0i64, 0i64);
    for base in (0..visible).step_by(THREADS) {
        let lanes = base..(base + THREADS);
        let keys: Vec<Option<u32>> = lanes
            .clone()
            .map(|s| (s < visible).then(|| order_key(row[s], plant)))
            .collect();
        let eq: Vec<i64> = keys
            .iter()
            .map(|k| i64::from(*k == Some(threshold)))
            .collect();
        let (eq_rank, eq_total) = block_scan(&eq);
        let pick: Vec<i64> = keys
            .iter()
            .zip(&eq_rank)
            .zip(&eq)
            .map(|((key, rank), &e)| {
                let rank = if plant == Plant::TiesFromTop {
                    // Counted from the other end of the whole row.
                    let later = row
                        .iter()
                        .filter(|&&v| order_key(v, plant) == threshold)
                        .count();
                    later as i64 - 1 - (eq_before + rank)
                } else {
                    eq_before + rank
                };
                i64::from(key.is_some_and(|k| k > threshold || (e == 1 && rank < ties)))
            })
            .collect();
        let (at, pick_total) = block_scan(&pick);
        for (lane, s) in lanes.enumerate() {
            if pick[lane] == 1 {
                slots[(picked_before + at[lane]) as usize] = s as i32;
            }
        }
        eq_before += eq_total;
        picked_before += pick_total;
    }
    slots
}

/// `indexer_topk` for one request: the indices of the `min(k, visible)` best of the first
/// `visible` scores in `f32::total_cmp` order (-0 below +0; ties to the lower index) in ascending order, then [`TOPK_EMPTY`]; every
/// slot [`TOPK_POISONED`] when a visible score is NaN.
pub fn topk_radix(scores: &[f32], visible: usize, k: usize) -> Vec<i32> {
    topk_with(scores, visible, k, Plant::None)
}
