//! Scheduler settings per shard (`scheduler show|configure`) and the queue per tier.

use crate::connect::{tier_name, Ctx};
use crate::failure::usage;
use crate::output::{show, Table};
use crate::timefmt::format_duration_ms;
use crate::values;
use allot_statemachine::scheduler::SchedulerSettings;
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum SchedulerCmd {
    /// The scheduler settings of a shard (every shard if --shard is omitted).
    Show {
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Changes the given settings (reads the current ones, changes only those given,
    /// sends them whole); every shard if --shard is omitted.
    Configure(ConfigureArgs),
}

#[derive(Args, Debug)]
pub struct ConfigureArgs {
    #[arg(long)]
    shard: Option<u32>,
    /// A job runs at least this long before it may be preempted.
    #[arg(long, value_parser = values::duration_ms)]
    min_runtime: Option<u64>,
    /// Time a preempted job gets to checkpoint before its GPUs are reclaimed.
    #[arg(long, value_parser = values::duration_ms)]
    grace: Option<u64>,
    /// A placed job without a heartbeat for this long ends as Lost.
    #[arg(long, value_parser = values::duration_ms)]
    job_lease: Option<u64>,
    /// A node without a heartbeat for this long takes no new work; a fence margin later
    /// it is down (its jobs are requeued, billed to their last heartbeat, or fail once
    /// they used up their requeues).
    #[arg(long, value_parser = values::duration_ms)]
    node_lease: Option<u64>,
    /// How long after a node's lease ran out its jobs are placed elsewhere (the agent has
    /// stopped them by then; docs/DESIGN.md §45).
    #[arg(long, value_parser = values::duration_ms)]
    fence_margin: Option<u64>,
    /// Most times one job is requeued because its node went down (0: it fails at once).
    #[arg(long)]
    node_failure_requeues: Option<u32>,
    /// No preemption while a running job on a fitting node ends within this time.
    #[arg(long, value_parser = values::duration_ms)]
    hysteresis: Option<u64>,
    /// Most preemptions of one job.
    #[arg(long)]
    preemptions_max: Option<u32>,
    /// Half-life of the decayed usage behind fair share.
    #[arg(long, value_parser = values::duration_ms)]
    half_life: Option<u64>,
    /// Preemption loss cap: a running job is a victim only while the work it would lose
    /// (GPUs × time since its last checkpoint) is at most this much GPU time (e.g. 2h =
    /// two GPU-hours).
    #[arg(long, value_parser = values::duration_ms)]
    preemption_loss_max: Option<u64>,
    /// Retunes one tier (repeatable): <tier name or number>:<key>=<value>,... with keys
    /// weight, floor (percent), ceiling (percent), max-wait (duration), price (percent
    /// of list), e.g. --tier paid:weight=3,floor=20,max-wait=2h. Keys not given keep
    /// their values; the shard validates the whole set (floors add up to at most 100).
    #[arg(long = "tier", value_parser = values::tier_change)]
    tiers: Vec<values::TierChange>,
}

#[derive(Args, Debug)]
pub struct QueueArgs {
    /// One shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
}

pub async fn run(ctx: &Ctx, cmd: SchedulerCmd) -> anyhow::Result<()> {
    match cmd {
        SchedulerCmd::Show { shard } => {
            let mut all = Vec::new();
            for s in ctx.shards_or_all(shard).await? {
                all.push((s, ctx.client.scheduler_settings(s).await?));
            }
            print_settings(ctx, &all)
        }
        SchedulerCmd::Configure(a) => configure(ctx, a).await,
    }
}

async fn configure(ctx: &Ctx, a: ConfigureArgs) -> anyhow::Result<()> {
    let changes = [
        a.min_runtime,
        a.grace,
        a.job_lease,
        a.node_lease,
        a.fence_margin,
        a.hysteresis,
        a.half_life,
        a.preemptions_max.map(u64::from),
        a.node_failure_requeues.map(u64::from),
        a.preemption_loss_max,
    ];
    if changes.iter().all(Option::is_none) && a.tiers.is_empty() {
        return Err(usage("nothing to change: give at least one setting"));
    }
    let mut all = Vec::new();
    for shard in ctx.shards_or_all(a.shard).await? {
        let mut s = ctx.client.scheduler_settings(shard).await?;
        apply_changes(&mut s, &a)?;
        ctx.client
            .configure_scheduler(shard, s.clone())
            .await
            .with_context(|| format!("configuring the scheduler of shard {shard}"))?;
        all.push((shard, s));
    }
    print_settings(ctx, &all)
}

fn apply_changes(s: &mut SchedulerSettings, a: &ConfigureArgs) -> anyhow::Result<()> {
    let set = |field: &mut u64, v: Option<u64>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut s.min_runtime_ms, a.min_runtime);
    set(&mut s.grace_ms, a.grace);
    set(&mut s.job_lease_ms, a.job_lease);
    set(&mut s.node_lease_ms, a.node_lease);
    set(&mut s.fence_margin_ms, a.fence_margin);
    set(&mut s.hysteresis_ms, a.hysteresis);
    set(&mut s.usage_half_life_ms, a.half_life);
    if let Some(p) = a.preemptions_max {
        s.preemptions_per_job_max = p;
    }
    if let Some(r) = a.node_failure_requeues {
        s.node_failure_requeues_max = r;
    }
    set(&mut s.preemption_loss_max_gpu_ms, a.preemption_loss_max);
    for change in &a.tiers {
        let i = match &change.tier {
            values::TierArg::Number(n) => *n as usize,
            values::TierArg::Name(name) => s
                .tiers
                .iter()
                .position(|t| t.name.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    let names: Vec<&str> = s.tiers.iter().map(|t| t.name.as_str()).collect();
                    usage(format!(
                        "--tier {name}: this shard's tiers are {} (or a number)",
                        names.join(", ")
                    ))
                })?,
        };
        let n = s.tiers.len();
        let t = s.tiers.get_mut(i).ok_or_else(|| {
            usage(format!(
                "--tier {i}: this shard has tiers 0..{n} (tiers are retuned, not added)"
            ))
        })?;
        if let Some(v) = change.weight {
            t.weight = v;
        }
        if let Some(v) = change.floor_pct {
            t.floor_pct = v;
        }
        if let Some(v) = change.ceiling_pct {
            t.ceiling_pct = v;
        }
        if let Some(v) = change.max_wait_ms {
            t.max_wait_ms = v;
        }
        if let Some(v) = change.price_pct {
            t.price_pct = v;
        }
    }
    Ok(())
}

fn print_settings(ctx: &Ctx, all: &[(u32, SchedulerSettings)]) -> anyhow::Result<()> {
    let json: Vec<serde_json::Value> = all
        .iter()
        .map(|(shard, s)| serde_json::json!({"shard": shard, "settings": s}))
        .collect();
    let d = |ms: u64| format_duration_ms(ms);
    let mut tiers = Table::new(&[
        "SHARD",
        "TIER",
        "WEIGHT",
        "FLOOR %",
        "CEILING %",
        "MAX WAIT",
        "PRICE %",
    ]);
    let mut rows: Vec<Vec<String>> = [
        "min runtime",
        "grace",
        "job lease",
        "node lease",
        "fence margin",
        "hysteresis",
        "preemptions max",
        "usage half-life",
        "node-failure requeues",
        "preemption loss max (GPU time)",
    ]
    .iter()
    .map(|n| vec![n.to_string()])
    .collect();
    let mut headers = vec!["SETTING".to_string()];
    for (shard, s) in all {
        headers.push(format!("SHARD {shard}"));
        let values = [
            d(s.min_runtime_ms),
            d(s.grace_ms),
            d(s.job_lease_ms),
            d(s.node_lease_ms),
            d(s.fence_margin_ms),
            d(s.hysteresis_ms),
            s.preemptions_per_job_max.to_string(),
            d(s.usage_half_life_ms),
            s.node_failure_requeues_max.to_string(),
            d(s.preemption_loss_max_gpu_ms),
        ];
        for (row, v) in rows.iter_mut().zip(values) {
            row.push(v);
        }
        for (i, tc) in s.tiers.iter().enumerate() {
            tiers.row(vec![
                shard.to_string(),
                format!("{i} ({})", tc.name),
                tc.weight.to_string(),
                tc.floor_pct.to_string(),
                tc.ceiling_pct.to_string(),
                d(tc.max_wait_ms),
                tc.price_pct.to_string(),
            ]);
        }
    }
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let t = Table::new(&headers).with_rows(rows);
    show(ctx.format, &json, &[t, tiers])
}

pub async fn queue(ctx: &Ctx, a: QueueArgs) -> anyhow::Result<()> {
    let mut json = Vec::new();
    let mut t = Table::new(&["SHARD", "TIER", "QUEUED", "OLDEST WAIT", "RUNNING GPUS"]);
    for shard in ctx.shards_or_all(a.shard).await? {
        let config = ctx.tiers(shard).await?;
        for q in ctx.client.queue(shard).await? {
            t.row(vec![
                shard.to_string(),
                tier_name(&config, q.tier),
                q.queued.to_string(),
                format_duration_ms(q.oldest_wait_ms),
                q.running_gpus.to_string(),
            ]);
            json.push(serde_json::json!({
                "shard": shard,
                "tier": q.tier.0,
                "tier_name": config.get(q.tier.0 as usize).map(|c| c.name.clone()),
                "queued": q.queued,
                "oldest_wait_ms": q.oldest_wait_ms,
                "running_gpus": q.running_gpus,
            }));
        }
    }
    show(ctx.format, &json, &[t])
}
