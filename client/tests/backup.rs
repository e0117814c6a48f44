//! Backup and restore end to end: `allotctl backup create` copies every shard of a real
//! 3-node cluster, `allot-node restore` seeds the data dirs of a new 3-node cluster on
//! other ports from those files, and the new cluster — started without `init` — holds
//! the same ledger, serves and verifies the whole audit trail from genesis, agrees
//! across replicas and takes new writes. Tampered files and non-empty data dirs are
//! refused.

mod common;

use allot_client::{AuditFilter, Client};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_node::workload::{self, HoldCycle};
use allot_statemachine::backup::ShardBackup;
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::{verify_chain, AuditChain, AuditEvent};
use common::*;
use std::path::PathBuf;
use std::time::Duration;

const SHARDS: u32 = 2;

async fn audit_trail(client: &Client, shard: u32) -> Vec<AuditEvent> {
    let mut events = Vec::new();
    client
        .audit_export(shard, AuditFilter::default(), 0, |e| {
            events.push(e.clone());
            Ok(())
        })
        .await
        .unwrap();
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_restores_into_a_new_cluster_with_its_audit_trail() {
    let dir = tempfile::Builder::new()
        .prefix("allot-backup-")
        .tempdir()
        .unwrap();
    let mut a = LocalCluster::new(node_binary().unwrap(), dir.path().join("a"), 3, SHARDS).unwrap();
    a.start_all().unwrap();
    a.init().await.unwrap();
    a.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let client = a.admin_client().unwrap();
    // History on both shards: the fixture world, a grant, and hold cycles.
    for shard in 0..SHARDS {
        let (outs, _) = client
            .execute(shard, &workload::setup(1_000_000_000))
            .await
            .unwrap();
        assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
        let mut cycle = HoldCycle::new(7 + shard as u64, 3_000_000);
        let reqs: Vec<_> = (0..30).map(|_| cycle.request()).collect();
        let (outs, _) = client.execute(shard, &reqs).await.unwrap();
        assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
    }

    // Back up through allotctl; the files verify offline.
    let eps = a.endpoints().join(",");
    let out = dir.path().join("backup");
    let rows = json(&eps, &["backup", "create", "--out", out.to_str().unwrap()]);
    let rows = rows.as_array().unwrap().clone();
    assert_eq!(rows.len(), SHARDS as usize);
    let files: Vec<PathBuf> = rows
        .iter()
        .map(|r| PathBuf::from(r["file"].as_str().unwrap()))
        .collect();
    for r in &rows {
        assert!(r["log_index"].as_u64().unwrap() > 0, "{r}");
        assert!(r["audit_events"].as_u64().unwrap() > 0, "{r}");
    }
    let mut args = vec!["backup", "verify"];
    args.extend(files.iter().map(|f| f.to_str().unwrap()));
    let verified = json(&eps, &args);
    assert_eq!(verified[0]["state_hash"], rows[0]["state_hash"]);
    let backups: Vec<ShardBackup> = files
        .iter()
        .map(|f| ShardBackup::decode(&std::fs::read(f).unwrap()).unwrap())
        .collect();
    let mut before = Vec::new();
    for b in &backups {
        let (state, _) = b.verify().unwrap();
        let trail = audit_trail(&client, b.shard).await;
        before.push((state.ledger.totals, trail));
    }
    // A tampered file does not verify.
    let tampered = dir.path().join("tampered.allot-backup");
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&tampered, &bytes).unwrap();
    fails(&eps, &["backup", "verify", tampered.to_str().unwrap()], 1);
    drop(client);
    drop(a); // the old cluster is gone

    // A new cluster on other ports, seeded from the files, started without init.
    let mut b = LocalCluster::new(node_binary().unwrap(), dir.path().join("b"), 3, SHARDS).unwrap();
    let members = members(&b);
    // Every shard is needed.
    let o = restore(&dir.path().join("b/node-1"), 1, &files[..1], &members);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no backup of shard"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A truncated file is refused by type, and leaves no data dir (nor its staging).
    let truncated = dir.path().join("truncated.allot-backup");
    let whole = std::fs::read(&files[1]).unwrap();
    std::fs::write(&truncated, &whole[..whole.len() - 40]).unwrap();
    let node1 = dir.path().join("b/node-1");
    let o = restore(&node1, 1, &[files[0].clone(), truncated], &members);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("truncated"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!node1.exists() && !dir.path().join("b/node-1.restoring").exists());
    // One backup set, copied to each node: node 1 and 2 restore from their copy of the
    // directory, node 3 from the same files rewritten in the layout of the releases
    // before streaming (still read).
    let legacy: Vec<PathBuf> = files
        .iter()
        .map(|f| {
            let old = dir.path().join(format!(
                "legacy-{}",
                f.file_name().unwrap().to_str().unwrap()
            ));
            let b = ShardBackup::decode(&std::fs::read(f).unwrap()).unwrap();
            std::fs::write(&old, b.encode()).unwrap();
            old
        })
        .collect();
    for n in &b.nodes {
        let set = if n.id == 3 {
            legacy.clone()
        } else {
            let copy = dir.path().join(format!("copied-to-{}", n.id));
            std::fs::create_dir_all(&copy).unwrap();
            for f in &files {
                std::fs::copy(f, copy.join(f.file_name().unwrap())).unwrap();
            }
            vec![copy]
        };
        let o = restore(&b.dir.join(format!("node-{}", n.id)), n.id, &set, &members);
        assert!(
            o.status.success(),
            "restore of node {}: {}",
            n.id,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // A data dir holding anything is not written to: refused, every file unchanged.
    let before_refusal = dir_digest(&node1);
    let o = restore(&node1, 1, &files, &members);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not empty"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(dir_digest(&node1), before_refusal);
    b.start_all().unwrap();
    b.wait_leaders(Duration::from_secs(60)).await.unwrap();
    let client = b.admin_client().unwrap();
    for (shard, (totals, trail)) in before.iter().enumerate() {
        let shard = shard as u32;
        match client.query(shard, &Query::Totals).await.unwrap() {
            Answer::Totals(t) => assert_eq!(&t, totals, "shard {shard} totals"),
            other => panic!("{other:?}"),
        }
        // The whole trail is served and verifies from genesis; the backed-up part is
        // the original one, event for event.
        let restored = audit_trail(&client, shard).await;
        verify_chain(&AuditChain::default(), &restored).unwrap();
        assert!(restored.len() >= trail.len());
        assert_eq!(
            &restored[..trail.len()],
            &trail[..],
            "shard {shard} audit trail"
        );
        // New writes go on from there.
        let grant = workload::admin(
            workload::rid(99, shard as u64),
            allot_statemachine::Command::IssueGrant(workload::grant(
                500,
                allot_statemachine::Account::Org(allot_statemachine::testkit::ORG),
                5_000_000,
            )),
        );
        let (outs, _) = client
            .execute(shard, std::slice::from_ref(&grant))
            .await
            .unwrap();
        assert!(outs[0].is_ok(), "{outs:?}");
        for node in &b.nodes {
            match client
                .query_replica(&node.addr, shard, &Query::Invariants)
                .await
                .unwrap()
            {
                Answer::Invariants(r) => r.unwrap(),
                other => panic!("{other:?}"),
            }
        }
    }
    let eps = b.endpoints().join(",");
    json(&eps, &["shard", "hash", "--check"]);
}

/// Every file under `dir` with its content, in path order.
fn dir_digest(dir: &std::path::Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                out.push((p, bytes));
            }
        }
    }
    out.sort();
    out
}

/// `allotctl backup create` into `out`: the files, and each shard's backed-up log index.
fn backup_set(eps: &str, out: &std::path::Path) -> (Vec<PathBuf>, Vec<u64>) {
    let rows = json(eps, &["backup", "create", "--out", out.to_str().unwrap()]);
    let rows = rows.as_array().unwrap().clone();
    (
        rows.iter()
            .map(|r| PathBuf::from(r["file"].as_str().unwrap()))
            .collect(),
        rows.iter()
            .map(|r| r["log_index"].as_u64().unwrap())
            .collect(),
    )
}

/// DESIGN §68: nodes restored from two backup sets of one cluster (or one node restored
/// from an older set than the rest) are two clusters. Old code: node 3, restored from
/// the later set, took the appends of the leader of nodes 1 and 2 (restored from the
/// earlier one) past its own committed index — a history that is not its own — and its
/// state diverged without a word. Now every peer message carries the sender's cluster
/// id and node 3 refuses theirs (and they its): it applies nothing of their history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_restored_from_different_backup_sets_do_not_join_each_other() {
    let dir = tempfile::Builder::new()
        .prefix("allot-backup-sets-")
        .tempdir()
        .unwrap();
    let mut a = LocalCluster::new(node_binary().unwrap(), dir.path().join("a"), 3, 1).unwrap();
    a.start_all().unwrap();
    a.init().await.unwrap();
    a.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let genesis = a.status(1).await.unwrap().cluster_id;
    assert_eq!(genesis.len(), 32, "a new cluster has an id");
    for n in 2..=3 {
        assert_eq!(a.status(n).await.unwrap().cluster_id, genesis);
    }
    let client = a.admin_client().unwrap();
    let (outs, _) = client
        .execute(0, &workload::setup(1_000_000_000))
        .await
        .unwrap();
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
    let eps = a.endpoints().join(",");
    let (earlier, _) = backup_set(&eps, &dir.path().join("earlier"));
    let mut cycle = HoldCycle::new(7, 3_000_000);
    let reqs: Vec<_> = (0..30).map(|_| cycle.request()).collect();
    let (outs, _) = client.execute(0, &reqs).await.unwrap();
    assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
    let (later, later_index) = backup_set(&eps, &dir.path().join("later"));
    drop(client);
    drop(a);

    let mut b = LocalCluster::new(node_binary().unwrap(), dir.path().join("b"), 3, 1).unwrap();
    let members = members(&b);
    for n in 1..=3u64 {
        let set = if n == 3 { &later } else { &earlier };
        let o = restore(&b.dir.join(format!("node-{n}")), n, set, &members);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    b.start_all().unwrap();
    let ids: Vec<String> = {
        let mut v = Vec::new();
        for n in 1..=3 {
            v.push(b.status(n).await.unwrap().cluster_id);
        }
        v
    };
    assert_eq!(ids[0], ids[1], "one backup set, one cluster");
    assert_ne!(ids[0], ids[2], "another backup set, another cluster");
    assert!(
        ids.iter().all(|i| i.len() == 32 && *i != genesis),
        "{ids:?}"
    );
    // Nodes 1 and 2 elect a leader and take writes, one entry each.
    let client = allot_node::local_cluster::client(b.endpoints()[..2].to_vec());
    let mut cycle = HoldCycle::new(8, 3_000_000);
    for _ in 0..20 {
        let r = cycle.request();
        let (outs, _) = client.execute(0, std::slice::from_ref(&r)).await.unwrap();
        assert!(outs[0].is_ok(), "{outs:?}");
    }
    let leader_applied = b.status(1).await.unwrap().shards[0].applied_index;
    assert!(
        leader_applied > later_index[0] + 5,
        "nodes 1 and 2 went past node 3's restored index {}: {leader_applied}",
        later_index[0]
    );
    // Past several heartbeats: node 3 took nothing of theirs.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let s3 = b.status(3).await.unwrap().shards[0].clone();
        assert_eq!(
            s3.applied_index, later_index[0],
            "node 3 applied another cluster's entries: {s3:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(b.log_path(1)).unwrap_or_default();
    assert!(
        log.contains("another cluster") || log.contains("belongs to cluster"),
        "node 1 says why node 3 is not reached"
    );
}
