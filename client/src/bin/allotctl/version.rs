//! `allotctl version`: the cluster version gate (docs/DESIGN.md §48) — which rule
//! version each shard runs, what each node supports, and activating a new version once
//! every node runs a release that supports it.

use crate::connect::Ctx;
use crate::output::{show, Table};
use allot_statemachine::{Command, Reply};
use clap::{Args, Subcommand};
use serde::Serialize;

#[derive(Subcommand, Debug)]
pub enum VersionCmd {
    /// Per endpoint: the newest rule version and the persisted format its binary
    /// supports, and each shard's active rule version there.
    Status,
    /// Activates rule version `--to` on every shard (admin). Refused (exit 1, nothing
    /// changed) unless every member of each shard runs a binary that supports it; the
    /// message names the nodes to upgrade first. Once activated, a version cannot be
    /// undone: the old release no longer starts on these data dirs.
    Activate(ActivateArgs),
}

#[derive(Args, Debug)]
pub struct ActivateArgs {
    /// The rule version to activate.
    #[arg(long)]
    to: u32,
}

pub async fn run(ctx: &Ctx, cmd: VersionCmd) -> anyhow::Result<()> {
    match cmd {
        VersionCmd::Status => status(ctx).await,
        VersionCmd::Activate(a) => activate(ctx, a.to).await,
    }
}

#[derive(Serialize)]
struct NodeRow {
    endpoint: String,
    node_id: Option<u64>,
    release: Option<String>,
    rules_max: Option<u32>,
    format_version: Option<u32>,
    format_read_min: Option<u32>,
    /// (shard, active rule version) on this replica.
    shards: Vec<(u32, u32)>,
    error: Option<String>,
}

async fn status(ctx: &Ctx) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for addr in ctx.client.endpoints() {
        rows.push(match ctx.client.status_of(addr).await {
            Ok(s) => NodeRow {
                endpoint: addr.to_string(),
                node_id: Some(s.node_id),
                release: s.versions.as_ref().map(|v| v.release.clone()),
                rules_max: s.versions.as_ref().map(|v| v.rules_max),
                format_version: s.versions.as_ref().map(|v| v.format_version),
                format_read_min: s.versions.as_ref().map(|v| v.format_read_min),
                shards: s
                    .shards
                    .iter()
                    .map(|sh| (sh.shard, sh.rules_active.max(1)))
                    .collect(),
                error: None,
            },
            Err(e) => NodeRow {
                endpoint: addr.to_string(),
                node_id: None,
                release: None,
                rules_max: None,
                format_version: None,
                format_read_min: None,
                shards: Vec::new(),
                error: Some(e.to_string()),
            },
        });
    }
    let mut t = Table::new(&[
        "ENDPOINT",
        "NODE",
        "RELEASE",
        "RULES MAX",
        "FORMAT",
        "ACTIVE",
        "ERROR",
    ]);
    let dash = || "-".to_string();
    for r in &rows {
        let mut active: Vec<u32> = r.shards.iter().map(|s| s.1).collect();
        active.sort_unstable();
        active.dedup();
        t.row(vec![
            r.endpoint.clone(),
            r.node_id.map_or_else(dash, |v| v.to_string()),
            r.release.clone().unwrap_or_else(dash),
            r.rules_max.map_or_else(dash, |v| v.to_string()),
            match (r.format_read_min, r.format_version) {
                (Some(lo), Some(hi)) => format!("{hi} (reads {lo}..={hi})"),
                _ => dash(),
            },
            active
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
            r.error.clone().unwrap_or_default(),
        ]);
    }
    show(ctx.format, &rows, &[t])?;
    if rows.iter().all(|r| r.error.is_some()) {
        anyhow::bail!("no endpoint answered");
    }
    Ok(())
}

#[derive(Serialize)]
struct ActivatedRow {
    shard: u32,
    rules_active: u32,
}

async fn activate(ctx: &Ctx, to: u32) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for shard in ctx.shards().await? {
        let reply = ctx
            .client
            .run(shard, Command::ActivateVersion { version: to })
            .await
            .map_err(|e| anyhow::anyhow!("shard {shard}: {e}"))?;
        let Reply::RulesActive { version } = reply else {
            anyhow::bail!("shard {shard}: unexpected reply {reply:?}");
        };
        rows.push(ActivatedRow {
            shard,
            rules_active: version,
        });
    }
    let mut t = Table::new(&["SHARD", "RULES ACTIVE"]);
    for r in &rows {
        t.row(vec![r.shard.to_string(), r.rules_active.to_string()]);
    }
    show(ctx.format, &rows, &[t])
}
