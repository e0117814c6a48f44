//! Who may apply which command. Checked inside apply (on every replica, after any
//! forwarding), so no edge or forwarded request can escalate.
//!
//! A tenant touching another org's object gets the same "unknown" error as for an id
//! that does not exist: the answer never reveals whether the target exists.

use crate::command::{BudgetScope, Command, SettleReason};
use crate::ids::{Account, Actor, JobId, OrgId};
use crate::ledger::{unknown_account, Ledger};
use crate::outcome::CommandError;
use crate::scheduler::Scheduler;

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
        Command::SetBudget { scope, .. } => match scope {
            BudgetScope::Org(o) => (ledger.org_of(Account::Org(*o)), CommandError::UnknownOrg),
            BudgetScope::Project(p) => (
                ledger.org_of(Account::Project(*p)),
                CommandError::UnknownProject,
            ),
            BudgetScope::User(u) => (
                ledger.users.get(u).map(|r| r.org),
                CommandError::UnknownUser,
            ),
        },
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
        | Command::SetNodeDraining { .. } => return None,
    })
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
    )
}

pub(crate) fn authorize(
    ledger: &Ledger,
    sched: &Scheduler,
    actor: Actor,
    command: &Command,
) -> Result<(), CommandError> {
    match actor {
        Actor::Admin(_) => Ok(()),
        Actor::System => match command {
            Command::Tick => Ok(()),
            _ => Err(CommandError::Unauthorized),
        },
        Actor::Agent(node) => match command {
            // Which jobs an agent may report on is the scheduler's dispatch record
            // (checked there: only jobs placed on its own node).
            Command::Heartbeat(_)
            | Command::Tick
            | Command::JobHeartbeat(_)
            | Command::FinishJob { .. } => Ok(()),
            Command::NodeHeartbeat { node: n } if *n == node => Ok(()),
            Command::Settle {
                reason: SettleReason::Succeeded | SettleReason::Failed,
                ..
            } => Ok(()),
            _ => Err(CommandError::Unauthorized),
        },
        Actor::Tenant { org, .. } => {
            if admin_only(command)
                || matches!(
                    command,
                    Command::Heartbeat(_)
                        | Command::JobHeartbeat(_)
                        | Command::FinishJob { .. }
                        | Command::NodeHeartbeat { .. }
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
                Some((Some(o), _)) if o == org => Ok(()),
                Some((_, unknown)) => Err(unknown),
                None => Ok(()),
            }
        }
    }
}
