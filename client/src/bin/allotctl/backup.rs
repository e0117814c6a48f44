//! Backups of shards: `backup create` copies every shard (or one) into a directory, one
//! verified file per shard; `backup verify` checks files offline. Restore with
//! `allot-node restore` (DESIGN §41).

use crate::connect::Ctx;
use crate::output::{show, Table};
use allot_client::SavedBackup;
use allot_statemachine::backup::BackupSummary;
use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum BackupCmd {
    /// Copies each shard (state, Raft position, voters, audit trail) into DIR as
    /// `shard-<n>.allot-backup`, streamed to disk and checked as a stream (checksum,
    /// state hash, audit chain and commands) before it takes its name.
    Create(CreateArgs),
    /// Verifies backup files offline and whole: checksum, state hash, audit chain and
    /// commands, the decoded state's invariants and its agreement with the header.
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
    bytes: u64,
}

fn row(file: String, s: &BackupSummary, bytes: u64) -> Row {
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

/// Copies `shards` into `dir`, one streamed file each.
async fn take_all(
    ctx: &Ctx,
    dir: &Path,
    shards: &[u32],
) -> anyhow::Result<Vec<(PathBuf, SavedBackup)>> {
    let mut out = Vec::new();
    for &shard in shards {
        let file = dir.join(format!("shard-{shard}.allot-backup"));
        let saved = ctx
            .client
            .backup_to_file(shard, &file)
            .await
            .with_context(|| format!("backing up shard {shard}"))?;
        out.push((file, saved));
    }
    Ok(out)
}

fn token_drift(taken: &[(PathBuf, SavedBackup)]) -> Vec<allot_statemachine::PrincipalId> {
    let views: Vec<_> = taken.iter().map(|(_, s)| s.header.tokens.clone()).collect();
    allot_statemachine::backup::views_disagree(&views)
}

/// Verifies one file whole: the stream's checks, then the decoded state's (hash,
/// invariants, agreement with the header). Holds the state, never the audit trail.
fn verify_file(f: &Path) -> anyhow::Result<BackupSummary> {
    let file = std::fs::File::open(f).with_context(|| format!("reading {}", f.display()))?;
    let v = allot_statemachine::backup::read_verified(
        std::io::BufReader::with_capacity(1 << 20, file),
        |_| Ok::<(), std::convert::Infallible>(()),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
    .with_context(|| format!("{} does not verify", f.display()))?;
    Ok(v.summary)
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
            let mut taken = take_all(ctx, &a.out, &shards).await?;
            if !token_drift(&taken).is_empty() {
                taken = take_all(ctx, &a.out, &shards).await?;
                let drift = token_drift(&taken);
                if !drift.is_empty() {
                    anyhow::bail!(
                        "token commands kept changing principals {drift:?} while the shards \
                         were copied; try again"
                    );
                }
            }
            let rows: Vec<Row> = taken
                .iter()
                .map(|(file, s)| row(file.display().to_string(), &s.summary, s.bytes))
                .collect();
            print(ctx, &rows)
        }
        BackupCmd::Verify { files } => {
            let mut rows = Vec::new();
            for f in files {
                let bytes = std::fs::metadata(&f)
                    .with_context(|| format!("reading {}", f.display()))?
                    .len();
                let check = f.clone();
                let summary = tokio::task::spawn_blocking(move || verify_file(&check)).await??;
                rows.push(row(f.display().to_string(), &summary, bytes));
            }
            print(ctx, &rows)
        }
    }
}
