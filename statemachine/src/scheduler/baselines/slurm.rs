//! Slurm-like baseline, from the public descriptions of Slurm's priority/multifactor
//! plugin, its Fair Tree fair-share algorithm, QOS preemption (preempt/qos) and
//! sched/backfill. What is modelled and what is left out: DESIGN §24.
//!
//! - **Priority** = age + fair share + QOS, each factor in [0, 1] times its weight, in
//!   integer points: age = time queued / PriorityMaxAge (capped at 1; PriorityMaxAge is
//!   the usage half-life, as in SchedMD's example configuration where both are 14
//!   days); QOS = the tier's weight / the highest tier weight (tiers as QOS); fair share
//!   by **Fair Tree**: orgs (accounts under the root) ranked by level fairshare =
//!   shares / usage among siblings, then each org's users the same way, and every user
//!   association, visited in that order, gets a rank from n down to 1 (ties share one);
//!   its factor is rank / n. Usage is decayed GPU-ms (PriorityDecayHalfLife = the usage
//!   half-life) plus what running attempts have used so far; shares are the share
//!   weights. Computed once per pass, as Slurm computes priorities per cycle.
//! - **Order**: jobs that can preempt first (Slurm evaluates them before the others),
//!   then priority, then time queued, then id.
//! - **QOS preemption** (PreemptType=preempt/qos, PreemptMode=REQUEUE): the top tier's
//!   QOS preempts every lower one. A blocked job of the top tier takes victims of lower
//!   tiers on one node, lowest QOS first, then youngest first; GraceTime is the shard's
//!   grace period, PreemptExemptTime its minimum runtime.
//! - **EASY backfill**: the first job in that order that cannot start (and is not
//!   waiting for its own preemption) gets a reservation on the node where enough GPUs
//!   become free earliest, by the running jobs' time limits (their max duration); a later
//!   job may start on that node only if it ends, by its own time limit, before the
//!   reservation starts, or uses GPUs the reservation does not need.

use super::{Baseline, Scheduler, SchedulerConfig};
use crate::ids::{GpuType, JobKey, NodeId, OrgId, ProjectId, Tier, UserId};
use crate::ledger::{Ctx, Ledger};
use crate::limits::SHARE_WEIGHT_DEFAULT;
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// slurm.conf's PriorityWeightAge for the baseline. With fair share at ten times the
/// age weight, as in SchedMD's example configuration.
pub const SLURM_WEIGHT_AGE: u64 = 1_000;
/// PriorityWeightFairshare.
pub const SLURM_WEIGHT_FAIRSHARE: u64 = 10_000;
/// PriorityWeightQOS: ten times fair share, so that with the QOS factor (the tier's
/// weight over the highest: 1/8, 3/8, 1 by default) the tiers are strictly ordered and
/// fair share, then age, order the jobs within a tier — the usual set-up when QOS are
/// service classes. (Measured with 10,000 and 20,000: the free tier was served ahead of
/// the paid tier, DESIGN §24.)
pub const SLURM_WEIGHT_QOS: u64 = 100_000;

/// A queued job's priority as Slurm's `sprio` shows it: each factor times its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlurmPriority {
    pub age: u64,
    pub fairshare: u64,
    pub qos: u64,
    /// age + fairshare + qos.
    pub total: u64,
    /// The job's QOS may preempt others: it is evaluated before every job that cannot.
    pub can_preempt: bool,
}

/// Fair Tree's outcome: the rank of each user association (org, user) with queued jobs,
/// from `users` (the highest level fairshare) down to 1.
struct FairTree {
    rank: BTreeMap<(OrgId, UserId), u64>,
    users: u64,
}

/// Level fairshare is shares / usage among siblings (infinite without usage); the
/// siblings' normalisations cancel when two of them are compared, so `a` ranks above `b`
/// when shares_a × usage_b > shares_b × usage_a. Each is (shares, usage).
fn level_fairshare_cmp(a: (u64, u64), b: (u64, u64)) -> Ordering {
    (a.0 as u128 * b.1 as u128).cmp(&(b.0 as u128 * a.1 as u128))
}

/// Where a head came from: its tier, org, project, user queue.
type Coord = (Tier, OrgId, ProjectId, UserId);
/// Heap order (greatest first): can preempt, priority, then the earliest queued, then
/// the lowest id.
type Key = (bool, u64, Reverse<u64>, Reverse<JobKey>);

/// The EASY reservation of a pass: the top blocked job's node, when it may start there,
/// and the GPUs free on the node then that it does not need.
#[derive(Clone, Copy, Debug)]
struct Shadow {
    node: NodeId,
    start_ms: u64,
    spare: u32,
}

pub(super) struct Pass {
    now: u64,
    tree: FairTree,
    /// QOS points per tier.
    qos: Vec<u64>,
    max_age_ms: u64,
    top_tier: Option<Tier>,
    /// Every user queue's oldest job, by priority.
    heads: BinaryHeap<(Key, Coord)>,
    /// The user queue of the candidate handed out last.
    last: Option<Coord>,
    shadow: Option<Shadow>,
    shadow_tried: bool,
}

impl Pass {
    pub(super) fn new(s: &Scheduler, cfg: &SchedulerConfig, now: u64) -> Pass {
        let weight_max = cfg.tiers.iter().map(|t| t.weight).max().unwrap_or(1).max(1) as u64;
        let mut pass = Pass {
            now,
            tree: s.fair_tree(cfg, now),
            qos: cfg
                .tiers
                .iter()
                .map(|t| SLURM_WEIGHT_QOS * t.weight as u64 / weight_max)
                .collect(),
            max_age_ms: cfg.usage_half_life_ms.max(1),
            top_tier: (cfg.tiers.len() > 1).then(|| Tier(cfg.tiers.len() as u8 - 1)),
            heads: BinaryHeap::new(),
            last: None,
            shadow: None,
            shadow_tried: false,
        };
        for (tier, orgs) in &s.queue {
            for (org, projects) in orgs {
                for (project, users) in projects {
                    for user in users.keys() {
                        pass.push_head(s, (*tier, *org, *project, *user));
                    }
                }
            }
        }
        pass
    }

    fn priority(&self, tier: Tier, org: OrgId, user: UserId, since: u64) -> SlurmPriority {
        let age_ms = self.now.saturating_sub(since).min(self.max_age_ms);
        let age = SLURM_WEIGHT_AGE * age_ms / self.max_age_ms;
        let rank = self.tree.rank.get(&(org, user)).copied().unwrap_or(0);
        let fairshare = SLURM_WEIGHT_FAIRSHARE * rank / self.tree.users.max(1);
        let qos = self.qos.get(tier.0 as usize).copied().unwrap_or(0);
        SlurmPriority {
            age,
            fairshare,
            qos,
            total: age + fairshare + qos,
            can_preempt: self.can_preempt(tier),
        }
    }

    fn can_preempt(&self, tier: Tier) -> bool {
        self.top_tier == Some(tier)
    }

    /// Pushes the oldest job of the user queue `c`, if any is left.
    fn push_head(&mut self, s: &Scheduler, c: Coord) {
        let (tier, org, project, user) = c;
        let head = s
            .queue
            .get(&tier)
            .and_then(|o| o.get(&org))
            .and_then(|p| p.get(&project))
            .and_then(|u| u.get(&user))
            .and_then(|q| q.first());
        if let Some(&(since, id)) = head {
            let p = self.priority(tier, org, user, since);
            self.heads
                .push(((p.can_preempt, p.total, Reverse(since), Reverse(id)), c));
        }
    }

    /// Whether a job of `gpus` GPUs that ends (by its time limit) at `ends_ms` may start
    /// on `node` without delaying the reservation.
    fn allows(&self, node: NodeId, gpus: u32, ends_ms: u64) -> bool {
        self.shadow
            .is_none_or(|sh| node != sh.node || ends_ms <= sh.start_ms || gpus <= sh.spare)
    }
}

impl Baseline for Pass {
    fn next(&mut self, _: &Scheduler) -> Option<JobKey> {
        let ((_, _, _, Reverse(id)), c) = self.heads.pop()?;
        self.last = Some(c);
        Some(id)
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
        let gpus = j.spec.gpus;
        let ends_ms = ctx.now + remaining_ms(j);
        let Some((node, indices)) = s.find_fit_where(id, types, |n| self.allows(n, gpus, ends_ms))
        else {
            return false;
        };
        if s.place(ctx, ledger, cfg, id, node, indices).is_err() {
            return false;
        }
        if let Some(sh) = self.shadow.as_mut() {
            if sh.node == node && ends_ms > sh.start_ms {
                sh.spare = sh.spare.saturating_sub(gpus);
            }
        }
        true
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
        let Some(tier) = s.jobs.get(&id).map(|j| j.spec.tier) else {
            return;
        };
        if self.can_preempt(tier)
            && !s.awaiting_preemption(id)
            && *searches < cfg.preemption_searches_per_pass_max
        {
            *searches += 1;
            s.qos_preempt(ctx, ledger, cfg, id, types);
        }
        // EASY: one reservation, for the first blocked job not served by a preemption.
        if !self.shadow_tried && s.jobs.get(&id).is_some_and(|j| j.reserved_node.is_none()) {
            self.shadow_tried = true;
            self.shadow = s.shadow_for(id, types, ctx.now);
        }
    }

    fn left(&mut self, s: &Scheduler) {
        if let Some(c) = self.last.take() {
            self.push_head(s, c);
        }
    }
}

/// The job's time limit from now if it starts now: what its max duration leaves.
fn remaining_ms(j: &super::super::Job) -> u64 {
    j.spec.max_duration_ms.saturating_sub(j.run_ms).max(1)
}

impl Scheduler {
    /// The Slurm-like baseline's priority of queued job `id` at `now`, as `sprio` would
    /// show it (computed as a pass would: Fair Tree over the queued associations).
    pub fn slurm_priority(
        &self,
        cfg: &SchedulerConfig,
        now: u64,
        id: JobKey,
    ) -> Option<SlurmPriority> {
        let j = self.jobs.get(&id)?;
        if j.state != super::JobState::Queued {
            return None;
        }
        let pass = Pass::new(self, cfg, now);
        Some(pass.priority(j.spec.tier, j.org, j.spec.user, j.queued_since_ms))
    }

    /// Fair Tree over the user associations with queued jobs: orgs ranked by level
    /// fairshare, then each org's users, ranks handed out in that order from n down.
    /// Ties between an org's users share a rank; ties between orgs go by org id.
    fn fair_tree(&self, cfg: &SchedulerConfig, now: u64) -> FairTree {
        let mut assoc: BTreeMap<OrgId, BTreeSet<UserId>> = BTreeMap::new();
        for orgs in self.queue.values() {
            for (org, projects) in orgs {
                for users in projects.values() {
                    assoc.entry(*org).or_default().extend(users.keys().copied());
                }
            }
        }
        let (run_org, run_user) = self.running_use(now);
        let h = cfg.usage_half_life_ms;
        let org_use = |o: &OrgId| {
            let past = self.usage_org.get(o).map_or(0, |u| u.value_at(now, h));
            past.saturating_add(run_org.get(o).copied().unwrap_or(0))
        };
        let user_use = |k: &(OrgId, UserId)| {
            let past = self.usage_user.get(k).map_or(0, |u| u.value_at(now, h));
            past.saturating_add(run_user.get(k).copied().unwrap_or(0))
        };
        let shares = |w: Option<&u32>| w.copied().unwrap_or(SHARE_WEIGHT_DEFAULT) as u64;
        let mut orgs: Vec<(OrgId, (u64, u64))> = assoc
            .keys()
            .map(|o| (*o, (shares(self.weight_org.get(o)), org_use(o))))
            .collect();
        orgs.sort_by(|a, b| level_fairshare_cmp(b.1, a.1).then(a.0.cmp(&b.0)));
        let users = assoc.values().map(|u| u.len() as u64).sum::<u64>();
        let mut rank = BTreeMap::new();
        let mut next = users;
        for (org, _) in orgs {
            let mut us: Vec<(UserId, (u64, u64))> = assoc[&org]
                .iter()
                .map(|u| {
                    let k = (org, *u);
                    (*u, (shares(self.weight_user.get(&k)), user_use(&k)))
                })
                .collect();
            us.sort_by(|a, b| level_fairshare_cmp(b.1, a.1).then(a.0.cmp(&b.0)));
            let mut prev: Option<((u64, u64), u64)> = None;
            for (user, lf) in us {
                let r = match prev {
                    Some((p, r)) if level_fairshare_cmp(p, lf) == Ordering::Equal => r,
                    _ => next,
                };
                rank.insert((org, user), r);
                prev = Some((lf, r));
                next = next.saturating_sub(1);
            }
        }
        FairTree { rank, users }
    }

    /// GPU-ms used so far by the running attempts, per org and per (org, user): Slurm
    /// accrues a running job's usage as it runs; allot adds an attempt's to the decayed
    /// usage when it ends.
    #[allow(clippy::type_complexity)]
    fn running_use(&self, now: u64) -> (BTreeMap<OrgId, u64>, BTreeMap<(OrgId, UserId), u64>) {
        let (mut org, mut user) = (BTreeMap::new(), BTreeMap::new());
        for nodes in self.type_nodes.values() {
            for node in nodes {
                let Some(n) = self.nodes.get(node) else {
                    continue;
                };
                for key in n.jobs() {
                    let Some(j) = self.jobs.get(&key) else {
                        continue;
                    };
                    let Some(p) = j.placement.as_ref().filter(|_| j.state.holds_gpus()) else {
                        continue;
                    };
                    let used = j.spec.gpus as u64 * now.saturating_sub(p.started_ms);
                    *org.entry(j.org).or_insert(0u64) += used;
                    *user.entry((j.org, j.spec.user)).or_insert(0u64) += used;
                }
            }
        }
        (org, user)
    }

    /// QOS preemption for a blocked job of the top tier: on one node, victims of lower
    /// tiers that the shard's rules let go (`victim_loss`), taken lowest tier first, then
    /// youngest first, until the job fits; the node needing the lowest-tier victims, then
    /// the fewest, then the job's preferred type, then the lowest id.
    fn qos_preempt(
        &mut self,
        ctx: &mut Ctx,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
    ) {
        let Some(j) = self.jobs.get(&id) else { return };
        let (tier, gpus, floor, now) = (j.spec.tier, j.spec.gpus, j.spec.mem_floor_gb, ctx.now);
        // (highest victim tier, victims, type preference, node).
        type Choice = (Tier, usize, usize, NodeId);
        let mut best: Option<(Choice, Vec<JobKey>)> = None;
        for (rank, t) in types.iter().enumerate() {
            for (node, n) in self.candidate_nodes(id, t, gpus, floor) {
                let mut cands: Vec<(Tier, Reverse<u64>, JobKey, u32)> = n
                    .jobs()
                    .into_iter()
                    .filter_map(|v| {
                        let vj = self.jobs.get(&v)?;
                        let started = vj.placement.as_ref()?.started_ms;
                        (vj.spec.tier < tier && self.victim_loss(ledger, cfg, v, now).is_some())
                            .then_some((vj.spec.tier, Reverse(started), v, vj.spec.gpus))
                    })
                    .collect();
                cands.sort();
                let mut free = n.free_gpus();
                let mut victims = Vec::new();
                let mut top = Tier(0);
                for (vt, _, v, g) in cands {
                    if free >= gpus {
                        break;
                    }
                    free += g;
                    victims.push(v);
                    top = top.max(vt);
                }
                if free < gpus || victims.is_empty() {
                    continue;
                }
                let key = (top, victims.len(), rank, node);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, victims));
                }
            }
        }
        if let Some(((_, _, _, node), victims)) = best {
            self.begin_preemption(ctx, cfg, id, node, victims, ledger.rules.0);
        }
    }

    /// EASY backfill's reservation for blocked job `id`: of the nodes that could hold
    /// it, the one where enough GPUs are free earliest — now, or as running jobs reach
    /// their time limits (a job being preempted, at its grace's end) — then the job's
    /// preferred type, then the lowest id; with the GPUs free there then that it does
    /// not need.
    fn shadow_for(&self, id: JobKey, types: &[GpuType], now: u64) -> Option<Shadow> {
        let j = self.jobs.get(&id)?;
        let (gpus, floor) = (j.spec.gpus, j.spec.mem_floor_gb);
        let mut best: Option<((u64, usize, NodeId), u32)> = None;
        for (rank, t) in types.iter().enumerate() {
            for (node, n) in self.candidate_nodes(id, t, gpus, floor) {
                let mut ends: Vec<(u64, u32)> = n
                    .jobs()
                    .into_iter()
                    .filter_map(|v| {
                        let vj = self.jobs.get(&v)?;
                        let end = if vj.state == super::JobState::Preempting {
                            vj.grace_at
                        } else {
                            vj.deadline_at
                        };
                        Some((end.unwrap_or(now).max(now), vj.spec.gpus))
                    })
                    .collect();
                ends.sort();
                let (mut free, mut start) = (n.free_gpus(), now);
                let mut i = 0;
                while free < gpus && i < ends.len() {
                    start = ends[i].0;
                    // Every job ending at that instant frees its GPUs.
                    while i < ends.len() && ends[i].0 == start {
                        free += ends[i].1;
                        i += 1;
                    }
                }
                if free < gpus {
                    continue;
                }
                let key = (start, rank, node);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, free - gpus));
                }
            }
        }
        best.map(|((start_ms, _, node), spare)| Shadow {
            node,
            start_ms,
            spare,
        })
    }
}
