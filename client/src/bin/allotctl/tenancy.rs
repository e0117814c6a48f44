//! Organisations, projects, users, quotas, plans (tier entitlements), fair-share
//! weights and the usage ranking.

use crate::connect::Ctx;
use crate::output::{cr, show, Table};
use crate::values::{self, Scope};
use allot_client::Error;
use allot_statemachine::query::{UsageLevel, UsageQuery};
use allot_statemachine::{BudgetPeriod, BudgetScope, OrgId, Plan, ProjectId, Quota, Tier, UserId};
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum OrgCmd {
    /// Creates an organisation (on its home shard: org id mod shard count).
    Create {
        #[arg(long)]
        org: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum ProjectCmd {
    /// Creates a project in an organisation.
    Create {
        #[arg(long)]
        org: u64,
        #[arg(long)]
        project: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum UserCmd {
    /// Creates a user in an organisation.
    Create {
        #[arg(long)]
        org: u64,
        #[arg(long)]
        user: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum QuotaCmd {
    /// Sets an org's quotas: the flags given change, the others keep the org's current
    /// values (or, with --clear, the org returns to the shard default).
    Set(QuotaArgs),
    /// An org's quotas, plan and what it uses of each (admin, or the org's own token).
    Show {
        #[arg(long)]
        org: u64,
    },
}

#[derive(Args, Debug)]
pub struct QuotaArgs {
    #[arg(long)]
    org: u64,
    /// Jobs queued at once; a submission beyond it is refused.
    #[arg(long)]
    queued_max: Option<u32>,
    /// Jobs running at once; beyond it the org's jobs wait in the queue.
    #[arg(long)]
    running_max: Option<u32>,
    /// Holds open at once (jobs' holds included).
    #[arg(long)]
    holds_open_max: Option<u32>,
    /// Idempotency records of the org's tokens (each kept 24 h of logical time).
    #[arg(long)]
    records_max: Option<u32>,
    /// Buckets in use across the org's and its projects' accounts.
    #[arg(long)]
    buckets_max: Option<u32>,
    /// Principals (token identities) of the org.
    #[arg(long)]
    principals_max: Option<u32>,
    #[arg(long)]
    projects_max: Option<u32>,
    #[arg(long)]
    users_max: Option<u32>,
    /// Finished jobs kept for status queries (beyond it the org's oldest go first).
    #[arg(long)]
    finished_jobs_max: Option<u32>,
    /// Settled holds kept for status queries (beyond it the org's oldest go first).
    #[arg(long)]
    settled_holds_max: Option<u32>,
    /// Server streams (event and assignment watches) the org's principals hold open at
    /// once on one node, together.
    #[arg(long)]
    streams_max: Option<u32>,
    #[arg(long, conflicts_with_all = [
        "queued_max", "running_max", "holds_open_max", "records_max", "buckets_max",
        "principals_max", "projects_max", "users_max", "finished_jobs_max",
        "settled_holds_max", "streams_max",
    ])]
    clear: bool,
}

impl QuotaArgs {
    /// `base` with the fields given on the command line.
    fn apply(&self, base: Quota) -> Quota {
        Quota {
            queued_max: self.queued_max.unwrap_or(base.queued_max),
            running_max: self.running_max.unwrap_or(base.running_max),
            holds_open_max: self.holds_open_max.unwrap_or(base.holds_open_max),
            records_max: self.records_max.unwrap_or(base.records_max),
            buckets_max: self.buckets_max.unwrap_or(base.buckets_max),
            principals_max: self.principals_max.unwrap_or(base.principals_max),
            projects_max: self.projects_max.unwrap_or(base.projects_max),
            users_max: self.users_max.unwrap_or(base.users_max),
            finished_jobs_max: self.finished_jobs_max.unwrap_or(base.finished_jobs_max),
            settled_holds_max: self.settled_holds_max.unwrap_or(base.settled_holds_max),
            streams_max: self.streams_max.unwrap_or(base.streams_max),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum PlanCmd {
    /// Sets an org's plan: the tiers its jobs and holds may use (admin). Without a plan
    /// an org may use every tier but the highest.
    Set(PlanArgs),
    /// An org's plan and the tiers it may use.
    Show {
        #[arg(long)]
        org: u64,
    },
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[arg(long)]
    org: u64,
    /// Tiers (names or numbers), comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = values::tier, required_unless_present = "clear")]
    tiers: Vec<values::TierArg>,
    /// A project with fewer tiers than the org: PROJECT=TIER[,TIER...] (repeatable).
    #[arg(long = "project", value_parser = project_tiers)]
    projects: Vec<(u64, Vec<values::TierArg>)>,
    /// Back to the default entitlement.
    #[arg(long, conflicts_with_all = ["tiers", "projects"])]
    clear: bool,
}

fn project_tiers(s: &str) -> Result<(u64, Vec<values::TierArg>), String> {
    let (p, tiers) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected PROJECT=TIER[,TIER...]"))?;
    let p = p
        .parse()
        .map_err(|_| format!("{p:?}: expected a project id"))?;
    let tiers = tiers
        .split(',')
        .map(values::tier)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((p, tiers))
}

#[derive(Subcommand, Debug)]
pub enum ShareCmd {
    /// Sets the fair-share weight of an org (admin), or of one of its projects or users
    /// (the org's own token may): twice the weight, twice the GPUs under contention.
    Set(ShareArgs),
}

#[derive(Args, Debug)]
pub struct ShareArgs {
    #[arg(long)]
    org: u64,
    /// org, project:<id> or user:<id>.
    #[arg(long, default_value = "org", value_parser = values::scope)]
    scope: Scope,
    /// 1..=10000; the default is 100.
    #[arg(long, required_unless_present = "clear")]
    weight: Option<u32>,
    /// Back to the default weight.
    #[arg(long, conflicts_with = "weight")]
    clear: bool,
}

#[derive(Args, Debug)]
pub struct UsageArgs {
    /// What to rank: org, project or user.
    #[arg(long, default_value = "org", value_parser = level)]
    level: UsageLevel,
    /// Only this org's projects or users (its home shard); default: every shard.
    #[arg(long)]
    org: Option<u64>,
    /// Credits used (held + spent) in this period: day, month or lifetime.
    #[arg(long, default_value = "month", value_parser = values::period)]
    period: BudgetPeriod,
    /// Rows, 1..=1000.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    limit: u32,
}

fn level(s: &str) -> Result<UsageLevel, String> {
    match s {
        "org" => Ok(UsageLevel::Org),
        "project" => Ok(UsageLevel::Project),
        "user" => Ok(UsageLevel::User),
        _ => Err(format!("level {s:?}: expected org, project or user")),
    }
}

pub async fn run_share(ctx: &Ctx, cmd: ShareCmd) -> anyhow::Result<()> {
    let ShareCmd::Set(a) = cmd;
    let org = OrgId(a.org);
    let scope = a.scope.budget_scope(org);
    let weight = if a.clear { None } else { a.weight };
    ctx.client
        .set_share_weight(org, scope, weight)
        .await
        .with_context(|| format!("setting the share weight of {scope}"))?;
    let shown = weight.unwrap_or(allot_statemachine::limits::SHARE_WEIGHT_DEFAULT);
    let json = serde_json::json!({"org": org.0, "scope": scope, "weight": shown});
    let t = Table::fields([("scope", scope.to_string()), ("weight", shown.to_string())]);
    show(ctx.format, &json, &[t])
}

pub async fn usage_top(ctx: &Ctx, a: UsageArgs) -> anyhow::Result<()> {
    let q = UsageQuery {
        level: a.level,
        org: a.org.map(OrgId),
        period: a.period,
        limit: a.limit,
    };
    let rows = ctx.client.usage(q).await.context("usage ranking")?;
    let mut t = Table::new(&[
        "RANK",
        "SHARD",
        "WHO",
        "USED",
        "HELD",
        "GPU-H (DECAYED)",
        "RUNNING GPUS",
        "WEIGHT",
    ]);
    let mut json = Vec::new();
    for (i, (shard, r)) in rows.iter().enumerate() {
        let who = match r.scope {
            BudgetScope::Org(o) => o.to_string(),
            BudgetScope::Project(p) => format!("{p} ({})", r.org),
            BudgetScope::User(u) => format!("{u} ({})", r.org),
        };
        t.row(vec![
            (i + 1).to_string(),
            shard.to_string(),
            who,
            cr(r.used_micro),
            cr(r.held_micro),
            format!("{:.2}", r.gpu_ms_decayed as f64 / 3_600_000.0),
            r.running_gpus.to_string(),
            r.share_weight.to_string(),
        ]);
        let mut v = serde_json::to_value(r)?;
        v["shard"] = (*shard).into();
        json.push(v);
    }
    show(ctx.format, &json, &[t])
}

pub async fn run_org(ctx: &Ctx, cmd: OrgCmd) -> anyhow::Result<()> {
    let OrgCmd::Create { org } = cmd;
    let org = OrgId(org);
    let r = ctx.client.create_org(org).await;
    created(ctx, org, r, &[("org", org.0)], &format!("creating {org}")).await
}

pub async fn run_project(ctx: &Ctx, cmd: ProjectCmd) -> anyhow::Result<()> {
    let ProjectCmd::Create { org, project } = cmd;
    let (org, project) = (OrgId(org), ProjectId(project));
    let r = ctx.client.create_project(org, project).await;
    let what = format!("creating {project} in {org}");
    created(
        ctx,
        org,
        r,
        &[("org", org.0), ("project", project.0)],
        &what,
    )
    .await
}

pub async fn run_user(ctx: &Ctx, cmd: UserCmd) -> anyhow::Result<()> {
    let UserCmd::Create { org, user } = cmd;
    let (org, user) = (OrgId(org), UserId(user));
    let r = ctx.client.create_user(org, user).await;
    let what = format!("creating {user} in {org}");
    created(ctx, org, r, &[("org", org.0), ("user", user.0)], &what).await
}

/// Reports a create: the ids, the org's home shard.
async fn created(
    ctx: &Ctx,
    org: OrgId,
    r: Result<(), Error>,
    ids: &[(&str, u64)],
    what: &str,
) -> anyhow::Result<()> {
    r.with_context(|| what.to_string())?;
    let shard = ctx.home_shard(org).await?;
    let mut json = serde_json::Map::new();
    let mut fields = Vec::new();
    for (k, v) in ids {
        json.insert(k.to_string(), (*v).into());
        fields.push((k.to_string(), v.to_string()));
    }
    json.insert("shard".into(), shard.into());
    json.insert("created".into(), true.into());
    fields.push(("shard".into(), shard.to_string()));
    show(ctx.format, &json, &[Table::fields(fields)])
}

pub async fn run_quota(ctx: &Ctx, cmd: QuotaCmd) -> anyhow::Result<()> {
    let a = match cmd {
        QuotaCmd::Set(a) => a,
        QuotaCmd::Show { org } => return show_tenancy(ctx, OrgId(org), None).await,
    };
    let org = OrgId(a.org);
    let quota = if a.clear {
        None
    } else {
        let current = ctx
            .client
            .tenancy(org)
            .await
            .with_context(|| format!("reading the quota of {org}"))?;
        Some(a.apply(current.quota))
    };
    ctx.client
        .set_quota(org, quota)
        .await
        .with_context(|| format!("setting the quota of {org}"))?;
    // "quota" is what was set (null: back to the shard default), as before.
    show_tenancy(ctx, org, Some(quota)).await
}

pub async fn run_plan(ctx: &Ctx, cmd: PlanCmd) -> anyhow::Result<()> {
    let a = match cmd {
        PlanCmd::Set(a) => a,
        PlanCmd::Show { org } => return show_tenancy(ctx, OrgId(org), None).await,
    };
    let org = OrgId(a.org);
    let plan = if a.clear {
        None
    } else {
        let shard = ctx.home_shard(org).await?;
        let mut project_tiers = Vec::new();
        for (p, tiers) in &a.projects {
            project_tiers.push((ProjectId(*p), ctx.resolve_tiers(shard, tiers).await?));
        }
        Some(Plan {
            tiers: ctx.resolve_tiers(shard, &a.tiers).await?,
            project_tiers,
        })
    };
    ctx.client
        .set_plan(org, plan)
        .await
        .with_context(|| format!("setting the plan of {org}"))?;
    show_tenancy(ctx, org, None).await
}

/// An org's quotas with their use, its plan and the tiers it may use. JSON: "quota" is
/// `set` when given (what a `quota set` set), else the org's quota in force;
/// "effective" is always the latter.
async fn show_tenancy(ctx: &Ctx, org: OrgId, set: Option<Option<Quota>>) -> anyhow::Result<()> {
    let v = ctx
        .client
        .tenancy(org)
        .await
        .with_context(|| format!("reading the quotas of {org}"))?;
    let tiers = ctx.tiers(ctx.home_shard(org).await?).await?;
    let names = |ts: &[Tier]| {
        ts.iter()
            .map(|t| crate::connect::tier_name(&tiers, *t))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (q, u) = (v.quota, v.used);
    let json = serde_json::json!({
        "org": org.0,
        "quota": set.map_or(serde_json::json!(q), |s| serde_json::json!(s)),
        "effective": q,
        "quota_set": v.quota_set,
        "used": u,
        "plan": v.plan,
        "tiers": v.tiers,
    });
    let source = if v.quota_set {
        "set for the org"
    } else {
        "shard default"
    };
    let mut rows = Table::new(&["quota", "used", "max"]);
    for (name, used, max) in [
        ("queued jobs", u.queued, q.queued_max),
        ("running jobs", u.running, q.running_max),
        ("open holds", u.holds_open, q.holds_open_max),
        ("request records", u.records, q.records_max),
        ("buckets", u.buckets, q.buckets_max),
        ("principals", u.principals, q.principals_max),
        ("projects", u.projects, q.projects_max),
        ("users", u.users, q.users_max),
        ("finished jobs kept", u.finished_jobs, q.finished_jobs_max),
        ("settled holds kept", u.settled_holds, q.settled_holds_max),
    ] {
        rows.row(vec![name.to_string(), used.to_string(), max.to_string()]);
    }
    let mut fields = vec![
        ("org".to_string(), org.to_string()),
        ("quotas".to_string(), source.to_string()),
        ("tiers".to_string(), names(&v.tiers)),
    ];
    if let Some(plan) = &v.plan {
        for (p, ts) in &plan.project_tiers {
            fields.push((format!("tiers of {p}"), names(ts)));
        }
    } else {
        fields.push((
            "plan".to_string(),
            "default (every tier but the highest)".into(),
        ));
    }
    show(ctx.format, &json, &[Table::fields(fields), rows])
}
