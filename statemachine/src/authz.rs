//! Who may apply which command. Checked inside apply (on every replica, after any
//! forwarding), so no edge or forwarded request can escalate.
//!
//! A request acts in one org's namespace (`Request::namespace`): a tenant's token
//! forces its own org, so a tenant can only ever name its own objects — another org's
//! ids are simply not in its namespace, and answer exactly as ids nobody uses. A
//! project or user token is further confined to its project (and user).

use crate::command::{BudgetScope, Command, SettleReason};
use crate::ids::{Account, Actor, OrgId, ProjectId, UserId};
use crate::ledger::{unknown_account, Ledger};
use crate::limits::PROJECT_TRANSFERS_STAY_HOME_FROM;
use crate::outcome::CommandError;
use crate::scheduler::Scheduler;
use crate::security::{Scope, Security};

/// The org, project or user of `scope` exists in `org`'s namespace, or the typed
/// "unknown" error naming it.
pub(crate) fn scope_exists(
    ledger: &Ledger,
    org: OrgId,
    scope: BudgetScope,
) -> Result<(), CommandError> {
    let found = match scope {
        BudgetScope::Org(o) => o == org && ledger.orgs.contains_key(&o),
        BudgetScope::Project(p) => ledger.projects.contains_key(&(org, p)),
        BudgetScope::User(u) => ledger.users.contains_key(&(org, u)),
    };
    if found {
        return Ok(());
    }
    Err(match scope {
        BudgetScope::Org(_) => CommandError::UnknownOrg,
        BudgetScope::Project(_) => CommandError::UnknownProject,
        BudgetScope::User(_) => CommandError::UnknownUser,
    })
}

/// A command a tenant may never send, whatever it names: `Unauthorized`.
pub(crate) fn tenant_refusal(command: &Command) -> Option<CommandError> {
    let agent_only = matches!(
        command,
        Command::Heartbeat(_)
            | Command::JobHeartbeat(_)
            | Command::FinishJob { .. }
            | Command::FinishJobAt { .. }
            | Command::JobFenced { .. }
            | Command::NodeHeartbeat { .. }
            | Command::Tick
    );
    (admin_only(command) || agent_only).then_some(CommandError::Unauthorized)
}

/// Commands only an admin may issue.
fn admin_only(command: &Command) -> bool {
    matches!(
        command,
        Command::CreateOrg { .. }
            | Command::SetPrices { .. }
            | Command::IssueGrant(_)
            | Command::IssueGrantIn { .. }
            | Command::ActivateVersion { .. }
            | Command::StartMeter { .. }
            | Command::ConfigureScheduler(_)
            | Command::RegisterNode(_)
            | Command::SetNodeDraining { .. }
            | Command::SetQuota { .. }
            | Command::SetPlan { .. }
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
            | Command::SubmitJobDedup { .. }
            | Command::CancelJob { .. }
            | Command::Transfer { .. }
    )
}

/// What a user-scoped token may do: its own holds and jobs (not move the project's
/// credits).
fn user_allowed(command: &Command) -> bool {
    project_allowed(command) && !matches!(command, Command::Transfer { .. })
}

/// The project and user a command acts for in `org` (for project and user tokens),
/// with the error for a caller from outside them. `None` for the user where the command
/// names no user.
fn project_target(
    ledger: &Ledger,
    sched: &Scheduler,
    org: OrgId,
    command: &Command,
) -> Result<(ProjectId, Option<UserId>), CommandError> {
    let hold = |id| {
        ledger
            .hold(org, id)
            .map(|h| (h.project, Some(h.user)))
            .ok_or(CommandError::UnknownHold)
    };
    match command {
        Command::CreateHold(spec) => Ok((spec.project, Some(spec.user))),
        Command::SubmitJob(spec) | Command::SubmitJobDedup { spec, .. } => {
            Ok((spec.project, Some(spec.user)))
        }
        Command::Capture { hold: h, .. }
        | Command::TopUp { hold: h, .. }
        | Command::ReleaseHold { hold: h }
        | Command::Settle { hold: h, .. } => hold(*h),
        Command::CancelJob { job } => sched
            .job(org, *job)
            .map(|j| (j.spec.project, Some(j.spec.user)))
            .ok_or(CommandError::UnknownJob),
        Command::Transfer { from, .. } => match from {
            Account::Project(p) => Ok((*p, None)),
            Account::Org(_) => Err(unknown_account(*from)),
        },
        _ => Err(CommandError::Unauthorized),
    }
}

/// May `actor` (already resolved from its token) apply `command` in namespace `ns`?
/// Which jobs an agent may report on is the scheduler's dispatch record (checked
/// there: only jobs placed on its own node).
pub(crate) fn authorize(
    ledger: &Ledger,
    sched: &Scheduler,
    security: &Security,
    actor: Actor,
    ns: Option<OrgId>,
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
            Command::JobHeartbeat(_)
            | Command::FinishJob { .. }
            | Command::FinishJobAt { .. }
            | Command::JobFenced { .. } => Ok(()),
            Command::NodeHeartbeat { node: n } if *n == node => Ok(()),
            _ => Err(CommandError::Unauthorized),
        },
        Actor::Tenant { .. } | Actor::Project { .. } | Actor::User { .. } => {
            tenant(ledger, sched, security, actor, ns, command)
        }
    }
}

fn tenant(
    ledger: &Ledger,
    sched: &Scheduler,
    security: &Security,
    actor: Actor,
    ns: Option<OrgId>,
    command: &Command,
) -> Result<(), CommandError> {
    if command.is_security() {
        return tenant_security(security, actor, command);
    }
    if let Some(e) = tenant_refusal(command) {
        return Err(e);
    }
    if let Command::Settle { reason, .. } = command {
        if *reason != SettleReason::Cancelled {
            return Err(CommandError::Unauthorized);
        }
    }
    // The namespace is the tenant's own org (`Request::namespace` forced it).
    let Some(org) = ns else {
        return Err(CommandError::Unauthorized);
    };
    let (project, user) = match actor {
        Actor::Project { project, .. } if project_allowed(command) => (project, None),
        Actor::User { project, user, .. } if user_allowed(command) => (project, Some(user)),
        Actor::Project { .. } | Actor::User { .. } => return Err(CommandError::Unauthorized),
        _ => return Ok(()),
    };
    let (p, u) = project_target(ledger, sched, org, command)?;
    // From rule version 7 a project token moves its project's credits only back to its
    // org: another project, existing or not, answers as one it cannot see (before, it
    // could credit a sibling, and tell siblings that exist from ids that do not).
    if let Command::Transfer {
        to: Account::Project(q),
        ..
    } = command
    {
        if ledger.rules.0 >= PROJECT_TRANSFERS_STAY_HOME_FROM && *q != project {
            return Err(CommandError::UnknownProject);
        }
    }
    if p != project {
        // Another project of the org answers as a project the token cannot see.
        return Err(match command {
            Command::CreateHold(_) | Command::SubmitJob(_) | Command::SubmitJobDedup { .. } => {
                CommandError::UnknownProject
            }
            Command::CancelJob { .. } => CommandError::UnknownJob,
            Command::Transfer { from, .. } => unknown_account(*from),
            _ => CommandError::UnknownHold,
        });
    }
    if let Some(user) = user {
        if u.is_some_and(|u| u != user) {
            return Err(match command {
                Command::CreateHold(_) | Command::SubmitJob(_) | Command::SubmitJobDedup { .. } => {
                    CommandError::UnknownUser
                }
                Command::CancelJob { .. } => CommandError::UnknownJob,
                _ => CommandError::UnknownHold,
            });
        }
    }
    Ok(())
}

/// Token management by a tenant, inside its own org's namespace: an org token creates
/// org, project and user tokens of its org and rotates or revokes them; a project or
/// user token only rotates or revokes itself.
fn tenant_security(
    security: &Security,
    actor: Actor,
    command: &Command,
) -> Result<(), CommandError> {
    let (org, own) = match actor {
        Actor::Tenant { org, principal }
        | Actor::Project { org, principal, .. }
        | Actor::User { org, principal, .. } => (org, principal),
        _ => return Err(CommandError::Unauthorized),
    };
    let narrow = !matches!(actor, Actor::Tenant { .. });
    match command {
        Command::CreateToken { scope, .. } if !narrow => match scope {
            Scope::Org(o) | Scope::Project { org: o, .. } | Scope::User { org: o, .. }
                if *o == org =>
            {
                Ok(())
            }
            Scope::Org(_) | Scope::Project { .. } | Scope::User { .. } => {
                Err(CommandError::UnknownOrg)
            }
            Scope::Admin | Scope::Agent(_) => Err(CommandError::Unauthorized),
        },
        Command::RotateToken { principal, .. } | Command::RevokeToken { principal } => {
            let in_scope = if narrow {
                *principal == own
            } else {
                security.principal(Some(org), *principal).is_some()
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
