//! `allotctl` end to end: the real binary against one real 3-node cluster (2 shards) on
//! loopback. Every command runs at least once; `-o json` output is parsed and checked
//! against the ledger and scheduler; a follower endpoint serves writes and reads; bad
//! input (unknown ids, 7-decimal amounts, unreachable endpoints, bad flags) fails with a
//! clear message and changes nothing.

mod common;

use allot_node::local_cluster::{node_binary, LocalCluster};
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Org 1's home shard with 2 shards (org mod 2).
const SHARD: &str = "1";
const C: u64 = 1_000_000;

fn free_port() -> u16 {
    allot_node::local_cluster::free_port().unwrap()
}

/// A node process started by the test (a fourth member), killed on drop.
struct ExtraNode(Child);

impl Drop for ExtraNode {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_extra_node(dir: &Path, id: u64, addr: &str, shards: u32) -> ExtraNode {
    let data = dir.join(format!("node-{id}"));
    std::fs::create_dir_all(&data).unwrap();
    let log = std::fs::File::create(data.join("node.log")).unwrap();
    let child = Command::new(node_binary().unwrap())
        .args(["run", "--node-id", &id.to_string(), "--listen", addr])
        .args(["--metrics-listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(&data)
        .args(["--shards", &shards.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    ExtraNode(child)
}

/// A fresh 3-node, 2-shard cluster initialised through allotctl, with its leaders:
/// (its dir, the cluster, its endpoints as allotctl takes them).
async fn up(prefix: &str) -> (tempfile::TempDir, LocalCluster, String) {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.path().into(), 3, 2).unwrap();
    c.start_all().unwrap();
    let eps = c.endpoints().join(",");
    init_cluster(&c, &eps);
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    (dir, c, eps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allotctl_drives_a_real_cluster() {
    let (dir, c, eps) = up("allotctl-").await;

    cluster_views(&eps);
    tenancy_and_grants(&eps);
    settings_from_the_environment(&eps);
    budgets_quotas_scheduler(&eps);
    jobs_and_nodes(&eps);
    follower_endpoint(&c, &eps);
    audit_trail(&eps);
    bad_input_changes_nothing(&eps);
    replicas_agree(&eps);
    operator_commands(&eps);
    bench(&eps);
    versions(&eps);
    dedup_jobs(&eps);
    leader_transfer(&eps);
    membership(dir.path(), &eps);
}

/// `job submit --dedup-key` at rule version 3 (`versions` activated it; DESIGN §53): a
/// second submission with the key attaches to the first; cancelling it refunds its
/// whole hold; a key past its bound is refused and nothing is submitted.
fn dedup_jobs(eps: &str) {
    let submit = |job: &str, key: &str| -> Vec<String> {
        [
            "job",
            "submit",
            "--org",
            "1",
            "--job",
            job,
            "--project",
            "11",
            "--user",
            "21",
            "--tier",
            "paid",
            "--gpu-types",
            "A100",
            "--gpus",
            "1",
            "--max-duration",
            "1h",
            "--dedup-key",
            key,
        ]
        .map(String::from)
        .to_vec()
    };
    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let first = json(eps, &args(&submit("900", "prompt-7")));
    assert_eq!(u(&first["job"]), 900);
    assert!(first.get("attached_to").is_none(), "{first}");
    let second = json(eps, &args(&submit("901", "prompt-7")));
    assert_eq!(
        (u(&second["attached_to"]), second["state"].as_str()),
        (900, Some("Attached")),
        "{second}"
    );
    let st = json(eps, &["job", "status", "--org", "1", "--job", "901"]);
    assert_eq!(st["state"].as_str(), Some("Attached"), "{st}");
    let cancelled = json(eps, &["job", "cancel", "--org", "1", "--job", "901"]);
    assert_eq!(
        u(&cancelled["settlement"]["captured_micro"]),
        0,
        "{cancelled}"
    );
    assert!(
        u(&cancelled["settlement"]["refunded_micro"]) > 0,
        "{cancelled}"
    );
    let long = "k".repeat(allot_statemachine::limits::DEDUP_KEY_BYTES_MAX + 1);
    let e = fails(eps, &args(&submit("902", &long)), 1);
    assert!(e.contains("INVALID_JOB") || e.contains("dedup"), "{e}");
    fails(eps, &["job", "status", "--org", "1", "--job", "902"], 1);
    // The job that runs is cancelled too: it leaves the fixtures' queue as it was.
    json(eps, &["job", "cancel", "--org", "1", "--job", "900"]);
}

/// `shard transfer-leader` (docs/DESIGN.md §49): one shard to a chosen voter, then
/// every shard a node leads; refusals and usage errors change nothing.
fn leader_transfer(eps: &str) {
    let leader_of = |shard: u64| -> u64 {
        let rows = json(eps, &["endpoint", "status"]);
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| u(&r["shard"]) == shard && u(&r["leader"]) >= 1)
            .map(|r| u(&r["leader"]))
            .expect("a leader")
    };
    let from = leader_of(0);
    let to = (1..=3).find(|id| *id != from).unwrap();
    let rows = json(
        eps,
        &[
            "shard",
            "transfer-leader",
            "--shard",
            "0",
            "--to",
            &to.to_string(),
        ],
    );
    let r = &rows.as_array().unwrap()[0];
    assert_eq!((u(&r["from"]), u(&r["to"])), (from, to), "{r}");
    assert_eq!(leader_of(0), to);
    let rows = json(
        eps,
        &["shard", "transfer-leader", "--from-node", &to.to_string()],
    );
    let rows = rows.as_array().unwrap();
    assert!(!rows.is_empty() && rows.iter().all(|r| u(&r["to"]) != to));
    assert_ne!(leader_of(0), to);
    fails(eps, &["shard", "transfer-leader"], 2);
    let e = fails(
        eps,
        &["shard", "transfer-leader", "--shard", "0", "--to", "9"],
        1,
    );
    assert!(e.contains("not a voter"), "{e}");
}

/// `version status` and `version activate` (docs/DESIGN.md §48), and the new columns
/// of `endpoint status`.
fn versions(eps: &str) {
    let max = allot_statemachine::version::RULES_MAX as u64;
    let nodes = json(eps, &["version", "status"]);
    let nodes = nodes.as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    for n in nodes {
        assert_eq!(u(&n["rules_max"]), max);
        assert_eq!(
            u(&n["format_version"]),
            allot_statemachine::codec::FORMAT_VERSION as u64
        );
        assert!(n["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| u(&s[1]) == 1));
    }
    let rows = json(eps, &["endpoint", "status"]);
    assert!(rows
        .as_array()
        .unwrap()
        .iter()
        .all(|r| u(&r["rules_active"]) == 1
            && u(&r["rules_max"]) == max
            && r["snapshot_index"].is_u64()
            && r["purged_index"].is_u64()
            && u(&r["audit_head_seq"]) > 0
            && u(&r["audit_verified_seq"]) <= u(&r["audit_head_seq"])));
    // A version this build does not implement: refused by every node, nothing changed.
    let e = fails(
        eps,
        &["version", "activate", "--to", &(max + 1).to_string()],
        1,
    );
    assert!(e.contains(&format!("supports up to {max}")), "{e}");
    let done = json(eps, &["version", "activate", "--to", &max.to_string()]);
    let done = done.as_array().unwrap();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|r| u(&r["rules_active"]) == max));
    let rows = poll(
        "every replica applied the activation",
        Duration::from_secs(20),
        || {
            let rows = json(eps, &["endpoint", "status"]);
            let arr = rows.as_array().unwrap().clone();
            arr.iter()
                .all(|r| u(&r["rules_active"]) == max)
                .then_some(arr)
        },
    );
    assert_eq!(rows.len(), 6);
}

fn init_cluster(c: &LocalCluster, eps: &str) {
    let members: Vec<String> = c
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.addr))
        .collect();
    // Dev mode (the nodes run with --insecure-dev-mode): the tests act as several
    // identities by claiming them; the security tests cover tokens.
    let mut args = vec!["cluster", "init", "--insecure"];
    for m in &members {
        args.extend(["--member", m]);
    }
    // A wrong shard count is refused before anything is initialised.
    let mut wrong = args.clone();
    wrong.extend(["--shards", "3"]);
    let e = fails(eps, &wrong, 1);
    assert!(e.contains("--shards 3") && e.contains("2 shards"), "{e}");
    args.extend(["--shards", "2"]);
    let v = json(eps, &args);
    assert_eq!(u(&v["shards"]), 2);
    let init = v["initialised"].as_array().unwrap();
    // Shard s went through the (s mod 3)-th member: node 1 for shard 0, node 2 for 1.
    assert_eq!(u(&init[0]["through"]), 1);
    assert_eq!(u(&init[1]["through"]), 2);
    assert!(init.iter().all(|s| u(&s["leader"]) >= 1));
}

fn cluster_views(eps: &str) {
    // One row per endpoint and shard, and exactly one leader per shard.
    let rows = poll("one leader per shard", Duration::from_secs(20), || {
        let rows = json(eps, &["endpoint", "status"]);
        let arr = rows.as_array().unwrap().clone();
        let leaders = |s: u64| {
            arr.iter()
                .filter(|r| u(&r["shard"]) == s && r["is_leader"] == true)
                .count()
        };
        (leaders(0) == 1 && leaders(1) == 1).then_some(arr)
    });
    assert_eq!(rows.len(), 6);
    assert!(rows
        .iter()
        .all(|r| r["error"].is_null() && u(&r["applied_index"]) > 0));
    let members = json(eps, &["member", "list"]);
    let members = members.as_array().unwrap();
    assert_eq!(members.len(), 2);
    for m in members {
        assert_eq!(m["voters"], serde_json::json!([1, 2, 3]));
        assert!(u(&m["leader"]) >= 1);
    }
    // The table form is aligned text with a header.
    let o = ctl(eps, &["endpoint", "status"]);
    assert_eq!(o.code, 0);
    assert!(
        o.stdout.starts_with("ENDPOINT") && o.stdout.lines().count() == 7,
        "{}",
        o.stdout
    );
}

fn tenancy_and_grants(eps: &str) {
    let v = json(eps, &["price", "set", "A100=2", "h100=4"]);
    assert_eq!(v["versions"].as_array().unwrap().len(), 2);
    let prices = json(eps, &["price", "list"]);
    for p in prices.as_array().unwrap() {
        assert_eq!(u(&p["prices_micro_per_gpu_hour"]["A100"]), 2 * C);
        assert_eq!(u(&p["prices_micro_per_gpu_hour"]["H100"]), 4 * C);
    }
    let v = json(eps, &["org", "create", "--org", "1"]);
    assert_eq!((u(&v["org"]), u(&v["shard"])), (1, 1));
    json(eps, &["project", "create", "--org", "1", "--project", "11"]);
    json(eps, &["user", "create", "--org", "1", "--user", "21"]);
    let paid = json(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            "1",
            "--owner",
            "project:11",
            "--kind",
            "paid",
            "--amount",
            "100",
            "--bucket",
            "100",
            "--source-ref",
            "purchase-1",
        ],
    );
    assert_eq!(
        (u(&paid["bucket"]), u(&paid["amount_micro"])),
        (100, 100 * C)
    );
    // Without --bucket, a fresh bucket id is made and printed.
    let promo = json(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            "1",
            "--owner",
            "project:11",
            "--kind",
            "promotional",
            "--amount",
            "5.5",
            "--expires-in",
            "1h",
            "--gpu-types",
            "A100,H100",
            "--tiers",
            "free,paid",
        ],
    );
    let promo_bucket = u(&promo["bucket"]);
    assert!(promo_bucket != 100 && promo_bucket > 0);
    assert_eq!(promo["policy"]["tiers"], serde_json::json!([0, 1]));
    let b = json(eps, &["balance", "--org", "1", "--project", "11"]);
    assert_eq!(u(&b["paid_available_micro"]), 100 * C);
    assert_eq!(u(&b["promotional_available_micro"]), 5_500_000);
    assert_eq!(u(&b["available_micro"]), 105_500_000);
    assert_eq!(u(&b["held_micro"]), 0);
    assert_eq!(u(&b["upcoming_expirations"][0]["bucket"]), promo_bucket);
    let o = ctl(eps, &["balance", "--org", "1", "--project", "11"]);
    assert!(
        o.stdout.contains("100.000000") && o.stdout.contains("EXPIRING BUCKET"),
        "{}",
        o.stdout
    );
}

/// Every global flag also comes from an `ALLOTCTL_*` variable.
fn settings_from_the_environment(eps: &str) {
    let run = |identity: &str, args: &[&str]| {
        let child = Command::new(CTL)
            .args(args)
            .env("ALLOTCTL_ENDPOINTS", eps)
            .env("ALLOTCTL_OUTPUT", "json")
            .env("ALLOTCTL_TIMEOUT", "5s")
            .env("ALLOTCTL_RETRIES", "3")
            .env("ALLOTCTL_AS", identity)
            .env_remove("ALLOTCTL_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_bounded(child, Duration::from_secs(30))
    };
    let out = run("org:1", &["balance", "--org", "1", "--project", "11"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(u(&b["paid_available_micro"]), 100 * C);
    // The identity from the environment: a tenant of org 1 may create in org 1 only.
    let out = run("org:1", &["user", "create", "--org", "1", "--user", "22"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run("org:1", &["org", "create", "--org", "9"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[Unauthorized]"));
    let out = run("root", &["balance", "--org", "1"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a bad ALLOTCTL_AS is a usage error"
    );
    // ALLOTCTL_TOKEN is sent: a token the cluster does not know is refused even in dev
    // mode (a bearer token always overrides the claimed identity), and nothing is shown.
    let child = Command::new(CTL)
        .args(["balance", "--org", "1"])
        .env("ALLOTCTL_ENDPOINTS", eps)
        .env("ALLOTCTL_RETRIES", "1")
        .env(
            "ALLOTCTL_TOKEN",
            "alt_not-a-token-of-this-cluster-000000000000",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_bounded(child, Duration::from_secs(30));
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(err.contains("unauthenticated"), "{err}");
    assert!(out.stdout.is_empty());
}

fn budgets_quotas_scheduler(eps: &str) {
    let set = [
        "budget",
        "set",
        "--org",
        "1",
        "--scope",
        "project:11",
        "--limit",
        "1000",
        "--period",
        "month",
        "--mode",
        "soft",
    ];
    let v = json(eps, &set);
    assert_eq!(u(&v["budget"]["limit_micro"]), 1_000 * C);
    let v = json(
        eps,
        &["budget", "show", "--org", "1", "--scope", "project:11"],
    );
    assert_eq!(v["budget"]["mode"], "Soft");
    let v = json(
        eps,
        &[
            "budget",
            "set",
            "--org",
            "1",
            "--scope",
            "project:11",
            "--clear",
        ],
    );
    assert!(v["budget"].is_null());
    let v = json(
        eps,
        &[
            "quota",
            "set",
            "--org",
            "1",
            "--queued-max",
            "5",
            "--running-max",
            "2",
        ],
    );
    assert_eq!(u(&v["quota"]["queued_max"]), 5);
    let v = json(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--node-lease",
            "10m",
            "--grace",
            "2s",
        ],
    );
    assert_eq!(u(&v[0]["settings"]["grace_ms"]), 2_000);
    let v = json(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--node-failure-requeues",
            "1",
            "--fence-margin",
            "15s",
        ],
    );
    assert_eq!(u(&v[0]["settings"]["node_failure_requeues_max"]), 1);
    assert_eq!(u(&v[0]["settings"]["fence_margin_ms"]), 15_000);
    assert_eq!(
        u(&v[0]["settings"]["grace_ms"]),
        2_000,
        "other settings kept"
    );
    // A margin beyond the lease bound is refused and changes nothing.
    fails(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--fence-margin",
            "3650d",
        ],
        1,
    );
    let v = json(eps, &["scheduler", "show", "--shard", SHARD]);
    assert_eq!(u(&v[0]["settings"]["fence_margin_ms"]), 15_000);
    // Fair-share weights: a project of org 1 weighs 250, then back to the default.
    let v = json(
        eps,
        &[
            "share",
            "set",
            "--org",
            "1",
            "--scope",
            "project:11",
            "--weight",
            "250",
        ],
    );
    assert_eq!(
        (v["scope"]["Project"].as_u64(), u(&v["weight"])),
        (Some(11), 250)
    );
    let v = json(
        eps,
        &[
            "share",
            "set",
            "--org",
            "1",
            "--scope",
            "project:11",
            "--clear",
        ],
    );
    assert_eq!(u(&v["weight"]), 100);
    let v = json(eps, &["scheduler", "show", "--shard", SHARD]);
    assert_eq!(u(&v[0]["settings"]["node_lease_ms"]), 600_000);
    assert_eq!(u(&v[0]["settings"]["grace_ms"]), 2_000);
    // The other shard kept its defaults.
    let v = json(eps, &["scheduler", "show"]);
    assert_eq!(u(&v[0]["settings"]["grace_ms"]), 30_000);
}

fn jobs_and_nodes(eps: &str) {
    let v = json(
        eps,
        &[
            "node",
            "register",
            "--shard",
            SHARD,
            "--node",
            "7",
            "--gpu-type",
            "a100",
            "--gpus",
            "8",
            "--mem-gb",
            "80",
            "--label",
            "rack=r1",
        ],
    );
    assert_eq!(
        (v[0]["gpu_type"].as_str(), u(&v[0]["free_gpus"])),
        (Some("A100"), 8)
    );
    let v = json(eps, &["node", "drain", "--shard", SHARD, "--node", "7"]);
    assert_eq!(v[0]["state"], "Draining");
    let before = json(eps, &["balance", "--org", "1", "--project", "11"]);

    // Submitted while the only node drains: it queues; cancelling refunds the whole hold.
    let submit = [
        "job",
        "submit",
        "--org",
        "1",
        "--job",
        "500",
        "--project",
        "11",
        "--user",
        "21",
        "--tier",
        "paid",
        "--gpu-types",
        "A100",
        "--gpus",
        "2",
        "--mem-gb",
        "40",
        "--max-duration",
        "1h",
        "--preemptible",
    ];
    let v = json(eps, &submit);
    assert_eq!(
        (v["state"].as_str(), u(&v["hold_micro"])),
        (Some("Queued"), 4 * C)
    );
    let b = json(eps, &["balance", "--org", "1", "--project", "11"]);
    assert_eq!(u(&b["held_micro"]), 4 * C);
    // The usage ranking counts the held credit against project 11 this month.
    let top = json(
        eps,
        &["usage", "--level", "project", "--org", "1", "--limit", "5"],
    );
    let row = top
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["scope"]["Project"].as_u64() == Some(11))
        .unwrap_or_else(|| panic!("project 11 not ranked: {top}"));
    assert!(u(&row["held_micro"]) >= 4 * C, "{row}");
    assert!(u(&row["used_micro"]) >= u(&row["held_micro"]), "{row}");
    assert_eq!(
        u(&b["available_micro"]),
        u(&before["available_micro"]) - 4 * C
    );
    let st = json(eps, &["job", "status", "--org", "1", "--job", "500"]);
    assert_eq!(
        (st["state"].as_str(), u(&st["hold_micro"])),
        (Some("Queued"), 4 * C)
    );
    let listed = json(eps, &["job", "list", "--org", "1"]);
    assert!(listed
        .as_array()
        .unwrap()
        .iter()
        .any(|j| u(&j["spec"]["job"]) == 500));
    let running = json(eps, &["job", "list", "--org", "1", "--state", "running"]);
    assert!(running.as_array().unwrap().is_empty());
    let q = json(eps, &["queue", "--shard", SHARD]);
    let paid = q
        .as_array()
        .unwrap()
        .iter()
        .find(|t| u(&t["tier"]) == 1)
        .unwrap();
    assert_eq!(
        (u(&paid["queued"]), paid["tier_name"].as_str()),
        (1, Some("paid"))
    );
    // The demand signal: the draining node is no capacity, so the job's 2 GPU-hours
    // (2 GPUs × 1 h) have no finite wait, and the paid tier needs 12 GPUs to run them
    // within its 10-minute target (half of them at --run-pct 50). (Who may ask is the
    // state machine's rule, `statemachine/tests/demand.rs`: in dev mode every reader is
    // the operator.)
    let d = json(eps, &["demand", "--shard", SHARD]);
    let a100 = &d.as_array().unwrap()[0];
    assert_eq!(a100["gpu_type"], "A100", "{d}");
    assert_eq!(
        (u(&a100["capacity_gpus"]), u(&a100["queued_jobs"])),
        (0, 1),
        "{d}"
    );
    assert_eq!(u(&a100["queued_gpu_ms"]), 2 * 3_600_000);
    assert!(a100["wait_ms"].is_null(), "{d}");
    assert_eq!(a100["tiers"][1]["tier_name"], "paid");
    assert_eq!(u(&a100["tiers"][1]["gpus_needed"]), 12);
    assert_eq!(
        u(&a100["tiers"][0]["gpus_needed"]),
        0,
        "nothing free queued"
    );
    let d = json(eps, &["demand", "--shard", SHARD, "--run-pct", "50"]);
    assert_eq!(u(&d[0]["tiers"][1]["gpus_needed"]), 6);
    let o = ctl(eps, &["demand", "--shard", SHARD]);
    assert!(
        o.stdout.contains("GPUS NEEDED") && o.stdout.contains("no capacity"),
        "{}",
        o.stdout
    );
    fails(eps, &["demand", "--run-pct", "0"], 2);
    fails(eps, &["demand", "--run-pct", "101"], 2);
    let cancel = json(eps, &["job", "cancel", "--org", "1", "--job", "500"]);
    assert_eq!(u(&cancel["settlement"]["refunded_micro"]), 4 * C);
    assert_eq!(u(&cancel["settlement"]["captured_micro"]), 0);
    let after = json(eps, &["balance", "--org", "1", "--project", "11"]);
    assert_eq!(
        after, before,
        "a cancelled queued job leaves the balance as it was"
    );

    // Back in service: a job is placed, holds 2 GPUs, and is settled on cancel.
    let v = json(
        eps,
        &["node", "drain", "--shard", SHARD, "--node", "7", "--undo"],
    );
    assert_eq!(v[0]["state"], "Ready");
    let mut submit = submit.to_vec();
    submit[5] = "501";
    json(eps, &submit);
    poll("job 501 placed", Duration::from_secs(10), || {
        let st = json(eps, &["job", "status", "--org", "1", "--job", "501"]);
        (st["state"] == "Placed").then_some(())
    });
    let nodes = json(eps, &["node", "list", "--shard", SHARD]);
    assert_eq!(u(&nodes[0]["free_gpus"]), 6);
    assert_eq!(nodes[0]["jobs"], serde_json::json!([501]));
    let q = json(eps, &["queue"]);
    assert!(q
        .as_array()
        .unwrap()
        .iter()
        .any(|t| u(&t["running_gpus"]) == 2));
    let cancel = json(eps, &["job", "cancel", "--org", "1", "--job", "501"]);
    let s = &cancel["settlement"];
    assert_eq!(u(&s["captured_micro"]) + u(&s["refunded_micro"]), 4 * C);
    let b = json(eps, &["balance", "--org", "1", "--project", "11"]);
    assert_eq!(u(&b["held_micro"]), 0);
    assert_eq!(
        u(&b["available_micro"]) + u(&b["consumed_micro"]),
        u(&b["issued_micro"])
    );
    let nodes = json(eps, &["node", "list"]);
    assert_eq!(u(&nodes[0]["free_gpus"]), 8);
}

/// A write and a read through a single follower endpoint.
fn follower_endpoint(c: &LocalCluster, eps: &str) {
    let rows = json(eps, &["endpoint", "status"]);
    let leader_addr = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["shard"] == 1 && r["is_leader"] == true)
        .map(|r| r["endpoint"].as_str().unwrap().to_string())
        .unwrap();
    let follower = c
        .endpoints()
        .into_iter()
        .find(|e| *e != leader_addr)
        .unwrap();
    json(
        &follower,
        &[
            "grant", "issue", "--org", "1", "--kind", "granted", "--amount", "7", "--bucket", "300",
        ],
    );
    let b = json(&follower, &["balance", "--org", "1"]);
    assert_eq!(u(&b["granted_available_micro"]), 7 * C);
    assert_eq!(b["account"], "org:1");
}

fn audit_trail(eps: &str) {
    let events = json(eps, &["audit", "--org", "1"]);
    let events = events.as_array().unwrap();
    let issued_100 = events
        .iter()
        .find(|e| e["kind"] == "issued" && e["body"]["Issued"]["bucket"] == 100)
        .expect("the paid grant's issue event");
    assert_eq!(u(&issued_100["body"]["Issued"]["amount_micro"]), 100 * C);
    assert_eq!(issued_100["actor"], "admin:1");
    // The seqs are increasing and each event names its chain predecessor's hash.
    assert!(events.windows(2).all(|w| u(&w[0]["seq"]) < u(&w[1]["seq"])));

    let job = json(eps, &["audit", "--org", "1", "--job", "500"]);
    let job = job.as_array().unwrap();
    let to: Vec<&str> = job
        .iter()
        .filter(|e| e["kind"] == "job_transition")
        .map(|e| e["body"]["JobTransition"]["to"].as_str().unwrap())
        .collect();
    assert_eq!(to, ["Queued", "Cancelled"]);
    let refunded: u64 = job
        .iter()
        .filter(|e| e["kind"] == "refunded")
        .map(|e| u(&e["body"]["Refunded"]["amount_micro"]))
        .sum();
    assert_eq!(refunded, 4 * C);

    // export: JSON lines, the same events.
    let o = ctl(eps, &["audit", "export", "--org", "1"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let lines: Vec<Value> = o
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON event per line"))
        .collect();
    let seqs = |v: &[Value]| v.iter().map(|e| u(&e["seq"])).collect::<Vec<_>>();
    assert_eq!(seqs(&lines), seqs(events));
    // Time and project filters.
    let recent = json(eps, &["audit", "--org", "1", "--since", "1h"]);
    assert_eq!(recent.as_array().unwrap().len(), events.len());
    let old = json(
        eps,
        &["audit", "--org", "1", "--until", "2020-01-01T00:00:00Z"],
    );
    assert!(old.as_array().unwrap().is_empty());
    let project = json(eps, &["audit", "--org", "1", "--project", "11"]);
    let project = project.as_array().unwrap();
    assert!(!project.is_empty() && project.len() < events.len());
    assert!(project.iter().all(|e| e["account"] == "project:11"));
    let shard = json(eps, &["audit", "--shard", SHARD, "--limit", "5"]);
    assert_eq!(shard.as_array().unwrap().len(), 5);
    let o = ctl(eps, &["audit", "--org", "1", "--job", "500"]);
    assert!(
        o.stdout.starts_with("SEQ") && o.stdout.contains("Queued -> Cancelled"),
        "{}",
        o.stdout
    );

    // --follow picks up an event that lands while it runs.
    let follow = spawn_ctl(
        eps,
        &[
            "audit",
            "--org",
            "1",
            "--follow",
            "--follow-for",
            "5s",
            "-o",
            "json",
            "--from-seq",
            "0",
        ],
    );
    json(
        eps,
        &[
            "grant", "issue", "--org", "1", "--kind", "granted", "--amount", "1", "--bucket", "400",
        ],
    );
    let out = wait_bounded(follow, Duration::from_secs(30));
    assert!(out.status.success());
    let followed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(followed
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["kind"] == "issued" && e["body"]["Issued"]["bucket"] == 400));
}

fn bad_input_changes_nothing(eps: &str) {
    let totals = json(eps, &["totals"]);
    let balance = json(eps, &["balance", "--org", "1", "--project", "11"]);

    let e = fails(
        eps,
        &["project", "create", "--org", "999", "--project", "5"],
        1,
    );
    assert!(
        e.contains("unknown organisation") && e.contains("[UnknownOrg]"),
        "{e}"
    );
    let e = fails(eps, &["balance", "--org", "999"], 1);
    assert!(e.contains("unknown account org:999"), "{e}");
    let e = fails(eps, &["job", "status", "--org", "1", "--job", "424242"], 1);
    assert!(e.contains("unknown job:424242"), "{e}");
    // A tenant of org 2 cannot act in org 1 (told "unknown", like a missing org).
    let e = fails(
        eps,
        &[
            "--as",
            "org:2",
            "project",
            "create",
            "--org",
            "1",
            "--project",
            "77",
        ],
        1,
    );
    assert!(e.contains("[UnknownOrg]"), "{e}");
    let e = fails(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            "1",
            "--kind",
            "paid",
            "--amount",
            "1.1234567",
        ],
        2,
    );
    assert!(e.contains("at most 6 decimals"), "{e}");
    let e = fails(eps, &["org", "create", "--org", "5", "--bogus"], 2);
    assert!(e.contains("--bogus"), "{e}");
    let e = fails(
        eps,
        &[
            "job",
            "submit",
            "--org",
            "1",
            "--project",
            "11",
            "--user",
            "21",
            "--tier",
            "platinum",
            "--gpu-types",
            "A100",
            "--gpus",
            "1",
            "--max-duration",
            "1h",
        ],
        2,
    );
    assert!(
        e.contains("platinum") && e.contains("free, paid, enterprise"),
        "{e}"
    );
    let e = fails(eps, &["scheduler", "configure"], 2);
    assert!(e.contains("nothing to change"), "{e}");
    let e = fails(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--job-lease",
            "10ms",
        ],
        1,
    );
    assert!(e.contains("[InvalidConfig]"), "{e}");
    let e = fails(
        eps,
        &[
            "job",
            "submit",
            "--org",
            "1",
            "--job",
            "600",
            "--project",
            "11",
            "--user",
            "21",
            "--tier",
            "paid",
            "--gpu-types",
            "A100",
            "--gpus",
            "2",
            "--max-duration",
            "1000h",
        ],
        1,
    );
    assert!(e.contains("InvalidJob"), "{e}");

    // Nothing listens on this port: a clear error, fast, bounded retries.
    let dead = format!("127.0.0.1:{}", free_port());
    let o = ctl(&dead, &["--timeout", "5s", "org", "create", "--org", "5"]);
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(
        o.stderr.contains("unreachable") && o.stderr.contains(&dead),
        "{}",
        o.stderr
    );
    assert!(o.elapsed < Duration::from_secs(10), "took {:?}", o.elapsed);

    assert_eq!(
        json(eps, &["totals"]),
        totals,
        "bad input changed the totals"
    );
    assert_eq!(
        json(eps, &["balance", "--org", "1", "--project", "11"]),
        balance
    );
    fails(eps, &["balance", "--org", "5"], 1);
}

fn replicas_agree(eps: &str) {
    let rows = json(eps, &["shard", "hash", "--check"]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 6);
    for shard in 0..2u64 {
        let of: Vec<&Value> = rows.iter().filter(|r| u(&r["shard"]) == shard).collect();
        assert_eq!(of.len(), 3);
        assert!(
            of.iter().all(|r| r["state_hash"] == of[0]["state_hash"]),
            "{of:?}"
        );
        assert!(of
            .iter()
            .all(|r| r["applied_index"] == of[0]["applied_index"]));
        assert_eq!(of[0]["state_hash"].as_str().unwrap().len(), 64);
    }
    let one = json(eps, &["shard", "hash", "--shard", "0"]);
    assert_eq!(one.as_array().unwrap().len(), 3);
}

/// `check`, `balance --buckets`, `--request-id` retries, `grant issue --expires-in` on
/// the cluster's logical time, every scheduler setting, refusals without debug text.
fn operator_commands(eps: &str) {
    // check: every replica of every shard, invariants and equal hashes.
    let rows = json(eps, &["check"]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 6, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r["invariants"] == "ok" && r["hash_agrees"] == true && r["error"].is_null()),
        "{rows:?}"
    );
    let o = ctl(eps, &["check", "--shard", "0"]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.starts_with("ENDPOINT") && o.stdout.lines().count() == 4);

    // A relative expiry is evaluated when the cluster applies the grant, and a hand
    // retry with the same --request-id is answered, not applied twice.
    let before = u(&json(eps, &["balance", "--org", "1", "--project", "11"])["available_micro"]);
    let grant = [
        "--request-id",
        "0x5eed",
        "grant",
        "issue",
        "--org",
        "1",
        "--owner",
        "project:11",
        "--kind",
        "granted",
        "--amount",
        "2",
        "--expires-in",
        "1h",
        "--source-ref",
        "retry-me",
    ];
    let first = json(eps, &grant);
    let again = json(eps, &grant);
    assert_eq!(first["bucket"], again["bucket"]);
    assert_eq!(first["expires_at_ms"], again["expires_at_ms"]);
    let b = json(
        eps,
        &["balance", "--org", "1", "--project", "11", "--buckets"],
    );
    assert_eq!(u(&b["available_micro"]), before + 2 * C, "issued once");
    let buckets = b["buckets"].as_array().unwrap();
    let mine = buckets
        .iter()
        .find(|x| x["bucket"] == first["bucket"])
        .unwrap();
    assert_eq!(mine["kind"], "Granted");
    assert_eq!(mine["source_ref"], "retry-me");
    assert_eq!(u(&mine["remaining_micro"]), 2 * C);
    assert_eq!(u(&mine["held_micro"]), 0);
    let paid = buckets.iter().find(|x| u(&x["bucket"]) == 100).unwrap();
    assert_eq!(paid["source_ref"], "purchase-1");
    // Exactly one hour after the logical time of the entry that issued it.
    let events = json(
        eps,
        &["audit", "--org", "1", "--project", "11", "--limit", "1000"],
    );
    let issued = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body"]["Issued"]["bucket"] == first["bucket"])
        .unwrap_or_else(|| panic!("no audit event of the grant: {events:?}"));
    assert_eq!(
        u(&mine["expires_at_ms"]),
        u(&issued["time_ms"]) + 3_600_000,
        "{issued:?}"
    );
    let o = ctl(
        eps,
        &["balance", "--org", "1", "--project", "11", "--buckets"],
    );
    assert!(
        o.stdout.contains("retry-me") && o.stdout.contains("SOURCE"),
        "{}",
        o.stdout
    );
    let e = fails(
        eps,
        &["--request-id", "0", "org", "create", "--org", "9"],
        2,
    );
    assert!(e.contains("must not be zero"), "{e}");

    // An alert on a project already below its threshold fires once, at once.
    let alert = [
        "budget",
        "alert",
        "--org",
        "1",
        "--scope",
        "project:11",
        "--low-balance",
        "100000",
    ];
    let v = json(eps, &alert);
    assert_eq!(u(&v["alert"]["low_balance_micro"]), 100_000 * C);
    json(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            "1",
            "--owner",
            "project:11",
            "--kind",
            "paid",
            "--amount",
            "1",
        ],
    );
    let lows = |eps: &str| {
        json(
            eps,
            &["audit", "--org", "1", "--project", "11", "--limit", "10000"],
        )
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "low_balance")
        .count()
    };
    assert_eq!(lows(eps), 1, "below and still below: one event");
    let e = fails(
        eps,
        &[
            "budget",
            "alert",
            "--org",
            "1",
            "--scope",
            "project:11",
            "--budget-pcts",
            "80,50",
        ],
        1,
    );
    assert!(e.contains("[DuplicateEntry]"), "{e}");
    let v = json(
        eps,
        &[
            "budget",
            "alert",
            "--org",
            "1",
            "--scope",
            "project:11",
            "--clear",
        ],
    );
    assert!(v["alert"].is_null());

    // Every setting of the configure command, tiers included.
    let v = json(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--preemption-loss-max",
            "4h",
            "--tier",
            "paid:weight=3,max-wait=2h,price=120",
            "--tier",
            "0:ceiling=60",
        ],
    );
    let s = &v[0]["settings"];
    assert_eq!(u(&s["preemption_loss_max_gpu_ms"]), 4 * 3_600_000);
    assert_eq!(u(&s["tiers"][1]["weight"]), 3);
    assert_eq!(u(&s["tiers"][1]["max_wait_ms"]), 2 * 3_600_000);
    assert_eq!(u(&s["tiers"][1]["price_pct"]), 120);
    assert_eq!(u(&s["tiers"][0]["ceiling_pct"]), 60);
    // Refused whole by the shard, and named without Rust debug text.
    let e = fails(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--tier",
            "paid:floor=99",
        ],
        1,
    );
    assert!(
        e.contains("tier share") && e.contains("[InvalidConfig]"),
        "{e}"
    );
    let e = fails(
        eps,
        &["scheduler", "configure", "--tier", "gold:weight=2"],
        2,
    );
    assert!(e.contains("free, paid, enterprise"), "{e}");
    json(
        eps,
        &[
            "scheduler",
            "configure",
            "--shard",
            SHARD,
            "--tier",
            "paid:price=100",
        ],
    );
}

fn bench(eps: &str) {
    let o = ctl(
        eps,
        &[
            "bench",
            "--concurrency",
            "4",
            "--duration",
            "2s",
            "-o",
            "json",
        ],
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: Value = serde_json::from_str(&o.stdout).unwrap();
    assert!(u(&v["commands"]) > 10, "{v}");
    assert_eq!(u(&v["errors"]), 0, "{v}");
    let (p50, p99, max) = (
        v["p50_ms"].as_f64().unwrap(),
        v["p99_ms"].as_f64().unwrap(),
        v["max_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{v}");
    assert!(v["commands_per_s"].as_f64().unwrap() > 0.0);
    assert!(
        o.stderr.contains("bench:") && o.stderr.contains("ops"),
        "progress lines: {}",
        o.stderr
    );
}

fn membership(dir: &Path, eps: &str) {
    let addr = format!("127.0.0.1:{}", free_port());
    let _node4 = start_extra_node(dir, 4, &addr, 2);
    let v = json(
        eps,
        &[
            "--timeout",
            "30s",
            "member",
            "add-learner",
            "--id",
            "4",
            "--addr",
            &addr,
        ],
    );
    let v = v.as_array().unwrap();
    assert_eq!(v.len(), 2);
    assert!(
        v.iter().all(|s| s["learners"] == serde_json::json!([4])),
        "{v:?}"
    );
    let v = json(eps, &["--timeout", "30s", "member", "promote", "--id", "4"]);
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .all(|s| s["voters"] == serde_json::json!([1, 2, 3, 4])),
        "{v}"
    );
    let e = fails(eps, &["member", "promote", "--id", "4"], 1);
    assert!(e.contains("already a voter"), "{e}");
    let v = json(eps, &["--timeout", "30s", "member", "remove", "--id", "4"]);
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .all(|s| s["voters"] == serde_json::json!([1, 2, 3])),
        "{v}"
    );
    let list = json(eps, &["member", "list"]);
    assert!(list
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["voters"] == serde_json::json!([1, 2, 3])));
}

/// allotctl's retries span its whole `--timeout` (issue 23): a write sent while no node
/// of the cluster runs (so no leader can answer) is retried, backing off, until the
/// nodes are back and elect leaders, and succeeds. An explicit `--retries` still caps
/// the attempts. Before, a fixed 6 retries gave up after ~1–3 s, in the middle of an
/// election, with 7 s of the 10 s timeout left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waits_out_a_cluster_without_a_leader_until_its_timeout() {
    let (_dir, mut c, eps) = up("allotctl-retries-").await;

    for id in 1..=3 {
        c.kill(id);
    }
    // A fixed budget still gives up early (the flag keeps working).
    let capped = ctl(&eps, &["--retries", "3", "org", "create", "--org", "41"]);
    assert_eq!(capped.code, 1, "{}", capped.stderr);
    assert!(
        capped.stderr.contains("gave up after") && capped.stderr.contains("unreachable"),
        "{}",
        capped.stderr
    );
    assert!(
        capped.elapsed < Duration::from_secs(8),
        "{:?}",
        capped.elapsed
    );

    let write = spawn_ctl(
        &eps,
        &[
            "--timeout",
            "30s",
            "-o",
            "json",
            "org",
            "create",
            "--org",
            "42",
        ],
    );
    std::thread::sleep(Duration::from_secs(4));
    c.start_all().unwrap();
    let out = wait_bounded(write, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the write must wait for the cluster within its timeout: {stderr}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(u(&v["org"]), 42, "{v}");
    // And it was applied once: the org exists.
    let again = fails(&eps, &["org", "create", "--org", "42"], 1);
    assert!(again.contains("AlreadyExists"), "{again}");
}
