//! `allot-bench`: the replicated benchmark. Starts a local cluster of real `allot-node`
//! processes (loopback, fsync on), funds every shard, then for each concurrency level
//! runs that many clients, each sending ledger commands (hold → capture → release) one
//! RPC at a time, `--per-call` commands per RPC, and prints committed commands/s,
//! latency percentiles and the CPU every process of the run (nodes and load generator)
//! spent per committed command. A last run paces the clients to half the peak
//! throughput and reports its latency.
//!
//! `--vs-etcd` first runs the same client counts against a 3-member etcd on loopback
//! (this benchmark's own load generator: 256-byte puts to the leader), then allot at 1
//! and 16 commands per RPC, and prints both side by side with the ratios.
//!
//! `--rate R` runs one paced run of R commands/s instead (a sustained run), reported
//! per `--window` seconds with every node's resident memory.
//!
//! `--leaders-on N` moves every shard's leadership to node N before the runs (the
//! default spreads the leaders over the nodes).
//!
//! `--reads` sends reads that need no consensus instead of writes, one per RPC: allot's
//! `Query::Totals` answered by the shard's leader from its applied state (`stale_ok`),
//! etcd's serializable `KV.Range` of one key. What a call costs without Raft is the
//! floor under what a command costs with it (DESIGN §64).
//!
//!   allot-bench [--nodes 3] [--shards 4] [--seconds 10] [--concurrency 1,64,512]
//!               [--per-call 1[,16]] [--vs-etcd [--etcd-bin etcd] [--value-bytes 256]]
//!               [--rate R [--window S]] [--reads] [--leaders-on N] [--node-arg FLAG]...
//!               [--dir DIR] [--json]

mod etcd;
mod hist;
mod procfs;

use allot_node::local_cluster::{node_binary, Client, LocalCluster};
use allot_node::workload::{self, HoldCycle};
use anyhow::{bail, Context};
use hist::Hist;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: allot-bench [--nodes 3] [--shards 4] [--seconds 10] [--concurrency 1,64,512] [--per-call 1[,16]] [--vs-etcd [--etcd-bin PATH] [--value-bytes 256]] [--rate COMMANDS_PER_S [--window SECONDS]] [--reads] [--leaders-on NODE] [--tls] [--node-arg FLAG]... [--dir DIR] [--json]";

struct Opts {
    nodes: u64,
    shards: u32,
    seconds: u64,
    concurrency: Vec<usize>,
    per_call: Vec<usize>,
    json: bool,
    dir: Option<std::path::PathBuf>,
    node_args: Vec<String>,
    vs_etcd: bool,
    etcd_bin: std::path::PathBuf,
    value_bytes: usize,
    rate: Option<f64>,
    window: u64,
    /// Reads without consensus instead of writes (`--reads`).
    reads: bool,
    /// The node every shard's leadership is moved to (`--leaders-on`).
    leaders_on: Option<u64>,
    /// The allot nodes serve TLS with a development CA, and the load generator calls
    /// them over TLS (`--tls`).
    tls: bool,
}

fn list(v: &str) -> anyhow::Result<Vec<usize>> {
    Ok(v.split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?)
}

fn parse(args: impl IntoIterator<Item = String>) -> anyhow::Result<Opts> {
    let mut o = Opts {
        nodes: 3,
        shards: 4,
        seconds: 10,
        concurrency: Vec::new(),
        per_call: Vec::new(),
        json: false,
        dir: None,
        node_args: Vec::new(),
        vs_etcd: false,
        etcd_bin: "etcd".into(),
        value_bytes: 256,
        rate: None,
        window: 0,
        reads: false,
        leaders_on: None,
        tls: false,
    };
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--nodes" => o.nodes = val()?.parse()?,
            "--shards" => o.shards = val()?.parse()?,
            "--seconds" => o.seconds = val()?.parse()?,
            "--per-call" => o.per_call = list(&val()?)?,
            "--concurrency" => o.concurrency = list(&val()?)?,
            "--dir" => o.dir = Some(val()?.into()),
            "--node-arg" => o.node_args.push(val()?),
            "--json" => o.json = true,
            "--vs-etcd" => o.vs_etcd = true,
            "--etcd-bin" => o.etcd_bin = val()?.into(),
            "--value-bytes" => o.value_bytes = val()?.parse()?,
            "--rate" => o.rate = Some(val()?.parse()?),
            "--window" => o.window = val()?.parse()?,
            "--reads" => o.reads = true,
            "--leaders-on" => o.leaders_on = Some(val()?.parse()?),
            "--tls" => o.tls = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    if o.concurrency.is_empty() {
        o.concurrency = if o.vs_etcd {
            vec![1, 64, 256]
        } else if o.rate.is_some() {
            vec![64]
        } else {
            vec![1, 64, 512]
        };
    }
    if o.per_call.is_empty() {
        o.per_call = if o.vs_etcd && !o.reads {
            vec![1, 16]
        } else {
            vec![1]
        };
    }
    if o.nodes == 0
        || o.shards == 0
        || o.seconds == 0
        || o.per_call.contains(&0)
        || o.concurrency.contains(&0)
        || o.value_bytes == 0
    {
        bail!("--nodes, --shards, --seconds, --per-call, --concurrency and --value-bytes must be positive");
    }
    if let Some(r) = o.rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--rate must be a positive number of commands per second");
        }
        if o.vs_etcd || o.concurrency.len() != 1 || o.per_call.len() != 1 {
            bail!("--rate runs one paced run: one --concurrency, one --per-call, no --vs-etcd");
        }
    } else if o.window != 0 {
        bail!("--window goes with --rate");
    }
    if o.leaders_on.is_some_and(|n| n == 0 || n > o.nodes) {
        bail!("--leaders-on names one of the --nodes (1 to {})", o.nodes);
    }
    if o.tls && o.vs_etcd {
        bail!("--tls measures allot alone: the etcd it is compared with serves plaintext");
    }
    if o.reads && (o.rate.is_some() || o.per_call != [1]) {
        bail!("--reads sends one read per RPC in closed-loop runs: no --rate, --per-call 1");
    }
    if o.window == 0 {
        o.window = o.seconds;
    }
    Ok(o)
}

/// The stage columns of the second table and their JSON names.
const STAGES: [&str; 7] = [
    "queue",
    "append",
    "local_flush",
    "replicate",
    "apply",
    "follower_append",
    "peer_append",
];

/// What the allot nodes' own histograms said about one run.
#[derive(Debug)]
struct Server {
    /// Upper bound of the server-side histogram bucket holding the 99th percentile of
    /// `execute` as the nodes measured it (request in → reply out), for this run only.
    p99_ms: f64,
    /// The same for a proposal's commit + apply (its queue wait is the first of
    /// `stages`).
    commit_p99_ms: f64,
    /// The commit split on the leaders' timelines, (p50, p99) bucket bounds of each:
    /// queue wait, RaftCore writing the entry, the leader's fsync, the followers'
    /// acknowledgement, apply and answer; the followers' own time to answer an
    /// AppendEntries, and the leaders' time from sending one to its answer. Named as in
    /// [`STAGES`]. The third figure is each stage's mean (ms),
    /// from the histograms' sums: finer than the buckets below a millisecond.
    stages: Vec<(f64, f64, f64)>,
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

/// One window of a run (a closed-loop run is one window).
struct Window {
    hist: Hist,
    commands: u64,
    seconds: f64,
    /// CPU seconds of every process of the system under test and of this process.
    cpu_s: f64,
    /// The same per process: the servers in the order they were started, this process
    /// last.
    cpu_by_process: Vec<f64>,
    /// Resident memory of each server process at the window's end.
    rss: Vec<u64>,
    /// What each allot node's memory is made of at the window's end, `None` for a node
    /// whose metrics could not be read (empty for etcd, and for a run of one window).
    memory: Vec<Option<NodeMemory>>,
}

impl Window {
    fn rate(&self) -> f64 {
        self.commands as f64 / self.seconds
    }

    /// CPU µs per committed command (or put).
    fn cpu_us(&self) -> f64 {
        self.cpu_s * 1e6 / self.commands.max(1) as f64
    }

    /// [`Window::cpu_us`] per process.
    fn cpu_us_each(&self) -> impl Iterator<Item = f64> + '_ {
        self.cpu_by_process
            .iter()
            .map(|s| s * 1e6 / self.commands.max(1) as f64)
    }
}

struct RunResult {
    system: &'static str,
    label: String,
    clients: usize,
    per_call: usize,
    total: Window,
    windows: Vec<Window>,
    server: Option<Server>,
}

/// One histogram as scraped, summed over the nodes: its cumulative buckets (le in seconds
/// → count) and the sum of its observations (seconds).
#[derive(Default)]
struct Scraped {
    buckets: Vec<(f64, f64)>,
    sum_s: f64,
}

/// The series of `metric` whose labels contain `filter`, scraped from every node
/// ([`add_histogram`]).
async fn server_buckets(metrics: &[String], metric: &str, filter: &str) -> Scraped {
    let mut sum: std::collections::BTreeMap<u64, f64> = Default::default();
    let mut sum_s = 0.0;
    for addr in metrics {
        let Some(body) = exposition(addr).await else {
            continue;
        };
        add_histogram(&body, metric, filter, &mut sum, &mut sum_s);
    }
    Scraped {
        buckets: sum.into_iter().map(|(k, v)| (k as f64 / 1e6, v)).collect(),
        sum_s,
    }
}

/// One node's metrics exposition, or `None` if it cannot be read within 2 s (a paused
/// or starved node must not hold the run up).
async fn exposition(addr: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).await.ok()?;
        Some(body)
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// What a node's memory is made of at a window's end (DESIGN §63): the rows of its
/// replicas' tables summed over its shards (`allot_state_rows`, by table) and RocksDB's
/// memory summed over its column families (`allot_rocksdb_memory_bytes`, by kind).
#[derive(Clone, Debug, Default, PartialEq)]
struct NodeMemory {
    rows: std::collections::BTreeMap<String, f64>,
    rocksdb_bytes: std::collections::BTreeMap<String, f64>,
}

impl NodeMemory {
    fn parse(body: &str) -> NodeMemory {
        let mut m = NodeMemory::default();
        // `labels` is what follows the metric's `{`: a label starts it or follows a comma.
        let label = |labels: &str, name: &str| -> Option<String> {
            let key = format!("{name}=\"");
            let at = if labels.starts_with(&key) {
                0
            } else {
                labels.find(&format!(",{key}"))? + 1
            };
            let start = at + key.len();
            let len = labels[start..].find('"')?;
            Some(labels[start..start + len].to_string())
        };
        for line in body.lines() {
            let (into, key) = if let Some(rest) = line.strip_prefix("allot_state_rows{") {
                (&mut m.rows, label(rest, "table"))
            } else if let Some(rest) = line.strip_prefix("allot_rocksdb_memory_bytes{") {
                (&mut m.rocksdb_bytes, label(rest, "kind"))
            } else {
                continue;
            };
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(key), Some(value)) = (key, value) {
                *into.entry(key).or_default() += value;
            }
        }
        m
    }

    fn json(&self) -> String {
        let map = |m: &std::collections::BTreeMap<String, f64>| {
            m.iter()
                .map(|(k, v)| format!("\"{k}\":{v:.0}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "{{\"rows\":{{{}}},\"rocksdb_bytes\":{{{}}}}}",
            map(&self.rows),
            map(&self.rocksdb_bytes)
        )
    }
}

/// Adds the series of `metric` in one node's exposition `body` whose labels contain
/// `filter` to `buckets` (le in µs → cumulative count) and `sum_s` (a `_sum` line
/// matches when its labels do, or when `filter` is `le=`, which every bucket carries).
fn add_histogram(
    body: &str,
    metric: &str,
    filter: &str,
    buckets: &mut std::collections::BTreeMap<u64, f64>,
    sum_s: &mut f64,
) {
    for line in body.lines() {
        let Some(after) = line.strip_prefix(metric) else {
            continue;
        };
        if let Some(labels) = after.strip_prefix("_sum") {
            if filter == "le=" || labels.contains(filter) {
                *sum_s += labels
                    .rsplit(' ')
                    .next()
                    .and_then(|c| c.parse::<f64>().ok())
                    .unwrap_or(0.0);
            }
            continue;
        }
        let Some(rest) = after.strip_prefix("_bucket{") else {
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
        *buckets
            .entry((le * 1e6).min(u64::MAX as f64) as u64)
            .or_default() += count;
    }
}

/// Mean (ms) of what a histogram gained between two scrapes; NaN when it gained nothing.
fn server_mean(before: &Scraped, after: &Scraped) -> f64 {
    let n = server_count(&before.buckets, &after.buckets);
    if n == 0 {
        return f64::NAN;
    }
    (after.sum_s - before.sum_s).max(0.0) * 1e3 / n as f64
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

/// A figure as a JSON number with one decimal, `null` when there is none (NaN).
fn json_num(x: f64) -> String {
    json_fixed(x, 1)
}

/// A figure as a JSON number with `decimals` decimals, `null` when there is none (NaN).
fn json_fixed(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "null".into()
    }
}

/// What the clients of a run drive.
#[derive(Clone)]
enum Target {
    Allot { client: Client, shards: u32 },
    Etcd { addr: String, value: bytes::Bytes },
}

struct Spec<'a> {
    label: &'a str,
    clients: usize,
    per_call: usize,
    /// Calls per second over all clients; closed loop when `None`.
    pace: Option<f64>,
    seconds: u64,
    window: u64,
    stream_base: u64,
}

/// One client's calls: one histogram and command count per window.
type ClientStats = (Vec<Hist>, Vec<u64>);

async fn drive(
    target: &Target,
    spec: &Spec<'_>,
    pids: &[u32],
    metrics: &[String],
    o: &Opts,
) -> anyhow::Result<(Window, Vec<Window>)> {
    let json = o.json;
    let stop = Arc::new(AtomicBool::new(false));
    let windows = spec.seconds.div_ceil(spec.window) as usize;
    let started = Instant::now();
    // One connection per 32 clients, as separate client processes would have: a single
    // HTTP/2 connection for 512 callers serialises them in its driver task.
    let pools = spec.clients.div_ceil(32);
    let mut allot_pools = Vec::new();
    let mut etcd_pools = Vec::new();
    match target {
        Target::Allot { client, .. } => {
            allot_pools = (0..pools).map(|_| client.fresh()).collect();
        }
        Target::Etcd { addr, .. } => {
            for _ in 0..pools {
                etcd_pools.push(etcd::connect(addr).await?);
            }
        }
    }
    let mut tasks = Vec::new();
    for w in 0..spec.clients {
        let stop = stop.clone();
        let per_call = spec.per_call;
        let window = Duration::from_secs(spec.window);
        // Per-client interval when paced: `pace` calls/s over all clients.
        let interval = spec
            .pace
            .map(|r| Duration::from_secs_f64(spec.clients as f64 / r));
        let clients = spec.clients;
        let reads = o.reads;
        let stream = spec.stream_base + w as u64;
        let call = match target {
            Target::Allot { shards, .. } => Call::Allot {
                client: allot_pools[w / 32].clone(),
                shard: (w % *shards as usize) as u32,
                cycle: HoldCycle::new(stream, 3_000_000),
            },
            Target::Etcd { value, .. } => Call::Etcd {
                ch: etcd_pools[w / 32].clone(),
                value: value.clone(),
                client: w,
                n: 0,
            },
        };
        tasks.push(tokio::spawn(async move {
            let mut call = call;
            let mut stats: ClientStats = (vec![Hist::default(); windows], vec![0; windows]);
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
                let t = Instant::now();
                let done = if reads {
                    call.read().await?
                } else {
                    call.once(per_call).await?
                };
                let end = Instant::now();
                let i = ((end - started).as_secs_f64() / window.as_secs_f64()) as usize;
                let i = i.min(windows - 1);
                stats.0[i].record(end - t);
                stats.1[i] += done;
            }
            Ok::<_, anyhow::Error>(stats)
        }));
    }
    let mut marks = vec![(0.0, procfs::cpu_each(pids), Vec::new(), Vec::new())];
    // The server processes: every pid but the last, which is the benchmark itself.
    let servers = &pids[..pids.len() - 1];
    let mut last = 0u64;
    while last < spec.seconds {
        let next_tick = started + Duration::from_secs(last + 1);
        tokio::time::sleep_until(next_tick.into()).await;
        last += 1;
        // A server process that died (a full disk, a fatal storage error) would otherwise
        // show only as clients retrying an unreachable address until they give up.
        if let Some(dead) = servers.iter().find(|&&p| !procfs::running(p)) {
            stop.store(true, Ordering::Relaxed);
            bail!(
                "server process {dead} exited during the {} run ({} clients)",
                spec.label,
                spec.clients
            );
        }
        if last.is_multiple_of(spec.window) || last == spec.seconds {
            let rss = servers
                .iter()
                .map(|&p| procfs::rss_bytes(p).unwrap_or(0))
                .collect();
            let at = started.elapsed().as_secs_f64();
            let cpu = procfs::cpu_each(pids);
            let mut memory = Vec::new();
            // Only runs of several windows (the sustained run) follow memory: a
            // closed-loop run is one window and its figures stay as they were.
            if spec.window < spec.seconds {
                for addr in metrics {
                    memory.push(exposition(addr).await.map(|b| NodeMemory::parse(&b)));
                }
            }
            marks.push((at, cpu, rss, memory));
            if spec.window < spec.seconds && !json {
                eprintln!();
            }
        }
        if !json {
            eprint!(
                "\r  {}: {} clients, {last}/{} s",
                spec.label, spec.clients, spec.seconds
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut all: Vec<ClientStats> = Vec::new();
    for t in tasks {
        all.push(t.await??);
    }
    // Calls still in flight at the last mark were counted: the last window ends when
    // they have all come back.
    if let Some(m) = marks.last_mut() {
        m.0 = started.elapsed().as_secs_f64();
        m.1 = procfs::cpu_each(pids);
    }
    if !json {
        eprintln!();
    }
    let mut out = Vec::new();
    for i in 0..windows {
        let mut hist = Hist::default();
        let mut commands = 0;
        for (h, c) in &all {
            hist.merge(&h[i]);
            commands += c[i];
        }
        let (t0, c0, _, _) = &marks[i];
        let (t1, c1, rss, memory) = &marks[(i + 1).min(marks.len() - 1)];
        let cpu = procfs::cpu_between(c0, c1);
        out.push(Window {
            hist,
            commands,
            seconds: t1 - t0,
            cpu_s: cpu.iter().sum(),
            cpu_by_process: cpu,
            rss: rss.clone(),
            memory: memory.clone(),
        });
    }
    let total_cpu = procfs::cpu_between(&marks[0].1, &marks[marks.len() - 1].1);
    let mut total = Window {
        hist: Hist::default(),
        commands: 0,
        seconds: marks.last().map_or(0.0, |m| m.0),
        cpu_s: total_cpu.iter().sum(),
        cpu_by_process: total_cpu,
        rss: marks.last().map(|m| m.2.clone()).unwrap_or_default(),
        memory: marks.last().map(|m| m.3.clone()).unwrap_or_default(),
    };
    for w in &out {
        total.hist.merge(&w.hist);
        total.commands += w.commands;
    }
    Ok((total, out))
}

/// One client's next call.
enum Call {
    Allot {
        client: Client,
        shard: u32,
        cycle: HoldCycle,
    },
    Etcd {
        ch: tonic::transport::Channel,
        value: bytes::Bytes,
        client: usize,
        n: u64,
    },
}

impl Call {
    /// Sends one call; the commands (or puts) it committed.
    async fn once(&mut self, per_call: usize) -> anyhow::Result<u64> {
        match self {
            Call::Allot {
                client,
                shard,
                cycle,
            } => {
                let reqs: Vec<_> = (0..per_call).map(|_| cycle.request()).collect();
                let (outs, _) = client.execute(*shard, &reqs).await?;
                if let Some(bad) = outs.iter().find(|o| o.is_err()) {
                    bail!("a benchmark command failed: {bad:?}");
                }
                Ok(outs.len() as u64)
            }
            Call::Etcd {
                ch,
                value,
                client,
                n,
            } => {
                // A bounded key space per client (1,024 keys), as a real table would
                // overwrite its rows: etcd keeps every revision until compaction.
                *n += 1;
                let key = format!("bench/{client:05}/{:04}", *n % 1024);
                if etcd::put(ch, key.into(), value.clone()).await? <= 0 {
                    bail!("etcd answered a put without a revision");
                }
                Ok(1)
            }
        }
    }

    /// Sends one read that needs no consensus (`--reads`); 1 once answered.
    async fn read(&mut self) -> anyhow::Result<u64> {
        match self {
            Call::Allot { client, shard, .. } => {
                let q = allot_statemachine::query::Query::Totals;
                match client.query_with(*shard, &q, true).await? {
                    allot_statemachine::query::Answer::Totals(_) => Ok(1),
                    other => bail!("a benchmark read was answered with {other:?}"),
                }
            }
            Call::Etcd { ch, client, .. } => {
                let key = format!("bench/{client:05}/0000");
                if etcd::get(ch, key.into()).await? <= 0 {
                    bail!("etcd answered a read without a revision");
                }
                Ok(1)
            }
        }
    }
}

async fn run(
    target: &Target,
    metrics: &[String],
    pids: &[u32],
    o: &Opts,
    spec: Spec<'_>,
) -> anyhow::Result<RunResult> {
    let exec = ("allot_request_seconds", "method=\"api.execute\"");
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
    let peer = ("allot_peer_append_seconds", "le=");
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
            server_buckets(metrics, peer.0, peer.1).await,
        ]
    };
    let before = scrape().await;
    let (total, windows) = drive(target, &spec, pids, metrics, o).await?;
    let after = scrape().await;
    let (b, a) = (|i: usize| &before[i].buckets, |i: usize| &after[i].buckets);
    let server = matches!(target, Target::Allot { .. }).then(|| Server {
        snapshots: server_count(b(4), a(4)),
        snap_clone_max_ms: server_quantile(b(4), a(4), 1.0),
        snap_encode_max_ms: server_quantile(b(5), a(5), 1.0),
        wal_p99_ms: server_p99(b(3), a(3)),
        wal_max_ms: server_quantile(b(3), a(3), 1.0),
        commit_max_ms: server_quantile(b(2), a(2), 1.0),
        p99_ms: server_p99(b(0), a(0)),
        commit_p99_ms: server_p99(b(2), a(2)),
        stages: [1, 6, 7, 8, 9, 10, 11]
            .iter()
            .map(|&i| {
                (
                    server_quantile(b(i), a(i), 0.5),
                    server_p99(b(i), a(i)),
                    server_mean(&before[i], &after[i]),
                )
            })
            .collect(),
    });
    Ok(RunResult {
        system: if server.is_some() { "allot" } else { "etcd" },
        label: spec.label.to_string(),
        clients: spec.clients,
        per_call: spec.per_call,
        total,
        windows,
        server,
    })
}

/// Closed-loop runs at every client count, then the peak's client count paced at half
/// the peak.
async fn series(
    target: &Target,
    metrics: &[String],
    pids: &[u32],
    o: &Opts,
    per_call: usize,
    stream: &mut u64,
) -> anyhow::Result<Vec<RunResult>> {
    let mut results = Vec::new();
    for &clients in &o.concurrency {
        let spec = Spec {
            label: "closed loop",
            clients,
            per_call,
            pace: None,
            seconds: o.seconds,
            window: o.seconds,
            stream_base: *stream,
        };
        results.push(run(target, metrics, pids, o, spec).await?);
        *stream += clients as u64;
    }
    if let Some(peak) = results
        .iter()
        .max_by(|a, b| a.total.rate().total_cmp(&b.total.rate()))
    {
        let spec = Spec {
            label: "half of peak",
            clients: peak.clients,
            per_call,
            pace: Some(peak.total.rate() / 2.0 / per_call as f64),
            seconds: o.seconds,
            window: o.seconds,
            stream_base: *stream,
        };
        *stream += peak.clients as u64;
        results.push(run(target, metrics, pids, o, spec).await?);
    }
    Ok(results)
}

/// Starts the allot cluster, funds every shard, and returns it with its client.
async fn start_allot(o: &Opts, dir: &std::path::Path) -> anyhow::Result<(LocalCluster, Client)> {
    let mut c = LocalCluster::new(node_binary()?, dir.to_path_buf(), o.nodes, o.shards)?;
    // The benchmark measures the replicated core with one tenant far above a tenant's
    // default rate limit: the per-tenant write limit is off unless a --node-arg sets it.
    let mut node_args = o.node_args.clone();
    if !node_args.iter().any(|a| a == "--rate-limit") {
        node_args.extend(["--rate-limit".to_string(), "0".to_string()]);
    }
    for n in &mut c.nodes {
        n.extra_args = node_args.clone();
    }
    if o.tls {
        let certs = dir.join("certs");
        allot_node::tls::write_dev_certs(&certs, &["127.0.0.1".to_string()])?;
        c.tls_dir = Some(certs);
    }
    if !o.json {
        eprintln!(
            "starting {} allot nodes × {} shards in {}{}",
            o.nodes,
            o.shards,
            dir.display(),
            if o.tls { ", serving TLS" } else { "" }
        );
    }
    c.start_all()?;
    c.init().await?;
    c.wait_leaders(Duration::from_secs(60)).await?;
    let client = c.client()?;
    for s in 0..o.shards {
        let mut setup = vec![workload::activate_newest()];
        setup.extend(workload::setup(
            allot_statemachine::limits::AMOUNT_MICRO_MAX / 10,
        ));
        if o.rate.is_some() {
            // A sustained run keeps a day's idempotency records (DESIGN §50).
            setup.push(workload::sustained_quota());
        }
        let (outs, _) = client.execute(s, &setup).await?;
        if let Some(bad) = outs.iter().find(|x| x.is_err()) {
            bail!("setup failed on shard {s}: {bad:?}");
        }
    }
    if let Some(node) = o.leaders_on {
        let admin = c.admin_client()?;
        for s in 0..o.shards {
            if c.leader_of(s).await? != node {
                admin.transfer_leader(s, Some(node)).await?;
            }
        }
        for s in 0..o.shards {
            let deadline = Instant::now() + Duration::from_secs(30);
            while c.leader_of(s).await.ok() != Some(node) {
                if Instant::now() > deadline {
                    bail!("shard {s}'s leadership did not move to node {node}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Ok((c, client))
}

fn etcd_version(bin: &std::path::Path) -> anyhow::Result<String> {
    let out = std::process::Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| {
            format!(
                "running {} --version (install etcd-server, or pass --etcd-bin)",
                bin.display()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("etcd Version: "))
        .unwrap_or("unknown")
        .trim()
        .to_string())
}

fn main() {
    let o = match parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("allot-bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    if let Err(e) = rt.block_on(bench(o)) {
        eprintln!("allot-bench: {e:#}");
        std::process::exit(1);
    }
}

async fn bench(o: Opts) -> anyhow::Result<()> {
    let tmp;
    let dir = match &o.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new().prefix("allot-bench-").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let me = std::process::id();
    let mut results = Vec::new();
    let mut etcd_ver = None;
    if o.vs_etcd {
        let version = etcd_version(&o.etcd_bin)?;
        let edir = dir.join("etcd");
        std::fs::create_dir_all(&edir)?;
        if !o.json {
            eprintln!("starting 3 etcd {version} members in {}", edir.display());
        }
        let cluster = etcd::EtcdCluster::start(&o.etcd_bin, &edir, 3).await?;
        let target = Target::Etcd {
            addr: cluster.leader().await?,
            value: vec![b'v'; o.value_bytes].into(),
        };
        let mut pids = cluster.pids();
        pids.push(me);
        let mut stream = 0;
        results.extend(series(&target, &[], &pids, &o, 1, &mut stream).await?);
        drop(cluster);
        etcd_ver = Some(version);
    }
    let (mut c, client) = start_allot(&o, &dir.join("allot")).await?;
    // Which node led each shard when the runs began.
    let mut leaders = Vec::new();
    for s in 0..o.shards {
        leaders.push(c.leader_of(s).await?);
    }
    let metrics: Vec<String> = c.nodes.iter().map(|n| n.metrics_addr.clone()).collect();
    let mut pids: Vec<u32> = c.nodes.iter().filter_map(|n| c.pid(n.id)).collect();
    pids.push(me);
    let target = Target::Allot {
        client,
        shards: o.shards,
    };
    let mut stream = 1u64 << 20;
    let runs = allot_runs(&o, &target, &metrics, &pids, &mut stream).await;
    // A node that exited during a run (a full disk, a fatal storage error) shows to the
    // clients only as an unreachable address: name it, with the end of its log.
    let results_allot = runs.map_err(|e| match exited_nodes(&mut c) {
        Some(why) => e.context(why),
        None => e,
    })?;
    results.extend(results_allot);
    report(&o, &results, etcd_ver.as_deref(), &leaders);
    drop(c);
    Ok(())
}

/// Which nodes of `c` exited by themselves, each with its status and the end of its log.
fn exited_nodes(c: &mut LocalCluster) -> Option<String> {
    let ids: Vec<u64> = c.nodes.iter().map(|n| n.id).collect();
    let gone: Vec<String> = ids
        .into_iter()
        .filter_map(|id| {
            let status = c.exited(id)?;
            Some(format!(
                "node {id} exited during the run ({status}); its log ends:\n{}",
                c.log_tail(id, 5)
            ))
        })
        .collect();
    (!gone.is_empty()).then(|| gone.join("\n"))
}

/// The allot runs of the benchmark: the sustained run, or the closed-loop series of every
/// per-call size.
async fn allot_runs(
    o: &Opts,
    target: &Target,
    metrics: &[String],
    pids: &[u32],
    stream: &mut u64,
) -> anyhow::Result<Vec<RunResult>> {
    let mut results = Vec::new();
    if let Some(rate) = o.rate {
        let per_call = o.per_call[0];
        let spec = Spec {
            label: "sustained",
            clients: o.concurrency[0],
            per_call,
            pace: Some(rate / per_call as f64),
            seconds: o.seconds,
            window: o.window,
            stream_base: *stream,
        };
        results.push(run(target, metrics, pids, o, spec).await?);
    } else {
        for &per_call in &o.per_call {
            results.extend(series(target, metrics, pids, o, per_call, stream).await?);
        }
    }
    Ok(results)
}

/// A row's figures as JSON fields (without braces).
fn json_window(w: &Window) -> String {
    format!(
        "\"commands\":{},\"seconds\":{:.2},\"commands_per_s\":{:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3},\"cpu_seconds\":{:.2},\"cpu_us_per_command\":{:.1},\"cpu_us_per_command_by_process\":[{}],\"rss_bytes\":[{}],\"memory\":[{}]",
        w.commands,
        w.seconds,
        w.rate(),
        w.hist.quantile_ms(0.5),
        w.hist.quantile_ms(0.99),
        w.hist.max_ms(),
        w.cpu_s,
        w.cpu_us(),
        w.cpu_us_each()
            .map(|c| format!("{c:.1}"))
            .collect::<Vec<_>>()
            .join(","),
        w.rss.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
        w.memory
            .iter()
            .map(|m| m.as_ref().map_or_else(|| "null".to_string(), NodeMemory::json))
            .collect::<Vec<_>>()
            .join(",")
    )
}

fn json_row(r: &RunResult) -> String {
    let mut out = format!(
        "{{\"system\":\"{}\",\"run\":\"{}\",\"clients\":{},\"per_call\":{},{}",
        r.system,
        r.label,
        r.clients,
        r.per_call,
        json_window(&r.total)
    );
    if let Some(s) = &r.server {
        out += &format!(
            ",\"server_p99_ms_le\":{},\"commit_p99_ms_le\":{},{}\"wal_sync_p99_ms_le\":{},\"wal_sync_max_ms_le\":{},\"commit_max_ms_le\":{},\"snapshots\":{},\"snapshot_clone_max_ms_le\":{},\"snapshot_encode_max_ms_le\":{}",
            json_num(s.p99_ms),
            json_num(s.commit_p99_ms),
            STAGES
                .iter()
                .zip(&s.stages)
                .map(|(n, (p50, p99, mean))| format!(
                    "\"{n}_p50_ms_le\":{},\"{n}_p99_ms_le\":{},\"{n}_mean_ms\":{},",
                    json_num(*p50),
                    json_num(*p99),
                    json_fixed(*mean, 3)
                ))
                .collect::<String>(),
            json_num(s.wal_p99_ms),
            json_num(s.wal_max_ms),
            json_num(s.commit_max_ms),
            s.snapshots,
            json_num(s.snap_clone_max_ms),
            json_num(s.snap_encode_max_ms)
        );
    }
    if r.windows.len() > 1 {
        let ws: Vec<String> = r
            .windows
            .iter()
            .map(|w| format!("{{{}}}", json_window(w)))
            .collect();
        out += &format!(",\"windows\":[{}]", ws.join(","));
    }
    out + "}"
}

/// The closed-loop row of `system` at `per_call` and `clients`.
fn find<'a>(
    results: &'a [RunResult],
    system: &str,
    per_call: usize,
    clients: usize,
) -> Option<&'a RunResult> {
    results.iter().find(|r| {
        r.system == system
            && r.per_call == per_call
            && r.clients == clients
            && r.label == "closed loop"
    })
}

/// The side-by-side rows: per client count, etcd and allot at each per-call, and the
/// ratio of allot's throughput to etcd's at the same count (and to etcd's best).
struct Compared {
    clients: usize,
    etcd: (f64, f64, f64),
    allot: Vec<(usize, f64, f64, f64, f64, f64)>,
}

fn compare(o: &Opts, results: &[RunResult]) -> Vec<Compared> {
    let etcd_best = results
        .iter()
        .filter(|r| r.system == "etcd" && r.label == "closed loop")
        .map(|r| r.total.rate())
        .fold(0.0, f64::max);
    o.concurrency
        .iter()
        .filter_map(|&clients| {
            let e = find(results, "etcd", 1, clients)?;
            let allot = o
                .per_call
                .iter()
                .filter_map(|&pc| {
                    let a = find(results, "allot", pc, clients)?;
                    Some((
                        pc,
                        a.total.rate(),
                        a.total.hist.quantile_ms(0.5),
                        a.total.hist.quantile_ms(0.99),
                        a.total.rate() / e.total.rate(),
                        a.total.rate() / etcd_best,
                    ))
                })
                .collect();
            Some(Compared {
                clients,
                etcd: (
                    e.total.rate(),
                    e.total.hist.quantile_ms(0.5),
                    e.total.hist.quantile_ms(0.99),
                ),
                allot,
            })
        })
        .collect()
}

fn report(o: &Opts, results: &[RunResult], etcd_version: Option<&str>, leaders: &[u64]) {
    let compared = if etcd_version.is_some() {
        compare(o, results)
    } else {
        Vec::new()
    };
    if o.json {
        let rows: Vec<String> = results.iter().map(json_row).collect();
        let mut extra = String::new();
        if let Some(v) = etcd_version {
            let cmp: Vec<String> = compared
                .iter()
                .map(|c| {
                    let allot: Vec<String> = c
                        .allot
                        .iter()
                        .map(|(pc, rate, p50, p99, ratio, best)| format!(
                            "{{\"per_call\":{pc},\"commands_per_s\":{rate:.0},\"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3},\"ratio_to_etcd\":{ratio:.2},\"ratio_to_etcd_best\":{best:.2}}}"
                        ))
                        .collect();
                    format!(
                        "{{\"clients\":{},\"etcd_puts_per_s\":{:.0},\"etcd_p50_ms\":{:.3},\"etcd_p99_ms\":{:.3},\"allot\":[{}]}}",
                        c.clients,
                        c.etcd.0,
                        c.etcd.1,
                        c.etcd.2,
                        allot.join(",")
                    )
                })
                .collect();
            extra = format!(
                ",\"etcd_version\":\"{v}\",\"etcd_value_bytes\":{},\"comparison\":[{}]",
                o.value_bytes,
                cmp.join(",")
            );
        }
        println!(
            "{{\"nodes\":{},\"shards\":{},\"tls\":{},\"leaders\":[{}],\"reads\":{}{extra},\"results\":[{}]}}",
            o.nodes,
            o.shards,
            o.tls,
            leaders
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            o.reads,
            rows.join(",")
        );
        return;
    }
    if let Some(v) = etcd_version {
        if o.reads {
            println!(
                "allot vs etcd {v}: 3 members each, loopback, {}s per run; reads without consensus, one per RPC, answered by the leader: etcd serializable ranges of one key; allot: {} nodes × {} shards, stale-ok totals queries",
                o.seconds, o.nodes, o.shards
            );
        } else {
            println!(
                "allot vs etcd {v}: 3 members each, fsync on, loopback, {}s per run; etcd: {}-byte puts to the leader; allot: {} nodes × {} shards, ledger commands (hold → capture → release)",
                o.seconds, o.value_bytes, o.nodes, o.shards
            );
        }
        let (etcd_what, allot_what) = if o.reads {
            ("reads", "reads")
        } else {
            ("puts", "cmds")
        };
        print!(
            "{:>8} {:>30}",
            "clients",
            format!("etcd {etcd_what}/s · p50 · p99 ms")
        );
        for pc in &o.per_call {
            print!(
                " {:>44}",
                format!("allot {pc}/RPC {allot_what}/s · p50 · p99 ms (×etcd)")
            );
        }
        println!();
        for c in &compared {
            print!(
                "{:>8} {:>30}",
                c.clients,
                format!("{:.0} · {:.2} · {:.2}", c.etcd.0, c.etcd.1, c.etcd.2)
            );
            for (_, rate, p50, p99, ratio, best) in &c.allot {
                print!(
                    " {:>44}",
                    format!("{rate:.0} · {p50:.2} · {p99:.2} ({ratio:.2}×; {best:.2}× best)")
                );
            }
            println!();
        }
        println!();
    }
    println!(
        "{:<6} {:<14} {:>6} {:>8} {:>12} {:>9} {:>9} {:>9} {:>10} {:>16} {:>10} {:>10} {:>10} {:>6}",
        "system",
        "run",
        "per",
        "clients",
        if o.reads { "reads/s" } else { "commands/s" },
        "p50 ms",
        "p99 ms",
        "max ms",
        "CPU µs/cmd",
        "server p99 ≤ ms",
        "commit ≤",
        "fsync ≤",
        "max ≤",
        "snaps"
    );
    for r in results {
        let t = &r.total;
        let s = r.server.as_ref();
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| v.to_string());
        println!(
            "{:<6} {:<14} {:>6} {:>8} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>10.1} {:>16} {:>10} {:>10} {:>10} {:>6}",
            r.system,
            r.label,
            r.per_call,
            r.clients,
            t.rate(),
            t.hist.quantile_ms(0.5),
            t.hist.quantile_ms(0.99),
            t.hist.max_ms(),
            t.cpu_us(),
            f(s.map(|s| s.p99_ms)),
            f(s.map(|s| s.commit_p99_ms)),
            f(s.map(|s| s.wal_p99_ms)),
            f(s.map(|s| s.wal_max_ms)),
            s.map_or("-".to_string(), |s| s.snapshots.to_string()),
        );
    }
    for r in results.iter().filter(|r| r.windows.len() > 1) {
        println!(
            "\n{} run, {} clients, {} per call: per window",
            r.label, r.clients, r.per_call
        );
        println!(
            "{:>8} {:>12} {:>9} {:>9} {:>9} {:>10}  RSS per node (MB); node 1: idempotency records, settled holds, RocksDB memory (MB)",
            "from s", "commands/s", "p50 ms", "p99 ms", "max ms", "CPU µs/cmd"
        );
        let mut from = 0.0;
        for w in &r.windows {
            println!(
                "{:>8.0} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>10.1}  {}",
                from,
                w.rate(),
                w.hist.quantile_ms(0.5),
                w.hist.quantile_ms(0.99),
                w.hist.max_ms(),
                w.cpu_us(),
                w.rss
                    .iter()
                    .map(|b| format!("{:.0}", *b as f64 / 1e6))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            match w.memory.first() {
                Some(Some(m)) => {
                    let row = |t: &str| m.rows.get(t).copied().unwrap_or(0.0);
                    println!(
                        "{:>8} records {:.0} · settled holds {:.0} · RocksDB {:.0} MB",
                        "",
                        row("idempotency_records"),
                        row("holds_settled"),
                        m.rocksdb_bytes.values().sum::<f64>() / 1e6
                    );
                }
                Some(None) => println!("{:>8} node 1's metrics could not be read", ""),
                None => {}
            }
            from += w.seconds;
        }
    }
    let allot: Vec<&RunResult> = results.iter().filter(|r| r.server.is_some()).collect();
    // Reads propose nothing: the stages would show only the nodes' own background
    // entries (clock ticks, denials).
    if allot.is_empty() || o.reads {
        return;
    }
    println!(
        "\nwhere allot's commit time goes (p50 / p99 of each stage, bucket upper bounds in ms, then its mean in ms; the leaders' own timelines, the followers' answers to AppendEntries, and the leaders' round trips of them):"
    );
    print!("{:<14} {:>6} {:>8}", "run", "per", "clients");
    for n in STAGES {
        print!(" {n:>22}");
    }
    println!();
    for r in allot {
        print!("{:<14} {:>6} {:>8}", r.label, r.per_call, r.clients);
        for (p50, p99, mean) in r
            .server
            .as_ref()
            .map(|s| s.stages.as_slice())
            .unwrap_or(&[])
        {
            print!(" {:>22}", format!("{p50} / {p99} · {mean:.3}"));
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn a_nodes_memory_is_summed_over_its_shards_and_column_families() {
        let body = "# HELP allot_state_rows Rows\n\
            allot_state_rows{shard=\"0\",table=\"idempotency_records\"} 1200\n\
            allot_state_rows{shard=\"1\",table=\"idempotency_records\"} 34\n\
            allot_state_rows{shard=\"1\",table=\"holds_settled\"} 5\n\
            allot_rocksdb_memory_bytes{cf=\"log\",kind=\"memtables\"} 1000000\n\
            allot_rocksdb_memory_bytes{cf=\"audit\",kind=\"memtables\"} 500000\n\
            allot_rocksdb_memory_bytes{cf=\"log\",kind=\"block_cache\"} 7\n\
            allot_rocksdb_memory_bytes{cf=\"log\",subkind=\"x\",kind=\"table_readers\"} 9\n\
            allot_rocksdb_memory_bytes{cf=\"log\",subkind=\"memtables\"} 1\n\
            allot_state_rows_other{shard=\"0\",table=\"idempotency_records\"} 99\n";
        let m = super::NodeMemory::parse(body);
        assert_eq!(m.rows["idempotency_records"], 1234.0);
        assert_eq!(m.rows["holds_settled"], 5.0);
        assert_eq!(m.rows.len(), 2);
        assert_eq!(m.rocksdb_bytes["memtables"], 1_500_000.0);
        assert_eq!(m.rocksdb_bytes["block_cache"], 7.0);
        // A label whose name ends like another's is not taken for it.
        assert_eq!(m.rocksdb_bytes["table_readers"], 9.0);
        assert_eq!(m.rocksdb_bytes.len(), 3);
        assert_eq!(
            m.json(),
            r#"{"rows":{"holds_settled":5,"idempotency_records":1234},"rocksdb_bytes":{"block_cache":7,"memtables":1500000,"table_readers":9}}"#
        );
    }

    #[test]
    fn a_stage_mean_is_its_sum_over_its_count_between_scrapes() {
        use super::{add_histogram, server_mean, Scraped};
        let scrape = |queue: (f64, f64), commit: (f64, f64)| {
            // Two nodes' expositions; `commit` is a different stage of the same metric.
            let body = format!(
                "allot_proposal_stage_seconds_bucket{{stage=\"queue\",le=\"0.0001\"}} {q0}\n\
                 allot_proposal_stage_seconds_bucket{{stage=\"queue\",le=\"+Inf\"}} {q0}\n\
                 allot_proposal_stage_seconds_sum{{stage=\"queue\"}} {qs}\n\
                 allot_proposal_stage_seconds_count{{stage=\"queue\"}} {q0}\n\
                 allot_proposal_stage_seconds_bucket{{stage=\"commit\",le=\"+Inf\"}} {c0}\n\
                 allot_proposal_stage_seconds_sum{{stage=\"commit\"}} {cs}\n",
                q0 = queue.0,
                qs = queue.1,
                c0 = commit.0,
                cs = commit.1
            );
            let (mut buckets, mut sum_s) = (Default::default(), 0.0);
            for _node in 0..2 {
                add_histogram(
                    &body,
                    "allot_proposal_stage_seconds",
                    "stage=\"queue\"",
                    &mut buckets,
                    &mut sum_s,
                );
            }
            Scraped {
                buckets: buckets
                    .into_iter()
                    .map(|(k, v)| (k as f64 / 1e6, v))
                    .collect(),
                sum_s,
            }
        };
        let before = scrape((10.0, 0.001), (5.0, 9.0));
        // Each node gains 4 observations of 0.25 ms in all; the commit stage gains 9 s.
        let after = scrape((14.0, 0.002), (6.0, 18.0));
        let mean = server_mean(&before, &after);
        assert!((mean - 0.25).abs() < 1e-9, "mean {mean} ms");
        assert!(
            server_mean(&after, &after).is_nan(),
            "no observations, no mean"
        );
    }

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_parse_and_bad_ones_are_refused() {
        let o = parse(args("--vs-etcd")).unwrap();
        assert_eq!(
            (o.concurrency.clone(), o.per_call.clone()),
            (vec![1, 64, 256], vec![1, 16])
        );
        let o = parse(args("--per-call 16 --concurrency 64")).unwrap();
        assert_eq!(
            (o.concurrency.clone(), o.per_call.clone()),
            (vec![64], vec![16])
        );
        let o = parse(args("--nodes 5 --leaders-on 5")).unwrap();
        assert_eq!(o.leaders_on, Some(5));
        assert!(parse(args("--tls")).unwrap().tls);
        let o = parse(args("--vs-etcd --reads")).unwrap();
        assert_eq!((o.reads, o.per_call.clone()), (true, vec![1]));
        let o = parse(args("--rate 5000 --seconds 1800 --window 300")).unwrap();
        assert_eq!(
            (o.rate, o.window, o.concurrency.clone()),
            (Some(5000.0), 300, vec![64])
        );
        for bad in [
            "--bogus",
            "--seconds",
            "--seconds x",
            "--per-call 0",
            "--concurrency 1,,2",
            "--rate -1",
            "--rate 10 --vs-etcd",
            "--rate 10 --concurrency 1,2",
            "--window 5",
            "--value-bytes 0",
            "--reads --rate 10",
            "--reads --per-call 16",
            "--reads --per-call 1,16",
            "--leaders-on 0",
            "--leaders-on 4",
            "--nodes 5 --leaders-on 6",
            "--tls --vs-etcd",
        ] {
            assert!(parse(args(bad)).is_err(), "{bad}");
        }
    }
}
