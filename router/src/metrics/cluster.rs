//! The cluster part of `/metrics`: workers by role and state, each worker's last reported
//! load, build and model info. Rendered from the worker registry at scrape time, so a worker
//! that leaves the registry leaves the metrics.

use std::fmt::Write as _;

use super::{
    BUILD_INFO, MODEL_INFO, WORKER_PAGES_CACHED, WORKER_PAGES_TOTAL, WORKER_PAGES_USED,
    WORKER_QUEUED_REQUESTS, WORKER_RESERVATIONS, WORKER_RUNNING_REQUESTS, WORKERS,
};
use crate::backend::workers::{WorkerListing, Workers};

/// A per-worker gauge: name, help, and its value in a listing row.
type PerWorker = (&'static str, &'static str, fn(&WorkerListing) -> u64);

const ROLES: [&str; 2] = ["prefill", "decode"];
const STATES: [&str; 5] = ["ready", "starting", "loading", "draining", "unreachable"];

pub(super) fn render(out: &mut String, workers: &Workers, model: Option<&str>) {
    let listing = workers.listing();
    let _ = writeln!(
        out,
        "# HELP {WORKERS} Workers known to this router by role and state."
    );
    let _ = writeln!(out, "# TYPE {WORKERS} gauge");
    for role in ROLES {
        for state in STATES {
            let n = listing
                .iter()
                .filter(|w| w.role == role && w.state == state)
                .count();
            let _ = writeln!(out, "{WORKERS}{{role=\"{role}\",state=\"{state}\"}} {n}");
        }
    }
    let per_worker: [PerWorker; 6] = [
        (
            WORKER_RUNNING_REQUESTS,
            "Requests being prefilled or decoded on the worker.",
            |w| u64::from(w.running_requests),
        ),
        (
            WORKER_QUEUED_REQUESTS,
            "Requests waiting for admission on the worker.",
            |w| u64::from(w.queued_requests),
        ),
        (
            WORKER_PAGES_TOTAL,
            "Pages in the worker's state pool.",
            |w| w.pages_total,
        ),
        (
            WORKER_PAGES_USED,
            "Pages held by requests, reservations or the prefix cache.",
            |w| w.pages_used,
        ),
        (
            WORKER_PAGES_CACHED,
            "Pages held only by the prefix cache (evictable).",
            |w| w.pages_cached,
        ),
        (
            WORKER_RESERVATIONS,
            "Uncommitted reservations on a decode worker.",
            |w| u64::from(w.reservations),
        ),
    ];
    for (name, help, value) in per_worker {
        let _ = writeln!(out, "# HELP {name} {help} Last reported.");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for w in &listing {
            let _ = writeln!(
                out,
                "{name}{{role=\"{}\",worker=\"{}\"}} {}",
                w.role,
                escape(&w.address),
                value(w)
            );
        }
    }
    let _ = writeln!(out, "# HELP {BUILD_INFO} The router's build.");
    let _ = writeln!(out, "# TYPE {BUILD_INFO} gauge");
    let _ = writeln!(
        out,
        "{BUILD_INFO}{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(out, "# HELP {MODEL_INFO} The served model, once loaded.");
    let _ = writeln!(out, "# TYPE {MODEL_INFO} gauge");
    if let Some(model) = model {
        let _ = writeln!(out, "{MODEL_INFO}{{model=\"{}\"}} 1", escape(model));
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
