//! [`DeviceStepOps`] as one rank of an expert-parallel group (`--ep N --dp-attention`): each
//! rank steps its own requests on its own device and holds `1/N` of every layer's routed
//! experts; at each MoE layer the step reads its (token, expert) pairs and their inputs back,
//! exchanges them with the group over the model's [`ExpertParallel`] (the same collective and
//! framing as the host forward's, `engine::parallel::expert::exchange_pairs`), computes the
//! pairs it received with its own experts on its device, and puts the outputs that came back
//! into the step's buffer in pair order. The slot-order sum (`combine`) stays on the device.
//! Every product is the row one rank's step computes (a pair's row does not depend on the
//! other rows of its launch), so the group's logits are the one-rank step's, bit for bit with
//! the exact kernels.
//!
//! The exchange goes through the host: a step of V4-Flash's 43 layers reads its pairs back
//! 43 times. Device-resident dispatch (NCCL send/recv of device buffers with counts in-band)
//! would remove the round trips; the bits would not change.

use std::sync::Arc;

use engine::parallel::expert::{ExpertError, ExpertParallel};

use super::{
    StepOps,
    device_ops::{DBuf, DIdx, DeviceStepOps},
    kernels::Kernels,
};

impl<K: Kernels> DeviceStepOps<K> {
    /// The group this rank exchanges its routed experts' pairs with, if any.
    pub fn expert_parallel(&self) -> Option<&Arc<ExpertParallel>> {
        self.expert_parallel.as_ref()
    }

    /// [`StepOps::routed_experts`] over the group `ep`: `[pairs, D]` in pair order.
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
        let k = k.max(1);
        let tokens = pairs.div_ceil(k);
        let ids = self.get_idx(experts, 0..pairs)?;
        let rows = self.get(h, 0..tokens * d)?;
        let xs: Vec<&[f32]> = rows.chunks_exact(d.max(1)).collect();
        let listed = ids
            .iter()
            .enumerate()
            .map(|(p, &e)| usize::try_from(e).map(|e| (p / k, e)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| format!("layer {layer}: a negative routed expert id").to_owned())?;
        let mut compute = |inputs: &[(usize, &[f32])]| {
            self.held_pairs(layer, inputs, inter)
                .map_err(|e| ExpertError::Invalid(e.to_string()))
        };
        let outputs = ep
            .routed_with(d, &xs, &listed, &mut compute)
            .map_err(|e| format!("layer {layer}'s routed experts over the group: {e}"))?;
        let mut ys = self.alloc(pairs * d)?;
        self.put_at(&mut ys, 0, &outputs.concat())?;
        Ok(ys)
    }

    /// The routed experts of the pairs this rank received: each input row through its held
    /// expert (`inputs`' first value: the expert's index among this rank's), one output row
    /// each, in order.
    fn held_pairs(
        &self,
        layer: usize,
        inputs: &[(usize, &[f32])],
        inter: usize,
    ) -> Result<Vec<Vec<f32>>, K::Error> {
        let d = self.config.hidden_size;
        let m = inputs.len();
        let local: Vec<i32> = inputs
            .iter()
            .map(|&(e, _)| i32::try_from(e).map_err(|_| format!("expert {e}")))
            .collect::<Result<_, _>>()?;
        let mut x = self.alloc(m * d)?;
        let flat: Vec<f32> = inputs
            .iter()
            .flat_map(|(_, row)| row.iter().copied())
            .collect();
        self.put_at(&mut x, 0, &flat)?;
        let experts = self.put_idx(&local)?;
        let ys = super::routed_here(self, layer, &x, &experts, (1, inter), m)?;
        let out = self.get(&ys, 0..m * d)?;
        Ok(out.chunks_exact(d.max(1)).map(<[f32]>::to_vec).collect())
    }

    /// A step with no tokens on a rank of an expert-parallel group: every layer's exchange,
    /// computing the pairs the other ranks send (nothing to do without a group).
    pub fn idle_exchange(&self) -> Result<(), K::Error> {
        let Some(ep) = self.expert_parallel.as_deref() else {
            return Ok(());
        };
        self.begin_step();
        let (d, inter) = (self.config.hidden_size, self.config.moe_intermediate_size);
        for layer in 0..self.config.num_layers() {
            let mut compute = |inputs: &[(usize, &[f32])]| {
                self.held_pairs(layer, inputs, inter)
                    .map_err(|e| ExpertError::Invalid(e.to_string()))
            };
            ep.routed_with(d, &[], &[], &mut compute)
                .map_err(|e| format!("layer {layer}'s routed experts over the group: {e}"))?;
        }
        Ok(())
    }
}
