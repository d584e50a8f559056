//! Plumbing shared by every pdserve binary: layered configuration, the one list of
//! environment variable names, logging, shutdown signals and local asset lookup.
//!
//! Wire types do not live here (see the `proto` crate).

pub mod assets;
pub mod binary_check;
pub mod cli;
pub mod cluster_auth;
pub mod config;
pub mod env;
pub mod fault;
pub mod grpc;
pub mod http_client;
pub mod internal_tls;
pub mod listen;
pub mod logging;
pub mod pending;
pub mod registration;
pub mod shutdown;
pub mod systemd;
pub mod worker_info;
pub mod worker_server;

pub use config::{ConfigError, Origin, ServiceConfig};
