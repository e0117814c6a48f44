//! Job lifecycle: submission (validate, quota, price, reserve, enqueue — all or
//! nothing), placement, heartbeats, finish, cancel, requeue after preemption, and every
//! ending settled through the ledger.

use super::{Ending, Job, JobState, Placement, Reason, Scheduler, SchedulerConfig, Timer};
use crate::audit::{EventBody, PendingEvent};
use crate::command::{Heartbeat, HoldSpec, JobHeartbeat, JobSpec, RunnerExit, SettleReason};
use crate::ids::{Account, Actor, HoldId, JobKey, NodeId, OrgId};
use crate::ledger::{cost_micro, tier_price, Ctx, Ledger, MeterStart};
use crate::limits::*;
use crate::outcome::{CommandError, Limit, QuotaKind, Reply, Settlement};

/// What a job spec needs from the shard's configuration (the spec's own fields are
/// checked by `crate::validate`).
fn check_spec(spec: &JobSpec, cfg: &SchedulerConfig) -> Result<(), CommandError> {
    if spec.tier.0 as usize >= cfg.tiers.len() {
        return Err(CommandError::UnknownTier);
    }
    Ok(())
}

/// A job's hold: the same id, in the same org.
pub(crate) fn hold_of(id: JobKey) -> HoldId {
    HoldId(id.1 .0)
}

/// The rule version from which a job that ends while its node's lease has run out (a
/// cancel, its deadline, a late finish) is billed no later than the lease's end
/// (`Scheduler::end`).
pub const ENDINGS_ON_A_LAPSED_NODE_BILL_TO_THE_LEASE_FROM: u32 = 4;

/// The rule version from which an agent's report on a job not placed on its node is
/// answered `UnknownJob` whatever became of the job (`Scheduler::job_for`).
pub const AGENTS_SEE_ONLY_THEIR_JOBS_FROM: u32 = 4;

/// The rule version that introduced `Command::FinishJobAt`: a finish that says when
/// the runner exited bills no later than that instant (`Scheduler::exit_instant`).
pub const RUNNER_EXIT_BILLS_FROM: u32 = 6;

impl Scheduler {
    /// Jobs not yet finished (queued, placed, running, preempting): what
    /// `JOBS_ACTIVE_MAX` bounds. Every finished job is still in `jobs` until pruned.
    pub fn active_jobs(&self) -> usize {
        self.jobs.len() - self.finished.len()
    }

    pub(crate) fn job_event(
        &self,
        effects: &mut Vec<PendingEvent>,
        id: JobKey,
        from: Option<JobState>,
        reason: Reason,
    ) {
        let Some(j) = self.jobs.get(&id) else { return };
        effects.push(PendingEvent {
            org: Some(j.org),
            account: Some(Account::Project(j.spec.project)),
            hold: Some(hold_of(id)),
            body: EventBody::JobTransition {
                job: id.1,
                from,
                to: j.state,
                attempt: j.attempt,
                node: j.placement.as_ref().map(|p| p.node),
                reason,
            },
        });
    }

    pub(super) fn transition(&mut self, ctx: &mut Ctx, id: JobKey, to: JobState, reason: Reason) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let from = j.state;
        j.state = to;
        j.last_reason = reason;
        if from == JobState::Preempting && to != JobState::Preempting {
            self.fence.preempted_ms.remove(&id);
        }
        if to.is_final() {
            j.finished_ms = Some(ctx.now);
            self.finished.push(ctx.now, id.0, id.1);
        }
        self.job_event(ctx.effects, id, Some(from), reason);
    }

    pub(crate) fn set_timer(&mut self, id: JobKey, kind: fn(JobKey) -> Timer, at: Option<u64>) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let slot = match kind(id) {
            Timer::JobLease(_) => &mut j.lease_at,
            Timer::Grace(_) => &mut j.grace_at,
            Timer::Deadline(_) => &mut j.deadline_at,
            Timer::NodeLease(_) => return,
        };
        if let Some(old) = slot.take() {
            self.timers.remove(&(old, kind(id)));
        }
        if let Some(at) = at {
            *slot = Some(at);
            self.timers.insert((at, kind(id)));
        }
    }

    fn clear_timers(&mut self, id: JobKey) {
        self.set_timer(id, Timer::JobLease, None);
        self.set_timer(id, Timer::Grace, None);
        self.set_timer(id, Timer::Deadline, None);
    }

    pub(crate) fn enqueue(&mut self, id: JobKey) {
        let Some(j) = self.jobs.get(&id) else { return };
        let (s, key) = (&j.spec, (j.queued_since_ms, id));
        self.queue
            .entry(s.tier)
            .or_default()
            .entry(j.org)
            .or_default()
            .entry(s.project)
            .or_default()
            .entry(s.user)
            .or_default()
            .insert(key);
        self.by_age.entry(s.tier).or_default().insert(key);
        self.org_counts.entry(j.org).or_default().0 += 1;
        self.queue_joins.0 = self.queue_joins.0.wrapping_add(1);
    }

    pub(crate) fn dequeue(&mut self, id: JobKey) {
        let Some(j) = self.jobs.get(&id) else { return };
        let (s, key, org) = (&j.spec, (j.queued_since_ms, id), j.org);
        if let Some(orgs) = self.queue.get_mut(&s.tier) {
            if let Some(projects) = orgs.get_mut(&org) {
                if let Some(users) = projects.get_mut(&s.project) {
                    if let Some(q) = users.get_mut(&s.user) {
                        q.remove(&key);
                        if q.is_empty() {
                            users.remove(&s.user);
                        }
                    }
                    if users.is_empty() {
                        projects.remove(&s.project);
                    }
                }
                if projects.is_empty() {
                    orgs.remove(&org);
                }
            }
            if orgs.is_empty() {
                self.queue.remove(&s.tier);
            }
        }
        if let Some(q) = self.by_age.get_mut(&s.tier) {
            q.remove(&key);
            if q.is_empty() {
                self.by_age.remove(&s.tier);
            }
        }
        if let Some(c) = self.org_counts.get_mut(&org) {
            c.0 -= 1;
        }
    }

    /// Running-GPU counters of a job's tier, org, project and user, by `delta` GPUs.
    fn count_running(&mut self, id: JobKey, add: bool) {
        let Some(j) = self.jobs.get(&id) else { return };
        let (g, s, org) = (j.spec.gpus, j.spec.clone(), j.org);
        let apply = |v: &mut u32| *v = if add { *v + g } else { v.saturating_sub(g) };
        apply(self.tier_gpus.entry(s.tier).or_default());
        apply(self.running_org.entry(org).or_default());
        apply(self.running_project.entry((org, s.project)).or_default());
        apply(self.running_user.entry((org, s.user)).or_default());
        if add {
            self.used_gpus += g;
            self.org_counts.entry(org).or_default().1 += 1;
        } else {
            self.used_gpus -= g;
            if let Some(c) = self.org_counts.get_mut(&org) {
                c.1 -= 1;
            }
        }
    }

    /// Frees the job's GPUs and charges their use to fair share.
    fn release_gpus(&mut self, now: u64, cfg: &SchedulerConfig, id: JobKey) {
        let Some(j) = self.jobs.get(&id) else { return };
        let Some(p) = j.placement.clone() else { return };
        let (gpus, org, project, user) = (j.spec.gpus, j.org, j.spec.project, j.spec.user);
        self.unindex(p.node);
        if let Some(n) = self.nodes.get_mut(&p.node) {
            for slot in n.slots.iter_mut() {
                if *slot == Some(id) {
                    *slot = None;
                }
            }
        }
        self.index(p.node);
        self.count_running(id, false);
        let gpu_ms = gpus as u64 * now.saturating_sub(p.started_ms);
        let h = cfg.usage_half_life_ms;
        self.usage_org.entry(org).or_default().add(now, h, gpu_ms);
        self.usage_project
            .entry((org, project))
            .or_default()
            .add(now, h, gpu_ms);
        self.usage_user
            .entry((org, user))
            .or_default()
            .add(now, h, gpu_ms);
    }

    pub(crate) fn submit(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        org: OrgId,
        spec: &JobSpec,
    ) -> Result<Reply, CommandError> {
        self.admit(ctx, ledger, cfg, org, spec, true)
    }

    /// [`Scheduler::submit`], which reserves the job's hold (`reserve`), or the same
    /// admission without a hold, for a job that ends in the same command without
    /// running (a keyed submission that takes a retained result, `dedup.rs`): every check
    /// is the same but the reservation's own (credit, budget, open holds), and the job's
    /// hold id must still be free, as it names the job's hold.
    pub(crate) fn admit(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        org: OrgId,
        spec: &JobSpec,
        reserve: bool,
    ) -> Result<Reply, CommandError> {
        check_spec(spec, cfg)?;
        let key = (org, spec.job);
        if let Some(j) = self.jobs.get(&key) {
            if &j.spec == spec {
                return Ok(Reply::JobSubmitted {
                    job: spec.job,
                    hold_micro: j.hold_micro,
                    state: j.state,
                });
            }
            return Err(CommandError::AlreadyExists);
        }
        // The project and the user are the org's own (its namespace).
        if !ledger.projects.contains_key(&(org, spec.project)) {
            return Err(CommandError::UnknownProject);
        }
        if !ledger.users.contains_key(&(org, spec.user)) {
            return Err(CommandError::UnknownUser);
        }
        if !self.entitled(cfg, org, spec.project, spec.tier) {
            return Err(CommandError::TierNotEntitled(spec.tier));
        }
        if let Some(t) = spec
            .gpu_types
            .iter()
            .find(|t| !self.knows_type(t) && ledger.price_of(t).is_none())
        {
            return Err(CommandError::UnknownGpuType(t.clone()));
        }
        if !self.satisfiable(&spec.gpu_types, spec.gpus, spec.mem_floor_gb) {
            return Err(CommandError::Unsatisfiable);
        }
        let mut price_max = 0;
        for t in &spec.gpu_types {
            price_max = price_max.max(
                ledger
                    .price_of(t)
                    .ok_or(CommandError::UnknownPrice(t.clone()))?,
            );
        }
        // The hold covers the whole run at the tier's price of the dearest type.
        let price_max = tier_price(price_max, cfg.price_pct(spec.tier));
        let quota = self.quota(cfg, org);
        // Jobs attached to another's result wait like queued ones (`dedup.rs`).
        let waiting = self.org_counts.get(&org).map_or(0, |c| c.0) + self.dedup.attached_of(org);
        if waiting >= quota.queued_max {
            return Err(CommandError::QuotaExceeded(QuotaKind::QueuedJobs));
        }
        if self.active_jobs() >= JOBS_ACTIVE_MAX {
            return Err(CommandError::LimitReached(Limit::JobsActive));
        }
        let hold_micro = cost_micro(spec.max_duration_ms, price_max, spec.gpus).max(1);
        crate::ledger::check_amount(hold_micro)?;
        let hold = HoldSpec {
            hold: HoldId(spec.job.0),
            project: spec.project,
            user: spec.user,
            tier: spec.tier,
            gpu_types: spec.gpu_types.clone(),
            amount_micro: hold_micro,
        };
        let hold_micro = if reserve {
            ledger.create_hold(ctx, org, &quota, &hold)?;
            ledger.mark_job_hold(org, hold.hold);
            hold_micro
        } else if ledger.hold(org, hold.hold).is_some() {
            return Err(CommandError::AlreadyExists);
        } else {
            0
        };
        self.jobs.insert(
            key,
            Job {
                spec: spec.clone(),
                org,
                state: JobState::Queued,
                attempt: 0,
                submitted_ms: ctx.now,
                queued_since_ms: ctx.now,
                placement: None,
                run_ms: 0,
                preemptions: 0,
                hold_micro,
                last_reason: Reason::Submitted,
                finished_ms: None,
                lease_at: None,
                deadline_at: None,
                grace_at: None,
                reserved_node: None,
                waits_ms: Vec::new(),
                node_failures: 0,
                preempted_for: None,
            },
        );
        self.org_jobs.insert(key);
        self.scoped_jobs.insert(key, spec);
        self.enqueue(key);
        self.job_event(ctx.effects, key, None, Reason::Submitted);
        Ok(Reply::JobSubmitted {
            job: spec.job,
            hold_micro,
            state: JobState::Queued,
        })
    }

    /// The job, if `actor` may act on it (an agent only on jobs placed on its node). A
    /// late report gets the answer for what became of the job: `JobFinished` once it
    /// ended, `StaleAttempt` once the attempt the agent ran was requeued or moved.
    ///
    /// From rule version [`AGENTS_SEE_ONLY_THEIR_JOBS_FROM`] an agent learns nothing of a
    /// job not placed on its node: every such report is `UnknownJob`, as for an id no
    /// job has. (Before it, a finished job answered `JobFinished`, a queued one
    /// `JobNotPlaced` and a requeued one `StaleAttempt` with its attempt count, to any
    /// agent, for any org's job: a GPU node could list every org's jobs and their
    /// states. The agent stops its runner on each of these answers alike.)
    fn job_for(&self, actor: Actor, id: JobKey, rules: u32) -> Result<&Job, CommandError> {
        self.job_for_attempt(actor, id, None, rules)
    }

    fn job_for_attempt(
        &self,
        actor: Actor,
        id: JobKey,
        attempt: Option<u32>,
        rules: u32,
    ) -> Result<&Job, CommandError> {
        let j = self.jobs.get(&id).ok_or(CommandError::UnknownJob)?;
        if let Actor::Agent(node) = actor {
            let placed = j.placement.as_ref().map(|p| p.node);
            if rules >= AGENTS_SEE_ONLY_THEIR_JOBS_FROM && placed != Some(node) {
                return Err(CommandError::UnknownJob);
            }
        }
        if j.state.is_final() {
            return Err(CommandError::JobFinished);
        }
        if let Actor::Agent(node) = actor {
            let placed = j.placement.as_ref().map(|p| p.node);
            if placed != Some(node) {
                // An older attempt (one this node may have run) is stale; the current
                // one, requeued and waiting, is not placed; any other report is about a
                // job this node has nothing to do with.
                return Err(match attempt {
                    Some(given) if given >= 1 && given < j.attempt => CommandError::StaleAttempt {
                        given,
                        current: j.attempt,
                    },
                    Some(given) if given == j.attempt && placed.is_none() => {
                        CommandError::JobNotPlaced
                    }
                    _ => CommandError::UnknownJob,
                });
            }
        }
        Ok(j)
    }

    fn check_attempt(j: &Job, attempt: u32) -> Result<(), CommandError> {
        if !j.state.holds_gpus() {
            return Err(CommandError::JobNotPlaced);
        }
        if attempt != j.attempt {
            return Err(CommandError::StaleAttempt {
                given: attempt,
                current: j.attempt,
            });
        }
        Ok(())
    }

    /// Places a queued job on `node`'s GPUs `indices`: new attempt (fencing token), the
    /// price of the placed type fixed on the meter, leases and deadline armed.
    pub(crate) fn place(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        node: NodeId,
        indices: Vec<u8>,
    ) -> Result<(), CommandError> {
        let (j, n) = (
            self.jobs.get(&id).ok_or(CommandError::UnknownJob)?,
            self.nodes.get(&node).ok_or(CommandError::UnknownNode)?,
        );
        let (attempt, gpu_type, gpus) = (j.attempt + 1, n.gpu_type.clone(), j.spec.gpus);
        let start = MeterStart {
            attempt,
            gpu_type: &gpu_type,
            gpus,
        };
        let (price, _) =
            ledger.start_meter(id.0, hold_of(id), start, ctx.now, |t| cfg.price_pct(t))?;
        self.dequeue(id);
        // The job may run elsewhere than the node it had reserved: release that node
        // (clearing only the placement node left stale reservations that blocked every
        // later reservation and preemption on their nodes).
        self.clear_reservation(id);
        self.unindex(node);
        if let Some(n) = self.nodes.get_mut(&node) {
            for &i in &indices {
                n.slots[i as usize] = Some(id);
            }
        }
        self.index(node);
        let Some(j) = self.jobs.get_mut(&id) else {
            return Ok(());
        };
        j.waits_ms.push(ctx.now - j.queued_since_ms);
        j.attempt = attempt;
        j.reserved_node = None;
        j.placement = Some(Placement {
            node,
            gpu_indices: indices,
            gpu_type,
            price_micro_per_gpu_hour: price,
            started_ms: ctx.now,
        });
        let remaining_ms = j.spec.max_duration_ms.saturating_sub(j.run_ms).max(1);
        self.count_running(id, true);
        self.set_timer(id, Timer::JobLease, Some(ctx.now + cfg.job_lease_ms));
        self.set_timer(id, Timer::Deadline, Some(ctx.now + remaining_ms));
        self.transition(ctx, id, JobState::Placed, Reason::Placed);
        Ok(())
    }

    /// Before a job's first placement, from rule version
    /// [`crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM`]: the credit its hold
    /// still holds from buckets that expired while it waited is forfeited and reserved
    /// again from spendable credit (`Books::renew_expired_draws`). Held credit stays
    /// valid past its bucket's expiry for a job that runs, not for one that waits. A job
    /// whose credit cannot be reserved again ends `Failed` (`OutOfCredits`) without
    /// running. `false`: the job ended (it has left the queue).
    pub(super) fn renew_unplaced_hold(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
    ) -> bool {
        if ledger.rules.0 < crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM
            || self.jobs.get(&id).is_none_or(|j| j.attempt > 0)
        {
            return true;
        }
        let Some(hc) = ledger.open_hold_ctx(id.0, hold_of(id)) else {
            return true;
        };
        if hc.books.renew_expired_draws(ctx, hc.hold).is_ok() {
            return true;
        }
        self.end(ctx, ledger, cfg, id, Ending::OUT_OF_CREDITS);
        false
    }

    /// Ends a job that holds GPUs (or is queued) for good: settles its hold through the
    /// ledger (billing per `settle`), frees its GPUs, records the final state.
    pub(crate) fn end(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        ending: Ending,
    ) -> Option<Settlement> {
        self.end_by(ctx, ledger, cfg, id, ending, None)
    }

    /// [`Scheduler::end`], an ending that bills to now billing no later than `exited`
    /// either (when the runner exited, by its agent's report).
    fn end_by(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        ending: Ending,
        exited: Option<u64>,
    ) -> Option<Settlement> {
        let Ending { settle, to, reason } = ending;
        let j = self.jobs.get(&id)?;
        let (state, attempt) = (j.state, j.attempt);
        if state == JobState::Placed {
            // An attempt whose runner never started (from rule version 4) bills nothing.
            ledger.meter_from_now_if_unstarted(id.0, hold_of(id), ctx.now);
        }
        // From rule version 4, an ending on a node whose lease has run out bills no later
        // than the lease's end: its agent has stopped the runner by then (the fence).
        let lease_end = (ledger.rules.0 >= ENDINGS_ON_A_LAPSED_NODE_BILL_TO_THE_LEASE_FROM)
            .then(|| j.placement.as_ref().and_then(|p| self.nodes.get(&p.node)))
            .flatten()
            .map(|n| n.lease_until_ms)
            .filter(|until| *until < ctx.now);
        let bill_until = lease_end.into_iter().chain(exited).min();
        let settlement = ledger
            .settle_until(ctx, id.0, hold_of(id), attempt, settle, bill_until)
            .ok();
        if state == JobState::Queued {
            self.dequeue(id);
        }
        if state.holds_gpus() {
            self.release_gpus(ctx.now, cfg, id);
        }
        self.clear_reservation(id);
        self.clear_timers(id);
        self.transition(ctx, id, to, reason);
        // Where it ran stays in the audit trail; a finished job holds no placement.
        if let Some(j) = self.jobs.get_mut(&id) {
            j.placement = None;
        }
        // Jobs attached to its result succeed with it, or one of them runs instead.
        self.dedup_ended(ctx, ledger, cfg, id, to);
        // The org's tombstones stay within its quota (its own oldest leave first).
        let quota = self.quota(cfg, id.0);
        ledger.trim_settled(id.0, quota.settled_holds_max);
        while let Some(old) = self.finished.pop_over_quota(id.0, quota.finished_jobs_max) {
            self.forget_job(old);
        }
        settlement
    }

    pub(crate) fn clear_reservation(&mut self, id: JobKey) {
        let Some(node) = self.jobs.get_mut(&id).and_then(|j| j.reserved_node.take()) else {
            return;
        };
        if let Some(n) = self.nodes.get_mut(&node) {
            if n.reserved_for == Some(id) {
                n.reserved_for = None;
            }
        }
    }

    /// A job whose attempt ended for a platform reason goes back to the queue: a
    /// preempted job after its grace period or its agent's hand-back (`Preempted`), or a
    /// job whose node missed its lease (`NodeFailure`). Its attempt is billed only to its
    /// last checkpoint (the rest returns to its hold, which stays reserved for the next
    /// run); the next placement is a new attempt, so reports of the old one are fenced.
    pub(crate) fn requeue(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        why: SettleReason,
        reason: Reason,
    ) {
        let Some(j) = self.jobs.get(&id) else { return };
        let attempt = j.attempt;
        let billed_ms = ledger
            .hold(id.0, hold_of(id))
            .and_then(|h| h.meter.as_ref())
            .map_or(0, |m| m.billable_ms(why, ctx.now));
        let rules = ledger.rules.0;
        if let Some(hc) = ledger.open_hold_ctx(id.0, hold_of(id)) {
            if let Ok((_, before_today)) = hc.books.end_attempt(ctx, hc.hold, attempt, why, None) {
                // From rule version 4, captures reversed from an earlier day go back to
                // their buckets: a next attempt spends today only what today's budget
                // checks let it draw.
                if rules >= crate::ledger::PAST_DAY_REVERSALS_RETURN_FROM && before_today > 0 {
                    hc.books.release_part(ctx, hc.hold, before_today);
                }
            }
        }
        self.release_gpus(ctx.now, cfg, id);
        self.set_timer(id, Timer::JobLease, None);
        self.set_timer(id, Timer::Grace, None);
        self.set_timer(id, Timer::Deadline, None);
        if let Some(j) = self.jobs.get_mut(&id) {
            j.run_ms += billed_ms;
            j.queued_since_ms = ctx.now;
            j.placement = None;
            if why == SettleReason::NodeFailure {
                j.node_failures += 1;
            }
        }
        self.enqueue(id);
        self.transition(ctx, id, JobState::Queued, reason);
    }

    pub(crate) fn cancel(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        actor: Actor,
        id: JobKey,
    ) -> Result<Reply, CommandError> {
        self.job_for(actor, id, ledger.rules.0)?;
        let s = self.end(
            ctx,
            ledger,
            cfg,
            id,
            Ending {
                settle: SettleReason::Cancelled,
                to: JobState::Cancelled,
                reason: Reason::Cancelled,
            },
        );
        Ok(Reply::JobCancelled(s))
    }

    pub(crate) fn heartbeat(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        actor: Actor,
        org: OrgId,
        hb: &JobHeartbeat,
    ) -> Result<Reply, CommandError> {
        let id = (org, hb.job);
        let j = self.job_for_attempt(actor, id, Some(hb.attempt), ledger.rules.0)?;
        Self::check_attempt(j, hb.attempt)?;
        let state = j.state;
        if state == JobState::Placed {
            // The runner has started: from rule version 4, its bill starts here.
            ledger.meter_from_now_if_unstarted(org, hold_of(id), ctx.now);
        }
        let reply = ledger.heartbeat(
            ctx,
            org,
            &Heartbeat {
                hold: hold_of(id),
                attempt: hb.attempt,
                seq: hb.seq,
                progress_ppm: hb.progress_ppm,
                checkpoint: hb.checkpoint,
            },
        )?;
        if reply.accepted {
            self.set_timer(id, Timer::JobLease, Some(ctx.now + cfg.job_lease_ms));
            if state == JobState::Placed {
                self.transition(ctx, id, JobState::Running, Reason::Started);
            }
        }
        if reply.stop.is_some() {
            // The ledger settled the hold: the job stops, even if non-preemptible.
            self.end(ctx, ledger, cfg, id, Ending::OUT_OF_CREDITS);
        }
        Ok(Reply::JobHeartbeat(reply))
    }

    /// The agent's report `(job, attempt, success)`, and when the runner exited if it
    /// says (`Command::FinishJobAt`).
    pub(crate) fn finish(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        actor: Actor,
        (id, attempt, success): (JobKey, u32, bool),
        exit: Option<RunnerExit>,
    ) -> Result<Reply, CommandError> {
        let j = self.job_for_attempt(actor, id, Some(attempt), ledger.rules.0)?;
        Self::check_attempt(j, attempt)?;
        let exited = exit.and_then(|e| Self::exit_instant(ledger, id, attempt, e));
        if j.state == JobState::Preempting && !success {
            // The agent stopped the job for preemption (after checkpointing).
            self.requeue(
                ctx,
                ledger,
                cfg,
                id,
                SettleReason::Preempted,
                Reason::Requeued,
            );
            return Ok(Reply::JobFinished(None));
        }
        let (settle, to, reason) = if success {
            (
                SettleReason::Succeeded,
                JobState::Succeeded,
                Reason::Succeeded,
            )
        } else {
            (SettleReason::Failed, JobState::Failed, Reason::Failed)
        };
        Ok(Reply::JobFinished(self.end_by(
            ctx,
            ledger,
            cfg,
            id,
            Ending { settle, to, reason },
            exited,
        )))
    }

    /// The logical instant by which a runner had exited, from its agent's report: the
    /// time the attempt's meter recorded for its newest accepted heartbeat plus
    /// `exit.after_ms`, when that heartbeat is the one the report counts from or a later
    /// one (the agent may not have seen a later heartbeat's answer). The cluster applies
    /// a heartbeat after its agent sent it, so the instant is never before the real
    /// exit: a report can shorten a bill to the runner's life, never below it. `None`
    /// (bill to now, as `FinishJob`) before rule version [`RUNNER_EXIT_BILLS_FROM`], for
    /// a meter that has seen no heartbeat of the attempt, or for a report counting from
    /// a heartbeat the meter has not seen.
    fn exit_instant(ledger: &Ledger, id: JobKey, attempt: u32, exit: RunnerExit) -> Option<u64> {
        if ledger.rules.0 < RUNNER_EXIT_BILLS_FROM {
            return None;
        }
        let m = ledger.hold(id.0, hold_of(id))?.meter.as_ref()?;
        (m.attempt == attempt && !m.closed && m.last_seq > 0 && m.last_seq >= exit.heartbeat_seq)
            .then(|| m.last_heartbeat_ms.saturating_add(exit.after_ms))
    }

    /// The agent stopped the attempt itself (it could not renew its lease): a job being
    /// preempted counts as stopped for the preemption; any other is requeued as a node
    /// failure, billed to its last heartbeat (`node_failure`).
    pub(crate) fn fenced(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        actor: Actor,
        (id, attempt): (JobKey, u32),
    ) -> Result<Reply, CommandError> {
        let j = self.job_for_attempt(actor, id, Some(attempt), ledger.rules.0)?;
        Self::check_attempt(j, attempt)?;
        Ok(Reply::JobFinished(self.node_failure(
            ctx,
            ledger,
            cfg,
            id,
            Reason::Fenced,
        )))
    }

    pub(crate) fn set_quota(
        &mut self,
        ledger: &Ledger,
        org: crate::ids::OrgId,
        quota: Option<crate::command::Quota>,
    ) -> Result<Reply, CommandError> {
        if !ledger.orgs.contains_key(&org) {
            return Err(CommandError::UnknownOrg);
        }
        match quota {
            Some(q) => self.quotas.insert(org, q),
            None => self.quotas.remove(&org),
        };
        Ok(Reply::QuotaSet)
    }

    /// Sets or removes `org`'s plan. Its tiers must exist and its projects be the org's;
    /// jobs already submitted keep their tier (the plan governs new submissions).
    pub(crate) fn set_plan(
        &mut self,
        ledger: &Ledger,
        cfg: &SchedulerConfig,
        org: OrgId,
        plan: Option<&crate::command::Plan>,
    ) -> Result<Reply, CommandError> {
        let rec = ledger.orgs.get(&org).ok_or(CommandError::UnknownOrg)?;
        let Some(plan) = plan else {
            self.plans.remove(&org);
            return Ok(Reply::PlanSet);
        };
        // Duplicates, sizes and project tiers within the org's: `crate::validate`.
        if plan.tiers.iter().any(|t| t.0 as usize >= cfg.tiers.len()) {
            return Err(CommandError::UnknownTier);
        }
        if plan
            .project_tiers
            .iter()
            .any(|(p, _)| !rec.projects.contains(p))
        {
            return Err(CommandError::UnknownProject);
        }
        self.plans.insert(org, plan.clone());
        Ok(Reply::PlanSet)
    }

    pub(crate) fn set_share_weight(
        &mut self,
        ledger: &Ledger,
        org: OrgId,
        scope: crate::command::BudgetScope,
        weight: Option<u32>,
    ) -> Result<Reply, CommandError> {
        use crate::command::BudgetScope;
        crate::authz::scope_exists(ledger, org, scope)?;
        fn set<K: Ord>(map: &mut std::collections::BTreeMap<K, u32>, k: K, w: Option<u32>) {
            match w {
                Some(w) if w != SHARE_WEIGHT_DEFAULT => map.insert(k, w),
                _ => map.remove(&k),
            };
        }
        match scope {
            BudgetScope::Org(o) => set(&mut self.weight_org, o, weight),
            BudgetScope::Project(p) => set(&mut self.weight_project, (org, p), weight),
            BudgetScope::User(u) => set(&mut self.weight_user, (org, u), weight),
        }
        Ok(Reply::ShareWeightSet)
    }

    /// Drops finished jobs after the retention window (bounded per entry), and the
    /// oldest early if the shard keeps more than `JOBS_FINISHED_MAX`.
    pub(crate) fn prune_finished(&mut self, now: u64, retention_ms: u64) {
        for _ in 0..PRUNE_PER_ENTRY_MAX {
            let Some(id) = self.finished.pop_due(now, retention_ms, JOBS_FINISHED_MAX) else {
                return;
            };
            self.forget_job(id);
        }
    }

    fn forget_job(&mut self, id: JobKey) {
        if let Some(j) = self.jobs.remove(&id) {
            self.scoped_jobs.remove(id, &j.spec);
        }
        self.org_jobs.remove(&id);
        self.dedup_forget(id);
    }
}
