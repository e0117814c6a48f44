//! The node's side of versioning (docs/DESIGN.md §48): the data dir's format marker,
//! the rule-version checks a node makes before it starts or applies, and the cluster
//! version gate an `ActivateVersion` passes before it is proposed.

use crate::node::{Node, Shard};
use allot_statemachine::codec::{FORMAT_READ_MIN, FORMAT_VERSION, WIRE_FORMAT};
use allot_statemachine::{Command, Request};
use anyhow::{bail, Context};
use std::path::Path;
use tonic::Status;

/// The file in a data dir naming the newest persisted format it may hold, written as
/// `allot-format <n>\n` once the node has opened the dir. Read before anything else
/// opens the dir, so a newer format is refused while the dir is untouched. A dir
/// without it was written by format 5 (the releases before the marker).
pub const FORMAT_FILE: &str = "FORMAT";

/// The format the data dir at `dir` says it holds (`None`: no marker).
pub fn data_dir_format(dir: &Path) -> anyhow::Result<Option<u8>> {
    let path = dir.join(FORMAT_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let version = text
        .trim()
        .strip_prefix("allot-format ")
        .and_then(|v| v.parse::<u8>().ok())
        .with_context(|| {
            format!(
                "{} is not an allot format marker (expected \"allot-format <n>\", found {:?})",
                path.display(),
                text.chars().take(64).collect::<String>()
            )
        })?;
    Ok(Some(version))
}

/// Refuses a data dir written by a format this build does not read.
pub fn check_data_dir(dir: &Path) -> anyhow::Result<()> {
    let staging = dir.join(crate::backup::INSIDE_STAGING);
    if staging.exists() {
        bail!(
            "the data dir {} holds {}: a restore into it did not finish copying. Nothing \
             was changed: run the restore again (it removes the staging first) or empty \
             the dir",
            dir.display(),
            staging.display()
        );
    }
    match data_dir_format(dir)? {
        Some(v) if v > FORMAT_VERSION => bail!(
            "the data dir {} holds format {v}, written by a newer release; this binary \
             reads formats {FORMAT_READ_MIN} to {FORMAT_VERSION}. Nothing was changed: run \
             the release that wrote it (or a newer one)",
            dir.display()
        ),
        Some(v) if v < FORMAT_READ_MIN => bail!(
            "the data dir {} holds format {v}, older than this binary reads ({FORMAT_READ_MIN} \
             to {FORMAT_VERSION}). Nothing was changed: upgrade through an intermediate \
             release first",
            dir.display()
        ),
        _ => Ok(()),
    }
}

/// Records that the data dir may now hold blobs of `format` (atomically: a temporary
/// file renamed over the marker). Never lowers it. A node marks its dir with
/// [`WIRE_FORMAT`] when it starts — what it writes into the log and the audit store —
/// and with a state's format before it stores a snapshot of it
/// ([`mark_for_snapshot`]): so until rule version 3 makes snapshots format 7, the dir
/// stays readable by the previous release (a rollback).
///
/// One writer at a time: every shard's snapshot builds mark the same dir, and two at once
/// went through the same temporary file (the second rename found it gone, and its shard
/// stopped on the storage error). The data dir's lock (RocksDB's) keeps other processes
/// out, so a lock in this process is enough; under it, the check and the write are one
/// step, so the marker is never lowered either.
pub fn mark_data_dir(dir: &Path, format: u8) -> anyhow::Result<()> {
    static WRITER: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = WRITER.lock().unwrap_or_else(|p| p.into_inner());
    if data_dir_format(dir)?.is_some_and(|v| v >= format) {
        return Ok(());
    }
    let tmp = dir.join(format!("{FORMAT_FILE}.tmp"));
    std::fs::write(&tmp, format!("allot-format {format}\n"))
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, dir.join(FORMAT_FILE)))
        .and_then(|()| std::fs::File::open(dir)?.sync_all())
        .with_context(|| format!("writing the format marker in {}", dir.display()))
}

/// The format a node marks its data dir with when it starts.
pub const START_FORMAT: u8 = WIRE_FORMAT;

/// Marks the data dir of the store at `db_path` (`<data dir>/db`) before a snapshot
/// whose encoding is `state` is stored in it.
pub fn mark_for_snapshot(db_path: &Path, state: &[u8]) -> std::io::Result<()> {
    match (state.first(), db_path.parent()) {
        (Some(&format), Some(dir)) if format > WIRE_FORMAT => {
            mark_data_dir(dir, format).map_err(|e| std::io::Error::other(format!("{e:#}")))
        }
        _ => Ok(()),
    }
}

/// Refuses to run shard `shard` whose active rule version is newer than this node
/// supports (a downgrade after activation).
pub fn check_rules(shard: u32, active: u32, supported: u32) -> anyhow::Result<()> {
    if active > supported {
        bail!(
            "shard {shard} runs rule version {active}, and this node supports up to \
             {supported} (--max-rules-version, or this binary's newest): a version once \
             activated cannot be undone. Nothing was changed: run a release that supports \
             version {active}"
        );
    }
    Ok(())
}

/// The rule version a batch would activate, if it holds an `ActivateVersion` (the
/// highest, if several).
pub fn activation_in(requests: &[Request]) -> Option<u32> {
    requests
        .iter()
        .filter_map(|r| match r.command {
            Command::ActivateVersion { version } => Some(version),
            _ => None,
        })
        .max()
}

/// The rule version above `rules_max` that `entry` would activate on `state`, if apply
/// would act on it: the replica must then stop rather than apply the entry (a newer
/// binary activates the version; this one cannot follow it). An activation apply would
/// refuse whatever the binary — a token nobody issued, a caller that is not the
/// operator, a replayed request id — is applied like any refused request on every
/// replica alike, so it stops nothing.
///
/// Whether apply acts on it is read from apply itself, on a copy of the state: the
/// request reached the version rule if its outcome is the activation's own (done, or
/// refused as `UnsupportedRulesVersion` — a version this build does not implement, which
/// a newer one may). Entries without such an activation (all but an operator's upgrade
/// step) cost one scan of their requests.
pub fn activation_beyond(
    state: &allot_statemachine::State,
    entry: &allot_statemachine::Entry,
    rules_max: u32,
) -> Option<u32> {
    use allot_statemachine::CommandError;
    let beyond = |r: &Request| match r.command {
        Command::ActivateVersion { version } if version > rules_max => Some(version),
        _ => None,
    };
    let version = entry.requests.iter().filter_map(beyond).max()?;
    let mut probe = state.clone();
    let Ok(out) = allot_statemachine::apply(&mut probe, entry) else {
        // Apply refuses the entry as a whole (already applied): the real apply says so.
        return None;
    };
    let acted = probe.rules.active > rules_max
        || entry.requests.iter().zip(&out.outcomes).any(|(r, o)| {
            beyond(r).is_some()
                && matches!(o, Ok(_) | Err(CommandError::UnsupportedRulesVersion { .. }))
        });
    acted.then_some(version)
}

/// What this node reports to a peer asking which versions it supports.
pub fn local_versions(node: &Node) -> allot_proto::VersionsReply {
    allot_proto::VersionsReply {
        node_id: node.id,
        rules_max: node.config.rules_max,
        format_version: FORMAT_VERSION as u32,
        format_read_min: FORMAT_READ_MIN as u32,
        release: env!("CARGO_PKG_VERSION").to_string(),
    }
}

/// The cluster version gate: `version` may be activated on `shard` only when every
/// member of its configuration (voters, and learners about to become voters) answers
/// that it supports it. Asked on the leader before it proposes; a member that does not
/// answer counts as one that does not support it.
pub async fn check_activation(node: &Node, shard: &Shard, version: u32) -> Result<(), Status> {
    let active = shard.view.read().state.rules.active;
    if version <= active {
        return Ok(()); // Apply answers it (a repeat, or a refusal): nothing to gate.
    }
    let members = shard.members();
    let mut behind = Vec::new();
    for (id, addr) in members {
        let reply = if id == node.id {
            Ok(local_versions(node))
        } else {
            ask(node, &addr).await
        };
        match reply {
            Ok(v) if v.rules_max >= version => {}
            Ok(v) => behind.push(format!(
                "node {id} supports up to {} (release {})",
                v.rules_max, v.release
            )),
            Err(e) => behind.push(format!("node {id} did not answer ({e})")),
        }
    }
    if behind.is_empty() {
        return Ok(());
    }
    Err(crate::edge::with_reason(
        Status::failed_precondition(format!(
            "rule version {version} cannot be activated on shard {}: {}; upgrade those \
             nodes first (nothing was changed)",
            shard.id,
            behind.join("; ")
        )),
        "VOTER_UNSUPPORTED",
    ))
}

async fn ask(node: &Node, addr: &str) -> Result<allot_proto::VersionsReply, String> {
    let mut c = node.channels.raft_client(addr).map_err(|e| e.to_string())?;
    let call = c.versions(node.channels.peer_request(allot_proto::VersionsRequest {}));
    match tokio::time::timeout(std::time::Duration::from_secs(5), call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        // An older release without the RPC answers UNIMPLEMENTED: it supports nothing
        // newer than the baseline.
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[cfg(test)]
mod marker_tests {
    use super::*;

    /// Found by a CI run (2026-11-27, the rolling-upgrade test): two shards storing their
    /// first format-7 snapshots at once both wrote the marker through the same temporary
    /// file, and the one whose rename came second found it gone. Its RaftCore stopped on
    /// the storage error and the node exited (status 74) in the middle of an upgrade.
    #[test]
    fn shards_marking_the_data_dir_at_once_all_succeed() {
        for round in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            mark_data_dir(dir.path(), START_FORMAT).unwrap();
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let (dir, barrier) = (dir.path().to_path_buf(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        mark_data_dir(&dir, FORMAT_VERSION).map_err(|e| format!("{e:#}"))
                    })
                })
                .collect();
            for t in threads {
                let r = t.join().unwrap();
                assert!(r.is_ok(), "round {round}: {r:?}");
            }
            assert_eq!(
                data_dir_format(dir.path()).unwrap(),
                Some(FORMAT_VERSION),
                "round {round}"
            );
        }
    }
}
