//! Low-balance and budget-threshold alerts (`allot_statemachine::alerts`): one event per
//! crossing, whatever drives the crossing (a command, an expiry), re-armed as
//! documented, bounded, and refused when malformed.

use allot_statemachine::alerts::AlertSpec;
use allot_statemachine::audit::EventBody;
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);
const SCOPE: BudgetScope = BudgetScope::Project(PROJECT);

fn low_balance_events(h: &Harness) -> Vec<(u64, u64)> {
    h.events
        .iter()
        .filter_map(|e| match e.body {
            EventBody::LowBalance {
                threshold_micro,
                available_micro,
            } if e.account == Some(P) => Some((threshold_micro, available_micro)),
            _ => None,
        })
        .collect()
}

fn threshold_events(h: &Harness) -> Vec<u32> {
    h.events
        .iter()
        .filter_map(|e| match e.body {
            EventBody::BudgetThreshold { scope, pct, .. } if scope == SCOPE => Some(pct),
            _ => None,
        })
        .collect()
}

fn hold(h: &mut Harness, id: u64, amount: u64) {
    h.ok(Command::CreateHold(Harness::hold_spec(id, amount)));
}

fn release(h: &mut Harness, id: u64) {
    h.ok(Command::ReleaseHold { hold: HoldId(id) });
}

#[test]
fn threshold_events_fire_once_per_crossing() {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(10), None);
    h.ok(Command::SetBudget {
        scope: SCOPE,
        budget: Some(BudgetSpec {
            limit_micro: credits(10),
            period: BudgetPeriod::Month,
            mode: BudgetMode::Soft,
        }),
    });
    assert_eq!(
        h.ok(Command::SetAlert {
            scope: SCOPE,
            alert: Some(AlertSpec {
                low_balance_micro: Some(credits(4)),
                budget_pcts: vec![50, 80],
            }),
        }),
        Reply::AlertSet
    );
    assert!(low_balance_events(&h).is_empty() && threshold_events(&h).is_empty());

    // 5 of 10 held: the 50% threshold, once; 5 available is not below 4.
    hold(&mut h, 1, credits(5));
    assert_eq!(threshold_events(&h), vec![50]);
    assert!(low_balance_events(&h).is_empty());
    // 3 available: below 4, once.
    hold(&mut h, 2, credits(2));
    assert_eq!(low_balance_events(&h), vec![(credits(4), credits(3))]);
    // Further down: no second event for the same crossing.
    hold(&mut h, 3, credits(1) / 2);
    h.tick();
    assert_eq!(low_balance_events(&h).len(), 1);
    assert_eq!(threshold_events(&h), vec![50]);

    // Back above (holds released) re-arms the low balance; budget percentages stay
    // fired for the period (no flapping on a released hold).
    for id in 1..=3 {
        release(&mut h, id);
    }
    assert_eq!(low_balance_events(&h).len(), 1);
    hold(&mut h, 4, credits(7));
    assert_eq!(
        low_balance_events(&h),
        vec![(credits(4), credits(3)), (credits(4), credits(3))],
        "a second fall is a second crossing"
    );
    assert_eq!(
        threshold_events(&h),
        vec![50],
        "50% already fired this month"
    );
    // 80% is crossed once, even past it.
    hold(&mut h, 5, credits(1));
    hold(&mut h, 6, credits(1));
    assert_eq!(threshold_events(&h), vec![50, 80]);
    assert_eq!(low_balance_events(&h).len(), 2);

    // A new month re-arms the percentages (held credit still counts as use).
    h.advance(32 * 86_400_000);
    h.tick();
    hold(&mut h, 7, credits(1) / 10);
    assert_eq!(threshold_events(&h), vec![50, 80, 50, 80]);
}

/// Credit that expires (no command involved) crosses the threshold too: evaluated after
/// the entry's time-driven work; and an alert set on an account already below fires at
/// once.
#[test]
fn expiry_crosses_and_setting_fires_for_a_threshold_already_passed() {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(2), None);
    let at = h.now + 60_000;
    h.grant(2, P, BucketKind::Promotional, credits(5), Some(at));
    h.ok(Command::SetAlert {
        scope: SCOPE,
        alert: Some(AlertSpec {
            low_balance_micro: Some(credits(3)),
            budget_pcts: vec![],
        }),
    });
    assert!(low_balance_events(&h).is_empty());
    h.advance(60_000);
    h.tick();
    assert_eq!(low_balance_events(&h), vec![(credits(3), credits(2))]);
    let ev = h
        .events
        .iter()
        .find(|e| matches!(e.body, EventBody::LowBalance { .. }))
        .unwrap();
    assert_eq!(ev.actor, Actor::System);
    assert_eq!(ev.org, Some(ORG));
    h.tick();
    assert_eq!(low_balance_events(&h).len(), 1);

    // Set afresh on an account already below: it fires at once, once.
    h.ok(Command::SetAlert {
        scope: SCOPE,
        alert: Some(AlertSpec {
            low_balance_micro: Some(credits(100)),
            budget_pcts: vec![],
        }),
    });
    assert_eq!(low_balance_events(&h).len(), 2);
    h.tick();
    assert_eq!(low_balance_events(&h).len(), 2);
    // Removed: nothing more.
    h.ok(Command::SetAlert {
        scope: SCOPE,
        alert: None,
    });
    assert!(h.state.alerts.is_empty());
}

#[test]
fn bad_alerts_are_refused_and_change_nothing() {
    let mut h = Harness::world();
    let bad = |scope, low: Option<u64>, pcts: Vec<u32>| Command::SetAlert {
        scope,
        alert: Some(AlertSpec {
            low_balance_micro: low,
            budget_pcts: pcts,
        }),
    };
    let cases = [
        (bad(SCOPE, None, vec![]), CommandError::InvalidAlert),
        (
            bad(BudgetScope::User(USER), Some(1), vec![]),
            CommandError::InvalidAlert,
        ),
        (bad(SCOPE, None, vec![0]), CommandError::InvalidAlert),
        (bad(SCOPE, None, vec![1001]), CommandError::InvalidAlert),
        (bad(SCOPE, None, vec![80, 50]), CommandError::DuplicateEntry),
        (bad(SCOPE, None, vec![50, 50]), CommandError::DuplicateEntry),
        (
            bad(SCOPE, None, (1..=9).collect()),
            CommandError::LimitReached(Limit::AlertPcts),
        ),
        (
            bad(BudgetScope::Project(ProjectId(999)), Some(1), vec![]),
            CommandError::UnknownProject,
        ),
    ];
    for (command, want) in cases {
        // The edge refuses what it can see alone, with apply's own rule.
        if want != CommandError::UnknownProject {
            let req = Request {
                actor: ADMIN,
                request_id: 1,
                org: Some(ORG),
                command: command.clone(),
            };
            assert_eq!(
                validate::validate(&req, allot_statemachine::version::RULES_BASELINE),
                Err(want.clone())
            );
        }
        assert_eq!(h.run(command), Err(want));
    }
    // Nothing refused reached the alert table.
    assert!(h.state.alerts.is_empty());
    // A project token may not set alerts; the org's token may.
    let mine = bad(SCOPE, Some(credits(1)), vec![]);
    assert_eq!(
        h.run_as(
            Actor::Project {
                org: ORG,
                project: PROJECT,
                principal: PrincipalId(300),
            },
            mine.clone()
        ),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(h.run_as(tenant(ORG), mine), Ok(Reply::AlertSet));
    // Another org's project is unknown to it.
    assert_eq!(
        h.run_as(tenant(OTHER_ORG), bad(SCOPE, Some(credits(1)), vec![])),
        Err(CommandError::UnknownProject)
    );
}
