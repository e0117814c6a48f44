//! Time-driven transitions, run first in every entry on logical time: node leases (a
//! node that misses its lease takes no new work; `fence_margin_ms` later, unless it came
//! back, it is down and its jobs go back to the queue, billed to their last heartbeat, up
//! to `node_failure_requeues_max` times, then fail), job leases (no heartbeat in time:
//! Lost), preemption grace, and max duration.

use super::{Ending, JobState, NodeState, Reason, Scheduler, SchedulerConfig, Timer};
use crate::command::SettleReason;
use crate::ledger::{Ctx, Ledger};
use crate::limits::TIMERS_PER_ENTRY_MAX;

/// The rule version from which a preemption's grace waits for a silent victim node
/// ([`Scheduler::grace_waits_for_the_node`]).
pub const GRACE_WAITS_FOR_THE_NODE_FROM: u32 = 4;
/// The rule version from which the instants that rule compares are kept as they happen
/// (`Fence`), not rebuilt from the settings of the moment.
pub const FENCE_INSTANTS_FROM: u32 = 5;

/// The rule version from which a `RegisterNode` of a known node by its own agent process
/// (the incarnation it holds; which renews its lease) ends the preemptions that waited
/// for the node's renewal, as a `NodeHeartbeat` does from
/// [`GRACE_WAITS_FOR_THE_NODE_FROM`]; before it they waited for the next heartbeat.
pub const REGISTRATION_ENDS_WAITING_GRACES_FROM: u32 = 6;

/// The rule version from which an operator's `RegisterNode` (incarnation 0) of a node an
/// agent process has claimed changes only its labels: it no longer renews the node's
/// lease, notes a renewal or brings it back from `Down` — the agent's heartbeats do.
pub const OPERATOR_REGISTRATIONS_RENEW_NOTHING_FROM: u32 = 6;

/// The rule version from which a job being preempted when its node fails (the node's
/// fate, or a new agent process's registration) is requeued as preempted — billed to its
/// checkpoint, not counted as a node failure — as a fenced one always was.
pub const PREEMPTED_ON_A_FAILED_NODE_FROM: u32 = 8;

impl Scheduler {
    /// A job whose node lost it (the lease ran out, or the agent stopped it when it could
    /// not renew the lease): requeued as a new attempt, billed to its last heartbeat, or
    /// failed once it used its requeues or its whole duration.
    ///
    /// A job being preempted ends as its preemption would: requeued, billed to its
    /// checkpoint, not counted as a node failure (the platform had chosen to stop it) —
    /// when its agent fenced it, always; when its node reached its fate or a new agent
    /// process registered the node, from rule version
    /// [`PREEMPTED_ON_A_FAILED_NODE_FROM`].
    pub(crate) fn node_failure(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        job: crate::ids::JobKey,
        reason: Reason,
    ) -> Option<crate::outcome::Settlement> {
        let preempting = self
            .jobs
            .get(&job)
            .is_some_and(|j| j.state == JobState::Preempting);
        if preempting
            && (reason == Reason::Fenced || ledger.rules.0 >= PREEMPTED_ON_A_FAILED_NODE_FROM)
        {
            self.end_grace(ctx, ledger, cfg, job);
            return None;
        }
        let retry = self.jobs.get(&job).is_some_and(|j| {
            j.node_failures < cfg.node_failure_requeues_max && j.run_ms < j.spec.max_duration_ms
        });
        if retry {
            self.requeue(ctx, ledger, cfg, job, SettleReason::NodeFailure, reason);
            None
        } else {
            self.end(
                ctx,
                ledger,
                cfg,
                job,
                Ending {
                    settle: SettleReason::NodeFailure,
                    to: JobState::Failed,
                    reason,
                },
            )
        }
    }

    /// When the fate of the silent node holding `job` is decided (its lease end plus the
    /// fence margin); `None` if the job holds no GPUs or its node's lease has not run out.
    fn node_silent_until(
        &self,
        job: crate::ids::JobKey,
        cfg: &SchedulerConfig,
        now: u64,
    ) -> Option<u64> {
        let j = self.jobs.get(&job)?;
        if !j.state.holds_gpus() {
            return None;
        }
        let n = self.nodes.get(&j.placement.as_ref()?.node)?;
        (n.state != NodeState::Down && n.lease_until_ms <= now)
            .then(|| n.lease_until_ms.saturating_add(cfg.fence_margin_ms))
    }

    /// From rule version 4: at the end of a preemption's grace (`grace_end`), whether
    /// the victim's node has been silent since the preemption began (its last lease
    /// renewal is older). From rule version 5 both instants are kept as they happened
    /// (`Fence`); before, they are rebuilt from today's `grace_ms` and `node_lease_ms`,
    /// and a setting changed in between made a silent node look renewed (a longer
    /// grace, a shorter lease). Its agent may then be cut off and never have learnt of the
    /// preemption, its runner still running, so the victim keeps its GPUs — no timer —
    /// until the node's fate: it goes down at its lease's end plus the fence margin (by
    /// which its agent has stopped every runner) and its jobs are requeued, or it renews
    /// and [`Scheduler::end_waiting_graces`] requeues the victim then.
    fn grace_waits_for_the_node(
        &self,
        job: crate::ids::JobKey,
        cfg: &SchedulerConfig,
        grace_end: u64,
        rules: u32,
    ) -> bool {
        let Some(j) = self
            .jobs
            .get(&job)
            .filter(|j| j.state == JobState::Preempting)
        else {
            return false;
        };
        let Some(n) = j.placement.as_ref().and_then(|p| self.nodes.get(&p.node)) else {
            return false;
        };
        // From version 5 both are always recorded (its activation fills them in): the
        // settings are then a fallback the invariants say is never taken.
        let kept = rules >= FENCE_INSTANTS_FROM;
        let began = (self.fence.preempted_ms.get(&job).copied().filter(|_| kept))
            .unwrap_or_else(|| grace_end.saturating_sub(cfg.grace_ms));
        let renewed = (self.fence.renewed_ms.get(&n.id).copied().filter(|_| kept))
            .unwrap_or_else(|| n.lease_until_ms.saturating_sub(cfg.node_lease_ms));
        n.state != NodeState::Down && renewed < began
    }

    /// The fence instants as rule version 5's activation finds the shard: each node's
    /// last renewal and each grace timer's start, rebuilt from the settings in force
    /// (the best that can be known of the time before version 5 recorded them).
    pub(crate) fn fill_fence(&mut self, cfg: &SchedulerConfig) {
        let mut fence = super::Fence::default();
        for (id, n) in self.nodes.sorted() {
            let renewed = n.lease_until_ms.saturating_sub(cfg.node_lease_ms);
            fence.renewed_ms.insert(*id, renewed);
        }
        for (id, j) in self.jobs.sorted() {
            if let (JobState::Preempting, Some(end)) = (j.state, j.grace_at) {
                fence
                    .preempted_ms
                    .insert(*id, end.saturating_sub(cfg.grace_ms));
            }
        }
        self.fence = fence;
    }

    /// A renewal of `node` (rule version 4): the preemptions on it whose grace ended
    /// while it was silent (`Preempting` with no grace timer) end now.
    pub(crate) fn end_waiting_graces(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        node: crate::ids::NodeId,
    ) {
        let Some(n) = self.nodes.get(&node) else {
            return;
        };
        let waiting: Vec<crate::ids::JobKey> = n
            .jobs()
            .into_iter()
            .filter(|k| {
                self.jobs
                    .get(k)
                    .is_some_and(|j| j.state == JobState::Preempting && j.grace_at.is_none())
            })
            .collect();
        for job in waiting {
            self.end_grace(ctx, ledger, cfg, job);
        }
    }

    /// A preempted job's grace is over: it is requeued, billed to its checkpoint.
    fn end_grace(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        job: crate::ids::JobKey,
    ) {
        self.requeue(
            ctx,
            ledger,
            cfg,
            job,
            SettleReason::Preempted,
            Reason::Requeued,
        );
    }

    pub(crate) fn fire_timers(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        rules: u32,
    ) {
        for _ in 0..TIMERS_PER_ENTRY_MAX {
            let Some(&(at, timer)) = self.timers.first() else {
                return;
            };
            if at > ctx.now {
                return;
            }
            self.timers.pop_first();
            match timer {
                Timer::NodeLease(node) => {
                    let Some(n) = self.nodes.get(&node) else {
                        continue;
                    };
                    if n.state == NodeState::Down {
                        continue;
                    }
                    let (until, lapsed) = (n.lease_until_ms, n.lapsed);
                    if !lapsed && until <= ctx.now {
                        // The lease ran out: no new work here; the node's agent stops its
                        // jobs by now (it fences itself), and the cluster re-places them
                        // only once the margin for the clocks' disagreement has passed.
                        self.unindex(node);
                        if let Some(n) = self.nodes.get_mut(&node) {
                            n.lapsed = true;
                        }
                        let at = until.saturating_add(cfg.fence_margin_ms);
                        self.timers.insert((at, Timer::NodeLease(node)));
                    } else if lapsed && until.saturating_add(cfg.fence_margin_ms) <= ctx.now {
                        for job in self.nodes.get(&node).map(|n| n.jobs()).unwrap_or_default() {
                            self.node_failure(ctx, ledger, cfg, job, Reason::NodeDown);
                        }
                        self.set_node_state(node, NodeState::Down, ctx.effects);
                    }
                }
                Timer::JobLease(job) | Timer::Deadline(job) => {
                    // A job whose node is silent too waits for the node's fate: once
                    // down, it is requeued as a platform fault, billed to its last
                    // heartbeat (after a whole-cluster outage logical time resumes at the
                    // real instant and every lease and deadline is due at once — the jobs
                    // that agents stopped for want of a lease are neither Lost nor billed
                    // to now); if the node comes back, the timer fires then.
                    if let Some(decided) = self.node_silent_until(job, cfg, ctx.now) {
                        let kind = match timer {
                            Timer::JobLease(_) => Timer::JobLease,
                            _ => Timer::Deadline,
                        };
                        self.set_timer(job, kind, Some(decided.max(ctx.now).saturating_add(1)));
                        continue;
                    }
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    let ending = if let Timer::JobLease(_) = timer {
                        // No heartbeat in time (e.g. the finish call was lost).
                        j.lease_at = None;
                        Ending {
                            settle: SettleReason::Lost,
                            to: JobState::Lost,
                            reason: Reason::LeaseExpired,
                        }
                    } else {
                        // The job used its whole max duration: billed to now, stopped.
                        j.deadline_at = None;
                        Ending {
                            settle: SettleReason::Failed,
                            to: JobState::Failed,
                            reason: Reason::MaxDuration,
                        }
                    };
                    if j.state.holds_gpus() {
                        self.end(ctx, ledger, cfg, job, ending);
                    }
                }
                Timer::Grace(job) => {
                    let waits = rules >= GRACE_WAITS_FOR_THE_NODE_FROM
                        && self.grace_waits_for_the_node(job, cfg, at, rules);
                    self.fence.preempted_ms.remove(&job);
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    j.grace_at = None;
                    if waits {
                        continue;
                    }
                    if j.state == JobState::Preempting {
                        self.end_grace(ctx, ledger, cfg, job);
                    }
                }
            }
        }
    }
}
