//! Leader transfer (docs/DESIGN.md §49): hands a shard's leadership to another voter so
//! that restarting or removing the leader's node costs no unplanned election.
//!
//! openraft 0.9 has no transfer of its own, and its leader lease (a voter refuses to vote
//! while it heard from a leader within `election_timeout_max`) makes a challenger fail
//! while the leader is alive. So the leader steps aside in order:
//! 1. it **pauses proposals** (callers get "not the leader", which clients retry; ticks
//!    stop too), so no entry refreshes the followers' lease;
//! 2. it waits until the **target has every entry** it holds (no vote could be refused
//!    for a shorter log);
//! 3. it asks the **other voters to hold their elections** for a bounded time (they
//!    still vote), holds its own, and **stops heartbeating**;
//! 4. once its lease has run out on every follower, it tells the **target to
//!    campaign**; the target wins the next term with the other voters' votes, and the
//!    old leader steps down on seeing it;
//! 5. whatever happened, everything is undone: heartbeats, elections, proposals. Every
//!    hold also ends by itself after its bound, so a transfer cut short (the leader
//!    crashing mid-way) leaves no voter unable to elect.

use crate::node::{Node, Shard};
use allot_proto::handoff_request::Step;
use allot_proto::{HandoffRequest, TransferLeaderReply};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tonic::Status;

/// New proposals wait while this is set (a leader transfer in progress).
#[derive(Default)]
pub struct Pause {
    until: Mutex<Option<Instant>>,
}

impl Pause {
    pub fn active(&self) -> bool {
        let g = self.until.lock().unwrap_or_else(|p| p.into_inner());
        g.is_some_and(|u| Instant::now() < u)
    }

    fn end(&self) {
        *self.until.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Starts a pause until `until`, unless one is under way (one transfer at a time).
    fn begin(&self, until: Instant) -> bool {
        let mut g = self.until.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_some_and(|u| Instant::now() < u) {
            return false;
        }
        *g = Some(until);
        true
    }
}

/// A voter's held elections: resumed at the deadline unless a later hold extended it.
#[derive(Default)]
pub struct Hold {
    until: Mutex<Option<Instant>>,
}

/// Applies a handoff step on this node (the peer RPC `Raft.Handoff`).
pub async fn step(shard: &Shard, step: Step, hold: Duration) -> Result<(), Status> {
    match step {
        Step::HoldElections => {
            let until = Instant::now() + hold.min(HOLD_MAX);
            *shard.hold.until.lock().unwrap_or_else(|p| p.into_inner()) = Some(until);
            shard.raft.runtime_config().elect(false);
            let (raft, hold_state) = (shard.raft.clone(), shard.hold.clone());
            let rejoin = shard.rejoin.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(until.into()).await;
                let mut g = hold_state.until.lock().unwrap_or_else(|p| p.into_inner());
                if g.is_some_and(|u| u <= Instant::now()) {
                    *g = None;
                    resume_elections(&raft, &rejoin);
                }
            });
            Ok(())
        }
        Step::ResumeElections => {
            *shard.hold.until.lock().unwrap_or_else(|p| p.into_inner()) = None;
            resume_elections(&shard.raft, &shard.rejoin);
            Ok(())
        }
        Step::Campaign if !shard.rejoin.may_stand() => Err(Status::failed_precondition(
            "this replica started with an empty log and has not caught up: it stands for no \
             election yet",
        )),
        Step::Campaign => shard
            .raft
            .trigger()
            .elect()
            .await
            .map_err(|e| Status::internal(e.to_string())),
        Step::Unspecified => Err(Status::invalid_argument("a handoff step is required")),
    }
}

/// Lets the replica stand for election again — unless it is still rejoining after
/// opening empty (`crate::rejoin`): then it does once it is whole.
pub fn resume_elections(raft: &crate::types::Raft, rejoin: &crate::rejoin::Rejoin) {
    raft.runtime_config().elect(rejoin.may_stand());
}

/// Called when a rejoining replica may stand for election (it became whole, or it
/// initialised the shard), unless a leader transfer holds its elections (the hold's end
/// resumes them).
pub fn rejoined(shard: &Shard) {
    let held = shard.hold.until.lock().unwrap_or_else(|p| p.into_inner());
    if held.is_none() {
        resume_elections(&shard.raft, &shard.rejoin);
    }
}

/// The longest any voter holds its elections for one transfer.
const HOLD_MAX: Duration = Duration::from_secs(30);

/// Hands `shard`'s leadership from this node (its leader) to `to` (`None`: the most
/// up-to-date other voter).
pub async fn transfer(
    node: &Node,
    shard: &Shard,
    to: Option<u64>,
) -> Result<TransferLeaderReply, Status> {
    let started = Instant::now();
    let metrics = shard.raft.metrics().borrow().clone();
    if metrics.current_leader != Some(node.id) {
        return Err(crate::edge::with_reason(
            Status::failed_precondition(format!(
                "node {} is not the leader of shard {} (the leader is {:?}): ask the leader",
                node.id, shard.id, metrics.current_leader
            )),
            "NOT_LEADER",
        ));
    }
    let voters: Vec<(u64, String)> = {
        let m = metrics.membership_config.membership();
        m.voter_ids()
            .map(|id| {
                (
                    id,
                    m.get_node(&id).map(|n| n.addr.clone()).unwrap_or_default(),
                )
            })
            .collect()
    };
    let target = match to {
        Some(t) if t == node.id => {
            return Err(Status::invalid_argument(format!(
                "node {t} already leads shard {}",
                shard.id
            )))
        }
        Some(t) if !voters.iter().any(|(id, _)| *id == t) => {
            return Err(Status::invalid_argument(format!(
                "node {t} is not a voter of shard {}",
                shard.id
            )))
        }
        Some(t) => t,
        None => voters
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| *id != node.id)
            .max_by_key(|id| (matched(&metrics, *id), std::cmp::Reverse(*id)))
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "shard {} has no other voter to hand over to",
                    shard.id
                ))
            })?,
    };
    let election_max = Duration::from_millis(node.config.raft.election_max_ms);
    // The whole transfer's bound: catching up, a lease, a few election rounds.
    let budget = election_max * 6 + Duration::from_secs(2);
    let deadline = started + budget;
    if !shard.pause.begin(deadline) {
        return Err(Status::failed_precondition(format!(
            "a leader transfer of shard {} is already under way",
            shard.id
        )));
    }
    let others: Vec<&(u64, String)> = voters
        .iter()
        .filter(|(id, _)| *id != node.id && *id != target)
        .collect();
    let outcome = hand_over(node, shard, target, &others, election_max, deadline).await;
    // Undo everything, whatever happened.
    shard.raft.runtime_config().heartbeat(true);
    resume_elections(&shard.raft, &shard.rejoin);
    shard.pause.end();
    for (_, addr) in &others {
        let _ = ask(node, addr, shard.id, Step::ResumeElections, Duration::ZERO).await;
    }
    let term = outcome?;
    Ok(TransferLeaderReply {
        shard: shard.id,
        from: node.id,
        to: target,
        term,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

async fn hand_over(
    node: &Node,
    shard: &Shard,
    target: u64,
    others: &[&(u64, String)],
    election_max: Duration,
    deadline: Instant,
) -> Result<u64, Status> {
    let timed_out = |what: &str| {
        crate::edge::with_reason(
            Status::unavailable(format!(
                "leader transfer of shard {} to node {target}: {what}; nothing changed (the \
                 leader stays, writes resume)",
                shard.id
            )),
            "TRANSFER_TIMEOUT",
        )
    };
    let mut watch = shard.raft.metrics();
    // 2. The target holds every entry this leader holds (proposals are paused: the
    //    last index only moves for batches already in flight). A target that does not
    //    catch up within two election timeouts (down, or far behind) is given up on
    //    early: writes wait meanwhile.
    let caught_up_by = (Instant::now() + election_max * 2).min(deadline);
    loop {
        let caught_up = {
            let m = watch.borrow();
            matched(&m, target) >= m.last_log_index.unwrap_or(0)
        };
        if caught_up {
            break;
        }
        if tokio::time::timeout_at(caught_up_by.into(), watch.changed())
            .await
            .is_err()
        {
            return Err(timed_out("the target did not catch up"));
        }
    }
    // 3. The other voters and this one hold their elections; heartbeats stop. A voter
    //    of a release without the handoff (during a rolling upgrade) would not hold its
    //    elections, and would campaign once heartbeats stop: the transfer is refused
    //    before they do, with nothing changed. The target is asked too (to resume, which
    //    changes nothing), so that one it could not tell to campaign is found now.
    let target_addr = {
        let m = watch.borrow();
        m.membership_config
            .membership()
            .get_node(&target)
            .map(|n| n.addr.clone())
            .unwrap_or_default()
    };
    let hold = deadline.saturating_duration_since(Instant::now()) + election_max;
    let mut unsupported = Vec::new();
    let asks = others
        .iter()
        .map(|(id, addr)| (*id, addr.as_str(), Step::HoldElections, hold))
        .chain([(
            target,
            target_addr.as_str(),
            Step::ResumeElections,
            Duration::ZERO,
        )]);
    for (id, addr, step, hold) in asks {
        match ask(node, addr, shard.id, step, hold).await {
            Ok(()) => {}
            Err(e) if e.unsupported => unsupported.push(id),
            // Down or cut off: it hears no heartbeats either way, and the target still
            // wins with the others' votes. Worth a line, not a refusal.
            Err(e) => tracing::warn!(
                shard = shard.id,
                node = id,
                "leader transfer: hold refused: {}",
                e.message
            ),
        }
    }
    if !unsupported.is_empty() {
        return Err(crate::edge::with_reason(
            Status::failed_precondition(format!(
                "leader transfer of shard {} to node {target}: node(s) {unsupported:?} run a \
                 release without leader transfer (the handoff is unimplemented there) and \
                 would hold an election of their own; upgrade them first (nothing changed: \
                 the leader stays, writes resume)",
                shard.id
            )),
            "VOTER_UNSUPPORTED",
        ));
    }
    shard.raft.runtime_config().elect(false);
    shard.raft.runtime_config().heartbeat(false);
    let stopped = Instant::now();
    // 4. Once the followers' lease on this leader has run out, the target campaigns;
    //    again every election timeout until it leads (or the deadline).
    tokio::time::sleep_until((stopped + election_max + Duration::from_millis(20)).into()).await;
    loop {
        if let Err(e) = ask(node, &target_addr, shard.id, Step::Campaign, Duration::ZERO).await {
            // A target that cannot be told to campaign (down, unreachable) will not
            // lead: give up now rather than keep writes waiting to the deadline.
            return Err(timed_out(&format!(
                "the target did not answer ({})",
                e.message
            )));
        }
        let round = Instant::now() + election_max;
        loop {
            {
                let m = watch.borrow();
                if m.current_leader == Some(target) {
                    return Ok(m.current_term);
                }
            }
            let until = round.min(deadline);
            if tokio::time::timeout_at(until.into(), watch.changed())
                .await
                .is_err()
            {
                break;
            }
        }
        if Instant::now() >= deadline {
            let leader = watch.borrow().current_leader;
            return Err(timed_out(&format!(
                "the target was not elected in time (the leader is now {leader:?})"
            )));
        }
    }
}

/// The last log index the leader knows `id` holds (0: none, or not the leader).
fn matched(m: &openraft::RaftMetrics<u64, openraft::BasicNode>, id: u64) -> u64 {
    m.replication
        .as_ref()
        .and_then(|r| r.get(&id).cloned().flatten())
        .map_or(0, |l| l.index)
}

/// Why a voter did not take a handoff step.
#[derive(Debug)]
struct NotTaken {
    /// It answered `UNIMPLEMENTED`: a release without leader transfer.
    unsupported: bool,
    message: String,
}

impl NotTaken {
    fn other(message: impl Into<String>) -> NotTaken {
        NotTaken {
            unsupported: false,
            message: message.into(),
        }
    }
}

async fn ask(
    node: &Node,
    addr: &str,
    shard: u32,
    step: Step,
    hold: Duration,
) -> Result<(), NotTaken> {
    let mut c = node
        .channels
        .raft_client(addr)
        .map_err(|e| NotTaken::other(e.to_string()))?;
    let call = c.handoff(node.channels.peer_request(HandoffRequest {
        shard,
        step: step as i32,
        hold_ms: hold.as_millis() as u64,
    }));
    match tokio::time::timeout(Duration::from_secs(2), call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(NotTaken {
            unsupported: s.code() == tonic::Code::Unimplemented,
            message: s.message().to_string(),
        }),
        Err(_) => Err(NotTaken::other("timed out")),
    }
}
