//! Binding listeners with errors that name the setting, so "address in use" says which key.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::ConfigError;

/// Binds `addr`, the value of setting `key`.
pub async fn bind(key: &str, addr: SocketAddr) -> Result<TcpListener, ConfigError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ConfigError::Bind {
            key: key.to_owned(),
            addr,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn port_in_use_names_the_key() {
        let first = bind("grpc_listen", "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let taken = first.local_addr().unwrap();
        let err = bind("grpc_listen", taken).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("`grpc_listen`: cannot listen on 127.0.0.1:"),
            "{msg}"
        );
    }
}
