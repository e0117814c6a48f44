//! Hostile input against real 3-node clusters (issue 19): each defect found by trying
//! the public gRPC surface as an attacker, reproduced, and the properties that must hold
//! under any sequence of messages within the limits — no node exits, memory stays
//! bounded, nothing refused is applied, every shard commits afterwards.
//!
//! `fuzz_every_service` runs a short quick mode in the suite; set `ALLOT_FUZZ_SECS`
//! (and `ALLOT_FUZZ_SEED`) for a soak run (`scripts/soak.sh fuzz`).

use allot_node::limits::{RAFT_MESSAGE_MAX, SNAPSHOT_BYTES_MAX, TERM_MAX};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_node::network::{AppendWire, SnapshotChunk};
use allot_node::peer::PEER_SECRET;
use allot_node::types::{Batch, LogEntry, LogId, SnapshotMeta, Vote};
use allot_proto::admin_client::AdminClient;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_client::ApiClient;
use allot_proto::raft_client::RaftClient;
use allot_proto::typed;
use allot_proto::*;
use allot_statemachine::limits::COMMAND_BYTES_MAX;
use allot_statemachine::*;
use prost::Message as _;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::Code;

mod common;
use common::{raw_streaming, raw_unary};

// ---------------------------------------------------------------- harness

struct Hostile {
    _dir: tempfile::TempDir,
    c: LocalCluster,
    admin: ::allot_client::Client,
    token: String,
    /// The cluster's id (`allot_node::identity`): peers send it with every message.
    cluster: String,
}

/// What a peer presents: the peer secret and its cluster's id.
#[derive(Clone)]
struct PeerSecret {
    secret: String,
    cluster: String,
}

/// A secured 3-node cluster (admin token bootstrapped, peers sharing a secret).
async fn secured(shards: u32) -> Hostile {
    secured_with(shards, &[]).await
}

/// [`secured`], node 1 started with `node1_args` as well.
async fn secured_with(shards: u32, node1_args: &[&str]) -> Hostile {
    let dir = tempfile::Builder::new()
        .prefix("allot-hostile-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.path().into(), 3, shards).unwrap();
    c.dev_mode = false;
    c.nodes[0]
        .extra_args
        .extend(node1_args.iter().map(|a| a.to_string()));
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let token = ::allot_client::security::generate_token().unwrap();
    c.admin_client()
        .unwrap()
        .bootstrap(PrincipalId(1), &token)
        .await
        .unwrap();
    c.admin_token = Some(token.clone());
    let admin = c.admin_client().unwrap();
    let cluster = c.status(1).await.unwrap().cluster_id;
    assert_eq!(cluster.len(), 32, "a new cluster has an id");
    Hostile {
        _dir: dir,
        c,
        admin,
        token,
        cluster,
    }
}

async fn channel(addr: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

fn api(ch: Channel) -> ApiClient<Channel> {
    ApiClient::new(ch)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(64 << 20)
}

fn raft(ch: Channel) -> RaftClient<Channel> {
    RaftClient::new(ch)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(64 << 20)
}

fn bearer<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    // A token that is not even a valid header value cannot be sent.
    if let Some(Ok(v)) = token.map(|t| format!("Bearer {t}").parse()) {
        r.metadata_mut().insert("authorization", v);
    }
    r
}

fn as_peer<T>(msg: T, peer: &PeerSecret) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert(PEER_SECRET, peer.secret.parse().unwrap());
    r.metadata_mut()
        .insert(allot_node::identity::HEADER, peer.cluster.parse().unwrap());
    r
}

fn reason(s: &tonic::Status) -> &str {
    s.metadata()
        .get("allot-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn exec(shard: u32, reqs: &[Request]) -> pb::ExecuteRequest {
    typed::execute_request(Some(shard), reqs).expect("client commands")
}

fn req(id: u128, command: Command) -> Request {
    Request {
        actor: Actor::Anonymous,
        request_id: id,
        org: None,
        command,
    }
}

/// Kilobytes of resident memory now, and the peak so far, of a process.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

impl Hostile {
    fn secret(&self) -> PeerSecret {
        PeerSecret {
            secret: self.c.peer_secret.clone().unwrap(),
            cluster: self.cluster.clone(),
        }
    }

    fn addr(&self, id: u64) -> String {
        self.c.node(id).addr.clone()
    }

    fn pids(&self) -> Vec<u32> {
        (1..=3).filter_map(|id| self.c.pid(id)).collect()
    }

    /// Every node's resident memory now (KiB), by node.
    fn rss_now(&self) -> Vec<u64> {
        self.pids().into_iter().map(|p| rss_kib(p).0).collect()
    }

    fn assert_all_running(&mut self) {
        for id in 1..=3 {
            assert!(
                self.c.exited(id).is_none(),
                "node {id} exited: {}",
                self.c.log_tail(id, 30)
            );
        }
    }

    /// The peak resident memory of every node stayed below its idle figure plus
    /// `budget_mib`; returns the largest growth seen (MiB).
    fn assert_memory_within(&self, idle_kib: &[u64], budget_mib: u64) -> u64 {
        let mut worst = 0;
        for (i, pid) in self.pids().into_iter().enumerate() {
            let (_, peak) = rss_kib(pid);
            let grew = peak.saturating_sub(idle_kib[i]) / 1024;
            worst = worst.max(grew);
            assert!(
                grew < budget_mib,
                "node {} peaked at {} MiB, {grew} MiB over idle",
                i + 1,
                peak / 1024
            );
        }
        worst
    }

    /// Creates `n` users in `org` on shard 0 (user ids from 1,000), as the admin, in
    /// batches: one audit event each.
    async fn create_users(&self, org: OrgId, n: u64) {
        let reqs: Vec<Request> = (0..n)
            .map(|u| Request {
                actor: Actor::Admin(PrincipalId(1)),
                request_id: (u128::from(org.0) << 64) | u128::from(u + 1),
                org: None,
                command: Command::CreateUser {
                    org,
                    user: UserId(1_000 + u),
                },
            })
            .collect();
        for chunk in reqs.chunks(4_000) {
            let (outs, _) = self.admin.execute(0, chunk).await.unwrap();
            assert!(outs.iter().all(Result::is_ok));
        }
    }

    /// Orgs 7 and 8, and a client holding an org token of org 8 (principal 80).
    async fn orgs_7_and_8(&self) -> ::allot_client::Client {
        for org in [7, 8] {
            self.admin.create_org(OrgId(org)).await.unwrap();
        }
        let t8 = self
            .admin
            .create_token(PrincipalId(80), Scope::Org(OrgId(8)), None)
            .await
            .unwrap();
        self.client_with(t8)
    }

    /// A client of the cluster with `token`.
    fn client_with(&self, token: String) -> ::allot_client::Client {
        ::allot_client::Client::builder()
            .endpoints(self.c.endpoints())
            .token(token)
            .build()
            .unwrap()
    }

    /// The shard's audit chain length as its leader sees it.
    async fn head_seq(&self, shard: u32) -> u64 {
        self.admin
            .audit(shard, ::allot_client::AuditFilter::default(), u64::MAX, 1)
            .await
            .unwrap()
            .head_seq
    }

    /// Since `from`, the shard's trail holds nothing but edge denials (the node's own
    /// `RecordDenials` commands and their `Denied` events) — and the commands of
    /// `probe_org`, the write that checks the shard still commits: nothing a hostile
    /// caller sent was applied.
    async fn only_denials_since(&self, shard: u32, from: u64, probe_org: Option<u64>) {
        let mut bad = Vec::new();
        self.admin
            .audit_export(shard, ::allot_client::AuditFilter::default(), from, |ev| {
                let ok = match &ev.body {
                    EventBody::Denied { .. } => true,
                    EventBody::Command { outcome, .. } => {
                        (ev.actor == Actor::System
                            && matches!(outcome, Ok(Reply::DenialsRecorded { .. })))
                            || (probe_org.is_some() && ev.org == probe_org.map(OrgId))
                    }
                    _ => false,
                };
                if !ok {
                    bad.push(format!("{ev:?}"));
                }
                Ok(())
            })
            .await
            .unwrap();
        assert!(bad.is_empty(), "applied after the hostile phase: {bad:?}");
    }

    /// A normal write commits on every shard, each within `within`.
    async fn every_shard_commits(&self, within: Duration, org_base: u64) -> Duration {
        let mut slowest = Duration::ZERO;
        for shard in 0..self.c.shards {
            let org = OrgId(org_base + shard as u64);
            assert_eq!(
                allot_proto::shard_of_org(org.0, self.c.shards),
                shard,
                "org {org:?} is homed on shard {shard}"
            );
            let started = Instant::now();
            tokio::time::timeout(within, self.admin.create_org(org))
                .await
                .unwrap_or_else(|_| panic!("shard {shard} did not commit within {within:?}"))
                .unwrap();
            slowest = slowest.max(started.elapsed());
        }
        slowest
    }

    /// Every replica of every shard reaches the same state hash.
    async fn replicas_agree(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        'retry: loop {
            for shard in 0..self.c.shards {
                let mut seen = Vec::new();
                for id in 1..=3 {
                    let mut a = AdminClient::new(channel(&self.addr(id)).await);
                    let r = a
                        .shard_hash(bearer(ShardRequest { shard }, Some(&self.token)))
                        .await
                        .unwrap()
                        .into_inner();
                    seen.push((r.applied_index, r.state_hash));
                }
                let same = seen.iter().all(|s| s == &seen[0]);
                if !same {
                    assert!(Instant::now() < deadline, "shard {shard}: {seen:?}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue 'retry;
                }
            }
            return;
        }
    }

    async fn metric(&self, id: u64, name: &str) -> f64 {
        common::metric(&self.c.node(id).metrics_addr, name).await
    }
}

fn labels(n: usize) -> NodeSpec {
    NodeSpec {
        node: NodeId(1),
        gpu_type: GpuType::new("H100"),
        gpu_count: 8,
        gpu_mem_gb: 80,
        labels: vec![(String::new(), String::new()); n],
        incarnation: 0,
    }
}

// ---------------------------------------------------------------- the defects

/// Defect 1: a well-formed ~8 MiB `RegisterNode` of 4 million empty labels passed the
/// edge, became a ~64 MiB AppendEntries and wedged its shard for good. Now: refused at
/// the edge by size and by the state machine's own validation, never proposed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_1_a_huge_register_node_never_reaches_the_log() {
    let mut h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let mut l = api(channel(&h.addr(leader)).await);
    let before = h.head_seq(0).await;
    let idle = h.rss_now();
    let tok = Some(h.token.as_str());

    // The original: ~8 MiB in one request; gRPC refuses the message by its length.
    let huge = req(1, Command::RegisterNode(labels(4_000_000)));
    let e = l.execute(bearer(exec(0, &[huge]), tok)).await.unwrap_err();
    assert!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );
    // Within the message bound but above one command's bound: refused by size.
    let big = req(2, Command::RegisterNode(labels(300_000)));
    let e = l.execute(bearer(exec(0, &[big]), tok)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(reason(&e), "LIMIT_REACHED");
    // Small, but 17 labels: the state machine's own rule, answered at the edge with the
    // typed error the client reports as the state machine's.
    let seventeen = req(3, Command::RegisterNode(labels(17)));
    let e = h
        .admin
        .execute(0, std::slice::from_ref(&seventeen))
        .await
        .unwrap_err();
    assert_eq!(
        e.command_error(),
        Some(&CommandError::LimitReached(Limit::Labels)),
        "{e:?}"
    );
    // Nothing reached the log; the shard commits at once; memory did not move.
    assert_eq!(h.head_seq(0).await, before, "nothing was applied");
    let t = h.every_shard_commits(Duration::from_secs(5), 100).await;
    eprintln!("defect 1: a write committed {t:?} after the hostile requests");
    let grew = h.assert_memory_within(&idle, 64);
    eprintln!("defect 1: peak RSS growth {grew} MiB");
    h.assert_all_running();
}

/// A grant to an unknown org with a `source_ref` of `len` bytes: refused once read.
fn huge_grant(i: u128, len: usize) -> Request {
    req(
        i,
        Command::IssueGrant(Grant {
            bucket: BucketId(i as u64),
            owner: Account::Org(OrgId(999_999)),
            kind: BucketKind::Paid,
            amount_micro: 1,
            expires_at_ms: None,
            priority: 0,
            policy: None,
            source_ref: Some("x".repeat(len)),
        }),
    )
}

/// Defect 2: forty concurrent ~7.9 MiB grants (unknown org, 8 MB source reference) took
/// the leader to ~3 GiB and wedged the shard. Now each is refused by its length before
/// it is buffered, and a batch is closed by bytes as well as by count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_forty_huge_grants_cost_nothing() {
    let mut h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let before = h.head_seq(0).await;
    let idle = h.rss_now();
    let mut calls = Vec::new();
    for i in 0..40u128 {
        let ch = channel(&h.addr(leader)).await;
        let token = h.token.clone();
        calls.push(tokio::spawn(async move {
            // 38 of them ~7.9 MiB, two within the message bound but over a command's.
            let len = if i < 38 { 7_900_000 } else { 600_000 };
            api(ch)
                .execute(bearer(exec(0, &[huge_grant(i + 1, len)]), Some(&token)))
                .await
                .unwrap_err()
        }));
    }
    let started = Instant::now();
    for c in calls {
        let e = c.await.unwrap();
        assert!(
            matches!(
                e.code(),
                Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument
            ),
            "{e:?}"
        );
    }
    eprintln!("defect 2: 40 refusals in {:?}", started.elapsed());
    assert_eq!(h.head_seq(0).await, before, "nothing was applied");
    h.every_shard_commits(Duration::from_secs(5), 100).await;
    let grew = h.assert_memory_within(&idle, 256);
    eprintln!("defect 2: peak RSS growth {grew} MiB (budget 256)");
    h.assert_all_running();
}

/// Calls in flight: tonic reads a call's whole message before any handler, permit or
/// rate limit sees it, so a thousand concurrent ~1 MiB calls over a handful of
/// connections held a GiB on the node (each within every per-call bound). Now a call's
/// bytes are taken from the node's admission budget before its message is read (the rest
/// waits in HTTP/2 flow control, one window per connection), so memory stays bounded
/// however many calls are open; a call that cannot get its bytes within two seconds is
/// told `NODE_BUSY` with a retry-after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_cost_bounded_memory_however_many_are_open() {
    const CONNECTIONS: usize = 16;
    const CALLS_PER_CONNECTION: usize = 64;
    let mut h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let before = h.head_seq(0).await;
    let idle = h.rss_now();
    // Within the message bound, over a command's: refused at the edge once read.
    let call = pb::ExecuteRequest::encode_to_vec(&exec(0, &[huge_grant(1, 1_000_000)]));
    let mut calls = Vec::new();
    for _ in 0..CONNECTIONS {
        let ch = channel(&h.addr(leader)).await;
        for _ in 0..CALLS_PER_CONNECTION {
            let (ch, body, token) = (ch.clone(), call.clone(), h.token.clone());
            calls.push(tokio::spawn(async move {
                raw_unary(ch, "/allot.api.v1.Api/Execute", bearer(body, Some(&token)))
                    .await
                    .unwrap_err()
            }));
        }
    }
    let started = Instant::now();
    let (mut refused, mut busy) = (0, 0);
    for c in calls {
        let e = c.await.unwrap();
        match (e.code(), reason(&e)) {
            (Code::ResourceExhausted, "NODE_BUSY") => {
                assert!(e
                    .metadata()
                    .get(allot_proto::meta::RETRY_AFTER_MS)
                    .is_some());
                busy += 1;
            }
            (Code::InvalidArgument, _) => refused += 1,
            other => panic!("unexpected answer {other:?}: {e:?}"),
        }
    }
    eprintln!(
        "in flight: {} calls of {} bytes over {CONNECTIONS} connections answered in {:?}: \
         {refused} refused as too large once read, {busy} told NODE_BUSY",
        CONNECTIONS * CALLS_PER_CONNECTION,
        call.len(),
        started.elapsed()
    );
    assert!(refused > 0, "some calls were read and refused");
    assert_eq!(h.head_seq(0).await, before, "nothing was applied");
    h.every_shard_commits(Duration::from_secs(5), 100).await;
    let grew = h.assert_memory_within(&idle, 384);
    eprintln!("in flight: peak RSS growth {grew} MiB (budget 384)");
    h.assert_all_running();
}

/// Defect 7 (found by review, 2026-11-27): an anonymous `Execute` of 1 MiB of empty
/// commands (two bytes each on the wire, ~200 bytes each once prost has decoded them)
/// was admitted for its 1 MiB and decoded to ~115 MB, then ~130 MB more while its
/// commands were converted, before anything counted them; sixty-four at once fit the
/// byte budget. Now admission charges what a message decodes to, bounded from its bytes
/// before it is decoded (`decoded.rs`), and refuses one that could never fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_7_what_a_message_decodes_to_is_charged_before_it_is_decoded() {
    let mut h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let before = h.head_seq(0).await;
    let idle = h.rss_now();
    let flood = pb::ExecuteRequest {
        shard: Some(0),
        commands: vec![pb::Command::default(); 524_000],
    }
    .encode_to_vec();
    assert!(flood.len() <= 1 << 20);
    let mut calls = Vec::new();
    for _ in 0..8 {
        let ch = channel(&h.addr(leader)).await;
        let body = flood.clone();
        calls.push(tokio::spawn(async move {
            raw_unary(ch, "/allot.api.v1.Api/Execute", bearer(body, None))
                .await
                .unwrap_err()
        }));
    }
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.unwrap());
    }
    let grew = h.assert_memory_within(&idle, 96);
    eprintln!("defect 7: peak RSS growth {grew} MiB (budget 96)");
    for e in answers {
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        assert!(e.message().contains("decodes to"), "{e:?}");
    }
    assert_eq!(h.head_seq(0).await, before, "nothing was applied");
    h.every_shard_commits(Duration::from_secs(5), 10).await;
    h.assert_all_running();
}

/// Defect 8 (found by review, 2026-11-27): admission read a call's first message only;
/// tonic then decoded (and dropped) every further message of a unary call, none of them
/// admitted. Now a second message in a call of a one-message method ends the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_8_a_unary_call_carries_one_message() {
    let h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let ch = channel(&h.addr(leader)).await;
    let status = pb::QueryRequest {
        read: Some(pb::Read {
            shard: Some(0),
            stale_ok: false,
        }),
        query: Some(pb::query_request::Query::Fleet(pb::Empty::default())),
    }
    .encode_to_vec();
    // One message: answered.
    raw_unary(
        ch.clone(),
        "/allot.api.v1.Api/Query",
        bearer(status.clone(), Some(&h.token)),
    )
    .await
    .unwrap();
    // The same message followed by 512 KiB of a second one: refused.
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.unwrap();
    let second = vec![0u8; 512 << 10];
    let req = bearer(tokio_stream::iter(vec![status, second]), Some(&h.token));
    let e = g
        .client_streaming(
            req,
            http::uri::PathAndQuery::from_static("/allot.api.v1.Api/Query"),
            common::RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("exactly one message"), "{e:?}");
}

/// Defect 9 (found by review, 2026-11-27): a peer's `ReportDenials` was proposed as it
/// came — never validated — so an oversized report (too many denials, an `api` of
/// megabytes) entered the log and was refused only in apply, and a report sized near the
/// Raft message bound made an AppendEntries its transport could not send. A report in the
/// name of a node that is not a member was proposed too. Now the leader validates the
/// report with the state machine's own check and refuses it (nothing proposed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_9_a_peers_denial_report_is_validated_before_it_is_proposed() {
    let h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let mut peer = raft(channel(&h.addr(leader)).await);
    let before = h.head_seq(0).await;
    let denial = |api: String| Denial {
        actor: Actor::Anonymous,
        api,
        reason: DenialReason::Unauthenticated,
    };
    let report = |reporter: u64, denials: Vec<Denial>| {
        let payload = codec::encode(&(reporter, denials));
        as_peer(RaftMessage { shard: 0, payload }, &h.secret())
    };
    let too_many = vec![denial("query:balance".into()); 300];
    let too_long = vec![denial("x".repeat(1 << 20))];
    for (what, msg) in [
        ("300 denials", report(2, too_many)),
        ("a 1 MiB api", report(2, too_long)),
        (
            "an unknown reporter",
            report(99, vec![denial("audit".into())]),
        ),
    ] {
        let e = peer.report_denials(msg).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert_eq!(reason(&e), "PEER_MESSAGE_REFUSED", "{what}: {e:?}");
    }
    assert_eq!(h.head_seq(0).await, before, "nothing was proposed");
    // A legal report from a member is still recorded.
    peer.report_denials(report(2, vec![denial("audit".into())]))
        .await
        .unwrap();
    assert!(h.head_seq(0).await > before);
}

/// Defect 10 (found by review, 2026-11-27): a refused call's denial was queued for the
/// audit trail under the shard the call named before anything checked the shard exists,
/// so anonymous calls naming a different unknown shard each made the flush log one
/// unthrottled line per shard every second. Now a call naming an unknown shard is refused
/// `UNKNOWN_SHARD` first, and a denial is queued only for a shard the node hosts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_10_calls_naming_unknown_shards_queue_no_denials() {
    let h = secured(1).await;
    let leader = h.c.leader_of(0).await.unwrap();
    let mut l = api(channel(&h.addr(leader)).await);
    let lines = |h: &Hostile| {
        std::fs::read_to_string(h.c.log_path(leader))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("denials not audited"))
            .count()
    };
    let before = lines(&h);
    // Anonymous: no token at all (refused before any token is looked up).
    let mut answers = Vec::new();
    for shard in 1_000..1_200u32 {
        let call = exec(shard, &[req(1, Command::CreateOrg { org: OrgId(5) })]);
        answers.push(l.execute(bearer(call, None)).await.unwrap_err());
    }
    // Two flushes of the denial buffer (it is flushed every second).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(lines(&h), before, "{}", h.c.log_tail(leader, 5));
    for e in answers {
        assert_eq!(reason(&e), "UNKNOWN_SHARD", "{e:?}");
    }
}

/// Defect 11: one caller's refused calls crowded everyone else's out of the audit
/// trail. A node keeps at most 1,024 denials per shard between two flushes (about a
/// second); a tenant with a valid token whose reads are refused (a shard-wide read)
/// fills that within its own read burst, and every other caller's denial in the same
/// second was only counted, never audited. Now each caller has a share of the buffer
/// (64 per org, agent or admin; 256 for every unresolved caller together): org 7's
/// flood keeps its share, and each of org 8's denials reaches the trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_11_one_tenants_denials_cannot_crowd_out_anothers() {
    use allot_node::limits::DENIALS_PENDING_PER_CALLER_MAX;
    let h = secured(1).await;
    for org in [7, 8] {
        h.admin.create_org(OrgId(org)).await.unwrap();
    }
    let t7 = h
        .admin
        .create_token(PrincipalId(70), Scope::Org(OrgId(7)), None)
        .await
        .unwrap();
    let t8 = h
        .admin
        .create_token(PrincipalId(80), Scope::Org(OrgId(8)), None)
        .await
        .unwrap();
    let leader = h.c.leader_of(0).await.unwrap();
    let ch = channel(&h.addr(leader)).await;
    let totals = |t: &str| {
        bearer(
            typed::query::query_request(0, false, &query::Query::Totals),
            Some(t),
        )
    };
    let before = h.head_seq(0).await;
    let started = Instant::now();
    const ROUNDS: usize = 4;
    const FLOOD: usize = 1_100;
    for _ in 0..ROUNDS {
        // More of org 7's refused reads than the whole buffer holds, as fast as the
        // node answers them (within org 7's read burst: each is a denial, not a rate
        // refusal) ...
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (mut a, t7) = (api(ch.clone()), t7.clone());
            tasks.push(tokio::spawn(async move {
                let mut codes = Vec::new();
                for _ in 0..FLOOD / 32 + 1 {
                    let q = bearer(
                        typed::query::query_request(0, false, &query::Query::Totals),
                        Some(&t7),
                    );
                    codes.push(a.query(q).await.unwrap_err().code());
                }
                codes
            }));
        }
        for t in tasks {
            for code in t.await.unwrap() {
                assert_eq!(code, Code::PermissionDenied);
            }
        }
        // ... then one of org 8's.
        let e = api(ch.clone()).query(totals(&t8)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    }
    let secs = started.elapsed().as_secs() + 2;
    // Two flushes (every second) for the last ones.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let mut denied = std::collections::BTreeMap::<u64, usize>::new();
    h.admin
        .audit_export(0, ::allot_client::AuditFilter::default(), before, |ev| {
            if let EventBody::Denied {
                caller: Actor::Tenant { org, .. },
                ..
            } = &ev.body
            {
                *denied.entry(org.0).or_default() += 1;
            }
            Ok(())
        })
        .await
        .unwrap();
    eprintln!("defect 11: audited denials by org {denied:?} in ~{secs} s");
    assert_eq!(
        denied.get(&8),
        Some(&ROUNDS),
        "each of org 8's denials is audited"
    );
    let org7 = denied.get(&7).copied().unwrap_or(0);
    assert!(
        org7 >= 1 && org7 as u64 <= DENIALS_PENDING_PER_CALLER_MAX as u64 * secs,
        "org 7 keeps its share per flush: {org7}"
    );
}

/// Defect 12: a tenant's audit page scanned up to 100,000 events of the shard-wide
/// trail to find its own, for one read token; a tenant with no events of its own made
/// the node decode the whole trail over and over (5,000 pages in its read burst). Now a
/// tenant's page looks at most `AUDIT_SCAN_MAX_TENANT` (10,000) events and says where
/// to go on; an admin's still looks at up to 100,000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_12_a_tenants_audit_page_scans_a_bounded_part_of_the_trail() {
    use allot_node::limits::AUDIT_SCAN_MAX_TENANT;
    let h = secured(1).await;
    let tenant = h.orgs_7_and_8().await;
    let from = h.head_seq(0).await;
    // Org 7's trail grows past the tenant's bound (one event a user).
    let users = AUDIT_SCAN_MAX_TENANT as u64 + 2_000;
    h.create_users(OrgId(7), users).await;
    let head = h.head_seq(0).await;
    assert!(head - from > AUDIT_SCAN_MAX_TENANT as u64, "{from}..{head}");
    let page = tenant
        .audit(0, ::allot_client::AuditFilter::default(), from, 100)
        .await
        .unwrap();
    assert!(page.events.is_empty(), "none of org 8's");
    assert!(
        page.next_seq > from && page.next_seq <= from + AUDIT_SCAN_MAX_TENANT as u64,
        "the page looked at {} events",
        page.next_seq - from
    );
    // Paging on reaches the head.
    let mut at = page.next_seq;
    while at < head {
        let p = tenant
            .audit(0, ::allot_client::AuditFilter::default(), at, 100)
            .await
            .unwrap();
        assert!(p.next_seq > at);
        at = p.next_seq;
    }
    // An admin's page looks further.
    let admin = h
        .admin
        .audit(
            0,
            ::allot_client::AuditFilter {
                org: Some(OrgId(8)),
                ..Default::default()
            },
            from,
            100,
        )
        .await
        .unwrap();
    assert!(admin.events.is_empty() && admin.next_seq >= head);
}

/// Defect 14: a tenant's audit events carried the shard-wide chain's `prev_hash` and
/// `hash`, and the chain runs through every org's events. With two events of its own
/// around one of another org's, a tenant could test guesses about that event offline —
/// hash its guess onto its first event's `hash` and compare with its second event's
/// `prev_hash` (did org 7 just add a user, with this id, at this time?). Here the
/// "guess" is the true event, read by the admin: it confirmed on the old node. Now a
/// tenant's events carry no chain hashes; the admin's still do, and still verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_14_a_tenant_cannot_check_guesses_about_another_orgs_events() {
    let h = secured(1).await;
    let tenant = h.orgs_7_and_8().await;
    let from = h.head_seq(0).await;
    for (org, user) in [(8, 81), (7, 71), (8, 82)] {
        h.admin.create_user(OrgId(org), UserId(user)).await.unwrap();
    }
    let mine = tenant
        .audit(0, ::allot_client::AuditFilter::default(), from, 100)
        .await
        .unwrap()
        .events;
    let all = h
        .admin
        .audit(0, ::allot_client::AuditFilter::default(), from, 100)
        .await
        .unwrap()
        .events;
    assert!(mine.iter().all(|e| e.org == Some(OrgId(8))), "{mine:?}");
    let (first, last) = (mine.first().unwrap(), mine.last().unwrap());
    let between: Vec<_> = all
        .iter()
        .filter(|e| e.seq > first.seq && e.seq < last.seq)
        .collect();
    assert!(
        between.iter().any(|e| e.org == Some(OrgId(7))),
        "org 7's event lies between two of org 8's: {all:?}"
    );
    // The tenant's check of its guesses: chain them onto its first event's hash.
    let mut scratch = Vec::new();
    let guessed = between.iter().fold(first.hash, |prev, e| {
        let mut e = (*e).clone();
        e.prev_hash = prev;
        e.compute_hash(&mut scratch)
    });
    assert_ne!(
        guessed, last.prev_hash,
        "the tenant's events confirm a guess about org 7's event"
    );
    assert!(mine
        .iter()
        .all(|e| e.hash == [0; 32] && e.prev_hash == [0; 32]));
    // The admin's page is the chain itself.
    let anchor = allot_statemachine::AuditChain {
        next_seq: all[0].seq,
        head: all[0].prev_hash,
    };
    allot_statemachine::verify_chain(&anchor, &all).unwrap();
}

/// Defect 15: a project token's own replies and trail carried the org pool's credit and
/// its sibling projects' buckets (`redact`; the rules are proven in
/// `tenancy.rs::a_project_token_sees_neither_its_siblings_nor_the_org_pool`). Here, the
/// node's wiring: a reply, the same request replayed, and the audit page of the refusal
/// all show the project its own figures only; the org token sees the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_15_a_project_tokens_replies_and_trail_show_its_project_only() {
    let h = secured(1).await;
    let org = OrgId(7);
    h.admin.create_org(org).await.unwrap();
    for p in [71, 72] {
        h.admin.create_project(org, ProjectId(p)).await.unwrap();
    }
    h.admin.create_user(org, UserId(700)).await.unwrap();
    h.admin
        .set_prices(vec![(GpuType::new("A100"), 2_000_000)])
        .await
        .unwrap();
    h.admin
        .issue_grant(
            org,
            allot_statemachine::workload::grant(1, Account::Org(org), 9_000_000_000),
        )
        .await
        .unwrap();
    let token = |principal, scope| {
        let admin = &h.admin;
        async move {
            admin
                .create_token(PrincipalId(principal), scope, None)
                .await
                .unwrap()
        }
    };
    let project = h.client_with(
        token(
            90,
            Scope::Project {
                org,
                project: ProjectId(71),
            },
        )
        .await,
    );
    let org_token = h.client_with(token(91, Scope::Org(org)).await);
    let spec = |hold: u64, amount_micro: u64| HoldSpec {
        hold: HoldId(hold),
        project: ProjectId(71),
        user: UserId(700),
        tier: Tier::PAID,
        gpu_types: vec![GpuType::new("A100")],
        amount_micro,
    };
    let refusal = |r: Result<Reply, ::allot_client::Error>| match r {
        Err(::allot_client::Error::Rejected(e)) => e,
        other => panic!("{other:?}"),
    };
    let too_much = 10_000_000_000;
    let seen = refusal(project.create_hold(org, spec(5, too_much)).await);
    assert_eq!(
        seen,
        CommandError::InsufficientCredits {
            needed: too_much,
            available: 0
        },
        "the org pool's credit is not the project's to see"
    );
    let whole = refusal(org_token.create_hold(org, spec(6, too_much)).await);
    assert_eq!(
        whole,
        CommandError::InsufficientCredits {
            needed: too_much,
            available: 9_000_000_000
        }
    );
    // A hold that draws on the org's bucket: the project does not see which.
    match project.create_hold(org, spec(7, 1_000_000)).await.unwrap() {
        Reply::HoldCreated { draws, .. } => assert!(draws.is_empty(), "{draws:?}"),
        other => panic!("{other:?}"),
    }
    // Its trail: the refusals show the same.
    let page = project
        .audit(0, ::allot_client::AuditFilter::default(), 0, 1_000)
        .await
        .unwrap();
    let outcomes: Vec<_> = page
        .events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Command {
                outcome: Err(e @ CommandError::InsufficientCredits { .. }),
                ..
            } => Some(e.clone()),
            _ => None,
        })
        .collect();
    // Both refusals in project 71's account, the org token's included, show the
    // project's figures.
    assert_eq!(outcomes, vec![seen.clone(), seen], "{:?}", page.events);
}

/// Defect 13: a usage ranking looks at every account of its level in the org — up to
/// the org's 500,000 users — under the shard's state lock, for one read token; a tenant
/// that filled its user quota could keep apply waiting with 1,000 rankings a second.
/// Now a ranking costs one more read unit per 1,000 accounts it ranks
/// (`query::read_units`): org 7, with 30,000 users, gets ~31× fewer rankings out of its
/// read burst, and another org's reads are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_13_a_usage_ranking_pays_for_the_accounts_it_ranks() {
    use allot_node::ratelimit::DEFAULT_LIMITS;
    use allot_statemachine::query::{Query, UsageLevel, UsageQuery};
    let h = secured(1).await;
    for org in [7, 8] {
        h.admin.create_org(OrgId(org)).await.unwrap();
    }
    let users = 30_000u64;
    h.create_users(OrgId(7), users).await;
    let token = |p, org| {
        h.admin
            .create_token(PrincipalId(p), Scope::Org(OrgId(org)), None)
    };
    let (t7, t8) = (token(70, 7).await.unwrap(), token(80, 8).await.unwrap());
    let ranking = |org: u64, t: &str| {
        bearer(
            typed::query::query_request(
                0,
                true,
                &Query::Usage(UsageQuery {
                    level: UsageLevel::User,
                    org: Some(OrgId(org)),
                    period: BudgetPeriod::Month,
                    limit: 10,
                }),
            ),
            Some(t),
        )
    };
    let leader = h.c.leader_of(0).await.unwrap();
    let mut a = api(channel(&h.addr(leader)).await);
    let started = Instant::now();
    let mut passed = 0u64;
    let refusal = loop {
        match a.query(ranking(7, &t7)).await {
            Ok(_) => passed += 1,
            Err(e) => break e,
        }
        assert!(passed < 10_000, "org 7's rankings were never limited");
    };
    let took = started.elapsed().as_secs_f64();
    assert_eq!(reason(&refusal), "RATE_LIMITED", "{refusal:?}");
    let r = DEFAULT_LIMITS.read;
    let units = 1 + users / 1_000;
    let most = (r.burst as f64 + took * r.per_sec as f64) / units as f64 + 2.0;
    eprintln!(
        "defect 13: {passed} rankings of {users} users passed in {took:.2} s (at most {most:.0})"
    );
    assert!(
        passed >= 1 && (passed as f64) <= most,
        "{passed} rankings (at most {most:.0})"
    );
    // Another org's reads are another budget.
    a.query(ranking(8, &t8)).await.expect("org 8 reads");
}

fn blank_entries(prev: u64, n: usize, term: u64) -> Vec<LogEntry> {
    (0..n)
        .map(|i| LogEntry {
            log_id: LogId::new(
                openraft::CommittedLeaderId::new(term, 2),
                prev + 1 + i as u64,
            ),
            payload: openraft::EntryPayload::Blank,
        })
        .collect()
}

fn append_msg(shard: u32, w: &AppendWire) -> RaftMessage {
    RaftMessage {
        shard,
        payload: codec::encode(w),
    }
}

/// Defect 3: near-limit Raft messages cost far more memory than they carry, and were
/// decoded before the peer was authenticated. Now the Raft service refuses an
/// unauthenticated caller from its headers, a message above `RAFT_MESSAGE_MAX` by its
/// length, and an AppendEntries of more than `APPEND_ENTRIES_MAX` entries while it is
/// decoded; memory stays bounded by message size × the messages handled at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_3_raft_messages_cost_what_they_carry_and_need_a_peer() {
    let mut h = secured(1).await;
    let target = h.addr(1);
    let idle = h.rss_now();
    let secret = h.secret();
    // ~256 MiB of blank entries (four at once in the report). Without the secret the
    // body is never read.
    let wire = AppendWire {
        vote: Vote::new_committed(1, 2),
        prev_log_id: None,
        leader_commit: None,
        entries: blank_entries(0, 3_000_000, 1),
    };
    let big = append_msg(0, &wire);
    eprintln!("defect 3: {} MiB AppendEntries", big.payload.len() >> 20);
    let mut calls = Vec::new();
    for with_secret in [false, false, true, true] {
        let ch = channel(&target).await;
        let msg = big.clone();
        let secret = secret.clone();
        calls.push(tokio::spawn(async move {
            let r = if with_secret {
                as_peer(msg, &secret)
            } else {
                tonic::Request::new(msg)
            };
            (with_secret, raft(ch).append(r).await.unwrap_err())
        }));
    }
    for c in calls {
        let (with_secret, e) = c.await.unwrap();
        if with_secret {
            assert!(
                matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
                "{e:?}"
            );
        } else {
            assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
            assert_eq!(reason(&e), "PEER_UNAUTHENTICATED");
        }
    }
    // Just under the bound, from a peer: 16 at once, each refused while decoding (more
    // entries than one AppendEntries may carry).
    let per_entry = codec::encoded_len(&blank_entries(1 << 20, 1, 1)) as usize;
    let n = (RAFT_MESSAGE_MAX - 4096) / per_entry;
    let near = append_msg(
        0,
        &AppendWire {
            vote: Vote::new_committed(1, 2),
            prev_log_id: None,
            leader_commit: None,
            entries: blank_entries(0, n, 1),
        },
    );
    assert!(
        near.payload.len() < RAFT_MESSAGE_MAX,
        "{}",
        near.payload.len()
    );
    let mut calls = Vec::new();
    for _ in 0..16 {
        let ch = channel(&target).await;
        let msg = as_peer(near.clone(), &secret);
        calls.push(tokio::spawn(async move {
            raft(ch).append(msg).await.unwrap_err()
        }));
    }
    for c in calls {
        let e = c.await.unwrap();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    h.every_shard_commits(Duration::from_secs(5), 100).await;
    let grew = h.assert_memory_within(&idle, 256);
    eprintln!("defect 3: peak RSS growth {grew} MiB (budget 256)");
    h.assert_all_running();
}

/// Defect 4: a forged `Raft.Vote` with term u64::MAX killed the replica (openraft's
/// `term + 1` overflows). Now refused before openraft sees it, like every term or index
/// above 2^62 and every vote in the receiver's own name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_4_a_forged_vote_of_the_largest_term_is_refused() {
    let mut h = secured(1).await;
    let secret = h.secret();
    for id in 1..=3u64 {
        let mut r = raft(channel(&h.addr(id)).await);
        for (term, node, last) in [
            (u64::MAX, 99, None),
            (TERM_MAX + 1, 2, None),
            (5, id, None),
            (
                5,
                99,
                Some(LogId::new(openraft::CommittedLeaderId::new(1, 1), u64::MAX)),
            ),
        ] {
            let vote = openraft::raft::VoteRequest {
                vote: Vote::new(term, node),
                last_log_id: last,
            };
            let e = r
                .vote(as_peer(
                    RaftMessage {
                        shard: 0,
                        payload: codec::encode(&vote),
                    },
                    &secret,
                ))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert_eq!(reason(&e), "PEER_MESSAGE_REFUSED");
        }
    }
    // Every replica is alive and the shard commits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.assert_all_running();
    h.every_shard_commits(Duration::from_secs(5), 100).await;
}

/// The peer link (`allot_node::link`) is the Raft service by another road, and an
/// attacker who reaches the port gets no more from it: a hello without the peer secret
/// is refused before anything else is read; a frame longer than the bound closes the
/// connection before its body is read; a hello that never ends is dropped; an unknown
/// request kind is refused; a forged vote meets the same guard as over gRPC; and
/// near-limit AppendEntries from many callers at once cost bounded memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_link_needs_the_secret_bounds_its_frames_and_checks_what_it_carries() {
    use allot_node::limits::{LINK_FRAME_MAX as FRAME_MAX, LINK_HELLO_TIMEOUT as HELLO_TIMEOUT};
    use allot_node::link::{Kind, Link, LinkError, MAGIC, MAGIC_WITH_CLUSTER};
    use allot_node::peer::PeerCredential;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut h = secured(1).await;
    let target = h.addr(1);
    let secret = h.secret();
    let idle = h.rss_now();
    let hello = |presented: &str| {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&(presented.len() as u16).to_le_bytes());
        b.extend_from_slice(presented.as_bytes());
        b
    };
    let cluster = allot_node::identity::parse(secret.cluster.as_bytes()).unwrap();
    // A member's hello: the secret and a cluster id.
    let member_hello = |presented: &str, id: &[u8; 16]| {
        let mut b = MAGIC_WITH_CLUSTER.to_vec();
        b.extend_from_slice(&(presented.len() as u16).to_le_bytes());
        b.extend_from_slice(presented.as_bytes());
        b.push(16);
        b.extend_from_slice(id);
        b
    };
    let member = |id: Option<[u8; 16]>| {
        let c = PeerCredential::new(Some(&secret.secret)).unwrap();
        c.with_identity(std::sync::Arc::new(
            allot_node::identity::Identity::in_memory(id, false),
        ))
    };
    // Reads until the node closes the connection (bounded wait).
    // (A close with unread bytes in the node's buffer arrives as a reset: also an end.)
    async fn closed(s: &mut tokio::net::TcpStream, within: Duration) -> Vec<u8> {
        let mut rest = Vec::new();
        match tokio::time::timeout(within, s.read_to_end(&mut rest))
            .await
            .expect("the node closes the connection")
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("reading to the end: {e}"),
        }
        rest
    }

    // 1. No secret, or the wrong one: refused in the hello, then closed.
    for presented in ["", "not-the-cluster-secret-0000000"] {
        let mut s = tokio::net::TcpStream::connect(&target).await.unwrap();
        s.write_all(&hello(presented)).await.unwrap();
        // A request sent at once after the hello is never read.
        s.write_all(&[0xff; 64]).await.unwrap();
        let mut ack = [0u8; 9];
        s.read_exact(&mut ack).await.unwrap();
        assert_eq!(
            (&ack[..8], ack[8]),
            (&MAGIC[..], 1),
            "refused: {presented:?}"
        );
        assert!(closed(&mut s, Duration::from_secs(5)).await.is_empty());
    }
    assert_eq!(
        h.metric(
            1,
            "allot_peer_link_connections_total{result=\"unauthenticated\"}"
        )
        .await,
        2.0
    );
    let vote = |term: u64| {
        codec::encode(&openraft::raft::VoteRequest::<u64> {
            vote: Vote::new(term, 99),
            last_log_id: None,
        })
    };
    let wrong = Link::new(
        target.clone(),
        PeerCredential::new(Some("not-the-cluster-secret-0000000")).unwrap(),
    );
    // Refused in its hello; then its calls are refused (not sent) until it tries again.
    match wrong.connect(Duration::from_secs(5)).await {
        Err(LinkError::Status(s)) => assert_eq!(s.code(), Code::PermissionDenied, "{s:?}"),
        other => panic!("a link without the secret: {other:?}"),
    }
    match wrong
        .call(Kind::Vote, 0, &vote(5), Duration::from_secs(5))
        .await
    {
        Err(LinkError::Status(s)) => assert_eq!(s.code(), Code::PermissionDenied, "{s:?}"),
        other => panic!("a link without the secret: {other:?}"),
    }
    assert_eq!(
        h.metric(
            1,
            "allot_peer_link_connections_total{result=\"unauthenticated\"}"
        )
        .await,
        3.0
    );

    // 2. With the secret, the gRPC service's guards: a forged vote of the largest term.
    let link = Link::new(target.clone(), member(Some(cluster)));
    link.connect(Duration::from_secs(5))
        .await
        .expect("the link connects");
    for term in [u64::MAX, TERM_MAX + 1] {
        match link
            .call(Kind::Vote, 0, &vote(term), Duration::from_secs(5))
            .await
        {
            Err(LinkError::Status(s)) => assert_eq!(s.code(), Code::InvalidArgument, "{s:?}"),
            other => panic!("a forged vote of term {term}: {other:?}"),
        }
    }

    // 2b. With the secret, from another cluster (DESIGN §68) — a node of an earlier
    // release's data dir (no id), or of another backup set: refused in the hello.
    let other_cluster = "allot_peer_link_connections_total{result=\"other_cluster\"}";
    let mut ack = [0u8; 9];
    for h_bytes in [
        hello(&secret.secret),
        member_hello(&secret.secret, &[7u8; 16]),
    ] {
        let mut s = tokio::net::TcpStream::connect(&target).await.unwrap();
        s.write_all(&h_bytes).await.unwrap();
        s.read_exact(&mut ack).await.unwrap();
        assert_eq!(ack[8], 2, "another cluster's hello is refused");
    }
    for id in [None, Some([7u8; 16])] {
        match Link::new(target.clone(), member(id))
            .connect(Duration::from_secs(5))
            .await
        {
            Err(LinkError::Status(s)) => assert!(s.message().contains("another cluster"), "{s:?}"),
            other => panic!("a link of another cluster: {other:?}"),
        }
    }
    assert_eq!(h.metric(1, other_cluster).await, 4.0);

    // 3. A frame longer than the bound: closed before its body is read.
    let mut s = tokio::net::TcpStream::connect(&target).await.unwrap();
    s.write_all(&member_hello(&secret.secret, &cluster))
        .await
        .unwrap();
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack[8], 0, "the secret is accepted");
    s.write_all(&((FRAME_MAX + 1) as u32).to_le_bytes())
        .await
        .unwrap();
    assert!(closed(&mut s, Duration::from_secs(5)).await.is_empty());

    // 4. An unknown request kind: refused, the connection stays usable.
    let mut s = tokio::net::TcpStream::connect(&target).await.unwrap();
    s.write_all(&member_hello(&secret.secret, &cluster))
        .await
        .unwrap();
    s.read_exact(&mut ack).await.unwrap();
    let mut frame = Vec::new();
    frame.extend_from_slice(&(17u32 + 3).to_le_bytes());
    frame.extend_from_slice(&42u64.to_le_bytes());
    frame.push(9);
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&1000u32.to_le_bytes());
    frame.extend_from_slice(b"abc");
    s.write_all(&frame).await.unwrap();
    let mut reply = [0u8; 4 + 9];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(u64::from_le_bytes(reply[4..12].try_into().unwrap()), 42);
    assert_eq!(reply[12], Code::Unimplemented as u8);

    // 5. A hello that never ends is dropped.
    let mut s = tokio::net::TcpStream::connect(&target).await.unwrap();
    s.write_all(MAGIC).await.unwrap();
    let began = Instant::now();
    closed(&mut s, HELLO_TIMEOUT + Duration::from_secs(3)).await;
    assert!(began.elapsed() >= HELLO_TIMEOUT - Duration::from_millis(100));

    // 6. Sixteen near-limit AppendEntries at once on one link, each refused while it is
    // decoded (more entries than one AppendEntries may carry), in bounded memory.
    let per_entry = codec::encoded_len(&blank_entries(1 << 20, 1, 1)) as usize;
    let n = (RAFT_MESSAGE_MAX - 4096) / per_entry;
    let near = codec::encode(&AppendWire {
        vote: Vote::new_committed(1, 2),
        prev_log_id: None,
        leader_commit: None,
        entries: blank_entries(0, n, 1),
    });
    let link = std::sync::Arc::new(link);
    let near = std::sync::Arc::new(near);
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let (link, near) = (link.clone(), near.clone());
            tokio::spawn(async move {
                link.call(Kind::Append, 0, &near, Duration::from_secs(20))
                    .await
            })
        })
        .collect();
    for c in calls {
        match c.await.unwrap() {
            Err(LinkError::Status(s)) => assert!(
                matches!(s.code(), Code::InvalidArgument | Code::ResourceExhausted),
                "{s:?}"
            ),
            other => panic!("a near-limit AppendEntries: {other:?}"),
        }
    }
    h.every_shard_commits(Duration::from_secs(5), 120).await;
    let grew = h.assert_memory_within(&idle, 256);
    eprintln!("peer link: peak RSS growth {grew} MiB (budget 256)");
    h.assert_all_running();
}

fn forged_meta(term: u64, index: u64) -> SnapshotMeta {
    let last = LogId::new(openraft::CommittedLeaderId::new(term, 99), index);
    let nodes = std::collections::BTreeMap::from([(2u64, openraft::BasicNode::new("x:1"))]);
    SnapshotMeta {
        last_log_id: Some(last),
        last_membership: openraft::StoredMembership::new(
            Some(last),
            openraft::Membership::new(vec![std::collections::BTreeSet::from([2u64])], nodes),
        ),
        snapshot_id: "forged".into(),
    }
}

/// A chunk of snapshot `id` from a leader (node 99) nobody elected, at `term`.
fn forged_chunk(term: u64, id: &str, offset: u64, total: u64, data: Vec<u8>) -> SnapshotChunk {
    SnapshotChunk {
        vote: Vote::new_committed(term, 99),
        meta: SnapshotMeta {
            snapshot_id: id.into(),
            ..forged_meta(term, 1 << 40)
        },
        total_bytes: total,
        offset,
        data,
    }
}

/// Defect 5: a forged snapshot chunk at offset 3 GiB made a follower allocate and zero
/// 3 GiB (2^40: until the machine ran out). Now chunks must arrive in order within the
/// size the first declared and `SNAPSHOT_BYTES_MAX`; memory grows only with bytes
/// received; a snapshot that does not decode is refused before openraft installs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_5_a_forged_snapshot_chunk_allocates_nothing() {
    let mut h = secured(1).await;
    let secret = h.secret();
    let idle = h.rss_now();
    let term = 1_000;
    let chunk =
        |offset: u64, total: u64, data: Vec<u8>| forged_chunk(term, "forged", offset, total, data);
    for id in 1..=3u64 {
        let mut r = raft(channel(&h.addr(id)).await);
        for (c, code) in [
            (
                chunk(3 << 30, 4 << 30, vec![1; 1024]),
                Code::FailedPrecondition,
            ),
            (
                chunk(1 << 40, (1 << 40) + 1024, vec![1; 1024]),
                Code::InvalidArgument,
            ),
            (
                chunk(0, SNAPSHOT_BYTES_MAX + 1, vec![1; 16]),
                Code::InvalidArgument,
            ),
            (chunk(10, 20, vec![1; 16]), Code::InvalidArgument),
            // Complete, in order, but not a state: refused, not installed.
            (chunk(0, 64, vec![7; 64]), Code::InvalidArgument),
        ] {
            let e = r
                .snapshot(as_peer(
                    RaftMessage {
                        shard: 0,
                        payload: codec::encode(&c),
                    },
                    &secret,
                ))
                .await
                .unwrap_err();
            assert_eq!(
                e.code(),
                code,
                "offset {} of {}: {e:?}",
                c.offset,
                c.total_bytes
            );
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.assert_all_running();
    let grew = h.assert_memory_within(&idle, 64);
    eprintln!("defect 5: peak RSS growth {grew} MiB");
    h.every_shard_commits(Duration::from_secs(5), 100).await;
}

/// A snapshot being received was kept in memory up to its declared size (then 16 GiB,
/// more than the state codec could ever decode): anyone reaching the peer port of a
/// node without peer authentication — and any peer with it — could make a follower hold
/// that much. Now the chunks go to a file under the data dir: 256 MiB of an unfinished
/// snapshot cost the follower one chunk of memory, the file holds exactly what arrived,
/// and a new snapshot starting at 0 replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_being_received_is_kept_on_disk_not_in_memory() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: u64 = 256;
    let mut h = secured(1).await;
    let secret = h.secret();
    let leader = h.c.leader_of(0).await.unwrap();
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    let idle = h.rss_now();
    let term = 1_000;
    let total = 1u64 << 30;
    let chunk = |offset: u64, id: &str, data: Vec<u8>| forged_chunk(term, id, offset, total, data);
    let mut r = raft(channel(&h.addr(follower)).await);
    let started = Instant::now();
    for i in 0..CHUNKS {
        r.snapshot(as_peer(
            RaftMessage {
                shard: 0,
                payload: codec::encode(&chunk(i * CHUNK as u64, "big", vec![7; CHUNK])),
            },
            &secret,
        ))
        .await
        .unwrap();
    }
    let grew = h.assert_memory_within(&idle, 64);
    eprintln!("snapshot: peak RSS growth {grew} MiB (budget 64)");
    let file =
        h.c.dir
            .join(format!("node-{follower}"))
            .join("incoming")
            .join("shard-0.snapshot");
    let on_disk = std::fs::metadata(&file).unwrap().len();
    eprintln!(
        "snapshot: {CHUNKS} chunks of 1 MiB received in {:?}; {} MiB on disk",
        started.elapsed(),
        on_disk >> 20
    );
    assert_eq!(
        on_disk,
        CHUNKS * CHUNK as u64,
        "the file holds what arrived"
    );
    // Another snapshot from its start replaces the unfinished one.
    r.snapshot(as_peer(
        RaftMessage {
            shard: 0,
            payload: codec::encode(&chunk(0, "other", vec![1; 16])),
        },
        &secret,
    ))
    .await
    .unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 16);
    h.assert_all_running();
    h.every_shard_commits(Duration::from_secs(5), 100).await;
}

/// Defect 6: cancelled `WatchAssignments` streams were released only when the node's
/// assignments next changed. Now a stream ends as soon as its client goes away (the
/// open-streams gauge falls back at once, with no assignment change), and streams per
/// principal are bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_6_cancelled_streams_are_released_at_once() {
    let mut h = secured(1).await;
    let id = 1;
    let mut agent = api(channel(&h.addr(id)).await);
    let watch = || {
        bearer(
            pb::WatchAssignmentsRequest { shard: 0, node: 5 },
            Some(&h.token),
        )
    };
    // 200 rounds of the principal's whole allowance, each cancelled: none is refused,
    // so each was released before the next round.
    let per = allot_node::limits::STREAMS_PER_PRINCIPAL_MAX;
    for round in 0..200 {
        let mut open = Vec::new();
        for _ in 0..per {
            let mut s = agent.watch_assignments(watch()).await.unwrap().into_inner();
            // The first message (the current assignments) arrives.
            s.message().await.unwrap().unwrap();
            open.push(s);
        }
        if round == 0 {
            let e = agent.watch_assignments(watch()).await.unwrap_err();
            assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        }
        drop(open);
        let deadline = Instant::now() + Duration::from_secs(2);
        while h.metric(id, "allot_open_streams").await > 0.0 {
            assert!(
                Instant::now() < deadline,
                "round {round}: cancelled streams still open"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    h.assert_all_running();
}

/// Defect 17: a `WatchAssignments` stream resolved its caller's token once, when it
/// opened, and went on pushing the node's assignments (every org's jobs placed there)
/// after the token was revoked, for as long as the client kept the stream. Now the token
/// is resolved again at every change of the shard's state, and a stream whose token no
/// longer resolves ends UNAUTHENTICATED, recorded as a denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_17_a_stream_ends_when_its_token_is_revoked() {
    use ::allot_statemachine::security::Scope;
    use ::allot_statemachine::NodeId;
    let mut h = secured(1).await;
    let tokens = [
        (PrincipalId(60), Scope::Admin),
        (PrincipalId(61), Scope::Agent(NodeId(5))),
    ];
    let mut streams = Vec::new();
    for (principal, scope) in tokens {
        let token = h.admin.create_token(principal, scope, None).await.unwrap();
        let mut a = api(channel(&h.addr(1)).await);
        let m = pb::WatchAssignmentsRequest { shard: 0, node: 5 };
        let mut s = a
            .watch_assignments(bearer(m, Some(&token)))
            .await
            .unwrap()
            .into_inner();
        s.message().await.unwrap().expect("the current set");
        streams.push((principal, s));
    }
    for (principal, mut s) in streams {
        h.admin.revoke_token(None, principal).await.unwrap();
        let end = tokio::time::timeout(Duration::from_secs(10), s.message())
            .await
            .unwrap_or_else(|_| panic!("principal {principal:?}: the stream outlived its token"));
        let e = end.expect_err("the stream ends with an error");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    }
    h.assert_all_running();
}

/// `Admin.Status` answers any authenticated caller, for routing. A tenant's answer
/// carried every shard's applied and log indexes and audit head: how fast another org
/// on its own shard acts, event by event. Now a tenant gets the routing (shards,
/// leaders, terms) with those counters at 0; the operator sees them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_status_shows_routing_not_other_orgs_activity() {
    use ::allot_statemachine::security::Scope;
    let mut h = secured(2).await;
    h.admin.create_org(OrgId(7)).await.unwrap();
    let t7 = h
        .admin
        .create_token(PrincipalId(70), Scope::Org(OrgId(7)), None)
        .await
        .unwrap();
    let mut a = AdminClient::new(channel(&h.addr(1)).await);
    let admin = a
        .status(bearer(StatusRequest {}, Some(&h.token)))
        .await
        .unwrap()
        .into_inner();
    let tenant = a
        .status(bearer(StatusRequest {}, Some(&t7)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(admin.shards.len(), 2);
    assert_eq!(tenant.shards.len(), 2);
    for (op, t) in admin.shards.iter().zip(&tenant.shards) {
        assert!(op.applied_index > 0 && op.audit_head_seq > 0, "{op:?}");
        let counters = |s: &ShardStatus| {
            [
                s.applied_index,
                s.last_log_index,
                s.snapshot_index,
                s.purged_index,
                s.audit_head_seq,
                s.audit_verified_seq,
            ]
        };
        assert_eq!(counters(t), [0; 6], "{t:?}");
        let routing =
            |s: &ShardStatus| (s.shard, s.leader, s.leader_addr.clone(), s.voters.clone());
        assert_eq!(routing(t), routing(op));
    }
    h.assert_all_running();
}

// ---------------------------------------------------------------- also seen

/// Commands carrying a well-formed but unknown, revoked or expired token were
/// replicated, fsynced and audited before apply refused them. Now the leader refuses
/// them at its edge (UNAUTHENTICATED), records the denial, and proposes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tokens_are_refused_at_the_edge_and_never_proposed() {
    let mut h = secured(1).await;
    h.admin.create_org(OrgId(7)).await.unwrap();
    let revoked = h
        .admin
        .create_token(PrincipalId(50), Scope::Org(OrgId(7)), None)
        .await
        .unwrap();
    h.admin
        .revoke_token(Some(OrgId(7)), PrincipalId(50))
        .await
        .unwrap();
    let before = h.head_seq(0).await;
    let unknown = ::allot_client::security::generate_token().unwrap();
    for id in 1..=3 {
        let mut a = api(channel(&h.addr(id)).await);
        for t in [&unknown, &revoked] {
            let r = req(77, Command::CreateOrg { org: OrgId(8) });
            let e = a.execute(bearer(exec(0, &[r]), Some(t))).await.unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "node {id}: {e:?}");
            assert_eq!(reason(&e), "UNAUTHENTICATED");
        }
    }
    // Denials reach the trail (the nodes report them about once a second); no command
    // of the callers was applied.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    h.only_denials_since(0, before, None).await;
    assert!(h.head_seq(0).await > before, "the denials were audited");
    h.assert_all_running();
}

/// A rule-version activation reaches the log only if apply would act on it. A tenant's
/// `ActivateVersion` (of a version every node supports, so the cluster version gate
/// passes it) is refused at the edge as apply would refuse it, through every node, and
/// nothing of it is applied. Before, it was proposed and refused inside apply — an
/// entry that stops every replica of the previous release for good (a node rolled back
/// before the operator activates cannot start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_apply_would_refuse_never_reaches_the_log() {
    let mut h = secured(1).await;
    h.admin.create_org(OrgId(7)).await.unwrap();
    let tenant = h
        .admin
        .create_token(PrincipalId(50), Scope::Org(OrgId(7)), None)
        .await
        .unwrap();
    let before = h.head_seq(0).await;
    for id in 1..=3 {
        let mut a = api(channel(&h.addr(id)).await);
        let r = Request {
            org: Some(OrgId(7)),
            ..req(80 + id as u128, Command::ActivateVersion { version: 2 })
        };
        let e = a
            .execute(bearer(exec(0, &[r]), Some(&tenant)))
            .await
            .map(|ok| ok.into_inner())
            .expect_err("refused before the log");
        assert_eq!(reason(&e), "UNAUTHORIZED", "node {id}: {e:?}");
    }
    h.only_denials_since(0, before, None).await;
    h.assert_all_running();
}

/// Reads are rate-limited per org by default (the node's own defaults, no flags): a
/// tenant's queries past the read burst get `RESOURCE_EXHAUSTED` with a retry hint,
/// whichever of its tokens it uses and whether or not it claims to be forwarded;
/// another org's reads still pass meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_rate_limited_per_org_by_default() {
    use allot_node::ratelimit::DEFAULT_LIMITS;
    let mut h = secured(1).await;
    for org in [7, 8] {
        h.admin.create_org(OrgId(org)).await.unwrap();
    }
    let token = |p, org| {
        h.admin
            .create_token(PrincipalId(p), Scope::Org(OrgId(org)), None)
    };
    let (t7a, t7b, t8) = (
        token(70, 7).await.unwrap(),
        token(71, 7).await.unwrap(),
        token(80, 8).await.unwrap(),
    );
    let query = |org: u64, t: &str, forwarded: bool| {
        let mut r = bearer(
            pb::QueryRequest {
                read: Some(pb::Read {
                    shard: Some(0),
                    stale_ok: true,
                }),
                query: Some(pb::query_request::Query::Balance(pb::BalanceQuery {
                    org,
                    account: Some(pb::Account {
                        org: Some(org),
                        project: None,
                    }),
                    horizon_ms: 0,
                })),
            },
            Some(t),
        );
        if forwarded {
            r.metadata_mut()
                .insert(allot_proto::meta::FORWARDED, "1".parse().unwrap());
        }
        r
    };
    let mut a = api(channel(&h.addr(1)).await);
    let started = Instant::now();
    let mut passed = 0u64;
    let refusal = loop {
        // Two tokens of org 7, some calls claiming to be forwarded: one bucket.
        let (t, fwd) = match passed % 3 {
            0 => (&t7a, false),
            1 => (&t7b, false),
            _ => (&t7a, true),
        };
        match a.query(query(7, t, fwd)).await {
            Ok(_) => passed += 1,
            Err(e) => break e,
        }
        assert!(passed < 100_000, "org 7's reads were never limited");
    };
    let took = started.elapsed();
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal:?}");
    assert_eq!(reason(&refusal), "RATE_LIMITED");
    assert!(refusal
        .metadata()
        .get(allot_proto::meta::RETRY_AFTER_MS)
        .is_some());
    // The burst, plus what the rate refilled while the loop ran.
    let r = DEFAULT_LIMITS.read;
    let most = r.burst as u64 + (took.as_secs_f64() * r.per_sec as f64).ceil() as u64 + 1;
    eprintln!(
        "org 7: {passed} reads passed in {took:?} before the limit (burst {}, {}/s)",
        r.burst, r.per_sec
    );
    assert!(
        passed >= r.burst as u64 && passed <= most,
        "{passed} reads (at most {most})"
    );
    // Org 8 is another bucket.
    a.query(query(8, &t8, false))
        .await
        .expect("another org reads");
    h.assert_all_running();
}

/// The largest legal commands commit within a second, alone and as calls that fill
/// whole batches — several at once — and the shard keeps committing afterwards. Two
/// paths: the largest a caller can send (`testkit::largest_commands` without the
/// node's own `RecordDenials`: an admin's `SetPlan`), and the largest of all, a full
/// `RecordDenials`, which only a peer proposes (its edge denials).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_legal_commands_commit_within_a_second() {
    let mut h = secured(1).await;
    let callers_largest = testkit::largest_commands()
        .into_iter()
        .filter(|c| !matches!(c, Command::RecordDenials { .. }))
        .max_by_key(codec::encoded_len)
        .unwrap();
    let size = codec::encoded_len(&callers_largest) as usize;
    assert!(size <= COMMAND_BYTES_MAX, "{size}");
    eprintln!(
        "largest caller command: {} of {size} bytes (bound {COMMAND_BYTES_MAX})",
        callers_largest.name()
    );
    // Apply may refuse it (its ids are the largest legal ones, unknown here): what is
    // timed is the commit; a refusal for its size would mean it never was legal.
    let not_too_big =
        |o: &Result<Reply, CommandError>| !matches!(o, Err(CommandError::LimitReached(_)));
    let started = Instant::now();
    let (outs, _) = h
        .admin
        .execute(0, &[req(1, callers_largest.clone())])
        .await
        .unwrap();
    let alone = started.elapsed();
    assert!(outs.iter().all(not_too_big), "{outs:?}");
    assert!(alone < Duration::from_secs(1), "{alone:?}");
    // Calls of ~1 MiB of them (a whole batch each), four at once.
    let wire_size = exec(0, &[req(1, callers_largest.clone())]).encoded_len();
    let per_call = (allot_node::limits::CLIENT_MESSAGE_MAX - 64 * 1024) / wire_size;
    let mut calls = Vec::new();
    for c in 0..4u64 {
        let admin = h.c.admin_client().unwrap();
        let reqs: Vec<Request> = (0..per_call as u64)
            .map(|i| {
                req(
                    (c as u128 + 1) << 32 | (i as u128 + 1),
                    callers_largest.clone(),
                )
            })
            .collect();
        calls.push(tokio::spawn(async move {
            let started = Instant::now();
            let (outs, _) = admin.execute(0, &reqs).await.unwrap();
            (started.elapsed(), outs)
        }));
    }
    let mut slowest = Duration::ZERO;
    for c in calls {
        let (took, outs) = c.await.unwrap();
        assert_eq!(outs.len(), per_call);
        assert!(outs.iter().all(not_too_big), "{:?}", outs.first());
        slowest = slowest.max(took);
    }
    eprintln!(
        "largest caller command alone: {alone:?}; four calls of {per_call} at once, slowest {slowest:?}"
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");

    // The largest of all: a peer's full denial report, alone and 64 at once (more
    // than one batch's bytes). Each report returns once its entry is applied.
    let largest = testkit::largest_command();
    let Command::RecordDenials { denials, .. } = &largest else {
        panic!("the largest command is {}", largest.name());
    };
    let report_size = codec::encoded_len(&largest);
    let report = |n: u64| {
        let payload = codec::encode(&(n, denials.clone()));
        as_peer(RaftMessage { shard: 0, payload }, &h.secret())
    };
    let leader = h.c.leader_of(0).await.unwrap();
    let mut peer = raft(channel(&h.addr(leader)).await);
    let started = Instant::now();
    peer.report_denials(report(1)).await.unwrap();
    let one_report = started.elapsed();
    let mut reports = Vec::new();
    for n in 0..64 {
        let mut peer = peer.clone();
        // From the members (a report in another node's name is refused).
        let msg = report(n % 3 + 1);
        reports.push(tokio::spawn(async move {
            let started = Instant::now();
            peer.report_denials(msg).await.unwrap();
            started.elapsed()
        }));
    }
    let mut slowest_report = Duration::ZERO;
    for r in reports {
        slowest_report = slowest_report.max(r.await.unwrap());
    }
    eprintln!(
        "largest command (record_denials, {report_size} bytes) alone: {one_report:?}; 64 at once, slowest {slowest_report:?}"
    );
    assert!(one_report < Duration::from_secs(1), "{one_report:?}");
    assert!(
        slowest_report < Duration::from_secs(1),
        "{slowest_report:?}"
    );
    h.every_shard_commits(Duration::from_secs(5), 100).await;
    h.replicas_agree().await;
    h.assert_all_running();
}

// ---------------------------------------------------------------- fuzz

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max as u64 + 1) as usize;
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
    fn big(&mut self) -> u64 {
        let any = self.next();
        *self.pick(&[0, 1, 7, u64::MAX, u64::MAX / 2, 1 << 62, 1 << 63, any])
    }
    fn string(&mut self, max: usize) -> String {
        let n = self.below(max as u64 + 1) as usize;
        (0..n)
            .map(|_| (b'A' + (self.next() % 26) as u8) as char)
            .collect()
    }
}

/// A random command, often out of bounds (long lists and strings, zero and huge
/// numbers, reserved ids).
fn random_command(r: &mut Rng) -> Command {
    let gpu = |r: &mut Rng| GpuType(r.string(24));
    let list = |r: &mut Rng, max: usize| -> usize { r.below(max as u64) as usize };
    match r.below(14) {
        0 => Command::CreateOrg {
            org: OrgId(r.big()),
        },
        1 => Command::SetPrices {
            prices: (0..list(r, 100)).map(|_| (gpu(r), r.big())).collect(),
        },
        2 => Command::IssueGrant(Grant {
            bucket: BucketId(r.big()),
            owner: Account::Org(OrgId(r.big())),
            kind: BucketKind::Promotional,
            amount_micro: r.big(),
            expires_at_ms: Some(r.big()),
            priority: r.next() as u8,
            policy: Some(BucketPolicy {
                gpu_types: (0..list(r, 40)).map(|_| gpu(r)).collect(),
                tiers: (0..list(r, 40)).map(|_| Tier(r.next() as u8)).collect(),
            }),
            source_ref: Some(r.string(400)),
        }),
        3 => Command::RegisterNode(NodeSpec {
            node: NodeId(r.big()),
            gpu_type: gpu(r),
            gpu_count: r.next() as u32,
            gpu_mem_gb: r.next() as u32,
            labels: (0..list(r, 300))
                .map(|_| (r.string(100), r.string(100)))
                .collect(),
            incarnation: 0,
        }),
        4 => Command::SubmitJob(JobSpec {
            job: JobId(r.big()),
            project: ProjectId(r.big()),
            user: UserId(r.big()),
            tier: Tier(r.next() as u8),
            gpu_types: (0..list(r, 40)).map(|_| gpu(r)).collect(),
            gpus: r.next() as u32,
            mem_floor_gb: r.next() as u32,
            preemptible: true,
            checkpointable: false,
            max_duration_ms: r.big(),
        }),
        5 => Command::Transfer {
            from: Account::Org(OrgId(r.big())),
            to: Account::Project(ProjectId(r.big())),
            amount_micro: r.big(),
        },
        6 => Command::JobHeartbeat(JobHeartbeat {
            job: JobId(r.big()),
            attempt: r.next() as u32,
            seq: r.big(),
            progress_ppm: r.next() as u32,
            checkpoint: r.big(),
        }),
        7 => Command::CreateToken {
            principal: PrincipalId(r.big()),
            digest: TokenDigest([r.next() as u8; 32]),
            scope: Scope::Admin,
            expires_at_ms: None,
        },
        8 => Command::RecordDenials {
            node: r.big(),
            denials: (0..list(r, 400))
                .map(|_| Denial {
                    actor: Actor::Anonymous,
                    api: r.string(100),
                    reason: DenialReason::Unauthenticated,
                })
                .collect(),
        },
        9 => Command::Bootstrap {
            principal: PrincipalId(r.big()),
            digest: TokenDigest([r.next() as u8; 32]),
        },
        10 => Command::SetShareWeight {
            scope: BudgetScope::Org(OrgId(r.big())),
            weight: Some(r.next() as u32),
        },
        11 => Command::CreateHold(HoldSpec {
            hold: HoldId(r.big()),
            project: ProjectId(r.big()),
            user: UserId(r.big()),
            tier: Tier(r.next() as u8),
            gpu_types: (0..list(r, 40)).map(|_| gpu(r)).collect(),
            amount_micro: r.big(),
        }),
        12 => Command::Tick,
        _ => Command::FinishJob {
            job: JobId(r.big()),
            attempt: r.next() as u32,
            success: true,
        },
    }
}

/// A random actor a client might claim (the edge overwrites or refuses it).
fn random_actor(r: &mut Rng) -> Actor {
    match r.below(5) {
        0 => Actor::Admin(PrincipalId(r.big())),
        1 => Actor::System,
        2 => Actor::Bearer(TokenDigest([r.next() as u8; 32])),
        3 => Actor::Tenant {
            org: OrgId(r.big()),
            principal: PrincipalId(1),
        },
        _ => Actor::Anonymous,
    }
}

/// A token that resolves to nobody: missing, malformed, unknown, or revoked.
fn hostile_token(r: &mut Rng, revoked: &str) -> Option<String> {
    match r.below(5) {
        0 => None,
        1 => Some(r.string(8)),
        2 => Some(format!("alt_{}", r.string(43))),
        3 => Some(revoked.to_string()),
        _ => Some(String::from_utf8_lossy(&r.bytes(60)).into_owned()),
    }
}

/// A Raft message a peer could send that a guard must refuse (each breaks one rule).
fn hostile_append(r: &mut Rng, me: u64) -> AppendWire {
    let lid = |t: u64, n: u64, i: u64| LogId::new(openraft::CommittedLeaderId::new(t, n), i);
    let term = 2 + r.below(1_000);
    let base = AppendWire {
        vote: Vote::new_committed(term, 2 + r.below(2)),
        prev_log_id: Some(lid(1, 1, 1 << 40)),
        leader_commit: None,
        entries: Vec::new(),
    };
    match r.below(7) {
        0 => AppendWire {
            vote: Vote::new_committed(u64::MAX - r.below(3), 2),
            ..base
        },
        1 => AppendWire {
            vote: Vote::new(term, 2),
            ..base
        },
        2 => AppendWire {
            vote: Vote::new_committed(term, me),
            ..base
        },
        3 => AppendWire {
            entries: vec![LogEntry {
                log_id: lid(term, 2, (1 << 40) + 5),
                payload: openraft::EntryPayload::Blank,
            }],
            ..base
        },
        4 => AppendWire {
            entries: vec![LogEntry {
                log_id: lid(term + 1, 2, (1 << 40) + 1),
                payload: openraft::EntryPayload::Normal(Batch {
                    logical_time_ms: 0,
                    requests: r.bytes(64),
                }),
            }],
            ..base
        },
        5 => AppendWire {
            leader_commit: Some(lid(term, 2, u64::MAX)),
            ..base
        },
        _ => AppendWire {
            entries: vec![LogEntry {
                log_id: lid(term, 2, (1 << 40) + 1),
                // Three configurations (a joint has at most two), one of them empty.
                payload: openraft::EntryPayload::Membership(openraft::Membership::new(
                    vec![
                        std::collections::BTreeSet::from([9u64]),
                        std::collections::BTreeSet::new(),
                        std::collections::BTreeSet::from([8u64]),
                    ],
                    std::collections::BTreeMap::<u64, openraft::BasicNode>::new(),
                )),
            }],
            ..base
        },
    }
}

/// A random read, often of ids no one uses and limits out of range.
fn random_query(r: &mut Rng) -> query::Query {
    use query::{JobFilter, Query};
    let org = OrgId(r.big());
    match r.below(6) {
        0 => Query::Jobs(JobFilter {
            org: Some(org),
            limit: r.next() as u32,
            ..Default::default()
        }),
        1 => Query::Job(org, JobId(r.big())),
        2 => Query::Balance {
            org,
            account: Account::Org(org),
            horizon_ms: r.big(),
        },
        3 => Query::Totals,
        4 => Query::StateHash,
        _ => Query::Assignments(NodeId(r.big())),
    }
}

/// `bytes` with a few bytes overwritten, cut short, or grown by garbage.
fn mangle(r: &mut Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    match r.below(3) {
        0 if !bytes.is_empty() => {
            for _ in 0..1 + r.below(8) {
                let i = r.below(bytes.len() as u64) as usize;
                bytes[i] = r.next() as u8;
            }
        }
        1 => bytes.truncate(r.below(bytes.len() as u64 + 1) as usize),
        _ => bytes.extend(r.bytes(64)),
    }
    bytes
}

/// Every method the node serves, as (path, streams): the services of allot's own
/// descriptors, gRPC health and server reflection.
fn every_method() -> &'static [(&'static str, bool)] {
    static METHODS: std::sync::OnceLock<Vec<(&'static str, bool)>> = std::sync::OnceLock::new();
    METHODS.get_or_init(|| {
        let mut out = Vec::new();
        for set in [
            allot_proto::FILE_DESCRIPTOR_SET,
            tonic_health::pb::FILE_DESCRIPTOR_SET,
        ] {
            let fds = prost_types::FileDescriptorSet::decode(set).unwrap();
            for f in &fds.file {
                for svc in &f.service {
                    for m in &svc.method {
                        let path = format!("/{}.{}/{}", f.package(), svc.name(), m.name());
                        let streams = m.server_streaming() || m.client_streaming();
                        out.push((&*Box::leak(path.into_boxed_str()), streams));
                    }
                }
            }
        }
        out.push((
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            true,
        ));
        out.push((
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            true,
        ));
        out
    })
}

/// The fuzz reaches every service and method the node serves.
#[test]
fn the_fuzz_knows_every_method() {
    let paths: Vec<&str> = every_method().iter().map(|(p, _)| *p).collect();
    for p in [
        "/allot.api.v1.Api/Execute",
        "/allot.api.v1.Api/Query",
        "/allot.api.v1.Api/WatchEvents",
        "/allot.api.v1.Api/WatchAssignments",
        "/allot.v1.Admin/Backup",
        "/allot.v1.Raft/Append",
        "/allot.v1.Raft/Clock",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    ] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
}

/// Sends one random hostile message to `addr`; any answer is fine as long as the
/// cluster survives and applies nothing. Returns the gRPC code (None: a raw socket).
async fn one_hostile_message(r: &mut Rng, addr: &str, me: u64, secret: &PeerSecret, revoked: &str) {
    let ch = match tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
    {
        Ok(c) => c,
        Err(_) => return,
    };
    let tok = hostile_token(r, revoked);
    let tok = tok.as_deref();
    let shard = *r.pick(&[0u32, 0, 1, 7, u32::MAX]);
    match r.below(14) {
        0 | 1 => {
            // Typed commands, random and often out of bounds, with any claimed actor;
            // a third of the calls have their encoding mangled.
            let n = 1 + r.below(6) as usize;
            let reqs: Vec<Request> = (0..n)
                .map(|_| Request {
                    actor: random_actor(r),
                    request_id: r.next() as u128,
                    org: (r.below(2) == 0).then(|| OrgId(r.big())),
                    command: random_command(r),
                })
                .collect();
            let call = typed::execute_request(Some(shard), &reqs).unwrap_or_default();
            if r.below(3) == 0 {
                let bytes = mangle(r, call.encode_to_vec());
                let _ = raw_unary(ch, "/allot.api.v1.Api/Execute", bearer(bytes, tok)).await;
            } else {
                let _ = api(ch).execute(bearer(call, tok)).await;
            }
        }
        2 => {
            let q = random_query(r);
            let msg = typed::query::query_request(shard, r.below(2) == 0, &q);
            if r.below(3) == 0 {
                let bytes = mangle(r, msg.encode_to_vec());
                let _ = raw_unary(ch, "/allot.api.v1.Api/Query", bearer(bytes, tok)).await;
            } else {
                let _ = api(ch).query(bearer(msg, tok)).await;
            }
        }
        3 => {
            let _ = api(ch)
                .audit(bearer(
                    pb::AuditRequest {
                        read: Some(pb::Read {
                            shard: Some(shard),
                            stale_ok: r.below(2) == 0,
                        }),
                        from_seq: r.big(),
                        limit: r.next() as u32,
                        org: Some(r.big()),
                        from_ms: r.big(),
                        ..Default::default()
                    },
                    tok,
                ))
                .await;
        }
        4 => {
            let mut a = api(ch);
            if r.below(2) == 0 {
                let m = pb::WatchAssignmentsRequest {
                    shard,
                    node: r.big(),
                };
                if let Ok(s) = a.watch_assignments(bearer(m, tok)).await {
                    drop(s);
                }
            } else {
                let m = pb::WatchEventsRequest {
                    shard: Some(shard),
                    org: Some(r.big()),
                    from_seq: r.big(),
                };
                if let Ok(s) = a.watch_events(bearer(m, tok)).await {
                    drop(s);
                }
            }
        }
        12 => {
            // Any method of any service the node serves (from its own descriptors, so
            // a new method is fuzzed the day it exists), with random bytes as its body.
            let (path, streaming) = *r.pick(every_method());
            let body = r.bytes(512);
            if streaming {
                let _ = raw_streaming(ch, path, bearer(body, tok)).await;
            } else {
                let _ = raw_unary(ch, path, bearer(body, tok)).await;
            }
        }
        5 => {
            let mut a = AdminClient::new(ch);
            let member = Member {
                node_id: r.big(),
                addr: r.string(30),
            };
            let _ = match r.below(6) {
                0 => a
                    .init(bearer(
                        InitRequest {
                            members: vec![member],
                            shards: vec![shard],
                            cluster_id: r.string(34),
                        },
                        tok,
                    ))
                    .await
                    .map(|_| ()),
                1 => a
                    .add_learner(bearer(
                        MemberRequest {
                            shard,
                            all_shards: r.below(2) == 0,
                            member: Some(member),
                        },
                        tok,
                    ))
                    .await
                    .map(|_| ()),
                2 => a
                    .change_membership(bearer(
                        ChangeMembershipRequest {
                            shard,
                            all_shards: true,
                            voters: vec![r.big()],
                            allow_audit_loss: r.big().is_multiple_of(2),
                            expected_membership_index: None,
                        },
                        tok,
                    ))
                    .await
                    .map(|_| ()),
                3 => a
                    .shard_hash(bearer(ShardRequest { shard }, tok))
                    .await
                    .map(|_| ()),
                4 => a
                    .backup(bearer(ShardRequest { shard }, tok))
                    .await
                    .map(|_| ()),
                _ => a.status(bearer(StatusRequest {}, tok)).await.map(|_| ()),
            };
        }
        6 | 7 => {
            // Peer messages without the secret, random bytes or structured.
            let payload = if r.below(2) == 0 {
                r.bytes(300)
            } else {
                codec::encode(&hostile_append(r, me))
            };
            let msg = RaftMessage { shard, payload };
            let mut c = raft(ch);
            let _ = match r.below(4) {
                0 => c.append(msg).await.map(|_| ()),
                1 => c.vote(msg).await.map(|_| ()),
                2 => c.snapshot(msg).await.map(|_| ()),
                _ => c.report_denials(msg).await.map(|_| ()),
            };
        }
        8 | 9 => {
            // From a peer (the secret): every such message breaks a guard.
            let shard = 0;
            let mut c = raft(ch);
            let which = r.below(3);
            let append = hostile_append(r, me);
            let what = format!("{which}: {:?}", append.vote);
            let e = match which {
                0 => c
                    .append(as_peer(
                        RaftMessage {
                            shard,
                            payload: codec::encode(&append),
                        },
                        secret,
                    ))
                    .await
                    .err(),
                1 => c
                    .vote(as_peer(
                        RaftMessage {
                            shard,
                            payload: codec::encode(&openraft::raft::VoteRequest {
                                vote: Vote::new(TERM_MAX + 1 + r.below(1 << 20), 2),
                                last_log_id: None,
                            }),
                        },
                        secret,
                    ))
                    .await
                    .err(),
                _ => c
                    .snapshot(as_peer(
                        RaftMessage {
                            shard,
                            payload: codec::encode(&SnapshotChunk {
                                vote: Vote::new_committed(5, 99),
                                meta: forged_meta(5, 1 << 40),
                                total_bytes: r.big(),
                                offset: 1 + r.below(u64::MAX - 1),
                                data: r.bytes(64),
                            }),
                        },
                        secret,
                    ))
                    .await
                    .err(),
            };
            let e = e.unwrap_or_else(|| {
                panic!("a guard-breaking peer message was accepted by node {me}: {what}")
            });
            assert!(
                matches!(e.code(), Code::InvalidArgument | Code::FailedPrecondition),
                "{e:?}"
            );
        }
        10 | 11 => {
            // Raw bytes on the socket: garbage, or an HTTP/2 preface and garbage frames.
            use tokio::io::AsyncWriteExt;
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                if r.below(2) == 0 {
                    let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
                }
                let _ = s.write_all(&r.bytes(4096)).await;
                let _ = s.shutdown().await;
            }
        }
        _ => {
            // A message over every bound.
            let big = bearer(vec![1; 2 << 20], tok);
            let _ = raw_unary(ch, "/allot.api.v1.Api/Execute", big).await;
        }
    }
}

/// Random and structure-aware hostile messages at every service and method of a
/// secured 3-node cluster (2 shards), 4 senders at once: no node exits, no node's peak
/// memory passes idle + 512 MiB, nothing is applied, every shard commits within 5 s of
/// the end, and the replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_every_service() {
    let secs: u64 = std::env::var("ALLOT_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let seed: u64 = std::env::var("ALLOT_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15);
    eprintln!("fuzz: {secs} s, seed {seed}");
    let mut h = secured(2).await;
    for o in [4u64, 5] {
        h.admin.create_org(OrgId(o)).await.unwrap();
    }
    let revoked = h
        .admin
        .create_token(PrincipalId(60), Scope::Agent(NodeId(9)), None)
        .await
        .unwrap();
    h.admin.revoke_token(None, PrincipalId(60)).await.unwrap();
    // Let the cluster settle, then take the idle figures and the trail's heads.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = h.rss_now();
    let heads = [h.head_seq(0).await, h.head_seq(1).await];
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut senders = Vec::new();
    for s in 0..4u64 {
        let addrs: Vec<(u64, String)> = (1..=3).map(|id| (id, h.addr(id))).collect();
        let (secret, revoked) = (h.secret(), revoked.clone());
        senders.push(tokio::spawn(async move {
            let mut r = Rng(seed ^ (s + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
            let mut sent = 0u64;
            while Instant::now() < deadline {
                let (me, addr) = r.pick(&addrs).clone();
                one_hostile_message(&mut r, &addr, me, &secret, &revoked).await;
                sent += 1;
            }
            sent
        }));
    }
    let mut sent = 0;
    for s in senders {
        sent += s.await.unwrap();
    }
    h.assert_all_running();
    let grew = h.assert_memory_within(&idle, 512);
    let t = h.every_shard_commits(Duration::from_secs(5), 1_000).await;
    // The denials of the last second reach the trail, then nothing else did.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for (shard, head) in heads.iter().enumerate() {
        h.only_denials_since(shard as u32, *head, Some(1_000 + shard as u64))
            .await;
    }
    h.replicas_agree().await;
    let idle_mib: Vec<u64> = idle.iter().map(|k| k / 1024).collect();
    eprintln!(
        "fuzz: {sent} hostile messages in {secs} s; idle RSS {idle_mib:?} MiB, peak growth \
         {grew} MiB (budget 512); every shard committed within {t:?} after"
    );
}

/// Defect 16: an anonymous caller that opened `--max-connections` connections, sent
/// HTTP/2's preface on each and then nothing, held every connection slot for good. Every
/// later connection — a client's, an operator's, a peer's after a restart — was closed at
/// accept, so one unauthenticated host could cut a node off its cluster. Now a new
/// connection at the bound takes the slot of a connection that has never authenticated
/// (the one longest without a call first); a connection that has authenticated keeps its
/// slot while a call of it is open, and so do the peer links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_16_idle_connections_cannot_hold_a_nodes_connection_slots() {
    use tokio::io::AsyncWriteExt;
    const MAX: usize = 16;
    let max = MAX.to_string();
    let mut h = secured_with(1, &["--max-connections", &max]).await;
    let target = h.addr(1);
    let secret = h.secret();
    // Node 2 leads, so node 1 holds a peer link that node 2 dialled.
    let leader = h.c.leader_of(0).await.unwrap();
    if leader != 2 {
        AdminClient::new(channel(&h.addr(leader)).await)
            .transfer_leader(bearer(
                TransferLeaderRequest { shard: 0, to: 2 },
                Some(&h.token),
            ))
            .await
            .expect("leadership moves to node 2");
    }
    let links = "allot_peer_link_connections_total{result=\"accepted\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.metric(1, links).await < 1.0 {
        assert!(Instant::now() < deadline, "node 2 links to node 1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let links_before = h.metric(1, links).await;

    // The attacker: three times the bound of connections that say HTTP/2's preface and
    // an empty SETTINGS frame, then nothing (the preface routes them to the gRPC server
    // at once, which would hold them for good).
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    let mut held = Vec::new();
    for _ in 0..3 * MAX {
        if let Ok(mut s) = tokio::net::TcpStream::connect(&target).await {
            let _ = s.write_all(PREFACE).await;
            held.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // New connections are still served: an operator's, and a peer's.
    let fresh = |who: &'static str, round: usize| {
        let target = target.clone();
        async move {
            tonic::transport::Endpoint::from_shared(format!("http://{target}"))
                .unwrap()
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap_or_else(|e| panic!("round {round}: a new {who} connects: {e}"))
        }
    };
    for round in 0..3 {
        AdminClient::new(fresh("client", round).await)
            .status(bearer(StatusRequest {}, Some(&h.token)))
            .await
            .unwrap_or_else(|e| panic!("round {round}: a new client is served: {e}"));
        raft(fresh("peer", round).await)
            .versions(as_peer(VersionsRequest {}, &secret))
            .await
            .unwrap_or_else(|e| panic!("round {round}: a new peer connection is served: {e}"));
        // The attacker keeps coming.
        for _ in 0..MAX {
            if let Ok(mut s) = tokio::net::TcpStream::connect(&target).await {
                let _ = s.write_all(PREFACE).await;
                held.push(s);
            }
        }
    }

    // The cluster commits and node 1 follows over the link it had: only connections
    // that never authenticated gave up their slots.
    h.every_shard_commits(Duration::from_secs(10), 700).await;
    h.replicas_agree().await;
    let evicted = "allot_edge_refusals_total{api=\"connections\",reason=\"evicted\"}";
    let evicted_idle = "allot_edge_refusals_total{api=\"connections\",reason=\"evicted_idle\"}";
    assert!(
        h.metric(1, evicted).await >= (3 * MAX) as f64,
        "the attacker's connections gave up their slots"
    );
    assert_eq!(
        h.metric(1, evicted_idle).await,
        0.0,
        "no authenticated connection lost its slot while the attacker's were there"
    );
    assert_eq!(
        h.metric(1, links).await,
        links_before,
        "node 2's link to node 1 was never closed"
    );
    // The gauge shows the slots: the bound, the attacker's connections in them, and the
    // authenticated ones (node 2's link at least), never more than the bound together.
    let gauge = |state: &str| format!("allot_edge_connections{{state=\"{state}\"}}");
    assert_eq!(h.metric(1, &gauge("max")).await, MAX as f64);
    let authenticated = h.metric(1, &gauge("authenticated")).await;
    let unauthenticated = h.metric(1, &gauge("unauthenticated")).await;
    assert!(
        authenticated >= 1.0 && unauthenticated >= 1.0,
        "{authenticated} authenticated, {unauthenticated} not"
    );
    assert!(authenticated + unauthenticated <= MAX as f64);
    drop(held);
    h.assert_all_running();
}
