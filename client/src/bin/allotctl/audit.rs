//! The audit trail: `audit` (a table, or one JSON array) and `audit export` (JSON
//! lines), both with `--follow` to keep polling for new events.

use crate::connect::Ctx;
use crate::failure::{code, usage};
use crate::output::{cr, hex, line, print, print_json, print_json_line, show, Table};
use crate::timefmt::format_ms;
use crate::values;
use allot_client::AuditFilter;
use allot_statemachine::{Actor, AuditEvent, EventBody, HoldId, OrgId, ProjectId};
use clap::{Args, Subcommand};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AuditArgs {
    #[command(subcommand)]
    export: Option<AuditCmd>,
    #[command(flatten)]
    filter: FilterArgs,
    /// Most events to list (without --follow).
    #[arg(long, default_value_t = 10_000)]
    limit: usize,
}

#[derive(Subcommand, Debug)]
pub enum AuditCmd {
    /// Every matching event as JSON lines on stdout, one AuditEvent per line.
    Export(ExportArgs),
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    filter: FilterArgs,
}

#[derive(Args, Debug, Clone)]
pub struct FilterArgs {
    /// The org's events (on its home shard).
    #[arg(long)]
    org: Option<u64>,
    /// A shard's whole trail (instead of, or to override, the org's home shard).
    #[arg(long)]
    shard: Option<u32>,
    #[arg(long)]
    project: Option<u64>,
    /// A job's events (its hold has the job's id).
    #[arg(long)]
    job: Option<u64>,
    /// From this logical time: unix ms, 2025-01-31T12:00:00Z, or a duration ago (10m).
    #[arg(long, value_parser = values::since_ms)]
    since: Option<u64>,
    /// Before this logical time (same forms as --since).
    #[arg(long, value_parser = values::since_ms)]
    until: Option<u64>,
    /// Start at this position of the shard's chain.
    #[arg(long, default_value_t = 0)]
    from_seq: u64,
    /// Keep polling for new events until interrupted (Ctrl-C). With -o json the events
    /// are printed as one array when it ends.
    #[arg(long)]
    follow: bool,
    /// Stop following after this long (for scripts and tests).
    #[arg(long, hide = true, value_parser = values::duration, requires = "follow")]
    follow_for: Option<Duration>,
}

/// How events are handed out: collected, or printed as they arrive.
enum Sink {
    Collect(Vec<AuditEvent>),
    TableLines { header_done: bool },
    JsonLines,
}

pub async fn run(ctx: &Ctx, a: AuditArgs) -> anyhow::Result<()> {
    match a.export {
        Some(AuditCmd::Export(e)) => walk(ctx, &e.filter, usize::MAX, Sink::JsonLines)
            .await
            .map(drop),
        None => {
            let sink = match (a.filter.follow, ctx.json()) {
                (true, false) => Sink::TableLines { header_done: false },
                _ => Sink::Collect(Vec::new()),
            };
            let limit = if a.filter.follow { usize::MAX } else { a.limit };
            let sink = walk(ctx, &a.filter, limit, sink).await?;
            match sink {
                Sink::Collect(events) => print_events(ctx, &events),
                _ => Ok(()),
            }
        }
    }
}

/// Pages through the trail from `--from-seq` to its head (and on while following).
async fn walk(ctx: &Ctx, f: &FilterArgs, limit: usize, mut sink: Sink) -> anyhow::Result<Sink> {
    let (shard, filter) = resolve(ctx, f).await?;
    let stop_at = f.follow_for.map(|d| Instant::now() + d);
    let mut from = f.from_seq;
    let mut seen = 0usize;
    loop {
        let page = ctx.client.audit(shard, filter, from, 1_000).await?;
        for ev in page.events {
            if seen == limit {
                eprintln!(
                    "note: stopped at --limit {limit}; continue with --from-seq {}",
                    ev.seq
                );
                return Ok(sink);
            }
            seen += 1;
            emit(&mut sink, ev)?;
        }
        let caught_up = page.next_seq >= page.head_seq || page.next_seq == from;
        from = page.next_seq;
        if !caught_up {
            continue;
        }
        if !f.follow || stop_at.is_some_and(|t| Instant::now() >= t) {
            return Ok(sink);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            _ = tokio::signal::ctrl_c() => return Ok(sink),
        }
    }
}

async fn resolve(ctx: &Ctx, f: &FilterArgs) -> anyhow::Result<(u32, AuditFilter)> {
    let shard = match (f.shard, f.org) {
        (Some(s), _) => ctx.shards_or_all(Some(s)).await?[0],
        (None, Some(o)) => ctx.home_shard(OrgId(o)).await?,
        (None, None) => return Err(usage("--org or --shard is required")),
    };
    let filter = AuditFilter {
        org: f.org.map(OrgId),
        project: f.project.map(ProjectId),
        hold: f.job.map(HoldId),
        from_ms: f.since.unwrap_or(0),
        to_ms: f.until.unwrap_or(0),
    };
    Ok((shard, filter))
}

fn emit(sink: &mut Sink, ev: AuditEvent) -> anyhow::Result<()> {
    match sink {
        Sink::Collect(v) => v.push(ev),
        Sink::JsonLines => print_json_line(&event_json(&ev))?,
        Sink::TableLines { header_done } => {
            if !*header_done {
                print(&format!("{}\n", line(&HEADERS.map(String::from), &WIDTHS)));
                *header_done = true;
            }
            print(&format!("{}\n", line(&event_cells(&ev), &WIDTHS)));
        }
    }
    Ok(())
}

const HEADERS: [&str; 5] = ["SEQ", "TIME", "ACTOR", "KIND", "DETAILS"];
const WIDTHS: [usize; 5] = [6, 24, 10, 16, 0];

fn print_events(ctx: &Ctx, events: &[AuditEvent]) -> anyhow::Result<()> {
    if ctx.json() {
        let all: Vec<serde_json::Value> = events.iter().map(event_json).collect();
        return print_json(&all);
    }
    let mut t = Table::new(&HEADERS);
    for ev in events {
        t.row(event_cells(ev));
    }
    show(ctx.format, &(), &[t])
}

fn event_cells(ev: &AuditEvent) -> Vec<String> {
    vec![
        ev.seq.to_string(),
        format_ms(ev.time_ms),
        actor(ev.actor),
        kind(&ev.body).to_string(),
        details(ev),
    ]
}

/// An event as JSON: the stored fields, hashes in hex, plus `kind` and `details`.
pub fn event_json(ev: &AuditEvent) -> serde_json::Value {
    let mut body = serde_json::to_value(&ev.body).unwrap_or_default();
    if let EventBody::Command { digest, .. } = &ev.body {
        if let Some(c) = body.get_mut("Command").and_then(|c| c.as_object_mut()) {
            c.insert("digest".into(), hex(digest).into());
        }
    }
    serde_json::json!({
        "seq": ev.seq,
        "log_index": ev.log_index,
        "time_ms": ev.time_ms,
        "actor": actor(ev.actor),
        "request_id": format!("{:032x}", ev.request_id),
        "org": ev.org.map(|o| o.0),
        "account": ev.account.map(|a| a.to_string()),
        "hold": ev.hold.map(|h| h.0),
        "kind": kind(&ev.body),
        "details": details(ev),
        "body": body,
        "prev_hash": hex(&ev.prev_hash),
        "hash": hex(&ev.hash),
    })
}

fn actor(a: Actor) -> String {
    match a {
        Actor::Admin(p) => format!("admin:{}", p.0),
        Actor::Tenant { org, principal } => format!("org:{}/principal:{}", org.0, principal.0),
        Actor::Project {
            org,
            project,
            principal,
        } => format!(
            "org:{}/project:{}/principal:{}",
            org.0, project.0, principal.0
        ),
        Actor::User {
            org,
            project,
            user,
            principal,
        } => format!(
            "org:{}/project:{}/user:{}/principal:{}",
            org.0, project.0, user.0, principal.0
        ),
        Actor::Agent(n) => format!("agent:{}", n.0),
        Actor::System => "system".into(),
        Actor::Bearer(d) => format!("unresolved-token:{d:?}"),
        Actor::Anonymous => "anonymous".into(),
    }
}

fn kind(b: &EventBody) -> &'static str {
    match b {
        EventBody::Command { .. } => "command",
        EventBody::Issued { .. } => "issued",
        EventBody::HoldDrawn { .. } => "hold_drawn",
        EventBody::Captured { .. } => "captured",
        EventBody::CaptureReversed { .. } => "capture_reversed",
        EventBody::Refunded { .. } => "refunded",
        EventBody::RefundForfeited { .. } => "refund_forfeited",
        EventBody::BucketExpired { .. } => "bucket_expired",
        EventBody::TransferredOut { .. } => "transferred_out",
        EventBody::TransferredIn { .. } => "transferred_in",
        EventBody::JobTransition { .. } => "job_transition",
        EventBody::NodeStateChanged { .. } => "node_state",
        EventBody::BudgetAlert { .. } => "budget_alert",
        EventBody::Denied { .. } => "denied",
        EventBody::BucketArchived { .. } => "bucket_archived",
        EventBody::LowBalance { .. } => "low_balance",
        EventBody::BudgetThreshold { .. } => "budget_threshold",
    }
}

fn details(ev: &AuditEvent) -> String {
    let hold = ev.hold.map_or(String::new(), |h| format!(" {h}"));
    match &ev.body {
        EventBody::Command {
            outcome, replayed, ..
        } => {
            let r = if *replayed { " (replayed)" } else { "" };
            match outcome {
                Ok(reply) => format!("ok: {reply:?}{r}"),
                Err(e) => format!("rejected: {e} [{}]{r}", code(e)),
            }
        }
        EventBody::Issued {
            bucket,
            amount_micro,
        }
        | EventBody::HoldDrawn {
            bucket,
            amount_micro,
        }
        | EventBody::Captured {
            bucket,
            amount_micro,
        }
        | EventBody::CaptureReversed {
            bucket,
            amount_micro,
        }
        | EventBody::Refunded {
            bucket,
            amount_micro,
        }
        | EventBody::RefundForfeited {
            bucket,
            amount_micro,
        }
        | EventBody::BucketExpired {
            bucket,
            amount_micro,
        }
        | EventBody::TransferredOut {
            bucket,
            amount_micro,
        }
        | EventBody::TransferredIn {
            bucket,
            amount_micro,
        } => format!("{bucket} {}{hold}", cr(*amount_micro)),
        EventBody::BucketArchived { bucket } => format!("{bucket} closed and archived"),
        EventBody::JobTransition {
            job,
            from,
            to,
            attempt,
            node,
            reason,
        } => {
            let from = from.map_or("-".into(), |f| format!("{f:?}"));
            let node = node.map_or(String::new(), |n| format!(" on {n}"));
            format!("{job} {from} -> {to:?} attempt {attempt}{node} ({reason:?})")
        }
        EventBody::NodeStateChanged { node, state } => format!("{node} -> {state:?}"),
        EventBody::Denied {
            node,
            caller,
            api,
            reason,
        } => format!(
            "{api} by {} refused at node {node}: {reason:?}",
            actor(*caller)
        ),
        EventBody::BudgetAlert {
            scope,
            limit_micro,
            used_micro,
        } => format!("{scope}: used {} of {}", cr(*used_micro), cr(*limit_micro)),
        EventBody::LowBalance {
            threshold_micro,
            available_micro,
        } => format!(
            "{}: available {} fell below {}",
            ev.account.map_or("-".into(), |a| a.to_string()),
            cr(*available_micro),
            cr(*threshold_micro)
        ),
        EventBody::BudgetThreshold {
            scope,
            pct,
            limit_micro,
            used_micro,
        } => format!(
            "{scope}: budget {pct}% reached (used {} of {})",
            cr(*used_micro),
            cr(*limit_micro)
        ),
    }
}
