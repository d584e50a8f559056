//! [`DeviceStepOps`] as one rank of a group. Of an expert-parallel group (`--ep N
//! --dp-attention`) each rank steps its own requests on its own device and holds `1/N` of
//! every layer's routed experts. At each MoE layer the step packs its dispatch messages on its
//! device (`ep_slots` and `copy_rows`: the framing of the host forward's
//! `engine::parallel::expert::dispatch_messages`, value for value), the ranks gather every
//! rank's message counts on their devices and read them back once ([`Kernels::gather_counts`]),
//! so each knows what it sends and receives, and exchange the messages GPU to GPU without
//! gathering sizes again ([`Kernels::exchange_known`], over NCCL); each computes the pairs it
//! received with its own experts, sends the outputs back the same way, and gathers them into
//! pair order (`copy_rows`) for the device's slot-order sum (`combine`). No row crosses to the
//! host. Every product is the row one rank's step computes (a pair's row does not depend on
//! the other rows of its launch), so the group's logits are the one-rank step's, bit for bit
//! with the exact kernels. The ranks of a group run the same phases on the same kind of step
//! (a rank stepping prompts on the host would meet the others' device exchanges).
//!
//! Of a tensor-parallel group (`--tp N`) every rank steps every request over its share of the
//! heads and gathers the attention's output groups ([`StepOps::gather_lows`]); with the experts
//! split over the same ranks, each computes its experts' pairs from its own copy of the tokens
//! and the ranks sum their rows, -0 where another rank holds the pair's expert
//! ([`DeviceStepOps::routed_replicated`]); with every expert sliced over them (`--moe-tp`),
//! each computes its slice of every pair and the ranks sum the gathered partial outputs in
//! rank order ([`DeviceStepOps::routed_sliced`]). These groups' exchanges have the batch's
//! sizes and read nothing back, so their steps replay as graphs do (`super::replay`).

use std::sync::Arc;

use engine::parallel::{
    collective::Collective, expert::ExpertParallel, sliced::SlicedExperts, tensor::TensorParallel,
};

use super::{
    StepOps,
    device_ops::{DBuf, DIdx, DeviceStepOps, offsets},
    kernels::{Kernels, SlotSpec},
};

/// A layer's dispatch messages on the device ([`DeviceStepOps::pack`]).
struct Packed<K: Kernels> {
    /// The messages, back to back by destination rank.
    send: DBuf<K>,
    /// Where each pair's output is in what the ranks send back.
    back_from: K::L,
    /// The pairs to each rank.
    counts: Vec<usize>,
    /// The pairs each rank sends this one (where the counts were gathered).
    to_me: Vec<usize>,
}

impl<K: Kernels> DeviceStepOps<K> {
    /// The group this rank gathers the attention's output groups over, if any.
    pub fn tensor_parallel(&self) -> Option<&Arc<TensorParallel>> {
        self.tensor_parallel.as_ref()
    }

    /// The group this rank sums its routed experts' partial outputs over, if any.
    pub fn sliced_experts(&self) -> Option<&Arc<SlicedExperts>> {
        self.sliced.as_ref()
    }

    /// The group this rank exchanges its routed experts' pairs with, if any.
    pub fn expert_parallel(&self) -> Option<&Arc<ExpertParallel>> {
        self.expert_parallel.as_ref()
    }

    /// [`StepOps::routed_experts`] over the group `ep`: `[pairs, D]` in pair order. The
    /// dispatch messages are packed on the device (`ep_slots`, `copy_rows`), their counts
    /// gathered ([`Kernels::gather_counts`], the one read back) and the messages exchanged by
    /// [`Kernels::exchange_known`] (GPU to GPU over NCCL).
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
        let context = |e: K::Error| format!("layer {layer}'s routed experts over the group: {e}");
        let packed = self.pack(ep, (h, experts), (k, d), pairs)?;
        let message = |c: usize| 1 + c * (1 + d);
        let sizes: Vec<usize> = packed.counts.iter().map(|&c| message(c)).collect();
        let from: Vec<usize> = packed.to_me.iter().map(|&c| message(c)).collect();
        let recv = self
            .exchange_known(ep.collective().as_mut(), &packed.send, (&sizes, &from))
            .map_err(context)?;
        // What each rank sent: [count, expert ids, rows], back to back.
        let (mut id_at, mut row_at) = (Vec::new(), Vec::new());
        let mut base = 0;
        for &m in &packed.to_me {
            id_at.extend((0..m).map(|j| (base + 1 + j) as i64));
            row_at.extend((0..m).map(|j| (base + 1 + m + j * d) as i64));
            base += message(m);
        }
        let ys = if id_at.is_empty() {
            self.alloc(1)?
        } else {
            self.held_pairs(ep, layer, &recv, (&id_at, &row_at), inter)?
        };
        // The outputs back to their tokens' ranks, in the order each listed its pairs.
        let sizes: Vec<usize> = packed.to_me.iter().map(|&m| m * d).collect();
        let back_sizes: Vec<usize> = packed.counts.iter().map(|&c| c * d).collect();
        let back = self
            .exchange_known(ep.collective().as_mut(), &ys, (&sizes, &back_sizes))
            .map_err(context)?;
        self.unpack(&back, &packed, d, pairs)
    }

    /// A layer's dispatch messages packed on the device (`ep_slots`, then the rows by
    /// `copy_rows`), with every rank's counts, gathered on the devices and read back once.
    fn pack(
        &self,
        ep: &ExpertParallel,
        (h, experts): (&DBuf<K>, &DIdx<K>),
        (k, d): (usize, usize),
        pairs: usize,
    ) -> Result<Packed<K>, K::Error> {
        let (k, split) = (k.max(1), ep.split());
        let ranks = split.ranks();
        if K::f_len(h) < pairs.div_ceil(k) * d || K::i_len(experts) < pairs {
            return Err(format!("{pairs} pairs of {k} per token outside their buffers").into());
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
        // Every rank's counts (one read back: gathered on the devices).
        let me = ep.rank();
        let all = self
            .k
            .gather_counts(ep.collective().as_mut(), &counts, ranks + 1)?;
        let whole = |c: i32| usize::try_from(c).unwrap_or(usize::MAX);
        let mut counts: Vec<usize> = all[me].iter().map(|&c| whole(c)).collect();
        let invalid = counts.pop().unwrap_or(usize::MAX);
        if invalid != 0 || counts.len() != ranks || counts.iter().sum::<usize>() != pairs {
            return Err(format!(
                "{invalid} of {pairs} routed pairs name no expert of the model's {}",
                split.experts()
            )
            .into());
        }
        let to_me = all
            .iter()
            .enumerate()
            .map(|(r, row)| {
                row.get(me)
                    .and_then(|&c| usize::try_from(c).ok())
                    .ok_or_else(|| format!("rank {r} gathered no count for rank {me}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Packed {
            send,
            back_from,
            counts,
            to_me,
        })
    }

    /// The outputs that came back (`back`, each rank's in the order this rank listed its
    /// pairs to it) into pair order: `[pairs, D]`.
    fn unpack(
        &self,
        back: &K::F,
        packed: &Packed<K>,
        d: usize,
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let mut out = self.alloc((pairs * d).max(1))?;
        if pairs > 0 {
            let to = self.plan_l(&offsets(pairs, d, 0))?;
            self.k
                .copy_rows(back, &packed.back_from, &mut out, &to, d, pairs)?;
        }
        Ok(out)
    }

    /// [`StepOps::routed_experts`] on a rank of an expert-parallel group whose ranks hold the
    /// same tokens and pairs (tensor-parallel attention): each rank computes the pairs of the
    /// experts it holds from its own copy of their tokens (`held_ids`: another rank's pairs
    /// get -1, a NaN row the kernels skip past), clears the others' rows to -0.0
    /// (`clear_unheld_rows`) and the ranks sum their rows ([`Kernels::all_owned`]: one NCCL
    /// all-reduce), which gives each pair's row as the rank that holds its expert computed it,
    /// bit for bit. Nothing is read back: the exchange's size is the batch's. The host
    /// forward's `routed_replicated` splits the pairs differently; every product is the same
    /// row.
    pub(super) fn routed_replicated(
        &self,
        ep: &ExpertParallel,
        layer: usize,
        h: &DBuf<K>,
        experts: &DIdx<K>,
        (k, inter): (usize, usize),
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let (d, split) = (self.config.hidden_size, ep.split());
        let mut out = self.alloc((pairs * d).max(1))?;
        // Every rank has the same pairs: none on one is none on all, and none exchanges.
        if pairs == 0 {
            return Ok(out);
        }
        if K::i_len(experts) < pairs {
            return Err(format!("{pairs} pairs outside their buffer").into());
        }
        let held = split.held_by(ep.rank());
        let mut ids = self.alloc_i(pairs)?;
        let mine = (held.start, held.len());
        self.k
            .held_ids(experts, mine, split.experts(), pairs, &mut ids)?;
        let mut ys = super::routed_here(self, layer, h, &ids, (k, inter), pairs)?;
        self.k.clear_unheld_rows(&mut ys, &ids, d, pairs)?;
        self.k
            .all_owned(ep.collective().as_mut(), &ys, pairs * d, &mut out)
            .map_err(|e| format!("layer {layer}'s routed experts over the group: {e}"))?;
        Ok(out)
    }

    /// The outputs of the pairs of `received` (ids at `at.0`, rows at `at.1`) through this
    /// rank's experts: `[m, D]`.
    fn held_pairs(
        &self,
        ep: &ExpertParallel,
        layer: usize,
        received: &K::F,
        (id_at, row_at): (&[i64], &[i64]),
        inter: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let (d, m) = (self.config.hidden_size, id_at.len());
        let held = ep.split().held_by(ep.rank());
        let mut ids = self.alloc_i(m)?;
        let at = self.plan_l(id_at)?;
        self.k
            .ep_take_ids(received, &at, (held.start, held.len()), m, &mut ids)?;
        let mut x = self.alloc(m * d)?;
        self.copy_rows(received, row_at, &mut x, &offsets(m, d, 0), d)?;
        super::routed_here(self, layer, &x, &ids, (1, inter), m)
    }

    /// [`StepOps::gather_lows`] over the tensor-parallel group `tp`: this rank's groups'
    /// outputs (`[n, width]`) to every rank, every rank's joined per token in rank order.
    pub(super) fn gather_in_group(
        &self,
        tp: &TensorParallel,
        lows: &DBuf<K>,
        n: usize,
        width: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let ranks = tp.size();
        let part = n * width;
        let recv = self
            .all_gather(tp.collective().as_mut(), lows, (n, width))
            .map_err(|e| format!("the attention's output groups over the group: {e}"))?;
        let mut joined = self.alloc((ranks * part).max(1))?;
        if part > 0 {
            let (from, to): (Vec<i64>, Vec<i64>) = (0..ranks)
                .flat_map(|r| (0..n).map(move |t| (r, t)))
                .map(|(r, t)| {
                    (
                        (r * part + t * width) as i64,
                        ((t * ranks + r) * width) as i64,
                    )
                })
                .unzip();
            self.copy_rows(&recv, &from, &mut joined, &to, width)?;
        }
        Ok(joined)
    }

    /// [`StepOps::routed_experts`] on a rank of an expert-slice group, whose ranks hold the
    /// same tokens and pairs (tensor-parallel attention): this rank's partial output of every
    /// pair (the experts it holds are its slices of theirs, `SlicedExperts::held`, so the
    /// one-rank products over `inter / N` values are the partials), gathered from every rank
    /// and summed in rank order as the host forward's `SlicedExperts::routed` sums them, bit
    /// for bit with the exact kernels.
    pub(super) fn routed_sliced(
        &self,
        sliced: &SlicedExperts,
        layer: usize,
        h: &DBuf<K>,
        experts: &DIdx<K>,
        (k, inter): (usize, usize),
        pairs: usize,
    ) -> Result<DBuf<K>, K::Error> {
        let (d, ranks) = (self.config.hidden_size, sliced.size());
        let part = pairs * d;
        let partials = if pairs == 0 {
            self.alloc(1)?
        } else {
            let slice = sliced.slice(inter).len();
            super::routed_here(self, layer, h, experts, (k, slice), pairs)?
        };
        let all = self
            .all_gather(sliced.collective().as_mut(), &partials, (pairs, d))
            .map_err(|e| format!("layer {layer}'s expert slices over the group: {e}"))?;
        let mut sum = self.alloc(part.max(1))?;
        if part > 0 {
            self.k.sum_blocks(&all, (ranks, part), &mut sum)?;
        }
        Ok(sum)
    }

    /// `rows` rows of `width` of `buf` from every rank of `coll`'s group to every rank:
    /// `[ranks * rows * width]`, rank r's at `r * rows * width` ([`Kernels::all_gather`]: one
    /// NCCL all-gather on GPUs), in a buffer of the step's pool.
    fn all_gather(
        &self,
        coll: &mut dyn Collective,
        buf: &K::F,
        (rows, width): (usize, usize),
    ) -> Result<DBuf<K>, K::Error> {
        let part = rows * width;
        if K::f_len(buf) < part {
            return Err(format!("all-gather: {rows} rows of {width} outside their buffer").into());
        }
        let mut all = self.alloc((coll.size() * part).max(1))?;
        self.k.all_gather(coll, buf, part, &mut all)?;
        Ok(all)
    }

    /// [`Kernels::exchange_known`] over a group's collective.
    fn exchange_known(
        &self,
        coll: &mut dyn Collective,
        send: &K::F,
        sizes: (&[usize], &[usize]),
    ) -> Result<K::F, K::Error> {
        let ranks = coll.size();
        if sizes.0.len() != ranks || sizes.1.len() != ranks {
            return Err(format!("messages for a group of {ranks}").into());
        }
        self.k.exchange_known(coll, send, sizes)
    }

    /// A step with no tokens on a rank of an expert-parallel group: every layer's exchange,
    /// computing the pairs the other ranks send (nothing to do without a group).
    pub fn idle_exchange(&self) -> Result<(), K::Error> {
        // Under tensor parallelism every rank steps every request: all idle at once.
        let Some(ep) = self
            .expert_parallel
            .as_deref()
            .filter(|_| self.tensor_parallel.is_none())
        else {
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
