//! A node: one process hosting every shard of the cluster (one Raft group each), over one
//! RocksDB, with one clock sampler and one channel pool shared by the shards.

use crate::clock::ClusterClock;
use crate::metrics::Metrics;
use crate::network::{Channels, Network};
use crate::proposer::{Proposer, ProposerConfig, ProposerTask};
use crate::store::{self, LogStore, ShardView, SnapshotTrigger, StateMachineStore};
use crate::types::{NodeId, Raft, ShardId};
use allot_proto::ClockRequest;
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Raft timings of every shard.
#[derive(Clone, Copy, Debug)]
pub struct RaftTimings {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    /// Entries applied since the last snapshot that trigger a new one (a backstop: the
    /// size rule below normally comes first).
    pub snapshot_every: u64,
    /// Size rule: snapshot once the log appended since the last snapshot is this share
    /// (percent) of that snapshot's size, and at least `snapshot_min_log_bytes`.
    pub snapshot_log_percent: u64,
    pub snapshot_min_log_bytes: u64,
    /// Entries kept in the log behind the snapshot (for followers slightly behind).
    pub keep_behind_snapshot: u64,
    /// How long a leader's commit-index advance waits for the next AppendEntries to a
    /// follower to carry it before one is sent for it alone (0: at once, openraft's
    /// behaviour). Below `heartbeat_ms` (docs/DESIGN.md §54).
    pub commit_linger_us: u64,
    /// A leader sends what it appends to its followers without waiting for its own log
    /// flush, and counts itself towards the quorum once the flush is reported (openraft
    /// patch `Config::leader_flush_overlap`; docs/DESIGN.md §62). false: openraft's
    /// behaviour, the flush first.
    pub leader_flush_overlap: bool,
}

impl Default for RaftTimings {
    fn default() -> Self {
        RaftTimings {
            heartbeat_ms: 100,
            election_min_ms: 600,
            election_max_ms: 1200,
            snapshot_every: 1_000_000,
            snapshot_log_percent: 100,
            snapshot_min_log_bytes: 16 << 20,
            keep_behind_snapshot: 1024,
            commit_linger_us: 5_000,
            leader_flush_overlap: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// The gRPC address peers and clients reach this node at.
    pub advertise: String,
    pub data_dir: PathBuf,
    pub shards: u32,
    pub raft: RaftTimings,
    pub proposer: ProposerConfig,
    /// Test-only skew of this node's wall clock, ms.
    pub clock_offset_ms: i64,
    /// Test only: a file holding a clock offset in ms, re-read every 50 ms (clock bumps
    /// and strobes without a restart); absent or unreadable = `clock_offset_ms`.
    pub test_clock_offset_file: Option<PathBuf>,
    /// Peer routes: dial the peer advertised at the key at the value instead
    /// (`--peer-route`; used by the fault-injection harness's per-link proxies).
    pub peer_routes: Vec<(String, String)>,
    /// Accept requests without a bearer token (their claimed actor) while the shard is
    /// unsecured. Off unless `--insecure-dev-mode`; logged loudly at start.
    pub insecure_dev_mode: bool,
    /// Test fault injection: while this file exists, WAL fsyncs fail.
    pub test_fsync_fail_file: Option<PathBuf>,
    /// Test hook: while this file exists, snapshot builds wait between encoding and
    /// storing (`--test-snapshot-hold-file`).
    pub test_snapshot_hold_file: Option<PathBuf>,
    /// TEST ONLY: while this file exists, no WAL fsync starts (a stalled disk).
    pub test_fsync_hold_file: Option<PathBuf>,
    /// While this file exists, the audit fill task copies no rows from peers
    /// (`--test-audit-fill-hold-file`).
    pub test_audit_fill_hold_file: Option<PathBuf>,
    /// Answers `Raft.Handoff` `UNIMPLEMENTED`, as a release without leader transfer
    /// does (`--test-without-handoff`).
    pub test_without_handoff: bool,
    /// TLS for clients and peers (`--tls-cert/--tls-key/--tls-ca`).
    pub tls: Option<crate::tls::TlsFiles>,
    /// The secret peers present to each other (`--peer-secret-file`), if any.
    pub peer_secret: Option<String>,
    /// Serve and dial the peer link (`crate::link`; `--peer-link`). Without TLS only.
    pub peer_link: bool,
    /// The newest rule version this node supports (`--max-rules-version`; at most
    /// `allot_statemachine::version::RULES_MAX`).
    pub rules_max: u32,
    /// Below this many free bytes on the data directory's disk, tenants' writes are
    /// refused (`--min-free-disk-mib`; 0: never; `crate::disk`).
    pub min_free_disk: u64,
}

pub struct Shard {
    pub id: ShardId,
    pub raft: Raft,
    pub view: ShardView,
    pub proposer: Proposer,
    /// Inbound AppendEntries and snapshot chunks are handled one at a time per shard
    /// (their guards compare with the committed log id); the snapshot being received.
    pub inbound: tokio::sync::Mutex<crate::peer::SnapshotReceiver>,
    /// A received snapshot's state, decoded (checked) before openraft installs it.
    pub preloaded: store::sm::Preloaded,
    /// Set while this node hands the shard's leadership over: proposals wait.
    pub pause: Arc<crate::transfer::Pause>,
    /// Elections held for another node's leader transfer.
    pub hold: Arc<crate::transfer::Hold>,
    /// Whether the replica, if it opened empty, has caught up enough to vote
    /// (`crate::rejoin`).
    pub rejoin: Arc<crate::rejoin::Rejoin>,
    /// A reader of the shard's log store (the last log id, for `crate::rejoin`).
    log: LogStore,
}

pub struct Node {
    pub id: NodeId,
    pub advertise: String,
    pub shards: Vec<Shard>,
    pub db: Arc<rocksdb::DB>,
    /// The WAL's group-commit thread, shared by every shard (`store::log::Syncer`).
    pub syncer: Arc<store::log::Syncer>,
    pub clock: Arc<ClusterClock>,
    pub channels: Arc<Channels>,
    pub metrics: Arc<Metrics>,
    pub config: NodeConfig,
    /// Edge denials waiting for the audit trail.
    pub denials: crate::auth::Denials,
    /// The data directory's free space (`crate::disk`).
    pub disk: crate::disk::DiskGuard,
    /// Tenants' audit scans running now (`crate::server::AuditScans`).
    pub audit_scans: Arc<crate::server::AuditScans>,
    /// Loaded TLS configuration, if the node serves TLS.
    pub tls: Option<crate::tls::Tls>,
    /// How peers authenticate to this node.
    pub peer_auth: crate::peer::PeerAuth,
    /// The cluster this node's data belongs to (`crate::identity`).
    pub identity: Arc<crate::identity::Identity>,
    /// Whether this node serves (and dials) the peer link: `--peer-link on` without TLS.
    pub peer_link: bool,
    /// Raft messages being decoded and handled now (`RAFT_MESSAGES_IN_FLIGHT_MAX`).
    raft_in_flight: Arc<tokio::sync::Semaphore>,
    /// Rate of warnings about refused peer messages.
    pub log_throttle: crate::metrics::Throttle,
    /// Snapshot builds running on threads of their own: shutdown waits for them.
    background: Arc<store::sm::Background>,
    /// The client and peer connection slots, once the node serves (`crate::serve`).
    pub connections: std::sync::OnceLock<crate::connections::Connections>,
    /// `Admin.Init` calls, one at a time: a shard's emptiness check, its "initialised
    /// here" flag and openraft's `initialize` are one step (`crate::rejoin`).
    pub init_lock: tokio::sync::Mutex<()>,
}

const SHARD_COUNT_KEY: &[u8] = b"cluster/shards";

/// How long shutdown waits for snapshot builds (encoding a large state takes seconds;
/// well inside a supervisor's usual stop timeout, systemd's 90 s).
pub const BACKGROUND_STOP_MAX: std::time::Duration = std::time::Duration::from_secs(60);

impl Shard {
    /// The replica's last log id (an entry's, or its snapshot's once the log before it
    /// was purged), read from its store.
    pub async fn last_log_id(&self) -> Result<Option<crate::types::LogId>, String> {
        use openraft::storage::RaftLogStorage;
        let mut log = self.log.clone();
        log.get_log_state()
            .await
            .map(|st| st.last_log_id)
            .map_err(|e| e.to_string())
    }

    /// Whether the replica holds nothing: no log entry, no snapshot, no vote.
    pub async fn is_empty_replica(&self) -> Result<bool, String> {
        use openraft::storage::RaftLogStorage;
        if self.last_log_id().await?.is_some() {
            return Ok(false);
        }
        let mut log = self.log.clone();
        Ok(log.read_vote().await.map_err(|e| e.to_string())?.is_none())
    }

    /// Every member of the shard's current configuration (voters and learners), with
    /// the address it is reached at.
    pub fn members(&self) -> Vec<(NodeId, String)> {
        let m = self.raft.metrics().borrow().membership_config.clone();
        m.membership()
            .nodes()
            .map(|(id, n)| (*id, n.addr.clone()))
            .collect()
    }
}

impl Node {
    pub async fn start(config: NodeConfig) -> anyhow::Result<Arc<Node>> {
        if config.shards == 0 || config.shards > crate::limits::SHARDS_MAX {
            bail!(
                "--shards must be between 1 and {} (got {})",
                crate::limits::SHARDS_MAX,
                config.shards
            );
        }
        if config.raft.commit_linger_us >= config.raft.heartbeat_ms.saturating_mul(1000) {
            bail!(
                "--commit-linger-us ({} µs) must be below --heartbeat-ms ({} ms)",
                config.raft.commit_linger_us,
                config.raft.heartbeat_ms
            );
        }
        if config.id == 0 {
            bail!("--node-id must be positive (0 means 'no leader' on the wire)");
        }
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
        // Before anything opens (and so touches) the data dir: a dir written by a newer
        // format is refused as it is.
        // A restore into this (existing) dir that completed its copy but not its move.
        if crate::backup::finish_install(&config.data_dir)
            .with_context(|| format!("finishing a restore into {}", config.data_dir.display()))?
        {
            tracing::info!("finished installing an interrupted restore");
        }
        crate::versions::check_data_dir(&config.data_dir)?;
        let db = store::open_db(&config.data_dir.join("db"))
            .with_context(|| format!("opening RocksDB in {}", config.data_dir.display()))?;
        check_shard_count(&db, config.shards)?;
        // Which cluster this data belongs to (`crate::identity`); whether a new node may
        // adopt its first peer's is known once every shard has opened (below).
        let identity = Arc::new(crate::identity::Identity::open(db.clone())?);
        let clock = Arc::new(ClusterClock::new(config.clock_offset_ms));
        let tls = config
            .tls
            .as_ref()
            .map(|f| crate::tls::Tls::load(f, config.peer_link))
            .transpose()?;
        let channels = Arc::new(Channels::new(
            config.peer_routes.iter().cloned().collect(),
            tls.as_ref(),
            crate::peer::PeerCredential::new(config.peer_secret.as_deref())?
                .with_identity(identity.clone()),
            config.peer_link,
        ));
        let peer_auth = crate::peer::PeerAuth::new(tls.is_some(), config.peer_secret.as_deref())
            .with_identity(identity.clone());
        if !peer_auth.configured() {
            tracing::warn!(
                "peers are not authenticated (no TLS, no --peer-secret-file): anyone who can \
                 reach this node's port can send it Raft messages; use only where nothing but \
                 the cluster's nodes can connect"
            );
        }
        let metrics = Arc::new(Metrics::new());
        let wal = metrics.wal_sync.clone();
        let syncer = store::log::Syncer::start_observed(
            db.clone(),
            move |d, _| wal.observe(d.as_secs_f64()),
            store::log::SyncFaults {
                fail_if: config.test_fsync_fail_file.clone(),
                hold_if: config.test_fsync_hold_file.clone(),
            },
        );
        // Every shard opened: from here this binary's log and audit format may be
        // written (snapshots mark their own format as they are stored).
        crate::versions::mark_data_dir(&config.data_dir, crate::versions::START_FORMAT)?;
        let mut shards: Vec<Shard> = Vec::new();
        let mut every_shard_empty = true;
        let background = Arc::new(store::sm::Background::default());
        for id in 0..config.shards {
            let trigger = Arc::new(SnapshotTrigger::new(
                config.raft.snapshot_log_percent,
                config.raft.snapshot_min_log_bytes,
            ));
            let timeline = Arc::new(store::Timeline::new());
            let local_flush = metrics
                .stage
                .with_label_values(&[id.to_string().as_str(), "local_flush"]);
            timeline.observe_flushes(move |d| local_flush.observe(d.as_secs_f64()));
            let preloaded = store::sm::Preloaded::default();
            let sm = StateMachineStore::open(db.clone(), id, allot_statemachine::Config::default())
                .map_err(|e| anyhow::anyhow!("opening shard {id}: {e}"))?;
            let floor = Arc::new(
                store::log::PurgeFloor::open(&db, id, sm.stored_snapshot_index())
                    .map_err(|e| anyhow::anyhow!("opening shard {id}'s log: {e}"))?,
            );
            let mut log = LogStore::new(db.clone(), id, syncer.clone())
                .with_trigger(trigger.clone())
                .with_timeline(timeline.clone())
                .with_purge_floor(floor.clone());
            let sm = sm
                .with_purge_floor(floor)
                .with_metrics(metrics.clone())
                .with_trigger(trigger.clone())
                .with_timeline(timeline.clone())
                .with_preloaded(preloaded.clone())
                .with_rules_max(config.rules_max)
                .with_background(background.clone())
                .with_test_hold(config.test_snapshot_hold_file.clone());
            let view = sm.view();
            // Read from storage before Raft starts (its metrics are published later): a
            // replica that opens with nothing may be one that lost its disk
            // (`crate::rejoin`).
            let started_empty = {
                use openraft::storage::RaftLogStorage;
                let st = log
                    .get_log_state()
                    .await
                    .map_err(|e| anyhow::anyhow!("reading shard {id}'s log state: {e}"))?;
                let vote = log
                    .read_vote()
                    .await
                    .map_err(|e| anyhow::anyhow!("reading shard {id}'s vote: {e}"))?;
                let g = view.read();
                st.last_log_id.is_none()
                    && vote.is_none()
                    && g.last_applied.is_none()
                    && g.membership.membership().nodes().next().is_none()
            };
            // Rejoining lasts across restarts until the replica is whole: a marker,
            // synced before Raft starts (it may accept a leader's vote at once).
            let mut rejoining = crate::rejoin::marked(&db, id)
                .map_err(|e| anyhow::anyhow!("reading shard {id}'s rejoining marker: {e}"))?;
            if started_empty && rejoining.is_none() {
                let fresh = crate::rejoin::Marker::default();
                crate::rejoin::mark(&db, id, &fresh)
                    .map_err(|e| anyhow::anyhow!("marking shard {id} rejoining: {e}"))?;
                rejoining = Some(fresh);
            }
            let active = store::sm::rules_on_disk(&db, id, &view.read().state)
                .map_err(|e| anyhow::anyhow!("reading shard {id}'s rule version: {e}"))?;
            crate::versions::check_rules(id, active, config.rules_max)?;
            let rc = openraft::Config {
                cluster_name: format!("allot-shard-{id}"),
                heartbeat_interval: config.raft.heartbeat_ms,
                election_timeout_min: config.raft.election_min_ms,
                election_timeout_max: config.raft.election_max_ms,
                snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
                    config.raft.snapshot_every,
                ),
                max_in_snapshot_log_to_keep: config.raft.keep_behind_snapshot,
                max_payload_entries: 64,
                commit_linger_us: config.raft.commit_linger_us,
                leader_flush_overlap: config.raft.leader_flush_overlap,
                ..Default::default()
            }
            .validate()
            .context("raft config")?;
            let log_reader = log.clone();
            let raft = Raft::new(
                config.id,
                Arc::new(rc),
                Network {
                    shard: id,
                    me: config.id,
                    channels: channels.clone(),
                    append_rtt: metrics.peer_append.with_label_values(&[&id.to_string()]),
                    sent: metrics.peer_rpcs.clone(),
                },
                log,
                sm,
            )
            .await
            .with_context(|| format!("starting raft of shard {id}"))?;
            every_shard_empty &= started_empty;
            let rejoin = Arc::new(crate::rejoin::Rejoin::new(rejoining).stored_in(db.clone(), id));
            if rejoining.is_some() {
                tracing::info!(
                    shard = id,
                    stands = rejoin.may_stand(),
                    "this replica opened with an empty log (a new node, or one that lost its \
                     disk): it votes only for a candidate holding a leader's commit, and \
                     stands for no election unless it initialised the shard, until it has \
                     caught up (DESIGN §67)"
                );
                raft.runtime_config().elect(rejoin.may_stand());
                if rejoin.may_stand() {
                    crate::rejoin::whole_once_led(raft.clone(), rejoin.clone(), config.id);
                }
            }
            let pause = Arc::new(crate::transfer::Pause::default());
            let proposer = ProposerTask {
                pause: pause.clone(),
                shard: id,
                me: config.id,
                raft: raft.clone(),
                view: view.clone(),
                clock: clock.clone(),
                timeline,
                config: config.proposer,
                metrics: metrics.clone(),
            }
            .spawn();
            tokio::spawn(snapshot_by_size(raft.clone(), trigger));
            shards.push(Shard {
                id,
                raft,
                view,
                proposer,
                inbound: tokio::sync::Mutex::new(crate::peer::SnapshotReceiver::new(
                    config
                        .data_dir
                        .join("incoming")
                        .join(format!("shard-{id}.snapshot")),
                )),
                preloaded,
                pause,
                hold: Arc::default(),
                rejoin,
                log: log_reader,
            });
        }
        identity.set_fresh(every_shard_empty);
        if let Some(id) = identity.current() {
            tracing::info!(cluster = %crate::identity::hex(&id), "this node's cluster");
        }
        let peer_link = config.peer_link;
        let node = Arc::new(Node {
            id: config.id,
            advertise: config.advertise.clone(),
            shards,
            db,
            syncer,
            clock,
            channels,
            metrics,
            disk: crate::disk::DiskGuard::new(&config.data_dir, config.min_free_disk),
            config,
            denials: Default::default(),
            audit_scans: Default::default(),
            tls,
            peer_auth,
            identity,
            peer_link,
            raft_in_flight: Arc::new(tokio::sync::Semaphore::new(
                crate::limits::RAFT_MESSAGES_IN_FLIGHT_MAX,
            )),
            log_throttle: Default::default(),
            background,
            connections: Default::default(),
            init_lock: Default::default(),
        });
        tokio::spawn(sample_clocks(Arc::downgrade(&node)));
        tokio::spawn(crate::auth::flush_denials(Arc::downgrade(&node)));
        tokio::spawn(crate::disk::watch(Arc::downgrade(&node)));
        tokio::spawn(crate::audit_fill::run(Arc::downgrade(&node)));
        if let Some(f) = node.config.test_clock_offset_file.clone() {
            tokio::spawn(follow_clock_offset(Arc::downgrade(&node), f));
        }
        Ok(node)
    }

    pub fn shard(&self, id: ShardId) -> Option<&Shard> {
        self.shards.get(id as usize)
    }

    /// A place among the Raft messages decoded and handled at once.
    #[allow(clippy::result_large_err)]
    pub async fn raft_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, tonic::Status> {
        self.raft_in_flight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| tonic::Status::unavailable("node shutting down"))
    }

    /// Every other node any shard knows of (voters and learners), id → address.
    pub fn peers(&self) -> BTreeMap<NodeId, String> {
        let mut peers = BTreeMap::new();
        for s in &self.shards {
            let m = s.raft.metrics().borrow().clone();
            for (id, n) in m.membership_config.membership().nodes() {
                if *id != self.id {
                    peers.insert(*id, n.addr.clone());
                }
            }
        }
        peers
    }

    /// Resolves when a shard's Raft has stopped on a fatal error (a storage error such as
    /// ENOSPC or a failed fsync: openraft stops the group rather than continue on a
    /// log it cannot trust). `allot-node run` then exits non-zero, so a supervisor
    /// restarts it and the failure is visible, instead of a process that is up but
    /// silently no longer takes part in its shards. A normal shutdown is not fatal.
    pub async fn fatal(&self) -> (ShardId, String) {
        let waits = self.shards.iter().map(|s| {
            // Watch the server metrics (vote, role, leader, membership: they change
            // rarely), not the full metrics, which change with every entry applied and
            // would wake this task thousands of times a second. Their sender belongs to
            // RaftCore, so it closes when RaftCore stops, after RaftCore has put the
            // reason in the full metrics' `running_state`.
            let mut server = s.raft.server_metrics();
            let metrics = s.raft.metrics();
            let id = s.id;
            Box::pin(async move {
                while server.changed().await.is_ok() {}
                let reason = match &metrics.borrow().running_state {
                    // Shut down: never fatal from here on.
                    Err(openraft::error::Fatal::Stopped) => None,
                    Err(e) => Some(e.to_string()),
                    // RaftCore always reports why it stops; gone without a report, it
                    // panicked.
                    Ok(()) => Some("the shard's Raft core stopped without a report".into()),
                };
                match reason {
                    Some(reason) => (id, reason),
                    None => std::future::pending().await,
                }
            })
        });
        futures::future::select_all(waits).await.0
    }

    /// Stops every shard's Raft, waits for the snapshot builds running on threads of
    /// their own (see [`Node::stop_background`]) and syncs the WAL.
    pub async fn shutdown(&self) {
        for s in &self.shards {
            let _ = s.raft.shutdown().await;
        }
        self.stop_background().await;
        let _ = self.db.flush_wal(true);
    }

    /// Starts no more snapshot builds and waits for the running ones, up to
    /// [`BACKGROUND_STOP_MAX`]: the process must not exit while one of their threads is
    /// inside RocksDB. A build still encoding finishes encoding and then gives up; one
    /// storing finishes storing.
    pub async fn stop_background(&self) {
        let running = self.background.running();
        if running > 0 {
            tracing::info!(running, "waiting for snapshot builds to end");
        }
        let left = self.background.close(BACKGROUND_STOP_MAX).await;
        if left > 0 {
            tracing::warn!(
                left,
                "snapshot builds still running after {:?}; exiting anyway",
                BACKGROUND_STOP_MAX
            );
        }
    }
}

/// The shard count stored in a data dir (none before its first start).
pub fn stored_shard_count(db: &rocksdb::DB) -> anyhow::Result<Option<u32>> {
    let meta = store::cf(db, store::CF_META);
    match db.get_cf(meta, store::shard_key(u32::MAX, SHARD_COUNT_KEY))? {
        Some(v) if v.len() == 4 => Ok(Some(u32::from_be_bytes([v[0], v[1], v[2], v[3]]))),
        Some(_) => bail!("corrupt shard count in the data dir"),
        None => Ok(None),
    }
}

pub(crate) fn check_shard_count(db: &rocksdb::DB, shards: u32) -> anyhow::Result<()> {
    match stored_shard_count(db)? {
        Some(have) if have != shards => {
            bail!("this data dir holds {have} shards; started with --shards {shards}")
        }
        Some(_) => {}
        None => db.put_cf(
            store::cf(db, store::CF_META),
            store::shard_key(u32::MAX, SHARD_COUNT_KEY),
            shards.to_be_bytes(),
        )?,
    }
    Ok(())
}

/// Test only: applies the clock offset written in `file` (ms), every 50 ms.
async fn follow_clock_offset(node: std::sync::Weak<Node>, file: PathBuf) {
    let mut every = tokio::time::interval(Duration::from_millis(50));
    let mut last = None;
    loop {
        every.tick().await;
        let Some(node) = node.upgrade() else { return };
        let offset = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| t.trim().parse::<i64>().ok())
            .unwrap_or(node.config.clock_offset_ms);
        if last != Some(offset) {
            if last.is_some() {
                tracing::warn!(offset_ms = offset, "TEST CLOCK OFFSET changed at run time");
            }
            node.clock.set_offset_ms(offset);
            last = Some(offset);
        }
    }
}

/// Samples every peer's wall clock twice a second (see [`crate::clock`]).
/// Asks the shard's Raft for a snapshot whenever the size rule says one is due
/// (`store::trigger`). openraft ignores the request while a snapshot is being built.
/// Ends when the Raft shuts down.
async fn snapshot_by_size(raft: Raft, trigger: Arc<SnapshotTrigger>) {
    let mut every = tokio::time::interval(Duration::from_millis(250));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if trigger.due() && raft.trigger().snapshot().await.is_err() {
            return;
        }
    }
}

async fn sample_clocks(node: std::sync::Weak<Node>) {
    let mut every = tokio::time::interval(Duration::from_millis(500));
    loop {
        every.tick().await;
        let Some(node) = node.upgrade() else { return };
        let peers = node.peers();
        let mut calls = Vec::new();
        for (id, addr) in peers {
            let Ok(mut client) = node.channels.raft_client(&addr) else {
                continue;
            };
            let clock = node.clock.clone();
            let mut req = node.channels.peer_request(ClockRequest {});
            calls.push(async move {
                let sent = std::time::Instant::now();
                req.set_timeout(Duration::from_millis(300));
                match client.clock(req).await {
                    // Only the peer asked for counts: an address that now serves another
                    // node (or this one) must not give one clock two votes.
                    Ok(r) if r.get_ref().node_id == id => {
                        let wall = r.into_inner().wall_ms;
                        clock.record(id, sent, wall, std::time::Instant::now())
                    }
                    _ => clock.forget(id),
                }
            });
        }
        drop(node);
        futures::future::join_all(calls).await;
    }
}
