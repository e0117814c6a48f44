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
use allot_statemachine::scheduler::{Job, JobState, Placement, SchedulerSettings, TierConfig};
use allot_statemachine::security::Scope as TokenScope;
use allot_statemachine::{
    Account, Actor, BucketId, BucketKind, BucketPolicy, BudgetMode, BudgetPeriod, BudgetScope,
    BudgetSpec, Command, CommandError, DrawReport, GpuType, Grant, Heartbeat, HeartbeatReply,
    HoldId, HoldSpec, JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, OrgId, Outcome, Plan,
    PrincipalId, ProjectId, Quota, Reply, Request, RequestId, RunnerExit, SettleReason, Settlement,
    Tier, TokenDigest, UserId,
};
use std::collections::BTreeMap;

pub mod audit;
pub mod query;

/// A field of a typed message this server cannot take: named, with what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    pub field: String,
    pub problem: String,
}

pub(crate) fn bad(field: &str, problem: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_string(),
        problem: problem.into(),
    }
}

pub(crate) fn required<'a, T>(v: Option<&'a T>, field: &str) -> Result<&'a T, FieldError> {
    v.ok_or_else(|| bad(field, "required"))
}

pub(crate) fn narrow<T: TryFrom<u32>>(v: u32, field: &str) -> Result<T, FieldError> {
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
    if call.request_id == 0 && call.request_id_high == 0 {
        return Err(bad(
            "call.request_id",
            "required: choose one per request and reuse it on every retry",
        ));
    }
    Ok(Header {
        request_id: (u128::from(call.request_id_high) << 64) | u128::from(call.request_id),
        shard: call.shard,
        dev_actor: dev_actor(&call.dev_actor, "call.dev_actor")?,
    })
}

/// The header of a read (absent: defaults): (shard, stale reads allowed).
pub fn read_header(read: Option<&pb::Read>) -> (Option<u32>, bool) {
    read.map_or((None, false), |r| (r.shard, r.stale_ok))
}

/// A dev-mode identity (empty: none): `admin`, `org:<org>`, `project:<org>/<project>`,
/// `user:<org>/<project>/<user>`, `agent:<node>`, `system` or `anonymous`; an admin or
/// tenant identity may end in `@<principal>` (default 1). [`dev_actor_text`] writes it.
pub fn dev_actor(s: &str, field: &str) -> Result<Option<Actor>, FieldError> {
    if s.is_empty() {
        return Ok(None);
    }
    let problem = || {
        bad(
            field,
            format!(
                "{s:?}: expected admin, org:<id>, project:<org>/<project>, \
                 user:<org>/<project>/<user> or agent:<node> (tenants and admin may \
                 end in @<principal>)"
            ),
        )
    };
    let (body, principal) = match s.rsplit_once('@') {
        Some((b, p)) => (b, PrincipalId(p.parse().map_err(|_| problem())?)),
        None => (s, PrincipalId(1)),
    };
    let ids = |t: &str, n: usize| -> Result<Vec<u64>, FieldError> {
        let v = t
            .split('/')
            .map(|x| x.parse::<u64>().map_err(|_| problem()))
            .collect::<Result<Vec<_>, _>>()?;
        if v.len() == n {
            Ok(v)
        } else {
            Err(problem())
        }
    };
    let with_principal = !matches!(body.split_once(':'), Some(("agent", _)))
        && !matches!(body, "system" | "anonymous");
    if s.contains('@') && !with_principal {
        return Err(problem());
    }
    let actor = match body.split_once(':') {
        None if body == "admin" => Actor::Admin(principal),
        None if body == "system" => Actor::System,
        None if body == "anonymous" => Actor::Anonymous,
        Some(("admin", p)) if !s.contains('@') => {
            Actor::Admin(PrincipalId(p.parse().map_err(|_| problem())?))
        }
        Some(("org", t)) => Actor::Tenant {
            org: OrgId(ids(t, 1)?[0]),
            principal,
        },
        Some(("project", t)) => {
            let v = ids(t, 2)?;
            Actor::Project {
                org: OrgId(v[0]),
                project: ProjectId(v[1]),
                principal,
            }
        }
        Some(("user", t)) => {
            let v = ids(t, 3)?;
            Actor::User {
                org: OrgId(v[0]),
                project: ProjectId(v[1]),
                user: UserId(v[2]),
                principal,
            }
        }
        Some(("agent", t)) => Actor::Agent(NodeId(ids(t, 1)?[0])),
        _ => return Err(problem()),
    };
    Ok(Some(actor))
}

/// The text [`dev_actor`] reads back as `a` (empty for a bearer token's digest: a call
/// with a token runs as its token).
pub fn dev_actor_text(a: &Actor) -> String {
    let at = |p: PrincipalId| {
        if p.0 == 1 {
            String::new()
        } else {
            format!("@{}", p.0)
        }
    };
    match a {
        Actor::Admin(p) => format!("admin{}", at(*p)),
        Actor::Tenant { org, principal } => format!("org:{}{}", org.0, at(*principal)),
        Actor::Project {
            org,
            project,
            principal,
        } => format!("project:{}/{}{}", org.0, project.0, at(*principal)),
        Actor::User {
            org,
            project,
            user,
            principal,
        } => format!("user:{}/{}/{}{}", org.0, project.0, user.0, at(*principal)),
        Actor::Agent(n) => format!("agent:{}", n.0),
        Actor::System => "system".into(),
        Actor::Anonymous => "anonymous".into(),
        Actor::Bearer(_) => String::new(),
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
        JobState::Attached => pb::JobState::Attached,
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
        Ok(pb::JobState::Attached) => JobState::Attached,
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
        SettleReason::Deduplicated => pb::SettleReason::Deduplicated,
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
        Ok(pb::SettleReason::Deduplicated) => SettleReason::Deduplicated,
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
        None => Account::Org(OrgId(*required(a.org.as_ref(), &format!("{field}.org"))?)),
    })
}

/// An account with the org it belongs to (a project account's org is not in the Rust
/// type: the request names it).
pub fn account_to(org: OrgId, a: Account) -> pb::Account {
    account_in(Some(org), a)
}

/// An account in a command: a project account's org is the command's namespace, if it
/// names one.
pub fn account_in(org: Option<OrgId>, a: Account) -> pb::Account {
    match a {
        Account::Org(o) => pb::Account {
            org: Some(o.0),
            project: None,
        },
        Account::Project(p) => pb::Account {
            org: org.map(|o| o.0),
            project: Some(p.0),
        },
    }
}

pub(crate) fn policy_from(p: &pb::BucketPolicy, field: &str) -> Result<BucketPolicy, FieldError> {
    Ok(BucketPolicy {
        gpu_types: p.gpu_types.iter().map(|g| GpuType(g.clone())).collect(),
        tiers: tiers_from(&p.tiers, &format!("{field}.tiers"))?,
    })
}

pub(crate) fn policy_to(p: &BucketPolicy) -> pb::BucketPolicy {
    pb::BucketPolicy {
        gpu_types: p.gpu_types.iter().map(|g| g.0.clone()).collect(),
        tiers: tiers_to(&p.tiers),
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
        policy: r
            .policy
            .as_ref()
            .map(|p| policy_from(p, "policy"))
            .transpose()?,
        source_ref: (!r.source_ref.is_empty()).then(|| r.source_ref.clone()),
    })
}

pub fn grant_to(org: OrgId, g: &Grant) -> pb::IssueGrantRequest {
    grant_in(Some(org), g)
}

/// A grant in a command (a project owner's org: the command's namespace, if named).
pub fn grant_in(org: Option<OrgId>, g: &Grant) -> pb::IssueGrantRequest {
    pb::IssueGrantRequest {
        call: None,
        bucket: g.bucket.0,
        owner: Some(account_in(org, g.owner)),
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
        meter: false,
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

pub fn node_spec_from(r: &pb::RegisterNodeRequest) -> Result<NodeSpec, FieldError> {
    let labels = match (r.labels.is_empty(), r.label_list.is_empty()) {
        (false, false) => {
            return Err(bad(
                "label_list",
                "set at most one of labels and label_list",
            ))
        }
        // A protobuf map has no order: sorted by key, as the state machine keeps them.
        (false, true) => r
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect(),
        (true, _) => r
            .label_list
            .iter()
            .map(|l| (l.key.clone(), l.value.clone()))
            .collect(),
    };
    Ok(NodeSpec {
        node: NodeId(r.node),
        gpu_type: GpuType(r.gpu_type.clone()),
        gpu_count: r.gpus,
        gpu_mem_gb: r.mem_gb,
        labels,
        incarnation: r.incarnation,
    })
}

pub fn node_spec_to(n: &NodeSpec) -> pb::RegisterNodeRequest {
    pb::RegisterNodeRequest {
        call: None,
        node: n.node.0,
        gpu_type: n.gpu_type.0.clone(),
        gpus: n.gpu_count,
        mem_gb: n.gpu_mem_gb,
        labels: Default::default(),
        label_list: n
            .labels
            .iter()
            .map(|(key, value)| pb::Label {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        incarnation: n.incarnation,
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

pub fn job_heartbeat_to(org: Option<OrgId>, h: &JobHeartbeat) -> pb::JobHeartbeatRequest {
    pb::JobHeartbeatRequest {
        call: None,
        org: org.map(|o| o.0),
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
    let org = r.owner.as_ref().and_then(|o| o.org).map(OrgId);
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
typed_command!(pb::SubmitJobRequest, |r| {
    let spec = job_spec_from(r.spec.as_ref())?;
    let command = match &r.dedup_key {
        None => Command::SubmitJob(spec),
        Some(key) => Command::SubmitJobDedup {
            spec,
            key: allot_statemachine::DedupKey(key.clone()),
        },
    };
    Ok((command, r.org.map(OrgId)))
});
typed_command!(pb::SetAlertRequest, |r| {
    let org = r.org.map(OrgId);
    let scope = match (r.project, r.user) {
        (Some(_), Some(_)) => return Err(bad("user", "set at most one of project and user")),
        (Some(p), None) => BudgetScope::Project(ProjectId(p)),
        (None, Some(u)) => BudgetScope::User(UserId(u)),
        (None, None) => BudgetScope::Org(*required(org.as_ref(), "org")?),
    };
    let alert = (!r.remove).then(|| allot_statemachine::alerts::AlertSpec {
        low_balance_micro: r.low_balance_micro,
        budget_pcts: r.budget_pcts.clone(),
    });
    Ok((Command::SetAlert { scope, alert }, org))
});
typed_command!(pb::CancelJobRequest, |r| Ok((
    Command::CancelJob { job: JobId(r.job) },
    r.org.map(OrgId)
)));
typed_command!(pb::RegisterNodeRequest, |r| Ok((
    Command::RegisterNode(node_spec_from(r)?),
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
    r.org.map(OrgId)
)));
typed_command!(pb::FinishJobRequest, |r| Ok((
    match &r.exit {
        None => Command::FinishJob {
            job: JobId(r.job),
            attempt: r.attempt,
            success: r.success,
        },
        Some(e) => Command::FinishJobAt {
            job: JobId(r.job),
            attempt: r.attempt,
            success: r.success,
            exit: RunnerExit {
                heartbeat_seq: e.heartbeat_seq,
                after_ms: e.after_ms,
            },
        },
    },
    r.org.map(OrgId)
)));

// ---------------------------------------------------------------- more command parts

fn enum_value<T>(
    v: i32,
    field: &str,
    known: Result<T, prost::UnknownEnumValue>,
) -> Result<T, FieldError> {
    known.map_err(|_| bad(field, format!("unknown value {v}")))
}

pub fn scope_from(s: Option<&pb::Scope>, field: &str) -> Result<BudgetScope, FieldError> {
    let s = required(s, field)?;
    Ok(match (s.project, s.user) {
        (Some(_), Some(_)) => {
            return Err(bad(
                &format!("{field}.user"),
                "set at most one of project and user",
            ))
        }
        (Some(p), None) => BudgetScope::Project(ProjectId(p)),
        (None, Some(u)) => BudgetScope::User(UserId(u)),
        (None, None) => {
            BudgetScope::Org(OrgId(*required(s.org.as_ref(), &format!("{field}.org"))?))
        }
    })
}

/// A scope with the org it is in (a project's or user's org is not in the Rust type:
/// the command's namespace, if it names one).
pub fn scope_to(org: Option<OrgId>, s: BudgetScope) -> pb::Scope {
    match s {
        BudgetScope::Org(o) => pb::Scope {
            org: Some(o.0),
            project: None,
            user: None,
        },
        BudgetScope::Project(p) => pb::Scope {
            org: org.map(|o| o.0),
            project: Some(p.0),
            user: None,
        },
        BudgetScope::User(u) => pb::Scope {
            org: org.map(|o| o.0),
            project: None,
            user: Some(u.0),
        },
    }
}

pub fn budget_period_to(p: BudgetPeriod) -> pb::BudgetPeriod {
    match p {
        BudgetPeriod::Day => pb::BudgetPeriod::Day,
        BudgetPeriod::Month => pb::BudgetPeriod::Month,
        BudgetPeriod::Lifetime => pb::BudgetPeriod::Lifetime,
    }
}

pub fn budget_period_from(v: i32, field: &str) -> Result<BudgetPeriod, FieldError> {
    Ok(match enum_value(v, field, pb::BudgetPeriod::try_from(v))? {
        pb::BudgetPeriod::Day => BudgetPeriod::Day,
        pb::BudgetPeriod::Month => BudgetPeriod::Month,
        pb::BudgetPeriod::Lifetime => BudgetPeriod::Lifetime,
        pb::BudgetPeriod::Unspecified => return Err(bad(field, "required")),
    })
}

pub fn budget_mode_to(m: BudgetMode) -> pb::BudgetMode {
    match m {
        BudgetMode::Hard => pb::BudgetMode::Hard,
        BudgetMode::Soft => pb::BudgetMode::Soft,
    }
}

pub fn budget_mode_from(v: i32, field: &str) -> Result<BudgetMode, FieldError> {
    Ok(match enum_value(v, field, pb::BudgetMode::try_from(v))? {
        pb::BudgetMode::Hard => BudgetMode::Hard,
        pb::BudgetMode::Soft => BudgetMode::Soft,
        pb::BudgetMode::Unspecified => return Err(bad(field, "required")),
    })
}

pub fn budget_spec_to(b: &BudgetSpec) -> pb::BudgetSpec {
    pb::BudgetSpec {
        limit_micro: b.limit_micro,
        period: budget_period_to(b.period) as i32,
        mode: budget_mode_to(b.mode) as i32,
    }
}

pub fn budget_spec_from(b: &pb::BudgetSpec) -> Result<BudgetSpec, FieldError> {
    Ok(BudgetSpec {
        limit_micro: b.limit_micro,
        period: budget_period_from(b.period, "budget.period")?,
        mode: budget_mode_from(b.mode, "budget.mode")?,
    })
}

pub fn quota_to(q: &Quota) -> pb::Quota {
    pb::Quota {
        queued_max: q.queued_max,
        running_max: q.running_max,
        holds_open_max: q.holds_open_max,
        records_max: q.records_max,
        buckets_max: q.buckets_max,
        principals_max: q.principals_max,
        projects_max: q.projects_max,
        users_max: q.users_max,
        finished_jobs_max: q.finished_jobs_max,
        settled_holds_max: q.settled_holds_max,
        streams_max: Some(q.streams_max),
    }
}

pub fn quota_from(q: &pb::Quota) -> Quota {
    Quota {
        queued_max: q.queued_max,
        running_max: q.running_max,
        holds_open_max: q.holds_open_max,
        records_max: q.records_max,
        buckets_max: q.buckets_max,
        principals_max: q.principals_max,
        projects_max: q.projects_max,
        users_max: q.users_max,
        finished_jobs_max: q.finished_jobs_max,
        settled_holds_max: q.settled_holds_max,
        // Unset (a client that predates the field): the default.
        streams_max: q
            .streams_max
            .unwrap_or_else(|| Quota::default().streams_max),
    }
}

/// Tiers from a repeated field, each narrowed to its Rust range (`field[i]` named).
pub(crate) fn tiers_from(t: &[u32], field: &str) -> Result<Vec<Tier>, FieldError> {
    t.iter()
        .enumerate()
        .map(|(i, t)| narrow::<u8>(*t, &format!("{field}[{i}]")).map(Tier))
        .collect()
}

pub(crate) fn tiers_to(t: &[Tier]) -> Vec<u32> {
    t.iter().map(|t| u32::from(t.0)).collect()
}

pub fn plan_to(p: &Plan) -> pb::Plan {
    pb::Plan {
        tiers: tiers_to(&p.tiers),
        project_tiers: p
            .project_tiers
            .iter()
            .map(|(project, tiers)| pb::ProjectTiers {
                project: project.0,
                tiers: tiers_to(tiers),
            })
            .collect(),
    }
}

pub fn plan_from(p: &pb::Plan) -> Result<Plan, FieldError> {
    Ok(Plan {
        tiers: tiers_from(&p.tiers, "plan.tiers")?,
        project_tiers: p
            .project_tiers
            .iter()
            .map(|pt| {
                Ok((
                    ProjectId(pt.project),
                    tiers_from(&pt.tiers, "plan.project_tiers.tiers")?,
                ))
            })
            .collect::<Result<_, FieldError>>()?,
    })
}

pub fn scheduler_settings_to(s: &SchedulerSettings) -> pb::SchedulerSettings {
    pb::SchedulerSettings {
        node_lease_ms: s.node_lease_ms,
        job_lease_ms: s.job_lease_ms,
        grace_ms: s.grace_ms,
        min_runtime_ms: s.min_runtime_ms,
        hysteresis_ms: s.hysteresis_ms,
        preemptions_per_job_max: s.preemptions_per_job_max,
        preemption_loss_max_gpu_ms: s.preemption_loss_max_gpu_ms,
        usage_half_life_ms: s.usage_half_life_ms,
        node_failure_requeues_max: s.node_failure_requeues_max,
        tiers: s
            .tiers
            .iter()
            .map(|t| pb::TierConfig {
                name: t.name.clone(),
                weight: t.weight,
                floor_pct: t.floor_pct,
                ceiling_pct: t.ceiling_pct,
                max_wait_ms: t.max_wait_ms,
                price_pct: t.price_pct,
            })
            .collect(),
        fence_margin_ms: s.fence_margin_ms,
    }
}

pub fn scheduler_settings_from(s: &pb::SchedulerSettings) -> SchedulerSettings {
    SchedulerSettings {
        node_lease_ms: s.node_lease_ms,
        job_lease_ms: s.job_lease_ms,
        grace_ms: s.grace_ms,
        min_runtime_ms: s.min_runtime_ms,
        hysteresis_ms: s.hysteresis_ms,
        preemptions_per_job_max: s.preemptions_per_job_max,
        preemption_loss_max_gpu_ms: s.preemption_loss_max_gpu_ms,
        usage_half_life_ms: s.usage_half_life_ms,
        node_failure_requeues_max: s.node_failure_requeues_max,
        tiers: s
            .tiers
            .iter()
            .map(|t| TierConfig {
                name: t.name.clone(),
                weight: t.weight,
                floor_pct: t.floor_pct,
                ceiling_pct: t.ceiling_pct,
                max_wait_ms: t.max_wait_ms,
                price_pct: t.price_pct,
            })
            .collect(),
        fence_margin_ms: s.fence_margin_ms,
    }
}

pub fn token_scope_to(s: &TokenScope) -> pb::TokenScope {
    use pb::token_scope::Scope as S;
    pb::TokenScope {
        scope: Some(match *s {
            TokenScope::Admin => S::Admin(pb::Empty {}),
            TokenScope::Org(o) => S::Org(o.0),
            TokenScope::Project { org, project } => S::Project(pb::Account {
                org: Some(org.0),
                project: Some(project.0),
            }),
            TokenScope::User { org, project, user } => S::User(pb::UserScope {
                org: org.0,
                project: project.0,
                user: user.0,
            }),
            TokenScope::Agent(n) => S::Agent(n.0),
        }),
    }
}

pub fn token_scope_from(s: Option<&pb::TokenScope>) -> Result<TokenScope, FieldError> {
    use pb::token_scope::Scope as S;
    let s = required(required(s, "scope")?.scope.as_ref(), "scope")?;
    Ok(match s {
        S::Admin(_) => TokenScope::Admin,
        S::Org(o) => TokenScope::Org(OrgId(*o)),
        S::Project(a) => TokenScope::Project {
            org: OrgId(*required(a.org.as_ref(), "scope.project.org")?),
            project: ProjectId(*required(a.project.as_ref(), "scope.project.project")?),
        },
        S::User(u) => TokenScope::User {
            org: OrgId(u.org),
            project: ProjectId(u.project),
            user: UserId(u.user),
        },
        S::Agent(n) => TokenScope::Agent(NodeId(*n)),
    })
}

pub fn digest_from(b: &[u8], field: &str) -> Result<TokenDigest, FieldError> {
    <[u8; 32]>::try_from(b)
        .map(TokenDigest)
        .map_err(|_| bad(field, format!("{} bytes; a SHA-256 digest has 32", b.len())))
}

typed_command!(pb::SetBudgetRequest, |r| {
    let scope = scope_from(r.scope.as_ref(), "scope")?;
    let budget = r.budget.as_ref().map(budget_spec_from).transpose()?;
    Ok((
        Command::SetBudget { scope, budget },
        r.scope.as_ref().and_then(|s| s.org).map(OrgId),
    ))
});
typed_command!(pb::CreateHoldRequest, |r| Ok((
    Command::CreateHold(HoldSpec {
        hold: HoldId(r.hold),
        project: ProjectId(r.project),
        user: UserId(r.user),
        tier: Tier(narrow(r.tier, "tier")?),
        gpu_types: r.gpu_types.iter().map(|g| GpuType(g.clone())).collect(),
        amount_micro: r.amount_micro,
    }),
    r.org.map(OrgId)
)));
typed_command!(pb::CaptureRequest, |r| Ok((
    Command::Capture {
        hold: HoldId(r.hold),
        amount_micro: r.amount_micro,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::TopUpRequest, |r| Ok((
    Command::TopUp {
        hold: HoldId(r.hold),
        amount_micro: r.amount_micro,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::ReleaseHoldRequest, |r| Ok((
    Command::ReleaseHold {
        hold: HoldId(r.hold)
    },
    r.org.map(OrgId)
)));
typed_command!(pb::StartMeterRequest, |r| Ok((
    Command::StartMeter {
        hold: HoldId(r.hold),
        attempt: r.attempt,
        gpu_type: GpuType(r.gpu_type.clone()),
        gpus: r.gpus,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::MeterHeartbeatRequest, |r| Ok((
    Command::Heartbeat(Heartbeat {
        hold: HoldId(r.hold),
        attempt: r.attempt,
        seq: r.seq,
        progress_ppm: r.progress_ppm,
        checkpoint: r.checkpoint,
    }),
    r.org.map(OrgId)
)));
typed_command!(pb::SettleRequest, |r| Ok((
    Command::Settle {
        hold: HoldId(r.hold),
        attempt: r.attempt,
        reason: settle_reason_from(r.reason, "reason")?,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::TransferRequest, |r| Ok((
    Command::Transfer {
        from: account_from(r.from.as_ref(), "from")?,
        to: account_from(r.to.as_ref(), "to")?,
        amount_micro: r.amount_micro,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::TickRequest, |_r| Ok((Command::Tick, None)));
typed_command!(pb::SetNodeDrainingRequest, |r| Ok((
    Command::SetNodeDraining {
        node: NodeId(r.node),
        draining: r.draining,
    },
    None
)));
typed_command!(pb::SetQuotaRequest, |r| Ok((
    Command::SetQuota {
        org: OrgId(r.org),
        quota: r.quota.as_ref().map(quota_from),
    },
    Some(OrgId(r.org))
)));
typed_command!(pb::ConfigureSchedulerRequest, |r| Ok((
    Command::ConfigureScheduler(scheduler_settings_from(required(
        r.settings.as_ref(),
        "settings"
    )?)),
    None
)));
typed_command!(pb::BootstrapRequest, |r| Ok((
    Command::Bootstrap {
        principal: PrincipalId(r.principal),
        digest: digest_from(&r.digest, "digest")?,
    },
    None
)));
typed_command!(pb::CreateTokenRequest, |r| Ok((
    Command::CreateToken {
        principal: PrincipalId(r.principal),
        digest: digest_from(&r.digest, "digest")?,
        scope: token_scope_from(r.scope.as_ref())?,
        expires_at_ms: r.expires_at_ms,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::RotateTokenRequest, |r| Ok((
    Command::RotateToken {
        principal: PrincipalId(r.principal),
        digest: digest_from(&r.digest, "digest")?,
        overlap_ms: r.overlap_ms,
    },
    r.org.map(OrgId)
)));
typed_command!(pb::RevokeTokenRequest, |r| Ok((
    Command::RevokeToken {
        principal: PrincipalId(r.principal)
    },
    r.org.map(OrgId)
)));
typed_command!(pb::SetShareWeightRequest, |r| {
    let scope = scope_from(r.scope.as_ref(), "scope")?;
    Ok((
        Command::SetShareWeight {
            scope,
            weight: r.weight,
        },
        r.scope.as_ref().and_then(|s| s.org).map(OrgId),
    ))
});
typed_command!(pb::ActivateVersionRequest, |r| Ok((
    Command::ActivateVersion { version: r.version },
    None
)));
typed_command!(pb::SetPlanRequest, |r| Ok((
    Command::SetPlan {
        org: OrgId(r.org),
        plan: r.plan.as_ref().map(plan_from).transpose()?,
    },
    Some(OrgId(r.org))
)));
typed_command!(pb::JobFencedRequest, |r| Ok((
    Command::JobFenced {
        job: JobId(r.job),
        attempt: r.attempt,
    },
    r.org.map(OrgId)
)));

/// The one command of an `Execute` batch entry: its header, command and org.
pub fn command_from(c: &pb::Command) -> Result<(Header, Command, Option<OrgId>), FieldError> {
    use pb::command::Command as C;
    fn go(t: &dyn TypedCommand) -> Result<(Header, Command, Option<OrgId>), FieldError> {
        let header = header(t.call())?;
        let (command, org) = t.command()?;
        Ok((header, command, org))
    }
    let c = required(c.command.as_ref(), "command")?;
    match c {
        C::CreateOrg(r) => go(r),
        C::CreateProject(r) => go(r),
        C::CreateUser(r) => go(r),
        C::SetPrices(r) => go(r),
        C::IssueGrant(r) => go(r),
        C::SetBudget(r) => go(r),
        C::CreateHold(r) => go(r),
        C::Capture(r) => go(r),
        C::TopUp(r) => go(r),
        C::ReleaseHold(r) => go(r),
        C::StartMeter(r) => go(r),
        C::MeterHeartbeat(r) => go(r),
        C::Settle(r) => go(r),
        C::Transfer(r) => go(r),
        C::Tick(r) => go(r),
        C::RegisterNode(r) => go(r),
        C::NodeHeartbeat(r) => go(r),
        C::SetNodeDraining(r) => go(r),
        C::SubmitJob(r) => go(r),
        C::CancelJob(r) => go(r),
        C::JobHeartbeat(r) => go(r),
        C::FinishJob(r) => go(r),
        C::SetQuota(r) => go(r),
        C::ConfigureScheduler(r) => go(r),
        C::Bootstrap(r) => go(r),
        C::CreateToken(r) => go(r),
        C::RotateToken(r) => go(r),
        C::RevokeToken(r) => go(r),
        C::SetShareWeight(r) => go(r),
        C::SetPlan(r) => go(r),
        C::JobFenced(r) => go(r),
        C::SetAlert(r) => go(r),
        C::ActivateVersion(r) => go(r),
    }
}

/// A request of the state machine as an `Execute` batch entry, with its header (the
/// request id and, for dev mode, its actor as text). `None` for the node's internal
/// commands (RecordDenials), which no client sends.
pub fn command_to(r: &Request) -> Option<pb::Command> {
    use pb::command::Command as C;
    let call = Some(pb::Call {
        request_id: r.request_id as u64,
        request_id_high: (r.request_id >> 64) as u64,
        shard: None,
        dev_actor: dev_actor_text(&r.actor),
    });
    let ns = r.org.map(|o| o.0);
    let command = match &r.command {
        Command::CreateOrg { org } => C::CreateOrg(pb::CreateOrgRequest { call, org: org.0 }),
        Command::CreateProject { project, org } => C::CreateProject(pb::CreateProjectRequest {
            call,
            org: org.0,
            project: project.0,
        }),
        Command::CreateUser { user, org } => C::CreateUser(pb::CreateUserRequest {
            call,
            org: org.0,
            user: user.0,
        }),
        Command::SetPrices { prices } => C::SetPrices(pb::SetPricesRequest {
            call,
            prices: prices
                .iter()
                .map(|(g, p)| pb::GpuPrice {
                    gpu_type: g.0.clone(),
                    micro_per_gpu_hour: *p,
                })
                .collect(),
        }),
        Command::IssueGrant(g) => C::IssueGrant(pb::IssueGrantRequest {
            call,
            ..grant_in(r.org, g)
        }),
        Command::IssueGrantIn {
            grant,
            expires_in_ms,
        } => C::IssueGrant(pb::IssueGrantRequest {
            call,
            expires_in_ms: Some(*expires_in_ms),
            ..grant_in(r.org, grant)
        }),
        Command::SetBudget { scope, budget } => C::SetBudget(pb::SetBudgetRequest {
            call,
            scope: Some(scope_to(r.org, *scope)),
            budget: budget.as_ref().map(budget_spec_to),
        }),
        Command::CreateHold(h) => C::CreateHold(pb::CreateHoldRequest {
            call,
            org: ns,
            hold: h.hold.0,
            project: h.project.0,
            user: h.user.0,
            tier: u32::from(h.tier.0),
            gpu_types: h.gpu_types.iter().map(|g| g.0.clone()).collect(),
            amount_micro: h.amount_micro,
        }),
        Command::Capture { hold, amount_micro } => C::Capture(pb::CaptureRequest {
            call,
            org: ns,
            hold: hold.0,
            amount_micro: *amount_micro,
        }),
        Command::TopUp { hold, amount_micro } => C::TopUp(pb::TopUpRequest {
            call,
            org: ns,
            hold: hold.0,
            amount_micro: *amount_micro,
        }),
        Command::ReleaseHold { hold } => C::ReleaseHold(pb::ReleaseHoldRequest {
            call,
            org: ns,
            hold: hold.0,
        }),
        Command::StartMeter {
            hold,
            attempt,
            gpu_type,
            gpus,
        } => C::StartMeter(pb::StartMeterRequest {
            call,
            org: ns,
            hold: hold.0,
            attempt: *attempt,
            gpu_type: gpu_type.0.clone(),
            gpus: *gpus,
        }),
        Command::Heartbeat(h) => C::MeterHeartbeat(pb::MeterHeartbeatRequest {
            call,
            org: ns,
            hold: h.hold.0,
            attempt: h.attempt,
            seq: h.seq,
            progress_ppm: h.progress_ppm,
            checkpoint: h.checkpoint,
        }),
        Command::Settle {
            hold,
            attempt,
            reason,
        } => C::Settle(pb::SettleRequest {
            call,
            org: ns,
            hold: hold.0,
            attempt: *attempt,
            reason: settle_reason_to(*reason) as i32,
        }),
        Command::Transfer {
            from,
            to,
            amount_micro,
        } => C::Transfer(pb::TransferRequest {
            call,
            org: ns,
            from: Some(account_in(r.org, *from)),
            to: Some(account_in(r.org, *to)),
            amount_micro: *amount_micro,
        }),
        Command::Tick => C::Tick(pb::TickRequest { call }),
        Command::RegisterNode(n) => C::RegisterNode(pb::RegisterNodeRequest {
            call,
            ..node_spec_to(n)
        }),
        Command::NodeHeartbeat { node } => {
            C::NodeHeartbeat(pb::NodeHeartbeatRequest { call, node: node.0 })
        }
        Command::SetNodeDraining { node, draining } => {
            C::SetNodeDraining(pb::SetNodeDrainingRequest {
                call,
                node: node.0,
                draining: *draining,
            })
        }
        Command::SubmitJob(spec) => C::SubmitJob(pb::SubmitJobRequest {
            call,
            org: ns,
            spec: Some(job_spec_to(spec)),
            dedup_key: None,
        }),
        Command::SubmitJobDedup { spec, key } => C::SubmitJob(pb::SubmitJobRequest {
            call,
            org: ns,
            spec: Some(job_spec_to(spec)),
            dedup_key: Some(key.0.clone()),
        }),
        Command::CancelJob { job } => C::CancelJob(pb::CancelJobRequest {
            call,
            org: ns,
            job: job.0,
        }),
        Command::JobHeartbeat(h) => C::JobHeartbeat(pb::JobHeartbeatRequest {
            call,
            ..job_heartbeat_to(r.org, h)
        }),
        c @ (Command::FinishJob { .. } | Command::FinishJobAt { .. }) => {
            let (job, attempt, success, exit) = c.finish_report()?;
            C::FinishJob(pb::FinishJobRequest {
                call,
                org: ns,
                job: job.0,
                attempt,
                success,
                exit: exit.map(|e| pb::RunnerExit {
                    heartbeat_seq: e.heartbeat_seq,
                    after_ms: e.after_ms,
                }),
            })
        }
        Command::SetQuota { org, quota } => C::SetQuota(pb::SetQuotaRequest {
            call,
            org: org.0,
            quota: quota.as_ref().map(quota_to),
        }),
        Command::ConfigureScheduler(s) => C::ConfigureScheduler(pb::ConfigureSchedulerRequest {
            call,
            settings: Some(scheduler_settings_to(s)),
        }),
        Command::Bootstrap { principal, digest } => C::Bootstrap(pb::BootstrapRequest {
            call,
            principal: principal.0,
            digest: digest.0.to_vec(),
        }),
        Command::CreateToken {
            principal,
            digest,
            scope,
            expires_at_ms,
        } => C::CreateToken(pb::CreateTokenRequest {
            call,
            principal: principal.0,
            digest: digest.0.to_vec(),
            scope: Some(token_scope_to(scope)),
            expires_at_ms: *expires_at_ms,
            org: r.org.map(|o| o.0),
        }),
        Command::RotateToken {
            principal,
            digest,
            overlap_ms,
        } => C::RotateToken(pb::RotateTokenRequest {
            call,
            principal: principal.0,
            digest: digest.0.to_vec(),
            overlap_ms: *overlap_ms,
            org: r.org.map(|o| o.0),
        }),
        Command::RevokeToken { principal } => C::RevokeToken(pb::RevokeTokenRequest {
            call,
            principal: principal.0,
            org: r.org.map(|o| o.0),
        }),
        Command::RecordDenials { .. } => return None,
        Command::SetShareWeight { scope, weight } => C::SetShareWeight(pb::SetShareWeightRequest {
            call,
            scope: Some(scope_to(r.org, *scope)),
            weight: *weight,
        }),
        Command::SetPlan { org, plan } => C::SetPlan(pb::SetPlanRequest {
            call,
            org: org.0,
            plan: plan.as_ref().map(plan_to),
        }),
        Command::ActivateVersion { version } => C::ActivateVersion(pb::ActivateVersionRequest {
            call,
            version: *version,
        }),
        Command::JobFenced { job, attempt } => C::JobFenced(pb::JobFencedRequest {
            call,
            org: ns,
            job: job.0,
            attempt: *attempt,
        }),
        Command::SetAlert { scope, alert } => {
            let s = scope_to(r.org, *scope);
            C::SetAlert(pb::SetAlertRequest {
                call,
                org: s.org,
                project: s.project,
                user: s.user,
                low_balance_micro: alert.as_ref().and_then(|a| a.low_balance_micro),
                budget_pcts: alert
                    .as_ref()
                    .map(|a| a.budget_pcts.clone())
                    .unwrap_or_default(),
                remove: alert.is_none(),
            })
        }
    };
    Some(pb::Command {
        command: Some(command),
    })
}

// ---------------------------------------------------------------- outcomes

/// A refusal as the typed `Error`: its stable reason, its message and its fields.
pub fn error_to(e: &CommandError) -> pb::Error {
    if let CommandError::Unrecognized {
        reason,
        message,
        details_json,
    } = e
    {
        // As it came: its flat details are rebuilt from its JSON.
        let json = serde_json::from_str(details_json).unwrap_or_default();
        let (_, details) = flatten(&json);
        return pb::Error {
            reason: *reason,
            message: message.clone(),
            details: details.into_iter().collect(),
            details_json: details_json.clone(),
        };
    }
    let json = serde_json::to_value(e).unwrap_or_default();
    let (_, details) = flatten(&json);
    pb::Error {
        reason: reason_of(e) as i32,
        message: e.to_string(),
        details: details.into_iter().collect(),
        details_json: json.to_string(),
    }
}

/// The exact refusal back from its `details_json`; one this build does not know (a
/// newer release's) as [`CommandError::Unrecognized`], so it fails its own request only.
pub fn error_from(e: &pb::Error) -> Result<CommandError, FieldError> {
    Ok(
        serde_json::from_str(&e.details_json).unwrap_or_else(|_| CommandError::Unrecognized {
            reason: e.reason,
            message: e.message.clone(),
            details_json: e.details_json.clone(),
        }),
    )
}

/// The typed result of one applied command (total: every reply has its arm).
pub fn outcome_to(o: &Outcome) -> pb::command_reply::Result {
    use pb::command_reply::Result as R;
    let settled = |s: Option<&Settlement>, by: pb::SettledBy| {
        R::Settled(pb::SettlementResult {
            settlement: s.map(settlement_to),
            by: by as i32,
        })
    };
    let heartbeat = |h: &HeartbeatReply, meter: bool| {
        R::Heartbeat(pb::HeartbeatResult {
            meter,
            ..heartbeat_to(h)
        })
    };
    let empty = pb::Empty {};
    let reply = match o {
        Err(e) => return R::Error(error_to(e)),
        Ok(r) => r,
    };
    match reply {
        Reply::Created => R::Created(empty),
        Reply::PricesSet { version } => R::PricesSet(pb::PricesSet { version: *version }),
        Reply::GrantIssued { bucket } => R::GrantIssued(pb::GrantIssued { bucket: bucket.0 }),
        Reply::BudgetSet => R::BudgetSet(empty),
        Reply::HoldCreated { hold, draws } => R::HoldCreated(pb::HoldCreated {
            hold: hold.0,
            draws: draws
                .iter()
                .map(|d| pb::Draw {
                    bucket: d.bucket.0,
                    amount_micro: d.amount_micro,
                })
                .collect(),
        }),
        Reply::Captured {
            captured_micro,
            held_micro,
        } => R::Captured(pb::Captured {
            captured_micro: *captured_micro,
            held_micro: *held_micro,
        }),
        Reply::ToppedUp {
            added_micro,
            held_micro,
        } => R::ToppedUp(pb::ToppedUp {
            added_micro: *added_micro,
            held_micro: *held_micro,
        }),
        Reply::MeterStarted {
            price_micro_per_gpu_hour,
            price_version,
        } => R::MeterStarted(pb::MeterStarted {
            price_micro_per_gpu_hour: *price_micro_per_gpu_hour,
            price_version: *price_version,
        }),
        Reply::Heartbeat(h) => heartbeat(h, true),
        Reply::Settled(st) => settled(Some(st), pb::SettledBy::Settle),
        Reply::Transferred { buckets } => R::Transferred(pb::Transferred {
            buckets: buckets.iter().map(|b| b.0).collect(),
        }),
        Reply::Ticked => R::Ticked(empty),
        Reply::NodeRegistered => R::NodeRegistered(empty),
        Reply::NodeUpdated => R::NodeUpdated(empty),
        Reply::JobSubmitted {
            job,
            hold_micro,
            state,
        } => R::JobSubmitted(pb::JobSubmitted {
            job: job.0,
            hold_micro: *hold_micro,
            state: job_state_to(*state) as i32,
            attached_to: None,
        }),
        Reply::JobAttached {
            job,
            to,
            hold_micro,
            state,
        } => R::JobSubmitted(pb::JobSubmitted {
            job: job.0,
            hold_micro: *hold_micro,
            state: job_state_to(*state) as i32,
            attached_to: Some(to.0),
        }),
        Reply::JobCancelled(st) => settled(st.as_ref(), pb::SettledBy::CancelJob),
        Reply::JobHeartbeat(h) => heartbeat(h, false),
        Reply::JobFinished(st) => settled(st.as_ref(), pb::SettledBy::FinishJob),
        Reply::QuotaSet => R::QuotaSet(empty),
        Reply::SchedulerConfigured => R::SchedulerConfigured(empty),
        Reply::TokenSet => R::TokenSet(empty),
        Reply::DenialsRecorded { count } => {
            R::DenialsRecorded(pb::DenialsRecorded { count: *count })
        }
        Reply::ShareWeightSet => R::ShareWeightSet(empty),
        Reply::PlanSet => R::PlanSet(empty),
        Reply::AlertSet => R::AlertSet(empty),
        Reply::RulesActive { version } => R::RulesActive(pb::RulesActive { version: *version }),
    }
}

/// Requests as one `Api.Execute` call on `shard` (`None` when one of them is the nodes'
/// own command, which no client sends). What the client sends, and what a follower
/// forwards to its leader (a request's actor goes as dev-mode text; one that ran as a
/// bearer token goes without, and the leader stamps it from the forwarded token).
pub fn execute_request(shard: Option<u32>, requests: &[Request]) -> Option<pb::ExecuteRequest> {
    Some(pb::ExecuteRequest {
        shard,
        commands: requests.iter().map(command_to).collect::<Option<_>>()?,
    })
}

/// The outcomes of an `Api.Execute` reply that answered `n` requests, in order.
pub fn outcomes_from(reply: &pb::ExecuteReply, n: usize) -> Result<Vec<Outcome>, FieldError> {
    if reply.replies.len() != n {
        return Err(bad(
            "replies",
            format!("{} replies for {n} requests", reply.replies.len()),
        ));
    }
    reply
        .replies
        .iter()
        .enumerate()
        .map(|(i, r)| {
            outcome_from(r.result.as_ref()).map_err(|e| FieldError {
                field: format!("replies[{i}].{}", e.field),
                problem: e.problem,
            })
        })
        .collect()
}

/// An applied command's result back from its typed form.
pub fn outcome_from(r: Option<&pb::command_reply::Result>) -> Result<Outcome, FieldError> {
    use pb::command_reply::Result as R;
    let r = required(r, "result")?;
    let settlement =
        |s: &pb::SettlementResult| s.settlement.as_ref().map(settlement_from).transpose();
    Ok(Ok(match r {
        R::Error(e) => return Ok(Err(error_from(e)?)),
        R::Created(_) => Reply::Created,
        R::PricesSet(p) => Reply::PricesSet { version: p.version },
        R::GrantIssued(g) => Reply::GrantIssued {
            bucket: BucketId(g.bucket),
        },
        R::BudgetSet(_) => Reply::BudgetSet,
        R::HoldCreated(h) => Reply::HoldCreated {
            hold: HoldId(h.hold),
            draws: h
                .draws
                .iter()
                .map(|d| DrawReport {
                    bucket: BucketId(d.bucket),
                    amount_micro: d.amount_micro,
                })
                .collect(),
        },
        R::Captured(c) => Reply::Captured {
            captured_micro: c.captured_micro,
            held_micro: c.held_micro,
        },
        R::ToppedUp(t) => Reply::ToppedUp {
            added_micro: t.added_micro,
            held_micro: t.held_micro,
        },
        R::MeterStarted(m) => Reply::MeterStarted {
            price_micro_per_gpu_hour: m.price_micro_per_gpu_hour,
            price_version: m.price_version,
        },
        R::Heartbeat(h) if h.meter => Reply::Heartbeat(heartbeat_from(h)?),
        R::Heartbeat(h) => Reply::JobHeartbeat(heartbeat_from(h)?),
        R::Settled(s) => match pb::SettledBy::try_from(s.by) {
            Ok(pb::SettledBy::Settle) => Reply::Settled(
                s.settlement
                    .as_ref()
                    .map(settlement_from)
                    .transpose()?
                    .ok_or_else(|| bad("settled.settlement", "required"))?,
            ),
            Ok(pb::SettledBy::CancelJob) => Reply::JobCancelled(settlement(s)?),
            Ok(pb::SettledBy::FinishJob) => Reply::JobFinished(settlement(s)?),
            Ok(pb::SettledBy::Unspecified) => return Err(bad("settled.by", "required")),
            Err(_) => return Err(bad("settled.by", format!("unknown value {}", s.by))),
        },
        R::Transferred(t) => Reply::Transferred {
            buckets: t.buckets.iter().map(|b| BucketId(*b)).collect(),
        },
        R::Ticked(_) => Reply::Ticked,
        R::NodeRegistered(_) => Reply::NodeRegistered,
        R::NodeUpdated(_) => Reply::NodeUpdated,
        R::JobSubmitted(j) => match j.attached_to {
            None => Reply::JobSubmitted {
                job: JobId(j.job),
                hold_micro: j.hold_micro,
                state: job_state_from(j.state, "job_submitted.state")?,
            },
            Some(to) => Reply::JobAttached {
                job: JobId(j.job),
                to: JobId(to),
                hold_micro: j.hold_micro,
                state: job_state_from(j.state, "job_submitted.state")?,
            },
        },
        R::QuotaSet(_) => Reply::QuotaSet,
        R::SchedulerConfigured(_) => Reply::SchedulerConfigured,
        R::TokenSet(_) => Reply::TokenSet,
        R::DenialsRecorded(d) => Reply::DenialsRecorded { count: d.count },
        R::ShareWeightSet(_) => Reply::ShareWeightSet,
        R::PlanSet(_) => Reply::PlanSet,
        R::AlertSet(_) => Reply::AlertSet,
        R::RulesActive(r) => Reply::RulesActive { version: r.version },
    }))
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

/// An audit event, typed: common fields as fields, the body and the actor exactly
/// (`body`, `actor_detail`) and as text (`kind` and `fields`, `actor`).
pub fn audit_event_to(e: &AuditEvent) -> pb::AuditEvent {
    let (kind, fields) = flatten(&serde_json::to_value(&e.body).unwrap_or_default());
    pb::AuditEvent {
        seq: e.seq,
        log_index: e.log_index,
        logical_time_ms: e.time_ms,
        request_id: e.request_id as u64,
        request_id_high: (e.request_id >> 64) as u64,
        actor: actor_text(&e.actor),
        kind,
        org: e.org.map(|o| o.0),
        account: e.account.map(|a| account_to(e.org.unwrap_or(OrgId(0)), a)),
        hold: e.hold.map(|h| h.0),
        fields: fields.into_iter().collect(),
        prev_hash: hex(&e.prev_hash),
        hash: hex(&e.hash),
        actor_detail: Some(audit::actor_to(&e.actor)),
        body: Some(audit::event_body_to(&e.body)),
    }
}

fn unhex(s: &str, field: &str) -> Result<[u8; 32], FieldError> {
    let wrong = || bad(field, "expected 64 hex digits");
    if s.len() != 64 || !s.is_ascii() {
        return Err(wrong());
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| wrong())?;
    }
    Ok(out)
}

/// An audit event back exactly (its hash chain can be verified on the result).
pub fn audit_event_from(e: &pb::AuditEvent) -> Result<AuditEvent, FieldError> {
    Ok(AuditEvent {
        seq: e.seq,
        log_index: e.log_index,
        time_ms: e.logical_time_ms,
        actor: audit::actor_from(e.actor_detail.as_ref(), "actor_detail")?,
        request_id: (u128::from(e.request_id_high) << 64) | u128::from(e.request_id),
        org: e.org.map(OrgId),
        account: e
            .account
            .as_ref()
            .map(|a| account_from(Some(a), "account"))
            .transpose()?,
        hold: e.hold.map(HoldId),
        body: audit::event_body_from(e.body.as_ref())?,
        prev_hash: unhex(&e.prev_hash, "prev_hash")?,
        hash: unhex(&e.hash, "hash")?,
    })
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
