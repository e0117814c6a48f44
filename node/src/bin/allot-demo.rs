//! `allot-demo`: a mixed multi-tenant GPU workload against a running cluster, with a live
//! progress view, a summary table and an invariant check on every replica.
//!
//! Per shard it creates three teams (enterprise, paid, free), funds them, registers a
//! GPU pool (2 × 8 A100 + 2 × 8 H100) and plays the GPU agents itself: node heartbeats,
//! job heartbeats with checkpoints, finishing jobs when their run time is over and
//! acknowledging preemptions. Jobs arrive faster than the pool can run them, so queues,
//! fair sharing and preemption are visible.
//!
//!   allot-demo --endpoints 127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103 [--shards 4] [--seconds 60]

use allot_node::local_cluster::{admin, Client};
use allot_node::workload::{admin as admin_req, grant, rid};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::scheduler::{JobState, SchedulerConfig};
use allot_statemachine::testkit::{
    a100, h100, world_commands, ORG, OTHER_ORG, OTHER_PROJECT, OTHER_USER, PROJECT, PROJECT_B,
    USER, USER_B,
};
use allot_statemachine::{
    Account, Actor, Command, GpuType, JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, OrgId,
    PrincipalId, ProjectId, Request, Tier, UserId,
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
    run_ms: u64,
    submitted: Instant,
    /// (attempt, when we first saw it running, heartbeat seq)
    running: Option<(u32, Instant, u64)>,
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
        for (node, ty) in node_ids(s) {
            reqs.push(admin_req(
                next_rid(1),
                Command::RegisterNode(NodeSpec {
                    node,
                    gpu_type: ty,
                    gpu_count: 8,
                    gpu_mem_gb: 80,
                    labels: vec![],
                }),
            ));
        }
        let (outs, _) = client.execute(s, &reqs).await?;
        if let Some(bad) = outs.iter().find(|o| o.is_err()) {
            bail!("setup of shard {s} failed: {bad:?} (is this a fresh cluster?)");
        }
    }

    let mut rng = Lcg(42);
    let mut jobs: BTreeMap<(u32, u64), Track> = BTreeMap::new();
    let mut next_job = 1u64;
    let started = Instant::now();
    let mut last_node_hb = Instant::now() - Duration::from_secs(10);
    let mut last_view = Instant::now() - Duration::from_secs(10);
    let mut submit_debt = 0.0f64;
    let mut last_loop = Instant::now();
    let mut refused = 0u64;
    let tty = std::io::stdout().is_terminal();
    println!("== running the workload for {seconds} s (jobs of 1–8 GPUs, 4–16 s each; arrivals ≈1.3× capacity)");
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let dt = last_loop.elapsed().as_secs_f64();
        last_loop = Instant::now();
        // Node agents: heartbeat every 2 s.
        if last_node_hb.elapsed() > Duration::from_secs(2) {
            last_node_hb = Instant::now();
            for s in 0..shards {
                let reqs: Vec<Request> = node_ids(s)
                    .into_iter()
                    .map(|(node, _)| Request {
                        actor: Actor::Agent(node),
                        request_id: 0,
                        command: Command::NodeHeartbeat { node },
                    })
                    .collect();
                client.execute(s, &reqs).await?;
            }
        }
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
            let run_ms = 4_000 + rng.below(12_000);
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
                command: Command::SubmitJob(spec),
            };
            let (outs, _) = client.execute(s, &[req]).await?;
            if outs[0].is_ok() {
                jobs.insert(
                    (s, id),
                    Track {
                        tier: team.tier,
                        run_ms,
                        submitted: Instant::now(),
                        running: None,
                        waited: None,
                        state: JobState::Queued,
                        preemptions: 0,
                    },
                );
            } else {
                refused += 1;
            }
        }
        // GPU agents: what is placed on each node.
        for s in 0..shards {
            let mut reqs = Vec::new();
            for (node, _) in node_ids(s) {
                let Answer::Assignments(a) = client.query(s, &Query::Assignments(node)).await?
                else {
                    continue;
                };
                for (job, attempt, _gpus, state) in a {
                    let Some(t) = jobs.get_mut(&(s, job.0)) else {
                        continue;
                    };
                    t.state = state;
                    match state {
                        JobState::Placed | JobState::Running => {
                            let (att, since, seq) = match t.running {
                                Some((att, since, seq)) if att == attempt => (att, since, seq + 1),
                                _ => {
                                    t.waited.get_or_insert(t.submitted.elapsed());
                                    (attempt, Instant::now(), 1)
                                }
                            };
                            t.running = Some((att, since, seq));
                            let ran = since.elapsed().as_millis() as u64;
                            let actor = Actor::Agent(node);
                            if ran >= t.run_ms {
                                reqs.push(Request {
                                    actor,
                                    request_id: next_rid(3),
                                    command: Command::FinishJob {
                                        job,
                                        attempt,
                                        success: true,
                                    },
                                });
                            } else {
                                reqs.push(Request {
                                    actor,
                                    request_id: 0,
                                    command: Command::JobHeartbeat(JobHeartbeat {
                                        job,
                                        attempt,
                                        seq,
                                        progress_ppm: (ran * 1_000_000 / t.run_ms) as u32,
                                        // A checkpoint every 2 s of run time.
                                        checkpoint: ran / 2_000,
                                    }),
                                });
                            }
                        }
                        JobState::Preempting => {
                            // The agent stops the job within its grace period.
                            reqs.push(Request {
                                actor: Actor::Agent(node),
                                request_id: next_rid(3),
                                command: Command::FinishJob {
                                    job,
                                    attempt,
                                    success: false,
                                },
                            });
                            t.running = None;
                        }
                        _ => {}
                    }
                }
            }
            if !reqs.is_empty() {
                client.execute(s, &reqs).await?;
            }
        }
        if last_view.elapsed() >= Duration::from_secs(1) {
            last_view = Instant::now();
            refresh_states(&client, &mut jobs).await?;
            let line = progress_line(&client, &endpoints, shards, &jobs, started.elapsed()).await?;
            if tty {
                print!("\r{line}");
                std::io::stdout().flush()?;
            } else if started.elapsed().as_secs().is_multiple_of(5) {
                println!("{line}");
            }
        }
    }
    println!();
    refresh_states(&client, &mut jobs).await?;
    summary(&client, &endpoints, shards, &jobs, refused).await
}

async fn refresh_states(
    client: &Client,
    jobs: &mut BTreeMap<(u32, u64), Track>,
) -> anyhow::Result<()> {
    for ((s, id), t) in jobs.iter_mut() {
        if t.state.is_final() {
            continue;
        }
        if let Answer::Job(Some(j)) = client.query(*s, &Query::Job(JobId(*id))).await? {
            t.state = j.state;
            t.preemptions = j.preemptions;
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
    Ok(format!(
        "[{:>3}s] {} | GPUs {used}/{gpus} ({:.0}%) | credits held {:.0} consumed {:.0} | leaders {}   ",
        elapsed.as_secs(),
        tiers.join(" "),
        100.0 * used as f64 / gpus.max(1) as f64,
        held as f64 / 1e6,
        consumed as f64 / 1e6,
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
        for ep in endpoints {
            match client.query_replica(ep, s, &Query::Invariants).await {
                Ok(Answer::Invariants(Ok(()))) => {}
                other => {
                    failures += 1;
                    println!("shard {s} on {ep}: {other:?}");
                }
            }
        }
        // Ticks keep every shard moving: compare the replicas at one applied index.
        let mut hashes = Vec::new();
        for _ in 0..200 {
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
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        let same_index = hashes.windows(2).all(|w| w[0].0 == w[1].0);
        let agree = same_index && hashes.windows(2).all(|w| w[0].1 == w[1].1);
        println!(
            "shard {s}: invariants ok on {} replicas; state hash {}",
            endpoints.len(),
            if agree {
                format!("equal on all replicas at index {}", hashes[0].0)
            } else if same_index {
                failures += 1;
                "DIFFERS".to_string()
            } else {
                "not compared (replicas at different indexes this instant)".to_string()
            }
        );
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("all checks passed");
    Ok(())
}
