//! Raft membership per shard: `member list|add-learner|promote|remove`.

use crate::connect::Ctx;
use crate::failure::usage;
use crate::output::{list, show, Table};
use allot_proto::{ChangeMembershipRequest, Member, MemberRequest, ShardStatus};
use clap::{Args, Subcommand};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Subcommand, Debug)]
pub enum MemberCmd {
    /// Per shard: leader, term, voters and learners (as the shard's leader reports them).
    List,
    /// Adds a node as a learner (it catches up by log or snapshot; waits until it has).
    AddLearner(AddLearnerArgs),
    /// Makes a learner a voter: the voter set becomes the current voters plus the node.
    Promote(ChangeArgs),
    /// Removes a voter: the voter set becomes the current voters minus the node.
    Remove(ChangeArgs),
}

#[derive(Args, Debug)]
pub struct AddLearnerArgs {
    #[arg(long)]
    id: u64,
    /// The node's gRPC address (host:port) as the other nodes reach it.
    #[arg(long)]
    addr: String,
    /// Only this shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
}

#[derive(Args, Debug)]
pub struct ChangeArgs {
    #[arg(long)]
    id: u64,
    /// Only this shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
    /// Remove the node even if it is the last reachable one holding a shard's whole
    /// audit trail and no member left holds it yet (by default the change waits, up to
    /// --timeout, for the members left to copy it).
    #[arg(long)]
    allow_audit_loss: bool,
}

#[derive(Serialize)]
struct MemberRow {
    shard: u32,
    leader: Option<u64>,
    leader_addr: String,
    term: u64,
    voters: Vec<u64>,
    learners: Vec<u64>,
}

pub async fn run(ctx: &Ctx, cmd: MemberCmd) -> anyhow::Result<()> {
    match cmd {
        MemberCmd::List => {
            let views = shard_views(ctx).await?;
            print_rows(ctx, views.values())
        }
        MemberCmd::AddLearner(a) => add_learner(ctx, a).await,
        MemberCmd::Promote(a) => change(ctx, a, true).await,
        MemberCmd::Remove(a) => change(ctx, a, false).await,
    }
}

/// Each shard's status as its leader reports it (or the first replica that answered).
async fn shard_views(ctx: &Ctx) -> anyhow::Result<BTreeMap<u32, ShardStatus>> {
    let mut views: BTreeMap<u32, ShardStatus> = BTreeMap::new();
    let mut errors = Vec::new();
    for addr in ctx.client.endpoints() {
        match ctx.client.status_of(addr).await {
            Ok(s) => {
                for sh in s.shards {
                    let better = views
                        .get(&sh.shard)
                        .is_none_or(|v| !v.is_leader && sh.is_leader);
                    if better {
                        views.insert(sh.shard, sh);
                    }
                }
            }
            Err(e) => errors.push(format!("{addr}: {e}")),
        }
    }
    if views.is_empty() {
        anyhow::bail!("no endpoint answered: {}", errors.join("; "));
    }
    for e in errors {
        eprintln!("warning: {e}");
    }
    Ok(views)
}

fn print_rows<'a>(ctx: &Ctx, shards: impl Iterator<Item = &'a ShardStatus>) -> anyhow::Result<()> {
    let rows: Vec<MemberRow> = shards
        .map(|s| MemberRow {
            shard: s.shard,
            leader: (s.leader != 0).then_some(s.leader),
            leader_addr: s.leader_addr.clone(),
            term: s.term,
            voters: s.voters.clone(),
            learners: s.learners.clone(),
        })
        .collect();
    let mut t = Table::new(&[
        "SHARD",
        "LEADER",
        "LEADER ADDR",
        "TERM",
        "VOTERS",
        "LEARNERS",
    ]);
    for r in &rows {
        t.row(vec![
            r.shard.to_string(),
            r.leader.map_or("-".into(), |l| l.to_string()),
            r.leader_addr.clone(),
            r.term.to_string(),
            list(&r.voters),
            list(&r.learners),
        ]);
    }
    show(ctx.format, &rows, &[t])
}

async fn add_learner(ctx: &Ctx, a: AddLearnerArgs) -> anyhow::Result<()> {
    if a.id == 0 || !a.addr.contains(':') {
        return Err(usage("--id must be positive and --addr host:port"));
    }
    let shards = ctx.shards_or_all(a.shard).await?;
    let mut out = Vec::new();
    for shard in shards {
        let member = Member {
            node_id: a.id,
            addr: a.addr.clone(),
        };
        let reply = ctx
            .admin_retry(
                &format!("adding learner {} to shard {shard}", a.id),
                |mut c| {
                    let req = ctx.admin_req(MemberRequest {
                        shard,
                        all_shards: false,
                        member: Some(member.clone()),
                    });
                    async move { c.add_learner(req).await }
                },
            )
            .await?;
        out.extend(reply.shards);
    }
    print_rows(ctx, out.iter())
}

/// How many times a change is computed again after the membership changed under it.
const MEMBERSHIP_READS_MAX: usize = 5;

async fn change(ctx: &Ctx, a: ChangeArgs, promote: bool) -> anyhow::Result<()> {
    let targets = ctx.shards_or_all(a.shard).await?;
    let mut views = shard_views(ctx).await?;
    let mut out = Vec::new();
    for shard in targets {
        let what = format!(
            "{} node {} on shard {shard}",
            if promote { "promoting" } else { "removing" },
            a.id
        );
        let mut reads = 0;
        loop {
            let view = views
                .get(&shard)
                .ok_or_else(|| anyhow::anyhow!("no replica of shard {shard} answered"))?
                .clone();
            // Read again after a refusal: a retried change that was made (its answer
            // lost) finds the membership already as asked.
            if reads > 0 && view.voters.contains(&a.id) == promote {
                out.push(view);
                break;
            }
            let voters = new_voters(&view, a.id, promote)?;
            // A compare-and-set on the membership this voter set was computed from
            // (a previous-release leader ignores it).
            let expected = view.membership_index;
            let reply = ctx
                .admin_retry(&what, |mut c| {
                    let req = ctx.admin_req(ChangeMembershipRequest {
                        shard,
                        all_shards: false,
                        voters: voters.clone(),
                        allow_audit_loss: a.allow_audit_loss,
                        expected_membership_index: Some(expected),
                    });
                    async move {
                        match c.change_membership(req).await {
                            Ok(r) => Ok(r.map(Some)),
                            Err(s) if reason(&s) == Some("MEMBERSHIP_CHANGED") => {
                                Ok(tonic::Response::new(None))
                            }
                            Err(s) => Err(s),
                        }
                    }
                })
                .await?;
            match reply {
                Some(reply) => {
                    out.extend(reply.shards);
                    break;
                }
                None if reads + 1 < MEMBERSHIP_READS_MAX => {
                    reads += 1;
                    // A lagging view catches up meanwhile.
                    tokio::time::sleep(std::time::Duration::from_millis(200 * reads as u64)).await;
                    views = shard_views(ctx).await?;
                }
                None => anyhow::bail!(
                    "{what}: the membership kept changing under the change \
                     ({MEMBERSHIP_READS_MAX} reads): not changed by this command (read it with \
                     `allotctl member list`)"
                ),
            }
        }
    }
    print_rows(ctx, out.iter())
}

fn reason(s: &tonic::Status) -> Option<&str> {
    s.metadata()
        .get(allot_proto::meta::REASON)
        .and_then(|v| v.to_str().ok())
}

/// The voter set after promoting or removing `id`, checked against the current one.
fn new_voters(view: &ShardStatus, id: u64, promote: bool) -> anyhow::Result<Vec<u64>> {
    let mut voters = view.voters.clone();
    let shard = view.shard;
    if promote {
        if voters.contains(&id) {
            anyhow::bail!("node {id} is already a voter of shard {shard}");
        }
        if !view.learners.contains(&id) {
            anyhow::bail!(
                "node {id} is not a learner of shard {shard}: add it first (member add-learner)"
            );
        }
        voters.push(id);
    } else {
        if !voters.contains(&id) {
            anyhow::bail!(
                "node {id} is not a voter of shard {shard} (voters: {})",
                list(&voters)
            );
        }
        voters.retain(|v| *v != id);
        if voters.is_empty() {
            anyhow::bail!("node {id} is the last voter of shard {shard}");
        }
    }
    voters.sort_unstable();
    Ok(voters)
}
