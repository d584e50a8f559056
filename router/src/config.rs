//! Settings of the router. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf};

use clap::Parser;
use common::config::{Invalid, ServiceConfig, check_host_port, check_range};
use serde::{Deserialize, Serialize};

/// `reasoning_effort` values DeepSeek-V4 accepts (`none` turns thinking off); the targets
/// `effort_aliases` may map to.
pub const ACCEPTED_EFFORTS: [&str; 4] = ["none", "low", "high", "max"];

/// Validated settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Where the HTTP API (OpenAI-compatible, health, metrics) listens. Port 0: any free port.
    pub http_listen: SocketAddr,
    /// Where the gRPC server (worker registry, health) listens. Port 0: any free port.
    pub grpc_listen: SocketAddr,
    /// Static prefill workers, host:port of their gRPC servers.
    pub prefill_workers: Vec<String>,
    /// Static decode workers, host:port of their gRPC servers.
    pub decode_workers: Vec<String>,
    /// Largest accepted HTTP request body, bytes (413 beyond).
    pub max_body_bytes: u64,
    /// Milliseconds in-flight requests may take to finish after SIGTERM.
    pub shutdown_grace_ms: u64,
    /// Checkpoint folder (`config.json`, weights, `tokenizer.json`) served by the in-process
    /// engine backend. Unset: no backend; `/health/ready` stays 503.
    pub model_dir: Option<PathBuf>,
    /// The model name the API reports and accepts.
    pub served_model_name: String,
    /// Further model names accepted in requests (reported as `served_model_name`).
    pub model_aliases: Vec<String>,
    /// Whether requests that do not choose a thinking mode think.
    pub thinking_default: bool,
    /// Extra `reasoning_effort` request values mapped onto accepted ones (`none`, `low`,
    /// `high`, `max`), each `"from=to"`, e.g. `["medium=high"]`. Unmapped other values are a
    /// 400 listing the accepted ones.
    pub reasoning_effort_map: Vec<String>,
    /// Bearer keys accepted on the API; empty: no authentication.
    pub api_keys: Vec<String>,
    /// File holding the cluster's shared secret (a line of 32+ visible characters, not
    /// readable by other users; further lines are secrets also accepted, for rotation). Every
    /// internal gRPC call carries it and calls without it are refused; all roles of a cluster
    /// must name the same secret. Unset: no authentication.
    pub cluster_secret_file: Option<PathBuf>,
    /// Mutual TLS between the cluster's processes (`[tls]`: `cert_file`, `key_file`,
    /// `ca_file`, optional `server_name`); unset: plain connections.
    pub tls: common::internal_tls::TlsSettings,
    /// Requests one API key may have in flight (streams count until they end); beyond it the
    /// router answers 429. 0: no limit.
    pub max_concurrent_per_key: u32,
    /// Context length in tokens (prompt plus completion). Unset: the smaller of the model's
    /// `max_position_embeddings` and the engine's page pool.
    pub max_model_len: Option<u32>,
    /// Pages in the in-process engine's pool.
    pub engine_num_pages: u32,
    /// Output-token limit of chat, Messages and Responses requests that set none (`max_tokens`
    /// / `max_output_tokens`; /v1/completions keeps OpenAI's default, 16). The official defaults (8192; 65536 when thinking) reserve that many tokens of pages per
    /// request, so a deployment caps them; an explicit request value is kept.
    pub default_max_tokens: u32,
    /// How the PD backend picks a prefill worker: `prefix-affinity` (the worker that last
    /// prefilled the longest cached prefix of the prompt, unless it is busier than the
    /// least-loaded live worker by more than `affinity_slack` requests), `least-loaded` or
    /// `round-robin`.
    pub prefill_policy: Policy,
    /// How the PD backend picks a decode worker: `least-loaded` (requests in flight, then pages
    /// in use), `power-of-two` (the less loaded of two random live workers) or `round-robin`.
    pub decode_policy: Policy,
    /// Requests a prefix-affinity choice may exceed the least-loaded worker by.
    pub affinity_slack: u32,
    /// Milliseconds a request may wait for room on a decode worker (every one full: no free
    /// request slot or pages) before it fails with 503; it retries as requests finish. 0: fail
    /// at once.
    pub queue_timeout_ms: u32,
    /// Where requests are generated: `pd` (prefill and decode workers, static and
    /// registered), `local` (an engine inside the router, for development), or `auto`: `pd`
    /// when workers are configured, else `local`.
    pub backend: BackendKind,
    /// The prefill worker sends a checksum of every state page it wrote and the decode worker
    /// verifies them before admitting the request (a mismatch fails the request).
    pub transfer_checksums: bool,
}

/// See [`RouterConfig::backend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    Auto,
    Pd,
    Local,
}

/// A worker selection policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    PrefixAffinity,
    LeastLoaded,
    PowerOfTwo,
    RoundRobin,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            http_listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 8001)),
            prefill_workers: Vec::new(),
            decode_workers: Vec::new(),
            max_body_bytes: 16 << 20,
            shutdown_grace_ms: 30_000,
            model_dir: None,
            served_model_name: "deepseek-v4-flash".to_owned(),
            model_aliases: vec![
                "DeepSeek-V4-Flash".to_owned(),
                "deepseek-ai/DeepSeek-V4-Flash".to_owned(),
            ],
            thinking_default: true,
            reasoning_effort_map: Vec::new(),
            api_keys: Vec::new(),
            cluster_secret_file: None,
            tls: common::internal_tls::TlsSettings::default(),
            max_concurrent_per_key: 0,
            max_model_len: None,
            engine_num_pages: 1024,
            default_max_tokens: 4096,
            prefill_policy: Policy::PrefixAffinity,
            decode_policy: Policy::LeastLoaded,
            affinity_slack: 4,
            queue_timeout_ms: 30_000,
            backend: BackendKind::Auto,
            transfer_checksums: true,
        }
    }
}

impl RouterConfig {
    /// Whether requests go to prefill and decode workers.
    pub fn disaggregated(&self) -> bool {
        match self.backend {
            BackendKind::Pd => true,
            BackendKind::Local => false,
            BackendKind::Auto => {
                !self.prefill_workers.is_empty() || !self.decode_workers.is_empty()
            }
        }
    }

    /// `reasoning_effort_map` as a map (checked: `from=to`, `to` an accepted effort).
    pub fn effort_map(&self) -> Result<BTreeMap<String, String>, Invalid> {
        let mut map = BTreeMap::new();
        for entry in &self.reasoning_effort_map {
            let Some((from, to)) = entry.split_once('=') else {
                return Err(Invalid::new(
                    "reasoning_effort_map",
                    format!("{entry:?} is not `from=to`"),
                ));
            };
            let (from, to) = (from.trim(), to.trim());
            if from.is_empty() || !ACCEPTED_EFFORTS.contains(&to) {
                return Err(Invalid::new(
                    "reasoning_effort_map",
                    format!(
                        "{entry:?}: the target must be one of {}",
                        ACCEPTED_EFFORTS.join(", ")
                    ),
                ));
            }
            map.insert(from.to_owned(), to.to_owned());
        }
        Ok(map)
    }
}

impl ServiceConfig for RouterConfig {
    const ROLE: &'static str = "router";
    const HOST_PORT_KEY: Option<&'static str> = Some("http_listen");

    fn validate(&self) -> Result<(), Invalid> {
        for (key, list) in [
            ("prefill_workers", &self.prefill_workers),
            ("decode_workers", &self.decode_workers),
        ] {
            for address in list {
                check_host_port(key, address)?;
            }
        }
        if self.http_listen == self.grpc_listen && self.http_listen.port() != 0 {
            return Err(Invalid::new("grpc_listen", "must differ from http_listen"));
        }
        check_range("max_body_bytes", self.max_body_bytes, 1024, 1 << 30)?;
        if self.served_model_name.trim().is_empty() {
            return Err(Invalid::new("served_model_name", "must not be empty"));
        }
        self.effort_map()?;
        if self.api_keys.iter().any(String::is_empty) {
            return Err(Invalid::new("api_keys", "keys must not be empty"));
        }
        common::cluster_auth::Security::load(self.cluster_secret_file.as_deref(), &self.tls)?;
        check_range(
            "max_concurrent_per_key",
            u64::from(self.max_concurrent_per_key),
            0,
            1 << 20,
        )?;
        // The limit counts per API key: without keys nothing would count.
        if self.max_concurrent_per_key > 0 && self.api_keys.is_empty() {
            return Err(Invalid::new(
                "max_concurrent_per_key",
                "limits requests per API key, and no api_keys are set",
            ));
        }
        if let Some(len) = self.max_model_len {
            check_range("max_model_len", u64::from(len), 16, 1 << 24)?;
        }
        check_range(
            "engine_num_pages",
            u64::from(self.engine_num_pages),
            1,
            1 << 24,
        )?;
        if self.decode_policy == Policy::PrefixAffinity {
            return Err(Invalid::new(
                "decode_policy",
                "prefix-affinity applies to prefill workers only",
            ));
        }
        check_range("affinity_slack", u64::from(self.affinity_slack), 0, 1 << 20)?;
        check_range(
            "queue_timeout_ms",
            u64::from(self.queue_timeout_ms),
            0,
            600_000,
        )?;
        check_range(
            "default_max_tokens",
            u64::from(self.default_max_tokens),
            1,
            1 << 24,
        )?;
        check_range("shutdown_grace_ms", self.shutdown_grace_ms, 0, 600_000)
    }
}

/// Command line of `pdserve-router`. Every flag overrides the setting of the same name.
#[derive(Debug, Parser, Serialize)]
#[command(name = "pdserve-router", version, about = "pdserve router: OpenAI-compatible HTTP API over prefill and decode workers", long_about = None)]
pub struct Cli {
    #[command(flatten)]
    #[serde(skip)]
    pub config: common::cli::ConfigFileArg,
    /// HTTP listen address, e.g. 0.0.0.0:8000 (port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_listen: Option<SocketAddr>,
    #[command(flatten)]
    #[serde(flatten)]
    pub host_port: common::cli::HostPortFlags,
    /// gRPC listen address (worker registry), e.g. 0.0.0.0:8001.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_listen: Option<SocketAddr>,
    /// A static prefill worker (host:port); repeat for several.
    #[arg(long = "prefill-worker", value_name = "HOST:PORT")]
    #[serde(rename = "prefill_workers", skip_serializing_if = "Vec::is_empty")]
    pub prefill_workers: Vec<String>,
    /// A static decode worker (host:port); repeat for several.
    #[arg(long = "decode-worker", value_name = "HOST:PORT")]
    #[serde(rename = "decode_workers", skip_serializing_if = "Vec::is_empty")]
    pub decode_workers: Vec<String>,
    /// Largest accepted HTTP request body in bytes.
    #[arg(long, value_name = "BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u64>,
    /// Milliseconds in-flight requests may take after SIGTERM.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_ms: Option<u64>,
    /// Checkpoint folder served by the in-process engine backend.
    #[arg(long, visible_alias = "model", value_name = "DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_dir: Option<PathBuf>,
    /// Model name the API reports and accepts.
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// A further accepted model name; repeat for several (replaces the configured list).
    #[arg(long = "model-alias", value_name = "NAME")]
    #[serde(rename = "model_aliases", skip_serializing_if = "Vec::is_empty")]
    pub model_aliases: Vec<String>,
    /// Whether requests that do not choose a thinking mode think (true/false).
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking_default: Option<bool>,
    /// A `reasoning_effort` mapping `from=to`, e.g. `medium=high`; repeat for several.
    #[arg(long = "reasoning-effort-map", value_name = "FROM=TO")]
    #[serde(rename = "reasoning_effort_map", skip_serializing_if = "Vec::is_empty")]
    pub reasoning_effort_map: Vec<String>,
    /// An accepted API key (Bearer); repeat for several.
    #[arg(long = "api-key", value_name = "KEY")]
    #[serde(rename = "api_keys", skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub security: common::cluster_auth::SecurityFlags,
    /// Requests one API key may have in flight (0: no limit).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent_per_key: Option<u32>,
    /// Context length in tokens (prompt plus completion).
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// Pages in the in-process engine's pool.
    #[arg(long, value_name = "PAGES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_num_pages: Option<u32>,
    /// Output-token limit of chat, Messages and Responses requests that set none
    /// (/v1/completions keeps OpenAI's 16).
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u32>,
    /// Prefill worker selection.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_policy: Option<Policy>,
    /// Decode worker selection.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_policy: Option<Policy>,
    /// Requests a prefix-affinity choice may exceed the least-loaded worker by.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_slack: Option<u32>,
    /// Milliseconds a request may wait for room on a decode worker (0: fail at once).
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_timeout_ms: Option<u32>,
    /// Where requests are generated: auto, pd or local.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendKind>,
    /// Verify every transferred state page by checksum (true/false).
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_checksums: Option<bool>,
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn load(args: &[&str]) -> Result<RouterConfig, common::config::ConfigError> {
        let cli =
            Cli::try_parse_from(std::iter::once("pdserve-router").chain(args.iter().copied()))
                .expect("flags");
        common::config::load::<RouterConfig>(None, std::iter::empty(), &cli)
    }

    /// vLLM's `--host` and `--port` set the HTTP listen address's parts.
    #[test]
    fn host_and_port_set_the_http_listen_address() {
        let c = load(&["--host", "0.0.0.0", "--port", "9001"]).expect("settings");
        assert_eq!(c.http_listen.to_string(), "0.0.0.0:9001");
        let c = load(&["--http-listen", "127.0.0.2:8000", "--port", "9002"]).expect("settings");
        assert_eq!(c.http_listen.to_string(), "127.0.0.2:9002");
        let err = load(&["--host", "my-host"]).expect_err("a name is not an IP");
        assert!(err.to_string().contains("--host"), "{err}");
    }

    /// A per-key limit without keys would limit nothing: refused, not ignored.
    #[test]
    fn a_per_key_limit_needs_keys() {
        let err = load(&["--max-concurrent-per-key", "2"]).expect_err("no keys");
        assert!(err.to_string().contains("max_concurrent_per_key"), "{err}");
        let c = load(&["--max-concurrent-per-key", "2", "--api-key", "k"]).expect("settings");
        assert_eq!(c.max_concurrent_per_key, 2);
        load(&["--max-concurrent-per-key", "0"]).expect("no limit");
    }
}
