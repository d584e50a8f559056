//! Expert tensor parallelism (MoE TP, what SGLang's and vLLM's `--tp` does to the experts when
//! expert parallelism is off): each rank holds a contiguous slice of every routed expert's
//! intermediate dimension (rows of `w1` and `w3`, the matching columns of `w2`) and computes,
//! for every (token, expert) pair, the expert's output over its slice; the ranks all-gather
//! these partial outputs and every rank sums them in rank order. All ranks hold the same tokens
//! (tensor-parallel attention), so every rank ends with the same result.
//!
//! Not bit-identical to one rank: the one-rank dot product of `w2` runs over the whole
//! intermediate dimension, here it is cut into per-rank sums added afterwards, so the result
//! differs in the last bits (the tests bound it and check the greedy tokens). Deterministic and
//! batch-invariant: every pair's partials are the same dot products whatever the batch, summed
//! in a fixed order.
//!
//! A CPU rank reads only its slice from the shared mapping: its rows of `w1` and `w3`, and its
//! window of `w2`'s columns (`Weight::apply_cols_many`). A slice is a multiple of 8 values,
//! so every window starts where the engine's dot product starts a lane.

use std::ops::Range;

use super::{
    collective::{Collective, SharedCollective},
    expert::ExpertError,
};
use crate::{model::moe, weights::ExpertWeights};

/// This rank's slice of every routed expert's intermediate dimension.
#[derive(Debug)]
pub struct SlicedExperts {
    collective: SharedCollective,
    rank: usize,
    size: usize,
}

impl SlicedExperts {
    /// This rank (`collective`'s) of a split of each expert's `inter` intermediate values over
    /// its group; they must divide.
    pub fn new(collective: Box<dyn Collective>, inter: usize) -> Result<Self, String> {
        let (rank, size) = (collective.rank(), collective.size());
        if size == 0 || !inter.is_multiple_of(size) || !(inter / size).is_multiple_of(8) {
            return Err(format!(
                "moe tp {size} must divide the experts' {inter} intermediate values into \
                 slices of a multiple of 8"
            ));
        }
        Ok(Self {
            collective: SharedCollective::new(collective),
            rank,
            size,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's intermediate values of an expert with `inter` of them.
    pub fn slice(&self, inter: usize) -> Range<usize> {
        let per = inter / self.size;
        self.rank * per..(self.rank + 1) * per
    }

    /// The outputs of `pairs` (token, expert) over `xs`, in pair order: this rank's partials
    /// of every pair, gathered from every rank and summed in rank order. Every rank of the
    /// group must call this with the same tokens and pairs.
    pub fn routed(
        &self,
        experts: &[ExpertWeights],
        limit: f32,
        xs: &[Vec<f32>],
        pairs: &[(usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let width = xs.first().map_or(0, Vec::len);
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        for (p, &(t, e)) in pairs.iter().enumerate() {
            if t >= xs.len() || e >= experts.len() {
                return Err(ExpertError::Invalid(format!(
                    "pair {p} (token {t}, expert {e}) outside {} tokens and {} experts",
                    xs.len(),
                    experts.len()
                )));
            }
            by_expert[e].push(p);
        }
        let mut partials = vec![0.0f32; pairs.len() * width];
        for (e, list) in by_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let inputs: Vec<&[f32]> = list.iter().map(|&p| xs[pairs[p].0].as_slice()).collect();
            for (&p, y) in list.iter().zip(self.partial(&experts[e], limit, &inputs)) {
                partials[p * width..(p + 1) * width].copy_from_slice(&y);
            }
        }
        let gathered = self.collective.lock().all_gather(partials)?;
        for (rank, values) in gathered.iter().enumerate() {
            if values.len() != pairs.len() * width {
                return Err(ExpertError::Invalid(format!(
                    "rank {rank} gathered {} partial values for {} pairs of width {width}",
                    values.len(),
                    pairs.len()
                )));
            }
        }
        Ok((0..pairs.len())
            .map(|p| {
                let mut out = gathered[0][p * width..(p + 1) * width].to_vec();
                for values in &gathered[1..] {
                    for (o, v) in out.iter_mut().zip(&values[p * width..(p + 1) * width]) {
                        *o += v;
                    }
                }
                out
            })
            .collect())
    }

    /// One expert's output over this rank's slice for each input: this slice's columns of
    /// `w2` times the clamped SwiGLU of this slice's rows of `w1` and `w3`.
    fn partial(&self, w: &ExpertWeights, limit: f32, xs: &[&[f32]]) -> Vec<Vec<f32>> {
        let slice = self.slice(w.w1.rows);
        let gates = w.w1.apply_rows_many(slice.start, slice.len(), xs);
        let ups = w.w3.apply_rows_many(slice.start, slice.len(), xs);
        let acts: Vec<Vec<f32>> = gates
            .iter()
            .zip(&ups)
            .map(|(g, u)| {
                let mut act = vec![0.0f32; slice.len()];
                moe::swiglu(g, u, limit, &mut act);
                act
            })
            .collect();
        w.w2.apply_cols_many(slice.start, slice.len(), &acts)
    }

    /// Marks this rank failed, so its peers stop at once.
    pub fn fail(&self, reason: &str) {
        self.collective.fail(reason);
    }
}
