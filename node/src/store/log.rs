//! The Raft log of one shard in the node's RocksDB.
//!
//! Contract (openraft 0.9 `RaftLogStorage`): the vote is durable before `save_vote`
//! returns; an append is reported through its callback only after the WAL holding it was
//! fsynced. Appends of all shards go through one [`Syncer`] thread, so concurrent appends
//! share an fsync (group commit across shards).

use super::{
    cf, index_key, index_of_key, io_read, io_write, shard_key, SnapshotTrigger, Timeline, CF_LOG,
    CF_META,
};
use crate::types::{LogEntry, LogId, ShardId, StorageError, TypeConfig, Vote};
use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{LogState, RaftLogReader};
use rocksdb::{IteratorMode, ReadOptions, WriteBatch, WriteOptions, DB};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

const META_VOTE: &[u8] = b"vote";
const META_COMMITTED: &[u8] = b"committed";
const META_PURGED: &[u8] = b"purged";
/// A purge openraft asked for past the shard's stored snapshot, made when a snapshot
/// covers it ([`PurgeFloor`]).
const META_PURGE_PENDING: &[u8] = b"purge-pending";

/// Read options that confine an iterator to `[lower, upper)` (`upper` `None`: to the
/// end of the shard's keys). Without bounds RocksDB cannot tell that a range is
/// exhausted until it finds the next *live* key, and the next keys in the log column
/// family are usually the following shard's purged entries: `delete_range` leaves them
/// in the memtable until a compaction, and stepping over each one on every read of the
/// log (openraft reads the entries it applies and replicates) was a third of a busy
/// node's CPU, in bursts that made the tail latency.
fn bounded(shard: ShardId, lower: [u8; 12], upper: Option<[u8; 12]>) -> ReadOptions {
    let mut o = ReadOptions::default();
    o.set_iterate_lower_bound(lower.to_vec());
    match upper {
        Some(u) => o.set_iterate_upper_bound(u.to_vec()),
        // The first key past the shard's prefix.
        None => {
            if let Some(next) = shard.checked_add(1) {
                o.set_iterate_upper_bound(next.to_be_bytes().to_vec());
            }
        }
    }
    o
}

/// Fault injection for tests, by files a test creates and removes.
#[derive(Clone, Debug, Default)]
pub struct SyncFaults {
    /// `--test-fsync-fail-file`: once this file exists, a sync reports failure (as a
    /// failing disk would), and so does every later one (`sync_once`); openraft treats it
    /// as fatal for the shard.
    pub fail_if: Option<std::path::PathBuf>,
    /// `--test-fsync-hold-file`: while this file exists, no sync starts (as a disk that
    /// stalls would): the appends queued behind it stay unflushed until it is removed.
    pub hold_if: Option<std::path::PathBuf>,
}

/// Group commit: callbacks queued behind one `flush_wal(true)`.
pub struct Syncer {
    tx: mpsc::Sender<Flush>,
    /// When the oldest append the sync thread is making durable was written, in µs after
    /// `epoch` (at least 1), or 0 while the thread waits for work.
    busy_since_us: Arc<AtomicU64>,
    epoch: Instant,
}

/// One append waiting for the fsync: openraft's callback, the entries to mark durable
/// in the shard's timeline, and when it was written.
struct Flush {
    callback: LogFlushed<TypeConfig>,
    marks: Option<(Arc<Timeline>, u64, u64)>,
    written: Instant,
}

/// An fsync slower than this is logged (a failing or overloaded disk; etcd warns from
/// 1 s too).
pub const SLOW_SYNC: Duration = Duration::from_secs(1);

impl Syncer {
    /// Starts the sync thread; `observe` receives each fsync's duration and the number
    /// of appends it made durable.
    pub fn start(db: Arc<DB>) -> Arc<Syncer> {
        Syncer::start_observed(db, |_, _| {}, SyncFaults::default())
    }

    /// `faults`: fault injection for tests (`SyncFaults`).
    pub fn start_observed(
        db: Arc<DB>,
        observe: impl Fn(std::time::Duration, usize) + Send + 'static,
        faults: SyncFaults,
    ) -> Arc<Syncer> {
        let SyncFaults { fail_if, hold_if } = faults;
        let (tx, rx) = mpsc::channel::<Flush>();
        let epoch = Instant::now();
        let busy_since_us = Arc::new(AtomicU64::new(0));
        let busy = busy_since_us.clone();
        // A weak handle: the thread must not keep the database open. RocksDB aborts the
        // process at exit ("pthread lock: Invalid argument") if a DB is still open when
        // its static state is torn down, so the DB closes when its last user drops it.
        let db = Arc::downgrade(&db);
        std::thread::Builder::new()
            .name("allot-wal-sync".into())
            .spawn(move || {
                // After one failed fsync nothing written since is trusted (Linux reports a
                // writeback error once and may have dropped the pages): every later flush
                // fails too, so no append is reported durable past a hole, in any shard.
                let mut failed: Option<String> = None;
                while let Ok(first) = rx.recv() {
                    let since = first.written.saturating_duration_since(epoch);
                    busy.store((since.as_micros() as u64).max(1), Ordering::Relaxed);
                    let mut pending = vec![first];
                    // A held sync counts as a stalled fsync: it is timed, and logged if slow.
                    let t = Instant::now();
                    if let Some(hold) = &hold_if {
                        while hold.exists() {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                    pending.extend(rx.try_iter());
                    let injected = fail_if.as_ref().is_some_and(|p| p.exists());
                    let result = sync_once(&mut failed, || match db.upgrade() {
                        _ if injected => Err("fsync failed (injected test fault)".into()),
                        Some(db) => db.flush_wal(true).map_err(|e| e.to_string()),
                        None => Err("database closed".into()),
                    });
                    let took = t.elapsed();
                    observe(took, pending.len());
                    if took >= SLOW_SYNC {
                        tracing::warn!(
                            "slow WAL fsync: {took:?} for {} appends (a failing or overloaded disk?)",
                            pending.len()
                        );
                    }
                    for f in pending {
                        if let (Ok(()), Some((timeline, first, last))) = (&result, &f.marks) {
                            timeline.flushed(*first, *last);
                        }
                        f.callback
                            .log_io_completed(result.clone().map_err(std::io::Error::other));
                    }
                    busy.store(0, Ordering::Relaxed);
                }
            })
            .expect("spawning the WAL sync thread");
        Arc::new(Syncer {
            tx,
            busy_since_us,
            epoch,
        })
    }

    /// How long the oldest append the sync thread is now making durable has waited since
    /// it was written (zero while the thread is idle). It grows for as long as an fsync
    /// does not return: what `allot_wal_sync_waiting_seconds` shows of a stalled disk.
    pub fn waiting(&self) -> Duration {
        match self.busy_since_us.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            us => self
                .epoch
                .elapsed()
                .saturating_sub(Duration::from_micros(us)),
        }
    }
}

/// One group-commit fsync, unless one has failed before: then none is tried and the
/// first failure is reported again. `failed` keeps that first failure. (RocksDB with its
/// default `paranoid_checks` also stops writing after a failed WAL sync — a background
/// error — so the node's synced writes outside this thread fail too; this keeps the rule
/// here whatever that option says, and for the injected test fault.)
fn sync_once(
    failed: &mut Option<String>,
    fsync: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    if let Some(e) = failed {
        return Err(format!("an earlier WAL fsync failed: {e}"));
    }
    let result = fsync();
    if let Err(e) = &result {
        *failed = Some(e.clone());
    }
    result
}

/// The log of a shard is never purged past its stored snapshot.
///
/// openraft 0.9 purges a follower's log up to a snapshot it installs as soon as it hands
/// the snapshot to the state machine — before the state machine has stored it. A crash,
/// a full disk or a refused snapshot (a rule version this node does not support) in
/// between left a replica whose log was purged past its newest snapshot: it could not
/// start again (the entries to re-apply were gone) until its data dir was wiped. So a
/// purge past the stored snapshot is deferred — recorded durably, so a restart finishes
/// or forgets it — and made when a snapshot that covers it is stored; if none ever is,
/// the log keeps its entries, consistent with the snapshot it has.
#[derive(Debug, Default)]
pub struct PurgeFloor {
    inner: std::sync::Mutex<Floor>,
}

#[derive(Debug, Default)]
struct Floor {
    /// The last index the shard's stored snapshot covers.
    stored: Option<u64>,
    /// A purge waiting for a snapshot that covers it.
    pending: Option<LogId>,
}

impl PurgeFloor {
    /// The floor of a shard whose stored snapshot covers up to `stored`, with a purge
    /// a previous run deferred made now if the snapshot covers it, else forgotten.
    pub fn open(db: &DB, shard: ShardId, stored: Option<u64>) -> Result<PurgeFloor, StorageError> {
        let floor = PurgeFloor {
            inner: std::sync::Mutex::new(Floor {
                stored,
                pending: None,
            }),
        };
        let key = shard_key(shard, META_PURGE_PENDING);
        if let Some(bytes) = db.get_cf(cf(db, CF_META), &key).map_err(io_read)? {
            let pending: LogId = bincode::deserialize(&bytes).map_err(io_read)?;
            let covered = stored.is_some_and(|s| s >= pending.index);
            settle_pending(db, shard, covered.then_some(pending))?;
        }
        Ok(floor)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Floor> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A snapshot covering up to `index` is stored: a deferred purge it covers is made.
    pub fn stored(&self, db: &DB, shard: ShardId, index: u64) -> Result<(), StorageError> {
        let mut f = self.lock();
        f.stored = f.stored.max(Some(index));
        if let Some(p) = f.pending.filter(|p| p.index <= index) {
            settle_pending(db, shard, Some(p))?;
            f.pending = None;
        }
        Ok(())
    }
}

/// Ends a deferred purge: makes it (`Some`) or forgets it, and drops its record.
fn settle_pending(db: &DB, shard: ShardId, purge: Option<LogId>) -> Result<(), StorageError> {
    if let Some(p) = purge {
        purge_now(db, shard, p)?;
    }
    db.delete_cf_opt(
        cf(db, CF_META),
        shard_key(shard, META_PURGE_PENDING),
        &sync_opts(),
    )
    .map_err(io_write)
}

/// Purges the log up to `log_id` (never lowering the recorded purge point). Callers
/// hold the shard's [`PurgeFloor`] lock when it has one.
fn purge_now(db: &DB, shard: ShardId, log_id: LogId) -> Result<(), StorageError> {
    let meta = cf(db, CF_META);
    let key = shard_key(shard, META_PURGED);
    if let Some(bytes) = db.get_cf(meta, &key).map_err(io_read)? {
        let purged: LogId = bincode::deserialize(&bytes).map_err(io_read)?;
        if purged.index >= log_id.index {
            return Ok(());
        }
    }
    // Record the purge point first: a crash between the two writes leaves entries that
    // are already covered by `last_purged` and are never read again.
    let bytes = bincode::serialize(&log_id).map_err(io_write)?;
    db.put_cf_opt(meta, key, bytes, &sync_opts())
        .map_err(io_write)?;
    db.delete_range_cf(
        cf(db, CF_LOG),
        index_key(shard, 0),
        index_key(shard, log_id.index + 1),
    )
    .map_err(io_write)
}

/// Adds a restored shard's log metadata to `batch`: the log starts after `last` (as if
/// purged up to it, the entries being inside the restored snapshot), `last` is
/// committed, and the node has seen `vote` — the term of `last` — so its first election
/// is in a later term than every restored entry.
pub(crate) fn put_restored_meta(
    batch: &mut WriteBatch,
    db: &DB,
    shard: ShardId,
    last: LogId,
    vote: Vote,
) -> Result<(), StorageError> {
    let meta = cf(db, CF_META);
    let mut put = |tag: &[u8], bytes: Result<Vec<u8>, bincode::Error>| {
        bytes
            .map(|b| batch.put_cf(meta, shard_key(shard, tag), b))
            .map_err(io_write)
    };
    put(META_PURGED, bincode::serialize(&last))?;
    put(META_COMMITTED, bincode::serialize(&Some(last)))?;
    put(META_VOTE, bincode::serialize(&vote))
}

/// A synced write (restores: everything of a shard in one batch, or nothing).
pub(crate) fn write_synced(db: &DB, batch: WriteBatch) -> Result<(), StorageError> {
    db.write_opt(batch, &sync_opts()).map_err(io_write)
}

#[derive(Clone)]
pub struct LogStore {
    db: Arc<DB>,
    shard: ShardId,
    syncer: Arc<Syncer>,
    trigger: Option<Arc<SnapshotTrigger>>,
    timeline: Option<Arc<Timeline>>,
    floor: Option<Arc<PurgeFloor>>,
}

fn sync_opts() -> WriteOptions {
    let mut o = WriteOptions::default();
    o.set_sync(true);
    o
}

impl LogStore {
    pub fn new(db: Arc<DB>, shard: ShardId, syncer: Arc<Syncer>) -> LogStore {
        LogStore {
            db,
            shard,
            syncer,
            trigger: None,
            timeline: None,
            floor: None,
        }
    }

    /// Never purges past the shard's stored snapshot ([`PurgeFloor`], shared with the
    /// shard's state machine store).
    pub fn with_purge_floor(mut self, floor: Arc<PurgeFloor>) -> LogStore {
        self.floor = Some(floor);
        self
    }

    /// Records when each entry is appended and made durable.
    pub fn with_timeline(mut self, timeline: Arc<Timeline>) -> LogStore {
        self.timeline = Some(timeline);
        self
    }

    /// Counts the bytes appended towards the size-based snapshot rule.
    pub fn with_trigger(mut self, trigger: Arc<SnapshotTrigger>) -> LogStore {
        self.trigger = Some(trigger);
        self
    }

    fn get_meta<T: serde::de::DeserializeOwned>(
        &self,
        tag: &[u8],
    ) -> Result<Option<T>, StorageError> {
        let v = self
            .db
            .get_cf(cf(&self.db, CF_META), shard_key(self.shard, tag))
            .map_err(io_read)?;
        match v {
            None => Ok(None),
            Some(bytes) => bincode::deserialize(&bytes).map(Some).map_err(io_read),
        }
    }

    fn put_meta<T: serde::Serialize>(
        &self,
        tag: &[u8],
        value: &T,
        sync: bool,
    ) -> Result<(), StorageError> {
        let bytes = bincode::serialize(value).map_err(io_write)?;
        let opts = if sync {
            sync_opts()
        } else {
            WriteOptions::default()
        };
        self.db
            .put_cf_opt(
                cf(&self.db, CF_META),
                shard_key(self.shard, tag),
                bytes,
                &opts,
            )
            .map_err(io_write)
    }

    fn last_entry(&self) -> Result<Option<LogEntry>, StorageError> {
        let mut it = self.db.iterator_cf_opt(
            cf(&self.db, CF_LOG),
            bounded(self.shard, index_key(self.shard, 0), None),
            IteratorMode::End,
        );
        match it.next() {
            None => Ok(None),
            Some(item) => {
                let (k, v) = item.map_err(io_read)?;
                if k.len() != 12 || k[..4] != self.shard.to_be_bytes() {
                    return Ok(None);
                }
                bincode::deserialize(&v).map(Some).map_err(io_read)
            }
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<LogEntry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&x) => x,
            Bound::Excluded(&x) => x + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&x) => x.checked_add(1),
            Bound::Excluded(&x) => Some(x),
            Bound::Unbounded => None,
        };
        if end.is_some_and(|e| e <= start) {
            return Ok(Vec::new());
        }
        let from = index_key(self.shard, start);
        let upper = end.map(|e| index_key(self.shard, e));
        let mut out = Vec::new();
        for item in self.db.iterator_cf_opt(
            cf(&self.db, CF_LOG),
            bounded(self.shard, from, upper),
            IteratorMode::Start,
        ) {
            let (k, v) = item.map_err(io_read)?;
            if k.len() != 12 || k[..4] != self.shard.to_be_bytes() {
                break;
            }
            let idx = index_of_key(&k);
            if !range.contains(&idx) {
                break;
            }
            out.push(bincode::deserialize(&v).map_err(io_read)?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged: Option<LogId> = self.get_meta(META_PURGED)?;
        // The later of the two: entries below the purge point are still there between
        // the purge point's write and the range delete (or after a crash between them).
        let last = self.last_entry()?.map(|e| e.log_id).max(last_purged);
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.put_meta(META_VOTE, vote, true)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.get_meta(META_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.put_meta(META_COMMITTED, &committed, false)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.get_meta::<Option<LogId>>(META_COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = LogEntry> + Send,
        I::IntoIter: Send,
    {
        let mut batch = WriteBatch::default();
        let log = cf(&self.db, CF_LOG);
        let mut appended = 0;
        let mut range: Option<(u64, u64)> = None;
        for e in entries {
            let i = e.log_id.index;
            range = Some(range.map_or((i, i), |(a, b)| (a.min(i), b.max(i))));
            let bytes = bincode::serialize(&e).map_err(io_write)?;
            appended += bytes.len() as u64;
            batch.put_cf(log, index_key(self.shard, e.log_id.index), bytes);
        }
        if let Some(t) = &self.trigger {
            t.appended(appended);
        }
        // Written in call order (so the log never has a hole), made durable by the syncer.
        self.db.write(batch).map_err(io_write)?;
        let marks = match (&self.timeline, range) {
            (Some(t), Some((first, last))) => {
                t.appended(first, last);
                Some((t.clone(), first, last))
            }
            _ => None,
        };
        self.syncer
            .tx
            .send(Flush {
                callback,
                marks,
                written: Instant::now(),
            })
            .map_err(|e| io_write(std::io::Error::other(e.to_string())))
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(
            cf(&self.db, CF_LOG),
            index_key(self.shard, log_id.index),
            index_key(self.shard, u64::MAX),
        );
        batch.delete_cf(cf(&self.db, CF_LOG), index_key(self.shard, u64::MAX));
        self.db.write_opt(batch, &sync_opts()).map_err(io_write)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let Some(floor) = &self.floor else {
            return purge_now(&self.db, self.shard, log_id);
        };
        let mut f = floor.lock();
        if f.stored.is_some_and(|s| s >= log_id.index) {
            return purge_now(&self.db, self.shard, log_id);
        }
        // Past the stored snapshot (one being installed): deferred until it is stored.
        let pending = f.pending.map_or(log_id, |p| p.max(log_id));
        self.put_meta(META_PURGE_PENDING, &pending, true)?;
        f.pending = Some(pending);
        Ok(())
    }
}

#[cfg(test)]
mod sync_tests {
    use super::sync_once;

    /// After a failed fsync no later one is tried or reported durable, though the disk
    /// answers again: an append written before the failure may be lost (Linux reports a
    /// writeback error once), so a later success must not cover it.
    #[test]
    fn after_one_failed_fsync_every_later_flush_fails() {
        let mut failed = None;
        assert_eq!(sync_once(&mut failed, || Ok(())), Ok(()));
        assert_eq!(
            sync_once(&mut failed, || Err("EIO".into())),
            Err("EIO".into())
        );
        let mut tried = false;
        let later = sync_once(&mut failed, || {
            tried = true;
            Ok(())
        });
        assert!(!tried, "no fsync is tried after one failed");
        assert_eq!(later, Err("an earlier WAL fsync failed: EIO".into()));
    }
}
