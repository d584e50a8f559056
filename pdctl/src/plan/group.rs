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
    /// Under sliced experts: each rank's slice of every expert's intermediate values, of how
    /// many, and whether it falls on the stored form's scale blocks (which GPU workers need).
    pub slice: Option<ExpertSlice>,
}

/// A rank's slice of every routed expert's intermediate values.
#[derive(Debug, Clone, Copy)]
pub struct ExpertSlice {
    pub values: usize,
    pub of: usize,
    /// Values per scale block of the experts' stored form (1: none).
    pub block: usize,
}

impl ExpertSlice {
    /// Of `c`'s experts over `parallel`'s ranks, under sliced experts.
    fn of(c: &ModelConfig, parallel: Parallel) -> Option<Self> {
        use engine::config::ExpertFormat;
        let block = match c.expert_format {
            ExpertFormat::Bf16 => 1,
            ExpertFormat::Fp8Block => engine::quant::FP8_BLOCK,
            ExpertFormat::Mxfp4 => engine::quant::MXFP4_BLOCK,
            ExpertFormat::Nvfp4 => engine::quant::NVFP4_BLOCK,
        };
        let of = c.moe_intermediate_size;
        (parallel.moe_tp && parallel.tp > 0).then(|| Self {
            values: of / parallel.tp,
            of,
            block,
        })
    }

    /// Whether a GPU worker can hold it: its edges on the stored form's scale blocks.
    pub fn on_blocks(self) -> bool {
        self.values.is_multiple_of(self.block)
    }
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
            slice: ExpertSlice::of(c, parallel),
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
            "expert_slice": self.slice.map(|s| json!({
                "values": s.values,
                "of": s.of,
                "on_scale_blocks": s.on_blocks(),
            })),
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
        if let Some(s) = self.slice {
            let _ = write!(
                out,
                "  experts: each rank holds {} of every expert's {} intermediate values",
                s.values, s.of
            );
            if s.on_blocks() {
                let _ = writeln!(out);
            } else {
                let _ = writeln!(
                    out,
                    "; GPU workers refuse it (a slice of {} cuts the stored scale blocks of {}; \
                     the cpu backend runs it)",
                    s.values, s.block
                );
            }
        }
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
