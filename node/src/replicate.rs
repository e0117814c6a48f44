//! One replication stream per node pair (DESIGN §51).
//!
//! Every shard is its own Raft group, and openraft replicates each group to each
//! follower on its own: one AppendEntries call at a time per group and follower. A node
//! that leads several shards therefore sent each follower several calls at once, each
//! paying its own HTTP/2 stream, headers, tasks and wake-ups on both sides. A
//! [`PeerStream`] is the one sender of AppendEntries from this node to one peer address:
//! a group's call waits in its queue while a batch is in flight, and the calls that
//! gathered go together as one `Raft.AppendMany` call when the slot frees. The peer
//! handles the messages at once and streams each answer back as soon as it is ready, so
//! one slow shard (say, one installing a snapshot) holds back no other shard's answer.
//!
//! - **No added wait when idle**: a call that finds the slot free goes at once (after
//!   one yield, so calls woken together leave together); alone it is sent as a plain
//!   `Raft.Append`, the same bytes as before this stream existed.
//! - **Bounded hold**: a batch keeps the slot until its last answer or
//!   [`HOLD_MAX`], whichever comes first; after that the next batch goes even though
//!   the slow one is still out, so a stuck shard delays the others by at most this.
//! - **Each call keeps its own deadline**: a caller stops waiting at its own timeout;
//!   a call whose caller gave up is dropped before it is sent.
//! - **A batch is what the peer accepts**: each shard at most once, and the messages'
//!   bytes within [`RAFT_MESSAGE_MAX`] (a larger set waits for the next batch).
//! - **Older peers** (without `AppendMany`): found by an empty probe batch before the
//!   first real one; such a peer gets each message as a plain `Append`, and is probed
//!   again after [`REPROBE_AFTER`] (it may have been upgraded).

use crate::limits::RAFT_MESSAGE_MAX;
use allot_proto::{RaftBatch, RaftMessage, RaftReply};
use futures::{Stream, StreamExt};
use prost::Message;
use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Code, Status};

/// A batch's answers as the peer streams them.
pub type Replies = Pin<Box<dyn Stream<Item = Result<RaftReply, Status>> + Send>>;

/// How a stream reaches its peer: gRPC in the node ([`crate::network`]), a fake in the
/// tests.
pub trait Link: Send + Sync + 'static {
    /// One message as a plain `Raft.Append`.
    fn one(
        &self,
        msg: RaftMessage,
        timeout: Duration,
    ) -> impl Future<Output = Result<RaftMessage, Status>> + Send;
    /// Several messages as one `Raft.AppendMany`.
    fn many(
        &self,
        batch: RaftBatch,
        timeout: Duration,
    ) -> impl Future<Output = Result<Replies, Status>> + Send;
}

/// Batches out to one peer at once (more wait and leave together).
pub const BATCHES_IN_FLIGHT: usize = 1;
/// How long a batch keeps its slot while answers are outstanding (a healthy follower
/// answers in one fsync and a round trip: a few milliseconds).
pub const HOLD_MAX: Duration = Duration::from_millis(10);
/// How long a peer that answered the probe `UNIMPLEMENTED` gets plain `Append`s before
/// it is probed again.
pub const REPROBE_AFTER: Duration = Duration::from_secs(30);
/// The probe's own timeout.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

struct Pending {
    msg: RaftMessage,
    deadline: Instant,
    reply: oneshot::Sender<Result<RaftMessage, Status>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Support {
    Unknown,
    Yes,
    NoUntil(Instant),
}

struct Queue {
    waiting: VecDeque<Pending>,
    /// Batch slots taken (≤ [`BATCHES_IN_FLIGHT`]); a driver task owns each.
    in_flight: usize,
    support: Support,
}

/// The AppendEntries sender to one peer address (see the module's documentation).
pub struct PeerStream<L> {
    link: L,
    queue: Mutex<Queue>,
    /// Called with the number of messages of each call sent (the node's histogram).
    observe: Option<Box<dyn Fn(usize) + Send + Sync>>,
}

impl<L: Link> PeerStream<L> {
    pub fn new(link: L, observe: Option<Box<dyn Fn(usize) + Send + Sync>>) -> Arc<Self> {
        Arc::new(PeerStream {
            link,
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                in_flight: 0,
                support: Support::Unknown,
            }),
            observe,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `msg` (one shard's AppendEntries) with the next batch and waits for its
    /// answer, at most `timeout`.
    pub async fn append(
        self: &Arc<Self>,
        msg: RaftMessage,
        timeout: Duration,
    ) -> Result<RaftMessage, Status> {
        let (tx, rx) = oneshot::channel();
        let deadline = Instant::now() + timeout;
        let start = {
            let mut q = self.lock();
            q.waiting.push_back(Pending {
                msg,
                deadline,
                reply: tx,
            });
            if q.in_flight < BATCHES_IN_FLIGHT {
                q.in_flight += 1;
                true
            } else {
                false
            }
        };
        if start {
            tokio::spawn(self.clone().drive(true));
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Status::unavailable("the peer stream dropped the message")),
            Err(_) => Err(Status::deadline_exceeded(
                "no answer to AppendEntries within its timeout",
            )),
        }
    }

    /// Owns one batch slot: sends what waits, batch after batch, until nothing does.
    /// (Boxed: a driver may start the next one, and a recursive `async fn` has no
    /// nameable `Send` future.)
    fn drive(self: Arc<Self>, gather: bool) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(self.drive_slot(gather))
    }

    async fn drive_slot(self: Arc<Self>, gather: bool) {
        if gather {
            // Calls woken by the same event (one fsync acknowledges every shard) are
            // usually runnable now: let them join before the batch is cut.
            tokio::task::yield_now().await;
        }
        while let Some(batch) = self.take() {
            let send = self.clone().send(batch);
            tokio::pin!(send);
            if tokio::time::timeout(HOLD_MAX, &mut send).await.is_err() {
                // Slow answers: the slot passes to a new driver now; this one only
                // finishes delivering them.
                tokio::spawn(self.clone().drive(false));
                send.await;
                return;
            }
        }
    }

    /// The next batch, or `None` (and the slot given back) when nothing waits.
    fn take(&self) -> Option<Vec<Pending>> {
        let mut q = self.lock();
        let now = Instant::now();
        let mut batch = Vec::new();
        let mut shards = BTreeSet::new();
        let mut bytes = 0usize;
        let mut later = VecDeque::new();
        while let Some(p) = q.waiting.pop_front() {
            if p.reply.is_closed() || p.deadline <= now {
                continue; // its caller stopped waiting
            }
            let len = batch_entry_len(&p.msg);
            if shards.contains(&p.msg.shard) || (!batch.is_empty() && bytes + len > BATCH_BYTES_MAX)
            {
                later.push_back(p);
                continue;
            }
            shards.insert(p.msg.shard);
            bytes += len;
            batch.push(p);
        }
        q.waiting = later;
        if batch.is_empty() {
            q.in_flight -= 1;
            None
        } else {
            Some(batch)
        }
    }

    /// Whether batches go to this peer as `AppendMany`, probing it when unknown.
    async fn batches_supported(&self) -> bool {
        let support = {
            let mut q = self.lock();
            if let Support::NoUntil(t) = q.support {
                if Instant::now() >= t {
                    q.support = Support::Unknown;
                }
            }
            q.support
        };
        match support {
            Support::Yes => true,
            Support::NoUntil(_) => false,
            Support::Unknown => match self.link.many(RaftBatch::default(), PROBE_TIMEOUT).await {
                Ok(_) => {
                    self.lock().support = Support::Yes;
                    true
                }
                Err(s) => {
                    if s.code() == Code::Unimplemented {
                        self.not_supported();
                    }
                    false
                }
            },
        }
    }

    fn not_supported(&self) {
        tracing::info!(
            "peer has no Raft.AppendMany (an older binary): plain Append for {}s",
            REPROBE_AFTER.as_secs()
        );
        self.lock().support = Support::NoUntil(Instant::now() + REPROBE_AFTER);
    }

    async fn send(self: Arc<Self>, batch: Vec<Pending>) {
        if let Some(f) = &self.observe {
            f(batch.len());
        }
        if batch.len() == 1 || !self.batches_supported().await {
            let link = &self.link;
            futures::future::join_all(batch.into_iter().map(|p| async move {
                let left = p.deadline.saturating_duration_since(Instant::now());
                let r = link.one(p.msg, left).await;
                let _ = p.reply.send(r);
            }))
            .await;
            return;
        }
        let deadline = batch.iter().map(|p| p.deadline).max().unwrap_or_else(Instant::now);
        let mut messages = Vec::with_capacity(batch.len());
        let mut slots = Vec::with_capacity(batch.len());
        for p in batch {
            messages.push(p.msg);
            slots.push(Some(p.reply));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let failed = match self.link.many(RaftBatch { messages }, left).await {
            Err(s) => {
                if s.code() == Code::Unimplemented {
                    self.not_supported();
                }
                s
            }
            Ok(mut replies) => loop {
                match replies.next().await {
                    Some(Ok(r)) => {
                        // An index out of range or answered twice is ignored: the
                        // message it would name gets "no answer" below.
                        let slot = usize::try_from(r.index)
                            .ok()
                            .and_then(|i| slots.get_mut(i))
                            .and_then(Option::take);
                        if let Some(tx) = slot {
                            let _ = tx.send(reply_of(r));
                        }
                    }
                    Some(Err(s)) => break s,
                    None => break Status::unavailable("the peer did not answer this message"),
                }
            },
        };
        for tx in slots.into_iter().flatten() {
            let _ = tx.send(Err(failed.clone()));
        }
    }
}

/// A batch's bytes on the wire, at most (a little under the peer's message bound, for
/// the batch's own framing).
const BATCH_BYTES_MAX: usize = RAFT_MESSAGE_MAX - 1024;

/// One message's bytes inside a `RaftBatch` (its field tag and length prefix included).
fn batch_entry_len(m: &RaftMessage) -> usize {
    let n = m.encoded_len();
    1 + prost::length_delimiter_len(n) + n
}

/// A reply of `AppendMany` as `Append` would have answered it.
pub fn reply_of(r: RaftReply) -> Result<RaftMessage, Status> {
    if r.code == 0 {
        return Ok(RaftMessage {
            shard: 0,
            payload: r.payload,
        });
    }
    let status = Status::new(Code::from(r.code), r.message);
    Err(if r.reason.is_empty() {
        status
    } else {
        crate::edge::with_reason(status, &r.reason)
    })
}

/// `Append`'s answer to message `index` of a batch, as an `AppendMany` reply.
pub fn reply_to(index: usize, r: Result<RaftMessage, Status>) -> RaftReply {
    let index = u32::try_from(index).unwrap_or(u32::MAX);
    match r {
        Ok(m) => RaftReply {
            index,
            payload: m.payload,
            ..RaftReply::default()
        },
        Err(s) => RaftReply {
            index,
            payload: Vec::new(),
            code: s.code() as i32,
            message: s.message().to_string(),
            reason: s
                .metadata()
                .get(allot_proto::meta::REASON)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A peer in memory: answers each message with its own payload reversed after the
    /// delay its shard is given; records every call.
    #[derive(Clone, Default)]
    struct Fake {
        calls: Arc<Mutex<Vec<Vec<u32>>>>,
        slow_shard: Option<(u32, Duration)>,
        old: bool,
        probes: Arc<AtomicUsize>,
        gate: Option<Arc<tokio::sync::Notify>>,
    }

    impl Fake {
        async fn answer(&self, m: RaftMessage) -> Result<RaftMessage, Status> {
            if let Some((s, d)) = self.slow_shard {
                if s == m.shard {
                    tokio::time::sleep(d).await;
                }
            }
            if m.shard == 99 {
                return Err(crate::edge::with_reason(
                    Status::not_found("unknown shard 99"),
                    "UNKNOWN_SHARD",
                ));
            }
            let mut p = m.payload;
            p.reverse();
            Ok(RaftMessage {
                shard: 0,
                payload: p,
            })
        }
        fn calls(&self) -> Vec<Vec<u32>> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl Link for Fake {
        async fn one(&self, msg: RaftMessage, _t: Duration) -> Result<RaftMessage, Status> {
            self.calls.lock().unwrap().push(vec![msg.shard]);
            if let Some(g) = &self.gate {
                g.notified().await;
            }
            self.answer(msg).await
        }
        async fn many(&self, batch: RaftBatch, _t: Duration) -> Result<Replies, Status> {
            if batch.messages.is_empty() {
                self.probes.fetch_add(1, Ordering::SeqCst);
            } else {
                self.calls
                    .lock()
                    .unwrap()
                    .push(batch.messages.iter().map(|m| m.shard).collect());
            }
            if self.old {
                return Err(Status::unimplemented("AppendMany"));
            }
            let me = self.clone();
            let answers: futures::stream::FuturesUnordered<_> = batch
                .messages
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    let me = me.clone();
                    async move { Ok(reply_to(i, me.answer(m).await)) }
                })
                .collect();
            Ok(Box::pin(answers))
        }
    }

    fn msg(shard: u32, payload: &[u8]) -> RaftMessage {
        RaftMessage {
            shard,
            payload: payload.to_vec(),
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn alone_a_message_goes_at_once_as_a_plain_append() {
        let fake = Fake::default();
        let s = PeerStream::new(fake.clone(), None);
        let r = s.append(msg(3, b"ab"), T).await.unwrap();
        assert_eq!(r.payload, b"ba");
        assert_eq!(fake.calls(), vec![vec![3]]);
        assert_eq!(fake.probes.load(Ordering::SeqCst), 0, "no probe for one message");
    }

    #[tokio::test(start_paused = true)]
    async fn messages_waiting_behind_a_batch_leave_together_and_get_their_own_answers() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let fake = Fake {
            gate: Some(gate.clone()),
            ..Fake::default()
        };
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let s = PeerStream::new(
            fake.clone(),
            Some(Box::new(move |n| seen.lock().unwrap().push(n))),
        );
        // The first goes alone and is held at the peer; three more arrive meanwhile.
        let first = tokio::spawn({
            let s = s.clone();
            async move { s.append(msg(0, b"0"), T).await }
        });
        while fake.calls().is_empty() {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = (1..4u32)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move { s.append(msg(i, &[b'a', i as u8]), T).await })
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(fake.calls().len(), 1, "the others wait for the slot");
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap().payload, b"0");
        for (i, h) in (1..4u32).zip(rest) {
            assert_eq!(h.await.unwrap().unwrap().payload, vec![i as u8, b'a']);
        }
        assert_eq!(fake.calls(), vec![vec![0], vec![1, 2, 3]]);
        assert_eq!(*sizes.lock().unwrap(), vec![1, 3]);
        assert_eq!(fake.probes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shard_appears_once_per_batch_and_errors_keep_their_reason() {
        let fake = Fake::default();
        let s = PeerStream::new(fake.clone(), None);
        // Queue up while no driver can run (they are all spawned before any runs).
        let hs: Vec<_> = [(5u32, b"x"), (5, b"y"), (99, b"z"), (6, b"w")]
            .into_iter()
            .map(|(sh, p)| {
                let s = s.clone();
                tokio::spawn(async move { s.append(msg(sh, p), T).await })
            })
            .collect();
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        assert_eq!(out[0].as_ref().unwrap().payload, b"x");
        assert_eq!(out[1].as_ref().unwrap().payload, b"y");
        let e = out[2].as_ref().unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        assert_eq!(
            e.metadata().get(allot_proto::meta::REASON).unwrap(),
            "UNKNOWN_SHARD"
        );
        for call in fake.calls() {
            let distinct: BTreeSet<_> = call.iter().collect();
            assert_eq!(distinct.len(), call.len(), "shard twice in {call:?}");
        }
        assert!(fake.calls().iter().any(|c| c.len() > 1), "{:?}", fake.calls());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_shard_holds_the_slot_no_longer_than_hold_max() {
        let fake = Fake {
            slow_shard: Some((1, Duration::from_secs(3))),
            ..Fake::default()
        };
        let s = PeerStream::new(fake.clone(), None);
        let started = Instant::now();
        let slow = {
            let s = s.clone();
            tokio::spawn(async move { s.append(msg(1, b"s"), T).await })
        };
        let other = {
            let s = s.clone();
            tokio::spawn(async move { s.append(msg(2, b"o"), T).await })
        };
        assert_eq!(other.await.unwrap().unwrap().payload, b"o");
        // Shard 2 was in the slow batch: its answer is streamed at once.
        assert!(started.elapsed() < HOLD_MAX, "{:?}", started.elapsed());
        // The next message goes after HOLD_MAX, not after the slow answer.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1) {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        let next = s.append(msg(2, b"n"), T).await.unwrap();
        assert_eq!(next.payload, b"n");
        assert!(
            started.elapsed() <= HOLD_MAX + Duration::from_millis(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(slow.await.unwrap().unwrap().payload, b"s");
        assert!(started.elapsed() >= Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn an_older_peer_gets_plain_appends_and_is_probed_again_later() {
        let fake = Fake {
            old: true,
            ..Fake::default()
        };
        let s = PeerStream::new(fake.clone(), None);
        let round = |s: Arc<PeerStream<Fake>>| async move {
            let hs: Vec<_> = (0..3u32)
                .map(|i| {
                    let s = s.clone();
                    tokio::spawn(async move { s.append(msg(i, b"p"), T).await })
                })
                .collect();
            for h in hs {
                assert_eq!(h.await.unwrap().unwrap().payload, b"p");
            }
        };
        round(s.clone()).await;
        assert_eq!(fake.probes.load(Ordering::SeqCst), 1);
        assert!(fake.calls().iter().all(|c| c.len() == 1), "{:?}", fake.calls());
        round(s.clone()).await;
        assert_eq!(fake.probes.load(Ordering::SeqCst), 1, "not probed again yet");
        tokio::time::sleep(REPROBE_AFTER).await;
        round(s.clone()).await;
        assert_eq!(fake.probes.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_stops_waiting_at_its_own_timeout() {
        let fake = Fake {
            slow_shard: Some((1, Duration::from_secs(60))),
            ..Fake::default()
        };
        let s = PeerStream::new(fake.clone(), None);
        let e = s
            .append(msg(1, b"s"), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
    }

    #[test]
    fn replies_round_trip_codes_and_reasons() {
        let ok = reply_of(reply_to(
            7,
            Ok(RaftMessage {
                shard: 0,
                payload: b"p".to_vec(),
            }),
        ))
        .unwrap();
        assert_eq!(ok.payload, b"p");
        let err = reply_of(reply_to(
            1,
            Err(crate::edge::with_reason(
                Status::invalid_argument("bad"),
                "PEER_MESSAGE_REFUSED",
            )),
        ))
        .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(err.message(), "bad");
        assert_eq!(
            err.metadata().get(allot_proto::meta::REASON).unwrap(),
            "PEER_MESSAGE_REFUSED"
        );
        // A peer's unknown code is still an error.
        let odd = RaftReply {
            index: 0,
            code: 1234,
            ..RaftReply::default()
        };
        assert!(reply_of(odd).is_err());
    }
}
