//! Prometheus metrics, served on their own port (`/metrics`). Counters and histograms are
//! updated on the request path; per-shard gauges (Raft position, queues, GPUs, credits)
//! are refreshed from the shards at scrape time.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    pub batch_size: HistogramVec,
    /// Encoded request bytes per proposed log entry.
    pub batch_bytes: HistogramVec,
    /// Calls refused at the edge before anything was proposed, by api and reason
    /// (`invalid`, `too_large`, `rate_limited`, `streams`, `peer`, ...).
    pub refusals: IntCounterVec,
    /// Server streams open now (`WatchAssignments`).
    pub streams: prometheus::IntGauge,
    /// Connections holding a slot now, by `state` (`authenticated`, `unauthenticated`),
    /// and the node's bound (`max`): refreshed at scrape time (`crate::connections`).
    pub connections: IntGaugeVec,
    /// Free bytes on the data directory's file system, and whether the node refuses
    /// tenants' writes for it (`crate::disk`).
    pub disk_free_bytes: prometheus::IntGauge,
    pub disk_low: prometheus::IntGauge,
    pub requests: IntCounterVec,
    pub latency: HistogramVec,
    /// Where a proposal's time goes: `queue` (waiting for a batch and a pipeline slot),
    /// `commit` (handed to openraft until answered), and `commit` split on the leader's
    /// own timeline: `append` (until RaftCore wrote it to the log), `replicate` (from that
    /// write until it was committed — a quorum's fsyncs and acknowledgements — and handed
    /// to apply), `apply` (until the caller was answered). Beside them, `local_flush`:
    /// each append's wait from its write to its WAL fsync on this node, observed by the
    /// sync thread when it happens (leaders' and followers' appends; a leader's runs in
    /// parallel with `replicate`, docs/DESIGN.md §62).
    pub stage: HistogramVec,
    /// How long this node took to answer the leader's AppendEntries, per shard (decode,
    /// append, fsync, reply): the follower's part of the `replicate` stage.
    pub follower_append: HistogramVec,
    /// The leader's side of the same: from sending an AppendEntries to its answer
    /// (transport both ways and the follower's time), per shard.
    pub peer_append: HistogramVec,
    /// Raft calls this node sent to its peers, by transport (`link`, `grpc`).
    pub peer_rpcs: IntCounterVec,
    /// Peer-link connections this node served, by result (`accepted`, `unauthenticated`).
    pub peer_link_connections: IntCounterVec,
    /// Entries carried by each AppendEntries this node answered, per shard; the `le="0"`
    /// bucket counts the ones that carried only a commit index or a heartbeat.
    pub follower_append_entries: HistogramVec,
    /// Duration of each WAL fsync (one covers the waiting appends of every shard).
    pub wal_sync: prometheus::Histogram,
    /// How long the oldest append the WAL sync thread is making durable has waited
    /// (0 while it is idle); it keeps growing while an fsync does not return.
    pub wal_sync_waiting: prometheus::Gauge,
    pub raft: GaugeVec,
    pub queue_depth: GaugeVec,
    pub gpus: GaugeVec,
    pub credits: GaugeVec,
    /// Calls refused at the edge, by api and reason.
    pub auth_denials: IntCounterVec,
    /// Snapshot building per shard and stage: `clone` (under the apply lock), `encode`,
    /// `store` (written and flushed).
    pub snapshot: HistogramVec,
    /// Size of the last snapshot built or installed, per shard.
    pub snapshot_bytes: GaugeVec,
    /// Audit events copied from peers into gaps left by snapshot installs, per shard.
    pub audit_rows_copied: IntCounterVec,
    /// The demand signal (DESIGN §52) per shard and GPU type, every job taken to run to
    /// its max duration: GPUs that take work and GPUs used (`kind`), the queued work,
    /// the wait it implies (+Inf: work and no capacity), and per tier the GPUs that
    /// would bring the tier within its target wait.
    pub demand_gpus: GaugeVec,
    pub demand_queued_gpu_hours: GaugeVec,
    pub demand_wait_seconds: GaugeVec,
    pub demand_gpus_needed: GaugeVec,
    /// What a shard's replica holds in memory, per table (`table`): the rows that grow
    /// with traffic or tenants, bounded as DESIGN §44 and `statemachine/src/limits.rs`
    /// say, so memory growth can be read off line by line (DESIGN §63).
    pub state_rows: GaugeVec,
    /// RocksDB's own memory per column family and kind (`memtables`, `table_readers`,
    /// `block_cache`), from its properties at scrape time.
    pub rocksdb_memory_bytes: GaugeVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are static; a failure here is a programming error caught by
    // the first test that starts a node.
    r.unwrap_or_else(|e| panic!("metric definition: {e}"))
}

/// Latency buckets (seconds) fine enough to tell a 10 ms target from its neighbours.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
        0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
    ]
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("allot".into()), None).unwrap_or_default();
        let batch_size = must(HistogramVec::new(
            HistogramOpts::new("proposal_batch_size", "Requests per proposed log entry").buckets(
                vec![0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 8192.0],
            ),
            &["shard"],
        ));
        let batch_bytes = must(HistogramVec::new(
            HistogramOpts::new(
                "proposal_batch_bytes",
                "Encoded request bytes per proposed log entry",
            )
            .buckets(vec![
                0.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 2097152.0,
            ]),
            &["shard"],
        ));
        let refusals = must(IntCounterVec::new(
            Opts::new(
                "edge_refusals_total",
                "Calls refused at the edge before proposing, by api and reason",
            ),
            &["api", "reason"],
        ));
        let streams = must(prometheus::IntGauge::new(
            "open_streams",
            "Server streams (WatchAssignments) open now",
        ));
        let connections = must(IntGaugeVec::new(
            Opts::new(
                "edge_connections",
                "Client and peer connections holding a slot, by state, and the bound (max)",
            ),
            &["state"],
        ));
        let disk_free_bytes = must(prometheus::IntGauge::new(
            "disk_free_bytes",
            "Free bytes on the data directory's file system",
        ));
        let disk_low = must(prometheus::IntGauge::new(
            "disk_low",
            "1 while the disk is below --min-free-disk-mib and tenants' writes are refused",
        ));
        let requests = must(IntCounterVec::new(
            Opts::new("requests_total", "gRPC requests by method and result"),
            &["method", "result"],
        ));
        let latency = must(HistogramVec::new(
            HistogramOpts::new("request_seconds", "gRPC request latency by method")
                .buckets(latency_buckets()),
            &["method"],
        ));
        let stage = must(HistogramVec::new(
            HistogramOpts::new(
                "proposal_stage_seconds",
                "Proposal time per stage and shard",
            )
            .buckets(latency_buckets()),
            &["shard", "stage"],
        ));
        let follower_append = must(HistogramVec::new(
            HistogramOpts::new(
                "follower_append_seconds",
                "Time to answer an AppendEntries from the shard's leader",
            )
            .buckets(latency_buckets()),
            &["shard"],
        ));
        let peer_append = must(HistogramVec::new(
            HistogramOpts::new(
                "peer_append_seconds",
                "Time from sending an AppendEntries to the shard's follower to its answer",
            )
            .buckets(latency_buckets()),
            &["shard"],
        ));
        let follower_append_entries = must(HistogramVec::new(
            HistogramOpts::new(
                "follower_append_entries",
                "Entries in each AppendEntries answered for the shard's leader",
            )
            .buckets(vec![0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
            &["shard"],
        ));
        let wal_sync = must(prometheus::Histogram::with_opts(
            HistogramOpts::new("wal_sync_seconds", "WAL fsync duration (group commit)")
                .buckets(latency_buckets()),
        ));
        let raft = must(GaugeVec::new(
            Opts::new(
                "raft",
                "Raft position per shard (term, leader, applied, last_log, is_leader)",
            ),
            &["shard", "field"],
        ));
        let queue_depth = must(GaugeVec::new(
            Opts::new("queue_depth", "Queued jobs per shard and tier"),
            &["shard", "tier"],
        ));
        let gpus = must(GaugeVec::new(
            Opts::new("gpus", "GPUs per shard: fleet and used"),
            &["shard", "kind"],
        ));
        let credits = must(GaugeVec::new(
            Opts::new("credits_micro", "Credit totals per shard (micro-credits)"),
            &["shard", "kind"],
        ));
        let peer_rpcs = must(IntCounterVec::new(
            Opts::new(
                "peer_rpcs_total",
                "Raft calls sent to peers, by transport (link: the peer link; grpc)",
            ),
            &["transport"],
        ));
        let peer_link_connections = must(IntCounterVec::new(
            Opts::new(
                "peer_link_connections_total",
                "Peer-link connections served, by result (accepted, unauthenticated)",
            ),
            &["result"],
        ));
        let auth_denials = must(IntCounterVec::new(
            Opts::new(
                "auth_denials_total",
                "Calls refused at the edge by api and reason",
            ),
            &["api", "reason"],
        ));
        let snapshot = must(HistogramVec::new(
            HistogramOpts::new(
                "snapshot_seconds",
                "Snapshot build time per shard and stage",
            )
            .buckets(vec![
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
            ]),
            &["shard", "stage"],
        ));
        let snapshot_bytes = must(GaugeVec::new(
            Opts::new("snapshot_bytes", "Size of the last snapshot per shard"),
            &["shard"],
        ));
        let audit_rows_copied = must(IntCounterVec::new(
            Opts::new(
                "audit_events_copied_total",
                "Audit events copied from peers into gaps a snapshot install left",
            ),
            &["shard"],
        ));
        let demand_gpus = must(GaugeVec::new(
            Opts::new(
                "demand_gpus",
                "GPUs per shard and type: capacity (nodes taking work) and used",
            ),
            &["shard", "gpu_type", "kind"],
        ));
        let demand_queued_gpu_hours = must(GaugeVec::new(
            Opts::new(
                "demand_queued_gpu_hours",
                "Queued work per shard and GPU type (GPUs x max duration), GPU-hours",
            ),
            &["shard", "gpu_type"],
        ));
        let demand_wait_seconds = must(GaugeVec::new(
            Opts::new(
                "demand_wait_seconds",
                "Time the type's capacity takes to run its queued work (+Inf: no capacity)",
            ),
            &["shard", "gpu_type"],
        ));
        let demand_gpus_needed = must(GaugeVec::new(
            Opts::new(
                "demand_gpus_needed",
                "GPUs to add for the tier's queued work (and above) to be within its target wait",
            ),
            &["shard", "gpu_type", "tier"],
        ));
        let wal_sync_waiting = must(prometheus::Gauge::new(
            "wal_sync_waiting_seconds",
            "How long the oldest append being made durable has waited for its fsync (0: idle)",
        ));
        let state_rows = must(GaugeVec::new(
            Opts::new(
                "state_rows",
                "Rows a shard's replica holds in memory, per table",
            ),
            &["shard", "table"],
        ));
        let rocksdb_memory_bytes = must(GaugeVec::new(
            Opts::new(
                "rocksdb_memory_bytes",
                "RocksDB memory per column family and kind (memtables, table_readers, block_cache)",
            ),
            &["cf", "kind"],
        ));
        for c in [
            Box::new(snapshot.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(state_rows.clone()),
            Box::new(wal_sync_waiting.clone()),
            Box::new(rocksdb_memory_bytes.clone()),
            Box::new(audit_rows_copied.clone()),
            Box::new(snapshot_bytes.clone()),
            Box::new(auth_denials.clone()),
            Box::new(batch_size.clone()),
            Box::new(batch_bytes.clone()),
            Box::new(refusals.clone()),
            Box::new(streams.clone()),
            Box::new(connections.clone()),
            Box::new(disk_free_bytes.clone()),
            Box::new(disk_low.clone()),
            Box::new(requests.clone()),
            Box::new(latency.clone()),
            Box::new(stage.clone()),
            Box::new(follower_append.clone()),
            Box::new(peer_append.clone()),
            Box::new(peer_rpcs.clone()),
            Box::new(peer_link_connections.clone()),
            Box::new(follower_append_entries.clone()),
            Box::new(wal_sync.clone()),
            Box::new(raft.clone()),
            Box::new(queue_depth.clone()),
            Box::new(gpus.clone()),
            Box::new(credits.clone()),
            Box::new(demand_gpus.clone()),
            Box::new(demand_queued_gpu_hours.clone()),
            Box::new(demand_wait_seconds.clone()),
            Box::new(demand_gpus_needed.clone()),
        ] {
            must(registry.register(c));
        }
        Metrics {
            registry,
            batch_size,
            batch_bytes,
            refusals,
            streams,
            connections,
            disk_free_bytes,
            disk_low,
            requests,
            latency,
            stage,
            follower_append,
            peer_append,
            peer_rpcs,
            peer_link_connections,
            follower_append_entries,
            wal_sync,
            raft,
            queue_depth,
            gpus,
            credits,
            auth_denials,
            snapshot,
            snapshot_bytes,
            audit_rows_copied,
            demand_gpus,
            demand_queued_gpu_hours,
            demand_wait_seconds,
            demand_gpus_needed,
            state_rows,
            rocksdb_memory_bytes,
            wal_sync_waiting,
        }
    }

    pub fn encode(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// At most one event a second (log lines an attacker could otherwise multiply).
#[derive(Default)]
pub struct Throttle {
    last_s: std::sync::atomic::AtomicU64,
}

impl Throttle {
    /// Whether the event may happen now (true at most once per wall-clock second).
    pub fn due(&self) -> bool {
        use std::sync::atomic::Ordering;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            + 1;
        let last = self.last_s.load(Ordering::Relaxed);
        last != now
            && self
                .last_s
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
