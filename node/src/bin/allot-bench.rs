//! `allot-bench`: the replicated benchmark. Starts a local cluster of real `allot-node`
//! processes (loopback, fsync on), funds every shard, then for each concurrency level
//! runs that many clients, each sending ledger commands (hold → capture → release) one
//! RPC at a time, `--per-call` commands per RPC, and prints committed commands/s and
//! latency percentiles. A last run paces the clients to half the peak throughput and
//! reports its latency.
//!
//!   allot-bench [--nodes 3] [--shards 4] [--seconds 10] [--concurrency 1,64,512] [--json]

use allot_node::local_cluster::{node_binary, Client, LocalCluster};
use allot_node::workload::{self, HoldCycle};
use anyhow::{bail, Context};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Opts {
    nodes: u64,
    shards: u32,
    seconds: u64,
    concurrency: Vec<usize>,
    per_call: usize,
    json: bool,
    dir: Option<std::path::PathBuf>,
    node_args: Vec<String>,
}

fn parse() -> anyhow::Result<Opts> {
    let mut o = Opts {
        nodes: 3,
        shards: 4,
        seconds: 10,
        concurrency: vec![1, 64, 512],
        per_call: 1,
        json: false,
        dir: None,
        node_args: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--nodes" => o.nodes = val()?.parse()?,
            "--shards" => o.shards = val()?.parse()?,
            "--seconds" => o.seconds = val()?.parse()?,
            "--per-call" => o.per_call = val()?.parse()?,
            "--concurrency" => {
                o.concurrency = val()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--dir" => o.dir = Some(val()?.into()),
            "--node-arg" => o.node_args.push(val()?),
            "--json" => o.json = true,
            "-h" | "--help" => {
                println!("allot-bench [--nodes 3] [--shards 4] [--seconds 10] [--concurrency 1,64,512] [--per-call 1] [--node-arg FLAG]... [--dir DIR] [--json]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other} (see --help)"),
        }
    }
    if o.nodes == 0
        || o.shards == 0
        || o.seconds == 0
        || o.per_call == 0
        || o.concurrency.contains(&0)
    {
        bail!("--nodes, --shards, --seconds, --per-call and --concurrency must be positive");
    }
    Ok(o)
}

/// The stage columns of the second table and their JSON names.
const STAGES: [&str; 6] = [
    "queue",
    "append",
    "local_flush",
    "replicate",
    "apply",
    "follower_append",
];

#[derive(Debug)]
struct RunResult {
    label: String,
    clients: usize,
    commands: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Upper bound of the server-side histogram bucket holding the 99th percentile of
    /// `execute` as the nodes measured it (request in → reply out), for this run only.
    server_p99_ms: f64,
    /// The same for a proposal's commit + apply (its queue wait is the first of
    /// `stages`).
    commit_p99_ms: f64,
    /// The commit split on the leaders' timelines, (p50, p99) bucket bounds of each:
    /// queue wait, RaftCore writing the entry, the leader's fsync, the followers'
    /// acknowledgement, apply and answer; and the followers' own time to answer an
    /// AppendEntries. Named as in [`STAGES`].
    stages: Vec<(f64, f64)>,
    /// The same for the nodes' WAL fsyncs, and the bucket of the slowest fsync and of
    /// the slowest commit.
    wal_p99_ms: f64,
    wal_max_ms: f64,
    commit_max_ms: f64,
    /// Snapshots the nodes built during the run (every replica counts), and the bucket
    /// bound of the longest clone (under the apply lock) and encoding among them.
    snapshots: u64,
    snap_clone_max_ms: f64,
    snap_encode_max_ms: f64,
}

/// Cumulative histogram buckets (le in seconds → count) of the series of `metric` whose
/// labels contain `filter`, summed over the nodes.
async fn server_buckets(metrics: &[String], metric: &str, filter: &str) -> Vec<(f64, f64)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sum: std::collections::BTreeMap<u64, f64> = Default::default();
    for addr in metrics {
        let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
            continue;
        };
        if s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .is_err()
        {
            continue;
        }
        let mut body = String::new();
        if s.read_to_string(&mut body).await.is_err() {
            continue;
        }
        for line in body.lines() {
            let Some(rest) = line
                .strip_prefix(metric)
                .and_then(|r| r.strip_prefix("_bucket{"))
            else {
                continue;
            };
            if !rest.contains(filter) {
                continue;
            }
            let Some(le) = rest.split("le=\"").nth(1).and_then(|x| x.split('"').next()) else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            let count: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|c| c.parse().ok())
                .unwrap_or(0.0);
            *sum.entry((le * 1e6).min(u64::MAX as f64) as u64)
                .or_default() += count;
        }
    }
    sum.into_iter().map(|(k, v)| (k as f64 / 1e6, v)).collect()
}

fn server_p99(before: &[(f64, f64)], after: &[(f64, f64)]) -> f64 {
    server_quantile(before, after, 0.99)
}

/// Observations a histogram gained between two scrapes.
fn server_count(before: &[(f64, f64)], after: &[(f64, f64)]) -> u64 {
    let total = |b: &[(f64, f64)]| b.last().map_or(0.0, |x| x.1);
    (total(after) - total(before)).max(0.0) as u64
}

/// Upper bound (ms) of the bucket holding quantile `q` of what a histogram gained
/// between two scrapes; NaN when it gained nothing.
fn server_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            (
                *le,
                c - before.iter().find(|b| b.0 == *le).map_or(0.0, |b| b.1),
            )
        })
        .collect();
    let total = delta.last().map_or(0.0, |d| d.1);
    delta
        .iter()
        .find(|(_, c)| *c >= q * total && total > 0.0)
        .map_or(f64::NAN, |(le, _)| le * 1e3)
}

/// A figure as a JSON number, `null` when there is none (NaN).
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "null".into()
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[allow(clippy::too_many_arguments)]
async fn run(
    client: &Client,
    metrics: &[String],
    o: &Opts,
    clients: usize,
    stream_base: u64,
    pace: Option<f64>,
    label: &str,
) -> anyhow::Result<RunResult> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let exec = ("allot_request_seconds", "method=\"execute\"");
    let queue = ("allot_proposal_stage_seconds", "stage=\"queue\"");
    let commit = ("allot_proposal_stage_seconds", "stage=\"commit\"");
    let wal = ("allot_wal_sync_seconds", "le=");
    let clone = ("allot_snapshot_seconds", "stage=\"clone\"");
    let encode = ("allot_snapshot_seconds", "stage=\"encode\"");
    let append = ("allot_proposal_stage_seconds", "stage=\"append\"");
    let flush = ("allot_proposal_stage_seconds", "stage=\"local_flush\"");
    let replicate = ("allot_proposal_stage_seconds", "stage=\"replicate\"");
    let apply = ("allot_proposal_stage_seconds", "stage=\"apply\"");
    let follower = ("allot_follower_append_seconds", "le=");
    let scrape = || async {
        [
            server_buckets(metrics, exec.0, exec.1).await,
            server_buckets(metrics, queue.0, queue.1).await,
            server_buckets(metrics, commit.0, commit.1).await,
            server_buckets(metrics, wal.0, wal.1).await,
            server_buckets(metrics, clone.0, clone.1).await,
            server_buckets(metrics, encode.0, encode.1).await,
            server_buckets(metrics, append.0, append.1).await,
            server_buckets(metrics, flush.0, flush.1).await,
            server_buckets(metrics, replicate.0, replicate.1).await,
            server_buckets(metrics, apply.0, apply.1).await,
            server_buckets(metrics, follower.0, follower.1).await,
        ]
    };
    let before = scrape().await;
    let started = Instant::now();
    // One connection pool per 32 clients, as separate client processes would have: a
    // single HTTP/2 connection for 512 callers serialises them in its driver task.
    let pools: Vec<Client> = (0..clients.div_ceil(32)).map(|_| client.fresh()).collect();
    for w in 0..clients {
        let client = pools[w / 32].clone();
        let stop = stop.clone();
        let shard = (w % o.shards as usize) as u32;
        let per_call = o.per_call;
        // Per-client interval when paced: `pace` calls/s over all clients.
        let interval = pace.map(|r| Duration::from_secs_f64(clients as f64 / r));
        tasks.push(tokio::spawn(async move {
            let mut cycle = HoldCycle::new(stream_base + w as u64, 3_000_000);
            let mut lat = Vec::new();
            let mut commands = 0u64;
            // Paced clients start at evenly spread phases: identical phases would send
            // every client's call at the same instant, a burst per interval.
            let mut next = Instant::now()
                + interval.map_or(Duration::ZERO, |iv| iv * w as u32 / clients as u32);
            while !stop.load(Ordering::Relaxed) {
                if let Some(iv) = interval {
                    next += iv;
                    let now = Instant::now();
                    if next > now {
                        tokio::time::sleep(next - now).await;
                    }
                }
                let reqs: Vec<_> = (0..per_call).map(|_| cycle.request()).collect();
                let t = Instant::now();
                let (outs, _) = client.execute(shard, &reqs).await?;
                lat.push(t.elapsed());
                if let Some(bad) = outs.iter().find(|o| o.is_err()) {
                    bail!("a benchmark command failed: {bad:?}");
                }
                commands += outs.len() as u64;
            }
            Ok::<_, anyhow::Error>((commands, lat))
        }));
    }
    let total = Duration::from_secs(o.seconds);
    let mut last = 0u64;
    while started.elapsed() < total {
        tokio::time::sleep(Duration::from_secs(1)).await;
        last += 1;
        if !o.json {
            eprint!("\r  {label}: {clients} clients, {last}/{} s", o.seconds);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut commands = 0;
    let mut lat = Vec::new();
    for t in tasks {
        let (c, l) = t.await??;
        commands += c;
        lat.extend(l);
    }
    let seconds = started.elapsed().as_secs_f64();
    if !o.json {
        eprintln!();
    }
    lat.sort_unstable();
    let after = scrape().await;
    Ok(RunResult {
        snapshots: server_count(&before[4], &after[4]),
        snap_clone_max_ms: server_quantile(&before[4], &after[4], 1.0),
        snap_encode_max_ms: server_quantile(&before[5], &after[5], 1.0),
        wal_p99_ms: server_p99(&before[3], &after[3]),
        wal_max_ms: server_quantile(&before[3], &after[3], 1.0),
        commit_max_ms: server_quantile(&before[2], &after[2], 1.0),
        server_p99_ms: server_p99(&before[0], &after[0]),
        commit_p99_ms: server_p99(&before[2], &after[2]),
        stages: [1, 6, 7, 8, 9, 10]
            .iter()
            .map(|&i| {
                (
                    server_quantile(&before[i], &after[i], 0.5),
                    server_p99(&before[i], &after[i]),
                )
            })
            .collect(),
        label: label.to_string(),
        clients,
        commands,
        seconds,
        p50_ms: pct(&lat, 0.50),
        p99_ms: pct(&lat, 0.99),
        max_ms: lat.last().map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let o = parse()?;
    let tmp;
    let dir = match &o.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new().prefix("allot-bench-").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let mut c = LocalCluster::new(node_binary()?, dir.clone(), o.nodes, o.shards)?;
    // The benchmark measures the replicated core with one tenant far above a tenant's
    // default rate limit: the per-tenant write limit is off unless a --node-arg sets it.
    let mut node_args = o.node_args.clone();
    if !node_args.iter().any(|a| a == "--rate-limit") {
        node_args.extend(["--rate-limit".to_string(), "0".to_string()]);
    }
    for n in &mut c.nodes {
        n.extra_args = node_args.clone();
    }
    if !o.json {
        eprintln!(
            "starting {} nodes × {} shards in {}",
            o.nodes,
            o.shards,
            dir.display()
        );
    }
    c.start_all()?;
    c.init().await?;
    c.wait_leaders(Duration::from_secs(60)).await?;
    let client = allot_node::local_cluster::client(c.endpoints());
    for s in 0..o.shards {
        let (outs, _) = client
            .execute(
                s,
                &workload::setup(allot_statemachine::limits::AMOUNT_MICRO_MAX / 10),
            )
            .await?;
        if let Some(bad) = outs.iter().find(|x| x.is_err()) {
            bail!("setup failed on shard {s}: {bad:?}");
        }
    }
    let metrics: Vec<String> = c.nodes.iter().map(|n| n.metrics_addr.clone()).collect();
    let mut results = Vec::new();
    let mut stream = 1u64 << 20;
    for &clients in &o.concurrency {
        results.push(run(&client, &metrics, &o, clients, stream, None, "closed loop").await?);
        stream += clients as u64;
    }
    if let Some(peak) = results
        .iter()
        .max_by(|a, b| (a.commands as f64 / a.seconds).total_cmp(&(b.commands as f64 / b.seconds)))
    {
        let half_rate = peak.commands as f64 / peak.seconds / 2.0 / o.per_call as f64;
        let clients = peak.clients;
        results.push(
            run(
                &client,
                &metrics,
                &o,
                clients,
                stream,
                Some(half_rate),
                "half of peak",
            )
            .await?,
        );
    }
    if o.json {
        let rows: Vec<String> = results
            .iter()
            .map(|r| {
                format!(
                    "{{\"run\":\"{}\",\"clients\":{},\"per_call\":{},\"commands\":{},\"seconds\":{:.2},\"commands_per_s\":{:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3},\"server_p99_ms_le\":{},\"commit_p99_ms_le\":{},{}\"wal_sync_p99_ms_le\":{},\"wal_sync_max_ms_le\":{},\"commit_max_ms_le\":{},\"snapshots\":{},\"snapshot_clone_max_ms_le\":{},\"snapshot_encode_max_ms_le\":{}}}",
                    r.label, r.clients, o.per_call, r.commands, r.seconds, r.commands as f64 / r.seconds, r.p50_ms, r.p99_ms, r.max_ms, json_num(r.server_p99_ms), json_num(r.commit_p99_ms), STAGES.iter().zip(&r.stages).map(|(n, (p50, p99))| format!("\"{n}_p50_ms_le\":{},\"{n}_p99_ms_le\":{},", json_num(*p50), json_num(*p99))).collect::<String>(), json_num(r.wal_p99_ms), json_num(r.wal_max_ms), json_num(r.commit_max_ms), r.snapshots, json_num(r.snap_clone_max_ms), json_num(r.snap_encode_max_ms)
                )
            })
            .collect();
        println!(
            "{{\"nodes\":{},\"shards\":{},\"results\":[{}]}}",
            o.nodes,
            o.shards,
            rows.join(",")
        );
    } else {
        println!("allot replicated benchmark: {} nodes, {} shards, fsync on, loopback, {} command(s) per call", o.nodes, o.shards, o.per_call);
        println!(
            "{:<14} {:>8} {:>12} {:>10} {:>10} {:>10} {:>16} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>9} {:>10}",
            "run",
            "clients",
            "commands/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "server p99 ≤ ms",
            "queue ≤",
            "commit ≤",
            "max ≤",
            "fsync ≤",
            "max ≤",
            "snaps",
            "clone ≤",
            "encode ≤"
        );
        for r in &results {
            println!(
                "{:<14} {:>8} {:>12.0} {:>10.2} {:>10.2} {:>10.2} {:>16} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>9} {:>10}",
                r.label,
                r.clients,
                r.commands as f64 / r.seconds,
                r.p50_ms,
                r.p99_ms,
                r.max_ms,
                r.server_p99_ms,
                r.stages[0].1,
                r.commit_p99_ms,
                r.commit_max_ms,
                r.wal_p99_ms,
                r.wal_max_ms,
                r.snapshots,
                r.snap_clone_max_ms,
                r.snap_encode_max_ms
            );
        }
        println!(
            "\nwhere the commit time goes (p50 / p99 of each stage, bucket upper bounds in ms; the leaders' own timelines, and the followers' answers to AppendEntries):"
        );
        print!("{:<14} {:>8}", "run", "clients");
        for n in STAGES {
            print!(" {n:>16}");
        }
        println!();
        for r in &results {
            print!("{:<14} {:>8}", r.label, r.clients);
            for (p50, p99) in &r.stages {
                print!(" {:>16}", format!("{p50} / {p99}"));
            }
            println!();
        }
    }
    drop(c);
    Ok(())
}
