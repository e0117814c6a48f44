//! The typed API's conversions (`allot_proto::typed`): every converted type round-trips
//! through its protobuf message *and its wire bytes* (property tests over generated
//! values); every refusal reason of the state machine has its enum value; a newer
//! client's unknown fields are ignored and its unknown enum values refused, naming the
//! field.

use allot_proto::api::v1 as pb;
use allot_proto::typed::{self, TypedCommand};
use allot_statemachine::ledger::{Balance, UpcomingExpiry};
use allot_statemachine::{
    Account, BucketId, BucketKind, BucketPolicy, Command, GpuType, Grant, HeartbeatReply,
    JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, OrgId, ProjectId, Tier, UserId,
};
use proptest::prelude::*;
use prost::Message;

mod common;
use common::*;

fn gpu_type() -> impl Strategy<Value = GpuType> {
    "[A-Z0-9_-]{1,12}".prop_map(GpuType)
}

fn account() -> impl Strategy<Value = Account> {
    prop_oneof![
        any::<u64>().prop_map(|o| Account::Org(OrgId(o))),
        any::<u64>().prop_map(|p| Account::Project(ProjectId(p))),
    ]
}

proptest! {
    #[test]
    fn grants_round_trip(
        bucket in any::<u64>(),
        org in any::<u64>(),
        owner in account(),
        kind in kind(),
        amount in any::<u64>(),
        expires in proptest::option::of(any::<u64>()),
        priority in any::<u8>(),
        policy in proptest::option::of((proptest::collection::vec(gpu_type(), 0..4), proptest::collection::vec(any::<u8>(), 0..4))),
        source_ref in proptest::option::of("[a-z0-9-]{1,20}"),
    ) {
        let owner = match owner {
            Account::Org(_) => Account::Org(OrgId(org)),
            p => p,
        };
        let g = Grant {
            bucket: BucketId(bucket),
            owner,
            kind,
            amount_micro: amount,
            expires_at_ms: expires,
            priority,
            policy: policy.map(|(g, t)| BucketPolicy { gpu_types: g, tiers: t.into_iter().map(Tier).collect() }),
            source_ref,
        };
        let m = wire(&typed::grant_to(OrgId(org), &g));
        prop_assert_eq!(typed::grant_from(&m).unwrap(), g.clone());
        // As a command, with the org it acts in.
        let (c, o) = m.command().unwrap();
        prop_assert_eq!(c, Command::IssueGrant(g.clone()));
        prop_assert_eq!(o, Some(OrgId(org)));
        // A relative expiry is its own command (evaluated on the cluster's clock); with
        // an absolute one as well it is refused, naming the field.
        let relative = pb::IssueGrantRequest { expires_at_ms: None, expires_in_ms: Some(amount), ..m.clone() };
        let (c, _) = wire(&relative).command().unwrap();
        prop_assert_eq!(c, Command::IssueGrantIn { grant: Grant { expires_at_ms: None, ..g }, expires_in_ms: amount });
        let both = pb::IssueGrantRequest { expires_at_ms: Some(1), expires_in_ms: Some(1), ..m };
        prop_assert_eq!(both.command().unwrap_err().field, "expires_in_ms");
    }

    #[test]
    fn job_specs_round_trip(
        ids in any::<[u64; 3]>(),
        tier in any::<u8>(),
        types in proptest::collection::vec(gpu_type(), 0..5),
        gpus in any::<u32>(),
        mem in any::<u32>(),
        flags in any::<(bool, bool)>(),
        max in any::<u64>(),
    ) {
        let s = JobSpec {
            job: JobId(ids[0]),
            project: ProjectId(ids[1]),
            user: UserId(ids[2]),
            tier: Tier(tier),
            gpu_types: types,
            gpus,
            mem_floor_gb: mem,
            preemptible: flags.0,
            checkpointable: flags.1,
            max_duration_ms: max,
        };
        let m = wire(&typed::job_spec_to(&s));
        prop_assert_eq!(typed::job_spec_from(Some(&m)).unwrap(), s.clone());
        let req = wire(&pb::SubmitJobRequest { call: None, org: Some(9), spec: Some(m), dedup_key: None });
        prop_assert_eq!(req.command().unwrap(), (Command::SubmitJob(s), Some(OrgId(9))));
    }

    #[test]
    fn node_specs_round_trip(
        node in any::<u64>(),
        ty in gpu_type(),
        count in any::<u32>(),
        mem in any::<u32>(),
        labels in proptest::collection::vec(("[a-z]{0,3}", "[a-z0-9]{0,8}"), 0..6),
    ) {
        // Any labels, in any order, repeated keys too: exactly as sent (the state
        // machine judges them, the conversion does not merge or sort them).
        let n = NodeSpec {
            node: NodeId(node),
            gpu_type: ty,
            gpu_count: count,
            gpu_mem_gb: mem,
            labels, incarnation: 0, };
        let m = wire(&typed::node_spec_to(&n));
        prop_assert_eq!(typed::node_spec_from(&m).unwrap(), n.clone());
        // The map form (older clients) arrives sorted by key; both at once is refused.
        let mut as_map = m.clone();
        as_map.labels = n.labels.iter().cloned().collect();
        as_map.label_list.clear();
        let sorted: std::collections::BTreeMap<_, _> = n.labels.iter().cloned().collect();
        prop_assert_eq!(typed::node_spec_from(&as_map).unwrap().labels, sorted.into_iter().collect::<Vec<_>>());
        if !n.labels.is_empty() {
            as_map.label_list = m.label_list.clone();
            prop_assert_eq!(typed::node_spec_from(&as_map).unwrap_err().field, "label_list");
        }
    }

    #[test]
    fn job_heartbeats_round_trip(org in any::<u64>(), job in any::<u64>(), attempt in any::<u32>(), seq in any::<u64>(), ppm in any::<u32>(), cp in any::<u64>()) {
        let h = JobHeartbeat { job: JobId(job), attempt, seq, progress_ppm: ppm, checkpoint: cp };
        let m = wire(&typed::job_heartbeat_to(Some(OrgId(org)), &h));
        prop_assert_eq!(typed::job_heartbeat_from(&m), h);
        prop_assert_eq!(m.command().unwrap(), (Command::JobHeartbeat(h), Some(OrgId(org))));
    }

    #[test]
    fn balances_round_trip(
        figures in any::<[u64; 9]>(),
        upcoming in proptest::collection::vec((any::<u64>(), kind(), any::<u64>(), any::<u64>()), 0..5),
    ) {
        let b = Balance {
            paid_available_micro: figures[0],
            promotional_available_micro: figures[1],
            granted_available_micro: figures[2],
            held_micro: figures[3],
            consumed_micro: figures[4],
            expired_micro: figures[5],
            issued_micro: figures[6],
            moved_in_micro: figures[7],
            moved_out_micro: figures[8],
            upcoming_expirations: upcoming
                .into_iter()
                .map(|(bucket, kind, at, rem)| UpcomingExpiry {
                    bucket: BucketId(bucket),
                    kind,
                    expires_at_ms: at,
                    remaining_micro: rem,
                })
                .collect(),
        };
        let m = wire(&typed::balance_to(&b));
        prop_assert_eq!(
            m.available_micro,
            figures[0].saturating_add(figures[1]).saturating_add(figures[2])
        );
        prop_assert_eq!(typed::balance_from(&m).unwrap(), b);
    }

    #[test]
    fn settlements_and_heartbeat_results_round_trip(
        s in settlement(),
        stop in proptest::option::of(settlement()),
        accepted in any::<bool>(),
        f in any::<[u64; 3]>(),
    ) {
        let m = wire(&typed::settlement_to(&s));
        prop_assert_eq!(typed::settlement_from(&m).unwrap(), s);
        let h = HeartbeatReply {
            accepted,
            captured_delta_micro: f[0],
            captured_attempt_micro: f[1],
            held_micro: f[2],
            stop,
        };
        let m = wire(&typed::heartbeat_to(&h));
        prop_assert_eq!(typed::heartbeat_from(&m).unwrap(), h);
    }
}

/// Every reason `CommandError::reason` can return has its value in the `Reason` enum
/// (read from the source of `reason()`, so a new reason without a value fails here),
/// and the enum names no reason the code does not have.
#[test]
fn every_refusal_reason_has_its_enum_value() {
    let src = include_str!("../../statemachine/src/outcome.rs");
    let body = &src[src.find("pub fn reason(&self)").expect("reason()")..];
    let body = &body[..body.find("\n    }\n").expect("end of reason()")];
    // `UNRECOGNIZED` is this build's name for a reason it does not know: on the wire it
    // keeps the number it came with, so it has no value of its own.
    let names: Vec<&str> = body
        .split("=> \"")
        .skip(1)
        .map(|s| &s[..s.find('"').unwrap()])
        .filter(|n| *n != "UNRECOGNIZED")
        .collect();
    assert!(names.len() >= 50, "{names:?}");
    for n in &names {
        let v = pb::Reason::from_str_name(&format!("REASON_{n}"));
        assert!(v.is_some(), "no Reason value for {n}");
        assert_ne!(v, Some(pb::Reason::Unspecified));
    }
    for v in 1..200 {
        if let Ok(r) = pb::Reason::try_from(v) {
            let name = r.as_str_name().trim_start_matches("REASON_");
            assert!(names.contains(&name), "{name} is not a reason of the code");
        }
    }
}

#[test]
fn a_refusal_carries_its_reason_and_fields() {
    let e = allot_statemachine::CommandError::InsufficientCredits {
        needed: 5,
        available: 3,
    };
    let m = wire(&typed::error_to(&e));
    assert_eq!(m.reason(), pb::Reason::InsufficientCredits);
    assert_eq!(m.details.get("needed").map(String::as_str), Some("5"));
    assert_eq!(m.details.get("available").map(String::as_str), Some("3"));
    assert_eq!(m.message, e.to_string());
    // A unit refusal has no fields.
    let m = typed::error_to(&allot_statemachine::CommandError::UnknownOrg);
    assert_eq!(m.reason(), pb::Reason::UnknownOrg);
    assert!(m.details.is_empty());
}

/// A newer client's message: a field this server does not know is skipped (proto3), so
/// the call works as if it were absent; an enum value it does not know is refused,
/// naming the field; a missing required field is named too.
#[test]
fn newer_clients_unknown_fields_and_values_are_handled_as_documented() {
    let spec = pb::JobSpec {
        job: 7,
        project: 70,
        user: 700,
        tier: 1,
        gpu_types: vec!["A100".into()],
        gpus: 1,
        max_duration_ms: 60_000,
        ..Default::default()
    };
    let req = pb::SubmitJobRequest {
        call: Some(pb::Call {
            request_id: 42,
            ..Default::default()
        }),
        org: Some(3),
        spec: Some(spec),
        dedup_key: None,
    };
    let mut bytes = req.encode_to_vec();
    // Field 99 (varint 5) and field 100 (a string): unknown to this schema.
    prost::encoding::uint64::encode(99, &5, &mut bytes);
    prost::encoding::string::encode(100, &"from the future".to_string(), &mut bytes);
    let newer = pb::SubmitJobRequest::decode(bytes.as_slice()).expect("unknown fields skipped");
    assert_eq!(newer, req);
    assert_eq!(typed::header(newer.call.as_ref()).unwrap().request_id, 42);

    // An unknown enum value.
    let mut g = typed::grant_to(
        OrgId(3),
        &Grant {
            bucket: BucketId(1),
            owner: Account::Org(OrgId(3)),
            kind: BucketKind::Paid,
            amount_micro: 1,
            expires_at_ms: None,
            priority: 0,
            policy: None,
            source_ref: None,
        },
    );
    g.kind = 99;
    let e = typed::grant_from(&wire(&g)).unwrap_err();
    assert_eq!(e.field, "kind");
    g.kind = 0;
    assert_eq!(typed::grant_from(&g).unwrap_err().field, "kind");
    g.kind = 1;
    g.owner = None;
    assert_eq!(typed::grant_from(&g).unwrap_err().field, "owner");
    // Out of range for the Rust type.
    let mut s = pb::JobSpec {
        tier: 256,
        ..Default::default()
    };
    assert_eq!(
        typed::job_spec_from(Some(&s)).unwrap_err().field,
        "spec.tier"
    );
    s.tier = 255;
    assert!(typed::job_spec_from(Some(&s)).is_ok());
    assert_eq!(typed::job_spec_from(None).unwrap_err().field, "spec");
    // A call without a request id.
    assert_eq!(
        typed::header(Some(&pb::Call::default())).unwrap_err().field,
        "call.request_id"
    );
    assert_eq!(typed::header(None).unwrap_err().field, "call");
}
