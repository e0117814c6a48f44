//! The backup format of one shard: its state at an applied log index (the encoding a
//! Raft snapshot carries), where that index sits in the Raft log, the shard's membership,
//! and its audit rows — so a restored cluster continues the same ledger *and* still
//! serves and verifies its whole audit trail. Pure data and checks; taking a backup and
//! restoring one (RocksDB, Raft metadata) is the node's job (`node/src/backup.rs`).
//!
//! A backup file is streamed ([`stream`]: framed, checksummed, read and written in
//! bounded pieces). The releases before it wrote one `codec::encode(&ShardBackup)`, which
//! every reader here still accepts.

pub mod stream;
pub use stream::{
    read_verified, write_streamed, BackupHeader, BackupReader, BackupWriter, VerifiedBackup,
};

use crate::audit::{verify_chain, verify_commands, AuditChain, AuditEvent};
use crate::codec::{self, CodecError};
use crate::command::Entry;
use crate::ids::{PrincipalId, TokenDigest};
use crate::invariants::check_invariants;
use crate::state::State;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// The Raft log position a backup's state reflects: the last applied entry's term and
/// index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogPosition {
    pub term: u64,
    pub index: u64,
}

/// Which audit key space a row belongs to (the node's audit store layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AuditRowKind {
    /// The events of one entry (codec of `Vec<AuditEvent>`), keyed by the first event's
    /// sequence number.
    Events,
    /// The commands of one entry (codec of `Entry`), keyed by its log index.
    Batch,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRow {
    pub kind: AuditRowKind,
    pub key: u64,
    pub value: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardBackup {
    pub shard: u32,
    /// The cluster's shard count (a restore must start with the same).
    pub shards: u32,
    /// `None`: the shard had applied nothing yet.
    pub position: Option<LogPosition>,
    /// The voters at that position: (node id, address).
    pub members: Vec<(u64, String)>,
    /// `State::encode()` at `position`.
    pub state: Vec<u8>,
    /// `State::state_hash()` of that state.
    pub state_hash: [u8; 32],
    pub logical_time_ms: u64,
    /// Every audit row of the shard up to `position`, in key order per kind.
    pub audit: Vec<AuditRow>,
}

/// What a verified backup holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupSummary {
    pub shard: u32,
    pub position: Option<LogPosition>,
    pub state_hash: [u8; 32],
    pub logical_time_ms: u64,
    pub audit_events: u64,
    pub audit_batches: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackupError {
    #[error("not a backup: {0}")]
    Codec(#[from] CodecError),
    #[error("the state does not decode: {0}")]
    State(String),
    #[error("the state's hash does not match the one recorded")]
    HashMismatch,
    #[error("the state breaks an invariant: {0}")]
    Invariant(String),
    #[error("shard {shard} is out of range for {shards} shards")]
    ShardOutOfRange { shard: u32, shards: u32 },
    #[error("audit row {key}: {problem}")]
    AuditRow { key: u64, problem: String },
    #[error("the audit trail does not verify: {0}")]
    AuditChain(String),
    #[error("the audit trail ends at event {found}, the state's chain at {expected}")]
    AuditIncomplete { found: u64, expected: u64 },
    #[error("the audit trail's commands do not match their events: {0}")]
    AuditCommands(String),
    #[error("the backup is truncated (it ends before its end record): copy it again")]
    Truncated,
    #[error("the backup's checksum does not match its content: the file is corrupted")]
    Checksum,
    #[error("the backup is malformed: {0}")]
    Frame(String),
    #[error(
        "the backup was written in layout {0} by a newer release: restore it with that release"
    )]
    NewerLayout(u8),
    #[error("the state disagrees with the backup's header on its {0}")]
    HeaderMismatch(&'static str),
    #[error("reading the backup: {0}")]
    Io(String),
}

impl ShardBackup {
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Reads a backup file of either layout whole (streamed: checked as it is read).
    pub fn decode(bytes: &[u8]) -> Result<ShardBackup, BackupError> {
        if stream::is_streamed(bytes) {
            return stream::read_whole(bytes);
        }
        Ok(codec::decode(bytes)?)
    }

    /// The streamed layout of this backup (what `allotctl backup create` writes).
    pub fn encode_streamed(&self) -> Result<Vec<u8>, BackupError> {
        stream::write_streamed(self, Vec::new(), stream::FRAME_TARGET)
    }

    /// Checks everything a restore relies on: the state decodes to the recorded hash and
    /// passes the invariant check, and the audit rows form the shard's hash chain from
    /// genesis up to exactly the state's chain head (no event missing, none edited).
    /// Returns the decoded state.
    pub fn verify(&self) -> Result<(State, BackupSummary), BackupError> {
        if self.shard >= self.shards {
            return Err(BackupError::ShardOutOfRange {
                shard: self.shard,
                shards: self.shards,
            });
        }
        let state = State::decode(&self.state).map_err(|e| BackupError::State(e.to_string()))?;
        if state.state_hash() != self.state_hash {
            return Err(BackupError::HashMismatch);
        }
        check_invariants(&state).map_err(|v| BackupError::Invariant(v.to_string()))?;
        let mut chain = AuditChain::default();
        let mut events: Vec<AuditEvent> = Vec::new();
        let mut entries: Vec<Entry> = Vec::new();
        let row_error = |key: u64, problem: String| BackupError::AuditRow { key, problem };
        for row in &self.audit {
            match row.kind {
                AuditRowKind::Events => {
                    let evs: Vec<AuditEvent> = codec::decode_kept(&row.value)
                        .map_err(|e| row_error(row.key, e.to_string()))?;
                    if evs.first().map(|e| e.seq) != Some(row.key) {
                        return Err(row_error(
                            row.key,
                            "keyed by another event than its first".into(),
                        ));
                    }
                    chain = verify_chain(&chain, &evs)
                        .map_err(|e| BackupError::AuditChain(format!("{e:?}")))?;
                    events.extend(evs);
                }
                AuditRowKind::Batch => {
                    let entry: Entry = codec::decode_kept(&row.value)
                        .map_err(|e| row_error(row.key, e.to_string()))?;
                    let beyond = self.position.is_none_or(|p| entry.log_index > p.index);
                    if entry.log_index != row.key || beyond {
                        return Err(row_error(
                            row.key,
                            format!("holds the commands of entry {}", entry.log_index),
                        ));
                    }
                    entries.push(entry);
                }
            }
        }
        if chain != state.audit {
            return Err(BackupError::AuditIncomplete {
                found: chain.next_seq,
                expected: state.audit.next_seq,
            });
        }
        // Every command event's digest binds the command it names in its entry.
        verify_commands(&events, &entries)
            .map_err(|e| BackupError::AuditCommands(format!("{e:?}")))?;
        let (events, batches) = (events.len() as u64, entries.len() as u64);
        let summary = BackupSummary {
            shard: self.shard,
            position: self.position,
            state_hash: self.state_hash,
            logical_time_ms: self.logical_time_ms,
            audit_events: events,
            audit_batches: batches,
        };
        Ok((state, summary))
    }
}

/// Per operator principal: revoked, and its key digests.
pub type TokenView = BTreeMap<PrincipalId, (bool, BTreeSet<TokenDigest>)>;

/// Who holds which of the operator's tokens (admin and agent principals: the ones
/// installed on every shard), as one shard's token table says (key expiry instants left
/// out: they are stamped by each shard's own logical time). An org's own principals live
/// only on its home shard, so they are not compared.
pub fn token_view(state: &State) -> TokenView {
    state
        .security
        .principals
        .iter()
        .filter(|((org, _), _)| org.is_none())
        .map(|((_, id), p)| (*id, (p.revoked, p.keys.iter().map(|k| k.digest).collect())))
        .collect()
}

/// Tokens are created, rotated and revoked on every shard in turn, so the shards of one
/// backup, copied one after another, can disagree if a token command ran in between —
/// and a restore would then bring back, on some shards, a token revoked on others.
/// Returns the principals the shards disagree on (empty: they agree).
pub fn token_disagreements(states: &[&State]) -> Vec<PrincipalId> {
    let views: Vec<TokenView> = states.iter().map(|s| token_view(s)).collect();
    views_disagree(&views)
}

/// [`token_disagreements`] of views already taken (backup headers).
pub fn views_disagree(views: &[TokenView]) -> Vec<PrincipalId> {
    let mut ids: BTreeSet<PrincipalId> = BTreeSet::new();
    for v in views {
        ids.extend(v.keys().copied());
    }
    ids.into_iter()
        .filter(|id| views.windows(2).any(|w| w[0].get(id) != w[1].get(id)))
        .collect()
}
