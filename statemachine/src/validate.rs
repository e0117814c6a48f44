//! Static validation: everything about a request that can be decided from the request
//! alone — its encoded size, list lengths, string lengths, number ranges, well-formed
//! names, reserved ids — without looking at the state.
//!
//! One function, two callers: the node's edge runs [`validate`] on every request
//! before proposing it, so a malformed command is refused with its typed error and never
//! reaches the log; and apply runs it again on every request (apply is the authority: a
//! leader is not trusted), before the idempotency table, so an invalid request takes no
//! shared capacity. Checks that need the state (unknown ids, tiers of this shard's
//! configuration, expiry against the logical time, quotas) stay in apply.
//!
//! The rules themselves live here (or in the helpers this module calls, which the apply
//! paths that build values internally — a job's hold, its meter — also call).

use crate::codec;
use crate::command::{
    BucketPolicy, Command, Heartbeat, JobHeartbeat, JobSpec, NodeSpec, Request, SettleReason,
};
use crate::ids::GpuType;
use crate::limits::*;
use crate::outcome::{CommandError, JobProblem, Limit, NodeProblem};
use crate::scheduler::SchedulerSettings;

/// Validates one request under rule version `rules` (`crate::version`; the shard's
/// active one): its size, its request id, and its command.
pub fn validate(req: &Request, rules: u32) -> Result<(), CommandError> {
    validate_size(&req.command)?;
    if req.request_id == 0 && req.command.uses_idempotency_table() {
        return Err(CommandError::MissingRequestId);
    }
    validate_command(&req.command, rules)
}

/// The encoded size of a command is at most [`COMMAND_BYTES_MAX`].
pub fn validate_size(command: &Command) -> Result<(), CommandError> {
    if codec::encoded_len(command) > COMMAND_BYTES_MAX as u64 {
        return Err(CommandError::LimitReached(Limit::CommandBytes));
    }
    Ok(())
}

/// The command's own fields, without the state, under rule version `rules`.
pub fn validate_command(command: &Command, rules: u32) -> Result<(), CommandError> {
    // A kind of command newer than the active rules does not exist for the shard yet
    // (`Command::introduced_in`): refused as a whole.
    if command.introduced_in() > rules {
        return Err(CommandError::UnsupportedRulesVersion {
            active: rules,
            newest: crate::version::RULES_MAX,
        });
    }
    match command {
        Command::CreateOrg { org } => check_id(org.0),
        Command::CreateProject { project, .. } => check_id(project.0),
        Command::CreateUser { user, .. } => check_id(user.0),
        Command::SetPrices { prices } => {
            check_gpu_types(
                prices.iter().map(|(t, _)| t),
                PRICE_TABLE_TYPES_MAX,
                Limit::PriceTableTypes,
            )?;
            if prices
                .iter()
                .any(|&(_, p)| p == 0 || p > PRICE_MICRO_PER_GPU_HOUR_MAX)
            {
                return Err(CommandError::InvalidPrice);
            }
            Ok(())
        }
        Command::SetAlert {
            scope,
            alert: Some(alert),
        } => alert.validate(*scope),
        Command::IssueGrant(g) | Command::IssueGrantIn { grant: g, .. } => {
            check_amount(g.amount_micro)?;
            check_id(g.bucket.0)?;
            if g.source_ref
                .as_ref()
                .is_some_and(|s| s.len() > SOURCE_REF_LEN_MAX)
            {
                return Err(CommandError::SourceRefTooLong);
            }
            g.policy.as_ref().map_or(Ok(()), check_policy)
        }
        Command::CreateHold(spec) => {
            check_amount(spec.amount_micro)?;
            check_gpu_types(
                spec.gpu_types.iter(),
                GPU_TYPES_PER_LIST_MAX,
                Limit::GpuTypesPerList,
            )
        }
        Command::Capture { amount_micro, .. } | Command::TopUp { amount_micro, .. } => {
            check_amount(*amount_micro)
        }
        Command::StartMeter { gpu_type, gpus, .. } => {
            check_gpu_type(gpu_type)?;
            if *gpus == 0 || *gpus > GPUS_PER_HOLD_MAX {
                return Err(CommandError::InvalidGpuCount);
            }
            Ok(())
        }
        Command::Heartbeat(Heartbeat { progress_ppm, .. })
        | Command::JobHeartbeat(JobHeartbeat { progress_ppm, .. }) => check_progress(*progress_ppm),
        Command::Transfer {
            from,
            to,
            amount_micro,
        } => {
            check_amount(*amount_micro)?;
            if from == to {
                return Err(CommandError::InvalidTransfer);
            }
            Ok(())
        }
        Command::RegisterNode(spec) => check_node_spec(spec),
        Command::SubmitJob(spec) => check_job_spec(spec, rules),
        Command::SubmitJobDedup { spec, key } => {
            // Result dedup is rule version 3's (`Command::introduced_in`).
            if !key.is_valid() {
                return Err(CommandError::InvalidJob(JobProblem::DedupKey));
            }
            check_job_spec(spec, rules)
        }
        Command::ConfigureScheduler(s) => check_settings(s),
        Command::Bootstrap { principal, digest } => {
            check_principal(principal.0)?;
            check_digest(digest)
        }
        Command::CreateToken {
            principal, digest, ..
        } => {
            check_principal(principal.0)?;
            check_digest(digest)?;
            Ok(())
        }
        Command::RotateToken { digest, .. } => check_digest(digest),
        Command::RecordDenials { denials, .. } => {
            if denials.len() > DENIALS_PER_RECORD_MAX
                || denials.iter().any(|d| d.api.len() > DENIAL_API_LEN_MAX)
            {
                return Err(CommandError::LimitReached(Limit::Denials));
            }
            Ok(())
        }
        Command::FinishJobAt { exit, .. } => {
            if exit.heartbeat_seq == 0 || exit.after_ms > crate::version::job_duration_max(rules) {
                return Err(CommandError::InvalidJob(JobProblem::RunnerExit));
            }
            Ok(())
        }
        Command::SetShareWeight { weight, .. } => {
            if weight.is_some_and(|w| w == 0 || w > SHARE_WEIGHT_MAX) {
                return Err(CommandError::InvalidShareWeight);
            }
            Ok(())
        }
        Command::SetBudget { .. }
        | Command::SetAlert { alert: None, .. }
        | Command::ReleaseHold { .. }
        | Command::Tick
        | Command::NodeHeartbeat { .. }
        | Command::SetNodeDraining { .. }
        | Command::CancelJob { .. }
        | Command::FinishJob { .. }
        | Command::JobFenced { .. }
        | Command::SetQuota { .. }
        | Command::ActivateVersion { .. }
        | Command::RevokeToken { .. } => Ok(()),
        Command::SetPlan { plan, .. } => plan.as_ref().map_or(Ok(()), check_plan),
        // Only the scheduler settles a hold as deduplicated (`scheduler::dedup`); from a
        // caller it would be a reason older replicas cannot read.
        Command::Settle { reason, .. } if *reason == SettleReason::Deduplicated => {
            Err(CommandError::Unauthorized)
        }
        Command::Settle { .. } => Ok(()),
    }
}

/// A plan: at most `TIERS_PER_POLICY_MAX` tiers (no duplicates), and as many projects
/// each with a subset of the org's tiers.
fn check_plan(plan: &crate::command::Plan) -> Result<(), CommandError> {
    let distinct = |tiers: &[crate::ids::Tier]| {
        let mut t = tiers.to_vec();
        t.sort();
        t.dedup();
        t.len() == tiers.len()
    };
    if plan.tiers.len() > TIERS_PER_POLICY_MAX {
        return Err(CommandError::LimitReached(Limit::TiersPerPolicy));
    }
    if plan.project_tiers.len() > PLAN_PROJECTS_MAX {
        return Err(CommandError::LimitReached(Limit::PlanProjects));
    }
    if !distinct(&plan.tiers) {
        return Err(CommandError::DuplicateEntry);
    }
    let mut projects: Vec<_> = plan.project_tiers.iter().map(|(p, _)| *p).collect();
    projects.sort();
    projects.dedup();
    if projects.len() != plan.project_tiers.len() {
        return Err(CommandError::DuplicateEntry);
    }
    for (p, tiers) in &plan.project_tiers {
        check_id(p.0)?;
        if !distinct(tiers) {
            return Err(CommandError::DuplicateEntry);
        }
        if tiers.iter().any(|t| !plan.tiers.contains(t)) {
            return Err(CommandError::UnknownTier);
        }
    }
    Ok(())
}

/// Client-chosen ids stay below the range the state machine allocates itself.
pub(crate) fn check_id(id: u64) -> Result<(), CommandError> {
    if id >= INTERNAL_ID_BASE {
        return Err(CommandError::IdOutOfRange);
    }
    Ok(())
}

fn check_principal(id: u64) -> Result<(), CommandError> {
    if id == 0 {
        return Err(CommandError::IdOutOfRange);
    }
    check_id(id)
}

fn check_digest(digest: &crate::ids::TokenDigest) -> Result<(), CommandError> {
    if digest.0 == [0; 32] {
        return Err(CommandError::InvalidToken);
    }
    Ok(())
}

/// A command amount: non-zero and within the per-command maximum.
pub(crate) fn check_amount(amount: u64) -> Result<(), CommandError> {
    if amount == 0 {
        return Err(CommandError::AmountZero);
    }
    if amount > AMOUNT_MICRO_MAX {
        return Err(CommandError::AmountTooLarge);
    }
    Ok(())
}

fn check_progress(ppm: u32) -> Result<(), CommandError> {
    if ppm > 1_000_000 {
        return Err(CommandError::InvalidProgress);
    }
    Ok(())
}

fn check_gpu_type(t: &GpuType) -> Result<(), CommandError> {
    if !t.is_valid() {
        return Err(CommandError::InvalidGpuType(t.clone()));
    }
    Ok(())
}

/// A list of GPU types: each well-formed, no duplicates, within the bound.
pub(crate) fn check_gpu_types<'a>(
    types: impl ExactSizeIterator<Item = &'a GpuType>,
    max: usize,
    limit: Limit,
) -> Result<(), CommandError> {
    if types.len() > max {
        return Err(CommandError::LimitReached(limit));
    }
    let mut seen: Vec<&GpuType> = Vec::with_capacity(types.len());
    for t in types {
        check_gpu_type(t)?;
        if seen.contains(&t) {
            return Err(CommandError::DuplicateEntry);
        }
        seen.push(t);
    }
    Ok(())
}

fn check_policy(policy: &BucketPolicy) -> Result<(), CommandError> {
    check_gpu_types(
        policy.gpu_types.iter(),
        GPU_TYPES_PER_LIST_MAX,
        Limit::GpuTypesPerList,
    )?;
    if policy.tiers.len() > TIERS_PER_POLICY_MAX {
        return Err(CommandError::LimitReached(Limit::TiersPerPolicy));
    }
    let mut tiers = policy.tiers.clone();
    tiers.sort();
    tiers.dedup();
    if tiers.len() != policy.tiers.len() {
        return Err(CommandError::DuplicateEntry);
    }
    Ok(())
}

fn check_node_spec(spec: &NodeSpec) -> Result<(), CommandError> {
    check_gpu_type(&spec.gpu_type)?;
    if spec.gpu_count == 0 || spec.gpu_count > GPUS_PER_NODE_MAX {
        return Err(CommandError::InvalidNode(NodeProblem::GpuCount));
    }
    if spec.gpu_mem_gb == 0 || spec.gpu_mem_gb > GPU_MEM_GB_MAX {
        return Err(CommandError::InvalidNode(NodeProblem::Memory));
    }
    if spec.labels.len() > LABELS_PER_NODE_MAX {
        return Err(CommandError::LimitReached(Limit::Labels));
    }
    if spec
        .labels
        .iter()
        .any(|(k, v)| k.is_empty() || k.len() > LABEL_LEN_MAX || v.len() > LABEL_LEN_MAX)
    {
        return Err(CommandError::InvalidNode(NodeProblem::Label));
    }
    Ok(())
}

fn check_job_spec(spec: &JobSpec, rules: u32) -> Result<(), CommandError> {
    if spec.gpus == 0 || spec.gpus > GPUS_PER_JOB_MAX {
        return Err(CommandError::InvalidGpuCount);
    }
    if spec.gpu_types.is_empty() {
        return Err(CommandError::InvalidJob(JobProblem::NoGpuTypes));
    }
    check_gpu_types(
        spec.gpu_types.iter(),
        GPU_TYPES_PER_LIST_MAX,
        Limit::GpuTypesPerList,
    )?;
    if spec.max_duration_ms == 0 || spec.max_duration_ms > crate::version::job_duration_max(rules) {
        return Err(CommandError::InvalidJob(JobProblem::MaxDuration));
    }
    if spec.mem_floor_gb > GPU_MEM_GB_MAX {
        return Err(CommandError::InvalidJob(JobProblem::MemoryFloor));
    }
    check_id(spec.job.0)
}

/// Scheduler settings, each field within `settings_bounds`. Whether the tier count
/// matches the shard's configuration needs the state: checked in apply.
fn check_settings(s: &SchedulerSettings) -> Result<(), CommandError> {
    use crate::outcome::ConfigProblem as P;
    use crate::scheduler::settings_bounds::*;
    let check = |ok: bool, p: P| {
        if ok {
            Ok(())
        } else {
            Err(CommandError::InvalidConfig(p))
        }
    };
    let lease = LEASE_MS_MIN..=LEASE_MS_MAX;
    check(lease.contains(&s.node_lease_ms), P::NodeLease)?;
    check(lease.contains(&s.job_lease_ms), P::JobLease)?;
    check(s.fence_margin_ms <= LEASE_MS_MAX, P::FenceMargin)?;
    check(s.grace_ms <= GRACE_MS_MAX, P::Grace)?;
    check(s.min_runtime_ms <= RUNTIME_MS_MAX, P::MinRuntime)?;
    check(s.hysteresis_ms <= RUNTIME_MS_MAX, P::Hysteresis)?;
    check(
        s.preemptions_per_job_max <= PREEMPTIONS_PER_JOB_MAX,
        P::PreemptionCap,
    )?;
    check(
        s.preemption_loss_max_gpu_ms <= PREEMPTION_LOSS_GPU_MS_MAX,
        P::PreemptionLoss,
    )?;
    check(
        (HALF_LIFE_MS_MIN..=HALF_LIFE_MS_MAX).contains(&s.usage_half_life_ms),
        P::HalfLife,
    )?;
    check(
        s.node_failure_requeues_max <= NODE_FAILURE_REQUEUES_MAX,
        P::NodeFailureRequeues,
    )?;
    check(s.tiers.len() <= TIERS_MAX, P::TierCount)?;
    let mut floors = 0u32;
    for t in &s.tiers {
        check(
            !t.name.is_empty() && t.name.len() <= TIER_NAME_LEN_MAX,
            P::TierName,
        )?;
        check((1..=TIER_WEIGHT_MAX).contains(&t.weight), P::TierWeight)?;
        check(
            t.floor_pct <= t.ceiling_pct && t.ceiling_pct <= 100,
            P::TierShare,
        )?;
        check(t.max_wait_ms <= TIER_WAIT_MS_MAX, P::TierWait)?;
        check(
            (1..=TIER_PRICE_PCT_MAX).contains(&t.price_pct),
            P::TierPrice,
        )?;
        floors += t.floor_pct;
    }
    check(floors <= 100, P::TierShare)
}
