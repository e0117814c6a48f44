//! The node's gRPC surface against a real 3-node cluster: forwarding and NotLeader,
//! stale reads, the assignment stream, the audit store, health, metrics, and bad input
//! (unknown shard, malformed bytes, malformed protobuf, oversized and empty calls).

use allot_node::local_cluster::{admin, Client, LocalCluster};
use allot_node::server::{FORWARDED, LEADER_ADDR};
use allot_node::workload;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_client::ApiClient;
use allot_proto::typed;
use allot_proto::*;
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::testkit::{a100, tenant, Harness, ORG};
use allot_statemachine::{AuditChain, AuditEvent, Command, JobId, NodeSpec, Request, Tier};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::Code;

mod common;
use common::http_get;

async fn cluster() -> (tempfile::TempDir, LocalCluster) {
    let dir = tempfile::Builder::new()
        .prefix("allot-api-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(
        PathBuf::from(env!("CARGO_BIN_EXE_allot-node")),
        dir.path().to_path_buf(),
        3,
        2,
    )
    .unwrap();
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    (dir, c)
}

async fn raw(addr: &str) -> ApiClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    ApiClient::new(ch).max_encoding_message_size(64 << 20)
}

fn exec(shard: u32, reqs: &[Request]) -> pb::ExecuteRequest {
    typed::execute_request(Some(shard), reqs).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_surface_answers_typed_errors_and_serves_every_api() {
    let (_dir, c) = cluster().await;
    let client = allot_node::local_cluster::client(c.endpoints());
    let (outs, _) = client
        .execute(0, &workload::setup(1_000_000_000_000))
        .await
        .unwrap();
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
    let leader = c.leader_of(0).await.unwrap();
    let follower = (1..=3).find(|n| *n != leader).unwrap();
    let leader_addr = c.node(leader).addr.clone();
    let follower_addr = c.node(follower).addr.clone();

    // A write sent to a follower is forwarded to the leader and applied once.
    let grant = workload::admin(
        workload::rid(9, 1),
        Command::IssueGrant(workload::grant(
            77,
            allot_statemachine::Account::Org(ORG),
            5_000_000,
        )),
    );
    let mut f = raw(&follower_addr).await;
    let r = f
        .execute(exec(0, std::slice::from_ref(&grant)))
        .await
        .unwrap()
        .into_inner();
    let first = typed::outcomes_from(&r, 1).unwrap().remove(0);
    assert!(first.is_ok(), "{first:?}");
    // Already forwarded once: the follower answers NotLeader with the leader's address.
    let mut req = tonic::Request::new(exec(0, std::slice::from_ref(&grant)));
    req.metadata_mut()
        .insert(FORWARDED, MetadataValue::from_static("1"));
    let e = f.execute(req).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(
        e.metadata().get(LEADER_ADDR).unwrap().to_str().unwrap(),
        leader_addr
    );
    // The retry (same request id) through the leader answers the first outcome.
    let (again, _) = client
        .execute(0, std::slice::from_ref(&grant))
        .await
        .unwrap();
    assert_eq!(again[0], first);

    // A stale read on the follower sees the grant once it has applied it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Answer::Totals(t) = client
            .query_replica(&follower_addr, 0, &Query::Totals)
            .await
            .unwrap()
        {
            if t.issued == 1_000_000_000_000 + 5_000_000 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the follower never applied the grant"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Assignments stream: a GPU node, a job, and its placement arrives on the stream.
    let node = allot_statemachine::NodeId(500);
    let spec = NodeSpec {
        node,
        gpu_type: a100(),
        gpu_count: 8,
        gpu_mem_gb: 80,
        labels: vec![],
        incarnation: 0,
    };
    let (o, _) = client
        .execute(
            0,
            &[workload::admin(
                workload::rid(9, 2),
                Command::RegisterNode(spec),
            )],
        )
        .await
        .unwrap();
    assert!(o[0].is_ok(), "{o:?}");
    let agent_ch = tonic::transport::Endpoint::from_shared(format!("http://{follower_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut stream = ApiClient::new(agent_ch)
        .watch_assignments(pb::WatchAssignmentsRequest {
            shard: 0,
            node: 500,
        })
        .await
        .unwrap()
        .into_inner();
    let job = Harness::job_spec(900, Tier::PAID, vec![a100()], 2);
    let submit = Request {
        actor: tenant(ORG),
        request_id: workload::rid(9, 3),
        org: None,
        command: Command::SubmitJob(job),
    };
    let (o, _) = client.execute(0, &[submit]).await.unwrap();
    assert!(o[0].is_ok(), "{o:?}");
    let placed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let m = stream.message().await.unwrap().expect("stream open");
            let a: Vec<allot_statemachine::scheduler::AssignmentRow> = m
                .assignments
                .iter()
                .map(|a| typed::query::assignment_from(a, "assignments").unwrap())
                .collect();
            if let Some(x) = a.into_iter().find(|x| x.0 .1 == JobId(900)) {
                return x;
            }
        }
    })
    .await
    .expect("the placement reached the watcher");
    assert_eq!(placed.1, 1, "first attempt");
    assert_eq!(placed.2.len(), 2, "two GPUs assigned");

    // The audit store holds a verifiable chain from genesis.
    let r = raw(&leader_addr)
        .await
        .audit(pb::AuditRequest {
            read: Some(pb::Read {
                shard: Some(0),
                stale_ok: true,
            }),
            from_seq: 0,
            limit: 10_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let events: Vec<AuditEvent> = r
        .events
        .iter()
        .map(|e| typed::audit_event_from(e).unwrap())
        .collect();
    assert!(events.len() > 10);
    allot_statemachine::verify_chain(&AuditChain::default(), &events)
        .expect("audit chain verifies");

    // Health and metrics.
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{leader_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let h = tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "allot.api.v1.Api".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        h.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let metrics = http_get(&c.node(leader).metrics_addr, "/metrics").await;
    assert!(
        metrics.contains("allot_raft{field=\"is_leader\",shard=\"0\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("allot_proposal_batch_size"), "{metrics}");
    // The commit time is split into the leader's stages, and the followers time their
    // AppendEntries answers.
    let value = |m: &str, series: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    for stage in ["append", "local_flush", "replicate", "apply"] {
        let series =
            format!("allot_proposal_stage_seconds_count{{shard=\"0\",stage=\"{stage}\"}} ");
        assert!(
            value(&metrics, &series) > 0.0,
            "no {stage} stage in {metrics}"
        );
    }
    // What memory is made of: the state's tables per shard, RocksDB's own per column
    // family (DESIGN §63).
    assert!(
        value(
            &metrics,
            "allot_state_rows{shard=\"0\",table=\"idempotency_records\"} "
        ) >= 3.0,
        "{metrics}"
    );
    assert_eq!(
        value(&metrics, "allot_state_rows{shard=\"0\",table=\"jobs\"} "),
        1.0,
        "{metrics}"
    );
    assert!(
        value(
            &metrics,
            "allot_rocksdb_memory_bytes{cf=\"log\",kind=\"memtables\"} "
        ) > 0.0,
        "{metrics}"
    );
    let follower = c.nodes.iter().find(|n| n.id != leader).expect("a follower");
    let fm = http_get(&follower.metrics_addr, "/metrics").await;
    assert!(
        value(&fm, "allot_follower_append_seconds_count{shard=\"0\"} ") > 0.0,
        "{fm}"
    );
    // A dev-mode node says so loudly at start (three warnings).
    let log = c.log_tail(leader, 10_000);
    assert_eq!(log.matches("INSECURE DEV MODE").count(), 3, "{log}");
    // The placed job's hold is counted in the shard's held credits.
    let held: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("allot_credits_micro{kind=\"held\",shard=\"0\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no held credits gauge in {metrics}"));
    assert!(held > 0.0, "held credits {held}");

    // ---- bad input: typed errors, nothing applied, the node keeps serving.
    let mut l = raw(&leader_addr).await;
    let before = totals(&client).await;
    let e = l
        .execute(exec(7, std::slice::from_ref(&grant)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(
        e.metadata().get("allot-reason").unwrap().to_str().unwrap(),
        "UNKNOWN_SHARD"
    );
    // An entry with no command set.
    let e = l
        .execute(pb::ExecuteRequest {
            shard: Some(0),
            commands: vec![pb::Command::default()],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = l
        .execute(pb::ExecuteRequest {
            shard: Some(0),
            commands: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let many = vec![grant.clone(); allot_node::server::REQUESTS_PER_CALL_MAX + 1];
    let e = l.execute(exec(0, &many)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let huge = vec![
        pb::Command {
            command: Some(pb::command::Command::CreateOrg(pb::CreateOrgRequest {
                call: Some(pb::Call {
                    request_id: 1,
                    dev_actor: "x".repeat(1 << 20),
                    ..Default::default()
                }),
                org: 1,
            })),
        };
        9
    ];
    let e = l
        .execute(pb::ExecuteRequest {
            shard: Some(0),
            commands: huge,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );
    let e = l
        .query(pb::QueryRequest {
            read: None,
            query: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut raft = allot_proto::raft_client::RaftClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{leader_addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let not_raft = || RaftMessage {
        shard: 0,
        payload: b"not raft".to_vec(),
    };
    // Without the peer secret the Raft service does not read the message at all.
    let e = raft.append(not_raft()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A peer's malformed message is refused as such.
    let secret = c.peer_secret.clone().unwrap();
    let cluster = c.status(1).await.unwrap().cluster_id;
    let mut req = tonic::Request::new(not_raft());
    req.metadata_mut()
        .insert(allot_node::peer::PEER_SECRET, secret.parse().unwrap());
    // With the secret but without the cluster's id: a node of another cluster (or of an
    // earlier release's data dir), refused before the message is read (DESIGN §68).
    let e = raft.append(req).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        e.metadata()
            .get("allot-reason")
            .and_then(|v| v.to_str().ok()),
        Some("OTHER_CLUSTER"),
        "{e:?}"
    );
    let mut req = tonic::Request::new(not_raft());
    req.metadata_mut()
        .insert(allot_node::peer::PEER_SECRET, secret.parse().unwrap());
    req.metadata_mut()
        .insert(allot_node::identity::HEADER, cluster.parse().unwrap());
    let e = raft.append(req).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // The membership guard's coverage question is a peer call like the others.
    let coverage = |shard: u32, with_secret: bool| {
        let mut req = tonic::Request::new(allot_proto::AuditCoverageRequest { shard });
        if with_secret {
            req.metadata_mut()
                .insert(allot_node::peer::PEER_SECRET, secret.parse().unwrap());
            req.metadata_mut()
                .insert(allot_node::identity::HEADER, cluster.parse().unwrap());
        }
        req
    };
    let e = raft.audit_coverage(coverage(0, false)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = raft
        .audit_coverage(coverage(u32::MAX, true))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let c0 = raft
        .audit_coverage(coverage(0, true))
        .await
        .expect("a peer asks")
        .into_inner();
    assert!(
        c0.head > 0 && c0.contiguous_to == c0.head,
        "the leader holds its whole trail: {c0:?}"
    );
    let e = admin(&leader_addr)
        .await
        .unwrap()
        .init(InitRequest {
            members: vec![],
            shards: vec![],
            cluster_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Bytes that are not a protobuf message at all.
    let code = malformed_protobuf(&leader_addr).await;
    assert!(
        matches!(code, Code::Internal | Code::InvalidArgument),
        "{code:?}"
    );
    assert_eq!(
        totals(&client).await,
        before,
        "no bad request changed the ledger"
    );
    let (again, _) = client
        .execute(0, std::slice::from_ref(&grant))
        .await
        .unwrap();
    assert_eq!(
        again[0], first,
        "still serving; still answering the first outcome"
    );
}

async fn totals(client: &Client) -> allot_statemachine::ledger::Totals {
    match client.query(0, &Query::Totals).await.unwrap() {
        Answer::Totals(t) => t,
        other => panic!("{other:?}"),
    }
}

/// Sends raw bytes that do not decode as `ExecuteRequest` and returns the status code.
async fn malformed_protobuf(addr: &str) -> Code {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Field 1 declared as a 10-byte varint that never terminates: invalid protobuf.
    let body = vec![
        0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    ];
    match common::raw_unary(ch, "/allot.api.v1.Api/Execute", tonic::Request::new(body)).await {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_rate_is_refused_at_the_edge_and_sigterm_shuts_down_cleanly() {
    let dir = tempfile::Builder::new()
        .prefix("allot-edge-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(
        PathBuf::from(env!("CARGO_BIN_EXE_allot-node")),
        dir.path().to_path_buf(),
        3,
        1,
    )
    .unwrap();
    for n in &mut c.nodes {
        n.extra_args = ["--rate-limit", "1", "--rate-burst", "20"]
            .map(String::from)
            .to_vec();
    }
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let client = allot_node::local_cluster::client(c.endpoints());
    // Admin setup: 10 requests, within the admin's burst of 20.
    let (outs, _) = client
        .execute(0, &workload::setup(1_000_000_000))
        .await
        .unwrap();
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
    let before = totals(&client).await;

    // The tenant's burst is 20: a call of 21 requests is refused whole, with a hint.
    let leader = c.leader_of(0).await.unwrap();
    let mut l = raw(&c.node(leader).addr).await;
    let mut cycle = workload::HoldCycle::new(3, 1_000_000);
    let reqs: Vec<Request> = (0..21).map(|_| cycle.request()).collect();
    let e = l.execute(exec(0, &reqs)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let wait: u64 = e
        .metadata()
        .get(allot_node::server::RETRY_AFTER_MS)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(wait >= 1, "retry-after {wait} ms");
    assert_eq!(totals(&client).await, before, "nothing was applied");
    // Within the burst it passes: the refused call took no tokens.
    let (outs, _) = client.execute(0, &reqs[..3]).await.unwrap();
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");

    // SIGTERM: the node stops its listener and Raft, syncs, and exits 0; it restarts on
    // its data and the shard converges again.
    let follower = (1..=3).find(|n| *n != leader).unwrap();
    let status = c
        .terminate(follower, Duration::from_secs(20))
        .expect("exited on SIGTERM");
    assert!(status.success(), "exit status {status:?}");
    c.start(follower).unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut idx = Vec::new();
        for n in 1..=3u64 {
            let mut a = admin(&c.node(n).addr).await.unwrap();
            let r = a
                .shard_hash(ShardRequest { shard: 0 })
                .await
                .unwrap()
                .into_inner();
            idx.push((r.applied_index, r.state_hash));
        }
        if idx.windows(2).all(|w| w[0] == w[1]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replicas did not converge after the restart: {idx:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The typed API (`allot.api.v1.Api`) on every node, discoverable by server reflection
/// and reported by `grpc.health.v1`; a typed call through a follower is forwarded, a
/// retried request id applies once, a malformed call names its field, and a refusal
/// carries its typed reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typed_api_is_reflected_healthy_and_idempotent_on_every_node() {
    use allot_proto::api::v1 as pb;
    use allot_proto::api::v1::api_client::ApiClient;
    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let (_dir, c) = cluster().await;
    for addr in c.endpoints() {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        // Reflection lists the typed API with the other services.
        let mut refl = ServerReflectionClient::new(ch.clone());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = refl
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .unwrap()
            .into_inner();
        let first = answers.next().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = first.message_response else {
            panic!("{first:?}");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        for s in [
            "allot.api.v1.Api",
            "allot.v1.Admin",
            "grpc.health.v1.Health",
        ] {
            assert!(names.iter().any(|n| n == s), "{s} not in {names:?}");
        }
        // The state machine's codec bytes are no longer served to clients or agents.
        for s in ["allot.v1.Allot", "allot.v1.Agent"] {
            assert!(!names.iter().any(|n| n == s), "{s} still served: {names:?}");
        }
        let h = tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: "allot.api.v1.Api".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            h.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }

    // Through a follower of shard 1 (org 3's home shard of 2): forwarded to the leader.
    let leader = c.leader_of(1).await.unwrap();
    let follower = c
        .endpoints()
        .into_iter()
        .find(|e| *e != c.node(leader).addr)
        .unwrap();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{follower}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut api = ApiClient::new(ch);
    let call = |id| {
        Some(pb::Call {
            request_id: id,
            shard: None,
            dev_actor: "admin".into(),
            request_id_high: 0,
        })
    };
    // UNAVAILABLE (the new shard's clock not sampled yet) is the documented retryable
    // answer; the same request id is resent.
    let started = Instant::now();
    let created = loop {
        match api
            .create_org(pb::CreateOrgRequest {
                call: call(11),
                org: 3,
            })
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(s)
                if s.code() == Code::Unavailable && started.elapsed() < Duration::from_secs(20) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(s) => panic!("{s:?}"),
        }
    };
    assert!(matches!(
        created.result,
        Some(pb::command_reply::Result::Created(_))
    ));
    let grant = |id| pb::IssueGrantRequest {
        call: call(id),
        bucket: 1,
        owner: Some(pb::Account {
            org: Some(3),
            project: None,
        }),
        kind: pb::BucketKind::Paid as i32,
        amount_micro: 5_000_000,
        ..Default::default()
    };
    let first = api.issue_grant(grant(12)).await.unwrap().into_inner();
    let retry = api.issue_grant(grant(12)).await.unwrap().into_inner();
    assert!(matches!(
        first.result,
        Some(pb::command_reply::Result::GrantIssued(pb::GrantIssued {
            bucket: 1
        }))
    ));
    assert_eq!(
        first.result, retry.result,
        "the retry gets the first answer"
    );
    let bal = api
        .balance(pb::BalanceRequest {
            read: None,
            account: Some(pb::Account {
                org: Some(3),
                project: None,
            }),
            horizon_ms: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .balance
        .unwrap();
    assert_eq!(bal.paid_available_micro, 5_000_000, "applied once");
    assert_eq!(bal.available_micro, 5_000_000);
    // A second grant of the same bucket id: refused with its typed reason.
    let dup = api.issue_grant(grant(13)).await.unwrap().into_inner();
    let Some(pb::command_reply::Result::Error(e)) = dup.result else {
        panic!("{dup:?}");
    };
    assert_eq!(e.reason(), pb::Reason::AlreadyExists);
    // Malformed: no request id; an unknown enum value. Nothing applied.
    let s = api
        .create_org(pb::CreateOrgRequest {
            call: call(0),
            org: 4,
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(s.metadata().get("allot-field").unwrap(), "call.request_id");
    let mut g = grant(14);
    g.kind = 77;
    let s = api.issue_grant(g).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(s.metadata().get("allot-field").unwrap(), "kind");
    // The state machine's own validation, at the edge: a zero amount.
    let mut g = grant(15);
    g.amount_micro = 0;
    let s = api.issue_grant(g).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(s.metadata().get("allot-reason").unwrap(), "AMOUNT_ZERO");
    // The typed audit trail: the issue is there once, with its fields by name.
    let audit = api
        .audit(pb::AuditRequest {
            read: None,
            from_seq: 0,
            limit: 100,
            org: Some(3),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let issued: Vec<_> = audit.events.iter().filter(|e| e.kind == "Issued").collect();
    assert_eq!(issued.len(), 1, "{:?}", audit.events);
    assert_eq!(issued[0].org, Some(3));
    assert_eq!(issued[0].hash.len(), 64);
}

/// The next event of a `WatchEvents` stream, within 10 s.
async fn next_event(
    s: &mut tonic::Streaming<allot_proto::api::v1::AuditEvent>,
) -> allot_proto::api::v1::AuditEvent {
    use tokio_stream::StreamExt;
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("an event within 10 s")
        .expect("the stream stays open")
        .expect("no error")
}

/// `WatchEvents`: a consumer that disconnects and resumes from its last sequence + 1
/// misses nothing and sees nothing twice (its events equal the trail's), and the
/// alert events it consumes fire exactly once per crossing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_events_resumes_without_gaps_and_alerts_fire_once_per_crossing() {
    use allot_proto::api::v1 as pb;
    use allot_proto::api::v1::api_client::ApiClient;
    use allot_statemachine::{
        Account, Actor, BudgetMode, BudgetPeriod, BudgetScope, BudgetSpec, HoldId, HoldSpec, OrgId,
        PrincipalId, ProjectId, UserId,
    };

    let (_dir, c) = cluster().await;
    let client = allot_node::local_cluster::client(c.endpoints());
    // Org 5 lives on shard 1 (5 mod 2).
    let (org, project, user, shard) = (OrgId(5), ProjectId(51), UserId(52), 1u32);
    let mut n = 0u64;
    let mut run = |command: Command| {
        n += 1;
        Request {
            actor: Actor::Admin(PrincipalId(1)),
            request_id: workload::rid(50, n),
            org: Some(org),
            command,
        }
    };
    let setup = vec![
        run(Command::CreateOrg { org }),
        run(Command::CreateProject { project, org }),
        run(Command::CreateUser { user, org }),
        run(Command::IssueGrant(workload::grant(
            1,
            Account::Project(project),
            10_000_000,
        ))),
        run(Command::SetBudget {
            scope: BudgetScope::Project(project),
            budget: Some(BudgetSpec {
                limit_micro: 10_000_000,
                period: BudgetPeriod::Month,
                mode: BudgetMode::Soft,
            }),
        }),
    ];
    let started = Instant::now();
    loop {
        match client.execute(shard, &setup).await {
            Ok((outs, _)) => {
                assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
                break;
            }
            Err(e) if started.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    let mut hold = |id: u64, amount: u64| {
        run(Command::CreateHold(HoldSpec {
            hold: HoldId(id),
            project,
            user,
            tier: Tier::PAID,
            gpu_types: vec![a100()],
            amount_micro: amount,
        }))
    };
    let (h1, h2, h3) = (hold(1, 5_000_000), hold(2, 2_000_000), hold(3, 500_000));

    let addr = c.node(c.leader_of(shard).await.unwrap()).addr.clone();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut api = ApiClient::new(ch);
    let set = api
        .set_alert(pb::SetAlertRequest {
            call: Some(pb::Call {
                request_id: 77,
                dev_actor: "admin".into(),
                ..Default::default()
            }),
            org: Some(5),
            project: Some(51),
            low_balance_micro: Some(4_000_000),
            budget_pcts: vec![50],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(set.result, Some(pb::command_reply::Result::AlertSet(_))),
        "{set:?}"
    );
    let watch = |from_seq| pb::WatchEventsRequest {
        shard: None,
        org: Some(5),
        from_seq,
    };
    // Consumer A: from the start until the 50% threshold (hold 1), then it goes away.
    let mut a = api.watch_events(watch(0)).await.unwrap().into_inner();
    let (o, _) = client.execute(shard, &[h1]).await.unwrap();
    assert!(o[0].is_ok(), "{o:?}");
    let mut seen: Vec<pb::AuditEvent> = Vec::new();
    loop {
        let ev = next_event(&mut a).await;
        let done = ev.kind == "BudgetThreshold";
        seen.push(ev);
        if done {
            break;
        }
    }
    drop(a);
    // While it is away: the balance falls below 4 (hold 2), then further (hold 3).
    for h in [h2, h3] {
        let (o, _) = client.execute(shard, &[h]).await.unwrap();
        assert!(o[0].is_ok(), "{o:?}");
    }
    // The whole trail of the org, as the audit read gives it.
    let trail = api
        .audit(pb::AuditRequest {
            read: None,
            from_seq: 0,
            limit: 1_000,
            org: Some(5),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    let last = trail.last().unwrap().seq;
    // Consumer B resumes after A's last sequence.
    let resume = seen.last().unwrap().seq + 1;
    let mut b = api.watch_events(watch(resume)).await.unwrap().into_inner();
    while seen.last().unwrap().seq < last {
        seen.push(next_event(&mut b).await);
    }
    let seqs = |v: &[pb::AuditEvent]| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(seqs(&seen), seqs(&trail), "no gap, no duplicate");
    assert_eq!(seen, trail, "the same events");
    let kinds = |k: &str| seen.iter().filter(|e| e.kind == k).count();
    assert_eq!(kinds("LowBalance"), 1, "one crossing, one event");
    assert_eq!(kinds("BudgetThreshold"), 1);
    let low = seen.iter().find(|e| e.kind == "LowBalance").unwrap();
    assert_eq!(low.fields.get("available_micro").unwrap(), "3000000");
    assert_eq!(low.fields.get("threshold_micro").unwrap(), "4000000");
    // The stream follows new events live: back above the threshold (re-armed), then a
    // new crossing. (Alerts are evaluated per log entry: the state an entry leaves.)
    let (o, _) = client
        .execute(
            shard,
            &[
                run(Command::ReleaseHold { hold: HoldId(2) }),
                run(Command::ReleaseHold { hold: HoldId(3) }),
            ],
        )
        .await
        .unwrap();
    assert!(o.iter().all(|o| o.is_ok()), "{o:?}");
    let (o, _) = client
        .execute(
            shard,
            &[run(Command::CreateHold(HoldSpec {
                hold: HoldId(4),
                project,
                user,
                tier: Tier::PAID,
                gpu_types: vec![a100()],
                amount_micro: 3_000_000,
            }))],
        )
        .await
        .unwrap();
    assert!(o.iter().all(|o| o.is_ok()), "{o:?}");
    loop {
        let ev = next_event(&mut b).await;
        if ev.kind == "LowBalance" {
            assert_eq!(ev.fields.get("available_micro").unwrap(), "2000000");
            break;
        }
    }
}
