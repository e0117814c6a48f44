//! The client library against a real 3-node cluster on loopback: a submit retried after
//! a client-side timeout charges once; a follower endpoint works as well as the leader;
//! typed refusals; unreachable endpoints fail within a bounded number of attempts.

use allot_client::{AuditFilter, Client, Error};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::scheduler::JobState;
use allot_statemachine::testkit::{a100, world_commands, Harness, ORG, PROJECT};
use allot_statemachine::{
    Account, BucketId, BucketKind, Command, CommandError, EventBody, Grant, HoldId, JobId, NodeId,
    NodeSpec, Reply, Tier,
};
use std::time::{Duration, Instant};

const CREDITS: u64 = 1_000_000;

async fn cluster(shards: u32) -> (tempfile::TempDir, LocalCluster) {
    let dir = tempfile::Builder::new()
        .prefix("allot-client-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.path().into(), 3, shards).unwrap();
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    (dir, c)
}

fn client(endpoints: Vec<String>) -> Client {
    Client::builder()
        .endpoints(endpoints)
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// The fixture world on the org's home shard, 1,000 credits of paid credit on the
/// project, and one 8-GPU A100 node in that shard's pool. Returns the shard.
async fn world(c: &Client) -> u32 {
    let shard = c.shard_of_org(ORG).await.unwrap();
    for cmd in world_commands() {
        c.run(shard, cmd).await.unwrap();
    }
    c.issue_grant(
        ORG,
        Grant {
            bucket: BucketId(1),
            owner: Account::Project(PROJECT),
            kind: BucketKind::Paid,
            amount_micro: 1_000 * CREDITS,
            expires_at_ms: None,
            priority: 100,
            policy: None,
            source_ref: Some("purchase-1".into()),
        },
    )
    .await
    .unwrap();
    c.register_node(
        shard,
        NodeSpec {
            node: NodeId(1),
            gpu_type: a100(),
            gpu_count: 8,
            gpu_mem_gb: 80,
            labels: vec![],
            incarnation: 0,
        },
    )
    .await
    .unwrap();
    shard
}

/// A TCP proxy on loopback to `upstream` that forwards what the client sends and drops
/// everything the server answers.
async fn mute_proxy(upstream: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut down_r, _down_w) = down.split();
                let (mut up_r, mut up_w) = up.split();
                let to_server = tokio::io::copy(&mut down_r, &mut up_w);
                let mut sink = tokio::io::sink();
                let swallow = tokio::io::copy(&mut up_r, &mut sink);
                let _ = tokio::join!(to_server, swallow);
            });
        }
    });
    addr
}

async fn held(c: &Client) -> u64 {
    c.balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap()
        .held_micro
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_retried_after_a_client_timeout_charges_once() {
    let (_dir, cluster) = cluster(2).await;
    let c = client(cluster.endpoints());
    let shard = world(&c).await;
    assert_eq!(held(&c).await, 0);

    // The client reaches the leader through a proxy that passes requests but swallows
    // every answer: the shard applies the submit, the client times out.
    let leader = cluster.leader_of(shard).await.unwrap();
    let proxy = mute_proxy(cluster.node(leader).addr.clone()).await;
    let impatient = Client::builder()
        .endpoints([proxy.clone()])
        .shards(c.shards().await.unwrap())
        .attempt_timeout(Duration::from_millis(500))
        .retries(0)
        .build()
        .unwrap();
    let mut spec = Harness::job_spec(77, Tier::PAID, vec![a100()], 2);
    spec.max_duration_ms = 3_600_000;
    let request_id = c.next_request_id();
    let first = impatient
        .run_in(
            shard,
            Some(ORG),
            request_id,
            Command::SubmitJob(spec.clone()),
        )
        .await;
    assert!(
        matches!(first, Err(Error::Unavailable { attempts: 1, .. })),
        "{first:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.job(ORG, JobId(77)).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the submit never reached the shard"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(held(&c).await, 4 * CREDITS, "applied although unanswered");

    // The retry (same request id, patient client) is answered with the first outcome.
    let retried = c
        .run_in(
            shard,
            Some(ORG),
            request_id,
            Command::SubmitJob(spec.clone()),
        )
        .await
        .unwrap();
    let Reply::JobSubmitted { hold_micro, .. } = retried else {
        panic!("{retried:?}")
    };
    // 1 h × 2 GPUs × 2 credits/GPU-h.
    assert_eq!(hold_micro, 4 * CREDITS);
    // A fresh request id for the same job is idempotent by job id: still one hold.
    c.submit_job(ORG, spec).await.unwrap();
    assert_eq!(held(&c).await, hold_micro, "charged (held) exactly once");
    let holds_drawn = c
        .audit(
            shard,
            AuditFilter {
                hold: Some(HoldId(77)),
                ..AuditFilter::default()
            },
            0,
            1_000,
        )
        .await
        .unwrap()
        .events
        .iter()
        .filter(|e| matches!(e.body, EventBody::HoldDrawn { .. }))
        .count();
    assert_eq!(holds_drawn, 1, "one draw in the audit trail");

    // The library retries by itself: its first attempt goes to the mute proxy (the
    // first endpoint it tries for this shard) and times out; the retry goes to the next
    // endpoint with the same request id (generated once by `submit_job`) and is answered
    // with the first outcome.
    let leader_addr = cluster.node(leader).addr.clone();
    let eps = if shard % 2 == 0 {
        [proxy.clone(), leader_addr]
    } else {
        [leader_addr, proxy.clone()]
    };
    let retrying = Client::builder()
        .endpoints(eps)
        .shards(c.shards().await.unwrap())
        .attempt_timeout(Duration::from_millis(500))
        .retries(4)
        .build()
        .unwrap();
    let mut spec78 = Harness::job_spec(78, Tier::PAID, vec![a100()], 2);
    spec78.max_duration_ms = 3_600_000;
    let reply = retrying.submit_job(ORG, spec78).await.unwrap();
    assert!(
        matches!(reply, Reply::JobSubmitted { hold_micro, .. } if hold_micro == 4 * CREDITS),
        "{reply:?}"
    );
    assert_eq!(held(&c).await, 8 * CREDITS, "job 78 held once");
    let events = c
        .audit(
            shard,
            AuditFilter {
                hold: Some(HoldId(78)),
                ..AuditFilter::default()
            },
            0,
            1_000,
        )
        .await
        .unwrap()
        .events;
    let submits = |replayed: bool| {
        events
            .iter()
            .filter(|e| matches!(e.body, EventBody::Command { replayed: r, .. } if r == replayed))
            .count()
    };
    assert_eq!(submits(false), 1, "applied once: {events:?}");
    assert!(
        submits(true) >= 1,
        "the library's retry reached the shard and was answered from the idempotency table"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e.body, EventBody::HoldDrawn { .. }))
            .count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_endpoint_serves_writes_and_reads_and_refusals_are_typed() {
    let (_dir, cluster) = cluster(2).await;
    let setup = client(cluster.endpoints());
    let shard = world(&setup).await;
    let leader = cluster.leader_of(shard).await.unwrap();
    let follower = (1..=3).find(|n| *n != leader).unwrap();
    let c = client(vec![cluster.node(follower).addr.clone()]);

    let spec = Harness::job_spec(5, Tier::ENTERPRISE, vec![a100()], 4);
    match c.submit_job(ORG, spec).await.unwrap() {
        Reply::JobSubmitted { job, .. } => assert_eq!(job, JobId(5)),
        other => panic!("{other:?}"),
    }
    let job = c.job(ORG, JobId(5)).await.unwrap();
    assert_eq!(job.state, JobState::Placed, "placed on the fleet at once");
    let page = c.jobs(ORG, Default::default()).await.unwrap();
    assert_eq!(page.jobs.len(), 1);
    let stale = c
        .query_replica(
            &cluster.node(follower).addr,
            shard,
            &Query::Job(ORG, JobId(5)),
        )
        .await
        .unwrap();
    assert!(matches!(stale, Answer::Job(Some(_))), "{stale:?}");

    // Typed refusal from apply, nothing changed.
    let before = setup.totals(shard).await.unwrap();
    let e = c
        .create_project(allot_statemachine::OrgId(999), PROJECT)
        .await;
    assert!(
        matches!(
            e,
            Err(Error::Rejected(
                CommandError::UnknownOrg | CommandError::AlreadyExists
            ))
        ),
        "{e:?}"
    );
    let e = c.cancel_job(ORG, JobId(404)).await.unwrap_err();
    assert_eq!(e.command_error(), Some(&CommandError::UnknownJob));
    assert_eq!(setup.totals(shard).await.unwrap(), before);
    // Cancelling the placed job refunds its whole hold (it never ran).
    c.cancel_job(ORG, JobId(5)).await.unwrap();
    assert_eq!(held(&c).await, 0);
}

#[tokio::test]
async fn unreachable_endpoints_fail_after_bounded_attempts() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = Client::builder()
        .endpoints([format!("127.0.0.1:{port}")])
        .shards(1)
        .retries(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(10))
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let started = Instant::now();
    let e = c.create_org(ORG).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable { attempts: 4, .. }), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // And the shard count cannot be discovered from nobody.
    let c = client(vec![format!("127.0.0.1:{port}")]);
    assert!(matches!(c.shards().await, Err(Error::Unavailable { .. })));
    // Bad configuration is refused before any call.
    assert!(matches!(Client::builder().build(), Err(Error::Config(_))));
    assert!(matches!(
        Client::builder().endpoints(["ftp://x:1"]).build(),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        Client::builder()
            .endpoints(["h:1"])
            .token("bad\ntoken")
            .build(),
        Err(Error::Config(_))
    ));
}
