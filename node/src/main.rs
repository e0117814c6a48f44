//! `allot-node`: runs a node (`run`), or talks to one for cluster set-up (`init`,
//! `status`) until allotctl covers it.

use allot_node::node::{Node, NodeConfig, RaftTimings};
use allot_node::proposer::ProposerConfig;
use allot_node::ratelimit::{RateLimiter, DEFAULT_LIMITS};
use allot_node::serve::{serve, shutdown_signal};
use allot_proto::admin_client::AdminClient;
use allot_proto::StatusRequest;
use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// glibc malloc was ~12% of a loaded node's profile (many small short-lived buffers).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "allot-node",
    version,
    about = "allot: Raft-replicated GPU-credit ledger and GPU job scheduler"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs a node.
    Run(Box<RunArgs>),
    /// Initialises every shard of a new cluster through one of its nodes, then secures
    /// it with an admin token (created, or read from --admin-token-file) and prints how
    /// to use it.
    Init {
        /// gRPC endpoint of a node to initialise through (host:port).
        #[arg(long, env = "ALLOT_ENDPOINT")]
        endpoint: String,
        /// Voters: `id=host:port`, repeated (must include the endpoint's node).
        #[arg(long = "member", required = true)]
        members: Vec<String>,
        /// The admin token: read from this file if it exists (at least 32 characters),
        /// else generated and written there (mode 0600). Without it, one is generated
        /// and printed.
        #[arg(long, env = "ALLOT_ADMIN_TOKEN_FILE", conflicts_with = "insecure")]
        admin_token_file: Option<PathBuf>,
        /// Leave the cluster unsecured (nodes in --insecure-dev-mode; development only).
        #[arg(long)]
        insecure: bool,
    },
    /// Prints the Raft status of every shard of a node (one line per shard).
    Status {
        #[arg(long, env = "ALLOT_ENDPOINT")]
        endpoint: String,
        /// Exit non-zero unless every shard has a leader.
        #[arg(long)]
        require_leaders: bool,
        /// API token (any valid token may read the status of a secured cluster).
        #[arg(long, env = "ALLOT_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Creates a node's data dir from a backup set (`allotctl backup create`): one file
    /// per shard of the cluster, each read as a stream and verified whole first
    /// (checksum, state hash, invariants, audit chain). Copy the same set to every node
    /// of the new cluster and run this there (with the same --member list when the hosts
    /// changed), then start the nodes with `run` — no `init`: the shards continue the
    /// backed-up log, and secured shards keep their tokens. The data dir must not exist
    /// or be empty; it is built beside it and renamed into place when complete (inside
    /// it and moved up, when it exists — a mount point).
    /// Lets a replica that opened with an empty log (a new node, or one that lost its
    /// disk) vote and stand for election as any replica, before it has heard a leader's
    /// commit (DESIGN §67). For a shard left with no leader because every replica able
    /// to lead is rejoining. Unsafe: a replica that lost its disk may then elect a leader
    /// missing entries it had acknowledged. Run it with the node stopped.
    ForceWhole {
        #[arg(long, env = "ALLOT_DATA_DIR")]
        data_dir: PathBuf,
        /// Only this shard (default: every shard of the data dir).
        #[arg(long)]
        shard: Option<u32>,
    },
    Restore {
        #[arg(long, env = "ALLOT_NODE_ID")]
        node_id: u64,
        #[arg(long, env = "ALLOT_DATA_DIR")]
        data_dir: PathBuf,
        /// Backup files, one per shard (repeatable), or a directory holding a set (its
        /// `*.allot-backup` files).
        #[arg(long = "backup", required = true)]
        backups: Vec<PathBuf>,
        /// The restored cluster's voters, `id=host:port` (repeated); default: the voters
        /// recorded in the backups.
        #[arg(long = "member")]
        members: Vec<String>,
    },
    /// Writes a development CA and a node certificate (server and client use) for
    /// local TLS clusters and tests: ca.pem, ca-key.pem, node.pem, node-key.pem.
    DevCerts {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Names and IP addresses the certificate is valid for (repeatable).
        #[arg(long = "host", default_values_t = ["127.0.0.1".to_string(), "localhost".to_string()])]
        hosts: Vec<String>,
    },
}

#[derive(Args)]
struct RunArgs {
    /// This node's id (positive, stable for the life of its data dir).
    #[arg(long, env = "ALLOT_NODE_ID")]
    node_id: u64,
    /// gRPC listen address (client, agent, admin and Raft APIs).
    #[arg(long, env = "ALLOT_LISTEN", default_value = "127.0.0.1:7001")]
    listen: String,
    /// Address peers and clients use to reach this node (default: --listen).
    #[arg(long, env = "ALLOT_ADVERTISE")]
    advertise: Option<String>,
    /// Prometheus listen address (`/metrics`); empty disables it.
    #[arg(long, env = "ALLOT_METRICS_LISTEN", default_value = "127.0.0.1:9101")]
    metrics_listen: String,
    #[arg(long, env = "ALLOT_DATA_DIR")]
    data_dir: PathBuf,
    /// Number of shards (Raft groups) of the cluster; fixed at the first start.
    #[arg(long, env = "ALLOT_SHARDS", default_value_t = 4)]
    shards: u32,
    #[arg(long, env = "ALLOT_HEARTBEAT_MS", default_value_t = 100)]
    heartbeat_ms: u64,
    #[arg(long, env = "ALLOT_ELECTION_MIN_MS", default_value_t = 600)]
    election_min_ms: u64,
    #[arg(long, env = "ALLOT_ELECTION_MAX_MS", default_value_t = 1200)]
    election_max_ms: u64,
    /// Log entries between snapshots (a backstop: the size rule normally comes first).
    #[arg(long, env = "ALLOT_SNAPSHOT_EVERY", default_value_t = 1_000_000)]
    snapshot_every: u64,
    /// Snapshot once the log appended since the last snapshot reaches this percentage of
    /// that snapshot's size (snapshot work ≤ 100/percent bytes encoded per log byte).
    #[arg(long, env = "ALLOT_SNAPSHOT_LOG_PERCENT", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..))]
    snapshot_log_percent: u64,
    /// ... and at least this many log bytes.
    #[arg(long, env = "ALLOT_SNAPSHOT_MIN_LOG_BYTES", default_value_t = 16 << 20)]
    snapshot_min_log_bytes: u64,
    /// Log entries kept behind the snapshot for followers slightly behind.
    #[arg(long, env = "ALLOT_KEEP_BEHIND_SNAPSHOT", default_value_t = 1024)]
    keep_behind_snapshot: u64,
    /// How long (µs) a leader's commit-index advance waits for the next AppendEntries to a
    /// follower to carry it, before one is sent for it alone; 0 sends it at once. Must be
    /// below --heartbeat-ms.
    #[arg(long, env = "ALLOT_COMMIT_LINGER_US", default_value_t = 5_000)]
    commit_linger_us: u64,
    /// A leader replicates what it appends without waiting for its own log flush (`on`),
    /// counting itself towards the quorum once the flush is done; `off`: the flush first.
    /// Either way an entry is committed only once a majority has it on disk.
    #[arg(long, env = "ALLOT_LEADER_FLUSH_OVERLAP", default_value = "on",
          value_parser = clap::builder::PossibleValuesParser::new(["on", "off"]))]
    leader_flush_overlap: String,
    /// Most requests per log entry.
    #[arg(long, env = "ALLOT_BATCH_MAX", default_value_t = 2048)]
    batch_max: usize,
    /// Extra wait for more requests before proposing, microseconds (0: none).
    #[arg(long, env = "ALLOT_BATCH_WINDOW_US", default_value_t = 0)]
    batch_window_us: u64,
    /// Log entries in flight per shard.
    #[arg(long, env = "ALLOT_INFLIGHT", default_value_t = 8)]
    inflight: usize,
    /// Idle interval after which a tick entry advances logical time, ms.
    #[arg(long, env = "ALLOT_TICK_MS", default_value_t = 1000)]
    tick_ms: u64,
    /// A proposal slower than this (queue wait + commit and apply), ms, is logged with its
    /// stage times (0: never).
    #[arg(long, env = "ALLOT_SLOW_PROPOSAL_MS", default_value_t = 1000)]
    slow_proposal_ms: u64,
    /// Most a leader may steer logical time toward the cluster's median clock, in
    /// parts per million of elapsed time: bills run within this of real time.
    #[arg(long, env = "ALLOT_CLOCK_SLEW_PPM", default_value_t = 500)]
    clock_slew_ppm: u64,
    /// Write requests per second per tenant (an org, whichever of its tokens it uses;
    /// an agent's node) at this node's edge (0 disables).
    #[arg(long, env = "ALLOT_RATE_LIMIT", default_value_t = DEFAULT_LIMITS.write.per_sec)]
    rate_limit: u32,
    /// Writes a tenant may send at once above its rate.
    #[arg(long, env = "ALLOT_RATE_BURST", default_value_t = DEFAULT_LIMITS.write.burst)]
    rate_burst: u32,
    /// Reads (queries, audit pages, stream opens, status) per second per tenant (0
    /// disables).
    #[arg(long, env = "ALLOT_READ_RATE_LIMIT", default_value_t = DEFAULT_LIMITS.read.per_sec)]
    read_rate_limit: u32,
    #[arg(long, env = "ALLOT_READ_RATE_BURST", default_value_t = DEFAULT_LIMITS.read.burst)]
    read_rate_burst: u32,
    /// Calls per second of each admin principal (0: not limited).
    #[arg(long, env = "ALLOT_ADMIN_RATE_LIMIT", default_value_t = DEFAULT_LIMITS.admin.per_sec)]
    admin_rate_limit: u32,
    /// Calls per second, all together, whose credentials do not resolve here (0
    /// disables).
    #[arg(
        long,
        env = "ALLOT_UNAUTHENTICATED_RATE_LIMIT",
        default_value_t = DEFAULT_LIMITS.unresolved.per_sec
    )]
    unauthenticated_rate_limit: u32,
    /// Connections open at once (clients, agents and peers together). At the bound a new
    /// connection takes the slot of one that never authenticated, else of an
    /// authenticated one with no call open; if every slot is an authenticated connection
    /// with a call open, it is closed as soon as it is accepted. Each may hold 256 KiB of
    /// unread request bytes.
    #[arg(long, env = "ALLOT_MAX_CONNECTIONS", default_value_t = allot_node::limits::CONNECTIONS_MAX)]
    max_connections: usize,
    /// A secret every node of the cluster presents to its peers (a file holding at least
    /// 22 printable characters, the same on every node). Peers are then authenticated
    /// before their messages are read, also without TLS.
    #[arg(long, env = "ALLOT_PEER_SECRET_FILE")]
    peer_secret_file: Option<PathBuf>,
    /// Raft traffic between nodes over the peer link (`on`: framed TCP on this same port,
    /// inside mutual TLS when the node serves TLS, falling back to gRPC for a peer of an
    /// older release) or gRPC only (`off`).
    #[arg(long, env = "ALLOT_PEER_LINK", default_value = "on",
          value_parser = clap::builder::PossibleValuesParser::new(["on", "off"]))]
    peer_link: String,
    /// Async worker threads (0: one per CPU). Several nodes sharing a small machine
    /// contend less with fewer.
    #[arg(long, env = "ALLOT_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
    /// The newest rule version this node reports it supports (default: the newest this
    /// binary implements; only lower is accepted). A lower value makes the node behave,
    /// for the cluster version gate, as the release that stopped there: it refuses to
    /// start on, or to apply, a newer active version, and voters report it when an
    /// activation is asked. For rehearsing an upgrade, or for holding a version back
    /// while a rollback must stay possible (docs/DESIGN.md §48).
    #[arg(long, env = "ALLOT_MAX_RULES_VERSION", default_value_t = allot_statemachine::version::RULES_MAX,
          value_parser = clap::value_parser!(u32).range(
              allot_statemachine::version::RULES_BASELINE as i64..=allot_statemachine::version::RULES_MAX as i64))]
    max_rules_version: u32,
    /// Below this many MiB free on the data directory's file system, the node refuses
    /// the writes that grow the ledger — tenants' and unresolved callers' — with
    /// RESOURCE_EXHAUSTED (reason DISK_LOW), before a full disk stops the replica; it
    /// still serves reads and takes agents' reports, operators' commands and its own.
    /// Lifted once the free space is a tenth above the mark. 0 turns the guard off.
    /// Raise it in production to cover a day of agents' reports and a compaction.
    #[arg(long, env = "ALLOT_MIN_FREE_DISK_MIB", default_value_t = 512)]
    min_free_disk_mib: u64,
    /// Logs as JSON lines.
    #[arg(long, env = "ALLOT_LOG_JSON")]
    log_json: bool,
    /// TEST ONLY: skews this node's wall clock by this many ms (clock-skew tests).
    #[arg(
        long,
        env = "ALLOT_TEST_CLOCK_OFFSET_MS",
        default_value_t = 0,
        hide = true,
        allow_hyphen_values = true
    )]
    test_clock_offset_ms: i64,
    /// TEST ONLY: a file holding a clock offset (ms) that replaces --test-clock-offset-ms
    /// while it exists; re-read every 50 ms (clock bumps and strobes without a restart).
    #[arg(long, env = "ALLOT_TEST_CLOCK_OFFSET_FILE", hide = true)]
    test_clock_offset_file: Option<PathBuf>,
    /// Dial the peer advertised at ADDR at VIA instead (`ADDR=VIA`, repeatable; the
    /// environment variable takes a comma-separated list). For fault-injection proxies.
    #[arg(long = "peer-route", env = "ALLOT_PEER_ROUTE", value_delimiter = ',')]
    peer_route: Vec<String>,
    /// INSECURE: accept requests without a bearer token (the identity the client claims
    /// is taken as given) while the cluster has no admin token. For local development
    /// and tests only; logged loudly. Without it every call needs a token (except
    /// cluster init and bootstrap before the admin token exists).
    #[arg(long, env = "ALLOT_INSECURE_DEV_MODE")]
    insecure_dev_mode: bool,
    /// TEST ONLY: while this file exists, WAL fsyncs fail (disk-fault injection; the
    /// node must stop, not continue).
    #[arg(long, env = "ALLOT_TEST_FSYNC_FAIL_FILE", hide = true)]
    test_fsync_fail_file: Option<PathBuf>,
    /// TEST ONLY: while this file exists, no WAL fsync starts (a stalled disk).
    #[arg(long, env = "ALLOT_TEST_FSYNC_HOLD_FILE", hide = true)]
    test_fsync_hold_file: Option<PathBuf>,
    /// TEST ONLY: while this file exists, a snapshot build that has encoded its state
    /// waits before storing it (to stop a node in the middle of a build).
    #[arg(long, env = "ALLOT_TEST_SNAPSHOT_HOLD_FILE", hide = true)]
    test_snapshot_hold_file: Option<PathBuf>,
    /// TEST ONLY: while this file exists, the audit fill task copies no rows from peers
    /// (a new replica's trail keeps the gap its snapshot install left).
    #[arg(long, env = "ALLOT_TEST_AUDIT_FILL_HOLD_FILE", hide = true)]
    test_audit_fill_hold_file: Option<PathBuf>,
    /// TEST ONLY: answer the leader-transfer handoff `UNIMPLEMENTED`, as a release
    /// without leader transfer does (to rehearse a rolling upgrade).
    #[arg(long, hide = true)]
    test_without_handoff: bool,
    /// TLS: this node's certificate (PEM). With --tls-key and --tls-ca, the node serves
    /// only TLS and peers must present a certificate of the CA (mutual TLS).
    #[arg(long, env = "ALLOT_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// TLS: this node's private key (PEM).
    #[arg(long, env = "ALLOT_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// TLS: the cluster CA (PEM) that signs every node's certificate.
    #[arg(long, env = "ALLOT_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// CHAOS BUILDS ONLY (cargo feature `chaos`): replaces every request id with a fresh
    /// one before proposing, so retries are applied again. Exists to show that the
    /// harness's idempotency checker catches it; never in a release build.
    #[cfg(feature = "chaos")]
    #[arg(long, hide = true)]
    chaos_skip_idempotency: bool,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Cmd::Run(a) = &cli.cmd {
        if a.worker_threads > 0 {
            builder.worker_threads(a.worker_threads);
        }
    }
    let rt = builder
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Run(a) => run(*a).await,
            Cmd::Init {
                endpoint,
                members,
                admin_token_file,
                insecure,
            } => init(endpoint, members, admin_token_file, insecure).await,
            Cmd::Status {
                endpoint,
                require_leaders,
                token,
            } => status(endpoint, require_leaders, token).await,
            Cmd::Restore {
                node_id,
                data_dir,
                backups,
                members,
            } => restore(node_id, data_dir, backups, members),
            Cmd::ForceWhole { data_dir, shard } => {
                for line in allot_node::rejoin::force_whole(&data_dir, shard)? {
                    println!("{line}");
                }
                Ok(())
            }
            Cmd::DevCerts { out, hosts } => {
                allot_node::tls::write_dev_certs(&out, &hosts)?;
                println!(
                    "wrote {0}/ca.pem, {0}/node.pem, {0}/node-key.pem (and ca-key.pem); start nodes \
                     with --tls-cert {0}/node.pem --tls-key {0}/node-key.pem --tls-ca {0}/ca.pem \
                     and clients with --tls-ca {0}/ca.pem",
                    out.display()
                );
                Ok(())
            }
        }
    })
}

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLOT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn"));
    if a.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    if a.test_clock_offset_ms != 0 {
        tracing::warn!(
            offset_ms = a.test_clock_offset_ms,
            "TEST CLOCK OFFSET: this node's wall clock is skewed on purpose"
        );
    }
    if a.insecure_dev_mode {
        for _ in 0..3 {
            tracing::warn!(
                "INSECURE DEV MODE: requests without a token run as the identity they claim \
                 until an admin token is bootstrapped. Never use this in production."
            );
        }
    }
    if a.peer_secret_file.is_none() && a.tls_cert.is_none() {
        tracing::warn!(
            "no peer authentication (--peer-secret-file or --tls-*): anyone who reaches \
             this port can send Raft messages as a peer. Set one in production."
        );
    }
    let mut peer_routes = Vec::new();
    for r in &a.peer_route {
        let Some((addr, via)) = r.split_once('=') else {
            bail!("--peer-route must be ADDR=VIA (got {r:?})");
        };
        if addr.is_empty() || via.is_empty() {
            bail!("--peer-route must be ADDR=VIA (got {r:?})");
        }
        peer_routes.push((addr.to_string(), via.to_string()));
    }
    #[cfg(feature = "chaos")]
    if a.chaos_skip_idempotency {
        tracing::warn!("CHAOS: request ids are replaced before proposing (idempotency off)");
        allot_node::chaos::SKIP_IDEMPOTENCY.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("binding gRPC listener {}", a.listen))?;
    let metrics = if a.metrics_listen.is_empty() {
        None
    } else {
        Some(
            tokio::net::TcpListener::bind(&a.metrics_listen)
                .await
                .with_context(|| format!("binding metrics listener {}", a.metrics_listen))?,
        )
    };
    let config = NodeConfig {
        id: a.node_id,
        advertise: a.advertise.clone().unwrap_or_else(|| a.listen.clone()),
        data_dir: a.data_dir.clone(),
        shards: a.shards,
        raft: RaftTimings {
            heartbeat_ms: a.heartbeat_ms,
            election_min_ms: a.election_min_ms,
            election_max_ms: a.election_max_ms,
            snapshot_every: a.snapshot_every,
            snapshot_log_percent: a.snapshot_log_percent,
            snapshot_min_log_bytes: a.snapshot_min_log_bytes,
            keep_behind_snapshot: a.keep_behind_snapshot,
            commit_linger_us: a.commit_linger_us,
            leader_flush_overlap: a.leader_flush_overlap == "on",
        },
        proposer: ProposerConfig {
            max_batch: a
                .batch_max
                .clamp(1, allot_statemachine::limits::COMMANDS_PER_ENTRY_MAX),
            window: Duration::from_micros(a.batch_window_us),
            max_inflight: a.inflight.max(1),
            tick: Duration::from_millis(a.tick_ms.max(10)),
            slew_ppm: a.clock_slew_ppm,
            slow: (a.slow_proposal_ms > 0).then(|| Duration::from_millis(a.slow_proposal_ms)),
            ..ProposerConfig::default()
        },
        clock_offset_ms: a.test_clock_offset_ms,
        test_clock_offset_file: a.test_clock_offset_file.clone(),
        peer_routes,
        insecure_dev_mode: a.insecure_dev_mode,
        test_fsync_fail_file: a.test_fsync_fail_file.clone(),
        test_fsync_hold_file: a.test_fsync_hold_file.clone(),
        test_snapshot_hold_file: a.test_snapshot_hold_file.clone(),
        test_audit_fill_hold_file: a.test_audit_fill_hold_file.clone(),
        test_without_handoff: a.test_without_handoff,
        rules_max: a.max_rules_version,
        min_free_disk: a.min_free_disk_mib.saturating_mul(1 << 20),
        peer_link: a.peer_link == "on",
        peer_secret: match &a.peer_secret_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading the peer secret {}", f.display()))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        },
        tls: match (&a.tls_cert, &a.tls_key, &a.tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(allot_node::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            }),
            _ => None,
        },
    };
    use allot_node::ratelimit::Rate;
    let rate = |per_sec: u32, burst: u32| Rate { per_sec, burst };
    let limits = allot_node::ratelimit::Limits {
        write: rate(a.rate_limit, a.rate_burst),
        read: rate(a.read_rate_limit, a.read_rate_burst),
        admin: Rate::with_short_burst(a.admin_rate_limit),
        unresolved: Rate::with_short_burst(a.unauthenticated_rate_limit),
    };
    let node = Node::start(config).await?;
    tracing::info!(
        node = a.node_id,
        listen = %a.listen,
        metrics = %a.metrics_listen,
        shards = a.shards,
        data_dir = %a.data_dir.display(),
        "allot-node serving"
    );
    let watched = node.clone();
    let stopping = node.clone();
    tokio::select! {
        r = serve(
            node,
            listener,
            metrics,
            RateLimiter::new(limits),
            a.max_connections,
            shutdown_signal(),
        ) => r,
        (shard, error) = async move { watched.fatal().await } => {
            tracing::error!(shard, %error, "fatal storage error: exiting (restart the node once the disk is fixed)");
            // Exiting runs RocksDB's static destructors: not while the other shards'
            // Raft or a snapshot build is inside RocksDB. Stop them first, bounded.
            let bound = allot_node::node::BACKGROUND_STOP_MAX + Duration::from_secs(10);
            if tokio::time::timeout(bound, stopping.shutdown()).await.is_err() {
                tracing::warn!("shutdown after the fatal error took over {bound:?}; exiting anyway");
            }
            let _ = watched_flush();
            std::process::exit(EXIT_FATAL_STORAGE);
        }
    }
}

/// Exit status after a fatal storage error (EX_IOERR).
const EXIT_FATAL_STORAGE: i32 = 74;

fn watched_flush() -> std::io::Result<()> {
    use std::io::Write;
    std::io::stderr().flush()?;
    std::io::stdout().flush()
}

async fn admin(endpoint: &str) -> anyhow::Result<AdminClient<tonic::transport::Channel>> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .with_context(|| format!("connecting to {endpoint}"))?;
    Ok(AdminClient::new(ch))
}

fn parse_members(members: Vec<String>) -> anyhow::Result<Vec<(u64, String)>> {
    let mut ms = Vec::new();
    for m in members {
        let Some((id, addr)) = m.split_once('=') else {
            bail!("--member must be id=host:port (got {m})");
        };
        let node_id: u64 = id.parse().with_context(|| format!("member id {id}"))?;
        ms.push((node_id, addr.to_string()));
    }
    Ok(ms)
}

/// The backup files named: a directory stands for its `*.allot-backup` files.
fn backup_files(paths: Vec<PathBuf>) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if !p.is_dir() {
            files.push(p);
            continue;
        }
        let mut set: Vec<PathBuf> = std::fs::read_dir(&p)
            .with_context(|| format!("reading {}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|x| x == "allot-backup"))
            .collect();
        if set.is_empty() {
            bail!("{} holds no *.allot-backup file", p.display());
        }
        set.sort();
        files.extend(set);
    }
    Ok(files)
}

fn restore(
    node_id: u64,
    data_dir: PathBuf,
    files: Vec<PathBuf>,
    members: Vec<String>,
) -> anyhow::Result<()> {
    let members = parse_members(members)?;
    let members = (!members.is_empty()).then_some(members.as_slice());
    let files = backup_files(files)?;
    let restored = allot_node::backup::restore(&data_dir, node_id, &files, members)?;
    let shards = restored.first().map_or(0, |r| r.shards);
    for r in &restored {
        println!(
            "shard {}: restored at log index {} (logical time {} ms, state hash {}, {} audit \
             events, {} audit rows) from {}",
            r.summary.shard,
            r.summary.position.map_or(0, |p| p.index),
            r.summary.logical_time_ms,
            hex(&r.summary.state_hash[..8]),
            r.summary.audit_events,
            r.rows,
            r.file.display()
        );
    }
    if let Some(r) = restored.first() {
        println!(
            "cluster id {} (every node restored from this backup set with these members has \
             it; peers of any other are refused)",
            allot_node::identity::hex(&r.cluster)
        );
    }
    println!(
        "data dir {} is ready: start the node with `allot-node run --node-id {node_id} \
         --data-dir {} --shards {shards} ...` (no init)",
        data_dir.display(),
        data_dir.display()
    );
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn init(
    endpoint: String,
    members: Vec<String>,
    admin_token_file: Option<PathBuf>,
    insecure: bool,
) -> anyhow::Result<()> {
    let ms = parse_members(members)?;
    let shards = admin(&endpoint)
        .await?
        .status(StatusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("status of {endpoint}: {}", s.message()))?
        .into_inner()
        .shards
        .len() as u32;
    allot_node::local_cluster::init_spread(&ms, shards).await?;
    println!("initialised {shards} shards over {} members", ms.len());
    if insecure {
        eprintln!("WARNING: cluster left unsecured (--insecure): development only");
        return Ok(());
    }
    let (token, source) = allot_client::security::admin_token(admin_token_file.as_deref())?;
    allot_client::Client::builder()
        .endpoints(ms.iter().map(|(_, a)| a.clone()))
        .shards(shards)
        .timeout(Duration::from_secs(30))
        .retries(u32::MAX)
        .build()?
        .bootstrap(allot_statemachine::PrincipalId(1), &token)
        .await
        .context("installing the admin token (bootstrap)")?;
    println!(
        "{}",
        allot_client::security::admin_token_help(&token, &source)
    );
    Ok(())
}

async fn status(
    endpoint: String,
    require_leaders: bool,
    token: Option<String>,
) -> anyhow::Result<()> {
    let mut req = tonic::Request::new(StatusRequest {});
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse()?);
    }
    let r = admin(&endpoint)
        .await?
        .status(req)
        .await
        .map_err(|s| anyhow::anyhow!("status: {}", s.message()))?
        .into_inner();
    let mut leaderless = 0;
    for s in &r.shards {
        println!(
            "node {} shard {} state {} term {} leader {} applied {} last_log {} time_ms {}",
            s.node_id,
            s.shard,
            s.state,
            s.term,
            s.leader,
            s.applied_index,
            s.last_log_index,
            s.logical_time_ms
        );
        if s.leader == 0 {
            leaderless += 1;
        }
    }
    if require_leaders && (leaderless > 0 || r.shards.is_empty()) {
        bail!("{leaderless} shard(s) without a leader");
    }
    Ok(())
}
