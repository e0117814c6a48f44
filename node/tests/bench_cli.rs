//! `allot-bench`'s own bad flags are a usage error (exit 2) before anything starts.

use std::process::Command;

#[test]
fn bad_flags_are_a_usage_error() {
    let bench = env!("CARGO_BIN_EXE_allot-bench");
    for bad in [
        &["--bogus"][..],
        &["--seconds"],
        &["--per-call", "0"],
        &["--rate", "10", "--vs-etcd"],
        &["--window", "5"],
        &["--reads", "--per-call", "16"],
        &["--reads", "--rate", "10"],
        &["--leaders-on", "4"],
        &["--tls", "--vs-etcd"],
    ] {
        let out = Command::new(bench).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("usage: allot-bench"), "{bad:?}: {err}");
    }
    let help = Command::new(bench).arg("--help").output().unwrap();
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--vs-etcd"));
}

/// A node that dies during a run (here: its fsync fails, so it exits with status 74, as
/// on a full disk) is named at once with the end of its log. Before, the clients retried
/// the unreachable address until they gave up ("tcp connect error", no node named).
#[test]
fn a_node_that_exits_during_a_run_is_named_with_its_log() {
    use std::io::Read;
    let bench = env!("CARGO_BIN_EXE_allot-bench");
    let dir = tempfile::tempdir().unwrap();
    let fail = dir.path().join("fail-fsync");
    let mut child = Command::new(bench)
        .args(["--nodes", "1", "--shards", "1", "--seconds", "60"])
        .args(["--concurrency", "1", "--per-call", "1", "--node-arg"])
        .arg("--test-fsync-fail-file")
        .arg("--node-arg")
        .arg(&fail)
        .arg("--dir")
        .arg(dir.path().join("run"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    // Wait for the first progress line of the run, then make every fsync fail.
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("1 clients, 1/60 s") {
        let n = stderr.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the bench ended before its run: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    std::fs::write(&fail, b"").unwrap();
    let failed_at = std::time::Instant::now();
    stderr.read_to_end(&mut seen).unwrap();
    let status = child.wait().unwrap();
    let err = String::from_utf8_lossy(&seen);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("node 1 exited during the run"), "{err}");
    assert!(err.contains("74"), "the node's exit status: {err}");
    assert!(
        err.contains("fatal storage error"),
        "the node's log tail: {err}"
    );
    // The run was to last 60 s; the death is reported within seconds of it.
    assert!(
        failed_at.elapsed() < std::time::Duration::from_secs(20),
        "{err}"
    );
}

/// Runs a one-second benchmark with `args` and `--json`; its JSON once it succeeded.
fn run_json(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_allot-bench"))
        .args(["--seconds", "1", "--json", "--dir"])
        .arg(dir.path().join("run"))
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// `--reads` sends reads that need no consensus: the run counts answered reads, and the
/// nodes' `api.execute` histogram (every write goes through it) gains nothing.
#[test]
fn reads_are_answered_without_a_command() {
    let text = run_json(&[
        "--nodes",
        "1",
        "--shards",
        "1",
        "--concurrency",
        "2",
        "--reads",
    ]);
    assert!(text.contains("\"reads\":true"), "{text}");
    let row = text
        .split("{\"system\":\"allot\",\"run\":\"closed loop\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no closed-loop row: {text}"));
    let field = |name: &str| {
        row.split(&format!("\"{name}\":"))
            .nth(1)
            .and_then(|r| r.split([',', '}']).next())
            .unwrap_or_else(|| panic!("no {name}: {row}"))
            .to_string()
    };
    let reads: u64 = field("commands").parse().unwrap();
    assert!(reads > 10, "{reads} reads answered in a second: {row}");
    assert_eq!(field("server_p99_ms_le"), "null", "a write was sent: {row}");
}

/// `--leaders-on N` moves every shard's leadership to node N before the runs; the JSON
/// names each shard's leader as the runs began (by default they are spread).
#[test]
fn leaders_can_be_placed_on_one_node() {
    for (extra, want) in [
        (&[][..], "\"leaders\":[1,2]"),
        (&["--leaders-on", "3"][..], "\"leaders\":[3,3]"),
    ] {
        let args = [
            &["--nodes", "3", "--shards", "2", "--concurrency", "1"][..],
            extra,
        ]
        .concat();
        let text = run_json(&args);
        assert!(text.contains(want), "{extra:?}: want {want} in {text}");
    }
}

/// `--tls` runs the cluster with a development CA and calls it over TLS; the peers'
/// Raft goes over the peer link inside TLS (DESIGN §65).
#[test]
fn a_tls_cluster_is_measured_over_tls() {
    let text = run_json(&[
        "--nodes",
        "3",
        "--shards",
        "1",
        "--concurrency",
        "2",
        "--tls",
    ]);
    assert!(text.contains("\"tls\":true"), "{text}");
    let commands: u64 = text
        .split("\"commands\":")
        .nth(1)
        .and_then(|r| r.split([',', '}']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no commands: {text}"));
    assert!(
        commands > 10,
        "{commands} commands in a second over TLS: {text}"
    );
}
