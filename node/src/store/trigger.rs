//! When a shard takes a snapshot. openraft 0.9 counts entries only
//! (`SnapshotPolicy::LogsSinceLast`), but an entry holds 1 to 2,048 commands and a
//! snapshot costs time proportional to the *state*, not the log: a count tuned for a
//! small state snapshots a large one over and over (a 90 MB state every few seconds in
//! the benchmark, docs/DESIGN.md §29). So the node also snapshots by size: once the log
//! appended since the last snapshot reaches `percent`% of that snapshot's size (and at
//! least `min_bytes`). Snapshot work is then at most 100/`percent` bytes encoded per log
//! byte written, and the log to replay at start-up stays below `percent`% of the state
//! plus `min_bytes`. The entry count stays as a backstop (`--snapshot-every`).
//!
//! Each replica decides for itself: a snapshot is local to a replica in Raft.

use std::sync::atomic::{AtomicU64, Ordering};

/// The size rule, as a pure function (so it is tested alone).
pub fn snapshot_due(
    log_bytes_since: u64,
    last_snapshot_bytes: u64,
    percent: u64,
    min_bytes: u64,
) -> bool {
    let threshold = (last_snapshot_bytes as u128 * percent as u128 / 100).max(min_bytes as u128);
    log_bytes_since as u128 >= threshold
}

/// Shared by a shard's log store (counts appended bytes), state machine (records each
/// snapshot) and the task that triggers snapshots.
#[derive(Debug)]
pub struct SnapshotTrigger {
    percent: u64,
    min_bytes: u64,
    /// Log bytes appended since the process started.
    appended: AtomicU64,
    /// `appended` when the state of the last snapshot was taken.
    at_last: AtomicU64,
    /// Size of the last snapshot built, installed or loaded.
    last_bytes: AtomicU64,
}

impl SnapshotTrigger {
    pub fn new(percent: u64, min_bytes: u64) -> SnapshotTrigger {
        SnapshotTrigger {
            percent,
            min_bytes,
            appended: AtomicU64::new(0),
            at_last: AtomicU64::new(0),
            last_bytes: AtomicU64::new(0),
        }
    }

    pub fn appended(&self, bytes: u64) {
        self.appended.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The current position, to pass to [`SnapshotTrigger::taken`] for a snapshot whose
    /// state is taken now.
    pub fn mark(&self) -> u64 {
        self.appended.load(Ordering::Relaxed)
    }

    /// A snapshot of `bytes` whose state was taken at `mark` is now stored.
    pub fn taken(&self, mark: u64, bytes: u64) {
        self.at_last.fetch_max(mark, Ordering::Relaxed);
        self.last_bytes.store(bytes, Ordering::Relaxed);
    }

    pub fn due(&self) -> bool {
        let since = self
            .mark()
            .saturating_sub(self.at_last.load(Ordering::Relaxed));
        snapshot_due(
            since,
            self.last_bytes.load(Ordering::Relaxed),
            self.percent,
            self.min_bytes,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_a_share_of_the_last_snapshot_with_a_floor() {
        // No snapshot yet (size 0): the floor decides.
        assert!(!snapshot_due(999, 0, 100, 1_000));
        assert!(snapshot_due(1_000, 0, 100, 1_000));
        // A large state: the share decides.
        assert!(!snapshot_due(89_999_999, 90_000_000, 100, 1_000));
        assert!(snapshot_due(90_000_000, 90_000_000, 100, 1_000));
        assert!(!snapshot_due(44_999_999, 90_000_000, 50, 1_000));
        assert!(snapshot_due(45_000_000, 90_000_000, 50, 1_000));
        // No overflow at the extremes.
        assert!(!snapshot_due(u64::MAX - 1, u64::MAX, 100, 0));
        assert!(snapshot_due(u64::MAX, u64::MAX, 100, 0));
    }

    #[test]
    fn appends_after_the_mark_count_towards_the_next_snapshot() {
        let t = SnapshotTrigger::new(100, 100);
        t.appended(150);
        assert!(t.due());
        let mark = t.mark();
        t.appended(60); // appended while the snapshot was being built
        t.taken(mark, 200);
        assert!(!t.due()); // 60 since the mark, threshold 200
        t.appended(140);
        assert!(t.due());
        // A late, older snapshot does not move the mark back.
        t.taken(10, 200);
        assert!(t.due());
    }
}
