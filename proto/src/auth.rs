//! Authentication between pdserve processes. Every internal gRPC call (router → workers,
//! workers → router registry, prefill → decode state transfer) carries the cluster's shared
//! secret as `authorization: Bearer <secret>`. A server configured with a secret refuses any
//! other call with `UNAUTHENTICATED`, except the standard health service, which load balancers
//! and probes call without credentials and which reveals nothing but serving status.
//!
//! Optionally the calls also run over mutual TLS ([`ClientTls`]): every process presents a
//! certificate signed by the cluster's CA and accepts only peers that do, which encrypts the
//! gRPC legs (registration, control calls, TCP state transfer) and authenticates both ends.

use std::{fmt, sync::Arc};

use tonic::{
    Request, Status,
    metadata::{AsciiMetadataValue, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Channel, ClientTlsConfig, Endpoint},
};

/// Metadata (HTTP/2 header) that carries the secret.
pub const HEADER: &str = "authorization";

/// Path prefix of the standard health service, which stays open.
pub const HEALTH_PATH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Shortest secret accepted: 32 characters (e.g. 16 random bytes in hex).
pub const MIN_SECRET_CHARS: usize = 32;

/// Longest secret accepted (it travels as a header on every call).
pub const MAX_SECRET_CHARS: usize = 1024;

/// Why a secret (or a secret file) is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Fewer than [`MIN_SECRET_CHARS`] or more than [`MAX_SECRET_CHARS`] characters.
    #[error(
        "the secret has {chars} characters; it must have {MIN_SECRET_CHARS} to \
         {MAX_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
    )]
    Length { chars: usize },
    /// A character (1-based `position`) that is not visible ASCII, or a space.
    #[error(
        "the secret must be visible ASCII characters without spaces; character {position} is not"
    )]
    NotVisible { position: usize },
    /// A secret file with no secret in it.
    #[error("no secret in the file")]
    Empty,
    /// A secret file's line (1-based) holds a bad secret.
    #[error("line {line}: {source}")]
    Line {
        line: usize,
        source: Box<SecretError>,
    },
}

impl SecretError {
    fn on_line(self, line: usize) -> Self {
        Self::Line {
            line,
            source: Box::new(self),
        }
    }
}

/// The cluster's shared secret: the one this process presents, and any further ones it also
/// accepts (during a rotation, when processes with the old and the new secret must still talk).
/// Its `Debug` form never shows a value.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret {
    presented: Arc<str>,
    also_accepted: Arc<[Arc<str>]>,
}

impl ClusterSecret {
    /// Checks the secret's shape: `MIN_SECRET_CHARS..=MAX_SECRET_CHARS` visible ASCII
    /// characters (no spaces), so it fits a header unchanged.
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        Ok(Self {
            presented: checked(secret)?,
            also_accepted: Arc::from(Vec::new()),
        })
    }

    /// One secret per line: the first is presented, every one is accepted. Blank lines and a
    /// final newline are ignored.
    pub fn from_lines(text: &str) -> Result<Self, SecretError> {
        let mut lines = text
            .lines()
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .enumerate()
            .filter(|(_, l)| !l.is_empty());
        let (_, first) = lines.next().ok_or(SecretError::Empty)?;
        let presented = checked(first).map_err(|e| e.on_line(1))?;
        let also_accepted = lines
            .map(|(i, l)| checked(l).map_err(|e| e.on_line(i + 1)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            presented,
            also_accepted: Arc::from(also_accepted),
        })
    }

    /// Whether an `authorization` header value presents one of the accepted secrets. Each
    /// comparison takes the same time wherever the first difference is (it reveals only
    /// lengths), and every accepted secret is compared.
    pub fn accepts(&self, header: Option<&[u8]>) -> bool {
        let Some(presented) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        std::iter::once(&self.presented)
            .chain(self.also_accepted.iter())
            .fold(false, |found, expected| {
                found | constant_time_eq(presented, expected.as_bytes())
            })
    }

    fn bearer(&self) -> AsciiMetadataValue {
        // The constructor allows only visible ASCII, which is always a valid header value.
        MetadataValue::try_from(format!("Bearer {}", self.presented))
            .unwrap_or_else(|_| MetadataValue::from_static(""))
    }
}

fn checked(secret: &str) -> Result<Arc<str>, SecretError> {
    let chars = secret.len();
    if !(MIN_SECRET_CHARS..=MAX_SECRET_CHARS).contains(&chars) {
        return Err(SecretError::Length { chars });
    }
    if let Some(bad) = secret.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(SecretError::NotVisible { position: bad + 1 });
    }
    Ok(Arc::from(secret))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// The client half of the cluster's mutual TLS: this process's certificate and key (PEM), the
/// cluster CA that servers' certificates must chain to, and optionally the name servers'
/// certificates carry (else the host part of the address dialed).
#[derive(Clone)]
pub struct ClientTls {
    config: ClientTlsConfig,
    server_name: Option<String>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key material.
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    pub fn new(
        cert_pem: &[u8],
        key_pem: &[u8],
        ca_pem: &[u8],
        server_name: Option<String>,
    ) -> Self {
        let config = ClientTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert_pem, key_pem))
            .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem));
        Self {
            config,
            server_name,
        }
    }
}

/// What a client attaches to each call: the cluster secret (or nothing when the cluster runs
/// without one, in local development), and how it connects (plain or mutual TLS).
#[derive(Clone, Default)]
pub struct Credentials {
    bearer: Option<AsciiMetadataValue>,
    tls: Option<Arc<ClientTls>>,
}

impl Credentials {
    /// Credentials presenting `secret` (none when `None`), over plain connections.
    pub fn new(secret: Option<&ClusterSecret>) -> Self {
        Self {
            bearer: secret.map(ClusterSecret::bearer),
            tls: None,
        }
    }

    /// Calls carry no credentials.
    pub fn none() -> Self {
        Self::default()
    }

    /// Connections use mutual TLS with `tls` (plain when `None`).
    #[must_use]
    pub fn with_tls(mut self, tls: Option<ClientTls>) -> Self {
        self.tls = tls.map(Arc::new);
        self
    }

    /// Whether connections use TLS.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// An endpoint for `address` (host:port): `http://`, or with TLS `https://` with this
    /// process's identity and the cluster CA.
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, tonic::transport::Error> {
        match &self.tls {
            None => Endpoint::from_shared(format!("http://{address}")),
            Some(tls) => {
                let mut config = tls.config.clone();
                if let Some(name) = &tls.server_name {
                    config = config.domain_name(name.clone());
                }
                Endpoint::from_shared(format!("https://{address}"))?.tls_config(config)
            }
        }
    }

    /// Wraps a channel so every call on it carries these credentials.
    pub fn channel(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, self.clone())
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("secret", &self.bearer.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.bearer {
            request.metadata_mut().insert(HEADER, value.clone());
        }
        Ok(request)
    }
}

/// A channel whose calls carry the cluster's credentials.
pub type AuthChannel = InterceptedService<Channel, Credentials>;

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn secret_shape_is_checked() {
        assert!(ClusterSecret::new(SECRET).is_ok());
        let short = ClusterSecret::new(&SECRET[1..]).unwrap_err();
        assert_eq!(short, SecretError::Length { chars: 31 });
        assert_eq!(
            short.to_string(),
            "the secret has 31 characters; it must have 32 to 1024 (e.g. `openssl rand -hex 32`)"
        );
        assert!(ClusterSecret::new(&"x".repeat(MAX_SECRET_CHARS + 1)).is_err());
        let spaced = format!("{} {}", &SECRET[..16], &SECRET[16..]);
        assert_eq!(
            ClusterSecret::new(&spaced).unwrap_err().to_string(),
            "the secret must be visible ASCII characters without spaces; character 17 is not"
        );
        assert!(ClusterSecret::new(&format!("{SECRET}é")).is_err());
    }

    #[test]
    fn only_the_exact_bearer_value_is_accepted() {
        let secret = ClusterSecret::new(SECRET).unwrap();
        assert!(secret.accepts(Some(format!("Bearer {SECRET}").as_bytes())));
        for wrong in [
            String::new(),
            SECRET.to_owned(),
            format!("bearer {SECRET}"),
            format!("Bearer {SECRET}0"),
            format!("Bearer {}", &SECRET[1..]),
            format!("Bearer {}e", &SECRET[..SECRET.len() - 1]),
        ] {
            assert!(!secret.accepts(Some(wrong.as_bytes())), "{wrong:?}");
        }
        assert!(!secret.accepts(None));
    }

    #[test]
    fn several_lines_present_the_first_and_accept_all() {
        let other = "f".repeat(40);
        let secret = ClusterSecret::from_lines(&format!("{SECRET}\n\n{other}\r\n")).unwrap();
        assert!(secret.accepts(Some(format!("Bearer {SECRET}").as_bytes())));
        assert!(secret.accepts(Some(format!("Bearer {other}").as_bytes())));
        assert!(!secret.accepts(Some(format!("Bearer {}", "e".repeat(40)).as_bytes())));
        let header = Credentials::new(Some(&secret))
            .call(Request::new(()))
            .unwrap()
            .metadata()
            .get(HEADER)
            .unwrap()
            .as_bytes()
            .to_vec();
        assert_eq!(header, format!("Bearer {SECRET}").into_bytes());
        let empty = ClusterSecret::from_lines("\n\n").unwrap_err();
        assert_eq!(empty, SecretError::Empty);
        assert_eq!(empty.to_string(), "no secret in the file");
        let bad = ClusterSecret::from_lines(&format!("{SECRET}\nshort\n"))
            .unwrap_err()
            .to_string();
        assert!(
            bad.starts_with("line 2: the secret has 5 characters"),
            "{bad}"
        );
    }

    #[test]
    fn credentials_attach_the_header_and_never_print_it() {
        let secret = ClusterSecret::new(SECRET).unwrap();
        let mut credentials = Credentials::new(Some(&secret));
        let request = credentials.call(Request::new(())).unwrap();
        let header = request.metadata().get(HEADER).unwrap().as_bytes();
        assert!(secret.accepts(Some(header)));
        assert!(!format!("{credentials:?} {secret:?}").contains(SECRET));

        let request = Credentials::none().call(Request::new(())).unwrap();
        assert!(request.metadata().get(HEADER).is_none());
    }
}
