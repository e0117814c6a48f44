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
//! So a replica whose shard opened empty (no vote, no log, no snapshot) is *rejoining*:
//! - it grants no vote, except to a candidate whose log is the genesis configuration
//!   alone (index 0: a shard that never committed anything has nothing to lose, and a
//!   new cluster's first election needs its members' votes);
//! - it stands for no election (openraft's election timer is off, and a leader
//!   transfer's `Campaign` is refused);
//! - it follows a leader as any replica does, and notes the highest commit index a
//!   leader announced to it; once its own log reaches that index it holds every entry
//!   it could have acknowledged before it lost its disk (those were committed, so a
//!   later leader's commit index covers them) and becomes whole: it votes and stands
//!   for election again.
//!
//! The node that initialises a shard (`Admin.Init`) holds its genesis log and is whole
//! from then on. A restored data dir holds a snapshot: it is not empty.
//!
//! What this does not do: tell whom the lost node had voted for in a term still under
//! way (only removing the node and adding it back, which is the documented procedure
//! after a lost disk, gives that guarantee); nor refuse to follow a deposed leader that
//! reached it first (it then waits for that leader's, lower, commit index, and the real
//! leader's next message raises the mark while it is still rejoining).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub struct Rejoin {
    /// Whether this replica votes and stands for election (read on every vote and
    /// append; written once).
    whole: AtomicBool,
    /// While rejoining: the highest commit a leader announced (`Some(None)`: a leader
    /// spoke and had committed nothing), `None` before any leader spoke.
    mark: Mutex<Option<Option<u64>>>,
}

impl Rejoin {
    /// `started_empty`: the shard opened with no vote, no log and no snapshot.
    pub fn new(started_empty: bool) -> Rejoin {
        Rejoin {
            whole: AtomicBool::new(!started_empty),
            mark: Mutex::new(None),
        }
    }

    pub fn is_whole(&self) -> bool {
        self.whole.load(Ordering::Acquire)
    }

    /// This node initialised the shard: its log is the genesis configuration.
    pub fn initialised_here(&self) {
        self.whole.store(true, Ordering::Release);
    }

    /// A leader's append announced `leader_commit` (its commit index).
    pub fn heard(&self, leader_commit: Option<u64>) {
        if self.is_whole() {
            return;
        }
        let mut g = self.mark.lock().unwrap_or_else(|p| p.into_inner());
        *g = Some(match *g {
            None => leader_commit,
            Some(m) => m.max(leader_commit),
        });
    }

    /// Records this replica's last log index; `true` when that made it whole (the
    /// caller then lets it stand for election).
    pub fn progress(&self, last_log_index: Option<u64>) -> bool {
        if self.is_whole() {
            return false;
        }
        let g = self.mark.lock().unwrap_or_else(|p| p.into_inner());
        let reached = match *g {
            None => false,
            Some(mark) => last_log_index >= mark,
        };
        if reached {
            self.whole.store(true, Ordering::Release);
        }
        reached
    }

    /// Why this replica does not vote for a candidate whose last log index is
    /// `candidate_last`, or `None` when it may (openraft then compares the logs).
    pub fn vote_refusal(&self, candidate_last: Option<u64>) -> Option<String> {
        if self.is_whole() || candidate_last.unwrap_or(0) == 0 {
            return None;
        }
        let mark = *self.mark.lock().unwrap_or_else(|p| p.into_inner());
        Some(match mark {
            None => "this replica started with an empty log and has heard no leader yet: it \
                     votes once it holds a leader's commit index"
                .to_string(),
            Some(m) => format!(
                "this replica started with an empty log and has not yet caught up to a \
                 leader's commit index {}: it votes once it has",
                m.map_or("(none)".to_string(), |i| i.to_string())
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_with_its_log_votes_and_one_started_empty_waits_for_a_leaders_commit() {
        let whole = Rejoin::new(false);
        assert!(whole.is_whole());
        assert_eq!(whole.vote_refusal(Some(40)), None);

        let r = Rejoin::new(true);
        assert!(!r.is_whole());
        // The genesis election: a candidate holding only the initial configuration.
        assert_eq!(r.vote_refusal(Some(0)), None);
        assert_eq!(r.vote_refusal(None), None);
        // Anything past genesis, before any leader spoke: refused.
        assert!(r.vote_refusal(Some(1)).is_some());
        assert!(!r.progress(Some(100)), "no leader heard: no mark to reach");
        r.heard(Some(50));
        // A deposed leader's lower commit does not lower the mark.
        r.heard(Some(20));
        assert!(!r.progress(Some(49)));
        assert!(r.vote_refusal(Some(60)).unwrap().contains("50"));
        assert!(r.progress(Some(50)), "reaching the mark makes it whole");
        assert!(r.is_whole());
        assert!(!r.progress(Some(51)), "whole once: no second transition");
        assert_eq!(r.vote_refusal(Some(60)), None);
    }

    #[test]
    fn a_leader_that_committed_nothing_leaves_nothing_to_wait_for() {
        let r = Rejoin::new(true);
        r.heard(None);
        assert!(r.progress(None));
        assert!(r.is_whole());
    }

    #[test]
    fn the_node_that_initialises_the_shard_is_whole() {
        let r = Rejoin::new(true);
        r.initialised_here();
        assert_eq!(r.vote_refusal(Some(9)), None);
    }
}
