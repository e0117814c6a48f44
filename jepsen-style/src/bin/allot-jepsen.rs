//! `allot-jepsen`: fault-injection runs against real `allot-node` processes.
//!
//! ```text
//! allot-jepsen run --workload ledger-bank --nemesis kill,partition --time-limit 30 --seed 7
//! allot-jepsen profile ci          # every workload, every nemesis at least once, ≤ 5 min
//! allot-jepsen profile long        # soak: every workload × every nemesis
//! allot-jepsen check --workload register --history runs/…/history.jsonl
//! ```
//! Exits non-zero on any checker violation, and when a cluster cannot start.

use allot_jepsen::history::read_jsonl;
use allot_jepsen::nemesis::Nemesis;
use allot_jepsen::rng::clock_seed;
use allot_jepsen::run::{profile, run, RunConfig, RunReport};
use allot_jepsen::workloads::{check, Workload};
use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "allot-jepsen",
    version,
    about = "Fault-injection runs with history checkers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// One run per workload given, under the given nemeses.
    Run {
        /// Workloads (comma-separated or repeated; default: all).
        #[arg(long, value_delimiter = ',')]
        workload: Vec<Workload>,
        /// Nemeses active in the run (comma-separated or repeated; none: no faults).
        #[arg(long, value_delimiter = ',')]
        nemesis: Vec<Nemesis>,
        /// Seconds of workload and faults per run.
        #[arg(long, default_value_t = 30)]
        time_limit: u64,
        #[command(flatten)]
        common: Common,
    },
    /// A named profile of runs: `ci` (≤ 5 minutes) or `long` (soak, ~30 minutes).
    Profile {
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Runs a workload's checkers over a recorded history (JSON lines).
    Check {
        #[arg(long)]
        workload: Workload,
        #[arg(long)]
        history: PathBuf,
    },
}

#[derive(Args, Clone)]
struct Common {
    /// Seed of the run (printed at start; replay a run with the same seed and flags).
    #[arg(long)]
    seed: Option<u64>,
    /// Nodes in the cluster (3 or 5).
    #[arg(long, default_value_t = 3)]
    nodes: u64,
    /// Concurrent client processes.
    #[arg(long, default_value_t = 4)]
    processes: u32,
    /// The allot-node binary (default: next to this one, or $ALLOT_NODE_BIN).
    #[arg(long)]
    node_bin: Option<PathBuf>,
    /// Directory for the runs (histories, reports, node data).
    #[arg(long, default_value = "jepsen-runs")]
    out: PathBuf,
    /// Extra argument for every node (repeatable), e.g. --node-arg=--chaos-skip-idempotency.
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    node_args: Vec<String>,
    /// Keep node data dirs after passing runs.
    #[arg(long)]
    keep_data: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("allot-jepsen: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<bool> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match cli.cmd {
        Cmd::Check { workload, history } => {
            let ops =
                read_jsonl(&history).with_context(|| format!("reading {}", history.display()))?;
            let verdicts = check(workload, &ops);
            for v in &verdicts {
                println!("{} {:<48} {}", v.mark(), v.checker, v.detail);
            }
            Ok(verdicts.iter().all(|v| v.ok))
        }
        Cmd::Run {
            workload,
            nemesis,
            time_limit,
            common,
        } => {
            let workloads = if workload.is_empty() {
                Workload::ALL.to_vec()
            } else {
                workload
            };
            let mut nem = nemesis;
            nem.sort();
            nem.dedup();
            let runs = workloads
                .into_iter()
                .map(|w| (w, nem.clone(), time_limit))
                .collect();
            rt.block_on(run_all(runs, common))
        }
        Cmd::Profile { name, common } => {
            let Some(runs) = profile(&name) else {
                bail!("unknown profile {name:?} (ci or long)");
            };
            rt.block_on(run_all(runs, common))
        }
    }
}

async fn run_all(runs: Vec<(Workload, Vec<Nemesis>, u64)>, c: Common) -> anyhow::Result<bool> {
    if c.nodes != 3 && c.nodes != 5 {
        bail!("--nodes must be 3 or 5 (got {})", c.nodes);
    }
    if c.processes == 0 || c.processes > 64 {
        bail!("--processes must be between 1 and 64 (got {})", c.processes);
    }
    if runs.iter().any(|r| r.2 == 0 || r.2 > 24 * 3600) {
        bail!("--time-limit must be between 1 and 86400 seconds");
    }
    let node_bin = match c.node_bin {
        Some(p) => p,
        None => allot_node::local_cluster::node_binary()?,
    };
    let seed = c.seed.unwrap_or_else(clock_seed);
    println!(
        "allot-jepsen: seed {seed} ({} run(s); node binary {})",
        runs.len(),
        node_bin.display()
    );
    let mut reports: Vec<RunReport> = Vec::new();
    for (i, (w, nem, secs)) in runs.into_iter().enumerate() {
        let run_seed = seed.wrapping_add(i as u64);
        let names: Vec<&str> = nem.iter().map(|n| n.name()).collect();
        let dir = c.out.join(format!(
            "{}-{}-{}",
            w.name(),
            if names.is_empty() {
                "none".into()
            } else {
                names.join("+")
            },
            run_seed
        ));
        println!(
            "-- run {}: {} × [{}] for {secs} s, seed {run_seed}",
            i + 1,
            w.name(),
            names.join(",")
        );
        let cfg = RunConfig {
            workload: w,
            nemeses: nem,
            time_limit: Duration::from_secs(secs),
            seed: run_seed,
            nodes: c.nodes,
            processes: c.processes,
            node_bin: node_bin.clone(),
            dir,
            node_args: c.node_args.clone(),
            keep_data: c.keep_data,
        };
        let r = run(cfg).await?;
        r.print();
        reports.push(r);
    }
    println!();
    println!("| workload | nemeses | seed | s | ok | fail | info | nemesis events | verdict |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &reports {
        let names: Vec<&str> = r.nemeses.iter().map(|n| n.name()).collect();
        let failed: Vec<&str> = r
            .verdicts
            .iter()
            .filter(|v| !v.ok)
            .map(|v| v.checker.as_str())
            .collect();
        println!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
            r.workload.name(),
            names.join("+"),
            r.seed,
            r.elapsed_s,
            r.ok,
            r.fail,
            r.info,
            r.nemesis_events,
            if failed.is_empty() {
                let unknown: Vec<&str> = r
                    .verdicts
                    .iter()
                    .filter(|v| v.unknown)
                    .map(|v| v.checker.as_str())
                    .collect();
                if unknown.is_empty() {
                    "PASS".to_string()
                } else {
                    format!("PASS, UNKNOWN: {}", unknown.join(", "))
                }
            } else {
                format!("FAIL: {}", failed.join(", "))
            }
        );
    }
    Ok(reports.iter().all(RunReport::passed))
}
