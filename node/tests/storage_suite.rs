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
/// format or of one older than it reads, or an activation of a rule version it does not
/// support — stops with an
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

    let mut newer = Batch::new(5, std::slice::from_ref(&activation));
    newer.requests[0] = FORMAT_VERSION + 1;
    let refused = sm.apply([entry(1, newer)]).await;
    assert!(
        format!("{refused:?}").contains("newer release"),
        "{refused:?}"
    );
    assert_eq!(hash(&sm), empty, "nothing applied");

    // Bytes of a format older than this binary reads: written by a release before the
    // support window, applied by the replicas that ran it. Applying them as a tick here
    // would diverge from those replicas' state, silently.
    let mut older = Batch::new(5, std::slice::from_ref(&activation));
    older.requests[0] = allot_statemachine::codec::FORMAT_READ_MIN - 1;
    let refused = sm.apply([entry(1, older)]).await;
    assert!(
        format!("{refused:?}").contains("intermediate release"),
        "{refused:?}"
    );
    assert_eq!(hash(&sm), empty, "nothing applied");

    let mut malformed = Batch::new(5, &[]);
    malformed.requests = vec![FORMAT_VERSION, 0xff, 0xff];
    sm.apply([entry(1, malformed)]).await.expect("a tick");
    assert_eq!(sm.view().read().state.time_ms, 5);
}

/// Only an activation that apply would act on stops a replica. The same request from a
/// token nobody issued, or from a tenant, is refused by apply on every replica alike
/// (whatever version it names), so the replica applies it and goes on. Before, any
/// `ActivateVersion` above the replica's version stopped it — and every replica of the
/// shard, for good, since the entry is committed: a request that reached the log through
/// a follower elected in between (the version gate runs on the leader) was enough.
#[tokio::test]
async fn an_activation_apply_would_refuse_does_not_stop_the_replica() {
    use allot_node::types::{Batch, LogEntry};
    use allot_statemachine::ids::{Actor, OrgId, PrincipalId, TokenDigest};
    use allot_statemachine::outcome::CommandError;
    use allot_statemachine::{Command, Request};
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId};

    let dir = tempfile::tempdir().expect("temp dir");
    let db = store::open_db(dir.path()).expect("open db");
    let mut sm = StateMachineStore::open(db, 0, allot_statemachine::Config::default())
        .expect("open")
        .with_rules_max(1);
    let entry = |index: u64, requests: &[Request]| LogEntry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Batch::new(5 + index, requests)),
    };
    let activate = |actor, version| Request {
        actor,
        request_id: 7,
        org: None,
        command: Command::ActivateVersion { version },
    };
    let cases = [
        (
            activate(Actor::Bearer(TokenDigest([9; 32])), u32::MAX),
            CommandError::Unauthenticated,
        ),
        (
            activate(
                Actor::Tenant {
                    org: OrgId(3),
                    principal: PrincipalId(1),
                },
                2,
            ),
            CommandError::Unauthorized,
        ),
    ];
    for (i, (request, refused)) in cases.into_iter().enumerate() {
        let index = i as u64 + 1;
        let applied = sm
            .apply([entry(index, std::slice::from_ref(&request))])
            .await
            .unwrap_or_else(|e| panic!("{request:?} stopped the replica: {e:?}"));
        assert_eq!(applied[0].outcomes, vec![Err(refused)], "{request:?}");
        let view = sm.view();
        let g = view.read();
        assert_eq!(g.last_applied.map(|l| l.index), Some(index));
        assert_eq!(g.state.rules.active, 1, "nothing activated");
    }

    // The operator's activation of a version this replica does not support still stops
    // it, and changes nothing.
    let admin = allot_node::workload::admin(8, Command::ActivateVersion { version: 2 });
    let refused = sm.apply([entry(3, &[admin])]).await;
    assert!(
        format!("{refused:?}").contains("activates rule version 2"),
        "{refused:?}"
    );
    let view = sm.view();
    let g = view.read();
    assert_eq!(g.last_applied.map(|l| l.index), Some(2), "not applied");
    assert_eq!(g.state.rules.active, 1);
}

/// Shutdown waits for snapshot work running on threads of its own: `close` does not
/// report the work done while it runs, a closed tracker starts nothing, and `close`
/// returns once the running work ends. (Before, nothing joined these threads, and a
/// process could exit under a snapshot build inside RocksDB: DESIGN §55.)
#[tokio::test]
async fn closing_the_background_waits_for_running_snapshot_work_and_starts_none() {
    use allot_node::store::sm::Background;
    use std::sync::Arc;
    use std::time::Duration;

    let bg = Arc::new(Background::default());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let job = tokio::spawn({
        let bg = bg.clone();
        async move {
            bg.run(move || {
                started_tx.send(()).expect("test waits");
                release_rx.recv().expect("released");
                std::thread::current().name().map(str::to_owned)
            })
            .await
        }
    });
    started_rx.await.expect("the job started");
    assert_eq!(bg.running(), 1);

    // The job cannot end while it waits for its release: the close times out on it.
    assert_eq!(
        bg.close(Duration::from_millis(20)).await,
        1,
        "still running"
    );
    assert!(bg.closed());
    let refused = bg.run(|| ()).await;
    assert!(
        format!("{refused:?}").contains("shutting down"),
        "{refused:?}"
    );
    assert_eq!(bg.running(), 1, "the refused job was not counted");

    release_tx.send(()).expect("job waits");
    assert_eq!(bg.close(Duration::from_secs(60)).await, 0, "ended");
    let name = job.await.expect("joined").expect("ran");
    assert_eq!(name.as_deref(), Some("allot-snapshot"));
}

/// A snapshot build that starts after shutdown began stores nothing and reports the
/// shutdown, so the log it would have let openraft purge stays.
#[tokio::test]
async fn a_snapshot_build_during_shutdown_stores_nothing() {
    use allot_node::store::sm::Background;
    use openraft::storage::RaftStateMachine;
    use openraft::RaftSnapshotBuilder;
    use std::sync::Arc;
    use std::time::Duration;

    let dir = tempfile::tempdir().expect("temp dir");
    let db = store::open_db(dir.path()).expect("open db");
    let bg = Arc::new(Background::default());
    let mut sm = StateMachineStore::open(db, 0, allot_statemachine::Config::default())
        .expect("open")
        .with_background(bg.clone());
    let built = sm.get_snapshot_builder().await.build_snapshot().await;
    assert!(built.is_ok(), "{:?}", built.err());
    let stored = sm.get_current_snapshot().await.expect("read");
    let first = stored.expect("stored").meta.snapshot_id;

    assert_eq!(bg.close(Duration::from_secs(60)).await, 0);
    let refused = sm.get_snapshot_builder().await.build_snapshot().await;
    assert!(
        format!("{:?}", refused.err()).contains("shutting down"),
        "refused"
    );
    let stored = sm.get_current_snapshot().await.expect("read");
    assert_eq!(stored.expect("kept").meta.snapshot_id, first, "unchanged");
}

/// The log is never purged past the shard's stored snapshot. openraft 0.9 purges a
/// follower's log up to a snapshot it installs as soon as it hands the snapshot over,
/// before the state machine has stored it; an install that then fails (here: a
/// snapshot taken under a rule version this node does not support; a crash or a full
/// disk alike) left the log purged past the newest snapshot, and the replica could not
/// start again. Now that purge waits for the snapshot: after a failed install the log
/// still holds its entries, and after a successful one it is purged; a purge a crash
/// left pending is made or forgotten at the next start by what the stored snapshot
/// covers.
#[tokio::test]
async fn an_install_that_fails_leaves_the_log_unpurged() {
    use allot_node::store::log::PurgeFloor;
    use allot_node::types::{LogEntry, SnapshotMeta};
    use allot_statemachine::{Command, State};
    use openraft::storage::{RaftLogReader, RaftLogStorage, RaftStateMachine};
    use openraft::{CommittedLeaderId, EntryPayload, LogId, StoredMembership};
    use std::io::Cursor;
    use std::sync::Arc;

    let dir = tempfile::tempdir().expect("temp dir");
    let db = store::open_db(dir.path()).expect("open db");
    let id = |index| LogId::new(CommittedLeaderId::new(1, 1), index);
    let log_cf = db.cf_handle(store::CF_LOG).expect("log cf");
    for index in 1..=3u64 {
        let mut key = 0u32.to_be_bytes().to_vec();
        key.extend_from_slice(&index.to_be_bytes());
        let entry = LogEntry {
            log_id: id(index),
            payload: EntryPayload::Blank,
        };
        db.put_cf(log_cf, key, bincode::serialize(&entry).unwrap())
            .expect("put");
    }
    let open = |db: &Arc<rocksdb::DB>, rules_max| {
        let sm = StateMachineStore::open(db.clone(), 0, allot_statemachine::Config::default())
            .expect("open")
            .with_rules_max(rules_max);
        let floor = Arc::new(PurgeFloor::open(db, 0, sm.stored_snapshot_index()).expect("floor"));
        let log = LogStore::new(db.clone(), 0, store::log::Syncer::start(db.clone()))
            .with_purge_floor(floor.clone());
        (log, sm.with_purge_floor(floor))
    };
    // A snapshot at index 10 of a state under rule version 2.
    let mut state = State::default();
    let activate = allot_node::workload::admin(1, Command::ActivateVersion { version: 2 });
    allot_statemachine::apply(
        &mut state,
        &allot_statemachine::Entry {
            log_index: 10,
            logical_time_ms: 5,
            requests: vec![activate],
        },
    )
    .expect("applied");
    let meta = SnapshotMeta {
        last_log_id: Some(id(10)),
        last_membership: StoredMembership::default(),
        snapshot_id: "installed".into(),
    };
    let purged = |log: &mut LogStore| {
        let mut log = log.clone();
        async move { log.get_log_state().await.expect("state").last_purged_log_id }
    };

    // openraft's order: the purge, then the install (refused by a node that supports
    // rule version 1 only).
    let (mut log, mut sm) = open(&db, 1);
    log.purge(id(10)).await.expect("purge");
    let refused = sm
        .install_snapshot(&meta, Box::new(Cursor::new(state.encode())))
        .await;
    assert!(refused.is_err(), "the install fails");
    assert_eq!(purged(&mut log).await, None, "nothing purged");
    assert_eq!(log.try_get_log_entries(1..4).await.expect("read").len(), 3);

    // A restart forgets the purge no snapshot covers; the log is whole.
    drop((log, sm));
    let (mut log, sm) = open(&db, 1);
    assert_eq!(purged(&mut log).await, None);
    assert_eq!(log.try_get_log_entries(1..4).await.expect("read").len(), 3);
    drop((log, sm));

    // On a node that supports the version, the install stores the snapshot, and the
    // purge is made.
    let (mut log, mut sm) = open(&db, 2);
    log.purge(id(10)).await.expect("purge");
    assert_eq!(
        purged(&mut log).await,
        None,
        "deferred until the snapshot is stored"
    );
    sm.install_snapshot(&meta, Box::new(Cursor::new(state.encode())))
        .await
        .expect("installed");
    assert_eq!(purged(&mut log).await, Some(id(10)));
    assert!(log
        .try_get_log_entries(1..4)
        .await
        .expect("read")
        .is_empty());
}

/// A snapshot build that was still encoding when the leader's newer snapshot was
/// installed does not store its older state over the installed one. openraft runs the
/// build in a task of its own and installs meanwhile; the build's store came last and
/// put index 3 on disk over index 10, with the log purged past 3 (by the install): the
/// replica could not start again, and served the older snapshot to lagging followers.
#[tokio::test]
async fn a_build_that_ends_after_an_install_leaves_the_installed_snapshot_stored() {
    use allot_node::store::sm::Background;
    use allot_node::types::{LogEntry, SnapshotMeta};
    use allot_statemachine::State;
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder, StoredMembership};
    use std::io::Cursor;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().expect("temp dir");
    let db = store::open_db(dir.path()).expect("open db");
    let hold = dir.path().join("hold");
    std::fs::write(&hold, b"").expect("hold");
    let bg = Arc::new(Background::default());
    let id = |index| LogId::new(CommittedLeaderId::new(1, 1), index);
    let mut sm = StateMachineStore::open(db.clone(), 0, allot_statemachine::Config::default())
        .expect("open")
        .with_background(bg.clone())
        .with_test_hold(Some(hold.clone()));
    let blanks = (1..=3).map(|i| LogEntry {
        log_id: id(i),
        payload: EntryPayload::Blank,
    });
    sm.apply(blanks).await.expect("applied");
    // The build copies the state at index 3, encodes it, and waits before storing.
    let mut builder = sm.get_snapshot_builder().await;
    let build = tokio::spawn(async move { builder.build_snapshot().await });
    let waited = Instant::now();
    while bg.running() == 0 {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the build started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Meanwhile the leader's snapshot at index 10 is installed.
    let meta = SnapshotMeta {
        last_log_id: Some(id(10)),
        last_membership: StoredMembership::default(),
        snapshot_id: "installed".into(),
    };
    sm.install_snapshot(&meta, Box::new(Cursor::new(State::default().encode())))
        .await
        .expect("installed");
    std::fs::remove_file(&hold).expect("release");
    let built = build.await.expect("joined").expect("built");
    assert_eq!(built.meta.last_log_id, Some(id(3)));
    let stored = sm
        .get_current_snapshot()
        .await
        .expect("read")
        .expect("stored");
    assert_eq!(
        stored.meta.snapshot_id, "installed",
        "the newer snapshot stays"
    );
    drop(sm);
    let reopened =
        StateMachineStore::open(db, 0, allot_statemachine::Config::default()).expect("open");
    assert_eq!(reopened.stored_snapshot_index(), Some(10));
}
