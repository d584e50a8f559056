//! Errors of the router process. HTTP API errors and their status mapping are in
//! [`crate::api::error`].

use common::{ConfigError, cli::ExitStatus};

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The router could not start serving.
    #[error("{0}")]
    Startup(String),
}

impl ExitStatus for RouterError {
    fn exit_code(&self) -> u8 {
        match self {
            RouterError::Config(e) => e.exit_code(),
            RouterError::Grpc(_) | RouterError::Io(_) | RouterError::Startup(_) => {
                common::cli::EXIT_RUNTIME
            }
        }
    }
}
