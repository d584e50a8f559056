//! Every environment variable pdserve reads, in one place.
//!
//! Service settings map mechanically onto `PDSERVE_<KEY>` (nested keys joined with `__`),
//! see [`setting_var`]. The variables below are the ones that are not settings of a single
//! service; any other `PDSERVE_*` variable that is not a setting of the running service is a
//! configuration error, so a typo in a unit file is caught at start instead of ignored.

/// Prefix of every pdserve environment variable.
pub const PREFIX: &str = "PDSERVE_";

/// Path of the TOML configuration file (same as `--config`).
pub const CONFIG: &str = "PDSERVE_CONFIG";

/// Log filter in `tracing_subscriber::EnvFilter` syntax, for example `info,router=debug`.
pub const LOG: &str = "PDSERVE_LOG";

/// Log format: `text` (default) or `json`.
pub const LOG_FORMAT: &str = "PDSERVE_LOG_FORMAT";

/// Folder for downloaded assets (tokenizer). Default: `$XDG_CACHE_HOME/pdserve` or
/// `$HOME/.cache/pdserve`.
pub const CACHE_DIR: &str = "PDSERVE_CACHE_DIR";

/// Set by `scripts/setup --cuda`: the folder holding `bin/nvcc` from the PyPI CUDA wheels.
pub const CUDA_HOME: &str = "PDSERVE_CUDA_HOME";

/// Set to `1` (by the test command) to make a build without nvcc an error instead of a
/// CPU-only build of the kernels crate.
pub const REQUIRE_CUDA_KERNELS: &str = "PDSERVE_REQUIRE_CUDA_KERNELS";

/// API key `pdctl` sends to a router (`pdctl workers --api-key`).
pub const API_KEY: &str = "PDSERVE_API_KEY";

/// Seconds `pdctl up` waits for its workers to load their models and serve (`--start-timeout`).
pub const START_TIMEOUT: &str = "PDSERVE_START_TIMEOUT";

/// Names a fault a worker injects on purpose (see `common::fault`); tests only.
pub const INJECT_FAULT: &str = "PDSERVE_INJECT_FAULT";

/// systemd's notification socket (`Type=notify` units): a path or `@abstract-name`.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// systemd's watchdog timeout in microseconds (`WatchdogSec`).
pub const WATCHDOG_USEC: &str = "WATCHDOG_USEC";

/// The process `WATCHDOG_USEC` is meant for.
pub const WATCHDOG_PID: &str = "WATCHDOG_PID";

/// Variables that any pdserve process may see without them being a setting of that process.
pub const GLOBAL: &[&str] = &[
    CONFIG,
    LOG,
    LOG_FORMAT,
    CACHE_DIR,
    CUDA_HOME,
    REQUIRE_CUDA_KERNELS,
    API_KEY,
    START_TIMEOUT,
    INJECT_FAULT,
];

/// The environment variable that sets the configuration key `path` (e.g. `["tls", "cert_file"]`).
pub fn setting_var(path: &[&str]) -> String {
    let mut var = String::from(PREFIX);
    for (i, part) in path.iter().enumerate() {
        if i > 0 {
            var.push_str("__");
        }
        var.push_str(&part.to_ascii_uppercase());
    }
    var
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_names() {
        assert_eq!(setting_var(&["grpc_listen"]), "PDSERVE_GRPC_LISTEN");
        assert_eq!(setting_var(&["tls", "cert_file"]), "PDSERVE_TLS__CERT_FILE");
    }

    #[test]
    fn global_names_have_prefix() {
        for name in GLOBAL {
            assert!(name.starts_with(PREFIX), "{name}");
        }
    }
}
