//! The service manager's notification protocol (systemd's `sd_notify`): readiness, and
//! the watchdog that bounds how long a paused or hung agent's runners outlive it.
//!
//! The agent fences its runners itself when it cannot renew its lease, but only while
//! it runs: an agent stopped (SIGSTOP), or whose runtime is blocked whole, runs no timer, and its
//! runners — in their own process groups and cgroups — go on after the cluster has
//! re-placed their jobs. Under systemd with `WatchdogSec=` (docs/allot-agent.service),
//! the agent pings the watchdog from its runtime every half period; when the pings stop,
//! systemd aborts the service and, with `KillMode=control-group`, kills every process in
//! its cgroup, runners included, within `WatchdogSec` + `TimeoutAbortSec`. Keep that
//! below the node lease (the cluster re-places a silent node's jobs at its lease's end
//! plus the fence margin); the agent warns when the watchdog is not shorter than half
//! the node lease.
//!
//! The protocol: datagrams of `KEY=value` lines to the unix socket named by
//! `NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace); `WATCHDOG_USEC` is
//! the watchdog period, for the process `WATCHDOG_PID` if set. Without `NOTIFY_SOCKET`
//! nothing is sent.

use std::time::Duration;
use tracing::{debug, warn};

/// Where notifications go, from the environment (`None`: not run by a service manager
/// that asked for them).
#[derive(Clone, Debug)]
pub struct Notifier {
    socket: String,
    /// The watchdog period, when one is asked of this process.
    watchdog: Option<Duration>,
}

impl Notifier {
    pub fn from_env() -> Option<Notifier> {
        Notifier::from_vars(
            std::env::var("NOTIFY_SOCKET").ok(),
            std::env::var("WATCHDOG_USEC").ok(),
            std::env::var("WATCHDOG_PID").ok(),
            std::process::id(),
        )
    }

    fn from_vars(
        socket: Option<String>,
        usec: Option<String>,
        pid: Option<String>,
        me: u32,
    ) -> Option<Notifier> {
        let socket = socket.filter(|s| !s.is_empty())?;
        let for_me = pid.is_none_or(|p| p.trim().parse::<u32>().ok() == Some(me));
        let watchdog = usec
            .and_then(|u| u.trim().parse::<u64>().ok())
            .filter(|&u| u > 0 && for_me)
            .map(Duration::from_micros);
        Some(Notifier { socket, watchdog })
    }

    /// The watchdog period asked of this process.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Sends `state` (e.g. `READY=1`); a failure is logged, never fatal.
    pub fn send(&self, state: &str) {
        if let Err(e) = self.try_send(state) {
            warn!(socket = %self.socket, "notifying the service manager failed: {e}");
        }
    }

    fn try_send(&self, state: &str) -> std::io::Result<()> {
        use std::os::unix::net::{SocketAddr, UnixDatagram};
        let sock = UnixDatagram::unbound()?;
        let addr = match self.socket.strip_prefix('@') {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name.as_bytes())?
            }
            None => SocketAddr::from_pathname(&self.socket)?,
        };
        sock.send_to_addr(state.as_bytes(), &addr)?;
        Ok(())
    }

    /// Pings the watchdog every half period, for as long as the runtime runs this task
    /// (the one that also runs every runner's fence). Returns at once without a
    /// watchdog.
    pub async fn keep_watchdog(self) {
        let Some(period) = self.watchdog else {
            return;
        };
        debug!(?period, "pinging the service manager's watchdog");
        let mut tick = tokio::time::interval(period / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.send("WATCHDOG=1");
        }
    }
}

impl Notifier {
    /// Says `READY=1` and starts pinging the watchdog (if one is asked) on this runtime.
    pub fn ready(self) -> Started {
        self.send("READY=1");
        let watchdog = self
            .watchdog
            .is_some()
            .then(|| tokio::spawn(self.clone().keep_watchdog()));
        Started {
            notifier: self,
            watchdog,
            stopping: false,
        }
    }
}

/// A process that told the service manager it is ready. Its watchdog is pinged while this
/// lives; `STOPPING=1` is sent once, by [`Started::stopping`] when the agent begins to shut
/// down, or when this is dropped — an error return after readiness included.
pub struct Started {
    notifier: Notifier,
    watchdog: Option<tokio::task::JoinHandle<()>>,
    stopping: bool,
}

impl Started {
    /// The watchdog period asked of this process.
    pub fn watchdog(&self) -> Option<Duration> {
        self.notifier.watchdog()
    }

    /// Says `STOPPING=1`, once. The watchdog is still pinged while the runners stop.
    pub fn stopping(&mut self) {
        if !self.stopping {
            self.stopping = true;
            self.notifier.send("STOPPING=1");
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.stopping();
        if let Some(w) = self.watchdog.take() {
            w.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_decides_what_is_sent() {
        let n = |s: Option<&str>, u: Option<&str>, p: Option<&str>| {
            Notifier::from_vars(s.map(Into::into), u.map(Into::into), p.map(Into::into), 42)
        };
        assert!(n(None, Some("1000000"), None).is_none());
        assert!(n(Some(""), None, None).is_none());
        let w = |x: Option<Notifier>| x.and_then(|x| x.watchdog());
        assert_eq!(w(n(Some("/run/x"), None, None)), None);
        assert_eq!(
            w(n(Some("/run/x"), Some("20000000"), None)),
            Some(Duration::from_secs(20))
        );
        assert_eq!(
            w(n(Some("/run/x"), Some("20000000"), Some("42"))),
            Some(Duration::from_secs(20))
        );
        // Another process's watchdog, or garbage: none.
        assert_eq!(w(n(Some("/run/x"), Some("20000000"), Some("7"))), None);
        assert_eq!(w(n(Some("/run/x"), Some("soon"), None)), None);
        assert_eq!(w(n(Some("/run/x"), Some("0"), None)), None);
    }

    /// The pings reach a socket bound where `NOTIFY_SOCKET` says, path or abstract.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pings_reach_the_socket_every_half_period() {
        use std::os::unix::net::UnixDatagram;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let n = Notifier {
            socket: path.to_str().unwrap().into(),
            watchdog: Some(Duration::from_millis(100)),
        };
        n.send("READY=1");
        let task = tokio::spawn(n.keep_watchdog());
        let mut buf = [0u8; 64];
        let mut got = Vec::new();
        for _ in 0..3 {
            let len = tokio::task::block_in_place(|| server.recv(&mut buf)).unwrap();
            got.push(String::from_utf8_lossy(&buf[..len]).into_owned());
        }
        task.abort();
        assert_eq!(got, ["READY=1", "WATCHDOG=1", "WATCHDOG=1"]);

        let name = format!("allot-notify-test-{}", std::process::id());
        let abs = {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap()
        };
        let server = UnixDatagram::bind_addr(&abs).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        Notifier {
            socket: format!("@{name}"),
            watchdog: None,
        }
        .send("STOPPING=1");
        let len = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
    }

    /// `STOPPING=1` goes out once: at the shutdown's start, or when the process gives up
    /// after readiness (an error return drops its `Started`).
    #[tokio::test]
    async fn stopping_is_said_once_and_on_every_way_out() {
        use std::os::unix::net::UnixDatagram;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        server.set_nonblocking(true).unwrap();
        let n = Notifier {
            socket: path.to_str().unwrap().into(),
            watchdog: None,
        };
        let received = || {
            let mut buf = [0u8; 64];
            let mut got = Vec::new();
            while let Ok(len) = server.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..len]).into_owned());
            }
            got
        };
        // An early return: dropped without `stopping`.
        drop(n.clone().ready());
        assert_eq!(received(), ["READY=1", "STOPPING=1"]);
        // A shutdown: said at its start, not again when dropped.
        let mut started = n.ready();
        started.stopping();
        assert_eq!(received(), ["READY=1", "STOPPING=1"]);
        drop(started);
        assert_eq!(received(), Vec::<String>::new());
    }
}
