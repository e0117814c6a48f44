//! Nemeses: faults applied to the cluster on a schedule, one at a time, each recorded
//! in the history as `start-<kind>` and `stop-<kind>` (process -1). The schedule —
//! gaps, durations, targets, variants — comes from the run's seed; kinds are taken in
//! a seeded rotation so that every enabled kind runs once before any runs twice.

use crate::cluster::Cluster;
use crate::history::History;
use crate::proxy::Cut;
use crate::rng::Rng;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, serde::Serialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Nemesis {
    /// SIGKILL a node (often the leader), restart it later.
    Kill,
    /// SIGSTOP a node (often the leader), SIGCONT it later.
    Pause,
    /// Partitions through the link proxies: isolate the leader, majority/minority,
    /// bridge, or slow links (per-chunk delay); black-holed or reset.
    Partition,
    /// Restart a node with its wall clock skewed by ±2..30 s, later back to 0.
    Clock,
    /// Remove a voter from every shard, later add it back as a learner and promote it.
    Membership,
    /// A disk fault: fill the small tmpfs holding one node's data dir (ENOSPC, needs
    /// root), or make a node's WAL fsyncs fail (`--test-fsync-fail-file`); the node
    /// must exit. Then heal and restart it.
    Disk,
}

impl Nemesis {
    pub const ALL: [Nemesis; 6] = [
        Nemesis::Kill,
        Nemesis::Pause,
        Nemesis::Partition,
        Nemesis::Clock,
        Nemesis::Membership,
        Nemesis::Disk,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Nemesis::Kill => "kill",
            Nemesis::Pause => "pause",
            Nemesis::Partition => "partition",
            Nemesis::Clock => "clock",
            Nemesis::Membership => "membership",
            Nemesis::Disk => "disk",
        }
    }
}

/// What has to be undone.
enum Active {
    Killed(u64),
    Paused(u64),
    Partitioned,
    Skewed(u64),
    /// A running node's clock offset changed once (file), or flipping (task).
    Bumped(u64),
    Strobing(
        u64,
        Arc<std::sync::atomic::AtomicBool>,
        tokio::task::JoinHandle<()>,
    ),
    Removed(u64),
    /// Node, variant, and where its log stood when the fault began.
    DiskFault(u64, &'static str, u64),
}

/// A target: the leader of shard 0 half the time, else a random running voter.
async fn target(c: &Cluster, rng: &mut Rng) -> u64 {
    if rng.chance(50) {
        if let Some(l) = c.leader_of(0).await {
            return l;
        }
    }
    let running: Vec<u64> = c
        .voters
        .iter()
        .copied()
        .filter(|v| c.is_running(*v))
        .collect();
    if running.is_empty() {
        1
    } else {
        *rng.pick(&running)
    }
}

async fn start(c: &mut Cluster, kind: Nemesis, rng: &mut Rng, h: &History) -> Option<Active> {
    match kind {
        Nemesis::Kill => {
            let id = target(c, rng).await;
            c.kill(id);
            h.nemesis("start-kill", json!({"signal": "KILL"}), Some(id));
            Some(Active::Killed(id))
        }
        Nemesis::Pause => {
            let id = target(c, rng).await;
            let ok = c.pause(id);
            h.nemesis("start-pause", json!({"signal": "STOP", "ok": ok}), Some(id));
            Some(Active::Paused(id))
        }
        Nemesis::Partition => {
            let how = if rng.chance(50) {
                Cut::Blackhole
            } else {
                Cut::Reset
            };
            let nodes: Vec<u64> = (1..=c.n).collect();
            match rng.below(4) {
                0 => {
                    let l = c.leader_of(0).await.unwrap_or(1);
                    let rest: Vec<u64> = nodes.iter().copied().filter(|x| *x != l).collect();
                    c.partition(&[vec![l], rest.clone()], how);
                    h.nemesis(
                        "start-partition",
                        json!({"variant": "isolate-leader", "groups": [[l], rest], "cut": how}),
                        Some(l),
                    );
                }
                1 => {
                    let mut shuffled = nodes.clone();
                    for i in (1..shuffled.len()).rev() {
                        shuffled.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    let minority: Vec<u64> = shuffled[..(c.n as usize / 2)].to_vec();
                    let majority: Vec<u64> = shuffled[(c.n as usize / 2)..].to_vec();
                    c.partition(&[minority.clone(), majority.clone()], how);
                    h.nemesis("start-partition", json!({"variant": "majority-minority", "groups": [minority, majority], "cut": how}), None);
                }
                2 => {
                    // Bridge: one node sees everyone; the two sides do not see each other.
                    let bridge = *rng.pick(&nodes);
                    let others: Vec<u64> = nodes.iter().copied().filter(|x| *x != bridge).collect();
                    let half = others.len() / 2;
                    let (a, b) = others.split_at(half);
                    let mut pairs = Vec::new();
                    for x in a {
                        for y in b {
                            pairs.push((*x, *y));
                        }
                    }
                    c.cut_pairs(&pairs, how);
                    h.nemesis(
                        "start-partition",
                        json!({"variant": "bridge", "bridge": bridge, "sides": [a, b], "cut": how}),
                        Some(bridge),
                    );
                }
                _ => {
                    let ms = rng.range(20, 150);
                    c.set_delay(ms);
                    h.nemesis(
                        "start-partition",
                        json!({"variant": "slow-links", "delay_ms_per_chunk": ms}),
                        None,
                    );
                }
            }
            Some(Active::Partitioned)
        }
        Nemesis::Clock => {
            let id = target(c, rng).await;
            let mag = rng.range(2_000, 30_000) as i64;
            let offset = if rng.chance(50) { mag } else { -mag };
            match rng.below(3) {
                // A restart with a skewed clock.
                0 => {
                    let r = c.set_clock(id, offset);
                    h.nemesis(
                        "start-clock",
                        json!({"variant": "restart", "offset_ms": offset, "restart": r.is_ok()}),
                        Some(id),
                    );
                    Some(Active::Skewed(id))
                }
                // A bump: the running node's clock jumps.
                1 => {
                    c.write_clock(id, Some(offset));
                    h.nemesis(
                        "start-clock",
                        json!({"variant": "bump", "offset_ms": offset}),
                        Some(id),
                    );
                    Some(Active::Bumped(id))
                }
                // A strobe: the running node's clock flips between +mag and -mag every
                // 50-250 ms until the fault ends.
                _ => {
                    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let file = c.clock_file(id);
                    let period = Duration::from_millis(rng.range(50, 250));
                    let flag = stop.clone();
                    let task = tokio::spawn(async move {
                        let mut sign = 1;
                        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                            let _ = std::fs::write(&file, format!("{}\n", sign * mag));
                            sign = -sign;
                            tokio::time::sleep(period).await;
                        }
                    });
                    h.nemesis(
                        "start-clock",
                        json!({"variant": "strobe", "offset_ms": [mag, -mag],
                               "period_ms": period.as_millis() as u64}),
                        Some(id),
                    );
                    Some(Active::Strobing(id, stop, task))
                }
            }
        }
        Nemesis::Membership => {
            if c.voters.len() < 3 {
                return None;
            }
            let id = target(c, rng).await;
            match c.remove_voter(id).await {
                Ok(()) => {
                    h.nemesis(
                        "start-membership",
                        json!({"removed": id, "voters": c.voters}),
                        Some(id),
                    );
                    Some(Active::Removed(id))
                }
                Err(e) => {
                    h.nemesis(
                        "start-membership",
                        json!({"removed": null, "error": format!("{e:#}")}),
                        Some(id),
                    );
                    None
                }
            }
        }
        Nemesis::Disk => {
            // ENOSPC needs the tmpfs node (root); a failing fsync works on any node.
            let enospc = c.disk_node.is_some() && rng.chance(50);
            let (id, variant, written, log_from) = if enospc {
                let id = c.disk_node?;
                let from = c.log_len(id);
                (id, "enospc", c.fill_disk().ok(), from)
            } else {
                let id = target(c, rng).await;
                let from = c.log_len(id);
                c.fail_fsync(id, true);
                (id, "fsync-failure", None, from)
            };
            let mut exited = None;
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(5) {
                if let Some(st) = c.lc.exited(id) {
                    exited = Some(st.to_string());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            h.nemesis(
                "start-disk",
                json!({"variant": variant, "filled_bytes": written, "node_exited": exited,
                       "after_ms": started.elapsed().as_millis() as u64}),
                Some(id),
            );
            Some(Active::DiskFault(id, variant, log_from))
        }
    }
}

async fn stop(c: &mut Cluster, a: Active, h: &History) {
    match a {
        Active::Killed(id) => {
            let r = c.restart(id);
            h.nemesis("stop-kill", json!({"restarted": r.is_ok()}), Some(id));
        }
        Active::Paused(id) => {
            let ok = c.resume(id);
            h.nemesis("stop-pause", json!({"signal": "CONT", "ok": ok}), Some(id));
        }
        Active::Partitioned => {
            c.heal();
            h.nemesis("stop-partition", json!({"healed": true}), None);
        }
        Active::Skewed(id) => {
            let r = c.set_clock(id, 0);
            h.nemesis(
                "stop-clock",
                json!({"variant": "restart", "offset_ms": 0, "restart": r.is_ok()}),
                Some(id),
            );
        }
        Active::Bumped(id) => {
            c.write_clock(id, None);
            h.nemesis(
                "stop-clock",
                json!({"variant": "bump", "offset_ms": 0}),
                Some(id),
            );
        }
        Active::Strobing(id, stop, task) => {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = task.await;
            c.write_clock(id, None);
            h.nemesis(
                "stop-clock",
                json!({"variant": "strobe", "offset_ms": 0}),
                Some(id),
            );
        }
        Active::Removed(id) => {
            let r = c.readd_voter(id).await;
            h.nemesis(
                "stop-membership",
                json!({"readded": id, "ok": r.is_ok(), "error": r.err().map(|e| format!("{e:#}")), "voters": c.voters}),
                Some(id),
            );
        }
        Active::DiskFault(id, variant, log_from) => {
            c.free_disk();
            c.fail_fsync(id, false);
            let exited = c.lc.exited(id).map(|s| s.to_string());
            let kept_running = exited.is_none() && c.is_running(id);
            let log = c.log_since(id, log_from);
            let storage_error = [
                "No space left",
                "fsync failed",
                "fatal storage error",
                "LogFlush error",
                "StorageError",
            ]
            .iter()
            .any(|m| log.contains(m));
            if kept_running {
                // A node whose storage failed must not carry on: stop it for the restart.
                c.kill(id);
            }
            let r = c.restart(id);
            h.nemesis(
                "stop-disk",
                json!({"variant": variant, "freed": true, "exit": exited, "kept_running": kept_running,
                       "storage_error_logged": storage_error, "restarted": r.is_ok()}),
                Some(id),
            );
        }
    }
}

/// Runs the schedule until `deadline`; returns the number of faults started. Leaves
/// no fault active.
pub async fn run(
    cluster: Arc<Mutex<Cluster>>,
    kinds: Vec<Nemesis>,
    mut rng: Rng,
    history: Arc<History>,
    deadline: Instant,
) -> u64 {
    let mut started = 0;
    if kinds.is_empty() {
        return 0;
    }
    let mut order: Vec<Nemesis> = Vec::new();
    loop {
        let gap = Duration::from_millis(rng.range(1_000, 2_500));
        if Instant::now() + gap >= deadline {
            break;
        }
        tokio::time::sleep(gap).await;
        if order.is_empty() {
            order = kinds.clone();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        let kind = order.remove(0);
        let hold = Duration::from_millis(rng.range(2_000, 5_000));
        let mut c = cluster.lock().await;
        let Some(active) = start(&mut c, kind, &mut rng, &history).await else {
            continue;
        };
        started += 1;
        drop(c);
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(hold.min(left)).await;
        let mut c = cluster.lock().await;
        stop(&mut c, active, &history).await;
    }
    started
}
