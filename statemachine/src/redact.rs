//! What a tenant's token may see of an answer: the rule, in one place.
//!
//! An org is the tenant boundary: another org's ids and amounts never reach a tenant
//! (`Request::namespace`, [`crate::query::answer_as`]). Inside an org, a **project**
//! token (and a **user** token, narrower still) is confined to its project: the teams
//! of one customer get tokens that do not show them each other's work or the org's
//! pool. The rules apply answers as they are produced, so they are the same for a
//! fresh outcome, an idempotent replay and an audit read of the same command — and
//! they change nothing that is replicated (the stored outcome and the audit trail are
//! whole; the operator and the org token see them as they are).
//!
//! For a narrow token (DESIGN §44, "Inside an org"):
//! - `InsufficientCredits.available` is 0: the figure is the project's credit *and the
//!   org pool's*, which it cannot read otherwise (its `Balance` of the org is refused);
//! - `BudgetExceeded` keeps its scope but shows `limit` and `used` as 0 unless the
//!   scope is its own project, or its own user (a user's use is counted across the
//!   org's projects);
//! - `HoldCreated.draws` and `Transferred.buckets` name only buckets its project owns;
//! - `JobAttached.to` (result dedup) names a job only if it is its project's, else the
//!   job's own id stands in;
//! - a preemption names the preempting job only if it is its project's (for an org
//!   token: its org's), in a job's `last_reason`, `preempted_for` and audit events;
//! - audit: a refused or applied command of *another* project's token that named this
//!   project's hold or job is not shown (it belongs to the caller's trail), and the
//!   events it caused here (a transfer in, an attached job released) show the org
//!   (principal 0) as their actor, without a request id; a `BudgetAlert` on a user
//!   shows no amounts.
//!
//! Ids are checked against the state as it is when the answer is read, failing closed:
//! an audit read of an old event does not name a bucket archived or a job forgotten
//! since, even the reader's own. A user token is confined like a project token, and to
//! its own jobs.

use crate::audit::{AuditEvent, EventBody};
use crate::command::BudgetScope;
use crate::ids::{Account, Actor, BucketId, JobId, OrgId, ProjectId, UserId};
use crate::outcome::{CommandError, Outcome, Reply};
use crate::scheduler::{Job, Reason};
use crate::state::State;

/// Who reads: a tenant's org, and for a narrow token its project (and user).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Viewer {
    pub org: OrgId,
    pub project: Option<ProjectId>,
    pub user: Option<UserId>,
}

impl Viewer {
    /// A reader whose scope is not known (its token revoked between the apply and the
    /// answer): of everything the rules below hide from anyone, it sees nothing.
    pub const NOBODY: Viewer = Viewer {
        org: OrgId(u64::MAX),
        project: Some(ProjectId(u64::MAX)),
        user: Some(UserId(u64::MAX)),
    };

    /// The viewer a resolved actor reads as; `None`: the operator, an agent or the
    /// system (not a tenant: nothing here applies).
    pub fn of(actor: &Actor) -> Option<Viewer> {
        match *actor {
            Actor::Tenant { org, .. } => Some(Viewer {
                org,
                project: None,
                user: None,
            }),
            Actor::Project { org, project, .. } => Some(Viewer {
                org,
                project: Some(project),
                user: None,
            }),
            Actor::User {
                org, project, user, ..
            } => Some(Viewer {
                org,
                project: Some(project),
                user: Some(user),
            }),
            _ => None,
        }
    }

    /// A project or user token.
    pub fn narrow(&self) -> bool {
        self.project.is_some()
    }

    /// Whether the viewer may see the id of job `job` of `org`: its org's, and for a
    /// narrow token its project's (a user token: its own). Looked up in the state as
    /// it is now, failing closed: a job no longer known is not shown.
    fn sees_job(&self, state: &State, org: OrgId, job: JobId) -> bool {
        org == self.org
            && match self.project {
                None => true,
                Some(p) => state.scheduler.job(org, job).is_some_and(|j| {
                    j.spec.project == p && self.user.is_none_or(|u| j.spec.user == u)
                }),
            }
    }

    /// Whether `actor` is a token of another project (or, for a user token, another
    /// user) of the viewer's org.
    fn foreign(&self, actor: &Actor) -> bool {
        match (self.project, *actor) {
            (Some(mine), Actor::Project { project, .. }) => project != mine,
            (Some(mine), Actor::User { project, user, .. }) => {
                project != mine || self.user.is_some_and(|u| u != user)
            }
            _ => false,
        }
    }

    /// Whether the viewer may see bucket `b` (a narrow token: its project's only).
    fn sees_bucket(&self, state: &State, b: BucketId) -> bool {
        match self.project {
            None => true,
            Some(p) => state
                .ledger
                .buckets
                .get(&b)
                .is_some_and(|b| b.org == self.org && b.owner == Account::Project(p)),
        }
    }

    fn reason(&self, state: &State, r: Reason) -> Reason {
        match r {
            Reason::Preempted {
                by: Some(by),
                by_tier,
            } if !self.sees_job(state, self.org, by) => Reason::Preempted { by: None, by_tier },
            r => r,
        }
    }

    /// A job of the viewer's org (its confinement to the caller's project is the
    /// query's) as the viewer may see it.
    pub fn job(&self, state: &State, mut j: Job) -> Job {
        if j.preempted_for
            .is_some_and(|(o, id)| !self.sees_job(state, o, id))
        {
            j.preempted_for = None;
        }
        j.last_reason = self.reason(state, j.last_reason);
        j
    }

    /// A command's outcome (its reply or its refusal) as the viewer may see it.
    pub fn outcome(&self, state: &State, o: Outcome) -> Outcome {
        if !self.narrow() {
            return o;
        }
        match o {
            Err(CommandError::InsufficientCredits { needed, .. }) => {
                Err(CommandError::InsufficientCredits {
                    needed,
                    available: 0,
                })
            }
            Err(CommandError::BudgetExceeded {
                scope,
                limit,
                used,
                asked,
            }) => {
                let own = match scope {
                    BudgetScope::Project(p) => Some(p) == self.project,
                    BudgetScope::User(u) => Some(u) == self.user,
                    BudgetScope::Org(_) => false,
                };
                Err(CommandError::BudgetExceeded {
                    scope,
                    limit: if own { limit } else { 0 },
                    used: if own { used } else { 0 },
                    asked,
                })
            }
            Ok(Reply::HoldCreated { hold, mut draws }) => {
                draws.retain(|d| self.sees_bucket(state, d.bucket));
                Ok(Reply::HoldCreated { hold, draws })
            }
            Ok(Reply::Transferred { mut buckets }) => {
                buckets.retain(|b| self.sees_bucket(state, *b));
                Ok(Reply::Transferred { buckets })
            }
            Ok(Reply::JobAttached {
                job,
                to,
                hold_micro,
                state: js,
            }) => Ok(Reply::JobAttached {
                job,
                to: if self.sees_job(state, self.org, to) {
                    to
                } else {
                    job
                },
                hold_micro,
                state: js,
            }),
            o => o,
        }
    }

    /// An audit event of the viewer's org (and project, for a narrow token) as the
    /// viewer may see it; `None`: not the viewer's to see.
    pub fn event(&self, state: &State, mut e: AuditEvent) -> Option<AuditEvent> {
        if self.foreign(&e.actor) {
            // Another project's token acting on this project's hold or job (refused, or
            // applied through a path the org allows) is that project's business: its
            // command is not shown, and what it did here (money transferred in, an
            // attached job released) is shown as the org's, without the request id.
            if matches!(e.body, EventBody::Command { .. }) {
                return None;
            }
            e.actor = Actor::Tenant {
                org: self.org,
                principal: crate::ids::PrincipalId(0),
            };
            e.request_id = 0;
        }
        match &mut e.body {
            EventBody::Command { outcome, .. } if self.narrow() => {
                *outcome = self.outcome(state, outcome.clone());
            }
            EventBody::JobTransition { reason, .. } => *reason = self.reason(state, *reason),
            EventBody::BudgetAlert {
                scope: BudgetScope::User(u),
                limit_micro,
                used_micro,
            } if self.narrow() && Some(*u) != self.user => {
                *limit_micro = 0;
                *used_micro = 0;
            }
            _ => {}
        }
        Some(e)
    }
}
