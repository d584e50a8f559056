//! One model copy spread over a GPU group: which bytes each GPU holds under tensor-parallel
//! attention (`tp`), expert-parallel routed experts (`ep`) and data-parallel attention
//! (`dp_attention`), and how the request state divides.
//!
//! The split follows the peers' choices for V4 (`../shared/reference/parallelism.md`):
//! attention TP shards `wq_b` by head and `wo_a` by output group and replicates the rest of the
//! attention (the one KV latent is stored whole on every rank); EP gives each rank
//! `n_routed_experts / ep` whole experts; everything else (embedding, head, router, shared
//! experts, compressors, indexer, norms) is replicated. Under DP-attention each rank owns whole
//! requests, so the state divides by rank; under TP every rank stores every request's state.

use super::WeightClass;
use crate::{
    config::ModelConfig,
    schema::{self, TensorSpec},
};

/// How one model copy is spread over its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Attention tensor parallelism (ranks sharing each request's heads).
    pub tp: usize,
    /// Expert parallelism (ranks holding disjoint experts).
    pub ep: usize,
    /// Attention by requests: each of the `ep` ranks runs whole requests (`tp` must be 1).
    pub dp_attention: bool,
    /// Every routed expert sliced over the `tp` ranks (its intermediate dimension), instead of
    /// replicated (`ep` 1) or divided by whole experts (`ep` = `tp`).
    pub moe_tp: bool,
}

impl Parallel {
    /// One GPU.
    pub const SINGLE: Self = Self {
        tp: 1,
        ep: 1,
        dp_attention: false,
        moe_tp: false,
    };

    /// GPUs in the group.
    pub fn gpus(&self) -> usize {
        self.tp.max(self.ep)
    }

    /// Whether each rank can step whole steps on its own device: one rank, ranks of expert
    /// parallelism with data-parallel attention (each exchanging its routed experts' pairs),
    /// or tensor-parallel ranks (each gathering the attention's output groups), their experts
    /// whole, split among them or each sliced over them.
    pub fn steps_whole_on_devices(&self) -> bool {
        let one = self.tp == 1 && self.ep == 1;
        let expert_ranks = self.ep > 1 && self.tp == 1 && !self.moe_tp && self.dp_attention;
        let head_ranks = self.tp > 1 && (self.ep == 1 || self.ep == self.tp);
        one || expert_ranks || head_ranks
    }

    /// The group as the device step's plan names it (none for one rank).
    pub fn describe_ranks(&self) -> String {
        match (self.tp, self.ep) {
            (1, 1) => String::new(),
            (1, ep) => format!(", each of {ep} expert-parallel ranks on its own"),
            (tp, 1) if self.moe_tp => format!(
                ", {tp} tensor-parallel ranks each with 1/{tp} of the heads and of every \
                 expert's intermediate values"
            ),
            (tp, 1) => format!(", {tp} tensor-parallel ranks each with 1/{tp} of the heads"),
            (tp, _) => format!(
                ", {tp} tensor-parallel ranks each with 1/{tp} of the heads and of the experts"
            ),
        }
    }

    /// Whether `c` can be split so, with the reason when not.
    pub fn validate(&self, c: &ModelConfig) -> Result<(), String> {
        let Self {
            tp,
            ep,
            dp_attention,
            moe_tp,
        } = *self;
        if tp == 0 || ep == 0 {
            return Err("tp and ep must be at least 1".to_owned());
        }
        let gpus = self.gpus();
        if !gpus.is_multiple_of(tp) || !gpus.is_multiple_of(ep) {
            return Err(format!(
                "tp {tp} and ep {ep} must each divide the group's {gpus} GPUs"
            ));
        }
        if dp_attention && tp != 1 {
            return Err(format!(
                "dp-attention runs whole requests per rank: tp must be 1 (got {tp})"
            ));
        }
        if !c.num_heads.is_multiple_of(tp) {
            return Err(format!(
                "tp {tp} must divide the {} attention heads",
                c.num_heads
            ));
        }
        if !c.o_groups.is_multiple_of(tp) {
            return Err(format!(
                "tp {tp} must divide the {} output groups (wo_a): attention TP is at most {}",
                c.o_groups, c.o_groups
            ));
        }
        if moe_tp && (tp < 2 || ep != 1) {
            return Err(format!(
                "moe-tp slices the experts over the tp ranks: it needs tp > 1 and ep 1 (got tp \
                 {tp}, ep {ep})"
            ));
        }
        if moe_tp
            && (!c.moe_intermediate_size.is_multiple_of(tp)
                || !(c.moe_intermediate_size / tp).is_multiple_of(8))
        {
            return Err(format!(
                "moe-tp {tp} must divide the experts' {} intermediate values into slices of a \
                 multiple of 8",
                c.moe_intermediate_size
            ));
        }
        if !c.n_routed_experts.is_multiple_of(ep) {
            return Err(format!(
                "ep {ep} must divide the {} routed experts",
                c.n_routed_experts
            ));
        }
        Ok(())
    }

    /// The share of `spec`'s bytes one GPU holds.
    fn share(&self, spec: &TensorSpec) -> f64 {
        let n = spec.name.as_str();
        if n.contains(".ffn.experts.") {
            let ranks = if self.moe_tp { self.tp } else { self.ep };
            1.0 / ranks as f64
        } else if n.contains(".attn.wq_b") || n.contains(".attn.wo_a") {
            1.0 / self.tp as f64
        } else {
            1.0
        }
    }
}

/// Served weight bytes on each GPU of the group, by class.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuWeights {
    /// In `WeightClass` order, served classes only.
    pub classes: Vec<(WeightClass, u64)>,
    pub total: u64,
}

/// What each GPU of a group holds of `c`'s served weights under `parallel` (every GPU the same).
pub fn gpu_weights(c: &ModelConfig, parallel: Parallel) -> GpuWeights {
    let mut classes: Vec<(WeightClass, f64)> = Vec::new();
    for spec in schema::tensors(c) {
        let class = WeightClass::of(&spec);
        let bytes = schema::stored_bytes(&spec) as f64 * parallel.share(&spec);
        match classes.iter_mut().find(|(k, _)| *k == class) {
            Some((_, b)) => *b += bytes,
            None => classes.push((class, bytes)),
        }
    }
    classes.sort_by_key(|(k, _)| *k);
    let classes: Vec<(WeightClass, u64)> = classes
        .into_iter()
        .map(|(k, b)| (k, b.ceil() as u64))
        .collect();
    let total = classes.iter().map(|(_, b)| b).sum();
    GpuWeights { classes, total }
}

/// What fits on each GPU of a group after its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuFit {
    /// Memory the engine may use on one GPU.
    pub usable_bytes: u64,
    /// Usable memory left after this GPU's weights; 0 when they do not fit.
    pub free_bytes: u64,
    pub weights_fit: bool,
    /// State pages on one GPU.
    pub pages_per_gpu: u64,
    /// Tokens of state the group holds: every GPU's pages under DP-attention (each rank its
    /// own requests), one GPU's under TP (every rank stores every request's latent).
    pub tokens: u64,
    /// Requests of `context` tokens the group holds at once.
    pub requests: u64,
}

/// The state that fits beside `weights` on GPUs of `memory_bytes` (fraction `utilization`
/// usable), for pages of `page_bytes` holding `page_size` tokens and requests of
/// `request_bytes`.
pub fn gpu_fit(
    weights: &GpuWeights,
    parallel: Parallel,
    memory_bytes: u64,
    utilization: f64,
    (page_bytes, page_size, request_bytes): (u64, u64, u64),
) -> GpuFit {
    let usable = ((memory_bytes as f64) * utilization).floor() as u64;
    let free = usable.saturating_sub(weights.total);
    let pages = free / page_bytes.max(1);
    let per_gpu_requests = free / request_bytes.max(1);
    let holders = if parallel.dp_attention {
        parallel.gpus() as u64
    } else {
        1
    };
    GpuFit {
        usable_bytes: usable,
        free_bytes: free,
        weights_fit: weights.total <= usable,
        pages_per_gpu: pages,
        tokens: pages * page_size * holders,
        requests: per_gpu_requests * holders,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::ExpertFormat, synth::Preset};

    fn bytes_of(w: &GpuWeights, class: WeightClass) -> u64 {
        w.classes
            .iter()
            .find(|(k, _)| *k == class)
            .map_or(0, |(_, b)| *b)
    }

    #[test]
    fn one_gpu_holds_every_served_byte_and_shards_divide_their_classes() {
        let c = Preset::Small.config(ExpertFormat::Nvfp4);
        let one = gpu_weights(&c, Parallel::SINGLE);
        assert_eq!(one.total, super::super::weights(&c).served);
        let ep = Parallel {
            tp: 1,
            ep: 4,
            dp_attention: true,
            moe_tp: false,
        };
        ep.validate(&c).unwrap();
        let four = gpu_weights(&c, ep);
        let experts = bytes_of(&one, WeightClass::RoutedExperts);
        assert_eq!(bytes_of(&four, WeightClass::RoutedExperts), experts / 4);
        for class in [
            WeightClass::Embedding,
            WeightClass::AttentionLinears,
            WeightClass::SharedExperts,
        ] {
            assert_eq!(
                bytes_of(&four, class),
                bytes_of(&one, class),
                "{class:?} replicated"
            );
        }
        let tp = Parallel {
            tp: 2,
            ep: 2,
            dp_attention: false,
            moe_tp: false,
        };
        tp.validate(&c).unwrap();
        let two = gpu_weights(&c, tp);
        let attn = (
            bytes_of(&one, WeightClass::AttentionLinears),
            bytes_of(&two, WeightClass::AttentionLinears),
        );
        assert!(
            attn.1 < attn.0 && attn.1 > attn.0 / 2,
            "wq_b and wo_a split, the rest whole: {attn:?}"
        );
    }

    #[test]
    fn splits_that_do_not_divide_are_refused() {
        let c = Preset::Small.config(ExpertFormat::Nvfp4);
        let p = |tp, ep, dp_attention| Parallel {
            tp,
            ep,
            dp_attention,
            moe_tp: false,
        };
        assert!(p(3, 1, false).validate(&c).is_err(), "heads");
        assert!(
            p(c.o_groups * 2, 1, false).validate(&c).is_err(),
            "output groups"
        );
        assert!(p(1, 3, true).validate(&c).is_err(), "experts");
        assert!(p(2, 2, true).validate(&c).is_err(), "dp-attention with tp");
        assert!(p(2, 4, false).validate(&c).is_ok());
        assert!(p(0, 1, false).validate(&c).is_err());
    }

    #[test]
    fn dp_attention_multiplies_the_state_tp_does_not() {
        let w = GpuWeights {
            classes: Vec::new(),
            total: 10,
        };
        let dp = Parallel {
            tp: 1,
            ep: 4,
            dp_attention: true,
            moe_tp: false,
        };
        let tp = Parallel {
            tp: 4,
            ep: 4,
            dp_attention: false,
            moe_tp: false,
        };
        let f = |p| gpu_fit(&w, p, 1000, 1.0, (100, 10, 300));
        assert_eq!(f(dp).pages_per_gpu, 9);
        assert_eq!(f(dp).tokens, 4 * 90);
        assert_eq!(f(tp).tokens, 90);
        assert_eq!(f(dp).requests, 4 * 3);
        assert_eq!(f(tp).requests, 3);
    }

    /// Sliced experts put 1/tp of every expert on each GPU; slicing needs tp > 1 without ep and
    /// an intermediate dimension the ranks divide.
    #[test]
    fn sliced_experts_divide_every_expert_by_tp() {
        let c = Preset::Small.config(ExpertFormat::Nvfp4);
        let one = gpu_weights(&c, Parallel::SINGLE);
        let sliced = Parallel {
            tp: 2,
            ep: 1,
            dp_attention: false,
            moe_tp: true,
        };
        sliced.validate(&c).unwrap();
        let two = gpu_weights(&c, sliced);
        let experts = bytes_of(&one, WeightClass::RoutedExperts);
        assert_eq!(bytes_of(&two, WeightClass::RoutedExperts), experts / 2);
        for (bad, what) in [
            (Parallel { ep: 2, ..sliced }, "ep 1"),
            (Parallel { tp: 1, ..sliced }, "tp > 1"),
        ] {
            let err = bad.validate(&c).unwrap_err();
            assert!(err.contains(what), "{err}");
        }
        let mut odd = c.clone();
        odd.moe_intermediate_size = 33;
        assert!(
            sliced
                .validate(&odd)
                .unwrap_err()
                .contains("33 intermediate")
        );
    }
}
