//! Mutual TLS between the processes of a cluster: the `[tls]` settings every role shares
//! (`cert_file`, `key_file`, `ca_file`, optional `server_name`), checked once at start, and the
//! server and client configurations built from them. With TLS on, a process's gRPC server
//! accepts only connections whose client presents a certificate signed by the cluster CA, and
//! its own calls verify the server's certificate against the same CA.

use std::path::{Path, PathBuf};

use proto::auth::ClientTls;
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::config::Invalid;

/// The `[tls]` settings (all three files, or none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSettings {
    /// This process's certificate chain (PEM), signed by the cluster CA; it must name the
    /// addresses others dial (or `server_name`).
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM; not readable by other users).
    pub key_file: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present certificates it signed.
    pub ca_file: Option<PathBuf>,
    /// The name every server certificate carries, when the certificates do not name the
    /// dialed host (e.g. one certificate for the whole cluster).
    pub server_name: Option<String>,
}

/// Command-line flags of the `[tls]` settings, shared by every role.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct TlsFlags {
    /// Certificate (PEM) for mutual TLS between the cluster's processes.
    #[arg(long = "tls-cert-file", value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert-file.
    #[arg(long = "tls-key-file", value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// The cluster CA (PEM).
    #[arg(long = "tls-ca-file", value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Name the servers' certificates carry (default: the dialed host).
    #[arg(long = "tls-server-name", value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

impl TlsFlags {
    /// No TLS flag was given (the flags then add nothing to the configuration).
    pub fn is_empty(&self) -> bool {
        self.cert_file.is_none()
            && self.key_file.is_none()
            && self.ca_file.is_none()
            && self.server_name.is_none()
    }

    /// The settings these flags alone describe (for tools without a configuration file).
    pub fn settings(&self) -> TlsSettings {
        TlsSettings {
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            ca_file: self.ca_file.clone(),
            server_name: self.server_name.clone(),
        }
    }
}

/// Loaded TLS material. Its `Debug` form shows no key.
#[derive(Clone)]
pub struct InternalTls {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    server_name: Option<String>,
}

impl std::fmt::Debug for InternalTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternalTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsSettings {
    /// Reads and checks the files: all three or none, PEM that rustls accepts, a private key
    /// other users cannot read. `None` when TLS is off.
    pub fn load(&self) -> Result<Option<InternalTls>, Invalid> {
        let (cert, key, ca) = match (&self.cert_file, &self.key_file, &self.ca_file) {
            (None, None, None) => {
                if self.server_name.is_some() {
                    return Err(Invalid::new(
                        "tls.server_name",
                        "needs tls.cert_file, tls.key_file and tls.ca_file",
                    ));
                }
                return Ok(None);
            }
            (Some(cert), Some(key), Some(ca)) => (cert, key, ca),
            _ => {
                return Err(Invalid::new(
                    "tls.cert_file",
                    "tls.cert_file, tls.key_file and tls.ca_file go together",
                ));
            }
        };
        let tls = InternalTls {
            cert: read_pem("tls.cert_file", cert, false)?,
            key: read_pem("tls.key_file", key, true)?,
            ca: read_pem("tls.ca_file", ca, false)?,
            server_name: self.server_name.clone(),
        };
        // Build both sides now, so bad PEM is a start-up error naming the setting.
        tonic::transport::Server::builder()
            .tls_config(tls.server_config())
            .map_err(|e| Invalid::new("tls.cert_file", format!("unusable: {e}")))?;
        proto::auth::Credentials::none()
            .with_tls(Some(tls.client()))
            .endpoint("localhost:1")
            .map_err(|e| Invalid::new("tls.cert_file", format!("unusable: {e}")))?;
        Ok(Some(tls))
    }
}

impl InternalTls {
    /// The server side: this identity, and client certificates required and checked against
    /// the cluster CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    /// The client side of this process's calls.
    pub fn client(&self) -> ClientTls {
        ClientTls::new(&self.cert, &self.key, &self.ca, self.server_name.clone())
    }
}

fn read_pem(key: &str, path: &Path, private: bool) -> Result<Vec<u8>, Invalid> {
    let invalid = |reason: String| Invalid::new(key, format!("{}: {reason}", path.display()));
    let metadata = std::fs::metadata(path).map_err(|e| invalid(e.to_string()))?;
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode();
        if mode & 0o007 != 0 {
            return Err(invalid(format!(
                "other users may access it (mode {:o}); `chmod 600` it",
                mode & 0o777
            )));
        }
    }
    let bytes = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(invalid("not PEM (no -----BEGIN line)".to_owned()));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_go_together() {
        assert!(TlsSettings::default().load().unwrap().is_none());
        let partial = TlsSettings {
            cert_file: Some("/nonexistent".into()),
            ..TlsSettings::default()
        };
        assert_eq!(partial.load().unwrap_err().key, "tls.cert_file");
        let name_only = TlsSettings {
            server_name: Some("pdserve".into()),
            ..TlsSettings::default()
        };
        assert_eq!(name_only.load().unwrap_err().key, "tls.server_name");
    }

    #[test]
    fn bad_files_name_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let not_pem = dir.path().join("cert");
        std::fs::write(&not_pem, "hello").unwrap();
        let settings = TlsSettings {
            cert_file: Some(not_pem.clone()),
            key_file: Some(not_pem.clone()),
            ca_file: Some(not_pem),
            server_name: None,
        };
        let error = settings.load().unwrap_err();
        assert_eq!(error.key, "tls.cert_file");
        assert!(error.reason.contains("not PEM"), "{}", error.reason);
    }
}
