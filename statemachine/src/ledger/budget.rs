//! Hierarchical budgets: org → project → user, per period of logical time, hard or soft.
//!
//! A budget limits *spend*: credits held for running work plus credits captured in the
//! current period. Every hold and top-up must fit every budget on its path (user,
//! project, org); a hard budget rejects, a soft one allows and emits one alert per period.

use super::{Books, Ctx};
use crate::audit::{EventBody, PendingEvent};
use crate::calendar::{day_index, month_index};

/// The calendar month of a day index.
fn month_of_day(day: u32) -> u32 {
    month_index(u64::from(day) * 86_400_000)
}
use crate::command::{BudgetMode, BudgetPeriod, BudgetScope, BudgetSpec};
use crate::ids::{Account, OrgId, ProjectId, UserId};
use crate::outcome::CommandError;
use serde::{Deserialize, Serialize};

/// Spend counters of one org, project or user (kept whether or not a budget is set, so
/// a budget set mid-period sees the period's spend).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub held: u64,
    pub day: u32,
    pub spent_day: u64,
    pub month: u32,
    pub spent_month: u64,
    pub spent_total: u64,
}

impl Usage {
    fn roll(&mut self, now: u64) {
        let day = day_index(now);
        if day == self.day {
            return; // same day, so same month: no calendar arithmetic on the hot path
        }
        self.day = day;
        self.spent_day = 0;
        let month = month_index(now);
        if month != self.month {
            self.month = month;
            self.spent_month = 0;
        }
    }

    /// Held plus spent in `period` as of `now`.
    pub fn used(&self, period: BudgetPeriod, now: u64) -> u64 {
        let spent = match period {
            BudgetPeriod::Day if self.day == day_index(now) => self.spent_day,
            BudgetPeriod::Month if self.month == month_index(now) => self.spent_month,
            BudgetPeriod::Day | BudgetPeriod::Month => 0,
            BudgetPeriod::Lifetime => self.spent_total,
        };
        self.held.saturating_add(spent)
    }

    fn hold(&mut self, amount: u64) {
        self.held = self.held.saturating_add(amount);
    }

    fn unhold(&mut self, amount: u64) {
        self.held = self.held.saturating_sub(amount);
    }

    fn spend(&mut self, now: u64, amount: u64) {
        self.roll(now);
        self.held = self.held.saturating_sub(amount);
        self.spent_day = self.spent_day.saturating_add(amount);
        self.spent_month = self.spent_month.saturating_add(amount);
        self.spent_total = self.spent_total.saturating_add(amount);
    }

    /// A reversed capture: back from spent to held, credited to the period in which it
    /// was billed (`billed_day`). The day and month counters hold the current period only:
    /// a capture billed in an earlier one is not in them, and taking it off them would
    /// let the current period overspend a hard budget by the reversed amount.
    fn unspend(&mut self, amount: u64, billed_day: u32) {
        self.held = self.held.saturating_add(amount);
        if self.day == billed_day {
            self.spent_day = self.spent_day.saturating_sub(amount);
        }
        if self.month == month_of_day(billed_day) {
            self.spent_month = self.spent_month.saturating_sub(amount);
        }
        self.spent_total = self.spent_total.saturating_sub(amount);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub spec: BudgetSpec,
    /// The period index (day or month; 0 for lifetime) in which the last alert was sent.
    pub alerted_period: Option<u32>,
}

pub(crate) fn period_index(period: BudgetPeriod, now: u64) -> u32 {
    match period {
        BudgetPeriod::Day => day_index(now),
        BudgetPeriod::Month => month_index(now),
        BudgetPeriod::Lifetime => 0,
    }
}

/// The org, project and user a spend counts against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpendPath {
    pub org: OrgId,
    pub project: ProjectId,
    pub user: UserId,
}

/// How a spend moves the usage counters of every level of its path.
#[derive(Clone, Copy)]
pub(crate) enum UsageMove {
    Hold(u64),
    Unhold(u64),
    Spend(u64),
    /// A reversed capture, and the day it was billed on.
    Unspend(u64, u32),
}

impl Books {
    /// The counters and budget of `scope` in `org`'s namespace.
    fn usage_and_budget_mut(
        &mut self,
        org: OrgId,
        scope: BudgetScope,
    ) -> Option<(&mut Usage, &mut Option<Budget>)> {
        match scope {
            BudgetScope::Org(o) if o == org => self
                .orgs
                .get_mut(&o)
                .map(|r| (&mut r.account.usage, &mut r.account.budget)),
            BudgetScope::Org(_) => None,
            BudgetScope::Project(p) => self
                .projects
                .get_mut(&(org, p))
                .map(|r| (&mut r.account.usage, &mut r.account.budget)),
            BudgetScope::User(u) => self
                .users
                .get_mut(&(org, u))
                .map(|r| (&mut r.usage, &mut r.budget)),
        }
    }

    fn scopes(path: SpendPath) -> [BudgetScope; 3] {
        [
            BudgetScope::User(path.user),
            BudgetScope::Project(path.project),
            BudgetScope::Org(path.org),
        ]
    }

    pub(crate) fn set_budget(
        &mut self,
        org: OrgId,
        scope: BudgetScope,
        spec: Option<BudgetSpec>,
    ) -> Result<(), CommandError> {
        let (_, budget) = self.usage_and_budget_mut(org, scope).ok_or(match scope {
            BudgetScope::Org(_) => CommandError::UnknownOrg,
            BudgetScope::Project(_) => CommandError::UnknownProject,
            BudgetScope::User(_) => CommandError::UnknownUser,
        })?;
        *budget = spec.map(|spec| Budget {
            spec,
            alerted_period: None,
        });
        Ok(())
    }

    /// Checks that `amount` more spend fits every budget on `path`; emits soft alerts.
    /// Checks all levels before touching any alert flag, so a rejection changes nothing.
    pub(crate) fn check_budgets(
        &mut self,
        ctx: &mut Ctx,
        path: SpendPath,
        amount: u64,
    ) -> Result<(), CommandError> {
        let now = ctx.now;
        let mut alerts = [None; 3];
        for (i, scope) in Self::scopes(path).into_iter().enumerate() {
            let Some((usage, Some(budget))) = self.usage_and_budget_mut(path.org, scope) else {
                continue;
            };
            let used = usage.used(budget.spec.period, now);
            if used.saturating_add(amount) <= budget.spec.limit_micro {
                continue;
            }
            match budget.spec.mode {
                BudgetMode::Hard => {
                    return Err(CommandError::BudgetExceeded {
                        scope,
                        limit: budget.spec.limit_micro,
                        used,
                        asked: amount,
                    })
                }
                BudgetMode::Soft => {
                    alerts[i] = Some((scope, budget.spec.limit_micro, used.saturating_add(amount)))
                }
            }
        }
        for (scope, limit_micro, used_micro) in alerts.into_iter().flatten() {
            let Some((_, Some(budget))) = self.usage_and_budget_mut(path.org, scope) else {
                continue;
            };
            let period = period_index(budget.spec.period, now);
            if budget.alerted_period == Some(period) {
                continue;
            }
            budget.alerted_period = Some(period);
            ctx.effects.push(PendingEvent {
                org: Some(path.org),
                account: Some(match scope {
                    BudgetScope::Org(o) => Account::Org(o),
                    _ => Account::Project(path.project),
                }),
                hold: None,
                body: EventBody::BudgetAlert {
                    scope,
                    limit_micro,
                    used_micro,
                },
            });
        }
        Ok(())
    }

    pub(crate) fn move_usage(&mut self, now: u64, path: SpendPath, mv: UsageMove) {
        for scope in Self::scopes(path) {
            if let Some((usage, _)) = self.usage_and_budget_mut(path.org, scope) {
                match mv {
                    UsageMove::Hold(a) => usage.hold(a),
                    UsageMove::Unhold(a) => usage.unhold(a),
                    UsageMove::Spend(a) => usage.spend(now, a),
                    UsageMove::Unspend(a, day) => usage.unspend(a, day),
                }
            }
        }
    }
}
