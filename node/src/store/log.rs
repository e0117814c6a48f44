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
use std::collections::VecDeque;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// Scratch switch for measuring the tail (`ALLOT_X_LOG_TAIL=0` turns reads from it off).
static TAIL_ON: std::sync::LazyLock<std::sync::atomic::AtomicBool> =
    std::sync::LazyLock::new(|| {
        std::sync::atomic::AtomicBool::new(std::env::var("ALLOT_X_LOG_TAIL").as_deref() != Ok("0"))
    });

const META_VOTE: &[u8] = b"vote";
const META_COMMITTED: &[u8] = b"committed";
const META_PURGED: &[u8] = b"purged";

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

/// Group commit: callbacks queued behind one `flush_wal(true)`.
pub struct Syncer {
    tx: mpsc::Sender<Flush>,
}

/// One append waiting for the fsync: openraft's callback, and the entries to mark
/// durable in the shard's timeline.
struct Flush {
    callback: LogFlushed<TypeConfig>,
    marks: Option<(Arc<Timeline>, u64, u64)>,
}

impl Syncer {
    /// Starts the sync thread; `observe` receives each fsync's duration and the number
    /// of appends it made durable.
    pub fn start(db: Arc<DB>) -> Arc<Syncer> {
        Syncer::start_observed(db, |_, _| {}, None)
    }

    /// `fail_if`: fault injection for tests (`--test-fsync-fail-file`): while that file
    /// exists, every sync reports failure (as a failing disk would), which openraft
    /// treats as fatal for the shard.
    pub fn start_observed(
        db: Arc<DB>,
        observe: impl Fn(std::time::Duration, usize) + Send + 'static,
        fail_if: Option<std::path::PathBuf>,
    ) -> Arc<Syncer> {
        let (tx, rx) = mpsc::channel::<Flush>();
        // A weak handle: the thread must not keep the database open. RocksDB aborts the
        // process at exit ("pthread lock: Invalid argument") if a DB is still open when
        // its static state is torn down, so the DB closes when its last user drops it.
        let db = Arc::downgrade(&db);
        std::thread::Builder::new()
            .name("allot-wal-sync".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut pending = vec![first];
                    pending.extend(rx.try_iter());
                    let t = std::time::Instant::now();
                    let injected = fail_if.as_ref().is_some_and(|p| p.exists());
                    let result: Result<(), String> = match db.upgrade() {
                        _ if injected => Err("fsync failed (injected test fault)".into()),
                        Some(db) => db.flush_wal(true).map_err(|e| e.to_string()),
                        None => Err("database closed".into()),
                    };
                    observe(t.elapsed(), pending.len());
                    for f in pending {
                        if let (Ok(()), Some((timeline, first, last))) = (&result, &f.marks) {
                            timeline.flushed(*first, *last);
                        }
                        f.callback
                            .log_io_completed(result.clone().map_err(std::io::Error::other));
                    }
                }
            })
            .expect("spawning the WAL sync thread");
        Arc::new(Syncer { tx })
    }
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
    /// Shared by the store and its readers (clones).
    tail: Arc<Mutex<Tail>>,
}

/// The most entries the log's [`Tail`] keeps.
const TAIL_ENTRIES_MAX: usize = 4_096;
/// The most payload bytes the log's [`Tail`] keeps (one shard's; a batch is at most
/// `MAX_BATCH_BYTES`, 1 MiB, so it always holds the newest few).
const TAIL_BYTES_MAX: usize = 8 << 20;

/// The newest entries of the log, as appended, in memory. openraft reads every entry
/// back right after appending it — on the leader to apply it and once per follower to
/// replicate it, on a follower to apply it — and each read from RocksDB builds an
/// iterator (a super-version reference, a merging iterator over the memtables and
/// files) and decodes the entry again. The tail answers those reads with a copy.
///
/// Invariant: when not empty, it holds a contiguous run of entries that **ends at the
/// log's last entry** — every append, truncation and purge goes through it — so a read
/// starting at or after its first entry is answered from it whole, and any other read
/// from RocksDB. After a restart it is empty until the first append.
#[derive(Default)]
struct Tail {
    entries: VecDeque<LogEntry>,
    bytes: usize,
}

impl Tail {
    fn payload(e: &LogEntry) -> usize {
        match &e.payload {
            openraft::EntryPayload::Normal(b) => b.requests.len(),
            _ => 0,
        }
    }

    /// Entries just written to the log, in index order.
    fn appended(&mut self, entries: Vec<LogEntry>) {
        let Some(first) = entries.first().map(|e| e.log_id.index) else {
            return;
        };
        if self
            .entries
            .back()
            .is_some_and(|last| last.log_id.index.checked_add(1) != Some(first))
        {
            // Not a continuation (openraft truncates before it overwrites, so this is
            // defensive): start over from these, which are the log's newest.
            self.entries.clear();
            self.bytes = 0;
        }
        for e in entries {
            self.bytes += Tail::payload(&e);
            self.entries.push_back(e);
        }
        while self.entries.len() > TAIL_ENTRIES_MAX
            || (self.bytes > TAIL_BYTES_MAX && self.entries.len() > 1)
        {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= Tail::payload(&e);
            }
        }
    }

    /// Entries from `index` on were deleted.
    fn truncated(&mut self, index: u64) {
        while self.entries.back().is_some_and(|e| e.log_id.index >= index) {
            if let Some(e) = self.entries.pop_back() {
                self.bytes -= Tail::payload(&e);
            }
        }
    }

    /// Entries up to `index` were deleted.
    fn purged(&mut self, index: u64) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.log_id.index <= index)
        {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= Tail::payload(&e);
            }
        }
    }

    /// `[start, end)` (`end` `None`: to the last entry) if the tail holds all of it.
    fn get(&self, start: u64, end: Option<u64>) -> Option<Vec<LogEntry>> {
        let first = self.entries.front()?.log_id.index;
        let last = self.entries.back()?.log_id.index;
        if start < first {
            return None;
        }
        let from = (start - first) as usize;
        let to = end.map_or(last + 1, |e| e.min(last + 1));
        if to <= start {
            return Some(Vec::new());
        }
        Some(
            self.entries
                .range(from..(to - first) as usize)
                .cloned()
                .collect(),
        )
    }
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
            tail: Arc::default(),
        }
    }

    fn tail(&self) -> std::sync::MutexGuard<'_, Tail> {
        // A panic while holding it would have poisoned it; the tail's updates are
        // whole or nothing, so its content is still valid.
        self.tail
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
        if TAIL_ON.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(entries) = self.tail().get(start, end) {
                return Ok(entries);
            }
        }
        self.read_db(start, end)
    }
}

impl LogStore {
    /// Entries `[start, end)` (`end` `None`: to the last) from RocksDB.
    fn read_db(&self, start: u64, end: Option<u64>) -> Result<Vec<LogEntry>, StorageError> {
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
            if idx < start || end.is_some_and(|e| idx >= e) {
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
        let last = self.last_entry()?.map(|e| e.log_id).or(last_purged);
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
        let mut kept = Vec::new();
        for e in entries {
            let i = e.log_id.index;
            range = Some(range.map_or((i, i), |(a, b)| (a.min(i), b.max(i))));
            let bytes = bincode::serialize(&e).map_err(io_write)?;
            appended += bytes.len() as u64;
            batch.put_cf(log, index_key(self.shard, e.log_id.index), bytes);
            kept.push(e);
        }
        if let Some(t) = &self.trigger {
            t.appended(appended);
        }
        // Written in call order (so the log never has a hole), made durable by the syncer.
        // The tail is updated under its lock around the write, so a reader never sees it
        // ahead of or behind RocksDB for long enough to matter: both hold the entries
        // once this returns, and nothing reads an entry before openraft appended it.
        {
            let mut tail = self.tail();
            let written = self.db.write(batch).map_err(io_write);
            match written {
                Ok(()) => tail.appended(kept),
                Err(e) => {
                    // What RocksDB holds is unknown: answer every read from it.
                    *tail = Tail::default();
                    return Err(e);
                }
            }
        }
        let marks = match (&self.timeline, range) {
            (Some(t), Some((first, last))) => {
                t.appended(first, last);
                Some((t.clone(), first, last))
            }
            _ => None,
        };
        self.syncer
            .tx
            .send(Flush { callback, marks })
            .map_err(|e| io_write(std::io::Error::other(e.to_string())))
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.tail().truncated(log_id.index);
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
        // Record the purge point first: a crash between the two writes leaves entries
        // that are already covered by `last_purged` and are never read again.
        self.put_meta(META_PURGED, &log_id, true)?;
        self.tail().purged(log_id.index);
        self.db
            .delete_range_cf(
                cf(&self.db, CF_LOG),
                index_key(self.shard, 0),
                index_key(self.shard, log_id.index + 1),
            )
            .map_err(io_write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::storage::RaftLogStorageExt;
    use openraft::{CommittedLeaderId, Entry, EntryPayload};

    fn entry(term: u64, index: u64, bytes: usize) -> LogEntry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(crate::types::Batch {
                logical_time_ms: index,
                requests: vec![index as u8; bytes],
            }),
        }
    }

    /// The tail answers every read it answers exactly as RocksDB does, through appends
    /// (small and large, past its bounds), truncations (a new leader's overwrite) and
    /// purges (snapshots), in a long pseudo-random sequence; and it answers the reads
    /// of the newest entries (what it is for).
    #[tokio::test]
    async fn the_log_tail_answers_as_rocksdb_does() {
        let dir = tempfile::tempdir().unwrap();
        let db = super::super::open_db(dir.path()).unwrap();
        let mut log = LogStore::new(db.clone(), 3, Syncer::start(db));
        let (mut next, mut term, mut purged) = (1u64, 1u64, 0u64);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut roll = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let (mut from_tail, mut checked) = (0, 0);
        for step in 0..2_000 {
            let mut appended_last = false;
            match roll(20) {
                0 if next - 1 > purged => {
                    // A new leader overwrites a suffix.
                    let at = purged + 1 + roll(next - 1 - purged);
                    log.truncate(LogId::new(CommittedLeaderId::new(term, 1), at))
                        .await
                        .unwrap();
                    next = at;
                    term += 1;
                }
                1 if next - 1 > purged => {
                    let upto = purged + 1 + roll(next - 1 - purged);
                    log.purge(LogId::new(CommittedLeaderId::new(term, 1), upto))
                        .await
                        .unwrap();
                    purged = upto;
                }
                _ => {
                    let n = 1 + roll(if step % 97 == 0 { 6_000 } else { 8 });
                    let big = if roll(100) == 0 { 3 << 20 } else { 64 };
                    let batch: Vec<_> = (next..next + n).map(|i| entry(term, i, big)).collect();
                    log.blocking_append(batch).await.unwrap();
                    next += n;
                    appended_last = true;
                }
            }
            // Reads around the tail's edges and the log's.
            let last = next - 1;
            for _ in 0..4 {
                let start = purged + 1 + roll(last.saturating_sub(purged) + 2);
                let end = match roll(3) {
                    0 => None,
                    _ => Some(start + roll(10)),
                };
                let want = log.read_db(start, end).unwrap();
                if let Some(got) = log.tail().get(start, end) {
                    assert_eq!(got, want, "step {step}: [{start}, {end:?})");
                    from_tail += 1;
                }
                checked += 1;
                let via_reader = match end {
                    Some(e) => log.try_get_log_entries(start..e).await.unwrap(),
                    None => log.try_get_log_entries(start..).await.unwrap(),
                };
                assert_eq!(via_reader, want, "step {step}: [{start}, {end:?})");
            }
            // After an append, the newest entry is in the tail (a truncation or a purge
            // may leave it empty: then RocksDB answers).
            if appended_last && last > purged {
                assert_eq!(
                    log.tail().get(last, None).map(|v| v.len()),
                    Some(1),
                    "step {step}"
                );
            }
            let t = log.tail();
            assert!(t.entries.len() <= TAIL_ENTRIES_MAX);
            assert!(
                t.bytes <= TAIL_BYTES_MAX || t.entries.len() == 1,
                "{}",
                t.bytes
            );
        }
        assert!(
            from_tail * 2 > checked,
            "{from_tail} of {checked} reads from the tail"
        );
    }
}
