//! The RocksDB log and state-machine storage pass openraft's own storage test suite
//! (vote durability, log state, truncate/purge contract, snapshots, membership).

use allot_node::store::{self, LogStore, StateMachineStore};
use allot_node::types::{StorageError, TypeConfig};
use openraft::testing::{StoreBuilder, Suite};

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = store::open_db(dir.path()).expect("open db");
        let syncer = store::log::Syncer::start(db.clone());
        // Shards share the database: the suite runs on shard 1 while shards 0 and 2 hold
        // rows that are not entries at all, so a scan leaking out of shard 1's key range
        // fails to decode and the suite fails.
        let log_cf = db.cf_handle(store::CF_LOG).expect("log cf");
        for shard in [0u32, 2] {
            for index in [0u64, 1, 5, 100, u64::MAX] {
                let mut key = shard.to_be_bytes().to_vec();
                key.extend_from_slice(&index.to_be_bytes());
                db.put_cf(log_cf, key, b"not an entry").expect("put");
            }
        }
        let log = LogStore::new(db.clone(), 1, syncer);
        let sm = StateMachineStore::open(db, 1, allot_statemachine::Config::default())?;
        Ok((dir, log, sm))
    }
}

#[test]
fn rocksdb_storage_passes_the_openraft_suite() {
    if let Err(e) = Suite::test_all(Builder) {
        panic!("openraft storage suite: {e}");
    }
}
