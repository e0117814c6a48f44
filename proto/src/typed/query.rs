//! Queries and answers, both ways (part of [`crate::typed`]).
//!
//! Exact: every [`Query`] and every [`Answer`] converts to its message, through its wire
//! bytes and back to itself (scheduler bookkeeping included, so nothing is lost on the
//! way). Inbound, as everywhere in [`crate::typed`], only the shape is checked: a
//! required message or oneof arm present, enum values known, numbers in their Rust
//! range, the state hash 32 bytes long; a refusal names the field by its dotted path
//! from the request or reply (`jobs.state`, `job.job.job.spec.tier`,
//! `nodes.nodes[2].slots[0].job`).

use super::{bad, narrow, policy_from, policy_to, required, tiers_from, tiers_to, FieldError};
use crate::api::v1 as pb;
use allot_statemachine::ledger::{BucketView, PriceTable, Totals, Usage};
use allot_statemachine::query::{
    Answer, BudgetView, DemandQuery, JobFilter, JobsPage, Query, QuotaUse, TenancyView, TierDemand,
    TierQueue, TypeDemand, UsageLevel, UsageQuery, UsageRow,
};
use allot_statemachine::scheduler::{AssignmentRow, GpuNode, Job, NodeState, Placement, Reason};
use allot_statemachine::{
    BucketId, BudgetScope, GpuType, JobId, JobKey, NodeId, OrgId, PrincipalId, ProjectId, Tier,
    UserId,
};
use pb::query_reply::Answer as A;
use pb::query_request::Query as Q;

// ---------------------------------------------------------------- paths and numbers

/// Prefixes a nested conversion's field name with the path of the message it converted.
fn at(path: &str) -> impl Fn(FieldError) -> FieldError + '_ {
    move |e| FieldError {
        field: format!("{path}.{}", e.field),
        problem: e.problem,
    }
}

/// `path.leaf`.
fn dot(path: &str, leaf: &str) -> String {
    format!("{path}.{leaf}")
}

/// `path[i]`: one element of a repeated field.
fn nth(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

fn tier_from(v: u32, field: &str) -> Result<Tier, FieldError> {
    narrow::<u8>(v, field).map(Tier)
}

/// A `usize` count goes out as uint64 (exact on every target Rust supports here).
fn count_to(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn count_from(n: u64, field: &str) -> Result<usize, FieldError> {
    usize::try_from(n).map_err(|_| bad(field, format!("{n} is out of range")))
}

fn u128_to(v: u128) -> pb::Uint128 {
    pb::Uint128 {
        high: (v >> 64) as u64,
        low: v as u64,
    }
}

fn u128_from(v: Option<&pb::Uint128>, field: &str) -> Result<u128, FieldError> {
    let v = required(v, field)?;
    Ok((u128::from(v.high) << 64) | u128::from(v.low))
}

// ---------------------------------------------------------------- small shared types

fn job_ref_to((org, job): JobKey) -> pb::JobRef {
    pb::JobRef {
        org: org.0,
        job: job.0,
    }
}

fn job_ref_from(r: &pb::JobRef) -> JobKey {
    (OrgId(r.org), JobId(r.job))
}

pub fn budget_scope_to(s: BudgetScope) -> pb::BudgetScope {
    use pb::budget_scope::Scope as S;
    pb::BudgetScope {
        scope: Some(match s {
            BudgetScope::Org(o) => S::Org(o.0),
            BudgetScope::Project(p) => S::Project(p.0),
            BudgetScope::User(u) => S::User(u.0),
        }),
    }
}

pub fn budget_scope_from(
    s: Option<&pb::BudgetScope>,
    field: &str,
) -> Result<BudgetScope, FieldError> {
    use pb::budget_scope::Scope as S;
    Ok(match required(required(s, field)?.scope.as_ref(), field)? {
        S::Org(o) => BudgetScope::Org(OrgId(*o)),
        S::Project(p) => BudgetScope::Project(ProjectId(*p)),
        S::User(u) => BudgetScope::User(UserId(*u)),
    })
}

pub fn node_state_to(s: NodeState) -> pb::NodeState {
    match s {
        NodeState::Ready => pb::NodeState::Ready,
        NodeState::Draining => pb::NodeState::Draining,
        NodeState::Down => pb::NodeState::Down,
    }
}

pub fn node_state_from(v: i32, field: &str) -> Result<NodeState, FieldError> {
    Ok(match pb::NodeState::try_from(v) {
        Ok(pb::NodeState::Ready) => NodeState::Ready,
        Ok(pb::NodeState::Draining) => NodeState::Draining,
        Ok(pb::NodeState::Down) => NodeState::Down,
        Ok(pb::NodeState::Unspecified) => return Err(bad(field, "required")),
        Err(_) => return Err(bad(field, format!("unknown value {v}"))),
    })
}

pub fn usage_level_to(l: UsageLevel) -> pb::UsageLevel {
    match l {
        UsageLevel::Org => pb::UsageLevel::Org,
        UsageLevel::Project => pb::UsageLevel::Project,
        UsageLevel::User => pb::UsageLevel::User,
    }
}

pub fn usage_level_from(v: i32, field: &str) -> Result<UsageLevel, FieldError> {
    Ok(match pb::UsageLevel::try_from(v) {
        Ok(pb::UsageLevel::Org) => UsageLevel::Org,
        Ok(pb::UsageLevel::Project) => UsageLevel::Project,
        Ok(pb::UsageLevel::User) => UsageLevel::User,
        Ok(pb::UsageLevel::Unspecified) => return Err(bad(field, "required")),
        Err(_) => return Err(bad(field, format!("unknown value {v}"))),
    })
}

pub fn job_reason_to(r: &Reason) -> pb::JobReason {
    use pb::JobReasonKind as K;
    let kind = match r {
        Reason::Submitted => K::Submitted,
        Reason::Placed => K::Placed,
        Reason::Started => K::Started,
        Reason::Preempted { by, by_tier } => {
            return pb::JobReason {
                kind: K::Preempted as i32,
                preempted_by: by.map(|j| j.0),
                preempted_by_tier: u32::from(by_tier.0),
            }
        }
        Reason::Requeued => K::Requeued,
        Reason::Succeeded => K::Succeeded,
        Reason::Failed => K::Failed,
        Reason::Cancelled => K::Cancelled,
        Reason::LeaseExpired => K::LeaseExpired,
        Reason::NodeDown => K::NodeDown,
        Reason::OutOfCredits => K::OutOfCredits,
        Reason::MaxDuration => K::MaxDuration,
        Reason::Unpriced => K::Unpriced,
        Reason::Fenced => K::Fenced,
        Reason::Deduplicated => K::Deduplicated,
        Reason::DedupReleased => K::DedupReleased,
    };
    pb::JobReason {
        kind: kind as i32,
        preempted_by: None,
        preempted_by_tier: 0,
    }
}

/// A job's transition reason (`field`: the `JobReason` message's path; its preemption
/// fields are read only for PREEMPTED).
pub fn job_reason_from(r: Option<&pb::JobReason>, field: &str) -> Result<Reason, FieldError> {
    use pb::JobReasonKind as K;
    let r = required(r, field)?;
    Ok(match K::try_from(r.kind) {
        Ok(K::Submitted) => Reason::Submitted,
        Ok(K::Placed) => Reason::Placed,
        Ok(K::Started) => Reason::Started,
        Ok(K::Preempted) => Reason::Preempted {
            by: r.preempted_by.map(JobId),
            by_tier: tier_from(r.preempted_by_tier, &dot(field, "preempted_by_tier"))?,
        },
        Ok(K::Requeued) => Reason::Requeued,
        Ok(K::Succeeded) => Reason::Succeeded,
        Ok(K::Failed) => Reason::Failed,
        Ok(K::Cancelled) => Reason::Cancelled,
        Ok(K::LeaseExpired) => Reason::LeaseExpired,
        Ok(K::NodeDown) => Reason::NodeDown,
        Ok(K::OutOfCredits) => Reason::OutOfCredits,
        Ok(K::MaxDuration) => Reason::MaxDuration,
        Ok(K::Unpriced) => Reason::Unpriced,
        Ok(K::Fenced) => Reason::Fenced,
        Ok(K::Deduplicated) => Reason::Deduplicated,
        Ok(K::DedupReleased) => Reason::DedupReleased,
        Ok(K::Unspecified) => return Err(bad(&dot(field, "kind"), "required")),
        Err(_) => {
            return Err(bad(
                &dot(field, "kind"),
                format!("unknown value {}", r.kind),
            ))
        }
    })
}

// ---------------------------------------------------------------- queries

/// The org a query names (its home shard answers it); `None`: a shard-wide query (the
/// shard is the caller's choice), including an admin's listing of every org's jobs or
/// usage.
pub fn query_org(q: &Query) -> Option<OrgId> {
    match q {
        Query::Balance { org, .. }
        | Query::Buckets { org, .. }
        | Query::Job(org, _)
        | Query::Budget(org, _)
        | Query::Tenancy(org) => Some(*org),
        Query::Jobs(f) => f.org,
        Query::Usage(u) => u.org,
        Query::Assignments(_)
        | Query::QueueDepth
        | Query::Totals
        | Query::Invariants
        | Query::StateHash
        | Query::Fleet
        | Query::Nodes
        | Query::Queue
        | Query::Prices
        | Query::SchedulerSettings
        | Query::Principals(_)
        | Query::Demand(_) => None,
    }
}

fn job_filter_to(f: &JobFilter) -> pb::JobFilter {
    pb::JobFilter {
        org: f.org.map(|o| o.0),
        project: f.project.map(|p| p.0),
        user: f.user.map(|u| u.0),
        state: f
            .state
            .map_or(pb::JobState::Unspecified, super::job_state_to) as i32,
        after: f.after.map(|j| j.0),
        limit: f.limit,
        after_org: f.after_org.map(|o| o.0),
    }
}

fn job_filter_from(f: &pb::JobFilter, path: &str) -> Result<JobFilter, FieldError> {
    let state = match f.state {
        0 => None,
        v => Some(super::job_state_from(v, &dot(path, "state"))?),
    };
    Ok(JobFilter {
        org: f.org.map(OrgId),
        project: f.project.map(ProjectId),
        user: f.user.map(UserId),
        state,
        after: f.after.map(JobId),
        limit: f.limit,
        after_org: f.after_org.map(OrgId),
    })
}

fn usage_query_to(u: &UsageQuery) -> pb::UsageQuery {
    pb::UsageQuery {
        level: usage_level_to(u.level) as i32,
        org: u.org.map(|o| o.0),
        period: super::budget_period_to(u.period) as i32,
        limit: u.limit,
    }
}

fn usage_query_from(u: &pb::UsageQuery, path: &str) -> Result<UsageQuery, FieldError> {
    Ok(UsageQuery {
        level: usage_level_from(u.level, &dot(path, "level"))?,
        org: u.org.map(OrgId),
        period: super::budget_period_from(u.period, &dot(path, "period"))?,
        limit: u.limit,
    })
}

/// A query as its request arm. The org a project account is in is the query's own
/// `org` (an account message always carries one).
pub fn query_to(q: &Query) -> Q {
    let empty = pb::Empty {};
    match q {
        Query::Balance {
            org,
            account,
            horizon_ms,
        } => Q::Balance(pb::BalanceQuery {
            org: org.0,
            account: Some(super::account_to(*org, *account)),
            horizon_ms: *horizon_ms,
        }),
        Query::Job(org, job) => Q::Job(pb::JobQuery {
            org: org.0,
            job: job.0,
        }),
        Query::Assignments(node) => Q::Assignments(pb::AssignmentsQuery { node: node.0 }),
        Query::QueueDepth => Q::QueueDepth(empty),
        Query::Totals => Q::Totals(empty),
        Query::Invariants => Q::Invariants(empty),
        Query::StateHash => Q::StateHash(empty),
        Query::Fleet => Q::Fleet(empty),
        Query::Jobs(f) => Q::Jobs(job_filter_to(f)),
        Query::Nodes => Q::Nodes(empty),
        Query::Queue => Q::Queue(empty),
        Query::Prices => Q::Prices(empty),
        Query::Budget(org, scope) => Q::Budget(pb::BudgetQuery {
            org: org.0,
            scope: Some(budget_scope_to(*scope)),
        }),
        Query::SchedulerSettings => Q::SchedulerSettings(empty),
        Query::Usage(u) => Q::Usage(usage_query_to(u)),
        Query::Principals(p) => Q::Principals(pb::PrincipalsQuery { principal: p.0 }),
        Query::Tenancy(org) => Q::Tenancy(pb::TenancyQuery { org: org.0 }),
        Query::Buckets { org, account } => Q::Buckets(pb::BucketsQuery {
            org: org.0,
            account: Some(super::account_to(*org, *account)),
        }),
        Query::Demand(d) => Q::Demand(pb::DemandQuery { run_pct: d.run_pct }),
    }
}

/// A request's query (`None`: the oneof is unset, refused as field `query`). Field
/// names are the arm's: `balance.account`, `jobs.state`, `usage.period`, ...
pub fn query_from(q: Option<&Q>) -> Result<Query, FieldError> {
    Ok(match required(q, "query")? {
        Q::Balance(b) => Query::Balance {
            org: OrgId(b.org),
            account: super::account_from(b.account.as_ref(), "balance.account")?,
            horizon_ms: b.horizon_ms,
        },
        Q::Job(j) => Query::Job(OrgId(j.org), JobId(j.job)),
        Q::Assignments(a) => Query::Assignments(NodeId(a.node)),
        Q::QueueDepth(_) => Query::QueueDepth,
        Q::Totals(_) => Query::Totals,
        Q::Invariants(_) => Query::Invariants,
        Q::StateHash(_) => Query::StateHash,
        Q::Fleet(_) => Query::Fleet,
        Q::Jobs(f) => Query::Jobs(job_filter_from(f, "jobs")?),
        Q::Nodes(_) => Query::Nodes,
        Q::Queue(_) => Query::Queue,
        Q::Prices(_) => Query::Prices,
        Q::Budget(b) => Query::Budget(
            OrgId(b.org),
            budget_scope_from(b.scope.as_ref(), "budget.scope")?,
        ),
        Q::SchedulerSettings(_) => Query::SchedulerSettings,
        Q::Usage(u) => Query::Usage(usage_query_from(u, "usage")?),
        Q::Principals(p) => Query::Principals(PrincipalId(p.principal)),
        Q::Tenancy(t) => Query::Tenancy(OrgId(t.org)),
        Q::Buckets(b) => Query::Buckets {
            org: OrgId(b.org),
            account: super::account_from(b.account.as_ref(), "buckets.account")?,
        },
        Q::Demand(d) => Query::Demand(DemandQuery { run_pct: d.run_pct }),
    })
}

// ---------------------------------------------------------------- jobs

fn gpu_indices_from(v: &[u32], field: &str) -> Result<Vec<u8>, FieldError> {
    v.iter()
        .enumerate()
        .map(|(i, g)| narrow::<u8>(*g, &nth(field, i)))
        .collect()
}

fn placement_from(p: &pb::Placement, path: &str) -> Result<Placement, FieldError> {
    Ok(Placement {
        node: NodeId(p.node),
        gpu_indices: gpu_indices_from(&p.gpu_indices, &dot(path, "gpu_indices"))?,
        gpu_type: GpuType(p.gpu_type.clone()),
        price_micro_per_gpu_hour: p.price_micro_per_gpu_hour,
        started_ms: p.started_ms,
    })
}

/// A job whole: its public view (`pb::Job`) and the scheduler's bookkeeping.
pub fn job_detail_to(j: &Job) -> pb::JobDetail {
    pb::JobDetail {
        job: Some(super::job_to(j)),
        last_reason: Some(job_reason_to(&j.last_reason)),
        queued_since_ms: j.queued_since_ms,
        lease_at_ms: j.lease_at,
        deadline_at_ms: j.deadline_at,
        grace_at_ms: j.grace_at,
        reserved_node: j.reserved_node.map(|n| n.0),
        waits_ms: j.waits_ms.clone(),
        preempted_for: j.preempted_for.map(job_ref_to),
    }
}

/// The job of a `JobDetail` at `path` (the public view's `last_reason` text is derived
/// from `last_reason` and not read).
pub fn job_detail_from(d: &pb::JobDetail, path: &str) -> Result<Job, FieldError> {
    let jpath = dot(path, "job");
    let j = required(d.job.as_ref(), &jpath)?;
    Ok(Job {
        spec: super::job_spec_from(j.spec.as_ref()).map_err(at(&jpath))?,
        org: OrgId(j.org),
        state: super::job_state_from(j.state, &dot(&jpath, "state"))?,
        attempt: j.attempt,
        submitted_ms: j.submitted_ms,
        queued_since_ms: d.queued_since_ms,
        placement: j
            .placement
            .as_ref()
            .map(|p| placement_from(p, &dot(&jpath, "placement")))
            .transpose()?,
        run_ms: j.run_ms,
        preemptions: j.preemptions,
        hold_micro: j.hold_micro,
        last_reason: job_reason_from(d.last_reason.as_ref(), &dot(path, "last_reason"))?,
        finished_ms: j.finished_ms,
        lease_at: d.lease_at_ms,
        deadline_at: d.deadline_at_ms,
        grace_at: d.grace_at_ms,
        reserved_node: d.reserved_node.map(NodeId),
        waits_ms: d.waits_ms.clone(),
        node_failures: j.node_failures,
        preempted_for: d.preempted_for.as_ref().map(job_ref_from),
    })
}

pub fn assignment_to((key, attempt, gpus, state): &AssignmentRow) -> pb::Assignment {
    pb::Assignment {
        job: Some(job_ref_to(*key)),
        attempt: *attempt,
        gpu_indices: gpus.iter().map(|g| u32::from(*g)).collect(),
        state: super::job_state_to(*state) as i32,
    }
}

pub fn assignment_from(a: &pb::Assignment, path: &str) -> Result<AssignmentRow, FieldError> {
    Ok((
        job_ref_from(required(a.job.as_ref(), &dot(path, "job"))?),
        a.attempt,
        gpu_indices_from(&a.gpu_indices, &dot(path, "gpu_indices"))?,
        super::job_state_from(a.state, &dot(path, "state"))?,
    ))
}

fn jobs_page_to(p: &JobsPage) -> pb::JobsPage {
    pb::JobsPage {
        jobs: p.jobs.iter().map(job_detail_to).collect(),
        next: p.next.map(|j| j.0),
        next_org: p.next_org.map(|o| o.0),
    }
}

fn jobs_page_from(p: &pb::JobsPage, path: &str) -> Result<JobsPage, FieldError> {
    let jobs = dot(path, "jobs");
    Ok(JobsPage {
        jobs: p
            .jobs
            .iter()
            .enumerate()
            .map(|(i, j)| job_detail_from(j, &nth(&jobs, i)))
            .collect::<Result<_, _>>()?,
        next: p.next.map(JobId),
        next_org: p.next_org.map(OrgId),
    })
}

// ---------------------------------------------------------------- shard views

fn totals_to(t: &Totals) -> pb::Totals {
    pb::Totals {
        issued_micro: Some(u128_to(t.issued)),
        consumed_micro: Some(u128_to(t.consumed)),
        expired_micro: Some(u128_to(t.expired)),
        moved_micro: Some(u128_to(t.moved)),
    }
}

fn totals_from(t: &pb::Totals, path: &str) -> Result<Totals, FieldError> {
    Ok(Totals {
        issued: u128_from(t.issued_micro.as_ref(), &dot(path, "issued_micro"))?,
        consumed: u128_from(t.consumed_micro.as_ref(), &dot(path, "consumed_micro"))?,
        expired: u128_from(t.expired_micro.as_ref(), &dot(path, "expired_micro"))?,
        moved: u128_from(t.moved_micro.as_ref(), &dot(path, "moved_micro"))?,
    })
}

fn gpu_node_to(n: &GpuNode) -> pb::GpuNode {
    pb::GpuNode {
        node: n.id.0,
        gpu_type: n.gpu_type.0.clone(),
        gpus: n.gpu_count,
        mem_gb: n.gpu_mem_gb,
        labels: n
            .labels
            .iter()
            .map(|(key, value)| pb::Label {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        state: node_state_to(n.state) as i32,
        lease_until_ms: n.lease_until_ms,
        lapsed: n.lapsed,
        slots: n
            .slots
            .iter()
            .map(|s| pb::GpuSlot {
                job: s.map(job_ref_to),
            })
            .collect(),
        reserved_for: n.reserved_for.map(job_ref_to),
        incarnation: n.incarnation,
    }
}

fn gpu_node_from(n: &pb::GpuNode, path: &str) -> Result<GpuNode, FieldError> {
    Ok(GpuNode {
        id: NodeId(n.node),
        gpu_type: GpuType(n.gpu_type.clone()),
        gpu_count: n.gpus,
        gpu_mem_gb: n.mem_gb,
        labels: n
            .labels
            .iter()
            .map(|l| (l.key.clone(), l.value.clone()))
            .collect(),
        state: node_state_from(n.state, &dot(path, "state"))?,
        lease_until_ms: n.lease_until_ms,
        lapsed: n.lapsed,
        slots: n
            .slots
            .iter()
            .map(|s| s.job.as_ref().map(job_ref_from))
            .collect(),
        reserved_for: n.reserved_for.as_ref().map(job_ref_from),
        incarnation: n.incarnation,
    })
}

fn tier_queue_to(t: &TierQueue) -> pb::TierQueue {
    pb::TierQueue {
        tier: u32::from(t.tier.0),
        queued: t.queued,
        oldest_wait_ms: t.oldest_wait_ms,
        running_gpus: t.running_gpus,
    }
}

fn tier_queue_from(t: &pb::TierQueue, path: &str) -> Result<TierQueue, FieldError> {
    Ok(TierQueue {
        tier: tier_from(t.tier, &dot(path, "tier"))?,
        queued: t.queued,
        oldest_wait_ms: t.oldest_wait_ms,
        running_gpus: t.running_gpus,
    })
}

fn price_table_to(p: &PriceTable) -> pb::PriceTable {
    pb::PriceTable {
        version: p.version,
        since_ms: p.since_ms,
        prices: p
            .prices
            .iter()
            .map(|(gpu_type, micro)| pb::GpuPrice {
                gpu_type: gpu_type.0.clone(),
                micro_per_gpu_hour: *micro,
            })
            .collect(),
    }
}

/// A price table (a GPU type listed twice: the last price, as a map reads it).
fn price_table_from(p: &pb::PriceTable) -> PriceTable {
    PriceTable {
        version: p.version,
        since_ms: p.since_ms,
        prices: p
            .prices
            .iter()
            .map(|g| (GpuType(g.gpu_type.clone()), g.micro_per_gpu_hour))
            .collect(),
    }
}

// ---------------------------------------------------------------- budgets and usage

fn usage_to(u: &Usage) -> pb::SpendCounters {
    pb::SpendCounters {
        held_micro: u.held,
        day: u.day,
        spent_day_micro: u.spent_day,
        month: u.month,
        spent_month_micro: u.spent_month,
        spent_total_micro: u.spent_total,
    }
}

fn usage_from(u: Option<&pb::SpendCounters>, field: &str) -> Result<Usage, FieldError> {
    let u = required(u, field)?;
    Ok(Usage {
        held: u.held_micro,
        day: u.day,
        spent_day: u.spent_day_micro,
        month: u.month,
        spent_month: u.spent_month_micro,
        spent_total: u.spent_total_micro,
    })
}

fn budget_view_to(b: &BudgetView) -> pb::BudgetView {
    pb::BudgetView {
        budget: b.budget.as_ref().map(super::budget_spec_to),
        used_micro: b.used_micro,
        usage: Some(usage_to(&b.usage)),
    }
}

fn budget_view_from(b: &pb::BudgetView, path: &str) -> Result<BudgetView, FieldError> {
    Ok(BudgetView {
        // `budget_spec_from` names its fields `budget.*`: the view's own field.
        budget: b
            .budget
            .as_ref()
            .map(super::budget_spec_from)
            .transpose()
            .map_err(at(path))?,
        used_micro: b.used_micro,
        usage: usage_from(b.usage.as_ref(), &dot(path, "usage"))?,
    })
}

fn usage_row_to(r: &UsageRow) -> pb::UsageRow {
    pb::UsageRow {
        scope: Some(budget_scope_to(r.scope)),
        org: r.org.0,
        used_micro: r.used_micro,
        held_micro: r.held_micro,
        gpu_ms_decayed: r.gpu_ms_decayed,
        running_gpus: r.running_gpus,
        share_weight: r.share_weight,
    }
}

fn usage_row_from(r: &pb::UsageRow, path: &str) -> Result<UsageRow, FieldError> {
    Ok(UsageRow {
        scope: budget_scope_from(r.scope.as_ref(), &dot(path, "scope"))?,
        org: OrgId(r.org),
        used_micro: r.used_micro,
        held_micro: r.held_micro,
        gpu_ms_decayed: r.gpu_ms_decayed,
        running_gpus: r.running_gpus,
        share_weight: r.share_weight,
    })
}

// ---------------------------------------------------------------- tokens and tenancy

fn principal_row_to(
    (org, scope, revoked): &(Option<OrgId>, allot_statemachine::security::Scope, bool),
) -> pb::PrincipalRow {
    pb::PrincipalRow {
        org: org.map(|o| o.0),
        scope: Some(super::token_scope_to(scope)),
        revoked: *revoked,
    }
}

fn principal_row_from(
    r: &pb::PrincipalRow,
    path: &str,
) -> Result<(Option<OrgId>, allot_statemachine::security::Scope, bool), FieldError> {
    Ok((
        r.org.map(OrgId),
        // `token_scope_from` names its fields `scope.*`: the row's own field.
        super::token_scope_from(r.scope.as_ref()).map_err(at(path))?,
        r.revoked,
    ))
}

fn quota_use_to(u: &QuotaUse) -> pb::QuotaUse {
    pb::QuotaUse {
        queued: u.queued,
        running: u.running,
        holds_open: u.holds_open,
        records: u.records,
        buckets: u.buckets,
        principals: u.principals,
        projects: u.projects,
        users: u.users,
        finished_jobs: u.finished_jobs,
        settled_holds: u.settled_holds,
    }
}

fn quota_use_from(u: &pb::QuotaUse) -> QuotaUse {
    QuotaUse {
        queued: u.queued,
        running: u.running,
        holds_open: u.holds_open,
        records: u.records,
        buckets: u.buckets,
        principals: u.principals,
        projects: u.projects,
        users: u.users,
        finished_jobs: u.finished_jobs,
        settled_holds: u.settled_holds,
    }
}

fn tenancy_to(t: &TenancyView) -> pb::TenancyView {
    pb::TenancyView {
        quota: Some(super::quota_to(&t.quota)),
        quota_set: t.quota_set,
        plan: t.plan.as_ref().map(super::plan_to),
        tiers: tiers_to(&t.tiers),
        used: Some(quota_use_to(&t.used)),
    }
}

fn tenancy_from(t: &pb::TenancyView, path: &str) -> Result<TenancyView, FieldError> {
    Ok(TenancyView {
        quota: super::quota_from(required(t.quota.as_ref(), &dot(path, "quota"))?),
        quota_set: t.quota_set,
        // `plan_from` names its fields `plan.*`: the view's own field.
        plan: t
            .plan
            .as_ref()
            .map(super::plan_from)
            .transpose()
            .map_err(at(path))?,
        tiers: tiers_from(&t.tiers, &dot(path, "tiers"))?,
        used: quota_use_from(required(t.used.as_ref(), &dot(path, "used"))?),
    })
}

// ---------------------------------------------------------------- buckets

fn bucket_view_to(b: &BucketView) -> pb::BucketView {
    pb::BucketView {
        bucket: b.bucket.0,
        kind: super::bucket_kind_to(b.kind) as i32,
        priority: u32::from(b.priority),
        expires_at_ms: b.expires_at_ms,
        policy: b.policy.as_ref().map(policy_to),
        source_ref: b.source_ref.clone(),
        spendable: b.spendable,
        remaining_micro: b.remaining_micro,
        held_micro: b.held_micro,
        issued_micro: b.issued_micro,
        moved_in_micro: b.moved_in_micro,
        consumed_micro: b.consumed_micro,
        expired_micro: b.expired_micro,
        moved_out_micro: b.moved_out_micro,
        closed_at_ms: b.closed_at_ms,
    }
}

fn bucket_view_from(b: &pb::BucketView, path: &str) -> Result<BucketView, FieldError> {
    Ok(BucketView {
        bucket: BucketId(b.bucket),
        kind: super::bucket_kind_from(b.kind, &dot(path, "kind"))?,
        priority: narrow(b.priority, &dot(path, "priority"))?,
        expires_at_ms: b.expires_at_ms,
        policy: b
            .policy
            .as_ref()
            .map(|p| policy_from(p, &dot(path, "policy")))
            .transpose()?,
        source_ref: b.source_ref.clone(),
        spendable: b.spendable,
        remaining_micro: b.remaining_micro,
        held_micro: b.held_micro,
        issued_micro: b.issued_micro,
        moved_in_micro: b.moved_in_micro,
        consumed_micro: b.consumed_micro,
        expired_micro: b.expired_micro,
        moved_out_micro: b.moved_out_micro,
        closed_at_ms: b.closed_at_ms,
    })
}

// ---------------------------------------------------------------- demand

fn tier_demand_to(t: &TierDemand) -> pb::TierDemand {
    pb::TierDemand {
        tier: u32::from(t.tier.0),
        queued_jobs: t.queued_jobs,
        queued_gpu_ms: t.queued_gpu_ms,
        target_wait_ms: t.target_wait_ms,
        wait_ms: t.wait_ms,
        overdue_jobs: t.overdue_jobs,
        overdue_gpus: t.overdue_gpus,
        gpus_needed: t.gpus_needed,
    }
}

fn tier_demand_from(t: &pb::TierDemand, path: &str) -> Result<TierDemand, FieldError> {
    Ok(TierDemand {
        tier: tier_from(t.tier, &dot(path, "tier"))?,
        queued_jobs: t.queued_jobs,
        queued_gpu_ms: t.queued_gpu_ms,
        target_wait_ms: t.target_wait_ms,
        wait_ms: t.wait_ms,
        overdue_jobs: t.overdue_jobs,
        overdue_gpus: t.overdue_gpus,
        gpus_needed: t.gpus_needed,
    })
}

fn type_demand_to(d: &TypeDemand) -> pb::GpuTypeDemand {
    pb::GpuTypeDemand {
        gpu_type: d.gpu_type.0.clone(),
        capacity_gpus: d.capacity_gpus,
        used_gpus: d.used_gpus,
        queued_jobs: d.queued_jobs,
        queued_gpu_ms: d.queued_gpu_ms,
        wait_ms: d.wait_ms,
        tiers: d.tiers.iter().map(tier_demand_to).collect(),
    }
}

fn type_demand_from(d: &pb::GpuTypeDemand, path: &str) -> Result<TypeDemand, FieldError> {
    Ok(TypeDemand {
        gpu_type: GpuType(d.gpu_type.clone()),
        capacity_gpus: d.capacity_gpus,
        used_gpus: d.used_gpus,
        queued_jobs: d.queued_jobs,
        queued_gpu_ms: d.queued_gpu_ms,
        wait_ms: d.wait_ms,
        tiers: each(&d.tiers, &dot(path, "tiers"), tier_demand_from)?,
    })
}

// ---------------------------------------------------------------- answers

/// Converts each element of a repeated field at `path`, naming a refused one by index.
fn each<P, T>(
    v: &[P],
    path: &str,
    f: impl Fn(&P, &str) -> Result<T, FieldError>,
) -> Result<Vec<T>, FieldError> {
    v.iter()
        .enumerate()
        .map(|(i, p)| f(p, &nth(path, i)))
        .collect()
}

/// A typed read of `shard`: linearizable, or `stale` from the replica asked.
pub fn query_request(shard: u32, stale: bool, q: &Query) -> pb::QueryRequest {
    pb::QueryRequest {
        read: Some(pb::Read {
            shard: Some(shard),
            stale_ok: stale,
        }),
        query: Some(query_to(q)),
    }
}

/// An answer as its reply arm.
pub fn answer_to(a: &Answer) -> A {
    match a {
        Answer::Balance(b) => A::Balance(pb::BalanceAnswer {
            balance: b.as_ref().map(super::balance_to),
        }),
        Answer::Job(j) => A::Job(pb::JobAnswer {
            job: j.as_deref().map(job_detail_to),
        }),
        Answer::Assignments { incarnation, rows } => A::Assignments(pb::AssignmentsAnswer {
            assignments: rows.iter().map(assignment_to).collect(),
            incarnation: *incarnation,
        }),
        Answer::QueueDepth(depth) => A::QueueDepth(pb::QueueDepthAnswer {
            queued: depth
                .iter()
                .map(|(t, n)| (u32::from(t.0), count_to(*n)))
                .collect(),
        }),
        Answer::Totals(t) => A::Totals(totals_to(t)),
        Answer::Invariants(r) => A::Invariants(match r {
            Ok(()) => pb::InvariantsAnswer {
                ok: true,
                violation: String::new(),
            },
            Err(v) => pb::InvariantsAnswer {
                ok: false,
                violation: v.clone(),
            },
        }),
        Answer::StateHash(h) => A::StateHash(pb::StateHashAnswer { sha256: h.to_vec() }),
        Answer::Fleet { gpus, used } => A::Fleet(pb::FleetAnswer {
            gpus: *gpus,
            used: *used,
        }),
        Answer::Jobs(p) => A::Jobs(jobs_page_to(p)),
        Answer::Nodes(nodes) => A::Nodes(pb::NodesAnswer {
            nodes: nodes.iter().map(gpu_node_to).collect(),
        }),
        Answer::Queue(tiers) => A::Queue(pb::QueueAnswer {
            tiers: tiers.iter().map(tier_queue_to).collect(),
        }),
        Answer::Prices(p) => A::Prices(price_table_to(p)),
        Answer::Budget(b) => A::Budget(pb::BudgetAnswer {
            budget: b.as_ref().map(budget_view_to),
        }),
        Answer::SchedulerSettings(s) => A::SchedulerSettings(super::scheduler_settings_to(s)),
        Answer::Usage(rows) => A::Usage(pb::UsageAnswer {
            rows: rows.iter().map(usage_row_to).collect(),
        }),
        Answer::Principals(rows) => A::Principals(pb::PrincipalsAnswer {
            principals: rows.iter().map(principal_row_to).collect(),
        }),
        Answer::Tenancy(t) => A::Tenancy(pb::TenancyAnswer {
            tenancy: t.as_deref().map(tenancy_to),
        }),
        Answer::Buckets(b) => A::Buckets(pb::BucketsAnswer {
            buckets: b.as_ref().map(|b| pb::BucketList {
                buckets: b.iter().map(bucket_view_to).collect(),
            }),
        }),
        Answer::Demand(rows) => A::Demand(pb::DemandAnswer {
            types: rows.iter().map(type_demand_to).collect(),
        }),
    }
}

/// A reply's answer (`None`: the oneof is unset, refused as field `answer`). Field names
/// are the arm's: `job.job.job.spec.tier`, `state_hash.sha256`, ...
pub fn answer_from(a: Option<&A>) -> Result<Answer, FieldError> {
    Ok(match required(a, "answer")? {
        A::Balance(b) => Answer::Balance(
            b.balance
                .as_ref()
                .map(super::balance_from)
                .transpose()
                .map_err(at("balance.balance"))?,
        ),
        A::Job(j) => Answer::Job(
            j.job
                .as_ref()
                .map(|d| job_detail_from(d, "job.job").map(Box::new))
                .transpose()?,
        ),
        A::Assignments(a) => Answer::Assignments {
            incarnation: a.incarnation,
            rows: each(&a.assignments, "assignments.assignments", assignment_from)?,
        },
        A::QueueDepth(d) => Answer::QueueDepth(
            d.queued
                .iter()
                .map(|(t, n)| {
                    Ok((
                        tier_from(*t, "queue_depth.queued")?,
                        count_from(*n, "queue_depth.queued")?,
                    ))
                })
                .collect::<Result<_, FieldError>>()?,
        ),
        A::Totals(t) => Answer::Totals(totals_from(t, "totals")?),
        A::Invariants(i) => Answer::Invariants(if i.ok {
            Ok(())
        } else {
            Err(i.violation.clone())
        }),
        A::StateHash(h) => {
            Answer::StateHash(<[u8; 32]>::try_from(h.sha256.as_slice()).map_err(|_| {
                bad(
                    "state_hash.sha256",
                    format!("expected 32 bytes, got {}", h.sha256.len()),
                )
            })?)
        }
        A::Fleet(f) => Answer::Fleet {
            gpus: f.gpus,
            used: f.used,
        },
        A::Jobs(p) => Answer::Jobs(jobs_page_from(p, "jobs")?),
        A::Nodes(n) => Answer::Nodes(each(&n.nodes, "nodes.nodes", gpu_node_from)?),
        A::Queue(q) => Answer::Queue(each(&q.tiers, "queue.tiers", tier_queue_from)?),
        A::Prices(p) => Answer::Prices(price_table_from(p)),
        A::Budget(b) => Answer::Budget(
            b.budget
                .as_ref()
                .map(|v| budget_view_from(v, "budget.budget"))
                .transpose()?,
        ),
        A::SchedulerSettings(s) => Answer::SchedulerSettings(super::scheduler_settings_from(s)),
        A::Usage(u) => Answer::Usage(each(&u.rows, "usage.rows", usage_row_from)?),
        A::Principals(p) => Answer::Principals(each(
            &p.principals,
            "principals.principals",
            principal_row_from,
        )?),
        A::Tenancy(t) => Answer::Tenancy(
            t.tenancy
                .as_ref()
                .map(|v| tenancy_from(v, "tenancy.tenancy").map(Box::new))
                .transpose()?,
        ),
        A::Buckets(b) => Answer::Buckets(
            b.buckets
                .as_ref()
                .map(|l| each(&l.buckets, "buckets.buckets.buckets", bucket_view_from))
                .transpose()?,
        ),
        A::Demand(d) => Answer::Demand(each(&d.types, "demand.types", type_demand_from)?),
    })
}
