//! `allotctl demand`: the demand signal of a shard's GPU pool (admin only; DESIGN §52) —
//! per GPU type the capacity taking work, the queued work and the wait it implies, and
//! per tier the GPUs that would bring the tier within its target wait.

use crate::connect::{tier_name, Ctx};
use crate::output::{show, Table};
use crate::timefmt::format_duration_ms;
use allot_statemachine::query::TypeDemand;
use allot_statemachine::scheduler::TierConfig;
use clap::Args;
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct DemandArgs {
    /// One shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
    /// The share of its max duration a queued job is expected to run, percent (1-100).
    /// Default 100: every job runs to its bound, the most the queued work can be.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
    run_pct: u32,
}

pub async fn run(ctx: &Ctx, a: DemandArgs) -> anyhow::Result<()> {
    let mut shards = Vec::new();
    for shard in ctx.shards_or_all(a.shard).await? {
        let tiers = ctx.tiers(shard).await?;
        let rows = ctx.client.demand(shard, a.run_pct).await?;
        shards.push((shard, tiers, rows));
    }
    let (json, tables) = render(&shards);
    show(ctx.format, &json, &tables)
}

/// A shard's tiers and demand rows.
type ShardDemand = (u32, Vec<TierConfig>, Vec<TypeDemand>);

/// The JSON document (one object per shard and GPU type, its tiers inside) and the two
/// tables (per type; per type and tier).
fn render(shards: &[ShardDemand]) -> (Value, Vec<Table>) {
    let mut json = Vec::new();
    let mut types = Table::new(&[
        "SHARD",
        "GPU TYPE",
        "CAPACITY",
        "USED",
        "QUEUED",
        "QUEUED GPU-H",
        "WAIT",
    ]);
    let mut tiers = Table::new(&[
        "SHARD",
        "GPU TYPE",
        "TIER",
        "QUEUED",
        "QUEUED GPU-H",
        "WAIT",
        "TARGET",
        "OVERDUE",
        "GPUS NEEDED",
    ]);
    for (shard, config, rows) in shards {
        for r in rows {
            types.row(vec![
                shard.to_string(),
                r.gpu_type.0.clone(),
                r.capacity_gpus.to_string(),
                r.used_gpus.to_string(),
                r.queued_jobs.to_string(),
                gpu_hours(r.queued_gpu_ms),
                wait(r.wait_ms),
            ]);
            let mut tier_json = Vec::new();
            for t in &r.tiers {
                tiers.row(vec![
                    shard.to_string(),
                    r.gpu_type.0.clone(),
                    tier_name(config, t.tier),
                    t.queued_jobs.to_string(),
                    gpu_hours(t.queued_gpu_ms),
                    wait(t.wait_ms),
                    format_duration_ms(t.target_wait_ms),
                    t.overdue_jobs.to_string(),
                    t.gpus_needed.to_string(),
                ]);
                tier_json.push(json!({
                    "tier": t.tier.0,
                    "tier_name": config.get(t.tier.0 as usize).map(|c| c.name.clone()),
                    "queued_jobs": t.queued_jobs,
                    "queued_gpu_ms": t.queued_gpu_ms,
                    "target_wait_ms": t.target_wait_ms,
                    "wait_ms": t.wait_ms,
                    "overdue_jobs": t.overdue_jobs,
                    "overdue_gpus": t.overdue_gpus,
                    "gpus_needed": t.gpus_needed,
                }));
            }
            json.push(json!({
                "shard": shard,
                "gpu_type": r.gpu_type.0,
                "capacity_gpus": r.capacity_gpus,
                "used_gpus": r.used_gpus,
                "queued_jobs": r.queued_jobs,
                "queued_gpu_ms": r.queued_gpu_ms,
                "wait_ms": r.wait_ms,
                "tiers": tier_json,
            }));
        }
    }
    (Value::Array(json), vec![types, tiers])
}

/// GPU-ms as GPU-hours with one decimal.
fn gpu_hours(gpu_ms: u64) -> String {
    let tenths = gpu_ms / 360_000;
    format!("{}.{}", tenths / 10, tenths % 10)
}

/// A wait, or `no capacity` when there is queued work and nothing to run it.
fn wait(ms: Option<u64>) -> String {
    ms.map_or_else(|| "no capacity".into(), format_duration_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_statemachine::query::TierDemand;
    use allot_statemachine::{GpuType, Tier};

    fn tier_config(name: &str, max_wait_ms: u64) -> TierConfig {
        TierConfig {
            name: name.into(),
            weight: 1,
            floor_pct: 0,
            ceiling_pct: 100,
            max_wait_ms,
            price_pct: 100,
        }
    }

    #[test]
    fn demand_renders_as_tables_and_json() {
        let tier = |t: u8, queued_gpu_ms, wait_ms, gpus_needed| TierDemand {
            tier: Tier(t),
            queued_jobs: u64::from(queued_gpu_ms > 0),
            queued_gpu_ms,
            target_wait_ms: [1_800_000, 600_000][t as usize],
            wait_ms,
            overdue_jobs: u64::from(t == 0 && queued_gpu_ms > 0),
            overdue_gpus: if t == 0 && queued_gpu_ms > 0 { 1 } else { 0 },
            gpus_needed,
        };
        let rows = vec![
            TypeDemand {
                gpu_type: GpuType::new("A100"),
                capacity_gpus: 8,
                used_gpus: 8,
                queued_jobs: 1,
                queued_gpu_ms: 14_400_000,
                wait_ms: Some(1_800_000),
                tiers: vec![
                    tier(0, 0, Some(1_800_000), 0),
                    tier(1, 14_400_000, Some(1_800_000), 16),
                ],
            },
            TypeDemand {
                gpu_type: GpuType::new("H100"),
                capacity_gpus: 0,
                used_gpus: 0,
                queued_jobs: 1,
                queued_gpu_ms: 3_600_000,
                wait_ms: None,
                tiers: vec![tier(0, 3_600_000, None, 2), tier(1, 0, Some(0), 0)],
            },
        ];
        let config = vec![tier_config("free", 1_800_000), tier_config("paid", 600_000)];
        let (json, tables) = render(&[(1, config, rows)]);
        assert_eq!(
            tables[0].render(),
            "SHARD  GPU TYPE  CAPACITY  USED  QUEUED  QUEUED GPU-H  WAIT\n\
             1      A100      8         8     1       4.0           30m00s\n\
             1      H100      0         0     1       1.0           no capacity\n"
        );
        let per_tier = tables[1].render();
        assert!(
            per_tier.contains(
                "1      A100      1 (paid)  1       4.0           30m00s       10m00s  0        16"
            ),
            "{per_tier}"
        );
        assert!(
            per_tier.contains(
                "1      H100      0 (free)  1       1.0           no capacity  30m00s  1        2"
            ),
            "{per_tier}"
        );
        assert_eq!(json[0]["gpu_type"], "A100");
        assert_eq!(json[0]["tiers"][1]["tier_name"], "paid");
        assert_eq!(json[0]["tiers"][1]["gpus_needed"], 16);
        assert_eq!(json[1]["wait_ms"], Value::Null, "no capacity: null");
        assert_eq!(json[1]["tiers"][1]["wait_ms"], 0);
        assert_eq!(json[1]["tiers"][0]["overdue_jobs"], 1);
        assert_eq!(json[1]["shard"], 1);
    }
}
