//! Tensor-parallel attention: each rank computes a contiguous share of the query heads (rows of
//! `wq_b`, its heads' sinks) and of the output groups (rows of `wo_a`: a group's input is its
//! heads' outputs, so the head and group shares line up), then the ranks all-gather the groups'
//! low-rank outputs and every rank applies the whole, replicated `wo_b` in the one-rank order.
//! The one shared KV latent, the compressors and the indexer are computed whole on every rank
//! (they are small, and every rank's attention reads them). Every value a rank computes is the
//! same dot product the one-rank engine computes for it, and `wo_b` sees the same input in the
//! same order, so the attention output is bit-identical to the one-rank engine's: no all-reduce
//! (whose summation order would differ) is involved.
//!
//! All ranks of a group run the same requests in the same steps (their schedulers see the same
//! calls in the same order), so each layer's gather has the same tokens on every rank.

use std::ops::Range;

use super::collective::{Collective, CollectiveError, SharedCollective};
use crate::config::ModelConfig;

/// This rank's share of every layer's attention heads.
#[derive(Debug)]
pub struct TensorParallel {
    collective: SharedCollective,
    rank: usize,
    size: usize,
    heads: Range<usize>,
    groups: Range<usize>,
}

impl TensorParallel {
    /// This rank (`collective`'s) of a split of `c`'s heads over its group; the heads and the
    /// output groups must divide among the ranks.
    pub fn new(collective: Box<dyn Collective>, c: &ModelConfig) -> Result<Self, String> {
        let (rank, size) = (collective.rank(), collective.size());
        if size == 0 || !c.num_heads.is_multiple_of(size) || !c.o_groups.is_multiple_of(size) {
            return Err(format!(
                "tp {size} must divide the {} attention heads and the {} output groups",
                c.num_heads, c.o_groups
            ));
        }
        let (heads, groups) = (c.num_heads / size, c.o_groups / size);
        Ok(Self {
            collective: SharedCollective::new(collective),
            rank,
            size,
            heads: rank * heads..(rank + 1) * heads,
            groups: rank * groups..(rank + 1) * groups,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The query heads this rank computes.
    pub fn heads(&self) -> Range<usize> {
        self.heads.clone()
    }

    /// The output groups (blocks of `wo_a`) this rank computes.
    pub fn groups(&self) -> Range<usize> {
        self.groups.clone()
    }

    /// Every rank's `lows` (one row per token, this rank's groups), joined per token in rank
    /// order: the rows `wo_b` takes, as the one-rank engine builds them.
    pub fn gather(&self, lows: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let tokens = lows.len();
        let width = lows.first().map_or(0, Vec::len);
        let flat: Vec<f32> = lows.into_iter().flatten().collect();
        let parts = self.collective.lock().all_gather(flat)?;
        let mut out = vec![Vec::with_capacity(width * self.size); tokens];
        for part in &parts {
            if part.len() != tokens * width {
                return Err(CollectiveError::Shape(format!(
                    "a rank sent {} attention values for {tokens} tokens of width {width}",
                    part.len()
                )));
            }
            for (row, chunk) in out.iter_mut().zip(part.chunks_exact(width.max(1))) {
                row.extend_from_slice(chunk);
            }
        }
        Ok(out)
    }

    /// This rank's collective, for one call of the group (a device's own gather of the
    /// groups' outputs, `kernels::step::device_group`).
    pub fn collective(&self) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
        self.collective.lock()
    }

    /// Marks this rank failed, so its peers stop at once.
    pub fn fail(&self, reason: &str) {
        self.collective.fail(reason);
    }
}
