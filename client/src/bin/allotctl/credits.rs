//! Credits: grants, balances, budgets, prices and shard totals.

use crate::connect::Ctx;
use crate::failure::usage;
use crate::output::{cr, show, Table};
use crate::timefmt::{format_ms, now_ms, relative};
use crate::values::{self, Owner, Scope, TierArg};
use allot_statemachine::{
    Account, BucketId, BucketKind, BucketPolicy, BudgetMode, BudgetPeriod, BudgetSpec, GpuType,
    Grant, OrgId, ProjectId,
};
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum GrantCmd {
    /// Issues credits into a new bucket of an org or project.
    Issue(GrantArgs),
}

#[derive(Args, Debug)]
pub struct GrantArgs {
    #[arg(long)]
    org: u64,
    /// Who owns the bucket: org, or project:<id>.
    #[arg(long, default_value = "org", value_parser = values::owner)]
    owner: Owner,
    /// paid, promotional or granted.
    #[arg(long, value_parser = values::bucket_kind)]
    kind: BucketKind,
    /// Credits, up to 6 decimals.
    #[arg(long, value_parser = values::credits)]
    amount: u64,
    /// When the unspent remainder expires: unix ms or 2025-01-31T12:00:00Z.
    #[arg(long, value_parser = values::instant_ms, conflicts_with = "expires_in")]
    expires_at: Option<u64>,
    /// Expiry relative to now on the cluster's logical time (30m, 7d).
    #[arg(long, value_parser = values::duration_ms)]
    expires_in: Option<u64>,
    /// Spend order's first key: lower is spent first.
    #[arg(long, default_value_t = 100)]
    priority: u8,
    /// The bucket id (default: a fresh id, printed). Issuing again with the same id is
    /// answered as the first time.
    #[arg(long)]
    bucket: Option<u64>,
    /// External reference, e.g. the purchase id.
    #[arg(long)]
    source_ref: Option<String>,
    /// The bucket pays only for work whose GPU types are all listed (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = values::gpu_type)]
    gpu_types: Vec<GpuType>,
    /// The bucket pays only for these tiers (names or numbers, comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = values::tier)]
    tiers: Vec<TierArg>,
}

#[derive(Args, Debug)]
pub struct BalanceArgs {
    #[arg(long)]
    org: u64,
    /// A project's own buckets instead of the org's.
    #[arg(long)]
    project: Option<u64>,
    /// List buckets expiring within this horizon.
    #[arg(long, default_value = "7d", value_parser = values::duration_ms)]
    horizon: u64,
    /// Also list every bucket: kind, remaining, held, expiry, source, spend order.
    #[arg(long)]
    buckets: bool,
}

#[derive(Subcommand, Debug)]
pub enum BudgetCmd {
    /// Sets (or with --clear removes) the budget of an org, project or user.
    Set(BudgetSetArgs),
    /// A budget and its spend counters.
    Show(BudgetShowArgs),
    /// Sets (or with --clear removes) an alert: a `low_balance` audit event when the
    /// available credit falls below --low-balance, a `budget_threshold` one when the
    /// budget's use reaches each of --budget-pcts; once per crossing (watch them with
    /// `audit --follow` or the API's WatchEvents).
    Alert(AlertArgs),
}

#[derive(Args, Debug)]
pub struct AlertArgs {
    #[arg(long)]
    org: u64,
    /// org, project:<id> or user:<id> (a user has a budget but no balance).
    #[arg(long, default_value = "org", value_parser = values::scope)]
    scope: Scope,
    /// Credits: alert when the available credit falls below this.
    #[arg(long, value_parser = values::credits)]
    low_balance: Option<u64>,
    /// Percentages of the budget's limit, ascending (comma-separated), e.g. 50,80,100.
    #[arg(long, value_delimiter = ',')]
    budget_pcts: Vec<u32>,
    #[arg(long, conflicts_with_all = ["low_balance", "budget_pcts"])]
    clear: bool,
}

#[derive(Args, Debug)]
pub struct BudgetSetArgs {
    #[arg(long)]
    org: u64,
    /// org, project:<id> or user:<id>.
    #[arg(long, default_value = "org", value_parser = values::scope)]
    scope: Scope,
    /// Credits per period.
    #[arg(long, value_parser = values::credits, required_unless_present = "clear")]
    limit: Option<u64>,
    /// day, month or lifetime.
    #[arg(long, value_parser = values::period, default_value = "month")]
    period: BudgetPeriod,
    /// hard (refuse spends beyond the limit) or soft (alert once per period).
    #[arg(long, value_parser = values::mode, default_value = "hard")]
    mode: BudgetMode,
    #[arg(long, conflicts_with = "limit")]
    clear: bool,
}

#[derive(Args, Debug)]
pub struct BudgetShowArgs {
    #[arg(long)]
    org: u64,
    #[arg(long, default_value = "org", value_parser = values::scope)]
    scope: Scope,
}

#[derive(Subcommand, Debug)]
pub enum PriceCmd {
    /// Replaces the price table on every shard: A100=2.5 H100=4 (credits per GPU-hour).
    Set {
        #[arg(required = true, value_parser = values::price)]
        prices: Vec<(GpuType, u64)>,
    },
    /// The price table of each shard.
    List {
        #[arg(long)]
        shard: Option<u32>,
    },
}

#[derive(Args, Debug)]
pub struct TotalsArgs {
    #[arg(long)]
    shard: Option<u32>,
}

// ---------------------------------------------------------------- grants

pub async fn run_grant(ctx: &Ctx, cmd: GrantCmd) -> anyhow::Result<()> {
    let GrantCmd::Issue(a) = cmd;
    let org = OrgId(a.org);
    let policy = grant_policy(ctx, org, &a).await?;
    if a.source_ref.as_ref().is_some_and(|s| s.len() > 128) {
        return Err(usage("--source-ref: at most 128 bytes"));
    }
    let grant = Grant {
        bucket: BucketId(a.bucket.unwrap_or_else(|| ctx.new_id())),
        owner: a.owner.account(org),
        kind: a.kind,
        amount_micro: a.amount,
        expires_at_ms: a.expires_at,
        priority: a.priority,
        policy,
        source_ref: a.source_ref.clone(),
    };
    let issued = match a.expires_in {
        // Evaluated on the cluster's logical time when applied (the clock expiry runs
        // on), not on this machine's clock; a retry resends the same relative expiry.
        Some(d) => ctx.client.issue_grant_in(org, grant.clone(), d).await,
        None => ctx.client.issue_grant(org, grant.clone()).await,
    };
    let bucket = issued.with_context(|| format!("issuing a grant to {}", grant.owner))?;
    // Show the bucket as the cluster holds it (its expiry is the cluster's instant).
    let bucket_view = ctx
        .client
        .buckets(org, grant.owner)
        .await
        .ok()
        .and_then(|bs| bs.into_iter().find(|b| b.bucket == bucket));
    let grant = Grant {
        expires_at_ms: bucket_view.map_or(grant.expires_at_ms, |b| b.expires_at_ms),
        ..grant
    };
    print_grant(ctx, org, bucket, &grant)
}

async fn grant_policy(
    ctx: &Ctx,
    org: OrgId,
    a: &GrantArgs,
) -> anyhow::Result<Option<BucketPolicy>> {
    if a.gpu_types.is_empty() && a.tiers.is_empty() {
        return Ok(None);
    }
    let shard = ctx.home_shard(org).await?;
    let tiers = ctx.resolve_tiers(shard, &a.tiers).await?;
    Ok(Some(BucketPolicy {
        gpu_types: a.gpu_types.clone(),
        tiers,
    }))
}

fn print_grant(ctx: &Ctx, org: OrgId, bucket: BucketId, g: &Grant) -> anyhow::Result<()> {
    let json = serde_json::json!({
        "bucket": bucket.0,
        "org": org.0,
        "owner": g.owner.to_string(),
        "kind": g.kind,
        "amount_micro": g.amount_micro,
        "expires_at_ms": g.expires_at_ms,
        "priority": g.priority,
        "policy": g.policy,
        "source_ref": g.source_ref,
    });
    let t = Table::fields([
        ("bucket", bucket.0.to_string()),
        ("owner", g.owner.to_string()),
        ("kind", format!("{:?}", g.kind)),
        ("amount", cr(g.amount_micro)),
        ("expires", g.expires_at_ms.map_or("never".into(), format_ms)),
        ("priority", g.priority.to_string()),
    ]);
    show(ctx.format, &json, &[t])
}

// ---------------------------------------------------------------- balance

pub async fn balance(ctx: &Ctx, a: BalanceArgs) -> anyhow::Result<()> {
    let org = OrgId(a.org);
    let account = match a.project {
        Some(p) => Account::Project(ProjectId(p)),
        None => Account::Org(org),
    };
    let b = ctx
        .client
        .balance(org, account, a.horizon)
        .await
        .map_err(|e| match e {
            allot_client::Error::NotFound(_) => anyhow::anyhow!(
                "unknown account {account} (no such org, or the project is not in {org})"
            ),
            e => anyhow::Error::new(e).context(format!("balance of {account}")),
        })?;
    let mut json = serde_json::to_value(&b)?;
    if let Some(m) = json.as_object_mut() {
        m.insert("account".into(), account.to_string().into());
        m.insert("available_micro".into(), b.available_micro().into());
    }
    let t = Table::fields([
        ("account", account.to_string()),
        ("available", cr(b.available_micro())),
        ("  paid", cr(b.paid_available_micro)),
        ("  promotional", cr(b.promotional_available_micro)),
        ("  granted", cr(b.granted_available_micro)),
        ("held", cr(b.held_micro)),
        ("consumed", cr(b.consumed_micro)),
        ("expired", cr(b.expired_micro)),
        ("issued", cr(b.issued_micro)),
        ("moved in", cr(b.moved_in_micro)),
        ("moved out", cr(b.moved_out_micro)),
    ]);
    let now = now_ms();
    let mut exp = Table::new(&["EXPIRING BUCKET", "KIND", "REMAINING", "EXPIRES AT", "IN"]);
    for u in &b.upcoming_expirations {
        exp.row(vec![
            u.bucket.0.to_string(),
            format!("{:?}", u.kind),
            cr(u.remaining_micro),
            format_ms(u.expires_at_ms),
            relative(u.expires_at_ms, now),
        ]);
    }
    if !a.buckets {
        return show(ctx.format, &json, &[t, exp]);
    }
    let (buckets, cluster_now) = ctx
        .client
        .buckets_at(org, account)
        .await
        .with_context(|| format!("buckets of {account}"))?;
    if let Some(m) = json.as_object_mut() {
        m.insert("buckets".into(), serde_json::to_value(&buckets)?);
    }
    let mut bt = Table::new(&[
        "BUCKET",
        "KIND",
        "PRIORITY",
        "REMAINING",
        "HELD",
        "CONSUMED",
        "EXPIRES",
        "SOURCE",
        "STATE",
    ]);
    for b in &buckets {
        let state = if b.closed_at_ms.is_some() {
            "closed"
        } else if !b.spendable {
            "expired"
        } else {
            "live"
        };
        bt.row(vec![
            b.bucket.0.to_string(),
            format!("{:?}", b.kind),
            b.priority.to_string(),
            cr(b.remaining_micro),
            cr(b.held_micro),
            cr(b.consumed_micro),
            b.expires_at_ms.map_or("never".into(), |at| {
                format!("{} ({})", format_ms(at), relative(at, cluster_now))
            }),
            b.source_ref.clone().unwrap_or_else(|| "-".into()),
            state.into(),
        ]);
    }
    show(ctx.format, &json, &[t, exp, bt])
}

// ---------------------------------------------------------------- budgets

pub async fn run_budget(ctx: &Ctx, cmd: BudgetCmd) -> anyhow::Result<()> {
    match cmd {
        BudgetCmd::Set(a) => budget_set(ctx, a).await,
        BudgetCmd::Show(a) => budget_show(ctx, OrgId(a.org), a.scope).await,
        BudgetCmd::Alert(a) => alert_set(ctx, a).await,
    }
}

async fn budget_set(ctx: &Ctx, a: BudgetSetArgs) -> anyhow::Result<()> {
    let org = OrgId(a.org);
    let spec = match (a.clear, a.limit) {
        (true, _) => None,
        (false, Some(limit_micro)) => Some(BudgetSpec {
            limit_micro,
            period: a.period,
            mode: a.mode,
        }),
        (false, None) => return Err(usage("--limit (or --clear)")),
    };
    let scope = a.scope.budget_scope(org);
    ctx.client
        .set_budget(org, scope, spec)
        .await
        .with_context(|| format!("setting the budget of {scope}"))?;
    budget_show(ctx, org, a.scope).await
}

async fn alert_set(ctx: &Ctx, a: AlertArgs) -> anyhow::Result<()> {
    let org = OrgId(a.org);
    let scope = a.scope.budget_scope(org);
    let spec = (!a.clear).then(|| allot_statemachine::alerts::AlertSpec {
        low_balance_micro: a.low_balance,
        budget_pcts: a.budget_pcts.clone(),
    });
    ctx.client
        .set_alert(org, scope, spec.clone())
        .await
        .with_context(|| format!("setting the alert of {scope}"))?;
    let json = serde_json::json!({ "scope": scope.to_string(), "alert": spec });
    let t = Table::fields([
        ("scope", scope.to_string()),
        ("low balance", a.low_balance.map_or("-".into(), cr)),
        ("budget %", crate::output::list(&a.budget_pcts)),
        ("state", if a.clear { "removed" } else { "set" }.into()),
    ]);
    show(ctx.format, &json, &[t])
}

async fn budget_show(ctx: &Ctx, org: OrgId, scope: Scope) -> anyhow::Result<()> {
    let scope = scope.budget_scope(org);
    let v = ctx.client.budget(org, scope).await.map_err(|e| match e {
        allot_client::Error::NotFound(_) => anyhow::anyhow!("unknown {scope} in {org}"),
        e => anyhow::Error::new(e).context(format!("budget of {scope}")),
    })?;
    let json = serde_json::json!({
        "scope": scope,
        "budget": v.budget,
        "used_micro": v.used_micro,
        "usage": v.usage,
    });
    let t = Table::fields([
        ("scope", scope.to_string()),
        (
            "limit",
            v.budget.map_or("none".into(), |b| cr(b.limit_micro)),
        ),
        (
            "period",
            v.budget.map_or("-".into(), |b| format!("{:?}", b.period)),
        ),
        (
            "mode",
            v.budget.map_or("-".into(), |b| format!("{:?}", b.mode)),
        ),
        ("used in period", cr(v.used_micro)),
        ("held", cr(v.usage.held)),
        ("spent today", cr(v.usage.spent_day)),
        ("spent this month", cr(v.usage.spent_month)),
        ("spent in total", cr(v.usage.spent_total)),
    ]);
    show(ctx.format, &json, &[t])
}

// ---------------------------------------------------------------- prices, totals

pub async fn run_price(ctx: &Ctx, cmd: PriceCmd) -> anyhow::Result<()> {
    match cmd {
        PriceCmd::Set { prices } => {
            let versions = ctx
                .client
                .set_prices(prices.clone())
                .await
                .context("setting prices")?;
            let mut t = Table::new(&["SHARD", "VERSION"]);
            for (s, v) in versions.iter().enumerate() {
                t.row(vec![s.to_string(), v.to_string()]);
            }
            let json = serde_json::json!({
                "versions": versions,
                "prices_micro_per_gpu_hour": prices.iter().map(|(t, p)| (t.0.clone(), *p)).collect::<std::collections::BTreeMap<_, _>>(),
            });
            show(ctx.format, &json, &[t])
        }
        PriceCmd::List { shard } => price_list(ctx, shard).await,
    }
}

async fn price_list(ctx: &Ctx, shard: Option<u32>) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut t = Table::new(&["SHARD", "VERSION", "SINCE", "GPU TYPE", "CREDITS/GPU-HOUR"]);
    for s in ctx.shards_or_all(shard).await? {
        let p = ctx.client.prices(s).await?;
        for (ty, micro) in &p.prices {
            t.row(vec![
                s.to_string(),
                p.version.to_string(),
                format_ms(p.since_ms),
                ty.0.clone(),
                cr(*micro),
            ]);
        }
        rows.push(serde_json::json!({
            "shard": s,
            "version": p.version,
            "since_ms": p.since_ms,
            "prices_micro_per_gpu_hour": p.prices.iter().map(|(t, v)| (t.0.clone(), *v)).collect::<std::collections::BTreeMap<_, _>>(),
        }));
    }
    show(ctx.format, &rows, &[t])
}

pub async fn totals(ctx: &Ctx, a: TotalsArgs) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut t = Table::new(&["SHARD", "ISSUED", "CONSUMED", "EXPIRED", "MOVED"]);
    for s in ctx.shards_or_all(a.shard).await? {
        let tot = ctx.client.totals(s).await?;
        let m = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        let (issued, consumed, expired, moved) =
            (m(tot.issued), m(tot.consumed), m(tot.expired), m(tot.moved));
        t.row(vec![
            s.to_string(),
            cr(issued),
            cr(consumed),
            cr(expired),
            cr(moved),
        ]);
        rows.push(serde_json::json!({
            "shard": s,
            "issued_micro": issued,
            "consumed_micro": consumed,
            "expired_micro": expired,
            "moved_micro": moved,
        }));
    }
    show(ctx.format, &rows, &[t])
}
