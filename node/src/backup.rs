//! Backup and restore of shards (DESIGN §41). A backup is a consistent copy of one shard
//! taken on any replica that applied its whole history: the state at its applied index
//! (cloned under the read lock, as a snapshot is), the Raft position and voters at that
//! index, and the shard's audit rows up to it — `allot_statemachine::backup::ShardBackup`.
//! A restore seeds an empty data dir with such copies, so a node started on it loads the
//! state as its snapshot, continues the log after the backed-up index, and serves the
//! whole audit trail.

use crate::node::{Node, Shard};
use crate::store::{self, audit_key, AUDIT_BATCHES, AUDIT_EVENTS, CF_AUDIT};
use crate::types::{LogId, SnapshotMeta, StoredMembership, Vote};
use allot_statemachine::backup::{AuditRow, AuditRowKind, LogPosition, ShardBackup};
use anyhow::{bail, Context};
use openraft::{BasicNode, CommittedLeaderId, Membership};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("this replica lacks audit rows {0}: take the backup on another replica")]
    AuditGap(String),
    #[error("storage: {0}")]
    Storage(String),
}

/// Copies one shard. The state is cloned under the apply lock (O(1) for the large
/// history tables); the audit rows are read afterwards and cut at the copied state's
/// chain head and applied index, so rows of entries applied meanwhile are left out.
pub fn take(node: &Node, shard: &Shard) -> Result<ShardBackup, BackupError> {
    let (state, last_applied, membership) = {
        let g = shard.view.read();
        (g.state.clone(), g.last_applied, g.membership.clone())
    };
    let members: Vec<(u64, String)> = {
        let m = membership.membership();
        m.voter_ids()
            .map(|id| {
                let addr = m.get_node(&id).map(|n| n.addr.clone()).unwrap_or_default();
                (id, addr)
            })
            .collect()
    };
    let applied = last_applied.map_or(0, |l| l.index);
    let audit = audit_rows(node, shard.id, state.audit.next_seq, applied)?;
    Ok(ShardBackup {
        shard: shard.id,
        shards: node.shards.len() as u32,
        position: last_applied.map(|l| LogPosition {
            term: l.leader_id.term,
            index: l.index,
        }),
        members,
        state_hash: state.state_hash(),
        logical_time_ms: state.time_ms,
        state: state.encode(),
        audit,
    })
}

/// The shard's audit rows: event rows whose events precede `next_seq`, batch rows of
/// entries up to `applied`, each kind in key order. The event rows must start at 0 and
/// be contiguous (a replica that installed a snapshot has none for what it covers).
fn audit_rows(
    node: &Node,
    shard: u32,
    next_seq: u64,
    applied: u64,
) -> Result<Vec<AuditRow>, BackupError> {
    let db = &node.db;
    let audit = store::cf(db, CF_AUDIT);
    let mut rows = Vec::new();
    for (space, kind, end) in [
        (AUDIT_EVENTS, AuditRowKind::Events, next_seq),
        (
            AUDIT_BATCHES,
            AuditRowKind::Batch,
            applied.saturating_add(1),
        ),
    ] {
        let from = audit_key(shard, space, 0);
        let to = audit_key(shard, space, end);
        let mut expected_seq = 0u64;
        for item in db.iterator_cf(
            audit,
            rocksdb::IteratorMode::From(&from, rocksdb::Direction::Forward),
        ) {
            let (k, v) = item.map_err(|e| BackupError::Storage(e.to_string()))?;
            if k.as_ref() >= to.as_slice() {
                break;
            }
            let key = store::index_of_key(&k);
            if kind == AuditRowKind::Events {
                if key != expected_seq {
                    return Err(BackupError::AuditGap(format!("{expected_seq}..{key}")));
                }
                let events: Vec<allot_statemachine::AuditEvent> =
                    allot_statemachine::codec::decode(&v)
                        .map_err(|e| BackupError::Storage(format!("audit row {key}: {e}")))?;
                expected_seq = key + events.len() as u64;
            }
            rows.push(AuditRow {
                kind,
                key,
                value: v.to_vec(),
            });
        }
        if kind == AuditRowKind::Events && expected_seq != next_seq {
            return Err(BackupError::AuditGap(format!("{expected_seq}..{next_seq}")));
        }
    }
    Ok(rows)
}

/// Seeds the data dir of node `node_id` with `backups` (one per shard, every shard of a
/// `shards`-shard cluster). Each backup is verified first (state hash, invariants, the
/// audit chain up to the state's head). `members` replaces the backed-up voters (a
/// cluster restored on other hosts); every node of the new cluster is seeded from the
/// same files with the same members. Refuses a data dir that already holds any shard.
pub fn restore(
    data_dir: &Path,
    node_id: u64,
    shards: u32,
    backups: &[ShardBackup],
    members: Option<&[(u64, String)]>,
) -> anyhow::Result<()> {
    let mut by_shard = BTreeMap::new();
    let mut states = Vec::new();
    for b in backups {
        let (state, _) = b
            .verify()
            .with_context(|| format!("backup of shard {}", b.shard))?;
        if b.shards != shards {
            bail!(
                "the backup of shard {} comes from a {}-shard cluster; restoring {shards}",
                b.shard,
                b.shards
            );
        }
        if by_shard.insert(b.shard, b).is_some() {
            bail!("two backups of shard {}", b.shard);
        }
        states.push(state);
    }
    let missing: Vec<u32> = (0..shards).filter(|s| !by_shard.contains_key(s)).collect();
    if !missing.is_empty() {
        bail!("no backup of shard(s) {missing:?}");
    }
    let refs: Vec<&allot_statemachine::State> = states.iter().collect();
    let drift = allot_statemachine::backup::token_disagreements(&refs);
    if !drift.is_empty() {
        bail!(
            "the shards' token tables disagree on principals {drift:?} (a token was created, \
             rotated or revoked while the shards were copied one by one): take the backup \
             again"
        );
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let db = store::open_db(&data_dir.join("db"))
        .with_context(|| format!("opening RocksDB in {}", data_dir.display()))?;
    for s in 0..shards {
        if store::has_snapshot(&db, s)? || !store::log::is_pristine(&db, s)? {
            bail!(
                "{} already holds shard {s}: restore into an empty data dir",
                data_dir.display()
            );
        }
    }
    crate::node::check_shard_count(&db, shards)?;
    // Each shard in one synced batch — audit rows, snapshot, log metadata — so a crash
    // leaves the shard either restored or untouched (and a rerun refused or allowed
    // accordingly), never a snapshot without its vote and purge point.
    for (shard, b) in by_shard {
        let voters: Vec<(u64, String)> = match members {
            Some(m) => m.to_vec(),
            None => b.members.clone(),
        };
        if !voters.iter().any(|(id, _)| *id == node_id) {
            bail!("node {node_id} is not among the voters {voters:?} of shard {shard}");
        }
        let last = b
            .position
            .map(|p| LogId::new(CommittedLeaderId::new(p.term, 0), p.index));
        let ids: BTreeSet<u64> = voters.iter().map(|(id, _)| *id).collect();
        let nodes: BTreeMap<u64, BasicNode> = voters
            .iter()
            .map(|(id, addr)| (*id, BasicNode::new(addr.clone())))
            .collect();
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: StoredMembership::new(last, Membership::new(vec![ids], nodes)),
            snapshot_id: format!("restored-{shard}-{}", last.map_or(0, |l| l.index)),
        };
        let audit = store::cf(&db, CF_AUDIT);
        let mut batch = rocksdb::WriteBatch::default();
        for row in &b.audit {
            let space = match row.kind {
                AuditRowKind::Events => AUDIT_EVENTS,
                AuditRowKind::Batch => AUDIT_BATCHES,
            };
            batch.put_cf(audit, audit_key(shard, space, row.key), &row.value);
        }
        store::put_snapshot(&mut batch, &db, shard, meta, b.state.clone())?;
        if let Some(last) = last {
            let vote = Vote::new(last.leader_id.term, node_id);
            store::log::put_restored_meta(&mut batch, &db, shard, last, vote)?;
        }
        store::log::write_synced(&db, batch)?;
    }
    Ok(())
}
