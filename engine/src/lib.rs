//! The DeepSeek-V4 engine: model config and checkpoints, the forward pass over a backend,
//! paged request state, prefix cache, schedulers and sampling. Token ids in, token ids out.
//!
//! The model arrives with the "Engine I" work; this crate is the placeholder the workspace
//! layout promises.
pub mod config;
pub mod formats;
pub mod model;
pub mod paged;
pub mod pool;
pub mod quant;
pub mod rope;
pub mod safetensors;
pub mod sampling;
pub mod scheduler;
pub mod schema;
pub mod synth;
pub mod tensor;
pub mod weights;
