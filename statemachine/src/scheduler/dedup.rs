//! Result dedup (rule version 3; docs/DESIGN.md §53): a job submitted with a dedup key
//! (`Command::SubmitJobDedup`: e.g. a hash of a prompt and its parameters) does not run
//! the same work twice within its org.
//!
//! - **In flight**: a job of the org with the same key is queued, placed, running or
//!   preempting. The new job is created `Attached` to it: its own hold is reserved as for
//!   any job (so it can run if the other fails), it is not queued and does not run.
//!   When the other succeeds, each job attached to it succeeds too (reason
//!   `Deduplicated`) and its hold returns in full: **nothing is charged**, the job that
//!   ran paid for the run. When the other ends any other way (failed, cancelled, lost),
//!   the oldest attached job is queued to run itself (reason `DedupReleased`) and the
//!   others attach to it.
//! - **Succeeded and still retained** (`job_retention_ms`, or until the org's finished-jobs
//!   quota drops it): the new job succeeds at once, charging nothing. From rule version
//!   [`RETAINED_RESULTS_RESERVE_NOTHING_FROM`] it reserves nothing either, so credit and
//!   budgets cannot refuse it; before, it reserved its hold and released it in full.
//! - **Otherwise** (no such job, or it ended without success): the job runs like any
//!   other, and later submissions with the key attach to it.
//!
//! Scope: the org. Keys are looked up in the submitting org's namespace only, so two
//! orgs' equal keys never meet (a result is never shared across orgs, and nothing tells
//! one org that another used a key). Bounds: a key is 1 to `DEDUP_KEY_BYTES_MAX` bytes
//! (`validate`); every keyed job is a job of the org's tables, and attached jobs count
//! against the org's queued-jobs quota like queued ones.

use super::{Ending, JobState, Reason, Scheduler, SchedulerConfig};
use crate::command::{JobSpec, SettleReason};
use crate::ids::{DedupKey, JobId, JobKey, OrgId};
use crate::ledger::{Ctx, Ledger};
use crate::outcome::{CommandError, Reply};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// From this rule version a keyed submission that takes a retained result reserves
/// nothing: it cannot be refused for credit, budget or open holds, and no hold is
/// created and released for it (nor a soft budget's alert raised on money never spent).
/// Before it, it went through `submit`'s reservation and released it in the same
/// command.
pub const RETAINED_RESULTS_RESERVE_NOTHING_FROM: u32 = 4;

/// The dedup tables of a shard. Ordered maps: keys are chosen by callers, and lookups
/// are O(log n) whatever they choose.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dedup {
    /// (org, key) → the job that runs the key's work (in flight) or ran it (succeeded,
    /// still retained).
    pub by_key: BTreeMap<(OrgId, DedupKey), JobId>,
    /// The key of every job submitted with one, while the job is retained.
    pub key_of: BTreeMap<JobKey, DedupKey>,
    /// Job → the job whose result it took or waits for.
    pub attached_to: BTreeMap<JobKey, JobId>,
    /// In-flight job → the jobs attached to it, oldest first.
    pub waiting: BTreeMap<JobKey, Vec<JobId>>,
    /// Jobs attached and waiting, per org (they count against its queued-jobs quota).
    pub attached_by_org: BTreeMap<OrgId, u32>,
}

impl Dedup {
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty() && self.key_of.is_empty() && self.attached_to.is_empty()
    }

    /// Jobs of `org` attached and waiting.
    pub fn attached_of(&self, org: OrgId) -> u32 {
        self.attached_by_org.get(&org).copied().unwrap_or(0)
    }

    /// The job whose result `id` took or waits for.
    pub fn result_of(&self, id: JobKey) -> Option<JobId> {
        self.attached_to.get(&id).copied()
    }

    fn count_attached(&mut self, org: OrgId, add: bool) {
        let n = self.attached_by_org.entry(org).or_default();
        if add {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.attached_by_org.remove(&org);
            }
        }
    }
}

/// What a key finds in its org at submission.
enum Found {
    /// Nothing to attach to: the job runs and owns the key.
    Run,
    InFlight(JobId),
    Succeeded(JobId),
}

impl Scheduler {
    /// `SubmitJobDedup` (see the module docs). All or nothing, like `submit`.
    pub(crate) fn submit_dedup(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        org: OrgId,
        spec: &JobSpec,
        key: &DedupKey,
    ) -> Result<Reply, CommandError> {
        let id = (org, spec.job);
        if let Some(j) = self.jobs.get(&id) {
            // Idempotent by job id, key included.
            if &j.spec != spec || self.dedup.key_of.get(&id) != Some(key) {
                return Err(CommandError::AlreadyExists);
            }
            return Ok(self.dedup_reply(id));
        }
        let found = match self.dedup.by_key.get(&(org, key.clone())) {
            None => Found::Run,
            Some(&other) => match self.jobs.get(&(org, other)).map(|j| j.state) {
                Some(JobState::Succeeded) => Found::Succeeded(other),
                Some(s) if !s.is_final() => Found::InFlight(other),
                _ => Found::Run,
            },
        };
        // Every check and the reservation are `submit`'s: a keyed job is a job (its
        // queued-jobs quota counts attached jobs too). One that takes a retained result
        // reserves nothing from rule version 4 (before, it reserved and released its
        // hold in the same command, so it could be refused for credit or budget).
        let reserve = !(matches!(found, Found::Succeeded(_))
            && ledger.rules.0 >= RETAINED_RESULTS_RESERVE_NOTHING_FROM);
        self.admit(ctx, ledger, cfg, org, spec, reserve)?;
        self.dedup.key_of.insert(id, key.clone());
        match found {
            Found::Run => {
                self.dedup.by_key.insert((org, key.clone()), spec.job);
            }
            Found::InFlight(other) => {
                self.dequeue(id);
                self.dedup.attached_to.insert(id, other);
                self.dedup
                    .waiting
                    .entry((org, other))
                    .or_default()
                    .push(spec.job);
                self.dedup.count_attached(org, true);
                self.transition(ctx, id, JobState::Attached, Reason::Deduplicated);
            }
            Found::Succeeded(other) => {
                self.dedup.attached_to.insert(id, other);
                self.end(
                    ctx,
                    ledger,
                    cfg,
                    id,
                    Ending {
                        settle: SettleReason::Deduplicated,
                        to: JobState::Succeeded,
                        reason: Reason::Deduplicated,
                    },
                );
            }
        }
        Ok(self.dedup_reply(id))
    }

    /// The answer to a keyed submission, as the job stands.
    fn dedup_reply(&self, id: JobKey) -> Reply {
        let (state, hold_micro) = self
            .jobs
            .get(&id)
            .map_or((JobState::Queued, 0), |j| (j.state, j.hold_micro));
        match self.dedup.attached_to.get(&id) {
            Some(&to) => Reply::JobAttached {
                job: id.1,
                to,
                hold_micro,
                state,
            },
            None => Reply::JobSubmitted {
                job: id.1,
                hold_micro,
                state,
            },
        }
    }

    /// Job `id` ended (`to`, a final state): the jobs attached to it succeed with it, or
    /// the oldest of them runs itself; an attached job that ended leaves its list.
    pub(crate) fn dedup_ended(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        id: JobKey,
        to: JobState,
    ) {
        let org = id.0;
        if let Some(&other) = self.dedup.attached_to.get(&id) {
            let mut left = false;
            if let Some(list) = self.dedup.waiting.get_mut(&(org, other)) {
                if let Some(pos) = list.iter().position(|j| *j == id.1) {
                    list.remove(pos);
                    left = true;
                }
                if list.is_empty() {
                    self.dedup.waiting.remove(&(org, other));
                }
            }
            if left {
                self.dedup.count_attached(org, false);
            }
            if to != JobState::Succeeded {
                self.dedup.attached_to.remove(&id);
            }
        }
        let Some(attached) = self.dedup.waiting.remove(&id) else {
            return;
        };
        if to == JobState::Succeeded {
            for a in attached {
                self.dedup.count_attached(org, false);
                // Succeeds with the result; its hold returns in full (never metered).
                self.end(
                    ctx,
                    ledger,
                    cfg,
                    (org, a),
                    Ending {
                        settle: SettleReason::Deduplicated,
                        to: JobState::Succeeded,
                        reason: Reason::Deduplicated,
                    },
                );
            }
            return;
        }
        // No result: the oldest attached job runs, the others wait for it instead.
        let mut rest = attached.into_iter();
        let Some(first) = rest.next() else { return };
        let runner = (org, first);
        for a in rest.by_ref().collect::<Vec<_>>() {
            self.dedup.attached_to.insert((org, a), first);
            self.dedup.waiting.entry(runner).or_default().push(a);
        }
        self.dedup.attached_to.remove(&runner);
        self.dedup.count_attached(org, false);
        if let Some(key) = self.dedup.key_of.get(&runner).cloned() {
            self.dedup.by_key.insert((org, key), first);
        }
        // It queues by the time it was submitted: it has waited for a result since
        // then, and jobs submitted after it do not pass it.
        if let Some(j) = self.jobs.get_mut(&runner) {
            j.queued_since_ms = j.submitted_ms;
        }
        self.enqueue(runner);
        self.transition(ctx, runner, JobState::Queued, Reason::DedupReleased);
    }

    /// A retained job is dropped: so are its key (if it still owns it) and its link.
    pub(crate) fn dedup_forget(&mut self, id: JobKey) {
        if let Some(key) = self.dedup.key_of.remove(&id) {
            let k = (id.0, key);
            if self.dedup.by_key.get(&k) == Some(&id.1) {
                self.dedup.by_key.remove(&k);
            }
        }
        self.dedup.attached_to.remove(&id);
    }

    /// The dedup tables agree with the jobs (checked with the scheduler's invariants):
    /// every attached job is `Attached`, listed once under an in-flight job of its org,
    /// and counted; every key's job is retained and has that key.
    pub(crate) fn dedup_violations(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut counted: BTreeMap<OrgId, u32> = BTreeMap::new();
        for (&(org, other), list) in &self.dedup.waiting {
            let in_flight = self
                .jobs
                .get(&(org, other))
                .is_some_and(|j| !j.state.is_final() && j.state != JobState::Attached);
            if !in_flight {
                out.push(format!(
                    "jobs wait on {org}/{other}, which is not in flight"
                ));
            }
            for a in list {
                *counted.entry(org).or_default() += 1;
                let ok = self
                    .jobs
                    .get(&(org, *a))
                    .is_some_and(|j| j.state == JobState::Attached)
                    && self.dedup.attached_to.get(&(org, *a)) == Some(&other);
                if !ok {
                    out.push(format!(
                        "{org}/{a} listed as attached to {other} but is not"
                    ));
                }
            }
        }
        for (id, j) in self.jobs.iter() {
            if j.state == JobState::Attached
                && !self
                    .dedup
                    .attached_to
                    .get(id)
                    .and_then(|o| self.dedup.waiting.get(&(id.0, *o)))
                    .is_some_and(|l| l.contains(&id.1))
            {
                out.push(format!("{}/{} is attached to nothing", id.0, id.1));
            }
        }
        if counted != self.dedup.attached_by_org {
            out.push("attached jobs per org miscounted".into());
        }
        for ((org, key), job) in &self.dedup.by_key {
            let owns = self.dedup.key_of.get(&(*org, *job)) == Some(key);
            if !owns || !self.jobs.contains_key(&(*org, *job)) {
                out.push(format!(
                    "a key of {org} names {job}, which does not hold it"
                ));
            }
        }
        out
    }
}
