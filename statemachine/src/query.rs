//! Read queries against a shard's applied state: pure functions of [`State`], shared by
//! the node (which answers them) and the client (which sends them). They travel as
//! codec bytes in the gRPC `QueryRequest`; the node answers from the replica's state
//! after the consistency the caller asked for (read index, or stale).
//!
//! New variants go at the end of [`Query`] and [`Answer`]: their encoding is positional.

use crate::command::{BudgetScope, BudgetSpec};
use crate::ids::{Account, Actor, JobId, NodeId, OrgId, ProjectId, Tier, UserId};
use crate::ledger::{Balance, PriceTable, Totals, Usage};
use crate::limits::USAGE_ROWS_MAX;
pub use crate::scheduler::demand::{DemandQuery, TierDemand, TypeDemand};
use crate::scheduler::{GpuNode, Job, JobState, SchedulerSettings};
use crate::{check_invariants, State};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most jobs one `Jobs` page returns.
pub const JOBS_PAGE_MAX: u32 = 1_000;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// Balance of an account of `org` with the buckets expiring within `horizon_ms`.
    Balance {
        org: OrgId,
        account: Account,
        horizon_ms: u64,
    },
    /// A job of an org (each org has its own job ids).
    Job(OrgId, JobId),
    /// The jobs placed on a GPU node: (job, attempt, GPU indices, state).
    Assignments(NodeId),
    QueueDepth,
    Totals,
    /// Runs the state machine's invariant check (conservation included) on this replica.
    Invariants,
    /// SHA-256 of the canonical state encoding.
    StateHash,
    /// GPUs of the shard's pool: (registered, allocated).
    Fleet,
    /// A page of jobs matching the filter, by job id.
    Jobs(JobFilter),
    /// Every GPU node of the shard's pool, by node id.
    Nodes,
    /// Per tier: queued jobs, the oldest one's wait, GPUs running.
    Queue,
    /// The current price table.
    Prices,
    /// The budget of an org, project or user of `org` and its spend counters.
    Budget(OrgId, BudgetScope),
    /// The scheduler's current settings.
    SchedulerSettings,
    // -- appended (the encoding is positional) --
    /// The top consumers at one level (orgs, projects or users), by credits used (held
    /// plus spent) in a budget period, largest first; with their decayed GPU usage,
    /// running GPUs and fair-share weight.
    Usage(UsageQuery),
    /// Where principal `id` exists (admin only): the operator's namespace (`None`) and
    /// each org's that has a principal of that id, with its scope and whether it is
    /// revoked. Lets an operator act on a principal without knowing its org.
    Principals(crate::ids::PrincipalId),
    /// An org's quota and plan with what it uses of each quota (its own org token, or an
    /// admin): how close a tenant is to each bound before it meets it.
    Tenancy(OrgId),
    /// An account's buckets, in spend order (`balance --buckets`); visible like its
    /// balance.
    Buckets {
        org: OrgId,
        account: Account,
    },
    /// The demand signal (admin only): per GPU type of the shard's pool, the capacity
    /// taking work, the queued work and the wait it implies, and per tier the GPUs that
    /// would bring the tier within its target wait (`scheduler::demand`, DESIGN §52).
    Demand(DemandQuery),
}

/// An org's quota, plan and current use of each quota.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenancyView {
    pub quota: crate::command::Quota,
    /// Whether `quota` is the org's own (`SetQuota`) rather than the shard default.
    pub quota_set: bool,
    /// The org's plan (`None`: the default entitlement).
    pub plan: Option<crate::command::Plan>,
    /// The tiers the org may use (its plan's, or the default: all but the highest).
    pub tiers: Vec<Tier>,
    pub used: QuotaUse,
}

/// What an org holds of each quota.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaUse {
    pub queued: u32,
    pub running: u32,
    pub holds_open: u32,
    pub records: u32,
    pub buckets: u32,
    pub principals: u32,
    pub projects: u32,
    pub users: u32,
    pub finished_jobs: u32,
    pub settled_holds: u32,
}

/// Which level a usage ranking ranks, over what.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UsageLevel {
    Org,
    Project,
    User,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageQuery {
    pub level: UsageLevel,
    /// Only accounts of this org (tenants are confined to their own).
    pub org: Option<OrgId>,
    pub period: crate::command::BudgetPeriod,
    /// Rows wanted, 1..=`USAGE_ROWS_MAX` (0 means the maximum).
    pub limit: u32,
}

/// One ranked org, project or user.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRow {
    pub scope: BudgetScope,
    pub org: OrgId,
    /// Held now plus spent in the period (what budgets count); the ranking key.
    pub used_micro: u64,
    pub held_micro: u64,
    /// GPU-milliseconds of decayed usage behind fair share (half-life in logical time).
    pub gpu_ms_decayed: u64,
    pub running_gpus: u32,
    pub share_weight: u32,
}

/// Which jobs a `Jobs` query returns. Every set field must match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFilter {
    pub org: Option<OrgId>,
    pub project: Option<ProjectId>,
    pub user: Option<UserId>,
    pub state: Option<JobState>,
    /// Only jobs after this one, in (org, id) order (the previous page's `next`).
    pub after: Option<JobId>,
    /// Page size, 1..=`JOBS_PAGE_MAX` (0 means the maximum).
    pub limit: u32,
    /// With `org` unset (an admin's listing of every org): the org `after` is in (the
    /// previous page's `next_org`).
    pub after_org: Option<OrgId>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobsPage {
    pub jobs: Vec<Job>,
    /// Set when more jobs may match: pass it as `after` (and `next_org` as `after_org`)
    /// for the next page. A page looks at no more than `JOBS_SCAN_MAX` jobs, so it can
    /// hold fewer than asked and still have a `next`.
    pub next: Option<JobId>,
    pub next_org: Option<OrgId>,
}

/// Jobs one `Jobs` page looks at, at most (matching or not): a page's work is bounded
/// however selective the filter, and the state lock is held for that long at most.
pub const JOBS_SCAN_MAX: usize = 10 * JOBS_PAGE_MAX as usize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierQueue {
    pub tier: Tier,
    pub queued: u64,
    /// How long the oldest queued job of the tier has waited (0 when none is queued).
    pub oldest_wait_ms: u64,
    pub running_gpus: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetView {
    pub budget: Option<BudgetSpec>,
    /// Held plus spent in the budget's period (0 without a budget).
    pub used_micro: u64,
    pub usage: Usage,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Balance(Option<Balance>),
    Job(Option<Box<Job>>),
    /// The jobs placed on a node: `rows` holds ((org, job), attempt, GPU indices, state)
    /// of each; `incarnation` is the agent process the node runs now
    /// (`GpuNode::incarnation`; 0: none named, or no such node). An agent that finds a
    /// higher incarnation than its own has been replaced and must stop; a lower one is
    /// a view from before its registration.
    Assignments {
        incarnation: u64,
        rows: Vec<crate::scheduler::AssignmentRow>,
    },
    QueueDepth(BTreeMap<Tier, usize>),
    Totals(Totals),
    Invariants(Result<(), String>),
    StateHash([u8; 32]),
    Fleet {
        gpus: u32,
        used: u32,
    },
    Jobs(JobsPage),
    Nodes(Vec<GpuNode>),
    Queue(Vec<TierQueue>),
    Prices(PriceTable),
    /// `None`: unknown org, project or user.
    Budget(Option<BudgetView>),
    SchedulerSettings(SchedulerSettings),
    /// Largest first; ties by id.
    Usage(Vec<UsageRow>),
    /// (namespace, scope, revoked) of each principal of the asked id.
    Principals(Vec<(Option<OrgId>, crate::security::Scope, bool)>),
    /// `None`: unknown org.
    Tenancy(Option<Box<TenancyView>>),
    /// None: no such account (or another org's).
    Buckets(Option<Vec<crate::ledger::BucketView>>),
    /// One row per GPU type of the pool, by type.
    Demand(Vec<TypeDemand>),
}

/// Why a query was refused (the node answers PERMISSION_DENIED / UNAUTHENTICATED).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryDenied {
    #[error("unauthenticated")]
    Unauthenticated,
    #[error("permission denied")]
    PermissionDenied,
}

impl Query {
    /// A stable short name for logs and denial records.
    pub fn name(&self) -> &'static str {
        match self {
            Query::Balance { .. } => "balance",
            Query::Job(..) => "job",
            Query::Assignments(_) => "assignments",
            Query::QueueDepth => "queue_depth",
            Query::Totals => "totals",
            Query::Invariants => "invariants",
            Query::StateHash => "state_hash",
            Query::Fleet => "fleet",
            Query::Jobs(_) => "jobs",
            Query::Nodes => "nodes",
            Query::Queue => "queue",
            Query::Prices => "prices",
            Query::Budget(..) => "budget",
            Query::SchedulerSettings => "scheduler_settings",
            Query::Usage(_) => "usage",
            Query::Principals(_) => "principals",
            Query::Tenancy(_) => "tenancy",
            Query::Buckets { .. } => "buckets",
            Query::Demand(_) => "demand",
        }
    }
}

/// [`answer`] for `caller` (a claimed or bearer actor, resolved here against the
/// replicated token table). A tenant sees only its own org (a project token only its
/// project, a user token only its project's and its own): another org's account, job
/// or budget answers exactly as a nonexistent one (`None`), listings and queue counts
/// are confined to the caller's org, and every answer's work is bounded by the
/// caller's own org. Shard-wide views (totals, invariants, state hash, node list,
/// demand) are for admins; an agent sees its own node's assignments and the jobs placed
/// on it.
/// Accounts one read unit pays for in a usage ranking ([`read_units`]).
pub const ROWS_PER_READ_UNIT: u64 = 1_000;

/// What query `q` costs a caller's read budget (the node's read rate limit), in units of
/// one ordinary read: a usage ranking looks at every account of its level in the org
/// (`org`: the one a tenant is confined to; `None`: the whole shard), and an account's
/// balance or bucket list at every bucket the account still lists (closed ones too,
/// until they are archived), so each costs one more unit for every
/// [`ROWS_PER_READ_UNIT`] of them — an org of 500,000 users ranking them pays 501 — and
/// every other query costs 1 (their work is bounded by a page or an id). Looked up under
/// the state lock, in O(log n); only the queries [`priced_by_rows`] names need it.
pub fn read_units(state: &State, org: Option<OrgId>, q: &Query) -> u32 {
    let books = &state.ledger;
    let rows = match q {
        Query::Usage(u) => match (org.or(u.org), u.level) {
            (_, UsageLevel::Org) => books.orgs.len() as u64,
            (Some(o), UsageLevel::Project) => {
                books.orgs.get(&o).map_or(0, |r| r.projects.len() as u64)
            }
            (Some(o), UsageLevel::User) => books.orgs.get(&o).map_or(0, |r| r.users.len() as u64),
            (None, UsageLevel::Project) => books.projects.len() as u64,
            (None, UsageLevel::User) => books.users.len() as u64,
        },
        // Another org's account answers `None` to a tenant, and costs what that does.
        Query::Balance { org: o, .. } | Query::Buckets { org: o, .. }
            if org.is_some_and(|caller| caller != *o) =>
        {
            0
        }
        Query::Balance { org, account, .. } | Query::Buckets { org, account } => books
            .account(*org, *account)
            .map_or(0, |a| a.buckets.len() as u64),
        _ => return 1,
    };
    u32::try_from(1 + rows / ROWS_PER_READ_UNIT).unwrap_or(u32::MAX)
}

/// Whether [`read_units`] may price `q` above 1 (so the edge looks at the state for it).
pub fn priced_by_rows(q: &Query) -> bool {
    matches!(
        q,
        Query::Usage(_) | Query::Balance { .. } | Query::Buckets { .. }
    )
}

pub fn answer_as(state: &State, caller: Actor, q: &Query) -> Result<Answer, QueryDenied> {
    let actor = state
        .security
        .resolve(caller, state.time_ms)
        .map_err(|_| QueryDenied::Unauthenticated)?;
    let (org, project, user) = match actor {
        Actor::Admin(_) | Actor::System => return Ok(answer(state, q)),
        Actor::Anonymous | Actor::Bearer(_) => return Err(QueryDenied::Unauthenticated),
        Actor::Agent(node) => {
            return match q {
                Query::Assignments(n) if *n == node => Ok(answer(state, q)),
                Query::Job(o, id) => Ok(Answer::Job(
                    state
                        .scheduler
                        .job(*o, *id)
                        .filter(|j| j.placement.as_ref().is_some_and(|p| p.node == node))
                        .cloned()
                        .map(Box::new),
                )),
                Query::Prices | Query::SchedulerSettings => Ok(answer(state, q)),
                _ => Err(QueryDenied::PermissionDenied),
            };
        }
        Actor::Tenant { org, .. } => (org, None, None),
        Actor::Project { org, project, .. } => (org, Some(project), None),
        Actor::User {
            org, project, user, ..
        } => (org, Some(project), Some(user)),
    };
    let narrow = project.is_some();
    let viewer = crate::redact::Viewer { org, project, user };
    let in_scope = |o: OrgId, account: Account| {
        o == org
            && match account {
                Account::Org(a) => a == org && !narrow,
                Account::Project(p) => project.is_none_or(|mine| mine == p),
            }
    };
    Ok(match q {
        Query::Balance {
            org: o, account, ..
        } if !in_scope(*o, *account) => Answer::Balance(None),
        Query::Buckets { org: o, account } if !in_scope(*o, *account) => Answer::Buckets(None),
        Query::Job(o, id) => Answer::Job(
            state
                .scheduler
                .job(*o, *id)
                .filter(|j| {
                    j.org == org
                        && project.is_none_or(|p| j.spec.project == p)
                        && user.is_none_or(|u| j.spec.user == u)
                })
                .map(|j| Box::new(viewer.job(state, j.clone()))),
        ),
        Query::Jobs(filter) => {
            let mut f = filter.clone();
            let foreign = f.org.is_some_and(|o| o != org)
                || matches!((f.project, project), (Some(a), Some(b)) if a != b)
                || matches!((f.user, user), (Some(a), Some(b)) if a != b);
            if foreign {
                return Ok(Answer::Jobs(JobsPage {
                    jobs: Vec::new(),
                    next: None,
                    next_org: None,
                }));
            }
            f.org = Some(org);
            f.project = f.project.or(project);
            f.user = f.user.or(user);
            let mut page = jobs_page(state, &f);
            page.jobs = page
                .jobs
                .into_iter()
                .map(|j| viewer.job(state, j))
                .collect();
            Answer::Jobs(page)
        }
        Query::Budget(o, scope) => {
            let visible = *o == org
                && match scope {
                    BudgetScope::Org(a) => !narrow && *a == org,
                    BudgetScope::Project(p) => project.is_none_or(|mine| mine == *p),
                    BudgetScope::User(u) => {
                        (!narrow || user == Some(*u)) && state.ledger.users.contains_key(&(org, *u))
                    }
                };
            if visible {
                answer(state, q)
            } else {
                Answer::Budget(None)
            }
        }
        Query::Usage(u) => {
            let foreign = u.org.is_some_and(|o| o != org);
            match (project, u.level) {
                _ if foreign => Answer::Usage(Vec::new()),
                (Some(_), UsageLevel::Org | UsageLevel::User) => {
                    return Err(QueryDenied::PermissionDenied)
                }
                // A user token: the project's row is every user's of the project (its
                // running GPUs less the caller's own are the others'), which `Queue`
                // and `Fleet` keep from it; its own spend is in its holds and jobs.
                _ if user.is_some() => return Err(QueryDenied::PermissionDenied),
                (p, _) => {
                    let mut rows = usage(
                        state,
                        &UsageQuery {
                            org: Some(org),
                            ..*u
                        },
                        p,
                    );
                    rows.truncate(usage_limit(u.limit));
                    Answer::Usage(rows)
                }
            }
        }
        // Queue and depth counts of the caller's own org only (a narrow token: its own
        // project's, or user's): another org's volume of work is none of its business.
        Query::Queue => Answer::Queue(queue(state, Some(viewer))),
        Query::QueueDepth => Answer::QueueDepth(
            queue(state, Some(viewer))
                .into_iter()
                .map(|t| (t.tier, t.queued as usize))
                .collect(),
        ),
        // The pool's size, and the caller's own GPUs in use: the shard's total in use
        // less its own would be every other org's (for a narrow token, the org's would
        // be its sibling projects').
        Query::Fleet => Answer::Fleet {
            gpus: state.scheduler.fleet_gpus,
            used: if narrow {
                queue(state, Some(viewer))
                    .iter()
                    .map(|t| t.running_gpus)
                    .sum()
            } else {
                state.scheduler.running_org.get(&org).copied().unwrap_or(0)
            },
        },
        Query::Balance { .. }
        | Query::Buckets { .. }
        | Query::Prices
        | Query::SchedulerSettings => answer(state, q),
        // An org's own quotas and plan: its org token (a narrower one is confined to its
        // project and has no business with the org's bounds).
        Query::Tenancy(o) if *o == org && !narrow => answer(state, q),
        Query::Tenancy(_) if narrow => return Err(QueryDenied::PermissionDenied),
        Query::Tenancy(_) => Answer::Tenancy(None),
        // The demand signal is the shard's aggregate of every org's queued work (a
        // tenant could take its own from it and learn the others'): the operator's.
        Query::Assignments(_)
        | Query::Totals
        | Query::Invariants
        | Query::StateHash
        | Query::Nodes
        | Query::Principals(_)
        | Query::Demand(_) => return Err(QueryDenied::PermissionDenied),
    })
}

pub fn answer(state: &State, q: &Query) -> Answer {
    let sched = &state.scheduler;
    match q {
        Query::Balance {
            org,
            account,
            horizon_ms,
        } => Answer::Balance(
            state
                .ledger
                .balance(*org, *account, state.time_ms, *horizon_ms),
        ),
        Query::Buckets { org, account } => {
            Answer::Buckets(state.ledger.bucket_views(*org, *account, state.time_ms))
        }
        Query::Job(org, id) => Answer::Job(sched.job(*org, *id).cloned().map(Box::new)),
        Query::Assignments(node) => Answer::Assignments {
            incarnation: sched.node_incarnation(*node),
            rows: sched.assignments(*node),
        },
        Query::QueueDepth => Answer::QueueDepth(sched.queue_depth()),
        Query::Totals => Answer::Totals(state.ledger.totals),
        Query::Invariants => Answer::Invariants(check_invariants(state).map_err(|v| v.to_string())),
        Query::StateHash => Answer::StateHash(state.state_hash()),
        Query::Fleet => Answer::Fleet {
            gpus: sched.fleet_gpus,
            used: sched.used_gpus,
        },
        Query::Jobs(filter) => Answer::Jobs(jobs_page(state, filter)),
        Query::Nodes => {
            let mut nodes: Vec<GpuNode> = sched.nodes.values().cloned().collect();
            nodes.sort_by_key(|n| n.id);
            Answer::Nodes(nodes)
        }
        Query::Queue => Answer::Queue(queue(state, None)),
        Query::Prices => Answer::Prices(state.ledger.prices.clone()),
        Query::Budget(org, scope) => Answer::Budget(budget(state, *org, *scope)),
        Query::SchedulerSettings => Answer::SchedulerSettings(state.config.scheduler.settings()),
        Query::Usage(u) => Answer::Usage(usage(state, u, None)),
        Query::Tenancy(org) => Answer::Tenancy(tenancy(state, *org).map(Box::new)),
        Query::Demand(d) => {
            Answer::Demand(sched.demand(&state.config.scheduler, state.time_ms, *d))
        }
        Query::Principals(id) => Answer::Principals(
            state
                .security
                .principals
                .iter()
                .filter(|((_, p), _)| p == id)
                .map(|((org, _), p)| (*org, p.scope, p.revoked))
                .collect(),
        ),
    }
}

fn tenancy(state: &State, org: OrgId) -> Option<TenancyView> {
    let (sched, cfg) = (&state.scheduler, &state.config.scheduler);
    let rec = state.ledger.orgs.get(&org)?;
    let (queued, running) = sched.org_counts.get(&org).copied().unwrap_or_default();
    let tiers = (0..cfg.tiers.len() as u8)
        .map(Tier)
        .filter(|t| sched.entitled_org(cfg, org, *t))
        .collect();
    Some(TenancyView {
        quota: sched.quota(cfg, org),
        quota_set: sched.quotas.contains_key(&org),
        plan: sched.plans.get(&org).cloned(),
        tiers,
        used: QuotaUse {
            queued,
            running,
            holds_open: rec.holds_open,
            records: state.idempotency.of_org(org),
            buckets: rec.buckets_in_use,
            principals: state.security.principals_of(org) as u32,
            projects: rec.projects.len() as u32,
            users: rec.users.len() as u32,
            finished_jobs: sched.finished.of_org(org),
            settled_holds: state.ledger.holds.settled.of_org(org),
        },
    })
}

fn usage_limit(limit: u32) -> usize {
    let n = match limit {
        0 => USAGE_ROWS_MAX,
        n => n.min(USAGE_ROWS_MAX),
    };
    n as usize
}

/// Top-k selection over every account of the level (O(n log k), off the apply path, on
/// any replica): a bounded min-heap keyed by (used, reverse id), so the answer is the
/// same whatever order the hash tables iterate in. `only_project` confines it to one
/// project (a project token).
fn usage(state: &State, u: &UsageQuery, only_project: Option<ProjectId>) -> Vec<UsageRow> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let (books, sched, now) = (&state.ledger.books, &state.scheduler, state.time_ms);
    let h = state.config.scheduler.usage_half_life_ms;
    let k = usage_limit(u.limit);
    let used = |usage: &crate::ledger::Usage| usage.used(u.period, now);
    let decayed =
        |d: Option<&crate::scheduler::usage::DecayedUsage>| d.map_or(0, |d| d.value_at(now, h));
    // (used, Reverse((org, id))) ascending = worst kept at the heap's top, as Reverse.
    type Ranked = Reverse<(u64, Reverse<(OrgId, u64)>)>;
    let mut heap: BinaryHeap<Ranked> = BinaryHeap::new();
    let mut offer = |used: u64, org: OrgId, id: u64| {
        heap.push(Reverse((used, Reverse((org, id)))));
        if heap.len() > k {
            heap.pop();
        }
    };
    // One org's accounts come from its own namespace index (work bounded by the org);
    // every org's only for an admin's shard-wide ranking.
    let orgs: Vec<(OrgId, &crate::ledger::OrgRec)> = match u.org {
        Some(o) => books.orgs.get(&o).map(|r| (o, r)).into_iter().collect(),
        None => books.orgs.iter().map(|(o, r)| (*o, r)).collect(),
    };
    for (o, rec) in orgs {
        match u.level {
            UsageLevel::Org => offer(used(&rec.account.usage), o, o.0),
            UsageLevel::Project => {
                for p in &rec.projects {
                    if only_project.is_none_or(|only| only == *p) {
                        if let Some(r) = books.projects.get(&(o, *p)) {
                            offer(used(&r.account.usage), o, p.0);
                        }
                    }
                }
            }
            UsageLevel::User => {
                for id in &rec.users {
                    if let Some(r) = books.users.get(&(o, *id)) {
                        offer(used(&r.usage), o, id.0);
                    }
                }
            }
        }
    }
    let mut ranked: Vec<(u64, (OrgId, u64))> = heap
        .into_iter()
        .map(|Reverse((used, Reverse(key)))| (used, key))
        .collect();
    ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked
        .into_iter()
        .filter_map(|(used_micro, (org, id))| {
            let (scope, held, gpu_ms, running) = match u.level {
                UsageLevel::Org => (
                    BudgetScope::Org(org),
                    books.orgs.get(&org)?.account.usage.held,
                    decayed(sched.usage_org.get(&org)),
                    sched.running_org.get(&org).copied(),
                ),
                UsageLevel::Project => {
                    let key = (org, ProjectId(id));
                    (
                        BudgetScope::Project(key.1),
                        books.projects.get(&key)?.account.usage.held,
                        decayed(sched.usage_project.get(&key)),
                        sched.running_project.get(&key).copied(),
                    )
                }
                UsageLevel::User => {
                    let key = (org, UserId(id));
                    (
                        BudgetScope::User(key.1),
                        books.users.get(&key)?.usage.held,
                        decayed(sched.usage_user.get(&key)),
                        sched.running_user.get(&key).copied(),
                    )
                }
            };
            Some(UsageRow {
                scope,
                org,
                used_micro,
                held_micro: held,
                gpu_ms_decayed: gpu_ms,
                running_gpus: running.unwrap_or(0),
                share_weight: sched.share_weight(org, scope),
            })
        })
        .collect()
}

/// A page of jobs in (org, id) order: one org's jobs when the filter names it (a range
/// of the per-org index: no other org's job is looked at), every org's for an admin;
/// with a project (and a user) named too, a range of the per-project (per-user) index,
/// so a project's or a user's token never looks at a sibling's jobs — nor learns their
/// ids from the page's cursor, which is the last job looked at. At most
/// `JOBS_SCAN_MAX` jobs are looked at.
fn jobs_page(state: &State, f: &JobFilter) -> JobsPage {
    use std::ops::Bound::{Excluded, Included, Unbounded};
    let limit = match f.limit {
        0 => JOBS_PAGE_MAX,
        n => n.min(JOBS_PAGE_MAX),
    } as usize;
    let sched = &state.scheduler;
    let from = |a: Option<JobId>| a.map_or(JobId(0), |a| JobId(a.0.saturating_add(1)));
    let keys: Box<dyn Iterator<Item = crate::ids::JobKey>> = match (f.org, f.project, f.user) {
        (Some(o), Some(p), Some(u)) => Box::new(
            sched
                .scoped_jobs
                .by_user
                .range((o, p, u, from(f.after))..=(o, p, u, JobId(u64::MAX)))
                .map(|k| (k.0, k.3)),
        ),
        (Some(o), Some(p), None) => Box::new(
            sched
                .scoped_jobs
                .by_project
                .range((o, p, from(f.after))..=(o, p, JobId(u64::MAX)))
                .map(|k| (k.0, k.2)),
        ),
        _ => {
            let start = match (f.org, f.after_org, f.after) {
                (Some(o), _, Some(a)) => Excluded((o, a)),
                (Some(o), _, None) => Included((o, JobId(0))),
                (None, Some(o), Some(a)) => Excluded((o, a)),
                (None, Some(o), None) => Included((o, JobId(0))),
                (None, None, Some(a)) => Excluded((OrgId(0), a)),
                (None, None, None) => Unbounded,
            };
            let end = match f.org {
                Some(o) => Included((o, JobId(u64::MAX))),
                None => Unbounded,
            };
            Box::new(sched.org_jobs.range((start, end)).copied())
        }
    };
    let mut jobs = Vec::new();
    let mut last = None;
    let mut more = false;
    for (scanned, key) in keys.enumerate() {
        if jobs.len() == limit || scanned == JOBS_SCAN_MAX {
            more = true;
            break;
        }
        last = Some(key);
        let Some(j) = sched.jobs.get(&key) else {
            continue;
        };
        let keep = f.project.is_none_or(|p| j.spec.project == p)
            && f.user.is_none_or(|u| j.spec.user == u)
            && f.state.is_none_or(|s| j.state == s);
        if keep {
            jobs.push(j.clone());
        }
    }
    let next = last.filter(|_| more);
    JobsPage {
        jobs,
        next: next.map(|k| k.1),
        next_org: next.map(|k| k.0),
    }
}

/// Per tier: queued jobs, the oldest one's wait and the GPUs running — of one org
/// (a tenant's view: its own subtree of the queue and its own jobs) or of the shard.
fn queue(state: &State, viewer: Option<crate::redact::Viewer>) -> Vec<TierQueue> {
    let sched = &state.scheduler;
    let org = viewer.map(|v| v.org);
    // A narrow token counts its own project's (and user's) jobs only.
    let (project, user) = viewer.map_or((None, None), |v| (v.project, v.user));
    let mine = |j: &Job| {
        project.is_none_or(|p| j.spec.project == p) && user.is_none_or(|u| j.spec.user == u)
    };
    let mut running: BTreeMap<Tier, u32> = BTreeMap::new();
    if let Some(o) = org {
        // The org's GPUs in use, per tier, from the fleet's GPU slots (each held GPU is
        // one slot of its job): bounded by the fleet (at most `NODES_MAX` ×
        // `GPUS_PER_NODE_MAX` slots, the operator's), not by how many jobs the org has
        // kept (its finished jobs, up to its quota, are in `org_jobs` too: a scan of
        // those cost a tenant's every `Queue` query ~10–20 ms at the default quota).
        for key in sched.nodes.values().flat_map(|n| n.slots.iter().flatten()) {
            if key.0 == o {
                if let Some(j) = sched
                    .jobs
                    .get(key)
                    .filter(|j| j.state.holds_gpus() && mine(j))
                {
                    *running.entry(j.spec.tier).or_default() += 1;
                }
            }
        }
    }
    (0..sched_tiers(state))
        .map(|t| {
            let tier = Tier(t);
            let (queued, oldest) = match org {
                None => {
                    let aged = sched.by_age.get(&tier);
                    (
                        aged.map_or(0, |q| q.len() as u64),
                        aged.and_then(|q| q.first()).map(|(since, _)| *since),
                    )
                }
                Some(o) => {
                    let mine = sched.queue.get(&tier).and_then(|orgs| orgs.get(&o));
                    let users = mine
                        .into_iter()
                        .flat_map(|p| p.iter())
                        .filter(|(pid, _)| project.is_none_or(|mine| **pid == mine))
                        .flat_map(|(_, u)| u.iter())
                        .filter(|(uid, _)| user.is_none_or(|mine| **uid == mine))
                        .map(|(_, q)| q);
                    users.fold((0u64, None::<u64>), |(n, oldest), q| {
                        let first = q.first().map(|(since, _)| *since);
                        (n + q.len() as u64, oldest.min(first).or(oldest).or(first))
                    })
                }
            };
            TierQueue {
                tier,
                queued,
                oldest_wait_ms: oldest.map_or(0, |since| state.time_ms.saturating_sub(since)),
                running_gpus: match org {
                    None => sched.tier_gpus.get(&tier).copied().unwrap_or(0),
                    Some(_) => running.get(&tier).copied().unwrap_or(0),
                },
            }
        })
        .collect()
}

fn sched_tiers(state: &State) -> u8 {
    state.config.scheduler.tiers.len().min(u8::MAX as usize) as u8
}

fn budget(state: &State, org: OrgId, scope: BudgetScope) -> Option<BudgetView> {
    let books = &state.ledger.books;
    let (usage, budget) = match scope {
        BudgetScope::Org(o) if o == org => books
            .orgs
            .get(&o)
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::Org(_) => return None,
        BudgetScope::Project(p) => books
            .projects
            .get(&(org, p))
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::User(u) => books.users.get(&(org, u)).map(|r| (r.usage, r.budget))?,
    };
    Some(BudgetView {
        budget: budget.map(|b| b.spec),
        used_micro: budget.map_or(0, |b| usage.used(b.spec.period, state.time_ms)),
        usage,
    })
}
