//! Starting the endpoints of the transports a worker offers. An endpoint that cannot start on
//! this machine (no UCX device, no NCCL library or GPU) is not offered, with a warning, so a
//! peer never negotiates a transport that would fail its first transfer.

use std::fmt::Display;

use kv_transfer::ucx::{Exporter, Putter};
use proto::v1::TransportKind;

/// A transport endpoint with a thread of its own, which must end before the process exits (a
/// UCX thread still running then races UCX's global teardown).
pub trait Endpoint: Send + Sync + 'static {
    fn stop(&self);
}

impl Endpoint for Exporter {
    fn stop(&self) {
        Exporter::stop(self);
    }
}

impl Endpoint for Putter {
    fn stop(&self) {
        Putter::stop(self);
    }
}

/// What a worker offers its peers: its transports in order of preference (those that could not
/// start here dropped), and the UCX endpoint behind one of them.
#[derive(Debug)]
pub struct Offered<U> {
    pub kinds: Vec<TransportKind>,
    pub ucx: Option<U>,
}

impl<U: Endpoint> Offered<U> {
    /// Ends the endpoints' threads (at shutdown).
    pub fn stop(&self) {
        if let Some(ucx) = &self.ucx {
            ucx.stop();
        }
    }
}

/// Starts the endpoint of `kind` with `start` when `offered` lists it; when it cannot start,
/// drops `kind` from `offered` and returns `None`.
pub fn start_offered<T, E: Display>(
    offered: &mut Vec<TransportKind>,
    kind: TransportKind,
    start: impl FnOnce() -> Result<T, E>,
) -> Option<T> {
    if !offered.contains(&kind) {
        return None;
    }
    match start() {
        Ok(endpoint) => Some(endpoint),
        Err(e) => {
            let name = kv_transfer::handshake::transport_name(kind);
            tracing::warn!(error = %e, transport = name, "{name} unavailable here; not offering it");
            offered.retain(|k| *k != kind);
            None
        }
    }
}

/// Drops NCCL from `offered` when this worker was built without it (`built` false).
pub fn without_unbuilt_nccl(offered: &mut Vec<TransportKind>, built: bool) {
    let _: Option<()> = start_offered(offered, TransportKind::Nccl, || {
        if built {
            Ok(())
        } else {
            Err("this worker was built without NCCL (cargo feature `nccl`)")
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_that_cannot_start_is_not_offered() {
        let mut offered = vec![TransportKind::Ucx, TransportKind::Tcp];
        let started = start_offered(&mut offered, TransportKind::Ucx, || Ok::<_, String>(7));
        assert_eq!(started, Some(7));
        assert_eq!(offered, [TransportKind::Ucx, TransportKind::Tcp]);
        let failed: Option<u8> =
            start_offered(&mut offered, TransportKind::Ucx, || Err("no device"));
        assert_eq!(failed, None);
        assert_eq!(offered, [TransportKind::Tcp]);
        let not_offered: Option<u8> =
            start_offered(&mut offered, TransportKind::Nccl, || -> Result<u8, &str> {
                unreachable!("not offered, not started")
            });
        assert_eq!(not_offered, None);
        let mut with_nccl = vec![TransportKind::Nccl, TransportKind::Tcp];
        without_unbuilt_nccl(&mut with_nccl, true);
        assert_eq!(with_nccl.len(), 2);
        without_unbuilt_nccl(&mut with_nccl, false);
        assert_eq!(with_nccl, [TransportKind::Tcp]);
    }
}
