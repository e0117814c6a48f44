//! Durable storage of a node: ONE RocksDB for all the shards it hosts.
//!
//! Column families are per kind of data, not per shard; every key starts with the shard
//! id (u32 big-endian), so one shard's keys are a contiguous range and a node's WAL fsync
//! covers the appends of every shard at once (see docs/DESIGN.md §27 for the choice).
//!
//! - `log`:   shard ‖ index (u64 BE) → bincode of the openraft entry
//! - `meta`:  shard ‖ tag → vote, committed log id, last purged log id
//! - `snap`:  shard → the current snapshot (meta and state machine bytes)
//! - `audit`: shard ‖ 0 ‖ first seq (u64 BE) → the audit events of one entry (codec bytes);
//!   shard ‖ 1 ‖ log index (u64 BE) → the entry's batch (the commands the events bind)

// openraft's trait methods return its `StorageError` (224 bytes); the helpers here
// return the same type rather than converting at every call.
#[allow(clippy::result_large_err)]
pub mod log;
#[allow(clippy::result_large_err)]
pub mod sm;
pub mod timeline;
pub mod trigger;

pub use log::LogStore;
pub(crate) use sm::put_snapshot;
pub use sm::{
    audit_key, read_audit, AppliedState, AuditReadError, ShardView, StateMachineStore,
    AUDIT_BATCHES, AUDIT_EVENTS,
};
pub use timeline::Timeline;
pub use trigger::SnapshotTrigger;

use crate::types::{ShardId, StorageError};
use openraft::{AnyError, StorageIOError};
use rocksdb::{ColumnFamilyDescriptor, Options, DB};
use std::path::Path;
use std::sync::Arc;

pub const CF_LOG: &str = "log";
pub const CF_META: &str = "meta";
pub const CF_SNAP: &str = "snap";
pub const CF_AUDIT: &str = "audit";
/// Every column family the node opens (besides RocksDB's `default`).
pub const COLUMN_FAMILIES: [&str; 4] = [CF_LOG, CF_META, CF_SNAP, CF_AUDIT];

/// Opens (creating if needed) the node's database.
pub fn open_db(dir: &Path) -> Result<Arc<DB>, rocksdb::Error> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    // The WAL is the durability point of the Raft log: writes are synced explicitly
    // (flush_wal(true)) before openraft is told an append is durable.
    opts.set_manual_wal_flush(false);
    opts.increase_parallelism(2);
    // Table files (memtable flushes, compactions) are written back 1 MiB at a time as
    // they are written, instead of as one multi-megabyte burst at their final sync that a
    // WAL fsync queued behind it would wait for. (On this project's VM the fsync tail
    // turned out to be CPU scheduling, not the disk: docs/DESIGN.md §29.)
    opts.set_bytes_per_sync(1 << 20);
    let cfs = COLUMN_FAMILIES
        .into_iter()
        .map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    Ok(Arc::new(DB::open_cf_descriptors(&opts, dir, cfs)?))
}

pub(crate) fn shard_key(shard: ShardId, suffix: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + suffix.len());
    k.extend_from_slice(&shard.to_be_bytes());
    k.extend_from_slice(suffix);
    k
}

pub(crate) fn index_key(shard: ShardId, index: u64) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(&shard.to_be_bytes());
    k[4..].copy_from_slice(&index.to_be_bytes());
    k
}

pub(crate) fn index_of_key(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[key.len() - 8..]);
    u64::from_be_bytes(b)
}

/// Writes (`Some`) or removes (`None`) one key of the meta column family, synced: a
/// node-level record (cluster id, rejoining marker) that must outlive a power loss.
pub fn meta_synced(db: &DB, key: &[u8], value: Option<&[u8]>) -> Result<(), rocksdb::Error> {
    let mut opts = rocksdb::WriteOptions::default();
    opts.set_sync(true);
    let mut batch = rocksdb::WriteBatch::default();
    match value {
        Some(v) => batch.put_cf(cf(db, CF_META), key, v),
        None => batch.delete_cf(cf(db, CF_META), key),
    }
    db.write_opt(batch, &opts)
}

pub(crate) fn cf<'a>(db: &'a DB, name: &str) -> &'a rocksdb::ColumnFamily {
    // The column families are created by `open_db`; a missing one is a programming error.
    db.cf_handle(name)
        .unwrap_or_else(|| panic!("column family {name} is opened by open_db"))
}

pub(crate) fn io_read(e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::read(AnyError::new(&e)).into()
}

pub(crate) fn io_write(e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::write(AnyError::new(&e)).into()
}
