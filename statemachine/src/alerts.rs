//! Alerts: thresholds an org sets on an account's available credit (low balance) and on
//! a budget's use (percentages of its limit). A crossing appends one audit event —
//! `LowBalance` or `BudgetThreshold` — which a platform consumes from the event stream
//! (`WatchEvents`) to notify someone or top the account up.
//!
//! Once per crossing:
//! - low balance fires when the account's available credit is below the threshold and
//!   the alert is armed; it re-arms when the credit is back at or above the threshold
//!   (a grant, a transfer in, a released hold), so the next fall fires again;
//! - each budget percentage fires once per budget period (the period turning over
//!   re-arms it; use falling back inside a period, e.g. a released hold, does not, so a
//!   hold held and released around a threshold does not flap);
//! - setting an alert arms it against the account as it is: thresholds already passed
//!   fire at once (the platform learns the state it asked about).
//!
//! Evaluated after every entry, for exactly the scopes the entry's audit events touched
//! (the account an event names, and the project and user of the hold it names), so the
//! cost is bounded by the entry's events, not by the number of alerts.

use crate::audit::{AuditEvent, EventBody, PendingEvent};
use crate::command::{BudgetScope, BudgetSpec};
use crate::ids::{Account, OrgId};
use crate::ledger::Ledger;
use crate::outcome::{CommandError, Limit};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use crate::limits::{ALERTS_MAX, ALERTS_PER_ORG_MAX, ALERT_PCTS_MAX, ALERT_PCT_MAX};

/// What one alert watches. Set with `Command::SetAlert`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertSpec {
    /// `LowBalance` when the account's available credit falls below this many
    /// micro-credits (org and project scopes: they have accounts).
    pub low_balance_micro: Option<u64>,
    /// `BudgetThreshold` when the scope's budget use in its period reaches each of these
    /// percentages of the limit (sorted, distinct, 1..=1000).
    pub budget_pcts: Vec<u32>,
}

impl AlertSpec {
    /// The static checks (edge and apply): the rule lives here.
    pub fn validate(&self, scope: BudgetScope) -> Result<(), CommandError> {
        if self.low_balance_micro.is_none() && self.budget_pcts.is_empty() {
            return Err(CommandError::InvalidAlert);
        }
        if self.low_balance_micro.is_some() && matches!(scope, BudgetScope::User(_)) {
            // A user has a budget but no account of its own.
            return Err(CommandError::InvalidAlert);
        }
        if self.budget_pcts.len() > ALERT_PCTS_MAX {
            return Err(CommandError::LimitReached(Limit::AlertPcts));
        }
        if self
            .budget_pcts
            .iter()
            .any(|p| *p == 0 || *p > ALERT_PCT_MAX)
        {
            return Err(CommandError::InvalidAlert);
        }
        if self.budget_pcts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommandError::DuplicateEntry);
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertState {
    pub spec: AlertSpec,
    /// Low balance fired and not yet re-armed.
    pub below: bool,
    /// The budget period (day or month index; 0 for lifetime) `fired_pct` is of.
    pub period: u32,
    /// The highest budget percentage fired in `period` (0: none).
    pub fired_pct: u32,
}

/// Every alert of the shard, by org and scope (ordered: deterministic).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alerts {
    table: BTreeMap<(OrgId, BudgetScope), AlertState>,
    per_org: BTreeMap<OrgId, u32>,
}

impl Alerts {
    pub fn get(&self, org: OrgId, scope: BudgetScope) -> Option<&AlertState> {
        self.table.get(&(org, scope))
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Sets (armed afresh) or removes an alert. The scope's existence is the caller's.
    pub fn set(
        &mut self,
        org: OrgId,
        scope: BudgetScope,
        spec: Option<AlertSpec>,
    ) -> Result<(), CommandError> {
        let key = (org, scope);
        let Some(spec) = spec else {
            if self.table.remove(&key).is_some() {
                self.count(org, -1);
            }
            return Ok(());
        };
        spec.validate(scope)?;
        if !self.table.contains_key(&key) {
            let mine = self.per_org.get(&org).copied().unwrap_or(0) as usize;
            if mine >= ALERTS_PER_ORG_MAX || self.table.len() >= ALERTS_MAX {
                return Err(CommandError::LimitReached(Limit::Alerts));
            }
            self.count(org, 1);
        }
        self.table.insert(
            key,
            AlertState {
                spec,
                below: false,
                period: 0,
                fired_pct: 0,
            },
        );
        Ok(())
    }

    fn count(&mut self, org: OrgId, delta: i32) {
        let n = self.per_org.entry(org).or_default();
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            self.per_org.remove(&org);
        }
    }

    /// The scopes with alerts that `events` touched.
    fn touched(&self, ledger: &Ledger, events: &[AuditEvent]) -> BTreeSet<(OrgId, BudgetScope)> {
        let mut out = BTreeSet::new();
        let mut last_org = None;
        for ev in events {
            let Some(org) = ev.org else { continue };
            if !self.per_org.contains_key(&org) {
                continue;
            }
            let mut add = |scope: BudgetScope| {
                if self.table.contains_key(&(org, scope)) {
                    out.insert((org, scope));
                }
            };
            if last_org != Some(org) {
                last_org = Some(org);
                add(BudgetScope::Org(org));
            }
            if let Some(Account::Project(p)) = ev.account {
                add(BudgetScope::Project(p));
            }
            if let Some(h) = ev.hold.and_then(|h| ledger.hold(org, h)) {
                add(BudgetScope::Project(h.project));
                add(BudgetScope::User(h.user));
            }
        }
        out
    }

    /// After an entry: the touched alerts' crossings, as events (in key order).
    pub fn evaluate(
        &mut self,
        ledger: &Ledger,
        events: &[AuditEvent],
        now: u64,
        out: &mut Vec<PendingEvent>,
    ) {
        if self.table.is_empty() {
            return;
        }
        for key in self.touched(ledger, events) {
            self.check(key, ledger, now, out);
        }
    }

    /// One alert's crossings now (also run when the alert is set: thresholds already
    /// passed fire at once).
    pub fn check(
        &mut self,
        key: (OrgId, BudgetScope),
        ledger: &Ledger,
        now: u64,
        out: &mut Vec<PendingEvent>,
    ) {
        let (org, scope) = key;
        let Some(st) = self.table.get_mut(&key) else {
            return;
        };
        let account = match scope {
            BudgetScope::Org(o) => Some(Account::Org(o)),
            BudgetScope::Project(p) => Some(Account::Project(p)),
            BudgetScope::User(_) => None,
        };
        if let (Some(threshold), Some(acct)) = (st.spec.low_balance_micro, account) {
            if let Some(b) = ledger.balance(org, acct, now, 0) {
                let available = b.available_micro();
                if available >= threshold {
                    st.below = false;
                } else if !st.below {
                    st.below = true;
                    out.push(PendingEvent {
                        org: Some(org),
                        account: Some(acct),
                        hold: None,
                        body: EventBody::LowBalance {
                            threshold_micro: threshold,
                            available_micro: available,
                        },
                    });
                }
            }
        }
        if st.spec.budget_pcts.is_empty() {
            return;
        }
        let Some((used, spec)) = budget_use(ledger, org, scope, now) else {
            return;
        };
        let period = crate::ledger::period_index(spec.period, now);
        if period != st.period {
            st.period = period;
            st.fired_pct = 0;
        }
        for &pct in &st.spec.budget_pcts {
            let reached = u128::from(used) * 100 >= u128::from(spec.limit_micro) * u128::from(pct);
            if pct <= st.fired_pct || !reached {
                continue;
            }
            st.fired_pct = pct;
            out.push(PendingEvent {
                org: Some(org),
                account,
                hold: None,
                body: EventBody::BudgetThreshold {
                    scope,
                    pct,
                    limit_micro: spec.limit_micro,
                    used_micro: used,
                },
            });
        }
    }
}

/// A scope's budget use in its current period, with the budget (None: no budget).
fn budget_use(
    ledger: &Ledger,
    org: OrgId,
    scope: BudgetScope,
    now: u64,
) -> Option<(u64, BudgetSpec)> {
    let (usage, budget) = match scope {
        BudgetScope::Org(o) => ledger
            .orgs
            .get(&o)
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::Project(p) => ledger
            .projects
            .get(&(org, p))
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::User(u) => ledger.users.get(&(org, u)).map(|r| (r.usage, r.budget))?,
    };
    let spec = budget?.spec;
    Some((usage.used(spec.period, now), spec))
}
