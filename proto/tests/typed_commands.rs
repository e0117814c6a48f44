//! Every command a client sends, every reply and every refusal, through the typed API's
//! messages *and their wire bytes* and back (property tests over generated values):
//! what the Rust client sends on `Api.Execute` is what the shard applies.

use allot_proto::api::v1 as pb;
use allot_proto::typed;
use allot_statemachine::alerts::AlertSpec;
use allot_statemachine::scheduler::{SchedulerSettings, TierConfig};
use allot_statemachine::security::Scope as TokenScope;
use allot_statemachine::*;
use proptest::prelude::*;

mod common;
use common::*;

fn gpu_type() -> impl Strategy<Value = GpuType> {
    "[A-Z0-9_-]{1,12}".prop_map(GpuType)
}

fn gpu_types() -> impl Strategy<Value = Vec<GpuType>> {
    proptest::collection::vec(gpu_type(), 0..4)
}

fn tiers() -> impl Strategy<Value = Vec<Tier>> {
    proptest::collection::vec(any::<u8>().prop_map(Tier), 0..4)
}

/// A scope in `org`.
fn scope(org: u64) -> impl Strategy<Value = BudgetScope> {
    prop_oneof![
        Just(BudgetScope::Org(OrgId(org))),
        any::<u64>().prop_map(|p| BudgetScope::Project(ProjectId(p))),
        any::<u64>().prop_map(|u| BudgetScope::User(UserId(u))),
    ]
}

fn token_scope() -> impl Strategy<Value = TokenScope> {
    prop_oneof![
        Just(TokenScope::Admin),
        any::<u64>().prop_map(|o| TokenScope::Org(OrgId(o))),
        any::<[u64; 2]>().prop_map(|[o, p]| TokenScope::Project {
            org: OrgId(o),
            project: ProjectId(p)
        }),
        any::<[u64; 3]>().prop_map(|[o, p, u]| TokenScope::User {
            org: OrgId(o),
            project: ProjectId(p),
            user: UserId(u)
        }),
        any::<u64>().prop_map(|n| TokenScope::Agent(NodeId(n))),
    ]
}

fn grant(org: u64) -> impl Strategy<Value = Grant> {
    (
        any::<u64>(),
        prop_oneof![
            Just(Account::Org(OrgId(org))),
            any::<u64>().prop_map(|p| Account::Project(ProjectId(p)))
        ],
        kind(),
        any::<u64>(),
        proptest::option::of(any::<u64>()),
        any::<u8>(),
        proptest::option::of((gpu_types(), tiers())),
        proptest::option::of("[a-z0-9-]{1,20}"),
    )
        .prop_map(
            |(bucket, owner, kind, amount, expires, priority, policy, source_ref)| Grant {
                bucket: BucketId(bucket),
                owner,
                kind,
                amount_micro: amount,
                expires_at_ms: expires,
                priority,
                policy: policy.map(|(gpu_types, tiers)| BucketPolicy { gpu_types, tiers }),
                source_ref,
            },
        )
}

fn job_spec() -> impl Strategy<Value = JobSpec> {
    (
        any::<[u64; 4]>(),
        any::<u8>(),
        gpu_types(),
        any::<[u32; 2]>(),
        any::<[bool; 2]>(),
    )
        .prop_map(
            |([job, project, user, max], tier, types, [gpus, mem], [p, c])| JobSpec {
                job: JobId(job),
                project: ProjectId(project),
                user: UserId(user),
                tier: Tier(tier),
                gpu_types: types,
                gpus,
                mem_floor_gb: mem,
                preemptible: p,
                checkpointable: c,
                max_duration_ms: max,
            },
        )
}

fn settings() -> impl Strategy<Value = SchedulerSettings> {
    (
        any::<[u64; 8]>(),
        any::<[u32; 2]>(),
        proptest::collection::vec(
            ("[a-z]{1,8}", any::<[u32; 4]>(), any::<u64>()).prop_map(
                |(name, [weight, floor_pct, ceiling_pct, price_pct], max_wait_ms)| TierConfig {
                    name,
                    weight,
                    floor_pct,
                    ceiling_pct,
                    max_wait_ms,
                    price_pct,
                },
            ),
            0..4,
        ),
    )
        .prop_map(|(u, [p, n], tiers)| SchedulerSettings {
            node_lease_ms: u[0],
            job_lease_ms: u[1],
            grace_ms: u[2],
            min_runtime_ms: u[3],
            hysteresis_ms: u[4],
            preemptions_per_job_max: p,
            preemption_loss_max_gpu_ms: u[5],
            usage_half_life_ms: u[6],
            node_failure_requeues_max: n,
            tiers,
            fence_margin_ms: u[7],
        })
}

fn digest() -> impl Strategy<Value = TokenDigest> {
    any::<[u8; 32]>().prop_map(TokenDigest)
}

/// Every command a client sends, with the org the request acts in as the typed API
/// carries it (the command's own org where it names one).
fn command() -> impl Strategy<Value = (Command, Option<OrgId>)> {
    fn with(org: u64, c: Command) -> (Command, Option<OrgId>) {
        (c, Some(OrgId(org)))
    }
    let o = any::<u64>();
    prop_oneof![
        o.prop_map(move |org| with(org, Command::CreateOrg { org: OrgId(org) })),
        (o, o).prop_map(move |(org, p)| with(
            org,
            Command::CreateProject {
                project: ProjectId(p),
                org: OrgId(org)
            }
        )),
        (o, o).prop_map(move |(org, u)| with(
            org,
            Command::CreateUser {
                user: UserId(u),
                org: OrgId(org)
            }
        )),
        proptest::collection::vec((gpu_type(), any::<u64>()), 0..4)
            .prop_map(|prices| (Command::SetPrices { prices }, None)),
        o.prop_flat_map(|org| grant(org).prop_map(move |g| with(org, Command::IssueGrant(g)))),
        (o, any::<u64>()).prop_flat_map(|(org, ms)| grant(org).prop_map(move |g| with(
            org,
            Command::IssueGrantIn {
                grant: Grant {
                    expires_at_ms: None,
                    ..g
                },
                expires_in_ms: ms
            }
        ))),
        o.prop_flat_map(|org| (
            scope(org),
            proptest::option::of((
                any::<u64>(),
                prop_oneof![
                    Just(BudgetPeriod::Day),
                    Just(BudgetPeriod::Month),
                    Just(BudgetPeriod::Lifetime)
                ],
                prop_oneof![Just(BudgetMode::Hard), Just(BudgetMode::Soft)]
            ))
        )
            .prop_map(move |(scope, b)| with(
                org,
                Command::SetBudget {
                    scope,
                    budget: b.map(|(limit_micro, period, mode)| BudgetSpec {
                        limit_micro,
                        period,
                        mode
                    })
                }
            ))),
        (o, any::<[u64; 4]>(), any::<u8>(), gpu_types()).prop_map(
            move |(org, [h, p, u, a], t, g)| with(
                org,
                Command::CreateHold(HoldSpec {
                    hold: HoldId(h),
                    project: ProjectId(p),
                    user: UserId(u),
                    tier: Tier(t),
                    gpu_types: g,
                    amount_micro: a
                })
            )
        ),
        (o, any::<[u64; 2]>()).prop_map(move |(org, [h, a])| with(
            org,
            Command::Capture {
                hold: HoldId(h),
                amount_micro: a
            }
        )),
        (o, any::<[u64; 2]>()).prop_map(move |(org, [h, a])| with(
            org,
            Command::TopUp {
                hold: HoldId(h),
                amount_micro: a
            }
        )),
        (o, o).prop_map(move |(org, h)| with(org, Command::ReleaseHold { hold: HoldId(h) })),
        (o, o, any::<[u32; 2]>(), gpu_type()).prop_map(move |(org, h, [a, n], g)| with(
            org,
            Command::StartMeter {
                hold: HoldId(h),
                attempt: a,
                gpu_type: g,
                gpus: n
            }
        )),
        (o, any::<[u64; 3]>(), any::<[u32; 2]>()).prop_map(move |(org, [h, s, c], [a, p])| with(
            org,
            Command::Heartbeat(Heartbeat {
                hold: HoldId(h),
                attempt: a,
                seq: s,
                progress_ppm: p,
                checkpoint: c
            })
        )),
        (o, o, any::<u32>(), settle_reason()).prop_map(move |(org, h, a, reason)| with(
            org,
            Command::Settle {
                hold: HoldId(h),
                attempt: a,
                reason
            }
        )),
        (o, any::<[u64; 3]>(), any::<[bool; 2]>()).prop_map(move |(org, [x, y, a], [px, py])| {
            let acct = |p: bool, id: u64| {
                if p {
                    Account::Project(ProjectId(id))
                } else {
                    Account::Org(OrgId(org))
                }
            };
            with(
                org,
                Command::Transfer {
                    from: acct(px, x),
                    to: acct(py, y),
                    amount_micro: a,
                },
            )
        }),
        Just((Command::Tick, None)),
        (
            o,
            gpu_type(),
            any::<[u32; 2]>(),
            proptest::collection::btree_map("[a-z]{1,6}", "[a-z0-9]{0,6}", 0..4),
            any::<u64>(),
        )
            .prop_map(|(n, g, [c, m], labels, incarnation)| (
                Command::RegisterNode(NodeSpec {
                    node: NodeId(n),
                    gpu_type: g,
                    gpu_count: c,
                    gpu_mem_gb: m,
                    labels: labels.into_iter().collect(),
                    incarnation,
                }),
                None
            )),
        o.prop_map(|n| (Command::NodeHeartbeat { node: NodeId(n) }, None)),
        (o, any::<bool>()).prop_map(|(n, d)| (
            Command::SetNodeDraining {
                node: NodeId(n),
                draining: d
            },
            None
        )),
        (o, job_spec()).prop_map(move |(org, s)| with(org, Command::SubmitJob(s))),
        (o, job_spec(), proptest::collection::vec(any::<u8>(), 0..80)).prop_map(
            move |(org, spec, key)| with(
                org,
                Command::SubmitJobDedup {
                    spec,
                    key: DedupKey(key)
                }
            )
        ),
        (o, o).prop_map(move |(org, j)| with(org, Command::CancelJob { job: JobId(j) })),
        (o, any::<[u64; 3]>(), any::<[u32; 2]>()).prop_map(move |(org, [j, s, c], [a, p])| with(
            org,
            Command::JobHeartbeat(JobHeartbeat {
                job: JobId(j),
                attempt: a,
                seq: s,
                progress_ppm: p,
                checkpoint: c
            })
        )),
        (o, o, any::<u32>(), any::<bool>()).prop_map(move |(org, j, a, s)| with(
            org,
            Command::FinishJob {
                job: JobId(j),
                attempt: a,
                success: s
            }
        )),
        (o, o, any::<u32>(), any::<bool>(), any::<[u64; 2]>()).prop_map(
            move |(org, j, a, s, [seq, after])| with(
                org,
                Command::FinishJobAt {
                    job: JobId(j),
                    attempt: a,
                    success: s,
                    exit: RunnerExit {
                        heartbeat_seq: seq,
                        after_ms: after
                    }
                }
            )
        ),
        (o, proptest::option::of(quota())).prop_map(move |(org, quota)| with(
            org,
            Command::SetQuota {
                org: OrgId(org),
                quota
            }
        )),
        settings().prop_map(|s| (Command::ConfigureScheduler(s), None)),
        (o, digest()).prop_map(|(p, digest)| (
            Command::Bootstrap {
                principal: PrincipalId(p),
                digest
            },
            None
        )),
        (
            o,
            digest(),
            token_scope(),
            proptest::option::of(any::<u64>()),
            proptest::option::of(o.prop_map(OrgId))
        )
            .prop_map(|(p, digest, scope, expires_at_ms, org)| (
                Command::CreateToken {
                    principal: PrincipalId(p),
                    digest,
                    scope,
                    expires_at_ms
                },
                org
            )),
        (
            o,
            digest(),
            any::<u64>(),
            proptest::option::of(o.prop_map(OrgId))
        )
            .prop_map(|(p, digest, overlap_ms, org)| (
                Command::RotateToken {
                    principal: PrincipalId(p),
                    digest,
                    overlap_ms
                },
                org
            )),
        (o, proptest::option::of(o.prop_map(OrgId))).prop_map(|(p, org)| (
            Command::RevokeToken {
                principal: PrincipalId(p)
            },
            org
        )),
        o.prop_flat_map(|org| (scope(org), proptest::option::of(any::<u32>()))
            .prop_map(move |(scope, weight)| with(org, Command::SetShareWeight { scope, weight }))),
        (
            o,
            proptest::option::of((
                tiers(),
                proptest::collection::vec((any::<u64>().prop_map(ProjectId), tiers()), 0..3)
            ))
        )
            .prop_map(move |(org, plan)| with(
                org,
                Command::SetPlan {
                    org: OrgId(org),
                    plan: plan.map(|(tiers, project_tiers)| Plan {
                        tiers,
                        project_tiers
                    })
                }
            )),
        (o, o, any::<u32>()).prop_map(move |(org, j, a)| with(
            org,
            Command::JobFenced {
                job: JobId(j),
                attempt: a
            }
        )),
        o.prop_flat_map(|org| (
            scope(org),
            proptest::option::of((
                proptest::option::of(any::<u64>()),
                proptest::collection::vec(any::<u32>(), 0..8)
            ))
        )
            .prop_map(move |(scope, alert)| with(
                org,
                Command::SetAlert {
                    scope,
                    alert: alert.map(|(low_balance_micro, budget_pcts)| AlertSpec {
                        low_balance_micro,
                        budget_pcts
                    })
                }
            ))),
    ]
}

fn actor() -> impl Strategy<Value = Actor> {
    let o = any::<u64>();
    prop_oneof![
        o.prop_map(|p| Actor::Admin(PrincipalId(p))),
        (o, o).prop_map(|(org, p)| Actor::Tenant {
            org: OrgId(org),
            principal: PrincipalId(p)
        }),
        (o, o, o).prop_map(|(org, project, p)| Actor::Project {
            org: OrgId(org),
            project: ProjectId(project),
            principal: PrincipalId(p)
        }),
        (o, o, o, o).prop_map(|(org, project, user, p)| Actor::User {
            org: OrgId(org),
            project: ProjectId(project),
            user: UserId(user),
            principal: PrincipalId(p)
        }),
        o.prop_map(|n| Actor::Agent(NodeId(n))),
        Just(Actor::System),
        Just(Actor::Anonymous),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    let o = any::<u64>();
    prop_oneof![
        Just(Reply::Created),
        any::<u32>().prop_map(|version| Reply::PricesSet { version }),
        o.prop_map(|b| Reply::GrantIssued {
            bucket: BucketId(b)
        }),
        Just(Reply::BudgetSet),
        (o, proptest::collection::vec((o, o), 0..4)).prop_map(|(h, d)| Reply::HoldCreated {
            hold: HoldId(h),
            draws: d
                .into_iter()
                .map(|(b, a)| DrawReport {
                    bucket: BucketId(b),
                    amount_micro: a
                })
                .collect()
        }),
        (o, o).prop_map(|(c, h)| Reply::Captured {
            captured_micro: c,
            held_micro: h
        }),
        (o, o).prop_map(|(a, h)| Reply::ToppedUp {
            added_micro: a,
            held_micro: h
        }),
        (o, any::<u32>()).prop_map(|(p, v)| Reply::MeterStarted {
            price_micro_per_gpu_hour: p,
            price_version: v
        }),
        heartbeat_reply().prop_map(Reply::Heartbeat),
        settlement().prop_map(Reply::Settled),
        proptest::collection::vec(o.prop_map(BucketId), 0..4)
            .prop_map(|buckets| Reply::Transferred { buckets }),
        Just(Reply::Ticked),
        Just(Reply::NodeRegistered),
        Just(Reply::NodeUpdated),
        (o, o, job_state()).prop_map(|(j, h, state)| Reply::JobSubmitted {
            job: JobId(j),
            hold_micro: h,
            state
        }),
        (o, o, o, job_state()).prop_map(|(j, to, h, state)| Reply::JobAttached {
            job: JobId(j),
            to: JobId(to),
            hold_micro: h,
            state
        }),
        proptest::option::of(settlement()).prop_map(Reply::JobCancelled),
        heartbeat_reply().prop_map(Reply::JobHeartbeat),
        proptest::option::of(settlement()).prop_map(Reply::JobFinished),
        Just(Reply::QuotaSet),
        Just(Reply::SchedulerConfigured),
        Just(Reply::TokenSet),
        any::<u32>().prop_map(|count| Reply::DenialsRecorded { count }),
        Just(Reply::ShareWeightSet),
        Just(Reply::PlanSet),
        Just(Reply::AlertSet),
    ]
}

fn error() -> impl Strategy<Value = CommandError> {
    let o = any::<u64>();
    prop_oneof![
        Just(CommandError::AmountZero),
        Just(CommandError::MissingRequestId),
        Just(CommandError::UnknownOrg),
        (o, o).prop_map(|(n, a)| CommandError::InsufficientCredits {
            needed: n,
            available: a
        }),
        gpu_type().prop_map(CommandError::UnknownPrice),
        Just(CommandError::LimitReached(Limit::CommandBytes)),
    ]
}

proptest! {
    #[test]
    fn every_command_round_trips_as_an_execute_entry(
        (command, org) in command(),
        actor in actor(),
        request_id in 1..=u128::MAX,
    ) {
        let request = Request { actor, request_id, org, command };
        let m = wire(&typed::command_to(&request).expect("a client command"));
        let (header, command, org) = typed::command_from(&m).unwrap();
        prop_assert_eq!(header.request_id, request.request_id);
        prop_assert_eq!(header.dev_actor, Some(request.actor));
        prop_assert_eq!(Request { actor: request.actor, request_id: header.request_id, org, command }, request.clone());
        // A command that names no org itself may leave its namespace to the caller's
        // token: unset stays unset (not org 0).
        if request.command.own_org().is_none() {
            let bare = Request { org: None, ..request };
            let (_, command, org) = typed::command_from(&wire(&typed::command_to(&bare).unwrap())).unwrap();
            prop_assert_eq!(org, None);
            prop_assert_eq!(command, bare.command);
        }
    }

    #[test]
    fn every_reply_and_refusal_round_trips(reply in reply(), error in error(), log_index in any::<u64>()) {
        for outcome in [Ok(reply.clone()), Err(error.clone())] {
            let m = wire(&pb::CommandReply {
                log_index,
                logical_time_ms: 0,
                result: Some(typed::outcome_to(&outcome)),
            });
            prop_assert_eq!(typed::outcome_from(m.result.as_ref()).unwrap(), outcome);
        }
    }

    #[test]
    fn dev_actor_text_reads_back(actor in actor()) {
        let text = typed::dev_actor_text(&actor);
        prop_assert_eq!(typed::dev_actor(&text, "f").unwrap(), Some(actor));
    }
}

#[test]
fn the_node_s_own_command_is_not_a_client_command() {
    let r = Request {
        actor: Actor::System,
        request_id: 1,
        org: None,
        command: Command::RecordDenials {
            node: 1,
            denials: Vec::new(),
        },
    };
    assert!(typed::command_to(&r).is_none());
}

#[test]
fn a_batch_entry_without_a_command_or_with_a_bad_field_names_it() {
    let e = typed::command_from(&pb::Command { command: None }).unwrap_err();
    assert_eq!(e.field, "command");
    let bad_digest = pb::Command {
        command: Some(pb::command::Command::Bootstrap(pb::BootstrapRequest {
            call: Some(pb::Call {
                request_id: 1,
                ..Default::default()
            }),
            principal: 1,
            digest: vec![0; 31],
        })),
    };
    assert_eq!(
        typed::command_from(&bad_digest).unwrap_err().field,
        "digest"
    );
    let unknown_period = pb::Command {
        command: Some(pb::command::Command::SetBudget(pb::SetBudgetRequest {
            call: Some(pb::Call {
                request_id: 1,
                ..Default::default()
            }),
            scope: Some(pb::Scope {
                org: Some(1),
                ..Default::default()
            }),
            budget: Some(pb::BudgetSpec {
                limit_micro: 1,
                period: 99,
                mode: 1,
            }),
        })),
    };
    let e = typed::command_from(&unknown_period).unwrap_err();
    assert_eq!(e.field, "budget.period");
    assert!(e.problem.contains("99"), "{e}");
    // A 128-bit request id needs both halves; zero in both is no id.
    let no_id = pb::Command {
        command: Some(pb::command::Command::Tick(pb::TickRequest {
            call: Some(pb::Call::default()),
        })),
    };
    assert_eq!(
        typed::command_from(&no_id).unwrap_err().field,
        "call.request_id"
    );
}

#[test]
fn a_refusal_carries_its_exact_fields_as_json() {
    let e = CommandError::InsufficientCredits {
        needed: 5,
        available: 3,
    };
    let m = typed::error_to(&e);
    let json: serde_json::Value = serde_json::from_str(&m.details_json).unwrap();
    assert_eq!(json["InsufficientCredits"]["needed"], 5);
    assert_eq!(typed::error_from(&m).unwrap(), e);
    // Details this build cannot read fail that request alone, with the reason and
    // message that came (see the next test).
    let garbled = pb::Error {
        details_json: "{".into(),
        ..m
    };
    assert!(matches!(
        typed::error_from(&garbled).unwrap(),
        CommandError::Unrecognized { reason, .. } if reason == pb::Reason::InsufficientCredits as i32
    ));
}

/// A refusal this build does not know (a newer release's node sends a new kind during a
/// rolling upgrade, or a new kind sits in the audit trail) fails only its own request:
/// the other replies of the call read as usual, and the unknown one is kept whole — a
/// follower that forwards it passes on the leader's reason, message and details as
/// they came. (It failed the whole reply: `outcomes_from` refused the call.)
#[test]
fn an_unknown_refusal_fails_only_its_own_request_and_passes_through_whole() {
    let newer = pb::Error {
        reason: 977,
        message: "a refusal from the future".into(),
        details: [("limit".to_string(), "3".to_string())].into(),
        details_json: r#"{"SomethingNew":{"limit":3}}"#.into(),
    };
    let reply = pb::ExecuteReply {
        replies: vec![
            pb::CommandReply {
                log_index: 5,
                logical_time_ms: 9,
                result: Some(typed::outcome_to(&Ok(Reply::Created))),
            },
            pb::CommandReply {
                log_index: 5,
                logical_time_ms: 9,
                result: Some(pb::command_reply::Result::Error(newer.clone())),
            },
        ],
        log_index: 5,
        logical_time_ms: 9,
    };
    let outcomes = typed::outcomes_from(&wire(&reply), 2).expect("the call reads");
    assert_eq!(outcomes[0], Ok(Reply::Created));
    let Err(e) = &outcomes[1] else {
        panic!("{outcomes:?}")
    };
    assert!(
        matches!(e, CommandError::Unrecognized { reason: 977, .. }),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "a refusal from the future");
    assert_eq!(e.reason(), "UNRECOGNIZED");
    // Passed on as it came.
    assert_eq!(typed::error_to(e), newer);
}
