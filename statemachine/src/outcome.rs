//! Typed results. Every command yields an [`Outcome`]: a [`Reply`] or a [`CommandError`].
//! Errors are declared in order of precedence: when several apply, validation of the
//! request itself comes first, then unknown ids, then conflicts, then resource limits.

use crate::command::{BudgetScope, SettleReason};
use crate::ids::{BucketId, GpuType, HoldId, JobId};
use serde::{Deserialize, Serialize};

pub type Outcome = Result<Reply, CommandError>;

/// Which bounded table or list was full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Limit {
    CommandsPerEntry,
    Orgs,
    Projects,
    Users,
    Buckets,
    BucketsPerAccount,
    HoldsOpen,
    DrawsPerHold,
    IdempotencyEntries,
    Nodes,
    JobsActive,
    Labels,
    PriceTableTypes,
    GpuTypesPerList,
    TiersPerPolicy,
    Tokens,
    TokenKeysPerPrincipal,
    Denials,
    // Appended (the encoding is positional).
    /// One command's encoded size (`COMMAND_BYTES_MAX`).
    CommandBytes,
    /// Projects with their own tiers in one plan (`PLAN_PROJECTS_MAX`).
    PlanProjects,
    /// Alerts of one org or of the shard (`limits::ALERTS_PER_ORG_MAX`, `ALERTS_MAX`).
    Alerts,
    /// Budget percentages in one alert (`limits::ALERT_PCTS_MAX`).
    AlertPcts,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CommandError {
    // -- the request itself --
    #[error("a mutating command needs a non-zero request id")]
    MissingRequestId,
    #[error("request id already used with a different payload")]
    RequestIdReused,
    #[error("amount must be greater than zero")]
    AmountZero,
    #[error("amount exceeds the per-command maximum")]
    AmountTooLarge,
    #[error("invalid GPU type name {:?}", .0.0)]
    InvalidGpuType(GpuType),
    #[error("GPU count must be between 1 and 8")]
    InvalidGpuCount,
    #[error("price must be between 1 and the maximum micro-credits per GPU-hour")]
    InvalidPrice,
    #[error("the list names the same entry twice")]
    DuplicateEntry,
    #[error("the source reference is too long")]
    SourceRefTooLong,
    #[error("expiry must be after the current logical time")]
    ExpiryInPast,
    #[error("ids at or above 2^63 are reserved")]
    IdOutOfRange,
    #[error("the command is not allowed for this caller")]
    Unauthorized,
    #[error("a transfer needs two distinct accounts of one organisation")]
    InvalidTransfer,
    #[error("progress must be at most 1,000,000 ppm")]
    InvalidProgress,
    // -- unknown ids --
    #[error("unknown organisation")]
    UnknownOrg,
    #[error("unknown project")]
    UnknownProject,
    #[error("unknown user")]
    UnknownUser,
    #[error("unknown hold")]
    UnknownHold,
    #[error("no price for GPU type {0}")]
    UnknownPrice(GpuType),
    // -- conflicts --
    #[error("an object with this id already exists")]
    AlreadyExists,
    /// Never produced since tenants were isolated (issue 20): a user, project or hold
    /// of another org is answered exactly as an unused id (`UnknownUser`, ...), so no
    /// answer reveals that it exists. Kept so the positional encoding of every later
    /// variant and the API's reason number 21 stay what they were.
    #[error("the user belongs to another organisation")]
    WrongOrg,
    #[error("the hold is already settled")]
    HoldSettled,
    #[error("the hold is metered: captures come from heartbeats and settlement")]
    HoldMetered,
    #[error("the hold belongs to a job: use the job commands")]
    HoldOwnedByJob,
    #[error("unknown GPU node")]
    UnknownNode,
    #[error("the node is down")]
    NodeDown,
    #[error("invalid node: {0}")]
    InvalidNode(NodeProblem),
    #[error("unknown job")]
    UnknownJob,
    #[error("a node with this id is registered with another shape")]
    NodeShapeConflict,
    #[error("no registered node type can ever meet this job's GPU type, count and memory")]
    Unsatisfiable,
    #[error("invalid job: {0}")]
    InvalidJob(JobProblem),
    #[error("unknown tier")]
    UnknownTier,
    #[error("the job is already finished")]
    JobFinished,
    #[error("the job is not placed on a node")]
    JobNotPlaced,
    #[error("the org's quota of {0} is exceeded")]
    QuotaExceeded(QuotaKind),
    #[error("the hold is not being metered")]
    HoldNotMetered,
    #[error("attempt {given} is not the current attempt {current}")]
    StaleAttempt { given: u32, current: u32 },
    /// A registration from an agent process older than the one the node runs now.
    #[error("agent incarnation {given} is older than the node's current incarnation {current}")]
    StaleIncarnation { given: u64, current: u64 },
    #[error("capture of {} credits exceeds the {} still held", crate::units::credits(*requested), crate::units::credits(*held))]
    CaptureExceedsHold { requested: u64, held: u64 },
    #[error("insufficient credits: {} available, {} needed", crate::units::credits(*available), crate::units::credits(*needed))]
    InsufficientCredits { available: u64, needed: u64 },
    #[error("hard budget of {scope} exceeded: limit {} credits, used {}, asked {}", crate::units::credits(*limit), crate::units::credits(*used), crate::units::credits(*asked))]
    BudgetExceeded {
        scope: BudgetScope,
        limit: u64,
        used: u64,
        asked: u64,
    },
    #[error("arithmetic overflow")]
    Overflow,
    // -- limits --
    #[error("limit reached: {0}")]
    LimitReached(Limit),
    // Appended (the encoding is positional): a request-validation error.
    #[error("invalid scheduler settings: {0}")]
    InvalidConfig(ConfigProblem),
    // -- security (appended: the encoding is positional) --
    /// Missing, unknown, expired or revoked token, or a claimed identity on a secured
    /// shard. Deliberately one error: the caller learns nothing about which.
    #[error("unauthenticated")]
    Unauthenticated,
    #[error("a token digest must not be all zeros")]
    InvalidToken,
    #[error("the shard is already secured (bootstrapped)")]
    AlreadyBootstrapped,
    #[error("unknown principal")]
    UnknownPrincipal,
    // -- appended (the encoding is positional) --
    /// A well-formed GPU type that the shard has neither a price nor a node for (a typo,
    /// or a type this pool does not have).
    #[error("unknown GPU type {0}: no price and no node of this type")]
    UnknownGpuType(GpuType),
    #[error("a share weight must be between 1 and 10,000")]
    InvalidShareWeight,
    // -- appended (the encoding is positional) --
    /// The command names org-scoped ids (a project, user, hold or job) but no org: an
    /// admin or agent names the org the ids are in.
    #[error("the command names org-scoped ids: name their organisation")]
    OrgRequired,
    /// The request's org and the org the command names differ.
    #[error("the request's organisation and the command's differ")]
    OrgMismatch,
    /// The org's plan does not entitle it (or the project) to the tier.
    #[error("the plan does not entitle this org or project to tier {}", .0.0)]
    TierNotEntitled(crate::ids::Tier),
    /// An alert without a threshold, a low-balance threshold on a user (no account), or
    /// a budget percentage outside 1..=1000.
    #[error("invalid alert: give a low-balance threshold (org or project) or budget percentages 1..=1000")]
    InvalidAlert,
    // -- appended (the encoding is positional) --
    /// `ActivateVersion` of a rule version older than the active one, or newer than
    /// this build implements (`crate::version`).
    #[error("rule version refused: version {active} is active and this build implements up to {newest} (versions never go back)")]
    UnsupportedRulesVersion { active: u32, newest: u32 },
    /// A refusal this build does not know, as a newer release's node sent it on the
    /// typed API (a rolling upgrade; a new kind in the audit trail): kept whole — its
    /// reason number, message and `details_json` — so it fails its own request only,
    /// and a node forwarding it passes it on unchanged. Never produced by the rules.
    #[error("{message}")]
    Unrecognized {
        reason: i32,
        message: String,
        details_json: String,
    },
}

impl CommandError {
    /// A stable, machine-readable name of the error kind (`INSUFFICIENT_CREDITS`), for
    /// gRPC status metadata, logs and other languages' clients. Never renamed: a new kind
    /// gets a new name.
    pub fn reason(&self) -> &'static str {
        match self {
            CommandError::MissingRequestId => "MISSING_REQUEST_ID",
            CommandError::RequestIdReused => "REQUEST_ID_REUSED",
            CommandError::AmountZero => "AMOUNT_ZERO",
            CommandError::AmountTooLarge => "AMOUNT_TOO_LARGE",
            CommandError::InvalidGpuType(_) => "INVALID_GPU_TYPE",
            CommandError::InvalidGpuCount => "INVALID_GPU_COUNT",
            CommandError::InvalidPrice => "INVALID_PRICE",
            CommandError::DuplicateEntry => "DUPLICATE_ENTRY",
            CommandError::SourceRefTooLong => "SOURCE_REF_TOO_LONG",
            CommandError::ExpiryInPast => "EXPIRY_IN_PAST",
            CommandError::IdOutOfRange => "ID_OUT_OF_RANGE",
            CommandError::Unauthorized => "UNAUTHORIZED",
            CommandError::InvalidTransfer => "INVALID_TRANSFER",
            CommandError::InvalidProgress => "INVALID_PROGRESS",
            CommandError::UnknownOrg => "UNKNOWN_ORG",
            CommandError::UnknownProject => "UNKNOWN_PROJECT",
            CommandError::UnknownUser => "UNKNOWN_USER",
            CommandError::UnknownHold => "UNKNOWN_HOLD",
            CommandError::UnknownPrice(_) => "UNKNOWN_PRICE",
            CommandError::AlreadyExists => "ALREADY_EXISTS",
            CommandError::WrongOrg => "WRONG_ORG",
            CommandError::HoldSettled => "HOLD_SETTLED",
            CommandError::HoldMetered => "HOLD_METERED",
            CommandError::HoldOwnedByJob => "HOLD_OWNED_BY_JOB",
            CommandError::UnknownNode => "UNKNOWN_NODE",
            CommandError::NodeDown => "NODE_DOWN",
            CommandError::InvalidNode(_) => "INVALID_NODE",
            CommandError::UnknownJob => "UNKNOWN_JOB",
            CommandError::NodeShapeConflict => "NODE_SHAPE_CONFLICT",
            CommandError::Unsatisfiable => "UNSATISFIABLE",
            CommandError::InvalidJob(_) => "INVALID_JOB",
            CommandError::UnknownTier => "UNKNOWN_TIER",
            CommandError::JobFinished => "JOB_FINISHED",
            CommandError::JobNotPlaced => "JOB_NOT_PLACED",
            CommandError::QuotaExceeded(_) => "QUOTA_EXCEEDED",
            CommandError::HoldNotMetered => "HOLD_NOT_METERED",
            CommandError::StaleAttempt { .. } => "STALE_ATTEMPT",
            CommandError::StaleIncarnation { .. } => "STALE_INCARNATION",
            CommandError::CaptureExceedsHold { .. } => "CAPTURE_EXCEEDS_HOLD",
            CommandError::InsufficientCredits { .. } => "INSUFFICIENT_CREDITS",
            CommandError::BudgetExceeded { .. } => "BUDGET_EXCEEDED",
            CommandError::Overflow => "OVERFLOW",
            CommandError::LimitReached(_) => "LIMIT_REACHED",
            CommandError::InvalidConfig(_) => "INVALID_CONFIG",
            CommandError::Unauthenticated => "UNAUTHENTICATED",
            CommandError::InvalidToken => "INVALID_TOKEN",
            CommandError::AlreadyBootstrapped => "ALREADY_BOOTSTRAPPED",
            CommandError::UnknownPrincipal => "UNKNOWN_PRINCIPAL",
            CommandError::UnknownGpuType(_) => "UNKNOWN_GPU_TYPE",
            CommandError::InvalidShareWeight => "INVALID_SHARE_WEIGHT",
            CommandError::OrgRequired => "ORG_REQUIRED",
            CommandError::OrgMismatch => "ORG_MISMATCH",
            CommandError::TierNotEntitled(_) => "TIER_NOT_ENTITLED",
            CommandError::InvalidAlert => "INVALID_ALERT",
            CommandError::UnsupportedRulesVersion { .. } => "UNSUPPORTED_RULES_VERSION",
            CommandError::Unrecognized { .. } => "UNRECOGNIZED",
        }
    }
}

/// Which scheduler setting is out of bounds (`scheduler::settings_bounds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConfigProblem {
    NodeLease,
    JobLease,
    Grace,
    MinRuntime,
    Hysteresis,
    PreemptionCap,
    PreemptionLoss,
    HalfLife,
    /// Tiers can be retuned, not added or removed.
    TierCount,
    TierName,
    TierWeight,
    /// floor ≤ ceiling ≤ 100 per tier, and floors add up to at most 100.
    TierShare,
    TierWait,
    // Appended (the encoding is positional).
    NodeFailureRequeues,
    TierPrice,
    FenceMargin,
}

/// What is wrong with a node registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeProblem {
    /// GPU count outside 1..=16.
    GpuCount,
    /// GPU memory outside 1..=4096 GB.
    Memory,
    /// A label key empty, or a key or value too long.
    Label,
}

/// What is wrong with a job spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobProblem {
    /// No acceptable GPU type given.
    NoGpuTypes,
    /// `max_duration_ms` is zero or longer than 30 days.
    MaxDuration,
    /// Memory floor above the largest possible.
    MemoryFloor,
    // Appended (the encoding is positional).
    /// A dedup key empty or longer than `limits::DEDUP_KEY_BYTES_MAX`.
    DedupKey,
    /// A runner's exit report (`Command::FinishJobAt`) naming heartbeat 0, or an exit
    /// later after it than the longest job may run.
    RunnerExit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuotaKind {
    /// The org's queue is full (the running cap does not refuse: jobs wait to run).
    QueuedJobs,
    // Appended (the encoding is positional).
    HoldsOpen,
    /// The org's principals' idempotency records (requests in the last 24 h).
    Records,
    Buckets,
    Principals,
    Projects,
    Users,
}

/// One draw of a hold from one bucket, as reported to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrawReport {
    pub bucket: BucketId,
    pub amount_micro: u64,
}

/// What settlement did with a hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settlement {
    pub reason: SettleReason,
    /// Everything captured from the hold over its life.
    pub captured_micro: u64,
    /// Returned to live buckets.
    pub refunded_micro: u64,
    /// Would have been refunded, but the bucket had expired: counted as expired.
    pub forfeited_micro: u64,
    /// Usage that the account could not pay (hold and top-ups exhausted).
    pub uncollected_micro: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// False when the seq was a duplicate or stale: nothing changed.
    pub accepted: bool,
    pub captured_delta_micro: u64,
    pub captured_attempt_micro: u64,
    pub held_micro: u64,
    /// Set when the job must stop (out of credits); the hold is then settled.
    pub stop: Option<Settlement>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Created,
    PricesSet {
        version: u32,
    },
    GrantIssued {
        bucket: BucketId,
    },
    BudgetSet,
    HoldCreated {
        hold: HoldId,
        draws: Vec<DrawReport>,
    },
    Captured {
        captured_micro: u64,
        held_micro: u64,
    },
    ToppedUp {
        added_micro: u64,
        held_micro: u64,
    },
    MeterStarted {
        price_micro_per_gpu_hour: u64,
        price_version: u32,
    },
    Heartbeat(HeartbeatReply),
    Settled(Settlement),
    Transferred {
        buckets: Vec<BucketId>,
    },
    Ticked,
    NodeRegistered,
    NodeUpdated,
    /// The job as it stands after submission (also for an idempotent resubmit).
    JobSubmitted {
        job: JobId,
        hold_micro: u64,
        state: crate::scheduler::JobState,
    },
    JobCancelled(Option<Settlement>),
    JobHeartbeat(HeartbeatReply),
    JobFinished(Option<Settlement>),
    QuotaSet,
    SchedulerConfigured,
    /// A token was installed, rotated or revoked.
    TokenSet,
    DenialsRecorded {
        count: u32,
    },
    // Appended (the encoding is positional).
    ShareWeightSet,
    PlanSet,
    AlertSet,
    /// `ActivateVersion`: the rule version now active (unchanged for a repeat).
    RulesActive {
        version: u32,
    },
    // Appended (the encoding is positional).
    /// `SubmitJobDedup`: the job was created attached to `to`, the job of its org with
    /// the same dedup key — `Attached` while `to` runs, `Succeeded` at once if `to` had
    /// succeeded. `hold_micro` is what the job's own hold reserved (0 for an immediate
    /// success: nothing is reserved or charged).
    JobAttached {
        job: JobId,
        to: JobId,
        hold_micro: u64,
        state: crate::scheduler::JobState,
    },
}

/// Lower-case words from a variant's name (`IdempotencyEntries` → "idempotency
/// entries"): how these enums read in error messages, without Rust debug text.
fn words(f: &mut std::fmt::Formatter<'_>, name: &str) -> std::fmt::Result {
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            f.write_str(" ")?;
        }
        write!(f, "{}", c.to_ascii_lowercase())?;
    }
    Ok(())
}

macro_rules! display_as_words {
    ($($t:ty),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                words(f, &format!("{self:?}"))
            }
        }
    )*};
}

display_as_words!(Limit, ConfigProblem, NodeProblem, JobProblem, QuotaKind);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{OrgId, ProjectId, Tier, UserId};

    /// Every refusal's message reads as text: no Rust debug forms such as
    /// `Org(OrgId(7))`, `GpuType("x")` or `Tier(2)`, and amounts in credits.
    #[test]
    fn refusals_read_without_debug_text() {
        let gpu = GpuType::new("A100");
        let mut all = vec![
            CommandError::InvalidGpuType(GpuType::new("bad type")),
            CommandError::UnknownPrice(gpu.clone()),
            CommandError::UnknownGpuType(gpu),
            CommandError::TierNotEntitled(Tier(2)),
            CommandError::StaleAttempt {
                given: 1,
                current: 2,
            },
            CommandError::StaleIncarnation {
                given: 1,
                current: 2,
            },
            CommandError::CaptureExceedsHold {
                requested: 3_000_000,
                held: 1_500_000,
            },
            CommandError::InsufficientCredits {
                available: 1,
                needed: 2_000_000,
            },
        ];
        for scope in [
            BudgetScope::Org(OrgId(7)),
            BudgetScope::Project(ProjectId(70)),
            BudgetScope::User(UserId(700)),
        ] {
            all.push(CommandError::BudgetExceeded {
                scope,
                limit: 1_000_000,
                used: 0,
                asked: 2_000_000,
            });
        }
        all.extend(
            [
                NodeProblem::GpuCount,
                NodeProblem::Memory,
                NodeProblem::Label,
            ]
            .map(CommandError::InvalidNode),
        );
        all.extend(
            [
                JobProblem::NoGpuTypes,
                JobProblem::MaxDuration,
                JobProblem::MemoryFloor,
                JobProblem::DedupKey,
                JobProblem::RunnerExit,
            ]
            .map(CommandError::InvalidJob),
        );
        all.extend(
            [
                QuotaKind::QueuedJobs,
                QuotaKind::HoldsOpen,
                QuotaKind::Records,
                QuotaKind::Buckets,
                QuotaKind::Principals,
                QuotaKind::Projects,
                QuotaKind::Users,
            ]
            .map(CommandError::QuotaExceeded),
        );
        all.extend(
            [
                Limit::IdempotencyEntries,
                Limit::BucketsPerAccount,
                Limit::CommandBytes,
            ]
            .map(CommandError::LimitReached),
        );
        all.extend(
            [
                ConfigProblem::TierShare,
                ConfigProblem::FenceMargin,
                ConfigProblem::NodeLease,
            ]
            .map(CommandError::InvalidConfig),
        );
        for e in &all {
            let text = e.to_string();
            for debug in ["Id(", "GpuType(", "Tier(", "{", "::", "Org(", "Project("] {
                assert!(!text.contains(debug), "{e:?} reads {text:?}");
            }
        }
        let budget = CommandError::BudgetExceeded {
            scope: BudgetScope::Org(OrgId(7)),
            limit: 1_000_000,
            used: 0,
            asked: 2_500_000,
        };
        assert_eq!(
            budget.to_string(),
            "hard budget of org:7 exceeded: limit 1.000000 credits, used 0.000000, asked 2.500000"
        );
        assert_eq!(
            CommandError::LimitReached(Limit::IdempotencyEntries).to_string(),
            "limit reached: idempotency entries"
        );
        assert_eq!(
            CommandError::TierNotEntitled(Tier(2)).to_string(),
            "the plan does not entitle this org or project to tier 2"
        );
    }
}
