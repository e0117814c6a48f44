//! The scheduling pass, run at the end of every entry with bounded work: pick the next
//! job by policy, place it best-fit, or (for a higher tier) preempt lower-tier work.

use super::{Ending, GpuNode, JobState, Policy, Reason, Scheduler, SchedulerConfig, Timer};
use crate::command::SettleReason;
use crate::ids::{GpuType, JobKey, NodeId, OrgId, ProjectId, Tier, UserId};
use crate::ledger::{Ctx, Ledger};
use crate::limits::SHARE_WEIGHT_DEFAULT;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Where a user is ranked: the (tier, project) of a `PassMemo::user_rank`.
type RankedIn = (Tier, ProjectId);

/// What one pass reuses from candidate to candidate. Nothing outlives the pass, and each
/// item is dropped or re-filed as soon as the pass changes what it was computed from, so
/// decisions are exactly those of recomputing everything per candidate (the scheduler
/// property tests and the simulator's figures are unchanged), only cheaper when most
/// candidates fail to fit.
#[derive(Default)]
struct PassMemo {
    /// Per tier, the orgs then queued in it, ascending by (fair-share score, org id):
    /// the first one still queued is the org `min_by_key` over the tier would choose.
    /// An org's score changes only when one of its jobs is placed (its running GPUs
    /// grow: `rescore`); preemption only marks victims, which keep their GPUs until
    /// their grace ends in a later entry. Entries of orgs gone from the tier are
    /// skipped. An org that joins a tier during the pass (a dedup runner's attached job
    /// of another tier taking over) is not ranked there until the next pass: the
    /// released behaviour, which only a rule version may change (parked jobs return
    /// only at the pass's end).
    org_rank: BTreeMap<Tier, VecDeque<(u64, OrgId)>>,
    /// The same one level down, built when the pass first descends into an org of a
    /// tier: its queued projects there ascending by (score, id). Without it every
    /// candidate ranked all of its org's projects, so one tenant queueing a job in each
    /// of 10,000 projects made every pass (every entry, on every replica) rank them
    /// 2,048 times over. Projects and users may join the queue during a pass (a dedup
    /// runner that ends hands its attached jobs a new runner, of any project and user
    /// of its org), and the choice below the org was always made afresh, so these
    /// rankings are dropped whenever a job joined (`joins`), and rebuilt as the pass
    /// next descends.
    project_rank: BTreeMap<(Tier, OrgId), BTreeSet<(u64, ProjectId)>>,
    /// And per (tier, org, project), its queued users there.
    user_rank: BTreeMap<(Tier, OrgId, ProjectId), BTreeSet<(u64, UserId)>>,
    /// The score each ranked project and user is filed under, and where a user is
    /// ranked (a user may queue in several projects), so a placement re-files them.
    project_score: BTreeMap<(OrgId, ProjectId), u64>,
    user_score: BTreeMap<(OrgId, UserId), (u64, Vec<RankedIn>)>,
    /// `Scheduler::queue_joins` when the rankings below the org were last valid.
    joins: u64,
    /// `try_reserve` found the reservation budget spent; only a placement (which
    /// releases the placed job's reservation) can free one.
    reserve_full: bool,
}

impl PassMemo {
    /// Re-files a placed job's project and user under their new scores (their running
    /// GPUs grew), wherever they are ranked.
    fn rescore_below(
        &mut self,
        org: OrgId,
        (project, ps): (ProjectId, u64),
        (user, us): (UserId, u64),
    ) {
        if let Some(old) = self.project_score.insert((org, project), ps) {
            for ((_, o), rank) in self.project_rank.iter_mut() {
                if *o == org && rank.remove(&(old, project)) {
                    rank.insert((ps, project));
                }
            }
        }
        if let Some((old, at)) = self.user_score.get_mut(&(org, user)) {
            for (tier, p) in at.iter() {
                if let Some(rank) = self.user_rank.get_mut(&(*tier, org, *p)) {
                    if rank.remove(&(*old, user)) {
                        rank.insert((us, user));
                    }
                }
            }
            *old = us;
        }
    }

    /// Moves `org` to its new place in every tier's ranking.
    fn rescore(&mut self, org: OrgId, score: u64) {
        for rank in self.org_rank.values_mut() {
            if let Some(pos) = rank.iter().position(|(_, o)| *o == org) {
                rank.remove(pos);
                let at = rank.partition_point(|e| *e < (score, org));
                rank.insert(at, (score, org));
            }
        }
    }
}

/// Fair-share score: decayed past usage plus the live allocation (running GPUs counted
/// as one half-life of use), in GPU-milliseconds, divided by the share weight relative to
/// the default (weight 200 counts its usage half: twice the share under contention).
fn score<K: Ord>(
    usage: &BTreeMap<K, super::usage::DecayedUsage>,
    running: &BTreeMap<K, u32>,
    weights: &BTreeMap<K, u32>,
    k: &K,
    now: u64,
    half_life: u64,
) -> u64 {
    let past = usage.get(k).map_or(0, |u| u.value_at(now, half_life));
    let raw = past.saturating_add(running.get(k).copied().unwrap_or(0) as u64 * half_life);
    match weights.get(k) {
        None => raw,
        Some(&w) => {
            let scaled = raw as u128 * SHARE_WEIGHT_DEFAULT as u128 / w.max(1) as u128;
            scaled.min(u64::MAX as u128) as u64
        }
    }
}

/// The first of `rank` still in `queued`, dropping those before it that left the queue
/// during the pass (a job joining drops the whole ranking instead: `PassMemo::joins`).
fn first_queued<K: Ord + Copy, V>(
    rank: &mut BTreeSet<(u64, K)>,
    queued: &BTreeMap<K, V>,
) -> Option<K> {
    loop {
        let first = *rank.first()?;
        if queued.contains_key(&first.1) {
            return Some(first.1);
        }
        rank.remove(&first);
    }
}

impl Scheduler {
    /// One bounded scheduling pass under rule version `rules` (the shard's active one,
    /// `crate::version`). From version 3 the fair policy gives its gang reservations to
    /// aged multi-GPU jobs, on the node that frees soonest (`reservations.rs`), and only
    /// the top tier may preempt a job that would lose work. Every other policy, and
    /// `Fair` under versions 1 and 2, decides as before.
    pub(crate) fn run_pass(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        rules: u32,
    ) {
        // The simulator's Slurm-like and Kueue-like baselines run their own candidate
        // order, admission and preemption (`baselines/`) over the same prelude, placement
        // and preemption mechanics.
        if matches!(cfg.policy, Policy::SlurmLike | Policy::KueueLike) {
            self.run_baseline_pass(ctx, ledger, cfg);
            return;
        }
        let v3 = cfg.policy == Policy::Fair && rules >= 3;
        // Jobs that cannot be placed now leave the queue for the rest of the pass.
        let mut parked: Vec<JobKey> = Vec::new();
        let (mut placed, mut examined, mut searches) = (0, 0, 0);
        let mut memo = PassMemo::default();
        if v3 {
            // Before the fair order (and before the memo ranks any org): aged gang jobs
            // take their ready reservations, and reserve nodes.
            placed += self.serve_aged_gangs(ctx, ledger, cfg);
        }
        while placed < cfg.placements_per_pass_max && examined < cfg.candidates_per_pass_max {
            // Nothing free anywhere: only preemption can help, and its budget is spent.
            let searches_left =
                cfg.policy != Policy::Fifo && searches < cfg.preemption_searches_per_pass_max;
            if !searches_left && self.free_index.values().all(|s| s.is_empty()) {
                break;
            }
            let Some(id) = self.pick(cfg, ctx.now, &mut memo) else {
                break;
            };
            examined += 1;
            let Some(types) = self.prelude(ctx, ledger, cfg, id, &mut parked) else {
                continue;
            };
            if let Some((node, indices)) = self.find_fit(id, &types) {
                if self.place(ctx, ledger, cfg, id, node, indices).is_ok() {
                    placed += 1;
                    if let Some(j) = self.jobs.get(&id) {
                        let (org, project, user) = (j.org, j.spec.project, j.spec.user);
                        let (now, h) = (ctx.now, cfg.usage_half_life_ms);
                        memo.rescore(org, self.org_score(&org, now, h));
                        memo.rescore_below(
                            org,
                            (project, self.project_score(org, project, now, h)),
                            (user, self.user_score(org, user, now, h)),
                        );
                    }
                    memo.reserve_full = false;
                    continue;
                }
            } else {
                if cfg.policy != Policy::Fifo && searches < cfg.preemption_searches_per_pass_max {
                    searches += 1;
                    self.try_preempt(ctx, ledger, cfg, id, &types, v3);
                }
                // From rule version 3 only aged gang jobs reserve (`serve_aged_gangs`).
                if cfg.policy == Policy::Fair && !v3 {
                    self.try_reserve(cfg, id, &types, &mut memo.reserve_full);
                }
            }
            self.dequeue(id);
            parked.push(id);
        }
        for id in parked {
            self.enqueue(id);
        }
    }

    /// What every policy does first with a picked candidate: a job whose org runs its
    /// quota of jobs is parked (it waits in the queue); a job not yet placed gives up
    /// the credit its expired buckets held (from rule version 8,
    /// [`Self::renew_unplaced_hold`]) or ends; only GPU types that still have a
    /// price can be metered, so a job whose preferred type lost its price tries its next,
    /// and one with none left fails (its hold returns) rather than wait forever. `None`:
    /// the job left the queue (parked or ended); otherwise its priced types, in its order.
    pub(super) fn prelude(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        parked: &mut Vec<JobKey>,
    ) -> Option<Vec<GpuType>> {
        if self.at_running_quota(cfg, id) {
            self.dequeue(id);
            parked.push(id);
            return None;
        }
        if !self.renew_unplaced_hold(ctx, ledger, cfg, id) {
            return None;
        }
        let types = self.priced_types(ledger, id);
        if types.is_empty() {
            self.end(
                ctx,
                ledger,
                cfg,
                id,
                Ending {
                    settle: SettleReason::Failed,
                    to: JobState::Failed,
                    reason: Reason::Unpriced,
                },
            );
            return None;
        }
        Some(types)
    }

    /// The job's acceptable GPU types that have a price now, in its order of preference.
    pub(super) fn priced_types(&self, ledger: &Ledger, id: JobKey) -> Vec<GpuType> {
        self.jobs.get(&id).map_or_else(Vec::new, |j| {
            j.spec
                .gpu_types
                .iter()
                .filter(|t| ledger.price_of(t).is_some())
                .cloned()
                .collect()
        })
    }

    pub(super) fn org_score(&self, org: &OrgId, now: u64, h: u64) -> u64 {
        score(
            &self.usage_org,
            &self.running_org,
            &self.weight_org,
            org,
            now,
            h,
        )
    }

    /// Whether the job's org already runs as many jobs as its quota allows.
    pub(super) fn at_running_quota(&self, cfg: &SchedulerConfig, id: JobKey) -> bool {
        let Some(org) = self.jobs.get(&id).map(|j| j.org) else {
            return false;
        };
        let quota = self.quotas.get(&org).copied().unwrap_or(cfg.default_quota);
        self.org_counts.get(&org).map_or(0, |c| c.1) >= quota.running_max
    }

    /// The next job to consider, by policy.
    fn pick(&self, cfg: &SchedulerConfig, now: u64, memo: &mut PassMemo) -> Option<JobKey> {
        let oldest = |t: &Tier| self.by_age.get(t).and_then(|q| q.first()).copied();
        match cfg.policy {
            Policy::Fifo => self.by_age.keys().filter_map(oldest).min().map(|(_, j)| j),
            // Their passes pick their own candidates (`baselines/`).
            Policy::SlurmLike | Policy::KueueLike => None,
            Policy::StrictPriority => self
                .by_age
                .keys()
                .next_back()
                .and_then(oldest)
                .map(|(_, j)| j),
            Policy::Fair => {
                // Aging: a tier whose oldest job waited past the tier's max wait and
                // that holds less than max(its floor, one job's worth) is served
                // first, most overdue first — so no tier starves even with a zero
                // floor, while sustained overload (when every tier is "aged") does
                // not turn priorities upside down. Inside a tier, fair share chooses.
                let fleet = self.fleet_gpus.max(1) as u64;
                let aged = self
                    .by_age
                    .iter()
                    .filter(|(t, _)| {
                        let used = self.tier_gpus.get(t).copied().unwrap_or(0) as u64;
                        let floor = (cfg.tiers[t.0 as usize].floor_pct as u64 * fleet / 100).max(1);
                        used < floor
                    })
                    .filter_map(|(t, q)| {
                        q.first()
                            .filter(|(since, _)| now - since >= cfg.tiers[t.0 as usize].max_wait_ms)
                            .map(|(since, _)| (*since, *t))
                    })
                    .min();
                let tier = match aged {
                    Some((_, t)) => t,
                    None => self.pick_tier(cfg)?,
                };
                self.pick_in_tier(tier, now, cfg.usage_half_life_ms, memo)
            }
        }
    }

    /// Tiers below their floor first (highest first); otherwise, among tiers under
    /// their ceiling (all, if none is), the one with the least GPUs per weight.
    fn pick_tier(&self, cfg: &SchedulerConfig) -> Option<Tier> {
        let fleet = self.fleet_gpus.max(1) as u64;
        let used = |t: &Tier| self.tier_gpus.get(t).copied().unwrap_or(0) as u64;
        let conf = |t: &Tier| &cfg.tiers[t.0 as usize];
        let tiers: Vec<Tier> = self.queue.keys().copied().collect();
        if let Some(t) = tiers
            .iter()
            .rev()
            .find(|t| used(t) * 100 < conf(t).floor_pct as u64 * fleet)
        {
            return Some(*t);
        }
        let under: Vec<Tier> = tiers
            .iter()
            .copied()
            .filter(|t| used(t) * 100 < conf(t).ceiling_pct as u64 * fleet)
            .collect();
        let pool = if under.is_empty() { tiers } else { under };
        pool.into_iter().min_by_key(|t| {
            (
                used(t) * 1_000_000 / conf(t).weight.max(1) as u64,
                std::cmp::Reverse(*t),
            )
        })
    }

    /// Weighted fair share down org → project → user on decayed usage, then oldest.
    fn pick_in_tier(&self, tier: Tier, now: u64, h: u64, memo: &mut PassMemo) -> Option<JobKey> {
        let orgs = self.queue.get(&tier)?;
        let rank = memo.org_rank.entry(tier).or_insert_with(|| {
            let mut r: Vec<(u64, OrgId)> = orgs
                .keys()
                .map(|o| (self.org_score(o, now, h), *o))
                .collect();
            r.sort_unstable();
            r.into()
        });
        while rank.front().is_some_and(|(_, o)| !orgs.contains_key(o)) {
            rank.pop_front();
        }
        let org = rank.front()?.1;
        // The memo must choose exactly what a fresh minimum over the tier chooses (every
        // test build checks it, on every candidate of every pass).
        debug_assert_eq!(
            Some(org),
            orgs.keys()
                .min_by_key(|o| (self.org_score(o, now, h), **o))
                .copied(),
            "the pass's org ranking diverged from fair share"
        );
        let projects = orgs.get(&org)?;
        if memo.joins != self.queue_joins.0 {
            memo.joins = self.queue_joins.0;
            memo.project_rank.clear();
            memo.user_rank.clear();
            memo.project_score.clear();
            memo.user_score.clear();
        }
        let rank = memo.project_rank.entry((tier, org)).or_insert_with(|| {
            projects
                .keys()
                .map(|p| {
                    let s = self.project_score(org, *p, now, h);
                    memo.project_score.insert((org, *p), s);
                    (s, *p)
                })
                .collect()
        });
        let project = first_queued(rank, projects)?;
        debug_assert_eq!(
            Some(project),
            projects
                .keys()
                .min_by_key(|p| (self.project_score(org, **p, now, h), **p))
                .copied(),
            "the pass's project ranking diverged from fair share"
        );
        let users = projects.get(&project)?;
        let rank = memo
            .user_rank
            .entry((tier, org, project))
            .or_insert_with(|| {
                users
                    .keys()
                    .map(|u| {
                        let s = self.user_score(org, *u, now, h);
                        let filed = memo.user_score.entry((org, *u)).or_insert((s, Vec::new()));
                        filed.1.push((tier, project));
                        (s, *u)
                    })
                    .collect()
            });
        let user = first_queued(rank, users)?;
        debug_assert_eq!(
            Some(user),
            users
                .keys()
                .min_by_key(|u| (self.user_score(org, **u, now, h), **u))
                .copied(),
            "the pass's user ranking diverged from fair share"
        );
        users.get(&user)?.first().map(|(_, j)| *j)
    }

    fn project_score(&self, org: OrgId, project: ProjectId, now: u64, h: u64) -> u64 {
        let k = (org, project);
        score(
            &self.usage_project,
            &self.running_project,
            &self.weight_project,
            &k,
            now,
            h,
        )
    }

    fn user_score(&self, org: OrgId, user: UserId, now: u64, h: u64) -> u64 {
        let k = (org, user);
        score(
            &self.usage_user,
            &self.running_user,
            &self.weight_user,
            &k,
            now,
            h,
        )
    }

    /// Best fit: in preference order of GPU types, the ready node with the fewest free
    /// GPUs that still fit (keeping whole free nodes for large jobs), memory floor met,
    /// not reserved for another waiting job; ties by node id. GPUs: lowest free indices.
    pub(super) fn find_fit(&self, id: JobKey, types: &[GpuType]) -> Option<(NodeId, Vec<u8>)> {
        self.find_fit_where(id, types, |_| true)
    }

    /// [`Self::find_fit`] over the nodes `allow` accepts (a baseline's backfill rule).
    pub(super) fn find_fit_where(
        &self,
        id: JobKey,
        types: &[GpuType],
        allow: impl Fn(NodeId) -> bool,
    ) -> Option<(NodeId, Vec<u8>)> {
        let j = self.jobs.get(&id)?;
        let (gpus, floor) = (j.spec.gpus, j.spec.mem_floor_gb);
        let usable = |node: NodeId| {
            if !allow(node) {
                return None;
            }
            let n = self.nodes.get(&node)?;
            let reserved_elsewhere = n.reserved_for.is_some_and(|r| {
                r != id
                    && self
                        .jobs
                        .get(&r)
                        .is_some_and(|rj| rj.state == JobState::Queued)
            });
            (n.gpu_mem_gb >= floor && !reserved_elsewhere && n.free_gpus() >= gpus).then(|| {
                let idx: Vec<u8> = n
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.is_none())
                    .map(|(i, _)| i as u8)
                    .take(gpus as usize)
                    .collect();
                (node, idx)
            })
        };
        if let Some(fit) = j.reserved_node.and_then(|n| {
            let ready = self
                .nodes
                .get(&n)
                .is_some_and(|x| x.placeable() && types.contains(&x.gpu_type));
            if ready {
                usable(n)
            } else {
                None
            }
        }) {
            return Some(fit);
        }
        for t in types {
            let Some(set) = self.free_index.get(t) else {
                continue;
            };
            for &(_, node) in set.range((gpus, NodeId(0))..) {
                if let Some(fit) = usable(node) {
                    return Some(fit);
                }
            }
        }
        None
    }

    /// Anti-fragmentation: a multi-GPU job that fits nowhere reserves the fitting node
    /// with the most free GPUs, so small jobs stop backfilling it; it then frees up as
    /// its jobs finish. Bounded by `reserved_nodes_max`.
    /// `full` is the pass's note that the budget is spent (set here, cleared by a
    /// placement), which spares a scan of every node per blocked candidate.
    fn try_reserve(
        &mut self,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
        full: &mut bool,
    ) {
        let Some(j) = self.jobs.get(&id) else { return };
        if *full || j.reserved_node.is_some() || j.spec.gpus < 2 {
            return;
        }
        if self.reservations_full(cfg) {
            *full = true;
            return;
        }
        let (gpus, floor) = (j.spec.gpus, j.spec.mem_floor_gb);
        let best = self
            .reservable_nodes(types, gpus, floor)
            .max_by_key(|&(node, n)| (n.free_gpus(), std::cmp::Reverse(node)));
        if let Some((node, _)) = best {
            self.reserve(id, node);
        }
    }

    /// Whether the reservation budget (`reserved_nodes_max` nodes) is spent.
    pub(super) fn reservations_full(&self, cfg: &SchedulerConfig) -> bool {
        let reserved = self
            .nodes
            .values()
            .filter(|n| n.reserved_for.is_some())
            .count();
        reserved >= cfg.reserved_nodes_max as usize
    }

    /// The nodes a job of `gpus` GPUs of at least `floor` GB each, of one of `types`,
    /// may reserve: placeable, large enough, memory floor met, not reserved.
    pub(super) fn reservable_nodes<'a>(
        &'a self,
        types: &'a [GpuType],
        gpus: u32,
        floor: u32,
    ) -> impl Iterator<Item = (NodeId, &'a GpuNode)> + 'a {
        types
            .iter()
            .flat_map(move |t| self.type_nodes.get(t).into_iter().flatten())
            .filter_map(move |&node| self.nodes.get(&node).map(|n| (node, n)))
            .filter(move |(_, n)| {
                n.placeable()
                    && n.gpu_count >= gpus
                    && n.gpu_mem_gb >= floor
                    && n.reserved_for.is_none()
            })
    }

    /// `node` is held for `id`.
    pub(super) fn reserve(&mut self, id: JobKey, node: NodeId) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.reserved_for = Some(id);
        }
        if let Some(j) = self.jobs.get_mut(&id) {
            j.reserved_node = Some(node);
        }
    }

    /// Preemption for a job that does not fit: only preemptible jobs of a lower tier,
    /// past their minimum runtime, under their preemption cap and whose loss (GPUs ×
    /// time since the last checkpoint) is within `preemption_loss_max_gpu_ms`; on one
    /// node, the victim set that frees enough GPUs with the least work lost since
    /// checkpoint, then the fewest victims (exact: [`cheapest_victims`]), then the lowest
    /// node id. Not when a running job on a fitting node ends within the hysteresis
    /// window (waiting is cheaper). Victims enter Preempting with a grace period; the
    /// node is reserved for the waiting job. A job whose own preemption is under way
    /// waits for it; a job holding only an anti-fragmentation reservation (waiting for a
    /// node to drain by itself) may still preempt, here or on another node.
    /// `lossless_below_top` (rule version 3, `Fair`): a job of any tier but the top one
    /// takes only checkpointable victims, which checkpoint in their grace period and so
    /// lose no work; losing work for a start is the top tier's alone (its SLA is the
    /// tight one).
    fn try_preempt(
        &mut self,
        ctx: &mut Ctx,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
        lossless_below_top: bool,
    ) {
        let Some(j) = self.jobs.get(&id) else { return };
        if j.reserved_node
            .is_some_and(|node| self.preempting_for(node, id))
        {
            return;
        }
        let (tier, gpus, floor, now) = (j.spec.tier, j.spec.gpus, j.spec.mem_floor_gb, ctx.now);
        let checkpointable_only = lossless_below_top && (tier.0 as usize) + 1 < cfg.tiers.len();
        let mut best: Option<((u64, usize, NodeId), Vec<JobKey>)> = None;
        for t in types {
            for &node in self.type_nodes.get(t).into_iter().flatten() {
                let Some(n) = self.nodes.get(&node) else {
                    continue;
                };
                if !n.placeable()
                    || n.gpu_mem_gb < floor
                    || n.gpu_count < gpus
                    || n.reserved_for.is_some_and(|r| r != id)
                {
                    continue;
                }
                let free = n.free_gpus();
                let mut cands: Vec<(u64, JobKey, u32)> = Vec::new();
                for v in n.jobs() {
                    let Some(vj) = self.jobs.get(&v) else {
                        continue;
                    };
                    if vj.placement.is_none() {
                        continue;
                    }
                    if vj.state == JobState::Running
                        && vj.deadline_at.is_some_and(|d| d <= now + cfg.hysteresis_ms)
                        && free + vj.spec.gpus >= gpus
                    {
                        return; // hysteresis: a job here ends soon and frees enough
                    }
                    if vj.spec.tier < tier && (!checkpointable_only || vj.spec.checkpointable) {
                        if let Some(lost) = self.victim_loss(ledger, cfg, v, now) {
                            cands.push((lost, v, vj.spec.gpus));
                        }
                    }
                }
                let need = gpus.saturating_sub(free);
                if need == 0 {
                    continue;
                }
                cands.sort();
                let Some((lost, victims)) = cheapest_victims(&cands, need) else {
                    continue;
                };
                let key = (lost, victims.len(), node);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, victims));
                }
            }
        }
        let Some(((_, _, node), victims)) = best else {
            return;
        };
        self.begin_preemption(ctx, cfg, id, node, victims, ledger.rules.0);
    }

    /// The work `v` would lose if preempted now (GPUs × time since its last checkpoint,
    /// or since it started), if the shard's rules let it be a victim at all: running,
    /// preemptible, past `min_runtime_ms` in this attempt, under
    /// `preemptions_per_job_max`, and losing at most `preemption_loss_max_gpu_ms`. Which
    /// of these victims a waiting job may take is the policy's rule.
    pub(super) fn victim_loss(
        &self,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        v: JobKey,
        now: u64,
    ) -> Option<u64> {
        let vj = self.jobs.get(&v)?;
        let p = vj.placement.as_ref()?;
        let eligible = vj.state == JobState::Running
            && vj.spec.preemptible
            && vj.preemptions < cfg.preemptions_per_job_max
            && now.saturating_sub(p.started_ms) >= cfg.min_runtime_ms;
        if !eligible {
            return None;
        }
        let since = ledger
            .hold(v.0, super::jobs::hold_of(v))
            .and_then(|h| h.meter.as_ref())
            .and_then(|m| m.checkpoint_ms)
            .unwrap_or(p.started_ms)
            .max(p.started_ms);
        let lost = vj.spec.gpus as u64 * now.saturating_sub(since);
        (lost <= cfg.preemption_loss_max_gpu_ms).then_some(lost)
    }

    /// Starts preempting `victims` on `node` for the waiting job `id`: each enters
    /// Preempting with the grace period to checkpoint, and the node is reserved for `id`
    /// (a plain reservation of `id` elsewhere gives way).
    pub(super) fn begin_preemption(
        &mut self,
        ctx: &mut Ctx,
        cfg: &SchedulerConfig,
        id: JobKey,
        node: NodeId,
        victims: Vec<JobKey>,
        rules: u32,
    ) {
        let Some(tier) = self.jobs.get(&id).map(|j| j.spec.tier) else {
            return;
        };
        let now = ctx.now;
        // A plain reservation elsewhere gives way to the preemption.
        if self.jobs.get(&id).and_then(|j| j.reserved_node) != Some(node) {
            self.clear_reservation(id);
        }
        for v in victims {
            if let Some(vj) = self.jobs.get_mut(&v) {
                vj.preemptions += 1;
            }
            self.set_timer(v, Timer::Grace, Some(now + cfg.grace_ms));
            if rules >= super::FENCE_INSTANTS_FROM {
                self.fence.preempted_ms.insert(v, now);
            }
            // The victim's org learns the preemptor's tier, and its id only if the
            // preemptor is its own (another org's job ids are never shown).
            let reason = Reason::Preempted {
                by: (v.0 == id.0).then_some(id.1),
                by_tier: tier,
            };
            if let Some(vj) = self.jobs.get_mut(&v) {
                vj.state = JobState::Preempting;
                vj.last_reason = reason;
                vj.preempted_for = Some(id);
            }
            self.job_event(ctx.effects, v, Some(JobState::Running), reason);
        }
        if let Some(n) = self.nodes.get_mut(&node) {
            n.reserved_for = Some(id);
        }
        if let Some(j) = self.jobs.get_mut(&id) {
            j.reserved_node = Some(node);
        }
    }

    /// Whether jobs on `node` are being preempted for `id` (in their grace period).
    pub(super) fn preempting_for(&self, node: NodeId, id: JobKey) -> bool {
        self.nodes.get(&node).is_some_and(|n| {
            n.jobs().iter().any(|v| {
                self.jobs.get(v).is_some_and(|vj| {
                    vj.state == JobState::Preempting && vj.preempted_for == Some(id)
                })
            })
        })
    }
}

/// The victim set that frees at least `need` GPUs with the least work lost, then the
/// fewest victims, then the smallest ids (candidates come sorted by (lost, id)): an exact
/// 0/1 knapsack over "at least g GPUs freed", O(candidates × need) — at most 16 × 16 on
/// one node. A greedy pick by smallest loss can take two victims where one whose loss
/// is smaller than their sum frees enough.
fn cheapest_victims(cands: &[(u64, JobKey, u32)], need: u32) -> Option<(u64, Vec<JobKey>)> {
    let need = need as usize;
    let mut best: Vec<Option<(u64, Vec<JobKey>)>> = vec![None; need + 1];
    best[0] = Some((0, Vec::new()));
    for &(lost, v, g) in cands {
        for want in (1..=need).rev() {
            let from = want.saturating_sub(g as usize);
            let Some((l, vs)) = &best[from] else { continue };
            let mut victims = vs.clone();
            victims.push(v);
            let cand = (l.saturating_add(lost), victims);
            let better = best[want]
                .as_ref()
                .is_none_or(|cur| (cand.0, cand.1.len(), &cand.1) < (cur.0, cur.1.len(), &cur.1));
            if better {
                best[want] = Some(cand);
            }
        }
    }
    best.pop().flatten()
}
