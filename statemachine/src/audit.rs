//! The audit trail: every applied command emits events (log index, logical time, actor,
//! command, outcome) plus one event per ledger movement, hash-chained per shard.
//!
//! Events are an *output* of apply, not part of the state: the node persists and indexes
//! them; the state keeps only the chain head, so snapshots stay small while every
//! replica computes the identical chain from the identical log.

use crate::command::{BudgetScope, Command};
use crate::ids::{Account, Actor, BucketId, HoldId, OrgId, RequestId};
use crate::outcome::Outcome;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub type Hash32 = [u8; 32];

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventBody {
    /// The command at position `request` of the entry at `log_index` was applied (or
    /// rejected); `replayed` marks a retry answered from the idempotency table with the
    /// first outcome. The command itself lives in the replicated log entry; `digest`
    /// (SHA-256 of its canonical encoding) binds it into the chain, and the node's audit
    /// store persists it beside the event (see [`command_of`], [`verify_commands`]).
    Command {
        request: u32,
        digest: Hash32,
        outcome: Outcome,
        replayed: bool,
    },
    /// Credits issued into a bucket (a grant).
    Issued {
        bucket: BucketId,
        amount_micro: u64,
    },
    HoldDrawn {
        bucket: BucketId,
        amount_micro: u64,
    },
    Captured {
        bucket: BucketId,
        amount_micro: u64,
    },
    /// Usage captured earlier but not billable (work after the last checkpoint on a
    /// platform-caused ending) returned from consumed to the hold.
    CaptureReversed {
        bucket: BucketId,
        amount_micro: u64,
    },
    Refunded {
        bucket: BucketId,
        amount_micro: u64,
    },
    /// A refund whose bucket had expired: forfeited at once, counted as expired.
    RefundForfeited {
        bucket: BucketId,
        amount_micro: u64,
    },
    BucketExpired {
        bucket: BucketId,
        amount_micro: u64,
    },
    TransferredOut {
        bucket: BucketId,
        amount_micro: u64,
    },
    TransferredIn {
        bucket: BucketId,
        amount_micro: u64,
    },
    /// A job changed state (every lifecycle transition is audited).
    JobTransition {
        job: crate::ids::JobId,
        from: Option<crate::scheduler::JobState>,
        to: crate::scheduler::JobState,
        attempt: u32,
        node: Option<crate::ids::NodeId>,
        reason: crate::scheduler::Reason,
    },
    /// A GPU node changed state.
    NodeStateChanged {
        node: crate::ids::NodeId,
        state: crate::scheduler::NodeState,
    },
    /// A soft budget was passed (or a hard one reached); once per period.
    BudgetAlert {
        scope: BudgetScope,
        limit_micro: u64,
        used_micro: u64,
    },
    /// A call refused at a node's edge (reported by `node`); the stamp's actor is the
    /// system, `caller` is who was refused.
    Denied {
        node: u64,
        caller: Actor,
        api: String,
        reason: crate::command::DenialReason,
    },
    // -- appended (the encoding is positional) --
    /// A closed bucket (nothing remaining, nothing held, no open hold drawn on it) left
    /// its account's list and the bucket table; its figures stay in the account's and
    /// the shard's archived totals.
    BucketArchived {
        bucket: BucketId,
    },
    /// The account's available credit fell below its alert's threshold (the event's
    /// account); once per crossing (`crate::alerts`).
    LowBalance {
        threshold_micro: u64,
        available_micro: u64,
    },
    /// A budget's use in its period reached `pct` percent of its limit; once per
    /// threshold per period (`crate::alerts`).
    BudgetThreshold {
        scope: BudgetScope,
        pct: u32,
        limit_micro: u64,
        used_micro: u64,
    },
}

/// An event before it is numbered and chained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingEvent {
    pub org: Option<OrgId>,
    pub account: Option<Account>,
    pub hold: Option<HoldId>,
    pub body: EventBody,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// Position in the shard's chain, from 0, without gaps.
    pub seq: u64,
    pub log_index: u64,
    pub time_ms: u64,
    pub actor: Actor,
    pub request_id: RequestId,
    /// Indexed references for queries by account, job and time range.
    pub org: Option<OrgId>,
    pub account: Option<Account>,
    pub hold: Option<HoldId>,
    pub body: EventBody,
    pub prev_hash: Hash32,
    pub hash: Hash32,
}

impl AuditEvent {
    /// The hash of this event's content chained onto `prev_hash`.
    pub fn compute_hash(&self, scratch: &mut Vec<u8>) -> Hash32 {
        scratch.clear();
        let header = (
            self.seq,
            self.log_index,
            self.time_ms,
            &self.actor,
            self.request_id,
            &self.org,
            &self.account,
            &self.hold,
        );
        crate::codec::encode_into(scratch, &header);
        let mut h = Sha256::new();
        h.update(self.prev_hash);
        match &self.body {
            EventBody::Command {
                request,
                digest,
                outcome,
                replayed,
            } => {
                // The digest goes to the hasher as bytes: encoding a [u8; 32] through
                // serde costs 32 calls for nothing.
                scratch.push(0);
                scratch.extend_from_slice(&request.to_le_bytes());
                scratch.extend_from_slice(digest);
                crate::codec::encode_into(scratch, &(outcome, replayed));
            }
            body => {
                scratch.push(1);
                crate::codec::encode_into(scratch, body);
            }
        }
        h.update(&scratch[..]);
        h.finalize().into()
    }
}

/// SHA-256 of a command's canonical encoding.
pub fn command_digest(command: &Command, scratch: &mut Vec<u8>) -> Hash32 {
    scratch.clear();
    crate::codec::encode_into(scratch, command);
    Sha256::digest(&scratch[..]).into()
}

/// The chain's head: the only audit data kept in the replicated state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditChain {
    pub next_seq: u64,
    pub head: Hash32,
}

/// Identity of the event being chained (shared by all events of one command).
pub(crate) struct Stamp {
    pub log_index: u64,
    pub time_ms: u64,
    pub actor: Actor,
    pub request_id: RequestId,
}

impl AuditChain {
    pub(crate) fn append(
        &mut self,
        stamp: &Stamp,
        pending: PendingEvent,
        out: &mut Vec<AuditEvent>,
        scratch: &mut Vec<u8>,
    ) {
        let mut ev = AuditEvent {
            seq: self.next_seq,
            log_index: stamp.log_index,
            time_ms: stamp.time_ms,
            actor: stamp.actor,
            request_id: stamp.request_id,
            org: pending.org,
            account: pending.account,
            hold: pending.hold,
            body: pending.body,
            prev_hash: self.head,
            hash: [0; 32],
        };
        ev.hash = ev.compute_hash(scratch);
        self.head = ev.hash;
        self.next_seq += 1;
        out.push(ev);
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("event {seq}: sequence gap (expected {expected})")]
    Gap { seq: u64, expected: u64 },
    #[error("event {seq}: prev_hash does not match the previous event")]
    BrokenLink { seq: u64 },
    #[error("event {seq}: hash does not match its content")]
    BadHash { seq: u64 },
}

/// Verifies a contiguous run of events starting from `start` (the chain state before
/// the first event). Returns the chain state after the last one.
pub fn verify_chain(start: &AuditChain, events: &[AuditEvent]) -> Result<AuditChain, ChainError> {
    let mut chain = start.clone();
    let mut scratch = Vec::new();
    for ev in events {
        if ev.seq != chain.next_seq {
            return Err(ChainError::Gap {
                seq: ev.seq,
                expected: chain.next_seq,
            });
        }
        if ev.prev_hash != chain.head {
            return Err(ChainError::BrokenLink { seq: ev.seq });
        }
        if ev.compute_hash(&mut scratch) != ev.hash {
            return Err(ChainError::BadHash { seq: ev.seq });
        }
        chain.head = ev.hash;
        chain.next_seq += 1;
    }
    Ok(chain)
}

/// Verifies a contiguous run of events that must *end* at `end` (the chain state right
/// after its last event): the last event's hash is `end.head`, each event's hash is its
/// content's and each links to the one before. Returns the chain state before the first
/// event — the anchor for the run before it. This is how rows copied from a peer are
/// checked from the back, against a head the replica already trusts (its state's, or
/// the first event it holds), so each row is proven as soon as it arrives.
pub fn verify_chain_back(
    end: &AuditChain,
    events: &[AuditEvent],
) -> Result<AuditChain, ChainError> {
    let mut chain = end.clone();
    let mut scratch = Vec::new();
    for ev in events.iter().rev() {
        if chain.next_seq == 0 || ev.seq != chain.next_seq - 1 {
            return Err(ChainError::Gap {
                seq: ev.seq,
                expected: chain.next_seq.wrapping_sub(1),
            });
        }
        if ev.hash != chain.head {
            return Err(ChainError::BrokenLink { seq: ev.seq });
        }
        if ev.compute_hash(&mut scratch) != ev.hash {
            return Err(ChainError::BadHash { seq: ev.seq });
        }
        chain = AuditChain {
            next_seq: ev.seq,
            head: ev.prev_hash,
        };
    }
    Ok(chain)
}

/// Checks that `entry` is the batch the command events of its index name: one command
/// event per request, in order, each with the request's id and its command's digest.
/// (`events` may hold other entries' events; those are ignored.)
pub fn verify_entry(
    entry: &crate::command::Entry,
    events: &[AuditEvent],
) -> Result<(), ChainError> {
    let mut scratch = Vec::new();
    let mut next = 0usize;
    for ev in events.iter().filter(|e| e.log_index == entry.log_index) {
        let EventBody::Command {
            request, digest, ..
        } = &ev.body
        else {
            continue;
        };
        let req = entry
            .requests
            .get(*request as usize)
            .filter(|_| *request as usize == next)
            .ok_or(ChainError::BadHash { seq: ev.seq })?;
        if req.request_id != ev.request_id || command_digest(&req.command, &mut scratch) != *digest
        {
            return Err(ChainError::BadHash { seq: ev.seq });
        }
        next += 1;
    }
    if next != entry.requests.len() {
        return Err(ChainError::Gap {
            seq: next as u64,
            expected: entry.requests.len() as u64,
        });
    }
    Ok(())
}

/// The command a command event refers to, from the entry it was applied in.
pub fn command_of<'a>(event: &AuditEvent, entry: &'a crate::command::Entry) -> Option<&'a Command> {
    match event.body {
        EventBody::Command { request, .. } if event.log_index == entry.log_index => {
            entry.requests.get(request as usize).map(|r| &r.command)
        }
        _ => None,
    }
}

/// Checks that every command event's digest matches the command at its position in
/// `entries` (the log, or the commands an audit store persisted beside the events).
pub fn verify_commands(
    events: &[AuditEvent],
    entries: &[crate::command::Entry],
) -> Result<(), ChainError> {
    let mut scratch = Vec::new();
    let by_index: std::collections::BTreeMap<u64, &crate::command::Entry> =
        entries.iter().map(|e| (e.log_index, e)).collect();
    for ev in events {
        let EventBody::Command { digest, .. } = &ev.body else {
            continue;
        };
        let entry = by_index.get(&ev.log_index).copied();
        let command = entry
            .and_then(|e| command_of(ev, e))
            .ok_or(ChainError::BadHash { seq: ev.seq })?;
        if command_digest(command, &mut scratch) != *digest {
            return Err(ChainError::BadHash { seq: ev.seq });
        }
    }
    Ok(())
}
