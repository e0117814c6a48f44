//! The per-shard batching proposer.
//!
//! openraft 0.9 waits for the log flush of every entry, so a shard that proposed one
//! command per entry would be bounded by fsync latency. Every client request goes
//! through this task instead: it gathers whatever is waiting (up to `max_batch`
//! requests, optionally waiting `window` for more), stamps the batch with the logical
//! time (see [`crate::clock`]), hands it to openraft in order, and keeps up to
//! `max_inflight` entries in the pipeline. Each caller gets its own outcomes back.
//! When the shard is idle it proposes an empty batch (a tick) every `tick`, so expiry,
//! leases and decay keep working with no traffic.

use crate::clock::{ClusterClock, Stamper};
use crate::metrics::Metrics;
use crate::store::{ShardView, Timeline};
use crate::types::{Applied, Batch, NodeId, Raft, ShardId, TypeConfig};
use allot_statemachine::{Outcome, Request};
use openraft::error::{ClientWriteError, ForwardToLeader, RaftError};
use openraft::raft::ClientWriteResponse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};

#[derive(Clone, Copy, Debug)]
pub struct ProposerConfig {
    /// Most requests in one log entry (≤ the state machine's COMMANDS_PER_ENTRY_MAX).
    pub max_batch: usize,
    /// Most encoded request bytes in one log entry (a single larger call goes alone).
    pub max_batch_bytes: usize,
    /// How long to wait for more requests once one arrived (zero: take what is queued).
    pub window: Duration,
    /// Entries proposed but not yet applied.
    pub max_inflight: usize,
    /// Requests waiting to be batched; beyond it callers are told to back off.
    pub queue: usize,
    /// Idle interval after which a tick entry is proposed.
    pub tick: Duration,
    /// Slew bound of logical time, parts per million of elapsed time.
    pub slew_ppm: u64,
    /// Proposals slower than this end to end are logged with their stage times.
    pub slow: Option<Duration>,
}

impl Default for ProposerConfig {
    fn default() -> Self {
        ProposerConfig {
            max_batch: 2048,
            max_batch_bytes: crate::limits::BATCH_BYTES_MAX,
            window: Duration::ZERO,
            max_inflight: 8,
            queue: 65_536,
            tick: Duration::from_millis(1000),
            slew_ppm: 500,
            slow: Some(Duration::from_secs(1)),
        }
    }
}

/// Why a proposal did not produce outcomes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("not the leader of this shard (leader: {leader:?} at {addr:?})")]
    NotLeader {
        leader: Option<NodeId>,
        addr: Option<String>,
    },
    #[error("the shard's proposal queue is full; retry later")]
    Overloaded,
    #[error("raft: {0}")]
    Raft(String),
    #[error("the node is shutting down")]
    ShuttingDown,
    /// openraft refused the operation (e.g. a membership change already in progress).
    #[error("refused: {0}")]
    Rejected(String),
    /// A new shard's first stamp waits for a majority of the cluster's clocks.
    #[error("waiting for a majority of the cluster's clocks to stamp the first entry")]
    ClockNotReady,
    /// A linearizable read's leadership check did not hear from a quorum in time (a
    /// loaded or cut-off leader): transient, retried.
    #[error("the leader could not confirm its leadership with a quorum: {0}")]
    NoQuorum(String),
}

/// The outcomes of one caller's requests and where they were applied.
#[derive(Clone, Debug)]
pub struct Committed {
    pub outcomes: Vec<Outcome>,
    pub log_index: u64,
    pub logical_time_ms: u64,
}

struct Pending {
    requests: Vec<Request>,
    /// The requests' encoded size (what they add to the entry).
    bytes: usize,
    reply: oneshot::Sender<Result<Committed, ProposeError>>,
    enqueued: Instant,
    /// Its share of the queue's byte bound, returned when the proposer takes it.
    _queued: tokio::sync::OwnedSemaphorePermit,
}

#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    /// Encoded bytes the queue may still take (`PROPOSER_QUEUE_BYTES_MAX`).
    queued: Arc<Semaphore>,
}

impl Proposer {
    pub async fn propose(&self, requests: Vec<Request>) -> Result<Committed, ProposeError> {
        let (reply, rx) = oneshot::channel();
        let bytes: usize = requests
            .iter()
            .map(|r| allot_statemachine::codec::encoded_len(r) as usize)
            .sum();
        let share = bytes.clamp(1, crate::limits::PROPOSER_QUEUE_BYTES_MAX) as u32;
        let queued = self
            .queued
            .clone()
            .try_acquire_many_owned(share)
            .map_err(|_| ProposeError::Overloaded)?;
        self.tx
            .try_send(Pending {
                requests,
                bytes,
                reply,
                enqueued: Instant::now(),
                _queued: queued,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ProposeError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => ProposeError::ShuttingDown,
            })?;
        rx.await.map_err(|_| ProposeError::ShuttingDown)?
    }
}

pub struct ProposerTask {
    /// Set while the leadership is being handed over (`crate::transfer`).
    pub pause: Arc<crate::transfer::Pause>,
    pub shard: ShardId,
    pub me: NodeId,
    pub raft: Raft,
    pub view: ShardView,
    pub clock: Arc<ClusterClock>,
    /// The shard's local stage instants, to split a proposal's commit time into stages.
    pub timeline: Arc<Timeline>,
    pub config: ProposerConfig,
    pub metrics: Arc<Metrics>,
}

/// A committed proposal's time split into the stages of the leader's timeline (see
/// [`Timeline`]): `append` (until RaftCore wrote the entry), `replicate` (from that write
/// until the entry was committed — a quorum's fsyncs and acknowledgements, the leader's
/// own fsync among them only when it waits for it, `--leader-flush-overlap off` — and
/// handed to apply) and `apply`; a stage whose instants were not recorded (the slot was
/// reused) is left out. The leader's `local_flush` runs beside `replicate`, not before
/// it, and is observed by the sync thread (`Timeline::observe_flushes`).
fn commit_stages(
    proposed: Instant,
    answered: Instant,
    t: Option<crate::store::timeline::EntryStages>,
) -> Vec<(&'static str, Duration)> {
    let Some(t) = t else {
        return Vec::new();
    };
    let marks = [
        ("append", Some(proposed), t.appended),
        ("replicate", t.appended, t.applying),
        ("apply", t.applying, Some(answered)),
    ];
    marks
        .into_iter()
        .filter_map(|(name, from, to)| Some((name, to?.saturating_duration_since(from?))))
        .collect()
}

/// The leader of a shard as this node sees it.
pub fn leader_of(raft: &Raft) -> (Option<NodeId>, Option<String>, u64) {
    let m = raft.metrics().borrow().clone();
    let addr = m.current_leader.and_then(|l| {
        m.membership_config
            .membership()
            .get_node(&l)
            .map(|n| n.addr.clone())
    });
    (m.current_leader, addr, m.current_term)
}

/// The error of a linearizable read's leadership check (`Raft::ensure_linearizable`): a
/// quorum that did not answer in time is transient (`NoQuorum`, retried), not a refusal.
pub fn from_read_error(
    raft: &Raft,
    e: RaftError<NodeId, openraft::error::CheckIsLeaderError<NodeId, openraft::BasicNode>>,
) -> ProposeError {
    no_quorum(&e).unwrap_or_else(|| from_raft_error(raft, e))
}

/// [`ProposeError::NoQuorum`] for a leadership check that did not hear from a quorum.
fn no_quorum(
    e: &RaftError<NodeId, openraft::error::CheckIsLeaderError<NodeId, openraft::BasicNode>>,
) -> Option<ProposeError> {
    match e {
        RaftError::APIError(openraft::error::CheckIsLeaderError::QuorumNotEnough(q)) => {
            Some(ProposeError::NoQuorum(q.to_string()))
        }
        _ => None,
    }
}

/// "Not the leader", naming the leader this replica knows of.
pub(crate) fn not_leader(raft: &Raft) -> ProposeError {
    let (leader, addr, _) = leader_of(raft);
    ProposeError::NotLeader { leader, addr }
}

impl ProposerTask {
    pub fn spawn(self) -> Proposer {
        let (tx, rx) = mpsc::channel(self.config.queue);
        tokio::spawn(self.run(rx));
        Proposer {
            tx,
            queued: Arc::new(Semaphore::new(crate::limits::PROPOSER_QUEUE_BYTES_MAX)),
        }
    }

    async fn run(self, mut rx: mpsc::Receiver<Pending>) {
        let mut stamper = Stamper::new(self.config.slew_ppm);
        // When a slow proposal was last logged (ms since the task started): at most one
        // log line per second per shard, so an overloaded shard does not flood its log.
        let started = Instant::now();
        let slow_logged = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        let inflight = Arc::new(Semaphore::new(self.config.max_inflight.max(1)));
        let mut last_proposal = Instant::now();
        let mut carry: Option<Pending> = None;
        let mut ticker = tokio::time::interval(self.config.tick.max(Duration::from_millis(10)) / 2);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let first = match carry.take() {
                Some(p) => Some(p),
                None => tokio::select! {
                    p = rx.recv() => match p {
                        Some(p) => Some(p),
                        None => return,
                    },
                    _ = ticker.tick() => None,
                },
            };
            let mut group = Vec::new();
            let mut count = 0usize;
            let mut bytes = 0usize;
            let (max_count, max_bytes) = (self.config.max_batch, self.config.max_batch_bytes);
            if let Some(p) = first {
                count += p.requests.len();
                bytes += p.bytes;
                group.push(p);
                if !self.config.window.is_zero() && count < max_count {
                    tokio::time::sleep(self.config.window).await;
                }
                // A batch closes by count or by bytes, whichever comes first; a call
                // that does not fit starts the next batch.
                while count < max_count && bytes < max_bytes {
                    match rx.try_recv() {
                        Ok(p) => {
                            if count + p.requests.len() > max_count || bytes + p.bytes > max_bytes {
                                carry = Some(p);
                                break;
                            }
                            count += p.requests.len();
                            bytes += p.bytes;
                            group.push(p);
                        }
                        Err(_) => break,
                    }
                }
            } else if last_proposal.elapsed() < self.config.tick {
                continue;
            }
            // A call whose caller stopped waiting (its deadline, a cancel) is not
            // proposed: the caller retries with the same request ids, or not at all.
            let before = group.len();
            group.retain(|p| !p.reply.is_closed());
            if before > 0 && group.is_empty() {
                continue;
            }
            count = group.iter().map(|p| p.requests.len()).sum();
            bytes = group.iter().map(|p| p.bytes).sum();
            let Ok(permit) = inflight.clone().acquire_owned().await else {
                return;
            };
            // Every replica notes the applied time as it goes (a new leader continues
            // from it: `Stamper::observe`); the leader stamps from the same reading.
            let applied_ms = self.view.read().state.time_ms;
            let (target, live_term) = {
                let m = self.raft.metrics().borrow().clone();
                let nodes: Vec<NodeId> = m.membership_config.membership().voter_ids().collect();
                // Time applied live, under a leader of the current term this node
                // knows, with no backlog to drain (`Stamper::observe`).
                let live = crate::clock::live_term(
                    m.current_leader.is_some(),
                    m.current_term,
                    m.last_applied.map(|l| (l.leader_id.term, l.index)),
                    m.last_log_index,
                );
                (self.clock.target_ms(self.me, &nodes, nodes.len()), live)
            };
            stamper.observe(applied_ms, self.clock.mono_ms(), target, live_term);
            let (leader, _, term) = leader_of(&self.raft);
            if leader != Some(self.me) || self.pause.active() {
                // Handing over: no entry (nor tick) may refresh the followers' lease on
                // this leader; callers retry and find the next one.
                let err = if leader == Some(self.me) {
                    ProposeError::NotLeader {
                        leader: None,
                        addr: None,
                    }
                } else {
                    not_leader(&self.raft)
                };
                for p in group {
                    let _ = p.reply.send(Err(err.clone()));
                }
                continue;
            }
            if target.is_none() && (applied_ms == 0 || stamper.needs_target(term)) {
                // Genesis, or a leader new in office, without a majority clock sample:
                // no stamp can be trusted yet (the caller retries; samples arrive
                // within the sampling interval from the majority that elected it).
                for p in group {
                    let _ = p.reply.send(Err(ProposeError::ClockNotReady));
                }
                continue;
            }
            let stamp = stamper.stamp(term, applied_ms, self.clock.mono_ms(), target);
            let shard_label = self.shard.to_string();
            let queue_wait = self
                .metrics
                .stage
                .with_label_values(&[&shard_label, "queue"]);
            let mut requests = Vec::with_capacity(count);
            let mut spans = Vec::with_capacity(group.len());
            let mut longest_wait = Duration::ZERO;
            for p in group {
                let start = requests.len();
                requests.extend(p.requests);
                let waited = p.enqueued.elapsed();
                longest_wait = longest_wait.max(waited);
                queue_wait.observe(waited.as_secs_f64());
                spans.push((start, requests.len(), p.reply));
            }
            let n_requests = requests.len();
            self.metrics
                .batch_size
                .with_label_values(&[&self.shard.to_string()])
                .observe(requests.len() as f64);
            self.metrics
                .batch_bytes
                .with_label_values(&[&self.shard.to_string()])
                .observe(bytes as f64);
            // Never past the latest logical time replicas accept (a wall clock set to
            // the year 10000): the shard's time stays there until clocks are fixed.
            let batch = Batch::new(
                stamp.min(allot_statemachine::limits::LOGICAL_TIME_MS_MAX),
                &requests,
            );
            drop(requests);
            last_proposal = Instant::now();
            let proposed = Instant::now();
            let commit = self
                .metrics
                .stage
                .with_label_values(&[&shard_label, "commit"]);
            let rx_write = match self.raft.client_write_ff(batch).await {
                Ok(rx) => rx,
                Err(fatal) => {
                    let err = ProposeError::Raft(fatal.to_string());
                    for (_, _, reply) in spans {
                        let _ = reply.send(Err(err.clone()));
                    }
                    return;
                }
            };
            let raft = self.raft.clone();
            let timeline = self.timeline.clone();
            let stage_hist = self.metrics.stage.clone();
            let (shard, slow) = (self.shard, self.config.slow);
            let slow_logged = slow_logged.clone();
            let me = self.me;
            tokio::spawn(async move {
                let _permit = permit;
                let deposed = deposed(&raft, me, term, LEADERSHIP_CHECK_EVERY);
                let answer = answer_unless_stranded(rx_write, deposed, STRANDED_AFTER).await;
                let result: Result<ClientWriteResponse<TypeConfig>, ProposeError> = match answer {
                    // Never answered after this node lost the term it proposed in:
                    // whether the entry commits is for the next leader to say, and a
                    // caller that retries (the same request ids) learns it there.
                    None => Err(not_leader(&raft)),
                    Some(Err(_)) => Err(ProposeError::ShuttingDown),
                    Some(Ok(Ok(resp))) => Ok(resp),
                    Some(Ok(Err(ClientWriteError::ForwardToLeader(_)))) => Err(not_leader(&raft)),
                    Some(Ok(Err(e))) => Err(ProposeError::Raft(e.to_string())),
                };
                let committed = proposed.elapsed();
                commit.observe(committed.as_secs_f64());
                let stages = match &result {
                    Ok(r) => commit_stages(
                        proposed,
                        proposed + committed,
                        timeline.get(r.data.log_index),
                    ),
                    Err(_) => Vec::new(),
                };
                for (name, d) in &stages {
                    stage_hist
                        .with_label_values(&[shard_label.as_str(), name])
                        .observe(d.as_secs_f64());
                }
                let now_ms = started.elapsed().as_millis() as u64;
                let last = slow_logged.load(Ordering::Relaxed);
                let due = last == u64::MAX || now_ms >= last.saturating_add(1_000);
                if let (true, Some(s), Ok(r)) = (due, slow, &result) {
                    if longest_wait + committed >= s {
                        slow_logged.store(now_ms, Ordering::Relaxed);
                        // The stage times of a tail request, for whoever investigates it
                        // (the histograms say how often; this says when and where).
                        let stage_ms: Vec<String> = stages
                            .iter()
                            .map(|(n, d)| format!("{n}={:.1}", d.as_secs_f64() * 1e3))
                            .collect();
                        tracing::warn!(
                            shard,
                            requests = n_requests,
                            log_index = r.data.log_index,
                            queue_wait_ms = longest_wait.as_millis() as u64,
                            commit_apply_ms = committed.as_millis() as u64,
                            stages_ms = stage_ms.join(" "),
                            "slow proposal (at most one such line per second per shard)"
                        );
                    }
                }
                match result {
                    Ok(resp) => {
                        let Applied {
                            log_index,
                            logical_time_ms,
                            mut outcomes,
                        } = resp.data;
                        // Hand each caller its slice, last first so `split_off` is cheap.
                        for (start, _end, reply) in spans.into_iter().rev() {
                            let mine = outcomes.split_off(start.min(outcomes.len()));
                            let _ = reply.send(Ok(Committed {
                                outcomes: mine,
                                log_index,
                                logical_time_ms,
                            }));
                        }
                    }
                    Err(e) => {
                        for (_, _, reply) in spans {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                }
            });
        }
    }
}

/// How often a proposal waiting for its answer checks that this node still leads in
/// the term it proposed in.
const LEADERSHIP_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long a proposal still waits for openraft's answer once this node has lost that
/// term (the answer normally comes at once: applied, or truncated with
/// `ForwardToLeader`).
const STRANDED_AFTER: Duration = Duration::from_secs(3);

/// Resolves once this node no longer leads in `term` (checked every `every`).
async fn deposed(raft: &Raft, me: NodeId, term: u64, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let (leader, _, now) = leader_of(raft);
        if leader != Some(me) || now != term {
            return;
        }
    }
}

/// openraft's answer to a proposed entry, or `None` if it has not come `grace` after
/// `deposed` resolved. openraft 0.9 answers a proposal when its entry is applied or
/// truncated, but not when a snapshot that covers its index replaces the log of a
/// deposed leader without truncating it: the answer never comes. The proposal's
/// in-flight slot was held for good then, and once all of them were, the proposer —
/// and the shard's writes and ticks on this node, should it lead again — stopped.
async fn answer_unless_stranded<T>(
    answer: impl std::future::Future<Output = T>,
    deposed: impl std::future::Future<Output = ()>,
    grace: Duration,
) -> Option<T> {
    tokio::pin!(answer);
    tokio::select! {
        a = &mut answer => return Some(a),
        () = deposed => {}
    }
    tokio::time::timeout(grace, answer).await.ok()
}

/// Turns an openraft API error into a proposal error: NotLeader when openraft says
/// to forward, the API error's own message otherwise.
pub fn from_raft_error<E>(raft: &Raft, e: RaftError<NodeId, E>) -> ProposeError
where
    E: std::error::Error + openraft::TryAsRef<ForwardToLeader<NodeId, openraft::BasicNode>>,
{
    if e.forward_to_leader::<openraft::BasicNode>().is_some() {
        return not_leader(raft);
    }
    match e {
        RaftError::APIError(a) => ProposeError::Rejected(a.to_string()),
        RaftError::Fatal(f) => ProposeError::Raft(f.to_string()),
    }
}

#[cfg(test)]
mod read_error_tests {
    /// A linearizable read whose leadership check did not hear from a quorum in time is
    /// transient: UNAVAILABLE (retried by the client), not FAILED_PRECONDITION (final).
    /// Found by a CI run: under one org's flood, an admin's `Tenancy` read failed with
    /// "not enough for a quorum" and the caller gave up.
    #[test]
    fn a_read_without_a_quorum_is_retried_not_refused() {
        use openraft::error::{CheckIsLeaderError, QuorumNotEnough, RaftError};
        let e: RaftError<crate::types::NodeId, CheckIsLeaderError<_, openraft::BasicNode>> =
            RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(QuorumNotEnough {
                cluster: "voters 1,2,3".into(),
                got: [1].into(),
            }));
        let s = crate::server::status_of(super::no_quorum(&e).expect("no quorum"));
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(
            s.metadata()
                .get("allot-reason")
                .and_then(|v| v.to_str().ok()),
            Some("NO_QUORUM")
        );
    }
}

#[cfg(test)]
mod waiting_tests {
    use super::*;

    /// A proposal whose answer never comes after its leader lost the term (openraft 0.9
    /// does not answer entries a snapshot replaced) gives its slot back `grace` after
    /// the loss, as "not the leader" (the caller retries with its request ids); an
    /// answer that comes within the grace is taken. Before, the wait had no end: after
    /// `max_inflight` such proposals the shard's proposer on that node stopped for good.
    #[tokio::test(start_paused = true)]
    async fn a_stranded_proposal_gives_its_slot_back() {
        let grace = Duration::from_secs(3);
        let never = std::future::pending::<u32>();
        let started = tokio::time::Instant::now();
        let deposed_after_2s = tokio::time::sleep(Duration::from_secs(2));
        assert_eq!(
            answer_unless_stranded(never, deposed_after_2s, grace).await,
            None
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));

        let late = async {
            tokio::time::sleep(Duration::from_secs(4)).await;
            7u32
        };
        let deposed_after_2s = tokio::time::sleep(Duration::from_secs(2));
        assert_eq!(
            answer_unless_stranded(late, deposed_after_2s, grace).await,
            Some(7)
        );

        // Still leading: the answer is waited for however long it takes.
        let slow = async {
            tokio::time::sleep(Duration::from_secs(3_600)).await;
            9u32
        };
        let still_leading = std::future::pending::<()>();
        assert_eq!(
            answer_unless_stranded(slow, still_leading, grace).await,
            Some(9)
        );
    }

    /// Calls wait in the queue within a byte bound of their own: a caller that stopped
    /// waiting gives back its admission permit, not its queued requests. Beyond the
    /// bound a call is refused as overloaded (retried), and a call taken off the queue
    /// gives its share back. Before, abandoned calls piled up to 65,536 a shard.
    #[tokio::test]
    async fn the_queue_is_bounded_by_bytes() {
        use allot_statemachine::Command;
        let (tx, mut rx) = mpsc::channel(1024);
        let grant = |id: u64| {
            allot_statemachine::workload::admin(
                id as u128,
                Command::CreateOrg {
                    org: allot_statemachine::OrgId(id),
                },
            )
        };
        let one = allot_statemachine::codec::encoded_len(&grant(1)) as usize;
        let p = Proposer {
            tx,
            queued: Arc::new(Semaphore::new(3 * one)),
        };
        let mut waiting = Vec::new();
        for id in 1..=3 {
            let p = p.clone();
            waiting.push(tokio::spawn(
                async move { p.propose(vec![grant(id)]).await },
            ));
        }
        while p.queued.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        let refused = p.propose(vec![grant(4)]).await;
        assert!(
            matches!(refused, Err(ProposeError::Overloaded)),
            "{refused:?}"
        );
        // The proposer takes one: its share comes back.
        let taken = rx.recv().await.expect("queued");
        drop(taken);
        assert_eq!(p.queued.available_permits(), one);
        for w in waiting {
            w.abort();
        }
    }
}
