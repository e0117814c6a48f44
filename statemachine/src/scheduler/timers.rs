//! Time-driven transitions, run first in every entry on logical time: node leases
//! (a node that misses its lease is down; its jobs go back to the queue, billed to their
//! last checkpoint, up to `node_failure_requeues_max` times, then fail as platform
//! faults), job leases (no heartbeat in time: Lost), preemption grace, and max duration.

use super::{Ending, JobState, NodeState, Reason, Scheduler, SchedulerConfig, Timer};
use crate::command::SettleReason;
use crate::ledger::{Ctx, Ledger};
use crate::limits::TIMERS_PER_ENTRY_MAX;

impl Scheduler {
    pub(crate) fn fire_timers(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
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
                    let down = self
                        .nodes
                        .get(&node)
                        .is_some_and(|n| n.state != NodeState::Down && n.lease_until_ms <= ctx.now);
                    if down {
                        for job in self.nodes.get(&node).map(|n| n.jobs()).unwrap_or_default() {
                            let retry = self.jobs.get(&job).is_some_and(|j| {
                                j.node_failures < cfg.node_failure_requeues_max
                                    && j.run_ms < j.spec.max_duration_ms
                            });
                            if retry {
                                self.requeue(
                                    ctx,
                                    ledger,
                                    cfg,
                                    job,
                                    SettleReason::NodeFailure,
                                    Reason::NodeDown,
                                );
                            } else {
                                self.end(
                                    ctx,
                                    ledger,
                                    cfg,
                                    job,
                                    Ending {
                                        settle: SettleReason::NodeFailure,
                                        to: JobState::Failed,
                                        reason: Reason::NodeDown,
                                    },
                                );
                            }
                        }
                        self.set_node_state(node, NodeState::Down, ctx.effects);
                    }
                }
                Timer::JobLease(job) | Timer::Deadline(job) => {
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
                    let Some(j) = self.jobs.get_mut(&job) else {
                        continue;
                    };
                    j.grace_at = None;
                    if j.state == JobState::Preempting {
                        self.requeue(
                            ctx,
                            ledger,
                            cfg,
                            job,
                            SettleReason::Preempted,
                            Reason::Requeued,
                        );
                    }
                }
            }
        }
    }
}
