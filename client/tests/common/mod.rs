//! Helpers shared by the `allotctl` integration tests: running the real binary with a
//! bound on its run time, parsing its JSON output, polling with a deadline.
#![allow(dead_code)] // each test binary uses its own subset

pub mod agent;

use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const CTL: &str = env!("CARGO_BIN_EXE_allotctl");

pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Runs allotctl against `eps` and waits for it, killing it after 60 s.
pub fn ctl(eps: &str, args: &[&str]) -> Out {
    let started = Instant::now();
    let child = spawn_ctl(eps, args);
    let out = wait_bounded(child, Duration::from_secs(60));
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

pub fn spawn_ctl(eps: &str, args: &[&str]) -> Child {
    Command::new(CTL)
        .arg("--endpoints")
        .arg(eps)
        .args(args)
        .env_remove("ALLOTCTL_OUTPUT")
        .env_remove("ALLOTCTL_AS")
        .env_remove("ALLOTCTL_TIMEOUT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("allotctl runs")
}

pub fn wait_bounded(mut child: Child, limit: Duration) -> std::process::Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("allotctl ran longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("output")
}

/// Runs a command with `-o json`; it must succeed and print one JSON document.
pub fn json(eps: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let o = ctl(eps, &all);
    assert_eq!(o.code, 0, "allotctl {args:?} failed:\n{}", o.stderr);
    serde_json::from_str(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "allotctl {args:?}: not one JSON document ({e}):\n{}",
            o.stdout
        )
    })
}

/// Runs a command expected to fail with `code`; returns its stderr.
pub fn fails(eps: &str, args: &[&str], code: i32) -> String {
    let o = ctl(eps, args);
    assert_eq!(
        o.code, code,
        "allotctl {args:?}: stdout {}\nstderr {}",
        o.stdout, o.stderr
    );
    assert!(
        o.stdout.trim().is_empty(),
        "nothing on stdout on failure: {}",
        o.stdout
    );
    o.stderr
}

pub fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Repeats `f` until it returns Some, or panics after `limit`.
pub fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `allot-node restore` of node `id` into `dir` from backup `files`, with the new
/// cluster's `members` (`id=host:port`).
pub fn restore(
    dir: &std::path::Path,
    id: u64,
    files: &[std::path::PathBuf],
    members: &[String],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(allot_node::local_cluster::node_binary().unwrap());
    cmd.args(["restore", "--node-id", &id.to_string()])
        .arg("--data-dir")
        .arg(dir);
    for f in files {
        cmd.arg("--backup").arg(f);
    }
    for m in members {
        cmd.args(["--member", m]);
    }
    cmd.output().unwrap()
}

/// A cluster's members as `restore` takes them (`id=host:port`).
pub fn members(c: &allot_node::local_cluster::LocalCluster) -> Vec<String> {
    c.nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.addr))
        .collect()
}

/// Restores every node of the (not yet started) cluster `c` from backup `files`, into
/// the data dirs it starts from; each restore must succeed.
pub fn restore_cluster(c: &allot_node::local_cluster::LocalCluster, files: &[std::path::PathBuf]) {
    let members = members(c);
    for n in &c.nodes {
        let o = restore(&c.dir.join(format!("node-{}", n.id)), n.id, files, &members);
        assert!(
            o.status.success(),
            "restore of node {}: {}",
            n.id,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
