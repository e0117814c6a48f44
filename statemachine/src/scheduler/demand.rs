//! The demand signal (issue 25, DESIGN §52): per GPU type of the shard's pool, the
//! capacity that takes work, the queued work that waits for it, the wait that work
//! implies at the current capacity, and per tier the GPUs that would bring the tier
//! within its target wait (`TierConfig::max_wait_ms`). An autoscaler reads it
//! (`Query::Demand`, the `allot_demand_*` gauges) to decide what to order.
//!
//! A read-only, pure function of the state: integer arithmetic, ordered maps only, so
//! every replica answers the same. Its work is one walk of the queued jobs (bounded by
//! `JOBS_ACTIVE_MAX`) and of the nodes (bounded by `NODES_MAX`).
//!
//! Definitions (the alternatives are in DESIGN §52):
//! - A queued job's **work** is `gpus × max_duration × run_pct / 100` GPU-ms. The state
//!   knows no job's real run time, only its bound; `run_pct` is the caller's estimate of
//!   the share of the bound a job runs (100 — every job runs to its bound — unless the
//!   caller knows its workload better).
//! - A job's work counts against **one type**: the first type of its preference list
//!   that a registered node shape can hold whole (count and memory), the type it would
//!   be placed on first. So work never asks for a type the job cannot use.
//! - **Capacity** is the GPUs of nodes that take new work: ready and their lease
//!   current. Draining, lapsed and down nodes are not capacity (their running jobs still
//!   count as used).
//! - A tier's **wait** is the queued work of that tier and of every tier above it,
//!   divided by the capacity: the time the type's whole capacity takes to run the work
//!   served before or with the tier's (rounded up; `None` when there is work and no
//!   capacity). The type's wait is its lowest tier's: all its queued work.
//! - A tier's queued jobs are **overdue** when they have been queued (since they last
//!   entered the queue) for at least the tier's `max_wait_ms`: capacity has not served
//!   them in time, whatever the drain time says (a whole-node job among fragments, a
//!   tier held to its share).
//! - A tier's **GPUs needed** are the larger of: the capacity that would make the wait
//!   at most the tier's `max_wait_ms`, less the capacity there is (`⌈work / max_wait⌉ −
//!   capacity`, at least 0), and the GPUs of its overdue jobs (each needs its GPUs now).
//!   A tier with nothing queued needs 0; so does a tier whose work drains within its
//!   target and none of whose jobs is overdue: that is "within its target".

use super::{Scheduler, SchedulerConfig};
use crate::ids::{GpuType, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a caller asks the demand signal for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemandQuery {
    /// The share of its max duration a queued job is expected to run, in percent:
    /// 1..=100. 0 means 100, and so does anything above (no job runs past its max
    /// duration).
    pub run_pct: u32,
}

impl DemandQuery {
    /// The percentage used: `run_pct`, or 100 when it is 0 or above 100.
    pub fn effective_run_pct(&self) -> u32 {
        match self.run_pct {
            1..=100 => self.run_pct,
            _ => 100,
        }
    }
}

/// The demand on one GPU type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeDemand {
    pub gpu_type: GpuType,
    /// GPUs of nodes of this type that take new work (ready, lease current).
    pub capacity_gpus: u32,
    /// GPUs of this type held by jobs, on any node of the type (draining ones too).
    pub used_gpus: u32,
    /// Queued jobs whose work counts against this type.
    pub queued_jobs: u64,
    /// Their work, GPU-ms (saturating).
    pub queued_gpu_ms: u64,
    /// The wait all that work implies at the current capacity, ms; `None` when there is
    /// queued work and no capacity (0 when nothing is queued).
    pub wait_ms: Option<u64>,
    /// One per tier of the shard, by tier.
    pub tiers: Vec<TierDemand>,
}

/// One tier's part of a type's demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierDemand {
    pub tier: Tier,
    /// The tier's own queued jobs and their work (GPU-ms) on this type.
    pub queued_jobs: u64,
    pub queued_gpu_ms: u64,
    /// The tier's target: its `max_wait_ms`.
    pub target_wait_ms: u64,
    /// The wait of the work of this tier and the tiers above it at the current
    /// capacity, ms; `None` when there is such work and no capacity.
    pub wait_ms: Option<u64>,
    /// The tier's jobs queued for at least `target_wait_ms`, and their GPUs.
    pub overdue_jobs: u64,
    pub overdue_gpus: u64,
    /// GPUs to add for the tier to be within its target: the most of what brings
    /// `wait_ms` within it and `overdue_gpus` (0: within it, or nothing of the tier
    /// queued). Saturates at `u32::MAX`.
    pub gpus_needed: u32,
}

/// Queued work of one type and tier.
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    jobs: u64,
    gpu_ms: u128,
    overdue_jobs: u64,
    overdue_gpus: u64,
}

/// Queued work of one type, per tier.
type TierWork = BTreeMap<Tier, Work>;

impl Scheduler {
    /// The demand signal, one row per GPU type ever registered in the pool, by type.
    /// `now` is the state's logical time (overdue jobs are counted against it).
    pub fn demand(&self, cfg: &SchedulerConfig, now: u64, q: DemandQuery) -> Vec<TypeDemand> {
        let run_pct = u128::from(q.effective_run_pct());
        let mut work: BTreeMap<&GpuType, TierWork> = BTreeMap::new();
        for (tier, queued) in &self.by_age {
            let target = cfg.tiers.get(tier.0 as usize).map(|t| t.max_wait_ms);
            for (since, key) in queued {
                let Some(j) = self.jobs.get(key) else {
                    continue;
                };
                let Some(t) = self.demand_type(&j.spec.gpu_types, j.spec.gpus, j.spec.mem_floor_gb)
                else {
                    continue;
                };
                let gpu_ms =
                    u128::from(j.spec.gpus) * u128::from(j.spec.max_duration_ms) * run_pct / 100;
                let e = work.entry(t).or_default().entry(*tier).or_default();
                e.jobs += 1;
                e.gpu_ms += gpu_ms;
                if target.is_some_and(|t| now.saturating_sub(*since) >= t) {
                    e.overdue_jobs += 1;
                    e.overdue_gpus += u64::from(j.spec.gpus);
                }
            }
        }
        self.type_nodes
            .iter()
            .map(|(t, nodes)| {
                let (capacity, used) = self.type_gpus(nodes);
                type_demand(cfg, t, capacity, used, work.get(t))
            })
            .collect()
    }

    /// The type a queued job's work counts against: the first of its types that a
    /// registered node shape can hold whole.
    fn demand_type(&self, types: &[GpuType], gpus: u32, mem_floor_gb: u32) -> Option<&GpuType> {
        types.iter().find_map(|t| {
            let (key, shapes) = self.type_shapes.get_key_value(t)?;
            shapes
                .iter()
                .any(|&(count, mem)| count >= gpus && mem >= mem_floor_gb)
                .then_some(key)
        })
    }

    /// (capacity, used) GPUs of these nodes.
    fn type_gpus(&self, nodes: &std::collections::BTreeSet<crate::ids::NodeId>) -> (u32, u32) {
        nodes
            .iter()
            .filter_map(|id| self.nodes.get(id))
            .fold((0u32, 0u32), |(cap, used), n| {
                let held = n.gpu_count.saturating_sub(n.free_gpus());
                let cap = if n.placeable() {
                    cap.saturating_add(n.gpu_count)
                } else {
                    cap
                };
                (cap, used.saturating_add(held))
            })
    }
}

/// Time for `capacity` GPUs to run `gpu_ms` of work, rounded up (`None`: work and no
/// capacity).
fn drain_ms(gpu_ms: u128, capacity: u32) -> Option<u64> {
    match (gpu_ms, capacity) {
        (0, _) => Some(0),
        (_, 0) => None,
        (w, c) => Some(sat64(w.div_ceil(u128::from(c)))),
    }
}

fn sat64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn type_demand(
    cfg: &SchedulerConfig,
    gpu_type: &GpuType,
    capacity: u32,
    used: u32,
    work: Option<&TierWork>,
) -> TypeDemand {
    let of = |tier: Tier| -> Work { work.and_then(|w| w.get(&tier)).copied().unwrap_or_default() };
    let n = cfg.tiers.len().min(usize::from(u8::MAX) + 1);
    // Highest tier first: each tier's wait counts the work of the tiers above it.
    let mut above: u128 = 0;
    let mut tiers: Vec<TierDemand> = (0..n)
        .rev()
        .map(|i| {
            let tier = Tier(i as u8);
            let w = of(tier);
            above += w.gpu_ms;
            let target = cfg.tiers[i].max_wait_ms;
            let needed = if w.jobs == 0 {
                0
            } else {
                above
                    .div_ceil(u128::from(target.max(1)))
                    .saturating_sub(u128::from(capacity))
                    .max(u128::from(w.overdue_gpus))
            };
            TierDemand {
                tier,
                queued_jobs: w.jobs,
                queued_gpu_ms: sat64(w.gpu_ms),
                target_wait_ms: target,
                wait_ms: drain_ms(above, capacity),
                overdue_jobs: w.overdue_jobs,
                overdue_gpus: w.overdue_gpus,
                gpus_needed: u32::try_from(needed).unwrap_or(u32::MAX),
            }
        })
        .collect();
    tiers.reverse();
    let (jobs, gpu_ms) = work.map_or((0, 0), |w| {
        w.values()
            .fold((0u64, 0u128), |a, x| (a.0 + x.jobs, a.1 + x.gpu_ms))
    });
    TypeDemand {
        gpu_type: gpu_type.clone(),
        capacity_gpus: capacity,
        used_gpus: used,
        queued_jobs: jobs,
        queued_gpu_ms: sat64(gpu_ms),
        wait_ms: drain_ms(gpu_ms, capacity),
        tiers,
    }
}
