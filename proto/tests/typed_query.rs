//! The typed queries and answers (`allot_proto::typed::query`): every query and every
//! answer of the state machine round-trips exactly through its protobuf message *and
//! its wire bytes* (property tests over generated values of every variant, nested views,
//! `None` and `Some`, empty and full collections, extreme numbers); a refused field is
//! named by its path; a newer client's unknown fields are ignored.

use allot_proto::api::v1 as pb;
use allot_proto::typed::query::{answer_from, answer_to, query_from, query_org, query_to};
use allot_statemachine::ledger::{Balance, BucketView, PriceTable, Totals, UpcomingExpiry, Usage};
use allot_statemachine::query::{
    Answer, BudgetView, DemandQuery, JobFilter, JobsPage, Query, QuotaUse, TenancyView, TierDemand,
    TierQueue, TypeDemand, UsageLevel, UsageQuery, UsageRow,
};
use allot_statemachine::scheduler::{
    GpuNode, Job, JobState, NodeState, Placement, Reason, SchedulerSettings, TierConfig,
};
use allot_statemachine::security::Scope;
use allot_statemachine::{
    Account, BucketId, BucketPolicy, BudgetMode, BudgetPeriod, BudgetScope, BudgetSpec, GpuType,
    JobId, JobKey, JobSpec, NodeId, OrgId, Plan, PrincipalId, ProjectId, Tier, UserId,
};
use proptest::collection::{btree_map, vec};
use proptest::option::of;
use proptest::prelude::*;
use prost::Message;

mod common;
use common::*;

/// A query through a whole `QueryRequest` on the wire, and back.
fn query_round_trip(q: &Query) -> Result<Query, allot_proto::typed::FieldError> {
    let m = wire(&pb::QueryRequest {
        read: Some(pb::Read {
            shard: Some(3),
            stale_ok: true,
        }),
        query: Some(query_to(q)),
    });
    query_from(m.query.as_ref())
}

/// An answer through a whole `QueryReply` on the wire, and back.
fn answer_round_trip(a: &Answer) -> Result<Answer, allot_proto::typed::FieldError> {
    let m = wire(&pb::QueryReply {
        applied_index: 7,
        logical_time_ms: 8,
        answer: Some(answer_to(a)),
    });
    answer_from(m.answer.as_ref())
}

// ---------------------------------------------------------------- numbers and ids

/// Any u64, with its extremes often.
fn n64() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()]
}

fn n32() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()]
}

fn n128() -> impl Strategy<Value = u128> {
    prop_oneof![
        Just(0u128),
        Just(u128::MAX),
        Just(u128::from(u64::MAX)),
        Just(u128::from(u64::MAX) + 1),
        any::<u128>()
    ]
}

fn opt64() -> impl Strategy<Value = Option<u64>> {
    of(n64())
}

fn org() -> impl Strategy<Value = OrgId> {
    n64().prop_map(OrgId)
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![
        Just(Tier(0)),
        Just(Tier(u8::MAX)),
        any::<u8>().prop_map(Tier)
    ]
}

fn tiers() -> impl Strategy<Value = Vec<Tier>> {
    vec(tier(), 0..4)
}

fn gpu_type() -> impl Strategy<Value = GpuType> {
    "[A-Z0-9_-]{0,12}".prop_map(GpuType)
}

fn text() -> impl Strategy<Value = String> {
    ".{0,16}"
}

fn job_key() -> impl Strategy<Value = JobKey> {
    (org(), n64().prop_map(JobId))
}

fn account() -> impl Strategy<Value = Account> {
    prop_oneof![
        org().prop_map(Account::Org),
        n64().prop_map(|p| Account::Project(ProjectId(p))),
    ]
}

fn budget_scope() -> impl Strategy<Value = BudgetScope> {
    prop_oneof![
        org().prop_map(BudgetScope::Org),
        n64().prop_map(|p| BudgetScope::Project(ProjectId(p))),
        n64().prop_map(|u| BudgetScope::User(UserId(u))),
    ]
}

fn period() -> impl Strategy<Value = BudgetPeriod> {
    prop_oneof![
        Just(BudgetPeriod::Day),
        Just(BudgetPeriod::Month),
        Just(BudgetPeriod::Lifetime)
    ]
}

fn level() -> impl Strategy<Value = UsageLevel> {
    prop_oneof![
        Just(UsageLevel::Org),
        Just(UsageLevel::Project),
        Just(UsageLevel::User)
    ]
}

// ---------------------------------------------------------------- queries

fn job_filter() -> impl Strategy<Value = JobFilter> {
    (
        of(org()),
        of(n64().prop_map(ProjectId)),
        of(n64().prop_map(UserId)),
        of(job_state()),
        of(n64().prop_map(JobId)),
        n32(),
        of(org()),
    )
        .prop_map(
            |(org, project, user, state, after, limit, after_org)| JobFilter {
                org,
                project,
                user,
                state,
                after,
                limit,
                after_org,
            },
        )
}

fn usage_query() -> impl Strategy<Value = UsageQuery> {
    (level(), of(org()), period(), n32()).prop_map(|(level, org, period, limit)| UsageQuery {
        level,
        org,
        period,
        limit,
    })
}

fn any_query() -> impl Strategy<Value = Query> {
    prop_oneof![
        (org(), account(), n64())
            .prop_map(|(org, account, horizon_ms)| Query::Balance {
                org,
                account,
                horizon_ms
            })
            .boxed(),
        job_key().prop_map(|(o, j)| Query::Job(o, j)).boxed(),
        n64().prop_map(|n| Query::Assignments(NodeId(n))).boxed(),
        Just(Query::QueueDepth).boxed(),
        Just(Query::Totals).boxed(),
        Just(Query::Invariants).boxed(),
        Just(Query::StateHash).boxed(),
        Just(Query::Fleet).boxed(),
        job_filter().prop_map(Query::Jobs).boxed(),
        Just(Query::Nodes).boxed(),
        Just(Query::Queue).boxed(),
        Just(Query::Prices).boxed(),
        (org(), budget_scope())
            .prop_map(|(o, s)| Query::Budget(o, s))
            .boxed(),
        Just(Query::SchedulerSettings).boxed(),
        usage_query().prop_map(Query::Usage).boxed(),
        n64()
            .prop_map(|p| Query::Principals(PrincipalId(p)))
            .boxed(),
        org().prop_map(Query::Tenancy).boxed(),
        (org(), account())
            .prop_map(|(org, account)| Query::Buckets { org, account })
            .boxed(),
        n32()
            .prop_map(|run_pct| Query::Demand(DemandQuery { run_pct }))
            .boxed(),
    ]
}

/// Which variant (exhaustive: a new variant fails to compile here until it is generated
/// and counted).
fn query_variant(q: &Query) -> usize {
    match q {
        Query::Balance { .. } => 0,
        Query::Job(..) => 1,
        Query::Assignments(_) => 2,
        Query::QueueDepth => 3,
        Query::Totals => 4,
        Query::Invariants => 5,
        Query::StateHash => 6,
        Query::Fleet => 7,
        Query::Jobs(_) => 8,
        Query::Nodes => 9,
        Query::Queue => 10,
        Query::Prices => 11,
        Query::Budget(..) => 12,
        Query::SchedulerSettings => 13,
        Query::Usage(_) => 14,
        Query::Principals(_) => 15,
        Query::Tenancy(_) => 16,
        Query::Buckets { .. } => 17,
        Query::Demand(_) => 18,
    }
}
const QUERY_VARIANTS: usize = 19;

// ---------------------------------------------------------------- answers

fn balance() -> impl Strategy<Value = Balance> {
    (
        proptest::array::uniform9(n64()),
        vec((n64(), kind(), n64(), n64()), 0..4),
    )
        .prop_map(|(f, upcoming)| Balance {
            paid_available_micro: f[0],
            promotional_available_micro: f[1],
            granted_available_micro: f[2],
            held_micro: f[3],
            consumed_micro: f[4],
            expired_micro: f[5],
            issued_micro: f[6],
            moved_in_micro: f[7],
            moved_out_micro: f[8],
            upcoming_expirations: upcoming
                .into_iter()
                .map(|(bucket, kind, at, rem)| UpcomingExpiry {
                    bucket: BucketId(bucket),
                    kind,
                    expires_at_ms: at,
                    remaining_micro: rem,
                })
                .collect(),
        })
}

fn job_spec() -> impl Strategy<Value = JobSpec> {
    (
        proptest::array::uniform3(n64()),
        tier(),
        vec(gpu_type(), 0..4),
        n32(),
        n32(),
        any::<(bool, bool)>(),
        n64(),
    )
        .prop_map(|(ids, tier, gpu_types, gpus, mem, flags, max)| JobSpec {
            job: JobId(ids[0]),
            project: ProjectId(ids[1]),
            user: UserId(ids[2]),
            tier,
            gpu_types,
            gpus,
            mem_floor_gb: mem,
            preemptible: flags.0,
            checkpointable: flags.1,
            max_duration_ms: max,
        })
}

fn reason() -> impl Strategy<Value = Reason> {
    prop_oneof![
        Just(Reason::Submitted).boxed(),
        Just(Reason::Placed).boxed(),
        Just(Reason::Started).boxed(),
        (of(n64().prop_map(JobId)), tier())
            .prop_map(|(by, by_tier)| Reason::Preempted { by, by_tier })
            .boxed(),
        Just(Reason::Requeued).boxed(),
        Just(Reason::Succeeded).boxed(),
        Just(Reason::Failed).boxed(),
        Just(Reason::Cancelled).boxed(),
        Just(Reason::LeaseExpired).boxed(),
        Just(Reason::NodeDown).boxed(),
        Just(Reason::OutOfCredits).boxed(),
        Just(Reason::MaxDuration).boxed(),
        Just(Reason::Unpriced).boxed(),
        Just(Reason::Fenced).boxed(),
        Just(Reason::Deduplicated).boxed(),
        Just(Reason::DedupReleased).boxed(),
    ]
}

fn placement() -> impl Strategy<Value = Placement> {
    (n64(), vec(any::<u8>(), 0..8), gpu_type(), n64(), n64()).prop_map(
        |(node, gpu_indices, gpu_type, price, started)| Placement {
            node: NodeId(node),
            gpu_indices,
            gpu_type,
            price_micro_per_gpu_hour: price,
            started_ms: started,
        },
    )
}

fn job() -> impl Strategy<Value = Job> {
    (
        (job_spec(), org(), job_state(), n32(), n64(), n64()),
        (of(placement()), n64(), n32(), n64(), reason(), opt64()),
        (
            opt64(),
            opt64(),
            opt64(),
            of(n64().prop_map(NodeId)),
            vec(n64(), 0..4),
            n32(),
            of(job_key()),
        ),
    )
        .prop_map(
            |(
                (spec, org, state, attempt, submitted_ms, queued_since_ms),
                (placement, run_ms, preemptions, hold_micro, last_reason, finished_ms),
                (lease_at, deadline_at, grace_at, reserved_node, waits_ms, node_failures, pf),
            )| Job {
                spec,
                org,
                state,
                attempt,
                submitted_ms,
                queued_since_ms,
                placement,
                run_ms,
                preemptions,
                hold_micro,
                last_reason,
                finished_ms,
                lease_at,
                deadline_at,
                grace_at,
                reserved_node,
                waits_ms,
                node_failures,
                preempted_for: pf,
            },
        )
}

fn gpu_node() -> impl Strategy<Value = GpuNode> {
    let state = prop_oneof![
        Just(NodeState::Ready),
        Just(NodeState::Draining),
        Just(NodeState::Down)
    ];
    (
        (n64(), gpu_type(), n32(), n32(), vec((text(), text()), 0..4)),
        (
            state,
            n64(),
            any::<bool>(),
            vec(of(job_key()), 0..8),
            of(job_key()),
            n64(),
        ),
    )
        .prop_map(
            |(
                (id, gpu_type, gpu_count, gpu_mem_gb, labels),
                (state, lease_until_ms, lapsed, slots, reserved_for, incarnation),
            )| GpuNode {
                id: NodeId(id),
                gpu_type,
                gpu_count,
                gpu_mem_gb,
                labels,
                state,
                lease_until_ms,
                lapsed,
                slots,
                reserved_for,
                incarnation,
            },
        )
}

fn budget_view() -> impl Strategy<Value = BudgetView> {
    let mode = prop_oneof![Just(BudgetMode::Hard), Just(BudgetMode::Soft)];
    (
        of(
            (n64(), period(), mode).prop_map(|(limit_micro, period, mode)| BudgetSpec {
                limit_micro,
                period,
                mode,
            }),
        ),
        n64(),
        (n64(), n32(), n64(), n32(), n64(), n64()),
    )
        .prop_map(
            |(budget, used_micro, (held, day, spent_day, month, spent_month, spent_total))| {
                BudgetView {
                    budget,
                    used_micro,
                    usage: Usage {
                        held,
                        day,
                        spent_day,
                        month,
                        spent_month,
                        spent_total,
                    },
                }
            },
        )
}

fn scheduler_settings() -> impl Strategy<Value = SchedulerSettings> {
    let tier_config = (text(), n32(), n32(), n32(), n64(), n32()).prop_map(
        |(name, weight, floor_pct, ceiling_pct, max_wait_ms, price_pct)| TierConfig {
            name,
            weight,
            floor_pct,
            ceiling_pct,
            max_wait_ms,
            price_pct,
        },
    );
    (
        proptest::array::uniform7(n64()),
        n32(),
        n32(),
        vec(tier_config, 0..4),
        n64(),
    )
        .prop_map(
            |(ms, preemptions, requeues, tiers, fence)| SchedulerSettings {
                node_lease_ms: ms[0],
                job_lease_ms: ms[1],
                grace_ms: ms[2],
                min_runtime_ms: ms[3],
                hysteresis_ms: ms[4],
                preemptions_per_job_max: preemptions,
                preemption_loss_max_gpu_ms: ms[5],
                usage_half_life_ms: ms[6],
                node_failure_requeues_max: requeues,
                tiers,
                fence_margin_ms: fence,
            },
        )
}

fn token_scope() -> impl Strategy<Value = Scope> {
    prop_oneof![
        Just(Scope::Admin),
        org().prop_map(Scope::Org),
        (org(), n64()).prop_map(|(org, p)| Scope::Project {
            org,
            project: ProjectId(p)
        }),
        n64().prop_map(|n| Scope::Agent(NodeId(n))),
        (org(), n64(), n64()).prop_map(|(org, p, u)| Scope::User {
            org,
            project: ProjectId(p),
            user: UserId(u)
        }),
    ]
}

fn tenancy() -> impl Strategy<Value = TenancyView> {
    let plan = (tiers(), vec((n64().prop_map(ProjectId), tiers()), 0..3)).prop_map(
        |(tiers, project_tiers)| Plan {
            tiers,
            project_tiers,
        },
    );
    (
        quota(),
        any::<bool>(),
        of(plan),
        tiers(),
        proptest::array::uniform10(n32()),
    )
        .prop_map(|(q, quota_set, plan, tiers, u)| TenancyView {
            quota: q,
            quota_set,
            plan,
            tiers,
            used: QuotaUse {
                queued: u[0],
                running: u[1],
                holds_open: u[2],
                records: u[3],
                buckets: u[4],
                principals: u[5],
                projects: u[6],
                users: u[7],
                finished_jobs: u[8],
                settled_holds: u[9],
            },
        })
}

fn bucket_view() -> impl Strategy<Value = BucketView> {
    let policy = (vec(gpu_type(), 0..3), tiers())
        .prop_map(|(gpu_types, tiers)| BucketPolicy { gpu_types, tiers });
    (
        (
            n64(),
            kind(),
            any::<u8>(),
            opt64(),
            of(policy),
            // `Some("")` included: the reference is carried as it is.
            of(text()),
            any::<bool>(),
        ),
        proptest::array::uniform7(n64()),
        opt64(),
    )
        .prop_map(
            |(
                (bucket, kind, priority, expires_at_ms, policy, source_ref, spendable),
                f,
                closed_at_ms,
            )| BucketView {
                bucket: BucketId(bucket),
                kind,
                priority,
                expires_at_ms,
                policy,
                source_ref,
                spendable,
                remaining_micro: f[0],
                held_micro: f[1],
                issued_micro: f[2],
                moved_in_micro: f[3],
                consumed_micro: f[4],
                expired_micro: f[5],
                moved_out_micro: f[6],
                closed_at_ms,
            },
        )
}

fn type_demand() -> impl Strategy<Value = TypeDemand> {
    let tier_demand = (tier(), proptest::array::uniform5(n64()), opt64(), n32()).prop_map(
        |(tier, f, wait_ms, gpus_needed)| TierDemand {
            tier,
            queued_jobs: f[0],
            queued_gpu_ms: f[1],
            target_wait_ms: f[2],
            wait_ms,
            overdue_jobs: f[3],
            overdue_gpus: f[4],
            gpus_needed,
        },
    );
    (
        gpu_type(),
        n32(),
        n32(),
        n64(),
        n64(),
        opt64(),
        vec(tier_demand, 0..4),
    )
        .prop_map(
            |(gpu_type, capacity_gpus, used_gpus, queued_jobs, queued_gpu_ms, wait_ms, tiers)| {
                TypeDemand {
                    gpu_type,
                    capacity_gpus,
                    used_gpus,
                    queued_jobs,
                    queued_gpu_ms,
                    wait_ms,
                    tiers,
                }
            },
        )
}

fn any_answer() -> impl Strategy<Value = Answer> {
    let usage_row = (budget_scope(), org(), n64(), n64(), n64(), n32(), n32()).prop_map(
        |(scope, org, used_micro, held_micro, gpu_ms_decayed, running_gpus, share_weight)| {
            UsageRow {
                scope,
                org,
                used_micro,
                held_micro,
                gpu_ms_decayed,
                running_gpus,
                share_weight,
            }
        },
    );
    prop_oneof![
        of(balance()).prop_map(Answer::Balance).boxed(),
        of(job().prop_map(Box::new)).prop_map(Answer::Job).boxed(),
        (
            any::<u64>(),
            vec(
                (job_key(), n32(), vec(any::<u8>(), 0..8), job_state()),
                0..4
            )
        )
            .prop_map(|(incarnation, rows)| Answer::Assignments { incarnation, rows })
            .boxed(),
        btree_map(
            tier(),
            prop_oneof![Just(0usize), Just(usize::MAX), any::<usize>()],
            0..4
        )
        .prop_map(Answer::QueueDepth)
        .boxed(),
        proptest::array::uniform4(n128())
            .prop_map(|t| Answer::Totals(Totals {
                issued: t[0],
                consumed: t[1],
                expired: t[2],
                moved: t[3],
            }))
            .boxed(),
        prop_oneof![Just(Ok(())), text().prop_map(Err)]
            .prop_map(Answer::Invariants)
            .boxed(),
        any::<[u8; 32]>().prop_map(Answer::StateHash).boxed(),
        (n32(), n32())
            .prop_map(|(gpus, used)| Answer::Fleet { gpus, used })
            .boxed(),
        (vec(job(), 0..3), of(n64().prop_map(JobId)), of(org()))
            .prop_map(|(jobs, next, next_org)| Answer::Jobs(JobsPage {
                jobs,
                next,
                next_org
            }))
            .boxed(),
        vec(gpu_node(), 0..3).prop_map(Answer::Nodes).boxed(),
        vec(
            (tier(), n64(), n64(), n32()).prop_map(|(tier, queued, wait, gpus)| TierQueue {
                tier,
                queued,
                oldest_wait_ms: wait,
                running_gpus: gpus,
            }),
            0..4
        )
        .prop_map(Answer::Queue)
        .boxed(),
        (n32(), n64(), btree_map(gpu_type(), n64(), 0..4))
            .prop_map(|(version, since_ms, prices)| Answer::Prices(PriceTable {
                version,
                since_ms,
                prices
            }))
            .boxed(),
        of(budget_view()).prop_map(Answer::Budget).boxed(),
        scheduler_settings()
            .prop_map(Answer::SchedulerSettings)
            .boxed(),
        vec(usage_row, 0..4).prop_map(Answer::Usage).boxed(),
        vec((of(org()), token_scope(), any::<bool>()), 0..4)
            .prop_map(Answer::Principals)
            .boxed(),
        of(tenancy().prop_map(Box::new))
            .prop_map(Answer::Tenancy)
            .boxed(),
        of(vec(bucket_view(), 0..3))
            .prop_map(Answer::Buckets)
            .boxed(),
        vec(type_demand(), 0..3).prop_map(Answer::Demand).boxed(),
    ]
}

/// Which variant (exhaustive, as [`query_variant`]).
fn answer_variant(a: &Answer) -> usize {
    match a {
        Answer::Balance(_) => 0,
        Answer::Job(_) => 1,
        Answer::Assignments { .. } => 2,
        Answer::QueueDepth(_) => 3,
        Answer::Totals(_) => 4,
        Answer::Invariants(_) => 5,
        Answer::StateHash(_) => 6,
        Answer::Fleet { .. } => 7,
        Answer::Jobs(_) => 8,
        Answer::Nodes(_) => 9,
        Answer::Queue(_) => 10,
        Answer::Prices(_) => 11,
        Answer::Budget(_) => 12,
        Answer::SchedulerSettings(_) => 13,
        Answer::Usage(_) => 14,
        Answer::Principals(_) => 15,
        Answer::Tenancy(_) => 16,
        Answer::Buckets(_) => 17,
        Answer::Demand(_) => 18,
    }
}
const ANSWER_VARIANTS: usize = 19;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_query_round_trips(q in any_query()) {
        prop_assert_eq!(query_round_trip(&q).unwrap(), q);
    }

    #[test]
    fn every_answer_round_trips(a in any_answer()) {
        prop_assert_eq!(answer_round_trip(&a).unwrap(), a);
    }

    /// The org a query names survives the trip, so a node that routes by the typed
    /// request routes where the query goes.
    #[test]
    fn a_querys_org_survives_the_wire(q in any_query()) {
        let back = query_round_trip(&q).unwrap();
        prop_assert_eq!(query_org(&back), query_org(&q));
    }

    /// Jobs on their own, many of them: the biggest view, with every bookkeeping field.
    #[test]
    fn jobs_round_trip_whole(j in job()) {
        let a = Answer::Job(Some(Box::new(j)));
        prop_assert_eq!(answer_round_trip(&a).unwrap(), a);
    }
}

/// The generators reach every variant (so the round-trip properties cover them all).
#[test]
fn the_generators_cover_every_variant() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (queries, answers) = (any_query(), any_answer());
    let mut seen_q = [false; QUERY_VARIANTS];
    let mut seen_a = [false; ANSWER_VARIANTS];
    for _ in 0..2_000 {
        let q = queries.new_tree(&mut runner).expect("query").current();
        seen_q[query_variant(&q)] = true;
        let a = answers.new_tree(&mut runner).expect("answer").current();
        seen_a[answer_variant(&a)] = true;
    }
    assert!(seen_q.iter().all(|s| *s), "queries seen: {seen_q:?}");
    assert!(seen_a.iter().all(|s| *s), "answers seen: {seen_a:?}");
}

#[test]
fn the_org_of_a_query_is_the_one_it_names() {
    let o = OrgId(7);
    let named = [
        Query::Balance {
            org: o,
            account: Account::Project(ProjectId(70)),
            horizon_ms: 0,
        },
        Query::Buckets {
            org: o,
            account: Account::Org(o),
        },
        Query::Job(o, JobId(1)),
        Query::Budget(o, BudgetScope::User(UserId(700))),
        Query::Tenancy(o),
        Query::Jobs(JobFilter {
            org: Some(o),
            ..JobFilter::default()
        }),
        Query::Usage(UsageQuery {
            level: UsageLevel::Project,
            org: Some(o),
            period: BudgetPeriod::Month,
            limit: 0,
        }),
    ];
    for q in &named {
        assert_eq!(query_org(q), Some(o), "{q:?}");
    }
    let shard_wide = [
        Query::Assignments(NodeId(7)),
        Query::QueueDepth,
        Query::Totals,
        Query::Invariants,
        Query::StateHash,
        Query::Fleet,
        Query::Nodes,
        Query::Queue,
        Query::Prices,
        Query::SchedulerSettings,
        Query::Principals(PrincipalId(7)),
        Query::Demand(DemandQuery { run_pct: 50 }),
        // An admin's listing of every org (the org of `after_org` is a cursor, not a
        // home shard).
        Query::Jobs(JobFilter {
            after_org: Some(o),
            ..JobFilter::default()
        }),
        Query::Usage(UsageQuery {
            level: UsageLevel::Org,
            org: None,
            period: BudgetPeriod::Day,
            limit: 5,
        }),
    ];
    for q in &shard_wide {
        assert_eq!(query_org(q), None, "{q:?}");
    }
}

/// The pieces of a typed query a server reads to route it: the org is a plain field of
/// the arm's message.
#[test]
fn the_org_is_a_field_of_the_request() {
    let q = query_to(&Query::Budget(
        OrgId(9),
        BudgetScope::Project(ProjectId(90)),
    ));
    match q {
        pb::query_request::Query::Budget(b) => {
            assert_eq!(b.org, 9);
            assert_eq!(
                b.scope.and_then(|s| s.scope),
                Some(pb::budget_scope::Scope::Project(90))
            );
        }
        other => panic!("{other:?}"),
    }
}

fn refused_query(q: pb::query_request::Query) -> allot_proto::typed::FieldError {
    let m = wire(&pb::QueryRequest {
        read: None,
        query: Some(q),
    });
    query_from(m.query.as_ref()).unwrap_err()
}

fn refused_answer(a: pb::query_reply::Answer) -> allot_proto::typed::FieldError {
    let m = wire(&pb::QueryReply {
        applied_index: 1,
        logical_time_ms: 1,
        answer: Some(a),
    });
    answer_from(m.answer.as_ref()).unwrap_err()
}

#[test]
fn unknown_enum_values_and_missing_fields_are_refused_naming_the_field() {
    use pb::query_request::Query as Q;
    // A newer client's job state.
    let mut f = match query_to(&Query::Jobs(JobFilter {
        state: Some(JobState::Running),
        ..JobFilter::default()
    })) {
        Q::Jobs(f) => f,
        other => panic!("{other:?}"),
    };
    f.state = 99;
    let e = refused_query(Q::Jobs(f));
    assert_eq!(e.field, "jobs.state");
    assert_eq!(e.problem, "unknown value 99");
    // Unspecified is "any state", not an error.
    f.state = 0;
    assert_eq!(
        query_from(Some(&Q::Jobs(f))).unwrap(),
        Query::Jobs(JobFilter::default())
    );

    // Usage: an unknown level, an unspecified period.
    let u = pb::UsageQuery {
        level: 42,
        org: None,
        period: pb::BudgetPeriod::Day as i32,
        limit: 0,
    };
    let e = refused_query(Q::Usage(u));
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("usage.level", "unknown value 42")
    );
    let u = pb::UsageQuery {
        level: pb::UsageLevel::User as i32,
        period: 0,
        ..u
    };
    let e = refused_query(Q::Usage(u));
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("usage.period", "required")
    );

    // Required messages and oneofs.
    let e = refused_query(Q::Balance(pb::BalanceQuery {
        org: 1,
        account: None,
        horizon_ms: 0,
    }));
    assert_eq!(e.field, "balance.account");
    let e = refused_query(Q::Buckets(pb::BucketsQuery {
        org: 1,
        account: None,
    }));
    assert_eq!(e.field, "buckets.account");
    let e = refused_query(Q::Budget(pb::BudgetQuery {
        org: 1,
        scope: Some(pb::BudgetScope { scope: None }),
    }));
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("budget.scope", "required")
    );

    // No query at all.
    let e = query_from(None).unwrap_err();
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("query", "required")
    );
    let empty = wire(&pb::QueryRequest::default());
    assert_eq!(query_from(empty.query.as_ref()).unwrap_err().field, "query");
    let e = answer_from(None).unwrap_err();
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("answer", "required")
    );
}

#[test]
fn answers_out_of_shape_are_refused_naming_the_field() {
    use pb::query_reply::Answer as A;
    // A hash of the wrong length.
    let e = refused_answer(A::StateHash(pb::StateHashAnswer {
        sha256: vec![0; 31],
    }));
    assert_eq!(e.field, "state_hash.sha256");
    assert!(e.problem.contains("31"), "{e}");
    assert!(answer_from(Some(&A::StateHash(pb::StateHashAnswer {
        sha256: vec![7; 32]
    })))
    .is_ok());

    // A tier past u8, deep in a list.
    let e = refused_answer(A::Queue(pb::QueueAnswer {
        tiers: vec![
            pb::TierQueue::default(),
            pb::TierQueue {
                tier: 256,
                ..Default::default()
            },
        ],
    }));
    assert_eq!(e.field, "queue.tiers[1].tier");

    // A job's spec tier, its state and its reason, nested in the job answer.
    let job = Job {
        spec: JobSpec {
            job: JobId(1),
            project: ProjectId(2),
            user: UserId(3),
            tier: Tier(1),
            gpu_types: vec![GpuType::new("A100")],
            gpus: 1,
            mem_floor_gb: 0,
            preemptible: true,
            checkpointable: false,
            max_duration_ms: 60_000,
        },
        org: OrgId(4),
        state: JobState::Running,
        attempt: 1,
        submitted_ms: 10,
        queued_since_ms: 10,
        placement: Some(Placement {
            node: NodeId(5),
            gpu_indices: vec![0],
            gpu_type: GpuType::new("A100"),
            price_micro_per_gpu_hour: 1,
            started_ms: 11,
        }),
        run_ms: 0,
        preemptions: 0,
        hold_micro: 100,
        last_reason: Reason::Started,
        finished_ms: None,
        lease_at: Some(20),
        deadline_at: None,
        grace_at: None,
        reserved_node: None,
        waits_ms: vec![1],
        node_failures: 0,
        preempted_for: None,
    };
    let detail = match answer_to(&Answer::Job(Some(Box::new(job)))) {
        A::Job(j) => j.job.expect("a job"),
        other => panic!("{other:?}"),
    };
    let with = |f: &dyn Fn(&mut pb::JobDetail)| {
        let mut d = detail.clone();
        f(&mut d);
        refused_answer(A::Job(pb::JobAnswer { job: Some(d) }))
    };
    let e = with(&|d| d.job.as_mut().unwrap().spec.as_mut().unwrap().tier = 300);
    assert_eq!(e.field, "job.job.job.spec.tier");
    let e = with(&|d| d.job.as_mut().unwrap().state = 77);
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("job.job.job.state", "unknown value 77")
    );
    let e = with(&|d| d.job.as_mut().unwrap().spec = None);
    assert_eq!(e.field, "job.job.job.spec");
    let e = with(&|d| {
        d.job
            .as_mut()
            .unwrap()
            .placement
            .as_mut()
            .unwrap()
            .gpu_indices = vec![0, 256]
    });
    assert_eq!(e.field, "job.job.job.placement.gpu_indices[1]");
    let e = with(&|d| d.last_reason = None);
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("job.job.last_reason", "required")
    );
    let e = with(&|d| d.last_reason.as_mut().unwrap().kind = 500);
    assert_eq!(e.field, "job.job.last_reason.kind");
    let e = with(&|d| d.job = None);
    assert_eq!(e.field, "job.job.job");

    // Totals without a figure; a node in an unknown state.
    let e = refused_answer(A::Totals(pb::Totals::default()));
    assert_eq!(e.field, "totals.issued_micro");
    let e = refused_answer(A::Nodes(pb::NodesAnswer {
        nodes: vec![pb::GpuNode {
            state: 9,
            ..Default::default()
        }],
    }));
    assert_eq!(e.field, "nodes.nodes[0].state");
    // A bucket's priority past u8; a principal's scope missing.
    let e = refused_answer(A::Buckets(pb::BucketsAnswer {
        buckets: Some(pb::BucketList {
            buckets: vec![pb::BucketView {
                kind: pb::BucketKind::Paid as i32,
                priority: 256,
                ..Default::default()
            }],
        }),
    }));
    assert_eq!(e.field, "buckets.buckets.buckets[0].priority");
    let e = refused_answer(A::Principals(pb::PrincipalsAnswer {
        principals: vec![pb::PrincipalRow::default()],
    }));
    assert_eq!(e.field, "principals.principals[0].scope");
    // A demand row's tier past u8.
    let e = refused_answer(A::Demand(pb::DemandAnswer {
        types: vec![pb::GpuTypeDemand {
            tiers: vec![
                pb::TierDemand::default(),
                pb::TierDemand {
                    tier: 256,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }],
    }));
    assert_eq!(e.field, "demand.types[0].tiers[1].tier");
}

/// Absent and empty are different answers, and stay so.
#[test]
fn none_and_empty_stay_apart() {
    for a in [
        Answer::Buckets(None),
        Answer::Buckets(Some(Vec::new())),
        Answer::Balance(None),
        Answer::Balance(Some(Balance::default())),
        Answer::Invariants(Ok(())),
        Answer::Invariants(Err(String::new())),
        Answer::Tenancy(None),
        Answer::Budget(None),
        Answer::Job(None),
        Answer::Demand(Vec::new()),
    ] {
        assert_eq!(answer_round_trip(&a).unwrap(), a);
    }
    assert_ne!(
        answer_to(&Answer::Buckets(None)),
        answer_to(&Answer::Buckets(Some(Vec::new())))
    );
}

/// A newer peer's message: fields this schema does not know are skipped (proto3), and
/// the conversion reads the message as if they were absent.
#[test]
fn a_newer_peers_unknown_fields_are_ignored() {
    let q = Query::Jobs(JobFilter {
        org: Some(OrgId(3)),
        state: Some(JobState::Queued),
        limit: 10,
        ..JobFilter::default()
    });
    let req = pb::QueryRequest {
        read: Some(pb::Read {
            shard: None,
            stale_ok: false,
        }),
        query: Some(query_to(&q)),
    };
    let mut bytes = req.encode_to_vec();
    prost::encoding::uint64::encode(1000, &5, &mut bytes);
    prost::encoding::string::encode(1001, &"from the future".to_string(), &mut bytes);
    let newer = pb::QueryRequest::decode(bytes.as_slice()).expect("unknown fields skipped");
    assert_eq!(newer, req);
    assert_eq!(query_from(newer.query.as_ref()).unwrap(), q);

    // Inside the arm's own message too.
    let mut inner = pb::JobFilter::default().encode_to_vec();
    prost::encoding::uint64::encode(1000, &5, &mut inner);
    let filter = pb::JobFilter::decode(inner.as_slice()).expect("decodes");
    assert_eq!(
        query_from(Some(&pb::query_request::Query::Jobs(filter))).unwrap(),
        Query::Jobs(JobFilter::default())
    );

    // And in a reply.
    let a = Answer::Fleet { gpus: 8, used: 3 };
    let reply = pb::QueryReply {
        applied_index: 1,
        logical_time_ms: 2,
        answer: Some(answer_to(&a)),
    };
    let mut bytes = reply.encode_to_vec();
    prost::encoding::uint64::encode(1000, &u64::MAX, &mut bytes);
    let newer = pb::QueryReply::decode(bytes.as_slice()).expect("unknown fields skipped");
    assert_eq!(newer, reply);
    assert_eq!(answer_from(newer.answer.as_ref()).unwrap(), a);
}

/// A 128-bit total is carried whole (a 64-bit field would wrap).
#[test]
fn totals_past_64_bits_are_exact() {
    let t = Totals {
        issued: u128::MAX,
        consumed: u128::from(u64::MAX) + 1,
        expired: 1 << 100,
        moved: 0,
    };
    let m = match answer_to(&Answer::Totals(t)) {
        pb::query_reply::Answer::Totals(m) => m,
        other => panic!("{other:?}"),
    };
    assert_eq!(m.consumed_micro, Some(pb::Uint128 { high: 1, low: 0 }));
    assert_eq!(
        answer_round_trip(&Answer::Totals(t)).unwrap(),
        Answer::Totals(t)
    );
}

/// A demand row without a finite wait (work and no capacity) and one with a zero wait
/// (nothing queued) stay apart on the wire.
#[test]
fn demand_waits_unset_and_zero_stay_apart() {
    let row = |wait_ms| TypeDemand {
        gpu_type: GpuType::new("H100"),
        capacity_gpus: 0,
        used_gpus: 8,
        queued_jobs: 2,
        queued_gpu_ms: 57_600_000,
        wait_ms,
        tiers: vec![TierDemand {
            tier: Tier(1),
            queued_jobs: 2,
            queued_gpu_ms: 57_600_000,
            target_wait_ms: 600_000,
            wait_ms,
            overdue_jobs: 1,
            overdue_gpus: 4,
            gpus_needed: 96,
        }],
    };
    let (none, zero) = (
        Answer::Demand(vec![row(None)]),
        Answer::Demand(vec![row(Some(0))]),
    );
    assert_eq!(answer_round_trip(&none).unwrap(), none);
    assert_eq!(answer_round_trip(&zero).unwrap(), zero);
    assert_ne!(answer_to(&none), answer_to(&zero));
    assert_eq!(
        query_round_trip(&Query::Demand(DemandQuery { run_pct: 0 })).unwrap(),
        Query::Demand(DemandQuery::default())
    );
}
