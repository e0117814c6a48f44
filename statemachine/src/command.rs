//! The commands a shard's log carries. One enum: the state machine is a function of the
//! sequence of these (wrapped in [`Request`]s, batched in [`Entry`]s).

use crate::ids::{
    Account, Actor, BucketId, GpuType, HoldId, JobId, NodeId, OrgId, PrincipalId, ProjectId,
    RequestId, Tier, TokenDigest, UserId,
};
pub use crate::security::Scope;
use serde::{Deserialize, Serialize};

/// One Raft log entry's payload: the leader stamps the logical time; the node's batching
/// proposer packs many client requests into one entry (one fsync for all of them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub log_index: u64,
    /// Consensus-assigned logical time (ms since the Unix epoch). The state machine never
    /// lets its clock go back: it applies `max(previous, logical_time_ms)`.
    pub logical_time_ms: u64,
    pub requests: Vec<Request>,
}

/// A client's command with the identity that sent it and its idempotency key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub actor: Actor,
    /// Generated once by the client per logical operation and reused on every retry.
    /// Zero is "missing" and rejected for every mutating command.
    pub request_id: RequestId,
    /// The organisation whose namespace the command's org-scoped ids (projects, users,
    /// holds, jobs, an org's principals) are in. A tenant's token implies it (naming
    /// another org is refused as an unknown org); an admin or an agent names it; a
    /// command that carries its own org (`CreateProject`, an `Account::Org`, a scope)
    /// may leave it out. See [`Request::namespace`].
    pub org: Option<OrgId>,
    pub command: Command,
}

impl Request {
    /// The org namespace the request acts in, for `actor` (the resolved identity).
    /// `Ok(None)`: a command that names no org-scoped object (prices, nodes, ticks...).
    pub fn namespace(&self, actor: &Actor) -> Result<Option<OrgId>, crate::CommandError> {
        let named = match (self.org, self.command.own_org()) {
            (Some(a), Some(b)) if a != b => return Err(crate::CommandError::OrgMismatch),
            (a, b) => a.or(b),
        };
        match actor.org() {
            Some(mine) if named.is_some_and(|n| n != mine) => Err(crate::CommandError::UnknownOrg),
            Some(mine) => Ok(Some(mine)),
            None => Ok(named),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum BucketKind {
    Paid,
    Promotional,
    Granted,
}

impl BucketKind {
    /// Rank in the spend order's third key: promotional before granted before paid
    /// (free money goes first; paid credit, which a customer may ask back, goes last).
    pub fn spend_rank(self) -> u8 {
        match self {
            BucketKind::Promotional => 0,
            BucketKind::Granted => 1,
            BucketKind::Paid => 2,
        }
    }
}

/// Restrictions on what a bucket may pay for. Empty lists mean "any".
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketPolicy {
    /// The bucket pays only for holds whose every acceptable GPU type is listed here.
    pub gpu_types: Vec<GpuType>,
    /// The bucket pays only for holds of these tiers.
    pub tiers: Vec<Tier>,
}

/// A grant of credits: a purchase (paid), a promotion, or a free grant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub bucket: BucketId,
    pub owner: Account,
    pub kind: BucketKind,
    pub amount_micro: u64,
    /// Logical-time instant at which the unspent remainder expires (must be in the future).
    pub expires_at_ms: Option<u64>,
    /// Spend order's first key: the lower value is spent first.
    pub priority: u8,
    pub policy: Option<BucketPolicy>,
    /// External reference, e.g. the purchase id.
    pub source_ref: Option<String>,
}

/// A reservation of credits for work in a project, made at submission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldSpec {
    pub hold: HoldId,
    pub project: ProjectId,
    pub user: UserId,
    pub tier: Tier,
    /// The GPU types the work may run on (bucket GPU policies are checked against all).
    pub gpu_types: Vec<GpuType>,
    pub amount_micro: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum BudgetScope {
    Org(OrgId),
    Project(ProjectId),
    User(UserId),
}

impl std::fmt::Display for BudgetScope {
    /// `org:7`, `project:70`, `user:700`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetScope::Org(o) => o.fmt(f),
            BudgetScope::Project(p) => p.fmt(f),
            BudgetScope::User(u) => u.fmt(f),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BudgetPeriod {
    /// A UTC calendar day of logical time.
    Day,
    /// A UTC calendar month of logical time.
    Month,
    /// No reset.
    Lifetime,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BudgetMode {
    /// A spend (hold or top-up) that would pass the limit is rejected.
    Hard,
    /// The spend is allowed and a `BudgetAlert` audit event is emitted once per period.
    Soft,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetSpec {
    pub limit_micro: u64,
    pub period: BudgetPeriod,
    pub mode: BudgetMode,
}

/// Why a metered hold is settled. It decides up to when usage is charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SettleReason {
    /// The job finished: charged up to the settlement instant.
    Succeeded,
    /// The job failed on its own: charged up to the settlement instant.
    Failed,
    /// The user cancelled it: charged up to the settlement instant.
    Cancelled,
    /// Preemption, which the platform decides: charged only up to the last checkpoint.
    Preempted,
    /// The node lost the job — its lease ran out, or its agent stopped the job because it
    /// could not renew the lease: charged up to the last accepted heartbeat (the GPU time
    /// the cluster saw used; a workload cannot make its attempts free by crashing its
    /// agent).
    NodeFailure,
    /// No heartbeat within the lease (e.g. the finish call was lost): charged up to the
    /// last accepted heartbeat, the last evidence that the job was running.
    Lost,
    /// The hold could not be topped up: charged for everything the account could pay.
    OutOfCredits,
    // -- appended (the encoding is positional) --
    /// The job attached to another with the same dedup key, which succeeded: its hold
    /// returns in full (nothing is charged; the job that ran paid for the run).
    Deduplicated,
}

impl SettleReason {
    /// The ending the platform itself declares (preemption) bills only the work a
    /// checkpoint preserved.
    pub fn bills_to_checkpoint(self) -> bool {
        matches!(self, SettleReason::Preempted)
    }

    /// Endings the cluster only observes (a lease ran out) bill to the last heartbeat.
    pub fn bills_to_last_heartbeat(self) -> bool {
        matches!(self, SettleReason::NodeFailure | SettleReason::Lost)
    }
}

/// A metering heartbeat from the agent running a hold's job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub hold: HoldId,
    /// The attempt (fencing token) the agent was given; a stale one is rejected.
    pub attempt: u32,
    /// Strictly increasing per attempt; a duplicate or older seq is ignored.
    pub seq: u64,
    /// Progress in parts per million (0..=1_000_000), informational.
    pub progress_ppm: u32,
    /// Number of the last durable checkpoint (0 = none); it never goes back.
    pub checkpoint: u64,
}

/// Every mutating operation. Reads are queries on [`crate::State`], not commands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    CreateOrg {
        org: OrgId,
    },
    CreateProject {
        project: ProjectId,
        org: OrgId,
    },
    CreateUser {
        user: UserId,
        org: OrgId,
    },
    /// Replaces the price table with a new version (micro-credits per GPU-hour).
    SetPrices {
        prices: Vec<(GpuType, u64)>,
    },
    IssueGrant(Grant),
    /// Sets (`Some`) or removes (`None`) the budget of an org, project or user.
    SetBudget {
        scope: BudgetScope,
        budget: Option<BudgetSpec>,
    },
    CreateHold(HoldSpec),
    /// An explicit partial capture from an unmetered hold.
    Capture {
        hold: HoldId,
        amount_micro: u64,
    },
    TopUp {
        hold: HoldId,
        amount_micro: u64,
    },
    /// Returns the whole unused remainder of an unmetered hold and closes it.
    ReleaseHold {
        hold: HoldId,
    },
    /// Starts metering an attempt: fixes the price of the GPU type actually placed on.
    StartMeter {
        hold: HoldId,
        attempt: u32,
        gpu_type: GpuType,
        gpus: u32,
    },
    Heartbeat(Heartbeat),
    /// Final capture for the attempt, then the unused hold returns to its buckets.
    Settle {
        hold: HoldId,
        attempt: u32,
        reason: SettleReason,
    },
    /// Moves credits between two accounts of one organisation, keeping each moved part's
    /// kind, expiry, priority and policy.
    Transfer {
        from: Account,
        to: Account,
        amount_micro: u64,
    },
    /// Advances logical time only (expiry, leases, pruning run in every entry).
    Tick,
    // -- scheduler --
    /// Registers a GPU node (re-registering the same shape renews its lease).
    RegisterNode(NodeSpec),
    /// The node's agent is alive: renews the node lease.
    NodeHeartbeat {
        node: NodeId,
    },
    /// Drain (no new placements; running jobs finish) or return a node to service.
    SetNodeDraining {
        node: NodeId,
        draining: bool,
    },
    /// Validates, applies admission quotas, reserves the hold and enqueues — all or
    /// nothing. Idempotent by job id: the same spec again returns the job as it is.
    SubmitJob(JobSpec),
    CancelJob {
        job: JobId,
    },
    /// Agent heartbeat for a placed job's attempt: meters it and renews its lease.
    JobHeartbeat(JobHeartbeat),
    /// The agent reports the attempt's exit (or, while preempting, that it stopped).
    FinishJob {
        job: JobId,
        attempt: u32,
        success: bool,
    },
    /// Admission quotas of one org (None: the shard default).
    SetQuota {
        org: OrgId,
        quota: Option<Quota>,
    },
    /// Retunes the shard's scheduler (leases, grace, preemption rules, decay, tiers);
    /// admin only; validated whole, applied whole.
    ConfigureScheduler(crate::scheduler::SchedulerSettings),
    // -- security --
    /// Installs the first admin token and secures the shard for good. The one command
    /// an unauthenticated caller may send; refused once the shard is secured.
    Bootstrap {
        principal: PrincipalId,
        digest: TokenDigest,
    },
    /// A new principal with one token (its SHA-256; the token never reaches the node).
    CreateToken {
        principal: PrincipalId,
        digest: TokenDigest,
        scope: Scope,
        expires_at_ms: Option<u64>,
    },
    /// Adds a new token to a principal; its old tokens stop working `overlap_ms` later.
    RotateToken {
        principal: PrincipalId,
        digest: TokenDigest,
        overlap_ms: u64,
    },
    /// Revokes every token of a principal, for good.
    RevokeToken {
        principal: PrincipalId,
    },
    /// Authorisation denials a node saw at its edge (queries, audit reads, admin
    /// calls), reported by the node itself so they enter the audit trail. Commands
    /// denied inside apply are audited by their own command event.
    RecordDenials {
        node: u64,
        denials: Vec<Denial>,
    },
    // -- appended (the encoding is positional) --
    /// The fair-share weight of an org, project or user (None: back to the default,
    /// `SHARE_WEIGHT_DEFAULT`). Inside a tier the scheduler divides each one's decayed
    /// GPU usage by its weight: twice the weight, twice the share under contention.
    /// Org weights are the operator's (admin); an org may weigh its own projects and
    /// users.
    SetShareWeight {
        scope: BudgetScope,
        weight: Option<u32>,
    },
    /// Sets (`Some`) or removes (`None`: back to the default) an org's plan: the tiers
    /// its jobs and holds may use. Admin only.
    SetPlan {
        org: OrgId,
        plan: Option<Plan>,
    },
    /// The agent stopped an attempt itself because it could not renew its lease (it
    /// fences itself before the cluster may re-place the job): requeued like a node
    /// failure, billed to the last heartbeat. Agent only.
    JobFenced {
        job: JobId,
        attempt: u32,
    },
    /// `IssueGrant` whose bucket expires `expires_in_ms` after the logical time the
    /// command is applied at (the grant's own `expires_at_ms` is ignored): a relative
    /// expiry on the cluster's clock, and the same bytes on every retry, so a retried
    /// request id is answered, not refused as reused. Applied as the `IssueGrant` it
    /// resolves to.
    IssueGrantIn {
        grant: Grant,
        expires_in_ms: u64,
    },
    /// Sets (`Some`, armed afresh) or removes an alert on an org's, project's or user's
    /// available credit and budget use (`crate::alerts`): a crossing appends a
    /// `LowBalance` or `BudgetThreshold` event. The org (its token) or an admin.
    SetAlert {
        scope: BudgetScope,
        alert: Option<crate::alerts::AlertSpec>,
    },
    /// Switches the shard's behaviour to rule version `version` from this entry on
    /// (`crate::version`). Admin only. The node proposes it only when every voter runs a
    /// binary that supports the version, and a replica whose binary does not stops
    /// rather than apply it (docs/DESIGN.md §48).
    ActivateVersion {
        version: u32,
    },
    // -- appended (the encoding is positional) --
    /// `SubmitJob` with a dedup key (rule version 3): if a job of the same org with the
    /// same key is in flight, the new job *attaches* to it — its hold is reserved as for
    /// any job, it does not run, and it succeeds with the other's result (its hold
    /// returned in full) or, if the other ends otherwise, runs itself; if such a job
    /// succeeded and is still retained, the new job succeeds at once with its result.
    /// Otherwise it runs like `SubmitJob` and later submissions with the key attach to
    /// it (docs/DESIGN.md §53).
    SubmitJobDedup {
        spec: JobSpec,
        key: crate::ids::DedupKey,
    },
    /// `FinishJob` with when the runner exited, as its agent measured it on its own
    /// monotonic clock (rule version 6): `exit.after_ms` after the agent sent heartbeat
    /// `exit.heartbeat_seq` of the attempt, the newest one it saw accepted. An ending
    /// that bills to now bills no later than the logical time the meter recorded for its
    /// newest heartbeat plus `after_ms`, so a runner that exits while its agent is cut
    /// off from the cluster is not billed until the report gets through (DESIGN §45,
    /// "The exit instant"). Otherwise applied as `FinishJob`. Agent only.
    FinishJobAt {
        job: JobId,
        attempt: u32,
        success: bool,
        exit: RunnerExit,
    },
}

/// When a runner exited, as its agent measured it (`Command::FinishJobAt`): `after_ms`
/// after the agent sent the attempt's heartbeat `heartbeat_seq` — the newest heartbeat
/// of the attempt the agent saw the cluster accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerExit {
    pub heartbeat_seq: u64,
    pub after_ms: u64,
}

/// One refused call at a node's edge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Denial {
    /// The caller as far as it could be established (a resolved principal, or the
    /// unresolved token digest, or `Anonymous`); never a secret.
    pub actor: Actor,
    /// The call, e.g. "query:balance", "audit", "admin:change_membership".
    pub api: String,
    pub reason: DenialReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DenialReason {
    Unauthenticated,
    PermissionDenied,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub node: NodeId,
    pub gpu_type: GpuType,
    pub gpu_count: u32,
    pub gpu_mem_gb: u32,
    /// Sorted `key=value` labels (informational; bounded).
    pub labels: Vec<(String, String)>,
    /// Which process of the node's agent registers (0: none named — an operator's
    /// registration, which starts no incarnation). Each agent process picks one above
    /// every earlier one; a registration naming a higher one ends the attempts the
    /// previous process was running (they are requeued, billed to their last
    /// heartbeat), so that process's late reports are stale; a lower one is refused
    /// (`StaleIncarnation`).
    pub incarnation: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub job: JobId,
    pub project: ProjectId,
    pub user: UserId,
    pub tier: Tier,
    /// Acceptable GPU types, most preferred first.
    pub gpu_types: Vec<GpuType>,
    /// 1..=8, all on one node.
    pub gpus: u32,
    pub mem_floor_gb: u32,
    pub preemptible: bool,
    pub checkpointable: bool,
    pub max_duration_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobHeartbeat {
    pub job: JobId,
    pub attempt: u32,
    pub seq: u64,
    pub progress_ppm: u32,
    pub checkpoint: u64,
}

/// An org's share of every table a tenant can grow (admin-settable per org; the
/// shard's default otherwise). A command that would pass one is refused with
/// `QuotaExceeded` before it takes anything from the shard, so the shard-wide caps in
/// `limits` are never what one tenant meets first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    /// Jobs queued at once; a submission beyond it is refused (`QuotaExceeded`).
    pub queued_max: u32,
    /// Jobs running at once; beyond it, the org's jobs wait in the queue.
    pub running_max: u32,
    /// Holds open at once (jobs' holds included).
    pub holds_open_max: u32,
    /// Idempotency records of the org's principals (24 h of logical time each).
    pub records_max: u32,
    /// Buckets in use (not closed) across the org's and its projects' accounts.
    pub buckets_max: u32,
    /// Principals (tokens' identities) in the org's namespace.
    pub principals_max: u32,
    pub projects_max: u32,
    pub users_max: u32,
    /// Finished jobs and settled holds kept as tombstones (status queries, refusing a
    /// reused id); beyond it the org's own oldest are dropped, never another org's.
    pub finished_jobs_max: u32,
    pub settled_holds_max: u32,
    /// Server streams (`WatchEvents`, `WatchAssignments`) the org's principals hold open
    /// at once on one node, together (each principal also at most
    /// `STREAMS_PER_PRINCIPAL_MAX`). Enforced by each node's edge, which reads it here.
    pub streams_max: u32,
}

impl Default for Quota {
    /// Sized so one tenant can run a large platform (10,000 queued jobs, 50,000 open
    /// holds, 1,000,000 requests a day) while sixteen such tenants still fit every
    /// shard-wide table (the idempotency table below its operator reserve).
    fn default() -> Self {
        Quota {
            queued_max: 10_000,
            running_max: 2_000,
            holds_open_max: 50_000,
            records_max: 1_000_000,
            buckets_max: 65_536,
            principals_max: 10_000,
            projects_max: 100_000,
            users_max: 500_000,
            finished_jobs_max: 200_000,
            settled_holds_max: 200_000,
            streams_max: 64,
        }
    }
}

/// What an org is entitled to: the tiers its jobs (and holds) may use, and narrower
/// ones for some of its projects. Set by an admin (`SetPlan`), replicated and audited.
/// Without one, an org may use every tier but the highest (`SchedulerConfig::tiers`):
/// the top tier — priority over other orgs, preemption of their jobs, the largest
/// floor — is granted, never self-selected.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub tiers: Vec<Tier>,
    /// Projects entitled to fewer tiers than the org (each a subset of `tiers`).
    pub project_tiers: Vec<(ProjectId, Vec<Tier>)>,
}

impl Command {
    /// The job a submission describes (`SubmitJob`, `SubmitJobDedup`).
    pub fn job_spec(&self) -> Option<&JobSpec> {
        match self {
            Command::SubmitJob(spec) | Command::SubmitJobDedup { spec, .. } => Some(spec),
            _ => None,
        }
    }

    /// An agent's finish report (`FinishJob`, `FinishJobAt`): the job, the attempt,
    /// whether it succeeded, and when its runner exited if the report says.
    pub fn finish_report(&self) -> Option<(JobId, u32, bool, Option<RunnerExit>)> {
        match self {
            Command::FinishJob {
                job,
                attempt,
                success,
            } => Some((*job, *attempt, *success, None)),
            Command::FinishJobAt {
                job,
                attempt,
                success,
                exit,
            } => Some((*job, *attempt, *success, Some(*exit))),
            _ => None,
        }
    }

    /// The command as apply runs it at logical time `now`: a relative expiry becomes
    /// the instant it names (`IssueGrantIn` → `IssueGrant`); every other command is
    /// itself. Borrowed unless it changed.
    pub fn resolved_at(&self, now: u64) -> std::borrow::Cow<'_, Command> {
        match self {
            Command::IssueGrantIn {
                grant,
                expires_in_ms,
            } => std::borrow::Cow::Owned(Command::IssueGrant(Grant {
                expires_at_ms: Some(now.saturating_add(*expires_in_ms)),
                ..grant.clone()
            })),
            c => std::borrow::Cow::Borrowed(c),
        }
    }

    /// The rule version that introduced this kind of command. An older binary reads a
    /// newer variant inside a request blob of the format it knows as malformed, and
    /// applies the entry as a tick — its replica would diverge without a word — so a
    /// command kind added after the baseline is refused by `validate` until its rule
    /// version is active, and activation needs every member to support it (DESIGN §48).
    /// The match is exhaustive on purpose: a new variant must say when it came.
    pub fn introduced_in(&self) -> u32 {
        use crate::version::RULES_BASELINE;
        match self {
            Command::SubmitJobDedup { .. } => 3,
            Command::FinishJobAt { .. } => crate::scheduler::RUNNER_EXIT_BILLS_FROM,
            Command::CreateOrg { .. }
            | Command::CreateProject { .. }
            | Command::CreateUser { .. }
            | Command::SetPrices { .. }
            | Command::IssueGrant(_)
            | Command::IssueGrantIn { .. }
            | Command::SetBudget { .. }
            | Command::CreateHold(_)
            | Command::Capture { .. }
            | Command::TopUp { .. }
            | Command::ReleaseHold { .. }
            | Command::StartMeter { .. }
            | Command::Heartbeat(_)
            | Command::Settle { .. }
            | Command::Transfer { .. }
            | Command::Tick
            | Command::RegisterNode(_)
            | Command::NodeHeartbeat { .. }
            | Command::SetNodeDraining { .. }
            | Command::SubmitJob(_)
            | Command::CancelJob { .. }
            | Command::JobHeartbeat(_)
            | Command::FinishJob { .. }
            | Command::SetQuota { .. }
            | Command::ConfigureScheduler(_)
            | Command::Bootstrap { .. }
            | Command::CreateToken { .. }
            | Command::RotateToken { .. }
            | Command::RevokeToken { .. }
            | Command::RecordDenials { .. }
            | Command::SetShareWeight { .. }
            | Command::SetPlan { .. }
            | Command::JobFenced { .. }
            | Command::SetAlert { .. }
            | Command::ActivateVersion { .. } => RULES_BASELINE,
        }
    }

    /// A stable short name for logs, metrics and audit queries.
    pub fn name(&self) -> &'static str {
        match self {
            Command::CreateOrg { .. } => "create_org",
            Command::CreateProject { .. } => "create_project",
            Command::CreateUser { .. } => "create_user",
            Command::SetPrices { .. } => "set_prices",
            Command::IssueGrant(_) | Command::IssueGrantIn { .. } => "issue_grant",
            Command::SetBudget { .. } => "set_budget",
            Command::CreateHold(_) => "create_hold",
            Command::Capture { .. } => "capture",
            Command::TopUp { .. } => "top_up",
            Command::ReleaseHold { .. } => "release_hold",
            Command::StartMeter { .. } => "start_meter",
            Command::Heartbeat(_) => "heartbeat",
            Command::Settle { .. } => "settle",
            Command::Transfer { .. } => "transfer",
            Command::Tick => "tick",
            Command::RegisterNode(_) => "register_node",
            Command::NodeHeartbeat { .. } => "node_heartbeat",
            Command::SetNodeDraining { .. } => "set_node_draining",
            Command::SubmitJob(_) => "submit_job",
            Command::SubmitJobDedup { .. } => "submit_job_dedup",
            Command::CancelJob { .. } => "cancel_job",
            Command::JobHeartbeat(_) => "job_heartbeat",
            Command::FinishJob { .. } | Command::FinishJobAt { .. } => "finish_job",
            Command::SetQuota { .. } => "set_quota",
            Command::ConfigureScheduler(_) => "configure_scheduler",
            Command::Bootstrap { .. } => "bootstrap",
            Command::CreateToken { .. } => "create_token",
            Command::RotateToken { .. } => "rotate_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::RecordDenials { .. } => "record_denials",
            Command::SetShareWeight { .. } => "set_share_weight",
            Command::SetPlan { .. } => "set_plan",
            Command::JobFenced { .. } => "job_fenced",
            Command::SetAlert { .. } => "set_alert",
            Command::ActivateVersion { .. } => "activate_version",
        }
    }

    /// The org the command itself names, if any (its namespace without `Request::org`).
    pub fn own_org(&self) -> Option<OrgId> {
        let of_account = |a: &Account| match a {
            Account::Org(o) => Some(*o),
            Account::Project(_) => None,
        };
        match self {
            Command::CreateOrg { org }
            | Command::CreateProject { org, .. }
            | Command::CreateUser { org, .. }
            | Command::SetQuota { org, .. }
            | Command::SetPlan { org, .. } => Some(*org),
            Command::IssueGrant(g) | Command::IssueGrantIn { grant: g, .. } => of_account(&g.owner),
            Command::Transfer { from, to, .. } => of_account(from).or(of_account(to)),
            Command::SetBudget { scope, .. }
            | Command::SetShareWeight { scope, .. }
            | Command::SetAlert { scope, .. } => match scope {
                BudgetScope::Org(o) => Some(*o),
                _ => None,
            },
            Command::CreateToken { scope, .. } => scope.org(),
            _ => None,
        }
    }

    /// Commands handled by the scheduler (the rest are the ledger's).
    pub fn is_scheduler(&self) -> bool {
        matches!(
            self,
            Command::RegisterNode(_)
                | Command::NodeHeartbeat { .. }
                | Command::SetNodeDraining { .. }
                | Command::SubmitJob(_)
                | Command::SubmitJobDedup { .. }
                | Command::CancelJob { .. }
                | Command::JobHeartbeat(_)
                | Command::FinishJob { .. }
                | Command::FinishJobAt { .. }
                | Command::JobFenced { .. }
                | Command::SetQuota { .. }
                | Command::SetShareWeight { .. }
                | Command::SetPlan { .. }
        )
    }

    /// Whether the command goes through the idempotency table. Ticks change nothing but
    /// time. Heartbeats are idempotent by their own key — `(hold, attempt, seq)` with
    /// `seq` strictly increasing — so a resent heartbeat is recognised as a duplicate and
    /// changes nothing; they are the hottest command (one per running job every 30–60 s)
    /// and must not fill the bounded request table.
    pub fn uses_idempotency_table(&self) -> bool {
        !matches!(
            self,
            Command::Tick
                | Command::Heartbeat(_)
                | Command::JobHeartbeat(_)
                | Command::NodeHeartbeat { .. }
                | Command::RecordDenials { .. }
        )
    }

    /// Commands that change the token table.
    pub fn is_security(&self) -> bool {
        matches!(
            self,
            Command::Bootstrap { .. }
                | Command::CreateToken { .. }
                | Command::RotateToken { .. }
                | Command::RevokeToken { .. }
                | Command::RecordDenials { .. }
        )
    }
}
