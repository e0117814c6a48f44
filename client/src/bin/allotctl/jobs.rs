//! GPU jobs: `job submit|status|list|cancel`.

use crate::connect::{tier_name, Ctx};
use crate::failure::usage;
use crate::output::{cr, list, show, Table};
use crate::timefmt::{format_duration_ms, format_ms};
use crate::values::{self, TierArg};
use allot_statemachine::query::JobFilter;
use allot_statemachine::scheduler::{Job, JobState, TierConfig};
use allot_statemachine::{
    DedupKey, GpuType, JobId, JobSpec, OrgId, ProjectId, Reply, Settlement, UserId,
};
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum JobCmd {
    /// Submits a job: reserves its hold (max duration × GPUs × the highest price of its
    /// GPU types) and queues it, all or nothing. Idempotent by job id.
    Submit(SubmitArgs),
    /// A job's state, placement, attempt, hold and history figures.
    Status {
        #[arg(long)]
        org: u64,
        #[arg(long)]
        job: u64,
    },
    /// An org's jobs by id (follows pages up to --limit).
    List(ListArgs),
    /// Cancels a job; its hold is settled (charged to now if it ran) and the rest refunded.
    Cancel {
        #[arg(long)]
        org: u64,
        #[arg(long)]
        job: u64,
    },
}

#[derive(Args, Debug)]
pub struct SubmitArgs {
    #[arg(long)]
    org: u64,
    /// The job id (default: a fresh id, printed).
    #[arg(long)]
    job: Option<u64>,
    #[arg(long)]
    project: u64,
    #[arg(long)]
    user: u64,
    /// free, paid, enterprise (the shard's tier names) or a tier number.
    #[arg(long, value_parser = values::tier)]
    tier: TierArg,
    /// Acceptable GPU types, most preferred first (comma-separated).
    #[arg(long, required = true, value_delimiter = ',', value_parser = values::gpu_type)]
    gpu_types: Vec<GpuType>,
    /// GPUs, 1..=8, all on one node.
    #[arg(long)]
    gpus: u32,
    /// Memory floor per GPU, GB.
    #[arg(long, default_value_t = 0)]
    mem_gb: u32,
    #[arg(long)]
    preemptible: bool,
    #[arg(long)]
    checkpointable: bool,
    #[arg(long, value_parser = values::duration_ms)]
    max_duration: u64,
    /// Result dedup (rule version 3): 1 to 64 bytes, e.g. a hash of the prompt and its
    /// parameters; a job of the org with the same key in flight or recently succeeded
    /// gives this job its result instead of running it again (nothing charged).
    #[arg(long)]
    dedup_key: Option<String>,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    #[arg(long)]
    org: u64,
    #[arg(long)]
    project: Option<u64>,
    #[arg(long)]
    user: Option<u64>,
    /// queued, placed, running, preempting, succeeded, failed, lost, cancelled, rejected.
    #[arg(long, value_parser = values::job_state)]
    state: Option<JobState>,
    /// Most jobs to list.
    #[arg(long, default_value_t = 1_000)]
    limit: u32,
}

pub async fn run(ctx: &Ctx, cmd: JobCmd) -> anyhow::Result<()> {
    match cmd {
        JobCmd::Submit(a) => submit(ctx, a).await,
        JobCmd::Status { org, job } => status(ctx, OrgId(org), JobId(job)).await,
        JobCmd::List(a) => list_jobs(ctx, a).await,
        JobCmd::Cancel { org, job } => cancel(ctx, OrgId(org), JobId(job)).await,
    }
}

async fn submit(ctx: &Ctx, a: SubmitArgs) -> anyhow::Result<()> {
    let org = OrgId(a.org);
    let shard = ctx.home_shard(org).await?;
    let tier = ctx
        .resolve_tiers(shard, std::slice::from_ref(&a.tier))
        .await?[0];
    let job = JobId(a.job.unwrap_or_else(|| ctx.new_id()));
    let spec = JobSpec {
        job,
        project: ProjectId(a.project),
        user: UserId(a.user),
        tier,
        gpu_types: a.gpu_types.clone(),
        gpus: a.gpus,
        mem_floor_gb: a.mem_gb,
        preemptible: a.preemptible,
        checkpointable: a.checkpointable,
        max_duration_ms: a.max_duration,
    };
    let reply = match a.dedup_key {
        None => ctx.client.submit_job(org, spec).await,
        Some(key) => {
            let key = DedupKey(key.into_bytes());
            ctx.client.submit_job_dedup(org, spec, key).await
        }
    }
    .with_context(|| format!("submitting {job}"))?;
    let (job, hold_micro, state, attached_to) = match reply {
        Reply::JobSubmitted {
            job,
            hold_micro,
            state,
        } => (job, hold_micro, state, None),
        Reply::JobAttached {
            job,
            to,
            hold_micro,
            state,
        } => (job, hold_micro, state, Some(to)),
        reply => anyhow::bail!("unexpected reply to a submission: {reply:?}"),
    };
    let mut json = serde_json::json!({
        "job": job.0, "org": org.0, "shard": shard, "state": state, "hold_micro": hold_micro,
    });
    let mut fields = vec![
        ("job", job.0.to_string()),
        ("shard", shard.to_string()),
        ("state", format!("{state:?}")),
        ("hold", cr(hold_micro)),
    ];
    if let Some(to) = attached_to {
        json["attached_to"] = serde_json::json!(to.0);
        fields.push(("attached to", to.to_string()));
    }
    show(ctx.format, &json, &[Table::fields(fields)])
}

async fn status(ctx: &Ctx, org: OrgId, job: JobId) -> anyhow::Result<()> {
    let shard = ctx.home_shard(org).await?;
    let j = ctx.client.job(org, job).await.map_err(|e| match e {
        allot_client::Error::NotFound(_) => anyhow::anyhow!("unknown {job} in {org}"),
        e => anyhow::Error::new(e).context(format!("status of {job}")),
    })?;
    let tiers = ctx.tiers(shard).await.unwrap_or_default();
    let mut json = serde_json::to_value(&j)?;
    if let Some(m) = json.as_object_mut() {
        m.insert("shard".into(), shard.into());
    }
    show(ctx.format, &json, &[job_fields(&j, &tiers)])
}

fn job_fields(j: &Job, tiers: &[TierConfig]) -> Table {
    let s = &j.spec;
    let placement = j.placement.as_ref().map_or("-".into(), |p| {
        format!(
            "{} GPUs {} ({}) at {}/GPU-h since {}",
            p.node,
            list(&p.gpu_indices),
            p.gpu_type,
            cr(p.price_micro_per_gpu_hour),
            format_ms(p.started_ms)
        )
    });
    Table::fields([
        ("job", s.job.0.to_string()),
        (
            "org / project / user",
            format!("{} / {} / {}", j.org, s.project, s.user),
        ),
        ("tier", tier_name(tiers, s.tier)),
        ("state", format!("{:?}", j.state)),
        ("last reason", format!("{:?}", j.last_reason)),
        ("attempt", j.attempt.to_string()),
        ("placement", placement),
        ("GPU types", list(&s.gpu_types)),
        (
            "GPUs x memory",
            format!("{} x {} GB", s.gpus, s.mem_floor_gb),
        ),
        (
            "preemptible / checkpointable",
            format!("{} / {}", s.preemptible, s.checkpointable),
        ),
        ("max duration", format_duration_ms(s.max_duration_ms)),
        ("run time (closed attempts)", format_duration_ms(j.run_ms)),
        ("preemptions", j.preemptions.to_string()),
        ("hold", cr(j.hold_micro)),
        ("submitted", format_ms(j.submitted_ms)),
        ("finished", j.finished_ms.map_or("-".into(), format_ms)),
    ])
}

async fn list_jobs(ctx: &Ctx, a: ListArgs) -> anyhow::Result<()> {
    if a.limit == 0 {
        return Err(usage("--limit must be positive"));
    }
    let org = OrgId(a.org);
    let mut jobs: Vec<Job> = Vec::new();
    let mut after = None;
    while (jobs.len() as u32) < a.limit {
        let filter = JobFilter {
            org: Some(org),
            project: a.project.map(ProjectId),
            user: a.user.map(UserId),
            state: a.state,
            after,
            limit: (a.limit - jobs.len() as u32).min(allot_statemachine::query::JOBS_PAGE_MAX),
            after_org: None,
        };
        let page = ctx
            .client
            .jobs(org, filter)
            .await
            .with_context(|| format!("jobs of {org}"))?;
        jobs.extend(page.jobs);
        match page.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let shard = ctx.home_shard(org).await?;
    let tiers = ctx.tiers(shard).await.unwrap_or_default();
    let mut t = Table::new(&[
        "JOB",
        "PROJECT",
        "USER",
        "TIER",
        "STATE",
        "ATTEMPT",
        "NODE",
        "GPUS",
        "HOLD",
        "SUBMITTED",
    ]);
    for j in &jobs {
        t.row(vec![
            j.spec.job.0.to_string(),
            j.spec.project.0.to_string(),
            j.spec.user.0.to_string(),
            tier_name(&tiers, j.spec.tier),
            format!("{:?}", j.state),
            j.attempt.to_string(),
            j.placement
                .as_ref()
                .map_or("-".into(), |p| p.node.0.to_string()),
            j.spec.gpus.to_string(),
            cr(j.hold_micro),
            format_ms(j.submitted_ms),
        ]);
    }
    show(ctx.format, &jobs, &[t])
}

async fn cancel(ctx: &Ctx, org: OrgId, job: JobId) -> anyhow::Result<()> {
    let reply = ctx
        .client
        .cancel_job(org, job)
        .await
        .with_context(|| format!("cancelling {job}"))?;
    let Reply::JobCancelled(settlement) = reply else {
        anyhow::bail!("unexpected reply to a cancel: {reply:?}");
    };
    let json =
        serde_json::json!({"job": job.0, "state": JobState::Cancelled, "settlement": settlement});
    show(ctx.format, &json, &[settlement_fields(job, settlement)])
}

fn settlement_fields(job: JobId, s: Option<Settlement>) -> Table {
    let Some(s) = s else {
        return Table::fields([("job", job.0.to_string()), ("settlement", "none".into())]);
    };
    Table::fields([
        ("job", job.0.to_string()),
        ("state", "Cancelled".into()),
        ("captured", cr(s.captured_micro)),
        ("refunded", cr(s.refunded_micro)),
        ("forfeited (expired)", cr(s.forfeited_micro)),
        ("uncollected", cr(s.uncollected_micro)),
    ])
}
