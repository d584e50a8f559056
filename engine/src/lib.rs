//! The DeepSeek-V4 engine: model config and checkpoints, the forward pass, paged request
//! state, prefix cache, the continuous-batching scheduler with the prefill/decode handoff,
//! sampling, and a thread runner for async services. Token ids in, token ids out.
pub mod backend;
pub mod config;
pub mod formats;
pub mod grammar;
pub mod model;
pub mod paged;
pub mod parallel;
pub mod plan;
pub mod pool;
pub mod quant;
pub mod rope;
pub mod runner;
pub mod safetensors;
pub mod sampling;
pub mod scheduler;
pub mod schema;
pub mod start;
pub mod synth;
pub mod tensor;
pub mod weights;
