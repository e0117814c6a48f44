//! The peer link: openraft's three RPCs (AppendEntries, Vote, snapshot chunks) between
//! nodes over one TCP connection per peer (inside TLS when the nodes serve TLS),
//! multiplexed by request id, on the node's own gRPC port.
//!
//! **Why.** A unary gRPC call costs, on this 2-core machine, ~140 µs of CPU and a ~120 µs
//! round trip on loopback: the channel's buffer task, an HTTP/2 stream with its headers
//! and both ends' connection tasks, the server's per-call task and tower layers. The same
//! message framed on a TCP connection costs ~65 µs and ~80 µs (`node/examples/rtt.rs`;
//! DESIGN §61). A commit takes two to four peer calls, so this is most of what a
//! one-client commit spends outside the disk and the state machine.
//!
//! **Same port.** A connection whose first eight bytes are [`MAGIC`] is a link; any
//! other is handed to the gRPC server as before (an HTTP/2 client's preface starts
//! `PRI `, a TLS handshake with `0x16`). A release without the link reads the magic as a
//! broken HTTP/2 preface and closes the connection: the dialling node then uses gRPC for
//! that peer and tries the link again [`RETRY_LINK_AFTER`] later. So a cluster of mixed
//! releases replicates during a rolling upgrade, and routes (`--peer-route`, the fault
//! harness's proxies) carry the link as they carry gRPC.
//!
//! **Under TLS** the link runs inside a TLS session whose ALPN is
//! [`crate::tls::ALPN_LINK`]: the dialler presents its node certificate, the listener
//! (allot's own, `crate::serve`) tells a link from HTTP/2 by the negotiated protocol, and
//! the hello that follows is the same. The listener admits it only with a client
//! certificate of the cluster CA (and the peer secret, when one is configured), as the
//! gRPC Raft service does. A TLS listener without the link (an older release, or
//! `--peer-link off`) refuses the protocol in the handshake, and the dialler uses gRPC
//! for that peer as it does for a plaintext node without it. `--peer-link off` turns the
//! link off either way.
//!
//! **Authentication and bounds**, as for the gRPC service (`crate::peer`): the first
//! frame is a hello carrying the peer secret, checked by [`PeerAuth::admits_link`]
//! before any other frame is read; every request frame's length is bounded by
//! [`RAFT_MESSAGE_MAX`] before its body is read, its bytes are taken from the same
//! in-flight budget as the gRPC Raft service's before they are read, and a body must
//! arrive within [`BODY_READ_MAX`]. The message is then handled by the gRPC service's
//! own methods ([`crate::server::Services`]), guards included: the link changes how a
//! message travels, never what is checked.
//!
//! **Wire** (little-endian):
//! - dialler: `MAGIC`, then the hello: `u16` secret length, the secret (≤ [`HELLO_SECRET_MAX`]);
//! - listener: `MAGIC`, then one byte: 0 accepted, or a refusal (the connection closes);
//! - request: `u32` length of what follows, `u64` id, `u8` kind (1 append, 2 vote,
//!   3 snapshot chunk), `u32` shard, `u32` timeout ms, the payload (the message the gRPC
//!   call carries in `RaftMessage.payload`);
//! - reply: `u32` length of what follows, `u64` id, `u8` status (0 ok, else a gRPC status
//!   code), then the reply's payload, or the status message (UTF-8).

use crate::admission::Budget;
use crate::limits::{
    BODY_READ_MAX, LINK_FIRST_BYTES_TIMEOUT as FIRST_BYTES_TIMEOUT, LINK_FRAME_MAX as FRAME_MAX,
    LINK_HELLO_SECRET_MAX as HELLO_SECRET_MAX, LINK_HELLO_TIMEOUT as HELLO_TIMEOUT,
    LINK_REPLY_WRITE_MAX as REPLY_WRITE_MAX, LINK_REQUESTS_IN_FLIGHT_MAX as REQUESTS_IN_FLIGHT_MAX,
    RAFT_MESSAGE_MAX,
};
use crate::peer::{PeerAuth, PeerCredential};
use crate::server::Services;
use allot_proto::raft_server::Raft as RaftService;
use allot_proto::RaftMessage;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_rustls::rustls;

/// The first bytes of a link connection, both ways; the last is the link's version.
pub const MAGIC: &[u8; 8] = b"ALLOTPL\x01";
/// A dialler's hello that also carries its cluster id (`crate::identity`): sent by a
/// node that has one. A node without one (a data dir of an earlier release) sends
/// [`MAGIC`], which an earlier release's listener understands; an earlier release's
/// listener reads this one as no link, and the dialler uses gRPC (whose header carries
/// the id).
pub const MAGIC_WITH_CLUSTER: &[u8; 8] = b"ALLOTPL\x02";
/// A request frame's fixed part after its length: id, kind, shard, timeout.
const REQUEST_HEAD: usize = 8 + 1 + 4 + 4;
/// A reply frame's fixed part after its length: id, status.
const REPLY_HEAD: usize = 8 + 1;
/// After a peer did not speak the link (an older release), gRPC is used this long.
pub const RETRY_LINK_AFTER: Duration = Duration::from_secs(30);
/// Longest a request may run on the receiving node, whatever timeout it carries (the
/// snapshot install's bound).
const HANDLE_MAX: Duration = crate::peer::SNAPSHOT_INSTALL_TIMEOUT;
/// How long a TCP connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
// The frame bound of `crate::limits` is a Raft message and this header.
const _: () = assert!(FRAME_MAX == RAFT_MESSAGE_MAX + REQUEST_HEAD);

/// Which of the Raft service's methods a request calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Append = 1,
    Vote = 2,
    Snapshot = 3,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Append),
            2 => Some(Kind::Vote),
            3 => Some(Kind::Snapshot),
            _ => None,
        }
    }
}

/// Hello refusal: the peer secret is missing or wrong.
const REFUSED_UNAUTHENTICATED: u8 = 1;
/// Hello refusal: the dialler belongs to another cluster (`crate::identity`).
const REFUSED_OTHER_CLUSTER: u8 = 2;

/// Why a call over the link did not produce the peer's answer.
#[derive(Debug)]
pub enum LinkError {
    /// The peer does not speak the link (an older release): use gRPC.
    Unsupported,
    /// No link connection is up yet (one is being made, or will be shortly): send this
    /// call by gRPC.
    NotReady,
    /// No connection could be made or it broke: the peer is unreachable.
    Unreachable(String),
    /// The peer answered with an error status (as the gRPC service would have).
    Status(tonic::Status),
}

// ---------------------------------------------------------------- framing

fn request_frame(id: u64, kind: Kind, shard: u32, timeout: Duration, payload: &[u8]) -> Vec<u8> {
    let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    let len = (REQUEST_HEAD + payload.len()) as u32;
    let mut f = Vec::with_capacity(4 + REQUEST_HEAD + payload.len());
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&id.to_le_bytes());
    f.push(kind as u8);
    f.extend_from_slice(&shard.to_le_bytes());
    f.extend_from_slice(&ms.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn reply_frame(id: u64, reply: &Result<tonic::Response<RaftMessage>, tonic::Status>) -> Vec<u8> {
    let (status, body): (u8, &[u8]) = match reply {
        Ok(r) => (0, &r.get_ref().payload),
        Err(s) => (
            (s.code() as i32).clamp(1, 255) as u8,
            s.message().as_bytes(),
        ),
    };
    // A status message is cut to what a frame holds (a payload never exceeds it: the
    // service's replies are bounded as the gRPC service's are).
    let body = &body[..body.len().min(FRAME_MAX - REPLY_HEAD)];
    let len = (REPLY_HEAD + body.len()) as u32;
    let mut f = Vec::with_capacity(4 + REPLY_HEAD + body.len());
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&id.to_le_bytes());
    f.push(status);
    f.extend_from_slice(body);
    f
}

/// Reads a frame's length and checks it against `min`..=[`FRAME_MAX`].
async fn read_len<R: AsyncRead + Unpin>(r: &mut R, min: usize) -> std::io::Result<usize> {
    let len = r.read_u32_le().await? as usize;
    if !(min..=FRAME_MAX).contains(&len) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a link frame of {len} bytes (allowed {min}..={FRAME_MAX})"),
        ));
    }
    Ok(len)
}

// ---------------------------------------------------------------- writing frames

/// One side's writing half, shared by the tasks that send on the connection. A frame is
/// always written whole before another frame's first byte: the frame being written is
/// kept with how much of it is out, so a writer dropped part-way (its caller's timeout,
/// or openraft's around it) leaves the rest here, and a finisher task — or the next
/// writer, whichever holds the half first — writes the rest before anything else.
/// Without that, the receiver would read the next frame's bytes as the rest of the cut
/// one. A timeout therefore never resets the connection (which every shard shares); a
/// write error, or a rest that cannot be written within [`REPLY_WRITE_MAX`], closes it.
pub struct FrameWriter {
    half: tokio::sync::Mutex<Half>,
    /// Set once the half is shut down: the connection carries nothing more.
    closed: std::sync::atomic::AtomicBool,
}

struct Half {
    w: Option<Box<dyn AsyncWrite + Send + Unpin>>,
    /// The frame being written, and how many of its bytes are out.
    pending: Option<(Vec<u8>, usize)>,
}

fn closed_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the peer link is closed")
}

impl Half {
    /// Writes the rest of the pending frame, if any. A dropped call leaves the count
    /// exact: a write either wrote `n` bytes (counted) or nothing.
    async fn finish(&mut self) -> std::io::Result<()> {
        let Half { w, pending } = self;
        loop {
            let Some((frame, out)) = pending.as_mut() else {
                return Ok(());
            };
            let writer = w.as_mut().ok_or_else(closed_error)?;
            if *out >= frame.len() {
                // All of it is with the writer; a TLS session may still hold encrypted
                // bytes that the socket did not take. The frame stays pending until they
                // are out, so a writer dropped here leaves them to the finisher.
                writer.flush().await?;
                *pending = None;
                return Ok(());
            }
            let n = writer.write(&frame[*out..]).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            *out += n;
        }
    }
}

/// Armed while a frame is being written; if the writer is dropped before it finished,
/// a task finishes the frame (or closes the connection).
struct Finisher(Option<Arc<FrameWriter>>);

impl Drop for Finisher {
    fn drop(&mut self) {
        let Some(writer) = self.0.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let mut half = writer.half.lock().await;
            let done = tokio::time::timeout(REPLY_WRITE_MAX, half.finish()).await;
            if !matches!(done, Ok(Ok(()))) {
                writer.close_half(&mut half).await;
            }
        });
    }
}

impl FrameWriter {
    pub fn new(w: impl AsyncWrite + Send + Unpin + 'static) -> Arc<FrameWriter> {
        Arc::new(FrameWriter {
            half: tokio::sync::Mutex::new(Half {
                w: Some(Box::new(w)),
                pending: None,
            }),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Writes `frame` whole (after the rest of a frame cut before it). A write error
    /// closes the connection.
    pub async fn send(self: &Arc<Self>, frame: Vec<u8>) -> std::io::Result<()> {
        let mut half = self.half.lock().await;
        if half.w.is_none() {
            return Err(closed_error());
        }
        let mut finisher = Finisher(Some(self.clone()));
        let mut written = half.finish().await;
        if written.is_ok() {
            half.pending = Some((frame, 0));
            written = half.finish().await;
        }
        finisher.0 = None;
        if written.is_err() {
            self.close_half(&mut half).await;
        }
        written
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Shuts the connection's writing half down (the peer sees the end) and writes
    /// nothing more. Waits at most 1 s for a writer in progress.
    pub async fn close(&self) {
        match tokio::time::timeout(Duration::from_secs(1), self.half.lock()).await {
            Ok(mut half) => self.close_half(&mut half).await,
            Err(_) => self.closed.store(true, Ordering::Release),
        }
    }

    async fn close_half(&self, half: &mut Half) {
        self.closed.store(true, Ordering::Release);
        half.pending = None;
        if let Some(mut writer) = half.w.take() {
            let _ = tokio::time::timeout(Duration::from_millis(100), writer.shutdown()).await;
        }
    }
}

// ---------------------------------------------------------------- dialling side

/// Calls waiting for their replies on one connection, by request id. Once the
/// connection's reader ended, or its writer failed, it is `closed`: no call waits on it
/// any more.
#[derive(Default)]
struct WaitMap {
    closed: bool,
    map: HashMap<u64, oneshot::Sender<Result<Vec<u8>, tonic::Status>>>,
}

type Waiters = Arc<Mutex<WaitMap>>;
/// Where a call's reply arrives: its payload, or the peer's error status.
#[cfg(test)]
type ReplyRx = oneshot::Receiver<Result<Vec<u8>, tonic::Status>>;

fn waiters_of(w: &Waiters) -> std::sync::MutexGuard<'_, WaitMap> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails every call waiting on the connection, and any that would register.
fn close_waiters(w: &Waiters) {
    let mut w = waiters_of(w);
    w.closed = true;
    w.map.clear();
}

/// One open link connection.
struct Conn {
    writer: Arc<FrameWriter>,
    waiters: Waiters,
}

impl Conn {
    fn alive(&self) -> bool {
        !self.writer.is_closed() && !waiters_of(&self.waiters).closed
    }
}

/// Where a connection attempt's outcome arrives.
type Attempt = tokio::sync::watch::Receiver<Option<Dialled>>;

/// What a connection attempt came to.
#[derive(Clone)]
enum Dialled {
    Up(Arc<Conn>),
    Unsupported,
    Refused(String),
    Unreachable(String),
}

#[derive(Default)]
struct LinkState {
    conn: Option<Arc<Conn>>,
    /// The attempt in progress.
    connecting: Option<Attempt>,
    /// gRPC is used until then: the peer did not speak the link.
    unsupported_until: Option<Instant>,
    /// The peer refused this node's hello (the secret): no new attempt until then.
    refused_until: Option<(Instant, String)>,
    /// After a failed attempt, the next not before then (and the pause after the next).
    retry_at: Option<(Instant, Duration)>,
}

/// After a refused hello, how long calls are refused before the next attempt.
const RETRY_REFUSED_AFTER: Duration = Duration::from_secs(1);
/// Pauses between attempts to reach an unreachable peer: doubling within these bounds.
const RETRY_UNREACHABLE_MIN: Duration = Duration::from_millis(100);
const RETRY_UNREACHABLE_MAX: Duration = Duration::from_secs(5);

/// The link to one peer (dialled at its routed address), connected on first use.
///
/// A call never waits for a connection: while none is up, it is answered
/// [`LinkError::NotReady`] (the caller sends it by gRPC) and an attempt runs on its own
/// task, so a heartbeat's 100 ms deadline is never spent connecting.
pub struct Link {
    dial: String,
    credential: PeerCredential,
    /// Dial inside TLS with this configuration (the node serves TLS).
    tls: Option<Arc<rustls::ClientConfig>>,
    next_id: AtomicU64,
    state: Arc<Mutex<LinkState>>,
}

impl Link {
    pub fn new(dial: String, credential: PeerCredential) -> Link {
        Link {
            dial,
            credential,
            tls: None,
            next_id: AtomicU64::new(1),
            state: Arc::default(),
        }
    }

    /// The same link dialled inside TLS (`crate::tls::link_client_config`).
    pub fn over_tls(mut self, tls: Option<Arc<rustls::ClientConfig>>) -> Link {
        self.tls = tls;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open connection; otherwise why not, having started an attempt if one is due.
    fn ready(&self) -> Result<Arc<Conn>, (LinkError, Option<Attempt>)> {
        let mut state = self.state();
        if let Some(c) = state.conn.as_ref().filter(|c| c.alive()) {
            return Ok(c.clone());
        }
        state.conn = None;
        let now = Instant::now();
        if state.unsupported_until.is_some_and(|t| now < t) {
            return Err((LinkError::Unsupported, None));
        }
        if let Some((until, why)) = &state.refused_until {
            if now < *until {
                let refused = tonic::Status::permission_denied(why.clone());
                return Err((LinkError::Status(refused), None));
            }
        }
        if let Some(rx) = &state.connecting {
            return Err((LinkError::NotReady, Some(rx.clone())));
        }
        if state.retry_at.is_some_and(|(t, _)| now < t) {
            return Err((LinkError::NotReady, None));
        }
        let (tx, rx) = tokio::sync::watch::channel(None);
        state.connecting = Some(rx.clone());
        tokio::spawn(attempt(
            self.dial.clone(),
            self.credential.clone(),
            self.tls.clone(),
            self.state.clone(),
            tx,
        ));
        Err((LinkError::NotReady, Some(rx)))
    }

    /// Connects now if no connection is up, waiting at most `within` for the outcome
    /// (tests, and anything that must know the link is up).
    pub async fn connect(&self, within: Duration) -> Result<(), LinkError> {
        let mut rx = match self.ready() {
            Ok(_) => return Ok(()),
            Err((_, Some(rx))) => rx,
            Err((e, None)) => return Err(e),
        };
        let outcome = tokio::time::timeout(within, rx.wait_for(Option::is_some))
            .await
            .map_err(|_| LinkError::Unreachable(format!("{}: not connected in time", self.dial)))?
            .map_err(|_| LinkError::Unreachable(format!("{}: the attempt ended", self.dial)))?
            .clone();
        match outcome {
            Some(Dialled::Up(_)) => Ok(()),
            Some(Dialled::Unsupported) => Err(LinkError::Unsupported),
            Some(Dialled::Refused(m)) => {
                Err(LinkError::Status(tonic::Status::permission_denied(m)))
            }
            Some(Dialled::Unreachable(m)) => Err(LinkError::Unreachable(m)),
            None => Err(LinkError::Unreachable(format!("{}: no outcome", self.dial))),
        }
    }

    /// Sends one request and waits for its reply's payload, at most `timeout`.
    pub async fn call(
        &self,
        kind: Kind,
        shard: u32,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, LinkError> {
        if payload.len() > RAFT_MESSAGE_MAX {
            // The peer would close the connection on it: refused here, as gRPC's
            // encoding bound refuses it before sending.
            return Err(LinkError::Status(tonic::Status::out_of_range(format!(
                "a Raft message of {} bytes (at most {RAFT_MESSAGE_MAX})",
                payload.len()
            ))));
        }
        let conn = self.ready().map_err(|(e, _)| e)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = waiters_of(&conn.waiters);
            if w.closed {
                return Err(LinkError::NotReady);
            }
            w.map.insert(id, tx);
        }
        // Unregisters the waiter however the call ends (a timeout drops this future).
        struct Forget<'a>(&'a Waiters, u64);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                waiters_of(self.0).map.remove(&self.1);
            }
        }
        let _forget = Forget(&conn.waiters, id);
        let frame = request_frame(id, kind, shard, timeout, payload);
        let outcome = tokio::time::timeout(timeout, async {
            if let Err(e) = conn.writer.send(frame).await {
                close_waiters(&conn.waiters);
                return Err(LinkError::Unreachable(format!("{}: {e}", self.dial)));
            }
            match rx.await {
                Ok(Ok(payload)) => Ok(payload),
                Ok(Err(status)) => Err(LinkError::Status(status)),
                Err(_) => Err(LinkError::Unreachable(format!(
                    "{}: the peer link closed",
                    self.dial
                ))),
            }
        })
        .await;
        outcome.unwrap_or_else(|_| {
            Err(LinkError::Status(tonic::Status::deadline_exceeded(
                format!("{}: no answer within {timeout:?}", self.dial),
            )))
        })
    }
}

/// One connection attempt, on its own task: bounded by its own timeouts, its outcome
/// stored in the link's state and sent to whoever waits. However it ends (a panic, the
/// runtime stopping), the attempt's slot is freed.
async fn attempt(
    dial: String,
    credential: PeerCredential,
    tls: Option<Arc<rustls::ClientConfig>>,
    state: Arc<Mutex<LinkState>>,
    tx: tokio::sync::watch::Sender<Option<Dialled>>,
) {
    struct Slot<'a>(
        &'a Mutex<LinkState>,
        &'a tokio::sync::watch::Sender<Option<Dialled>>,
    );
    impl Drop for Slot<'_> {
        fn drop(&mut self) {
            let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if s.connecting
                .as_ref()
                .is_some_and(|rx| rx.same_channel(&self.1.subscribe()))
            {
                s.connecting = None;
            }
        }
    }
    let _slot = Slot(&state, &tx);
    let outcome = tokio::time::timeout(
        CONNECT_TIMEOUT + HELLO_TIMEOUT,
        connect(&dial, &credential, tls),
    )
    .await
    .unwrap_or_else(|_| Dialled::Unreachable(format!("{dial}: no peer link within the timeout")));
    {
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        s.connecting = None;
        let now = Instant::now();
        match &outcome {
            Dialled::Up(c) => {
                s.conn = Some(c.clone());
                s.unsupported_until = None;
                s.refused_until = None;
                s.retry_at = None;
            }
            Dialled::Unsupported => {
                tracing::info!(
                    peer = %dial,
                    "the peer does not speak the peer link (an older release?): using gRPC"
                );
                s.unsupported_until = Some(now + RETRY_LINK_AFTER);
            }
            Dialled::Refused(m) => {
                tracing::warn!(peer = %dial, "{m}");
                s.refused_until = Some((now + RETRY_REFUSED_AFTER, m.clone()));
            }
            Dialled::Unreachable(_) => {
                let pause = s.retry_at.map_or(RETRY_UNREACHABLE_MIN, |(_, p)| {
                    (p * 2).min(RETRY_UNREACHABLE_MAX)
                });
                s.retry_at = Some((now + pause, pause));
            }
        }
    }
    let _ = tx.send(Some(outcome));
}

/// TCP keepalive on a dialled link: a peer host that vanished without a reset is seen
/// within ~15 s (as the gRPC channel's HTTP/2 keepalive of 5 s + 5 s saw it), and data
/// unacknowledged for 10 s ends the connection.
#[cfg(target_os = "linux")]
fn keep_alive(stream: &tokio::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: a valid socket descriptor and a pointer to a c_int of the given size.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 2);
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 10_000);
}

#[cfg(not(target_os = "linux"))]
fn keep_alive(_: &tokio::net::TcpStream) {}

async fn connect(
    dial: &str,
    credential: &PeerCredential,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> Dialled {
    let tls = match tls {
        None => None,
        Some(t) => match crate::tls::server_name(dial) {
            Ok(name) => Some((t, name)),
            Err(e) => return Dialled::Unreachable(format!("{e:#}")),
        },
    };
    let stream =
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(dial)).await {
            Err(_) => return Dialled::Unreachable(format!("{dial}: connect timed out")),
            Ok(Err(e)) => return Dialled::Unreachable(format!("{dial}: {e}")),
            Ok(Ok(s)) => s,
        };
    if let Err(e) = stream.set_nodelay(true) {
        return Dialled::Unreachable(e.to_string());
    }
    keep_alive(&stream);
    let Some((tls, name)) = tls else {
        let (r, w) = stream.into_split();
        return hello(dial, credential, r, w).await;
    };
    let session = match tokio_rustls::TlsConnector::from(tls)
        .connect(name, stream)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            // A TLS listener that does not offer the link's ALPN: an older release, or a
            // node with the link off.
            if tls_alert(&e) == Some(rustls::AlertDescription::NoApplicationProtocol) {
                return Dialled::Unsupported;
            }
            return certificate_refused(dial, &e)
                .unwrap_or_else(|| Dialled::Unreachable(format!("{dial}: TLS: {e}")));
        }
    };
    if session.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_LINK) {
        return Dialled::Unsupported;
    }
    let (r, w) = tokio::io::split(session);
    hello(dial, credential, r, w).await
}

/// The alert the peer sent, when a TLS session failed because of one.
fn tls_alert(e: &std::io::Error) -> Option<rustls::AlertDescription> {
    match e.get_ref()?.downcast_ref::<rustls::Error>()? {
        rustls::Error::AlertReceived(a) => Some(*a),
        _ => None,
    }
}

/// The refusal an error carries when it is the listener's alert refusing this node's
/// certificate. Under TLS 1.3 it comes after the dialler's handshake has finished, when
/// it reads the hello's answer.
fn certificate_refused(dial: &str, e: &std::io::Error) -> Option<Dialled> {
    use rustls::AlertDescription as A;
    let a = tls_alert(e)?;
    let refused = matches!(
        a,
        A::BadCertificate
            | A::UnsupportedCertificate
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::UnknownCA
            | A::AccessDenied
            | A::CertificateRequired
            | A::DecryptError
    );
    refused.then(|| {
        Dialled::Refused(format!(
            "{dial}: the peer refused this node's certificate ({a:?})"
        ))
    })
}

/// The link's hello on a connected stream (plain or inside TLS), then its reader.
async fn hello<R, W>(dial: &str, credential: &PeerCredential, mut r: R, mut w: W) -> Dialled
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let secret = credential.secret_bytes();
    let cluster = credential.cluster_id();
    let mut hello = Vec::with_capacity(MAGIC.len() + 2 + secret.len() + 17);
    hello.extend_from_slice(if cluster.is_some() {
        MAGIC_WITH_CLUSTER
    } else {
        MAGIC
    });
    hello.extend_from_slice(&(secret.len() as u16).to_le_bytes());
    hello.extend_from_slice(secret);
    if let Some(id) = cluster {
        hello.push(id.len() as u8);
        hello.extend_from_slice(&id);
    }
    if let Err(e) = async {
        w.write_all(&hello).await?;
        w.flush().await
    }
    .await
    {
        return Dialled::Unreachable(format!("{dial}: {e}"));
    }
    let mut ack = [0u8; 9];
    if let Err(e) = r.read_exact(&mut ack).await {
        if let Some(refused) = certificate_refused(dial, &e) {
            return refused;
        }
        // A node at its connection bound, or stopping: not a verdict on its release.
        return Dialled::Unreachable(format!("{dial}: the peer closed the link's hello: {e}"));
    }
    // An older release answers the magic with its HTTP/2 SETTINGS frame (9 bytes of
    // header at least), then closes the connection.
    if &ack[..8] != MAGIC {
        return Dialled::Unsupported;
    }
    if ack[8] == REFUSED_OTHER_CLUSTER {
        return Dialled::Refused(format!(
            "{dial}: the peer belongs to another cluster (a node restored from another \
             backup set, or from an old backup: DESIGN §68)"
        ));
    }
    if ack[8] != 0 {
        return Dialled::Refused(format!(
            "{dial}: the peer refused this node's link (the peer secret or certificate is \
             missing or wrong)"
        ));
    }
    let waiters: Waiters = Arc::default();
    tokio::spawn(read_replies(tokio::io::BufReader::new(r), waiters.clone()));
    Dialled::Up(Arc::new(Conn {
        writer: FrameWriter::new(w),
        waiters,
    }))
}

/// The dialling side's reader: hands each reply to its waiter; on any error closes the
/// wait map and fails every waiter (their senders are dropped).
async fn read_replies<R: AsyncRead + Unpin>(mut r: R, waiters: Waiters) {
    let result: std::io::Result<()> = async {
        loop {
            let len = read_len(&mut r, REPLY_HEAD).await?;
            let id = r.read_u64_le().await?;
            let status = r.read_u8().await?;
            let mut body = vec![0u8; len - REPLY_HEAD];
            r.read_exact(&mut body).await?;
            let reply = if status == 0 {
                Ok(body)
            } else {
                Err(tonic::Status::new(
                    tonic::Code::from_i32(status as i32),
                    String::from_utf8_lossy(&body).into_owned(),
                ))
            };
            let waiter = waiters_of(&waiters).map.remove(&id);
            if let Some(w) = waiter {
                let _ = w.send(reply);
            }
        }
    }
    .await;
    if let Err(e) = result {
        tracing::debug!(error = %e, "peer link closed");
    }
    let mut w = waiters_of(&waiters);
    w.closed = true;
    w.map.clear();
}

/// Links by advertised peer address.
pub struct Links {
    map: Mutex<HashMap<String, Arc<Link>>>,
    /// Every link is dialled inside TLS with this (the node serves TLS).
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Links {
    pub fn new(tls: Option<Arc<rustls::ClientConfig>>) -> Links {
        Links {
            map: Mutex::default(),
            tls,
        }
    }

    pub fn get(&self, addr: &str, dial: &str, credential: &PeerCredential) -> Arc<Link> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(addr.to_string())
            .or_insert_with(|| {
                Arc::new(Link::new(dial.to_string(), credential.clone()).over_tls(self.tls.clone()))
            })
            .clone()
    }
}

// ---------------------------------------------------------------- listening side

/// Whether the first bytes of a connection make it a link: `Some(true)` once all of
/// [`MAGIC`] is seen, `Some(false)` as soon as a byte differs, `None` while undecided.
pub fn classify(prefix: &[u8]) -> Option<bool> {
    let n = prefix.len().min(MAGIC.len());
    if prefix[..n] != MAGIC[..n] && prefix[..n] != MAGIC_WITH_CLUSTER[..n] {
        return Some(false);
    }
    (n == MAGIC.len()).then_some(true)
}

/// Peeks at a new connection's first bytes (without consuming them) until it is known
/// whether it is a link. `None`: nothing decisive arrived in time, or the peer closed.
/// A connection that sent part of the magic is looked at again with a growing pause
/// (1 ms to 100 ms) and given up on after [`HELLO_TIMEOUT`]: a connection that stops
/// half-way costs a few dozen wake-ups, not one a millisecond.
pub async fn is_link(stream: &tokio::net::TcpStream) -> Option<bool> {
    let mut buf = [0u8; 8];
    let decide = async {
        let mut pause = Duration::from_millis(1);
        let mut partial_since: Option<tokio::time::Instant> = None;
        loop {
            let n = stream.peek(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            if let Some(d) = classify(&buf[..n]) {
                return Some(d);
            }
            let since = *partial_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= HELLO_TIMEOUT {
                return None;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    };
    tokio::time::timeout(FIRST_BYTES_TIMEOUT, decide)
        .await
        .ok()
        .flatten()
}

/// What a link connection's server side needs.
#[derive(Clone)]
pub struct Served {
    pub services: Services,
    pub auth: PeerAuth,
    /// The Raft service's in-flight byte budget (shared with the gRPC Raft service).
    pub budget: Budget,
    /// Ends the connection when the node stops serving.
    pub stop: tokio::sync::watch::Receiver<bool>,
    /// `allot_peer_link_connections_total{result}`.
    pub connections: prometheus::IntCounterVec,
}

/// Serves one link connection (its magic not yet read) until it closes, breaks a rule
/// or the node stops. Its requests in handling end with it, and its writing half is
/// shut down, so the dialler sees the end at once. `peer_cert`: the connection is a TLS
/// session whose client presented a certificate of the cluster CA.
pub async fn serve<S>(stream: S, served: Served, peer_cert: bool)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let mut stop = served.stop.clone();
    let (r, w) = tokio::io::split(stream);
    let writer = FrameWriter::new(w);
    let broken = Arc::new(tokio::sync::Notify::new());
    let mut handling = tokio::task::JoinSet::new();
    tokio::select! {
        r = serve_conn(r, &writer, served.clone(), peer_cert, broken.clone(), &mut handling) => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "peer link connection ended");
            }
        }
        _ = broken.notified() => {
            tracing::debug!("peer link connection ended: a reply could not be written");
        }
        _ = stop.wait_for(|s| *s) => {}
    }
    handling.abort_all();
    writer.close().await;
}

async fn serve_conn<R>(
    r: R,
    writer: &Arc<FrameWriter>,
    served: Served,
    peer_cert: bool,
    broken: Arc<tokio::sync::Notify>,
    handling: &mut tokio::task::JoinSet<()>,
) -> std::io::Result<()>
where
    R: AsyncRead + Send + Unpin + 'static,
{
    let mut r = tokio::io::BufReader::new(r);
    let malformed =
        || std::io::Error::new(std::io::ErrorKind::InvalidData, "a malformed link hello");
    let (secret, cluster) = tokio::time::timeout(HELLO_TIMEOUT, async {
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic).await?;
        let len = r.read_u16_le().await? as usize;
        if (magic != *MAGIC && magic != *MAGIC_WITH_CLUSTER) || len > HELLO_SECRET_MAX {
            return Err(malformed());
        }
        let mut secret = vec![0u8; len];
        r.read_exact(&mut secret).await?;
        let mut cluster = None;
        if magic == *MAGIC_WITH_CLUSTER {
            let mut id: crate::identity::ClusterId = Default::default();
            if r.read_u8().await? as usize != id.len() {
                return Err(malformed());
            }
            r.read_exact(&mut id).await?;
            cluster = Some(id);
        }
        Ok((secret, cluster))
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no link hello in time"))??;
    let mut ack = [0u8; 9];
    ack[..8].copy_from_slice(MAGIC);
    if !served.auth.admits_link(&secret, peer_cert) {
        served
            .connections
            .with_label_values(&["unauthenticated"])
            .inc();
        ack[8] = REFUSED_UNAUTHENTICATED;
        writer.send(ack.to_vec()).await?;
        return Ok(());
    }
    // Authenticated first: only a peer may make a new node adopt its cluster.
    if let Err(refused) = served.auth.admits_cluster(cluster) {
        served
            .connections
            .with_label_values(&["other_cluster"])
            .inc();
        tracing::warn!(reason = %refused.message(), "peer link refused");
        ack[8] = REFUSED_OTHER_CLUSTER;
        writer.send(ack.to_vec()).await?;
        return Ok(());
    }
    served.connections.with_label_values(&["accepted"]).inc();
    // An authenticated peer's link keeps its connection slot while it is served
    // (`crate::connections`). Without peer authentication anyone is admitted here, and
    // the link keeps nothing.
    let _open = served.auth.configured().then(|| {
        crate::connections::vouch();
        crate::connections::busy()
    });
    writer.send(ack.to_vec()).await?;
    let in_flight = Arc::new(tokio::sync::Semaphore::new(REQUESTS_IN_FLIGHT_MAX));
    loop {
        while let Some(done) = handling.try_join_next() {
            if let Err(e) = done {
                if e.is_panic() {
                    tracing::error!(error = %e, "a peer-link request's handler panicked");
                }
            }
        }
        let slot = in_flight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| std::io::Error::other("closed"))?;
        let len = read_len(&mut r, REQUEST_HEAD).await?;
        // The frame's bytes are budgeted before they are read, as the gRPC service's
        // are; but the reader does not wait for them (the connection's other frames —
        // every shard's heartbeats and votes — would wait behind it): a frame the budget
        // cannot take now is refused busy, and the sender retries.
        let permit = served.budget.hold(len, tokio::time::Instant::now()).await;
        let body = tokio::time::timeout(BODY_READ_MAX, async {
            let id = r.read_u64_le().await?;
            let kind = r.read_u8().await?;
            let shard = r.read_u32_le().await?;
            let ms = r.read_u32_le().await?;
            if permit.is_err() {
                // Busy: the body is skipped (the stream stays in frame), the call refused.
                let skip = (len - REQUEST_HEAD) as u64;
                tokio::io::copy(&mut (&mut r).take(skip), &mut tokio::io::sink()).await?;
                return Ok::<_, std::io::Error>((id, kind, shard, ms, None));
            }
            let mut payload = vec![0u8; len - REQUEST_HEAD];
            r.read_exact(&mut payload).await?;
            Ok((id, kind, shard, ms, Some(payload)))
        })
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("a link frame's body did not arrive within {BODY_READ_MAX:?}"),
            )
        })??;
        let (id, kind, shard, ms, payload) = body;
        let services = served.services.clone();
        let (writer, broken) = (writer.clone(), broken.clone());
        handling.spawn(async move {
            let _slot = slot;
            let reply = match (payload, Kind::from_u8(kind)) {
                (None, _) => Err(crate::admission::busy("admission:raft")),
                (Some(_), None) => Err(tonic::Status::unimplemented(format!(
                    "peer link: unknown request kind {kind}"
                ))),
                (Some(payload), Some(kind)) => {
                    let limit = Duration::from_millis(ms as u64).min(HANDLE_MAX);
                    let msg = tonic::Request::new(RaftMessage { shard, payload });
                    let handled = async {
                        match kind {
                            Kind::Append => services.append(msg).await,
                            Kind::Vote => services.vote(msg).await,
                            Kind::Snapshot => services.snapshot(msg).await,
                        }
                    };
                    tokio::time::timeout(limit, handled)
                        .await
                        .unwrap_or_else(|_| {
                            Err(tonic::Status::deadline_exceeded(format!(
                                "not handled within the request's {limit:?}"
                            )))
                        })
                }
            };
            drop(permit);
            let frame = reply_frame(id, &reply);
            // A reply that could not be written ends the connection. One that stalled
            // past the bound is finished by the writer's finisher, which closes the
            // connection if it cannot.
            let written = tokio::time::timeout(REPLY_WRITE_MAX, writer.send(frame)).await;
            if matches!(written, Ok(Err(_))) || writer.is_closed() {
                broken.notify_one();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_magic_is_neither_an_http2_preface_nor_a_tls_handshake() {
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), Some(false));
        assert_eq!(classify(&[0x16, 0x03, 0x01]), Some(false));
        assert_eq!(classify(b"GET / HTTP/1.1"), Some(false));
        assert_eq!(classify(b"ALLOT"), None);
        assert_eq!(classify(b"ALLOTPL\x03"), Some(false));
        assert_eq!(classify(MAGIC), Some(true));
        assert_eq!(classify(MAGIC_WITH_CLUSTER), Some(true));
        assert_eq!(classify(b""), None);
    }

    fn waiting(ids: &[u64]) -> (Waiters, Vec<ReplyRx>) {
        let waiters: Waiters = Arc::default();
        let rxs = ids
            .iter()
            .map(|id| {
                let (t, r) = oneshot::channel();
                waiters_of(&waiters).map.insert(*id, t);
                r
            })
            .collect();
        (waiters, rxs)
    }

    #[tokio::test]
    async fn a_reply_frame_reads_back_as_its_payload_or_its_status() {
        let ok: Result<tonic::Response<RaftMessage>, tonic::Status> =
            Ok(tonic::Response::new(RaftMessage {
                shard: 3,
                payload: vec![1, 2, 3],
            }));
        let err: Result<tonic::Response<RaftMessage>, tonic::Status> =
            Err(tonic::Status::failed_precondition("no"));
        let mut bytes = reply_frame(7, &ok);
        bytes.extend(reply_frame(8, &err));
        let (waiters, mut rxs) = waiting(&[7, 8]);
        read_replies(&bytes[..], waiters.clone()).await;
        let r8 = rxs.pop().unwrap();
        let r7 = rxs.pop().unwrap();
        assert_eq!(r7.await.unwrap().unwrap(), vec![1, 2, 3]);
        let s = r8.await.unwrap().unwrap_err();
        assert_eq!(
            (s.code(), s.message()),
            (tonic::Code::FailedPrecondition, "no")
        );
        // The stream ended: no call waits on this connection any more.
        assert!(waiters_of(&waiters).closed);
    }

    #[tokio::test]
    async fn an_oversized_reply_frame_ends_the_connection_before_it_is_read() {
        let mut bytes = ((FRAME_MAX + 1) as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0u8; 64]);
        let (waiters, mut rxs) = waiting(&[0]);
        read_replies(&bytes[..], waiters.clone()).await;
        assert!(
            rxs.pop().unwrap().await.is_err(),
            "the waiter is failed, not answered"
        );
        assert!(waiters_of(&waiters).closed);
    }

    /// A frame whose writer is dropped part-way (a caller's timeout) is finished before
    /// the next frame's first byte, and the connection stays up: the receiver reads the
    /// two frames whole and in order, never the next frame's bytes as the rest of the
    /// cut one.
    #[tokio::test]
    async fn a_frame_cut_by_a_timeout_is_finished_before_the_next_frame() {
        let (near, mut far) = tokio::io::duplex(16);
        let writer = FrameWriter::new(near);
        let first = request_frame(1, Kind::Append, 0, Duration::from_secs(1), &[1u8; 64]);
        let second = request_frame(2, Kind::Vote, 0, Duration::from_secs(1), &[2u8; 8]);
        let cut = tokio::time::timeout(Duration::from_millis(50), writer.send(first.clone())).await;
        assert!(
            cut.is_err(),
            "the write blocks: nobody reads the far end yet"
        );
        let next = {
            let writer = writer.clone();
            let second = second.clone();
            tokio::spawn(async move { writer.send(second).await })
        };
        let mut got = vec![0u8; first.len() + second.len()];
        tokio::time::timeout(Duration::from_secs(5), far.read_exact(&mut got))
            .await
            .expect("both frames arrive")
            .expect("read");
        assert_eq!(got, [first, second].concat(), "whole frames, in order");
        next.await.unwrap().expect("the next frame is written");
        assert!(
            !writer.is_closed(),
            "a cut frame does not end the connection"
        );
    }

    #[test]
    fn a_request_frame_holds_its_header_and_payload() {
        let f = request_frame(9, Kind::Vote, 2, Duration::from_millis(1500), b"abc");
        assert_eq!(
            u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
            f.len() - 4
        );
        assert_eq!(u64::from_le_bytes(f[4..12].try_into().unwrap()), 9);
        assert_eq!(f[12], Kind::Vote as u8);
        assert_eq!(u32::from_le_bytes(f[13..17].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(f[17..21].try_into().unwrap()), 1500);
        assert_eq!(&f[21..], b"abc");
    }
}
