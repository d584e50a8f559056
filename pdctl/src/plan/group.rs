//! `pdctl plan --tp N --ep M [--dp-attention]`: what each GPU of a group holds (weights by
//! class, from `engine::plan::shard`) and what fits beside them.

use std::fmt::Write as _;

use engine::{
    config::ModelConfig,
    plan::{
        StatePlan,
        shard::{self, GpuFit, GpuWeights, Parallel},
    },
};
use serde_json::{Value, json};

use super::{gb, grouped};

/// The per-GPU part of a plan.
pub struct GroupReport {
    pub parallel: Parallel,
    pub weights: GpuWeights,
    pub fit: Option<GpuFit>,
    pub context: u64,
}

impl GroupReport {
    /// Sizes `c` over `parallel`; `memory` (bytes per GPU, utilization) sizes the fit.
    pub fn new(
        c: &ModelConfig,
        parallel: Parallel,
        state: &StatePlan,
        memory: Option<(u64, f64)>,
        context: u64,
    ) -> Self {
        let weights = shard::gpu_weights(c, parallel);
        let fit = memory.map(|(bytes, utilization)| {
            shard::gpu_fit(
                &weights,
                parallel,
                bytes,
                utilization,
                (
                    state.page_bytes,
                    state.page_size as u64,
                    state.request_bytes(context),
                ),
            )
        });
        Self {
            parallel,
            weights,
            fit,
            context,
        }
    }

    fn layout(&self) -> String {
        let p = self.parallel;
        let attention = if p.dp_attention {
            format!("data-parallel attention over {} ranks", p.gpus())
        } else {
            format!("attention TP {}", p.tp)
        };
        let experts = if p.moe_tp {
            format!("routed experts sliced over {} ranks (MoE TP)", p.tp)
        } else {
            format!("routed experts EP {}", p.ep)
        };
        format!("{} GPUs: {attention}, {experts}", p.gpus())
    }

    pub fn json(&self) -> Value {
        json!({
            "gpus": self.parallel.gpus(),
            "tp": self.parallel.tp,
            "ep": self.parallel.ep,
            "dp_attention": self.parallel.dp_attention,
            "moe_tp": self.parallel.moe_tp,
            "weight_bytes": self.weights.total,
            "classes": self.weights.classes.iter().map(|(k, b)| json!({
                "class": k.name(),
                "bytes": b,
            })).collect::<Vec<_>>(),
            "fit": self.fit.as_ref().map(|f| json!({
                "usable_bytes": f.usable_bytes,
                "weights_fit": f.weights_fit,
                "free_bytes": f.free_bytes,
                "pages_per_gpu": f.pages_per_gpu,
                "tokens": f.tokens,
                "requests_at_context": f.requests,
            })),
        })
    }

    pub fn text(&self, out: &mut String) {
        let _ = writeln!(out, "\nper GPU, {}", self.layout());
        let _ = writeln!(out, "  {:<30} {:>19} {:>9}", "class", "bytes", "GB");
        for (class, bytes) in &self.weights.classes {
            let _ = writeln!(
                out,
                "  {:<30} {:>19} {:>9.2}",
                class.name(),
                grouped(*bytes),
                gb(*bytes)
            );
        }
        let _ = writeln!(
            out,
            "  {:<30} {:>19} {:>9.2}",
            "weights on each GPU",
            grouped(self.weights.total),
            gb(self.weights.total)
        );
        let state = if self.parallel.dp_attention {
            "each rank stores the state of its own requests"
        } else {
            "every rank stores the whole state of every request (one KV latent, replicated)"
        };
        let _ = writeln!(out, "  state: {state}");
        if let Some(f) = &self.fit {
            if f.weights_fit {
                let _ = writeln!(
                    out,
                    "  fit: {:.1} GB usable per GPU, {:.1} GB left for state: {} pages per GPU; \
                     the group holds {} tokens, {} requests of {} tokens at once",
                    gb(f.usable_bytes),
                    gb(f.free_bytes),
                    grouped(f.pages_per_gpu),
                    grouped(f.tokens),
                    grouped(f.requests),
                    self.context
                );
            } else {
                let _ = writeln!(
                    out,
                    "  fit: {:.1} GB of weights per GPU do NOT fit in {:.1} GB usable",
                    gb(self.weights.total),
                    gb(f.usable_bytes)
                );
            }
        }
    }
}
