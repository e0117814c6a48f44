//! The simulator's two realistic baselines, written from the public descriptions of
//! Slurm (`slurm.rs`: multifactor priority with Fair Tree, QOS preemption, EASY backfill)
//! and Kueue (`kueue.rs`: ClusterQueues with nominal quotas in a cohort, borrowing and
//! lending limits, fair sharing, reclaim and lower-priority preemption). They are not
//! allot's policy, and no command chooses them: only `Config` does (DESIGN §24).
//!
//! Each decides its candidate order, whether a candidate may start now, and what a
//! blocked candidate does (preempt, reserve). They share with the other policies the
//! pass's bounds, its prelude (running quota, priced GPU types), best-fit placement on
//! one node, and the shard's preemption mechanics (which running jobs may be victims at
//! all, the grace period, requeue billed to the last checkpoint, the freed node reserved
//! for the waiting job). Pure and deterministic like the rest of the pass: integer
//! arithmetic, ordered maps, every loop bounded by the pass's bounds or by the size of
//! the fleet and the queue.

mod kueue;
mod slurm;

pub use kueue::ClusterQueueView;
pub use slurm::{SlurmPriority, SLURM_WEIGHT_AGE, SLURM_WEIGHT_FAIRSHARE, SLURM_WEIGHT_QOS};

use super::{JobState, Policy, Scheduler, SchedulerConfig};
use crate::ids::{GpuType, JobKey, NodeId};
use crate::ledger::{Ctx, Ledger};

/// One baseline's part of a pass.
trait Baseline {
    /// The next queued candidate, in the baseline's order.
    fn next(&mut self, s: &Scheduler) -> Option<JobKey>;
    /// Places `id` now if the baseline lets it start (`types`: its priced GPU types, in
    /// its order); true if placed.
    fn start(
        &mut self,
        s: &mut Scheduler,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
    ) -> bool;
    /// `id` cannot start now: preempt (spending one of the pass's `searches`) or
    /// reserve, as the baseline does.
    #[allow(clippy::too_many_arguments)]
    fn blocked(
        &mut self,
        s: &mut Scheduler,
        ctx: &mut Ctx,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        types: &[GpuType],
        searches: &mut u32,
    );
    /// The last candidate left the queue for the rest of the pass (placed, parked or
    /// ended).
    fn left(&mut self, s: &Scheduler);
}

impl Scheduler {
    /// One bounded pass of the configured baseline.
    pub(super) fn run_baseline_pass(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
    ) {
        match cfg.policy {
            Policy::SlurmLike => {
                let mut b = slurm::Pass::new(self, cfg, ctx.now);
                self.drive(ctx, ledger, cfg, &mut b);
            }
            Policy::KueueLike => {
                let mut b = kueue::Pass::new(self, cfg);
                self.drive(ctx, ledger, cfg, &mut b);
            }
            Policy::Fair | Policy::StrictPriority | Policy::Fifo => {}
        }
    }

    /// The pass's loop, with the same bounds as the other policies': at most
    /// `candidates_per_pass_max` candidates, `placements_per_pass_max` placements and
    /// `preemption_searches_per_pass_max` victim searches; a candidate that cannot start
    /// is parked for the rest of the pass.
    fn drive(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        b: &mut impl Baseline,
    ) {
        let mut parked: Vec<JobKey> = Vec::new();
        let (mut placed, mut examined, mut searches) = (0, 0, 0);
        while placed < cfg.placements_per_pass_max && examined < cfg.candidates_per_pass_max {
            // Nothing free anywhere: only preemption can help, and its budget is spent.
            if searches >= cfg.preemption_searches_per_pass_max
                && self.free_index.values().all(|s| s.is_empty())
            {
                break;
            }
            let Some(id) = b.next(self) else { break };
            examined += 1;
            let Some(types) = self.prelude(ctx, ledger, cfg, id, &mut parked) else {
                b.left(self);
                continue;
            };
            if b.start(self, ctx, ledger, cfg, id, &types) {
                placed += 1;
                b.left(self);
                continue;
            }
            b.blocked(self, ctx, ledger, cfg, id, &types, &mut searches);
            self.dequeue(id);
            parked.push(id);
            b.left(self);
        }
        for id in parked {
            self.enqueue(id);
        }
    }

    /// The nodes of type `t` a waiting job of `gpus` GPUs with memory floor `floor` could
    /// ever use: placeable, large enough, and not reserved for another queued job (a
    /// preemption under way for it).
    fn candidate_nodes<'a>(
        &'a self,
        id: JobKey,
        t: &GpuType,
        gpus: u32,
        floor: u32,
    ) -> impl Iterator<Item = (NodeId, &'a super::GpuNode)> + 'a {
        self.type_nodes
            .get(t)
            .into_iter()
            .flatten()
            .filter_map(move |node| {
                let n = self.nodes.get(node)?;
                let reserved_elsewhere = n.reserved_for.is_some_and(|r| {
                    r != id
                        && self
                            .jobs
                            .get(&r)
                            .is_some_and(|rj| rj.state == JobState::Queued)
                });
                (n.placeable()
                    && n.gpu_count >= gpus
                    && n.gpu_mem_gb >= floor
                    && !reserved_elsewhere)
                    .then_some((*node, n))
            })
    }

    /// Whether `id` waits for a preemption already under way for it (its victims are in
    /// their grace period): it must not start another.
    fn awaiting_preemption(&self, id: JobKey) -> bool {
        self.jobs
            .get(&id)
            .and_then(|j| j.reserved_node)
            .is_some_and(|node| self.preempting_for(node, id))
    }
}
