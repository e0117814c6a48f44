//! A job never runs twice, and every bill follows the GPU time actually used (issue 21),
//! with the real `allot-agent` against real 3-node clusters:
//! - an agent cut off from the cluster (an in-process TCP proxy) past its lease stops its
//!   runner before the cluster starts the next attempt elsewhere; each attempt is billed
//!   once;
//! - an agent SIGKILLed with a running job and restarted stops the orphaned runner
//!   before it offers the node again;
//! - a runner's environment holds none of the agent's credentials;
//! - after all three nodes were down for 60 s, a 30 s job is billed within 0.1 % of the
//!   GPU time its runner measured;
//! - a finish reported late, for a job settled meanwhile, is refused as already
//!   finished, logged as such by the agent, and changes nothing.

mod common;

use allot_client::Client;
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_statemachine::scheduler::{Job, JobState, Reason};
use allot_statemachine::testkit::{a100, ORG, PROJECT, USER};
use allot_statemachine::workload::grant as paid_grant;
use allot_statemachine::*;
use common::agent::{AgentProc, AgentSpec};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::{TcpListener, TcpStream};

const SHARD: u32 = 0;
/// 3.6 credits per GPU-hour: one micro-credit per GPU-millisecond, so a capture in
/// micro-credits is the billed time in ms.
const PRICE_MICRO_PER_GPU_HOUR: u64 = 3_600_000;

async fn cluster(dir: &Path) -> (LocalCluster, Client) {
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.join("cluster"), 3, 1).unwrap();
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let client = allot_node::local_cluster::client(c.endpoints());
    (c, client)
}

async fn fund(client: &Client) {
    client.create_org(ORG).await.unwrap();
    client.create_project(ORG, PROJECT).await.unwrap();
    client.create_user(ORG, USER).await.unwrap();
    client
        .set_prices(vec![(a100(), PRICE_MICRO_PER_GPU_HOUR)])
        .await
        .unwrap();
    client
        .issue_grant(
            ORG,
            paid_grant(1, Account::Project(PROJECT), 1_000_000_000_000),
        )
        .await
        .unwrap();
}

fn spec(job: u64, max_duration_ms: u64) -> JobSpec {
    JobSpec {
        job: JobId(job),
        project: PROJECT,
        user: USER,
        tier: Tier::PAID,
        gpu_types: vec![a100()],
        gpus: 1,
        mem_floor_gb: 0,
        preemptible: false,
        checkpointable: true,
        max_duration_ms,
    }
}

/// Waits until the agent has registered node `node` (failing if the agent exits).
async fn wait_node(client: &Client, agent: &mut AgentProc, node: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        agent.assert_running();
        if let Ok(nodes) = client.nodes(SHARD).await {
            if nodes.iter().any(|n| n.id == NodeId(node)) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "node {node} never registered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn job(client: &Client, id: u64) -> Job {
    client.job(ORG, JobId(id)).await.unwrap()
}

async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    within: Duration,
    mut f: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A runner that logs `start <job> <attempt> <pid> <ns>`, and from a child process
/// `alive ... <ns>` every 50 ms and `exit ... <ns>` (on SIGTERM, or when
/// `go-<job>-<attempt>` appears), to `$1/events`; it writes its environment to
/// `$1/env-<job>-<attempt>`.
const RUNNER: &str = r#"#!/bin/sh
out="$1"
tag="$ALLOT_JOB_ID $ALLOT_ATTEMPT $$"
env > "$out/env-$ALLOT_JOB_ID-$ALLOT_ATTEMPT"
echo "start $tag $(date +%s%N)" >> "$out/events"
# The work runs in a child process of the runner (as a training script's workers do):
# only the runner itself gets the kernel's parent-death signal.
(
  trap 'echo "exit $tag $(date +%s%N)" >> "$out/events"; exit 0' TERM
  while [ ! -e "$out/go-$ALLOT_JOB_ID-$ALLOT_ATTEMPT" ]; do
    echo "alive $tag $(date +%s%N)" >> "$out/events"
    sleep 0.05
  done
  echo "exit $tag $(date +%s%N)" >> "$out/events"
) &
wait
"#;

fn runner(dir: &Path) -> (PathBuf, PathBuf) {
    let script = dir.join("runner.sh");
    std::fs::write(&script, RUNNER).unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    (script, out)
}

/// (kind, job, attempt, pid, ns) of every line of the runners' event log.
fn events(out: &Path) -> Vec<(String, u64, u32, u32, u128)> {
    std::fs::read_to_string(out.join("events"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
                f.get(3)?.parse().ok()?,
                f.get(4)?.parse().ok()?,
            ))
        })
        .collect()
}

/// The last instant (ns) an attempt's runner was seen alive (its exit, or its last
/// `alive` line), and when it started.
fn span(ev: &[(String, u64, u32, u32, u128)], job: u64, attempt: u32) -> (u128, u128) {
    let mine = ev.iter().filter(|e| e.1 == job && e.2 == attempt);
    let start = mine
        .clone()
        .filter(|e| e.0 == "start")
        .map(|e| e.4)
        .min()
        .unwrap();
    let last = mine.map(|e| e.4).max().unwrap();
    (start, last)
}

/// Job 1's attempt 1 was last seen alive before attempt 2 started (both printed against
/// `cut_at`, when the test cut the first agent off).
fn one_attempt_at_a_time(ev: &[(String, u64, u32, u32, u128)], cut_at: u128, what: &str) {
    let (_, last1) = span(ev, 1, 1);
    let (start2, _) = span(ev, 1, 2);
    let ms = |ns: u128| ns as f64 / 1e6;
    println!(
        "{what}: partition at +0 ms; attempt 1 last alive/exit at {:+.0} ms; attempt 2 \
         started at {:+.0} ms; gap {:.0} ms",
        ms(last1 - cut_at),
        ms(start2 - cut_at),
        (start2 as f64 - last1 as f64) / 1e6
    );
    assert!(
        last1 < start2,
        "{what}: attempt 1 was still running when attempt 2 started: {ev:?}"
    );
}

fn agent(
    endpoints: &[String],
    node: u64,
    dir: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> AgentProc {
    AgentProc::spawn(AgentSpec {
        endpoints,
        shard: SHARD,
        node,
        gpus: 1,
        dir,
        extra,
        env,
    })
}

/// A test's funded 3-node cluster and the logging runner ([`RUNNER`]).
struct Scene {
    dir: tempfile::TempDir,
    c: LocalCluster,
    client: Client,
    script: PathBuf,
    out: PathBuf,
}

impl Scene {
    async fn new(prefix: &str) -> Scene {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
        let (c, client) = cluster(dir.path()).await;
        fund(&client).await;
        let (script, out) = runner(dir.path());
        Scene {
            dir,
            c,
            client,
            script,
            out,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// An agent's arguments: `flags`, then the runner.
    fn args<'a>(&'a self, flags: &[&'a str]) -> Vec<&'a str> {
        let run = [
            "--",
            "/bin/sh",
            self.script.to_str().unwrap(),
            self.out.to_str().unwrap(),
        ];
        flags.iter().copied().chain(run).collect()
    }
}

/// Waits until a runner of `job`'s `attempt` has started; its pid.
async fn started(out: &Path, job: u64, attempt: u32, within: Duration) -> u32 {
    until(
        &format!("job {job} attempt {attempt} running"),
        within,
        || async {
            events(out)
                .iter()
                .find(|e| e.0 == "start" && e.1 == job && e.2 == attempt)
                .map(|e| e.3)
        },
    )
    .await
}

/// A TCP proxy in the test process: forwards to `target` until cut; a cut closes
/// every connection and refuses new ones until healed.
struct Proxy {
    addr: String,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (c, k) = (cut.clone(), conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is refused
                }
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                k.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy { addr, cut, conns }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// A proxy in front of each of a cluster's endpoints: what an agent that can be cut off
/// from the whole cluster connects to.
struct Partition(Vec<Proxy>);

impl Partition {
    async fn around(endpoints: Vec<String>) -> Partition {
        let mut proxies = Vec::new();
        for e in endpoints {
            proxies.push(Proxy::start(e).await);
        }
        Partition(proxies)
    }

    fn addrs(&self) -> Vec<String> {
        self.0.iter().map(|p| p.addr.clone()).collect()
    }

    fn cut(&self) {
        self.0.iter().for_each(Proxy::cut);
    }

    fn heal(&self) {
        self.0.iter().for_each(Proxy::heal);
    }
}

/// An agent's timing for the partition tests: its fence margin, grace and heartbeats.
const FENCE_TIMING: [&str; 6] = [
    "--fence-margin",
    "1s",
    "--grace",
    "2s",
    "--heartbeat-interval",
    "500ms",
];

/// Short leases, so a partition longer than them fits in a test: node lease 5 s, fence
/// margin 3 s, job lease 20 s.
async fn short_leases(client: &Client) {
    let mut s = client.scheduler_settings(SHARD).await.unwrap();
    s.node_lease_ms = 5_000;
    s.fence_margin_ms = 3_000;
    s.job_lease_ms = 20_000;
    client.configure_scheduler(SHARD, s).await.unwrap();
}

/// A partition between an agent and the cluster, longer than the node lease: the old
/// runner has exited before the new attempt starts on another node (both timestamps
/// printed), and the ledger bills each attempt once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_agent_stops_its_runner_before_the_job_runs_elsewhere() {
    let dir = tempfile::Builder::new()
        .prefix("allot-fence-")
        .tempdir()
        .unwrap();
    let (c, client) = cluster(dir.path()).await;
    fund(&client).await;
    short_leases(&client).await;
    let (script, out) = runner(dir.path());
    let run = [
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let args: Vec<&str> = FENCE_TIMING.iter().chain(run.iter()).copied().collect();
    // Node 1's agent talks to the cluster only through proxies.
    let partition = Partition::around(c.endpoints()).await;
    let via = partition.addrs();
    let mut a1 = agent(&via, 1, &dir.path().join("agent-1"), &args, &[]);
    wait_node(&client, &mut a1, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    until("attempt 1 running", Duration::from_secs(20), || async {
        events(&out)
            .iter()
            .any(|e| e.0 == "start" && e.2 == 1)
            .then_some(())
    })
    .await;
    until(
        "attempt 1 heartbeating",
        Duration::from_secs(20),
        || async { (job(&client, 1).await.state == JobState::Running).then_some(()) },
    )
    .await;
    // Node 2 joins, free: where the job will go next.
    let mut a2 = agent(&c.endpoints(), 2, &dir.path().join("agent-2"), &args, &[]);
    wait_node(&client, &mut a2, 2).await;

    // The partition: node 1's agent can reach nothing.
    let cut_at = now_ns();
    partition.cut();
    until(
        "attempt 2 started on node 2",
        Duration::from_secs(30),
        || async {
            events(&out)
                .iter()
                .any(|e| e.0 == "start" && e.2 == 2)
                .then_some(())
        },
    )
    .await;
    let j = job(&client, 1).await;
    assert_eq!(j.placement.as_ref().map(|p| p.node), Some(NodeId(2)));
    assert_eq!(j.attempt, 2);
    let ev = events(&out);
    let (start1, last1) = span(&ev, 1, 1);
    assert!(
        last1 > cut_at,
        "attempt 1 stopped before the partition: {ev:?}\n{}",
        a1.log_text()
    );
    one_attempt_at_a_time(&ev, cut_at, "fence");
    let ms = |ns: u128| ns as f64 / 1e6;
    assert!(
        a1.log_text().contains("lease not renewed"),
        "node 1's agent fenced itself"
    );

    // Healed: node 1's agent reports the fenced attempt, which the cluster has already
    // requeued; attempt 2 runs to its end; the job is settled once.
    partition.heal();
    until(
        "node 1's agent to report",
        Duration::from_secs(30),
        || async {
            let log = a1.log_text();
            (log.contains("already requeued") || log.contains("fenced attempt reported"))
                .then_some(())
        },
    )
    .await;
    std::fs::write(out.join("go-1-2"), "").unwrap();
    let done = until("the job to succeed", Duration::from_secs(30), || async {
        let j = job(&client, 1).await;
        (j.state == JobState::Succeeded).then_some(j)
    })
    .await;
    assert_eq!(done.attempt, 2);
    let ev = events(&out);
    let (start2, end2) = span(&ev, 1, 2);
    // Billed: attempt 1 up to its last heartbeat (never past its runner's life), plus
    // attempt 2; nothing twice.
    let b = client
        .balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap();
    let gpu_ms = (ms(last1 - start1) + ms(end2 - start2)) as u64;
    println!(
        "fence: billed {} GPU-ms for {} GPU-ms the runners lived",
        b.consumed_micro, gpu_ms
    );
    assert!(b.consumed_micro <= gpu_ms + 1_000, "billed more than run");
    assert!(b.consumed_micro >= (ms(end2 - start2) as u64).saturating_sub(1_000));
    assert_eq!(b.held_micro, 0, "settled: nothing left held");
    // Per attempt, from the trail: captures (net of reversals) belong to the attempt of
    // the last transition before them (the requeue's final capture to attempt 1, until
    // attempt 2 is placed).
    let mut ended = 0;
    let mut attempt = 0u32;
    let mut billed = [0i64; 3];
    client
        .audit_export(
            SHARD,
            allot_client::AuditFilter {
                hold: Some(HoldId(1)),
                ..Default::default()
            },
            0,
            |e| {
                match &e.body {
                    EventBody::JobTransition { to, attempt: a, .. } => {
                        ended += to.is_final() as u32;
                        attempt = *a;
                    }
                    EventBody::Captured { amount_micro, .. } => {
                        billed[attempt.min(2) as usize] += *amount_micro as i64
                    }
                    EventBody::CaptureReversed { amount_micro, .. } => {
                        billed[attempt.min(2) as usize] -= *amount_micro as i64
                    }
                    _ => {}
                }
                Ok(())
            },
        )
        .await
        .unwrap();
    assert_eq!(ended, 1, "the job ended (and was settled) once");
    let (life1, life2) = (ms(last1 - start1) as i64, ms(end2 - start2) as i64);
    println!(
        "fence: attempt 1 billed {} GPU-ms of {life1} lived, attempt 2 billed {} of {life2}",
        billed[1], billed[2]
    );
    assert_eq!(billed[0], 0, "nothing billed before the first placement");
    assert_eq!(
        billed[1] + billed[2],
        b.consumed_micro as i64,
        "every capture belongs to one attempt"
    );
    // Each attempt is billed once, never past its runner's life (attempt 1 to its last
    // heartbeat before the cut; attempt 2 to its finish, within a heartbeat interval).
    assert!(
        (0..=life1 + 100).contains(&billed[1]),
        "attempt 1: {billed:?}"
    );
    assert!(
        (life2 - 1_000..=life2 + 1_000).contains(&billed[2]),
        "attempt 2: {billed:?}"
    );
    drop(a1);
    drop(a2);
}

/// An agent SIGKILLed while its runner runs, and restarted with the same arguments:
/// the orphaned runner is gone before the agent offers the node again (and so before
/// any attempt starts there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_stops_its_orphaned_runner_before_registering() {
    let sc = Scene::new("allot-orphan-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    let args = sc.args(&["--grace", "2s"]);
    let adir = sc.path().join("agent");
    let mut a = agent(&c.endpoints(), 1, &adir, &args, &[]);
    wait_node(client, &mut a, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    let pid = started(out, 1, 1, Duration::from_secs(20)).await;
    a.kill();
    // The kernel's parent-death signal may already have stopped the runner; either way
    // the restarted agent must find nothing of it running before it registers.
    let restarted_at = now_ns();
    let a = agent(&c.endpoints(), 1, &adir, &args, &[]);
    until(
        "the attempt to start again",
        Duration::from_secs(30),
        || async {
            events(out)
                .iter()
                .find(|e| e.0 == "start" && e.3 != pid)
                .map(|_| ())
        },
    )
    .await;
    let ev = events(out);
    let old_last = ev.iter().filter(|e| e.3 == pid).map(|e| e.4).max().unwrap();
    let new_start = ev
        .iter()
        .filter(|e| e.0 == "start" && e.3 != pid)
        .map(|e| e.4)
        .min()
        .unwrap();
    println!(
        "orphan: old runner last seen {:+.0} ms after the restart, the next runner started {:+.0} ms after it",
        (old_last as f64 - restarted_at as f64) / 1e6,
        (new_start as f64 - restarted_at as f64) / 1e6
    );
    assert!(old_last < new_start, "the orphan ran beside the new runner");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the orphaned runner is gone"
    );
    // The restarted agent is a new incarnation: attempt 1 ended at its registration, and
    // what runs now is a new placement, attempt 2. A late report of the dead process
    // (attempt 1) is stale and changes nothing.
    let restarted = ev
        .iter()
        .find(|e| e.0 == "start" && e.3 != pid)
        .expect("the new runner");
    assert_eq!(restarted.2, 2, "a new attempt, not attempt 1 re-run");
    let late = Request {
        actor: Actor::Agent(NodeId(1)),
        request_id: 0xdead_0001,
        org: Some(ORG),
        command: Command::FinishJob {
            job: JobId(1),
            attempt: 1,
            success: true,
        },
    };
    let (outs, _) = client.execute(SHARD, &[late]).await.unwrap();
    assert_eq!(
        outs[0],
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    assert_eq!(job(client, 1).await.state, JobState::Running);
    std::fs::write(
        out.join(format!("go-1-{}", job(client, 1).await.attempt)),
        "",
    )
    .unwrap();
    until("the job to succeed", Duration::from_secs(30), || async {
        (job(client, 1).await.state == JobState::Succeeded).then_some(())
    })
    .await;
    drop(a);
}

/// Secured cluster; the agent gets its token from a file and, as the docs once advised,
/// an admin register token in its environment: the runner sees neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_never_sees_the_agents_credentials() {
    let dir = tempfile::Builder::new()
        .prefix("allot-secrets-")
        .tempdir()
        .unwrap();
    let mut c =
        LocalCluster::new(node_binary().unwrap(), dir.path().join("cluster"), 3, 1).unwrap();
    c.dev_mode = false;
    c.start_all().unwrap();
    c.init().await.unwrap();
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let admin_token = allot_client::security::generate_token().unwrap();
    c.admin_client()
        .unwrap()
        .bootstrap(PrincipalId(1), &admin_token)
        .await
        .unwrap();
    c.admin_token = Some(admin_token.clone());
    let admin = c.admin_client().unwrap();
    fund(&admin).await;
    let agent_token = allot_client::security::generate_token().unwrap();
    admin
        .create_token_with(
            PrincipalId(41),
            Scope::Agent(NodeId(1)),
            None,
            &agent_token,
            admin.next_request_id(),
        )
        .await
        .unwrap();
    let token_file = dir.path().join("agent-token");
    std::fs::write(&token_file, &agent_token).unwrap();
    let (script, out) = runner(dir.path());
    let args = [
        "--token-file",
        token_file.to_str().unwrap(),
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let env = [
        ("ALLOT_AGENT_REGISTER_TOKEN", admin_token.as_str()),
        ("SOME_OTHER_SECRET", "not-for-jobs"),
    ];
    let mut a = agent(&c.endpoints(), 1, &dir.path().join("agent"), &args, &env);
    wait_node(&admin, &mut a, 1).await;
    admin.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    let env_file = out.join("env-1-1");
    let runner_env = until(
        "the runner's environment",
        Duration::from_secs(20),
        || async {
            std::fs::read_to_string(&env_file)
                .ok()
                .filter(|s| s.contains("ALLOT_JOB_ID"))
        },
    )
    .await;
    for secret in [admin_token.as_str(), agent_token.as_str(), "not-for-jobs"] {
        assert!(
            !runner_env.contains(secret),
            "a credential reached the runner"
        );
    }
    for name in [
        "ALLOT_AGENT_TOKEN",
        "ALLOT_AGENT_REGISTER_TOKEN",
        "SOME_OTHER_SECRET",
    ] {
        assert!(!runner_env.contains(name), "{name} reached the runner");
    }
    for name in [
        "CUDA_VISIBLE_DEVICES=0",
        "ALLOT_ATTEMPT=1",
        "ALLOT_PROGRESS_FILE=",
        "PATH=",
    ] {
        assert!(runner_env.contains(name), "{name} is missing: {runner_env}");
    }
    // And the token never appears on the agent's command line.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", a.pid().unwrap())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(&agent_token));
    std::fs::write(out.join("go-1-1"), "").unwrap();
    until("the job to succeed", Duration::from_secs(30), || async {
        (admin.job(ORG, JobId(1)).await.unwrap().state == JobState::Succeeded).then_some(())
    })
    .await;
    drop(a);
}

/// A late report: the runner finishes while its agent is cut off, and the job was
/// cancelled (settled) meanwhile. Once the agent reaches the cluster again its report
/// gets the typed "already finished" refusal, which it logs as such, and the
/// cancellation's settlement is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_finish_of_a_settled_job_is_refused_and_logged_as_such() {
    let sc = Scene::new("allot-late-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    let args = sc.args(&["--heartbeat-interval", "500ms"]);
    let partition = Partition::around(c.endpoints()).await;
    let via = partition.addrs();
    let mut a = agent(&via, 1, &sc.path().join("agent"), &args, &[]);
    wait_node(client, &mut a, 1).await;
    client.submit_job(ORG, spec(5, 3_600_000)).await.unwrap();
    until("job 5 running", Duration::from_secs(20), || async {
        (job(client, 5).await.state == JobState::Running).then_some(())
    })
    .await;
    // Cut off (well within the node lease); the job is cancelled meanwhile; the runner
    // then finishes on its own.
    partition.cut();
    let settled = match client.cancel_job(ORG, JobId(5)).await.unwrap() {
        Reply::JobCancelled(Some(s)) => s,
        other => panic!("cancel: {other:?}"),
    };
    std::fs::write(out.join("go-5-1"), "").unwrap();
    until("the runner exited", Duration::from_secs(10), || async {
        events(out)
            .iter()
            .any(|e| e.0 == "exit" && e.1 == 5)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_500)).await; // its report is retried
    partition.heal();
    // Its last heartbeat (sent when the runner exits, retried through the cut) or, if
    // that gave up first, its finish report is refused as already finished; the agent
    // logs which, and reports nothing more.
    let lines = [
        "but the job has already finished",
        "the job had already finished and been settled: nothing to report",
    ];
    let said = until(
        "the agent logs the late finish",
        Duration::from_secs(30),
        || async {
            let log = a.log_text();
            lines.iter().find(|l| log.contains(*l)).copied()
        },
    )
    .await;
    println!("late finish: the agent logged \"{said}\"");
    let j = job(client, 5).await;
    assert_eq!(
        (j.state, j.last_reason),
        (JobState::Cancelled, Reason::Cancelled)
    );
    // The finish changed nothing: what the project consumed is the cancellation's
    // capture, and its hold's rest was refunded.
    let b = client
        .balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap();
    assert_eq!(
        b.consumed_micro, settled.captured_micro,
        "{b:?} {settled:?}"
    );
    assert_eq!(b.held_micro, 0, "{b:?}");
    a.assert_running();
}

/// What the cluster may bill beyond the runner's own lifetime: the dispatch before it
/// starts and the report after it exits (DESIGN §45).
const DISPATCH_AND_REPORT_MS: f64 = 100.0;

/// A runner that exits while its agent is cut off (for less than the node's lease, so
/// the cluster never fences the node) is billed to its exit, not to when its report gets
/// through: from rule version 6 the agent's finish says when the runner exited
/// (`FinishJobAt`, DESIGN §45 "The exit instant"). The release before billed the whole
/// partition after the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_exits_while_its_agent_is_cut_off_is_billed_to_its_exit() {
    let sc = Scene::new("allot-exit-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    let to = allot_statemachine::version::RULES_MAX;
    client
        .run(SHARD, Command::ActivateVersion { version: to })
        .await
        .unwrap();
    let args = sc.args(&["--heartbeat-interval", "500ms"]);
    let partition = Partition::around(c.endpoints()).await;
    let via = partition.addrs();
    let mut a = agent(&via, 1, &sc.path().join("agent"), &args, &[]);
    wait_node(client, &mut a, 1).await;
    client.submit_job(ORG, spec(7, 3_600_000)).await.unwrap();
    until("job 7 running", Duration::from_secs(20), || async {
        (job(client, 7).await.state == JobState::Running).then_some(())
    })
    .await;
    // It runs a while, then the agent is cut off and the runner finishes at once. The
    // cut comes right after a heartbeat was answered, not at an arbitrary phase of the
    // cycle: a heartbeat applied whose answer the cut lost makes the meter's newest one
    // the agent never saw accepted, and the bill one interval longer (DESIGN §45, "What
    // it does not cover").
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let answered = |log: &str| log.matches("heartbeat job=7 attempt=1 seq=").count();
    let before = answered(&a.log_text());
    until("a heartbeat answered", Duration::from_secs(5), || {
        let now = answered(&a.log_text());
        async move { (now > before).then_some(()) }
    })
    .await;
    partition.cut();
    std::fs::write(out.join("go-7-1"), "").unwrap();
    until("the runner exited", Duration::from_secs(10), || async {
        events(out)
            .iter()
            .any(|e| e.0 == "exit" && e.1 == 7)
            .then_some(())
    })
    .await;
    // Its final heartbeat and its report are retried through the cut, which lasts longer
    // than the agent client's 5 s call timeout (a heartbeat that got through at the heal
    // would be the meter's newest, and the bill would run to it).
    let cut_for = Duration::from_secs(8);
    tokio::time::sleep(cut_for).await;
    partition.heal();
    let done = until("the job to succeed", Duration::from_secs(30), || async {
        let j = job(client, 7).await;
        (j.state == JobState::Succeeded).then_some(j)
    })
    .await;
    assert_eq!(done.attempt, 1);
    let (start, end) = span(&events(out), 7, 1);
    let lived = ((end - start) / 1_000_000) as u64;
    let b = client
        .balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap();
    println!(
        "exit instant: billed {} GPU-ms for {lived} GPU-ms the runner lived, cut off for {} ms after it",
        b.consumed_micro,
        cut_for.as_millis()
    );
    // Never less than the runner used (less the dispatch before its first heartbeat),
    // and not the partition after it: within a heartbeat interval of its life.
    assert!(
        b.consumed_micro + DISPATCH_AND_REPORT_MS as u64 >= lived,
        "billed less than run: {b:?}, lived {lived} ms"
    );
    assert!(
        b.consumed_micro <= lived + 500,
        "billed the partition after the exit: {b:?}, lived {lived} ms\n{}",
        a.log_text()
    );
    assert_eq!(b.held_micro, 0, "{b:?}");
    a.assert_running();
}

/// A token on the agent's command line (readable by every local user in
/// `/proc/<pid>/cmdline`) is refused before the agent does anything: it names the file
/// flag to use instead and exits 2.
#[test]
fn a_token_on_the_agents_command_line_is_refused() {
    for (flag, file_flag) in [
        ("--token", "--token-file"),
        ("--register-token", "--register-token-file"),
    ] {
        let mut out = std::process::Command::new(env!("CARGO_BIN_EXE_allot-agent"))
            .args([
                "--endpoints",
                "127.0.0.1:9",
                "--node",
                "1",
                "--gpu-type",
                "A100",
                "--gpus",
                "1",
                flag,
                "secret-on-argv",
                "--simulate",
            ])
            .env_remove("ALLOT_AGENT_TOKEN")
            .env_remove("ALLOT_AGENT_REGISTER_TOKEN")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // An agent that accepted the flag would run on (retrying the unreachable
        // endpoint): it is stopped and the test fails.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while out.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = out.kill();
                panic!("the agent started with {flag} on its command line");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = out.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(file_flag), "{flag}: {stderr}");
        assert!(!stderr.contains("secret-on-argv"), "{flag}: {stderr}");
    }
}

/// All three nodes stopped for 60 s, then restarted: a job running 30 s afterwards is
/// billed within 0.1 % of the GPU time its runner measured (the old 20 % slew billed
/// ~1.2× for the five minutes after such an outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_whole_cluster_outage_bills_follow_real_time() {
    let dir = tempfile::Builder::new()
        .prefix("allot-outage-")
        .tempdir()
        .unwrap();
    let (mut c, client) = cluster(dir.path()).await;
    fund(&client).await;
    // Some history (ticks) before the outage.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: Vec<u64> = c.nodes.iter().map(|n| n.id).collect();
    for id in &ids {
        c.terminate(*id, Duration::from_secs(10));
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    for id in &ids {
        c.start(*id).unwrap();
    }
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    let (script, out) = runner(dir.path());
    let args = [
        "--heartbeat-interval",
        "1s",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let mut a = agent(&c.endpoints(), 1, &dir.path().join("agent"), &args, &[]);
    wait_node(&client, &mut a, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    until("the runner", Duration::from_secs(20), || async {
        events(&out)
            .iter()
            .any(|e| e.0 == "start" && e.2 == 1)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    std::fs::write(out.join("go-1-1"), "").unwrap();
    until("the job to succeed", Duration::from_secs(30), || async {
        (job(&client, 1).await.state == JobState::Succeeded).then_some(())
    })
    .await;
    let (start, end) = span(&events(&out), 1, 1);
    let gpu_ms = (end - start) as f64 / 1e6;
    let billed = client
        .balance(ORG, Account::Project(PROJECT), 0)
        .await
        .unwrap()
        .consumed_micro as f64;
    let ratio = billed / gpu_ms;
    // The rate bound (0.1 %), plus the fixed time the cluster holds the GPU around the
    // runner: from placement to the runner's start, and from its exit to the finish's
    // commit (the agent's dispatch and report, a few tens of ms on a loaded machine —
    // 38 ms in one CI run). It does not grow with the outage or the job's length.
    let overhead_ms = billed - gpu_ms * 1.001;
    println!(
        "outage: runner lived {gpu_ms:.0} ms, billed {billed:.0} GPU-ms: {ratio:.5}× \
         (bound: 0.999× to 1.001× + {DISPATCH_AND_REPORT_MS} ms)"
    );
    assert!(
        ratio >= 0.999 && overhead_ms <= DISPATCH_AND_REPORT_MS,
        "billed {billed} GPU-ms for {gpu_ms:.0} ms of GPU time ({ratio:.5}×)"
    );
    drop(a);
}

/// An agent process paused (SIGSTOP) while a newer process registered the same node
/// from another host, then resumed: it learns from its first assignment set that it
/// has been replaced, kills its runner and exits, and never starts the attempt the
/// newer process runs. Before incarnations reached agents in assignment sets, the old
/// process went on renewing the node and started that attempt a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_agent_process_stops_when_it_resumes() {
    let sc = Scene::new("allot-replaced-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    short_leases(client).await;
    let args = sc.args(&["--grace", "2s"]);
    let mut old = agent(&c.endpoints(), 1, &sc.path().join("old"), &args, &[]);
    wait_node(client, &mut old, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    let old_pid = started(out, 1, 1, Duration::from_secs(20)).await;
    old.signal("STOP");
    // The replacement (another work dir: another host, or a fresh container) waits for
    // the paused process's attempts to end — its node lease and the fence margin — then
    // registers a higher incarnation; the job is placed again, here.
    let mut new = agent(&c.endpoints(), 1, &sc.path().join("new"), &args, &[]);
    let new_pid = started(out, 1, 2, Duration::from_secs(40)).await;
    old.signal("CONT");
    let status = until(
        "the replaced agent to exit",
        Duration::from_secs(30),
        || {
            let st = old.exited();
            async move { st }
        },
    )
    .await;
    assert_eq!(
        status.code(),
        Some(3),
        "the replaced agent exits 3 (not to be restarted)"
    );
    assert!(
        old.log_text()
            .contains("a newer agent process has registered this node"),
        "the replaced agent says why it stopped"
    );
    // Its runner is gone, and it started nothing more.
    until(
        "the replaced runner to be gone",
        Duration::from_secs(10),
        || async { (!Path::new(&format!("/proc/{old_pid}")).exists()).then_some(()) },
    )
    .await;
    let starts: Vec<_> = events(out)
        .into_iter()
        .filter(|e| e.0 == "start")
        .map(|e| (e.2, e.3))
        .collect();
    assert_eq!(
        starts,
        vec![(1, old_pid), (2, new_pid)],
        "each attempt started once, attempt 2 by the new process only"
    );
    new.assert_running();
    let j = job(client, 1).await;
    assert_eq!((j.state, j.attempt), (JobState::Running, 2));
}

/// Found by review (twenty-first session): a replacement agent process for a node, from
/// another work dir (another host, a fresh container), registered at once while the
/// node's previous process was only cut off. The registration ended that process's
/// attempts and the job started again while its old runner still ran, until the cut-off
/// agent fenced itself. Now a process that finds attempts of a process its work dir did
/// not run waits for them to end — the cut-off process's lease and the fence margin —
/// before it registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_from_another_work_dir_waits_for_the_cut_off_agents_fence() {
    let sc = Scene::new("allot-replacement-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    short_leases(client).await;
    let args = sc.args(&FENCE_TIMING);
    let partition = Partition::around(c.endpoints()).await;
    let mut old = agent(&partition.addrs(), 1, &sc.path().join("old"), &args, &[]);
    wait_node(client, &mut old, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    started(out, 1, 1, Duration::from_secs(20)).await;
    until(
        "attempt 1 heartbeating",
        Duration::from_secs(20),
        || async { (job(client, 1).await.state == JobState::Running).then_some(()) },
    )
    .await;
    let cut_at = now_ns();
    partition.cut();
    // The replacement, from a work dir of its own, reaching the cluster directly.
    let mut new = agent(&c.endpoints(), 1, &sc.path().join("new"), &args, &[]);
    started(out, 1, 2, Duration::from_secs(30)).await;
    // The old agent's fence stops attempt 1's runner: logged once its whole process
    // group is gone.
    until(
        "attempt 1's runner to be stopped",
        Duration::from_secs(30),
        || async {
            old.log_text()
                .contains("runner stopped: the lease could not be renewed")
                .then_some(())
        },
    )
    .await;
    one_attempt_at_a_time(&events(out), cut_at, "replacement");
    assert!(
        new.log_text().contains("another agent process"),
        "the replacement says why it waits:\n{}",
        new.log_text()
    );
    assert!(
        old.log_text().contains("lease not renewed"),
        "the old agent fenced itself"
    );
    new.assert_running();
    drop(old);
}

/// A paused agent runs no timer, so it cannot fence its runners (found by review,
/// twenty-first session): only a supervisor outside it can. Run by systemd with a
/// watchdog (`NOTIFY_SOCKET`, `WATCHDOG_USEC`), the agent says it is ready and pings the
/// watchdog every half period from the runtime that runs the fences; stopped, it pings
/// no more, which is what lets systemd abort the service and kill its cgroup, runners
/// included (docs/allot-agent.service).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_agent_stops_pinging_its_watchdog() {
    use std::os::unix::net::UnixDatagram;
    let sc = Scene::new("allot-watchdog-").await;
    let socket = sc.path().join("notify");
    let server = UnixDatagram::bind(&socket).unwrap();
    server.set_nonblocking(true).unwrap();
    let recv = |server: &UnixDatagram| {
        let mut buf = [0u8; 128];
        let mut got = Vec::new();
        while let Ok(n) = server.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        got
    };
    let args = sc.args(&[]);
    let env = [
        ("NOTIFY_SOCKET", socket.to_str().unwrap()),
        ("WATCHDOG_USEC", "400000"),
    ];
    let mut a = agent(&sc.c.endpoints(), 1, &sc.path().join("agent"), &args, &env);
    wait_node(&sc.client, &mut a, 1).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let running = recv(&server);
    assert_eq!(
        running.first().map(String::as_str),
        Some("READY=1"),
        "{running:?}"
    );
    let pings = running.iter().filter(|m| *m == "WATCHDOG=1").count();
    assert!(pings >= 2, "pings every 200 ms: {running:?}");
    a.signal("STOP");
    // Let a ping already sent arrive, then watch two whole periods.
    tokio::time::sleep(Duration::from_millis(100)).await;
    recv(&server);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        recv(&server),
        Vec::<String>::new(),
        "a stopped agent pings no more"
    );
    a.signal("CONT");
    let d = Instant::now() + Duration::from_secs(5);
    while !recv(&server).iter().any(|m| m == "WATCHDOG=1") {
        assert!(Instant::now() < d, "the resumed agent pings again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.assert_running();
}

/// A TCP proxy whose server-to-client bytes can be held back and then let through in
/// the order they arrived: what a client sees of a replica whose view arrives late.
struct HoldProxy {
    addr: String,
    gate: Arc<tokio::sync::watch::Sender<Gate>>,
    /// Chunks that arrived from the server while held.
    held: Arc<std::sync::atomic::AtomicU64>,
}

/// Server bytes that arrived before `hold_from`, or before `released_until`, pass.
#[derive(Clone, Copy, Default)]
struct Gate {
    hold_from: Option<Instant>,
    released_until: Option<Instant>,
}

impl Gate {
    fn passes(&self, arrived: Instant) -> bool {
        self.hold_from.is_none_or(|h| arrived < h)
            || self.released_until.is_some_and(|r| arrived < r)
    }
}

impl HoldProxy {
    async fn start(target: String) -> HoldProxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let gate = Arc::new(tokio::sync::watch::channel(Gate::default()).0);
        let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (g, h) = (gate.clone(), held.clone());
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                let Ok(outbound) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (mut from_client, mut to_client) = inbound.into_split();
                let (mut from_server, mut to_server) = outbound.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                });
                // Server bytes are stamped as they arrive (read at once, whatever is
                // held), and written in order once the gate lets their stamp through.
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
                let mut gate = g.subscribe();
                let (g2, h) = (g.clone(), h.clone());
                tokio::spawn(async move {
                    let g = g2;
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        match from_server.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                let at = Instant::now();
                                if !g.borrow().passes(at) {
                                    h.fetch_add(1, Ordering::SeqCst);
                                }
                                if tx.send((at, buf[..n].to_vec())).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
                tokio::spawn(async move {
                    while let Some((at, bytes)) = rx.recv().await {
                        if gate.wait_for(|g| g.passes(at)).await.is_err() {
                            return;
                        }
                        if to_client.write_all(&bytes).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        HoldProxy { addr, gate, held }
    }

    /// Holds every server byte that arrives from now on.
    fn hold(&self) {
        self.gate.send_replace(Gate {
            hold_from: Some(Instant::now()),
            released_until: None,
        });
    }

    /// Lets through what arrived before `until`; later bytes stay held.
    fn release_until(&self, until: Instant) {
        self.gate.send_modify(|g| g.released_until = Some(until));
    }

    /// Lets everything through.
    fn open(&self) {
        self.gate.send_replace(Gate::default());
    }

    fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }
}

/// An assignment set that reaches the agent late — from a replica that lags, here a
/// proxy that holds one endpoint's answers — names an attempt that has already moved
/// on (the job was cancelled): the agent confirms with a linearizable read before it
/// starts a runner, so the cancelled attempt never starts, not even for a moment. The
/// agent started it from the stale set and killed it only once a later set arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_from_a_late_assignment_set_is_confirmed_before_it_starts() {
    let sc = Scene::new("allot-late-set-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    let args = sc.args(&["--grace", "2s"]);
    // The agent's first endpoint, where it watches its assignments, answers through
    // the proxy; the others directly.
    let endpoints = c.endpoints();
    let proxy = HoldProxy::start(endpoints[0].clone()).await;
    let mut agent_endpoints = endpoints.clone();
    agent_endpoints[0] = proxy.addr.clone();
    let mut a = agent(&agent_endpoints, 1, &sc.path().join("agent"), &args, &[]);
    wait_node(client, &mut a, 1).await;
    until(
        "the agent to watch its assignments",
        Duration::from_secs(20),
        || {
            let log = a.log_text();
            async move { log.contains("watching assignments").then_some(()) }
        },
    )
    .await;

    proxy.hold();
    let held_before = proxy.held();
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    // The watched replica has placed the job (and so sent the set naming it, held).
    until(
        "the watched replica to place the job",
        Duration::from_secs(20),
        || async {
            let q = query::Query::Job(ORG, JobId(1));
            match client.query_replica(&endpoints[0], SHARD, &q).await {
                Ok(query::Answer::Job(Some(j))) if j.state == JobState::Placed => Some(()),
                _ => None,
            }
        },
    )
    .await;
    until(
        "the set to reach the proxy",
        Duration::from_secs(10),
        || async { (proxy.held() > held_before).then_some(()) },
    )
    .await;
    let before_cancel = Instant::now();
    client.cancel_job(ORG, JobId(1)).await.unwrap();
    assert_eq!(job(client, 1).await.state, JobState::Cancelled);
    // The agent now gets the set naming the cancelled attempt, and only later the sets
    // after the cancellation (and the answers to anything it asks that endpoint).
    proxy.release_until(before_cancel);
    let started = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            if events(out).iter().any(|e| e.0 == "start") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok();
    proxy.open();
    assert!(
        !started,
        "a runner started for an attempt that had moved on"
    );
    until(
        "the agent to drop the attempt unstarted",
        Duration::from_secs(20),
        || {
            let log = a.log_text();
            async move {
                log.contains("not started: the attempt is no longer this node's")
                    .then_some(())
            }
        },
    )
    .await;
    assert!(
        events(out).iter().all(|e| e.0 != "start"),
        "no runner ever started for the cancelled job"
    );
    a.assert_running();
}

/// The operator shortens the node lease (`ConfigureScheduler`) while a job runs, and
/// the agent is cut off right after: it stops its runner by the new length, before the
/// cluster may place the job elsewhere. The agent learnt a retuned length only at its
/// 15 s resync, so a cut inside that window left the runner up to the old lease (60 s
/// here) while the cluster re-placed the job after 5 + 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shortened_node_lease_fences_a_cut_off_agent_by_its_new_length() {
    let sc = Scene::new("allot-retuned-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    let args = sc.args(&["--fence-margin", "1s", "--grace", "2s"]);
    let partition = Partition::around(c.endpoints()).await;
    let mut a = agent(&partition.addrs(), 1, &sc.path().join("agent"), &args, &[]);
    wait_node(client, &mut a, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    started(out, 1, 1, Duration::from_secs(20)).await;
    // From the default 60 s node lease to 5 s (margin 3 s).
    short_leases(client).await;
    until(
        "the agent to count with the new lease",
        Duration::from_secs(10),
        || {
            let log = a.log_text();
            async move {
                log.lines()
                    .any(|l| {
                        l.contains("lease lengths in force") && l.contains("node_lease_ms=5000")
                    })
                    .then_some(())
            }
        },
    )
    .await;
    let cut = now_ns();
    partition.cut();
    until("the runner to stop", Duration::from_secs(20), || {
        let log = a.log_text();
        async move {
            log.contains("runner stopped: the lease could not be renewed")
                .then_some(())
        }
    })
    .await;
    // Its last sign of life: its exit line, or its last `alive` line (SIGKILL leaves
    // no exit line; a live runner writes one every 50 ms).
    let exited = until(
        "the runner's work to be gone",
        Duration::from_secs(10),
        || async {
            let last = span(&events(out), 1, 1).1;
            (now_ns().saturating_sub(last) > 500_000_000).then_some(last)
        },
    )
    .await;
    let after_ms = (exited as f64 - cut as f64) / 1e6;
    println!("retuned lease: the runner stopped {after_ms:.0} ms after the cut");
    // Its last counted renewal was at most a heartbeat interval (1 s) before the cut,
    // and the runner is killed 3.75 s after it (5 s less a quarter); the cluster may
    // re-place the job 5 + 3 s after the renewal at the earliest.
    assert!(after_ms < 6_000.0, "stopped {after_ms:.0} ms after the cut");
    a.assert_running();
}

/// A runner that ignores SIGTERM (a training script stuck in a collective, or one that
/// traps it to checkpoint for longer than it may): logs `start` and then `alive` every
/// 50 ms, as [`RUNNER`] does, until it is killed.
const STUBBORN: &str = r#"#!/bin/sh
out="$1"
trap '' TERM
tag="$ALLOT_JOB_ID $ALLOT_ATTEMPT $$"
echo "start $tag $(date +%s%N)" >> "$out/events"
while true; do
  echo "alive $tag $(date +%s%N)" >> "$out/events"
  sleep 0.05
done
"#;

/// An agent told to stop (SIGTERM: a rollout, an operator) still kills a runner that
/// ignores SIGTERM before the node's lease runs out, whatever its own `--grace`: once
/// it stops, nothing renews the leases, and the cluster re-places the job when they
/// lapse. Before, shutting down waited the agent's whole grace (here 60 s) and dropped
/// any SIGKILL already due, so the job could run on two nodes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_shutting_down_kills_a_stubborn_runner_before_its_lease_ends() {
    let sc = Scene::new("allot-shutdown-").await;
    let (c, client, out) = (&sc.c, &sc.client, &sc.out);
    short_leases(client).await;
    let script = sc.path().join("stubborn.sh");
    std::fs::write(&script, STUBBORN).unwrap();
    let args = [
        "--grace",
        "60s",
        "--",
        "/bin/sh",
        script.to_str().unwrap(),
        out.to_str().unwrap(),
    ];
    let adir = sc.path().join("agent");
    let mut a = agent(&c.endpoints(), 1, &adir, &args, &[]);
    wait_node(client, &mut a, 1).await;
    client.submit_job(ORG, spec(1, 3_600_000)).await.unwrap();
    let pid = started(out, 1, 1, Duration::from_secs(20)).await;
    // Let the agent learn the short leases and renew under them.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopped_at = now_ns();
    let status = a.stop(Duration::from_secs(20));
    let last = events(out)
        .iter()
        .filter(|e| e.3 == pid)
        .map(|e| e.4)
        .max()
        .unwrap();
    let after_ms = (last as f64 - stopped_at as f64) / 1e6;
    println!("shutdown: the runner was last seen {after_ms:+.0} ms after the agent's SIGTERM");
    assert!(status.is_some(), "the agent exited by itself");
    // The node lease is 5 s (the cluster may re-place the job from 8 s).
    assert!(
        after_ms < 5_000.0,
        "the runner outlived the lease: last seen {after_ms:.0} ms after the shutdown began"
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the runner is gone"
    );
}
