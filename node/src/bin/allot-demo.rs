//! `allot-demo`: a mixed multi-tenant GPU workload against a running cluster, with a live
//! progress view, a summary table and an invariant check on every replica.
//!
//! Per shard it creates three teams (enterprise, paid, free), funds them, and starts a
//! GPU pool of 2 × 8 A100 + 2 × 8 H100 nodes, each run by a GPU agent in simulate mode
//! (the `allot-agent` code, `allot_client::agent::run`, one task per node): the agents
//! register their nodes, watch their assignments, heartbeat progress and checkpoints,
//! finish jobs when their simulated run time is over and hand preempted GPUs back after
//! the grace period. Jobs arrive faster than the pools can run them, so queues, fair
//! sharing and preemption are visible.
//!
//!   allot-demo --endpoints 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103 [--shards 4] [--seconds 60]

use allot_client::agent::{self, AgentConfig, Mode, SimConfig};
use allot_client::{format_credits, AuditFilter};
use allot_node::local_cluster::{admin, Client};
use allot_node::workload::{admin as admin_req, grant, rid};
use allot_statemachine::query::{Answer, JobFilter, Query};
use allot_statemachine::scheduler::{JobState, SchedulerConfig};
use allot_statemachine::testkit::{
    a100, h100, world_commands, ORG, OTHER_ORG, OTHER_PROJECT, OTHER_USER, PROJECT, PROJECT_B,
    USER, USER_B,
};
use allot_statemachine::{
    Account, Actor, Command, EventBody, GpuType, JobId, JobSpec, NodeId, OrgId, PrincipalId,
    ProjectId, Request, Tier, UserId,
};
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

const CREDITS_PER_TEAM: u64 = 50_000 * 1_000_000;

struct Team {
    tier: Tier,
    org: OrgId,
    project: ProjectId,
    user: UserId,
}

fn teams() -> [Team; 3] {
    [
        Team {
            tier: Tier::ENTERPRISE,
            org: ORG,
            project: PROJECT,
            user: USER,
        },
        Team {
            tier: Tier::PAID,
            org: ORG,
            project: PROJECT_B,
            user: USER_B,
        },
        Team {
            tier: Tier::FREE,
            org: OTHER_ORG,
            project: OTHER_PROJECT,
            user: OTHER_USER,
        },
    ]
}

#[derive(Clone, Debug)]
struct Track {
    tier: Tier,
    /// The first placement's queue wait (logical time, from the job's record).
    waited: Option<Duration>,
    state: JobState,
    preemptions: u32,
}

/// A small deterministic generator (the demo's workload is reproducible).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn node_ids(shard: u32) -> Vec<(NodeId, GpuType)> {
    (0..4)
        .map(|i| {
            (
                NodeId(1000 * (shard as u64 + 1) + i),
                if i < 2 { a100() } else { h100() },
            )
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut endpoints = Vec::new();
    let mut shards = 4u32;
    let mut seconds = 60u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--endpoints" => endpoints = val()?.split(',').map(str::to_string).collect(),
            "--shards" => shards = val()?.parse()?,
            "--seconds" => seconds = val()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    if endpoints.is_empty() || shards == 0 {
        bail!("usage: allot-demo --endpoints H:P,H:P,... [--shards N] [--seconds S]");
    }
    let client = allot_node::local_cluster::client(endpoints.clone());
    let mut n = 0u64;
    let mut next_rid = |stream: u64| {
        n += 1;
        rid(stream, n)
    };

    println!("== setting up {shards} shards: 3 teams (enterprise / paid / free), 50,000 credits each, 32 GPUs per shard");
    for s in 0..shards {
        let mut reqs: Vec<Request> = world_commands()
            .into_iter()
            .map(|c| admin_req(next_rid(1), c))
            .collect();
        // Demo time scale: jobs run seconds, not hours, so preemption may start after
        // 3 s of run time (default 60 s) with a 2 s grace and hysteresis.
        let mut settings = SchedulerConfig::default().settings();
        settings.min_runtime_ms = 3_000;
        settings.hysteresis_ms = 2_000;
        settings.grace_ms = 2_000;
        reqs.push(admin_req(
            next_rid(1),
            Command::ConfigureScheduler(settings),
        ));
        for t in teams() {
            reqs.push(admin_req(
                next_rid(1),
                Command::IssueGrant(grant(
                    t.project.0,
                    Account::Project(t.project),
                    CREDITS_PER_TEAM,
                )),
            ));
        }
        let (outs, _) = client.execute(s, &reqs).await?;
        if let Some(bad) = outs.iter().find(|o| o.is_err()) {
            bail!("setup of shard {s} failed: {bad:?} (is this a fresh cluster?)");
        }
    }

    let agents = start_agents(&endpoints, shards)?;
    wait_fleet(&client, shards).await?;

    let mut rng = Lcg(42);
    let mut jobs: BTreeMap<(u32, u64), Track> = BTreeMap::new();
    let mut next_job = 1u64;
    let started = Instant::now();
    let mut last_view = Instant::now() - Duration::from_secs(10);
    let mut submit_debt = 0.0f64;
    let mut last_loop = Instant::now();
    let mut refused = 0u64;
    let mut money = Money::default();
    let tty = std::io::stdout().is_terminal();
    println!("== running the workload for {seconds} s (jobs of 1–8 GPUs, 4–16 s each; arrivals ≈1.3× capacity)");
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let dt = last_loop.elapsed().as_secs_f64();
        last_loop = Instant::now();
        // Arrivals: ≈ 1.3 × capacity (128 GPUs / (avg 3.1 GPUs × 10 s)).
        submit_debt += dt * 5.5;
        while submit_debt >= 1.0 {
            submit_debt -= 1.0;
            let s = rng.below(shards as u64) as u32;
            let r = rng.below(100);
            let team = &teams()[if r < 20 {
                0
            } else if r < 55 {
                1
            } else {
                2
            }];
            let gpus = [1u32, 1, 2, 2, 4, 8][rng.below(6) as usize];
            let id = next_job;
            next_job += 1;
            let spec = JobSpec {
                job: JobId(id),
                project: team.project,
                user: team.user,
                tier: team.tier,
                gpu_types: if rng.below(2) == 0 {
                    vec![h100(), a100()]
                } else {
                    vec![a100(), h100()]
                },
                gpus,
                mem_floor_gb: 0,
                preemptible: team.tier != Tier::ENTERPRISE,
                checkpointable: true,
                max_duration_ms: 120_000,
            };
            let req = Request {
                actor: Actor::Tenant {
                    org: team.org,
                    principal: PrincipalId(team.org.0),
                },
                request_id: next_rid(2),
                org: Some(team.org),
                command: Command::SubmitJob(spec),
            };
            let (outs, _) = client.execute(s, &[req]).await?;
            if outs[0].is_ok() {
                jobs.insert(
                    (s, id),
                    Track {
                        tier: team.tier,
                        waited: None,
                        state: JobState::Queued,
                        preemptions: 0,
                    },
                );
            } else {
                refused += 1;
            }
        }
        if last_view.elapsed() >= Duration::from_secs(1) {
            last_view = Instant::now();
            refresh_states(&client, shards, &mut jobs).await?;
            money.update(&client, shards).await?;
            let line = progress_line(
                &client,
                &endpoints,
                shards,
                &jobs,
                &money,
                started.elapsed(),
            )
            .await?;
            if tty {
                print!("\r{line}");
                std::io::stdout().flush()?;
            } else if started.elapsed().as_secs().is_multiple_of(5) {
                println!("{line}");
            }
        }
    }
    println!();
    refresh_states(&client, shards, &mut jobs).await?;
    money.update(&client, shards).await?;
    let result = summary(&client, &endpoints, shards, &jobs, &money, refused).await;
    agents.stop().await;
    result
}

/// Every job's state, preemptions and first wait, a page of jobs per query.
async fn refresh_states(
    client: &Client,
    shards: u32,
    jobs: &mut BTreeMap<(u32, u64), Track>,
) -> anyhow::Result<()> {
    for s in 0..shards {
        let mut after = None;
        loop {
            let filter = JobFilter {
                after,
                ..JobFilter::default()
            };
            let Answer::Jobs(page) = client.query(s, &Query::Jobs(filter)).await? else {
                bail!("jobs page")
            };
            for j in &page.jobs {
                if let Some(t) = jobs.get_mut(&(s, j.spec.job.0)) {
                    t.state = j.state;
                    t.preemptions = j.preemptions;
                    t.waited = j.waits_ms.first().map(|ms| Duration::from_millis(*ms));
                }
            }
            match page.next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
    }
    Ok(())
}

/// Credits refunded and forfeited so far, summed from each shard's audit trail
/// (read incrementally: each update reads only the events since the last one).
#[derive(Default)]
struct Money {
    next_seq: BTreeMap<u32, u64>,
    refunded_micro: u64,
    forfeited_micro: u64,
}

impl Money {
    async fn update(&mut self, client: &Client, shards: u32) -> anyhow::Result<()> {
        for s in 0..shards {
            let from = self.next_seq.get(&s).copied().unwrap_or(0);
            let (mut refunded, mut forfeited) = (0, 0);
            let next = client
                .audit_export(s, AuditFilter::default(), from, |ev| {
                    match ev.body {
                        EventBody::Refunded { amount_micro, .. } => refunded += amount_micro,
                        EventBody::RefundForfeited { amount_micro, .. } => {
                            forfeited += amount_micro
                        }
                        _ => {}
                    }
                    Ok(())
                })
                .await?;
            self.refunded_micro += refunded;
            self.forfeited_micro += forfeited;
            self.next_seq.insert(s, next);
        }
        Ok(())
    }
}

/// The simulated GPU agents, one task per node.
struct Agents {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn start_agents(endpoints: &[String], shards: u32) -> anyhow::Result<Agents> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let work = std::env::temp_dir().join(format!("allot-demo-agents-{}", std::process::id()));
    let mut tasks = Vec::new();
    for s in 0..shards {
        for (node, gpu_type) in node_ids(s) {
            let sim = SimConfig {
                runtime_min: Duration::from_secs(4),
                runtime_max: Duration::from_secs(16),
                checkpoint_every: Duration::from_secs(2),
                fail_pct: 3,
            };
            let mut cfg = AgentConfig::new(endpoints.to_vec(), node, Mode::Simulate(sim));
            cfg.shard = s;
            cfg.gpu_type = gpu_type;
            cfg.heartbeat_interval = Duration::from_secs(1);
            cfg.grace = Duration::from_secs(2);
            cfg.work_dir = work.join(node.0.to_string());
            let mut stopped = stopped.clone();
            tasks.push(tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                if let Err(e) = agent::run(cfg, shutdown).await {
                    eprintln!("agent of {node}: {e}");
                }
            }));
        }
    }
    println!(
        "== started {} GPU agents (simulate mode: 4–16 s jobs, a checkpoint every 2 s, 3% fail)",
        tasks.len()
    );
    Ok(Agents { stop, tasks })
}

impl Agents {
    /// Stops every agent (runners stopped, nothing reported finished: the cluster's
    /// leases decide what happens to jobs still placed).
    async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

/// Waits until every agent has registered its node (32 GPUs per shard).
async fn wait_fleet(client: &Client, shards: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    for s in 0..shards {
        loop {
            if let Answer::Fleet { gpus, .. } = client.query(s, &Query::Fleet).await? {
                if gpus >= 32 {
                    break;
                }
            }
            if Instant::now() > deadline {
                bail!("the agents of shard {s} did not register their nodes");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

fn tier_name(t: Tier) -> &'static str {
    match t.0 {
        0 => "free",
        1 => "paid",
        _ => "enterprise",
    }
}

async fn progress_line(
    client: &Client,
    endpoints: &[String],
    shards: u32,
    jobs: &BTreeMap<(u32, u64), Track>,
    money: &Money,
    elapsed: Duration,
) -> anyhow::Result<String> {
    let mut by_tier: BTreeMap<Tier, (u32, u32, u32)> = BTreeMap::new();
    for t in jobs.values() {
        let e = by_tier.entry(t.tier).or_default();
        match t.state {
            JobState::Queued => e.0 += 1,
            JobState::Placed | JobState::Running | JobState::Preempting => e.1 += 1,
            _ => e.2 += 1,
        }
    }
    let (mut gpus, mut used) = (0, 0);
    let (mut held, mut consumed) = (0u64, 0u64);
    for s in 0..shards {
        if let Answer::Fleet { gpus: g, used: u } = client.query(s, &Query::Fleet).await? {
            gpus += g;
            used += u;
        }
        for team in teams() {
            if let Answer::Balance(Some(b)) = client
                .query(
                    s,
                    &Query::Balance {
                        org: team.org,
                        account: Account::Project(team.project),
                        horizon_ms: 0,
                    },
                )
                .await?
            {
                held += b.held_micro;
                consumed += b.consumed_micro;
            }
        }
    }
    let leaders = leaders(endpoints, shards).await;
    let tiers: Vec<String> = by_tier
        .iter()
        .rev()
        .map(|(t, (q, r, d))| format!("{} {q}q/{r}r/{d}d", tier_name(*t)))
        .collect();
    let preempted: u32 = jobs.values().map(|t| t.preemptions).sum();
    Ok(format!(
        "[{:>3}s] {} | preempted {preempted} | GPUs {used}/{gpus} ({:.0}%) | credits held {:.0} consumed {:.1} refunded {:.0} | leaders {}   ",
        elapsed.as_secs(),
        tiers.join(" "),
        100.0 * used as f64 / gpus.max(1) as f64,
        held as f64 / 1e6,
        consumed as f64 / 1e6,
        money.refunded_micro as f64 / 1e6,
        leaders
    ))
}

async fn leaders(endpoints: &[String], shards: u32) -> String {
    for ep in endpoints {
        if let Ok(mut a) = admin(ep).await {
            if let Ok(r) = a.status(allot_proto::StatusRequest {}).await {
                let r = r.into_inner();
                return (0..shards)
                    .map(|s| {
                        let l = r
                            .shards
                            .iter()
                            .find(|x| x.shard == s)
                            .map(|x| x.leader)
                            .unwrap_or(0);
                        format!("s{s}:n{l}")
                    })
                    .collect::<Vec<_>>()
                    .join(",");
            }
        }
    }
    "unknown".into()
}

async fn summary(
    client: &Client,
    endpoints: &[String],
    shards: u32,
    jobs: &BTreeMap<(u32, u64), Track>,
    money: &Money,
    refused: u64,
) -> anyhow::Result<()> {
    println!("\n== summary");
    println!(
        "{:<11} {:>9} {:>9} {:>8} {:>7} {:>10} {:>12} {:>12}",
        "tier",
        "submitted",
        "succeeded",
        "running",
        "queued",
        "preempted",
        "wait p50 s",
        "wait max s"
    );
    let mut tiers: BTreeMap<Tier, Vec<&Track>> = BTreeMap::new();
    for t in jobs.values() {
        tiers.entry(t.tier).or_default().push(t);
    }
    for (tier, ts) in tiers.iter().rev() {
        let mut waits: Vec<f64> = ts
            .iter()
            .filter_map(|t| t.waited.map(|w| w.as_secs_f64()))
            .collect();
        waits.sort_by(f64::total_cmp);
        let p50 = waits.get(waits.len() / 2).copied().unwrap_or(0.0);
        let max = waits.last().copied().unwrap_or(0.0);
        let count = |f: &dyn Fn(&JobState) -> bool| ts.iter().filter(|t| f(&t.state)).count();
        println!(
            "{:<11} {:>9} {:>9} {:>8} {:>7} {:>10} {:>12.1} {:>12.1}",
            tier_name(*tier),
            ts.len(),
            count(&|s| *s == JobState::Succeeded),
            count(&|s| matches!(
                s,
                JobState::Placed | JobState::Running | JobState::Preempting
            )),
            count(&|s| *s == JobState::Queued),
            ts.iter().map(|t| t.preemptions).sum::<u32>(),
            p50,
            max
        );
    }
    println!("submissions refused by admission quotas: {refused}");
    println!(
        "credits refunded to their buckets: {}; forfeited (refund into an expired bucket): {}",
        format_credits(money.refunded_micro),
        format_credits(money.forfeited_micro)
    );
    println!(
        "\n{:<6} {:>14} {:>14} {:>14} {:>14}",
        "shard", "issued", "consumed", "held", "available"
    );
    for s in 0..shards {
        let Answer::Totals(t) = client.query(s, &Query::Totals).await? else {
            bail!("totals")
        };
        let (mut held, mut avail) = (0u64, 0u64);
        for team in teams() {
            if let Answer::Balance(Some(b)) = client
                .query(
                    s,
                    &Query::Balance {
                        org: team.org,
                        account: Account::Project(team.project),
                        horizon_ms: 0,
                    },
                )
                .await?
            {
                held += b.held_micro;
                avail += b.available_micro();
            }
        }
        println!(
            "{:<6} {:>14.6} {:>14.6} {:>14.6} {:>14.6}",
            s,
            t.issued as f64 / 1e6,
            t.consumed as f64 / 1e6,
            held as f64 / 1e6,
            avail as f64 / 1e6
        );
    }
    println!("\n== invariant check on every replica (conservation, holds, scheduler) and replica agreement");
    let mut failures = 0;
    for s in 0..shards {
        let mut bad_replicas = 0;
        for ep in endpoints {
            match client.query_replica(ep, s, &Query::Invariants).await {
                Ok(Answer::Invariants(Ok(()))) => {}
                other => {
                    bad_replicas += 1;
                    println!("shard {s} on {ep}: {other:?}");
                }
            }
        }
        failures += bad_replicas;
        // Ticks keep every shard moving: compare the replicas at one applied index
        // (polled for up to 10 s; a replica that never catches up is a failure).
        let mut hashes = Vec::new();
        for _ in 0..400 {
            hashes.clear();
            for ep in endpoints {
                if let Ok(mut a) = admin(ep).await {
                    if let Ok(r) = a.shard_hash(allot_proto::ShardRequest { shard: s }).await {
                        let r = r.into_inner();
                        hashes.push((r.applied_index, r.state_hash));
                    }
                }
            }
            if hashes.len() == endpoints.len() && hashes.windows(2).all(|w| w[0].0 == w[1].0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let all = hashes.len() == endpoints.len();
        let same_index = all && hashes.windows(2).all(|w| w[0].0 == w[1].0);
        let agree = same_index && hashes.windows(2).all(|w| w[0].1 == w[1].1);
        let hash = if agree {
            format!("equal on all replicas at index {}", hashes[0].0)
        } else {
            failures += 1;
            if !all {
                format!(
                    "answered by {} of {} replicas",
                    hashes.len(),
                    endpoints.len()
                )
            } else if same_index {
                "DIFFERS".to_string()
            } else {
                "not compared: the replicas did not reach one applied index in 10 s".to_string()
            }
        };
        let invariants = match bad_replicas {
            0 => format!("invariants ok on {} replicas", endpoints.len()),
            n => format!("invariants FAILED on {n} of {} replicas", endpoints.len()),
        };
        println!("shard {s}: {invariants}; state hash {hash}");
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("all checks passed");
    Ok(())
}
