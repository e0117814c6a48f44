//! Admission: what a call may cost the node *before* its message is read. tonic reads a
//! unary call's whole message into memory before the handler runs, so without this the
//! memory in flight grows with the number of open calls (connections × concurrent
//! streams × the message bound), whatever the rate limits and Raft permits say: they are
//! taken only after the message is in memory.
//!
//! Every service is wrapped in an [`Admitted`] that, on each call:
//! 1. reads the gRPC length prefix (the first 5 bytes of the body) — a message larger
//!    than the service's bound is refused there (`OUT_OF_RANGE`), as tonic would;
//! 2. takes the message's bytes from its class's budget (client calls and Raft messages
//!    have separate budgets, so a flood of one never starves the other), waiting at most
//!    [`ADMISSION_WAIT_MAX`]; a call that cannot get its bytes in time is refused with
//!    `RESOURCE_EXHAUSTED`, reason `NODE_BUSY`, and `retry-after-ms`;
//! 3. reads the rest of the message within [`BODY_READ_MAX`] (a sender that trickles its
//!    body holds its bytes at most that long: `DEADLINE_EXCEEDED`, reason `SLOW_BODY`);
//! 4. hands the call on and keeps the bytes until the handler answered (for a server
//!    stream: until the stream is set up).
//!
//! Bytes not yet read stay in HTTP/2 flow control: at most one connection window per
//! connection ([`CONNECTION_WINDOW_BYTES`]), and connections are counted
//! ([`Connections`](crate::connections::Connections)). So the node's memory for calls
//! is bounded by `CLIENT_BYTES_IN_FLIGHT_MAX + RAFT_BYTES_IN_FLIGHT_MAX + connections ×
//! CONNECTION_WINDOW_BYTES`, whatever callers do (docs/DESIGN.md §43).
//!
//! The Raft service's peer check runs on the headers *before* this (the interceptor
//! wraps the admitted service), so an unauthenticated caller never takes Raft budget.

use crate::connections::Connections;
use crate::decoded::{Malformed, Schema};
use crate::limits::{ADMISSION_WAIT_MAX, BODY_READ_MAX, CLIENT_STREAM_LIFE_MAX};
use allot_proto::meta;
use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use prometheus::IntCounterVec;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::metadata::MetadataValue;
use tonic::server::NamedService;
use tonic::Status;

/// Budgets count kibibytes (a semaphore takes at most `u32` permits at once).
const UNIT: usize = 1024;
/// The gRPC message prefix: a compression flag and a big-endian `u32` length.
const PREFIX: usize = 5;

/// One class's budget of message bytes being read or handled.
#[derive(Clone)]
pub struct Budget {
    name: &'static str,
    permits: Arc<Semaphore>,
    /// The budget's size in units: a call that needs more can never be admitted.
    total_units: usize,
    refusals: Option<IntCounterVec>,
    /// The connection slots whose calls this budget's services mark open (and, when
    /// `true`, authenticated: the Raft service's calls passed the peer check first).
    connections: Option<(Connections, bool)>,
}

impl Budget {
    /// A budget of `bytes` (rounded down to whole KiB, at least one message of 1 KiB).
    pub fn new(name: &'static str, bytes: usize) -> Budget {
        let total_units = (bytes / UNIT).max(1);
        Budget {
            name,
            permits: Arc::new(Semaphore::new(total_units)),
            total_units,
            refusals: None,
            connections: None,
        }
    }

    /// Makes each call's connection slot its current connection
    /// (`crate::connections::vouch`) and marks the slot busy while the call is handled
    /// (from its admission until its handler answered). `authenticated`: every call
    /// reaching this budget's services has authenticated already.
    pub fn tracking(mut self, connections: Connections, authenticated: bool) -> Budget {
        self.connections = Some((connections, authenticated));
        self
    }

    /// Counts refusals in `allot_edge_refusals_total{api=<name>, reason}`.
    pub fn counted(mut self, refusals: IntCounterVec) -> Budget {
        self.refusals = Some(refusals);
        self
    }

    /// Wraps `inner`, whose calls carry one message of at most `message_max` bytes
    /// (unary and server-streaming methods: every method of allot's services and of
    /// health). A message of a method in [`Schema::allot`] is charged what it decodes to
    /// ([`crate::decoded`]); a second message in the same call is refused.
    pub fn admit<S>(&self, inner: S, message_max: usize) -> Admitted<S> {
        Admitted {
            inner,
            budget: self.clone(),
            message_max,
            streams: None,
        }
    }

    /// Wraps `inner`, whose calls are client streams (server reflection): the first
    /// message is admitted as by [`Budget::admit`], and the call then holds one of
    /// `streams`' slots while its body is open, at most [`CLIENT_STREAM_LIFE_MAX`]. So
    /// the messages that follow — each at most the service's own decoding bound — cost at
    /// most that bound per slot, for a bounded time.
    pub fn admit_streams<S>(&self, inner: S, message_max: usize, streams: usize) -> Admitted<S> {
        Admitted {
            inner,
            budget: self.clone(),
            message_max,
            streams: Some(Arc::new(Semaphore::new(streams.max(1)))),
        }
    }

    /// Bytes (KiB) free now.
    pub fn available_kib(&self) -> usize {
        self.permits.available_permits()
    }

    fn refused(&self, reason: &str) {
        if let Some(r) = &self.refusals {
            r.with_label_values(&[self.name, reason]).inc();
        }
    }
}

/// A service whose calls are admitted by a [`Budget`].
#[derive(Clone)]
pub struct Admitted<S> {
    inner: S,
    budget: Budget,
    message_max: usize,
    /// Client-stream slots (`None`: one message per call).
    streams: Option<Arc<Semaphore>>,
}

impl<S: NamedService> NamedService for Admitted<S> {
    const NAME: &'static str = S::NAME;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S> tower_service::Service<http::Request<Body>> for Admitted<S>
where
    S: tower_service::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone that was driven to readiness serves this call (tower's rule).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let budget = self.budget.clone();
        let message_max = self.message_max;
        let streams = self.streams.clone();
        let (conn, authenticated) = match &self.budget.connections {
            Some((c, authenticated)) => (c.slot_of(&req), *authenticated),
            None => (None, false),
        };
        if authenticated {
            if let Some(c) = &conn {
                c.vouch();
            }
        }
        // A call is open on its connection's slot from when its message is admitted (a
        // call still waiting for its bytes, or trickling them, holds nothing open) until
        // its handler answered — not while its response is sent, which the caller's
        // flow control could stretch for ever. A stream that should keep its connection
        // holds the slot busy itself, under the stream bounds (`Services::open_stream`).
        let call = async move {
            let (parts, body) = req.into_parts();
            let slot = match &streams {
                None => None,
                Some(slots) => match slots.clone().try_acquire_owned() {
                    Ok(slot) => Some(slot),
                    Err(_) => {
                        budget.refused("streams");
                        return Ok(busy(budget.name).into_http());
                    }
                },
            };
            let cost = Cost {
                message_max,
                path: parts.uri.path(),
                schema: Some(Schema::allot()),
            };
            let (mut body, _permit) = match admit(&budget, body, &cost).await {
                Ok(admitted) => admitted,
                Err((status, reason)) => {
                    budget.refused(reason);
                    return Ok(status.into_http());
                }
            };
            let _open = crate::connections::busy();
            let Some(slot) = slot else {
                body.rest = Rest::Refused;
                return inner
                    .call(http::Request::from_parts(parts, Body::new(body)))
                    .await;
            };
            // A client stream's life is bounded on both sides: its requests (read by
            // the handler) and its responses, which hold the slot — a caller that stops
            // reading responses stalls the handler, which then reads no more requests.
            let end = tokio::time::Instant::now() + CLIENT_STREAM_LIFE_MAX;
            body.rest = Rest::Stream {
                until: Box::pin(tokio::time::sleep_until(end)),
            };
            let response = inner
                .call(http::Request::from_parts(parts, Body::new(body)))
                .await?;
            Ok(response.map(|b| {
                Body::new(Bounded {
                    inner: b,
                    until: Box::pin(tokio::time::sleep_until(end)),
                    _slot: slot,
                })
            }))
        };
        Box::pin(crate::connections::on(conn, call))
    }
}

type Refusal = (Status, &'static str);

/// How a call's message is admitted: its bound on the wire, and the schema that bounds
/// what it decodes to (by the method's `path`).
struct Cost<'a> {
    message_max: usize,
    path: &'a str,
    schema: Option<&'a Schema>,
}

/// Reads the call's message within the budget: the body to hand on (the bytes read,
/// then whatever the caller sends after them) and the bytes' permit.
///
/// The first frame is read under a permit too ([`FRAME_UNITS`], an HTTP/2 frame's most),
/// since reading it gives the caller flow-control window back: so a call waiting for
/// admission costs its headers only, and calls read at once are bounded by the budget.
async fn admit(
    budget: &Budget,
    mut body: Body,
    cost: &Cost<'_>,
) -> Result<(Replay, OwnedSemaphorePermit), Refusal> {
    let message_max = cost.message_max;
    let deadline = tokio::time::Instant::now() + BODY_READ_MAX;
    let wait_until = deadline.min(tokio::time::Instant::now() + ADMISSION_WAIT_MAX);
    let mut permit = budget.take(FRAME_UNITS, wait_until).await?;
    let mut head = BytesMut::new();
    read_until(&mut body, &mut head, PREFIX, deadline).await?;
    if head.len() < PREFIX {
        // No message at all: tonic answers that.
        return Ok((Replay::new(head, body), permit));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > message_max {
        return Err((
            Status::out_of_range(format!(
                "message of {len} bytes; this service takes at most {message_max}"
            )),
            "too_large",
        ));
    }
    let units = (PREFIX + len).div_ceil(UNIT).max(head.len().div_ceil(UNIT));
    if units > FRAME_UNITS {
        permit.merge(budget.take(units - FRAME_UNITS, wait_until).await?);
    } else {
        // Give back what a small message does not need.
        drop(permit.split(FRAME_UNITS - units));
    }
    head.reserve((PREFIX + len).saturating_sub(head.len()));
    read_until(&mut body, &mut head, PREFIX + len, deadline).await?;
    if head.len() < PREFIX + len {
        // The body ended early: tonic answers that.
        return Ok((Replay::new(head, body), permit));
    }
    if head.len() > PREFIX + len {
        // The frame that completed the message carries the start of another one.
        return Err(second_message());
    }
    // What the message decodes to (uncompressed messages of allot's own methods): the
    // call holds that much of the budget, not only its wire bytes.
    let decoded = match (cost.schema, head[0]) {
        (Some(schema), 0) => match schema.bound(cost.path, &head[PREFIX..]) {
            Some(Ok(bytes)) => bytes,
            Some(Err(Malformed)) => {
                return Err((
                    Status::invalid_argument("the message is not valid protobuf"),
                    "malformed",
                ))
            }
            None => 0,
        },
        _ => 0,
    };
    let decoded_units = decoded.div_ceil(UNIT);
    if decoded_units > permit.num_permits() {
        if decoded_units > budget.total_units {
            return Err((
                Status::out_of_range(format!(
                    "a message of {len} bytes that decodes to ~{decoded} bytes; this node \
                     decodes at most {} at once",
                    budget.total_units * UNIT
                )),
                "decodes_too_large",
            ));
        }
        let more = decoded_units - permit.num_permits();
        permit.merge(budget.take(more, wait_until).await?);
    }
    Ok((Replay::new(head, body), permit))
}

fn second_message() -> Refusal {
    (
        Status::invalid_argument("a call of this method carries exactly one message"),
        "second_message",
    )
}

/// An HTTP/2 DATA frame's largest size (the protocol's default `SETTINGS_MAX_FRAME_SIZE`,
/// which the server keeps), in budget units.
const FRAME_UNITS: usize = 16;

impl Budget {
    /// Holds `bytes` of the budget (whole KiB, at most all of it) until the permit is
    /// dropped; waits until `until` for them. A refusal is counted (`node_busy`).
    pub async fn hold(
        &self,
        bytes: usize,
        until: tokio::time::Instant,
    ) -> Result<OwnedSemaphorePermit, ()> {
        let units = bytes.div_ceil(UNIT).clamp(1, self.total_units);
        self.take(units, until)
            .await
            .map_err(|(_, reason)| self.refused(reason))
    }

    async fn take(
        &self,
        units: usize,
        until: tokio::time::Instant,
    ) -> Result<OwnedSemaphorePermit, Refusal> {
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        match tokio::time::timeout_at(until, self.permits.clone().acquire_many_owned(units)).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err((busy(self.name), "node_busy")),
        }
    }
}

/// Reads frames into `buf` until it holds `want` bytes or the body ends.
async fn read_until(
    body: &mut Body,
    buf: &mut BytesMut,
    want: usize,
    deadline: tokio::time::Instant,
) -> Result<(), Refusal> {
    while buf.len() < want {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err((
                    Status::deadline_exceeded(format!(
                        "the request's message did not arrive within {BODY_READ_MAX:?}"
                    )),
                    "slow_body",
                ))
            }
            Ok(None) => return Ok(()),
            Ok(Some(Err(s))) => return Err((s, "body_error")),
            Ok(Some(Ok(f))) => f,
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
        }
        // Request trailers are not part of gRPC; a frame that is not data is dropped.
    }
    Ok(())
}

pub(crate) fn busy(class: &str) -> Status {
    let mut s = crate::edge::with_reason(
        Status::resource_exhausted(format!(
            "node busy: its {class} calls in progress hold their whole byte budget; retry"
        )),
        "NODE_BUSY",
    );
    if let Ok(v) = MetadataValue::try_from(BUSY_RETRY_AFTER_MS.to_string()) {
        s.metadata_mut().insert(meta::RETRY_AFTER_MS, v);
    }
    s
}

/// What a refused-as-busy caller is told to wait before retrying.
const BUSY_RETRY_AFTER_MS: u64 = 100;

/// A body that yields the bytes already read, then what [`Rest`] lets through of the
/// rest of the caller's body.
struct Replay {
    head: Option<Bytes>,
    body: Body,
    rest: Rest,
}

/// What a call may send after its first message.
enum Rest {
    /// Nothing: a data frame that is not empty ends the call with `INVALID_ARGUMENT`
    /// (tonic would otherwise decode, hold and drop every further message of a unary
    /// call, none of them admitted).
    Refused,
    /// A client stream: anything, while the stream's slot is held and until `until`.
    Stream {
        /// The stream's end of life (polled, so an idle stream is ended too).
        until: Pin<Box<tokio::time::Sleep>>,
    },
}

/// A client stream's response body: ended with `DEADLINE_EXCEEDED` at the stream's end
/// of life, and holding the stream's slot until it is dropped (the HTTP/2 stream ends).
struct Bounded {
    inner: Body,
    until: Pin<Box<tokio::time::Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl http_body::Body for Bounded {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.until.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(lifetime_over())));
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }
}

fn lifetime_over() -> Status {
    Status::deadline_exceeded(format!(
        "a client stream stays open at most {CLIENT_STREAM_LIFE_MAX:?}"
    ))
}

impl Replay {
    fn new(head: BytesMut, body: Body) -> Replay {
        Replay {
            head: (!head.is_empty()).then(|| head.freeze()),
            body,
            rest: Rest::Refused,
        }
    }
}

impl http_body::Body for Replay {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Rest::Stream { until } = &mut self.rest {
            if until.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Some(Err(lifetime_over())));
            }
        }
        let frame = std::task::ready!(Pin::new(&mut self.body).poll_frame(cx));
        if let (Rest::Refused, Some(Ok(f))) = (&self.rest, &frame) {
            if f.data_ref().is_some_and(|d| !d.is_empty()) {
                return Poll::Ready(Some(Err(second_message().0)));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.body.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gRPC message of `len` bytes (prefix and payload) as a request body.
    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend((0..len).map(|i| i as u8));
        m
    }

    fn body(bytes: Vec<u8>) -> Body {
        Body::new(http_body_util::Full::new(Bytes::from(bytes)))
    }

    /// Admission by wire bytes only (the messages here are not protobuf).
    fn raw() -> Cost<'static> {
        Cost {
            message_max: 1 << 20,
            path: "",
            schema: None,
        }
    }

    async fn read_all(b: Replay) -> Vec<u8> {
        b.collect().await.unwrap().to_bytes().to_vec()
    }

    #[tokio::test]
    async fn a_message_is_handed_on_whole_and_holds_its_bytes_until_then() {
        let budget = Budget::new("test", 1 << 20);
        let full = budget.available_kib();
        for len in [0, 1, 100, 16 << 10, 300 << 10] {
            let m = message(len);
            let (b, permit) = admit(&budget, body(m.clone()), &raw()).await.unwrap();
            assert_eq!(
                permit.num_permits(),
                (PREFIX + len).div_ceil(UNIT).max(1),
                "a {len}-byte message holds its KiB"
            );
            assert_eq!(budget.available_kib(), full - permit.num_permits());
            drop(permit);
            assert_eq!(budget.available_kib(), full, "released with the call");
            assert_eq!(
                read_all(b).await,
                m,
                "the handler reads exactly what was sent"
            );
        }
        // No message at all: handed on for tonic to answer.
        let (b, _) = admit(&budget, body(vec![0, 0]), &raw()).await.unwrap();
        assert_eq!(read_all(b).await, vec![0, 0]);
    }

    #[tokio::test]
    async fn a_message_over_the_bound_is_refused_from_its_prefix() {
        let budget = Budget::new("test", 1 << 20);
        // Only the prefix is sent: the refusal must not wait for the rest.
        let mut m = message(0);
        m[1..5].copy_from_slice(&(4_000_000u32).to_be_bytes());
        let Err((s, reason)) = admit(&budget, body(m), &raw()).await else {
            panic!("a 4 MB message passed a 1 MiB bound");
        };
        assert_eq!((s.code(), reason), (tonic::Code::OutOfRange, "too_large"));
        assert_eq!(budget.available_kib(), 1024, "nothing held");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_cannot_get_its_bytes_is_told_the_node_is_busy() {
        let budget = Budget::new("test", 64 << 10);
        let (_b, held) = admit(&budget, body(message(60 << 10)), &raw())
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let Err((s, reason)) = admit(&budget, body(message(10 << 10)), &raw()).await else {
            panic!("admitted past the budget");
        };
        assert_eq!(
            (s.code(), reason),
            (tonic::Code::ResourceExhausted, "node_busy")
        );
        assert_eq!(
            s.metadata().get("allot-reason").unwrap().to_str().unwrap(),
            "NODE_BUSY"
        );
        assert!(s.metadata().get(meta::RETRY_AFTER_MS).is_some());
        assert_eq!(
            started.elapsed(),
            ADMISSION_WAIT_MAX,
            "after the wait bound"
        );
        // Once the first call is answered, the next one gets in.
        drop(held);
        let (_b, _held) = admit(&budget, body(message(10 << 10)), &raw())
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_arrives_is_given_up_after_the_read_bound() {
        let budget = Budget::new("test", 1 << 20);
        // The prefix promises 1 KiB; the body then stalls forever.
        let mut prefix = message(0);
        prefix[1..5].copy_from_slice(&1024u32.to_be_bytes());
        let stalled = futures::StreamExt::chain(
            futures::stream::iter([Ok::<_, Status>(Frame::data(Bytes::from(prefix)))]),
            futures::stream::pending(),
        );
        let b = Body::new(http_body_util::StreamBody::new(stalled));
        let Err((s, reason)) = admit(&budget, b, &raw()).await else {
            panic!("a stalled body was admitted");
        };
        assert_eq!(
            (s.code(), reason),
            (tonic::Code::DeadlineExceeded, "slow_body")
        );
        assert_eq!(budget.available_kib(), 1024, "its bytes are free again");
    }

    /// A gRPC frame of an encoded protobuf message.
    fn grpc(msg: &impl prost::Message) -> Vec<u8> {
        let b = msg.encode_to_vec();
        let mut m = vec![0u8];
        m.extend_from_slice(&(b.len() as u32).to_be_bytes());
        m.extend_from_slice(&b);
        m
    }

    fn execute() -> Cost<'static> {
        Cost {
            message_max: 1 << 20,
            path: "/allot.api.v1.Api/Execute",
            schema: Some(Schema::allot()),
        }
    }

    #[tokio::test]
    async fn a_message_is_charged_what_it_decodes_to_before_it_is_decoded() {
        use allot_proto::api::v1 as pb;
        let budget = Budget::new("test", 64 << 20);
        let full = budget.available_kib();
        // 1 MiB of empty commands decodes to hundreds of MB: refused from its bytes,
        // without waiting for budget it could never get.
        let flood = pb::ExecuteRequest {
            shard: None,
            commands: vec![pb::Command::default(); 524_288],
        };
        let Err((s, reason)) = admit(&budget, body(grpc(&flood)), &execute()).await else {
            panic!("1 MiB of empty commands was admitted");
        };
        assert_eq!(
            (s.code(), reason),
            (tonic::Code::OutOfRange, "decodes_too_large")
        );
        assert_eq!(budget.available_kib(), full, "nothing held");
        // A smaller one that fits the budget holds what it decodes to, not its wire size.
        let some = pb::ExecuteRequest {
            shard: None,
            commands: vec![pb::Command::default(); 4096],
        };
        let m = grpc(&some);
        let (_b, permit) = admit(&budget, body(m.clone()), &execute()).await.unwrap();
        let decoded = 4096 * std::mem::size_of::<pb::Command>();
        assert!(
            permit.num_permits() * UNIT >= decoded,
            "holds {} KiB for {decoded} decoded bytes",
            permit.num_permits()
        );
        assert!(m.len() < 10 << 10, "while its wire size is {}", m.len());
        // Not protobuf at all: refused before tonic sees it.
        let Err((s, reason)) = admit(&budget, body(message(3)), &execute()).await else {
            panic!("garbage admitted");
        };
        assert_eq!(
            (s.code(), reason),
            (tonic::Code::InvalidArgument, "malformed")
        );
    }

    #[tokio::test]
    async fn a_second_message_in_a_one_message_call_is_refused() {
        let budget = Budget::new("test", 1 << 20);
        // In the same frame as the first: refused while admitting.
        let mut two = message(10);
        two.extend(message(10));
        let Err((s, reason)) = admit(&budget, body(two), &raw()).await else {
            panic!("two messages admitted");
        };
        assert_eq!(
            (s.code(), reason),
            (tonic::Code::InvalidArgument, "second_message")
        );
        // In a later frame: the handler's body ends with the refusal instead of it.
        let frames = futures::stream::iter([
            Ok::<_, Status>(Frame::data(Bytes::from(message(10)))),
            Ok(Frame::data(Bytes::from(message(1 << 19)))),
        ]);
        let b = Body::new(http_body_util::StreamBody::new(frames));
        let (mut replay, _p) = admit(&budget, b, &raw()).await.unwrap();
        let first = replay.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap().len(), PREFIX + 10);
        let second = replay.frame().await.unwrap();
        assert_eq!(
            second.unwrap_err().code(),
            tonic::Code::InvalidArgument,
            "the second message is never handed on"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_stream_holds_a_slot_for_a_bounded_time() {
        let slots = Arc::new(Semaphore::new(1));
        let idle = futures::StreamExt::chain(
            futures::stream::iter([
                Ok::<_, Status>(Frame::data(Bytes::from(message(4)))),
                Ok(Frame::data(Bytes::from(message(4)))),
            ]),
            futures::stream::pending(),
        );
        let mut replay = Replay::new(
            BytesMut::new(),
            Body::new(http_body_util::StreamBody::new(idle)),
        );
        replay.rest = Rest::Stream {
            until: Box::pin(tokio::time::sleep(CLIENT_STREAM_LIFE_MAX)),
        };
        // The responses: none yet (a handler stalled because its caller reads none).
        let stalled = futures::stream::pending::<Result<Frame<Bytes>, Status>>();
        let mut responses = Bounded {
            inner: Body::new(http_body_util::StreamBody::new(stalled)),
            until: Box::pin(tokio::time::sleep(CLIENT_STREAM_LIFE_MAX)),
            _slot: slots.clone().try_acquire_owned().unwrap(),
        };
        // A stream may carry several messages.
        for _ in 0..2 {
            assert!(replay.frame().await.unwrap().is_ok());
        }
        assert_eq!(slots.available_permits(), 0, "the slot is held");
        let started = tokio::time::Instant::now();
        let end = replay.frame().await.unwrap();
        assert_eq!(end.unwrap_err().code(), tonic::Code::DeadlineExceeded);
        assert_eq!(
            started.elapsed(),
            CLIENT_STREAM_LIFE_MAX,
            "an idle stream is ended"
        );
        // The response side ends at the same instant, however stalled.
        let end = responses.frame().await.unwrap();
        assert_eq!(end.unwrap_err().code(), tonic::Code::DeadlineExceeded);
        assert_eq!(started.elapsed(), CLIENT_STREAM_LIFE_MAX);
        drop(replay);
        assert_eq!(slots.available_permits(), 0, "the responses hold the slot");
        drop(responses);
        assert_eq!(slots.available_permits(), 1, "freed with them");
    }
}
