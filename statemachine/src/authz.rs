//! Who may apply which command. Checked inside apply (on every replica, after any
//! forwarding), so no edge or forwarded request can escalate.
//!
//! A tenant touching another org's object gets the same "unknown" error as for an id
//! that does not exist: the answer never reveals whether the target exists.

use crate::command::{BudgetScope, Command, SettleReason};
use crate::ids::{Account, Actor, JobId, OrgId, ProjectId};
use crate::ledger::{unknown_account, Ledger};
use crate::outcome::CommandError;
use crate::scheduler::Scheduler;
use crate::security::{Scope, Security};

/// The org a command acts in, and the error to give a caller from outside it.
fn target(
    ledger: &Ledger,
    sched: &Scheduler,
    command: &Command,
) -> Option<(Option<OrgId>, CommandError)> {
    let job_org = |id: JobId| (sched.job(id).map(|j| j.org), CommandError::UnknownJob);
    let hold_org = |id| (ledger.hold(id).map(|h| h.org), CommandError::UnknownHold);
    Some(match command {
        Command::CreateProject { org, .. } | Command::CreateUser { org, .. } => {
            (Some(*org), CommandError::UnknownOrg)
        }
        Command::IssueGrant(g) => (ledger.org_of(g.owner), unknown_account(g.owner)),
        Command::SetBudget { scope, .. } | Command::SetShareWeight { scope, .. } => {
            scope_org(ledger, *scope)
        }
        Command::CreateHold(spec) => (
            ledger.org_of(Account::Project(spec.project)),
            CommandError::UnknownProject,
        ),
        Command::Capture { hold, .. }
        | Command::TopUp { hold, .. }
        | Command::ReleaseHold { hold }
        | Command::StartMeter { hold, .. }
        | Command::Settle { hold, .. } => hold_org(*hold),
        Command::Heartbeat(hb) => hold_org(hb.hold),
        Command::Transfer { from, .. } => (ledger.org_of(*from), unknown_account(*from)),
        Command::SubmitJob(spec) => (
            ledger.org_of(Account::Project(spec.project)),
            CommandError::UnknownProject,
        ),
        Command::CancelJob { job } | Command::FinishJob { job, .. } => job_org(*job),
        Command::JobHeartbeat(hb) => job_org(hb.job),
        Command::SetQuota { org, .. } => (Some(*org), CommandError::UnknownOrg),
        Command::CreateOrg { .. }
        | Command::SetPrices { .. }
        | Command::ConfigureScheduler(_)
        | Command::Tick
        | Command::RegisterNode(_)
        | Command::NodeHeartbeat { .. }
        | Command::SetNodeDraining { .. }
        | Command::Bootstrap { .. }
        | Command::CreateToken { .. }
        | Command::RotateToken { .. }
        | Command::RevokeToken { .. }
        | Command::RecordDenials { .. } => return None,
    })
}

/// The org an org, project or user belongs to, and the error naming a missing one.
pub(crate) fn scope_org(ledger: &Ledger, scope: BudgetScope) -> (Option<OrgId>, CommandError) {
    match scope {
        BudgetScope::Org(o) => (ledger.org_of(Account::Org(o)), CommandError::UnknownOrg),
        BudgetScope::Project(p) => (
            ledger.org_of(Account::Project(p)),
            CommandError::UnknownProject,
        ),
        BudgetScope::User(u) => (
            ledger.users.get(&u).map(|r| r.org),
            CommandError::UnknownUser,
        ),
    }
}

/// Commands only an admin may issue.
fn admin_only(command: &Command) -> bool {
    matches!(
        command,
        Command::CreateOrg { .. }
            | Command::SetPrices { .. }
            | Command::IssueGrant(_)
            | Command::StartMeter { .. }
            | Command::ConfigureScheduler(_)
            | Command::RegisterNode(_)
            | Command::SetNodeDraining { .. }
            | Command::SetQuota { .. }
            | Command::SetShareWeight {
                scope: BudgetScope::Org(_),
                ..
            }
    )
}

/// What a project-scoped token may do (all of it inside its own project).
fn project_allowed(command: &Command) -> bool {
    matches!(
        command,
        Command::CreateHold(_)
            | Command::Capture { .. }
            | Command::TopUp { .. }
            | Command::ReleaseHold { .. }
            | Command::Settle {
                reason: SettleReason::Cancelled,
                ..
            }
            | Command::SubmitJob(_)
            | Command::CancelJob { .. }
            | Command::Transfer { .. }
    )
}

/// The project a command acts in (for project-scoped tokens), with the error for a
/// caller from outside it.
fn project_target(
    ledger: &Ledger,
    sched: &Scheduler,
    command: &Command,
) -> (Option<ProjectId>, CommandError) {
    let hold_project = |id| {
        (
            ledger.hold(id).map(|h| h.project),
            CommandError::UnknownHold,
        )
    };
    match command {
        Command::CreateHold(spec) => (Some(spec.project), CommandError::UnknownProject),
        Command::SubmitJob(spec) => (Some(spec.project), CommandError::UnknownProject),
        Command::Capture { hold, .. }
        | Command::TopUp { hold, .. }
        | Command::ReleaseHold { hold }
        | Command::Settle { hold, .. } => hold_project(*hold),
        Command::CancelJob { job } => (
            sched.job(*job).map(|j| j.spec.project),
            CommandError::UnknownJob,
        ),
        Command::Transfer { from, .. } => (
            match from {
                Account::Project(p) => Some(*p),
                Account::Org(_) => None,
            },
            unknown_account(*from),
        ),
        _ => (None, CommandError::Unauthorized),
    }
}

/// Token management by a tenant: inside its own org only; a project token only on
/// itself (rotate or revoke its own principal).
fn tenant_security(
    security: &Security,
    actor: Actor,
    command: &Command,
) -> Result<(), CommandError> {
    let (org, own) = match actor {
        Actor::Tenant { org, principal } => (org, principal),
        Actor::Project { org, principal, .. } => (org, principal),
        _ => return Err(CommandError::Unauthorized),
    };
    let project_token = matches!(actor, Actor::Project { .. });
    match command {
        Command::CreateToken { scope, .. } if !project_token => match scope {
            Scope::Org(o) | Scope::Project { org: o, .. } if *o == org => Ok(()),
            Scope::Org(_) | Scope::Project { .. } => Err(CommandError::UnknownOrg),
            Scope::Admin | Scope::Agent(_) => Err(CommandError::Unauthorized),
        },
        Command::RotateToken { principal, .. } | Command::RevokeToken { principal } => {
            let in_scope = if project_token {
                *principal == own
            } else {
                security
                    .principal(*principal)
                    .is_some_and(|p| p.scope.org() == Some(org))
            };
            if in_scope {
                Ok(())
            } else {
                Err(CommandError::UnknownPrincipal)
            }
        }
        _ => Err(CommandError::Unauthorized),
    }
}

/// May `actor` (already resolved from its token) apply `command`? Objects of another
/// org answer as unknown. Which jobs an agent may report on is the scheduler's dispatch
/// record (checked there: only jobs placed on its own node).
pub(crate) fn authorize(
    ledger: &Ledger,
    sched: &Scheduler,
    security: &Security,
    actor: Actor,
    command: &Command,
) -> Result<(), CommandError> {
    if let Command::Bootstrap { .. } = command {
        // Anyone may try; it succeeds only on an unsecured shard.
        return Ok(());
    }
    match actor {
        Actor::Admin(_) => match command {
            Command::RecordDenials { .. } => Err(CommandError::Unauthorized),
            _ => Ok(()),
        },
        Actor::System => match command {
            Command::Tick | Command::RecordDenials { .. } => Ok(()),
            _ => Err(CommandError::Unauthorized),
        },
        Actor::Anonymous | Actor::Bearer(_) => Err(CommandError::Unauthenticated),
        Actor::Agent(node) => match command {
            Command::JobHeartbeat(_) | Command::FinishJob { .. } => Ok(()),
            Command::NodeHeartbeat { node: n } if *n == node => Ok(()),
            _ => Err(CommandError::Unauthorized),
        },
        Actor::Tenant { org, .. } | Actor::Project { org, .. } => {
            if command.is_security() {
                return tenant_security(security, actor, command);
            }
            if admin_only(command)
                || matches!(
                    command,
                    Command::Heartbeat(_)
                        | Command::JobHeartbeat(_)
                        | Command::FinishJob { .. }
                        | Command::NodeHeartbeat { .. }
                        | Command::Tick
                )
            {
                return Err(CommandError::Unauthorized);
            }
            if let Command::Settle { reason, .. } = command {
                if *reason != SettleReason::Cancelled {
                    return Err(CommandError::Unauthorized);
                }
            }
            match target(ledger, sched, command) {
                Some((Some(o), _)) if o == org => {}
                Some((_, unknown)) => return Err(unknown),
                None => return Err(CommandError::Unauthorized),
            }
            if let Actor::Project { project, .. } = actor {
                if !project_allowed(command) {
                    return Err(CommandError::Unauthorized);
                }
                match project_target(ledger, sched, command) {
                    (Some(p), _) if p == project => {}
                    (_, unknown) => return Err(unknown),
                }
            }
            Ok(())
        }
    }
}
