//! The CI profile as a test: real 3-node clusters behind link proxies, every workload,
//! every nemesis at least once; every checker must pass. Also: bad input is refused
//! with a clear error.

use allot_jepsen::run::{profile, run, RunConfig};
use allot_node::local_cluster::node_binary;
use std::process::Command;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_profile_passes_every_checker() {
    let bin = node_binary().expect("build it first: cargo build -p allot-node --bin allot-node");
    let dir = tempfile::Builder::new()
        .prefix("allot-jepsen-ci-")
        .tempdir()
        .unwrap();
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (i, (w, nem, secs)) in profile("ci").unwrap().into_iter().enumerate() {
        let _ = &nem;
        let r = run(RunConfig {
            workload: w,
            nemeses: nem,
            time_limit: Duration::from_secs(secs),
            seed: 20_000 + i as u64,
            nodes: 3,
            processes: 4,
            node_bin: bin.clone(),
            dir: dir.path().join(format!("run-{i}")),
            node_args: vec![],
            keep_data: false,
        })
        .await
        .expect("run");
        r.print();
        assert!(r.ok > 50, "the workload made progress: {r:?}");
        assert!(r.nemesis_events > 0, "faults were injected: {r:?}");
        seen.extend(r.nemesis_kinds.keys().cloned());
        if !r.passed() {
            failures.push(format!(
                "{:?}",
                r.verdicts.iter().filter(|v| !v.ok).collect::<Vec<_>>()
            ));
        }
    }
    for n in allot_jepsen::nemesis::Nemesis::ALL {
        assert!(
            seen.contains(n.name()),
            "nemesis {} never ran: {seen:?}",
            n.name()
        );
    }
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn bad_flags_and_unreachable_binary_are_clear_errors() {
    let exe = env!("CARGO_BIN_EXE_allot-jepsen");
    let out = Command::new(exe)
        .args(["run", "--workload", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'nope'"));

    let out = Command::new(exe)
        .args(["run", "--nemesis", "meteor"])
        .output()
        .unwrap();
    assert!(!out.status.success());

    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(exe)
        .args([
            "run",
            "--workload",
            "register",
            "--time-limit",
            "5",
            "--node-bin",
            "/nonexistent/allot-node",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/allot-node") && err.contains("not reachable"),
        "{err}"
    );

    let out = Command::new(exe)
        .args(["profile", "weekly"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown profile"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_cannot_start_says_why() {
    let bin = node_binary().expect("build it first: cargo build -p allot-node --bin allot-node");
    let dir = tempfile::tempdir().unwrap();
    // An argument the node refuses: every node exits at once.
    let r = run(RunConfig {
        workload: allot_jepsen::workloads::Workload::Register,
        nemeses: vec![],
        time_limit: Duration::from_secs(2),
        seed: 1,
        nodes: 3,
        processes: 1,
        node_bin: bin,
        dir: dir.path().to_path_buf(),
        node_args: vec!["--shards".into(), "0".into()],
        keep_data: false,
    })
    .await;
    let err = format!("{:#}", r.expect_err("the run must not start"));
    assert!(
        err.contains("did not start") && err.contains("shards"),
        "{err}"
    );
}
