//! The one place where the typed API's protobuf messages (`proto/allot_api.proto`,
//! package `allot.api.v1`) meet the state machine's Rust types, both ways.
//!
//! Inbound conversions check only the *shape* a protobuf message cannot express
//! (required fields present, enum values known, numbers in their Rust range) and name
//! the field they refuse ([`FieldError`] → `INVALID_ARGUMENT`); every rule about the
//! values themselves is the state machine's own (`allot_statemachine::validate`, run by
//! the node's edge on the converted request, and apply). Outbound conversions are total.

use crate::api::v1 as pb;
use allot_statemachine::audit::AuditEvent;
use allot_statemachine::ledger::{Balance, UpcomingExpiry};
use allot_statemachine::scheduler::{Job, JobState, Placement};
use allot_statemachine::{
    Account, Actor, BucketId, BucketKind, BucketPolicy, BudgetScope, Command, CommandError,
    GpuType, Grant, HeartbeatReply, JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, OrgId, Outcome,
    PrincipalId, ProjectId, Reply, RequestId, SettleReason, Settlement, Tier, UserId,
};
use std::collections::BTreeMap;

/// A field of a typed message this server cannot take: named, with what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    pub field: String,
    pub problem: String,
}

fn bad(field: &str, problem: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_string(),
        problem: problem.into(),
    }
}

fn required<'a, T>(v: Option<&'a T>, field: &str) -> Result<&'a T, FieldError> {
    v.ok_or_else(|| bad(field, "required"))
}

fn narrow<T: TryFrom<u32>>(v: u32, field: &str) -> Result<T, FieldError> {
    T::try_from(v).map_err(|_| bad(field, format!("{v} is out of range")))
}

// ---------------------------------------------------------------- headers

/// What a mutating call's header asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub request_id: RequestId,
    pub shard: Option<u32>,
    /// Dev mode's claimed identity (`None`: none claimed).
    pub dev_actor: Option<Actor>,
}

/// The header of a mutating call: `call.request_id` is required and non-zero.
pub fn header(call: Option<&pb::Call>) -> Result<Header, FieldError> {
    let call = required(call, "call")?;
    if call.request_id == 0 {
        return Err(bad(
            "call.request_id",
            "required: choose one per request and reuse it on every retry",
        ));
    }
    Ok(Header {
        request_id: RequestId::from(call.request_id),
        shard: call.shard,
        dev_actor: dev_actor(&call.dev_actor, "call.dev_actor")?,
    })
}

/// The header of a read (absent: defaults): (shard, stale reads allowed).
pub fn read_header(read: Option<&pb::Read>) -> (Option<u32>, bool) {
    read.map_or((None, false), |r| (r.shard, r.stale_ok))
}

/// A dev-mode identity: `admin`, `org:<id>` or `agent:<node>` (empty: none).
pub fn dev_actor(s: &str, field: &str) -> Result<Option<Actor>, FieldError> {
    if s.is_empty() {
        return Ok(None);
    }
    if s == "admin" {
        return Ok(Some(Actor::Admin(PrincipalId(1))));
    }
    let problem = || {
        bad(
            field,
            format!("{s:?}: expected admin, org:<id> or agent:<node>"),
        )
    };
    let (kind, id) = s.split_once(':').ok_or_else(problem)?;
    let id: u64 = id.parse().map_err(|_| problem())?;
    match kind {
        "org" => Ok(Some(Actor::Tenant {
            org: OrgId(id),
            principal: PrincipalId(1),
        })),
        "agent" => Ok(Some(Actor::Agent(NodeId(id)))),
        _ => Err(problem()),
    }
}

// ---------------------------------------------------------------- enums

pub fn bucket_kind_from(v: i32, field: &str) -> Result<BucketKind, FieldError> {
    match pb::BucketKind::try_from(v) {
        Ok(pb::BucketKind::Paid) => Ok(BucketKind::Paid),
        Ok(pb::BucketKind::Promotional) => Ok(BucketKind::Promotional),
        Ok(pb::BucketKind::Granted) => Ok(BucketKind::Granted),
        Ok(pb::BucketKind::Unspecified) => Err(bad(field, "required")),
        Err(_) => Err(bad(field, format!("unknown value {v}"))),
    }
}

pub fn bucket_kind_to(k: BucketKind) -> pb::BucketKind {
    match k {
        BucketKind::Paid => pb::BucketKind::Paid,
        BucketKind::Promotional => pb::BucketKind::Promotional,
        BucketKind::Granted => pb::BucketKind::Granted,
    }
}

pub fn job_state_to(s: JobState) -> pb::JobState {
    match s {
        JobState::Queued => pb::JobState::Queued,
        JobState::Placed => pb::JobState::Placed,
        JobState::Running => pb::JobState::Running,
        JobState::Preempting => pb::JobState::Preempting,
        JobState::Succeeded => pb::JobState::Succeeded,
        JobState::Failed => pb::JobState::Failed,
        JobState::Lost => pb::JobState::Lost,
        JobState::Cancelled => pb::JobState::Cancelled,
        JobState::Rejected => pb::JobState::Rejected,
    }
}

pub fn job_state_from(v: i32, field: &str) -> Result<JobState, FieldError> {
    Ok(match pb::JobState::try_from(v) {
        Ok(pb::JobState::Queued) => JobState::Queued,
        Ok(pb::JobState::Placed) => JobState::Placed,
        Ok(pb::JobState::Running) => JobState::Running,
        Ok(pb::JobState::Preempting) => JobState::Preempting,
        Ok(pb::JobState::Succeeded) => JobState::Succeeded,
        Ok(pb::JobState::Failed) => JobState::Failed,
        Ok(pb::JobState::Lost) => JobState::Lost,
        Ok(pb::JobState::Cancelled) => JobState::Cancelled,
        Ok(pb::JobState::Rejected) => JobState::Rejected,
        Ok(pb::JobState::Unspecified) => return Err(bad(field, "required")),
        Err(_) => return Err(bad(field, format!("unknown value {v}"))),
    })
}

pub fn settle_reason_to(r: SettleReason) -> pb::SettleReason {
    match r {
        SettleReason::Succeeded => pb::SettleReason::Succeeded,
        SettleReason::Failed => pb::SettleReason::Failed,
        SettleReason::Cancelled => pb::SettleReason::Cancelled,
        SettleReason::Preempted => pb::SettleReason::Preempted,
        SettleReason::NodeFailure => pb::SettleReason::NodeFailure,
        SettleReason::Lost => pb::SettleReason::Lost,
        SettleReason::OutOfCredits => pb::SettleReason::OutOfCredits,
    }
}

pub fn settle_reason_from(v: i32, field: &str) -> Result<SettleReason, FieldError> {
    Ok(match pb::SettleReason::try_from(v) {
        Ok(pb::SettleReason::Succeeded) => SettleReason::Succeeded,
        Ok(pb::SettleReason::Failed) => SettleReason::Failed,
        Ok(pb::SettleReason::Cancelled) => SettleReason::Cancelled,
        Ok(pb::SettleReason::Preempted) => SettleReason::Preempted,
        Ok(pb::SettleReason::NodeFailure) => SettleReason::NodeFailure,
        Ok(pb::SettleReason::Lost) => SettleReason::Lost,
        Ok(pb::SettleReason::OutOfCredits) => SettleReason::OutOfCredits,
        Ok(pb::SettleReason::Unspecified) => return Err(bad(field, "required")),
        Err(_) => return Err(bad(field, format!("unknown value {v}"))),
    })
}

/// The typed reason of a state-machine refusal (its stable `reason()` name).
pub fn reason_of(e: &CommandError) -> pb::Reason {
    pb::Reason::from_str_name(&format!("REASON_{}", e.reason())).unwrap_or(pb::Reason::Unspecified)
}

// ---------------------------------------------------------------- ledger types

pub fn account_from(a: Option<&pb::Account>, field: &str) -> Result<Account, FieldError> {
    let a = required(a, field)?;
    Ok(match a.project {
        Some(p) => Account::Project(ProjectId(p)),
        None => Account::Org(OrgId(a.org)),
    })
}

/// An account with the org it belongs to (a project account's org is not in the Rust
/// type: the request names it).
pub fn account_to(org: OrgId, a: Account) -> pb::Account {
    match a {
        Account::Org(o) => pb::Account {
            org: o.0,
            project: None,
        },
        Account::Project(p) => pb::Account {
            org: org.0,
            project: Some(p.0),
        },
    }
}

fn policy_from(p: Option<&pb::BucketPolicy>) -> Result<Option<BucketPolicy>, FieldError> {
    let Some(p) = p else { return Ok(None) };
    let tiers = p
        .tiers
        .iter()
        .map(|t| narrow::<u8>(*t, "policy.tiers").map(Tier))
        .collect::<Result<_, _>>()?;
    Ok(Some(BucketPolicy {
        gpu_types: p.gpu_types.iter().map(|g| GpuType(g.clone())).collect(),
        tiers,
    }))
}

fn policy_to(p: &BucketPolicy) -> pb::BucketPolicy {
    pb::BucketPolicy {
        gpu_types: p.gpu_types.iter().map(|g| g.0.clone()).collect(),
        tiers: p.tiers.iter().map(|t| u32::from(t.0)).collect(),
    }
}

pub fn grant_from(r: &pb::IssueGrantRequest) -> Result<Grant, FieldError> {
    Ok(Grant {
        bucket: BucketId(r.bucket),
        owner: account_from(r.owner.as_ref(), "owner")?,
        kind: bucket_kind_from(r.kind, "kind")?,
        amount_micro: r.amount_micro,
        expires_at_ms: r.expires_at_ms,
        priority: narrow(r.priority, "priority")?,
        policy: policy_from(r.policy.as_ref())?,
        source_ref: (!r.source_ref.is_empty()).then(|| r.source_ref.clone()),
    })
}

pub fn grant_to(org: OrgId, g: &Grant) -> pb::IssueGrantRequest {
    pb::IssueGrantRequest {
        call: None,
        bucket: g.bucket.0,
        owner: Some(account_to(org, g.owner)),
        kind: bucket_kind_to(g.kind) as i32,
        amount_micro: g.amount_micro,
        expires_at_ms: g.expires_at_ms,
        priority: u32::from(g.priority),
        policy: g.policy.as_ref().map(policy_to),
        source_ref: g.source_ref.clone().unwrap_or_default(),
        expires_in_ms: None,
    }
}

pub fn balance_to(b: &Balance) -> pb::Balance {
    pb::Balance {
        paid_available_micro: b.paid_available_micro,
        promotional_available_micro: b.promotional_available_micro,
        granted_available_micro: b.granted_available_micro,
        held_micro: b.held_micro,
        consumed_micro: b.consumed_micro,
        expired_micro: b.expired_micro,
        issued_micro: b.issued_micro,
        moved_in_micro: b.moved_in_micro,
        moved_out_micro: b.moved_out_micro,
        upcoming_expirations: b
            .upcoming_expirations
            .iter()
            .map(|u| pb::UpcomingExpiry {
                bucket: u.bucket.0,
                kind: bucket_kind_to(u.kind) as i32,
                remaining_micro: u.remaining_micro,
                expires_at_ms: u.expires_at_ms,
            })
            .collect(),
        available_micro: b
            .paid_available_micro
            .saturating_add(b.promotional_available_micro)
            .saturating_add(b.granted_available_micro),
    }
}

pub fn balance_from(b: &pb::Balance) -> Result<Balance, FieldError> {
    Ok(Balance {
        paid_available_micro: b.paid_available_micro,
        promotional_available_micro: b.promotional_available_micro,
        granted_available_micro: b.granted_available_micro,
        held_micro: b.held_micro,
        consumed_micro: b.consumed_micro,
        expired_micro: b.expired_micro,
        issued_micro: b.issued_micro,
        moved_in_micro: b.moved_in_micro,
        moved_out_micro: b.moved_out_micro,
        upcoming_expirations: b
            .upcoming_expirations
            .iter()
            .map(|u| {
                Ok(UpcomingExpiry {
                    bucket: BucketId(u.bucket),
                    kind: bucket_kind_from(u.kind, "upcoming_expirations.kind")?,
                    expires_at_ms: u.expires_at_ms,
                    remaining_micro: u.remaining_micro,
                })
            })
            .collect::<Result<_, FieldError>>()?,
    })
}

// ---------------------------------------------------------------- jobs

pub fn job_spec_from(s: Option<&pb::JobSpec>) -> Result<JobSpec, FieldError> {
    let s = required(s, "spec")?;
    Ok(JobSpec {
        job: JobId(s.job),
        project: ProjectId(s.project),
        user: UserId(s.user),
        tier: Tier(narrow(s.tier, "spec.tier")?),
        gpu_types: s.gpu_types.iter().map(|g| GpuType(g.clone())).collect(),
        gpus: s.gpus,
        mem_floor_gb: s.mem_floor_gb,
        preemptible: s.preemptible,
        checkpointable: s.checkpointable,
        max_duration_ms: s.max_duration_ms,
    })
}

pub fn job_spec_to(s: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        job: s.job.0,
        project: s.project.0,
        user: s.user.0,
        tier: u32::from(s.tier.0),
        gpu_types: s.gpu_types.iter().map(|g| g.0.clone()).collect(),
        gpus: s.gpus,
        mem_floor_gb: s.mem_floor_gb,
        preemptible: s.preemptible,
        checkpointable: s.checkpointable,
        max_duration_ms: s.max_duration_ms,
    }
}

pub fn settlement_to(s: &Settlement) -> pb::Settlement {
    pb::Settlement {
        reason: settle_reason_to(s.reason) as i32,
        captured_micro: s.captured_micro,
        refunded_micro: s.refunded_micro,
        forfeited_micro: s.forfeited_micro,
        uncollected_micro: s.uncollected_micro,
    }
}

pub fn settlement_from(s: &pb::Settlement) -> Result<Settlement, FieldError> {
    Ok(Settlement {
        reason: settle_reason_from(s.reason, "settlement.reason")?,
        captured_micro: s.captured_micro,
        refunded_micro: s.refunded_micro,
        forfeited_micro: s.forfeited_micro,
        uncollected_micro: s.uncollected_micro,
    })
}

pub fn heartbeat_to(h: &HeartbeatReply) -> pb::HeartbeatResult {
    pb::HeartbeatResult {
        accepted: h.accepted,
        captured_delta_micro: h.captured_delta_micro,
        captured_attempt_micro: h.captured_attempt_micro,
        held_micro: h.held_micro,
        stop: h.stop.as_ref().map(settlement_to),
    }
}

pub fn heartbeat_from(h: &pb::HeartbeatResult) -> Result<HeartbeatReply, FieldError> {
    Ok(HeartbeatReply {
        accepted: h.accepted,
        captured_delta_micro: h.captured_delta_micro,
        captured_attempt_micro: h.captured_attempt_micro,
        held_micro: h.held_micro,
        stop: h.stop.as_ref().map(settlement_from).transpose()?,
    })
}

fn placement_to(p: &Placement) -> pb::Placement {
    pb::Placement {
        node: p.node.0,
        gpu_indices: p.gpu_indices.iter().map(|i| u32::from(*i)).collect(),
        gpu_type: p.gpu_type.0.clone(),
        price_micro_per_gpu_hour: p.price_micro_per_gpu_hour,
        started_ms: p.started_ms,
    }
}

/// The public view of a job (timers and internal bookkeeping are not part of it).
pub fn job_to(j: &Job) -> pb::Job {
    pb::Job {
        spec: Some(job_spec_to(&j.spec)),
        org: j.org.0,
        state: job_state_to(j.state) as i32,
        attempt: j.attempt,
        submitted_ms: j.submitted_ms,
        placement: j.placement.as_ref().map(placement_to),
        run_ms: j.run_ms,
        preemptions: j.preemptions,
        hold_micro: j.hold_micro,
        last_reason: variant_name(&j.last_reason),
        finished_ms: j.finished_ms,
        node_failures: j.node_failures,
    }
}

pub fn node_spec_from(r: &pb::RegisterNodeRequest) -> NodeSpec {
    NodeSpec {
        node: NodeId(r.node),
        gpu_type: GpuType(r.gpu_type.clone()),
        gpu_count: r.gpus,
        gpu_mem_gb: r.mem_gb,
        // A protobuf map has no order: sorted by key, as the state machine keeps them.
        labels: r
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect(),
    }
}

pub fn node_spec_to(n: &NodeSpec) -> pb::RegisterNodeRequest {
    pb::RegisterNodeRequest {
        call: None,
        node: n.node.0,
        gpu_type: n.gpu_type.0.clone(),
        gpus: n.gpu_count,
        mem_gb: n.gpu_mem_gb,
        labels: n.labels.iter().cloned().collect(),
    }
}

pub fn job_heartbeat_from(r: &pb::JobHeartbeatRequest) -> JobHeartbeat {
    JobHeartbeat {
        job: JobId(r.job),
        attempt: r.attempt,
        seq: r.seq,
        progress_ppm: r.progress_ppm,
        checkpoint: r.checkpoint,
    }
}

pub fn job_heartbeat_to(org: OrgId, h: &JobHeartbeat) -> pb::JobHeartbeatRequest {
    pb::JobHeartbeatRequest {
        call: None,
        org: org.0,
        job: h.job.0,
        attempt: h.attempt,
        seq: h.seq,
        progress_ppm: h.progress_ppm,
        checkpoint: h.checkpoint,
    }
}

// ---------------------------------------------------------------- commands

/// A typed mutating request: its header, and the state machine's command with the org
/// it acts in.
pub trait TypedCommand {
    fn call(&self) -> Option<&pb::Call>;
    fn command(&self) -> Result<(Command, Option<OrgId>), FieldError>;
}

macro_rules! typed_command {
    ($t:ty, |$r:ident| $body:expr) => {
        impl TypedCommand for $t {
            fn call(&self) -> Option<&pb::Call> {
                self.call.as_ref()
            }
            fn command(&self) -> Result<(Command, Option<OrgId>), FieldError> {
                let $r = self;
                $body
            }
        }
    };
}

typed_command!(pb::CreateOrgRequest, |r| Ok((
    Command::CreateOrg { org: OrgId(r.org) },
    Some(OrgId(r.org))
)));
typed_command!(pb::CreateProjectRequest, |r| Ok((
    Command::CreateProject {
        project: ProjectId(r.project),
        org: OrgId(r.org),
    },
    Some(OrgId(r.org))
)));
typed_command!(pb::CreateUserRequest, |r| Ok((
    Command::CreateUser {
        user: UserId(r.user),
        org: OrgId(r.org),
    },
    Some(OrgId(r.org))
)));
typed_command!(pb::IssueGrantRequest, |r| {
    let org = r.owner.as_ref().map(|o| OrgId(o.org));
    let grant = grant_from(r)?;
    let command = match (r.expires_at_ms, r.expires_in_ms) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "expires_in_ms",
                "set at most one of expires_at_ms and expires_in_ms",
            ))
        }
        (_, Some(expires_in_ms)) => Command::IssueGrantIn {
            grant,
            expires_in_ms,
        },
        (_, None) => Command::IssueGrant(grant),
    };
    Ok((command, org))
});
typed_command!(pb::SetPricesRequest, |r| Ok((
    Command::SetPrices {
        prices: r
            .prices
            .iter()
            .map(|p| (GpuType(p.gpu_type.clone()), p.micro_per_gpu_hour))
            .collect(),
    },
    None
)));
typed_command!(pb::SubmitJobRequest, |r| Ok((
    Command::SubmitJob(job_spec_from(r.spec.as_ref())?),
    Some(OrgId(r.org))
)));
typed_command!(pb::SetAlertRequest, |r| {
    let org = OrgId(r.org);
    let scope = match (r.project, r.user) {
        (Some(_), Some(_)) => return Err(bad("user", "set at most one of project and user")),
        (Some(p), None) => BudgetScope::Project(ProjectId(p)),
        (None, Some(u)) => BudgetScope::User(UserId(u)),
        (None, None) => BudgetScope::Org(org),
    };
    let alert = (!r.remove).then(|| allot_statemachine::alerts::AlertSpec {
        low_balance_micro: r.low_balance_micro,
        budget_pcts: r.budget_pcts.clone(),
    });
    Ok((Command::SetAlert { scope, alert }, Some(org)))
});
typed_command!(pb::CancelJobRequest, |r| Ok((
    Command::CancelJob { job: JobId(r.job) },
    Some(OrgId(r.org))
)));
typed_command!(pb::RegisterNodeRequest, |r| Ok((
    Command::RegisterNode(node_spec_from(r)),
    None
)));
typed_command!(pb::NodeHeartbeatRequest, |r| Ok((
    Command::NodeHeartbeat {
        node: NodeId(r.node)
    },
    None
)));
typed_command!(pb::JobHeartbeatRequest, |r| Ok((
    Command::JobHeartbeat(job_heartbeat_from(r)),
    Some(OrgId(r.org))
)));
typed_command!(pb::FinishJobRequest, |r| Ok((
    Command::FinishJob {
        job: JobId(r.job),
        attempt: r.attempt,
        success: r.success,
    },
    Some(OrgId(r.org))
)));

// ---------------------------------------------------------------- outcomes

/// A refusal as the typed `Error`: its stable reason, its message and its fields.
pub fn error_to(e: &CommandError) -> pb::Error {
    let (_, details) = flatten(&serde_json::to_value(e).unwrap_or_default());
    pb::Error {
        reason: reason_of(e) as i32,
        message: e.to_string(),
        details: details.into_iter().collect(),
    }
}

/// The typed result of one applied command.
pub fn outcome_to(o: &Outcome) -> pb::command_reply::Result {
    use pb::command_reply::Result as R;
    let settled = |s: &Option<Settlement>| {
        R::Settled(pb::SettlementResult {
            settlement: s.as_ref().map(settlement_to),
        })
    };
    match o {
        Err(e) => R::Error(error_to(e)),
        Ok(Reply::Created) => R::Created(pb::Empty {}),
        Ok(Reply::GrantIssued { bucket }) => R::GrantIssued(pb::GrantIssued { bucket: bucket.0 }),
        Ok(Reply::JobSubmitted {
            job,
            hold_micro,
            state,
        }) => R::JobSubmitted(pb::JobSubmitted {
            job: job.0,
            hold_micro: *hold_micro,
            state: job_state_to(*state) as i32,
        }),
        Ok(Reply::JobCancelled(s)) | Ok(Reply::JobFinished(s)) => settled(s),
        Ok(Reply::Settled(s)) => settled(&Some(s.clone())),
        Ok(Reply::JobHeartbeat(h)) | Ok(Reply::Heartbeat(h)) => R::Heartbeat(heartbeat_to(h)),
        Ok(Reply::NodeRegistered) => R::NodeRegistered(pb::Empty {}),
        Ok(Reply::NodeUpdated) => R::NodeUpdated(pb::Empty {}),
        Ok(Reply::PricesSet { version }) => R::PricesSet(pb::PricesSet { version: *version }),
        Ok(Reply::AlertSet) => R::AlertSet(pb::Empty {}),
        // Replies of commands outside the typed API's commands: none of its RPCs
        // produces them, and they carry nothing a caller of these RPCs needs.
        Ok(_) => R::Created(pb::Empty {}),
    }
}

// ---------------------------------------------------------------- audit

/// An actor as text: `admin:<principal>`, `org:<org>`, `project:<org>/<project>`,
/// `user:<org>/<project>/<user>`, `agent:<node>`, `system`, `anonymous`, `token`.
pub fn actor_text(a: &Actor) -> String {
    match a {
        Actor::Admin(p) => format!("admin:{}", p.0),
        Actor::Tenant { org, .. } => format!("org:{}", org.0),
        Actor::Project { org, project, .. } => format!("project:{}/{}", org.0, project.0),
        Actor::User {
            org, project, user, ..
        } => format!("user:{}/{}/{}", org.0, project.0, user.0),
        Actor::Agent(n) => format!("agent:{}", n.0),
        Actor::System => "system".into(),
        Actor::Anonymous => "anonymous".into(),
        Actor::Bearer(_) => "token".into(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An audit event, typed: common fields as fields, the body as its kind and its fields
/// by name.
pub fn audit_event_to(e: &AuditEvent) -> pb::AuditEvent {
    let (kind, fields) = flatten(&serde_json::to_value(&e.body).unwrap_or_default());
    pb::AuditEvent {
        seq: e.seq,
        log_index: e.log_index,
        logical_time_ms: e.time_ms,
        request_id: u64::try_from(e.request_id).unwrap_or(u64::MAX),
        actor: actor_text(&e.actor),
        kind,
        org: e.org.map(|o| o.0),
        account: e.account.map(|a| account_to(e.org.unwrap_or(OrgId(0)), a)),
        hold: e.hold.map(|h| h.0),
        fields: fields.into_iter().collect(),
        prev_hash: hex(&e.prev_hash),
        hash: hex(&e.hash),
    }
}

/// The variant name of a serde-serialised enum value.
fn variant_name<T: serde::Serialize>(v: &T) -> String {
    flatten(&serde_json::to_value(v).unwrap_or_default()).0
}

/// An externally tagged serde value as (variant name, its fields as text): numbers in
/// decimal, strings as they are, anything else as JSON text.
fn flatten(v: &serde_json::Value) -> (String, BTreeMap<String, String>) {
    use serde_json::Value;
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    match v {
        Value::String(name) => (name.clone(), BTreeMap::new()),
        Value::Object(m) if m.len() == 1 => {
            let (name, inner) = m.iter().next().expect("one entry");
            let fields = match inner {
                Value::Object(f) => f.iter().map(|(k, v)| (k.clone(), text(v))).collect(),
                Value::Null => BTreeMap::new(),
                other => BTreeMap::from([("value".to_string(), text(other))]),
            };
            (name.clone(), fields)
        }
        other => (
            String::new(),
            BTreeMap::from([("value".to_string(), text(other))]),
        ),
    }
}
