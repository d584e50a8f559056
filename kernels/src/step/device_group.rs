//! [`DeviceStepOps`] as one rank of an expert-parallel group (`--ep N --dp-attention`): each
//! rank steps its own requests on its own device and holds `1/N` of every layer's routed
//! experts. At each MoE layer the step packs its dispatch messages on its device (`ep_slots`
//! and `copy_rows`: the framing of the host forward's `engine::parallel::expert::exchange_pairs`,
//! value for value, so device and host ranks exchange alike), exchanges them over the model's
//! [`ExpertParallel`] collective ([`Kernels::exchange`]: GPU to GPU over NCCL), computes the
//! pairs it received with its own experts, sends the outputs back the same way and gathers
//! them into pair order (`copy_rows`) for the device's slot-order sum (`combine`). The host
//! reads only the messages' counts (and NCCL gathers the sizes): no row crosses to it. Every
//! product is the row one rank's step computes (a pair's row does not depend on the other rows
//! of its launch), so the group's logits are the one-rank step's, bit for bit with the exact
//! kernels.

use std::sync::Arc;

use engine::parallel::expert::ExpertParallel;

use super::{
    StepOps,
    device_ops::{DBuf, DIdx, DeviceStepOps, offsets},
    kernels::{Kernels, SlotSpec},
};

impl<K: Kernels> DeviceStepOps<K> {
    /// The group this rank exchanges its routed experts' pairs with, if any.
    pub fn expert_parallel(&self) -> Option<&Arc<ExpertParallel>> {
        self.expert_parallel.as_ref()
    }

    /// [`StepOps::routed_experts`] over the group `ep`: `[pairs, D]` in pair order. The
    /// dispatch messages are packed on the device (`ep_slots`, `copy_rows`) and exchanged by
    /// [`Kernels::exchange`] (GPU to GPU over NCCL); the host reads the messages' counts only.
    pub(super) fn routed_in_group(
        &self,
        ep: &ExpertParallel,
        layer: usize,
        h: &DBuf<K>,
        experts: &DIdx<K>,
        (k, inter): (usize, usize),
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let d = self.config.hidden_size;
        let (k, split) = (k.max(1), ep.split());
        let ranks = split.ranks();
        let context = |e: K::Error| format!("layer {layer}'s routed experts over the group: {e}");
        if K::f_len(h) < pairs.div_ceil(k) * d || K::i_len(experts) < pairs {
            return Err(context("buffers shorter than the pairs".to_owned().into()).into());
        }
        let spec = SlotSpec {
            ranks,
            per_rank: split.per_rank(),
            width: d,
            pairs,
        };
        let mut send = self.alloc(ranks + pairs * (1 + d))?;
        let mut pack_to = self.k.zeros_l(pairs.max(1))?;
        let mut back_from = self.k.zeros_l(pairs.max(1))?;
        let mut counts = self.alloc_i(ranks + 1)?;
        let offsets_out = (&mut pack_to, &mut back_from);
        self.k
            .ep_slots(experts, spec, &mut send, offsets_out, &mut counts)?;
        if pairs > 0 {
            let tokens: Vec<i64> = (0..pairs).map(|p| (p / k * d) as i64).collect();
            let from = self.plan_l(&tokens)?;
            self.k.copy_rows(h, &from, &mut send, &pack_to, d, pairs)?;
        }
        let counts = self.get_idx(&counts, 0..ranks + 1)?;
        let sent: Vec<usize> = counts
            .iter()
            .map(|&c| usize::try_from(c).unwrap_or(usize::MAX))
            .collect();
        if sent[ranks] != 0 || sent[..ranks].iter().sum::<usize>() != pairs {
            return Err(format!(
                "layer {layer}: {} of {pairs} routed pairs name no expert of the model's {}",
                counts[ranks],
                split.experts()
            )
            .into());
        }
        let sizes: Vec<usize> = sent[..ranks].iter().map(|&c| 1 + c * (1 + d)).collect();
        let (recv, got) = self.exchange(ep, &send, &sizes).map_err(context)?;
        // What each rank sent: [count, expert ids, rows], back to back.
        let (mut id_at, mut row_at, mut from) = (Vec::new(), Vec::new(), Vec::new());
        let mut base = 0;
        for (source, &n) in got.iter().enumerate() {
            if n == 0 || !(n - 1).is_multiple_of(1 + d) {
                return Err(context(
                    format!("rank {source} sent {n} values, not inputs of width {d}").into(),
                )
                .into());
            }
            let m = (n - 1) / (1 + d);
            id_at.extend((0..m).map(|j| (base + 1 + j) as i64));
            row_at.extend((0..m).map(|j| (base + 1 + m + j * d) as i64));
            from.push(m);
            base += n;
        }
        let m = id_at.len();
        let ys = if m == 0 {
            self.alloc(1)?
        } else {
            let held = split.held_by(ep.rank());
            let mut ids = self.alloc_i(m)?;
            let at = self.plan_l(&id_at)?;
            self.k
                .ep_take_ids(&recv, &at, (held.start, held.len()), m, &mut ids)?;
            let mut x = self.alloc(m * d)?;
            self.copy_rows(&recv, &row_at, &mut x, &offsets(m, d, 0), d)?;
            super::routed_here(self, layer, &x, &ids, (1, inter), m)?
        };
        // The outputs back to their tokens' ranks, in the order each listed its pairs.
        let sizes: Vec<usize> = from.iter().map(|&m| m * d).collect();
        let (back, returned) = self.exchange(ep, &ys, &sizes).map_err(context)?;
        if let Some(owner) = (0..ranks).find(|&r| returned[r] != sent[r] * d) {
            return Err(context(
                format!(
                    "rank {owner} returned {} values for {} outputs of width {d}",
                    returned[owner], sent[owner]
                )
                .into(),
            )
            .into());
        }
        let mut out = self.alloc((pairs * d).max(1))?;
        if pairs > 0 {
            let to = self.plan_l(&offsets(pairs, d, 0))?;
            self.k
                .copy_rows(&back, &back_from, &mut out, &to, d, pairs)?;
        }
        Ok(out)
    }

    /// [`Kernels::exchange`] over the group's collective, with what failed said.
    fn exchange(
        &self,
        ep: &ExpertParallel,
        send: &K::F,
        sizes: &[usize],
    ) -> Result<(K::F, Vec<usize>), K::Error> {
        let mut coll = ep.collective();
        let ranks = coll.size();
        let (recv, got) = self.k.exchange(coll.as_mut(), send, sizes)?;
        if got.len() != ranks {
            return Err(format!("{} messages from a group of {ranks}", got.len()).into());
        }
        Ok((recv, got))
    }

    /// A step with no tokens on a rank of an expert-parallel group: every layer's exchange,
    /// computing the pairs the other ranks send (nothing to do without a group).
    pub fn idle_exchange(&self) -> Result<(), K::Error> {
        let Some(ep) = self.expert_parallel.as_deref() else {
            return Ok(());
        };
        self.begin_step();
        let (h, experts) = (self.alloc(1)?, self.alloc_i(1)?);
        let inter = self.config.moe_intermediate_size;
        for layer in 0..self.config.num_layers() {
            self.routed_in_group(ep, layer, &h, &experts, (1, inter), 0)?;
        }
        Ok(())
    }
}
