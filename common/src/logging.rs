//! Logging to stderr, filtered by `PDSERVE_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

use crate::env;

/// Installs the global subscriber once; later calls are no-ops (tests start several services).
pub fn init() {
    let filter = EnvFilter::try_from_env(env::LOG).unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var(env::LOG_FORMAT).is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    // An already-installed subscriber is fine: keep the first one.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
