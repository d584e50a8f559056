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
    /// `kv_cache_dtype = fp8`); the indexer's scores on tensor cores (`indexer_scores_mma`).
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
    /// (needs `kv_cache_dtype = fp8`).
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
