//! Organisations, projects, users, admission quotas, fair-share weights and the usage
//! ranking.

use crate::connect::Ctx;
use crate::failure::usage;
use crate::output::{cr, show, Table};
use crate::values::{self, Scope};
use allot_client::Error;
use allot_statemachine::query::{UsageLevel, UsageQuery};
use allot_statemachine::{BudgetPeriod, BudgetScope, OrgId, ProjectId, Quota, UserId};
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
    /// Sets an org's admission quotas (or, with --clear, returns it to the shard default).
    Set(QuotaArgs),
}

#[derive(Args, Debug)]
pub struct QuotaArgs {
    #[arg(long)]
    org: u64,
    /// Jobs queued at once; a submission beyond it is refused.
    #[arg(long, required_unless_present = "clear")]
    queued_max: Option<u32>,
    /// Jobs running at once; beyond it the org's jobs wait in the queue.
    #[arg(long, required_unless_present = "clear")]
    running_max: Option<u32>,
    #[arg(long, conflicts_with_all = ["queued_max", "running_max"])]
    clear: bool,
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
        .with_context(|| format!("setting the share weight of {scope:?}"))?;
    let shown = weight.unwrap_or(allot_statemachine::limits::SHARE_WEIGHT_DEFAULT);
    let json = serde_json::json!({"org": org.0, "scope": scope, "weight": shown});
    let t = Table::fields([
        ("scope", format!("{scope:?}")),
        ("weight", shown.to_string()),
    ]);
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
    let QuotaCmd::Set(a) = cmd;
    let org = OrgId(a.org);
    let quota = match (a.clear, a.queued_max, a.running_max) {
        (true, ..) => None,
        (false, Some(queued_max), Some(running_max)) => Some(Quota {
            queued_max,
            running_max,
        }),
        _ => return Err(usage("--queued-max and --running-max (or --clear)")),
    };
    ctx.client
        .set_quota(org, quota)
        .await
        .with_context(|| format!("setting the quota of {org}"))?;
    let json = serde_json::json!({"org": org.0, "quota": quota});
    let t = Table::fields([
        ("org", org.to_string()),
        (
            "queued max",
            quota.map_or("shard default".into(), |q| q.queued_max.to_string()),
        ),
        (
            "running max",
            quota.map_or("shard default".into(), |q| q.running_max.to_string()),
        ),
    ]);
    show(ctx.format, &json, &[t])
}
