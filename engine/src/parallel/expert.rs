//! Expert parallelism: a layer's routed experts divided among the ranks by whole experts, each
//! (token, expert) product computed on the rank that holds the expert and sent back to the
//! token's rank, which sums in its own fixed slot order. Every product is the same
//! [`expert::expert_many`] row a single rank computes (its rows do not depend on the other rows of
//! the call), so the MoE output is bit-identical to the one-rank engine's.
//!
//! cudarc's NCCL has no all-to-all, so dispatch and combine are two [`Collective::exchange`]
//! calls (grouped send/recv on GPUs). Every rank calls both each time, with or without tokens:
//! a rank that skipped would leave the others waiting until their timeout.
//!
//! Dispatch framing, per destination: `[count, expert_1 .. expert_count, x_1 .. x_count]`,
//! expert ids as `f32` (exact below 2^24), inputs of the hidden width each. The combine sends
//! back, per source, the outputs in the order that source listed its pairs.

use super::collective::{Collective, CollectiveError, SharedCollective};
use crate::{model::expert, weights::ExpertWeights};

/// Which rank holds which experts: `experts / ranks` consecutive experts per rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertSplit {
    experts: usize,
    ranks: usize,
}

impl ExpertSplit {
    /// The split of `experts` routed experts over `ranks` ranks; they must divide.
    pub fn new(experts: usize, ranks: usize) -> Result<Self, String> {
        if ranks == 0 || experts == 0 || !experts.is_multiple_of(ranks) {
            return Err(format!(
                "{experts} routed experts cannot be divided among {ranks} ranks"
            ));
        }
        Ok(Self { experts, ranks })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Experts each rank holds.
    pub fn per_rank(&self) -> usize {
        self.experts / self.ranks
    }

    /// The rank that holds `expert`.
    pub fn owner(&self, expert: usize) -> usize {
        expert / self.per_rank()
    }

    /// The experts rank `rank` holds.
    pub fn held_by(&self, rank: usize) -> std::ops::Range<usize> {
        rank * self.per_rank()..(rank + 1) * self.per_rank()
    }
}

/// Why an expert-parallel MoE step failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpertError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A pair names a token or expert that does not exist, or a peer's message is malformed.
    #[error("{0}")]
    Invalid(String),
}

/// This rank's share of one layer's routed experts.
#[derive(Debug, Clone, Copy)]
pub struct ExpertShard<'a> {
    pub split: ExpertSplit,
    /// The experts [`ExpertSplit::held_by`] this rank, in order.
    pub experts: &'a [ExpertWeights],
    /// The experts' SwiGLU clamp (`swiglu_limit`).
    pub limit: f32,
}

impl ExpertShard<'_> {
    /// Hidden width of the experts' inputs and outputs.
    fn width(&self) -> usize {
        self.experts.first().map_or(0, |e| e.w1.cols)
    }
}

/// The outputs of this rank's `(token, expert)` `pairs` over its tokens `xs`, in pair order,
/// each computed by the rank that holds the expert. Every rank of `coll` must call this for the
/// same layer at the same time, with its own tokens (possibly none).
pub fn routed_experts(
    coll: &mut dyn Collective,
    shard: &ExpertShard<'_>,
    xs: &[Vec<f32>],
    pairs: &[(usize, usize)],
) -> Result<Vec<Vec<f32>>, ExpertError> {
    if shard.split.ranks() != coll.size() || shard.experts.len() != shard.split.per_rank() {
        return Err(ExpertError::Invalid(format!(
            "rank {} holds {} experts of a split over {} ranks in a group of {}",
            coll.rank(),
            shard.experts.len(),
            shard.split.ranks(),
            coll.size()
        )));
    }
    let xs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
    // One call per local expert over its inputs.
    let mut compute = |inputs: &[(usize, &[f32])]| {
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); shard.experts.len()];
        for (i, &(local, _)) in inputs.iter().enumerate() {
            by_expert[local].push(i);
        }
        let mut outputs = vec![Vec::new(); inputs.len()];
        for (local, list) in by_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let xs: Vec<&[f32]> = list.iter().map(|&i| inputs[i].1).collect();
            let ys = expert::expert_many(&shard.experts[local], &xs, shard.limit);
            for (&i, y) in list.iter().zip(ys) {
                outputs[i] = y;
            }
        }
        Ok(outputs)
    };
    exchange_pairs(coll, (shard.split, shard.width()), &xs, pairs, &mut compute)
}

/// A rank's dispatch messages by destination rank, with the pairs each lists.
pub type Dispatch = (Vec<Vec<f32>>, Vec<Vec<usize>>);

/// The dispatch messages of a rank's `pairs` (over its tokens `xs`, rows of `width`), by
/// destination rank: `[count, expert_1 .. expert_count, x_1 .. x_count]`, the pairs to each
/// destination in the order they are listed; with the pairs each message lists. A device
/// packs the same messages (`ep_slots`).
///
/// # Errors
/// A pair whose token or expert does not exist.
pub fn dispatch_messages(
    (split, width): (ExpertSplit, usize),
    xs: &[&[f32]],
    pairs: &[(usize, usize)],
) -> Result<Dispatch, ExpertError> {
    let mut dispatched: Vec<Vec<usize>> = vec![Vec::new(); split.ranks()];
    for (p, &(t, e)) in pairs.iter().enumerate() {
        let ok = t < xs.len() && e < split.experts() && xs[t].len() == width;
        if !ok {
            return Err(ExpertError::Invalid(format!(
                "pair {p} (token {t}, expert {e}) outside {} tokens of width {width} and {} experts",
                xs.len(),
                split.experts()
            )));
        }
        dispatched[split.owner(e)].push(p);
    }
    let sends = dispatched
        .iter()
        .map(|list| {
            let mut msg = Vec::with_capacity(1 + list.len() * (1 + width));
            msg.push(list.len() as f32);
            msg.extend(list.iter().map(|&p| pairs[p].1 as f32));
            for &p in list {
                msg.extend_from_slice(xs[pairs[p].0]);
            }
            msg
        })
        .collect();
    Ok((sends, dispatched))
}

/// Computes a rank's share of a layer's expert pairs: every input this rank received, as
/// (its expert's index among the rank's held experts, the input row); returns one output row
/// per input, in order.
pub type ComputePairs<'a> =
    dyn FnMut(&[(usize, &[f32])]) -> Result<Vec<Vec<f32>>, ExpertError> + 'a;

/// The exchange under [`routed_experts`], whatever computes the products: each pair's input
/// (rows of `width`) to the rank that holds its expert, `compute` over what this rank
/// received (a device computes there), the outputs back in the order they were listed.
/// Outputs have the inputs' width (the routed experts' down projections).
pub fn exchange_pairs(
    coll: &mut dyn Collective,
    (split, width): (ExpertSplit, usize),
    xs: &[&[f32]],
    pairs: &[(usize, usize)],
    compute: &mut ComputePairs<'_>,
) -> Result<Vec<Vec<f32>>, ExpertError> {
    let ranks = coll.size();
    let me = coll.rank();
    if split.ranks() != ranks {
        return Err(ExpertError::Invalid(format!(
            "rank {me}: a split over {} ranks in a group of {ranks}",
            split.ranks()
        )));
    }
    let (sends, dispatched) = dispatch_messages((split, width), xs, pairs)?;
    let received = coll.exchange(sends)?;
    // Compute: every received input, by source rank then in the order it was listed.
    let held = split.held_by(me);
    let mut inputs: Vec<(usize, &[f32])> = Vec::new();
    let mut counts = Vec::with_capacity(ranks);
    for (source, msg) in received.iter().enumerate() {
        let count = msg.first().copied().unwrap_or(0.0) as usize;
        if msg.len() != 1 + count * (1 + width) {
            return Err(ExpertError::Invalid(format!(
                "rank {source} sent {} values for {count} inputs of width {width}",
                msg.len()
            )));
        }
        for i in 0..count {
            let e = msg[1 + i] as usize;
            if !held.contains(&e) {
                return Err(ExpertError::Invalid(format!(
                    "rank {source} sent expert {e} to rank {me}, which holds {held:?}"
                )));
            }
            let at = 1 + count + i * width;
            inputs.push((e - held.start, &msg[at..at + width]));
        }
        counts.push(count);
    }
    let outputs = if inputs.is_empty() {
        Vec::new()
    } else {
        compute(&inputs)?
    };
    if outputs.len() != inputs.len() || outputs.iter().any(|y| y.len() != width) {
        return Err(ExpertError::Invalid(format!(
            "rank {me} computed {} outputs for {} inputs of width {width}",
            outputs.len(),
            inputs.len()
        )));
    }
    // Combine: the outputs back to their tokens' ranks, in the order they were listed.
    let mut outputs = outputs.into_iter();
    let sends: Vec<Vec<f32>> = counts
        .iter()
        .map(|&count| outputs.by_ref().take(count).flatten().collect())
        .collect();
    let returned = coll.exchange(sends)?;
    let mut result: Vec<Vec<f32>> = vec![Vec::new(); pairs.len()];
    for (owner, list) in dispatched.iter().enumerate() {
        let values = &returned[owner];
        if values.len() != list.len() * width {
            return Err(ExpertError::Invalid(format!(
                "rank {owner} returned {} values for {} outputs of width {width}",
                values.len(),
                list.len()
            )));
        }
        for (&p, y) in list.iter().zip(values.chunks_exact(width.max(1))) {
            result[p] = y.to_vec();
        }
    }
    Ok(result)
}

/// A model's expert parallelism: this rank's place in the split and its link to the others.
/// Attached with [`crate::model::Model::set_expert_parallel`]; every MoE layer's routed
/// experts then go through [`routed_experts`] over it.
#[derive(Debug)]
pub struct ExpertParallel {
    collective: SharedCollective,
    split: ExpertSplit,
    rank: usize,
}

impl ExpertParallel {
    /// This rank (`collective`'s) of a split of `experts` routed experts over its group.
    pub fn new(collective: Box<dyn Collective>, experts: usize) -> Result<Self, String> {
        let split = ExpertSplit::new(experts, collective.size())?;
        Ok(Self {
            rank: collective.rank(),
            collective: SharedCollective::new(collective),
            split,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn split(&self) -> ExpertSplit {
        self.split
    }

    /// The routed experts of one layer whose experts are `experts` (all of the layer's, in
    /// order; this rank computes with its share).
    pub fn routed(
        &self,
        experts: &[ExpertWeights],
        limit: f32,
        xs: &[Vec<f32>],
        pairs: &[(usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let held = self.split.held_by(self.rank);
        let mine = experts.get(held.clone()).ok_or_else(|| {
            ExpertError::Invalid(format!(
                "the layer has {} experts; rank {} holds {held:?}",
                experts.len(),
                self.rank
            ))
        })?;
        let shard = ExpertShard {
            split: self.split,
            experts: mine,
            limit,
        };
        let mut collective = self.collective.lock();
        routed_experts(collective.as_mut(), &shard, xs, pairs)
    }

    /// [`exchange_pairs`] over this rank's collective: the pairs' products computed by
    /// `compute` on the rank that holds each expert (a device's kernels), `width` the rows'.
    pub fn routed_with(
        &self,
        width: usize,
        xs: &[&[f32]],
        pairs: &[(usize, usize)],
        compute: &mut ComputePairs<'_>,
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let mut collective = self.collective.lock();
        exchange_pairs(collective.as_mut(), (self.split, width), xs, pairs, compute)
    }

    /// [`Self::routed`] when every rank holds the same tokens and pairs (tensor-parallel
    /// attention): each rank sends only every `size`-th pair (from its rank on), so each product
    /// is computed once, and the ranks all-gather the outputs back into pair order. Every
    /// output is the same product as one rank's, so the result is too.
    pub fn routed_replicated(
        &self,
        experts: &[ExpertWeights],
        limit: f32,
        xs: &[Vec<f32>],
        pairs: &[(usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let size = self.split.ranks();
        let mine: Vec<(usize, usize)> = pairs
            .iter()
            .skip(self.rank)
            .step_by(size.max(1))
            .copied()
            .collect();
        let outputs = self.routed(experts, limit, xs, &mine)?;
        let width = outputs.first().map_or(0, Vec::len);
        let gathered = self.collective.lock().all_gather(outputs.concat())?;
        let mut result = vec![Vec::new(); pairs.len()];
        for (rank, values) in gathered.iter().enumerate() {
            let slots: Vec<usize> = (rank..pairs.len()).step_by(size.max(1)).collect();
            let width = if slots.is_empty() {
                width
            } else {
                values.len() / slots.len()
            };
            if values.len() != slots.len() * width {
                return Err(ExpertError::Invalid(format!(
                    "rank {rank} gathered {} values for {} outputs",
                    values.len(),
                    slots.len()
                )));
            }
            for (slot, y) in slots.into_iter().zip(values.chunks_exact(width.max(1))) {
                result[slot] = y.to_vec();
            }
        }
        Ok(result)
    }

    /// This rank's collective, for one call of the group (a device's own exchange of its
    /// dispatch messages, `kernels::step::device_group`).
    pub fn collective(&self) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
        self.collective.lock()
    }

    /// Marks this rank failed, so its peers stop at once.
    pub fn fail(&self, reason: &str) {
        self.collective.fail(reason);
    }

    /// Why the group's exchanges failed, once they did (every later one fails too).
    pub fn failure(&self) -> Option<String> {
        self.collective.failure()
    }
}

#[cfg(test)]
mod tests;
