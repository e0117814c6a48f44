//! Logical time: how a leader stamps entries.
//!
//! The state machine's clock is whatever the leader stamps (clamped so it never goes
//! back). A leader must not let its own wall clock decide that: one node minutes off
//! would expire credits and leases early. So:
//!
//! 1. **Target** — every node samples the wall clocks of its peers (the `Clock` RPC,
//!    corrected by half the round trip) and the target is the *lower median* of the
//!    fresh samples and its own clock, computed only when a majority of the cluster's
//!    clocks is in the sample. With at most f of 2f+1 clocks wrong, the median lies within
//!    the range of the correct clocks.
//! 2. **Slew** — the leader advances logical time by its monotonic clock since the last
//!    stamp, steered toward the target by at most `slew` × elapsed (faster or slower), and
//!    never past the target when it is catching up. Without a majority sample it advances
//!    by the monotonic clock alone.
//! 3. **Continuity** — a new leader starts from the greater of the last applied time and
//!    its own last stamp; the state machine applies `max(previous, stamp)`.
//!
//! Bound (docs/DESIGN.md §28): logical time never runs ahead of the fastest correct clock
//! by more than the sampling error (half a round trip plus the sample age).
//! The one exception is genesis: the first stamp of an empty shard is the target itself.

use crate::types::NodeId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Samples older than this are not used.
pub const SAMPLE_FRESH: Duration = Duration::from_secs(5);

/// The node's wall clock (with a test-only offset) and its view of its peers' clocks.
pub struct ClusterClock {
    /// Added to the system clock: tests simulate skewed machines with it (and change it
    /// at run time to simulate clock bumps and strobes).
    offset_ms: AtomicI64,
    samples: Mutex<BTreeMap<NodeId, Sample>>,
    start: Instant,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    /// Peer wall clock minus ours, ms.
    offset_ms: i64,
    at: Instant,
}

impl ClusterClock {
    pub fn new(offset_ms: i64) -> ClusterClock {
        ClusterClock {
            offset_ms: AtomicI64::new(offset_ms),
            samples: Mutex::new(BTreeMap::new()),
            start: Instant::now(),
        }
    }

    /// This node's wall clock in ms since the epoch (skewed by the test offset).
    pub fn wall_ms(&self) -> u64 {
        let sys = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        (sys + self.offset_ms.load(Ordering::Relaxed)).max(0) as u64
    }

    /// Test only: changes the wall-clock offset at run time (`--test-clock-offset-file`).
    pub fn set_offset_ms(&self, offset_ms: i64) {
        self.offset_ms.store(offset_ms, Ordering::Relaxed);
    }

    /// Milliseconds of the monotonic clock since the node started.
    pub fn mono_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Records a peer's reading: `sent_wall`/`recv_wall` are our wall clock around the
    /// call, `peer_wall` the peer's answer.
    pub fn record(&self, peer: NodeId, sent_wall: u64, peer_wall: u64, recv_wall: u64) {
        let mid = (sent_wall as i128 + recv_wall as i128) / 2;
        let offset = (peer_wall as i128 - mid).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        s.insert(
            peer,
            Sample {
                offset_ms: offset,
                at: Instant::now(),
            },
        );
    }

    pub fn forget(&self, peer: NodeId) {
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        s.remove(&peer);
    }

    /// The median of this node's clock and the fresh samples of `peers`, if they are a
    /// majority of `cluster_size` clocks; `None` otherwise.
    pub fn target_ms(&self, me: NodeId, peers: &[NodeId], cluster_size: usize) -> Option<u64> {
        let own = self.wall_ms();
        let s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut offsets = vec![0i64];
        for p in peers {
            if *p == me {
                continue;
            }
            if let Some(sample) = s.get(p) {
                if sample.at.elapsed() <= SAMPLE_FRESH {
                    offsets.push(sample.offset_ms);
                }
            }
        }
        median_target(own, &mut offsets, cluster_size)
    }
}

/// Lower median of `own + offsets`, if `offsets` (own included, as 0) are a majority.
pub fn median_target(own: u64, offsets: &mut [i64], cluster_size: usize) -> Option<u64> {
    if offsets.len() * 2 <= cluster_size.max(1) {
        return None;
    }
    offsets.sort_unstable();
    let m = offsets[(offsets.len() - 1) / 2];
    Some((own as i64).saturating_add(m).max(0) as u64)
}

/// The leader's stamp state for one shard.
#[derive(Clone, Debug)]
pub struct Stamper {
    /// Fraction of elapsed time by which a stamp may deviate from the monotonic clock to
    /// steer toward the target, in parts per million.
    pub slew_ppm: u64,
    last_ms: u64,
    last_mono: u64,
    term: Option<u64>,
}

impl Stamper {
    pub fn new(slew_ppm: u64) -> Stamper {
        Stamper {
            slew_ppm,
            last_ms: 0,
            last_mono: 0,
            term: None,
        }
    }

    /// The logical time of the next entry proposed in `term`, given the shard's applied
    /// time, the monotonic clock now and the cluster time target (if known).
    pub fn stamp(&mut self, term: u64, applied_ms: u64, mono_ms: u64, target: Option<u64>) -> u64 {
        if self.term != Some(term) {
            // Took office: continue from what the shard already agreed on.
            self.term = Some(term);
            self.last_ms = self.last_ms.max(applied_ms);
            self.last_mono = mono_ms;
        }
        self.last_ms = self.last_ms.max(applied_ms);
        let t = if self.last_ms == 0 {
            // Genesis: an empty shard takes the target (or, without one, our clock via
            // the caller's fallback), once.
            target.unwrap_or(0)
        } else {
            let dt = mono_ms.saturating_sub(self.last_mono);
            let base = self.last_ms + dt;
            match target {
                None => base,
                Some(target) => {
                    let max_adj = dt.saturating_mul(self.slew_ppm) / 1_000_000;
                    if target >= base {
                        base + (target - base).min(max_adj)
                    } else {
                        base - (base - target).min(max_adj)
                    }
                }
            }
        };
        let t = t.max(self.last_ms);
        self.last_ms = t;
        self.last_mono = mono_ms;
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_needs_a_majority_and_ignores_one_outlier_each_way() {
        // 3 clocks: own +10 min, one correct (offset -600000), one -10 min (-1200000).
        let own = 1_000_600_000;
        let mut offs = vec![0, -600_000, -1_200_000];
        assert_eq!(median_target(own, &mut offs, 3), Some(1_000_000_000));
        let mut only_me = vec![0];
        assert_eq!(median_target(own, &mut only_me, 3), None);
        let mut two = vec![0, -600_000];
        // Lower median of two: the slower clock (conservative: expiry late, never early).
        assert_eq!(median_target(own, &mut two, 3), Some(1_000_000_000));
    }

    #[test]
    fn stamps_never_go_back_and_slew_is_bounded() {
        let mut s = Stamper::new(100_000); // 10 %
        assert_eq!(s.stamp(1, 0, 0, Some(1_000_000)), 1_000_000); // genesis
                                                                  // Target jumps 10 min ahead: 1 s later we may move at most 1.1 s.
        assert_eq!(s.stamp(1, 1_000_000, 1_000, Some(1_600_000)), 1_001_100);
        // Target 10 min behind: time still advances, at 0.9 of the monotonic rate.
        assert_eq!(s.stamp(1, 1_000_000, 2_000, Some(400_000)), 1_002_000);
        // Never back, even if the applied time is ahead (another leader stamped it).
        assert_eq!(s.stamp(2, 1_500_000, 2_000, Some(400_000)), 1_500_000);
        // Catching up never overshoots the target.
        let mut c = Stamper::new(1_000_000);
        c.stamp(1, 0, 0, Some(10_000));
        assert_eq!(c.stamp(1, 10_000, 1_000, Some(11_500)), 11_500);
    }
}
