//! The GPU agent (`allot-agent`, the real binary) against a real 3-node cluster: simulated
//! jobs run to completion and settle (capture and refund), a real runner sees its
//! assigned GPUs and its exit status becomes the job's outcome, preemption reaches the
//! runner as SIGTERM, requeues the victim and lets the higher tier run, a cancelled job's
//! runner is killed at once, and one ignoring SIGTERM is killed after the grace period.
//!
//! Needs the node binary: `cargo build -p allot-node --bin allot-node`. Set
//! `ALLOT_TEST_AGENT_LOG=1` to see the agent's log of passing tests too.

mod common;

use allot_client::{AuditFilter, Client};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_statemachine::scheduler::{Job, JobState, Reason};
use allot_statemachine::testkit::{a100, A100_PRICE, ORG, PROJECT, USER};
use allot_statemachine::workload::grant as paid_grant;
use allot_statemachine::{
    Account, AuditEvent, EventBody, HoldId, JobId, JobSpec, NodeId, Reply, Tier,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SHARD: u32 = 0;
const NODE: u64 = 7;
const GRANT_MICRO: u64 = 100_000_000;

/// Polls with a deadline: `tick` fails the test once the deadline has passed.
struct Deadline {
    until: Instant,
    what: String,
}

impl Deadline {
    fn new(what: impl Into<String>, within: Duration) -> Deadline {
        Deadline {
            until: Instant::now() + within,
            what: what.into(),
        }
    }

    async fn tick(&self) {
        assert!(
            Instant::now() < self.until,
            "timed out waiting for {}",
            self.what
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A 3-node, 1-shard cluster in a fresh temp dir, and an admin client.
async fn cluster() -> (tempfile::TempDir, LocalCluster, Client) {
    let dir = tempfile::Builder::new()
        .prefix("allot-agent-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(
        node_binary().expect("build it first: cargo build -p allot-node --bin allot-node"),
        dir.path().join("cluster"),
        3,
        1,
    )
    .unwrap();
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let client = allot_node::local_cluster::client(c.endpoints());
    (dir, c, client)
}

/// An org with one project and user, the A100 price, and a paid grant to the project.
async fn fund(client: &Client) {
    client.create_org(ORG).await.unwrap();
    client.create_project(ORG, PROJECT).await.unwrap();
    client.create_user(ORG, USER).await.unwrap();
    // Entitled to every tier (the default withholds the highest).
    client
        .set_plan(ORG, Some(allot_statemachine::testkit::all_tiers()))
        .await
        .unwrap();
    client.set_prices(vec![(a100(), A100_PRICE)]).await.unwrap();
    client
        .issue_grant(ORG, paid_grant(1, Account::Project(PROJECT), GRANT_MICRO))
        .await
        .unwrap();
}

fn spec(job: u64, tier: Tier, gpus: u32, preemptible: bool) -> JobSpec {
    JobSpec {
        job: JobId(job),
        project: PROJECT,
        user: USER,
        tier,
        gpu_types: vec![a100()],
        gpus,
        mem_floor_gb: 0,
        preemptible,
        checkpointable: true,
        max_duration_ms: 600_000,
    }
}

async fn submit(client: &Client, spec: JobSpec) {
    let job = spec.job;
    match client.submit_job(ORG, spec).await.unwrap() {
        Reply::JobSubmitted { state, .. } => assert_eq!(state, JobState::Queued, "{job}"),
        other => panic!("submit {job}: {other:?}"),
    }
}

async fn job(client: &Client, id: u64) -> Job {
    client.job(ORG, JobId(id)).await.unwrap()
}

/// Waits for the job to reach `want`; any other final state fails the test.
async fn wait_state(client: &Client, id: u64, want: JobState, within: Duration) -> Job {
    let d = Deadline::new(format!("job {id} to be {want:?}"), within);
    loop {
        let j = job(client, id).await;
        if j.state == want {
            return j;
        }
        assert!(
            !j.state.is_final(),
            "job {id} ended {:?} ({:?}) instead of {want:?}",
            j.state,
            j.last_reason
        );
        d.tick().await;
    }
}

async fn wait_file(path: &Path, within: Duration) -> String {
    let d = Deadline::new(format!("{}", path.display()), within);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if s.ends_with('\n') {
                return s;
            }
        }
        d.tick().await;
    }
}

/// Every audit event of a job's hold.
async fn audit_of(client: &Client, id: u64) -> Vec<AuditEvent> {
    let mut out = Vec::new();
    let filter = AuditFilter {
        hold: Some(HoldId(id)),
        ..AuditFilter::default()
    };
    client
        .audit_export(SHARD, filter, 0, |e| {
            out.push(e.clone());
            Ok(())
        })
        .await
        .unwrap();
    out
}

/// The agent of node `NODE` on shard `SHARD`.
struct AgentProc;

impl AgentProc {
    fn start(
        endpoints: &[String],
        gpus: u32,
        dir: &Path,
        extra: &[&str],
    ) -> common::agent::AgentProc {
        common::agent::AgentProc::spawn(common::agent::AgentSpec {
            endpoints,
            shard: SHARD,
            node: NODE,
            gpus,
            dir,
            extra,
            env: &[],
        })
    }
}

/// Waits until the agent has registered its node with the configured shape.
async fn wait_registered(client: &Client, agent: &mut common::agent::AgentProc, gpus: u32) {
    let d = Deadline::new("the agent to register its node", Duration::from_secs(30));
    loop {
        agent.assert_running();
        let nodes = client.nodes(SHARD).await.unwrap();
        if let Some(n) = nodes.iter().find(|n| n.id == NodeId(NODE)) {
            assert_eq!(n.gpu_count, gpus);
            assert_eq!(n.gpu_type, a100());
            assert_eq!(n.gpu_mem_gb, 80);
            assert_eq!(
                n.labels,
                vec![("rack".into(), "r1".into()), ("zone".into(), "test".into())]
            );
            return;
        }
        d.tick().await;
    }
}

/// A job runner: records its pid and the GPUs it was given, reports progress and a
/// checkpoint, waits for a go file (or 60 s), exits 0 — or 3 if a fail file exists. On
/// SIGTERM it saves a checkpoint, leaves a marker and exits 0 (or, given an ignore-term
/// file, ignores SIGTERM). It claims each of its GPUs (`gpu-<index>` holds its pid), and
/// notes in `shared-<job>-<attempt>` any GPU whose last claimant is still alive. The GPU
/// file is written last: once it exists, the trap is set.
const RUNNER: &str = r#"#!/bin/sh
out="$1"
tag="$ALLOT_JOB_ID-$ALLOT_ATTEMPT"
if [ -e "$out/ignore-term-$ALLOT_JOB_ID" ]; then
  trap '' TERM
else
  trap 'echo "900000 2" > "$ALLOT_PROGRESS_FILE"; echo term > "$out/term-$tag"; exit 0' TERM
fi
echo "100000 1" > "$ALLOT_PROGRESS_FILE"
echo "$$" > "$out/pid-$tag"
for g in $(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
  if [ -e "$out/gpu-$g" ] && kill -0 "$(cat "$out/gpu-$g")" 2>/dev/null; then
    echo "$g" >> "$out/shared-$tag"
  fi
  echo "$$" > "$out/gpu-$g" 2>/dev/null
done
echo "$CUDA_VISIBLE_DEVICES" > "$out/cuda-$tag"
i=0
while [ ! -e "$out/go-$ALLOT_JOB_ID" ] && [ "$i" -lt 600 ]; do
  sleep 0.1
  i=$((i + 1))
done
echo "1000000 3" > "$ALLOT_PROGRESS_FILE"
if [ -e "$out/fail-$ALLOT_JOB_ID" ]; then exit 3; fi
exit 0
"#;

fn runner(dir: &Path) -> (PathBuf, PathBuf) {
    let script = dir.join("runner.sh");
    std::fs::write(&script, RUNNER).unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    (script, out)
}

fn touch(path: PathBuf) {
    std::fs::write(path, "").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulated_jobs_run_to_completion_and_settle_with_capture_and_refund() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    let mut agent = AgentProc::start(
        &c.endpoints(),
        4,
        &dir.path().join("agent"),
        &[
            "--simulate",
            "--sim-runtime",
            "2s..4s",
            "--sim-checkpoint-every",
            "1s",
            "--heartbeat-interval",
            "500ms",
        ],
    );
    wait_registered(&client, &mut agent, 4).await;

    // 7 GPUs of work on a 4-GPU node: some jobs wait for others to finish.
    let jobs = [(101, 1), (102, 2), (103, 1), (104, 2), (105, 1)];
    for (id, gpus) in jobs {
        submit(&client, spec(id, Tier::PAID, gpus, false)).await;
    }
    for (id, _) in jobs {
        let j = wait_state(&client, id, JobState::Succeeded, Duration::from_secs(90)).await;
        assert_eq!(j.attempt, 1, "job {id} ran once");
        assert_eq!(j.last_reason, Reason::Succeeded);
    }

    // The ledger: each hold partly captured, the rest refunded, nothing left held.
    let mut consumed = 0u64;
    for (id, _) in jobs {
        let events = audit_of(&client, id).await;
        let sum = |f: &dyn Fn(&EventBody) -> Option<u64>| -> u64 {
            events.iter().filter_map(|e| f(&e.body)).sum()
        };
        let drawn = sum(&|b| match b {
            EventBody::HoldDrawn { amount_micro, .. } => Some(*amount_micro),
            _ => None,
        });
        let captured = sum(&|b| match b {
            EventBody::Captured { amount_micro, .. } => Some(*amount_micro),
            _ => None,
        });
        let reversed = sum(&|b| match b {
            EventBody::CaptureReversed { amount_micro, .. } => Some(*amount_micro),
            _ => None,
        });
        let refunded = sum(&|b| match b {
            EventBody::Refunded { amount_micro, .. } => Some(*amount_micro),
            _ => None,
        });
        assert!(
            captured > reversed,
            "job {id}: nothing captured: {events:#?}"
        );
        assert!(refunded > 0, "job {id}: nothing refunded: {events:#?}");
        assert_eq!(
            drawn,
            captured - reversed + refunded,
            "job {id}: the hold is fully accounted for"
        );
        // Ran ~2–4 s on its GPUs at 2 credits per GPU-hour: far below the hold.
        assert!(
            captured - reversed < drawn / 10,
            "job {id}: {captured} of {drawn}"
        );
        let ran_here = events.iter().any(|e| {
            matches!(e.body, EventBody::JobTransition { to: JobState::Running, node: Some(n), .. } if n == NodeId(NODE))
        });
        assert!(ran_here, "job {id} ran on node {NODE}: {events:#?}");
        consumed += captured - reversed;
    }
    let b = client
        .balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap();
    assert_eq!(b.held_micro, 0, "{b:?}");
    assert_eq!(b.consumed_micro, consumed, "{b:?}");
    assert!(b.consumed_micro > 0);
    assert_eq!(
        b.paid_available_micro,
        GRANT_MICRO - b.consumed_micro,
        "{b:?}"
    );

    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_gets_its_gpus_and_its_exit_status_decides_the_outcome() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    let (script, out) = runner(dir.path());
    let mut agent = AgentProc::start(
        &c.endpoints(),
        4,
        &dir.path().join("agent"),
        &[
            "--heartbeat-interval",
            "500ms",
            "--",
            "/bin/sh",
            script.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    wait_registered(&client, &mut agent, 4).await;

    // 201 and 202 succeed, 203 exits 3.
    touch(out.join("fail-203"));
    for (id, gpus) in [(201, 1), (202, 2), (203, 1)] {
        submit(&client, spec(id, Tier::PAID, gpus, false)).await;
    }
    for id in [201, 202, 203] {
        wait_state(&client, id, JobState::Running, Duration::from_secs(30)).await;
    }
    // The GPUs the scheduler assigned, while the runners wait for their go files.
    let assigned: BTreeMap<u64, Vec<u8>> = client
        .assignments(SHARD, NodeId(NODE))
        .await
        .unwrap()
        .into_iter()
        .map(|a| {
            assert_eq!(a.attempt, 1);
            (a.job.0, a.gpu_indices)
        })
        .collect();
    assert_eq!(
        assigned.keys().copied().collect::<Vec<_>>(),
        vec![201, 202, 203]
    );
    let mut all: Vec<u8> = assigned.values().flatten().copied().collect();
    all.sort();
    assert_eq!(all, vec![0, 1, 2, 3], "four distinct GPUs: {assigned:?}");
    for (id, gpus) in &assigned {
        let want: Vec<String> = gpus.iter().map(u8::to_string).collect();
        let seen = wait_file(&out.join(format!("cuda-{id}-1")), Duration::from_secs(10)).await;
        assert_eq!(
            seen.trim(),
            want.join(","),
            "CUDA_VISIBLE_DEVICES of job {id}"
        );
    }
    for id in [201, 202, 203] {
        touch(out.join(format!("go-{id}")));
    }
    for id in [201, 202] {
        wait_state(&client, id, JobState::Succeeded, Duration::from_secs(30)).await;
    }
    let failed = wait_state(&client, 203, JobState::Failed, Duration::from_secs(30)).await;
    assert_eq!(failed.last_reason, Reason::Failed);
    assert!(client
        .assignments(SHARD, NodeId(NODE))
        .await
        .unwrap()
        .is_empty());
    // No runner was signalled.
    for id in [201, 202, 203] {
        assert!(
            !out.join(format!("term-{id}-1")).exists(),
            "job {id} got SIGTERM"
        );
    }
    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_reaches_the_runner_as_sigterm_and_requeues_the_victim() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    // Immediate preemption; the scheduler waits 5 s for the victim to stop.
    let mut s = client.scheduler_settings(SHARD).await.unwrap();
    s.min_runtime_ms = 0;
    s.hysteresis_ms = 0;
    s.grace_ms = 5_000;
    client.configure_scheduler(SHARD, s).await.unwrap();
    let (script, out) = runner(dir.path());
    let mut agent = AgentProc::start(
        &c.endpoints(),
        2,
        &dir.path().join("agent"),
        &[
            "--heartbeat-interval",
            "500ms",
            "--grace",
            "3s",
            "--",
            "/bin/sh",
            script.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    wait_registered(&client, &mut agent, 2).await;

    // A preemptible free-tier job fills the node.
    let (victim, vip) = (301, 302);
    submit(&client, spec(victim, Tier::FREE, 2, true)).await;
    wait_state(&client, victim, JobState::Running, Duration::from_secs(30)).await;
    // Its runner is up (and has installed its SIGTERM trap).
    wait_file(
        &out.join(format!("cuda-{victim}-1")),
        Duration::from_secs(10),
    )
    .await;

    // An enterprise job arrives: the victim's runner gets SIGTERM.
    submit(&client, spec(vip, Tier::ENTERPRISE, 2, false)).await;
    wait_file(
        &out.join(format!("term-{victim}-1")),
        Duration::from_secs(30),
    )
    .await;
    let e = wait_state(&client, vip, JobState::Running, Duration::from_secs(30)).await;
    assert_eq!(e.attempt, 1);
    // The victim went back to the queue (its runner exited 0 on SIGTERM, yet it was
    // reported as stopped, not succeeded), billed up to its SIGTERM checkpoint.
    let v = job(&client, victim).await;
    assert_eq!(v.state, JobState::Queued, "{v:?}");
    assert_eq!(v.preemptions, 1);
    assert!(v.run_ms > 0, "the checkpoints were reported: {v:?}");
    let seen = wait_file(&out.join(format!("cuda-{vip}-1")), Duration::from_secs(10)).await;
    assert_eq!(seen.trim(), "0,1");

    // The enterprise job completes; the victim runs again as attempt 2.
    touch(out.join(format!("go-{vip}")));
    wait_state(&client, vip, JobState::Succeeded, Duration::from_secs(30)).await;
    let d = Deadline::new("the victim to run again", Duration::from_secs(30));
    loop {
        let v = job(&client, victim).await;
        assert!(!v.state.is_final(), "{v:?}");
        if v.attempt == 2 && v.state == JobState::Running {
            break;
        }
        d.tick().await;
    }
    wait_file(
        &out.join(format!("cuda-{victim}-2")),
        Duration::from_secs(10),
    )
    .await;
    let transitions: Vec<(JobState, Reason, u32)> = audit_of(&client, victim)
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            EventBody::JobTransition {
                to,
                reason,
                attempt,
                ..
            } => Some((to, reason, attempt)),
            _ => None,
        })
        .collect();
    assert_eq!(
        transitions,
        vec![
            (JobState::Queued, Reason::Submitted, 0),
            (JobState::Placed, Reason::Placed, 1),
            (JobState::Running, Reason::Started, 1),
            (
                JobState::Preempting,
                Reason::Preempted {
                    by: Some(JobId(vip)),
                    by_tier: Tier::ENTERPRISE
                },
                1
            ),
            (JobState::Queued, Reason::Requeued, 1),
            (JobState::Placed, Reason::Placed, 2),
            (JobState::Running, Reason::Started, 2),
        ]
    );

    // Stopping the agent: the runner gets SIGTERM; the job is not reported finished.
    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
    assert!(out.join(format!("term-{victim}-2")).exists());
    let v = job(&client, victim).await;
    assert_eq!((v.state, v.attempt), (JobState::Running, 2), "{v:?}");
}

/// Whether a process is alive (`kill -0`).
fn alive(pid: &str) -> bool {
    Command::new("kill")
        .args(["-0", pid.trim()])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// The logical time of a job's first transition to `to`.
async fn transition_ms(client: &Client, id: u64, want: JobState) -> u64 {
    audit_of(client, id)
        .await
        .iter()
        .find_map(|e| match e.body {
            EventBody::JobTransition { to, .. } if to == want => Some(e.time_ms),
            _ => None,
        })
        .unwrap_or_else(|| panic!("job {id} never became {want:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_is_killed_at_once_and_a_runner_ignoring_sigterm_after_the_grace() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    // The scheduler would wait 10 s for a preempted job; the agent's grace is 2 s.
    let mut s = client.scheduler_settings(SHARD).await.unwrap();
    s.min_runtime_ms = 0;
    s.hysteresis_ms = 0;
    s.grace_ms = 10_000;
    client.configure_scheduler(SHARD, s).await.unwrap();
    let (script, out) = runner(dir.path());
    let mut agent = AgentProc::start(
        &c.endpoints(),
        2,
        &dir.path().join("agent"),
        &[
            "--heartbeat-interval",
            "500ms",
            "--grace",
            "2s",
            "--",
            "/bin/sh",
            script.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    wait_registered(&client, &mut agent, 2).await;

    // Cancelled while running: it leaves the assignment set and its runner is killed
    // at once (SIGKILL: no SIGTERM marker); no finish overrides the cancellation. The
    // job waiting for its GPUs is placed on them by the cancel's own entry, and its
    // runner starts only once the cancelled one is gone.
    submit(&client, spec(401, Tier::PAID, 2, false)).await;
    wait_state(&client, 401, JobState::Running, Duration::from_secs(30)).await;
    submit(&client, spec(404, Tier::PAID, 1, false)).await;
    assert_eq!(job(&client, 404).await.state, JobState::Queued);
    wait_file(&out.join("cuda-401-1"), Duration::from_secs(10)).await;
    let pid = std::fs::read_to_string(out.join("pid-401-1")).unwrap();
    assert!(alive(&pid));
    match client.cancel_job(ORG, JobId(401)).await.unwrap() {
        Reply::JobCancelled(Some(_)) => {}
        other => panic!("cancel: {other:?}"),
    }
    let d = Deadline::new(
        "the cancelled job's runner to be killed",
        Duration::from_secs(5),
    );
    while alive(&pid) {
        d.tick().await;
    }
    assert!(!out.join("term-401-1").exists(), "killed, not terminated");
    let j = job(&client, 401).await;
    assert_eq!(
        (j.state, j.last_reason),
        (JobState::Cancelled, Reason::Cancelled)
    );
    wait_file(&out.join("cuda-404-1"), Duration::from_secs(10)).await;
    assert!(
        !out.join("shared-404-1").exists(),
        "job 404's runner started while the cancelled job's runner held its GPU"
    );
    touch(out.join("go-404"));
    wait_state(&client, 404, JobState::Succeeded, Duration::from_secs(30)).await;

    // A preempted runner that ignores SIGTERM is SIGKILLed when the agent's grace is
    // over, and the attempt is then reported stopped (requeued) — well before the
    // scheduler's own 10 s grace would have requeued it.
    let (victim, vip) = (402, 403);
    touch(out.join(format!("ignore-term-{victim}")));
    submit(&client, spec(victim, Tier::FREE, 2, true)).await;
    wait_state(&client, victim, JobState::Running, Duration::from_secs(30)).await;
    wait_file(
        &out.join(format!("cuda-{victim}-1")),
        Duration::from_secs(10),
    )
    .await;
    let pid = std::fs::read_to_string(out.join(format!("pid-{victim}-1"))).unwrap();
    submit(&client, spec(vip, Tier::ENTERPRISE, 2, false)).await;
    wait_state(&client, vip, JobState::Running, Duration::from_secs(30)).await;
    assert!(!alive(&pid), "the victim's runner is gone");
    let v = job(&client, victim).await;
    assert_eq!((v.state, v.preemptions), (JobState::Queued, 1), "{v:?}");
    let preempted = transition_ms(&client, victim, JobState::Preempting).await;
    let requeued = audit_of(&client, victim)
        .await
        .iter()
        .find_map(|e| match e.body {
            EventBody::JobTransition {
                to: JobState::Queued,
                reason: Reason::Requeued,
                ..
            } => Some(e.time_ms),
            _ => None,
        })
        .expect("requeued");
    let waited = requeued - preempted;
    assert!(
        (1_900..9_000).contains(&waited),
        "requeued {waited} ms after the preemption: the agent's 2 s grace, then SIGKILL"
    );

    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
}

/// The agent exits within 10 s with the usage status (2), its log saying `says`.
fn assert_refused(agent: &mut common::agent::AgentProc, says: &str) {
    let st = (0..100)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            agent.exited()
        })
        .unwrap_or_else(|| panic!("the agent was to refuse to start ({says})"));
    assert_eq!(st.code(), Some(2), "{says}");
    let log = agent.log_text();
    assert!(log.contains(says), "{says}: {log}");
}

/// Found by review (twenty-first session): a second agent process on the same work dir
/// (the node started twice, or a successor started while its predecessor was paused)
/// stopped the first one's runners as orphans while that process still ran them, and
/// the first reported their exits as the jobs' own ends (Failed, billed). Now one process
/// holds the work dir; a second is refused at start, before it touches anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_on_the_same_work_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there: the first process keeps retrying its first read, holding
    // the work dir.
    let endpoints = vec!["127.0.0.1:1".to_string()];
    let args = ["--", "/bin/true"];
    let mut first = AgentProc::start(&endpoints, 1, dir.path(), &args);
    let work = dir.path().join("work");
    let d = std::time::Instant::now() + Duration::from_secs(10);
    while !work.join("incarnation").exists() {
        first.assert_running();
        assert!(
            std::time::Instant::now() < d,
            "the first agent never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let incarnation = std::fs::read_to_string(work.join("incarnation")).unwrap();
    let mut second = AgentProc::start(&endpoints, 1, dir.path(), &args);
    assert_refused(&mut second, "in use by another allot-agent process");
    first.assert_running();
    assert_eq!(
        std::fs::read_to_string(work.join("incarnation")).unwrap(),
        incarnation,
        "the refused process changed nothing"
    );
    // Once the first has gone, the work dir is free.
    first
        .stop(Duration::from_secs(10))
        .expect("the first agent stops");
    let mut third = AgentProc::start(&endpoints, 1, dir.path(), &args);
    tokio::time::sleep(Duration::from_millis(500)).await;
    third.assert_running();
}

/// With `--runner-user`, job code runs as that user: it cannot write the agent's work
/// dir, read the agent's environment, or read another job's log — it writes only its
/// own progress file, which the cluster still gets. (Runners ran as the agent's user,
/// root under the shipped unit: they could read the agent's tokens and rewrite the
/// records a restarted agent acts on.) An agent that is not root refuses the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runners_run_as_the_runner_user_and_cannot_touch_the_agents_files() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, c, client) = cluster().await;
    let script = dir.path().join("runner.sh");
    std::fs::write(
        &script,
        r#"#!/bin/sh
out="$1"; work="$2"; j="$ALLOT_JOB_ID"
id -u > "$out/uid-$j"
if echo x > "$work/evil" 2>/dev/null; then echo yes; else echo no; fi > "$out/work-$j"
if cat "/proc/$PPID/environ" > /dev/null 2>&1; then echo yes; else echo no; fi > "$out/environ-$j"
if cat "$work"/job-*.log > /dev/null 2>&1; then echo yes; else echo no; fi > "$out/logs-$j"
echo "1000000 4" > "$ALLOT_PROGRESS_FILE" && echo yes > "$out/progress-$j"
"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The runner user must reach the script and write its results.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    let adir = dir.path().join("agent");
    let work = adir.join("work");
    let args = [
        "--runner-user",
        "nobody",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
        work.to_str().unwrap(),
    ];
    let mut agent = AgentProc::start(&c.endpoints(), 2, &adir, &args);
    if unsafe { libc::geteuid() } != 0 {
        assert_refused(&mut agent, "must run as root");
        return;
    }
    fund(&client).await;
    wait_registered(&client, &mut agent, 2).await;
    submit(&client, spec(301, Tier::PAID, 1, false)).await;
    let done = wait_state(&client, 301, JobState::Succeeded, Duration::from_secs(30)).await;
    let read = |what: &str| {
        std::fs::read_to_string(out.join(format!("{what}-301")))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    assert_eq!(read("uid"), "65534", "the runner runs as nobody");
    assert_eq!(read("work"), "no", "it cannot write the work dir");
    assert_eq!(
        read("environ"),
        "no",
        "it cannot read the agent's environment"
    );
    assert_eq!(read("logs"), "no", "it cannot read the jobs' logs");
    assert_eq!(read("progress"), "yes", "it writes its progress file");
    assert_eq!(done.attempt, 1);
    assert!(!work.join("evil").exists());
    let mode = std::fs::metadata(&work).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o711, "the work dir is closed to runners");
    agent.stop(Duration::from_secs(15));
}

/// With `--runner-uid-range`, every attempt runs as a uid of its own. With one
/// `--runner-user`, all runners of a node are the same user, and one job could
/// `kill -KILL -1` (or trace, or read) every other org's runner there. Here the attacker
/// cannot signal the victim, by pid or with `kill -1`; and since the uid is swept when
/// its attempt ends, a process that left the runner's group dies with the attempt even
/// without cgroups (`--cgroup off`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_run_as_uids_of_their_own_and_cannot_signal_each_other() {
    use std::os::unix::fs::PermissionsExt;
    const FIRST: u32 = 3_900_000_100;
    let (dir, c, client) = cluster().await;
    let script = dir.path().join("runner.sh");
    std::fs::write(
        &script,
        r#"#!/bin/sh
out="$1"; j="$ALLOT_JOB_ID"
if [ -O "$HOME" ] && [ "$TMPDIR" = "$HOME" ]; then echo yes; else echo no; fi > "$out/home-$j"
echo "$HOME" > "$out/homepath-$j"
if grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status; then echo yes; else echo no; fi > "$out/nnp-$j"
id -u > "$out/uid-$j"
grep '^Max processes' /proc/self/limits | tr -s ' ' | cut -d' ' -f3,4 > "$out/nproc-$j"
case "$j" in
701)
  setsid sh -c 'echo $$ > "$0/escaped.tmp" && mv "$0/escaped.tmp" "$0/escaped"; exec sleep 600' "$out" &
  echo $$ > "$out/pid.tmp" && mv "$out/pid.tmp" "$out/pid"
  exec sleep 600 ;;
702)
  while [ ! -e "$out/pid" ] || [ ! -e "$out/escaped" ]; do sleep 0.05; done
  if kill -KILL "$(cat "$out/pid")" 2>/dev/null; then echo yes; else echo no; fi > "$out/direct"
  if kill -KILL "$(cat "$out/escaped")" 2>/dev/null; then echo yes; else echo no; fi > "$out/direct-escaped"
  kill -KILL -1 2>/dev/null
  echo done > "$out/all"
  # A fork bomb, in a subshell (a shell that cannot fork exits).
  ( i=0; while [ $i -lt 64 ]; do sleep 30 & i=$((i+1)); done ) 2>/dev/null
  n=0; for p in /proc/[0-9]*; do if [ -O "$p" ]; then n=$((n+1)); fi; done
  echo $n > "$out/procs.tmp" && mv "$out/procs.tmp" "$out/procs" ;;
esac
"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    let adir = dir.path().join("agent");
    let range = format!("{FIRST}-{}", FIRST + 3);
    let args = [
        "--runner-uid-range",
        &range,
        "--runner-procs-max",
        "24",
        "--cgroup",
        "off",
        "--grace",
        "1s",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let mut agent = AgentProc::start(&c.endpoints(), 2, &adir, &args);
    if unsafe { libc::geteuid() } != 0 {
        assert_refused(&mut agent, "must run as root");
        return;
    }
    fund(&client).await;
    wait_registered(&client, &mut agent, 2).await;
    submit(&client, spec(701, Tier::PAID, 1, false)).await;
    wait_state(&client, 701, JobState::Running, Duration::from_secs(30)).await;
    let victim = wait_file(&out.join("pid"), Duration::from_secs(30)).await;
    let escaped = wait_file(&out.join("escaped"), Duration::from_secs(30)).await;
    submit(&client, spec(702, Tier::PAID, 1, false)).await;
    wait_state(&client, 702, JobState::Succeeded, Duration::from_secs(30)).await;
    let read = |what: &str| {
        std::fs::read_to_string(out.join(what))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let uid = |job: u64| read(&format!("uid-{job}")).parse::<u32>().expect("a uid");
    let (u1, u2) = (uid(701), uid(702));
    assert_ne!(u1, u2, "each attempt has a uid of its own");
    for u in [u1, u2] {
        assert!(
            (FIRST..=FIRST + 3).contains(&u),
            "uid {u} is from the range"
        );
    }
    assert_eq!(read("home-701"), "yes", "its own home, as HOME and TMPDIR");
    assert_eq!(read("home-702"), "yes");
    assert_eq!(
        read("nnp-701"),
        "yes",
        "no setuid file lifts a runner to another uid"
    );
    assert_eq!(
        read("direct"),
        "no",
        "it cannot signal another attempt's runner"
    );
    assert_eq!(read("direct-escaped"), "no");
    assert_eq!(read("all"), "done", "kill -1 ran");
    // Each attempt's uid may have at most 24 processes and threads: the attacker's fork
    // bomb stops there (without the bound, all 64 sleeps and its shell: 65).
    assert_eq!(read("nproc-701"), "24 24", "RLIMIT_NPROC, soft and hard");
    assert_eq!(read("nproc-702"), "24 24");
    let procs: u32 = read("procs").parse().expect("a count");
    assert!(
        (12..=24).contains(&procs),
        "the fork bomb's processes: {procs}"
    );
    assert!(alive(&victim), "the victim survives the attacker's kill -1");
    assert!(alive(&escaped));
    assert_eq!(job(&client, 701).await.state, JobState::Running);
    // The attacker's attempt is over: its home went with it.
    assert!(!Path::new(&read("homepath-702")).exists());

    // Cancelled: the process that left the runner's group (no cgroup here) dies with the
    // attempt, by the sweep of its uid, and the home goes.
    client.cancel_job(ORG, JobId(701)).await.unwrap();
    gone(
        &escaped,
        "the cancelled attempt's escaped process to be swept",
    )
    .await;
    assert!(!alive(&victim));
    let d = Deadline::new(
        "the cancelled attempt's home to go",
        Duration::from_secs(15),
    );
    while Path::new(&read("homepath-701")).exists() {
        d.tick().await;
    }
    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
}

/// A range that names an account of the host is refused at start (a uid of the range
/// must belong to no one but the attempt holding it), as is one sharing with
/// `--runner-user` or smaller than the node's GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_uid_range_that_is_not_reserved_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let endpoints = vec!["127.0.0.1:1".to_string()];
    for (args, says) in [
        (vec!["--runner-uid-range", "65533-65534"], "nobody"),
        (
            vec!["--runner-uid-range", "3900000200-3900000200"],
            "at least one per GPU",
        ),
        (
            vec![
                "--runner-uid-range",
                "3900000200-3900000210",
                "--runner-user",
                "nobody",
            ],
            "cannot be used with",
        ),
    ] {
        let mut args = args;
        args.extend(["--", "/bin/true"]);
        let mut agent = AgentProc::start(&endpoints, 2, dir.path(), &args);
        let says = if unsafe { libc::geteuid() } != 0 && says == "nobody" {
            "must run as root"
        } else {
            says
        };
        assert_refused(&mut agent, says);
    }
}

/// A runner that forks a process which leaves the runner's process group (`setsid`) and
/// keeps running: the cluster has moved on from the attempt, but the escaped process
/// would hold the GPUs and go on working. (The agent signalled only the runner's process
/// group, so such a process outlived a cancellation, and the kernel's parent-death
/// signal reaches the runner alone, so it outlived a dead agent too.) Each attempt now
/// runs in a cgroup of its own, killed whole: on a cancellation, and by the next agent
/// process before it registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_leaves_its_process_group_is_still_killed() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    let script = dir.path().join("escape.sh");
    std::fs::write(
        &script,
        r#"#!/bin/sh
out="$1"; j="$ALLOT_JOB_ID"
setsid sh -c 'echo $$ > "$0/escaped-$1.tmp" && mv "$0/escaped-$1.tmp" "$0/escaped-$1"; exec sleep 600' "$out" "$j" &
while [ ! -e "$out/escaped-$j" ]; do sleep 0.05; done
exec sleep 600
"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let adir = dir.path().join("agent");
    let args = [
        "--grace",
        "1s",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let mut agent = AgentProc::start(&c.endpoints(), 2, &adir, &args);
    wait_registered(&client, &mut agent, 2).await;
    // Cancelled: the escaped process goes with the runner.
    submit(&client, spec(601, Tier::PAID, 1, false)).await;
    wait_state(&client, 601, JobState::Running, Duration::from_secs(30)).await;
    let pid = escaped_pid(&out, 601).await;
    client.cancel_job(ORG, JobId(601)).await.unwrap();
    gone(&pid, "the cancelled job's escaped process to be killed").await;

    // The agent dies (SIGKILL: it stops nothing itself): the next agent process kills
    // the escaped process before it registers the node again.
    submit(&client, spec(602, Tier::PAID, 1, false)).await;
    wait_state(&client, 602, JobState::Running, Duration::from_secs(30)).await;
    let pid = escaped_pid(&out, 602).await;
    agent.kill();
    assert!(alive(&pid), "the agent's death alone does not reach it");
    let mut agent = AgentProc::start(&c.endpoints(), 2, &adir, &args);
    gone(&pid, "the next agent process to kill the escaped process").await;
    // Registered: it has emptied and removed its predecessor's cgroups.
    wait_registered(&client, &mut agent, 2).await;
    let st = agent
        .stop(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(st.success(), "agent exit: {st}");
}

/// The pid the escape runner's setsid child wrote for `job`, once it runs.
async fn escaped_pid(out: &Path, job: u64) -> String {
    let pid = wait_file(&out.join(format!("escaped-{job}")), Duration::from_secs(30)).await;
    let pid = pid.trim().to_string();
    assert!(alive(&pid), "job {job}'s escaped process runs");
    pid
}

/// Waits until the process `pid` is gone.
async fn gone(pid: &str, what: &str) {
    let d = Deadline::new(what, Duration::from_secs(15));
    while alive(pid) {
        d.tick().await;
    }
}

/// A runner's output is capped in its log (`--log-max`): the head up to the cap, a line
/// counting what was dropped, and the last 64 KiB, where the failure's message is. (A
/// log grew as long as the job printed, on the disk the node's other jobs share.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runners_log_keeps_its_head_and_tail_within_the_cap() {
    let (dir, c, client) = cluster().await;
    fund(&client).await;
    let script = dir.path().join("loud.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\necho FIRST-LINE\nhead -c 3000000 /dev/zero | tr '\\0' x\necho\necho LAST-LINE >&2\n",
    )
    .unwrap();
    let adir = dir.path().join("agent");
    let args = [
        "--log-max",
        "1MiB",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
    ];
    let mut agent = AgentProc::start(&c.endpoints(), 2, &adir, &args);
    wait_registered(&client, &mut agent, 2).await;
    submit(&client, spec(701, Tier::PAID, 1, false)).await;
    wait_state(&client, 701, JobState::Succeeded, Duration::from_secs(30)).await;
    let log = std::fs::read(adir.join("work").join(format!("job-{}-701.1.log", ORG.0))).unwrap();
    assert!(
        log.len() <= (1 << 20) + (64 << 10) + 200,
        "log of {} bytes",
        log.len()
    );
    let text = String::from_utf8_lossy(&log);
    assert!(text.starts_with("FIRST-LINE\n"));
    assert!(text.ends_with("LAST-LINE\n"), "stderr's last line is kept");
    let dropped = "FIRST-LINE\n".len() + 3_000_000 + "\n".len() + "LAST-LINE\n".len()
        - (1 << 20)
        - (64 << 10);
    assert!(
        text.contains(&format!("{dropped} bytes of output dropped")),
        "the log says what it dropped"
    );
    agent.stop(Duration::from_secs(15));
}
