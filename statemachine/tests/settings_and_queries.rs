//! Scheduler settings changed through the log (`ConfigureScheduler`), and the read
//! queries the client and CLI use (`query::answer`), through `apply` only.

use allot_statemachine::query::{
    answer, answer_as, Answer, JobFilter, Query, QueryDenied, UsageLevel, UsageQuery, UsageRow,
};
use allot_statemachine::scheduler::{JobState, SchedulerSettings};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);

fn world() -> Harness {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h
}

fn settings(h: &Harness) -> SchedulerSettings {
    match answer(&h.state, &Query::SchedulerSettings) {
        Answer::SchedulerSettings(s) => s,
        other => panic!("{other:?}"),
    }
}

fn submit(h: &mut Harness, spec: JobSpec) {
    let id = spec.job.0;
    match h.run(Command::SubmitJob(spec)) {
        Ok(Reply::JobSubmitted { .. }) => {}
        other => panic!("submit {id}: {other:?}"),
    }
}

/// The same young victim that the default minimum runtime protects is preempted once
/// an operator sets the minimum runtime to zero through the log.
#[test]
fn configured_min_runtime_allows_an_earlier_preemption() {
    for (min_runtime_ms, expect) in [(None, JobState::Running), (Some(0), JobState::Preempting)] {
        let mut h = world();
        if let Some(ms) = min_runtime_ms {
            let mut s = settings(&h);
            s.min_runtime_ms = ms;
            s.hysteresis_ms = 0;
            assert_eq!(
                h.run(Command::ConfigureScheduler(s.clone())),
                Ok(Reply::SchedulerConfigured)
            );
            assert_eq!(settings(&h), s, "the settings read back");
        }
        h.fleet(&[(1, a100(), 2, 80)]);
        submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
        h.advance(10_000);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        submit(
            &mut h,
            Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
        );
        assert_eq!(h.job(10).state, expect, "min runtime {min_runtime_ms:?}");
    }
}

/// Makes one setting invalid.
type Breaker = fn(&mut SchedulerSettings);

#[test]
fn bad_settings_are_refused_whole_and_change_nothing() {
    let mut h = world();
    let good = settings(&h);
    let cases: Vec<(Breaker, ConfigProblem)> = vec![
        (|s| s.node_lease_ms = 999, ConfigProblem::NodeLease),
        (|s| s.job_lease_ms = 0, ConfigProblem::JobLease),
        (|s| s.grace_ms = 3_600_001, ConfigProblem::Grace),
        (|s| s.min_runtime_ms = 86_400_001, ConfigProblem::MinRuntime),
        (|s| s.hysteresis_ms = u64::MAX, ConfigProblem::Hysteresis),
        (
            |s| s.preemptions_per_job_max = 101,
            ConfigProblem::PreemptionCap,
        ),
        (|s| s.usage_half_life_ms = 59_999, ConfigProblem::HalfLife),
        (
            |s| s.preemption_loss_max_gpu_ms = 8 * 86_400_000 + 1,
            ConfigProblem::PreemptionLoss,
        ),
        (
            |s| {
                s.tiers.pop();
            },
            ConfigProblem::TierCount,
        ),
        (|s| s.tiers[0].name.clear(), ConfigProblem::TierName),
        (|s| s.tiers[1].weight = 0, ConfigProblem::TierWeight),
        (|s| s.tiers[2].floor_pct = 80, ConfigProblem::TierShare),
        (|s| s.tiers[2].ceiling_pct = 101, ConfigProblem::TierShare),
        (
            |s| {
                s.tiers[0].floor_pct = 50;
                s.tiers[1].floor_pct = 50;
            },
            ConfigProblem::TierShare,
        ),
        (
            |s| s.tiers[0].max_wait_ms = u64::MAX,
            ConfigProblem::TierWait,
        ),
    ];
    for (i, (break_it, problem)) in cases.into_iter().enumerate() {
        let mut s = good.clone();
        // A valid change alongside the invalid one must not be applied either.
        s.grace_ms = 1_234;
        break_it(&mut s);
        assert_eq!(
            h.run(Command::ConfigureScheduler(s)),
            Err(CommandError::InvalidConfig(problem)),
            "case {i}"
        );
        assert_eq!(settings(&h), good, "case {i}: nothing changed");
    }
    // Only an admin may configure.
    assert_eq!(
        h.run_as(tenant(ORG), Command::ConfigureScheduler(good.clone())),
        Err(CommandError::Unauthorized)
    );
}

#[test]
fn jobs_query_filters_and_pages_by_job_id() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    for j in [30, 10, 20, 40] {
        submit(&mut h, Harness::job_spec(j, Tier::PAID, vec![a100()], 4));
    }
    let page = |h: &Harness, f: JobFilter| match answer(&h.state, &Query::Jobs(f)) {
        Answer::Jobs(p) => (
            p.jobs.iter().map(|j| j.spec.job.0).collect::<Vec<_>>(),
            p.next,
        ),
        other => panic!("{other:?}"),
    };
    let first = page(
        &h,
        JobFilter {
            org: Some(ORG),
            limit: 3,
            ..JobFilter::default()
        },
    );
    assert_eq!(first, (vec![10, 20, 30], Some(JobId(30))));
    let rest = page(
        &h,
        JobFilter {
            org: Some(ORG),
            after: first.1,
            limit: 3,
            ..JobFilter::default()
        },
    );
    assert_eq!(rest, (vec![40], None));
    // Each submit is its own entry and pass: 30 and 10 fill the 8-GPU node.
    let queued = page(
        &h,
        JobFilter {
            state: Some(JobState::Queued),
            ..JobFilter::default()
        },
    );
    assert_eq!(queued.0, vec![20, 40], "30 and 10 were placed as they came");
    let other_org = page(
        &h,
        JobFilter {
            org: Some(OTHER_ORG),
            ..JobFilter::default()
        },
    );
    assert_eq!(other_org, (vec![], None));

    // The queue view agrees: two paid jobs queued since submission, 8 GPUs running.
    h.advance(5_000);
    h.tick();
    let Answer::Queue(q) = answer(&h.state, &Query::Queue) else {
        panic!()
    };
    let paid = q.iter().find(|t| t.tier == Tier::PAID).unwrap();
    assert_eq!((paid.queued, paid.running_gpus), (2, 8));
    assert!(paid.oldest_wait_ms >= 5_000, "{paid:?}");
    let Answer::Nodes(nodes) = answer(&h.state, &Query::Nodes) else {
        panic!()
    };
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].free_gpus(), 0);
}

#[test]
fn budget_and_price_queries() {
    let mut h = world();
    let spec = BudgetSpec {
        limit_micro: credits(50),
        period: BudgetPeriod::Month,
        mode: BudgetMode::Hard,
    };
    h.ok(Command::SetBudget {
        scope: BudgetScope::Project(PROJECT),
        budget: Some(spec),
    });
    h.ok(Command::CreateHold(Harness::hold_spec(7, credits(20))));
    let Answer::Budget(Some(view)) =
        answer(&h.state, &Query::Budget(ORG, BudgetScope::Project(PROJECT)))
    else {
        panic!()
    };
    assert_eq!(view.budget, Some(spec));
    assert_eq!(
        view.used_micro,
        credits(20),
        "held counts against the budget"
    );
    assert_eq!(
        answer(
            &h.state,
            &Query::Budget(ORG, BudgetScope::User(UserId(999)))
        ),
        Answer::Budget(None)
    );
    let Answer::Prices(p) = answer(&h.state, &Query::Prices) else {
        panic!()
    };
    assert_eq!(p.prices.get(&a100()), Some(&A100_PRICE));
}

/// Top-k consumers: orgs, projects or users ranked by credits used in the period (held
/// plus spent), largest first, ties by id; a tenant sees only its own org's rows, a
/// project token only its project.
#[test]
fn usage_ranking_top_k_and_its_scope() {
    let mut h = world();
    h.grant(
        2,
        Account::Project(PROJECT_B),
        BucketKind::Paid,
        credits(1_000),
        None,
    );
    h.grant(
        3,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(1_000),
        None,
    );
    let hold = |h: &mut Harness, id, project, user, amount| {
        let mut spec = Harness::hold_spec(id, credits(amount));
        spec.project = project;
        spec.user = user;
        h.ok(Command::CreateHold(spec));
    };
    hold(&mut h, 1, PROJECT, USER, 50);
    hold(&mut h, 2, PROJECT_B, USER_B, 30);
    hold(&mut h, 3, OTHER_PROJECT, OTHER_USER, 70);
    h.ok(Command::Capture {
        hold: HoldId(2),
        amount_micro: credits(10),
    });
    let q = |level, org, limit| {
        Query::Usage(UsageQuery {
            level,
            org,
            period: BudgetPeriod::Month,
            limit,
        })
    };
    let rows = |a: Answer| match a {
        Answer::Usage(r) => r
            .iter()
            .map(|r: &UsageRow| (r.scope, r.used_micro / 1_000_000))
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        rows(answer(&h.state, &q(UsageLevel::Project, None, 2))),
        vec![
            (BudgetScope::Project(OTHER_PROJECT), 70),
            (BudgetScope::Project(PROJECT), 50)
        ],
        "top 2 projects across the shard"
    );
    assert_eq!(
        rows(answer(&h.state, &q(UsageLevel::Org, None, 0))),
        vec![
            (BudgetScope::Org(ORG), 80),
            (BudgetScope::Org(OTHER_ORG), 70)
        ],
        "an org counts all its projects (a capture moves held to spent: 30 stays 30)"
    );
    assert_eq!(
        rows(answer(&h.state, &q(UsageLevel::User, Some(ORG), 0))),
        vec![
            (BudgetScope::User(USER), 50),
            (BudgetScope::User(USER_B), 30)
        ]
    );
    // Tenants: their own org only, whatever filter they send.
    let t = tenant(ORG);
    assert_eq!(
        rows(answer_as(&h.state, t, &q(UsageLevel::Project, None, 0)).unwrap()),
        vec![
            (BudgetScope::Project(PROJECT), 50),
            (BudgetScope::Project(PROJECT_B), 30)
        ]
    );
    assert_eq!(
        rows(answer_as(&h.state, t, &q(UsageLevel::Org, Some(OTHER_ORG), 0)).unwrap()),
        vec![],
        "another org's filter matches nothing"
    );
    let p = Actor::Project {
        org: ORG,
        project: PROJECT_B,
        principal: PrincipalId(500),
    };
    assert_eq!(
        rows(answer_as(&h.state, p, &q(UsageLevel::Project, None, 0)).unwrap()),
        vec![(BudgetScope::Project(PROJECT_B), 30)]
    );
    assert_eq!(
        answer_as(&h.state, p, &q(UsageLevel::User, None, 0)),
        Err(QueryDenied::PermissionDenied)
    );
    // A user token sees no ranking: its project's row is every user's of the project
    // (running GPUs included), which the queue and fleet reads keep from it.
    let u = Actor::User {
        org: ORG,
        project: PROJECT_B,
        user: USER_B,
        principal: PrincipalId(501),
    };
    for level in [UsageLevel::Org, UsageLevel::Project, UsageLevel::User] {
        assert_eq!(
            answer_as(&h.state, u, &q(level, None, 0)),
            Err(QueryDenied::PermissionDenied),
            "{level:?}"
        );
    }
    // Weights and running GPUs travel with the rows.
    h.ok(Command::SetShareWeight {
        scope: BudgetScope::Project(PROJECT),
        weight: Some(250),
    });
    match answer(&h.state, &q(UsageLevel::Project, Some(ORG), 1)) {
        Answer::Usage(r) => assert_eq!((r.len(), r[0].share_weight), (1, 250)),
        other => panic!("{other:?}"),
    }
}

/// Found by review (twenty-first session): a tier's price is the list price times its
/// percentage, rounded down, so a low list price and a low percentage priced a tier at
/// 0 µcredits per GPU-hour and its jobs ran free. From rule version 8 neither a price
/// list nor the tiers' percentages that would do it are taken (whichever comes second).
#[test]
fn prices_and_tiers_that_price_a_tier_at_zero_are_refused_from_rule_version_8() {
    for rules in [7, 8] {
        let mut h = world();
        h.ok(Command::ActivateVersion { version: rules });
        let prices = |p: u64| Command::SetPrices {
            prices: vec![(a100(), p)],
        };
        // The free tier at 1 % of list.
        let mut s = settings(&h);
        s.tiers[0].price_pct = 1;
        assert_eq!(
            h.run(Command::ConfigureScheduler(s)),
            Ok(Reply::SchedulerConfigured)
        );
        let version = h.state.ledger.prices.version;
        // 99 µcredits per GPU-hour at 1 %: 0.
        let cheap = h.run(prices(99));
        if rules == 7 {
            assert!(matches!(cheap, Ok(Reply::PricesSet { .. })), "{cheap:?}");
        } else {
            assert_eq!(cheap, Err(CommandError::InvalidPrice));
            assert_eq!(h.state.ledger.prices.version, version, "nothing changed");
        }
        // 100 at 1 %: 1 µcredit, taken under both.
        assert!(matches!(h.run(prices(100)), Ok(Reply::PricesSet { .. })));
        // The other way round: with every tier at list price, 50 µcredits is a price;
        // a tier at 1 % of it is not.
        let mut list = settings(&h);
        for t in &mut list.tiers {
            t.price_pct = 100;
        }
        h.ok(Command::ConfigureScheduler(list.clone()));
        h.ok(prices(50));
        let mut lower = list.clone();
        lower.tiers[0].price_pct = 1;
        let zero = h.run(Command::ConfigureScheduler(lower.clone()));
        if rules == 7 {
            assert_eq!(zero, Ok(Reply::SchedulerConfigured));
        } else {
            assert_eq!(
                zero,
                Err(CommandError::InvalidConfig(ConfigProblem::TierPrice))
            );
            assert_eq!(settings(&h), list, "nothing changed");
        }
    }
}
