//! The node's connection slots (`--max-connections`), and who may take one when none is
//! free (docs/DESIGN.md §66).
//!
//! Every accepted connection holds a [`Slot`] until it closes. A slot records whether
//! its connection has **authenticated** — a call of it carried a token that resolved, or
//! passed the peer check (the Raft service, a peer link's hello, when peers
//! authenticate): [`vouch`] — whether it is **busy** (a call of it being handled, a
//! stream of it open, a peer link served), and when a call of it last began or ended.
//!
//! At the bound, a new connection is not simply refused. It takes the slot of:
//! 1. a connection that has never authenticated, whatever it is doing (a TLS handshake,
//!    a half-sent preface, anonymous calls, an anonymous health watch): from the source
//!    address holding the most such connections, its oldest; else
//! 2. an authenticated connection with no call open, the one longest without a call
//!    first (its client reconnects at its next call); else
//! 3. none: every slot is an authenticated connection with a call open, and the new
//!    connection is closed at accept, as before.
//!
//! So a host that opens connections and sends nothing holds no slot for longer than it
//! takes others to arrive, and a peer link, an agent's assignment stream, a call being
//! handled keep theirs. The evicted connection is closed from the node's side: its
//! reads end (the task serving it is woken), and whoever waits on [`Slot::evicted`]
//! (the first-bytes wait of a plaintext connection) stops waiting.
//!
//! Calls find their connection's slot by the addresses tonic puts in each request
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
/// served, a stream while it is open). `None` outside a connection's task.
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

/// A connection's local and remote addresses (a node may listen on several local ones,
/// so the remote address alone need not be unique).
pub type Addrs = (Option<SocketAddr>, Option<SocketAddr>);

#[derive(Default)]
struct Table {
    next_id: u64,
    by_id: HashMap<u64, Arc<Slot>>,
    by_addr: HashMap<(SocketAddr, SocketAddr), Arc<Slot>>,
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

    /// The connections holding a slot now: (authenticated, not), and the bound.
    pub fn census(&self) -> (usize, usize, usize) {
        let t = self.lock();
        let trusted = t
            .by_id
            .values()
            .filter(|s| s.trusted.load(Ordering::Acquire))
            .count();
        (trusted, t.by_id.len() - trusted, self.max)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives `io` (local and remote addresses `addrs`) a slot: a free one, or one taken
    /// from another connection (module doc). `None`: every slot is an authenticated
    /// connection with a call open.
    pub fn admit<IO>(&self, io: IO, addrs: Addrs) -> Option<Counted<IO>> {
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
        let addr = match addrs {
            (Some(local), Some(remote)) => Some((local, remote)),
            _ => None,
        };
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

    /// The slot of the connection a request arrived on (by the local and remote
    /// addresses tonic records for the connection, plaintext or TLS).
    pub fn slot_of<B>(&self, req: &http::Request<B>) -> Option<Arc<Slot>> {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        let e = req.extensions();
        let tcp = e.get::<TcpConnectInfo>().or_else(|| {
            e.get::<TlsConnectInfo<TcpConnectInfo>>()
                .map(TlsConnectInfo::get_ref)
        })?;
        let addr = (tcp.local_addr()?, tcp.remote_addr()?);
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

/// The connection that gives its slot to a newcomer, and why (module doc).
///
/// Among connections that never authenticated, anonymous calls buy nothing: the source
/// address holding the most of them gives one up, its oldest (so a flood from one host
/// evicts its own connections, not a new client's from elsewhere; ties go to the source
/// whose oldest is older). Among authenticated ones with no call open, the one longest
/// without a call; ties go to the older connection (ids grow with each accept).
fn victim<'a>(slots: impl Iterator<Item = &'a Arc<Slot>>) -> Option<(&'a Arc<Slot>, Eviction)> {
    let mut by_source: HashMap<Option<std::net::IpAddr>, (usize, &'a Arc<Slot>)> = HashMap::new();
    let mut idle: Option<((u64, u64), &'a Arc<Slot>)> = None;
    for s in slots {
        if !s.trusted.load(Ordering::Acquire) {
            let e = by_source
                .entry(s.addr.map(|(_, r)| r.ip()))
                .or_insert((0, s));
            e.0 += 1;
            if s.id < e.1.id {
                e.1 = s;
            }
        } else if s.calls.load(Ordering::Acquire) == 0 {
            let key = (s.last_call_ms.load(Ordering::Acquire), s.id);
            if idle.is_none_or(|(k, _)| key < k) {
                idle = Some((key, s));
            }
        }
    }
    if let Some((_, oldest)) = by_source
        .into_values()
        .max_by_key(|(n, oldest)| (*n, std::cmp::Reverse(oldest.id)))
    {
        return Some((oldest, Eviction::Unauthenticated));
    }
    idle.map(|(_, s)| (s, Eviction::Idle))
}

/// One connection's slot.
pub struct Slot {
    id: u64,
    /// (local, remote).
    addr: Option<(SocketAddr, SocketAddr)>,
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
        // Read first: every authenticated call vouches, and a store each time would
        // bounce the slot's cache line between the cores serving its calls.
        if !self.trusted.load(Ordering::Acquire) {
            self.trusted.store(true, Ordering::Release);
        }
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

    fn addr(port: u16) -> Addrs {
        from([127, 0, 0, 1], port)
    }

    fn from(ip: [u8; 4], port: u16) -> Addrs {
        (
            Some(SocketAddr::from(([127, 0, 0, 1], 7000))),
            Some(SocketAddr::from((ip, port))),
        )
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
    fn of_unauthenticated_ones_the_source_holding_most_gives_way_first() {
        let c = Connections::new(4);
        // A client from one host came first; a flood from another holds the rest.
        let client = c.admit((), from([10, 0, 0, 2], 1)).unwrap();
        let flood: Vec<_> = (0..3)
            .map(|p| c.admit((), from([10, 0, 0, 1], p)).unwrap())
            .collect();
        let later: Vec<_> = (3..9)
            .map(|p| c.admit((), from([10, 0, 0, 1], p)).unwrap())
            .collect();
        assert!(!client.slot().is_evicted(), "the flood evicts its own");
        assert!(flood.iter().all(|f| f.slot().is_evicted()));
        assert_eq!(later.iter().filter(|f| f.slot().is_evicted()).count(), 3);
        assert_eq!(c.open(), 4);
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
        let (local_addr, remote_addr) = addr(7);
        req.extensions_mut().insert(TcpConnectInfo {
            local_addr,
            remote_addr,
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
