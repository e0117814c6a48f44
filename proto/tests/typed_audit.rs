//! Typed audit event bodies and actors (`allot_proto::typed::audit`): every actor and
//! every event body (every variant, every nested enum value, options set and unset)
//! round-trips exactly through its protobuf message *and its wire bytes*; a newer
//! writer's unknown fields are ignored; unknown enum values, missing oneofs, missing
//! required messages, hashes of the wrong length and numbers out of range are refused,
//! naming the field.

use allot_proto::api::v1 as pb;
use allot_proto::typed::audit::{actor_from, actor_to, event_body_from, event_body_to};
use allot_statemachine::audit::EventBody;
use allot_statemachine::scheduler::{JobState, NodeState, Reason};
use allot_statemachine::{
    Actor, BucketId, BudgetScope, CommandError, DenialReason, DrawReport, GpuType, HoldId, JobId,
    Limit, NodeId, OrgId, Outcome, PrincipalId, ProjectId, Reply, Tier, TokenDigest, UserId,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use prost::Message;

mod common;
use common::*;

/// A newer writer's message: this one's bytes and a field (1000, varint) this schema
/// does not have.
fn with_unknown_field<M: Message + Default>(m: &M) -> M {
    let mut bytes = m.encode_to_vec();
    prost::encoding::uint64::encode(1000, &7, &mut bytes);
    M::decode(bytes.as_slice()).expect("unknown fields are skipped")
}

// ---------------------------------------------------------------- strategies

fn actor() -> impl Strategy<Value = Actor> {
    prop_oneof![
        any::<u64>().prop_map(|p| Actor::Admin(PrincipalId(p))),
        any::<(u64, u64)>().prop_map(|(o, p)| Actor::Tenant {
            org: OrgId(o),
            principal: PrincipalId(p),
        }),
        any::<u64>().prop_map(|n| Actor::Agent(NodeId(n))),
        Just(Actor::System),
        any::<(u64, u64, u64)>().prop_map(|(o, pr, p)| Actor::Project {
            org: OrgId(o),
            project: ProjectId(pr),
            principal: PrincipalId(p),
        }),
        any::<[u8; 32]>().prop_map(|d| Actor::Bearer(TokenDigest(d))),
        Just(Actor::Anonymous),
        any::<(u64, u64, u64, u64)>().prop_map(|(o, pr, u, p)| Actor::User {
            org: OrgId(o),
            project: ProjectId(pr),
            user: UserId(u),
            principal: PrincipalId(p),
        }),
    ]
}

fn reason() -> impl Strategy<Value = Reason> {
    prop_oneof![
        Just(Reason::Submitted),
        Just(Reason::Placed),
        Just(Reason::Started),
        (proptest::option::of(any::<u64>()), any::<u8>()).prop_map(|(by, t)| {
            Reason::Preempted {
                by: by.map(JobId),
                by_tier: Tier(t),
            }
        }),
        Just(Reason::Requeued),
        Just(Reason::Succeeded),
        Just(Reason::Failed),
        Just(Reason::Cancelled),
        Just(Reason::LeaseExpired),
        Just(Reason::NodeDown),
        Just(Reason::OutOfCredits),
        Just(Reason::MaxDuration),
        Just(Reason::Unpriced),
        Just(Reason::Fenced),
        Just(Reason::Deduplicated),
        Just(Reason::DedupReleased),
    ]
}

fn node_state() -> impl Strategy<Value = NodeState> {
    prop_oneof![
        Just(NodeState::Ready),
        Just(NodeState::Draining),
        Just(NodeState::Down),
    ]
}

fn denial_reason() -> impl Strategy<Value = DenialReason> {
    prop_oneof![
        Just(DenialReason::Unauthenticated),
        Just(DenialReason::PermissionDenied),
    ]
}

fn budget_scope() -> impl Strategy<Value = BudgetScope> {
    prop_oneof![
        any::<u64>().prop_map(|o| BudgetScope::Org(OrgId(o))),
        any::<u64>().prop_map(|p| BudgetScope::Project(ProjectId(p))),
        any::<u64>().prop_map(|u| BudgetScope::User(UserId(u))),
    ]
}

/// Outcomes of several kinds: replies with and without fields, and refusals with and
/// without fields.
fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        Just(Ok(Reply::Created)),
        any::<u64>().prop_map(|b| Ok(Reply::GrantIssued {
            bucket: BucketId(b)
        })),
        (any::<u64>(), any::<u64>(), job_state()).prop_map(|(j, h, state)| Ok(
            Reply::JobSubmitted {
                job: JobId(j),
                hold_micro: h,
                state,
            }
        )),
        any::<u32>().prop_map(|version| Ok(Reply::PricesSet { version })),
        proptest::option::of(settlement()).prop_map(|s| Ok(Reply::JobCancelled(s))),
        proptest::option::of(settlement()).prop_map(|s| Ok(Reply::JobFinished(s))),
        settlement().prop_map(|s| Ok(Reply::Settled(s))),
        heartbeat_reply().prop_map(|h| Ok(Reply::Heartbeat(h))),
        heartbeat_reply().prop_map(|h| Ok(Reply::JobHeartbeat(h))),
        (
            any::<u64>(),
            proptest::collection::vec(any::<(u64, u64)>(), 0..4)
        )
            .prop_map(|(h, d)| Ok(Reply::HoldCreated {
                hold: HoldId(h),
                draws: d
                    .into_iter()
                    .map(|(b, a)| DrawReport {
                        bucket: BucketId(b),
                        amount_micro: a,
                    })
                    .collect(),
            })),
        Just(Ok(Reply::NodeRegistered)),
        Just(Ok(Reply::AlertSet)),
        Just(Err(CommandError::AmountZero)),
        Just(Err(CommandError::UnknownOrg)),
        any::<(u64, u64)>().prop_map(|(available, needed)| Err(
            CommandError::InsufficientCredits { available, needed }
        )),
        any::<(u32, u32)>()
            .prop_map(|(given, current)| Err(CommandError::StaleAttempt { given, current })),
        "[A-Za-z0-9 _-]{0,20}".prop_map(|g| Err(CommandError::InvalidGpuType(GpuType(g)))),
        (budget_scope(), any::<[u64; 3]>()).prop_map(|(scope, [limit, used, asked])| Err(
            CommandError::BudgetExceeded {
                scope,
                limit,
                used,
                asked,
            }
        )),
        Just(Err(CommandError::LimitReached(Limit::Orgs))),
    ]
}

/// Every event body: the 17 kinds, each with arbitrary fields.
fn event_body() -> impl Strategy<Value = EventBody> {
    let movement = |f: fn(BucketId, u64) -> EventBody| {
        any::<(u64, u64)>().prop_map(move |(b, a)| f(BucketId(b), a))
    };
    prop_oneof![
        (any::<u32>(), any::<[u8; 32]>(), outcome(), any::<bool>()).prop_map(
            |(request, digest, outcome, replayed)| EventBody::Command {
                request,
                digest,
                outcome,
                replayed,
            }
        ),
        movement(|bucket, amount_micro| EventBody::Issued {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::HoldDrawn {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::Captured {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::CaptureReversed {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::Refunded {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::RefundForfeited {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::BucketExpired {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::TransferredOut {
            bucket,
            amount_micro
        }),
        movement(|bucket, amount_micro| EventBody::TransferredIn {
            bucket,
            amount_micro
        }),
        (
            any::<u64>(),
            proptest::option::of(job_state()),
            job_state(),
            any::<u32>(),
            proptest::option::of(any::<u64>()),
            reason(),
        )
            .prop_map(|(job, from, to, attempt, node, reason)| {
                EventBody::JobTransition {
                    job: JobId(job),
                    from,
                    to,
                    attempt,
                    node: node.map(NodeId),
                    reason,
                }
            }),
        (any::<u64>(), node_state()).prop_map(|(n, state)| EventBody::NodeStateChanged {
            node: NodeId(n),
            state,
        }),
        (budget_scope(), any::<(u64, u64)>()).prop_map(|(scope, (limit_micro, used_micro))| {
            EventBody::BudgetAlert {
                scope,
                limit_micro,
                used_micro,
            }
        }),
        (any::<u64>(), actor(), "[a-z:_]{0,24}", denial_reason()).prop_map(
            |(node, caller, api, reason)| EventBody::Denied {
                node,
                caller,
                api,
                reason,
            }
        ),
        any::<u64>().prop_map(|b| EventBody::BucketArchived {
            bucket: BucketId(b)
        }),
        any::<(u64, u64)>().prop_map(|(threshold_micro, available_micro)| {
            EventBody::LowBalance {
                threshold_micro,
                available_micro,
            }
        }),
        (budget_scope(), any::<u32>(), any::<(u64, u64)>()).prop_map(
            |(scope, pct, (limit_micro, used_micro))| EventBody::BudgetThreshold {
                scope,
                pct,
                limit_micro,
                used_micro,
            }
        ),
    ]
}

/// The kind of a body, by position (no wildcard: a new kind fails to compile here until
/// it is generated above and counted below).
fn body_kind(b: &EventBody) -> usize {
    match b {
        EventBody::Command { .. } => 0,
        EventBody::Issued { .. } => 1,
        EventBody::HoldDrawn { .. } => 2,
        EventBody::Captured { .. } => 3,
        EventBody::CaptureReversed { .. } => 4,
        EventBody::Refunded { .. } => 5,
        EventBody::RefundForfeited { .. } => 6,
        EventBody::BucketExpired { .. } => 7,
        EventBody::TransferredOut { .. } => 8,
        EventBody::TransferredIn { .. } => 9,
        EventBody::JobTransition { .. } => 10,
        EventBody::NodeStateChanged { .. } => 11,
        EventBody::BudgetAlert { .. } => 12,
        EventBody::Denied { .. } => 13,
        EventBody::BucketArchived { .. } => 14,
        EventBody::LowBalance { .. } => 15,
        EventBody::BudgetThreshold { .. } => 16,
    }
}
const BODY_KINDS: usize = 17;

fn actor_kind(a: &Actor) -> usize {
    match a {
        Actor::Admin(_) => 0,
        Actor::Tenant { .. } => 1,
        Actor::Agent(_) => 2,
        Actor::System => 3,
        Actor::Project { .. } => 4,
        Actor::Bearer(_) => 5,
        Actor::Anonymous => 6,
        Actor::User { .. } => 7,
    }
}
const ACTOR_KINDS: usize = 8;

// ---------------------------------------------------------------- round trips

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn actors_round_trip(a in actor()) {
        let m = wire(&actor_to(&a));
        prop_assert_eq!(actor_from(Some(&m), "actor").unwrap(), a);
        // A newer writer's unknown field changes nothing.
        prop_assert_eq!(actor_from(Some(&with_unknown_field(&m)), "actor").unwrap(), a);
    }

    #[test]
    fn whole_events_round_trip_and_still_verify(
        b in event_body(),
        a in actor(),
        n in any::<[u64; 4]>(),
        request_id in any::<u128>(),
        org in proptest::option::of(any::<u64>()),
        project in proptest::option::of(any::<u64>()),
        hold in proptest::option::of(any::<u64>()),
    ) {
        let account = match (org, project) {
            (_, Some(p)) => Some(allot_statemachine::Account::Project(ProjectId(p))),
            (Some(o), None) => Some(allot_statemachine::Account::Org(OrgId(o))),
            (None, None) => None,
        };
        let mut e = allot_statemachine::AuditEvent {
            seq: n[0],
            log_index: n[1],
            time_ms: n[2],
            actor: a,
            request_id,
            org: org.map(OrgId),
            account,
            hold: hold.map(HoldId),
            body: b,
            prev_hash: [n[3] as u8; 32],
            hash: [0; 32],
        };
        e.hash = e.compute_hash(&mut Vec::new());
        let back = allot_proto::typed::audit_event_from(&wire(&allot_proto::typed::audit_event_to(&e))).unwrap();
        prop_assert_eq!(back.compute_hash(&mut Vec::new()), e.hash);
        prop_assert_eq!(back, e);
    }

    #[test]
    fn event_bodies_round_trip(b in event_body()) {
        let m = wire(&event_body_to(&b));
        prop_assert_eq!(event_body_from(Some(&m)).unwrap(), b.clone());
        prop_assert_eq!(event_body_from(Some(&with_unknown_field(&m))).unwrap(), b);
    }

    #[test]
    fn command_events_carry_the_outcome_as_a_command_reply(
        request in any::<u32>(),
        digest in any::<[u8; 32]>(),
        outcome in outcome(),
        replayed in any::<bool>(),
    ) {
        let b = EventBody::Command { request, digest, outcome: outcome.clone(), replayed };
        let m = wire(&event_body_to(&b));
        let Some(pb::event_body::Body::Command(c)) = &m.body else {
            return Err(TestCaseError::fail(format!("not a command arm: {m:?}")));
        };
        prop_assert_eq!(c.request, request);
        prop_assert_eq!(c.digest.as_slice(), digest.as_slice());
        prop_assert_eq!(c.replayed, replayed);
        let reply = c.outcome.as_ref().expect("an outcome");
        // The reply's index and time are the event's, not repeated here.
        prop_assert_eq!((reply.log_index, reply.logical_time_ms), (0, 0));
        prop_assert_eq!(reply.result.clone(), Some(allot_proto::typed::outcome_to(&outcome)));
        prop_assert_eq!(event_body_from(Some(&m)).unwrap(), b);
    }

    /// An unknown field inside a body's arm (not only at the top) is skipped too.
    #[test]
    fn unknown_fields_inside_an_arm_are_ignored(b in event_body()) {
        let m = event_body_to(&b);
        let Some(arm) = &m.body else {
            return Err(TestCaseError::fail("no arm"));
        };
        let mut inner = Vec::new();
        arm.encode(&mut inner);
        // The arm is one length-delimited field: its tag, its length, its bytes. Append
        // an unknown field to those bytes and re-frame them.
        let mut cursor = inner.as_slice();
        let (number, _) = prost::encoding::decode_key(&mut cursor).unwrap();
        let len = prost::encoding::decode_varint(&mut cursor).unwrap() as usize;
        prop_assert_eq!(cursor.len(), len);
        let mut payload = cursor.to_vec();
        prost::encoding::string::encode(1000, &"from the future".to_string(), &mut payload);
        let mut bytes = Vec::new();
        prost::encoding::bytes::encode(number, &payload, &mut bytes);
        let newer = pb::EventBody::decode(bytes.as_slice()).unwrap();
        prop_assert_eq!(event_body_from(Some(&newer)).unwrap(), b);
    }
}

/// The generators above reach every kind of body and of actor (so the round trips
/// cover them all).
#[test]
fn every_kind_of_body_and_actor_is_generated() {
    let mut runner = TestRunner::deterministic();
    let bodies = event_body();
    let mut seen = [false; BODY_KINDS];
    for _ in 0..2000 {
        let b = bodies.new_tree(&mut runner).unwrap().current();
        seen[body_kind(&b)] = true;
    }
    assert!(seen.iter().all(|s| *s), "body kinds seen: {seen:?}");
    let actors = actor();
    let mut seen = [false; ACTOR_KINDS];
    for _ in 0..500 {
        let a = actors.new_tree(&mut runner).unwrap().current();
        seen[actor_kind(&a)] = true;
    }
    assert!(seen.iter().all(|s| *s), "actor kinds seen: {seen:?}");
}

/// Distinct kinds with the same fields stay distinct (each has its own arm).
#[test]
fn movements_of_different_kinds_have_different_arms() {
    let bucket = BucketId(5);
    let bodies = [
        EventBody::Issued {
            bucket,
            amount_micro: 1,
        },
        EventBody::HoldDrawn {
            bucket,
            amount_micro: 1,
        },
        EventBody::Captured {
            bucket,
            amount_micro: 1,
        },
        EventBody::CaptureReversed {
            bucket,
            amount_micro: 1,
        },
        EventBody::Refunded {
            bucket,
            amount_micro: 1,
        },
        EventBody::RefundForfeited {
            bucket,
            amount_micro: 1,
        },
        EventBody::BucketExpired {
            bucket,
            amount_micro: 1,
        },
        EventBody::TransferredOut {
            bucket,
            amount_micro: 1,
        },
        EventBody::TransferredIn {
            bucket,
            amount_micro: 1,
        },
    ];
    let encoded: Vec<Vec<u8>> = bodies
        .iter()
        .map(|b| event_body_to(b).encode_to_vec())
        .collect();
    for (i, a) in encoded.iter().enumerate() {
        for b in &encoded[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

// ---------------------------------------------------------------- refusals

fn transition() -> pb::EventBody {
    event_body_to(&EventBody::JobTransition {
        job: JobId(1),
        from: Some(JobState::Queued),
        to: JobState::Placed,
        attempt: 1,
        node: Some(NodeId(3)),
        reason: Reason::Placed,
    })
}

fn with_transition(f: impl FnOnce(&mut pb::event_body::JobTransition)) -> pb::EventBody {
    let mut m = transition();
    match &mut m.body {
        Some(pb::event_body::Body::JobTransition(t)) => f(t),
        other => panic!("not a transition: {other:?}"),
    }
    m
}

fn denied(caller: Actor) -> pb::EventBody {
    event_body_to(&EventBody::Denied {
        node: 1,
        caller,
        api: "audit".into(),
        reason: DenialReason::PermissionDenied,
    })
}

fn with_denied(f: impl FnOnce(&mut pb::event_body::Denied)) -> pb::EventBody {
    let mut m = denied(Actor::Anonymous);
    match &mut m.body {
        Some(pb::event_body::Body::Denied(d)) => f(d),
        other => panic!("not a denial: {other:?}"),
    }
    m
}

/// The refusal of a message: (field, problem).
fn refusal(m: &pb::EventBody) -> (String, String) {
    let e = event_body_from(Some(&wire(m))).unwrap_err();
    (e.field, e.problem)
}

#[test]
fn unknown_enum_values_are_refused_naming_the_field() {
    let m = with_transition(|t| t.to_state = 99);
    assert_eq!(
        refusal(&m),
        (
            "body.job_transition.to_state".into(),
            "unknown value 99".into()
        )
    );
    let m = with_transition(|t| t.from_state = Some(42));
    assert_eq!(
        refusal(&m),
        (
            "body.job_transition.from_state".into(),
            "unknown value 42".into()
        )
    );
    let m = with_transition(|t| t.reason.as_mut().unwrap().kind = 77);
    assert_eq!(
        refusal(&m),
        (
            "body.job_transition.reason.kind".into(),
            "unknown value 77".into()
        )
    );
    let m = with_denied(|d| d.reason = 5);
    assert_eq!(
        refusal(&m),
        ("body.denied.reason".into(), "unknown value 5".into())
    );
    let m = event_body_to(&EventBody::NodeStateChanged {
        node: NodeId(1),
        state: NodeState::Down,
    });
    let mut m = wire(&m);
    if let Some(pb::event_body::Body::NodeStateChanged(n)) = &mut m.body {
        n.state = 12;
    }
    assert_eq!(
        refusal(&m),
        (
            "body.node_state_changed.state".into(),
            "unknown value 12".into()
        )
    );
    // The unknown value survives the wire as its number (proto3 open enums).
    let mut reply = pb::CommandReply {
        result: Some(allot_proto::typed::outcome_to(&Ok(Reply::JobSubmitted {
            job: JobId(1),
            hold_micro: 2,
            state: JobState::Queued,
        }))),
        ..Default::default()
    };
    if let Some(pb::command_reply::Result::JobSubmitted(j)) = &mut reply.result {
        j.state = 1234;
    }
    let m = pb::EventBody {
        body: Some(pb::event_body::Body::Command(pb::event_body::Command {
            request: 0,
            digest: vec![0; 32],
            outcome: Some(reply),
            replayed: false,
        })),
    };
    let (field, problem) = refusal(&m);
    assert!(field.starts_with("body.command.outcome."), "{field}");
    assert!(field.ends_with("state"), "{field}");
    assert_eq!(problem, "unknown value 1234");
}

#[test]
fn unspecified_enum_values_are_refused_where_a_value_is_required() {
    let m = with_transition(|t| t.to_state = 0);
    assert_eq!(
        refusal(&m),
        ("body.job_transition.to_state".into(), "required".into())
    );
    let m = with_transition(|t| t.reason.as_mut().unwrap().kind = 0);
    assert_eq!(
        refusal(&m),
        ("body.job_transition.reason.kind".into(), "required".into())
    );
    let m = with_denied(|d| d.reason = 0);
    assert_eq!(
        refusal(&m),
        ("body.denied.reason".into(), "required".into())
    );
    // An optional enum set to UNSPECIFIED is not "no previous state": that is unset.
    let m = with_transition(|t| t.from_state = Some(0));
    let (field, problem) = refusal(&m);
    assert_eq!(field, "body.job_transition.from_state");
    assert!(problem.starts_with("unspecified"), "{problem}");
    // Unset, it is none.
    let m = with_transition(|t| t.from_state = None);
    match event_body_from(Some(&wire(&m))).unwrap() {
        EventBody::JobTransition { from, .. } => assert_eq!(from, None),
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_oneofs_and_messages_are_refused_naming_the_field() {
    assert_eq!(
        event_body_from(None).unwrap_err(),
        allot_proto::typed::FieldError {
            field: "body".into(),
            problem: "required".into()
        }
    );
    assert_eq!(
        refusal(&pb::EventBody { body: None }),
        ("body".into(), "required".into())
    );
    // An actor without its arm, or absent.
    let e = actor_from(Some(&pb::Actor { actor: None }), "caller").unwrap_err();
    assert_eq!(
        (e.field.as_str(), e.problem.as_str()),
        ("caller", "required")
    );
    assert_eq!(actor_from(None, "caller").unwrap_err().field, "caller");
    let m = with_denied(|d| d.caller = Some(pb::Actor { actor: None }));
    assert_eq!(
        refusal(&m),
        ("body.denied.caller".into(), "required".into())
    );
    let m = with_denied(|d| d.caller = None);
    assert_eq!(
        refusal(&m),
        ("body.denied.caller".into(), "required".into())
    );
    // A budget scope without its arm, or absent.
    let mut m = event_body_to(&EventBody::BudgetAlert {
        scope: BudgetScope::Org(OrgId(1)),
        limit_micro: 1,
        used_micro: 2,
    });
    if let Some(pb::event_body::Body::BudgetAlert(a)) = &mut m.body {
        a.scope = Some(pb::BudgetScope { scope: None });
    }
    assert_eq!(refusal(&m).0, "body.budget_alert.scope");
    let mut m = event_body_to(&EventBody::BudgetThreshold {
        scope: BudgetScope::User(UserId(1)),
        pct: 80,
        limit_micro: 1,
        used_micro: 2,
    });
    if let Some(pb::event_body::Body::BudgetThreshold(a)) = &mut m.body {
        a.scope = None;
    }
    assert_eq!(refusal(&m).0, "body.budget_threshold.scope");
    // A transition without its reason.
    let m = with_transition(|t| t.reason = None);
    assert_eq!(
        refusal(&m),
        ("body.job_transition.reason".into(), "required".into())
    );
    // A command event without its outcome, or with a reply without a result.
    let command = |outcome: Option<pb::CommandReply>| pb::EventBody {
        body: Some(pb::event_body::Body::Command(pb::event_body::Command {
            request: 1,
            digest: vec![7; 32],
            outcome,
            replayed: false,
        })),
    };
    assert_eq!(
        refusal(&command(None)),
        ("body.command.outcome".into(), "required".into())
    );
    let (field, problem) = refusal(&command(Some(pb::CommandReply::default())));
    assert!(field.starts_with("body.command.outcome"), "{field}");
    assert_eq!(problem, "required");
}

#[test]
fn hashes_of_another_length_are_refused_naming_the_field() {
    for len in [0usize, 31, 33] {
        let m = pb::EventBody {
            body: Some(pb::event_body::Body::Command(pb::event_body::Command {
                request: 1,
                digest: vec![1; len],
                outcome: Some(pb::CommandReply {
                    result: Some(allot_proto::typed::outcome_to(&Ok(Reply::Created))),
                    ..Default::default()
                }),
                replayed: false,
            })),
        };
        assert_eq!(
            refusal(&m),
            (
                "body.command.digest".into(),
                format!("expected 32 bytes, got {len}")
            )
        );
        let bearer = pb::Actor {
            actor: Some(pb::actor::Actor::Bearer(pb::actor::Bearer {
                token_digest: vec![2; len],
            })),
        };
        let e = actor_from(Some(&wire(&bearer)), "actor").unwrap_err();
        assert_eq!(e.field, "actor.bearer.token_digest");
        let m = with_denied(|d| d.caller = Some(bearer.clone()));
        assert_eq!(refusal(&m).0, "body.denied.caller.bearer.token_digest");
    }
}

#[test]
fn numbers_out_of_their_rust_range_are_refused_naming_the_field() {
    let preempted = |tier: u32| {
        with_transition(|t| {
            t.reason = Some(pb::JobReason {
                kind: pb::JobReasonKind::Preempted as i32,
                preempted_by: Some(9),
                preempted_by_tier: tier,
            })
        })
    };
    assert_eq!(
        refusal(&preempted(256)),
        (
            "body.job_transition.reason.preempted_by_tier".into(),
            "256 is out of range".into()
        )
    );
    match event_body_from(Some(&wire(&preempted(255)))).unwrap() {
        EventBody::JobTransition { reason, .. } => assert_eq!(
            reason,
            Reason::Preempted {
                by: Some(JobId(9)),
                by_tier: Tier(255)
            }
        ),
        other => panic!("{other:?}"),
    }
}
