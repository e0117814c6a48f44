//! TLS against a real 3-node cluster: peers replicate over mutual TLS (a write commits
//! only if they do), a TLS client is served, a plaintext client is refused, and the
//! peer-only Raft service refuses a TLS caller without a cluster certificate.

use allot_node::local_cluster::{Client, LocalCluster};
use allot_proto::raft_client::RaftClient;
use allot_proto::RaftMessage;
use allot_statemachine::{OrgId, ProjectId};
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_serves_tls_and_refuses_plaintext_and_certless_peers() {
    let dir = tempfile::Builder::new()
        .prefix("allot-tls-")
        .tempdir()
        .unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_allot-node"));
    let certs = dir.path().join("certs");
    let st = std::process::Command::new(&bin)
        .args(["dev-certs", "--out"])
        .arg(&certs)
        .status()
        .unwrap();
    assert!(st.success());
    for f in ["ca.pem", "node.pem", "node-key.pem"] {
        assert!(certs.join(f).exists(), "{f}");
    }
    let mut c = LocalCluster::new(bin, dir.path().join("cluster"), 3, 1).unwrap();
    c.tls_dir = Some(certs.clone());
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
