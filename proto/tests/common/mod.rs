//! Shared by the typed API's conversion tests: the wire round trip and the generators of
//! the state machine's small types.
#![allow(dead_code)]

use allot_statemachine::scheduler::JobState;
use allot_statemachine::{BucketKind, HeartbeatReply, Quota, SettleReason, Settlement};
use proptest::prelude::*;
use prost::Message;

/// Through the wire: encoded and decoded again.
pub fn wire<M: Message + Default>(m: &M) -> M {
    M::decode(m.encode_to_vec().as_slice()).expect("decodes")
}

pub fn kind() -> impl Strategy<Value = BucketKind> {
    prop_oneof![
        Just(BucketKind::Paid),
        Just(BucketKind::Promotional),
        Just(BucketKind::Granted)
    ]
}

pub fn job_state() -> impl Strategy<Value = JobState> {
    prop_oneof![
        Just(JobState::Queued),
        Just(JobState::Placed),
        Just(JobState::Running),
        Just(JobState::Preempting),
        Just(JobState::Succeeded),
        Just(JobState::Failed),
        Just(JobState::Lost),
        Just(JobState::Cancelled),
        Just(JobState::Rejected),
        Just(JobState::Attached),
    ]
}

pub fn settle_reason() -> impl Strategy<Value = SettleReason> {
    prop_oneof![
        Just(SettleReason::Succeeded),
        Just(SettleReason::Failed),
        Just(SettleReason::Cancelled),
        Just(SettleReason::Preempted),
        Just(SettleReason::NodeFailure),
        Just(SettleReason::Lost),
        Just(SettleReason::OutOfCredits),
        Just(SettleReason::Deduplicated),
    ]
}

pub fn settlement() -> impl Strategy<Value = Settlement> {
    (settle_reason(), any::<[u64; 4]>()).prop_map(|(reason, [c, r, f, u])| Settlement {
        reason,
        captured_micro: c,
        refunded_micro: r,
        forfeited_micro: f,
        uncollected_micro: u,
    })
}

pub fn heartbeat_reply() -> impl Strategy<Value = HeartbeatReply> {
    (
        any::<bool>(),
        any::<[u64; 3]>(),
        proptest::option::of(settlement()),
    )
        .prop_map(|(accepted, [d, a, h], stop)| HeartbeatReply {
            accepted,
            captured_delta_micro: d,
            captured_attempt_micro: a,
            held_micro: h,
            stop,
        })
}

/// Any quota (every field any value).
pub fn quota() -> impl Strategy<Value = Quota> {
    any::<[u32; 11]>().prop_map(|q| Quota {
        queued_max: q[0],
        running_max: q[1],
        holds_open_max: q[2],
        records_max: q[3],
        buckets_max: q[4],
        principals_max: q[5],
        projects_max: q[6],
        users_max: q[7],
        finished_jobs_max: q[8],
        settled_holds_max: q[9],
        streams_max: q[10],
    })
}
