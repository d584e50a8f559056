//! systemd's service notification protocol (`sd_notify`), spoken directly: one datagram per
//! message to the Unix socket in `NOTIFY_SOCKET`. Units of `Type=notify` learn when a process
//! is ready (`READY=1`), stopping (`STOPPING=1`) and alive (`WATCHDOG=1` within
//! `WatchdogSec`). Outside systemd (`NOTIFY_SOCKET` unset) every call does nothing.

use std::{
    os::unix::net::{SocketAddr, UnixDatagram},
    sync::Arc,
    time::Duration,
};

use crate::env;

/// Where this process sends its notifications, if systemd asked for them.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    target: Option<Arc<Target>>,
    watchdog: Option<Duration>,
}

#[derive(Debug)]
struct Target {
    socket: UnixDatagram,
    address: SocketAddr,
}

impl Notifier {
    /// From `NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace) and
    /// `WATCHDOG_USEC` (honoured only when `WATCHDOG_PID` is unset or this process).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok(), std::process::id())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>, pid: u32) -> Self {
        let target = var(env::NOTIFY_SOCKET).and_then(|path| match Target::open(&path) {
            Ok(target) => Some(Arc::new(target)),
            Err(e) => {
                tracing::warn!(socket = %path, error = %e, "cannot use NOTIFY_SOCKET");
                None
            }
        });
        let for_us = var(env::WATCHDOG_PID).is_none_or(|p| p.trim() == pid.to_string());
        let watchdog = var(env::WATCHDOG_USEC)
            .and_then(|usec| usec.trim().parse::<u64>().ok())
            .filter(|usec| *usec > 0 && for_us && target.is_some())
            .map(Duration::from_micros);
        Self { target, watchdog }
    }

    /// Sends `message` (newline-separated `KEY=VALUE` lines); failures are logged, not fatal.
    pub fn notify(&self, message: &str) {
        if let Some(target) = &self.target
            && let Err(e) = target
                .socket
                .send_to_addr(message.as_bytes(), &target.address)
        {
            tracing::warn!(error = %e, "sd_notify failed");
        }
    }

    /// The process is serving; `status` is shown by `systemctl status`.
    pub fn ready(&self, status: &str) {
        self.notify(&format!("READY=1\nSTATUS={status}"));
    }

    /// Shutdown has begun.
    pub fn stopping(&self, status: &str) {
        self.notify(&format!("STOPPING=1\nSTATUS={status}"));
    }

    pub fn status(&self, status: &str) {
        self.notify(&format!("STATUS={status}"));
    }

    /// The watchdog timeout systemd enforces (`WatchdogSec`), if any.
    pub fn watchdog_timeout(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Pings the watchdog every quarter of its timeout while `alive()` says the serving loop
    /// is responsive; a wedged loop stops the pings and systemd restarts the process. Runs
    /// until the runtime stops (spawn it); returns at once without a watchdog.
    pub async fn keep_watchdog(self, alive: impl Fn() -> bool) {
        let Some(timeout) = self.watchdog else {
            return;
        };
        let every = timeout / 4;
        loop {
            if alive() {
                self.notify("WATCHDOG=1");
            } else {
                tracing::error!("the serving loop is not responding; not pinging the watchdog");
            }
            tokio::time::sleep(every).await;
        }
    }
}

impl Target {
    fn open(path: &str) -> std::io::Result<Self> {
        let address = match path.strip_prefix('@') {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name.as_bytes())?
            }
            None => SocketAddr::from_pathname(path)?,
        };
        Ok(Self {
            socket: UnixDatagram::unbound()?,
            address,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
        let list: Vec<(String, String)> = list
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        move |name| list.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn messages_reach_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let notifier = Notifier::from_vars(
            vars(&[
                (env::NOTIFY_SOCKET, path.display().to_string()),
                (env::WATCHDOG_USEC, "2000000".into()),
            ]),
            7,
        );
        assert_eq!(notifier.watchdog_timeout(), Some(Duration::from_secs(2)));
        notifier.ready("serving");
        notifier.stopping("draining");
        let mut buf = [0u8; 256];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1\nSTATUS=draining");
    }

    #[test]
    fn abstract_sockets_work() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("pdserve-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        let notifier = Notifier::from_vars(vars(&[(env::NOTIFY_SOCKET, format!("@{name}"))]), 7);
        notifier.status("x");
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STATUS=x");
    }

    #[test]
    fn watchdog_only_for_this_process_and_with_a_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        let _listener = UnixDatagram::bind(&path).unwrap();
        let socket = (env::NOTIFY_SOCKET, path.display().to_string());
        let usec = (env::WATCHDOG_USEC, "1000".to_owned());
        let other_pid = (env::WATCHDOG_PID, "8".to_owned());
        let this_pid = (env::WATCHDOG_PID, "7".to_owned());
        assert!(
            Notifier::from_vars(vars(&[socket.clone(), usec.clone(), other_pid]), 7)
                .watchdog_timeout()
                .is_none()
        );
        assert!(
            Notifier::from_vars(vars(&[socket, usec.clone(), this_pid]), 7)
                .watchdog_timeout()
                .is_some()
        );
        assert!(
            Notifier::from_vars(vars(&[usec]), 7)
                .watchdog_timeout()
                .is_none()
        );
        // Without systemd nothing is sent and nothing fails.
        Notifier::from_vars(vars(&[]), 7).ready("x");
    }
}
