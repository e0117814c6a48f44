//! The GPU scheduler: inventory, job lifecycle, placement, fairness, preemption and
//! dispatch fencing — inside apply, deterministic, with bounded work per entry.
//!
//! Order of work in every entry (see `state.rs`): timers first (node leases, job leases,
//! preemption grace, max duration), then the entry's commands, then one bounded
//! scheduling pass. Ties are always broken by stable ids.

mod baselines;
pub mod dedup;
pub mod demand;
mod invariants;
mod inventory;
pub use baselines::{
    ClusterQueueView, SlurmPriority, SLURM_WEIGHT_AGE, SLURM_WEIGHT_FAIRSHARE, SLURM_WEIGHT_QOS,
};
pub use invariants::check;
mod jobs;
mod pass;
mod reservations;
mod timers;
pub use jobs::{
    AGENTS_SEE_ONLY_THEIR_JOBS_FROM, ENDINGS_ON_A_LAPSED_NODE_BILL_TO_THE_LEASE_FROM,
    RUNNER_EXIT_BILLS_FROM,
};
pub use timers::{
    FENCE_INSTANTS_FROM, GRACE_WAITS_FOR_THE_NODE_FROM, OPERATOR_REGISTRATIONS_RENEW_NOTHING_FROM,
    PREEMPTED_ON_A_FAILED_NODE_FROM, REGISTRATION_ENDS_WAITING_GRACES_FROM,
};
pub mod usage;

use crate::command::{JobSpec, Quota};
use crate::idmap::IdMap;
use crate::ids::{
    GpuType, JobId, JobKey, NodeId, OrgId, ProjectId, ProjectKey, Tier, UserId, UserKey,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use usage::DecayedUsage;

/// Scheduling policy. `Fair` is allot's; the others are baselines for the simulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Policy {
    /// Aging lane, tier floors/ceilings and weights, then weighted fair share down
    /// org → project → user on decayed usage; preemption by policy.
    Fair,
    /// Strict tier priority, FIFO within a tier; preemption of lower tiers.
    StrictPriority,
    /// Submission order; no preemption.
    Fifo,
    // Appended (the encoding is positional).
    /// Slurm-like: multifactor priority (age, Fair Tree fair share, tier as QOS), QOS
    /// preemption by the top tier, EASY backfill (`baselines/slurm.rs`, DESIGN §24).
    SlurmLike,
    /// Kueue-like: one ClusterQueue per tier with nominal quotas per GPU type in one
    /// cohort (borrowing and lending limits), fair sharing by dominant resource share,
    /// reclaim within the cohort and lower-priority preemption within a ClusterQueue
    /// (`baselines/kueue.rs`, DESIGN §24).
    KueueLike,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierConfig {
    pub name: String,
    /// Share weight among tiers with queued work.
    pub weight: u32,
    /// Guaranteed share of the fleet's GPUs (percent) while the tier has demand.
    pub floor_pct: u32,
    /// Burst ceiling (percent) while other tiers have demand.
    pub ceiling_pct: u32,
    /// Aging: a job queued this long is served before any non-aged job.
    pub max_wait_ms: u64,
    /// The tier's price as a percentage of the GPU type's list price (100: list price),
    /// fixed on the job's meter at placement and used to size its hold: a higher tier
    /// may cost more per GPU-hour than a lower one. (Absent in settings files written
    /// before tiers had a price: list price.)
    #[serde(default = "list_price_pct")]
    pub price_pct: u32,
}

fn list_price_pct() -> u32 {
    100
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Indexed by `Tier.0`; a higher tier is more important.
    pub tiers: Vec<TierConfig>,
    pub policy: Policy,
    pub node_lease_ms: u64,
    pub job_lease_ms: u64,
    /// How long past a missed node lease the cluster waits before it re-places the
    /// node's jobs: the agent has stopped them by the lease's end (it fences itself), and
    /// this margin covers the clocks' disagreement (DESIGN §45). Meanwhile the node takes
    /// no new work.
    pub fence_margin_ms: u64,
    /// Time a preempted job gets to checkpoint before its GPUs are reclaimed.
    pub grace_ms: u64,
    /// A job runs at least this long (this attempt) before it may be preempted.
    pub min_runtime_ms: u64,
    /// No preemption while a running job on a fitting node ends within this time.
    pub hysteresis_ms: u64,
    pub preemptions_per_job_max: u32,
    /// A running job is a preemption victim only while the work it would lose (GPUs ×
    /// time since its last checkpoint, or since it started) is at most this many GPU-ms.
    pub preemption_loss_max_gpu_ms: u64,
    pub usage_half_life_ms: u64,
    /// A job whose node misses its lease is requeued (billed to its last heartbeat) at
    /// most this many times; after that it fails. 0: never requeued.
    pub node_failure_requeues_max: u32,
    pub default_quota: Quota,
    /// Bounds on one scheduling pass.
    pub placements_per_pass_max: u32,
    pub candidates_per_pass_max: u32,
    pub preemption_searches_per_pass_max: u32,
    /// Nodes held back for blocked multi-GPU jobs (anti-fragmentation), at most.
    pub reserved_nodes_max: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let tier = |name: &str, weight, floor_pct, ceiling_pct, max_wait_ms| TierConfig {
            name: name.into(),
            weight,
            floor_pct,
            ceiling_pct,
            max_wait_ms,
            price_pct: 100,
        };
        SchedulerConfig {
            tiers: vec![
                tier("free", 1, 5, 50, 30 * 60_000),
                tier("paid", 3, 15, 90, 10 * 60_000),
                tier("enterprise", 8, 30, 70, 5 * 60_000),
            ],
            policy: Policy::Fair,
            node_lease_ms: 60_000,
            job_lease_ms: 180_000,
            fence_margin_ms: 10_000,
            grace_ms: 30_000,
            min_runtime_ms: 60_000,
            hysteresis_ms: 60_000,
            preemptions_per_job_max: 3,
            preemption_loss_max_gpu_ms: 8 * 60_000,
            usage_half_life_ms: 3_600_000,
            node_failure_requeues_max: 3,
            default_quota: Quota::default(),
            placements_per_pass_max: 512,
            candidates_per_pass_max: 2_048,
            preemption_searches_per_pass_max: 8,
            reserved_nodes_max: 4,
        }
    }
}

/// The knobs an operator may change on a live shard (`Command::ConfigureScheduler`).
/// Tiers can be retuned but not added or removed: queued jobs are indexed by tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerSettings {
    pub node_lease_ms: u64,
    pub job_lease_ms: u64,
    pub grace_ms: u64,
    pub min_runtime_ms: u64,
    pub hysteresis_ms: u64,
    pub preemptions_per_job_max: u32,
    pub preemption_loss_max_gpu_ms: u64,
    pub usage_half_life_ms: u64,
    pub node_failure_requeues_max: u32,
    pub tiers: Vec<TierConfig>,
    /// Absent in settings written before fencing: the default.
    #[serde(default = "fence_margin_default")]
    pub fence_margin_ms: u64,
}

fn fence_margin_default() -> u64 {
    SchedulerConfig::default().fence_margin_ms
}

/// Bounds of [`SchedulerSettings`], by name.
pub mod settings_bounds {
    pub const LEASE_MS_MIN: u64 = 1_000;
    pub const LEASE_MS_MAX: u64 = 86_400_000;
    pub const GRACE_MS_MAX: u64 = 3_600_000;
    pub const RUNTIME_MS_MAX: u64 = 86_400_000;
    pub const HALF_LIFE_MS_MIN: u64 = 60_000;
    pub const HALF_LIFE_MS_MAX: u64 = 30 * 86_400_000;
    pub const PREEMPTIONS_PER_JOB_MAX: u32 = 100;
    pub const NODE_FAILURE_REQUEUES_MAX: u32 = 100;
    /// Eight GPUs for a day.
    pub const PREEMPTION_LOSS_GPU_MS_MAX: u64 = 8 * 86_400_000;
    pub const TIER_WEIGHT_MAX: u32 = 1_000;
    pub const TIER_NAME_LEN_MAX: usize = 32;
    pub const TIER_WAIT_MS_MAX: u64 = 30 * 86_400_000;
    /// A tier's price between 1% and 100× the list price.
    pub const TIER_PRICE_PCT_MAX: u32 = 10_000;
    /// Tiers one settings command may list (a shard has as many as it was created with).
    pub const TIERS_MAX: usize = 16;
}

impl SchedulerConfig {
    /// `tier`'s price as a percentage of list price (an unknown tier: list price).
    pub fn price_pct(&self, tier: Tier) -> u32 {
        self.tiers.get(tier.0 as usize).map_or(100, |t| t.price_pct)
    }

    pub fn settings(&self) -> SchedulerSettings {
        SchedulerSettings {
            node_lease_ms: self.node_lease_ms,
            job_lease_ms: self.job_lease_ms,
            grace_ms: self.grace_ms,
            min_runtime_ms: self.min_runtime_ms,
            hysteresis_ms: self.hysteresis_ms,
            preemptions_per_job_max: self.preemptions_per_job_max,
            preemption_loss_max_gpu_ms: self.preemption_loss_max_gpu_ms,
            usage_half_life_ms: self.usage_half_life_ms,
            node_failure_requeues_max: self.node_failure_requeues_max,
            tiers: self.tiers.clone(),
            fence_margin_ms: self.fence_margin_ms,
        }
    }

    /// Validates every field, then applies them all (or nothing). Timers already set
    /// keep their instants; new ones use the new values.
    pub fn apply_settings(
        &mut self,
        s: &SchedulerSettings,
    ) -> Result<(), crate::outcome::CommandError> {
        use crate::outcome::{CommandError, ConfigProblem as P};
        let check = |ok: bool, p: P| {
            if ok {
                Ok(())
            } else {
                Err(CommandError::InvalidConfig(p))
            }
        };
        // Every field's bounds: `crate::validate`. Tiers can be retuned, not added or
        // removed (queued jobs are indexed by tier): that needs this configuration.
        check(s.tiers.len() == self.tiers.len(), P::TierCount)?;
        self.node_lease_ms = s.node_lease_ms;
        self.job_lease_ms = s.job_lease_ms;
        self.grace_ms = s.grace_ms;
        self.min_runtime_ms = s.min_runtime_ms;
        self.hysteresis_ms = s.hysteresis_ms;
        self.preemptions_per_job_max = s.preemptions_per_job_max;
        self.preemption_loss_max_gpu_ms = s.preemption_loss_max_gpu_ms;
        self.usage_half_life_ms = s.usage_half_life_ms;
        self.node_failure_requeues_max = s.node_failure_requeues_max;
        self.tiers = s.tiers.clone();
        self.fence_margin_ms = s.fence_margin_ms;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum NodeState {
    Ready,
    Draining,
    Down,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuNode {
    pub id: NodeId,
    pub gpu_type: GpuType,
    pub gpu_count: u32,
    pub gpu_mem_gb: u32,
    pub labels: Vec<(String, String)>,
    pub state: NodeState,
    pub lease_until_ms: u64,
    /// The lease ran out and has not been renewed: the node takes no new work, and its
    /// jobs are re-placed `fence_margin_ms` after the lease's end unless it comes back.
    pub lapsed: bool,
    /// Which job holds each GPU index.
    pub slots: Vec<Option<JobKey>>,
    /// Set while preempted GPUs are being freed for a waiting job.
    pub reserved_for: Option<JobKey>,
    /// The agent process the node runs now (`NodeSpec::incarnation`; 0: none named).
    pub incarnation: u64,
}

impl GpuNode {
    /// Whether new work may go to this node: ready, and its lease current.
    pub fn placeable(&self) -> bool {
        self.state == NodeState::Ready && !self.lapsed
    }

    pub fn free_gpus(&self) -> u32 {
        self.slots.iter().filter(|s| s.is_none()).count() as u32
    }

    /// The jobs on this node, each once, in GPU-index order.
    pub fn jobs(&self) -> Vec<JobKey> {
        let mut out: Vec<JobKey> = Vec::new();
        for j in self.slots.iter().flatten() {
            if !out.contains(j) {
                out.push(*j);
            }
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum JobState {
    Queued,
    Placed,
    Running,
    Preempting,
    Succeeded,
    Failed,
    Lost,
    Cancelled,
    /// Reserved for a job refused after admission; admission-time refusals are typed
    /// errors on the submit command and record no job (they change nothing).
    Rejected,
    // Appended (the encoding is positional).
    /// Submitted with a dedup key while a job of its org with the same key was in
    /// flight: it waits for that job's result, holding its own reservation, without
    /// running (`dedup.rs`).
    Attached,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded
                | JobState::Failed
                | JobState::Lost
                | JobState::Cancelled
                | JobState::Rejected
        )
    }

    pub fn holds_gpus(self) -> bool {
        matches!(
            self,
            JobState::Placed | JobState::Running | JobState::Preempting
        )
    }
}

/// One job placed on a node, as its agent sees it: ((org, job), attempt (the fencing
/// token), GPU indices, state).
pub type AssignmentRow = (JobKey, u32, Vec<u8>, JobState);

/// Why a job left a state (recorded on transitions and on the finished job).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reason {
    Submitted,
    Placed,
    Started,
    /// Preempted for another job: `by` names it when it is of the same org (another
    /// org's job ids are never shown), `by_tier` is its tier.
    Preempted {
        by: Option<JobId>,
        by_tier: Tier,
    },
    Requeued,
    Succeeded,
    Failed,
    Cancelled,
    /// No heartbeat within the job lease.
    LeaseExpired,
    /// The node missed its lease (a platform fault): requeued, or failed once the job
    /// used up its requeues.
    NodeDown,
    OutOfCredits,
    MaxDuration,
    // Appended (the encoding is positional).
    /// None of the job's GPU types has a price any more: it cannot be metered anywhere.
    Unpriced,
    /// The node's agent stopped the attempt itself: it could not renew its lease
    /// (requeued like a node failure).
    Fenced,
    // Appended (the encoding is positional).
    /// Attached to another job with the same dedup key (`JobState::Attached`), or
    /// succeeded with its result.
    Deduplicated,
    /// The job it was attached to ended without a result: it runs itself.
    DedupReleased,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub node: NodeId,
    pub gpu_indices: Vec<u8>,
    pub gpu_type: GpuType,
    /// Fixed at placement: the price of the type actually placed on.
    pub price_micro_per_gpu_hour: u64,
    pub started_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub spec: JobSpec,
    pub org: OrgId,
    pub state: JobState,
    /// Fencing token: incremented at every placement.
    pub attempt: u32,
    pub submitted_ms: u64,
    /// When the job last entered the queue (aging and FIFO order).
    pub queued_since_ms: u64,
    pub placement: Option<Placement>,
    /// Run time of closed attempts.
    pub run_ms: u64,
    pub preemptions: u32,
    pub hold_micro: u64,
    pub last_reason: Reason,
    pub finished_ms: Option<u64>,
    /// Pending timers (so they can be cancelled).
    pub lease_at: Option<u64>,
    pub deadline_at: Option<u64>,
    pub grace_at: Option<u64>,
    /// The node whose preempted GPUs are reserved for this queued job.
    pub reserved_node: Option<NodeId>,
    /// Queue wait of each placement (for the simulator's figures).
    pub waits_ms: Vec<u64>,
    /// Times the job was requeued because its node went down.
    pub node_failures: u32,
    /// While preempting: the job it makes room for (internal; the public reason shows
    /// another org's job only as a tier).
    pub preempted_for: Option<JobKey>,
}

/// Everything that happens at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Timer {
    NodeLease(NodeId),
    JobLease(JobKey),
    Grace(JobKey),
    Deadline(JobKey),
}

/// Queued jobs of one user, oldest first.
type UserQueue = BTreeSet<(u64, JobKey)>;
/// Queued jobs of one tier: org → project → user → oldest first.
pub type TierQueue = BTreeMap<OrgId, BTreeMap<ProjectId, BTreeMap<UserId, UserQueue>>>;

/// How a job ends: what the ledger bills, the final state, and why.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ending {
    pub settle: crate::command::SettleReason,
    pub to: JobState,
    pub reason: Reason,
}

impl Ending {
    /// The job's credit cannot pay for it: the meter could not top its hold up, or its
    /// reservation could not be made whole before its first placement.
    pub(crate) const OUT_OF_CREDITS: Ending = Ending {
        settle: crate::command::SettleReason::OutOfCredits,
        to: JobState::Failed,
        reason: Reason::OutOfCredits,
    };
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scheduler {
    pub nodes: IdMap<NodeId, GpuNode>,
    /// Ready nodes with free GPUs, per type: (free GPUs, node).
    pub free_index: BTreeMap<GpuType, BTreeSet<(u32, NodeId)>>,
    /// Every registered node per type.
    pub type_nodes: BTreeMap<GpuType, BTreeSet<NodeId>>,
    /// Every node shape (GPU count, GPU memory) ever registered, per type: a job is
    /// admitted only if one shape can hold it whole (admission check).
    pub type_shapes: BTreeMap<GpuType, BTreeSet<(u32, u32)>>,
    /// Jobs by (org, job id): each org has its own namespace of job ids.
    pub jobs: IdMap<JobKey, Job>,
    /// Every job (active and finished, until pruned) in (org, id) order: an org's jobs
    /// are listed page by page without looking at any other org's.
    pub org_jobs: BTreeSet<JobKey>,
    /// Queued jobs: tier → org → project → user → oldest first.
    pub queue: BTreeMap<Tier, TierQueue>,
    /// Queued jobs per tier by age (aging lane, FIFO and strict-priority order).
    pub by_age: BTreeMap<Tier, BTreeSet<(u64, JobKey)>>,
    pub timers: BTreeSet<(u64, Timer)>,
    /// Finished jobs, pruned after the retention window, beyond the org's quota (its
    /// own oldest) or the shard's cap.
    pub finished: crate::tombstones::Tombstones<JobId>,
    pub quotas: BTreeMap<OrgId, Quota>,
    /// Orgs' plans (`SetPlan`): the tiers each may use.
    pub plans: BTreeMap<OrgId, crate::command::Plan>,
    /// Per org: (queued, running) job counts, for quotas.
    pub org_counts: BTreeMap<OrgId, (u32, u32)>,
    /// GPUs in use per tier, and in total; fleet size (ready + draining nodes).
    pub tier_gpus: BTreeMap<Tier, u32>,
    pub used_gpus: u32,
    pub fleet_gpus: u32,
    /// Decayed GPU usage per org, project and user (projects and users by org).
    pub usage_org: BTreeMap<OrgId, DecayedUsage>,
    pub usage_project: BTreeMap<ProjectKey, DecayedUsage>,
    pub usage_user: BTreeMap<UserKey, DecayedUsage>,
    /// Running GPUs per org, project and user (the live part of fair share).
    pub running_org: BTreeMap<OrgId, u32>,
    pub running_project: BTreeMap<ProjectKey, u32>,
    pub running_user: BTreeMap<UserKey, u32>,
    /// Fair-share weights set by `SetShareWeight` (absent: `SHARE_WEIGHT_DEFAULT`).
    pub weight_org: BTreeMap<OrgId, u32>,
    pub weight_project: BTreeMap<ProjectKey, u32>,
    pub weight_user: BTreeMap<UserKey, u32>,
    /// Result dedup (rule version 3, `dedup.rs`). Not part of the scheduler's own
    /// encoding: the state writes it after its other fields in format 7 only (it is
    /// empty until version 3, whose snapshots are format 7).
    #[serde(skip)]
    pub dedup: dedup::Dedup,
    /// Every job by project and by user (derived from `jobs`: not encoded, rebuilt when a
    /// state is decoded): a project's or a user's jobs are listed page by page without
    /// looking at a sibling's (`query::jobs_page`).
    #[serde(skip)]
    pub scoped_jobs: ScopedJobs,
    /// The instants the silent-node grace rule compares (rule version 5 on,
    /// `timers.rs`). Not part of the scheduler's own encoding: the state writes it after
    /// its other fields in format 8 only (it is empty before version 5, whose snapshots
    /// are format 8).
    #[serde(skip)]
    pub fence: Fence,
    /// How many times a job has joined the queue in this process (`enqueue`), so that
    /// the scheduling pass notices a job joining during it (a dedup runner's attached
    /// job taking over when the runner ends: `pass.rs::PassMemo`). Not state: not
    /// encoded, not compared.
    #[serde(skip)]
    pub(crate) queue_joins: QueueJoins,
}

/// A count of queue joins (see [`Scheduler::queue_joins`]).
pub type QueueJoins = crate::state::NotState<u64>;

/// When each node last renewed its lease, and when each preemption still in its grace
/// began (rule version 5 on; empty before). Kept as instants because the settings that
/// would otherwise rebuild them (`node_lease_ms`, `grace_ms`) can change in between.
/// Bounded by the nodes (one entry each) and the jobs in `Preempting`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    /// Node → the logical time of its last accepted renewal (registration or heartbeat).
    pub renewed_ms: BTreeMap<NodeId, u64>,
    /// Job in `Preempting` whose grace timer is pending → the logical time its
    /// preemption began (removed when the timer fires: nothing reads it after).
    pub preempted_ms: BTreeMap<JobKey, u64>,
}

/// Jobs in (org, project, id) and (org, project, user, id) order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScopedJobs {
    pub by_project: BTreeSet<(OrgId, ProjectId, JobId)>,
    pub by_user: BTreeSet<(OrgId, ProjectId, UserId, JobId)>,
}

impl ScopedJobs {
    fn insert(&mut self, (org, id): JobKey, spec: &JobSpec) {
        self.by_project.insert((org, spec.project, id));
        self.by_user.insert((org, spec.project, spec.user, id));
    }

    fn remove(&mut self, (org, id): JobKey, spec: &JobSpec) {
        self.by_project.remove(&(org, spec.project, id));
        self.by_user.remove(&(org, spec.project, spec.user, id));
    }
}

impl Scheduler {
    /// Rebuilds what is derived from the jobs and not encoded (after a decode).
    pub(crate) fn rebuild_derived(&mut self) {
        let mut scoped = ScopedJobs::default();
        for (key, j) in self.jobs.iter() {
            scoped.insert(*key, &j.spec);
        }
        self.scoped_jobs = scoped;
    }

    pub fn job(&self, org: OrgId, id: JobId) -> Option<&Job> {
        self.jobs.get(&(org, id))
    }

    pub fn node(&self, id: NodeId) -> Option<&GpuNode> {
        self.nodes.get(&id)
    }

    /// The agent incarnation `node` runs now (0: none named, or no such node).
    pub fn node_incarnation(&self, node: NodeId) -> u64 {
        self.nodes.get(&node).map_or(0, |n| n.incarnation)
    }

    /// What a node's agent must run: ((org, job), attempt, GPU indices, state), by job
    /// (the agent reports on each job in its org's namespace).
    pub fn assignments(&self, node: NodeId) -> Vec<AssignmentRow> {
        let Some(n) = self.nodes.get(&node) else {
            return Vec::new();
        };
        let mut out: Vec<_> = n
            .jobs()
            .into_iter()
            .filter_map(|j| self.jobs.get(&j))
            .filter_map(|j| {
                j.placement.as_ref().map(|p| {
                    (
                        (j.org, j.spec.job),
                        j.attempt,
                        p.gpu_indices.clone(),
                        j.state,
                    )
                })
            })
            .collect();
        out.sort();
        out
    }

    /// The fair-share weight of an org, project or user (of `org`).
    pub fn share_weight(&self, org: OrgId, scope: crate::command::BudgetScope) -> u32 {
        use crate::command::BudgetScope;
        let w = match scope {
            BudgetScope::Org(o) => self.weight_org.get(&o),
            BudgetScope::Project(p) => self.weight_project.get(&(org, p)),
            BudgetScope::User(u) => self.weight_user.get(&(org, u)),
        };
        w.copied().unwrap_or(crate::limits::SHARE_WEIGHT_DEFAULT)
    }

    /// The quota of `org`: its own, or the shard's default.
    pub fn quota(&self, cfg: &SchedulerConfig, org: OrgId) -> Quota {
        self.quotas.get(&org).copied().unwrap_or(cfg.default_quota)
    }

    /// Whether `org` (and `project` in it) may use `tier`: its plan's tiers, or without
    /// a plan every tier but the highest.
    pub fn entitled(
        &self,
        cfg: &SchedulerConfig,
        org: OrgId,
        project: ProjectId,
        tier: Tier,
    ) -> bool {
        self.entitled_org(cfg, org, tier)
            && self.plans.get(&org).is_none_or(|plan| {
                plan.project_tiers
                    .iter()
                    .find(|(p, _)| *p == project)
                    .is_none_or(|(_, tiers)| tiers.contains(&tier))
            })
    }

    /// Whether `org` may use `tier` (any of its projects).
    pub fn entitled_org(&self, cfg: &SchedulerConfig, org: OrgId, tier: Tier) -> bool {
        match self.plans.get(&org) {
            None => (tier.0 as usize) + 1 < cfg.tiers.len(),
            Some(plan) => plan.tiers.contains(&tier),
        }
    }

    /// Queued jobs per tier.
    pub fn queue_depth(&self) -> BTreeMap<Tier, usize> {
        self.by_age.iter().map(|(t, q)| (*t, q.len())).collect()
    }
}
