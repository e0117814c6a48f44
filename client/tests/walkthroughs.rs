//! The three seed walk-throughs end to end, through `allotctl` against a real 3-node
//! cluster, with `allot-agent --simulate` playing the GPU nodes:
//!
//! 1. a checkpointable job preempted at ~60% of its hold is charged only to its last
//!    checkpoint, and the rest of its hold goes back to the exact bucket it came from;
//! 2. a lost finish (the agent SIGKILLed mid-job): the job ends Lost on its job lease,
//!    charged to its last heartbeat, the rest refunded;
//! 3. a promotional bucket expiring mid-run: the held credit stays valid for the running
//!    job, and the refund that lands after the expiry is forfeited (counted as expired).
//!
//! Prices are 3600 credits per GPU-hour (1 credit per GPU-second, 1,000 micro-credits
//! per GPU-millisecond), so every charge is checked exactly against the logical
//! instants in the audit trail.

mod common;

use allot_node::local_cluster::{node_binary, LocalCluster};
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const AGENT: &str = env!("CARGO_BIN_EXE_allot-agent");
const C: u64 = 1_000_000;
/// Micro-credits per GPU-millisecond at 3600 credits per GPU-hour.
const PER_GPU_MS: u64 = 1_000;

// ---------------------------------------------------------------- helpers

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A running `allot-agent --simulate`; killed (SIGKILL) on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn agent(eps: &str, dir: &Path, node: u64, gpu_type: &str, gpus: u32, runtime: &str) -> Agent {
    let work = dir.join(format!("agent-{node}"));
    std::fs::create_dir_all(&work).unwrap();
    let log = std::fs::File::create(work.join("agent.log")).unwrap();
    let child = Command::new(AGENT)
        .args([
            "--endpoints",
            eps,
            "--shard",
            "0",
            "--node",
            &node.to_string(),
        ])
        .args([
            "--gpu-type",
            gpu_type,
            "--gpus",
            &gpus.to_string(),
            "--mem-gb",
            "80",
        ])
        .args([
            "--heartbeat-interval",
            "1s",
            "--node-heartbeat-interval",
            "1s",
        ])
        .args(["--grace", "5s", "--simulate", "--sim-runtime", runtime])
        .args(["--sim-checkpoint-every", "2s", "-v"])
        .arg("--work-dir")
        .arg(&work)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("allot-agent runs");
    Agent(child)
}

/// An org with one project and one user (ids `org`, `org*10+1`, `org*10+2`).
fn tenant(eps: &str, org: u64) -> (String, String, String) {
    let (o, p, us) = (
        org.to_string(),
        (org * 10 + 1).to_string(),
        (org * 10 + 2).to_string(),
    );
    json(eps, &["org", "create", "--org", &o]);
    json(eps, &["project", "create", "--org", &o, "--project", &p]);
    json(eps, &["user", "create", "--org", &o, "--user", &us]);
    (o, p, us)
}

fn job(eps: &str, org: &str, job: u64) -> Value {
    json(
        eps,
        &["job", "status", "--org", org, "--job", &job.to_string()],
    )
}

fn wait_state(eps: &str, org: &str, id: u64, state: &str, limit: Duration) -> Value {
    poll(&format!("job {id} {state}"), limit, || {
        let j = job(eps, org, id);
        (j["state"] == state).then_some(j)
    })
}

/// The audit events of one job (its hold).
fn job_events(eps: &str, org: &str, id: u64) -> Vec<Value> {
    let v = json(eps, &["audit", "--org", org, "--job", &id.to_string()]);
    v.as_array().unwrap().clone()
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

/// Sum of a movement kind's amounts, per bucket or overall.
fn moved(events: &[Value], kind: &str, body: &str, bucket: Option<u64>) -> u64 {
    of_kind(events, kind)
        .iter()
        .filter(|e| bucket.is_none_or(|b| u(&e["body"][body]["bucket"]) == b))
        .map(|e| u(&e["body"][body]["amount_micro"]))
        .sum()
}

/// Net charge of a hold: captured minus capture reversals.
fn charged(events: &[Value]) -> u64 {
    moved(events, "captured", "Captured", None)
        - moved(events, "capture_reversed", "CaptureReversed", None)
}

/// (to-state, reason, time) of each job transition.
fn transitions(events: &[Value]) -> Vec<(String, Value, u64)> {
    of_kind(events, "job_transition")
        .iter()
        .map(|e| {
            let t = &e["body"]["JobTransition"];
            (
                t["to"].as_str().unwrap().to_string(),
                t["reason"].clone(),
                u(&e["time_ms"]),
            )
        })
        .collect()
}

fn transition_time(events: &[Value], to: &str) -> u64 {
    transitions(events)
        .into_iter()
        .find(|(s, ..)| s == to)
        .unwrap_or_else(|| panic!("no transition to {to}"))
        .2
}

/// Logical instants of the heartbeats the shard accepted from `agent`.
fn accepted_heartbeats(events: &[Value], agent: &str) -> Vec<u64> {
    of_kind(events, "command")
        .iter()
        .filter(|e| e["actor"] == agent)
        .filter(|e| e["body"]["Command"]["outcome"]["Ok"]["JobHeartbeat"]["accepted"] == true)
        .map(|e| u(&e["time_ms"]))
        .collect()
}

// ---------------------------------------------------------------- the walk-throughs

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_walkthroughs_through_allotctl_and_the_agent() {
    let dir = tempfile::Builder::new()
        .prefix("allot-walk-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.path().into(), 3, 1).unwrap();
    c.start_all().unwrap();
    let eps = c.endpoints().join(",");
    let mut init = vec!["cluster".to_string(), "init".into(), "--insecure".into()];
    for n in &c.nodes {
        init.extend(["--member".into(), format!("{}={}", n.id, n.addr)]);
    }
    json(&eps, &init.iter().map(String::as_str).collect::<Vec<_>>());
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    json(&eps, &["price", "set", "A100=3600", "H100=3600", "L4=3600"]);

    preempted_at_60_percent(&eps, dir.path());
    lost_finish(&eps, dir.path());
    promotional_credit_expires_mid_run(&eps, dir.path());
    let hashes = json(&eps, &["shard", "hash", "--check"]);
    assert_eq!(
        hashes.as_array().unwrap().len(),
        3,
        "every replica answered and agreed"
    );
}

/// Walk-through 1: promo 30 + paid 100 credits; an 8-GPU job of at most 10 s holds 80
/// credits (30 promo, 50 paid); at ~6 s an enterprise job needs the node.
fn preempted_at_60_percent(eps: &str, dir: &Path) {
    json(
        eps,
        &[
            "scheduler",
            "configure",
            "--min-runtime",
            "0s",
            "--grace",
            "5s",
            "--hysteresis",
            "0s",
        ],
    );
    let (org, project, user) = tenant(eps, 1);
    let (org2, project2, user2) = tenant(eps, 2);
    // The enterprise tier is granted by the operator (a plan), never self-chosen.
    json(
        eps,
        &[
            "plan",
            "set",
            "--org",
            &org2,
            "--tiers",
            "free,paid,enterprise",
        ],
    );
    let grant = |org: &str, owner: &str, kind: &str, amount: &str, bucket: &str| {
        json(
            eps,
            &[
                "grant", "issue", "--org", org, "--owner", owner, "--kind", kind, "--amount",
                amount, "--bucket", bucket,
            ],
        )
    };
    let owner = format!("project:{project}");
    grant(&org, &owner, "promotional", "30", "101");
    grant(&org, &owner, "paid", "100", "102");
    grant(&org2, "org", "paid", "1000", "201");
    json(
        eps,
        &[
            "node",
            "register",
            "--shard",
            "0",
            "--node",
            "1",
            "--gpu-type",
            "A100",
            "--gpus",
            "8",
            "--mem-gb",
            "80",
        ],
    );
    let _agent = agent(eps, dir, 1, "A100", 8, "60s..60s");

    let victim = json(
        eps,
        &[
            "job",
            "submit",
            "--org",
            &org,
            "--job",
            "1001",
            "--project",
            &project,
            "--user",
            &user,
            "--tier",
            "free",
            "--gpu-types",
            "A100",
            "--gpus",
            "8",
            "--mem-gb",
            "40",
            "--preemptible",
            "--checkpointable",
            "--max-duration",
            "10s",
        ],
    );
    assert_eq!(u(&victim["hold_micro"]), 80 * C, "10 s x 8 GPUs x 1 credit");
    let running = wait_state(eps, &org, 1001, "Running", Duration::from_secs(15));
    let started = u(&running["placement"]["started_ms"]);
    // Let it run to ~60% of its max duration (logical time follows the wall clock).
    poll("6 s of run time", Duration::from_secs(15), || {
        (now_ms() >= started + 6_000).then_some(())
    });
    json(
        eps,
        &[
            "job",
            "submit",
            "--org",
            &org2,
            "--job",
            "2001",
            "--project",
            &project2,
            "--user",
            &user2,
            "--tier",
            "enterprise",
            "--gpu-types",
            "A100",
            "--gpus",
            "8",
            "--max-duration",
            "30s",
        ],
    );

    // The victim is preempted, stops at a checkpoint and goes back to the queue.
    let requeued = poll("job 1001 requeued", Duration::from_secs(15), || {
        let j = job(eps, &org, 1001);
        assert_ne!(j["state"], "Failed", "the victim hit its deadline: {j}");
        (j["state"] == "Queued" && u(&j["preemptions"]) == 1).then_some(j)
    });
    assert_eq!(requeued["last_reason"], "Requeued");
    wait_state(eps, &org2, 2001, "Running", Duration::from_secs(15));
    let run_ms = u(&requeued["run_ms"]);
    let events = job_events(eps, &org, 1001);
    let charge = charged(&events);
    assert_eq!(
        charge,
        run_ms * 8 * PER_GPU_MS,
        "charged exactly the billed run time"
    );
    assert!(
        (40 * C..=90 * C).contains(&charge),
        "preempted at ~60% of the 80-credit hold, charged {charge}"
    );
    // The billed run ends at the last checkpoint: an instant the shard accepted a
    // heartbeat at (the one that reported the checkpoint written on SIGTERM).
    assert!(
        accepted_heartbeats(&events, "agent:1").contains(&(started + run_ms)),
        "billing ends at a checkpoint heartbeat"
    );
    let states: Vec<String> = transitions(&events).into_iter().map(|t| t.0).collect();
    assert_eq!(
        states,
        ["Queued", "Placed", "Running", "Preempting", "Queued"]
    );
    let preempting = transitions(&events)
        .into_iter()
        .find(|t| t.0 == "Preempting")
        .unwrap();
    // The preemptor is another org's job: its id is not shown, its tier is.
    assert_eq!(
        preempting.1,
        serde_json::json!({"Preempted": {"by": null, "by_tier": 2}})
    );
    assert!(started + run_ms <= transition_time(&events, "Preempting") + 5_000);

    let b = json(eps, &["balance", "--org", &org, "--project", &project]);
    assert_eq!(u(&b["consumed_micro"]), charge);
    assert_eq!(
        u(&b["held_micro"]),
        80 * C - charge,
        "the rest stays reserved for the rerun"
    );

    // Cancel the requeued victim: the unused hold returns to the buckets it came from.
    let cancel = json(eps, &["job", "cancel", "--org", &org, "--job", "1001"]);
    assert_eq!(u(&cancel["settlement"]["captured_micro"]), charge);
    assert_eq!(u(&cancel["settlement"]["refunded_micro"]), 80 * C - charge);
    let events = job_events(eps, &org, 1001);
    for bucket in [101, 102] {
        let drawn = moved(&events, "hold_drawn", "HoldDrawn", Some(bucket));
        let used = moved(&events, "captured", "Captured", Some(bucket))
            - moved(&events, "capture_reversed", "CaptureReversed", Some(bucket));
        let refunded = moved(&events, "refunded", "Refunded", Some(bucket));
        assert_eq!(
            refunded,
            drawn - used,
            "bucket {bucket}: refund to the exact bucket"
        );
    }
    assert_eq!(
        moved(&events, "hold_drawn", "HoldDrawn", Some(101)),
        30 * C,
        "promo first"
    );
    let promo_used = 30 * C - moved(&events, "refunded", "Refunded", Some(101));
    let b = json(eps, &["balance", "--org", &org, "--project", &project]);
    assert_eq!(u(&b["held_micro"]), 0);
    assert_eq!(u(&b["consumed_micro"]), charge);
    assert_eq!(u(&b["promotional_available_micro"]), 30 * C - promo_used);
    assert_eq!(
        u(&b["paid_available_micro"]),
        100 * C - (charge - promo_used)
    );

    json(eps, &["job", "cancel", "--org", &org2, "--job", "2001"]);
    json(eps, &["node", "drain", "--shard", "0", "--node", "1"]);
}

/// Walk-through 2: job lease 3 s, node lease 60 s; the agent is SIGKILLed mid-job.
fn lost_finish(eps: &str, dir: &Path) {
    json(
        eps,
        &[
            "scheduler",
            "configure",
            "--job-lease",
            "3s",
            "--node-lease",
            "60s",
        ],
    );
    let (org, project, user) = tenant(eps, 3);
    json(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            &org,
            "--owner",
            &format!("project:{project}"),
            "--kind",
            "paid",
            "--amount",
            "500",
            "--bucket",
            "301",
        ],
    );
    json(
        eps,
        &[
            "node",
            "register",
            "--shard",
            "0",
            "--node",
            "2",
            "--gpu-type",
            "H100",
            "--gpus",
            "2",
            "--mem-gb",
            "80",
        ],
    );
    let mut agent = agent(eps, dir, 2, "H100", 2, "60s..60s");
    json(
        eps,
        &[
            "job",
            "submit",
            "--org",
            &org,
            "--job",
            "3001",
            "--project",
            &project,
            "--user",
            &user,
            "--tier",
            "paid",
            "--gpu-types",
            "H100",
            "--gpus",
            "2",
            "--max-duration",
            "60s",
            "--checkpointable",
        ],
    );
    wait_state(eps, &org, 3001, "Running", Duration::from_secs(15));
    poll("three accepted heartbeats", Duration::from_secs(15), || {
        (accepted_heartbeats(&job_events(eps, &org, 3001), "agent:2").len() >= 3).then_some(())
    });
    agent.0.kill().unwrap(); // SIGKILL: no finish is ever reported
    agent.0.wait().unwrap();

    let lost = wait_state(eps, &org, 3001, "Lost", Duration::from_secs(20));
    assert_eq!(lost["last_reason"], "LeaseExpired");
    let events = job_events(eps, &org, 3001);
    let last_hb = *accepted_heartbeats(&events, "agent:2")
        .iter()
        .max()
        .unwrap();
    let placed = transition_time(&events, "Placed");
    let charge = charged(&events);
    assert_eq!(
        charge,
        (last_hb - placed) * 2 * PER_GPU_MS,
        "charged to the last heartbeat"
    );
    assert!(
        transition_time(&events, "Lost") >= last_hb + 3_000,
        "ended by the job lease"
    );
    let hold = 60 * 2 * C;
    assert_eq!(
        moved(&events, "refunded", "Refunded", Some(301)),
        hold - charge
    );
    let b = json(eps, &["balance", "--org", &org, "--project", &project]);
    assert_eq!(u(&b["held_micro"]), 0);
    assert_eq!(u(&b["consumed_micro"]), charge);
    assert_eq!(u(&b["paid_available_micro"]), 500 * C - charge);
    // The node's lease (60 s) has not run out: the job lease ended the job, not a node
    // failure.
    let nodes = json(eps, &["node", "list", "--shard", "0"]);
    let node2 = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| u(&n["id"]) == 2)
        .unwrap();
    assert_eq!(node2["state"], "Ready");
    json(eps, &["node", "drain", "--shard", "0", "--node", "2"]);
    json(eps, &["scheduler", "configure", "--job-lease", "3m"]);
}

/// Walk-through 3: 50 promotional credits expiring in 6 s fund a job of at most 30 s
/// (30 credits held) that runs 10 s.
fn promotional_credit_expires_mid_run(eps: &str, dir: &Path) {
    let (org, project, user) = tenant(eps, 4);
    let owner = format!("project:{project}");
    let grant = json(
        eps,
        &[
            "grant",
            "issue",
            "--org",
            &org,
            "--owner",
            &owner,
            "--kind",
            "promotional",
            "--amount",
            "50",
            "--bucket",
            "401",
            "--expires-in",
            "6s",
        ],
    );
    let expires_at = u(&grant["expires_at_ms"]);
    json(
        eps,
        &[
            "node",
            "register",
            "--shard",
            "0",
            "--node",
            "3",
            "--gpu-type",
            "L4",
            "--gpus",
            "1",
            "--mem-gb",
            "80",
        ],
    );
    let _agent = agent(eps, dir, 3, "L4", 1, "10s..10s");
    let submitted = json(
        eps,
        &[
            "job",
            "submit",
            "--org",
            &org,
            "--job",
            "4001",
            "--project",
            &project,
            "--user",
            &user,
            "--tier",
            "paid",
            "--gpu-types",
            "L4",
            "--gpus",
            "1",
            "--max-duration",
            "30s",
        ],
    );
    assert_eq!(u(&submitted["hold_micro"]), 30 * C);
    let b = json(eps, &["balance", "--org", &org, "--project", &project]);
    assert_eq!(u(&b["upcoming_expirations"][0]["bucket"]), 401);
    wait_state(eps, &org, 4001, "Succeeded", Duration::from_secs(30));

    let events = job_events(eps, &org, 4001);
    let (placed, finished) = (
        transition_time(&events, "Placed"),
        transition_time(&events, "Succeeded"),
    );
    assert!(
        placed < expires_at && expires_at < finished,
        "the bucket expired mid-run"
    );
    let charge = charged(&events);
    assert_eq!(
        charge,
        (finished - placed) * PER_GPU_MS,
        "billed to the finish"
    );
    // The held credit stayed valid: heartbeats after the expiry captured from bucket 401.
    assert!(of_kind(&events, "captured")
        .iter()
        .any(|e| u(&e["time_ms"]) >= expires_at && u(&e["body"]["Captured"]["bucket"]) == 401));
    // The refund landed after the expiry: forfeited, not returned.
    assert_eq!(
        moved(&events, "refund_forfeited", "RefundForfeited", Some(401)),
        30 * C - charge
    );
    assert_eq!(moved(&events, "refunded", "Refunded", None), 0);
    let trail = json(eps, &["audit", "--org", &org]);
    let expired: Vec<&Value> = trail
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "bucket_expired")
        .collect();
    assert_eq!(expired.len(), 1, "{trail}");
    assert_eq!(
        u(&expired[0]["body"]["BucketExpired"]["amount_micro"]),
        20 * C
    );
    assert!(u(&expired[0]["time_ms"]) >= expires_at);

    let b = json(eps, &["balance", "--org", &org, "--project", &project]);
    assert_eq!(u(&b["promotional_available_micro"]), 0);
    assert_eq!(u(&b["held_micro"]), 0);
    assert_eq!(u(&b["consumed_micro"]), charge);
    assert_eq!(
        u(&b["expired_micro"]),
        50 * C - charge,
        "unspent + forfeited refund"
    );
    assert!(b["upcoming_expirations"].as_array().unwrap().is_empty());
}
