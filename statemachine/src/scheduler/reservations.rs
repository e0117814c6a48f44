//! Gang reservations of the fair policy from rule version 3 (DESIGN §21, §24).
//!
//! A multi-GPU job needs all its GPUs free on one node at once. Small jobs fill every GPU
//! that frees, so without a reservation a whole-node job waits for a node to drain by
//! chance; under versions 1 and 2 the first blocked multi-GPU jobs of each pass reserved
//! the node with the most free GPUs now, which then idled while its remaining jobs ran
//! to their ends (3 % of the simulator's fleet, and hours of waiting for whole-node jobs).
//! From version 3:
//! - **who reserves**: aged multi-GPU jobs only (waited past their tier's
//!   `max_wait_ms`), each org's most overdue one; within a tier by the org's fair-share
//!   score, across tiers by how long ago the next candidate's wait passed its tier's
//!   max wait ([`Scheduler::aged_gang_heads`]);
//! - **where**: the node where the job's GPUs are free soonest by the estimated ends of
//!   the jobs running there — a running job's end is estimated from the progress its
//!   agent reports, never later than its deadline ([`Scheduler::estimated_end`]) — so a
//!   node whose remaining jobs are about to end is reserved, not the emptiest one;
//! - **when**: before the fair order, a job whose reserved node is ready is placed there.
//!
//! The reservation budget is still `reserved_nodes_max`, and a pass runs at most that
//! many node searches for reservations.

use super::{JobState, Scheduler, SchedulerConfig};
use crate::ids::{GpuType, JobKey, NodeId, OrgId, Tier};
use crate::ledger::{Ctx, Ledger};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Progress is reported in parts per million.
const PROGRESS_PPM_FULL: u64 = 1_000_000;

impl Scheduler {
    /// Before the fair order (rule version 3): each aged gang head of
    /// [`Self::aged_gang_heads`], in that order — placed on its reserved node if the node
    /// is ready; left to the fair order if it fits somewhere now; otherwise given a
    /// reservation while the budget lasts. Returns the placements made.
    pub(super) fn serve_aged_gangs(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
    ) -> u32 {
        let (mut placed, mut searches, mut full) = (0, 0, false);
        for id in self.aged_gang_heads(cfg, ctx.now) {
            if placed >= cfg.placements_per_pass_max {
                break;
            }
            let types = self.priced_types(ledger, id);
            if types.is_empty() || self.at_running_quota(cfg, id) {
                continue;
            }
            let reserved = self.jobs.get(&id).and_then(|j| j.reserved_node);
            if let Some(node) = reserved {
                if self.preempting_for(node, id) {
                    continue; // its victims are still in their grace period
                }
                let fit = self.find_fit_where(id, &types, |n| n == node);
                if let Some((node, indices)) = fit {
                    // What the fair order's prelude does first (`Self::prelude`).
                    if !self.renew_unplaced_hold(ctx, ledger, cfg, id) {
                        continue;
                    }
                    if self.place(ctx, ledger, cfg, id, node, indices).is_ok() {
                        placed += 1;
                    }
                }
                continue;
            }
            // A job that fits starts in the fair order; a reserved one above may still
            // be ready after the budget or the searches are spent.
            if full || searches >= cfg.reserved_nodes_max || self.find_fit(id, &types).is_some() {
                continue;
            }
            searches += 1;
            full = !self.reserve_soonest(ledger, cfg, id, &types, ctx.now);
        }
        placed
    }

    /// The aged gang heads: queued jobs of two GPUs or more that waited at least their
    /// tier's `max_wait_ms`, one per org (its oldest, in the highest tier it has one
    /// in), looking at no more than `candidates_per_pass_max` queued jobs in all, an
    /// equal part of them in each tier (oldest first). Within a tier they follow the
    /// orgs' fair-share scores (then org id); the tiers are merged by when the next one's
    /// wait passed its tier's max wait (then the higher tier, then job id).
    pub(super) fn aged_gang_heads(&self, cfg: &SchedulerConfig, now: u64) -> Vec<JobKey> {
        let h = cfg.usage_half_life_ms;
        let mut per_tier: BTreeMap<Tier, Vec<(u64, OrgId, u64, JobKey)>> = BTreeMap::new();
        let mut orgs_seen: BTreeSet<OrgId> = BTreeSet::new();
        let looks_per_tier = (cfg.candidates_per_pass_max as usize / cfg.tiers.len().max(1)).max(1);
        for (tier, q) in self.by_age.iter().rev() {
            let Some(max_wait) = cfg.tiers.get(tier.0 as usize).map(|t| t.max_wait_ms) else {
                continue;
            };
            for &(since, id) in q.iter().take(looks_per_tier) {
                if now.saturating_sub(since) < max_wait {
                    break;
                }
                let Some(j) = self.jobs.get(&id) else {
                    continue;
                };
                // Oldest first: an org's first aged gang job in a tier is its oldest.
                if j.spec.gpus < 2 || !orgs_seen.insert(j.org) {
                    continue;
                }
                let score = self.org_score(&j.org, now, h);
                let due = since.saturating_add(max_wait);
                per_tier
                    .entry(*tier)
                    .or_default()
                    .push((score, j.org, due, id));
            }
        }
        let mut queues: BTreeMap<Tier, VecDeque<(u64, OrgId, u64, JobKey)>> = per_tier
            .into_iter()
            .map(|(t, mut v)| {
                v.sort_unstable();
                (t, v.into())
            })
            .collect();
        let mut out = Vec::new();
        loop {
            let next = queues
                .iter()
                .filter_map(|(t, q)| {
                    q.front()
                        .map(|&(_, _, due, id)| (due, std::cmp::Reverse(*t), id))
                })
                .min();
            let Some((_, std::cmp::Reverse(tier), id)) = next else {
                break;
            };
            if let Some(q) = queues.get_mut(&tier) {
                q.pop_front();
            }
            out.push(id);
        }
        out
    }

    /// Reserves for `id` the node of its types (placeable, large enough, memory floor
    /// met, not reserved) where its GPUs are free soonest by [`Self::free_at`], then the
    /// one with the most free GPUs now, then the lowest id. False if the reservation
    /// budget (`reserved_nodes_max` nodes) is spent; true otherwise, reserved or not.
    fn reserve_soonest(
        &mut self,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
        now: u64,
    ) -> bool {
        if self.reservations_full(cfg) {
            return false;
        }
        let Some(j) = self.jobs.get(&id) else {
            return true;
        };
        let (gpus, floor) = (j.spec.gpus, j.spec.mem_floor_gb);
        let best = self
            .reservable_nodes(types, gpus, floor)
            .filter_map(|(node, n)| {
                let at = self.free_at(ledger, node, gpus, now)?;
                Some((at, std::cmp::Reverse(n.free_gpus()), node))
            })
            .min();
        if let Some((_, _, node)) = best {
            self.reserve(id, node);
        }
        true
    }

    /// When `gpus` GPUs of `node` are free, by the estimated ends of the jobs on it
    /// (`now` if they are free already); `None` if the node has fewer GPUs.
    pub(super) fn free_at(
        &self,
        ledger: &Ledger,
        node: NodeId,
        gpus: u32,
        now: u64,
    ) -> Option<u64> {
        let n = self.nodes.get(&node)?;
        let mut ends: Vec<(u64, u32)> = n
            .jobs()
            .into_iter()
            .filter_map(|v| {
                let g = self.jobs.get(&v)?.spec.gpus;
                Some((self.estimated_end(ledger, v, now), g))
            })
            .collect();
        ends.sort_unstable();
        let (mut free, mut at) = (n.free_gpus(), now);
        for (end, g) in ends {
            if free >= gpus {
                break;
            }
            at = end;
            free += g;
        }
        (free >= gpus).then_some(at)
    }

    /// When a job holding GPUs will end, by estimate, never before `now`: a job being
    /// preempted at its grace's end; a running one from the progress its agent last
    /// reported (the time it has run, over all its attempts, scaled by the share of the
    /// work left), never after its deadline; without progress yet, at its deadline.
    pub(super) fn estimated_end(&self, ledger: &Ledger, id: JobKey, now: u64) -> u64 {
        let Some(j) = self.jobs.get(&id) else {
            return now;
        };
        if j.state == JobState::Preempting {
            return j.grace_at.unwrap_or(now).max(now);
        }
        let deadline = j.deadline_at.unwrap_or(now).max(now);
        let meter = ledger
            .hold(id.0, super::jobs::hold_of(id))
            .and_then(|h| h.meter.as_ref())
            .filter(|m| m.attempt == j.attempt && m.progress_ppm > 0);
        let (Some(m), Some(p)) = (meter, j.placement.as_ref()) else {
            return deadline;
        };
        let done = (m.progress_ppm as u64).min(PROGRESS_PPM_FULL);
        let ran = j.run_ms + m.last_heartbeat_ms.saturating_sub(p.started_ms);
        let left = (PROGRESS_PPM_FULL - done) as u128 * ran as u128 / done as u128;
        let end = m.last_heartbeat_ms as u128 + left;
        (end.min(deadline as u128) as u64).max(now)
    }
}
