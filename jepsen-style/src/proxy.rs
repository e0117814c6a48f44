//! A TCP proxy for one directed peer link (node i dialling node j). The harness cuts
//! and heals links; it never alters a byte:
//! - `cut(Blackhole)`: nothing is forwarded (open connections stall, new ones are
//!   accepted and left hanging) until healed — like a dropped route.
//! - `cut(Reset)`: open connections are closed at once and new ones are closed on
//!   accept — like a refused or reset connection.
//! - `set_delay(ms)`: every chunk waits `ms` before it is forwarded (order kept).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Cut {
    Blackhole,
    Reset,
}

#[derive(Default)]
struct LinkState {
    down: AtomicBool,
    reset: AtomicBool,
    delay_ms: AtomicU64,
    /// Bumped on every reset: connections of an older generation close.
    generation: AtomicU64,
    stopped: AtomicBool,
}

pub struct Link {
    pub from: u64,
    pub to: u64,
    /// Where node `from` dials (the proxy).
    pub listen: String,
    /// Node `to`'s real address.
    pub target: String,
    state: Arc<LinkState>,
}

const POLL: Duration = Duration::from_millis(20);

impl Link {
    /// Binds a proxy on a free loopback port forwarding to `target`.
    pub async fn start(from: u64, to: u64, target: String) -> anyhow::Result<Link> {
        Link::start_on(
            std::net::TcpListener::bind("127.0.0.1:0")?,
            from,
            to,
            target,
        )
    }

    /// Starts the proxy on a listener bound earlier (so that ports picked for the nodes
    /// afterwards cannot collide with it).
    pub fn start_on(
        listener: std::net::TcpListener,
        from: u64,
        to: u64,
        target: String,
    ) -> anyhow::Result<Link> {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let listen = listener.local_addr()?.to_string();
        let state = Arc::new(LinkState::default());
        tokio::spawn(accept_loop(listener, target.clone(), state.clone()));
        Ok(Link {
            from,
            to,
            listen,
            target,
            state,
        })
    }

    pub fn cut(&self, how: Cut) {
        self.state.reset.store(how == Cut::Reset, Ordering::SeqCst);
        self.state.down.store(true, Ordering::SeqCst);
        if how == Cut::Reset {
            self.state.generation.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn heal(&self) {
        self.state.down.store(false, Ordering::SeqCst);
        self.state.reset.store(false, Ordering::SeqCst);
    }

    pub fn is_down(&self) -> bool {
        self.state.down.load(Ordering::SeqCst)
    }

    pub fn set_delay(&self, ms: u64) {
        self.state.delay_ms.store(ms, Ordering::SeqCst);
    }

    pub fn stop(&self) {
        self.state.stopped.store(true, Ordering::SeqCst);
        self.state.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn accept_loop(listener: TcpListener, target: String, st: Arc<LinkState>) {
    loop {
        let accepted = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        if st.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(Ok((inbound, _))) = accepted else {
            continue;
        };
        if st.down.load(Ordering::SeqCst) && st.reset.load(Ordering::SeqCst) {
            drop(inbound);
            continue;
        }
        let st = st.clone();
        let target = target.clone();
        tokio::spawn(async move {
            let generation = st.generation.load(Ordering::SeqCst);
            // Black-holed: hold the connection without dialling until healed.
            if !wait_up(&st, generation).await {
                return;
            }
            let Ok(Ok(outbound)) =
                tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&target)).await
            else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::select! {
                _ = pump(ri, wo, st.clone(), generation) => {}
                _ = pump(ro, wi, st.clone(), generation) => {}
            }
        });
    }
}

/// Waits while the link is down; false if the connection must close (reset, stopped).
async fn wait_up(st: &LinkState, generation: u64) -> bool {
    loop {
        if st.generation.load(Ordering::SeqCst) != generation {
            return false;
        }
        if !st.down.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn generation_changed(st: &LinkState, generation: u64) {
    while st.generation.load(Ordering::SeqCst) == generation {
        tokio::time::sleep(POLL * 5).await;
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    st: Arc<LinkState>,
    generation: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = generation_changed(&st, generation) => return,
        };
        if !wait_up(&st, generation).await {
            return;
        }
        let delay = st.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
