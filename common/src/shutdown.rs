//! Shutdown on SIGTERM (systemd stop) or SIGINT (Ctrl-C).

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Installed signal handlers. Create it before serving so an early SIGTERM is not lost.
#[derive(Debug)]
pub struct ShutdownSignal {
    term: Signal,
    int: Signal,
}

impl ShutdownSignal {
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves when either signal arrives; returns its name for the log.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
