//! TLS against a real 3-node cluster: peers replicate over mutual TLS (a write commits
//! only if they do), a TLS client is served, a plaintext client is refused, and the
//! peer-only Raft service refuses a TLS caller without a cluster certificate. Raft
//! travels on the peer link inside TLS, and the link admits only the cluster's nodes.

mod common;

use allot_node::link::{Link, LinkError};
use allot_node::local_cluster::{Client, LocalCluster};
use allot_node::peer::PeerCredential;
use allot_proto::raft_client::RaftClient;
use allot_proto::RaftMessage;
use allot_statemachine::{OrgId, ProjectId};
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// A temporary directory (named `prefix…`) holding `allot-node dev-certs` output in
/// `certs/`.
fn dev_certs(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let certs = dir.path().join("certs");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_allot-node"))
        .args(["dev-certs", "--out"])
        .arg(&certs)
        .status()
        .unwrap();
    assert!(st.success());
    (dir, certs)
}

/// A 3-node, 1-shard cluster laid out in `dir/cluster`, serving TLS with `certs`.
fn tls_cluster(dir: &tempfile::TempDir, certs: &std::path::Path) -> LocalCluster {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_allot-node"));
    let mut c = LocalCluster::new(bin, dir.path().join("cluster"), 3, 1).unwrap();
    c.tls_dir = Some(certs.to_path_buf());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_serves_tls_and_refuses_plaintext_and_certless_peers() {
    let (dir, certs) = dev_certs("allot-tls-");
    for f in ["ca.pem", "node.pem", "node-key.pem"] {
        assert!(certs.join(f).exists(), "{f}");
    }
    let mut c = tls_cluster(&dir, &certs);
    c.start_all().unwrap();
    // Init and leader election go through TLS (the cluster's own client trusts the CA)
    // and the shards elect leaders over mutual-TLS peer links.
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let ca = std::fs::read(certs.join("ca.pem")).unwrap();

    // A TLS client: a write commits (replicated to a majority over TLS).
    let tls = Client::builder()
        .endpoints(c.endpoints())
        .tls_ca(ca.clone())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    tls.create_org(OrgId(1)).await.unwrap();
    tls.create_project(OrgId(1), ProjectId(10)).await.unwrap();
    // Through a follower too (forwarded to the leader over a peer link).
    let leader = c.leader_of(0).await.unwrap();
    let follower = c
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .unwrap()
        .addr
        .clone();
    let via_follower = Client::builder()
        .endpoints(vec![follower.clone()])
        .tls_ca(ca.clone())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    via_follower
        .create_project(OrgId(1), ProjectId(11))
        .await
        .unwrap();

    // A plaintext client is refused: its HTTP/2 preface is not a TLS handshake.
    let plain = Client::builder()
        .endpoints(c.endpoints())
        .retries(2)
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let e = plain.create_org(OrgId(2)).await.unwrap_err();
    assert!(
        matches!(
            e,
            allot_client::Error::Unavailable { .. } | allot_client::Error::Status { .. }
        ),
        "{e:?}"
    );
    // Nothing it sent was applied.
    assert!(
        tls.create_org(OrgId(2)).await.is_ok(),
        "org 2 did not exist yet"
    );

    // A TLS caller that trusts the CA but presents no certificate is not a peer.
    let ch = Endpoint::from_shared(format!("https://{follower}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca)))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let e = RaftClient::new(ch)
        .vote(RaftMessage {
            shard: 0,
            payload: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // A certificate from another CA does not pass the handshake.
    let other = dir.path().join("other-certs");
    allot_node::tls::write_dev_certs(&other, &["127.0.0.1".into()]).unwrap();
    let stranger = Client::builder()
        .endpoints(c.endpoints())
        .tls_ca(std::fs::read(other.join("ca.pem")).unwrap())
        .retries(2)
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    assert!(stranger.create_org(OrgId(3)).await.is_err());
}

async fn peer_rpcs(c: &LocalCluster, id: u64, transport: &str) -> u64 {
    let series = format!("allot_peer_rpcs_total{{transport=\"{transport}\"}}");
    common::metric(&c.node(id).metrics_addr, &series).await as u64
}

/// Under TLS the peer link runs inside mutual TLS (DESIGN §65): a leader sends its
/// AppendEntries by link to a follower of this release, and by gRPC to one with the link
/// off (as to a release before it). The link is admitted only with a certificate of the
/// cluster CA: a TLS dialler without one is refused in the hello, one with another CA's
/// certificate fails the handshake, a plaintext dialler is not served, and a node with
/// the link off refuses its protocol in the handshake (the dialler falls back to gRPC).
/// A follower that restarts gets a new link from the leader and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_peers_replicate_over_the_link_and_it_admits_only_cluster_certificates() {
    let dir = tempfile::Builder::new()
        .prefix("allot-tls-link-")
        .tempdir()
        .unwrap();
    let certs = dir.path().join("certs");
    allot_node::tls::write_dev_certs(&certs, &["127.0.0.1".into()]).unwrap();
    let read = |d: &std::path::Path, f: &str| std::fs::read(d.join(f)).unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_allot-node"));
    let mut c = LocalCluster::new(bin, dir.path().join("cluster"), 3, 1).unwrap();
    c.tls_dir = Some(certs.clone());
    c.nodes[2].extra_args = ["--peer-link", "off"].map(String::from).to_vec();
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let ca = read(&certs, "ca.pem");
    let client = Client::builder()
        .endpoints(c.endpoints())
        .tls_ca(ca.clone())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    // Node 3 plays the release without the link; a leader of this release is wanted.
    if c.leader_of(0).await.unwrap() == 3 {
        client.transfer_leader(0, Some(1)).await.unwrap();
    }
    let leader = c.leader_of(0).await.unwrap();
    assert_ne!(leader, 3);
    client.create_org(OrgId(1)).await.unwrap();
    for p in 0..40 {
        client
            .create_project(OrgId(1), ProjectId(100 + p))
            .await
            .unwrap();
    }
    let (link, grpc) = (
        peer_rpcs(&c, leader, "link").await,
        peer_rpcs(&c, leader, "grpc").await,
    );
    println!("leader {leader}: link {link}, grpc {grpc}");
    assert!(
        link >= 41,
        "each write went to the other follower by link: {link}"
    );
    assert!(grpc >= 41, "and to node 3 (link off) by gRPC: {grpc}");
    assert_eq!(peer_rpcs(&c, 3, "link").await, 0, "node 3 never dials it");

    let target = c.node(leader).addr.clone();
    let unauthenticated = "allot_peer_link_connections_total{result=\"unauthenticated\"}";
    let refused_before = common::metric(&c.node(leader).metrics_addr, unauthenticated).await;
    // Every dialler below presents the cluster's peer secret: only the certificate
    // differs.
    let cluster =
        allot_node::identity::parse(c.status(leader).await.unwrap().cluster_id.as_bytes()).unwrap();
    let secret = || {
        PeerCredential::new(c.peer_secret.as_deref())
            .unwrap()
            .with_identity(std::sync::Arc::new(
                allot_node::identity::Identity::in_memory(Some(cluster), false),
            ))
    };
    // The cluster's own certificate: admitted.
    let node_tls = allot_node::tls::link_client_config(
        &ca,
        Some((&read(&certs, "node.pem"), &read(&certs, "node-key.pem"))),
    )
    .unwrap();
    let member = Link::new(target.clone(), secret()).over_tls(Some(node_tls.clone()));
    member
        .connect(Duration::from_secs(5))
        .await
        .expect("a node certificate opens a link");
    // Trusting the CA, the secret right, but no certificate: refused in the hello.
    let certless = allot_node::tls::link_client_config(&ca, None).unwrap();
    let stranger = Link::new(target.clone(), secret()).over_tls(Some(certless));
    match stranger.connect(Duration::from_secs(5)).await {
        Err(LinkError::Status(s)) => {
            assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}")
        }
        other => panic!("a link without a certificate: {other:?}"),
    }
    assert_eq!(
        common::metric(&c.node(leader).metrics_addr, unauthenticated).await,
        refused_before + 1.0
    );
    // Another CA's certificate: the handshake fails (under TLS 1.3 the dialler learns it
    // from the listener's alert when it reads the hello's answer), and the dialler takes
    // it as a refusal of its certificate, not as an unreachable peer.
    let other = dir.path().join("other-certs");
    allot_node::tls::write_dev_certs(&other, &["127.0.0.1".into()]).unwrap();
    let foreign = allot_node::tls::link_client_config(
        &ca,
        Some((&read(&other, "node.pem"), &read(&other, "node-key.pem"))),
    )
    .unwrap();
    let foreign = Link::new(target.clone(), secret()).over_tls(Some(foreign));
    match foreign.connect(Duration::from_secs(5)).await {
        Err(LinkError::Status(s)) => {
            assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
            assert!(s.message().contains("certificate"), "{s:?}");
        }
        other => panic!("a link with another CA's certificate: {other:?}"),
    }
    // Plaintext: not a TLS handshake, not served.
    let plain = Link::new(target.clone(), secret());
    assert!(matches!(
        plain.connect(Duration::from_secs(5)).await,
        Err(LinkError::Unreachable(_))
    ));
    // Node 3 (link off) refuses the link's protocol: the dialler knows to use gRPC.
    let to_off = Link::new(c.node(3).addr.clone(), secret()).over_tls(Some(node_tls));
    assert!(matches!(
        to_off.connect(Duration::from_secs(5)).await,
        Err(LinkError::Unsupported)
    ));

    // A connection that never finishes its TLS handshake (here: sends nothing) is
    // dropped after `TLS_HANDSHAKE_TIMEOUT`.
    {
        use tokio::io::AsyncReadExt;
        let mut idle = tokio::net::TcpStream::connect(&target).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(
            allot_node::limits::TLS_HANDSHAKE_TIMEOUT + Duration::from_secs(5),
            idle.read(&mut buf),
        )
        .await
        .expect("the listener drops a stalled handshake");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        assert!(
            started.elapsed() >= allot_node::limits::TLS_HANDSHAKE_TIMEOUT - Duration::from_secs(1),
            "dropped after {:?}",
            started.elapsed()
        );
    }

    // The follower on the link restarts: the leader makes its link again (a new
    // handshake) and the node catches up.
    let follower = [1u64, 2].into_iter().find(|n| *n != leader).unwrap();
    c.kill(follower);
    for p in 0..10 {
        client
            .create_project(OrgId(1), ProjectId(200 + p))
            .await
            .unwrap();
    }
    c.start(follower).unwrap();
    c.wait_listening(follower, Duration::from_secs(30)).unwrap();
    let accepted = "allot_peer_link_connections_total{result=\"accepted\"}";
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut next = 300;
    while common::metric(&c.node(follower).metrics_addr, accepted).await < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the leader did not make its link to the restarted node again"
        );
        client
            .create_project(OrgId(1), ProjectId(next))
            .await
            .unwrap();
        next += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let applied = |st: allot_proto::StatusReply| st.shards[0].applied_index;
    let want = applied(c.status(leader).await.unwrap());
    while applied(c.status(follower).await.unwrap()) < want {
        assert!(
            std::time::Instant::now() < deadline,
            "the restarted node did not catch up to index {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Under TLS, a call finds its connection's slot through the session's connect info:
/// an agent's assignment stream keeps its slot while connections that never finish
/// their handshake, three times the node's bound, come and go; and a new TLS client is
/// served throughout (DESIGN §66).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_nodes_slots_go_to_stalled_handshakes_last() {
    use allot_node::workload;
    use allot_statemachine::{Command, GpuType, NodeId, NodeSpec};
    use futures::StreamExt;
    const MAX: usize = 12;
    let (dir, certs) = dev_certs("allot-tls-slots-");
    let mut c = tls_cluster(&dir, &certs);
    c.nodes[0]
        .extra_args
        .extend(["--max-connections".to_string(), MAX.to_string()]);
    // Secured: only a resolved token vouches for a connection (in dev mode a caller
    // without one is the operator, and proves nothing).
    c.dev_mode = false;
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let token = allot_client::security::generate_token().unwrap();
    c.admin_client()
        .unwrap()
        .bootstrap(allot_statemachine::PrincipalId(1), &token)
        .await
        .unwrap();
    c.admin_token = Some(token);
    let client = c.admin_client().unwrap();
    let spec = NodeSpec {
        node: NodeId(500),
        gpu_type: GpuType::new("H100"),
        gpu_count: 8,
        gpu_mem_gb: 80,
        labels: vec![],
        incarnation: 0,
    };
    let (o, _) = client
        .execute(
            0,
            &[workload::admin(
                workload::rid(16, 1),
                Command::RegisterNode(spec),
            )],
        )
        .await
        .unwrap();
    assert!(o[0].is_ok(), "{o:?}");
    let target = c.node(1).addr.clone();
    let mut stream = client
        .watch_assignments(&target, 0, NodeId(500))
        .await
        .unwrap();
    stream
        .next()
        .await
        .expect("the current set")
        .expect("the current set");

    // Connections that never start their handshake, three times the bound.
    let mut held = Vec::new();
    for _ in 0..3 * MAX {
        if let Ok(s) = tokio::net::TcpStream::connect(&target).await {
            held.push(s);
        }
    }
    let fresh = c.admin_client().unwrap();
    fresh
        .status_of(&target)
        .await
        .expect("a new TLS client is served");
    // The stream is still open: nothing arrives, and it did not end.
    let next = tokio::time::timeout(Duration::from_millis(500), stream.next()).await;
    assert!(next.is_err(), "the assignment stream ended: {next:?}");
    let m = &c.node(1).metrics_addr;
    assert!(
        common::metric(
            m,
            "allot_edge_refusals_total{api=\"connections\",reason=\"evicted\"}"
        )
        .await
            >= (2 * MAX) as f64
    );
    assert_eq!(
        common::metric(
            m,
            "allot_edge_refusals_total{api=\"connections\",reason=\"evicted_idle\"}"
        )
        .await,
        0.0
    );
    drop(held);
}
