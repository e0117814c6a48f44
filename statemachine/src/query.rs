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
use crate::scheduler::{GpuNode, Job, JobState, SchedulerSettings};
use crate::{check_invariants, State};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most jobs one `Jobs` page returns.
pub const JOBS_PAGE_MAX: u32 = 1_000;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// Balance of an account with the buckets expiring within `horizon_ms`.
    Balance {
        account: Account,
        horizon_ms: u64,
    },
    Job(JobId),
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
    /// The budget of an org, project or user and its spend counters.
    Budget(BudgetScope),
    /// The scheduler's current settings.
    SchedulerSettings,
    // -- appended (the encoding is positional) --
    /// The top consumers at one level (orgs, projects or users), by credits used (held
    /// plus spent) in a budget period, largest first; with their decayed GPU usage,
    /// running GPUs and fair-share weight.
    Usage(UsageQuery),
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
    /// Only jobs with a larger id (the previous page's `next`).
    pub after: Option<JobId>,
    /// Page size, 1..=`JOBS_PAGE_MAX` (0 means the maximum).
    pub limit: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobsPage {
    pub jobs: Vec<Job>,
    /// Set when more jobs may match: pass it as `after` for the next page.
    pub next: Option<JobId>,
}

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
    Assignments(Vec<(JobId, u32, Vec<u8>, JobState)>),
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
            Query::Job(_) => "job",
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
            Query::Budget(_) => "budget",
            Query::SchedulerSettings => "scheduler_settings",
            Query::Usage(_) => "usage",
        }
    }
}

/// [`answer`] for `caller` (a claimed or bearer actor, resolved here against the
/// replicated token table). A tenant sees only its own org (a project token only its
/// project): another org's account, job or budget answers exactly as a nonexistent
/// one (`None`), and job lists are confined to the caller's org. Shard-wide views
/// (totals, invariants, state hash, node list) are for admins; an agent sees its own
/// node's assignments and the jobs placed on it.
pub fn answer_as(state: &State, caller: Actor, q: &Query) -> Result<Answer, QueryDenied> {
    let actor = state
        .security
        .resolve(caller, state.time_ms)
        .map_err(|_| QueryDenied::Unauthenticated)?;
    let (org, project) = match actor {
        Actor::Admin(_) | Actor::System => return Ok(answer(state, q)),
        Actor::Anonymous | Actor::Bearer(_) => return Err(QueryDenied::Unauthenticated),
        Actor::Agent(node) => {
            return match q {
                Query::Assignments(n) if *n == node => Ok(answer(state, q)),
                Query::Job(id) => Ok(Answer::Job(
                    state
                        .scheduler
                        .job(*id)
                        .filter(|j| j.placement.as_ref().is_some_and(|p| p.node == node))
                        .cloned()
                        .map(Box::new),
                )),
                Query::Prices | Query::SchedulerSettings => Ok(answer(state, q)),
                _ => Err(QueryDenied::PermissionDenied),
            };
        }
        Actor::Tenant { org, .. } => (org, None),
        Actor::Project { org, project, .. } => (org, Some(project)),
    };
    let ledger = &state.ledger;
    let in_scope = |account: Account| {
        ledger.org_of(account) == Some(org)
            && project.is_none_or(|p| account == Account::Project(p))
    };
    Ok(match q {
        Query::Balance { account, .. } if !in_scope(*account) => Answer::Balance(None),
        Query::Job(id)
            if !state
                .scheduler
                .job(*id)
                .is_some_and(|j| j.org == org && project.is_none_or(|p| j.spec.project == p)) =>
        {
            Answer::Job(None)
        }
        Query::Jobs(filter) => {
            let mut f = filter.clone();
            let foreign = f.org.is_some_and(|o| o != org)
                || matches!((f.project, project), (Some(a), Some(b)) if a != b);
            if foreign {
                return Ok(Answer::Jobs(JobsPage {
                    jobs: Vec::new(),
                    next: None,
                }));
            }
            f.org = Some(org);
            f.project = f.project.or(project);
            Answer::Jobs(jobs_page(state, &f))
        }
        Query::Budget(scope) => {
            let visible = match scope {
                BudgetScope::Org(o) => project.is_none() && *o == org,
                BudgetScope::Project(p) => in_scope(Account::Project(*p)),
                BudgetScope::User(u) => {
                    project.is_none() && ledger.users.get(u).is_some_and(|r| r.org == org)
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
        Query::Balance { .. }
        | Query::Job(_)
        | Query::QueueDepth
        | Query::Fleet
        | Query::Queue
        | Query::Prices
        | Query::SchedulerSettings => answer(state, q),
        Query::Assignments(_)
        | Query::Totals
        | Query::Invariants
        | Query::StateHash
        | Query::Nodes => return Err(QueryDenied::PermissionDenied),
    })
}

pub fn answer(state: &State, q: &Query) -> Answer {
    let sched = &state.scheduler;
    match q {
        Query::Balance {
            account,
            horizon_ms,
        } => Answer::Balance(state.ledger.balance(*account, state.time_ms, *horizon_ms)),
        Query::Job(id) => Answer::Job(sched.job(*id).cloned().map(Box::new)),
        Query::Assignments(node) => Answer::Assignments(sched.assignments(*node)),
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
        Query::Queue => Answer::Queue(queue(state)),
        Query::Prices => Answer::Prices(state.ledger.prices.clone()),
        Query::Budget(scope) => Answer::Budget(budget(state, *scope)),
        Query::SchedulerSettings => Answer::SchedulerSettings(state.config.scheduler.settings()),
        Query::Usage(u) => Answer::Usage(usage(state, u, None)),
    }
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
    // (used, Reverse(id)) ascending = worst kept at the heap's top, as Reverse.
    let mut heap: BinaryHeap<Reverse<(u64, Reverse<u64>)>> = BinaryHeap::new();
    let mut offer = |used: u64, id: u64| {
        heap.push(Reverse((used, Reverse(id))));
        if heap.len() > k {
            heap.pop();
        }
    };
    let in_org = |o: OrgId| u.org.is_none_or(|want| want == o);
    match u.level {
        UsageLevel::Org => {
            for (o, r) in books.orgs.iter() {
                if in_org(*o) {
                    offer(used(&r.account.usage), o.0);
                }
            }
        }
        UsageLevel::Project => {
            for (p, r) in books.projects.iter() {
                if in_org(r.org) && only_project.is_none_or(|only| only == *p) {
                    offer(used(&r.account.usage), p.0);
                }
            }
        }
        UsageLevel::User => {
            for (id, r) in books.users.iter() {
                if in_org(r.org) {
                    offer(used(&r.usage), id.0);
                }
            }
        }
    }
    let mut ranked: Vec<(u64, u64)> = heap
        .into_iter()
        .map(|Reverse((used, Reverse(id)))| (used, id))
        .collect();
    ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked
        .into_iter()
        .filter_map(|(used_micro, id)| {
            let (scope, org, held, gpu_ms, running) = match u.level {
                UsageLevel::Org => {
                    let o = OrgId(id);
                    (
                        BudgetScope::Org(o),
                        o,
                        books.orgs.get(&o)?.account.usage.held,
                        decayed(sched.usage_org.get(&o)),
                        sched.running_org.get(&o).copied(),
                    )
                }
                UsageLevel::Project => {
                    let p = ProjectId(id);
                    let r = books.projects.get(&p)?;
                    (
                        BudgetScope::Project(p),
                        r.org,
                        r.account.usage.held,
                        decayed(sched.usage_project.get(&p)),
                        sched.running_project.get(&p).copied(),
                    )
                }
                UsageLevel::User => {
                    let user = UserId(id);
                    let r = books.users.get(&user)?;
                    (
                        BudgetScope::User(user),
                        r.org,
                        r.usage.held,
                        decayed(sched.usage_user.get(&user)),
                        sched.running_user.get(&user).copied(),
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
                share_weight: sched.share_weight(scope),
            })
        })
        .collect()
}

fn jobs_page(state: &State, f: &JobFilter) -> JobsPage {
    let limit = match f.limit {
        0 => JOBS_PAGE_MAX,
        n => n.min(JOBS_PAGE_MAX),
    } as usize;
    let mut ids: Vec<JobId> = state
        .scheduler
        .jobs
        .iter()
        .filter(|(id, j)| {
            f.after.is_none_or(|a| **id > a)
                && f.org.is_none_or(|o| j.org == o)
                && f.project.is_none_or(|p| j.spec.project == p)
                && f.user.is_none_or(|u| j.spec.user == u)
                && f.state.is_none_or(|s| j.state == s)
        })
        .map(|(id, _)| *id)
        .collect();
    ids.sort_unstable();
    let more = ids.len() > limit;
    ids.truncate(limit);
    JobsPage {
        next: if more { ids.last().copied() } else { None },
        jobs: ids
            .iter()
            .filter_map(|id| state.scheduler.job(*id).cloned())
            .collect(),
    }
}

fn queue(state: &State) -> Vec<TierQueue> {
    let sched = &state.scheduler;
    (0..sched_tiers(state))
        .map(|t| {
            let tier = Tier(t);
            let aged = sched.by_age.get(&tier);
            TierQueue {
                tier,
                queued: aged.map_or(0, |q| q.len() as u64),
                oldest_wait_ms: aged
                    .and_then(|q| q.first())
                    .map_or(0, |(since, _)| state.time_ms.saturating_sub(*since)),
                running_gpus: sched.tier_gpus.get(&tier).copied().unwrap_or(0),
            }
        })
        .collect()
}

fn sched_tiers(state: &State) -> u8 {
    state.config.scheduler.tiers.len().min(u8::MAX as usize) as u8
}

fn budget(state: &State, scope: BudgetScope) -> Option<BudgetView> {
    let books = &state.ledger.books;
    let (usage, budget) = match scope {
        BudgetScope::Org(o) => books
            .orgs
            .get(&o)
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::Project(p) => books
            .projects
            .get(&p)
            .map(|r| (r.account.usage, r.account.budget))?,
        BudgetScope::User(u) => books.users.get(&u).map(|r| (r.usage, r.budget))?,
    };
    Some(BudgetView {
        budget: budget.map(|b| b.spec),
        used_micro: budget.map_or(0, |b| usage.used(b.spec.period, state.time_ms)),
        usage,
    })
}
