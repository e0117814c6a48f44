//! GPU nodes of a shard's pool: `node register|drain|list`.

use crate::connect::Ctx;
use crate::output::{list, show, Table};
use crate::timefmt::{format_duration_ms, now_ms};
use crate::values;
use allot_statemachine::scheduler::GpuNode;
use allot_statemachine::{GpuType, NodeId, NodeSpec};
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Registers a GPU node in a shard's pool (re-registering the same shape updates its
    /// labels, and renews its lease only while no agent process has registered it —
    /// from rule version 6; the node's agent keeps it alive with heartbeats).
    Register(RegisterArgs),
    /// Drains a node (no new placements; running jobs finish), or with --undo returns it
    /// to service.
    Drain {
        #[arg(long)]
        shard: u32,
        #[arg(long)]
        node: u64,
        #[arg(long)]
        undo: bool,
    },
    /// The nodes of a shard's pool (every shard if --shard is omitted).
    List {
        #[arg(long)]
        shard: Option<u32>,
    },
}

#[derive(Args, Debug)]
pub struct RegisterArgs {
    #[arg(long)]
    shard: u32,
    #[arg(long)]
    node: u64,
    #[arg(long, value_parser = values::gpu_type)]
    gpu_type: GpuType,
    /// GPUs on the node (1..=16).
    #[arg(long)]
    gpus: u32,
    /// Memory per GPU, GB.
    #[arg(long)]
    mem_gb: u32,
    /// A `key=value` label; repeat for more.
    #[arg(long = "label", value_parser = values::label)]
    labels: Vec<(String, String)>,
}

pub async fn run(ctx: &Ctx, cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Register(a) => register(ctx, a).await,
        NodeCmd::Drain { shard, node, undo } => {
            let node = NodeId(node);
            ctx.shards_or_all(Some(shard)).await?;
            ctx.client
                .set_node_draining(shard, node, !undo)
                .await
                .with_context(|| {
                    format!("{} {node}", if undo { "undraining" } else { "draining" })
                })?;
            print_nodes(ctx, &nodes_of(ctx, Some(shard), Some(node)).await?)
        }
        NodeCmd::List { shard } => print_nodes(ctx, &nodes_of(ctx, shard, None).await?),
    }
}

async fn register(ctx: &Ctx, a: RegisterArgs) -> anyhow::Result<()> {
    ctx.shards_or_all(Some(a.shard)).await?;
    let mut labels = a.labels.clone();
    labels.sort();
    let node = NodeId(a.node);
    let spec = NodeSpec {
        node,
        gpu_type: a.gpu_type.clone(),
        gpu_count: a.gpus,
        gpu_mem_gb: a.mem_gb,
        labels,
        incarnation: 0,
    };
    ctx.client
        .register_node(a.shard, spec)
        .await
        .with_context(|| format!("registering {node} in shard {}", a.shard))?;
    print_nodes(ctx, &nodes_of(ctx, Some(a.shard), Some(node)).await?)
}

async fn nodes_of(
    ctx: &Ctx,
    shard: Option<u32>,
    only: Option<NodeId>,
) -> anyhow::Result<Vec<(u32, GpuNode)>> {
    let mut out = Vec::new();
    for s in ctx.shards_or_all(shard).await? {
        for n in ctx.client.nodes(s).await? {
            if only.is_none_or(|id| id == n.id) {
                out.push((s, n));
            }
        }
    }
    Ok(out)
}

fn print_nodes(ctx: &Ctx, nodes: &[(u32, GpuNode)]) -> anyhow::Result<()> {
    let now = now_ms();
    let json: Vec<serde_json::Value> = nodes
        .iter()
        .map(|(shard, n)| {
            let mut v = serde_json::to_value(n).unwrap_or_default();
            if let Some(m) = v.as_object_mut() {
                m.insert("shard".into(), (*shard).into());
                m.insert("free_gpus".into(), n.free_gpus().into());
                m.insert("jobs".into(), n.jobs().iter().map(|j| j.1 .0).collect());
                let keys: Vec<[u64; 2]> = n.jobs().iter().map(|j| [j.0 .0, j.1 .0]).collect();
                m.insert("job_orgs".into(), serde_json::json!(keys));
            }
            v
        })
        .collect();
    let mut t = Table::new(&[
        "SHARD",
        "NODE",
        "TYPE",
        "STATE",
        "FREE/TOTAL",
        "MEM GB",
        "LEASE",
        "JOBS",
        "LABELS",
    ]);
    for (shard, n) in nodes {
        let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let jobs: Vec<String> = n
            .jobs()
            .iter()
            .map(|j| format!("{}/{}", j.0 .0, j.1 .0))
            .collect();
        t.row(vec![
            shard.to_string(),
            n.id.0.to_string(),
            n.gpu_type.0.clone(),
            format!("{:?}", n.state),
            format!("{}/{}", n.free_gpus(), n.gpu_count),
            n.gpu_mem_gb.to_string(),
            lease_text(n.lease_until_ms, now),
            list(&jobs),
            list(&labels),
        ]);
    }
    show(ctx.format, &json, &[t])
}

fn lease_text(until: u64, now: u64) -> String {
    if until >= now {
        format!("expires in {}", format_duration_ms(until - now))
    } else {
        format!("expired {} ago", format_duration_ms(now - until))
    }
}
