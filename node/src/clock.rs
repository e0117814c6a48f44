//! Logical time: how a leader stamps entries.
//!
//! The state machine's clock is whatever the leader stamps (clamped so it never goes
//! back). A leader must not let its own wall clock decide that: one node minutes off
//! would expire credits and leases early. So:
//!
//! 1. **Target** — every node samples the wall clocks of its peers (the `Clock` RPC,
//!    corrected by half the round trip). Of the m fresh samples (its own clock included),
//!    the target is the (m − f)-th smallest, f = ⌊(n − 1)/2⌋ the clocks a cluster of n
//!    voters tolerates being wrong, computed only when m is a majority of n. At most f
//!    samples lie above it, so at least one correct clock is at or above it: however
//!    many of the unreachable nodes are correct, a minority of fast clocks can never move
//!    it ahead of every correct clock.
//! 2. **Rate** — the leader advances logical time by its monotonic clock since the last
//!    stamp (real time), steered toward the target by at most `slew` × elapsed (default
//!    500 ppm, 0.05 %), never past it when catching up. Without a target it advances by
//!    the monotonic clock alone.
//! 3. **Taking office** — a new leader starts from the greatest of the last applied
//!    time, its own last stamp, and the newest applied time it saw as a follower plus
//!    its monotonic clock since (so an election's gap is counted even when its target is
//!    behind: a slow clock among its samples), and at its first stamp with a target adopts the target at
//!    once if it is ahead (after an outage, time resumes at the real instant instead of
//!    catching up fast for a long while) — less the lag the shard's time was running
//!    with when this node last saw it, which it keeps slewing away as the old leader
//!    did (a jump would end every lease stamped during the lag early); time never goes
//!    back. Until it has a target
//!    it stamps nothing (`Stamper::needs_target`: proposals answer `ClockNotReady`,
//!    retryable), so no entry is stamped at the pre-outage time and billed the jump.
//!
//! Bounds (docs/DESIGN.md §28, §45): billed time over any interval is within the slew
//! of real elapsed time, and logical time never runs ahead of the fastest correct clock
//! by more than the sampling error (half a round trip plus the sample age). The one other
//! jump is genesis: the first stamp of an empty shard is the target itself.

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
    /// The boot-time clock at start (`mono_ms`).
    start_boot_ms: u64,
}

/// The boot-time clock in ms (`None` where the system has none: then `Instant`).
fn boottime_ms() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    (rc == 0).then(|| (ts.tv_sec as u64).saturating_mul(1_000) + ts.tv_nsec as u64 / 1_000_000)
}

/// How many entries a replica's log may hold beyond what it has applied for its applied
/// time to count as live ([`live_term`]): the replication pipeline's depth, not a
/// backlog.
pub const LIVE_APPLY_BACKLOG_MAX: u64 = 256;

/// The term whose leader is stamping the time this replica applies now, if it is
/// applying live: a leader known, the last applied entry of the current term, and no
/// more than [`LIVE_APPLY_BACKLOG_MAX`] entries of its log left to apply (a replica
/// draining a backlog applies time that is behind by the backlog — Raft may elect it,
/// since it elects on the log, not on what is applied). `None` otherwise: the
/// [`Stamper`] records no lag from what it observes then.
pub fn live_term(
    leader_known: bool,
    current_term: u64,
    last_applied: Option<(u64, u64)>,
    last_log_index: Option<u64>,
) -> Option<u64> {
    let (term, applied) = last_applied?;
    let backlog = last_log_index.unwrap_or(0).saturating_sub(applied);
    (leader_known && term == current_term && backlog <= LIVE_APPLY_BACKLOG_MAX)
        .then_some(current_term)
}

/// A peer's wall clock as read at one instant of ours. Anchored on our monotonic clock,
/// not our wall clock: a step of our own wall clock (an NTP step after boot) moves our
/// own reading only, not every peer's with it.
#[derive(Clone, Copy, Debug)]
struct Sample {
    /// The peer's wall clock, ms, at `at` (the middle of the call).
    peer_wall_ms: u64,
    at: Instant,
}

impl ClusterClock {
    pub fn new(offset_ms: i64) -> ClusterClock {
        ClusterClock {
            offset_ms: AtomicI64::new(offset_ms),
            samples: Mutex::new(BTreeMap::new()),
            start: Instant::now(),
            start_boot_ms: boottime_ms().unwrap_or(0),
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

    /// Milliseconds of the node's monotonic clock since it started: the boot-time clock
    /// (`CLOCK_BOOTTIME`), which never steps and, unlike `Instant` (`CLOCK_MONOTONIC`),
    /// counts the time the host spent suspended — with `Instant` a leader whose host was
    /// suspended for S fell S behind, and from this session's lag rule its followers
    /// would keep that lag across a change of leader.
    pub fn mono_ms(&self) -> u64 {
        match boottime_ms() {
            Some(now) => now.saturating_sub(self.start_boot_ms),
            None => self.start.elapsed().as_millis() as u64,
        }
    }

    /// Records a peer's reading: `sent`/`received` are our monotonic clock around the
    /// call, `peer_wall` the peer's answer (taken, we assume, half way through it).
    pub fn record(&self, peer: NodeId, sent: Instant, peer_wall: u64, received: Instant) {
        let at = sent + received.saturating_duration_since(sent) / 2;
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        s.insert(
            peer,
            Sample {
                peer_wall_ms: peer_wall,
                at,
            },
        );
    }

    pub fn forget(&self, peer: NodeId) {
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        s.remove(&peer);
    }

    /// The target of this node's clock and the fresh samples of `peers` ([`median_target`]),
    /// if they are a majority of `cluster_size` clocks; `None` otherwise.
    pub fn target_ms(&self, me: NodeId, peers: &[NodeId], cluster_size: usize) -> Option<u64> {
        let own = self.wall_ms();
        let s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut offsets = vec![0i64];
        for p in peers {
            if *p == me {
                continue;
            }
            if let Some(sample) = s.get(p) {
                let age = sample.at.elapsed();
                if age <= SAMPLE_FRESH {
                    // The peer's clock now: its reading plus the real time since.
                    let now = sample.peer_wall_ms as i128 + age.as_millis() as i128;
                    let offset = (now - own as i128).clamp(i64::MIN as i128, i64::MAX as i128);
                    offsets.push(offset as i64);
                }
            }
        }
        median_target(own, &mut offsets, cluster_size)
    }
}

/// The target of `own + offsets` (own included, as 0), if the offsets are a majority
/// of `cluster_size` clocks: the (m − f)-th smallest of the m samples, f = ⌊(n−1)/2⌋,
/// and never above the lower median. With every clock sampled that is the lower median;
/// with some unreachable it leans to the slower samples, so that the f possibly-wrong
/// clocks can all be fast and still sit above it. (With an even number of voters the
/// (m − f)-th smallest alone was the upper median — with two voters, the faster clock:
/// a cluster passing through two voters while one node is replaced took a fast clock's
/// time at its next change of leader.)
pub fn median_target(own: u64, offsets: &mut [i64], cluster_size: usize) -> Option<u64> {
    let (m, n) = (offsets.len(), cluster_size.max(1));
    if m * 2 <= n {
        return None;
    }
    let f = (n - 1) / 2;
    offsets.sort_unstable();
    let pick = offsets[m.saturating_sub(f + 1).min((m - 1) / 2)];
    Some((own as i64).saturating_add(pick).max(0) as u64)
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
    /// Whether this term has stamped with a target yet (the first such stamp may jump
    /// forward to it).
    synced: bool,
    /// The newest applied time this node saw (as follower or leader) and its monotonic
    /// clock when it saw it: a new leader continues from there plus the real time since,
    /// so an election's gap is counted whatever its target says.
    seen: Option<(u64, u64)>,
    /// How far this node's clock target was ahead of the applied time it saw, when it saw
    /// it stamped live: the lag the shard's time was running with (behind a slow target
    /// that has since caught up, say). A new leader keeps it and slews it away, as the
    /// old leader would have: adopting the target at once would pay the whole lag back in
    /// one entry, and end every lease, grace and deadline stamped during the lag early
    /// by all of it. Only time this process saw a live leader stamp counts
    /// ([`Stamper::observe`]): the time a restarted node's log replay reaches, or a
    /// lagging replica catching up, is behind by an outage or a backlog, not by a lag
    /// any lease was stamped in.
    seen_lag: Option<u64>,
    /// The last observation of live time: (the leader's term, applied time, monotonic
    /// clock).
    live: Option<(u64, u64, u64)>,
}

/// How much faster than the monotonic clock the applied time may advance between two
/// observations and still count as stamped live (ticks come every second, observations
/// every half second, so a live shard's time moves in steps of about a second).
pub const LIVE_RATE_SLACK_MS: u64 = 2_000;

/// How far a new leader's first stamp may move past the time it carries over from what
/// it saw (plus the lag it saw) toward its target: the age of the applied time it saw
/// when it saw it — the time between an entry's stamp and its observation, a tick (1 s)
/// at most on an idle shard. Without it every failover would leave that much lag behind.
pub const OFFICE_CATCH_UP_MAX_MS: u64 = 1_000;

impl Stamper {
    pub fn new(slew_ppm: u64) -> Stamper {
        Stamper {
            slew_ppm,
            last_ms: 0,
            last_mono: 0,
            term: None,
            synced: false,
            seen: None,
            seen_lag: None,
            live: None,
        }
    }

    /// Records that the shard's applied time is `applied_ms` at monotonic `mono_ms`, when
    /// this node's clock target is `target` (called by every replica as it goes; only a
    /// newer time replaces the last). `live_term` is the term of a leader this node
    /// knows whose entries it is applying (the last applied entry is of the current
    /// term), if any: the lag is recorded only from applied time that advanced under
    /// that leader, since the last such observation, no faster than the monotonic clock
    /// (plus [`LIVE_RATE_SLACK_MS`]) — time stamped live, not a log replayed after a
    /// restart or a backlog applied in a hurry. Otherwise the lag seen last is kept.
    pub fn observe(
        &mut self,
        applied_ms: u64,
        mono_ms: u64,
        target: Option<u64>,
        live_term: Option<u64>,
    ) {
        // A shard with no time yet (nothing stamped: before `init`, or only its blank
        // and membership entries applied) is not an observation: its first stamp is the
        // target itself (genesis), and a "lag" of the whole wall clock would keep its
        // time in 1970.
        if applied_ms == 0 {
            return;
        }
        if self.seen.is_none_or(|(t, _)| applied_ms > t) {
            self.seen = Some((applied_ms, mono_ms));
        }
        let Some(term) = live_term else {
            return;
        };
        match self.live {
            Some((t_term, t0, m0)) if t_term == term => {
                if applied_ms <= t0 {
                    return;
                }
                let real = mono_ms.saturating_sub(m0);
                if let Some(target) =
                    target.filter(|_| applied_ms - t0 <= real + LIVE_RATE_SLACK_MS)
                {
                    self.seen_lag = Some(target.saturating_sub(applied_ms));
                }
            }
            _ => {}
        }
        self.live = Some((term, applied_ms, mono_ms));
    }

    /// Whether a stamp in `term` needs a clock target first: a leader that took office
    /// (after an outage, a restart, a failover) must not stamp from the last applied time
    /// before it knows the cluster's time, or the entries in between (a job placed and
    /// metered) would be billed the jump to it.
    pub fn needs_target(&self, term: u64) -> bool {
        self.term != Some(term) || !self.synced
    }

    /// The logical time of the next entry proposed in `term`, given the shard's applied
    /// time, the monotonic clock now and the cluster time target (if known).
    pub fn stamp(&mut self, term: u64, applied_ms: u64, mono_ms: u64, target: Option<u64>) -> u64 {
        if self.term != Some(term) {
            // Took office: continue from what the shard already agreed on, advanced by
            // the real time since this node saw it (never early: the time seen was
            // stamped before it was seen, and the monotonic clock measures real time).
            let carried = self
                .seen
                .map_or(0, |(t, at)| t.saturating_add(mono_ms.saturating_sub(at)));
            self.term = Some(term);
            self.last_ms = self.last_ms.max(applied_ms).max(carried);
            self.last_mono = mono_ms;
            self.synced = false;
        }
        self.last_ms = self.last_ms.max(applied_ms);
        let t = if self.last_ms == 0 {
            // Genesis: an empty shard takes the target (or, without one, our clock via
            // the caller's fallback), once.
            self.synced = target.is_some();
            target.unwrap_or(0)
        } else {
            let dt = mono_ms.saturating_sub(self.last_mono);
            let base = self.last_ms + dt;
            match target {
                None => base,
                Some(target) if !self.synced => {
                    // Took office (or the first target of the term): the cluster's time
                    // at once when it is ahead — after an outage, no fast catch-up —
                    // less the lag the shard's time ran with when this node last saw
                    // it (`seen_lag`), which the slew below keeps paying back.
                    self.synced = true;
                    let to = match (self.seen, self.seen_lag) {
                        (Some(_), Some(lag)) => target
                            .saturating_sub(lag)
                            .max(target.min(base.saturating_add(OFFICE_CATCH_UP_MAX_MS))),
                        _ => target,
                    };
                    base.max(to)
                }
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
    /// A leader new in office stamps nothing until it has a target (the CI failure of
    /// the outage test: entries stamped at the pre-outage time, then the jump billed).
    #[test]
    fn a_new_term_needs_a_target_before_its_first_stamp() {
        let mut st = Stamper::new(500);
        st.stamp(1, 1_000, 0, Some(1_000));
        assert!(!st.needs_target(1));
        assert!(st.needs_target(2), "a new term");
        // Without a target the term stays unsynced; with one, it adopts it at once.
        st.stamp(2, 1_000, 10, None);
        assert!(st.needs_target(2));
        assert_eq!(st.stamp(2, 1_000, 20, Some(61_000)), 61_000);
        assert!(!st.needs_target(2));
    }

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

    /// Issue 21, finding 5: with two of five clocks fast and nodes unreachable, the
    /// target is still a correct clock (the old lower median of a bare majority, three
    /// samples with two fast, was fast).
    #[test]
    fn a_minority_of_fast_clocks_never_moves_the_target_even_with_nodes_down() {
        let own = 1_000_000_000;
        let fast = 600_000;
        // Five voters, four sampled (one down): two correct (own included), two fast.
        let mut four = vec![0, 0, fast, fast];
        assert_eq!(median_target(own, &mut four, 5), Some(own));
        // Three sampled: one correct, two fast.
        let mut three = vec![0, fast, fast];
        assert_eq!(median_target(own, &mut three, 5), Some(own));
        // All five: two fast, three correct.
        let mut five = vec![fast, 0, fast, 0, 0];
        assert_eq!(median_target(own, &mut five, 5), Some(own));
        // Two of five sampled is no majority.
        let mut two = vec![0, fast];
        assert_eq!(median_target(own, &mut two, 5), None);
        // An even number of voters, every clock sampled: the lower median, not the upper
        // (two voters, one fast: the correct one; four, two fast: a correct one).
        let mut pair = vec![fast, 0];
        assert_eq!(median_target(own, &mut pair, 2), Some(own));
        let mut four_all = vec![fast, 0, fast, 0];
        assert_eq!(median_target(own, &mut four_all, 4), Some(own));
        // One slow clock among three (all sampled) does not move it either.
        let mut slow = vec![0, -fast, 0];
        assert_eq!(median_target(own, &mut slow, 3), Some(own));
    }

    /// Issue 21, finding 4: after a whole-cluster outage the new leader resumes at the
    /// cluster's time at once, and then advances at the real rate (the old 20 % slew
    /// billed 1.2× for five times the outage's length).
    #[test]
    fn after_an_outage_time_resumes_at_once_and_runs_at_the_real_rate() {
        let t0 = 1_000_000_000;
        // The shard's last applied time is t0; 60 s later a fresh process takes office.
        let mut s = Stamper::new(500);
        let first = s.stamp(7, t0, 5_000, None);
        assert_eq!(first, t0, "no target yet: continue from the applied time");
        let resumed = s.stamp(7, t0, 5_100, Some(t0 + 60_100));
        assert_eq!(
            resumed,
            t0 + 60_100,
            "the first stamp with a target adopts it"
        );
        // From now on: the monotonic clock, steered by at most 500 ppm.
        let mut last = resumed;
        for k in 1..=30u64 {
            let mono = 5_100 + k * 1_000;
            // The target runs 10 % fast (a skewed median): the rate moves by 0.05 % only.
            let target = t0 + 60_100 + k * 1_100;
            let t = s.stamp(7, last, mono, Some(target));
            assert!(
                t - last <= 1_000 && t - last >= 999,
                "advanced {} ms in 1 s",
                t - last
            );
            last = t;
        }
        assert!(last - resumed <= 30_015 && last - resumed >= 29_985);
        // A new leader whose target is behind continues from the applied time, at the
        // real rate less at most the slew.
        let mut next = Stamper::new(500);
        let a = next.stamp(8, last, 0, Some(last - 5_000));
        assert_eq!(a, last);
        let b = next.stamp(8, a, 10_000, Some(last - 5_000));
        assert_eq!(b - a, 10_000 - 5);
    }

    /// Issue 21, finding 4 (the failover half): a follower that takes office with a
    /// target behind the shard's time (a slow clock among the samples it has) still
    /// counts the election's gap: it continues from the applied time it last saw,
    /// advanced by its own monotonic clock since it saw it. (The old stamper continued
    /// from the applied time itself, so a 3 s election was never billed.)
    #[test]
    fn a_failover_to_a_slow_target_keeps_the_election_gap() {
        let t0 = 2_000_000_000;
        let mut s = Stamper::new(500);
        // As a follower, it saw the shard's time reach t0 at its monotonic 10_000.
        s.observe(t0 - 200, 9_800, None, None);
        s.observe(t0, 10_000, None, None);
        // The same applied time seen again later is not a newer observation.
        s.observe(t0, 11_000, None, None);
        // Elected 3 s later; its target (the lower of a slow clock and a correct one)
        // is 10 minutes behind.
        let first = s.stamp(4, t0, 13_000, Some(t0 - 600_000));
        assert_eq!(first, t0 + 3_000, "the gap since it last saw an entry");
        // And from then on the real rate less at most the slew.
        let next = s.stamp(4, first, 23_000, Some(t0 - 600_000));
        assert_eq!(next - first, 10_000 - 5);
        // Without an observation (a fresh process), the applied time as before.
        let mut fresh = Stamper::new(500);
        assert_eq!(fresh.stamp(4, t0, 13_000, Some(t0 - 600_000)), t0);
    }

    /// Found by a read-only review (twenty-second session): logical time that fell behind
    /// the cluster's clocks (a slow clock was the target for days, then was fixed) is
    /// slewed back by the leader at 500 ppm. A new leader adopted its target at once, so
    /// the whole lag came back as one jump: every node lease, grace and deadline stamped
    /// during the lag ended early by all of it, and a node whose agent still held its
    /// lease was declared down and its jobs placed again elsewhere. Now the new leader
    /// keeps the lag it saw as a follower (catching up at most
    /// [`OFFICE_CATCH_UP_MAX_MS`], what observing costs) and slews it away.
    #[test]
    fn a_new_leader_keeps_the_lag_the_shards_time_ran_with() {
        let t0 = 3_000_000_000;
        let lag = 120_000;
        let mut s = Stamper::new(500);
        // As a follower it saw the shard's time run 120 s behind its target, the last
        // time at its monotonic 50_000.
        for k in 0..=50u64 {
            s.observe(
                t0 + k * 1_000,
                k * 1_000,
                Some(t0 + lag + k * 1_000),
                Some(8),
            );
        }
        // Elected 2 s later; its target is the real time.
        let carried = t0 + 50_000 + 2_000;
        let first = s.stamp(9, t0 + 50_000, 52_000, Some(carried + lag));
        assert!(
            first >= carried && first <= carried + OFFICE_CATCH_UP_MAX_MS,
            "the first stamp jumped {} ms past the time carried over",
            first - carried
        );
        // And from then on the real rate plus at most the slew.
        let next = s.stamp(9, first, 62_000, Some(carried + lag + 10_000));
        assert_eq!(next - first, 10_000 + 5);
        // Time this node did not see pass (its monotonic clock stopped while its host
        // was suspended, say) beyond the lag it saw: the target at once, as after an
        // outage.
        let mut none = Stamper::new(500);
        none.observe(t0, 0, Some(t0), Some(8));
        none.observe(t0 + 1_000, 1_000, Some(t0 + 1_000), Some(8));
        assert_eq!(
            none.stamp(9, t0 + 1_000, 3_000, Some(t0 + 60_000)),
            t0 + 60_000
        );
    }

    /// A replica is applying live only with a leader known, of the current term, and no
    /// backlog to drain (a third review: one draining a backlog at up to five times the
    /// real rate passed the rate check and recorded the backlog as a lag).
    #[test]
    fn only_a_replica_applying_live_under_a_known_leader_has_a_live_term() {
        assert_eq!(live_term(true, 4, Some((4, 1_000)), Some(1_010)), Some(4));
        assert_eq!(live_term(false, 4, Some((4, 1_000)), Some(1_010)), None);
        assert_eq!(live_term(true, 5, Some((4, 1_000)), Some(1_010)), None);
        assert_eq!(live_term(true, 4, None, Some(10)), None);
        let far = 1_000 + LIVE_APPLY_BACKLOG_MAX + 1;
        assert_eq!(live_term(true, 4, Some((4, 1_000)), Some(far)), None);
        // The boot-time clock runs.
        let c = ClusterClock::new(0);
        let a = c.mono_ms();
        std::thread::sleep(Duration::from_millis(20));
        assert!(c.mono_ms() >= a + 20);
    }

    /// Found by a read-only review of the lag rule's first version: a node restarted
    /// after an outage observed the time its log replay reached, against its clock
    /// target, as a lag of the whole outage, and kept it as leader (time stayed the
    /// outage's length behind). Time seen with no live leader, or advancing faster than
    /// real time (a replay, a backlog), records no lag: the new leader adopts its target.
    #[test]
    fn time_replayed_or_caught_up_records_no_lag() {
        let t0 = 4_000_000_000;
        let outage = 3_600_000;
        let now = t0 + outage;
        // A restarted node replays its log (no leader known yet: `None`), or a replica
        // catches up on a backlog under a leader it knows (`Some`): ten seconds of old
        // time per half second observed, too fast to be time stamped live, with its
        // target at the real time.
        for live in [None, Some(6)] {
            let mut s = Stamper::new(500);
            for k in 0..=10u64 {
                let applied = t0 - 100_000 + k * 10_000;
                s.observe(applied, k * 500, Some(now + k * 500), live);
            }
            let first = s.stamp(7, t0, 6_000, Some(now + 6_000));
            assert_eq!(first, now + 6_000, "live {live:?}");
        }
    }

    /// Found reviewing this session's diff: an empty shard's applied time (0) observed
    /// with a target (before `init`, the node's own clock) recorded a lag of the whole
    /// wall clock, and the first stamp kept it: the shard's time began in 1970. An
    /// applied time of 0 is not observed, and genesis takes the target.
    #[test]
    fn an_empty_shards_time_is_not_observed_and_genesis_takes_the_target() {
        let t = 1_800_000_000_000;
        let mut s = Stamper::new(500);
        s.observe(0, 0, Some(t), Some(1));
        s.observe(0, 500, Some(t + 500), Some(1));
        assert_eq!(s.stamp(1, 0, 10_000, Some(t + 10_000)), t + 10_000);
    }

    /// Found by the same review: peers' samples were kept as offsets from this node's own
    /// wall clock, so a step of that clock (an NTP step soon after boot) moved every
    /// peer's estimate with it, and the target with them: a node that took office right
    /// after its clock stepped an hour ahead stamped an hour ahead, for good. Now a
    /// sample is the peer's reading at an instant of the monotonic clock.
    #[test]
    fn a_step_of_the_own_wall_clock_moves_no_peer_sample() {
        let c = ClusterClock::new(0);
        let real = c.wall_ms();
        let at = Instant::now();
        c.record(2, at, real, at);
        c.record(3, at, real, at);
        c.set_offset_ms(3_600_000); // this node's clock steps an hour ahead
        let t = c.target_ms(1, &[1, 2, 3], 3).expect("a majority sampled");
        assert!(
            t >= real && t < real + 5_000,
            "the target moved {} ms with this node's own clock",
            t - real
        );
    }
}
