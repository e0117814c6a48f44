//! Audit event bodies and actors, both ways (part of [`crate::typed`]).
//!
//! Exact: every [`EventBody`] and [`Actor`] converts to its message and back to itself.
//! Inbound, as everywhere in [`crate::typed`], only the shape is checked (a required
//! message or oneof arm present, enum values known, numbers in their Rust range, hashes
//! 32 bytes long), naming the field: `body`, `body.<arm>.<field>`, and for an actor the
//! caller's name for it (`body.denied.caller`, ...).

// Shared with the queries (their messages are defined in allot_api_query.proto).
use super::query::{
    budget_scope_from, budget_scope_to, job_reason_from, job_reason_to, node_state_from,
    node_state_to,
};
use super::{bad, required, FieldError};
use crate::api::v1 as pb;
use allot_statemachine::audit::{EventBody, Hash32};
use allot_statemachine::{
    Actor, BucketId, DenialReason, JobId, NodeId, OrgId, PrincipalId, ProjectId, TokenDigest,
    UserId,
};

use pb::event_body as eb;

// ---------------------------------------------------------------- small types

/// A 32-byte hash from `bytes` (any other length is refused, naming the field).
fn hash32(b: &[u8], field: &str) -> Result<Hash32, FieldError> {
    Hash32::try_from(b).map_err(|_| bad(field, format!("expected 32 bytes, got {}", b.len())))
}

pub fn denial_reason_to(r: DenialReason) -> pb::DenialReason {
    match r {
        DenialReason::Unauthenticated => pb::DenialReason::Unauthenticated,
        DenialReason::PermissionDenied => pb::DenialReason::PermissionDenied,
    }
}

pub fn denial_reason_from(v: i32, field: &str) -> Result<DenialReason, FieldError> {
    Ok(match pb::DenialReason::try_from(v) {
        Ok(pb::DenialReason::Unauthenticated) => DenialReason::Unauthenticated,
        Ok(pb::DenialReason::PermissionDenied) => DenialReason::PermissionDenied,
        Ok(pb::DenialReason::Unspecified) => return Err(bad(field, "required")),
        Err(_) => return Err(bad(field, format!("unknown value {v}"))),
    })
}

// ---------------------------------------------------------------- actors

pub fn actor_to(a: &Actor) -> pb::Actor {
    use pb::actor::{self as m, Actor as A};
    let arm = match *a {
        Actor::Admin(p) => A::Admin(m::Admin { principal: p.0 }),
        Actor::Tenant { org, principal } => A::Tenant(m::Tenant {
            org: org.0,
            principal: principal.0,
        }),
        Actor::Agent(n) => A::Agent(m::Agent { node: n.0 }),
        Actor::System => A::System(pb::Empty {}),
        Actor::Project {
            org,
            project,
            principal,
        } => A::Project(m::Project {
            org: org.0,
            project: project.0,
            principal: principal.0,
        }),
        Actor::Bearer(d) => A::Bearer(m::Bearer {
            token_digest: d.0.to_vec(),
        }),
        Actor::Anonymous => A::Anonymous(pb::Empty {}),
        Actor::User {
            org,
            project,
            user,
            principal,
        } => A::User(m::User {
            org: org.0,
            project: project.0,
            user: user.0,
            principal: principal.0,
        }),
    };
    pb::Actor { actor: Some(arm) }
}

/// An actor; `field` names it in a refusal (absent, or no arm set: required).
pub fn actor_from(a: Option<&pb::Actor>, field: &str) -> Result<Actor, FieldError> {
    use pb::actor::Actor as A;
    let a = required(a, field)?;
    Ok(match required(a.actor.as_ref(), field)? {
        A::Admin(m) => Actor::Admin(PrincipalId(m.principal)),
        A::Tenant(m) => Actor::Tenant {
            org: OrgId(m.org),
            principal: PrincipalId(m.principal),
        },
        A::Agent(m) => Actor::Agent(NodeId(m.node)),
        A::System(_) => Actor::System,
        A::Project(m) => Actor::Project {
            org: OrgId(m.org),
            project: ProjectId(m.project),
            principal: PrincipalId(m.principal),
        },
        A::Bearer(m) => Actor::Bearer(TokenDigest(hash32(
            &m.token_digest,
            &format!("{field}.bearer.token_digest"),
        )?)),
        A::Anonymous(_) => Actor::Anonymous,
        A::User(m) => Actor::User {
            org: OrgId(m.org),
            project: ProjectId(m.project),
            user: UserId(m.user),
            principal: PrincipalId(m.principal),
        },
    })
}

// ---------------------------------------------------------------- event bodies

pub fn event_body_to(b: &EventBody) -> pb::EventBody {
    use eb::Body as B;
    let arm = match b {
        EventBody::Command {
            request,
            digest,
            outcome,
            replayed,
        } => B::Command(eb::Command {
            request: *request,
            digest: digest.to_vec(),
            outcome: Some(pb::CommandReply {
                log_index: 0,
                logical_time_ms: 0,
                result: Some(super::outcome_to(outcome)),
            }),
            replayed: *replayed,
        }),
        EventBody::Issued {
            bucket,
            amount_micro,
        } => B::Issued(eb::Issued {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::HoldDrawn {
            bucket,
            amount_micro,
        } => B::HoldDrawn(eb::HoldDrawn {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::Captured {
            bucket,
            amount_micro,
        } => B::Captured(eb::Captured {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::CaptureReversed {
            bucket,
            amount_micro,
        } => B::CaptureReversed(eb::CaptureReversed {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::Refunded {
            bucket,
            amount_micro,
        } => B::Refunded(eb::Refunded {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::RefundForfeited {
            bucket,
            amount_micro,
        } => B::RefundForfeited(eb::RefundForfeited {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::BucketExpired {
            bucket,
            amount_micro,
        } => B::BucketExpired(eb::BucketExpired {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::TransferredOut {
            bucket,
            amount_micro,
        } => B::TransferredOut(eb::TransferredOut {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::TransferredIn {
            bucket,
            amount_micro,
        } => B::TransferredIn(eb::TransferredIn {
            bucket: bucket.0,
            amount_micro: *amount_micro,
        }),
        EventBody::JobTransition {
            job,
            from,
            to,
            attempt,
            node,
            reason,
        } => B::JobTransition(eb::JobTransition {
            job: job.0,
            from_state: from.map(|s| super::job_state_to(s) as i32),
            to_state: super::job_state_to(*to) as i32,
            attempt: *attempt,
            node: node.map(|n| n.0),
            reason: Some(job_reason_to(reason)),
        }),
        EventBody::NodeStateChanged { node, state } => B::NodeStateChanged(eb::NodeStateChanged {
            node: node.0,
            state: node_state_to(*state) as i32,
        }),
        EventBody::BudgetAlert {
            scope,
            limit_micro,
            used_micro,
        } => B::BudgetAlert(eb::BudgetAlert {
            scope: Some(budget_scope_to(*scope)),
            limit_micro: *limit_micro,
            used_micro: *used_micro,
        }),
        EventBody::Denied {
            node,
            caller,
            api,
            reason,
        } => B::Denied(eb::Denied {
            node: *node,
            caller: Some(actor_to(caller)),
            api: api.clone(),
            reason: denial_reason_to(*reason) as i32,
        }),
        EventBody::BucketArchived { bucket } => {
            B::BucketArchived(eb::BucketArchived { bucket: bucket.0 })
        }
        EventBody::LowBalance {
            threshold_micro,
            available_micro,
        } => B::LowBalance(eb::LowBalance {
            threshold_micro: *threshold_micro,
            available_micro: *available_micro,
        }),
        EventBody::BudgetThreshold {
            scope,
            pct,
            limit_micro,
            used_micro,
        } => B::BudgetThreshold(eb::BudgetThreshold {
            scope: Some(budget_scope_to(*scope)),
            pct: *pct,
            limit_micro: *limit_micro,
            used_micro: *used_micro,
        }),
    };
    pb::EventBody { body: Some(arm) }
}

/// An event body (absent, or no arm set: `body` is required).
pub fn event_body_from(b: Option<&pb::EventBody>) -> Result<EventBody, FieldError> {
    use eb::Body as B;
    let b = required(b, "body")?;
    Ok(match required(b.body.as_ref(), "body")? {
        B::Command(c) => {
            let reply = required(c.outcome.as_ref(), "body.command.outcome")?;
            // The outcome's own fields are named inside the reply.
            let outcome = super::outcome_from(reply.result.as_ref()).map_err(|e| FieldError {
                field: format!("body.command.outcome.{}", e.field),
                problem: e.problem,
            })?;
            EventBody::Command {
                request: c.request,
                digest: hash32(&c.digest, "body.command.digest")?,
                outcome,
                replayed: c.replayed,
            }
        }
        B::Issued(m) => EventBody::Issued {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::HoldDrawn(m) => EventBody::HoldDrawn {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::Captured(m) => EventBody::Captured {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::CaptureReversed(m) => EventBody::CaptureReversed {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::Refunded(m) => EventBody::Refunded {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::RefundForfeited(m) => EventBody::RefundForfeited {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::BucketExpired(m) => EventBody::BucketExpired {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::TransferredOut(m) => EventBody::TransferredOut {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::TransferredIn(m) => EventBody::TransferredIn {
            bucket: BucketId(m.bucket),
            amount_micro: m.amount_micro,
        },
        B::JobTransition(t) => EventBody::JobTransition {
            job: JobId(t.job),
            from: match t.from_state {
                None => None,
                Some(0) => {
                    return Err(bad(
                        "body.job_transition.from_state",
                        "unspecified: leave it unset for no previous state",
                    ))
                }
                Some(v) => Some(super::job_state_from(v, "body.job_transition.from_state")?),
            },
            to: super::job_state_from(t.to_state, "body.job_transition.to_state")?,
            attempt: t.attempt,
            node: t.node.map(NodeId),
            reason: job_reason_from(t.reason.as_ref(), "body.job_transition.reason")?,
        },
        B::NodeStateChanged(m) => EventBody::NodeStateChanged {
            node: NodeId(m.node),
            state: node_state_from(m.state, "body.node_state_changed.state")?,
        },
        B::BudgetAlert(m) => EventBody::BudgetAlert {
            scope: budget_scope_from(m.scope.as_ref(), "body.budget_alert.scope")?,
            limit_micro: m.limit_micro,
            used_micro: m.used_micro,
        },
        B::Denied(m) => EventBody::Denied {
            node: m.node,
            caller: actor_from(m.caller.as_ref(), "body.denied.caller")?,
            api: m.api.clone(),
            reason: denial_reason_from(m.reason, "body.denied.reason")?,
        },
        B::BucketArchived(m) => EventBody::BucketArchived {
            bucket: BucketId(m.bucket),
        },
        B::LowBalance(m) => EventBody::LowBalance {
            threshold_micro: m.threshold_micro,
            available_micro: m.available_micro,
        },
        B::BudgetThreshold(m) => EventBody::BudgetThreshold {
            scope: budget_scope_from(m.scope.as_ref(), "body.budget_threshold.scope")?,
            pct: m.pct,
            limit_micro: m.limit_micro,
            used_micro: m.used_micro,
        },
    })
}
