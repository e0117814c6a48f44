//! The audit trail survives replica replacement (issue 23).
//!
//! Apply writes a shard's audit rows (events by first sequence, batches by log index) as
//! it goes, so a replica that catches up by *installing a snapshot* has no rows for the
//! entries the snapshot covers — and once every original replica has been replaced, no
//! replica would hold the trail from genesis. Each node therefore runs, per shard, a
//! background task that finds the gaps in its own event rows and copies the missing rows
//! from a peer:
//!
//! - **Finding gaps.** The task scans the shard's event rows in key order from its
//!   checkpoint (the sequence, chain head and log index up to which the local rows are
//!   known to be contiguous from 0), up to the state's chain head. A row whose first
//!   sequence is past the expected one is a gap, anchored at its first event's
//!   `prev_hash`; rows ending before the state's head leave a gap anchored at the state's
//!   head. The scan runs at start, after every snapshot install (`snapshots_installed`
//!   in the view), and every `RESCAN_EVERY` to move the checkpoint on (persisted, so a
//!   restart rescans only rows applied since).
//! - **Copying.** Pages of event rows come from a peer (the Raft service's `AuditRows`,
//!   peer-authenticated) *from the back of the gap*, and each row is verified against
//!   the anchor the replica already trusts before it is used
//!   (`allot_statemachine::audit::verify_chain_back`): its last event's hash is the
//!   anchor, every hash is its content's, every link holds. The anchor then moves to the
//!   row's first `prev_hash`. So a row is proven by the consensus-replicated head the
//!   moment it arrives, and a peer can neither forge nor reorder one. The batches the
//!   verified events name come next, each checked against its events
//!   (`verify_entry`: one command event per request, same ids and digests). Verified
//!   rows are written at once; the gap shrinks from its end, so a crash loses nothing.
//!   When the anchor reaches the gap's start it must equal the chain state the replica
//!   holds there (genesis or its own event's hash); otherwise the task logs an error.
//!
//! A peer that lacks the rows too (it also caught up by snapshot) answers with fewer or
//! none; the task tries each member in turn and retries later.

use crate::limits::AUDIT_PAGE_BYTES;
use crate::node::{Node, Shard};
use crate::store::{self, audit_key, AUDIT_BATCHES, AUDIT_EVENTS, CF_AUDIT};
use crate::types::{NodeId, ShardId};
use allot_statemachine::audit::{verify_chain_back, verify_entry};
use allot_statemachine::{codec, AuditChain, AuditEvent, Entry};
use rocksdb::DB;
use std::sync::Arc;

/// How long the membership guard waits for a member's coverage.
const COVERAGE_ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a peer may take to answer one page of rows (at most `AUDIT_PAGE_BYTES`).
const ROWS_ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
use serde::{Deserialize, Serialize};
use std::sync::Weak;
use std::time::Duration;

/// The checkpoint's key space inside the shard's audit range.
const AUDIT_CHECKPOINT: u8 = 2;
/// How often the task looks for a snapshot install.
const POLL: Duration = Duration::from_secs(1);
/// How often it scans anyway, to move the checkpoint on.
const RESCAN_EVERY: Duration = Duration::from_secs(600);

/// A range of one key space's rows, asked of a peer: keys in `lo..hi`, in key order or
/// from the back, at most `max_bytes` (capped at `AUDIT_PAGE_BYTES`) but at least one row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RowsRequest {
    pub space: u8,
    pub lo: u64,
    pub hi: u64,
    pub descending: bool,
    pub max_bytes: u32,
}

/// Rows as stored: (key, value).
pub type Rows = Vec<(u64, Vec<u8>)>;

/// What a peer answers: rows of `req` from this node's store.
pub fn read_rows(db: &DB, shard: ShardId, req: &RowsRequest) -> Result<Rows, String> {
    if req.space != AUDIT_EVENTS && req.space != AUDIT_BATCHES {
        return Err(format!("unknown audit key space {}", req.space));
    }
    let budget = (req.max_bytes as usize).min(AUDIT_PAGE_BYTES);
    let one_max = crate::limits::RAFT_MESSAGE_MAX - 4096;
    let audit = store::cf(db, CF_AUDIT);
    let (lo, hi) = (
        audit_key(shard, req.space, req.lo),
        audit_key(shard, req.space, req.hi),
    );
    let mode = if req.descending {
        rocksdb::IteratorMode::From(&hi, rocksdb::Direction::Reverse)
    } else {
        rocksdb::IteratorMode::From(&lo, rocksdb::Direction::Forward)
    };
    let mut rows = Vec::new();
    let mut bytes = 0usize;
    for item in db.iterator_cf(audit, mode) {
        let (k, v) = item.map_err(|e| e.to_string())?;
        if k.as_ref() < lo.as_slice() || k.as_ref() >= hi.as_slice() {
            // Reverse from `hi` starts at `hi` itself when it exists; past `lo` ends.
            if req.descending && k.as_ref() >= hi.as_slice() {
                continue;
            }
            break;
        }
        if bytes + v.len() > budget && !rows.is_empty() {
            break;
        }
        if v.len() > one_max {
            return Err(format!(
                "audit row {} is larger than a peer message",
                store::index_of_key(&k)
            ));
        }
        bytes += v.len();
        rows.push((store::index_of_key(&k), v.to_vec()));
    }
    Ok(rows)
}

/// How far the local event rows are known to be contiguous from 0: the chain state
/// after them.
type Checkpoint = AuditChain;

fn checkpoint_key(shard: ShardId) -> Vec<u8> {
    audit_key(shard, AUDIT_CHECKPOINT, 0)
}

fn load_checkpoint(db: &DB, shard: ShardId) -> Checkpoint {
    db.get_cf(store::cf(db, CF_AUDIT), checkpoint_key(shard))
        .ok()
        .flatten()
        .and_then(|b| codec::decode(&b).ok())
        .unwrap_or_default()
}

/// How far this replica's event rows of `shard` were last verified contiguous from
/// sequence 0 (its checkpoint): what `Admin.Status` reports as audit coverage.
pub fn verified_to(db: &DB, shard: ShardId) -> u64 {
    load_checkpoint(db, shard).next_seq
}

/// How much of `shard`'s trail this replica holds now: a scan from its checkpoint up to
/// its state's chain head (`Raft.AuditCoverage`; the membership guard of
/// [`check_removal`]).
pub fn coverage(node: &Node, shard: &Shard) -> Result<allot_proto::AuditCoverageReply, String> {
    let head = shard.view.read().state.audit.clone();
    let gap = scan(&node.db, shard.id, &head)?;
    Ok(allot_proto::AuditCoverageReply {
        node_id: node.id,
        contiguous_to: gap.map_or(head.next_seq, |g| g.start.next_seq),
        head: head.next_seq,
    })
}

/// A replica's answer, or why there is none.
async fn coverage_of(
    node: &Arc<Node>,
    shard: ShardId,
    id: NodeId,
    addr: &str,
) -> Result<allot_proto::AuditCoverageReply, String> {
    if id == node.id {
        let node = node.clone();
        return tokio::task::spawn_blocking(move || coverage(&node, &node.shards[shard as usize]))
            .await
            .map_err(|e| e.to_string())?;
    }
    let mut c = node.channels.raft_client(addr).map_err(|e| e.to_string())?;
    let call = c.audit_coverage(
        node.channels
            .peer_request(allot_proto::AuditCoverageRequest { shard }),
    );
    match tokio::time::timeout(COVERAGE_ASK_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        // An older release without the RPC answers UNIMPLEMENTED: its coverage is unknown.
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// Every member's answer, asked at once: one cut off costs its timeout, not the others'.
async fn coverage_of_all(
    node: &Arc<Node>,
    shard: ShardId,
    members: &[(NodeId, String)],
) -> Vec<(NodeId, Result<allot_proto::AuditCoverageReply, String>)> {
    futures::future::join_all(
        members
            .iter()
            .map(|(id, addr)| async move { (*id, coverage_of(node, shard, *id, addr).await) }),
    )
    .await
}

/// The membership guard: a change of `shard`'s members to `voters` that removes any
/// member must not remove the last reachable member holding the whole trail while no
/// member left holds it. The members left are asked first (one that holds it is enough);
/// then the members removed (if none of them answers holding it, nothing reachable is
/// lost: a dead member is removed at once). Refused with `UNAVAILABLE` / `AUDIT_GAP`
/// and a retry hint: the members left copy the trail from the others in the background
/// (`run`), so the same change goes through once one of them has it.
pub async fn check_removal(
    node: &Arc<Node>,
    shard: &Shard,
    voters: &std::collections::BTreeSet<NodeId>,
) -> Result<(), tonic::Status> {
    let members = shard.members();
    let (kept, removed): (Vec<_>, Vec<_>) =
        members.into_iter().partition(|(id, _)| voters.contains(id));
    if removed.is_empty() {
        return Ok(());
    }
    let whole = |c: &Result<allot_proto::AuditCoverageReply, String>| {
        c.as_ref().is_ok_and(|c| c.contiguous_to == c.head)
    };
    let left = coverage_of_all(node, shard.id, &kept).await;
    if left.iter().any(|(_, c)| whole(c)) {
        return Ok(());
    }
    let short: Vec<String> = left
        .iter()
        .map(|(id, c)| match c {
            Ok(c) => format!(
                "node {id} holds events 0..{} of {}",
                c.contiguous_to, c.head
            ),
            Err(e) => format!("node {id} did not answer ({e})"),
        })
        .collect();
    let whole_on: Vec<String> = coverage_of_all(node, shard.id, &removed)
        .await
        .iter()
        .filter(|(_, c)| whole(c))
        .map(|(id, _)| id.to_string())
        .collect();
    if whole_on.is_empty() {
        tracing::warn!(
            shard = shard.id,
            members_left = %short.join("; "),
            "members removed although no member left holds the whole audit trail: none of \
             those removed answered holding it either"
        );
        return Ok(());
    }
    let mut status = tonic::Status::unavailable(format!(
        "shard {}: removing node(s) {} would leave no member holding the whole audit \
         trail ({}); the members left copy it in the background, so retry shortly, or \
         allow the loss explicitly (allow_audit_loss; nothing was changed)",
        shard.id,
        whole_on.join(", "),
        short.join("; ")
    ));
    status.metadata_mut().insert(
        "retry-after-ms",
        tonic::metadata::MetadataValue::from(1000u64),
    );
    Err(crate::edge::with_reason(status, "AUDIT_GAP"))
}

/// A missing run of events: `start` is the chain state the replica holds before it,
/// `end` the trusted state right after it. (The batches to copy are those its events
/// name.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gap {
    pub start: AuditChain,
    pub end: AuditChain,
}

/// Scans the local event rows from the checkpoint up to `head` (the state's chain
/// head). Returns the first gap, if any; the checkpoint reached is persisted.
pub(crate) fn scan(db: &DB, shard: ShardId, head: &AuditChain) -> Result<Option<Gap>, String> {
    let mut at = load_checkpoint(db, shard);
    let before = at.clone();
    let audit = store::cf(db, CF_AUDIT);
    let from = audit_key(shard, AUDIT_EVENTS, at.next_seq);
    let end = audit_key(shard, AUDIT_EVENTS, head.next_seq);
    let mut gap = None;
    for item in db.iterator_cf(
        audit,
        rocksdb::IteratorMode::From(&from, rocksdb::Direction::Forward),
    ) {
        let (k, v) = item.map_err(|e| e.to_string())?;
        if k.as_ref() >= end.as_slice() {
            break;
        }
        let events: Vec<AuditEvent> = codec::decode_kept(&v).map_err(|e| e.to_string())?;
        let (Some(first), Some(last)) = (events.first(), events.last()) else {
            return Err(format!("empty audit row {}", store::index_of_key(&k)));
        };
        if first.seq != at.next_seq {
            gap = Some(Gap {
                start: at.clone(),
                end: AuditChain {
                    next_seq: first.seq,
                    head: first.prev_hash,
                },
            });
            break;
        }
        at = AuditChain {
            next_seq: last.seq + 1,
            head: last.hash,
        };
    }
    if gap.is_none() && at.next_seq < head.next_seq {
        gap = Some(Gap {
            start: at.clone(),
            end: head.clone(),
        });
    }
    if at != before {
        db.put_cf(audit, checkpoint_key(shard), codec::encode(&at))
            .map_err(|e| e.to_string())?;
    }
    Ok(gap)
}

/// Where rows come from: a peer's `AuditRows` (or, in tests, anything).
pub trait RowSource {
    fn rows(
        &self,
        req: RowsRequest,
    ) -> impl std::future::Future<Output = Result<Rows, String>> + Send;
}

/// Copies the rows of `gap` from `source`, verifying each against the trusted anchor
/// before writing it. Returns the number of events written; `Ok` with the gap closed,
/// `Err` if the source lacks rows or sent a bad one (what was verified stays written).
pub async fn fill<S: RowSource>(
    db: &DB,
    shard: ShardId,
    gap: &Gap,
    source: &S,
) -> Result<u64, String> {
    let mut anchor = gap.end.clone();
    let mut written = 0u64;
    while anchor.next_seq > gap.start.next_seq {
        let page = source
            .rows(RowsRequest {
                space: AUDIT_EVENTS,
                lo: gap.start.next_seq,
                hi: anchor.next_seq,
                descending: true,
                max_bytes: AUDIT_PAGE_BYTES as u32,
            })
            .await?;
        if page.is_empty() {
            return Err(format!(
                "the peer lacks audit events {}..{}",
                gap.start.next_seq, anchor.next_seq
            ));
        }
        let mut events_of_page: Vec<AuditEvent> = Vec::new();
        let mut rows = Vec::with_capacity(page.len());
        for (key, value) in page {
            let events: Vec<AuditEvent> =
                codec::decode_kept(&value).map_err(|e| format!("audit row {key}: {e}"))?;
            if events.first().map(|e| e.seq) != Some(key) || key < gap.start.next_seq {
                return Err(format!(
                    "audit row {key} is keyed by another event than its first"
                ));
            }
            anchor =
                verify_chain_back(&anchor, &events).map_err(|e| format!("audit row {key}: {e}"))?;
            events_of_page.extend(events);
            rows.push((key, value));
        }
        // The batches these events name, each checked against them.
        let indexes: std::collections::BTreeSet<u64> = events_of_page
            .iter()
            .filter(|e| matches!(e.body, allot_statemachine::EventBody::Command { .. }))
            .map(|e| e.log_index)
            .collect();
        let mut batches = Vec::new();
        if let (Some(&lo), Some(&hi)) = (indexes.first(), indexes.last()) {
            let mut next = lo;
            while next <= hi {
                let got = source
                    .rows(RowsRequest {
                        space: AUDIT_BATCHES,
                        lo: next,
                        hi: hi + 1,
                        descending: false,
                        max_bytes: AUDIT_PAGE_BYTES as u32,
                    })
                    .await?;
                if got.is_empty() {
                    break;
                }
                // Rows in the range asked, in key order, each once: a peer that repeats
                // or strays would otherwise keep this loop asking (and collecting).
                for (key, value) in got {
                    if key < next || key > hi {
                        return Err(format!(
                            "batch row {key} is outside the range asked ({next}..={hi})"
                        ));
                    }
                    next = key + 1;
                    if !indexes.contains(&key) {
                        continue;
                    }
                    let entry: Entry =
                        codec::decode_kept(&value).map_err(|e| format!("batch row {key}: {e}"))?;
                    if entry.log_index != key {
                        return Err(format!("batch row {key} holds entry {}", entry.log_index));
                    }
                    verify_entry(&entry, &events_of_page)
                        .map_err(|e| format!("batch row {key}: {e}"))?;
                    batches.push((key, value));
                }
            }
        }
        if batches.len() != indexes.len() {
            return Err(format!(
                "the peer lacks {} of the {} batches of audit events {}..",
                indexes.len() - batches.len(),
                indexes.len(),
                anchor.next_seq
            ));
        }
        let mut wb = rocksdb::WriteBatch::default();
        let audit = store::cf(db, CF_AUDIT);
        for (key, value) in &rows {
            wb.put_cf(audit, audit_key(shard, AUDIT_EVENTS, *key), value);
        }
        for (key, value) in &batches {
            wb.put_cf(audit, audit_key(shard, AUDIT_BATCHES, *key), value);
        }
        db.write(wb).map_err(|e| e.to_string())?;
        written += events_of_page.len() as u64;
    }
    if anchor != gap.start {
        return Err(format!(
            "the copied audit events do not meet this replica's own at {} (its trail is not \
             the cluster's)",
            gap.start.next_seq
        ));
    }
    Ok(written)
}

/// A peer's `AuditRows`.
struct Peer<'a> {
    node: &'a Node,
    shard: ShardId,
    addr: String,
}

impl RowSource for Peer<'_> {
    async fn rows(&self, req: RowsRequest) -> Result<Rows, String> {
        let mut c = self
            .node
            .channels
            .raft_client(&self.addr)
            .map_err(|e| e.to_string())?;
        let call = c.audit_rows(self.node.channels.peer_request(allot_proto::RaftMessage {
            shard: self.shard,
            payload: codec::encode(&req),
        }));
        // A peer that takes the call and never answers must not stall the filling of
        // every shard's trail behind this one.
        let reply = tokio::time::timeout(ROWS_ASK_TIMEOUT, call)
            .await
            .map_err(|_| format!("{}: no answer in {ROWS_ASK_TIMEOUT:?}", self.addr))?
            .map_err(|e| format!("{}: {}", self.addr, e.message()))?;
        codec::decode(&reply.into_inner().payload).map_err(|e| e.to_string())
    }
}

/// One pass over a shard: scan, and fill every gap found from the first peer that has it.
/// Returns whether the trail is now whole up to the state's head.
async fn pass(node: &Node, shard: &Shard) -> bool {
    loop {
        let head = shard.view.read().state.audit.clone();
        let db = node.db.clone();
        let id = shard.id;
        let gap = match tokio::task::spawn_blocking(move || scan(&db, id, &head)).await {
            Ok(Ok(gap)) => gap,
            Ok(Err(e)) => {
                tracing::error!(shard = id, error = %e, "audit scan failed");
                return false;
            }
            Err(e) => {
                tracing::error!(shard = id, error = %e, "audit scan task failed");
                return false;
            }
        };
        let Some(gap) = gap else { return true };
        if node
            .config
            .test_audit_fill_hold_file
            .as_ref()
            .is_some_and(|f| f.exists())
        {
            return false;
        }
        let peers: Vec<String> = {
            let m = shard.raft.metrics().borrow().clone();
            m.membership_config
                .membership()
                .nodes()
                .filter(|(n, _)| **n != node.id)
                .map(|(_, b)| b.addr.clone())
                .collect()
        };
        let mut closed = false;
        for addr in peers {
            let peer = Peer {
                node,
                shard: shard.id,
                addr: addr.clone(),
            };
            match fill(&node.db, shard.id, &gap, &peer).await {
                Ok(n) => {
                    tracing::info!(
                        shard = shard.id,
                        from = gap.start.next_seq,
                        to = gap.end.next_seq,
                        events = n,
                        peer = %addr,
                        "audit rows copied from a peer"
                    );
                    node.metrics
                        .audit_rows_copied
                        .with_label_values(&[&shard.id.to_string()])
                        .inc_by(n);
                    closed = true;
                    break;
                }
                Err(e) => tracing::warn!(
                    shard = shard.id,
                    from = gap.start.next_seq,
                    to = gap.end.next_seq,
                    peer = %addr,
                    error = %e,
                    "audit rows not copied from this peer"
                ),
            }
        }
        if !closed {
            return false;
        }
    }
}

/// The per-node task: every shard, at start, after each snapshot install, and every
/// `RESCAN_EVERY`; a shard left with a gap is tried again each poll.
pub async fn run(node: Weak<Node>) {
    let mut seen: Vec<Option<u64>> = Vec::new();
    let mut whole: Vec<bool> = Vec::new();
    let mut last_rescan = tokio::time::Instant::now();
    let mut every = tokio::time::interval(POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(node) = node.upgrade() else { return };
        let rescan = last_rescan.elapsed() >= RESCAN_EVERY;
        if rescan {
            last_rescan = tokio::time::Instant::now();
        }
        seen.resize(node.shards.len(), None);
        whole.resize(node.shards.len(), false);
        for shard in &node.shards {
            let i = shard.id as usize;
            let installs = shard.view.read().snapshots_installed;
            if seen[i] == Some(installs) && whole[i] && !rescan {
                continue;
            }
            seen[i] = Some(installs);
            whole[i] = pass(&node, shard).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_statemachine::testkit::{credits, Harness};
    use allot_statemachine::{BucketKind, Command, HoldId};

    /// A shard's history: a harness's events and entries (rows as apply writes them).
    fn history() -> (Harness, Rows, Rows) {
        let mut h = Harness::world();
        for i in 1..=20u64 {
            h.grant(
                i,
                allot_statemachine::Account::Project(allot_statemachine::testkit::PROJECT),
                BucketKind::Paid,
                credits(10),
                None,
            );
            h.ok(Command::CreateHold(Harness::hold_spec(i, credits(5))));
            h.ok(Command::ReleaseHold { hold: HoldId(i) });
        }
        let mut events = Vec::new();
        for entry in &h.entries {
            let of: Vec<AuditEvent> = h
                .events
                .iter()
                .filter(|e| e.log_index == entry.log_index)
                .cloned()
                .collect();
            if let Some(first) = of.first() {
                events.push((first.seq, codec::encode(&of)));
            }
        }
        let batches = h
            .entries
            .iter()
            .map(|e| (e.log_index, codec::encode(e)))
            .collect();
        (h, events, batches)
    }

    fn put(db: &DB, space: u8, rows: &[(u64, Vec<u8>)]) {
        for (k, v) in rows {
            db.put_cf(store::cf(db, CF_AUDIT), audit_key(0, space, *k), v)
                .unwrap();
        }
    }

    /// A peer's store as the source, optionally with one event row edited.
    struct FromDb {
        db: Arc<DB>,
        forge: Option<u64>,
    }

    impl RowSource for FromDb {
        async fn rows(&self, mut req: RowsRequest) -> Result<Rows, String> {
            // One row per answer: every page boundary is exercised.
            req.max_bytes = 1;
            let mut rows = read_rows(&self.db, 0, &req)?;
            for (k, v) in &mut rows {
                if req.space == AUDIT_EVENTS && Some(*k) == self.forge {
                    let mut evs: Vec<AuditEvent> = codec::decode(v).unwrap();
                    evs[0].time_ms += 1;
                    *v = codec::encode(&evs);
                }
            }
            Ok(rows)
        }
    }

    use std::sync::Arc;

    /// A replica that kept rows from the start and from the end (a snapshot install in
    /// between) finds the gap and copies exactly the missing rows, page by page, from a
    /// peer; its trail then equals the peer's. A peer that edits one row is refused at
    /// that row: nothing before it in the gap is written, and what was written is genuine.
    #[tokio::test]
    async fn a_gap_is_found_and_filled_from_a_peer_and_a_forged_row_is_refused() {
        let (h, events, batches) = history();
        let dir = tempfile::tempdir().unwrap();
        let peer = store::open_db(&dir.path().join("peer")).unwrap();
        put(&peer, AUDIT_EVENTS, &events);
        put(&peer, AUDIT_BATCHES, &batches);
        let head = h.state.audit.clone();

        for forge in [None, Some(events[events.len() / 2].0)] {
            let local = store::open_db(&dir.path().join(format!("local-{forge:?}"))).unwrap();
            // Rows of the first five entries and of the last five: a gap between.
            let (cut_lo, cut_hi) = (5, events.len() - 5);
            put(&local, AUDIT_EVENTS, &events[..cut_lo]);
            put(&local, AUDIT_EVENTS, &events[cut_hi..]);
            let gap = scan(&local, 0, &head).unwrap().expect("a gap");
            assert_eq!(gap.start.next_seq, events[cut_lo].0);
            assert_eq!(gap.end.next_seq, events[cut_hi].0);
            let source = FromDb {
                db: peer.clone(),
                forge,
            };
            let r = fill(&local, 0, &gap, &source).await;
            let got = read_rows(
                &local,
                0,
                &RowsRequest {
                    space: AUDIT_EVENTS,
                    lo: 0,
                    hi: u64::MAX,
                    descending: false,
                    max_bytes: u32::MAX,
                },
            )
            .unwrap();
            match forge {
                None => {
                    let n = r.unwrap();
                    assert!(n > 0);
                    assert_eq!(got, events, "the trail equals the peer's");
                    assert_eq!(scan(&local, 0, &head).unwrap(), None, "whole now");
                    // The batches the copied events name came too.
                    for (k, v) in &batches[cut_lo..cut_hi] {
                        let row = local
                            .get_cf(store::cf(&local, CF_AUDIT), audit_key(0, AUDIT_BATCHES, *k))
                            .unwrap();
                        let entry: Entry = codec::decode(v).unwrap();
                        if !entry.requests.is_empty() {
                            assert_eq!(row.as_deref(), Some(v.as_slice()), "batch {k}");
                        }
                    }
                }
                Some(forged) => {
                    assert!(r.is_err(), "a forged row is refused");
                    // Every row held is the genuine one, and the forged key is absent.
                    for (k, v) in &got {
                        assert!(events.contains(&(*k, v.clone())), "row {k} is genuine");
                    }
                    assert!(got.iter().all(|(k, _)| *k != forged));
                    assert!(scan(&local, 0, &head).unwrap().is_some(), "still a gap");
                }
            }
        }
    }

    /// A peer that answers the events honestly but the batches with rows it was not asked
    /// for: keys repeated (the one genuine row it was asked for first, again and again),
    /// below the range asked, or `u64::MAX`. Each is refused at once: the fill neither
    /// loops asking for ever while what it collected grows, nor overflows on the key.
    #[tokio::test]
    async fn batch_rows_out_of_range_or_repeated_are_refused() {
        let (h, events, batches) = history();
        let dir = tempfile::tempdir().unwrap();
        let peer = store::open_db(&dir.path().join("peer")).unwrap();
        put(&peer, AUDIT_EVENTS, &events);
        put(&peer, AUDIT_BATCHES, &batches);

        #[derive(Clone, Copy, Debug)]
        enum Lie {
            RepeatFirst,
            Below,
            KeyMax,
        }
        struct Lying {
            honest: FromDb,
            lie: Lie,
            calls: std::sync::atomic::AtomicU32,
        }
        const CALLS_MAX: u32 = 1_000;
        impl RowSource for Lying {
            async fn rows(&self, req: RowsRequest) -> Result<Rows, String> {
                if self
                    .calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    >= CALLS_MAX
                {
                    return Err("asked for ever".into());
                }
                if req.space != AUDIT_BATCHES {
                    return self.honest.rows(req).await;
                }
                let mut all = RowsRequest {
                    lo: 0,
                    hi: u64::MAX,
                    ..req.clone()
                };
                all.max_bytes = u32::MAX;
                let rows = read_rows(&self.honest.db, 0, &all)?;
                let at = |k: u64| rows.iter().find(|(x, _)| *x >= k).cloned().unwrap();
                Ok(match self.lie {
                    Lie::RepeatFirst => vec![at(req.lo); 64],
                    Lie::Below => vec![at(0), at(req.lo)],
                    Lie::KeyMax => vec![(u64::MAX, at(req.lo).1)],
                })
            }
        }
        for lie in [Lie::RepeatFirst, Lie::Below, Lie::KeyMax] {
            let local = store::open_db(&dir.path().join(format!("local-{lie:?}"))).unwrap();
            let gap = scan(&local, 0, &h.state.audit).unwrap().expect("a gap");
            let source = Lying {
                honest: FromDb {
                    db: peer.clone(),
                    forge: None,
                },
                lie,
                calls: Default::default(),
            };
            let r = fill(&local, 0, &gap, &source).await;
            let err = r.expect_err("a lying peer's batches are refused");
            assert!(!err.contains("asked for ever"), "{lie:?}: {err}");
            let calls = source.calls.load(std::sync::atomic::Ordering::Relaxed);
            assert!(
                calls <= 4,
                "{lie:?}: refused at the first lie, after {calls} calls"
            );
            assert!(
                scan(&local, 0, &h.state.audit).unwrap().is_some(),
                "still a gap"
            );
        }
    }

    /// With no rows at all (a replica whose state came whole from a snapshot), the gap
    /// runs from genesis to the state's head and is filled the same way.
    #[tokio::test]
    async fn a_replica_with_no_rows_fills_from_genesis() {
        let (h, events, batches) = history();
        let dir = tempfile::tempdir().unwrap();
        let peer = store::open_db(&dir.path().join("peer")).unwrap();
        put(&peer, AUDIT_EVENTS, &events);
        put(&peer, AUDIT_BATCHES, &batches);
        let local = store::open_db(&dir.path().join("local")).unwrap();
        let gap = scan(&local, 0, &h.state.audit).unwrap().expect("a gap");
        assert_eq!(gap.start, AuditChain::default());
        assert_eq!(gap.end, h.state.audit);
        let source = FromDb {
            db: peer.clone(),
            forge: None,
        };
        fill(&local, 0, &gap, &source).await.unwrap();
        assert_eq!(scan(&local, 0, &h.state.audit).unwrap(), None);
        // A peer that lacks the rows: an error, nothing written.
        let empty = store::open_db(&dir.path().join("empty")).unwrap();
        let other = store::open_db(&dir.path().join("other")).unwrap();
        let none = FromDb {
            db: empty,
            forge: None,
        };
        assert!(fill(&other, 0, &gap, &none).await.is_err());
    }
}
