//! The state machine of one shard: allot's pure [`State`] in memory, restored at start-up
//! from the last snapshot (the log after it is re-applied by openraft from the committed
//! log id). Applying persists each entry's audit events and its batch (the commands the
//! events bind by digest) in the `audit` column family.

use super::{cf, io_read, io_write, shard_key, CF_AUDIT, CF_SNAP};
use super::{SnapshotTrigger, Timeline};
use crate::metrics::Metrics;
use crate::types::{
    Applied, LogEntry, LogId, ShardId, Snapshot, SnapshotMeta, StorageError, StoredMembership,
    TypeConfig,
};
use allot_statemachine::{apply_into, codec, ApplyOutput, AuditEvent, Config, Entry, State};
use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, RaftSnapshotBuilder};
use rocksdb::{WriteBatch, WriteOptions, DB};
use serde::{Deserialize, Serialize};
use std::io::Cursor;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Instant;
use tokio::sync::watch;

/// The largest audit-row buffer a shard keeps between applies: one large entry's rows
/// do not pin their memory for the life of the process.
const ROW_BUFFER_KEPT: usize = 4 << 20;

/// Audit key spaces inside a shard's range of the `audit` column family.
pub const AUDIT_EVENTS: u8 = 0;
pub const AUDIT_BATCHES: u8 = 1;

pub fn audit_key(shard: ShardId, space: u8, n: u64) -> Vec<u8> {
    let mut suffix = Vec::with_capacity(9);
    suffix.push(space);
    suffix.extend_from_slice(&n.to_be_bytes());
    shard_key(shard, &suffix)
}

/// What the services read: the state and the Raft position it reflects.
#[derive(Clone, Debug)]
pub struct AppliedState {
    pub state: State,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    /// Snapshots installed since the process started (the audit fill looks for the gap
    /// each one leaves: `crate::audit_fill`).
    pub snapshots_installed: u64,
}

/// Shared read access to a shard's applied state (queries, watches, status).
#[derive(Clone)]
pub struct ShardView {
    inner: Arc<RwLock<AppliedState>>,
    applied: watch::Receiver<u64>,
}

impl ShardView {
    pub fn read(&self) -> RwLockReadGuard<'_, AppliedState> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that changes whenever an entry is applied (its value: the log index).
    pub fn applied_watch(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

pub struct StateMachineStore {
    shard: ShardId,
    db: Arc<DB>,
    inner: Arc<RwLock<AppliedState>>,
    applied_tx: watch::Sender<u64>,
    applied_rx: watch::Receiver<u64>,
    out: ApplyOutput,
    /// The buffer each audit row is encoded into before the write batch copies it
    /// (`codec::encode_reusing`): kept across entries, at most `ROW_BUFFER_KEPT` bytes.
    row: Vec<u8>,
    snapshot_seq: u64,
    metrics: Option<Arc<Metrics>>,
    trigger: Option<Arc<SnapshotTrigger>>,
    timeline: Option<Arc<Timeline>>,
    /// Size of the snapshot loaded at start (for the trigger).
    loaded_bytes: u64,
    /// A received snapshot the edge already decoded (to check it before openraft
    /// installs it): install takes it instead of decoding the bytes again.
    preloaded: Preloaded,
    /// The newest rule version this node supports: an entry that activates a newer one,
    /// or a snapshot taken under one, stops this replica instead of being applied.
    rules_max: u32,
    /// Where snapshot builds run (so shutdown can wait for them).
    background: Arc<Background>,
    /// Test hook (`--test-snapshot-hold-file`): builds wait between encoding and storing
    /// while this file exists.
    test_hold: Option<std::path::PathBuf>,
    /// Told of every snapshot stored, so the log is purged only up to one
    /// (`log::PurgeFloor`, shared with the shard's log store).
    floor: Option<Arc<super::log::PurgeFloor>>,
    /// The last index the stored snapshot covers, held while one is stored: see
    /// [`Newest`].
    newest: Newest,
}

/// The last log index the shard's stored snapshot covers (`None`: none, or one of an
/// empty state), locked while a snapshot is stored. openraft builds a snapshot in a task
/// of its own and does not hold an install back for it: a build copies the state at
/// index A and encodes it for seconds, and meanwhile the leader's snapshot at S > A may
/// be installed and stored. The build then stores A only if nothing newer is stored —
/// before, it stored A over S, and the log, already purged to S, left the replica unable
/// to start again (and serving A, older than its log, to lagging followers).
type Newest = Arc<std::sync::Mutex<Option<u64>>>;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A snapshot's state decoded ahead of its installation, by snapshot id.
pub type Preloaded = Arc<std::sync::Mutex<Option<(String, Box<State>)>>>;

fn snapshot_key(shard: ShardId) -> Vec<u8> {
    shard_key(shard, b"snapshot")
}

/// The newest rule version any entry applied on this replica activated (a u32 LE):
/// written with the entry, so a binary that does not support it refuses to start even
/// before the next snapshot records it.
fn rules_key(shard: ShardId) -> Vec<u8> {
    shard_key(shard, b"rules_active")
}

/// The rule version this replica's data holds active: its state's, or a later
/// activation applied since its last snapshot.
pub fn rules_on_disk(db: &DB, shard: ShardId, state: &State) -> Result<u32, StorageError> {
    let logged = match db
        .get_cf(cf(db, CF_SNAP), rules_key(shard))
        .map_err(io_read)?
    {
        None => 0,
        // Exactly four bytes, or the data is not what this release wrote: refusing is
        // the only safe reading (taking it as 0 would let an old binary run newer rules).
        Some(b) => u32::from_le_bytes(b.as_slice().try_into().map_err(|_| {
            io_read(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "shard {shard}'s rules_active record is {} bytes, not 4",
                    b.len()
                ),
            ))
        })?),
    };
    Ok(logged.max(state.rules.active))
}

fn load_snapshot(db: &DB, shard: ShardId) -> Result<Option<StoredSnapshot>, StorageError> {
    match db
        .get_cf(cf(db, CF_SNAP), snapshot_key(shard))
        .map_err(io_read)?
    {
        None => Ok(None),
        Some(bytes) => bincode::deserialize(&bytes).map(Some).map_err(io_read),
    }
}

impl StateMachineStore {
    /// This replica cannot apply the entry at `log_id` as the others do (bytes of a
    /// newer format, or an activation of a rule version it does not support): it stops
    /// here, the entry not applied (it stays in the log for a newer binary), rather than
    /// diverge.
    fn cannot_apply(
        &self,
        g: &mut AppliedState,
        applied_before: Option<LogId>,
        log_id: LogId,
        why: impl std::fmt::Display,
    ) -> StorageError {
        g.last_applied = applied_before;
        tracing::error!(
            shard = self.shard,
            index = log_id.index,
            "cannot apply: {why}; this replica stops applying (upgrade its binary to go on)"
        );
        StorageError::from(openraft::StorageIOError::apply(
            log_id,
            openraft::AnyError::error(why),
        ))
    }

    /// Opens the shard's state machine: the last snapshot if there is one, else a new
    /// state with `config`.
    pub fn open(
        db: Arc<DB>,
        shard: ShardId,
        config: Config,
    ) -> Result<StateMachineStore, StorageError> {
        let mut loaded_bytes = 0;
        let applied = match load_snapshot(&db, shard)? {
            Some(snap) => AppliedState {
                state: {
                    loaded_bytes = snap.data.len() as u64;
                    State::decode(&snap.data).map_err(io_read)?
                },
                last_applied: snap.meta.last_log_id,
                membership: snap.meta.last_membership,
                snapshots_installed: 0,
            },
            None => AppliedState {
                state: State::new(config),
                last_applied: None,
                membership: StoredMembership::default(),
                snapshots_installed: 0,
            },
        };
        let newest: Newest = Arc::new(std::sync::Mutex::new(applied.last_applied.map(|l| l.index)));
        let idx = applied.last_applied.map(|l| l.index).unwrap_or(0);
        let (applied_tx, applied_rx) = watch::channel(idx);
        Ok(StateMachineStore {
            shard,
            db,
            inner: Arc::new(RwLock::new(applied)),
            applied_tx,
            applied_rx,
            out: ApplyOutput::default(),
            row: Vec::new(),
            snapshot_seq: 0,
            metrics: None,
            trigger: None,
            timeline: None,
            loaded_bytes,
            preloaded: Preloaded::default(),
            rules_max: allot_statemachine::version::RULES_MAX,
            background: Arc::default(),
            test_hold: None,
            floor: None,
            newest,
        })
    }

    /// Reports every snapshot built, installed or loaded to the size-based rule.
    pub fn with_trigger(mut self, trigger: Arc<SnapshotTrigger>) -> StateMachineStore {
        trigger.taken(0, self.loaded_bytes);
        self.trigger = Some(trigger);
        self
    }

    /// Where the edge leaves a received snapshot it decoded (see [`Preloaded`]).
    /// The newest rule version this node supports (default: this build's newest).
    pub fn with_rules_max(mut self, rules_max: u32) -> StateMachineStore {
        self.rules_max = rules_max;
        self
    }

    pub fn with_preloaded(mut self, preloaded: Preloaded) -> StateMachineStore {
        self.preloaded = preloaded;
        self
    }

    /// Runs snapshot builds on `background` (the node's, which its shutdown waits for).
    pub fn with_background(mut self, background: Arc<Background>) -> StateMachineStore {
        self.background = background;
        self
    }

    /// Test hook: snapshot builds wait between encoding and storing while `file` exists.
    pub fn with_test_hold(mut self, file: Option<std::path::PathBuf>) -> StateMachineStore {
        self.test_hold = file;
        self
    }

    /// Tells `floor` of every snapshot stored (the shard's log store purges only up to
    /// one: `log::PurgeFloor`).
    pub fn with_purge_floor(mut self, floor: Arc<super::log::PurgeFloor>) -> StateMachineStore {
        self.floor = Some(floor);
        self
    }

    /// The last index the snapshot this store opened from covers (`None`: no snapshot).
    pub fn stored_snapshot_index(&self) -> Option<u64> {
        self.view().read().last_applied.map(|l| l.index)
    }

    /// Records when each entry starts being applied.
    pub fn with_timeline(mut self, timeline: Arc<Timeline>) -> StateMachineStore {
        self.timeline = Some(timeline);
        self
    }

    /// Records snapshot build times (per stage) and sizes in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> StateMachineStore {
        self.metrics = Some(metrics);
        self
    }

    pub fn view(&self) -> ShardView {
        ShardView {
            inner: self.inner.clone(),
            applied: self.applied_rx.clone(),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, AppliedState> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Builds snapshots from a consistent view: the state is *cloned* under the read lock,
/// so it reflects exactly the entries up to `last_applied`, then encoded and stored on a
/// blocking thread. Encoding under the lock (sorting and serialising the whole state)
/// held apply back for as long as it took — hundreds of milliseconds on a busy shard,
/// the largest part of the commit latency tail — and ran on a runtime worker.
pub struct SnapshotBuilder {
    shard: ShardId,
    db: Arc<DB>,
    inner: Arc<RwLock<AppliedState>>,
    seq: u64,
    metrics: Option<Arc<Metrics>>,
    trigger: Option<Arc<SnapshotTrigger>>,
    background: Arc<Background>,
    test_hold: Option<std::path::PathBuf>,
    floor: Option<Arc<super::log::PurgeFloor>>,
    newest: Newest,
}

impl SnapshotBuilder {
    fn observe(&self, stage: &str, since: Instant) {
        if let Some(m) = &self.metrics {
            m.snapshot
                .with_label_values(&[&self.shard.to_string(), stage])
                .observe(since.elapsed().as_secs_f64());
        }
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        let started = Instant::now();
        let mark = self.trigger.as_ref().map_or(0, |t| t.mark());
        let (state, last_applied, membership) = {
            let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
            (g.state.clone(), g.last_applied, g.membership.clone())
        };
        self.observe("clone", started);
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, self.seq),
            None => format!("none-{}", self.seq),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
            snapshot_id,
        };
        let (db, shard, stored_meta) = (self.db.clone(), self.shard, meta.clone());
        let (background, hold) = (self.background.clone(), self.test_hold.clone());
        let newest = self.newest.clone();
        let (data, encoded, stored) = self
            .background
            .run(move || {
                let started = Instant::now();
                let stored = StoredSnapshot {
                    meta: stored_meta,
                    data: state.encode(),
                };
                let encoded = started.elapsed();
                if let Some(hold) = hold {
                    while hold.exists() {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
                // Encoding is the long part; a shutdown that came meanwhile is not kept
                // waiting for the store as well.
                if background.closed() {
                    tracing::info!(
                        shard,
                        "snapshot build abandoned before storing: shutting down"
                    );
                    return Err(shutting_down());
                }
                // The audit rows of every entry the snapshot covers were written without a
                // sync; make them durable before the log they derive from may be purged.
                db.flush_wal(true).map_err(io_write)?;
                let index = stored.meta.last_log_id.map(|l| l.index);
                let mut newest = lock(&newest);
                if index < *newest {
                    // openraft keeps its own newer snapshot too (it ignores an older
                    // build), so nothing else needs this one.
                    tracing::info!(
                        shard,
                        built = ?index,
                        stored = ?*newest,
                        "snapshot build not stored: a newer snapshot was installed meanwhile"
                    );
                } else {
                    save_snapshot(&db, shard, &stored)?;
                    *newest = index;
                }
                drop(newest);
                Ok::<_, StorageError>((stored.data, encoded, started.elapsed() - encoded))
            })
            .await??;
        if let (Some(floor), Some(last)) = (&self.floor, meta.last_log_id) {
            floor.stored(&self.db, self.shard, last.index)?;
        }
        if let Some(t) = &self.trigger {
            t.taken(mark, data.len() as u64);
        }
        if let Some(m) = &self.metrics {
            let s = self.shard.to_string();
            m.snapshot
                .with_label_values(&[&s, "encode"])
                .observe(encoded.as_secs_f64());
            m.snapshot
                .with_label_values(&[&s, "store"])
                .observe(stored.as_secs_f64());
            m.snapshot_bytes
                .with_label_values(&[&s])
                .set(data.len() as f64);
        }
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

/// The snapshot work a node has running on threads of its own, so that shutdown can
/// wait for it. A process that returns from `main` while such a thread is inside RocksDB
/// tears RocksDB's statics down under it, and the thread can crash the process (the
/// likely cause of a SIGSEGV on SIGTERM: DESIGN §55). Tokio's runtime joins its own blocking
/// threads when dropped; these are plain threads (for their CPU priority), so nothing
/// joined them.
#[derive(Debug)]
pub struct Background {
    /// (closed, running): one value so a start checks and counts under one lock.
    jobs: watch::Sender<(bool, usize)>,
}

impl Default for Background {
    fn default() -> Self {
        Background {
            jobs: watch::Sender::new((false, 0)),
        }
    }
}

/// Counts one job as running until dropped (also when the job panics).
struct Running(Arc<Background>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.jobs.send_modify(|(_, n)| *n -= 1);
    }
}

impl Background {
    /// Whether [`Background::close`] was called: a job checks this between stages and
    /// gives up instead of starting the next (a snapshot not stored is harmless: the log
    /// it would replace is purged only after a snapshot is stored).
    pub fn closed(&self) -> bool {
        self.jobs.borrow().0
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.jobs.borrow().1
    }

    /// Starts no job from now on and waits up to `timeout` for the running ones to end.
    /// Returns how many are still running (0 unless the timeout passed).
    pub async fn close(&self, timeout: std::time::Duration) -> usize {
        self.jobs.send_modify(|(closed, _)| *closed = true);
        let mut rx = self.jobs.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|(_, n)| *n == 0)).await;
        self.running()
    }

    /// Runs `work` on a new thread at the lowest CPU priority (nice 19) and returns its
    /// result; refused once closed. Snapshot encoding is seconds of CPU for a large
    /// state; on a machine whose cores also serve requests it must only use what they
    /// leave idle, or it shows up as request latency. (A thread of its own: a pooled
    /// blocking thread would keep the priority.)
    pub async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, StorageError> {
        let started = self.jobs.send_if_modified(|(closed, n)| {
            if !*closed {
                *n += 1;
            }
            !*closed
        });
        if !started {
            return Err(shutting_down());
        }
        let running = Running(self.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("allot-snapshot".into())
            .spawn(move || {
                let _running = running;
                // Linux: the nice value is per thread; 0 names the calling thread.
                // Failure only leaves the default priority.
                // SAFETY: setpriority has no memory-safety preconditions.
                let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
                let _ = tx.send(work());
            })
            .map_err(io_write)?;
        rx.await.map_err(io_write)
    }
}

fn shutting_down() -> StorageError {
    io_write(std::io::Error::other("the node is shutting down"))
}

/// Stores a snapshot durably *without* the write-ahead log: the WAL is shared by every
/// shard's log appends, and a multi-megabyte synced write in it held all of them back
/// (the commit latency tail). The value goes to the snapshot column family's memtable and
/// that column family is flushed to a synced SST file before returning; a crash before
/// the flush completes leaves the previous snapshot, which the log still covers (the log
/// is purged only after this returns).
fn save_snapshot(db: &DB, shard: ShardId, snap: &StoredSnapshot) -> Result<(), StorageError> {
    crate::versions::mark_for_snapshot(db.path(), &snap.data).map_err(io_write)?;
    let bytes = bincode::serialize(snap).map_err(io_write)?;
    let mut opts = WriteOptions::default();
    opts.disable_wal(true);
    let snaps = cf(db, CF_SNAP);
    db.put_cf_opt(snaps, snapshot_key(shard), bytes, &opts)
        .map_err(io_write)?;
    db.flush_cf(snaps).map_err(io_write)
}

/// Adds `data` (a state encoding) as the shard's stored snapshot at `meta` to `batch`:
/// how a restore seeds a new data dir. The node loads it at start like any snapshot.
pub(crate) fn put_snapshot(
    batch: &mut WriteBatch,
    db: &DB,
    shard: ShardId,
    meta: SnapshotMeta,
    data: Vec<u8>,
) -> Result<(), StorageError> {
    crate::versions::mark_for_snapshot(db.path(), &data).map_err(io_write)?;
    let bytes = bincode::serialize(&StoredSnapshot { meta, data }).map_err(io_write)?;
    batch.put_cf(cf(db, CF_SNAP), snapshot_key(shard), bytes);
    Ok(())
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        Ok((g.last_applied, g.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Applied>, StorageError>
    where
        I: IntoIterator<Item = LogEntry> + Send,
        I::IntoIter: Send,
    {
        let mut replies = Vec::new();
        let mut batch = WriteBatch::default();
        let audit = cf(&self.db, CF_AUDIT);
        let mut last_index = None;
        {
            let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
            for entry in entries {
                let log_id = entry.log_id;
                if let Some(t) = &self.timeline {
                    t.applying(log_id.index);
                }
                last_index = Some(log_id.index);
                let applied_before = g.last_applied.replace(log_id);
                match entry.payload {
                    EntryPayload::Blank => replies.push(Applied {
                        log_index: log_id.index,
                        logical_time_ms: g.state.time_ms,
                        outcomes: Vec::new(),
                    }),
                    EntryPayload::Membership(m) => {
                        g.membership = StoredMembership::new(Some(log_id), m);
                        replies.push(Applied {
                            log_index: log_id.index,
                            logical_time_ms: g.state.time_ms,
                            outcomes: Vec::new(),
                        });
                    }
                    EntryPayload::Normal(b) => {
                        // Decoded once. Bytes of a format this binary does not read —
                        // newer (a newer release's leader) or older than its window (a
                        // release before it wrote them, and the replicas that ran it
                        // applied them) — or an activation of a rule version it does not
                        // support: this replica cannot apply the entry as the others do,
                        // so it stops here (the entry stays in its log for a binary that
                        // reads it) rather than diverge. Only a faulty leader proposes
                        // bytes that do not decode otherwise; every replica decodes the
                        // same bytes, so each applies such an entry as a tick alike (time
                        // advances; nothing else).
                        let decoded = b.decode();
                        if let Err(
                            e @ (codec::CodecError::NewerFormat(_)
                            | codec::CodecError::UnsupportedVersion(_)),
                        ) = &decoded
                        {
                            return Err(self.cannot_apply(&mut g, applied_before, log_id, e));
                        }
                        let requests = decoded.unwrap_or_else(|e| {
                            tracing::error!(
                                shard = self.shard,
                                index = log_id.index,
                                error = %e,
                                "log entry's requests do not decode: applied as a tick"
                            );
                            Vec::new()
                        });
                        let sm_entry = Entry {
                            log_index: log_id.index,
                            logical_time_ms: b.logical_time_ms,
                            requests,
                        };
                        if let Some(v) =
                            crate::versions::activation_beyond(&g.state, &sm_entry, self.rules_max)
                        {
                            let why = format!(
                                "the entry activates rule version {v}; this node supports \
                                 up to {}",
                                self.rules_max
                            );
                            return Err(self.cannot_apply(&mut g, applied_before, log_id, why));
                        }
                        let rules_before = g.state.rules.active;
                        apply_into(&mut g.state, &sm_entry, &mut self.out).map_err(|e| {
                            StorageError::from(openraft::StorageIOError::apply(
                                log_id,
                                openraft::AnyError::new(&e),
                            ))
                        })?;
                        if g.state.rules.active != rules_before {
                            batch.put_cf(
                                cf(&self.db, CF_SNAP),
                                rules_key(self.shard),
                                g.state.rules.active.to_le_bytes(),
                            );
                        }
                        // One row per entry: its events, keyed by the first one's seq.
                        if let Some(first) = self.out.events.first() {
                            codec::encode_reusing(&mut self.row, &self.out.events);
                            batch.put_cf(
                                audit,
                                audit_key(self.shard, AUDIT_EVENTS, first.seq),
                                &self.row,
                            );
                        }
                        codec::encode_reusing(&mut self.row, &sm_entry);
                        batch.put_cf(
                            audit,
                            audit_key(self.shard, AUDIT_BATCHES, log_id.index),
                            &self.row,
                        );
                        replies.push(Applied {
                            log_index: log_id.index,
                            logical_time_ms: g.state.time_ms,
                            outcomes: std::mem::take(&mut self.out.outcomes),
                        });
                    }
                }
            }
            // Written before the state lock is released: whoever sees the state at an
            // index (a query, a backup) finds the audit rows up to it in the store.
            if !batch.is_empty() {
                self.db.write(batch).map_err(io_write)?;
            }
        }
        if self.row.capacity() > ROW_BUFFER_KEPT {
            self.row = Vec::new();
        }
        if let Some(i) = last_index {
            self.applied_tx.send_replace(i);
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> SnapshotBuilder {
        self.snapshot_seq += 1;
        SnapshotBuilder {
            shard: self.shard,
            db: self.db.clone(),
            inner: self.inner.clone(),
            seq: self.snapshot_seq,
            metrics: self.metrics.clone(),
            trigger: self.trigger.clone(),
            background: self.background.clone(),
            test_hold: self.test_hold.clone(),
            floor: self.floor.clone(),
            newest: self.newest.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let mark = self.trigger.as_ref().map_or(0, |t| t.mark());
        let ready = self
            .preloaded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .filter(|(id, _)| *id == meta.snapshot_id);
        let state = match ready {
            Some((_, state)) => *state,
            None => State::decode(&data).map_err(io_read)?,
        };
        if let Err(e) = crate::versions::check_rules(self.shard, state.rules.active, self.rules_max)
        {
            tracing::error!(shard = self.shard, "refusing the snapshot: {e:#}");
            return Err(io_read(std::io::Error::other(e.to_string())));
        }
        let bytes = data.len() as u64;
        {
            // Stored under the lock a build stores under (`Newest`).
            let mut newest = lock(&self.newest);
            save_snapshot(
                &self.db,
                self.shard,
                &StoredSnapshot {
                    meta: meta.clone(),
                    data,
                },
            )?;
            *newest = meta.last_log_id.map(|l| l.index);
        }
        if let (Some(floor), Some(last)) = (&self.floor, meta.last_log_id) {
            floor.stored(&self.db, self.shard, last.index)?;
        }
        {
            let mut g = self.write();
            g.state = state;
            g.last_applied = meta.last_log_id;
            g.membership = meta.last_membership.clone();
            g.snapshots_installed += 1;
        }
        self.applied_tx
            .send_replace(meta.last_log_id.map(|l| l.index).unwrap_or(0));
        if let Some(t) = &self.trigger {
            t.taken(mark, bytes);
        }
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        Ok(load_snapshot(&self.db, self.shard)?.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

/// Reads up to `limit` audit events of a shard from `from_seq` on (codec bytes of each
/// event). Rows hold the events of one entry, keyed by the entry's first sequence number,
/// so the read starts at the last row whose first sequence is ≤ `from_seq`.
/// Audit events of a shard from `from_seq` on, in chain order: at most `limit` events
/// that `keep` accepts, looking at no more than `scan_max` events. Returns their
/// encodings and the sequence number to continue from (past everything looked at, so a
/// filtered page never rescans).
///
/// The chain must be contiguous from `from_seq`: a replica that caught up by installing
/// a snapshot has no rows for the entries the snapshot covers, and one whose audit write
/// failed (a fatal storage error) may lack the last ones. Such a gap is an error
/// ([`AuditReadError::Gap`]), never a silently shorter trail; the node answers it as
/// UNAVAILABLE so the client asks another replica.
pub fn read_audit(
    db: &DB,
    shard: ShardId,
    from_seq: u64,
    limit: usize,
    scan_max: usize,
    keep: impl Fn(&AuditEvent) -> bool,
) -> Result<(Vec<Vec<u8>>, u64), AuditReadError> {
    let audit = cf(db, CF_AUDIT);
    let first = audit_key(shard, AUDIT_EVENTS, 0);
    let from = audit_key(shard, AUDIT_EVENTS, from_seq);
    let end = audit_key(shard, AUDIT_EVENTS, u64::MAX);
    let mut start = from.clone();
    let mut back = db.raw_iterator_cf(audit);
    back.seek_for_prev(&from);
    if let Some(k) = back.key() {
        if k >= first.as_slice() {
            start = k.to_vec();
        }
    }
    back.status()?;
    let mut out = Vec::new();
    let mut next = from_seq;
    let mut scanned = 0usize;
    'rows: for item in db.iterator_cf(
        audit,
        rocksdb::IteratorMode::From(&start, rocksdb::Direction::Forward),
    ) {
        let (k, v) = item?;
        if k.as_ref() >= end.as_slice() {
            break;
        }
        let events: Vec<AuditEvent> = codec::decode_kept(&v)?;
        for ev in events {
            if ev.seq < from_seq {
                continue;
            }
            if out.len() >= limit || scanned >= scan_max {
                break 'rows;
            }
            if ev.seq != next {
                return Err(AuditReadError::Gap {
                    missing_from: next,
                    found: ev.seq,
                });
            }
            scanned += 1;
            next = ev.seq + 1;
            if keep(&ev) {
                out.push(codec::encode(&ev));
            }
        }
    }
    Ok((out, next))
}

#[derive(Debug, thiserror::Error)]
pub enum AuditReadError {
    #[error("audit store: {0}")]
    Db(#[from] rocksdb::Error),
    #[error("audit row: {0}")]
    Codec(#[from] codec::CodecError),
    #[error(
        "this replica lacks audit events {missing_from}..{found} (it caught up from a \
         snapshot); read the audit trail from another replica"
    )]
    Gap { missing_from: u64, found: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record of the rule version a replica's data holds fails closed: a record that
    /// does not parse stops the node instead of reading as "no newer rules" (found by
    /// review: it read as 0, so a binary too old for the data would have run it).
    #[test]
    fn a_rules_record_that_does_not_parse_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::store::open_db(dir.path()).unwrap();
        let state = State::new(Config::default());
        let shard: ShardId = 3;
        assert_eq!(
            rules_on_disk(&db, shard, &state).unwrap(),
            state.rules.active
        );
        db.put_cf(cf(&db, CF_SNAP), rules_key(shard), 7u32.to_le_bytes())
            .unwrap();
        assert_eq!(rules_on_disk(&db, shard, &state).unwrap(), 7);
        for bad in [&[7u8, 0][..], &[7, 0, 0, 0, 0][..], &[][..]] {
            db.put_cf(cf(&db, CF_SNAP), rules_key(shard), bad).unwrap();
            let e = rules_on_disk(&db, shard, &state).unwrap_err();
            assert!(e.to_string().contains("rules_active"), "{e}");
        }
    }
}
