//! The cluster secret on the serving side: read from the file the `cluster_secret_file`
//! setting names (validated once at start), and enforced on every gRPC call a process serves
//! (see `proto::auth` for the wire format and the client side).

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{SystemTime, UNIX_EPOCH},
};

use proto::auth::{ClusterSecret, Credentials, HEADER, HEALTH_PATH_PREFIX};
use tonic::codegen::{BoxFuture, http};

use crate::config::Invalid;

/// Command-line flags of the cluster's security settings (`cluster_secret_file` and `[tls]`),
/// the same for every service.
#[derive(Debug, Clone, Default, clap::Args, serde::Serialize)]
pub struct SecurityFlags {
    /// File holding the cluster's shared secret (all roles must use the same).
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_secret_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    #[serde(skip_serializing_if = "crate::internal_tls::TlsFlags::is_empty")]
    pub tls: crate::internal_tls::TlsFlags,
}
/// Configuration key of the secret file, the same in every role.
pub const KEY: &str = "cluster_secret_file";

/// Reads and checks the secret file: one secret per line, each 32 to 1024 visible ASCII
/// characters; the first is presented, all are accepted (a rotation adds the new secret as a
/// second line everywhere, then moves it first, then drops the old one). The file must not be
/// readable by other users.
pub fn read_secret(path: &Path) -> Result<ClusterSecret, Invalid> {
    let invalid = |reason: String| Invalid::new(KEY, format!("{}: {reason}", path.display()));
    let metadata = std::fs::metadata(path).map_err(|e| invalid(e.to_string()))?;
    if !metadata.is_file() {
        return Err(invalid("not a regular file".to_owned()));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode();
        if mode & 0o007 != 0 {
            return Err(invalid(format!(
                "other users may access it (mode {:o}); `chmod 600` it",
                mode & 0o777
            )));
        }
    }
    let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
    ClusterSecret::from_lines(&text).map_err(|e| invalid(e.to_string()))
}

/// The secret a process uses, if `cluster_secret_file` is set.
pub fn load(path: Option<&Path>) -> Result<Option<ClusterSecret>, Invalid> {
    path.map(read_secret).transpose()
}

/// How a process secures its internal gRPC: the shared secret and optional mutual TLS.
#[derive(Debug, Clone, Default)]
pub struct Security {
    pub secret: Option<ClusterSecret>,
    pub tls: Option<crate::internal_tls::InternalTls>,
}

impl Security {
    /// From a role's `cluster_secret_file` and `[tls]` settings (checked as in `validate`).
    pub fn load(
        secret_file: Option<&Path>,
        tls: &crate::internal_tls::TlsSettings,
    ) -> Result<Self, Invalid> {
        Ok(Self {
            secret: load(secret_file)?,
            tls: tls.load()?,
        })
    }

    /// What this process's own calls carry and how they connect.
    pub fn credentials(&self) -> Credentials {
        Credentials::new(self.secret.as_ref()).with_tls(
            self.tls
                .as_ref()
                .map(crate::internal_tls::InternalTls::client),
        )
    }
}

/// Warns once at start when a process serves unauthenticated gRPC beyond loopback.
pub fn warn_if_open(security: &Security, listen: SocketAddr) {
    if security.secret.is_none() && security.tls.is_none() && !listen.ip().is_loopback() {
        tracing::warn!(
            %listen,
            "internal gRPC calls are not authenticated; set {KEY} (and [tls]) on every role"
        );
    }
}

/// Tower layer refusing calls that do not carry the secret (all but the health service).
#[derive(Debug, Clone, Default)]
pub struct RequireSecretLayer {
    secret: Option<ClusterSecret>,
    last_warning_s: Arc<AtomicU64>,
}

impl RequireSecretLayer {
    /// `None` lets every call through (a cluster without a secret).
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        Self {
            secret,
            last_warning_s: Arc::default(),
        }
    }
}

impl<S> tower::Layer<S> for RequireSecretLayer {
    type Service = RequireSecret<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireSecret {
            inner,
            layer: self.clone(),
        }
    }
}

/// See [`RequireSecretLayer`].
#[derive(Debug, Clone)]
pub struct RequireSecret<S> {
    inner: S,
    layer: RequireSecretLayer,
}

impl<S, B> tower::Service<http::Request<B>> for RequireSecret<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(secret) = &self.layer.secret {
            let path = request.uri().path();
            let presented = request
                .headers()
                .get(HEADER)
                .map(http::HeaderValue::as_bytes);
            if !path.starts_with(HEALTH_PATH_PREFIX) && !secret.accepts(presented) {
                self.warn_refused(path, presented.is_some());
                let refused = tonic::Status::unauthenticated(
                    "this call needs the cluster secret (cluster_secret_file) of this cluster",
                );
                return Box::pin(std::future::ready(Ok(refused.into_http())));
            }
        }
        Box::pin(self.inner.call(request))
    }
}

impl<S> RequireSecret<S> {
    /// Logs refused calls at most once per second (a stray client must not flood the log).
    fn warn_refused(&self, path: &str, had_credentials: bool) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if self.layer.last_warning_s.swap(now, Ordering::Relaxed) != now {
            tracing::warn!(
                path,
                had_credentials,
                "refused an unauthenticated gRPC call (wrong or missing cluster secret)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn write(dir: &Path, name: &str, text: &str, mode: u32) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn secret_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let secret = "ab".repeat(16);
        let good = write(dir.path(), "good", &format!("{secret}\n"), 0o600);
        let loaded = read_secret(&good).unwrap();
        assert!(loaded.accepts(Some(format!("Bearer {secret}").as_bytes())));
        assert!(load(None).unwrap().is_none());

        let open = write(dir.path(), "open", &secret, 0o644);
        let error = read_secret(&open).unwrap_err();
        assert_eq!(error.key, KEY);
        assert!(error.reason.contains("chmod 600"), "{}", error.reason);

        let short = write(dir.path(), "short", "abc\n", 0o600);
        assert!(
            read_secret(&short)
                .unwrap_err()
                .reason
                .contains("3 characters")
        );
        let spaced = write(dir.path(), "spaced", &format!("{secret} {secret}\n"), 0o600);
        assert!(read_secret(&spaced).is_err());
        let empty = write(dir.path(), "empty", "\n", 0o600);
        assert!(
            read_secret(&empty)
                .unwrap_err()
                .reason
                .contains("no secret")
        );
        assert!(read_secret(&dir.path().join("missing")).is_err());
        assert!(read_secret(dir.path()).is_err());
    }
}
