//! Cluster-level operations: `cluster init`, `endpoint status`, `shard hash`.

use crate::connect::Ctx;
use crate::failure::usage;
use crate::output::{hex, list, show, Table};
use crate::values;
use allot_proto::{ShardRequest, StatusReply};
use clap::{Args, Subcommand};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Initialises a new cluster's shards with the given voters. Shard s is initialised
    /// through member s mod n (so the first leaders are spread), retried while the nodes
    /// start; then waits until every shard has a leader.
    Init(InitArgs),
}

#[derive(Args, Debug)]
pub struct InitArgs {
    /// A voter, `<node id>=<host:port>`; repeat for each node (order matters: shard s
    /// goes through the (s mod n)-th member).
    #[arg(long = "member", required = true, value_parser = values::member)]
    members: Vec<(u64, String)>,
    /// The shard count the nodes were started with; if given, the nodes must report it.
    #[arg(long)]
    shards: Option<u32>,
    /// How long to wait for the nodes to come up and for leaders.
    #[arg(long, default_value = "30s", value_parser = values::duration)]
    wait: Duration,
    /// The first admin token: read from this file if it exists (an operator-chosen
    /// secret of at least 32 characters), else generated and written there (mode 0600).
    /// Without it a generated token is printed. Installed on every shard (bootstrap),
    /// which secures the cluster: from then on every call needs a token.
    #[arg(long, conflicts_with = "insecure")]
    admin_token_file: Option<std::path::PathBuf>,
    /// Leave the cluster unsecured (no admin token): only for nodes started with
    /// --insecure-dev-mode, for local development.
    #[arg(long)]
    insecure: bool,
}

#[derive(Subcommand, Debug)]
pub enum EndpointCmd {
    /// One row per endpoint and shard: node id, role, leader, term, applied index, and
    /// the error of an endpoint that did not answer. Exits 0 if at least one endpoint
    /// answered, 1 if none did.
    Status,
}

#[derive(Subcommand, Debug)]
pub enum ShardCmd {
    /// Each replica's state hash per shard (endpoint, shard, applied index, hash): equal
    /// hashes at equal applied indexes mean identical replicas.
    Hash(HashArgs),
    /// Hands shard leadership to another voter without an unplanned election: before
    /// restarting or removing the leader's node. Writes wait (and are retried) for the
    /// transfer's few hundred milliseconds.
    TransferLeader(TransferArgs),
}

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// The shard to hand over (or --from-node).
    #[arg(long, conflicts_with = "from_node")]
    shard: Option<u32>,
    /// Every shard this node leads (before restarting it).
    #[arg(long)]
    from_node: Option<u64>,
    /// The voter to hand over to (default: the most up-to-date other voter).
    #[arg(long)]
    to: Option<u64>,
}

#[derive(Serialize)]
struct TransferRow {
    shard: u32,
    from: u64,
    to: u64,
    term: u64,
    elapsed_ms: u64,
}

#[derive(Args, Debug)]
pub struct HashArgs {
    #[arg(long)]
    shard: Option<u32>,
    /// Repeat until each shard's replicas report the same applied index (within
    /// --timeout), then exit 1 if their hashes differ.
    #[arg(long)]
    check: bool,
}

pub async fn run(ctx: &Ctx, cmd: ClusterCmd) -> anyhow::Result<()> {
    match cmd {
        ClusterCmd::Init(a) => init(ctx, a).await,
    }
}

pub async fn run_endpoint(ctx: &Ctx, cmd: EndpointCmd) -> anyhow::Result<()> {
    match cmd {
        EndpointCmd::Status => endpoint_status(ctx).await,
    }
}

pub async fn run_shard(ctx: &Ctx, cmd: ShardCmd) -> anyhow::Result<()> {
    match cmd {
        ShardCmd::Hash(a) => shard_hash(ctx, a).await,
        ShardCmd::TransferLeader(a) => transfer_leader(ctx, a).await,
    }
}

// ---------------------------------------------------------------- cluster init

async fn init(ctx: &Ctx, a: InitArgs) -> anyhow::Result<()> {
    let mut ids: Vec<u64> = a.members.iter().map(|m| m.0).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.len() != a.members.len() {
        return Err(usage("--member: each node id once"));
    }
    let deadline = Instant::now() + a.wait;
    let shards = agreed_shard_count(ctx, &a.members, a.shards, deadline).await?;
    let wait = deadline.saturating_duration_since(Instant::now());
    let through = ctx.client.init_cluster(&a.members, shards, wait).await?;
    let leaders = wait_leaders(ctx, &a.members, shards, deadline).await?;
    let token = if a.insecure {
        eprintln!("WARNING: cluster left unsecured (--insecure): dev mode only");
        None
    } else {
        Some(bootstrap(ctx, a.admin_token_file.as_deref()).await?)
    };
    print_init(ctx, shards, &through, &leaders, token)
}

/// Installs the admin token on every shard, from a client without a token.
async fn bootstrap(ctx: &Ctx, file: Option<&std::path::Path>) -> anyhow::Result<BootstrapToken> {
    let (token, source) =
        allot_client::security::admin_token(file).map_err(|e| usage(e.to_string()))?;
    // The shard count is known (from init); the anonymous client cannot ask for it once
    // the cluster is secured (a re-run).
    ctx.client.shards().await?;
    ctx.client
        .anonymous()
        .bootstrap(allot_statemachine::PrincipalId(1), &token)
        .await?;
    Ok(BootstrapToken { token, source })
}

struct BootstrapToken {
    token: String,
    source: String,
}

/// Every member's reported shard count, retried while nodes start; they must agree
/// (and equal `expected` if given).
async fn agreed_shard_count(
    ctx: &Ctx,
    members: &[(u64, String)],
    expected: Option<u32>,
    deadline: Instant,
) -> anyhow::Result<u32> {
    let mut counts = BTreeMap::new();
    for (id, addr) in members {
        let s = status_until(ctx, addr, deadline).await?;
        if s.node_id != *id {
            anyhow::bail!("{addr} is node {}, not node {id}", s.node_id);
        }
        counts.insert(*id, s.shards.len() as u32);
    }
    let distinct: std::collections::BTreeSet<u32> = counts.values().copied().collect();
    if distinct.len() != 1 {
        anyhow::bail!("the nodes report different shard counts: {counts:?} (node → shards)");
    }
    let n = *distinct.iter().next().unwrap_or(&0);
    match expected {
        Some(e) if e != n => anyhow::bail!(
            "--shards {e}, but the nodes were started with {n} shards (allot-node run --shards); nothing was initialised"
        ),
        _ if n == 0 => anyhow::bail!("the nodes host no shards"),
        _ => Ok(n),
    }
}

async fn status_until(ctx: &Ctx, addr: &str, deadline: Instant) -> anyhow::Result<StatusReply> {
    loop {
        match ctx.client.status_of(addr).await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                anyhow::bail!("node {addr} did not answer: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Waits until a member sees a leader for every shard; returns shard → leader id.
async fn wait_leaders(
    ctx: &Ctx,
    members: &[(u64, String)],
    shards: u32,
    deadline: Instant,
) -> anyhow::Result<BTreeMap<u32, u64>> {
    loop {
        let mut leaders = BTreeMap::new();
        for (_, addr) in members {
            if let Ok(s) = ctx.client.status_of(addr).await {
                for sh in s.shards.iter().filter(|sh| sh.leader != 0) {
                    leaders.insert(sh.shard, sh.leader);
                }
            }
        }
        if leaders.len() as u32 == shards {
            return Ok(leaders);
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "initialised, but only shards {:?} have a leader after the wait",
                leaders.keys().collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn print_init(
    ctx: &Ctx,
    shards: u32,
    through: &BTreeMap<u32, u64>,
    leaders: &BTreeMap<u32, u64>,
    token: Option<BootstrapToken>,
) -> anyhow::Result<()> {
    if let Some(t) = &token {
        // To stderr, so `-o json` stays one document (the token is in it too).
        eprintln!(
            "{}",
            allot_client::security::admin_token_help(&t.token, &t.source)
        );
    }
    let mut t = Table::new(&["SHARD", "INITIALISED THROUGH", "LEADER"]);
    let mut rows = Vec::new();
    for s in 0..shards {
        let (th, l) = (through.get(&s).copied(), leaders.get(&s).copied());
        t.row(vec![s.to_string(), opt(th), opt(l)]);
        rows.push(serde_json::json!({"shard": s, "through": th, "leader": l}));
    }
    show(
        ctx.format,
        &serde_json::json!({
            "shards": shards,
            "initialised": rows,
            "secured": token.is_some(),
            "admin_token": token.as_ref().map(|t| t.token.clone()),
        }),
        &[t],
    )
}

fn opt(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

// ---------------------------------------------------------------- endpoint status

#[derive(Serialize)]
struct EndpointRow {
    endpoint: String,
    node_id: Option<u64>,
    shard: Option<u32>,
    state: Option<String>,
    is_leader: bool,
    leader: Option<u64>,
    term: Option<u64>,
    applied_index: Option<u64>,
    last_log_index: Option<u64>,
    logical_time_ms: Option<u64>,
    voters: Vec<u64>,
    learners: Vec<u64>,
    error: Option<String>,
    /// The replica's latest snapshot covers the log up to here.
    snapshot_index: Option<u64>,
    /// Log entries up to here are purged (a replica further behind needs the snapshot);
    /// the first index still in the log is the next one.
    purged_index: Option<u64>,
    /// The shard's active rule version (docs/DESIGN.md §48).
    rules_active: Option<u32>,
    /// Audit coverage: the shard's chain head, and how far this replica's own trail was
    /// verified contiguous from sequence 0 by its last scan (at start, after a snapshot
    /// install, every 10 min). Rows past it are written by apply, in order; a replica
    /// that installed a snapshot since copies the missing ones from a peer at once.
    audit_head_seq: Option<u64>,
    audit_verified_seq: Option<u64>,
    /// The newest rule version and the persisted format this node's binary supports.
    rules_max: Option<u32>,
    format_version: Option<u32>,
    release: Option<String>,
    /// The node's free disk space, and whether it refuses tenants' writes for it
    /// (below `--min-free-disk-mib`: reason DISK_LOW).
    disk_free_bytes: Option<u64>,
    disk_low: Option<bool>,
}

async fn endpoint_status(ctx: &Ctx) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut answered = 0;
    for addr in ctx.client.endpoints() {
        match ctx.client.status_of(addr).await {
            Ok(s) => {
                answered += 1;
                rows.extend(status_rows(addr, &s));
            }
            Err(e) => rows.push(error_row(addr, e.to_string())),
        }
    }
    let mut t = Table::new(&[
        "ENDPOINT",
        "NODE",
        "SHARD",
        "STATE",
        "LEADER",
        "TERM",
        "APPLIED",
        "SNAPSHOT",
        "PURGED",
        "RULES",
        "AUDIT VERIFIED/HEAD",
        "DISK FREE",
        "ERROR",
    ]);
    for r in &rows {
        t.row(vec![
            r.endpoint.clone(),
            opt(r.node_id),
            opt(r.shard.map(u64::from)),
            r.state.clone().unwrap_or("-".into()),
            opt(r.leader),
            opt(r.term),
            opt(r.applied_index),
            opt(r.snapshot_index),
            opt(r.purged_index),
            match (r.rules_active, r.rules_max) {
                (Some(a), Some(m)) => format!("{a} (node up to {m})"),
                (Some(a), None) => a.to_string(),
                _ => "-".into(),
            },
            match (r.audit_verified_seq, r.audit_head_seq) {
                (Some(v), Some(h)) => format!("{v}/{h}"),
                _ => "-".into(),
            },
            match (r.disk_free_bytes, r.disk_low) {
                (f, Some(true)) => format!("{} MiB LOW", f.unwrap_or(0) >> 20),
                (Some(0) | None, _) => "-".into(),
                (Some(f), _) => format!("{} MiB", f >> 20),
            },
            r.error.clone().unwrap_or_default(),
        ]);
    }
    show(ctx.format, &rows, &[t])?;
    if answered == 0 {
        anyhow::bail!("no endpoint answered");
    }
    Ok(())
}

fn status_rows(addr: &str, s: &StatusReply) -> Vec<EndpointRow> {
    s.shards
        .iter()
        .map(|sh| EndpointRow {
            endpoint: addr.to_string(),
            node_id: Some(s.node_id),
            shard: Some(sh.shard),
            state: Some(sh.state.clone()),
            is_leader: sh.is_leader,
            leader: (sh.leader != 0).then_some(sh.leader),
            term: Some(sh.term),
            applied_index: Some(sh.applied_index),
            last_log_index: Some(sh.last_log_index),
            logical_time_ms: Some(sh.logical_time_ms),
            voters: sh.voters.clone(),
            learners: sh.learners.clone(),
            error: None,
            snapshot_index: Some(sh.snapshot_index),
            purged_index: Some(sh.purged_index),
            // A node of a release before rule versions reports 0: version 1.
            rules_active: Some(sh.rules_active.max(1)),
            audit_head_seq: Some(sh.audit_head_seq),
            audit_verified_seq: Some(sh.audit_verified_seq),
            rules_max: s.versions.as_ref().map(|v| v.rules_max),
            format_version: s.versions.as_ref().map(|v| v.format_version),
            release: s.versions.as_ref().map(|v| v.release.clone()),
            disk_free_bytes: Some(s.disk_free_bytes),
            disk_low: Some(s.disk_low),
        })
        .collect()
}

fn error_row(addr: &str, error: String) -> EndpointRow {
    EndpointRow {
        endpoint: addr.to_string(),
        node_id: None,
        shard: None,
        state: None,
        is_leader: false,
        leader: None,
        term: None,
        applied_index: None,
        last_log_index: None,
        logical_time_ms: None,
        voters: vec![],
        learners: vec![],
        error: Some(error),
        snapshot_index: None,
        purged_index: None,
        rules_active: None,
        audit_head_seq: None,
        audit_verified_seq: None,
        rules_max: None,
        format_version: None,
        release: None,
        disk_free_bytes: None,
        disk_low: None,
    }
}

// ---------------------------------------------------------------- shard hash

#[derive(Serialize, Clone)]
struct HashRow {
    endpoint: String,
    shard: u32,
    applied_index: Option<u64>,
    logical_time_ms: Option<u64>,
    state_hash: Option<String>,
    error: Option<String>,
}

async fn transfer_leader(ctx: &Ctx, a: TransferArgs) -> anyhow::Result<()> {
    let shards: Vec<u32> = match (a.shard, a.from_node) {
        (Some(s), _) => vec![s],
        (None, Some(node)) => {
            // The shards `node` leads, as the first answering endpoint sees them.
            let mut led = None;
            for e in ctx.client.endpoints() {
                if let Ok(status) = ctx.client.status_of(e).await {
                    led = Some(
                        status
                            .shards
                            .iter()
                            .filter(|s| s.leader == node)
                            .map(|s| s.shard)
                            .collect::<Vec<u32>>(),
                    );
                    break;
                }
            }
            led.ok_or_else(|| anyhow::anyhow!("no endpoint answered"))?
        }
        (None, None) => return Err(usage("give --shard S or --from-node N")),
    };
    let mut rows = Vec::new();
    for shard in shards {
        let r = ctx
            .client
            .transfer_leader(shard, a.to)
            .await
            .map_err(|e| anyhow::anyhow!("shard {shard}: {e}"))?;
        rows.push(TransferRow {
            shard: r.shard,
            from: r.from,
            to: r.to,
            term: r.term,
            elapsed_ms: r.elapsed_ms,
        });
    }
    let mut t = Table::new(&["SHARD", "FROM", "TO", "TERM", "ELAPSED"]);
    for r in &rows {
        t.row(vec![
            r.shard.to_string(),
            r.from.to_string(),
            r.to.to_string(),
            r.term.to_string(),
            format!("{} ms", r.elapsed_ms),
        ]);
    }
    show(ctx.format, &rows, &[t])
}

async fn shard_hash(ctx: &Ctx, a: HashArgs) -> anyhow::Result<()> {
    let shards = ctx.shards_or_all(a.shard).await?;
    let deadline = Instant::now() + ctx.timeout;
    let rows = loop {
        let rows = read_hashes(ctx, &shards).await?;
        if !a.check || settled(&rows) || Instant::now() >= deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut t = Table::new(&["ENDPOINT", "SHARD", "APPLIED", "STATE HASH", "ERROR"]);
    for r in &rows {
        t.row(vec![
            r.endpoint.clone(),
            r.shard.to_string(),
            opt(r.applied_index),
            r.state_hash.clone().unwrap_or("-".into()),
            r.error.clone().unwrap_or_default(),
        ]);
    }
    show(ctx.format, &rows, &[t])?;
    if a.check {
        check_hashes(&rows)?;
    }
    if rows.iter().all(|r| r.error.is_some()) {
        anyhow::bail!("no replica answered");
    }
    Ok(())
}

async fn read_hashes(ctx: &Ctx, shards: &[u32]) -> anyhow::Result<Vec<HashRow>> {
    let mut rows = Vec::new();
    for addr in ctx.client.endpoints() {
        for &shard in shards {
            let r = ctx
                .admin(addr)?
                .shard_hash(ctx.admin_req(ShardRequest { shard }))
                .await;
            rows.push(match r {
                Ok(h) => {
                    let h = h.into_inner();
                    HashRow {
                        endpoint: addr.clone(),
                        shard,
                        applied_index: Some(h.applied_index),
                        logical_time_ms: Some(h.logical_time_ms),
                        state_hash: Some(hex(&h.state_hash)),
                        error: None,
                    }
                }
                Err(s) => HashRow {
                    endpoint: addr.clone(),
                    shard,
                    applied_index: None,
                    logical_time_ms: None,
                    state_hash: None,
                    error: Some(format!("{:?}: {}", s.code(), s.message())),
                },
            });
        }
    }
    Ok(rows)
}

/// Every shard's answering replicas are at one applied index.
fn settled(rows: &[HashRow]) -> bool {
    let mut by_shard: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for r in rows {
        if let Some(i) = r.applied_index {
            by_shard.entry(r.shard).or_default().push(i);
        }
    }
    by_shard
        .values()
        .all(|v| v.windows(2).all(|w| w[0] == w[1]))
}

fn check_hashes(rows: &[HashRow]) -> anyhow::Result<()> {
    let mut by_shard: BTreeMap<u32, Vec<&HashRow>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.state_hash.is_some()) {
        by_shard.entry(r.shard).or_default().push(r);
    }
    for (shard, rs) in by_shard {
        let indexes: Vec<u64> = rs.iter().filter_map(|r| r.applied_index).collect();
        if indexes.windows(2).any(|w| w[0] != w[1]) {
            anyhow::bail!(
                "shard {shard}: the replicas did not reach one applied index within --timeout ({})",
                list(&indexes)
            );
        }
        if rs.windows(2).any(|w| w[0].state_hash != w[1].state_hash) {
            anyhow::bail!(
                "shard {shard}: replicas DIFFER at applied index {}",
                indexes.first().copied().unwrap_or(0)
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- check

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// One shard (default: every shard).
    #[arg(long)]
    shard: Option<u32>,
}

#[derive(Debug, Serialize)]
struct CheckRow {
    endpoint: String,
    shard: u32,
    applied_index: Option<u64>,
    /// The ledger's conservation laws and every cross-check (`check_invariants`) on
    /// this replica's applied state: "ok", or the first violation.
    invariants: Option<String>,
    /// Whether this replica's state hash equals the other replicas' at one applied
    /// index: null when the replicas did not stand at one index within --timeout.
    hash_agrees: Option<bool>,
    error: Option<String>,
}

/// `allotctl check`: the invariants (conservation included) on every replica of every
/// shard, and the replicas' state hashes compared at one applied index. Exit 1 on a
/// violation, on replicas that differ, or on a replica that did not answer.
pub async fn check(ctx: &Ctx, a: CheckArgs) -> anyhow::Result<()> {
    use allot_statemachine::query::{Answer, Query};
    let shards = ctx.shards_or_all(a.shard).await?;
    // Hashes first, waiting (within --timeout) for each shard's replicas to stand at
    // one applied index: a quiet cluster settles at once.
    let deadline = Instant::now() + ctx.timeout;
    let hashes = loop {
        let rows = read_hashes(ctx, &shards).await?;
        if settled(&rows) || Instant::now() >= deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let agree = |shard: u32, endpoint: &str| -> Option<bool> {
        let rs: Vec<&HashRow> = hashes
            .iter()
            .filter(|r| r.shard == shard && r.state_hash.is_some())
            .collect();
        if !settled(
            &hashes
                .iter()
                .filter(|r| r.shard == shard)
                .cloned()
                .collect::<Vec<_>>(),
        ) {
            return None;
        }
        let mine = rs.iter().find(|r| r.endpoint == endpoint)?;
        Some(rs.iter().all(|r| r.state_hash == mine.state_hash))
    };
    let mut rows = Vec::new();
    for addr in ctx.client.endpoints() {
        for &shard in &shards {
            let answer = ctx
                .client
                .query_replica(addr, shard, &Query::Invariants)
                .await;
            let applied = hashes
                .iter()
                .find(|r| r.shard == shard && &r.endpoint == addr)
                .and_then(|r| r.applied_index);
            rows.push(match answer {
                Ok(Answer::Invariants(r)) => CheckRow {
                    endpoint: addr.clone(),
                    shard,
                    applied_index: applied,
                    invariants: Some(r.err().unwrap_or_else(|| "ok".into())),
                    hash_agrees: agree(shard, addr),
                    error: None,
                },
                Ok(other) => CheckRow {
                    endpoint: addr.clone(),
                    shard,
                    applied_index: applied,
                    invariants: None,
                    hash_agrees: None,
                    error: Some(format!("unexpected answer {other:?}")),
                },
                Err(e) => CheckRow {
                    endpoint: addr.clone(),
                    shard,
                    applied_index: applied,
                    invariants: None,
                    hash_agrees: None,
                    error: Some(crate::failure::render(&anyhow::Error::new(e))),
                },
            });
        }
    }
    let mut t = Table::new(&[
        "ENDPOINT",
        "SHARD",
        "APPLIED",
        "INVARIANTS",
        "REPLICAS AGREE",
        "ERROR",
    ]);
    for r in &rows {
        t.row(vec![
            r.endpoint.clone(),
            r.shard.to_string(),
            opt(r.applied_index),
            r.invariants.clone().unwrap_or_else(|| "-".into()),
            match r.hash_agrees {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "not compared (replicas at different indexes)".into(),
            },
            r.error.clone().unwrap_or_default(),
        ]);
    }
    show(ctx.format, &rows, &[t])?;
    let failed: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let what = if let Some(e) = &r.error {
                format!("did not answer ({e})")
            } else if r.invariants.as_deref() != Some("ok") {
                format!(
                    "violates an invariant: {}",
                    r.invariants.as_deref().unwrap_or("-")
                )
            } else if r.hash_agrees == Some(false) {
                "differs from the other replicas".to_string()
            } else {
                return None;
            };
            Some(format!("{} shard {}: {what}", r.endpoint, r.shard))
        })
        .collect();
    if !failed.is_empty() {
        anyhow::bail!("check failed: {}", failed.join("; "));
    }
    Ok(())
}
