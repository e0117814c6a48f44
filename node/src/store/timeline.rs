//! When each recent entry of a shard's log reached each local stage: appended to the
//! log, made durable by the WAL fsync, handed to the state machine. The proposer reads
//! its own entry's instants when the entry is answered and splits the commit time into
//! stages (`allot_proposal_stage_seconds`: `append`, `replicate`, `apply`), so a slow
//! commit says whether the leader's RaftCore, the commit (a quorum's fsyncs and
//! acknowledgements) or the apply was slow (docs/DESIGN.md §29). The `local_flush`
//! stage — from an append to its WAL fsync on this node — is observed by the sync thread
//! when the flush happens (`observe_flushes`): a leader no longer waits for its own
//! flush (§62), so at an answer it may not have happened yet.
//!
//! A fixed ring of slots indexed by log index, lock-free: writers are RaftCore (append),
//! the WAL sync thread (flush) and the state-machine worker (apply); the reader is the
//! proposer. A slot is valid for an index only while it holds that index: reusing a slot
//! is a seqlock write (the index is cleared, the times written, the index set), so a
//! reader that raced with a reuse gets `None`, not a mix of two entries' times. A flush
//! or apply mark that races with its slot's reuse — the entry 1,024 later being appended
//! between the mark's index check and its store — would land on the newer entry; the
//! cost is one misattributed histogram observation, in a situation the pipeline depth
//! (a few entries in flight) does not produce.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Entries remembered per shard: far more than are ever in flight (the proposer keeps
/// a few entries in the pipeline; a follower appends at most `max_payload_entries`).
const SLOTS: u64 = 1024;

/// Marks an empty slot's index.
const NONE: u64 = u64::MAX;

#[derive(Default)]
struct Slot {
    index: AtomicU64,
    /// Microseconds since the timeline's epoch, plus one (0: not reached yet).
    appended: AtomicU64,
    flushed: AtomicU64,
    applying: AtomicU64,
}

pub struct Timeline {
    epoch: Instant,
    slots: Box<[Slot]>,
    /// Told each append's time from its write to its flush (`observe_flushes`).
    flush_observer: std::sync::OnceLock<FlushObserver>,
}

type FlushObserver = Box<dyn Fn(Duration) + Send + Sync>;

/// The local instants of one entry; `None` for a stage not reached (or not recorded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryStages {
    pub appended: Option<Instant>,
    pub flushed: Option<Instant>,
    pub applying: Option<Instant>,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline::new()
    }
}

impl Timeline {
    pub fn new() -> Timeline {
        Timeline {
            epoch: Instant::now(),
            slots: (0..SLOTS)
                .map(|_| Slot {
                    index: AtomicU64::new(NONE),
                    ..Slot::default()
                })
                .collect(),
            flush_observer: std::sync::OnceLock::new(),
        }
    }

    /// `observe` is told, at each flush, how long the flushed append waited from its
    /// write (the newest entry of the append; its entries share one write). Set once.
    pub fn observe_flushes(&self, observe: impl Fn(Duration) + Send + Sync + 'static) {
        let _ = self.flush_observer.set(Box::new(observe));
    }

    fn slot(&self, index: u64) -> &Slot {
        &self.slots[(index % SLOTS) as usize]
    }

    fn stamp(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64 + 1
    }

    fn instant(&self, stamp: u64) -> Option<Instant> {
        stamp
            .checked_sub(1)
            .map(|us| self.epoch + Duration::from_micros(us))
    }

    /// Entries `first..=last` were written to the log (not yet durable).
    pub fn appended(&self, first: u64, last: u64) {
        let now = self.stamp();
        // Only the newest SLOTS entries of a long range can be kept.
        for i in first.max(last.saturating_sub(SLOTS - 1))..=last {
            let s = self.slot(i);
            s.index.store(NONE, Ordering::Relaxed);
            // Readers that see any of the stores below also see the index cleared.
            fence(Ordering::Release);
            s.appended.store(now, Ordering::Relaxed);
            s.flushed.store(0, Ordering::Relaxed);
            s.applying.store(0, Ordering::Relaxed);
            s.index.store(i, Ordering::Release);
        }
    }

    /// Entries `first..=last` are durable.
    pub fn flushed(&self, first: u64, last: u64) {
        let now = self.stamp();
        for i in first.max(last.saturating_sub(SLOTS - 1))..=last {
            let s = self.slot(i);
            if s.index.load(Ordering::Acquire) == i {
                s.flushed.store(now, Ordering::Relaxed);
            }
        }
        if let (Some(observe), Some(stages)) = (self.flush_observer.get(), self.get(last)) {
            if let (Some(appended), Some(flushed)) = (stages.appended, self.instant(now)) {
                observe(flushed.saturating_duration_since(appended));
            }
        }
    }

    /// Entry `index` is being applied.
    pub fn applying(&self, index: u64) {
        let s = self.slot(index);
        if s.index.load(Ordering::Acquire) == index {
            s.applying.store(self.stamp(), Ordering::Relaxed);
        }
    }

    /// The instants recorded for `index`, or `None` if its slot holds another entry.
    pub fn get(&self, index: u64) -> Option<EntryStages> {
        let s = self.slot(index);
        if s.index.load(Ordering::Acquire) != index {
            return None;
        }
        let stages = EntryStages {
            appended: self.instant(s.appended.load(Ordering::Relaxed)),
            flushed: self.instant(s.flushed.load(Ordering::Relaxed)),
            applying: self.instant(s.applying.load(Ordering::Relaxed)),
        };
        // Re-checked: a newer entry may have taken the slot while it was read (the fence
        // orders the reads above before this one, as in a seqlock).
        fence(Ordering::Acquire);
        (s.index.load(Ordering::Relaxed) == index).then_some(stages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_recorded_in_order_per_entry() {
        let t = Timeline::new();
        assert_eq!(t.get(5), None);
        t.appended(5, 7);
        let s = t.get(6).expect("appended");
        assert!(s.appended.is_some() && s.flushed.is_none() && s.applying.is_none());
        t.flushed(5, 6);
        t.applying(6);
        let s = t.get(6).expect("recorded");
        let (a, f, p) = (s.appended.unwrap(), s.flushed.unwrap(), s.applying.unwrap());
        assert!(a <= f && f <= p);
        assert!(t.get(7).unwrap().flushed.is_none(), "7 was not flushed");
    }

    #[test]
    fn each_flush_is_observed_when_it_happens_with_its_wait_since_the_write() {
        let t = Timeline::new();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        t.observe_flushes(move |d| s2.lock().unwrap().push(d));
        t.appended(1, 4);
        std::thread::sleep(Duration::from_millis(3));
        t.flushed(1, 4);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen.len(),
            1,
            "one observation per flushed append: {seen:?}"
        );
        assert!(seen[0] >= Duration::from_millis(3), "{seen:?}");
        let s = t.get(4).unwrap();
        assert_eq!(seen[0], s.flushed.unwrap() - s.appended.unwrap());
    }

    #[test]
    fn a_slot_taken_by_a_newer_entry_answers_none_for_the_old_one() {
        let t = Timeline::new();
        t.appended(3, 3);
        t.appended(3 + SLOTS, 3 + SLOTS);
        assert_eq!(t.get(3), None);
        assert!(t.get(3 + SLOTS).is_some());
        // Marks for an entry whose slot was reused are dropped, not misattributed.
        t.flushed(3, 3);
        assert!(t.get(3 + SLOTS).unwrap().flushed.is_none());
    }

    #[test]
    fn a_range_longer_than_the_ring_keeps_its_newest_entries() {
        let t = Timeline::new();
        t.appended(1, 3 * SLOTS);
        assert!(t.get(3 * SLOTS).is_some());
        assert!(t.get(2 * SLOTS + 1).is_some());
        assert_eq!(t.get(2 * SLOTS), None);
    }
}
