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
use crate::{model::expert, tensor::Weight, weights::ExpertWeights};

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
                expert::swiglu(g, u, limit, &mut act);
                act
            })
            .collect();
        w.w2.apply_cols_many(slice.start, slice.len(), &acts)
    }

    /// This rank's collective, for one call of the group (a device's own gather of the
    /// partial outputs, `kernels::step::device_group`).
    pub fn collective(&self) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
        self.collective.lock()
    }

    /// This rank's slice of expert `w` as an expert of its own (what a device holds of it):
    /// its rows of `w1` and `w3` and its columns of `w2`, each computing as the whole weight
    /// over them bit for bit, so [`Self::routed`]'s partials are this expert's outputs. An
    /// error where the stored form cannot cut on the slice (a scale block across its edge).
    pub fn held(&self, w: &ExpertWeights) -> Result<ExpertWeights, String> {
        let s = self.slice(w.w1.rows);
        if (w.w3.rows, w.w2.cols) != (w.w1.rows, w.w1.rows) {
            return Err(format!(
                "an expert of {} gate rows, {} up rows and {} down columns",
                w.w1.rows, w.w3.rows, w.w2.cols
            ));
        }
        let cut = |block: Option<Weight>, what: &str| {
            block.ok_or_else(|| {
                format!(
                    "moe tp {}: the experts' {what} cannot be cut at intermediate values \
                     {s:?} (their scale blocks cross the slice's edge)",
                    self.size
                )
            })
        };
        Ok(ExpertWeights {
            w1: cut(w.w1.row_block(s.clone()), "gate rows")?,
            w2: cut(w.w2.col_block(s.clone()), "down columns")?,
            w3: cut(w.w3.row_block(s.clone()), "up rows")?,
        })
    }

    /// Marks this rank failed, so its peers stop at once.
    pub fn fail(&self, reason: &str) {
        self.collective.fail(reason);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use std::time::Duration;

    use super::*;
    use crate::{
        parallel::collective::InProcessGroup,
        synth::Rng,
        tensor::{Matrix, SharedBytes},
    };

    fn f32_weight(rng: &mut Rng, rows: usize, cols: usize) -> Weight {
        Weight::from(Matrix::new(
            rows,
            cols,
            (0..rows * cols).map(|_| rng.normal()).collect(),
        ))
    }

    fn nvfp4_weight(rng: &mut Rng, rows: usize, cols: usize) -> Weight {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 16)
            .map(|_| 40 + (rng.next_u64() % 40) as u8)
            .collect();
        let (p, s) = (SharedBytes::owned(packed), SharedBytes::owned(scales));
        Weight::nvfp4(rows, cols, p, s, 0.5).unwrap()
    }

    /// Every rank's held slice of an expert, computed as an expert of its own, gives that
    /// rank's partial outputs bit for bit (f32 and NVFP4 experts, 2 and 4 ranks); a slice that
    /// would cut an NVFP4 scale block is refused by name.
    #[test]
    fn a_ranks_held_slice_computes_its_partials() {
        let mut rng = Rng::for_tensor(4, "sliced-held");
        let (d, inter) = (32usize, 64usize);
        let xs: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..d).map(|_| rng.normal()).collect())
            .collect();
        let refs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
        let f32s = ExpertWeights {
            w1: f32_weight(&mut rng, inter, d),
            w2: f32_weight(&mut rng, d, inter),
            w3: f32_weight(&mut rng, inter, d),
        };
        let nvfp4 = ExpertWeights {
            w1: nvfp4_weight(&mut rng, inter, d),
            w2: nvfp4_weight(&mut rng, d, inter),
            w3: nvfp4_weight(&mut rng, inter, d),
        };
        for size in [2usize, 4] {
            for rank in InProcessGroup::new(size, Duration::from_secs(5)) {
                let sliced = SlicedExperts::new(Box::new(rank), inter).unwrap();
                for w in [&f32s, &nvfp4] {
                    let held = sliced.held(w).unwrap();
                    assert_eq!(held.w1.rows, inter / size);
                    let want = sliced.partial(w, 7.0, &refs);
                    assert_eq!(expert::expert_many(&held, &refs, 7.0), want, "of {size}");
                }
            }
        }
        // 64 over 8 ranks: slices of 8, across NVFP4's blocks of 16.
        let rank = InProcessGroup::new(8, Duration::from_secs(5)).remove(3);
        let sliced = SlicedExperts::new(Box::new(rank), inter).unwrap();
        assert!(sliced.held(&f32s).is_ok());
        let err = sliced.held(&nvfp4).unwrap_err();
        assert!(
            err.contains("down columns") && err.contains("24..32"),
            "{err}"
        );
    }
}
