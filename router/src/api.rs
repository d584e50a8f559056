//! The HTTP API: the three protocols (OpenAI chat/completions and completions, OpenAI
//! Responses, Anthropic Messages) with their parameter parsing, the server's routes and auth,
//! per-key limits, and the one mapping from an error to its HTTP status and body
//! ([`error::ApiError`]). It reaches the model only through [`crate::served::Served`] and its
//! [`crate::backend::Backend`].

pub mod chat;
pub mod completions;
pub mod content;
pub mod detokenize;
pub mod error;
pub mod fields;
pub mod http;
pub mod key_limit;
pub mod protocol;
pub mod request_id;
pub mod structured;
pub mod tool_grammar;
