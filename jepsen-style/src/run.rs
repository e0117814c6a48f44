//! One run: start the cluster, set up the workload, run its clients and the nemesis
//! schedule until the time limit, heal everything, take the final read, check
//! replicas, run the checkers, write the history and the report.

use crate::cluster::Cluster;
use crate::history::{pairs, History, OpType};
use crate::nemesis::{self, Nemesis};
use crate::rng::Rng;
use crate::workloads::{self, Ctx, Workload};
use crate::Verdict;
use anyhow::Context;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub workload: Workload,
    pub nemeses: Vec<Nemesis>,
    pub time_limit: Duration,
    pub seed: u64,
    pub nodes: u64,
    pub processes: u32,
    pub node_bin: PathBuf,
    /// The run's directory (cluster data, history.jsonl, report.json).
    pub dir: PathBuf,
    /// Extra `allot-node run` arguments for every node (e.g. a chaos flag).
    pub node_args: Vec<String>,
    /// Keep the nodes' data dirs after a passing run.
    pub keep_data: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub workload: Workload,
    pub nemeses: Vec<Nemesis>,
    pub seed: u64,
    pub time_limit_s: u64,
    pub elapsed_s: f64,
    pub ok: u64,
    pub fail: u64,
    pub info: u64,
    pub nemesis_events: u64,
    /// Faults started, by kind.
    pub nemesis_kinds: std::collections::BTreeMap<String, u64>,
    pub verdicts: Vec<Verdict>,
    pub notes: Vec<String>,
    pub dir: PathBuf,
}

impl RunReport {
    pub fn passed(&self) -> bool {
        self.verdicts.iter().all(|v| v.ok)
    }

    pub fn print(&self) {
        let nem: Vec<&str> = self.nemeses.iter().map(|n| n.name()).collect();
        println!(
            "== {} × [{}] seed {}: {:.0} s, ops ok {} / fail {} / info {}, nemesis events {} — {}",
            self.workload.name(),
            nem.join(","),
            self.seed,
            self.elapsed_s,
            self.ok,
            self.fail,
            self.info,
            self.nemesis_events,
            match (self.passed(), self.verdicts.iter().any(|v| v.unknown)) {
                (false, _) => "FAIL",
                (true, true) => "PASS (some checker could not decide: ??)",
                (true, false) => "PASS",
            }
        );
        for v in &self.verdicts {
            println!("   {} {:<48} {}", v.mark(), v.checker, v.detail);
        }
        println!("   faults: {:?}", self.nemesis_kinds);
        for n in &self.notes {
            println!("   note: {n}");
        }
        println!("   history: {}", self.dir.join("history.jsonl").display());
    }
}

pub async fn run(cfg: RunConfig) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.dir)
        .with_context(|| format!("creating the run directory {}", cfg.dir.display()))?;
    let mut rng = Rng::new(cfg.seed);
    let history = Arc::new(History::default());
    let disk = cfg
        .nemeses
        .contains(&Nemesis::Disk)
        .then_some((cfg.nodes, 256));
    let cluster = Cluster::start(
        cfg.node_bin.clone(),
        cfg.dir.join("cluster"),
        cfg.nodes,
        1,
        &cfg.node_args,
        disk,
    )
    .await?;
    let endpoints = cluster.endpoints();
    let control = workloads::patient_client(endpoints.clone());
    workloads::set_up(cfg.workload, &control)
        .await
        .context("setting up the workload")?;
    let cluster = Arc::new(tokio::sync::Mutex::new(cluster));
    let deadline = Instant::now() + cfg.time_limit;
    let ctx = Arc::new(Ctx {
        history: history.clone(),
        endpoints: endpoints.clone(),
        deadline,
    });
    let nem = tokio::spawn(nemesis::run(
        cluster.clone(),
        cfg.nemeses.clone(),
        rng.fork(0xE3E5),
        history.clone(),
        deadline,
    ));
    workloads::run_clients(ctx, cfg.workload, cfg.processes, &mut rng).await;
    let nemesis_events = nem.await.unwrap_or(0);

    let mut c = cluster.lock().await;
    let mut notes = c.heal_all().await;
    history.nemesis("heal-all", serde_json::json!({"notes": notes}), None);
    let mut verdicts = Vec::new();
    match workloads::final_read(cfg.workload, &control, &history).await {
        Ok(()) => {}
        Err(e) => notes.push(format!("final read: {e:#}")),
    }
    verdicts.push(
        match c.replicas_agree(&control, Duration::from_secs(60)).await {
            Ok(d) => Verdict::pass("replicas-agree-and-invariants", d),
            Err(d) => Verdict::fail("replicas-agree-and-invariants", d),
        },
    );
    drop(c);
    let ops = history.ops();
    verdicts.extend(workloads::check(cfg.workload, &ops));
    if let Some(v) = disk_verdict(&ops) {
        verdicts.push(v);
    }
    let (mut ok, mut fail, mut info) = (0, 0, 0);
    for p in pairs(&ops) {
        if p.invoke.process < 0 {
            continue;
        }
        match p.kind() {
            OpType::Ok => ok += 1,
            OpType::Fail => fail += 1,
            _ => info += 1,
        }
    }
    let mut nemesis_kinds = std::collections::BTreeMap::new();
    for o in &ops {
        if let Some(k) = o.f.strip_prefix("start-") {
            *nemesis_kinds.entry(k.to_string()).or_insert(0) += 1;
        }
    }
    history.write_jsonl(&cfg.dir.join("history.jsonl"))?;
    let report = RunReport {
        workload: cfg.workload,
        nemeses: cfg.nemeses.clone(),
        seed: cfg.seed,
        time_limit_s: cfg.time_limit.as_secs(),
        elapsed_s: started.elapsed().as_secs_f64(),
        ok,
        fail,
        info,
        nemesis_events,
        nemesis_kinds,
        verdicts,
        notes,
        dir: cfg.dir.clone(),
    };
    std::fs::write(
        cfg.dir.join("report.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    // Stop the nodes (and unmount a tmpfs) before removing their data.
    drop(Arc::try_unwrap(cluster).ok());
    if report.passed() && !cfg.keep_data {
        let _ = std::fs::remove_dir_all(cfg.dir.join("cluster"));
    }
    Ok(report)
}

/// A named profile: the runs it makes, as (workload, nemeses, seconds).
pub fn profile(name: &str) -> Option<Vec<(Workload, Vec<Nemesis>, u64)>> {
    use Nemesis::*;
    use Workload::*;
    match name {
        // ≤ 5 minutes on a 2-core machine: every workload, every nemesis at least once.
        "ci" => Some(vec![
            (LedgerBank, vec![Kill, Partition], 20),
            (Idempotency, vec![Pause, Clock], 20),
            (Scheduler, vec![Kill, Membership], 20),
            (Register, vec![Partition, Disk], 22),
        ]),
        // Soak: every workload × every nemesis alone (24 × 30 s), then every workload
        // under all nemeses (4 × 60 s): 16 minutes of faults, about 22 minutes in all.
        // For longer soaks, repeat with other seeds, or `run` with a longer --time-limit.
        "long" => {
            let mut runs = Vec::new();
            for w in Workload::ALL {
                for n in Nemesis::ALL {
                    runs.push((w, vec![n], 30));
                }
            }
            for w in Workload::ALL {
                runs.push((w, Nemesis::ALL.to_vec(), 60));
            }
            Some(runs)
        }
        _ => None,
    }
}

/// The disk nemesis: after ENOSPC or a failed fsync a node must crash cleanly (exit
/// non-zero) — never carry on as if its writes succeeded, and never linger up with its
/// shards stopped. Silent data loss would also show in the workload checkers and in
/// replica agreement; this verdict checks how the node itself behaved.
pub fn disk_verdict(ops: &[crate::history::Op]) -> Option<Verdict> {
    const NAME: &str = "disk/fault-stops-the-node";
    let stops: Vec<&crate::history::Op> = ops.iter().filter(|o| o.f == "stop-disk").collect();
    if stops.is_empty() {
        return None;
    }
    // Kept running *with* a storage error in its log: it did not stop. Kept running
    // without one: the fault never bit (RocksDB's preallocated WAL still had room, so
    // every write succeeded) — nothing failed, so nothing had to stop. The log is on a
    // healthy disk (only the database is on the tmpfs), so its silence is reliable.
    let stayed = stops.iter().find(|o| {
        o.value["kept_running"].as_bool() == Some(true)
            && o.value["storage_error_logged"].as_bool() != Some(false)
    });
    let unbitten = stops
        .iter()
        .filter(|o| o.value["kept_running"].as_bool() == Some(true))
        .count();
    Some(match stayed {
        Some(o) => Verdict::fail(
            NAME,
            format!(
                "op {}: {} fault, the node kept running after a storage error",
                o.index, o.value["variant"]
            ),
        ),
        None => {
            let variants: Vec<String> = stops
                .iter()
                .map(|o| o.value["variant"].as_str().unwrap_or("?").to_string())
                .collect();
            Verdict::pass(
                NAME,
                format!(
                    "{} fault(s) ({}): the node exited after every storage error{}",
                    stops.len(),
                    variants.join(", "),
                    if unbitten > 0 {
                        format!(
                            " ({unbitten} fault(s) did not bite within 5 s: no write failed, \
                             the node rightly went on)"
                        )
                    } else {
                        String::new()
                    }
                ),
            )
        }
    })
}
