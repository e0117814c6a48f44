//! Integration tests against real `allot-node` processes on loopback (127.0.0.1 only):
//! SIGKILL of a leader under load, catch-up by log and by snapshot, skewed clocks.

use allot_node::local_cluster::{Client, LocalCluster};
use allot_node::workload::{self, HoldCycle};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::testkit::{ORG, PROJECT};
use allot_statemachine::{Account, Outcome, Request};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod common;
use common::{audit_on, backup_on, metric};

const CREDITS: u64 = 1_000_000_000_000; // 1M credits on each shard's fixture project

/// Every node snapshots by the size rule (store/trigger.rs): every 4 KiB of log or the
/// last snapshot's size, whichever is more (the entry count out of reach), keeping 5
/// entries behind — so a node that falls behind catches up by snapshot.
fn snapshot_by_size(c: &mut LocalCluster) {
    for n in &mut c.nodes {
        n.extra_args = [
            "--snapshot-min-log-bytes",
            "4096",
            "--snapshot-every",
            "1000000",
            "--keep-behind-snapshot",
            "5",
        ]
        .map(String::from)
        .to_vec();
    }
}

fn cluster(name: &str, nodes: u64, shards: u32) -> (tempfile::TempDir, LocalCluster) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("allot-{name}-"))
        .tempdir()
        .expect("temp dir");
    let c = LocalCluster::new(
        PathBuf::from(env!("CARGO_BIN_EXE_allot-node")),
        dir.path().to_path_buf(),
        nodes,
        shards,
    )
    .expect("cluster layout");
    (dir, c)
}

async fn up(c: &mut LocalCluster) {
    c.start_all().expect("start nodes");
    c.init().await.expect("init");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
}

async fn setup_shards(client: &Client, shards: u32) {
    for s in 0..shards {
        let (outs, _) = client
            .execute(s, &workload::setup(CREDITS))
            .await
            .expect("setup");
        for o in outs {
            assert!(o.is_ok(), "setup command failed on shard {s}: {o:?}");
        }
    }
}

/// Polls every running replica of `shard` until they report the same applied index,
/// then returns their (node, hash) pairs at that index.
async fn hashes_at_same_index(
    c: &LocalCluster,
    shard: u32,
    timeout: Duration,
) -> Vec<(u64, Vec<u8>, u64)> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut got = Vec::new();
        for n in &c.nodes {
            if !c.is_running(n.id) || !c.members.contains(&n.id) {
                continue;
            }
            if let Ok(mut a) = allot_node::local_cluster::admin(&n.addr).await {
                if let Ok(r) = a.shard_hash(allot_proto::ShardRequest { shard }).await {
                    let r = r.into_inner();
                    got.push((n.id, r.state_hash, r.applied_index));
                }
            }
        }
        let running = c
            .nodes
            .iter()
            .filter(|n| c.is_running(n.id) && c.members.contains(&n.id))
            .count();
        if got.len() == running && got.windows(2).all(|w| w[0].2 == w[1].2) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "replicas of shard {shard} never reached the same index: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn assert_replicas_agree(c: &LocalCluster, client: &Client, shards: u32) {
    for s in 0..shards {
        let got = hashes_at_same_index(c, s, Duration::from_secs(60)).await;
        for w in got.windows(2) {
            assert_eq!(
                w[0].1, w[1].1,
                "shard {s}: node {} and node {} differ at index {}",
                w[0].0, w[1].0, w[0].2
            );
        }
        for n in &c.nodes {
            if !c.is_running(n.id) || !c.members.contains(&n.id) {
                continue;
            }
            match client.query_replica(&n.addr, s, &Query::Invariants).await {
                Ok(Answer::Invariants(r)) => {
                    assert_eq!(r, Ok(()), "invariants on node {} shard {s}", n.id)
                }
                other => panic!("invariants query on node {} shard {s}: {other:?}", n.id),
            }
        }
    }
}

type Acked = Arc<Mutex<Vec<(u32, Request, Outcome)>>>;

/// A worker driving hold cycles on one shard, recording every acknowledged request.
fn spawn_worker(
    client: Client,
    shard: u32,
    stream: u64,
    stop: Arc<AtomicBool>,
    acked: Acked,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut cycle = HoldCycle::new(stream, 3_000_000);
        while !stop.load(Ordering::Relaxed) {
            let reqs: Vec<Request> = (0..3).map(|_| cycle.request()).collect();
            for r in reqs {
                // Each request alone, retried with the same id until acknowledged.
                match client.execute(shard, std::slice::from_ref(&r)).await {
                    Ok((mut outs, _)) => {
                        let o = outs.pop().expect("one outcome");
                        acked.lock().unwrap().push((shard, r, o));
                    }
                    Err(e) => panic!("worker {stream} on shard {shard}: {e}"),
                }
            }
        }
    })
}

/// Every acknowledged command survived: replaying each request id returns its first
/// outcome (the idempotency table holds exactly what was applied).
async fn assert_acked_survived(client: &Client, acked: &[(u32, Request, Outcome)], shards: u32) {
    for chunk in acked.chunks(512) {
        for s in 0..shards {
            let reqs: Vec<Request> = chunk
                .iter()
                .filter(|a| a.0 == s)
                .map(|a| a.1.clone())
                .collect();
            if reqs.is_empty() {
                continue;
            }
            let (outs, _) = client.execute(s, &reqs).await.expect("replay");
            let firsts: Vec<&Outcome> = chunk.iter().filter(|a| a.0 == s).map(|a| &a.2).collect();
            for (o, first) in outs.iter().zip(firsts) {
                assert_eq!(
                    o, first,
                    "a replayed request answered differently on shard {s}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_loses_no_acknowledged_command_and_replicas_converge() {
    let shards = 4;
    let (_dir, mut c) = cluster("kill", 3, shards);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;

    let stop = Arc::new(AtomicBool::new(false));
    let acked: Acked = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8u64 {
        workers.push(spawn_worker(
            client.clone(),
            (w % shards as u64) as u32,
            w + 1,
            stop.clone(),
            acked.clone(),
        ));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let victim = c.leader_of(0).await.expect("leader of shard 0");
    let before_kill = acked.lock().unwrap().len();
    c.kill(victim);
    // Keep going through the failover until the survivors acknowledged more work.
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.lock().unwrap().iter().filter(|a| a.0 == 0).count() < before_kill / 4 + 30 {
        assert!(
            Instant::now() < deadline,
            "shard 0 made no progress after its leader was killed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("worker");
    }
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    assert!(
        acked.len() > before_kill,
        "work was acknowledged after the kill"
    );

    // Catch-up by log: the victim was down briefly, its followers' logs still hold
    // everything it missed.
    c.start(victim).expect("restart");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders after restart");

    assert_acked_survived(&client, &acked, shards).await;
    assert!(
        acked.iter().all(|a| a.2.is_ok()),
        "every hold-cycle command succeeded"
    );

    // Conservation: what was issued is still exactly what was granted, on the leader.
    for s in 0..shards {
        match client.query(s, &Query::Totals).await.expect("totals") {
            Answer::Totals(t) => assert_eq!(t.issued, CREDITS as u128, "shard {s}"),
            other => panic!("{other:?}"),
        }
    }
    assert_replicas_agree(&c, &client, shards).await;
}

/// The audit chain's head as the node at `addr` reports it (`stale_ok`: its own
/// replica's; otherwise linearizable).
async fn audit_head(addr: &str, shard: u32, stale_ok: bool) -> Result<u64, tonic::Status> {
    use allot_proto::api::v1 as pb;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let reply = pb::api_client::ApiClient::new(ch)
        .audit(pb::AuditRequest {
            read: Some(pb::Read {
                shard: Some(shard),
                stale_ok,
            }),
            from_seq: 0,
            limit: 1,
            ..Default::default()
        })
        .await?;
    Ok(reply.into_inner().head_seq)
}

/// An audit read is linearizable unless it asks for this replica's state (DESIGN §56):
/// a follower restarted after missing writes, asked at once, answers with the chain's
/// current head (through the leader), not with its own head from before the writes.
/// Before, every audit page was served from the local replica whatever the `Read`
/// header said, and a harness reading the head there missed acknowledged commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audit_head_read_through_a_lagging_follower_is_the_chains_head() {
    let (_dir, mut c) = cluster("audithead", 3, 1);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    let leader = c.leader_of(0).await.expect("leader");
    let follower = (1..=3).find(|n| *n != leader).expect("a follower");
    c.kill(follower);
    let mut cycle = HoldCycle::new(9, 3_000_000);
    for _ in 0..200 {
        let r = cycle.request();
        let (outs, _) = client.execute(0, &[r]).await.expect("execute");
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    let head = audit_head(&c.node(leader).addr, 0, false)
        .await
        .expect("the leader's head");

    c.start(follower).expect("restart");
    c.wait_listening(follower, Duration::from_secs(60))
        .expect("listening");
    // At once, and until the follower can answer at all (it may not know the leader
    // yet: Unavailable): never an older head.
    let addr = c.node(follower).addr.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        match audit_head(&addr, 0, false).await {
            Ok(h) => break h,
            Err(e) => assert!(Instant::now() < deadline, "no answer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        got, head,
        "a linearizable head through the restarted follower"
    );
    // Its own replica's head, asked for explicitly, is served (never past the chain's).
    let own = audit_head(&addr, 0, true).await.expect("stale read");
    assert!(own <= head, "{own} > {head}");
}

/// Whether process `pid` has a thread named `name` now.
fn has_thread(pid: u32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
}

/// SIGTERM while a snapshot build is under way: the node waits for the build before it
/// exits (a process exiting under a build inside RocksDB could crash: DESIGN §55), the
/// build gives up instead of storing, the node exits 0, and a restart loses no
/// acknowledged write. The build is held between encoding and storing by the test hook
/// `--test-snapshot-hold-file`, so the SIGTERM lands inside it every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_snapshot_build_waits_for_it_and_exits_cleanly() {
    let (dir, mut c) = cluster("snapterm", 1, 1);
    let hold = dir.path().join("hold-snapshots");
    std::fs::write(&hold, b"").expect("hold file");
    c.nodes[0].extra_args = vec![
        "--snapshot-every".into(),
        "20".into(),
        "--test-snapshot-hold-file".into(),
        hold.display().to_string(),
    ];
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    let pid = c.pid(1).expect("running");

    // Writes, one entry each, until a build is under way (and held).
    let acked: Acked = Arc::default();
    let mut cycle = HoldCycle::new(5, 3_000_000);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !has_thread(pid, "allot-snapshot") {
        assert!(Instant::now() < deadline, "no snapshot build started");
        let r = cycle.request();
        let (mut outs, _) = client
            .execute(0, std::slice::from_ref(&r))
            .await
            .expect("execute");
        acked
            .lock()
            .unwrap()
            .push((0, r, outs.pop().expect("one outcome")));
    }

    assert!(c.sigterm(1));
    let waiting = "waiting for snapshot builds to end";
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(c.log_path(1)).is_ok_and(|l| l.contains(waiting)) {
        assert!(
            Instant::now() < deadline,
            "the node never waited for the build: {}",
            c.log_tail(1, 30)
        );
        assert!(
            c.exited(1).is_none(),
            "exited under a build: {}",
            c.log_tail(1, 30)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        c.exited(1).is_none(),
        "the node waits while the build is held"
    );
    assert!(
        has_thread(pid, "allot-snapshot"),
        "the build is still running"
    );

    std::fs::remove_file(&hold).expect("release the build");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.exited(1) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the node did not exit once the build ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit after the build: {status:?}");
    let log = std::fs::read_to_string(c.log_path(1)).expect("log");
    assert!(
        log.contains("snapshot build abandoned before storing"),
        "{}",
        c.log_tail(1, 30)
    );

    c.start(1).expect("restart");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let acked = acked.lock().unwrap().clone();
    assert!(!acked.is_empty());
    assert_acked_survived(&client, &acked, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_behind_the_purged_log_catches_up_by_snapshot() {
    let shards = 2;
    let (_dir, mut c) = cluster("snap", 3, shards);
    snapshot_by_size(&mut c);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;
    let leader = c.leader_of(0).await.unwrap();
    let lagger = (1..=3).find(|n| *n != leader).unwrap();
    let lagger_last = c.status(lagger).await.unwrap().shards[0].last_log_index;
    c.kill(lagger);

    // Enough entries (one per call) for several snapshots and purges on the survivors.
    let mut cycle = HoldCycle::new(7, 3_000_000);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = cycle.request();
        let (outs, _) = client.execute(0, &[r]).await.expect("execute");
        assert!(outs[0].is_ok(), "{outs:?}");
        let st = c.status(c.leader_of(0).await.unwrap()).await.unwrap();
        if st.shards[0].purged_index > lagger_last + 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the leader never purged past the lagger: {st:?}"
        );
    }
    c.start(lagger).expect("restart");
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let got = hashes_at_same_index(&c, 0, Duration::from_secs(60)).await;
    for w in got.windows(2) {
        assert_eq!(w[0].1, w[1].1, "replicas differ after snapshot install");
    }
    let st = c.status(lagger).await.unwrap();
    assert!(
        st.shards[0].snapshot_index > lagger_last,
        "the lagger's state came from a snapshot past its old log: {:?}",
        st.shards[0]
    );
    assert_replicas_agree(&c, &client, shards).await;
    // The lagger's trail has a hole where the snapshot skipped its log; it copies the
    // rows from a peer and then serves the whole trail, the same as the leader's.
    let whole = audit_whole_on(&c, lagger, 0).await;
    assert_eq!(
        whole,
        audit_on(&c.node(leader).addr, 0).await.unwrap()[..whole.len()]
    );

    // Snapshots are stored without the WAL (flushed to an SST before the log is purged):
    // a SIGKILL right after must still find the installed snapshot on restart.
    c.kill(lagger);
    c.start(lagger).expect("restart after SIGKILL");
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let got = hashes_at_same_index(&c, 0, Duration::from_secs(60)).await;
    for w in got.windows(2) {
        assert_eq!(
            w[0].1, w[1].1,
            "replicas differ after a restart from the snapshot"
        );
    }
    assert_replicas_agree(&c, &client, shards).await;
}

fn real_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Documented bound (docs/DESIGN.md §28): logical time is never ahead of the correct
/// clocks by more than the sampling error. The test allows 1 s on a loaded machine.
const SKEW_BOUND_MS: u64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_clocks_neither_expire_credit_early_nor_stop_time() {
    let shards = 2;
    let (_dir, mut c) = cluster("skew", 3, shards);
    // Node 1 runs 10 minutes fast and wins elections (short timeouts); node 2 runs 10
    // minutes slow; node 3 is right.
    c.nodes[0].extra_args = [
        "--test-clock-offset-ms=600000",
        "--election-min-ms",
        "200",
        "--election-max-ms",
        "300",
    ]
    .map(String::from)
    .to_vec();
    c.nodes[1].extra_args = [
        "--test-clock-offset-ms=-600000",
        "--election-min-ms",
        "1500",
        "--election-max-ms",
        "3000",
    ]
    .map(String::from)
    .to_vec();
    c.nodes[2].extra_args = ["--election-min-ms", "1500", "--election-max-ms", "3000"]
        .map(String::from)
        .to_vec();
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;
    let mut led_by_fast = 0;
    for s in 0..shards {
        led_by_fast += (c.leader_of(s).await.unwrap() == 1) as u32;
    }
    assert!(
        led_by_fast > 0,
        "the fast node leads a shard (else the test proves little)"
    );

    // A promotional grant that expires 6 s from now (real time).
    let expires_at = real_now_ms() + 6_000;
    let mut g = workload::grant(50, Account::Project(PROJECT), 5_000_000);
    g.kind = allot_statemachine::BucketKind::Promotional;
    g.expires_at_ms = Some(expires_at);
    let (outs, _) = client
        .execute(
            0,
            &[workload::admin(
                workload::rid(0, 5000),
                allot_statemachine::Command::IssueGrant(g),
            )],
        )
        .await
        .unwrap();
    assert!(outs[0].is_ok(), "{outs:?}");

    let start_logical = shard_time(&c, 0).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        let before = real_now_ms();
        for s in 0..shards {
            let t = shard_time(&c, s).await;
            assert!(
                t <= real_now_ms() + SKEW_BOUND_MS,
                "shard {s} logical time {t} is ahead of real time {before}"
            );
        }
        match client
            .query(
                0,
                &Query::Balance {
                    org: ORG,
                    account: Account::Project(PROJECT),
                    horizon_ms: 0,
                },
            )
            .await
            .unwrap()
        {
            Answer::Balance(Some(b)) if real_now_ms() + SKEW_BOUND_MS < expires_at => assert_eq!(
                b.promotional_available_micro, 5_000_000,
                "promotional credit expired early"
            ),
            Answer::Balance(Some(_)) => {}
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Liveness: time kept moving at about the real rate (ticks with no traffic).
    let advanced = shard_time(&c, 0).await - start_logical;
    assert!(
        advanced >= 2_500,
        "logical time advanced only {advanced} ms in 4 s"
    );
    // And once real time is past the expiry (plus the bound), the credit is gone.
    while real_now_ms() < expires_at + 3 * SKEW_BOUND_MS {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match client
        .query(
            0,
            &Query::Balance {
                org: ORG,
                account: Account::Project(PROJECT),
                horizon_ms: 0,
            },
        )
        .await
        .unwrap()
    {
        Answer::Balance(Some(b)) => assert_eq!(b.promotional_available_micro, 0, "expired on time"),
        other => panic!("{other:?}"),
    }
}

/// Issue 21, finding 5: five nodes, two of them 10 minutes fast and quick to win
/// elections; one node down, then two (the three left — two fast, one right — still a
/// quorum). Logical time never runs ahead of real time by more than the bound, and a
/// promotional credit is usable until its instant and gone after it. (With the median of
/// a bare majority of samples, two fast clocks of three samples made the target fast.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fast_clocks_of_five_with_nodes_down_move_nothing_early() {
    let (_dir, mut c) = cluster("skew5", 5, 1);
    for i in 0..2 {
        c.nodes[i].extra_args = [
            "--test-clock-offset-ms=600000",
            "--election-min-ms",
            "200",
            "--election-max-ms",
            "300",
        ]
        .map(String::from)
        .to_vec();
    }
    for i in 2..5 {
        c.nodes[i].extra_args = ["--election-min-ms", "1500", "--election-max-ms", "3000"]
            .map(String::from)
            .to_vec();
    }
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    c.kill(5);
    let leader = c.leader_of(0).await.unwrap();
    assert!(
        leader <= 2,
        "a fast node leads (else the test proves little): {leader}"
    );

    let expires_at = real_now_ms() + 10_000;
    let mut g = workload::grant(50, Account::Project(PROJECT), 5_000_000);
    g.kind = allot_statemachine::BucketKind::Promotional;
    g.expires_at_ms = Some(expires_at);
    let (outs, _) = client
        .execute(
            0,
            &[workload::admin(
                workload::rid(0, 5000),
                allot_statemachine::Command::IssueGrant(g),
            )],
        )
        .await
        .unwrap();
    assert!(outs[0].is_ok(), "{outs:?}");
    let promo = || async {
        match client
            .query(
                0,
                &Query::Balance {
                    org: ORG,
                    account: Account::Project(PROJECT),
                    horizon_ms: 0,
                },
            )
            .await
            .unwrap()
        {
            Answer::Balance(Some(b)) => b.promotional_available_micro,
            other => panic!("{other:?}"),
        }
    };
    let started = Instant::now();
    let mut max_ahead: i64 = i64::MIN;
    let mut second_down = false;
    while real_now_ms() + SKEW_BOUND_MS < expires_at {
        if !second_down && started.elapsed() > Duration::from_secs(2) {
            // A correct node goes down too: two fast clocks of the three left. Then the
            // (fast) leader restarts, so a new leader takes office and adopts the
            // cluster's time from those three samples.
            c.kill(4);
            second_down = true;
            let leader = c.leader_of(0).await.unwrap();
            c.kill(leader);
            c.start(leader).unwrap();
            c.wait_leaders(Duration::from_secs(20)).await.unwrap();
        }
        let t = shard_time(&c, 0).await;
        let now = real_now_ms();
        max_ahead = max_ahead.max(t as i64 - now as i64);
        assert!(
            t <= now + SKEW_BOUND_MS,
            "logical time {t} is ahead of real time {now}"
        );
        if real_now_ms() + SKEW_BOUND_MS < expires_at {
            assert_eq!(promo().await, 5_000_000, "promotional credit expired early");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("skew5: logical time at most {max_ahead} ms ahead of real time");
    while real_now_ms() < expires_at + 3 * SKEW_BOUND_MS {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(promo().await, 0, "expired on time");
}

/// Issue 21, finding 4 (failover): the leader (a correct clock) is killed and a node
/// whose clock is 10 minutes slow takes office, with only its own and one correct
/// clock to sample: its target is the slow one, behind the shard's time. Logical time
/// over the failover still follows real time: the election's gap (≈ 2 s here) is
/// counted, not lost (the old stamper resumed from the applied time, so every job
/// running across such a failover was billed the gap short), and it never runs ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_slow_clock_keeps_logical_time_at_the_real_rate() {
    let (_dir, mut c) = cluster("slowfail", 3, 1);
    let tick = ["--tick-ms", "100"];
    let timeouts = [
        ("0", "200", "300"),
        ("-600000", "1500", "2000"),
        ("0", "4000", "6000"),
    ];
    for (n, (offset, min, max)) in c.nodes.iter_mut().zip(timeouts) {
        n.extra_args = vec![
            format!("--test-clock-offset-ms={offset}"),
            "--election-min-ms".into(),
            min.into(),
            "--election-max-ms".into(),
            max.into(),
        ];
        n.extra_args.extend(tick.map(String::from));
    }
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    assert_eq!(
        c.leader_of(0).await.unwrap(),
        1,
        "the quick correct node leads"
    );
    // Let every node sample the others' clocks and see the shard's time advance.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (t0, r0) = (shard_time(&c, 0).await, real_now_ms());
    c.kill(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        match c.leader_of(0).await {
            Ok(l) if l != 1 => break l,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("no new leader: {other:?}"),
        }
    };
    assert_eq!(
        leader, 2,
        "the slow node took office (else the test proves little)"
    );
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        let t = shard_time(&c, 0).await;
        let now = real_now_ms();
        assert!(
            t <= now + SKEW_BOUND_MS,
            "logical time {t} is ahead of real time {now}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (t1, r1) = (shard_time(&c, 0).await, real_now_ms());
    let (logical, real) = (t1 - t0, r1 - r0);
    println!("slowfail: logical time advanced {logical} ms over {real} ms of real time");
    // Each reading may lag real time by a tick (100 ms) plus the query; the slew takes
    // at most 0.05 %.
    let allowed = 300 + real / 1_000;
    assert!(
        logical.abs_diff(real) <= allowed,
        "logical time advanced {logical} ms over {real} ms of real time across the failover"
    );
}

/// The node's whole audit trail of `shard`, once it serves one (polled for 60 s: a
/// replica that installed a snapshot copies the missing rows from a peer first). The
/// chain is verified from genesis.
async fn audit_whole_on(
    c: &LocalCluster,
    id: u64,
    shard: u32,
) -> Vec<allot_statemachine::AuditEvent> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match audit_on(&c.node(id).addr, shard).await {
            Ok(events) if !events.is_empty() => {
                allot_statemachine::verify_chain(&Default::default(), &events)
                    .unwrap_or_else(|e| panic!("node {id}'s trail: {e}"));
                return events;
            }
            other => assert!(
                Instant::now() < deadline,
                "node {id} never served its whole trail: {:?}",
                other.map(|e| e.len())
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Issue 23: every original node is replaced, one at a time (a new node joins as a
/// learner, is promoted, and the old one is removed and stopped), under writes, with
/// snapshots by size so the newcomers catch up by snapshot past a purged log. Afterwards
/// no node that saw genesis is left, yet every replica serves the trail from sequence 0
/// — copied from peers and verified against its state's chain head — identical on all,
/// and a backup taken on each verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_every_original_node_keeps_the_audit_trail_from_genesis() {
    let (_dir, mut c) = cluster("replace", 6, 1);
    snapshot_by_size(&mut c);
    let client = start_with_voters_1_to_3(&mut c, 1).await;
    let mut cycle = HoldCycle::new(9, 3_000_000);
    let mut write = async |n: usize| {
        for _ in 0..n {
            let (outs, _) = client
                .execute(0, &[cycle.request()])
                .await
                .expect("execute");
            assert!(outs[0].is_ok(), "{outs:?}");
        }
    };
    write(300).await;
    let mut voters = vec![1u64, 2, 3];
    for (old, new) in [(1u64, 4u64), (2, 5), (3, 6)] {
        let via = *voters.iter().find(|v| **v != old).unwrap();
        let mut a = allot_node::local_cluster::admin(&c.node(via).addr)
            .await
            .unwrap();
        add_learner_everywhere(&mut a, &c, new).await;
        write(100).await;
        voters.retain(|v| *v != old);
        voters.push(new);
        change_voters_when_the_trail_allows(&mut a, &voters).await;
        c.members = voters.clone();
        c.kill(old);
        c.wait_leaders(Duration::from_secs(30))
            .await
            .expect("leaders");
        write(200).await;
    }
    // The newcomers caught up by snapshot (so their trails began with a gap) ...
    let mut copied = 0u64;
    for id in [4u64, 5, 6] {
        let st = c.status(id).await.unwrap();
        assert!(
            st.shards[0].snapshot_index > 0,
            "node {id}: {:?}",
            st.shards[0]
        );
        copied += metric(&c.node(id).metrics_addr, "allot_audit_events_copied_total").await as u64;
    }
    assert!(copied > 0, "some replica copied audit rows from a peer");
    // ... and each now serves the whole trail, the same on all.
    let trails = [
        audit_whole_on(&c, 4, 0).await,
        audit_whole_on(&c, 5, 0).await,
        audit_whole_on(&c, 6, 0).await,
    ];
    let n = trails.iter().map(Vec::len).min().unwrap();
    assert!(n > 1_000, "the trail holds the whole history: {n} events");
    assert_eq!(trails[0][..n], trails[1][..n]);
    assert_eq!(trails[0][..n], trails[2][..n]);
    for id in [4u64, 5, 6] {
        let b = backup_on(&c.node(id).addr, 0)
            .await
            .unwrap_or_else(|e| panic!("backup on node {id}: {e}"));
        let (_, summary) = b.verify().expect("the backup verifies");
        assert!(summary.audit_events >= n as u64, "{summary:?}");
    }
    println!("replace: {n} events served from genesis by every new replica, {copied} copied");
}

/// Starts every node of `c`, makes nodes 1–3 the voters of its `shards` shards, and sets
/// up each shard's world; the client of the cluster.
async fn start_with_voters_1_to_3(c: &mut LocalCluster, shards: u32) -> allot_client::Client {
    c.start_all().expect("start");
    c.init_members(&[1, 2, 3]).await.expect("init 1..3");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;
    client
}

/// Adds node `new` as a learner of every shard, through `a`.
async fn add_learner_everywhere(
    a: &mut allot_proto::admin_client::AdminClient<tonic::transport::Channel>,
    c: &LocalCluster,
    new: u64,
) {
    a.add_learner(allot_proto::MemberRequest {
        shard: 0,
        all_shards: true,
        member: Some(allot_proto::Member {
            node_id: new,
            addr: c.node(new).addr.clone(),
        }),
    })
    .await
    .expect("add learner");
}

/// Changes every shard's voters to `voters`, retrying while the membership guard answers
/// that no member left would hold the whole audit trail yet (`AUDIT_GAP`): the members
/// left copy it in the background, as `allotctl member remove` waits for them.
async fn change_voters_when_the_trail_allows(
    a: &mut allot_proto::admin_client::AdminClient<tonic::transport::Channel>,
    voters: &[u64],
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = a
            .change_membership(allot_proto::ChangeMembershipRequest {
                shard: 0,
                all_shards: true,
                voters: voters.to_vec(),
                allow_audit_loss: false,
                expected_membership_index: None,
            })
            .await;
        match r {
            Ok(_) => return,
            Err(s) if reason(&s) == Some("AUDIT_GAP") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(s) => panic!("change voters to {voters:?}: {s:?}"),
        }
    }
}

fn reason(s: &tonic::Status) -> Option<&str> {
    s.metadata()
        .get("allot-reason")
        .and_then(|v| v.to_str().ok())
}

/// Found by the tenth session's review (DESIGN §59): removing members did not check that
/// a member left holds the whole audit trail. Nodes 4–7 join by snapshot with their audit
/// fill held back (so each trail begins with a gap); replacing all of 1–3 by 4–6 in one
/// change would leave no member with the events before their snapshots. The change is
/// refused `AUDIT_GAP` (through the leader or a follower), nothing changed; keeping one
/// original is allowed at once; once the fill may run the replacement goes through, and
/// the new members serve the trail from genesis. `allow_audit_loss` overrides the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_last_members_with_the_whole_trail_waits_for_a_new_one() {
    use allot_proto::ChangeMembershipRequest;
    let (dir, mut c) = cluster("auditguard", 7, 1);
    snapshot_by_size(&mut c);
    let hold = dir.path().join("audit-fill-hold");
    let hold7 = dir.path().join("audit-fill-hold-7");
    std::fs::write(&hold, b"").unwrap();
    std::fs::write(&hold7, b"").unwrap();
    for id in [4u64, 5, 6, 7] {
        let file = if id == 7 { &hold7 } else { &hold };
        c.nodes[id as usize - 1].extra_args.extend([
            "--test-audit-fill-hold-file".to_string(),
            file.display().to_string(),
        ]);
    }
    let client = start_with_voters_1_to_3(&mut c, 1).await;
    let mut cycle = HoldCycle::new(9, 3_000_000);
    for _ in 0..300 {
        let (outs, _) = client
            .execute(0, &[cycle.request()])
            .await
            .expect("execute");
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    let leader = c.leader_of(0).await.unwrap();
    // The leader's log is purged behind a snapshot, so the learners join by snapshot.
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.status(leader).await.unwrap().shards[0].purged_index == 0 {
        assert!(Instant::now() < deadline, "the leader never purged its log");
        let (outs, _) = client
            .execute(0, &[cycle.request()])
            .await
            .expect("execute");
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    let mut a = allot_node::local_cluster::admin(&c.node(leader).addr)
        .await
        .unwrap();
    for new in [4u64, 5, 6, 7] {
        add_learner_everywhere(&mut a, &c, new).await;
    }
    for id in [4u64, 5, 6, 7] {
        let deadline = Instant::now() + Duration::from_secs(30);
        let st = loop {
            let st = c.status(id).await.unwrap();
            if st.shards[0].snapshot_index > 0 {
                break st;
            }
            assert!(Instant::now() < deadline, "node {id} joined by snapshot");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            st.shards[0].audit_verified_seq < st.shards[0].audit_head_seq,
            "node {id}'s trail has its gap: {:?}",
            st.shards[0]
        );
    }
    let change = |voters: Vec<u64>, allow_audit_loss: bool| ChangeMembershipRequest {
        shard: 0,
        all_shards: true,
        voters,
        allow_audit_loss,
        expected_membership_index: None,
    };
    // Through a follower too: it forwards to the leader, which runs the guard.
    let follower = [1u64, 2, 3].into_iter().find(|n| *n != leader).unwrap();
    let mut f = allot_node::local_cluster::admin(&c.node(follower).addr)
        .await
        .unwrap();
    for via in [&mut a, &mut f] {
        let refused = via
            .change_membership(change(vec![4, 5, 6, 7], false))
            .await
            .expect_err("no member left would hold the whole trail");
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert_eq!(reason(&refused), Some("AUDIT_GAP"), "{refused:?}");
        assert!(
            refused.message().contains("node 4 holds events 0.."),
            "{}",
            refused.message()
        );
    }
    let st = c.status(leader).await.unwrap();
    assert_eq!(st.shards[0].voters, vec![1, 2, 3], "nothing was changed");
    assert_eq!(
        st.shards[0].learners,
        vec![4, 5, 6, 7],
        "nothing was changed"
    );
    // Keeping one original, which holds the whole trail, is allowed at once.
    a.change_membership(change(vec![leader, 4, 5, 6, 7], false))
        .await
        .expect("the leader keeps the whole trail");
    // Removing it too waits until a newcomer has copied the trail.
    std::fs::remove_file(&hold).unwrap();
    change_voters_when_the_trail_allows(&mut a, &[4, 5, 6, 7]).await;
    c.members = vec![4, 5, 6, 7];
    for id in [1u64, 2, 3] {
        c.kill(id);
    }
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let trails = [
        audit_whole_on(&c, 4, 0).await,
        audit_whole_on(&c, 5, 0).await,
    ];
    assert!(trails[0].len() > 300, "{}", trails[0].len());
    let n = trails[0].len().min(trails[1].len());
    assert_eq!(trails[0][..n], trails[1][..n]);
    // Node 7's fill is still held: leaving only it would lose the trail, unless allowed.
    let mut a = allot_node::local_cluster::admin(&c.node(c.leader_of(0).await.unwrap()).addr)
        .await
        .unwrap();
    let refused = a
        .change_membership(change(vec![7], false))
        .await
        .expect_err("only node 7 would be left, without the whole trail");
    assert_eq!(reason(&refused), Some("AUDIT_GAP"), "{refused:?}");
    a.change_membership(change(vec![7], true))
        .await
        .expect("the loss allowed explicitly");
}

async fn shard_time(c: &LocalCluster, shard: u32) -> u64 {
    let leader = c.leader_of(shard).await.unwrap();
    let mut a = allot_node::local_cluster::admin(&c.node(leader).addr)
        .await
        .unwrap();
    a.shard_hash(allot_proto::ShardRequest { shard })
        .await
        .unwrap()
        .into_inner()
        .logical_time_ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_joins_is_promoted_and_the_removed_voter_does_not_disrupt() {
    use allot_proto::{ChangeMembershipRequest, Member, MemberRequest};
    let shards = 2;
    let (_dir, mut c) = cluster("member", 4, shards);
    let client = start_with_voters_1_to_3(&mut c, shards).await;

    // Node 4 joins every shard as a learner, through node 2 (each shard's call goes to
    // that shard's leader).
    let mut a2 = allot_node::local_cluster::admin(&c.node(2).addr)
        .await
        .unwrap();
    let r = a2
        .add_learner(MemberRequest {
            shard: 0,
            all_shards: true,
            member: Some(Member {
                node_id: 4,
                addr: c.node(4).addr.clone(),
            }),
        })
        .await
        .expect("add learner")
        .into_inner();
    assert_eq!(r.shards.len(), shards as usize);
    assert!(r.shards.iter().all(|s| s.learners.contains(&4)), "{r:?}");

    // With node 3 down, a change whose new voters need it — {1, 3}: node 2 removed by
    // mistake instead of 3 — is refused on every shard, and the shards still take
    // writes. (It was accepted: the joint configuration, needing node 3, never
    // committed, and every write of the shard waited on it.)
    c.kill(3);
    let until = Instant::now() + Duration::from_secs(60);
    for s in 0..shards {
        let refused = loop {
            let r = a2
                .change_membership(ChangeMembershipRequest {
                    shard: s,
                    all_shards: false,
                    voters: vec![1, 3],
                    allow_audit_loss: true,
                    expected_membership_index: None,
                })
                .await;
            match r {
                Err(e) if e.code() == tonic::Code::FailedPrecondition => break e,
                // An election after node 3's death, or the forward to a new leader.
                Err(e) if Instant::now() < until => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => panic!("shard {s}: the change was not refused: {other:?}"),
            }
        };
        assert!(
            refused.message().contains("no live majority"),
            "{refused:?}"
        );
        assert_eq!(
            refused
                .metadata()
                .get("allot-reason")
                .and_then(|v| v.to_str().ok()),
            Some("VOTERS_UNREACHABLE")
        );
    }
    for s in 0..shards {
        let mut cycle = HoldCycle::new(60 + s as u64, 3_000_000);
        let (outs, _) = client
            .execute(s, &[cycle.request()])
            .await
            .expect("a write after the refused change");
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    c.start(3).unwrap();
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders with node 3 back");

    // Promote 4 and remove 3 in one change (joint consensus inside openraft).
    let r = a2
        .change_membership(ChangeMembershipRequest {
            shard: 0,
            all_shards: true,
            voters: vec![1, 2, 4],
            allow_audit_loss: false,
            expected_membership_index: None,
        })
        .await
        .expect("change membership")
        .into_inner();
    assert!(
        r.shards
            .iter()
            .all(|s| s.voters == vec![1, 2, 4] && s.learners.is_empty()),
        "{r:?}"
    );
    c.members = vec![1, 2, 4];
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders after the change");

    // Node 3 keeps running, removed: no election is disturbed and writes go on.
    let mut terms = Vec::new();
    for s in 0..shards {
        let l = c.leader_of(s).await.unwrap();
        assert_ne!(l, 3, "the removed node leads nothing");
        terms.push(c.status(l).await.unwrap().shards[s as usize].term);
    }
    let mut cycles: Vec<HoldCycle> = (0..shards)
        .map(|s| HoldCycle::new(40 + s as u64, 3_000_000))
        .collect();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        for s in 0..shards {
            let r = cycles[s as usize].request();
            let (outs, _) = client.execute(s, &[r]).await.expect("write after removal");
            assert!(outs[0].is_ok(), "{outs:?}");
        }
    }
    for s in 0..shards {
        let l = c.leader_of(s).await.unwrap();
        assert_eq!(
            c.status(l).await.unwrap().shards[s as usize].term,
            terms[s as usize],
            "shard {s} re-elected"
        );
    }
    // The promoted node holds the same state as the others.
    assert_replicas_agree(&c, &client, shards).await;
}

// ---------------------------------------------------------------- upgrades (§48)

const OLD_RELEASE: [&str; 4] = ["--max-rules-version", "1", "--peer-link", "off"];
/// Snapshots every 200 entries in the upgrade test, so that each release's snapshots
/// are written, stored and read again on restart during it.
const SNAPSHOT_OFTEN: [&str; 2] = ["--snapshot-every", "200"];

/// The node arguments of "the previous release" (`old`) or of this one.
fn release_args(old: bool) -> Vec<String> {
    let mut args = SNAPSHOT_OFTEN.map(String::from).to_vec();
    if old {
        args.extend(OLD_RELEASE.map(String::from));
    }
    args
}

/// The format marker of node `id`'s data dir.
fn marker(c: &LocalCluster, id: u64) -> String {
    std::fs::read_to_string(c.dir.join(format!("node-{id}")).join("FORMAT")).expect("marker")
}

/// (shard, term) of every leader any running node reported, polled every 25 ms until
/// `stop`: the elections that happened (a campaign that won no leader is not one).
fn watch_leaders(
    addrs: Vec<String>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<std::collections::BTreeSet<(u32, u64, u64)>> {
    tokio::spawn(async move {
        let mut seen = std::collections::BTreeSet::new();
        while !stop.load(Ordering::Relaxed) {
            for a in &addrs {
                if let Ok(mut c) = allot_node::local_cluster::admin(a).await {
                    if let Ok(r) = c.status(allot_proto::StatusRequest {}).await {
                        for sh in r.into_inner().shards {
                            if sh.is_leader {
                                seen.insert((sh.shard, sh.term, sh.node_id));
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        seen
    })
}

/// An activation refused by the cluster version gate, naming what holds it back.
fn gate<T: std::fmt::Debug>(r: T, behind: &str) {
    let msg = format!("{r:?}");
    assert!(
        msg.contains("FailedPrecondition") && msg.contains(behind),
        "activation must be refused naming {behind}: {msg}"
    );
}

fn activate(version: u32, n: u64) -> Request {
    workload::admin(
        workload::rid(900, n),
        allot_statemachine::Command::ActivateVersion { version },
    )
}

/// A 60-day job: refused under rule version 1, accepted from version 2 on.
fn long_job(job: u64) -> Request {
    let mut spec = allot_statemachine::testkit::Harness::job_spec(
        job,
        allot_statemachine::Tier::PAID,
        vec![allot_statemachine::testkit::a100()],
        1,
    );
    spec.max_duration_ms = 60 * 86_400_000;
    Request {
        org: Some(ORG),
        ..workload::admin(
            workload::rid(901, job),
            allot_statemachine::Command::SubmitJob(spec),
        )
    }
}

/// The rolling upgrade of the issue: a 3-node cluster running "the previous release"
/// (`--max-rules-version 1`: it supports rule version 1 only) under load has each node
/// replaced in turn (SIGTERM, restart on the new release), one of them downgraded and
/// upgraded again before activation; the new version is refused while any node lacks
/// it, activated once all run it, and from then on a downgrade refuses to start.
/// Checked at every step: replicas' state hashes equal, at most one election per
/// restart; at the end every acknowledged write is present and conserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_under_load_switches_rules_only_when_every_node_supports_them() {
    let started = Instant::now();
    let shards = 2;
    let (_dir, mut c) = cluster("upgrade", 3, shards);
    for n in &mut c.nodes {
        n.extra_args = release_args(true);
    }
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;

    // The old rules: a 60-day job is refused; the new version cannot be activated.
    let refused = client.execute(0, &[long_job(1)]).await;
    assert!(
        format!("{refused:?}").contains("MaxDuration"),
        "{refused:?}"
    );
    gate(
        client.execute(0, &[activate(2, 1)]).await,
        "supports up to 1",
    );

    let acked: Acked = Arc::default();
    let mut stream = 0;
    let mut restarts = 0;
    // (node, new args): upgrade 1, downgrade 1, upgrade 1, upgrade 2, upgrade 3.
    let plan: Vec<(u64, bool)> = vec![(1, true), (1, false), (1, true), (2, true), (3, true)];
    for (id, new) in plan {
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for w in 0..4u64 {
            stream += 1;
            workers.push(spawn_worker(
                client.clone(),
                (w % shards as u64) as u32,
                stream,
                stop.clone(),
                acked.clone(),
            ));
        }
        let watch_stop = Arc::new(AtomicBool::new(false));
        let watcher = watch_leaders(c.endpoints(), watch_stop.clone());
        tokio::time::sleep(Duration::from_millis(700)).await;
        let before_terms: Vec<u64> = {
            let mut t = Vec::new();
            for s in 0..shards {
                let l = c.leader_of(s).await.expect("leader");
                let st = c.status(l).await.expect("status");
                t.push(st.shards[s as usize].term);
            }
            t
        };
        let status = c.terminate(id, Duration::from_secs(30));
        assert!(
            status.is_some_and(|s| s.success()),
            "node {id} stops cleanly on SIGTERM: {status:?}"
        );
        c.nodes[id as usize - 1].extra_args = release_args(!new);
        c.start(id).expect("restart");
        c.wait_listening(id, Duration::from_secs(60))
            .expect("listening");
        c.wait_leaders(Duration::from_secs(30))
            .await
            .expect("leaders");
        tokio::time::sleep(Duration::from_millis(700)).await;
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.await.expect("worker");
        }
        watch_stop.store(true, Ordering::Relaxed);
        let seen = watcher.await.expect("watcher");
        restarts += 1;
        for s in 0..shards {
            let elected: std::collections::BTreeSet<u64> = seen
                .iter()
                .filter(|(sh, term, _)| *sh == s && *term > before_terms[s as usize])
                .map(|(_, term, _)| *term)
                .collect();
            assert!(
                elected.len() <= 1,
                "restart {restarts} (node {id}) cost shard {s} {} elections: {seen:?}",
                elected.len()
            );
        }
        assert_replicas_agree(&c, &client, shards).await;
        eprintln!(
            "restart {restarts}: node {id} on the {} release; {} writes acknowledged so far; {:?}",
            if new { "new" } else { "old" },
            acked.lock().unwrap().len(),
            started.elapsed()
        );
        if id < 3 {
            // Not every node supports version 2 yet: the gate still refuses.
            gate(
                client.execute(0, &[activate(2, 1)]).await,
                "node 3 supports up to 1",
            );
        }
    }

    // Every node runs the new release: activation passes the gate, on every shard.
    for s in 0..shards {
        let (outs, _) = client
            .execute(s, &[activate(2, 10 + s as u64)])
            .await
            .expect("activation");
        assert_eq!(
            outs,
            vec![Ok(allot_statemachine::Reply::RulesActive { version: 2 })]
        );
    }
    let gpus = workload::admin(
        workload::rid(902, 1),
        allot_statemachine::Command::RegisterNode(allot_statemachine::NodeSpec {
            node: allot_statemachine::NodeId(1),
            gpu_type: allot_statemachine::testkit::a100(),
            gpu_count: 8,
            gpu_mem_gb: 80,
            labels: Vec::new(),
            incarnation: 0,
        }),
    );
    let (outs, _) = client
        .execute(0, &[gpus, long_job(2)])
        .await
        .expect("submit");
    assert!(outs[0].is_ok(), "{outs:?}");
    assert!(
        matches!(outs[1], Ok(allot_statemachine::Reply::JobSubmitted { .. })),
        "the new rule is on after activation: {outs:?}"
    );
    for n in &c.nodes {
        let st = c.status(n.id).await.expect("status");
        assert!(st.shards.iter().all(|s| s.rules_active == 2), "{st:?}");
    }

    // After activation, the old release refuses to start (clearly; nothing changed),
    // and the new one starts on the same data dir.
    assert!(c.terminate(3, Duration::from_secs(30)).is_some());
    c.nodes[2].extra_args = release_args(true);
    let log = refused_start(&mut c, 3);
    assert!(
        log.contains("cannot be undone"),
        "the refusal says why: {log}"
    );
    c.nodes[2].extra_args = release_args(false);
    c.start(3).expect("restart new");
    c.wait_listening(3, Duration::from_secs(60))
        .expect("listening");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");

    // Until rule version 3 every data dir holds only what the previous release reads
    // (format 6: its snapshots too), so rolling back stayed possible.
    for n in 1..=3 {
        assert_eq!(marker(&c, n), "allot-format 6\n", "node {n}");
    }
    // Version 3: snapshots are written in format 7 from its entry on (every 200
    // entries here), each node marks its dir before it stores one, restarts read them.
    for s in 0..shards {
        let (outs, _) = client
            .execute(s, &[activate(3, 20 + s as u64)])
            .await
            .expect("activation");
        assert_eq!(
            outs,
            vec![Ok(allot_statemachine::Reply::RulesActive { version: 3 })]
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            stream += 1;
            spawn_worker(
                client.clone(),
                (w % shards as u64) as u32,
                stream,
                stop.clone(),
                acked.clone(),
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (1..=3).any(|n| marker(&c, n) != "allot-format 7\n") {
        assert!(
            Instant::now() < deadline,
            "no format-7 snapshot within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c.terminate(2, Duration::from_secs(30)).is_some());
    c.start(2).expect("restart on a format-7 snapshot");
    c.wait_listening(2, Duration::from_secs(60))
        .expect("listening");
    if let Err(e) = c.wait_leaders(Duration::from_secs(30)).await {
        let logs: Vec<String> = (1..=3)
            .map(|n| format!("node {n}:\n{}", c.log_tail(n, 40)))
            .collect();
        panic!("leaders: {e}\n{}", logs.join("\n"));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("worker");
    }
    assert_replicas_agree(&c, &client, shards).await;
    // A node of the release before (here: one that supports version 2) refuses it.
    assert!(c.terminate(1, Duration::from_secs(30)).is_some());
    c.nodes[0].extra_args = release_args(false);
    c.nodes[0]
        .extra_args
        .extend(["--max-rules-version", "2"].map(String::from));
    let log = refused_start(&mut c, 1);
    assert!(log.contains("cannot be undone"), "{log}");
    c.nodes[0].extra_args = release_args(false);
    c.start(1).expect("restart new");
    c.wait_listening(1, Duration::from_secs(60))
        .expect("listening");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");

    let acked = std::mem::take(&mut *acked.lock().unwrap());
    assert!(acked.len() > 100, "load ran throughout: {}", acked.len());
    assert!(acked.iter().all(|a| a.2.is_ok()));
    assert_acked_survived(&client, &acked, shards).await;
    for s in 0..shards {
        match client.query(s, &Query::Totals).await.expect("totals") {
            Answer::Totals(t) => assert_eq!(t.issued, CREDITS as u128, "shard {s}"),
            other => panic!("{other:?}"),
        }
    }
    assert_replicas_agree(&c, &client, shards).await;
    eprintln!(
        "rolling upgrade: {restarts} restarts, {} writes acknowledged and replayed, {:?} in all",
        acked.len(),
        started.elapsed()
    );
}

/// Starts node `id`, which must refuse to run: it exits by itself, unsuccessfully,
/// within 60 s (its port may be bound before it refuses, so listening proves nothing).
/// Returns its log.
fn refused_start(c: &mut LocalCluster, id: u64) -> String {
    c.start(id).expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = c.exited(id) {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.is_some_and(|s| !s.success()),
        "node {id} must refuse to start: {status:?}"
    );
    std::fs::read_to_string(c.log_path(id)).expect("node log")
}

/// Every file of a data dir's store and its format marker, with its contents.
fn store_files(dir: &std::path::Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.join("db")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).expect("read")));
            }
        }
    }
    out.push((
        dir.join("FORMAT"),
        std::fs::read(dir.join("FORMAT")).unwrap_or_default(),
    ));
    out.sort();
    out
}

/// A data dir written by a newer format than this binary reads is refused before it is
/// opened: a clear message, a failed start, and not one byte of the store changed; the
/// same dir starts again once the marker is what this build wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_a_newer_format_is_refused_untouched() {
    let (_dir, mut c) = cluster("newer-format", 1, 1);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    assert!(c
        .terminate(1, Duration::from_secs(30))
        .is_some_and(|s| s.success()));
    let data = c.dir.join("node-1");
    let marker = std::fs::read_to_string(data.join("FORMAT")).expect("the node wrote its marker");
    // Before rule version 3 the dir holds what the previous release reads.
    assert_eq!(
        marker,
        format!("allot-format {}\n", allot_node::versions::START_FORMAT)
    );
    let newer = allot_statemachine::codec::FORMAT_VERSION + 1;
    std::fs::write(data.join("FORMAT"), format!("allot-format {newer}\n")).expect("marker");
    let before = store_files(&data);
    let msg = refused_start(&mut c, 1);
    assert!(
        msg.contains(&format!("holds format {newer}")) && msg.contains("newer release"),
        "{msg}"
    );
    assert!(
        store_files(&data) == before,
        "the refused start changed the data dir"
    );

    // Back to this build's marker: the same data starts and answers.
    std::fs::write(data.join("FORMAT"), marker).expect("marker");
    c.start(1).expect("restart");
    c.wait_listening(1, Duration::from_secs(60))
        .expect("listening");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leader");
    match client.query(0, &Query::Totals).await.expect("totals") {
        Answer::Totals(t) => assert_eq!(t.issued, CREDITS as u128),
        other => panic!("{other:?}"),
    }
}

/// A client whose first try for a shard is a follower — its first endpoint, or the
/// leader it cached before leadership moved — is forwarded once and told who leads: its
/// next calls go to the leader, not through the follower. Found reviewing the per-call
/// path (issue 24): a forwarded call's success made the client cache the follower as the
/// shard's leader for good, so every later write and linearizable read paid a second
/// gRPC hop (the follower's admission, its forward, and the leader's) until something
/// failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sent_to_a_follower_goes_to_the_leader_next_time() {
    let (_dir, mut c) = cluster("rehint", 3, 1);
    up(&mut c).await;
    setup_shards(&allot_node::local_cluster::client(c.endpoints()), 1).await;
    let leader = c.leader_of(0).await.expect("leader");
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    // Shard 0's first try is the first endpoint: the follower.
    let first = c.node(follower).addr.clone();
    let mut endpoints = vec![first.clone()];
    endpoints.extend(c.endpoints().into_iter().filter(|a| *a != first));
    let client = allot_node::local_cluster::client(endpoints);
    let served = |id: u64, method: &'static str| {
        let addr = c.node(id).metrics_addr.clone();
        async move { metric(&addr, &format!("allot_requests_total{{method=\"{method}\"")).await }
    };
    let before = (
        served(follower, "api.execute").await,
        served(follower, "api.query").await,
        served(leader, "api.execute").await,
    );
    const CALLS: u32 = 20;
    let mut cycle = HoldCycle::new(7, 3_000_000);
    for _ in 0..CALLS {
        let (outs, _) = client.execute(0, &[cycle.request()]).await.expect("write");
        assert!(outs.iter().all(Outcome::is_ok), "{outs:?}");
        client.query(0, &Query::Prices).await.expect("read");
    }
    let through_follower = (
        served(follower, "api.execute").await - before.0,
        served(follower, "api.query").await - before.1,
    );
    let at_leader = served(leader, "api.execute").await - before.2;
    eprintln!("the follower served {through_follower:?}, the leader {at_leader} writes");
    assert_eq!(c.leader_of(0).await.ok(), Some(leader), "leadership moved");
    // The first call reaches the follower (and is forwarded); none after it.
    assert!(
        through_follower.0 <= 1.0 && through_follower.1 == 0.0,
        "calls still routed through a follower: {through_follower:?} of {CALLS} writes and reads"
    );
    assert!(at_leader >= f64::from(CALLS), "{at_leader}");
}

// ---------------------------------------------------------------- leader transfer (§49)

/// A transfer whose call is dropped (the client's deadline, a cancel) still runs to its
/// end, which turns the leader's heartbeats and elections back on. Before, the handler's
/// future was the transfer, and dropping it mid-way left them off for good: made leader
/// again, the node sent no heartbeats, and the shard held an election every timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_whose_call_is_dropped_still_restores_the_leader() {
    let (_dir, mut c) = cluster("transfer-dropped", 3, 1);
    // Idle ticks far apart: followers hear from an idle leader by its heartbeats only.
    for n in &mut c.nodes {
        n.extra_args = vec!["--tick-ms".into(), "5000".into()];
    }
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    let a = c.leader_of(0).await.expect("leader");
    let mut admin = allot_node::local_cluster::admin(&c.node(a).addr)
        .await
        .unwrap();
    // Dropped while the leader waits for its followers' lease to run out (heartbeats
    // and elections off).
    let mut req = tonic::Request::new(allot_proto::TransferLeaderRequest { shard: 0, to: 0 });
    req.set_timeout(Duration::from_millis(100));
    let dropped =
        tokio::time::timeout(Duration::from_millis(100), admin.transfer_leader(req)).await;
    assert!(
        !matches!(dropped, Ok(Ok(_))),
        "the call ended early: {dropped:?}"
    );
    // The transfer's own end (its budget is a few election timeouts).
    tokio::time::sleep(Duration::from_secs(8)).await;
    if c.leader_of(0).await.ok() != Some(a) {
        client
            .transfer_leader(0, Some(a))
            .await
            .expect("leadership back to a");
    }
    let term = c.status(a).await.unwrap().shards[0].term;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(c.leader_of(0).await.ok(), Some(a), "a still leads");
    assert_eq!(
        c.status(a).await.unwrap().shards[0].term,
        term,
        "no election since: a sends heartbeats again"
    );
}

/// Found by the tenth session's review (DESIGN §59): during a rolling upgrade, a voter of
/// a release without the handoff answered the election hold `UNIMPLEMENTED`; the
/// transfer went on with heartbeats off, and that voter could hold an election of its
/// own. Now the transfer is refused before heartbeats stop, naming the voter — as a
/// bystander and as the target — and nothing changes: the same leader in the same term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_is_refused_while_a_voter_cannot_take_part() {
    let (_dir, mut c) = cluster("transfer-old", 3, 1);
    c.nodes[2].extra_args = vec!["--test-without-handoff".into()];
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    // Node 3 plays the older release; the test needs another leader.
    if c.leader_of(0).await.expect("leader") == 3 {
        client
            .transfer_leader(0, Some(1))
            .await
            .expect("node 3 hands over: it asks only the others");
    }
    let leader = c.leader_of(0).await.expect("leader");
    let term = c.status(leader).await.unwrap().shards[0].term;
    let other = [1u64, 2].into_iter().find(|n| *n != leader).unwrap();
    for to in [other, 3] {
        let refused = client
            .transfer_leader(0, Some(to))
            .await
            .expect_err("node 3 cannot take part");
        let text = format!("{refused:?}");
        assert!(
            text.contains("[3]") && text.contains("without leader transfer"),
            "to {to}: {text}"
        );
    }
    // Longer than an election timeout with heartbeats on: no election was held.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.leader_of(0).await.ok(), Some(leader));
    assert_eq!(c.status(leader).await.unwrap().shards[0].term, term);
    let mut cycle = HoldCycle::new(9, 3_000_000);
    let (outs, _) = client
        .execute(0, &[cycle.request()])
        .await
        .expect("writes resume");
    assert!(outs[0].is_ok(), "{outs:?}");
}

/// Leadership handed over under load: shard 0 goes to a chosen voter in exactly one new
/// term, then every shard node 1 leads is handed away and node 1 is restarted without
/// any election at all. No write fails (callers retry through the pause); every
/// acknowledged write survives and the replicas agree. A transfer to a non-voter, to the
/// leader itself, or asked of a follower is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_hands_over_under_load_without_an_unplanned_election() {
    let shards = 2;
    let (_dir, mut c) = cluster("transfer", 3, shards);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            spawn_worker(
                client.clone(),
                (w % shards as u64) as u32,
                w + 1,
                stop.clone(),
                acked.clone(),
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Refusals first: nothing changes.
    let leader = c.leader_of(0).await.expect("leader");
    let term = c.status(leader).await.unwrap().shards[0].term;
    let refused = client.transfer_leader(0, Some(leader)).await;
    assert!(
        format!("{refused:?}").contains("already leads"),
        "{refused:?}"
    );
    let refused = client.transfer_leader(0, Some(9)).await;
    assert!(
        format!("{refused:?}").contains("not a voter"),
        "{refused:?}"
    );
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let mut admin = allot_node::local_cluster::admin(&c.node(follower).addr)
        .await
        .unwrap();
    let refused = admin
        .transfer_leader(allot_proto::TransferLeaderRequest { shard: 0, to: 0 })
        .await;
    assert!(
        format!("{refused:?}").contains("is not the leader"),
        "{refused:?}"
    );
    assert_eq!(c.status(leader).await.unwrap().shards[0].term, term);
    // A target that is down: refused within a few election timeouts, the leader stays.
    let down = (1..=3).find(|id| *id != leader).unwrap();
    assert!(c.terminate(down, Duration::from_secs(30)).is_some());
    let asked = Instant::now();
    let refused = client.transfer_leader(0, Some(down)).await;
    assert!(
        format!("{refused:?}").contains("leader transfer"),
        "{refused:?}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(6),
        "{:?}",
        asked.elapsed()
    );
    eprintln!("to a stopped voter: refused in {:?}", asked.elapsed());
    assert_eq!(c.leader_of(0).await.ok(), Some(leader));
    c.start(down).expect("restart");
    c.wait_listening(down, Duration::from_secs(60))
        .expect("listening");
    let term = c.status(leader).await.unwrap().shards[0].term;

    // Shard 0 to a chosen voter: one new term, that voter leads it.
    let target = (1..=3).find(|id| *id != leader).unwrap();
    let r = client
        .transfer_leader(0, Some(target))
        .await
        .expect("transfer");
    assert_eq!((r.from, r.to, r.term), (leader, target, term + 1), "{r:?}");
    assert_eq!(c.leader_of(0).await.ok(), Some(target));
    eprintln!(
        "shard 0: node {leader} -> node {target} in {} ms",
        r.elapsed_ms
    );

    // Every shard that node leads (shard 0 at least) goes elsewhere; then it restarts
    // with no election at all.
    let restarted = target;
    let watch_stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_leaders(c.endpoints(), watch_stop.clone());
    let mut handed = 0;
    for s in 0..shards {
        if c.leader_of(s).await.ok() == Some(restarted) {
            let r = client.transfer_leader(s, None).await.expect("transfer");
            assert_ne!(r.to, restarted);
            handed += 1;
            eprintln!(
                "shard {s}: node {restarted} -> node {} in {} ms",
                r.to, r.elapsed_ms
            );
        }
    }
    assert!(handed >= 1);
    let mut terms = Vec::new();
    for s in 0..shards {
        let l = c.leader_of(s).await.expect("leader");
        assert_ne!(
            l, restarted,
            "node {restarted} leads nothing before its restart"
        );
        terms.push((l, c.status(l).await.unwrap().shards[s as usize].term));
    }
    let status = c.terminate(restarted, Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    c.start(restarted).expect("restart");
    c.wait_listening(restarted, Duration::from_secs(60))
        .expect("listening");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for (s, (l, term)) in terms.iter().enumerate() {
        assert_eq!(
            c.leader_of(s as u32).await.ok(),
            Some(*l),
            "shard {s} kept its leader"
        );
        assert_eq!(
            c.status(*l).await.unwrap().shards[s].term,
            *term,
            "shard {s}: the restart cost an election"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("no write failed");
    }
    watch_stop.store(true, Ordering::Relaxed);
    let seen = watcher.await.expect("watcher");
    for (s, (_, term)) in terms.iter().enumerate() {
        assert!(
            seen.iter().all(|(sh, t, _)| *sh != s as u32 || t <= term),
            "shard {s}: an election during the restart: {seen:?}"
        );
    }
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    assert!(acked.len() > 50, "load ran throughout: {}", acked.len());
    assert!(acked.iter().all(|a| a.2.is_ok()));
    assert_acked_survived(&client, &acked, shards).await;
    assert_replicas_agree(&c, &client, shards).await;
}

/// AppendEntries this node has answered for `shard`: all of them, and those that carried
/// no entry (a commit index or a heartbeat), from its `follower_append_entries` histogram.
async fn appends_answered(c: &LocalCluster, id: u64, shard: u32) -> (u64, u64) {
    let addr = &c.node(id).metrics_addr;
    let all = format!("allot_follower_append_entries_count{{shard=\"{shard}\"}}");
    let empty = format!("allot_follower_append_entries_bucket{{shard=\"{shard}\",le=\"0\"}}");
    (
        metric(addr, &all).await as u64,
        metric(addr, &empty).await as u64,
    )
}

/// `writers` clients, each one command at a time, on a one-shard cluster whose heartbeats
/// and ticks are a second apart: per entry the leader commits, how many AppendEntries did
/// each follower answer, and how long after the last write did every follower apply it?
async fn appends_per_entry(linger_us: u64, writers: u64) -> (f64, f64, Duration) {
    let (_dir, mut c) = cluster(&format!("linger-{linger_us}"), 3, 1);
    for n in &mut c.nodes {
        n.extra_args = [
            "--heartbeat-ms",
            "1000",
            "--election-min-ms",
            "3000",
            "--election-max-ms",
            "4000",
            "--tick-ms",
            "1000",
            "--commit-linger-us",
            &linger_us.to_string(),
        ]
        .map(String::from)
        .to_vec();
    }
    up(&mut c).await;
    let client = c.admin_client().unwrap();
    setup_shards(&client, 1).await;
    let leader = c.leader_of(0).await.unwrap();
    let followers: Vec<u64> = (1..=3).filter(|&id| id != leader).collect();
    let applied = |s: allot_proto::StatusReply| s.shards[0].applied_index;
    let before_index = applied(c.status(leader).await.unwrap());
    let mut before = (0, 0);
    for &f in &followers {
        let (all, empty) = appends_answered(&c, f, 0).await;
        before = (before.0 + all, before.1 + empty);
    }
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut cycle = HoldCycle::new(w, 3_000_000);
                for _ in 0..600 / writers {
                    let (outs, _) = client.execute(0, &[cycle.request()]).await.expect("write");
                    assert!(outs[0].is_ok(), "{outs:?}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("writer");
    }
    let written = Instant::now();
    let last = applied(c.status(leader).await.unwrap());
    // Every follower applies the last entry long before the next heartbeat or tick
    // (a second) could carry its commit.
    for &f in &followers {
        while applied(c.status(f).await.unwrap()) < last {
            assert!(
                written.elapsed() < Duration::from_secs(5),
                "node {f} never applied index {last}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let caught_up = written.elapsed();
    let mut after = (0, 0);
    for &f in &followers {
        let (all, empty) = appends_answered(&c, f, 0).await;
        after = (after.0 + all, after.1 + empty);
    }
    let per_entry = |n: u64| n as f64 / followers.len() as f64 / (last - before_index) as f64;
    let (all, empty) = (per_entry(after.0 - before.0), per_entry(after.1 - before.1));
    println!(
        "commit linger {linger_us} µs, {writers} writers: per entry and follower {all:.2} \
         AppendEntries, {empty:.2} of them empty ({} entries); followers applied the last \
         {caught_up:?} after it was answered",
        last - before_index
    );
    (all, empty, caught_up)
}

/// While the leader holds entries past its commit index, the commit index rides the next
/// AppendEntries instead of costing one of its own (docs/DESIGN.md §54); the commit of
/// the last entry still goes at once, so an idle follower applies it as soon as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_rides_the_next_append_and_still_reaches_idle_followers() {
    // A linger not below the heartbeat is refused at start-up, clearly.
    let (_dir, mut c) = cluster("linger-bad", 1, 1);
    c.nodes[0].extra_args = ["--heartbeat-ms", "100", "--commit-linger-us", "100000"]
        .map(String::from)
        .to_vec();
    let log = refused_start(&mut c, 1);
    assert!(log.contains("--commit-linger-us"), "{log}");
    for writers in [1, 16] {
        let (all_0, empty_0, _) = appends_per_entry(0, writers).await;
        let (all, empty, caught_up) = appends_per_entry(5_000, writers).await;
        println!(
            "{writers} writers: {all_0:.2} -> {all:.2} per entry, empty {empty_0:.2} -> {empty:.2}"
        );
        if writers == 1 {
            // Every commit covers the leader's whole log: it goes at once, as upstream
            // sends it, so a follower is no staler than before.
            assert!(
                empty >= 0.9,
                "the last entry's commit goes at once: {empty:.2}"
            );
        } else {
            // Entries past the commit index carry it: commit-only AppendEntries nearly
            // vanish (the periodic heartbeat is a second apart).
            assert!(
                empty <= 0.05 && empty < empty_0,
                "with entries in flight the commit rides them: {empty:.2} empty per entry \
                 (without the linger {empty_0:.2})"
            );
        }
        assert!(
            caught_up < Duration::from_millis(500),
            "idle followers learn the last commit at once: {caught_up:?}"
        );
    }
}

/// A node whose data directory's disk is below its low-water mark
/// (`--min-free-disk-mib`, set here above any disk's size) refuses the writes that grow
/// the ledger — a tenant's — with `RESOURCE_EXHAUSTED` / `DISK_LOW`, and keeps taking an
/// operator's and an agent's writes and serving reads, instead of filling the disk until
/// every replica's store fails at once. Restarted with the default mark, it takes the
/// tenant's write, and the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_low_on_disk_refuses_tenants_writes_and_keeps_the_rest() {
    use allot_statemachine::{Actor, Command, NodeId, NodeSpec, PrincipalId};
    let (_dir, mut c) = cluster("disk-low", 3, 1);
    for n in &mut c.nodes {
        n.extra_args = vec!["--min-free-disk-mib".into(), "1000000000000".into()];
    }
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    let req = |id: u128, actor: Actor, command: Command| Request {
        actor,
        request_id: id,
        org: Some(ORG),
        command,
    };
    let tenant = Actor::Tenant {
        org: ORG,
        principal: PrincipalId(7),
    };
    // The operator's writes pass.
    let (outs, _) = client
        .execute(
            0,
            &[
                Request {
                    org: None,
                    ..req(
                        1,
                        Actor::Admin(PrincipalId(1)),
                        Command::CreateOrg { org: ORG },
                    )
                },
                Request {
                    org: None,
                    ..req(
                        2,
                        Actor::Admin(PrincipalId(1)),
                        Command::RegisterNode(NodeSpec {
                            node: NodeId(1),
                            gpu_type: allot_statemachine::testkit::a100(),
                            gpu_count: 8,
                            gpu_mem_gb: 80,
                            labels: vec![],
                            incarnation: 0,
                        }),
                    )
                },
            ],
        )
        .await
        .expect("an operator's writes are taken");
    assert!(outs.iter().all(Result::is_ok), "{outs:?}");
    // An agent's too.
    let (outs, _) = client
        .execute(
            0,
            &[Request {
                org: None,
                ..req(
                    3,
                    Actor::Agent(NodeId(1)),
                    Command::NodeHeartbeat { node: NodeId(1) },
                )
            }],
        )
        .await
        .expect("an agent's heartbeat is taken");
    assert!(outs[0].is_ok(), "{outs:?}");
    // A tenant's write is refused, typed, by every node it reaches, and never applied.
    let impatient = Client::builder()
        .endpoints(c.endpoints())
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let project = req(
        4,
        tenant,
        Command::CreateProject {
            org: ORG,
            project: PROJECT,
        },
    );
    match impatient.execute(0, std::slice::from_ref(&project)).await {
        Err(allot_client::Error::Unavailable { cause, last, .. }) => {
            assert_eq!(cause.as_deref(), Some("DISK_LOW"), "{last}");
            assert!(last.contains("ResourceExhausted"), "{last}");
        }
        other => panic!("a tenant's write while the disk is low: {other:?}"),
    }
    // Reads still run, and say the project was not created.
    let project_balance = || {
        client.query(
            0,
            &Query::Balance {
                org: ORG,
                account: Account::Project(PROJECT),
                horizon_ms: 0,
            },
        )
    };
    let read = project_balance().await;
    assert!(matches!(read, Ok(Answer::Balance(None))), "{read:?}");
    let status = c.status(1).await.unwrap();
    assert!(status.disk_low, "the node reports it");
    assert!(status.disk_free_bytes > 0 && status.min_free_disk_bytes > status.disk_free_bytes);
    assert!(
        std::fs::read_to_string(c.log_path(1))
            .unwrap()
            .contains("disk is nearly full"),
        "the node logs it"
    );
    // Without the mark (0: this shared disk may itself be below the default's 512
    // MiB): the tenant's write is taken (the same request id: it was never applied, so
    // it is applied now, once).
    for id in 1..=3 {
        c.terminate(id, Duration::from_secs(30));
    }
    for n in &mut c.nodes {
        n.extra_args = vec!["--min-free-disk-mib".into(), "0".into()];
    }
    c.start_all().unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let (outs, _) = client.execute(0, &[project]).await.unwrap();
    assert!(outs[0].is_ok(), "{outs:?}");
    let read = project_balance().await;
    assert!(matches!(read, Ok(Answer::Balance(Some(_)))), "{read:?}");
    assert!(!c.status(1).await.unwrap().disk_low);
    assert_replicas_agree(&c, &client, 1).await;
}

/// Raft calls node `id` sent over `transport` (`link` or `grpc`).
async fn peer_rpcs(c: &LocalCluster, id: u64, transport: &str) -> u64 {
    let series = format!("allot_peer_rpcs_total{{transport=\"{transport}\"}}");
    metric(&c.node(id).metrics_addr, &series).await as u64
}

/// Raft traffic between nodes of this release goes over the peer link (`crate::link`);
/// a node without the link (`--peer-link off`, as a release before it is) is reached
/// over gRPC by the others, and it reaches them over gRPC. The replicas agree, and every
/// acknowledged write is on all of them. With that node down, the two others replicate
/// every write by link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_speak_the_link_and_fall_back_to_grpc_for_a_node_without_it() {
    let shards = 3;
    let (_dir, mut c) = cluster("link", 3, shards);
    c.nodes[2].extra_args = ["--peer-link", "off"].map(String::from).to_vec();
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, shards).await;
    let acked: Acked = Arc::default();
    let write_for = |secs: u64, first_stream: u64| {
        let (client, acked) = (client.clone(), acked.clone());
        async move {
            let stop = Arc::new(AtomicBool::new(false));
            let workers: Vec<_> = (0..shards)
                .map(|s| {
                    let stream = first_stream + s as u64;
                    spawn_worker(client.clone(), s, stream, stop.clone(), acked.clone())
                })
                .collect();
            tokio::time::sleep(Duration::from_secs(secs)).await;
            stop.store(true, Ordering::Relaxed);
            for w in workers {
                w.await.expect("worker");
            }
        }
    };
    write_for(2, 700).await;
    assert!(acked.lock().unwrap().len() >= 30, "the workers wrote");
    assert_replicas_agree(&c, &client, shards).await;
    let written = acked.lock().unwrap().clone();
    assert_acked_survived(&client, &written, shards).await;

    let mut leaders = std::collections::BTreeSet::new();
    for s in 0..shards {
        leaders.insert(c.leader_of(s).await.expect("leader"));
    }
    let (link3, grpc3) = (
        peer_rpcs(&c, 3, "link").await,
        peer_rpcs(&c, 3, "grpc").await,
    );
    println!("leaders {leaders:?}; node 3 (no link): link {link3}, grpc {grpc3}");
    assert_eq!(link3, 0, "a node with the link off never dials it");
    // A leader sends AppendEntries to both followers.
    for id in [1u64, 2] {
        let (link, grpc) = (
            peer_rpcs(&c, id, "link").await,
            peer_rpcs(&c, id, "grpc").await,
        );
        println!("node {id}: link {link}, grpc {grpc}");
        if leaders.contains(&id) {
            assert!(
                link > 0,
                "node {id} leads: it reaches node {} by link",
                3 - id
            );
            assert!(grpc > 0, "node {id} leads: it reaches node 3 by gRPC");
        }
    }
    if leaders.contains(&3) {
        assert!(grpc3 > 0, "node 3 leads: it sends by gRPC");
    }

    // Node 3 down: a commit needs the other follower's acknowledgement, by link.
    c.kill(3);
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let link_before = peer_rpcs(&c, 1, "link").await + peer_rpcs(&c, 2, "link").await;
    let acked_before = acked.lock().unwrap().len();
    write_for(2, 800).await;
    let written = (acked.lock().unwrap().len() - acked_before) as u64;
    let link_sent = peer_rpcs(&c, 1, "link").await + peer_rpcs(&c, 2, "link").await - link_before;
    println!("node 3 down: {written} writes, {link_sent} link calls");
    assert!(written >= 30, "the two nodes commit: {written}");
    assert!(
        link_sent >= written,
        "each write's entry went to the other node by link: {link_sent} calls, {written} writes"
    );
}

/// A commit does not wait for the leader's own fsync (docs/DESIGN.md §62): with the
/// leader's WAL fsync stalled, a write is acknowledged on the followers' fsyncs while the
/// leader has made none, and once its disk resumes the replicas agree. With
/// `--leader-flush-overlap off` (openraft's own order, the previous release's) the same
/// write waits for the leader's disk. Election timeouts are 8–10 s here and each wait
/// below is shorter, so no new leader can take the write over from the stalled one (which,
/// before the overlap, also stopped sending heartbeats while it waited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_does_not_wait_for_the_leaders_own_fsync() {
    for overlap in ["on", "off"] {
        let (dir, mut c) = cluster(&format!("overlap-{overlap}"), 3, 1);
        let hold = |id: u64| dir.path().join(format!("fsync-hold-{id}"));
        for n in &mut c.nodes {
            n.extra_args = vec![
                "--leader-flush-overlap".into(),
                overlap.into(),
                "--election-min-ms".into(),
                "8000".into(),
                "--election-max-ms".into(),
                "10000".into(),
                "--test-fsync-hold-file".into(),
                hold(n.id).display().to_string(),
            ];
        }
        up(&mut c).await;
        let client = allot_node::local_cluster::client(c.endpoints());
        setup_shards(&client, 1).await;
        let leader = c.leader_of(0).await.expect("leader");
        let syncs = "allot_wal_sync_seconds_count";
        std::fs::write(hold(leader), b"").expect("hold the leader's fsync");
        // An fsync that had started before the hold (the setup's last entry may be
        // answered before the leader's own flush of it) finishes first: wait until the
        // count stands still.
        let mut before = metric(&c.node(leader).metrics_addr, syncs).await;
        let mut still = 0;
        while still < 4 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = metric(&c.node(leader).metrics_addr, syncs).await;
            still = if now == before { still + 1 } else { 0 };
            before = now;
        }
        let mut cycle = HoldCycle::new(900, 3_000_000);
        let write = cycle.request();
        let call = client.execute(0, std::slice::from_ref(&write));
        let answer = if overlap == "on" {
            let (outs, _) = tokio::time::timeout(Duration::from_secs(5), call)
                .await
                .expect("acknowledged with the leader's fsync stalled")
                .expect("write");
            let after = metric(&c.node(leader).metrics_addr, syncs).await;
            assert_eq!(
                after, before,
                "the leader made no fsync: the write committed on the followers' disks"
            );
            // The stalled disk shows (DESIGN §63): the held append's wait grows while its
            // fsync does not return...
            let waiting = "allot_wal_sync_waiting_seconds";
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let w = metric(&c.node(leader).metrics_addr, waiting).await;
                if w >= 1.2 {
                    break;
                }
                assert!(Instant::now() < deadline, "the held append's wait: {w} s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            std::fs::remove_file(hold(leader)).expect("resume");
            // ...and is back to zero once it returned, the slow fsync logged.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let w = metric(&c.node(leader).metrics_addr, waiting).await;
                if w == 0.0 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "still waiting {w} s after the resume"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let log = c.log_tail(leader, 20_000);
            assert!(log.contains("slow WAL fsync"), "{log}");
            outs
        } else {
            let mut call = Box::pin(call);
            assert!(
                tokio::time::timeout(Duration::from_secs(1), &mut call)
                    .await
                    .is_err(),
                "without the overlap a commit waits for the leader's own fsync"
            );
            std::fs::remove_file(hold(leader)).expect("resume");
            let (outs, _) = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("acknowledged once the leader's disk resumed")
                .expect("write");
            outs
        };
        assert!(answer.iter().all(|o| o.is_ok()), "{answer:?}");
        assert_eq!(
            c.leader_of(0).await.expect("leader"),
            leader,
            "no election took the write over"
        );
        assert_replicas_agree(&c, &client, 1).await;
        let written = [(0, write, answer[0].clone())];
        assert_acked_survived(&client, &written, 1).await;
        // The leader's own copy is durable once its disk resumed: it still leads or
        // holds the entry as a follower, and all three agree (above).
        assert!(metric(&c.node(leader).metrics_addr, syncs).await > before);
    }
}

/// With one replica the leader's own flush is the quorum (docs/DESIGN.md §62): a leader
/// that replicates without waiting for its flush still commits only once it has flushed.
/// The node is restarted first: its stored vote made it the leader, and it now campaigns
/// in a new term at start-up (openraft patch 2; upstream resumed the old term, which with
/// the overlap could reuse log ids a lost tail had given out — that case needs a lost
/// write, which a process kill does not make; openraft's `startup_test` covers it). While
/// its fsync is stalled, a write is not answered; once the disk resumes it is, in the new
/// term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_commits_only_after_its_own_fsync_after_a_restart() {
    let (dir, mut c) = cluster("restart-one", 1, 1);
    let hold = dir.path().join("fsync-hold");
    c.nodes[0].extra_args = vec!["--test-fsync-hold-file".into(), hold.display().to_string()];
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    let addr = c.node(1).metrics_addr.clone();
    let field = |f: &'static str| {
        let addr = addr.clone();
        async move { metric(&addr, &format!("allot_raft{{field=\"{f}\",shard=\"0\"}}")).await }
    };
    let term = field("term").await;
    c.kill(1);
    c.start(1).expect("restart");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leader again");
    assert!(
        field("term").await > term,
        "a restarted leader campaigns in a new term"
    );
    std::fs::write(&hold, b"").expect("stall the fsync");
    let mut cycle = HoldCycle::new(901, 3_000_000);
    let write = cycle.request();
    let mut call = Box::pin(client.execute(0, std::slice::from_ref(&write)));
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut call)
            .await
            .is_err(),
        "one replica answered a write before its own fsync"
    );
    std::fs::remove_file(&hold).expect("resume");
    let (outs, _) = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("answered once the disk resumed")
        .expect("write");
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
}

/// A shard's time starts at the cluster's time however long its nodes waited for
/// `init`. Found reviewing the twenty-second session's diff: the clock's first draft
/// recorded an empty shard's time (0) against the node's own clock as a lag of the whole
/// wall clock, and a shard initialised more than a second after its nodes started began
/// its time in 1970 (and kept it: every later leader kept the lag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_initialised_late_starts_at_the_real_time() {
    let (_dir, mut c) = cluster("late-init", 3, 1);
    c.start_all().expect("start nodes");
    for id in 1..=3 {
        c.wait_listening(id, Duration::from_secs(30))
            .expect("listening");
    }
    // The nodes sample clocks and observe their (empty) shard for a while first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.init().await.expect("init");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let until = Instant::now() + Duration::from_secs(20);
    let t = loop {
        // The first stamped entry (a tick) gives the shard its time.
        let t = shard_time(&c, 0).await;
        if t > 0 || Instant::now() > until {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let now = real_now_ms();
    assert!(
        t + 10_000 >= now && t <= now + 1_000,
        "the shard's time is {t}, the wall clock {now}"
    );
}

/// After a whole-cluster outage the shard's time resumes at the real instant. Found by a
/// read-only review of this session's clock change: a restarted node observed the time
/// its log replay reached, with its clock target, as a "lag" of the whole outage, and a
/// new leader kept that lag, so the shard ran the outage's length behind real time (and
/// caught up at 500 ppm: some 80 days for an hour's outage). A lag is now only recorded
/// from time this process saw a live leader stamp, at the real rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_whole_cluster_outage_the_shards_time_resumes_at_the_real_instant() {
    let (_dir, mut c) = cluster("outage-time", 3, 1);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    let before = shard_time(&c, 0).await;
    for id in 1..=3 {
        c.kill(id);
    }
    // The outage: long against the 1 s a new leader may catch up at once.
    tokio::time::sleep(Duration::from_secs(12)).await;
    c.start_all().expect("restart");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders after the outage");
    let until = Instant::now() + Duration::from_secs(20);
    let t = loop {
        let t = shard_time(&c, 0).await;
        if t > before + 10_000 || Instant::now() > until {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let now = real_now_ms();
    assert!(
        t + 3_000 >= now && t <= now + 1_000,
        "the shard's time is {} ms behind the wall clock after the outage",
        now.saturating_sub(t)
    );
}

/// Removes everything in node `id`'s data dir but its log: a lost disk.
fn wipe_data_dir(c: &LocalCluster, dir: &std::path::Path, id: u64) {
    let node_dir = dir.join(format!("node-{id}"));
    for e in std::fs::read_dir(&node_dir).expect("data dir") {
        let p = e.expect("entry").path();
        if p == c.log_path(id) {
            continue;
        }
        if p.is_dir() {
            std::fs::remove_dir_all(&p).expect("wipe");
        } else {
            std::fs::remove_file(&p).expect("wipe");
        }
    }
}

/// DESIGN §67: a voter that lost its disk and came back empty under its node id must
/// not elect a candidate lacking entries it had acknowledged. Entries are committed by
/// nodes 1 and 3 while node 2 is down; node 3 loses its disk; node 1 (which holds them)
/// is down when 2 and 3 come back. Node 3 is rejoining: it grants 2 no vote, so no
/// leader without those entries; once node 1 is back they are all there, and node 3,
/// caught up, is whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_voter_that_lost_its_disk_elects_no_leader_missing_what_it_acknowledged() {
    let (dir, mut c) = cluster("lost-disk", 3, 1);
    up(&mut c).await;
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    c.kill(2);
    let mut cycle = HoldCycle::new(7, 3_000_000);
    for _ in 0..30 {
        let r = cycle.request();
        let (outs, _) = client
            .execute(0, std::slice::from_ref(&r))
            .await
            .expect("write with node 2 down");
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    // What nodes 1 and 3 committed without node 2.
    let leader = c.leader_of(0).await.expect("leader");
    let head = c.status(leader).await.expect("status").shards[0].audit_head_seq;
    assert!(head > 0);
    c.kill(3);
    wipe_data_dir(&c, dir.path(), 3);
    c.kill(1);
    c.start(2).expect("start 2");
    c.start(3).expect("start 3 (empty)");
    c.wait_listening(2, Duration::from_secs(60)).expect("2 up");
    c.wait_listening(3, Duration::from_secs(60)).expect("3 up");
    let s3 = c.status(3).await.expect("status of 3").shards[0].clone();
    assert!(s3.rejoining, "node 3 opened empty: {s3:?}");
    // Five election timeouts and more (at most 1.2 s each): 2 stands again and again,
    // and 3 refuses it every time.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        for id in [2, 3] {
            let s = c.status(id).await.expect("status").shards[0].clone();
            assert!(
                !s.is_leader,
                "node {id} was elected without node 1's entries: {s:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.start(1).expect("start 1");
    c.wait_listening(1, Duration::from_secs(60)).expect("1 up");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("a leader once node 1 is back");
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let mut whole = true;
        for id in 1..=3 {
            let s = c.status(id).await.expect("status").shards[0].clone();
            whole &= s.audit_head_seq >= head && !s.rejoining;
        }
        if whole {
            break;
        }
        assert!(
            Instant::now() < until,
            "node 3 did not catch up: {:?}",
            c.status(3).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// DESIGN §67: rejoining lasts across a restart. A replica that opened empty and then
/// stored something without becoming whole — here a vote granted in a new shard's first
/// election — is still rejoining after a restart. Old code: it opened "not empty" and
/// voted for anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_opened_empty_is_still_rejoining_after_a_restart() {
    use allot_statemachine::codec;
    let (_dir, mut c) = cluster("rejoin-restart", 3, 1);
    c.start(3).expect("start 3");
    c.wait_listening(3, Duration::from_secs(60)).expect("3 up");
    assert!(c.status(3).await.unwrap().shards[0].rejoining);
    // A genesis candidate's vote request, as a peer sends it.
    let vote = openraft::raft::VoteRequest::<u64> {
        vote: allot_node::types::Vote::new(5, 1),
        last_log_id: Some(allot_node::types::LogId::new(
            openraft::CommittedLeaderId::new(0, 0),
            0,
        )),
    };
    let mut req = tonic::Request::new(allot_proto::RaftMessage {
        shard: 0,
        payload: codec::encode(&vote),
    });
    req.metadata_mut().insert(
        allot_node::peer::PEER_SECRET,
        c.peer_secret.clone().unwrap().parse().unwrap(),
    );
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.node(3).addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let reply = allot_proto::raft_client::RaftClient::new(ch)
        .vote(req)
        .await
        .expect("a genesis vote request is answered")
        .into_inner();
    let answer: Result<openraft::raft::VoteResponse<u64>, openraft::error::RaftError<u64>> =
        codec::decode(&reply.payload).expect("a vote response");
    assert!(
        answer.expect("granted or not").vote_granted,
        "a genesis vote"
    );
    c.kill(3);
    c.start(3).expect("restart 3");
    c.wait_listening(3, Duration::from_secs(60))
        .expect("3 up again");
    let s = c.status(3).await.unwrap().shards[0].clone();
    assert_eq!(s.term, 5, "the vote was stored: {s:?}");
    assert!(s.rejoining, "rejoining survives the restart: {s:?}");
    // The operator's way out of a shard wedged by rejoining replicas: refused while the
    // node runs (its store is locked), applied once it is stopped.
    let force = |c: &LocalCluster| {
        std::process::Command::new(env!("CARGO_BIN_EXE_allot-node"))
            .args(["force-whole", "--data-dir"])
            .arg(c.log_path(3).parent().unwrap())
            .output()
            .unwrap()
    };
    let o = force(&c);
    assert!(!o.status.success(), "refused while the node runs");
    c.kill(3);
    let o = force(&c);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("shard 0: rejoining marker removed"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    c.start(3).expect("restart 3");
    c.wait_listening(3, Duration::from_secs(60)).expect("3 up");
    let s = c.status(3).await.unwrap().shards[0].clone();
    assert!(!s.rejoining, "forced whole: {s:?}");
}

/// DESIGN §67, found by review: the node that initialised a shard stands for election
/// after a restart too. Init reaches node 1 while 2 and 3 are still down; node 1
/// restarts before they come up. Old code (rejoining kept, "initialised here" not): no
/// replica of the shard could stand, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_initialised_before_its_peers_started_elects_after_its_first_node_restarts() {
    let (_dir, mut c) = cluster("init-early", 3, 1);
    c.start(1).expect("start 1");
    c.wait_listening(1, Duration::from_secs(60)).expect("1 up");
    let members: Vec<(u64, String)> = (1..=3).map(|id| (id, c.node(id).addr.clone())).collect();
    let mut a = allot_node::local_cluster::admin(&c.node(1).addr)
        .await
        .expect("admin");
    a.init(allot_proto::InitRequest {
        members: members
            .iter()
            .map(|(id, addr)| allot_proto::Member {
                node_id: *id,
                addr: addr.clone(),
            })
            .collect(),
        shards: vec![],
        cluster_id: String::new(),
    })
    .await
    .expect("init through node 1 alone");
    c.kill(1);
    c.start_all().expect("start every node");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("a leader once the peers are up");
    let client = allot_node::local_cluster::client(c.endpoints());
    setup_shards(&client, 1).await;
    // Every replica heard a commit of the leader's term by now, or soon: all whole.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let mut rejoining = Vec::new();
        for id in 1..=3 {
            if c.status(id).await.expect("status").shards[0].rejoining {
                rejoining.push(id);
            }
        }
        if rejoining.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "nodes {rejoining:?} stay rejoining with the shard under way"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A voter set computed from an older view of the membership (a lagging replica's, or
/// one another operator changed meanwhile) is refused, not applied: the change carries
/// the log index of the membership it was computed from. Operator A reads voters
/// {1, 2, 3} and learner 4; operator B promotes 4; A removes 3 from what A read. Old
/// code applied A's {1, 2}: node 4's promotion undone (and node 4 dropped) without a
/// word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_membership_change_computed_from_an_older_view_is_refused() {
    use allot_proto::ChangeMembershipRequest;
    let (_dir, mut c) = cluster("membership-cas", 4, 1);
    c.start_all().expect("start nodes");
    c.init_members(&[1, 2, 3]).await.expect("init 1-3");
    c.wait_leaders(Duration::from_secs(30))
        .await
        .expect("leaders");
    let leader = c.leader_of(0).await.expect("leader");
    let mut a = allot_node::local_cluster::admin(&c.node(leader).addr)
        .await
        .unwrap();
    add_learner_everywhere(&mut a, &c, 4).await;
    // Operator A's view.
    let read = c.status(leader).await.unwrap().shards[0].clone();
    assert_eq!(
        (read.voters.clone(), read.learners.clone()),
        (vec![1, 2, 3], vec![4])
    );
    let change = |voters: Vec<u64>, expected: u64| ChangeMembershipRequest {
        shard: 0,
        all_shards: false,
        voters,
        allow_audit_loss: true,
        expected_membership_index: Some(expected),
    };
    // Operator B, from the same view: applied.
    let r = a
        .change_membership(change(vec![1, 2, 3, 4], read.membership_index))
        .await
        .expect("promoting 4 from the current view");
    assert_eq!(r.into_inner().shards[0].voters, vec![1, 2, 3, 4]);
    // Operator A removes 3 from the older view: {1, 2} would drop 4. Refused.
    let e = a
        .change_membership(change(vec![1, 2], read.membership_index))
        .await
        .expect_err("a change from an older view");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert_eq!(reason(&e), Some("MEMBERSHIP_CHANGED"), "{e:?}");
    let now = c.status(leader).await.unwrap().shards[0].clone();
    assert_eq!(now.voters, vec![1, 2, 3, 4], "nothing changed");
    assert!(now.membership_index > read.membership_index);
    // One shard's index names one shard's membership.
    let e = a
        .change_membership(ChangeMembershipRequest {
            all_shards: true,
            ..change(vec![1, 2, 4], now.membership_index)
        })
        .await
        .expect_err("an expected index for every shard");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}
