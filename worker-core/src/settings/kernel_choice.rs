//! The device step's kernel choices, each a worker setting of its own: `exact` (the CPU
//! reference's bits) or `fast` (within the kernel's stated bound).

use serde::{Deserialize, Serialize};

/// How a decode worker's device step attends (decode workers on `cuda` or `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DecodeAttention {
    /// `attn_exact`: the CPU reference's bits.
    Exact,
    /// `attn_decode_fp8`: every head of a request against each tile of its FP8 rows on tensor
    /// cores, within `2^-8` of the largest row value of the exact result (needs
    /// `kv_cache_dtype` fp8 or bf16); the indexer's scores on tensor cores
    /// (`indexer_scores_mma`).
    Fast,
}

/// How a decode worker's device step runs the routed experts (decode workers on `cuda` or
/// `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DecodeExperts {
    /// `exact_pairs`: the CPU reference's bits.
    Exact,
    /// The grouped FP4 GEMV the per-op CUDA backend uses: within its bound of f64 sums over
    /// the decoded weights, not the reference's bits.
    Fast,
}

/// How a decode worker's device step runs the bf16 and FP8 linears (attention, shared expert,
/// output head; decode workers on `cuda` or `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DecodeLinears {
    /// `exact_gemv`: the CPU reference's bits (each weight read once per four sequences).
    Exact,
    /// The dense GEMM on bf16 tensor cores: each weight read once per 64 sequences, the
    /// activations rounded to bf16, within its bound of f64 sums over the bf16 operands.
    Fast,
}

/// How a prefill worker's device step attends for its prompt chunks (prefill workers on `cuda`
/// or `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PrefillAttention {
    /// `attn_exact`: the CPU reference's bits.
    Exact,
    /// `attn_decode_fp8` for each token of a chunk (all heads against each tile of its FP8
    /// rows on tensor cores) and the indexer's scores on tensor cores, within their bounds
    /// (needs `kv_cache_dtype` fp8 or bf16).
    Fast,
}

/// How a prefill worker's device step runs its prompt chunks' bf16 and FP8 linears
/// (attention, shared expert, output head; prefill workers on `cuda` or `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PrefillLinears {
    /// `exact_gemv`: the CPU reference's bits (each weight read once per four tokens).
    Exact,
    /// The dense GEMM on bf16 tensor cores: each weight read once per 64 tokens of the step,
    /// the activations rounded to bf16, within its bound of f64 sums over the bf16 operands.
    Fast,
}

/// How a prefill worker's device step runs its prompt chunks' routed experts (prefill
/// workers on `cuda` or `emulated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PrefillExperts {
    /// `exact_pairs`: the CPU reference's bits (each expert's weight read once per pair).
    Exact,
    /// The grouped GEMM: the (token, expert) pairs grouped by expert on the device, each
    /// expert's weight read once per 64 of its pairs, the activations rounded to bf16; within
    /// its bound of the f64 reference over the bf16 activations.
    Fast,
}

impl super::WorkerSettings {
    /// Whether the worker's steps run whole on its devices: backend cuda or emulated without
    /// hybrid, one rank or each rank of a tensor-parallel group (its experts whole, split or
    /// sliced over the ranks) or of an expert-parallel group with data-parallel attention.
    pub fn device_step(&self) -> bool {
        self.backend != kernels::backend::BackendKind::Cpu
            && !self.hybrid
            && self.group_spec().parallel.steps_whole_on_devices()
    }

    /// The first kernel setting of the other role's steps that is set, refused naming its key:
    /// a decode worker computes no prompts, a prefill worker decodes nothing (never accepted
    /// and then ignored).
    ///
    /// # Errors
    /// That setting's key.
    pub fn refuse_other_roles_settings(
        &self,
        role: proto::v1::Role,
    ) -> Result<(), common::config::Invalid> {
        let (set, why) = if role == proto::v1::Role::Decode {
            let set = [
                (
                    self.prefill_attention != PrefillAttention::Exact,
                    "prefill_attention",
                ),
                (
                    self.prefill_linears != PrefillLinears::Exact,
                    "prefill_linears",
                ),
                (
                    self.prefill_experts != PrefillExperts::Exact,
                    "prefill_experts",
                ),
            ];
            (set.to_vec(), "a decode worker computes no prompts")
        } else {
            let set = [
                (
                    self.decode_attention != DecodeAttention::Exact,
                    "decode_attention",
                ),
                (
                    self.decode_experts != DecodeExperts::Exact,
                    "decode_experts",
                ),
                (
                    self.decode_linears != DecodeLinears::Exact,
                    "decode_linears",
                ),
                (self.decode_graphs, "decode_graphs"),
            ];
            (set.to_vec(), "a prefill worker does not decode")
        };
        match set.into_iter().find(|&(set, _)| set) {
            Some((_, key)) => Err(common::config::Invalid::new(
                key,
                format!("{why}: it takes no {key}"),
            )),
            None => Ok(()),
        }
    }

    /// The settings that make the worker's results differ from the reference's bits within
    /// stated bounds: each fast kernel choice, sliced experts (their partial sums added in
    /// another order), and the per-op CUDA path (`hybrid`, or a group whose steps do not run
    /// whole on the devices: its GEMVs and GEMMs are within their bounds).
    pub fn fast_kernels(&self) -> Vec<&'static str> {
        let per_op_cuda =
            self.backend == kernels::backend::BackendKind::Cuda && !self.device_step();
        [
            (
                self.decode_attention == DecodeAttention::Fast,
                "decode_attention",
            ),
            (self.decode_experts == DecodeExperts::Fast, "decode_experts"),
            (self.decode_linears == DecodeLinears::Fast, "decode_linears"),
            (
                self.prefill_attention == PrefillAttention::Fast,
                "prefill_attention",
            ),
            (
                self.prefill_linears == PrefillLinears::Fast,
                "prefill_linears",
            ),
            (
                self.prefill_experts == PrefillExperts::Fast,
                "prefill_experts",
            ),
            (self.moe_tensor_parallel, "moe_tensor_parallel"),
            (per_op_cuda, "hybrid"),
        ]
        .into_iter()
        .filter_map(|(fast, key)| fast.then_some(key))
        .collect()
    }

    /// What computes the worker's steps, as its `Info` reports it; `plan` is the one its
    /// start-up log printed (none on the CPU reference).
    pub fn compute(&self, plan: Option<&engine::backend::BackendPlan>) -> proto::v1::Compute {
        proto::v1::Compute {
            backend: self.backend.name().to_owned(),
            plan: plan.map(ToString::to_string).unwrap_or_default(),
            kv_cache_dtype: self.kv_cache_dtype.storage().name().to_owned(),
            fast_kernels: self.fast_kernels().into_iter().map(str::to_owned).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;
    use crate::settings::{KvCacheDtype, WorkerSettings};
    use kernels::backend::BackendKind;

    /// A worker names each setting that makes its results differ from the reference's bits,
    /// and none when it computes them exactly.
    #[test]
    fn compute_names_the_settings_that_leave_the_references_bits() {
        let mut s = WorkerSettings::listening_on(0);
        let exact = s.compute(None);
        assert_eq!(
            (exact.backend.as_str(), exact.kv_cache_dtype.as_str()),
            ("cpu", "f32")
        );
        assert!(exact.fast_kernels.is_empty() && exact.plan.is_empty());
        s.backend = BackendKind::Emulated;
        s.kv_cache_dtype = KvCacheDtype::Bf16;
        s.decode_attention = DecodeAttention::Fast;
        s.prefill_experts = PrefillExperts::Fast;
        let c = s.compute(None);
        assert_eq!(c.kv_cache_dtype, "bf16");
        assert_eq!(c.fast_kernels, vec!["decode_attention", "prefill_experts"]);
        // The per-op CUDA path is within its kernels' bounds; the device step exact by default.
        let mut s = WorkerSettings::listening_on(0);
        s.backend = BackendKind::Cuda;
        assert!(s.device_step() && s.fast_kernels().is_empty());
        s.hybrid = true;
        assert_eq!(s.fast_kernels(), vec!["hybrid"]);
        s.hybrid = false;
        // Tensor-parallel ranks step on their devices too (exact), and so do sliced experts
        // (their partial sums within their bound).
        s.tensor_parallel_size = 2;
        assert!(s.device_step() && s.fast_kernels().is_empty());
        s.moe_tensor_parallel = true;
        assert!(s.device_step());
        assert_eq!(s.fast_kernels(), vec!["moe_tensor_parallel"]);
        s.moe_tensor_parallel = false;
        s.tensor_parallel_size = 1;
        s.expert_parallel_size = 2;
        s.dp_attention = true;
        assert!(s.device_step() && s.fast_kernels().is_empty());
    }
}
