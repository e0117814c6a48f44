//! Backups of shards: `backup create` copies every shard (or one) into a directory, one
//! verified file per shard; `backup verify` checks files offline. Restore with
//! `allot-node restore` (DESIGN §41).

use crate::connect::Ctx;
use crate::output::{show, Table};
use allot_statemachine::backup::{BackupSummary, ShardBackup};
use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum BackupCmd {
    /// Copies each shard (state, Raft position, voters, audit trail) into DIR as
    /// `shard-<n>.allot-backup`, verified before it is written.
    Create(CreateArgs),
    /// Verifies backup files offline: state hash, invariants, audit chain.
    Verify {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Directory to write the files to (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// One shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
}

#[derive(Serialize)]
struct Row {
    file: String,
    shard: u32,
    log_index: u64,
    term: u64,
    logical_time_ms: u64,
    state_hash: String,
    audit_events: u64,
    bytes: usize,
}

fn row(file: String, s: &BackupSummary, bytes: usize) -> Row {
    Row {
        file,
        shard: s.shard,
        log_index: s.position.map_or(0, |p| p.index),
        term: s.position.map_or(0, |p| p.term),
        logical_time_ms: s.logical_time_ms,
        state_hash: s.state_hash.iter().map(|b| format!("{b:02x}")).collect(),
        audit_events: s.audit_events,
        bytes,
    }
}

fn print(ctx: &Ctx, rows: &[Row]) -> anyhow::Result<()> {
    let mut t = Table::new(&[
        "SHARD",
        "LOG INDEX",
        "TERM",
        "STATE HASH",
        "AUDIT EVENTS",
        "BYTES",
        "FILE",
    ]);
    for r in rows {
        t.row(vec![
            r.shard.to_string(),
            r.log_index.to_string(),
            r.term.to_string(),
            r.state_hash[..16].to_string(),
            r.audit_events.to_string(),
            r.bytes.to_string(),
            r.file.clone(),
        ]);
    }
    show(ctx.format, &rows, &[t])
}

async fn take_all(ctx: &Ctx, shards: &[u32]) -> anyhow::Result<Vec<ShardBackup>> {
    let mut out = Vec::new();
    for &shard in shards {
        out.push(
            ctx.client
                .backup(shard)
                .await
                .with_context(|| format!("backing up shard {shard}"))?,
        );
    }
    Ok(out)
}

fn token_drift(taken: &[ShardBackup]) -> anyhow::Result<Vec<allot_statemachine::PrincipalId>> {
    let mut states = Vec::new();
    for b in taken {
        states.push(b.verify()?.0);
    }
    let refs: Vec<&allot_statemachine::State> = states.iter().collect();
    Ok(allot_statemachine::backup::token_disagreements(&refs))
}

pub async fn run(ctx: &Ctx, cmd: BackupCmd) -> anyhow::Result<()> {
    match cmd {
        BackupCmd::Create(a) => {
            std::fs::create_dir_all(&a.out)
                .with_context(|| format!("creating {}", a.out.display()))?;
            let shards = ctx.shards_or_all(a.shard).await?;
            // The shards are copied one after another; token commands run on every
            // shard in turn, so a copy that caught one in flight has shards whose token
            // tables disagree (a restore would refuse it): copy again, once.
            let mut taken = take_all(ctx, &shards).await?;
            if !token_drift(&taken)?.is_empty() {
                taken = take_all(ctx, &shards).await?;
                let drift = token_drift(&taken)?;
                if !drift.is_empty() {
                    anyhow::bail!(
                        "token commands kept changing principals {drift:?} while the shards \
                         were copied; try again"
                    );
                }
            }
            let mut rows = Vec::new();
            for b in &taken {
                let (_, summary) = b.verify()?;
                let bytes = b.encode();
                let file = a.out.join(format!("shard-{}.allot-backup", b.shard));
                std::fs::write(&file, &bytes)
                    .with_context(|| format!("writing {}", file.display()))?;
                rows.push(row(file.display().to_string(), &summary, bytes.len()));
            }
            print(ctx, &rows)
        }
        BackupCmd::Verify { files } => {
            let mut rows = Vec::new();
            for f in files {
                let bytes =
                    std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?;
                let (_, summary) = ShardBackup::decode(&bytes)
                    .and_then(|b| b.verify())
                    .with_context(|| format!("{} does not verify", f.display()))?;
                rows.push(row(f.display().to_string(), &summary, bytes.len()));
            }
            print(ctx, &rows)
        }
    }
}
