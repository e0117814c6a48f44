//! Backup and restore of shards (DESIGN §41). A backup is a consistent copy of one shard
//! taken on any replica that holds its whole audit trail: the state at its applied index
//! (cloned under the read lock, as a snapshot is), the Raft position and voters at that
//! index, and the shard's audit rows up to it, written as a stream
//! (`allot_statemachine::backup::stream`): nothing here holds the audit trail or the
//! state's encoding whole. A restore builds a new data dir from one backup file per shard
//! — the same set on every node — so a node started on it loads the state as its
//! snapshot, continues the log after the backed-up index, and serves the whole trail.

use crate::limits::{INDEX_MAX, SHARDS_MAX, TERM_MAX};
use crate::node::{Node, Shard};
use crate::store::{self, audit_key, AUDIT_BATCHES, AUDIT_EVENTS, CF_AUDIT};
use crate::types::{LogId, SnapshotMeta, StoredMembership, Vote};
use allot_statemachine::backup::stream::{merge_rows, ReadError};
use allot_statemachine::backup::{
    self as format, AuditRow, AuditRowKind, BackupHeader, BackupSummary, BackupWriter, LogPosition,
    TokenView,
};
use allot_statemachine::State;
use openraft::{BasicNode, CommittedLeaderId, Membership};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("this replica lacks audit rows {0}: take the backup on another replica")]
    AuditGap(String),
    #[error("storage: {0}")]
    Storage(String),
    /// The receiver went away (the client hung up) or the output failed.
    #[error("writing the backup: {0}")]
    Output(std::io::Error),
}

impl From<format::BackupError> for BackupError {
    fn from(e: format::BackupError) -> BackupError {
        BackupError::Storage(e.to_string())
    }
}

/// A shard's copy, fixed and checked for coverage, not yet written.
pub struct Prepared {
    state: State,
    header: BackupHeader,
    applied: u64,
}

/// Fixes the copy of `shard`: its state cloned under the apply lock (O(1) for the large
/// history tables), and refuses (`AuditGap`) a replica whose event rows do not reach the
/// state's chain head from sequence 0 — before a byte is sent, so the client asks the
/// next replica. The scan starts at the replica's verified checkpoint.
pub fn prepare(node: &Node, shard: &Shard) -> Result<Prepared, BackupError> {
    let (state, last_applied, membership) = {
        let g = shard.view.read();
        (g.state.clone(), g.last_applied, g.membership.clone())
    };
    if let Some(gap) =
        crate::audit_fill::scan(&node.db, shard.id, &state.audit).map_err(BackupError::Storage)?
    {
        return Err(BackupError::AuditGap(format!(
            "{}..{}",
            gap.start.next_seq, gap.end.next_seq
        )));
    }
    let m = membership.membership();
    let members: Vec<(u64, String)> = m
        .voter_ids()
        .map(|id| {
            let addr = m.get_node(&id).map(|n| n.addr.clone()).unwrap_or_default();
            (id, addr)
        })
        .collect();
    let position = last_applied.map(|l| LogPosition {
        term: l.leader_id.term,
        index: l.index,
    });
    let header = BackupHeader::of(
        &state,
        shard.id,
        node.shards.len() as u32,
        position,
        members,
    );
    Ok(Prepared {
        state,
        header,
        applied: last_applied.map_or(0, |l| l.index),
    })
}

impl Prepared {
    /// Streams the copy into `out`: the state encoded as it goes, then the audit rows
    /// read from the store in log order (event rows before the state's chain head, batch
    /// rows up to the applied index: rows of entries applied since are left out).
    pub fn write<W: Write>(self, node: &Node, out: W) -> Result<W, BackupError> {
        let Prepared {
            state,
            header,
            applied,
        } = self;
        let mut w = BackupWriter::start(out, &header).map_err(BackupError::Output)?;
        w.state(&state).map_err(BackupError::Output)?;
        let next_seq = state.audit.next_seq;
        drop(state);
        let db = &node.db;
        let audit = store::cf(db, CF_AUDIT);
        let shard = header.shard;
        let rows = |space: u8, kind: AuditRowKind, end: u64| {
            let from = audit_key(shard, space, 0);
            let to = audit_key(shard, space, end);
            db.iterator_cf(
                audit,
                rocksdb::IteratorMode::From(&from, rocksdb::Direction::Forward),
            )
            .map(|item| item.map_err(|e| BackupError::Storage(e.to_string())))
            .take_while(move |item| {
                item.as_ref()
                    .map_or(true, |(k, _)| k.as_ref() < to.as_slice())
            })
            .map(move |item| {
                item.map(|(k, v)| AuditRow {
                    kind,
                    key: store::index_of_key(&k),
                    value: v.to_vec(),
                })
            })
        };
        let events = rows(AUDIT_EVENTS, AuditRowKind::Events, next_seq);
        let batches = rows(
            AUDIT_BATCHES,
            AuditRowKind::Batch,
            applied.saturating_add(1),
        );
        for row in merge_rows(events, batches) {
            w.audit_row(row?).map_err(BackupError::Output)?;
        }
        w.finish().map_err(BackupError::Output)
    }
}

/// Why a restore refused. Nothing outside the new data dir's staging dir was written,
/// and that dir is removed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(
        "{0} is not empty: a restore creates a new data dir and never writes into one that \
         holds anything (move it away or name another)"
    )]
    NotEmpty(PathBuf),
    #[error("{file}: {source}")]
    Backup {
        file: PathBuf,
        source: format::BackupError,
    },
    #[error("{0}")]
    Set(String),
    #[error("{0}")]
    Storage(String),
}

/// What one shard's restore installed.
pub struct Restored {
    /// The restored cluster's id (`crate::identity`), the same in every shard's.
    pub cluster: crate::identity::ClusterId,
    pub file: PathBuf,
    pub summary: BackupSummary,
    pub rows: u64,
    pub shards: u32,
}

/// Audit rows go to the store in batches of about this many bytes (unsynced; the
/// shard's last batch is synced, and syncs the WAL before it).
const RESTORE_BATCH_BYTES: usize = 4 << 20;

/// Builds the data dir `data_dir` of node `node_id` from `files`: one backup per shard
/// of the cluster, the same set on every node. Each file is read once, as a stream, and
/// checked whole (checksum, state hash, audit chain and commands, invariants, the state
/// against its header) before its shard is installed; the set must cover every shard of
/// one cluster, once, with agreeing operator tokens. `members` replaces the backed-up
/// voters (a cluster restored on other hosts).
///
/// `data_dir` must not exist or be empty. Where it does not exist the restore is built in
/// `<data_dir>.restoring` (removed first if an interrupted restore left it) and renamed
/// into place when every shard is in and synced. Where it exists — empty, often a mount
/// point, which cannot be renamed over and may be another filesystem than its parent —
/// the restore is built inside it, in [`INSIDE_STAGING`] (an interrupted restore's
/// leftover removed first), and its entries are moved up when complete, the format
/// marker last; a node refuses to start on a dir that still holds the staging. So a
/// refusal or a crash during the copy leaves `data_dir` as it was (or holding only the
/// staging), and nothing is copied before the install is known to be possible.
pub fn restore(
    data_dir: &Path,
    node_id: u64,
    files: &[PathBuf],
    members: Option<&[(u64, String)]>,
) -> Result<Vec<Restored>, RestoreError> {
    let exists = data_dir.exists();
    // A restore that had completed its copy and was moving it up: finished, and the dir
    // is then not empty.
    if exists && finish_install(data_dir).map_err(storage)? {
        return Err(RestoreError::NotEmpty(data_dir.to_path_buf()));
    }
    if exists {
        let entries = std::fs::read_dir(data_dir)
            .map_err(|_| RestoreError::NotEmpty(data_dir.to_path_buf()))?;
        for e in entries {
            let e = e.map_err(storage)?;
            // An interrupted restore's unfinished staging may be there (removed below),
            // and a new filesystem's `lost+found` (left in place).
            if e.file_name() != INSIDE_STAGING && e.file_name() != "lost+found" {
                return Err(RestoreError::NotEmpty(data_dir.to_path_buf()));
            }
        }
    }
    if files.is_empty() {
        return Err(RestoreError::Set("no backup files".into()));
    }
    let staging = if exists {
        data_dir.join(INSIDE_STAGING)
    } else {
        staging_dir(data_dir)?
    };
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(storage)?;
    }
    std::fs::create_dir_all(&staging).map_err(storage)?;
    let installed = build(&staging, node_id, files, members).and_then(|restored| {
        crate::versions::mark_data_dir(&staging, crate::versions::START_FORMAT)
            .and_then(|()| install(&staging, data_dir, exists))
            .map_err(|e| storage(format!("installing {}: {e:#}", data_dir.display())))?;
        Ok(restored)
    });
    // A staging marked complete is moved up by the next restore or start, never lost.
    if installed.is_err() && !staging.join(STAGING_COMPLETE).exists() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    installed
}

/// In a staging dir inside the data dir: the copy is complete and synced, the entries
/// may be moved up.
const STAGING_COMPLETE: &str = "COMPLETE";

/// Finishes moving up a restore into an existing dir that had completed its copy
/// (its staging holds [`STAGING_COMPLETE`]): `Ok(true)` when there was one. Each entry
/// is renamed (atomic), so each is either still staged or in place; the format marker
/// goes last. A staging without the sentinel is left (a node refuses to start on it; a
/// restore removes it and copies again).
pub fn finish_install(data_dir: &Path) -> anyhow::Result<bool> {
    let staging = data_dir.join(INSIDE_STAGING);
    if !staging.join(STAGING_COMPLETE).exists() {
        // Stopped after the sentinel's removal, before the staging's: every entry is in
        // place (the format marker moved last).
        let emptied = staging.is_dir()
            && std::fs::read_dir(&staging)?.next().is_none()
            && data_dir.join(crate::versions::FORMAT_FILE).exists();
        if emptied {
            std::fs::remove_dir(&staging)?;
            std::fs::File::open(data_dir)?.sync_all()?;
        }
        return Ok(emptied);
    }
    let marker = crate::versions::FORMAT_FILE;
    let mut names: Vec<std::ffi::OsString> = std::fs::read_dir(&staging)?
        .map(|e| e.map(|e| e.file_name()))
        .filter(|n| n.as_ref().map_or(true, |n| n != STAGING_COMPLETE))
        .collect::<Result<_, _>>()?;
    names.sort_by_key(|n| n == marker);
    for name in names {
        std::fs::rename(staging.join(&name), data_dir.join(&name))?;
    }
    std::fs::File::open(data_dir)?.sync_all()?;
    std::fs::remove_file(staging.join(STAGING_COMPLETE))?;
    std::fs::remove_dir(&staging)?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(true)
}

/// The staging dir of a restore into an existing (empty) data dir, inside it.
pub const INSIDE_STAGING: &str = ".restoring";

/// Puts the complete, synced `staging` in place as `data_dir`.
fn install(staging: &Path, data_dir: &Path, exists: bool) -> anyhow::Result<()> {
    if !exists {
        if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        // Where none was: atomic on one filesystem (the staging is its sibling).
        std::fs::rename(staging, data_dir)?;
        let parent = data_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::File::open(parent)?.sync_all()?;
        return Ok(());
    }
    // Inside an existing dir: marked complete (synced), then each entry moved up (one
    // filesystem), the format marker last, then the staging removed. A crash or error
    // in between is finished by the next start or restore (`finish_install`).
    let complete = staging.join(STAGING_COMPLETE);
    std::fs::write(&complete, b"")?;
    std::fs::File::open(&complete)?.sync_all()?;
    std::fs::File::open(staging)?.sync_all()?;
    finish_install(data_dir)?;
    Ok(())
}

fn storage(e: impl std::fmt::Display) -> RestoreError {
    RestoreError::Storage(e.to_string())
}

fn staging_dir(data_dir: &Path) -> Result<PathBuf, RestoreError> {
    let name = data_dir
        .file_name()
        .ok_or_else(|| RestoreError::Set(format!("{} names no directory", data_dir.display())))?;
    let mut staged = name.to_os_string();
    staged.push(".restoring");
    Ok(data_dir.with_file_name(staged))
}

fn build(
    dir: &Path,
    node_id: u64,
    files: &[PathBuf],
    members: Option<&[(u64, String)]>,
) -> Result<Vec<Restored>, RestoreError> {
    let db = store::open_db(&dir.join("db")).map_err(storage)?;
    let mut restored: Vec<Restored> = Vec::new();
    let mut tokens: Vec<TokenView> = Vec::new();
    let mut seen: BTreeMap<u32, PathBuf> = BTreeMap::new();
    for file in files {
        let (r, view) = restore_shard(&db, node_id, file, members)?;
        if let Some(first) = restored.first() {
            if first.shards != r.shards {
                return Err(RestoreError::Set(format!(
                    "{} is of a {}-shard cluster, {} of a {}-shard one",
                    file.display(),
                    r.shards,
                    first.file.display(),
                    first.shards
                )));
            }
        }
        if let Some(other) = seen.insert(r.summary.shard, file.clone()) {
            return Err(RestoreError::Set(format!(
                "{} and {} are both of shard {}",
                other.display(),
                file.display(),
                r.summary.shard
            )));
        }
        tokens.push(view);
        restored.push(r);
    }
    let shards = restored[0].shards;
    let missing: Vec<u32> = (0..shards).filter(|s| !seen.contains_key(s)).collect();
    if !missing.is_empty() {
        return Err(RestoreError::Set(format!(
            "no backup of shard(s) {missing:?} of the {shards}-shard cluster"
        )));
    }
    let drift = format::views_disagree(&tokens);
    if !drift.is_empty() {
        return Err(RestoreError::Set(format!(
            "the shards' token tables disagree on principals {drift:?} (a token was created, \
             rotated or revoked while the shards were copied one by one): take the backup \
             again"
        )));
    }
    crate::node::check_shard_count(&db, shards).map_err(storage)?;
    // The restored cluster is a cluster of its own (`crate::identity`): every node
    // restored from this set with these members has this id, any other is refused.
    let id = crate::identity::of_restore(
        restored.iter().map(|r| {
            let (term, index) = r.summary.position.map_or((0, 0), |p| (p.term, p.index));
            (r.summary.shard, term, index, &r.summary.state_hash[..])
        }),
        members.map(|m| m.iter().map(|(id, addr)| (*id, addr.as_str()))),
    );
    crate::identity::store(&db, &id).map_err(storage)?;
    for r in &mut restored {
        r.cluster = id;
    }
    db.flush_wal(true).map_err(storage)?;
    Ok(restored)
}

/// Reads one backup file into `db`: its audit rows as they stream by, then (checked
/// whole) its snapshot and log metadata in one synced batch.
fn restore_shard(
    db: &rocksdb::DB,
    node_id: u64,
    file: &Path,
    members: Option<&[(u64, String)]>,
) -> Result<(Restored, TokenView), RestoreError> {
    let input = std::fs::File::open(file)
        .map_err(|e| storage(format!("reading {}: {e}", file.display())))?;
    let audit = store::cf(db, CF_AUDIT);
    let mut batch = rocksdb::WriteBatch::default();
    let mut rows = 0u64;
    // The shard is only known from the header, which comes with the first read; rows
    // are keyed once it is (the reader hands rows only after the header).
    let shard_of = std::cell::Cell::new(None::<u32>);
    let mut put = |chunk: &[AuditRow]| -> Result<(), String> {
        let shard = shard_of.get().ok_or("rows before the header")?;
        for row in chunk {
            let space = match row.kind {
                AuditRowKind::Events => AUDIT_EVENTS,
                AuditRowKind::Batch => AUDIT_BATCHES,
            };
            batch.put_cf(audit, audit_key(shard, space, row.key), &row.value);
            rows += 1;
        }
        if batch.size_in_bytes() >= RESTORE_BATCH_BYTES {
            db.write(std::mem::take(&mut batch))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let verified = format::stream::read_verified_with(
        std::io::BufReader::with_capacity(1 << 20, input),
        |h| shard_of.set(Some(h.shard)),
        &mut put,
    )
    .map_err(|e| match e {
        ReadError::Backup(source) => RestoreError::Backup {
            file: file.to_path_buf(),
            source,
        },
        ReadError::Sink(e) => storage(e),
    })?;
    let h = &verified.header;
    let shard = h.shard;
    // The header is the file's word, checksummed but not signed: what it says about the
    // cluster and the log is bounded as a peer's word is, before a Raft group starts on it
    // (openraft computes `term + 1` and `index + 1` unchecked).
    if h.shards > SHARDS_MAX {
        return Err(RestoreError::Set(format!(
            "{} is of a {}-shard cluster; a cluster has at most {SHARDS_MAX}",
            file.display(),
            h.shards
        )));
    }
    if let Some(p) = h
        .position
        .filter(|p| p.term > TERM_MAX || p.index > INDEX_MAX)
    {
        return Err(RestoreError::Set(format!(
            "{} names log position term {} index {}, beyond what a cluster reaches \
             (term and index at most {TERM_MAX})",
            file.display(),
            p.term,
            p.index
        )));
    }
    crate::versions::check_rules(
        shard,
        h.rules_active,
        allot_statemachine::version::RULES_MAX,
    )
    .map_err(|e| RestoreError::Set(format!("{}: {e:#}", file.display())))?;
    let voters: Vec<(u64, String)> = match members {
        Some(m) => m.to_vec(),
        None => h.members.clone(),
    };
    if !voters.iter().any(|(id, _)| *id == node_id) {
        return Err(RestoreError::Set(format!(
            "node {node_id} is not among the voters {voters:?} of shard {shard} (pass \
             --member for each voter of the restored cluster)"
        )));
    }
    let last = h
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
    // The snapshot and log metadata in one synced batch with the last rows: the shard
    // is installed whole or not at all (and the staging dir is discarded on failure).
    store::put_snapshot(&mut batch, db, shard, meta, verified.state).map_err(storage)?;
    if let Some(last) = last {
        let vote = Vote::new(last.leader_id.term, node_id);
        store::log::put_restored_meta(&mut batch, db, shard, last, vote).map_err(storage)?;
    }
    store::log::write_synced(db, batch).map_err(storage)?;
    Ok((
        Restored {
            // Known once the whole set is in (`build`).
            cluster: Default::default(),
            file: file.to_path_buf(),
            summary: verified.summary,
            rows,
            shards: h.shards,
        },
        h.tokens.clone(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_statemachine::backup::stream::{BackupHeader, BackupWriter};
    use allot_statemachine::backup::LogPosition;

    /// A backup file of an empty shard whose header names `shards` and `position`:
    /// well formed, checksummed, its state agreeing with its header.
    fn file_with(dir: &Path, shards: u32, position: Option<LogPosition>) -> PathBuf {
        let state = State::default();
        let members = vec![(1, "127.0.0.1:1".to_string())];
        let header = BackupHeader::of(&state, 0, shards, position, members);
        let mut w = BackupWriter::start(Vec::new(), &header).unwrap();
        w.state(&state).unwrap();
        let path = dir.join(format!("b-{shards}-{position:?}"));
        std::fs::write(&path, w.finish().unwrap()).unwrap();
        path
    }

    /// A header's log position and shard count are bounded before a Raft group starts on
    /// them: a term of `u64::MAX` restored cleanly before and panicked at the node's
    /// first election (`term + 1`); a shard count of `u32::MAX` made the check for
    /// missing shards list four billion of them. The bounds themselves restore.
    #[test]
    fn a_backup_header_beyond_a_clusters_bounds_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let refused = |file: PathBuf, why: &str| {
            let data = dir.path().join(format!("data-{why}"));
            let Err(e) = restore(&data, 1, &[file], None) else {
                panic!("restored: {why}");
            };
            assert!(e.to_string().contains(why), "{e}");
            assert!(!data.exists(), "nothing installed");
        };
        let at = |term, index| Some(LogPosition { term, index });
        refused(file_with(dir.path(), 1, at(u64::MAX, 0)), "log position");
        refused(
            file_with(dir.path(), 1, at(1, INDEX_MAX + 1)),
            "log position",
        );
        refused(file_with(dir.path(), SHARDS_MAX + 1, at(1, 1)), "at most");
        let data = dir.path().join("data-ok");
        restore(
            &data,
            1,
            &[file_with(dir.path(), 1, at(TERM_MAX, INDEX_MAX))],
            None,
        )
        .expect("the bounds themselves restore");
    }

    /// A restore into a data dir that exists and is empty — a mount point, typically —
    /// is built inside it and moved up, not renamed over it: the old code copied
    /// everything, then failed the rename over a mount point (`EBUSY`/`EXDEV`) and left
    /// its staging on the parent filesystem. Without the right to mount (not root) the
    /// existing dir is a plain one, which takes the same path.
    #[test]
    fn a_restore_into_an_existing_empty_dir_or_a_mount_point_installs_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = file_with(dir.path(), 1, Some(LogPosition { term: 1, index: 1 }));
        let data = dir.path().join("mounted");
        std::fs::create_dir(&data).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
            .arg(&data)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("note: no tmpfs mount (needs root): restoring into a plain empty dir");
        }
        // An interrupted restore's staging is cleared, not counted as content; a new
        // filesystem's `lost+found` is left in place.
        std::fs::create_dir_all(data.join(INSIDE_STAGING).join("db")).unwrap();
        std::fs::create_dir_all(data.join("lost+found")).unwrap();
        let restored = restore(&data, 1, std::slice::from_ref(&file), None);
        let installed: Vec<String> = std::fs::read_dir(&data)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let staged_beside = dir.path().join("mounted.restoring").exists();
        // Checked once the mount is gone, whatever the outcome.
        let checked = crate::versions::check_data_dir(&data);
        let db_opens = crate::store::open_db(&data.join("db")).is_ok();
        if mounted {
            let _ = std::process::Command::new("umount").arg(&data).status();
        }
        restored.expect("restored in place");
        assert!(installed.contains(&"db".to_string()), "{installed:?}");
        assert!(
            installed.contains(&crate::versions::FORMAT_FILE.to_string()),
            "{installed:?}"
        );
        assert!(
            !installed.contains(&INSIDE_STAGING.to_string()),
            "{installed:?}"
        );
        assert!(!staged_beside, "no staging on the parent filesystem");
        checked.expect("a node starts on it");
        assert!(db_opens);
        // A dir holding anything else is refused untouched.
        let busy = dir.path().join("busy");
        std::fs::create_dir_all(busy.join("db")).unwrap();
        assert!(matches!(
            restore(&busy, 1, &[file], None),
            Err(RestoreError::NotEmpty(_))
        ));
    }

    /// A restore that completed its copy but stopped while moving it up is finished by
    /// the next start (or restore): each entry is either still staged or in place.
    #[test]
    fn an_install_interrupted_while_moving_up_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        let file = file_with(dir.path(), 1, Some(LogPosition { term: 1, index: 1 }));
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        restore(&data, 1, std::slice::from_ref(&file), None).expect("restored");
        // Put it back as a crash would leave it: the copy complete, `db` moved up, the
        // format marker still staged.
        let staging = data.join(INSIDE_STAGING);
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(staging.join(STAGING_COMPLETE), b"").unwrap();
        let marker = crate::versions::FORMAT_FILE;
        std::fs::rename(data.join(marker), staging.join(marker)).unwrap();
        assert!(
            crate::versions::check_data_dir(&data).is_err(),
            "refused as it is"
        );
        // A restore again: the earlier one is finished, and the dir is not empty.
        assert!(matches!(
            restore(&data, 1, &[file], None),
            Err(RestoreError::NotEmpty(_))
        ));
        assert!(data.join(marker).exists() && !staging.exists());
        crate::versions::check_data_dir(&data).expect("a node starts on it");
        assert!(!finish_install(&data).unwrap(), "nothing left to finish");
        // Stopped between the sentinel's removal and the staging's (found by review).
        std::fs::create_dir(&staging).unwrap();
        assert!(finish_install(&data).unwrap());
        assert!(!staging.exists());
        crate::versions::check_data_dir(&data).expect("a node starts on it");
    }

    /// A node does not start on a data dir that still holds a restore's staging.
    #[test]
    fn a_data_dir_holding_an_unfinished_restore_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(INSIDE_STAGING)).unwrap();
        let e = crate::versions::check_data_dir(dir.path()).unwrap_err();
        assert!(e.to_string().contains("did not finish"), "{e}");
    }
}
