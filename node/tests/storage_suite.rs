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

/// A replica that meets an entry it cannot apply as the others do — bytes of a newer
/// format, or an activation of a rule version it does not support — stops with an
/// error and changes nothing, instead of applying it as a tick (a misread the other
/// replicas would not make). Malformed bytes (a faulty leader) still apply as a tick on
/// every replica alike.
#[tokio::test]
async fn entries_this_binary_cannot_apply_stop_the_replica_and_change_nothing() {
    use allot_node::types::{Batch, LogEntry};
    use allot_statemachine::codec::FORMAT_VERSION;
    use allot_statemachine::{Command, State};
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId};

    let dir = tempfile::tempdir().expect("temp dir");
    let db = store::open_db(dir.path()).expect("open db");
    let mut sm = StateMachineStore::open(db, 0, allot_statemachine::Config::default())
        .expect("open")
        .with_rules_max(1);
    let entry = |index: u64, batch: Batch| LogEntry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(batch),
    };
    let activation = allot_node::workload::admin(1, Command::ActivateVersion { version: 2 });
    let hash = |sm: &StateMachineStore| {
        let view = sm.view();
        let g = view.read();
        assert_eq!(g.last_applied, None, "no entry counts as applied");
        g.state.state_hash()
    };
    let empty = State::default().state_hash();

    let refused = sm
        .apply([entry(1, Batch::new(5, std::slice::from_ref(&activation)))])
        .await;
    assert!(
        format!("{refused:?}").contains("activates rule version 2"),
        "{refused:?}"
    );
    assert_eq!(hash(&sm), empty, "nothing applied");

    let mut newer = Batch::new(5, &[activation]);
    newer.requests[0] = FORMAT_VERSION + 1;
    let refused = sm.apply([entry(1, newer)]).await;
    assert!(
        format!("{refused:?}").contains("newer release"),
        "{refused:?}"
    );
    assert_eq!(hash(&sm), empty, "nothing applied");

    let mut malformed = Batch::new(5, &[]);
    malformed.requests = vec![FORMAT_VERSION, 0xff, 0xff];
    sm.apply([entry(1, malformed)]).await.expect("a tick");
    assert_eq!(sm.view().read().state.time_ms, 5);
}

/// The child of [`a_recycled_wal_keeps_every_synced_write_across_a_crash`]: the data dir.
const WAL_CHILD_DIR: &str = "ALLOT_TEST_WAL_CHILD_DIR";
/// Keys the child overwrites in turn, so that a record replayed from a recycled file's
/// old tail would set a key back to an older value.
const WAL_KEYS: u64 = 16;

fn wal_value(i: u64) -> Vec<u8> {
    let mut v = i.to_be_bytes().to_vec();
    v.resize(64 << 10, (i % 251) as u8);
    v
}

/// WAL recycling (`store::WAL_RECYCLE_FILES`, DESIGN §55) reuses old WAL files, whose
/// stale records follow the new ones. A child process writes as the log store does
/// (an unsynced write, then `flush_wal(true)`, then it reports the write durable) through
/// dozens of WAL files with a 1 MiB live-WAL bound, and aborts. Reopened, the database
/// holds every write the child reported, with its last value, and nothing older: no hole
/// and no stale record replayed. RocksDB's own log shows that files were reused. The
/// previous release's options (no recycling) read the same files alike: a rollback.
#[test]
fn a_recycled_wal_keeps_every_synced_write_across_a_crash() {
    if let Ok(dir) = std::env::var(WAL_CHILD_DIR) {
        use std::io::Write;
        let db = store::open_db_with(std::path::Path::new(&dir), 1 << 20).expect("open db");
        let log = db.cf_handle(store::CF_LOG).expect("log cf");
        let mut out = std::io::stdout().lock();
        for i in 0..400u64 {
            db.put_cf(log, (i % WAL_KEYS).to_be_bytes(), wal_value(i))
                .expect("put");
            db.flush_wal(true).expect("sync");
            writeln!(out, "synced {i}")
                .and_then(|()| out.flush())
                .expect("stdout");
        }
        std::process::abort();
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_recycled_wal_keeps_every_synced_write_across_a_crash",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WAL_CHILD_DIR, dir.path())
        .output()
        .expect("run the child");
    assert!(!child.status.success(), "the child aborts");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let last: u64 = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("synced ")?.parse().ok())
        .unwrap_or_else(|| panic!("the child reported no write: {stdout}"));
    assert_eq!(last, 399, "the child ran to the end");

    let log_text = std::fs::read_to_string(dir.path().join("LOG")).expect("RocksDB's LOG");
    let reused = log_text.matches("from recycle list").count();
    assert!(reused >= 5, "WAL files were reused {reused} times");

    // A rollback to the previous release reads the same files with its own options:
    // recycling off, RocksDB's default live-WAL bound (the options of `open_db` before
    // §55). It opens a copy, since opening recovers and rewrites the WAL.
    let copy = tempfile::tempdir().expect("temp dir");
    for e in std::fs::read_dir(dir.path()).expect("list") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), copy.path().join(e.file_name())).expect("copy");
    }
    let mut previous = rocksdb::Options::default();
    previous.set_manual_wal_flush(false);
    previous.increase_parallelism(2);
    previous.set_bytes_per_sync(1 << 20);
    let cfs = [
        store::CF_LOG,
        store::CF_META,
        store::CF_SNAP,
        store::CF_AUDIT,
    ];
    let rolled_back = rocksdb::DB::open_cf(&previous, copy.path(), cfs).expect("previous release");
    check_last_values(&rolled_back, last);
    check_last_values(
        &store::open_db_with(dir.path(), 1 << 20).expect("reopen after the crash"),
        last,
    );
}

/// Every key of the crash test holds the value of its last write up to `last`.
fn check_last_values(db: &rocksdb::DB, last: u64) {
    let log = db.cf_handle(store::CF_LOG).expect("log cf");
    for k in 0..WAL_KEYS {
        let want = (0..=last)
            .filter(|i| i % WAL_KEYS == k)
            .max()
            .expect("written");
        let got = db
            .get_cf(log, k.to_be_bytes())
            .expect("get")
            .expect("present");
        let at = u64::from_be_bytes(got[..8].try_into().expect("8 bytes"));
        assert_eq!(
            at, want,
            "key {k}: write {at} after the crash, {want} synced last"
        );
        assert_eq!(got, wal_value(want), "key {k}: the value of write {want}");
    }
}

/// A snapshot's table file that a crash left before its ingestion is removed when the
/// database is opened again; other files in the directory are not touched.
#[test]
fn a_snapshot_file_left_before_ingestion_is_removed_at_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    drop(store::open_db(dir.path()).expect("create"));
    let left = dir.path().join("snapshot-2-17.ingest");
    let other = dir.path().join("operator-notes.txt");
    std::fs::write(&left, b"half a table file").expect("write");
    std::fs::write(&other, b"keep me").expect("write");
    drop(store::open_db(dir.path()).expect("reopen"));
    assert!(!left.exists(), "the leftover is removed");
    assert!(other.exists(), "nothing else is");
}
