//! Kueue-like baseline, from the public descriptions of Kueue's ClusterQueue, Cohort,
//! fair sharing and preemption. What is modelled and what is left out: DESIGN §24.
//!
//! - **One ClusterQueue per tier, one cohort.** Resource flavors are the GPU types; each
//!   queue's quotas per flavor are derived from the tier config and the fleet's GPUs of
//!   that type (capacity: nodes not down): **nominal** = capacity × the tier's weight /
//!   the sum of weights (the rounding remainder to the top tier, so nominal quotas add up
//!   to the capacity); **borrowing limit** = the tier's ceiling of the capacity minus its
//!   nominal quota; **lending limit** = nominal minus the tier's floor of the capacity
//!   (the floor is never lent).
//! - **Admission** = quota reserved and the job placed on one node: a flavor fits when
//!   the queue's available quota (its unlent quota left, plus what the cohort's lendable
//!   quota has left, within nominal + borrowing limit) covers the job's GPUs; the job's
//!   types are the flavors, in its order (the first that fits and has a node wins, even
//!   by borrowing).
//! - **Order**: within a queue BestEffortFIFO — priority (a non-preemptible job is of a
//!   higher priority class than a preemptible one), then time queued, and a head that
//!   cannot be admitted does not block the next; across queues **fair sharing**: the
//!   head whose queue would have the lowest dominant resource share after admitting it
//!   (the largest share over flavors of GPUs borrowed above nominal / the cohort's
//!   lendable GPUs, divided by the tier's weight), then priority, time queued, id.
//! - **Preemption**, only when no flavor's quota admits the job (quota that admits it
//!   but no node with room: it waits): `reclaimWithinCohort: Any` (a queue that stays
//!   within its nominal quota takes back quota from queues that borrow) and
//!   `withinClusterQueue: LowerPriority` (lower-priority jobs of its own queue, if it
//!   then fits within nominal; with priority from the preemptible flag, a
//!   non-preemptible job preempting preemptible ones). Decided on usage as it will be
//!   once the preemptions under way are done. Candidates on one node, other queues'
//!   first, then lower priority, then the most recently started; a queue stops being a
//!   source once it no longer borrows; then victims not needed are given back. Victims
//!   must be ones the shard's rules let go (`victim_loss`).

use super::{Baseline, Scheduler, SchedulerConfig};
use crate::ids::{GpuType, JobKey, NodeId, Tier};
use crate::ledger::{Ctx, Ledger};
use std::cmp::Reverse;

/// A ClusterQueue's quota of one flavor (GPU type), as the Kueue-like baseline derives it
/// from the tier config and the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterQueueView {
    pub tier: Tier,
    pub flavor: GpuType,
    pub nominal: u64,
    pub borrowing_limit: u64,
    pub lending_limit: u64,
    /// GPUs its jobs hold now (those being preempted included).
    pub usage: u64,
}

/// Per tier and flavor: `[tier][flavor]`.
type Grid = Vec<Vec<u64>>;

/// The cohort's quotas and usage, for one pass.
struct Quotas {
    flavors: Vec<GpuType>,
    nominal: Grid,
    borrowing: Grid,
    lending: Grid,
    /// GPUs held, and of them by jobs being preempted (leaving); GPUs of queued jobs
    /// whose preemption is under way (incoming).
    usage: Grid,
    leaving: Grid,
    incoming: Grid,
    weight: Vec<u64>,
}

impl Quotas {
    fn new(s: &Scheduler, cfg: &SchedulerConfig) -> Quotas {
        let flavors: Vec<GpuType> = s.type_nodes.keys().cloned().collect();
        let tiers = cfg.tiers.len();
        let weight: Vec<u64> = cfg.tiers.iter().map(|t| t.weight.max(1) as u64).collect();
        let total: u64 = weight.iter().sum::<u64>().max(1);
        let grid = || vec![vec![0u64; flavors.len()]; tiers];
        let (mut nominal, mut borrowing, mut lending) = (grid(), grid(), grid());
        let (mut usage, mut leaving, mut incoming) = (grid(), grid(), grid());
        for (f, t) in flavors.iter().enumerate() {
            let mut cap = 0u64;
            for node in s.type_nodes.get(t).into_iter().flatten() {
                let Some(n) = s.nodes.get(node) else { continue };
                if n.state != super::super::NodeState::Down {
                    cap += n.gpu_count as u64;
                }
                if let Some(r) = n.reserved_for.filter(|r| s.preempting_for(*node, *r)) {
                    if let Some(rj) = s.jobs.get(&r) {
                        let tier = rj.spec.tier.0 as usize;
                        if tier < tiers {
                            incoming[tier][f] += rj.spec.gpus as u64;
                        }
                    }
                }
                for key in n.jobs() {
                    let Some(j) = s.jobs.get(&key) else { continue };
                    let tier = j.spec.tier.0 as usize;
                    if j.state.holds_gpus() && tier < tiers {
                        usage[tier][f] += j.spec.gpus as u64;
                        if j.state == super::super::JobState::Preempting {
                            leaving[tier][f] += j.spec.gpus as u64;
                        }
                    }
                }
            }
            for tier in 0..tiers {
                nominal[tier][f] = cap * weight[tier] / total;
            }
            let given: u64 = (0..tiers).map(|tier| nominal[tier][f]).sum();
            if let Some(top) = nominal.last_mut() {
                top[f] += cap - given;
            }
            for (tier, conf) in cfg.tiers.iter().enumerate() {
                let n = nominal[tier][f];
                borrowing[tier][f] = (cap * conf.ceiling_pct as u64 / 100).saturating_sub(n);
                lending[tier][f] = n - n.min(cap * conf.floor_pct as u64 / 100);
            }
        }
        Quotas {
            flavors,
            nominal,
            borrowing,
            lending,
            usage,
            leaving,
            incoming,
            weight,
        }
    }

    fn flavor(&self, t: &GpuType) -> Option<usize> {
        self.flavors.iter().position(|f| f == t)
    }

    /// Usage once the preemptions under way are done: the jobs being preempted gone,
    /// the jobs they make room for placed (what a new preemption decides on, so two
    /// waiting jobs do not both count the same unused nominal quota).
    fn planned(&self) -> Grid {
        let mut out = self.usage.clone();
        for (t, row) in out.iter_mut().enumerate() {
            for (f, u) in row.iter_mut().enumerate() {
                *u = (*u - self.leaving[t][f]) + self.incoming[t][f];
            }
        }
        out
    }

    /// GPUs of flavor `f` queue `t` may still take with `usage`: what is left of its
    /// quota that is never lent, plus what is left of the cohort's lendable quota, within
    /// its nominal quota plus borrowing limit.
    fn available(&self, usage: &Grid, t: usize, f: usize) -> u64 {
        let guaranteed = |q: usize| self.nominal[q][f] - self.lending[q][f];
        let local = guaranteed(t).saturating_sub(usage[t][f]);
        let pool: u64 = (0..usage.len()).map(|q| self.lending[q][f]).sum();
        let lent: u64 = (0..usage.len())
            .map(|q| usage[q][f].saturating_sub(guaranteed(q)))
            .sum();
        let cap = (self.nominal[t][f] + self.borrowing[t][f]).saturating_sub(usage[t][f]);
        (local + pool.saturating_sub(lent)).min(cap)
    }

    /// Queue `t`'s dominant resource share with `usage` plus `add` = (flavor, GPUs): the
    /// largest, over flavors, of GPUs borrowed above nominal per million of the cohort's
    /// lendable GPUs, divided by the tier's weight.
    fn share(&self, usage: &Grid, t: usize, add: Option<(usize, u64)>) -> u64 {
        let mut drs = 0u64;
        for f in 0..self.flavors.len() {
            let extra = add.filter(|(af, _)| *af == f).map_or(0, |(_, g)| g);
            let borrowed = (usage[t][f] + extra).saturating_sub(self.nominal[t][f]);
            if borrowed == 0 {
                continue;
            }
            let pool: u64 = (0..usage.len()).map(|q| self.lending[q][f]).sum();
            drs = drs.max(borrowed * 1_000_000 / pool.max(1));
        }
        drs / self.weight[t]
    }
}

/// Kueue's priority of a job: a non-preemptible job is of the higher priority class.
fn priority(j: &super::super::Job) -> u8 {
    u8::from(!j.spec.preemptible)
}

/// Where the scan for a tier's first non-preemptible queued job stands in its age order.
#[derive(Clone, Copy)]
enum Scan {
    From(Option<(u64, JobKey)>),
    Exhausted,
}

pub(super) struct Pass {
    q: Quotas,
    /// Per tier; the queue only loses jobs during a pass, so the scan only moves on.
    scan: Vec<Scan>,
}

impl Pass {
    pub(super) fn new(s: &Scheduler, cfg: &SchedulerConfig) -> Pass {
        Pass {
            q: Quotas::new(s, cfg),
            scan: vec![Scan::From(None); cfg.tiers.len()],
        }
    }

    /// The head of queue `tier` (BestEffortFIFO): its first non-preemptible job in age
    /// order, else its oldest.
    fn head(&mut self, s: &Scheduler, tier: Tier) -> Option<(u64, JobKey)> {
        let q = s.by_age.get(&tier)?;
        let slot = self.scan.get_mut(tier.0 as usize)?;
        if let Scan::From(from) = *slot {
            let mut rest = match from {
                Some(k) => q.range(k..),
                None => q.range(..),
            };
            let found = rest
                .find(|(_, id)| s.jobs.get(id).is_some_and(|j| !j.spec.preemptible))
                .copied();
            *slot = found.map_or(Scan::Exhausted, |k| Scan::From(Some(k)));
            if found.is_some() {
                return found;
            }
        }
        q.first().copied()
    }

    /// The first flavor of the job's types whose quota admits `gpus` now.
    fn fitting_flavor(&self, t: usize, gpus: u64, types: &[GpuType]) -> Option<usize> {
        types
            .iter()
            .filter_map(|ty| self.q.flavor(ty))
            .find(|&f| self.q.available(&self.q.usage, t, f) >= gpus)
    }
}

impl Baseline for Pass {
    fn next(&mut self, s: &Scheduler) -> Option<JobKey> {
        let tiers: Vec<Tier> = s.by_age.keys().copied().collect();
        // Fair sharing: (share after admission, higher priority, time queued, id).
        type Order = (u64, Reverse<u8>, u64, JobKey);
        let mut best: Option<(Order, JobKey)> = None;
        for tier in tiers {
            let Some((since, id)) = self.head(s, tier) else {
                continue;
            };
            let Some(j) = s.jobs.get(&id) else { continue };
            let (t, gpus) = (tier.0 as usize, j.spec.gpus as u64);
            if t >= self.q.weight.len() {
                continue;
            }
            let f = self
                .fitting_flavor(t, gpus, &j.spec.gpu_types)
                .or_else(|| j.spec.gpu_types.iter().find_map(|ty| self.q.flavor(ty)));
            let share = self.q.share(&self.q.usage, t, f.map(|f| (f, gpus)));
            let key = (share, Reverse(priority(j)), since, id);
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((key, id));
            }
        }
        best.map(|(_, id)| id)
    }

    fn start(
        &mut self,
        s: &mut Scheduler,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
    ) -> bool {
        let Some(j) = s.jobs.get(&id) else {
            return false;
        };
        let (t, gpus) = (j.spec.tier.0 as usize, j.spec.gpus as u64);
        if t >= self.q.weight.len() {
            return false;
        }
        for ty in types {
            let Some(f) = self.q.flavor(ty) else { continue };
            if self.q.available(&self.q.usage, t, f) < gpus {
                continue;
            }
            let Some((node, indices)) = s.find_fit_where(id, std::slice::from_ref(ty), |_| true)
            else {
                continue;
            };
            if s.place(ctx, ledger, cfg, id, node, indices).is_ok() {
                self.q.usage[t][f] += gpus;
                return true;
            }
        }
        false
    }

    fn blocked(
        &mut self,
        s: &mut Scheduler,
        ctx: &mut Ctx,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
        searches: &mut u32,
    ) {
        let Some(j) = s.jobs.get(&id) else { return };
        let (t, gpus) = (j.spec.tier.0 as usize, j.spec.gpus as u64);
        let high = priority(j) > 0;
        if t >= self.q.weight.len() || s.awaiting_preemption(id) {
            return;
        }
        // Quota admits it somewhere: it waits for a node, it does not preempt.
        if self.fitting_flavor(t, gpus, types).is_some() {
            return;
        }
        let net = self.q.planned();
        // Flavors where preemption could admit it: quota short even once the preemptions
        // under way are done, and it would be within nominal (by reclaiming, or by
        // preempting its own queue's lower-priority jobs).
        let flavors: Vec<(usize, &GpuType)> = types
            .iter()
            .filter_map(|ty| self.q.flavor(ty).map(|f| (f, ty)))
            .filter(|&(f, _)| {
                self.q.available(&net, t, f) < gpus
                    && (net[t][f] + gpus <= self.q.nominal[t][f] || high)
            })
            .collect();
        if flavors.is_empty() || *searches >= cfg.preemption_searches_per_pass_max {
            return;
        }
        *searches += 1;
        for (f, ty) in flavors {
            if let Some((node, victims)) = s.reclaim(ctx.now, ledger, cfg, &self.q, &net, id, f, ty)
            {
                for v in &victims {
                    if let Some(vj) = s.jobs.get(v) {
                        let vt = vj.spec.tier.0 as usize;
                        self.q.leaving[vt][f] += vj.spec.gpus as u64;
                    }
                }
                self.q.incoming[t][f] += gpus;
                s.begin_preemption(ctx, cfg, id, node, victims, ledger.rules.0);
                return;
            }
        }
    }

    fn left(&mut self, _: &Scheduler) {}
}

impl Scheduler {
    /// The Kueue-like baseline's ClusterQueues (one per tier) and their quotas per flavor,
    /// derived from the tier config and the fleet as a pass would.
    pub fn kueue_cluster_queues(&self, cfg: &SchedulerConfig) -> Vec<ClusterQueueView> {
        let q = Quotas::new(self, cfg);
        let mut out = Vec::new();
        for t in 0..cfg.tiers.len() {
            for (f, flavor) in q.flavors.iter().enumerate() {
                out.push(ClusterQueueView {
                    tier: Tier(t as u8),
                    flavor: flavor.clone(),
                    nominal: q.nominal[t][f],
                    borrowing_limit: q.borrowing[t][f],
                    lending_limit: q.lending[t][f],
                    usage: q.usage[t][f],
                });
            }
        }
        out
    }

    /// The victims on one node of flavor `f` whose preemption admits job `id` (queue
    /// `t`) within its nominal quota: candidates the shard's rules let go, of queues that
    /// borrow (reclaim) or of lower priority in its own queue, in Kueue's order (other
    /// queues' first, lower priority, most recently started); taken until the job fits
    /// on the node and in quota, a queue skipped once it no longer borrows; then those
    /// not needed given back. The node needing the fewest victims, then the lowest id.
    #[allow(clippy::too_many_arguments)]
    fn reclaim(
        &self,
        now: u64,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        q: &Quotas,
        net: &Grid,
        id: JobKey,
        f: usize,
        ty: &GpuType,
    ) -> Option<(NodeId, Vec<JobKey>)> {
        let j = self.jobs.get(&id)?;
        let (t, gpus, prio) = (j.spec.tier.0 as usize, j.spec.gpus, priority(j));
        let mut best: Option<((usize, NodeId), Vec<JobKey>)> = None;
        for (node, n) in self.candidate_nodes(id, ty, gpus, j.spec.mem_floor_gb) {
            let mut cands: Vec<(bool, u8, Reverse<u64>, JobKey, usize, u64)> = n
                .jobs()
                .into_iter()
                .filter_map(|v| {
                    let vj = self.jobs.get(&v)?;
                    let (vt, vp) = (vj.spec.tier.0 as usize, priority(vj));
                    let started = vj.placement.as_ref()?.started_ms;
                    let allowed = vt < q.weight.len() && (vt != t || vp < prio);
                    (allowed && self.victim_loss(ledger, cfg, v, now).is_some()).then_some((
                        vt == t,
                        vp,
                        Reverse(started),
                        v,
                        vt,
                        vj.spec.gpus as u64,
                    ))
                })
                .collect();
            cands.sort();
            let free = n.free_gpus() as u64;
            let fits = |taken: &[(usize, u64)]| {
                let mut after = net.clone();
                let mut freed = 0;
                for &(vt, g) in taken {
                    after[vt][f] = after[vt][f].saturating_sub(g);
                    freed += g;
                }
                free + freed >= gpus as u64
                    && after[t][f] + gpus as u64 <= q.nominal[t][f]
                    && q.available(&after, t, f) >= gpus as u64
            };
            let mut taken: Vec<(usize, u64)> = Vec::new();
            let mut victims: Vec<JobKey> = Vec::new();
            let mut released = vec![0u64; net.len()];
            for &(same, _, _, v, vt, g) in &cands {
                if fits(&taken) {
                    break;
                }
                if !same && net[vt][f].saturating_sub(released[vt]) <= q.nominal[vt][f] {
                    continue; // that queue no longer borrows
                }
                released[vt] += g;
                taken.push((vt, g));
                victims.push(v);
            }
            if victims.is_empty() || !fits(&taken) {
                continue;
            }
            // Give back the victims not needed, the last taken kept.
            for i in (0..victims.len().saturating_sub(1)).rev() {
                let mut without = taken.clone();
                without.remove(i);
                if fits(&without) {
                    taken = without;
                    victims.remove(i);
                }
            }
            let key = (victims.len(), node);
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((key, victims));
            }
        }
        best.map(|((_, node), victims)| (node, victims))
    }
}
