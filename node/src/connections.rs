//! The node's connection slots (`--max-connections`), and who may take one when none is
//! free (docs/DESIGN.md §66).
//!
//! Every accepted connection holds a [`Slot`] until it closes. A slot records whether
//! its connection has **authenticated** — a call of it resolved a token or passed the
//! peer check (the Raft service, a peer link's hello): [`vouch`] — whether a call of it
//! is open, and when a call of it last began or ended.
//!
//! At the bound, a new connection is not simply refused. It takes the slot of:
//! 1. a connection that has never authenticated, the oldest first, whatever it is doing
//!    (a TLS handshake, a half-sent preface, anonymous calls, an anonymous health
//!    watch); else
//! 2. an authenticated connection with no call open, the one longest without a call
//!    first (its client reconnects at its next call); else
//! 3. none: every slot is an authenticated connection with a call open, and the new
//!    connection is closed at accept, as before.
//!
//! So a host that opens connections and sends nothing holds no slot for longer than it
//! takes others to arrive, and a peer link, an agent's assignment stream, a call in
//! progress keep theirs. The evicted connection is closed from the node's side: its
//! reads end (the task serving it is woken), and whoever waits on [`Slot::evicted`]
//! (the first-bytes wait of a plaintext connection) stops waiting.
//!
//! Calls find their connection's slot by the remote address tonic puts in each request
//! ([`Connections::slot_of`]); [`Admitted`](crate::admission::Admitted) makes it the
//! task-local [`CONNECTION`] while the call runs, so that the edge's authentication can
//! [`vouch`] for it without passing it down.

use futures::task::AtomicWaker;
use prometheus::IntCounterVec;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

tokio::task_local! {
    /// The slot of the connection the current call (or peer link) arrived on.
    static CONNECTION: Arc<Slot>;
}

/// Runs `f` with `slot` as the current connection (see [`vouch`]).
pub async fn on<F: std::future::Future>(slot: Option<Arc<Slot>>, f: F) -> F::Output {
    match slot {
        Some(slot) => CONNECTION.scope(slot, f).await,
        None => f.await,
    }
}

/// The current call authenticated (a token resolved to a principal, or a peer passed
/// the peer check): its connection is no longer taken for a newcomer while a call of it
/// is open. Does nothing outside a call.
pub fn vouch() {
    let _ = CONNECTION.try_with(|s| s.vouch());
}

/// Marks the current connection busy until the guard drops (a peer link while it is
/// served). `None` outside a connection's task.
pub fn busy() -> Option<Active> {
    CONNECTION.try_with(Slot::begin).ok()
}

/// Open connections, bounded; see the module doc for who gives up a slot at the bound.
#[derive(Clone)]
pub struct Connections {
    table: Arc<Mutex<Table>>,
    max: usize,
    epoch: Instant,
    refusals: Option<IntCounterVec>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    by_id: HashMap<u64, Arc<Slot>>,
    by_addr: HashMap<SocketAddr, Arc<Slot>>,
}

/// Why a connection lost its slot to a newcomer (`allot_edge_refusals_total{api=
/// "connections", reason}`; the newcomer closed at accept is `too_many`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// It had never authenticated.
    Unauthenticated,
    /// It had authenticated and had no call open.
    Idle,
}

impl Eviction {
    fn label(self) -> &'static str {
        match self {
            Eviction::Unauthenticated => "evicted",
            Eviction::Idle => "evicted_idle",
        }
    }
}

impl Connections {
    pub fn new(max: usize) -> Connections {
        Connections {
            table: Arc::default(),
            max,
            epoch: Instant::now(),
            refusals: None,
        }
    }

    pub fn counted(mut self, refusals: IntCounterVec) -> Connections {
        self.refusals = Some(refusals);
        self
    }

    /// Open now (evicted connections no longer count, even before they are closed).
    pub fn open(&self) -> usize {
        self.lock().by_id.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives `io` (from `addr`) a slot: a free one, or one taken from another connection
    /// (module doc). `None`: every slot is an authenticated connection with a call open.
    pub fn admit<IO>(&self, io: IO, addr: Option<SocketAddr>) -> Option<Counted<IO>> {
        let mut t = self.lock();
        if t.by_id.len() >= self.max {
            let Some((victim, why)) = victim(t.by_id.values()).map(|(v, why)| (v.clone(), why))
            else {
                drop(t);
                self.count("too_many");
                return None;
            };
            t.remove(victim.id);
            victim.evict();
            self.count(why.label());
        }
        t.next_id += 1;
        let slot = Arc::new(Slot {
            id: t.next_id,
            addr,
            epoch: self.epoch,
            calls: AtomicUsize::new(0),
            last_call_ms: AtomicU64::new(0),
            trusted: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            reader: AtomicWaker::new(),
            waiters: tokio::sync::Notify::new(),
        });
        slot.touch();
        t.by_id.insert(slot.id, slot.clone());
        if let Some(a) = addr {
            t.by_addr.insert(a, slot.clone());
        }
        drop(t);
        Some(Counted {
            io,
            slot,
            table: self.table.clone(),
        })
    }

    /// The slot of the connection a request arrived on (by the remote address tonic
    /// records for the connection, plaintext or TLS).
    pub fn slot_of<B>(&self, req: &http::Request<B>) -> Option<Arc<Slot>> {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        let e = req.extensions();
        let addr = e
            .get::<TcpConnectInfo>()
            .and_then(TcpConnectInfo::remote_addr)
            .or_else(|| {
                e.get::<TlsConnectInfo<TcpConnectInfo>>()
                    .and_then(|t| t.get_ref().remote_addr())
            })?;
        self.lock().by_addr.get(&addr).cloned()
    }

    fn count(&self, reason: &str) {
        if let Some(r) = &self.refusals {
            r.with_label_values(&["connections", reason]).inc();
        }
    }
}

impl Table {
    fn remove(&mut self, id: u64) {
        if let Some(s) = self.by_id.remove(&id) {
            if let Some(a) = s.addr {
                if self.by_addr.get(&a).is_some_and(|o| o.id == id) {
                    self.by_addr.remove(&a);
                }
            }
        }
    }
}

/// The connection that gives its slot to a newcomer, and why (module doc); ties go to
/// the older connection (ids grow with each accept).
fn victim<'a>(slots: impl Iterator<Item = &'a Arc<Slot>>) -> Option<(&'a Arc<Slot>, Eviction)> {
    slots
        .filter_map(|s| {
            // Anonymous calls buy an unauthenticated connection nothing: the oldest
            // goes first. Among authenticated ones, the one longest without a call.
            let (why, key) = if !s.trusted.load(Ordering::Acquire) {
                (Eviction::Unauthenticated, (0, 0))
            } else if s.calls.load(Ordering::Acquire) == 0 {
                (Eviction::Idle, (1, s.last_call_ms.load(Ordering::Acquire)))
            } else {
                return None;
            };
            Some(((key, s.id), s, why))
        })
        .min_by_key(|(key, _, _)| *key)
        .map(|(_, s, why)| (s, why))
}

/// One connection's slot.
pub struct Slot {
    id: u64,
    addr: Option<SocketAddr>,
    epoch: Instant,
    /// Calls open (a server stream until its response ends; a peer link while served).
    calls: AtomicUsize,
    /// When a call last began or ended (or the connection was accepted), in ms since
    /// `epoch`.
    last_call_ms: AtomicU64,
    trusted: AtomicBool,
    evicted: AtomicBool,
    /// The task reading the connection, woken when it is evicted.
    reader: AtomicWaker,
    waiters: tokio::sync::Notify,
}

impl Slot {
    fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_call_ms.store(ms, Ordering::Release);
    }

    /// A call of this connection begins; it ends when the guard drops.
    pub fn begin(self: &Arc<Self>) -> Active {
        self.calls.fetch_add(1, Ordering::AcqRel);
        self.touch();
        Active(self.clone())
    }

    /// The connection authenticated (see [`vouch`]).
    pub fn vouch(&self) {
        self.trusted.store(true, Ordering::Release);
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.reader.wake();
        self.waiters.notify_waiters();
    }

    /// Whether the connection gave its slot to another.
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Resolves once the connection gave its slot to another.
    pub async fn evicted(&self) {
        loop {
            let notified = self.waiters.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.is_evicted() {
                return;
            }
            notified.await;
        }
    }
}

/// A call of a connection, open until dropped.
pub struct Active(Arc<Slot>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.touch();
        self.0.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection holding one of [`Connections`]' slots. Once evicted, its reads end (as
/// if the peer had closed) and its writes fail, so whatever serves it lets it go.
pub struct Counted<IO> {
    io: IO,
    slot: Arc<Slot>,
    table: Arc<Mutex<Table>>,
}

impl<IO> Counted<IO> {
    /// The connection itself (to peek at its first bytes).
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    pub fn slot(&self) -> &Arc<Slot> {
        &self.slot
    }
}

impl<IO> Drop for Counted<IO> {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.slot.id);
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Counted<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> IO::ConnectInfo {
        self.io.connect_info()
    }
}

fn gone() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the connection gave its slot to another",
    )
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        // Registered before the check, so an eviction between the two still wakes us.
        self.slot.reader.register(cx.waker());
        if self.slot.is_evicted() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.slot.is_evicted() {
            return Poll::Ready(Err(gone()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.slot.is_evicted() {
            return Poll::Ready(Err(gone()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.slot.is_evicted() {
            return Poll::Ready(Err(gone()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn addr(port: u16) -> Option<SocketAddr> {
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    }

    #[test]
    fn at_the_bound_a_connection_that_never_authenticated_gives_way() {
        let c = Connections::new(2);
        let a = c.admit((), addr(1)).unwrap();
        let b = c.admit((), addr(2)).unwrap();
        // `a` authenticated, and has a call open: it keeps its slot.
        CONNECTION.sync_scope(a.slot().clone(), vouch);
        let call = a.slot().begin();
        let d = c.admit((), addr(3)).expect("b gives way");
        assert!(b.slot().is_evicted());
        assert!(!a.slot().is_evicted());
        assert_eq!(c.open(), 2);
        // `d` never authenticated: it gives way next, however recent its calls.
        drop(d.slot().begin());
        let e = c.admit((), addr(4)).expect("d gives way");
        assert!(d.slot().is_evicted());
        // Once both have authenticated with calls open, a newcomer is refused.
        CONNECTION.sync_scope(e.slot().clone(), vouch);
        let e_call = e.slot().begin();
        assert!(c.admit((), addr(5)).is_none());
        assert_eq!(c.open(), 2);
        // A call ends: its connection is idle, and gives way.
        drop(call);
        let _f = c.admit((), addr(6)).expect("a, idle, gives way");
        assert!(a.slot().is_evicted());
        assert!(!e.slot().is_evicted());
        drop(e_call);
        // Dropping an evicted connection frees nothing more; dropping a live one does.
        drop((a, b, d));
        assert_eq!(c.open(), 2);
        drop(e);
        assert_eq!(c.open(), 1);
    }

    #[test]
    fn of_unauthenticated_ones_the_oldest_gives_way_whatever_it_calls() {
        let c = Connections::new(2);
        let a = c.admit((), addr(1)).unwrap();
        let b = c.admit((), addr(2)).unwrap();
        let _open = a.slot().begin();
        b.slot().last_call_ms.store(0, Ordering::Release);
        let _n = c.admit((), addr(3)).unwrap();
        assert!(a.slot().is_evicted(), "the older, with a call open");
        assert!(!b.slot().is_evicted());
    }

    #[test]
    fn of_authenticated_idle_ones_the_one_longest_without_a_call_gives_way() {
        let mut c = Connections::new(3);
        // Calls made now are at least 60 s after the figures stored below.
        c.epoch = Instant::now()
            .checked_sub(std::time::Duration::from_secs(60))
            .expect("the clock runs past a minute");
        let a = c.admit((), addr(1)).unwrap();
        let b = c.admit((), addr(2)).unwrap();
        let x = c.admit((), addr(3)).unwrap();
        for s in [&a, &b, &x] {
            CONNECTION.sync_scope(s.slot().clone(), vouch);
        }
        // The one longest without a call goes first; a call makes a connection the
        // most recent.
        a.slot().last_call_ms.store(5, Ordering::Release);
        b.slot().last_call_ms.store(3, Ordering::Release);
        x.slot().last_call_ms.store(9, Ordering::Release);
        let n = c.admit((), addr(4)).unwrap();
        assert!(b.slot().is_evicted());
        CONNECTION.sync_scope(n.slot().clone(), vouch);
        let _n_call = n.slot().begin();
        drop(a.slot().begin());
        let _m = c.admit((), addr(5)).unwrap();
        assert!(x.slot().is_evicted(), "a called last");
        assert!(!a.slot().is_evicted());
    }

    #[test]
    fn a_call_finds_its_connection_by_the_remote_address() {
        use tonic::transport::server::TcpConnectInfo;
        let c = Connections::new(4);
        let a = c.admit((), addr(7)).unwrap();
        let mut req = http::Request::new(());
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: addr(7),
        });
        assert_eq!(c.slot_of(&req).map(|s| s.id), Some(a.slot().id));
        drop(a);
        assert!(c.slot_of(&req).is_none(), "gone with its connection");
        // `vouch` and `busy` outside a connection do nothing.
        vouch();
        assert!(busy().is_none());
    }

    #[tokio::test]
    async fn an_evicted_connection_reads_its_end_and_its_waiters_wake() {
        let (near, _far) = tokio::io::duplex(64);
        let c = Connections::new(1);
        let mut a = c.admit(near, addr(1)).unwrap();
        let slot = a.slot().clone();
        let reading = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            let n = a.read(&mut buf).await.unwrap();
            (n, a)
        });
        let waiting = tokio::spawn(async move { slot.evicted().await });
        tokio::task::yield_now().await;
        let _b = c.admit(tokio::io::duplex(64).0, addr(2)).unwrap();
        let (n, _a) = reading.await.unwrap();
        assert_eq!(n, 0, "the read ends as at the peer's close");
        waiting.await.unwrap();
    }
}
