//! A replica that starts with an empty log (DESIGN §67).
//!
//! Raft's safety rests on every voter remembering what it acknowledged and whom it voted
//! for. A node whose data dir was wiped — a replaced disk, an operator's `rm -rf`, a
//! supervisor that recreated the directory — comes back under the same node id as an
//! empty replica that nobody can tell from a new one. Left alone it votes at once: for
//! any candidate, since every log is at least as long as its empty one, so a candidate
//! lacking entries this node had acknowledged (and that were committed with its
//! acknowledgement) can win, and those entries — credits reserved, jobs settled — are
//! lost. And once it holds its configuration again it stands for election itself with a
//! part of the log.
//!
//! So a replica whose shard opened empty (no vote, no log, no snapshot, no membership) is
//! *rejoining*, and stays so across restarts (a marker in its storage, written before
//! Raft starts, removed when it is whole):
//! - it stands for no election (openraft's election timer is off, and a leader
//!   transfer's `Campaign` is refused);
//! - it follows a leader as any replica does, and keeps the highest commit a leader
//!   announced *in its own term* (a leader that has committed an entry of its term holds
//!   every entry committed before: Raft's leader completeness; a commit index from an
//!   earlier term, which a new leader carries until its first entry commits, is not
//!   used);
//! - it grants a vote only to a candidate whose last log id is at least that mark (such
//!   a log holds every entry committed up to the mark, Raft §5.4.3), or, before any
//!   mark, to a candidate whose log is the genesis configuration alone (index 0: a new
//!   cluster's first election needs its members' votes, and a shard that never
//!   committed anything has nothing to lose);
//! - once its own commit index (openraft's, capped at what matches the leader's log)
//!   reaches the mark, it holds every entry it can have acknowledged before it lost its
//!   disk, and becomes whole: it votes and stands for election as any replica.
//!
//! The node that initialises a shard (`Admin.Init`) stands for election at once (its
//! genesis configuration is the log), and becomes whole when it has led the shard to a
//! commit in its own term or heard a leader's.
//!
//! What this does not do: know whom the lost node had voted for in a term still under
//! way, or refuse an append from a deposed leader of an older term (an empty replica
//! has no vote to compare with). Only removing the node and adding it back — the
//! documented procedure after a lost disk — gives those guarantees.

use crate::store;
use crate::types::LogId;
use rocksdb::DB;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const MARKER: &[u8] = b"rejoining";

fn marker_key(shard: u32) -> Vec<u8> {
    store::shard_key(shard, MARKER)
}

/// What a rejoining replica keeps in its storage: that it is rejoining, whether it
/// initialised the shard, and its mark. Value: [`MARKER_FORMAT`], a flags byte (bit 0:
/// initialised here), then, when there is a mark, its term, leader node and index (`u64`
/// LE each: a log id is ordered by all three).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Marker {
    pub initialised_here: bool,
    pub mark: Option<LogId>,
}

const MARKER_FORMAT: u8 = 1;

impl Marker {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![MARKER_FORMAT, u8::from(self.initialised_here)];
        if let Some(m) = self.mark {
            v.extend_from_slice(&m.leader_id.term.to_le_bytes());
            v.extend_from_slice(&m.leader_id.node_id.to_le_bytes());
            v.extend_from_slice(&m.index.to_le_bytes());
        }
        v
    }

    fn decode(v: &[u8]) -> Option<Marker> {
        if v.first() != Some(&MARKER_FORMAT) {
            return None;
        }
        let initialised_here = match v.get(1)? {
            0 => false,
            1 => true,
            _ => return None,
        };
        let u64_at = |at: usize| Some(u64::from_le_bytes(v.get(at..at + 8)?.try_into().ok()?));
        let mark = match v.len() {
            2 => None,
            26 => Some(LogId::new(
                openraft::CommittedLeaderId::new(u64_at(2)?, u64_at(10)?),
                u64_at(18)?,
            )),
            _ => return None,
        };
        Some(Marker {
            initialised_here,
            mark,
        })
    }
}

/// `shard`'s marker, if it is rejoining (it opened empty before and has not been whole
/// since).
pub fn marked(db: &DB, shard: u32) -> anyhow::Result<Option<Marker>> {
    match db.get_cf(store::cf(db, store::CF_META), marker_key(shard))? {
        None => Ok(None),
        Some(v) => Marker::decode(&v)
            .map(Some)
            .ok_or_else(|| anyhow::anyhow!("corrupt rejoining marker of shard {shard}")),
    }
}

/// Writes `shard`'s marker, synced.
pub fn mark(db: &DB, shard: u32, marker: &Marker) -> anyhow::Result<()> {
    Ok(store::meta_synced(
        db,
        &marker_key(shard),
        Some(&marker.encode()),
    )?)
}

/// `allot-node force-whole`: removes the rejoining marker of `shard` (or of every
/// shard) in the stopped node's data dir, so the replica votes and stands at its next
/// start. One line per shard saying what was done.
pub fn force_whole(data_dir: &std::path::Path, shard: Option<u32>) -> anyhow::Result<Vec<String>> {
    use anyhow::Context;
    crate::backup::finish_install(data_dir)?;
    crate::versions::check_data_dir(data_dir)?;
    // Nothing is created: a dir that is not a node's data dir is refused as it is.
    if !data_dir.join("db").is_dir() || crate::versions::data_dir_format(data_dir)?.is_none() {
        anyhow::bail!("{} is not a node's data dir", data_dir.display());
    }
    let db = store::open_db(&data_dir.join("db")).with_context(|| {
        format!(
            "opening {} (is the node stopped?)",
            data_dir.join("db").display()
        )
    })?;
    let shards = crate::node::stored_shard_count(&db)?
        .ok_or_else(|| anyhow::anyhow!("{} holds no shards", data_dir.display()))?;
    let which: Vec<u32> = match shard {
        Some(s) if s < shards => vec![s],
        Some(s) => anyhow::bail!("shard {s}: the data dir holds shards 0 to {}", shards - 1),
        None => (0..shards).collect(),
    };
    let mut out = Vec::new();
    for s in which {
        // The key itself, whatever it holds (a marker this release cannot read too).
        if db
            .get_cf(store::cf(&db, store::CF_META), marker_key(s))?
            .is_none()
        {
            out.push(format!("shard {s}: not rejoining"));
            continue;
        }
        store::meta_synced(&db, &marker_key(s), None)?;
        out.push(format!(
            "shard {s}: rejoining marker removed: the replica votes and stands at its next \
             start (one that holds no log entry at all is rejoining again)"
        ));
    }
    Ok(out)
}

pub struct Rejoin {
    /// Whether this replica votes as any replica (read on every vote and append).
    whole: AtomicBool,
    /// Whether it may stand for election: whole, or it initialised the shard.
    may_stand: AtomicBool,
    /// While rejoining: what the storage's marker says.
    marker: Mutex<Marker>,
    /// Where the marker is kept (none: tests).
    store: Option<(Arc<DB>, u32)>,
}

impl Rejoin {
    /// A replica that is whole (its shard opened with its storage), or rejoining with
    /// `marker` (it opened empty, now or at an earlier start).
    pub fn new(rejoining: Option<Marker>) -> Rejoin {
        let marker = rejoining.unwrap_or_default();
        Rejoin {
            whole: AtomicBool::new(rejoining.is_none()),
            may_stand: AtomicBool::new(rejoining.is_none() || marker.initialised_here),
            marker: Mutex::new(marker),
            store: None,
        }
    }

    pub fn stored_in(mut self, db: Arc<DB>, shard: u32) -> Rejoin {
        self.store = Some((db, shard));
        self
    }

    pub fn is_whole(&self) -> bool {
        self.whole.load(Ordering::Acquire)
    }

    pub fn may_stand(&self) -> bool {
        self.may_stand.load(Ordering::Acquire)
    }

    fn marker(&self) -> std::sync::MutexGuard<'_, Marker> {
        self.marker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the marker. `synced`: before what it allows happens.
    fn keep(&self, marker: &Marker, synced: bool) -> Result<(), String> {
        let Some((db, shard)) = &self.store else {
            return Ok(());
        };
        let r = if synced {
            mark(db, *shard, marker)
        } else {
            db.put_cf(
                store::cf(db, store::CF_META),
                marker_key(*shard),
                marker.encode(),
            )
            .map_err(Into::into)
        };
        r.map_err(|e| format!("keeping shard {shard}'s rejoining marker: {e:#}"))
    }

    /// This node is about to initialise the shard: its log will be the genesis
    /// configuration, and it stands for election — also after a restart (kept, synced,
    /// before `initialize`). `Ok(true)` when this call set it.
    pub fn initialising_here(&self) -> Result<bool, String> {
        let mut g = self.marker();
        if self.is_whole() || g.initialised_here {
            return Ok(false);
        }
        let next = Marker {
            initialised_here: true,
            ..*g
        };
        self.keep(&next, true)?;
        *g = next;
        self.may_stand.store(true, Ordering::Release);
        Ok(true)
    }

    /// `initialize` was refused after [`Rejoin::initialising_here`] set the flag: the
    /// replica holds someone else's log (it voted, or received entries, meanwhile).
    pub fn not_initialised_here(&self) {
        let mut g = self.marker();
        if self.is_whole() || !g.initialised_here {
            return;
        }
        let next = Marker {
            initialised_here: false,
            ..*g
        };
        if let Err(e) = self.keep(&next, true) {
            tracing::warn!(error = %e, "clearing the initialised flag");
        }
        *g = next;
        self.may_stand.store(false, Ordering::Release);
    }

    /// A leader of term `term` announced `leader_commit`.
    pub fn heard(&self, term: u64, leader_commit: Option<LogId>) {
        let Some(c) = leader_commit.filter(|c| c.leader_id.term == term) else {
            return;
        };
        // Under the marker's lock, whole checked inside it: a write after the marker's
        // removal would bring it back.
        let mut g = self.marker();
        if self.is_whole() || g.mark.is_some_and(|m| m >= c) {
            return;
        }
        let next = Marker {
            mark: Some(c),
            ..*g
        };
        // Not synced: a mark lost in a crash is heard again from the next leader.
        if let Err(e) = self.keep(&next, false) {
            tracing::warn!(error = %e, "rejoining mark not kept");
        }
        *g = next;
    }

    /// Records this replica's commit; `true` when that made it whole (the caller then
    /// lets it stand for election).
    pub fn progress(&self, committed: Option<LogId>) -> bool {
        let g = self.marker();
        if self.is_whole() {
            return false;
        }
        match g.mark {
            Some(m) if committed >= Some(m) => {
                self.become_whole(g);
                true
            }
            _ => false,
        }
    }

    /// This replica led the shard to a commit in its own term (it initialised the shard
    /// and won its first election): whole.
    pub fn led(&self) -> bool {
        let g = self.marker();
        if self.is_whole() {
            return false;
        }
        self.become_whole(g);
        true
    }

    /// Under the marker's lock (`_g`): no marker write can follow the removal.
    fn become_whole(&self, _g: std::sync::MutexGuard<'_, Marker>) {
        self.may_stand.store(true, Ordering::Release);
        self.whole.store(true, Ordering::Release);
        if let Some((db, shard)) = &self.store {
            // Synced: a marker back after a power loss would leave a replica that had
            // been whole unable to stand.
            if let Err(e) = store::meta_synced(db, &marker_key(*shard), None) {
                tracing::warn!(shard, error = %e, "removing the rejoining marker (the replica \
                    will be rejoining again after a restart)");
            }
        }
    }

    /// Why this replica does not vote for a candidate whose last log id is
    /// `candidate_last`, or `None` when it may (openraft then compares the logs).
    /// `own_last`: this replica's last log id.
    pub fn vote_refusal(
        &self,
        candidate_last: Option<LogId>,
        own_last: Option<LogId>,
    ) -> Option<String> {
        if self.is_whole() {
            return None;
        }
        match self.marker().mark {
            // A new shard's first election: the candidate holds the genesis
            // configuration alone.
            None if candidate_last.is_none_or(|l| l.index == 0) => None,
            // A new shard whose first leader committed but went before it told anyone
            // (nothing of a later term exists here): its successor holds at least what
            // this replica received. A replica that lost its disk in an older shard
            // hears a leader's commit of its own term with its first append.
            None if own_last.is_some_and(|o| o.leader_id.term <= 1)
                && candidate_last >= own_last =>
            {
                None
            }
            None => Some(
                "this replica started with an empty log and has heard no leader's commit \
                 yet: it votes for a candidate holding one"
                    .to_string(),
            ),
            Some(m) if candidate_last >= Some(m) => None,
            Some(m) => Some(format!(
                "this replica started with an empty log: it votes only for a candidate \
                 holding the commit {m} a leader announced"
            )),
        }
    }
}

/// After `Admin.Init` on a rejoining replica: it is whole once it leads the shard and
/// has applied an entry of its own term (committed by a majority that voted for its
/// genesis log), or once it heard a leader's commit (the append handler). Ends then, or
/// when the shard stops.
pub fn whole_once_led(raft: crate::types::Raft, rejoin: Arc<Rejoin>, me: u64) {
    tokio::spawn(async move {
        let mut m = raft.metrics();
        loop {
            if rejoin.is_whole() {
                return;
            }
            let led = {
                let g = m.borrow_and_update();
                g.current_leader == Some(me)
                    && g.last_applied
                        .is_some_and(|l| l.leader_id.term == g.current_term)
            };
            if led && rejoin.led() {
                tracing::info!(
                    "this replica initialised the shard and led it to a commit: it votes as \
                     any replica"
                );
                return;
            }
            if m.changed().await.is_err() {
                return;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(openraft::CommittedLeaderId::new(term, 2), index)
    }

    #[test]
    fn a_replica_with_its_log_votes_and_one_started_empty_waits_for_a_leaders_commit() {
        let whole = Rejoin::new(None);
        assert!(whole.is_whole() && whole.may_stand());
        assert_eq!(whole.vote_refusal(Some(log_id(3, 40)), None), None);

        let r = Rejoin::new(Some(Marker::default()));
        assert!(!r.is_whole() && !r.may_stand());
        // The genesis election: a candidate holding only the initial configuration.
        assert_eq!(r.vote_refusal(Some(log_id(0, 0)), None), None);
        assert_eq!(r.vote_refusal(None, None), None);
        // Anything past genesis, before any mark: refused.
        assert!(r.vote_refusal(Some(log_id(1, 1)), None).is_some());
        assert!(r
            .vote_refusal(Some(log_id(3, 9)), Some(log_id(2, 5)))
            .is_some());
        assert!(
            !r.progress(Some(log_id(9, 100))),
            "no leader heard: no mark to reach"
        );
        // A commit index of an earlier term (a new leader's, before its first entry
        // commits) sets no mark.
        r.heard(5, Some(log_id(4, 70)));
        assert!(!r.progress(Some(log_id(4, 70))));
        r.heard(4, Some(log_id(4, 50)));
        // A deposed leader's lower commit does not lower the mark.
        r.heard(3, Some(log_id(3, 20)));
        assert!(!r.progress(Some(log_id(4, 49))));
        // Votes: only for a log at least the mark; none for genesis once there is one.
        assert!(r
            .vote_refusal(Some(log_id(4, 49)), None)
            .unwrap()
            .contains("50"));
        assert!(r.vote_refusal(Some(log_id(0, 0)), None).is_some());
        assert_eq!(r.vote_refusal(Some(log_id(4, 50)), None), None);
        assert_eq!(r.vote_refusal(Some(log_id(5, 10)), None), None);
        assert!(
            r.progress(Some(log_id(4, 50))),
            "reaching the mark makes it whole"
        );
        assert!(r.is_whole() && r.may_stand());
        assert!(
            !r.progress(Some(log_id(4, 51))),
            "whole once: no second transition"
        );
        assert_eq!(r.vote_refusal(Some(log_id(1, 3)), None), None);
    }

    #[test]
    fn a_new_shards_followers_elect_the_successor_of_a_first_leader_that_went_early() {
        // The first leader committed its term-1 entry and went before announcing it.
        let r = Rejoin::new(Some(Marker::default()));
        let own = Some(log_id(1, 1));
        assert_eq!(r.vote_refusal(Some(log_id(1, 1)), own), None);
        assert_eq!(r.vote_refusal(Some(log_id(2, 2)), own), None);
        assert!(r.vote_refusal(Some(log_id(0, 0)), own).is_none());
        assert!(
            r.vote_refusal(Some(log_id(1, 0)), own).is_none(),
            "index 0: genesis"
        );
        // A log of a later term here: not a new shard.
        assert!(r
            .vote_refusal(Some(log_id(3, 9)), Some(log_id(2, 4)))
            .is_some());
    }

    #[test]
    fn the_node_that_initialises_the_shard_stands_at_once_and_is_whole_once_it_led() {
        let r = Rejoin::new(Some(Marker::default()));
        r.initialising_here().unwrap();
        assert!(r.may_stand() && !r.is_whole());
        assert!(r.vote_refusal(Some(log_id(1, 9)), None).is_some());
        assert!(r.led());
        assert!(r.is_whole());
        assert!(!r.led());
        // After a restart before it led: it still stands.
        let again = Rejoin::new(Some(Marker {
            initialised_here: true,
            mark: None,
        }));
        assert!(again.may_stand() && !again.is_whole());
    }

    #[test]
    fn the_marker_round_trips_with_the_marks_leader_and_refuses_garbage() {
        for m in [
            Marker::default(),
            Marker {
                initialised_here: true,
                mark: Some(log_id(7, 1 << 40)),
            },
        ] {
            assert_eq!(Marker::decode(&m.encode()), Some(m));
        }
        // A mark read back compares as the one kept: above a lower index of its term
        // (a log id is ordered by term, leader, index; the leader read back as 0 made
        // every index of the term pass it — found by review).
        let kept = Marker {
            initialised_here: false,
            mark: Some(log_id(5, 100)),
        };
        let back = Marker::decode(&kept.encode()).unwrap().mark.unwrap();
        assert!(back > log_id(5, 90));
        let r = Rejoin::new(Some(Marker::decode(&kept.encode()).unwrap()));
        assert!(!r.progress(Some(log_id(5, 90))));
        assert!(r.vote_refusal(Some(log_id(5, 95)), None).is_some());
        assert_eq!(Marker::decode(&[]), None);
        assert_eq!(Marker::decode(&[1]), None, "the first draft's layout");
        assert_eq!(Marker::decode(&[MARKER_FORMAT, 2]), None);
        assert_eq!(Marker::decode(&[MARKER_FORMAT, 1, 0, 0]), None);
    }

    #[test]
    fn an_initialise_refused_takes_the_flag_back() {
        let r = Rejoin::new(Some(Marker::default()));
        assert_eq!(r.initialising_here(), Ok(true));
        assert_eq!(r.initialising_here(), Ok(false), "set once");
        r.not_initialised_here();
        assert!(!r.may_stand());
    }
}
