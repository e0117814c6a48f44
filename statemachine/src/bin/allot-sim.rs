//! allot-sim: replays a GPU workload trace through the real state machine on simulated
//! logical time, with simulated agents (heartbeats, checkpoints, preemption hand-off,
//! finishes), once per scheduling policy, and prints scheduling-quality figures side by
//! side. The trace is generated from a seed (reproducible) or loaded from JSON lines.
//!
//! ```text
//! cargo run --release -p allot-statemachine --features sim --bin allot-sim -- \
//!     [--seed N] [--hours H] [--load X] [--flood N] [--json] \
//!     [--trace-out FILE] [--trace-in FILE] [--policies fair,fair-v1,strict,fifo,slurm,kueue] \
//!     [--flexible] [--big-jobs PCT] [--autoscale MIN,... [--autoscale-run-pct PCT]]
//! ```
//!
//! The policies: allot's `fair` (under this release's rules, version 3, activated in
//! the set-up of every run) and `fair-v1` (the same policy under rules 1, the previous
//! release's decisions); the baselines `strict` (strict tier priority), `fifo`, `slurm`
//! (Slurm-like: multifactor priority with Fair Tree, QOS preemption, EASY backfill) and
//! `kueue` (Kueue-like: a ClusterQueue per tier in one cohort, fair sharing, reclaim),
//! all six by default (DESIGN §24).
//!
//! Besides each tier's waits, it reports the time to admission (submission to first
//! placement) per tier and job size (1, 2, 4, 8 GPUs), as Kueue reports admission wait
//! per queue.
//!
//! `--autoscale 0,5,15,30` runs the policies (Fair unless `--policies` names others) on
//! the fixed fleet and then with a simulated autoscaler per provisioning delay, in
//! minutes: it reads the shard's demand signal every step and orders nodes that register
//! only after the delay (DESIGN §52; the code at the end of this file).

use allot_statemachine::scheduler::{JobState, Policy};
use allot_statemachine::testkit::{a100, h100, A100_PRICE, H100_PRICE, T0_MS};
use allot_statemachine::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};

const STEP_MS: u64 = 5_000;
const HEARTBEAT_MS: u64 = 30_000;
const CHECKPOINT_EVERY_MS: u64 = 60_000;
const CHECKPOINT_COST_MS: u64 = 10_000;
const NODES: u64 = 64;
const GPUS_PER_NODE: u32 = 8;
/// Orgs per tier (free, paid, enterprise); equal weights within a tier.
const ORGS_PER_TIER: [u64; 3] = [16, 8, 4];
const ADMIN: Actor = Actor::Admin(PrincipalId(1));

/// One job of the trace.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TraceJob {
    t_ms: u64,
    job: u64,
    org: u64,
    tier: u8,
    gpu_types: Vec<String>,
    gpus: u32,
    mem_floor_gb: u32,
    preemptible: bool,
    checkpointable: bool,
    max_duration_ms: u64,
    /// Work the job needs (run time on its GPUs without interruption).
    work_ms: u64,
}

/// splitmix64: a small, seedable, reproducible generator (no `rand` in this crate).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Args {
    seed: u64,
    hours: f64,
    load: f64,
    flood: u64,
    json: bool,
    trace_out: Option<String>,
    trace_in: Option<String>,
    policies: Vec<Run>,
    /// Every job accepts both GPU types (isolates fairness from type constraints).
    flexible: bool,
    /// Percent of jobs that take a whole node (8 GPUs); the rest are 1, 2 and 4 GPUs in
    /// the proportions 4:3:2. The default, 10, is the original trace, draw for draw.
    big_jobs_pct: u64,
    /// Provisioning delays (minutes) to run the autoscaler with; empty: no autoscaling.
    autoscale: Vec<u64>,
    /// The autoscaler's estimate of the share of its max duration a job runs (default:
    /// the trace's own, `trace_run_pct`).
    autoscale_run_pct: Option<u32>,
}

const USAGE: &str = "usage: allot-sim [--seed N] [--hours H] [--load X] [--flood N] [--json] [--trace-out F] [--trace-in F] [--policies fair,fair-v1,strict,fifo,slurm,kueue] [--flexible] [--big-jobs PCT] [--autoscale MIN,... [--autoscale-run-pct PCT]]";

/// A policy and the rule version its shard runs under (the set-up activates it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    policy: Policy,
    rules: u32,
}

impl Run {
    /// `policy` under this release's rules.
    const fn new(policy: Policy) -> Run {
        Run {
            policy,
            rules: version::RULES_MAX,
        }
    }

    /// The policy's name in the figures: with the rule version when it is not this
    /// release's (`Fair-v1`).
    fn label(&self) -> String {
        if self.rules == version::RULES_MAX {
            format!("{:?}", self.policy)
        } else {
            format!("{:?}-v{}", self.policy, self.rules)
        }
    }
}

/// Every policy, in the order `--policies` names them and the default runs them:
/// `fair-v1` is Fair as rule version 1 decides (before this release's changes).
const POLICIES: [(&str, Run); 6] = [
    ("fair", Run::new(Policy::Fair)),
    (
        "fair-v1",
        Run {
            policy: Policy::Fair,
            rules: version::RULES_BASELINE,
        },
    ),
    ("strict", Run::new(Policy::StrictPriority)),
    ("fifo", Run::new(Policy::Fifo)),
    ("slurm", Run::new(Policy::SlurmLike)),
    ("kueue", Run::new(Policy::KueueLike)),
];

/// Job sizes reported apart (GPUs per job).
const SIZES: [u32; 4] = [1, 2, 4, 8];

fn parse_args() -> Result<Args, String> {
    parse_from(std::env::args().skip(1))
}

fn parse_from(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        seed: 42,
        hours: 4.0,
        load: 1.6,
        flood: 2_000,
        json: false,
        trace_out: None,
        trace_in: None,
        policies: POLICIES.iter().map(|(_, p)| *p).collect(),
        flexible: false,
        big_jobs_pct: 10,
        autoscale: Vec::new(),
        autoscale_run_pct: None,
    };
    let mut policies_given = false;
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--hours" => a.hours = value()?.parse().map_err(|e| format!("--hours: {e}"))?,
            "--load" => a.load = value()?.parse().map_err(|e| format!("--load: {e}"))?,
            "--flood" => a.flood = value()?.parse().map_err(|e| format!("--flood: {e}"))?,
            "--json" => a.json = true,
            "--flexible" => a.flexible = true,
            "--big-jobs" => {
                a.big_jobs_pct = value()?.parse().map_err(|e| format!("--big-jobs: {e}"))?
            }
            "--autoscale" => a.autoscale = parse_delays(&value()?)?,
            "--autoscale-run-pct" => a.autoscale_run_pct = Some(parse_run_pct(&value()?)?),
            "--trace-out" => a.trace_out = Some(value()?),
            "--trace-in" => a.trace_in = Some(value()?),
            "--policies" => {
                policies_given = true;
                a.policies = value()?
                    .split(',')
                    .map(|p| {
                        POLICIES
                            .iter()
                            .find(|(name, _)| *name == p)
                            .map(|(_, policy)| *policy)
                            .ok_or(format!(
                                "unknown policy {p:?} (fair, fair-v1, strict, fifo, slurm, kueue)"
                            ))
                    })
                    .collect::<Result<_, _>>()?
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other:?} (try --help)")),
        }
    }
    if !(a.hours > 0.0 && a.hours <= 48.0 && a.load > 0.0 && a.load <= 10.0) {
        return Err("--hours must be in (0, 48] and --load in (0, 10]".into());
    }
    if a.big_jobs_pct > 100 {
        return Err("--big-jobs is a percentage: 0 to 100".into());
    }
    if a.autoscale_run_pct.is_some() && a.autoscale.is_empty() {
        return Err("--autoscale-run-pct needs --autoscale".into());
    }
    if !a.autoscale.is_empty() && !policies_given {
        a.policies = vec![Run::new(Policy::Fair)];
    }
    Ok(a)
}

/// The workload: Poisson arrivals at `load` × fleet capacity, tiers 45/35/20% of jobs,
/// Zipf-skewed demand across orgs, paid bursts (3× for 10 min every hour), 1–8 GPUs,
/// 20 s–10 min of work (log-uniform), 70% checkpointable; an enterprise flood of
/// `flood` jobs by one org at the one-hour mark.
fn generate(args: &Args) -> Vec<TraceJob> {
    let mut rng = Rng(args.seed);
    let capacity = (NODES * GPUS_PER_NODE as u64) as f64;
    // 1, 2 and 4 GPUs in the proportions 4:3:2 (a mean of 2), 8 GPUs for the rest. The
    // default's expression is the original's, so its arrival times are bit for bit.
    let mean_gpus = if args.big_jobs_pct == 10 {
        0.4 * 1.0 + 0.3 * 2.0 + 0.2 * 4.0 + 0.1 * 8.0
    } else {
        let big = args.big_jobs_pct as f64 / 100.0;
        big * 8.0 + (1.0 - big) * 2.0
    };
    let mean_work_s = (600.0 - 20.0) / (600.0f64 / 20.0).ln();
    let rate_per_ms = args.load * capacity / (mean_gpus * mean_work_s) / 1_000.0;
    let end_ms = (args.hours * 3_600_000.0) as u64;
    let mut jobs = Vec::new();
    let mut t = 0.0f64;
    let make = |rng: &mut Rng, t_ms: u64, tier: u8, org: u64, job: u64| {
        let gpus = job_gpus(rng, args.big_jobs_pct);
        let work_ms = (20_000.0 * (30.0f64).powf(rng.unit())) as u64;
        let types = match if args.flexible { 1 } else { rng.below(3) } {
            0 => vec!["H100".to_string()],
            1 => vec!["H100".to_string(), "A100".to_string()],
            _ => vec!["A100".to_string(), "H100".to_string()],
        };
        TraceJob {
            t_ms,
            job,
            org,
            tier,
            gpu_types: types,
            gpus,
            mem_floor_gb: 40,
            preemptible: tier < 2,
            checkpointable: rng.below(10) < 7,
            max_duration_ms: work_ms * 3 + 10 * 60_000,
            work_ms,
        }
    };
    loop {
        let hour_pos = (t as u64) % 3_600_000;
        let burst = (1_800_000..2_400_000).contains(&hour_pos);
        let rate = rate_per_ms * if burst { 1.35 } else { 0.95 };
        t += -(1.0 - rng.unit()).ln() / rate;
        if t as u64 >= end_ms {
            break;
        }
        let roll = rng.below(100);
        let tier: u8 = if burst && roll < 30 {
            1
        } else if roll < 45 {
            0
        } else if roll < 80 {
            1
        } else {
            2
        };
        // Zipf-like skew across the tier's orgs.
        let n = ORGS_PER_TIER[tier as usize];
        let weights: Vec<f64> = (0..n).map(|i| 1.0 / (i as f64 + 1.0).powf(0.7)).collect();
        let mut pick = rng.unit() * weights.iter().sum::<f64>();
        let mut k = 0;
        while k + 1 < n as usize && pick > weights[k] {
            pick -= weights[k];
            k += 1;
        }
        let id = jobs.len() as u64 + 1;
        jobs.push(make(&mut rng, t as u64, tier, org_id(tier, k as u64), id));
    }
    let flood_org = org_id(2, 0);
    let flood_at = (end_ms / 4).min(3_600_000);
    for _ in 0..args.flood.min(9_000) {
        let id = jobs.len() as u64 + 1;
        jobs.push(make(&mut rng, flood_at, 2, flood_org, id));
    }
    jobs.sort_by_key(|j| (j.t_ms, j.job));
    jobs
}

/// A job's size: whole-node (8 GPUs) for `big_pct` percent of jobs, else 1, 2 or 4 GPUs
/// in the proportions 4:3:2. At 10 % it draws exactly as the original trace did (one
/// draw below 10), so seeds reproduce their published figures.
fn job_gpus(rng: &mut Rng, big_pct: u64) -> u32 {
    const SMALL: [u32; 9] = [1, 1, 1, 1, 2, 2, 2, 4, 4];
    if big_pct == 10 {
        let i = rng.below(10) as usize;
        return SMALL.get(i).copied().unwrap_or(8);
    }
    let r = rng.below(100);
    if r < big_pct {
        8
    } else {
        SMALL[((r - big_pct) * 9 / (100 - big_pct)) as usize]
    }
}

fn org_id(tier: u8, k: u64) -> u64 {
    100 * (tier as u64 + 1) + k
}

/// The shard under simulation, and the simulated agents' view of their jobs.
struct Sim {
    state: State,
    index: u64,
    now: u64,
    rid: u128,
    /// job → (work done, work at last checkpoint, checkpoint count, last heartbeat, attempt, preempt ack due)
    agents: BTreeMap<u64, AgentJob>,
    lost_gpu_ms: u64,
    delivered_gpu_ms: u64,
    preemptions: u64,
    refunded_micro: u64,
    forfeited_micro: u64,
    invariants_ok: bool,
    used_samples: Vec<(u64, u64)>,
}

#[derive(Clone, Copy, Default)]
struct AgentJob {
    attempt: u32,
    done_ms: u64,
    saved_ms: u64,
    checkpoint: u64,
    last_hb_ms: u64,
    seq: u64,
    ack_at: Option<u64>,
}

impl Sim {
    fn apply(&mut self, requests: Vec<Request>) -> Vec<Outcome> {
        self.index += 1;
        let entry = Entry {
            log_index: self.index,
            logical_time_ms: self.now,
            requests,
        };
        let out = apply(&mut self.state, &entry).expect("fresh index");
        for e in &out.events {
            match e.body {
                EventBody::Refunded { amount_micro, .. } => self.refunded_micro += amount_micro,
                EventBody::RefundForfeited { amount_micro, .. } => {
                    self.forfeited_micro += amount_micro
                }
                EventBody::JobTransition {
                    to: JobState::Preempting,
                    ..
                } => self.preemptions += 1,
                _ => {}
            }
        }
        out.outcomes
    }

    fn req(&mut self, actor: Actor, command: Command) -> Request {
        self.req_in(actor, None, command)
    }

    /// A request in `org`'s namespace (jobs, their reports).
    fn req_in(&mut self, actor: Actor, org: Option<OrgId>, command: Command) -> Request {
        self.rid += 1;
        Request {
            actor,
            request_id: self.rid,
            org,
            command,
        }
    }

    /// The fleet, orgs, plans, quotas and grants, under rule version `rules` (activated
    /// first when it is not the baseline).
    fn setup(&mut self, rules: u32) {
        let mut reqs = Vec::new();
        if rules != version::RULES_BASELINE {
            reqs.push(self.req(ADMIN, Command::ActivateVersion { version: rules }));
        }
        reqs.push(self.req(
            ADMIN,
            Command::SetPrices {
                prices: vec![(a100(), A100_PRICE), (h100(), H100_PRICE)],
            },
        ));
        for node in 1..=NODES {
            let gpu_type = if node <= NODES / 2 { a100() } else { h100() };
            reqs.push(self.req(
                ADMIN,
                Command::RegisterNode(NodeSpec {
                    node: NodeId(node),
                    gpu_type,
                    gpu_count: GPUS_PER_NODE,
                    gpu_mem_gb: 80,
                    labels: vec![],
                    incarnation: 0,
                }),
            ));
        }
        for tier in 0..3u8 {
            for k in 0..ORGS_PER_TIER[tier as usize] {
                let org = org_id(tier, k);
                reqs.push(self.req(ADMIN, Command::CreateOrg { org: OrgId(org) }));
                reqs.push(self.req(
                    ADMIN,
                    Command::CreateProject {
                        project: ProjectId(org),
                        org: OrgId(org),
                    },
                ));
                reqs.push(self.req(
                    ADMIN,
                    Command::CreateUser {
                        user: UserId(org),
                        org: OrgId(org),
                    },
                ));
                // Admission control sheds what the fleet cannot serve: per-org queue caps
                // by tier (free work may be shed, per the seed). An enterprise org may
                // queue 250 jobs: a flood beyond that is refused at once (backpressure)
                // instead of waiting behind the org's fair share (DESIGN §24).
                let queued_max = [40, 200, 250][tier as usize];
                // Each org is entitled to its own tier (and those below it).
                reqs.push(self.req(
                    ADMIN,
                    Command::SetPlan {
                        org: OrgId(org),
                        plan: Some(Plan {
                            tiers: (0..=tier).map(Tier).collect(),
                            project_tiers: Vec::new(),
                        }),
                    },
                ));
                reqs.push(self.req(
                    ADMIN,
                    Command::SetQuota {
                        org: OrgId(org),
                        quota: Some(Quota {
                            queued_max,
                            running_max: 10_000,
                            ..Quota::default()
                        }),
                    },
                ));
                reqs.push(self.req(
                    ADMIN,
                    Command::IssueGrant(Grant {
                        bucket: BucketId(org),
                        owner: Account::Org(OrgId(org)),
                        kind: BucketKind::Paid,
                        amount_micro: 900_000_000_000_000,
                        expires_at_ms: None,
                        priority: 100,
                        policy: None,
                        source_ref: None,
                    }),
                ));
            }
        }
        let out = self.apply(reqs);
        assert!(
            out.iter().all(|o| o.is_ok()),
            "setup failed: {:?}",
            out.iter().find(|o| o.is_err())
        );
    }

    fn submit(&mut self, j: &TraceJob) -> Request {
        let spec = JobSpec {
            job: JobId(j.job),
            project: ProjectId(j.org),
            user: UserId(j.org),
            tier: Tier(j.tier),
            gpu_types: j.gpu_types.iter().map(|t| GpuType(t.clone())).collect(),
            gpus: j.gpus,
            mem_floor_gb: j.mem_floor_gb,
            preemptible: j.preemptible,
            checkpointable: j.checkpointable,
            max_duration_ms: j.max_duration_ms,
        };
        self.req_in(ADMIN, Some(OrgId(j.org)), Command::SubmitJob(spec))
    }

    /// One step of every simulated agent: progress, checkpoints, heartbeats, finishes,
    /// and the hand-off of preempted jobs after checkpointing.
    fn agents(&mut self, trace: &BTreeMap<u64, TraceJob>) -> Vec<Request> {
        let mut reqs = Vec::new();
        let placed: Vec<(u64, u32, JobState, u64)> = self
            .state
            .scheduler
            .jobs
            .sorted()
            .into_iter()
            .filter(|(_, j)| j.state.holds_gpus())
            .map(|(id, j)| {
                (
                    id.1 .0,
                    j.attempt,
                    j.state,
                    j.placement.as_ref().map_or(0, |p| p.node.0),
                )
            })
            .collect();
        for (job, attempt, state, node) in placed {
            let spec = &trace[&job];
            let a = self.agents.entry(job).or_default();
            if a.attempt != attempt {
                // A new attempt resumes from the last checkpoint (or from scratch).
                *a = AgentJob {
                    attempt,
                    done_ms: a.saved_ms,
                    saved_ms: a.saved_ms,
                    checkpoint: a.checkpoint,
                    last_hb_ms: self.now,
                    seq: 0,
                    ack_at: None,
                };
            }
            let agent = (Actor::Agent(NodeId(node)), Some(OrgId(spec.org)));
            a.done_ms += STEP_MS;
            self.delivered_gpu_ms += STEP_MS * spec.gpus as u64;
            if state == JobState::Preempting {
                // Checkpoint during the grace period, then hand the GPUs back.
                let ack_at = *a.ack_at.get_or_insert(self.now + CHECKPOINT_COST_MS);
                if self.now >= ack_at {
                    if spec.checkpointable {
                        a.saved_ms = a.done_ms;
                        a.checkpoint += 1;
                    }
                    self.lost_gpu_ms += (a.done_ms - a.saved_ms) * spec.gpus as u64;
                    a.seq += 1;
                    let hb = JobHeartbeat {
                        job: JobId(job),
                        attempt,
                        seq: a.seq,
                        progress_ppm: 0,
                        checkpoint: a.checkpoint,
                    };
                    let fin = Command::FinishJob {
                        job: JobId(job),
                        attempt,
                        success: false,
                    };
                    reqs.push((agent, Command::JobHeartbeat(hb)));
                    reqs.push((agent, fin));
                }
                continue;
            }
            if spec.checkpointable
                && a.done_ms - a.saved_ms >= CHECKPOINT_EVERY_MS
                && a.done_ms < spec.work_ms
            {
                a.saved_ms = a.done_ms;
                a.checkpoint += 1;
            }
            if a.done_ms >= spec.work_ms {
                reqs.push((
                    agent,
                    Command::FinishJob {
                        job: JobId(job),
                        attempt,
                        success: true,
                    },
                ));
            } else if self.now - a.last_hb_ms >= HEARTBEAT_MS || a.seq == 0 {
                a.seq += 1;
                a.last_hb_ms = self.now;
                let hb = JobHeartbeat {
                    job: JobId(job),
                    attempt,
                    seq: a.seq,
                    progress_ppm: (a.done_ms * 1_000_000 / spec.work_ms.max(1)).min(1_000_000)
                        as u32,
                    checkpoint: a.checkpoint,
                };
                reqs.push((agent, Command::JobHeartbeat(hb)));
            }
        }
        let nodes: Vec<u64> = (1..=NODES).collect();
        for n in nodes {
            reqs.push((
                (Actor::Agent(NodeId(n)), None),
                Command::NodeHeartbeat { node: NodeId(n) },
            ));
        }
        reqs.into_iter()
            .map(|((actor, org), c)| self.req_in(actor, org, c))
            .collect()
    }
}

/// Per tier, the GPUs committed to its queued jobs on nodes reserved for them: the free
/// GPUs the reservation keeps and those of victims in their grace period preempted for
/// the job (they are the job's once the victims hand back), at most the job's GPUs.
fn gpus_committed(s: &allot_statemachine::scheduler::Scheduler) -> [u64; 3] {
    let mut out = [0u64; 3];
    for node in s.nodes.values() {
        let Some(for_job) = node.reserved_for else {
            continue;
        };
        let Some((t, gpus)) = s
            .jobs
            .get(&for_job)
            .filter(|j| j.state == JobState::Queued)
            .map(|j| (j.spec.tier.0 as usize, j.spec.gpus as u64))
            .filter(|&(t, _)| t < out.len())
        else {
            continue;
        };
        let committed = node
            .slots
            .iter()
            .filter(|slot| match slot {
                None => true,
                Some(k) => s.jobs.get(k).is_some_and(|v| {
                    v.state == JobState::Preempting && v.preempted_for == Some(for_job)
                }),
            })
            .count() as u64;
        out[t] += committed.min(gpus);
    }
    out
}

#[derive(Serialize)]
struct TierFigures {
    tier: &'static str,
    jobs: usize,
    placed: usize,
    /// Refused at admission (queue quota): shed load.
    shed: usize,
    wait_p50_s: f64,
    wait_p95_s: f64,
    wait_p99_s: f64,
    wait_max_s: f64,
    jct_p50_s: f64,
    jain_index: f64,
    backlogged_orgs: usize,
    /// Share of the overload window's steps in which the tier had jobs queued.
    backlogged_pct: f64,
    /// Of those, the share in which it held at least its floor of the fleet's GPUs:
    /// 100 is "never starved".
    floor_met_pct: f64,
    /// Of those, the share in which it held what its floor promises it — its demand (the
    /// GPUs it holds plus those its queued jobs ask for) up to the floor — counting the
    /// GPUs committed to its queued jobs on nodes reserved for them (free GPUs kept for
    /// a gang job, and victims in their grace period preempted for the job: the
    /// scheduler has acted, the GPUs are the tier's once the victims hand back). `floor_met_pct` counts a step as missed even when the tier's
    /// whole demand is below its floor.
    floor_committed_pct: f64,
    /// The longest stretch, in seconds, in which the tier was backlogged and short of
    /// what its floor promises it by that count: how long it went without the
    /// scheduler acting for it (0: never).
    starved_max_s: f64,
    /// Time to admission (submission to first placement) by job size.
    by_gpus: Vec<SizeFigures>,
}

/// Time to admission of one tier's jobs of one size. A job never placed counts with the
/// time it had waited when the run ended (censored), like the tier's waits.
#[derive(Serialize, Debug, PartialEq)]
struct SizeFigures {
    gpus: u32,
    jobs: usize,
    placed: usize,
    wait_p50_s: f64,
    wait_p95_s: f64,
    wait_max_s: f64,
}

/// Per size in [`SIZES`]: the figures of `waits` (GPUs, wait ms, placed).
fn by_size(waits: &[(u32, u64, bool)]) -> Vec<SizeFigures> {
    SIZES
        .iter()
        .map(|&g| {
            let mut w: Vec<u64> = waits.iter().filter(|x| x.0 == g).map(|x| x.1).collect();
            SizeFigures {
                gpus: g,
                jobs: w.len(),
                placed: waits.iter().filter(|x| x.0 == g && x.2).count(),
                wait_p50_s: pct(&mut w, 0.50),
                wait_p95_s: pct(&mut w, 0.95),
                wait_max_s: pct(&mut w, 1.0),
            }
        })
        .collect()
}

#[derive(Serialize)]
struct Figures {
    policy: String,
    jobs: usize,
    allocation_pct: f64,
    tiers: Vec<TierFigures>,
    preemptions: u64,
    gpu_hours_delivered: f64,
    gpu_hours_lost: f64,
    gpu_hours_lost_pct: f64,
    credits_charged: f64,
    credits_refunded: f64,
    credits_forfeited: f64,
    invariants_ok: bool,
    entries: u64,
    /// With `--autoscale` only (absent otherwise, so the default output is unchanged).
    #[serde(skip_serializing_if = "Option::is_none")]
    autoscale: Option<AutoscaleFigures>,
}

fn pct(v: &mut [u64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i] as f64 / 1_000.0
}

fn jain(x: &[f64]) -> f64 {
    let (s, s2) = (x.iter().sum::<f64>(), x.iter().map(|v| v * v).sum::<f64>());
    if x.is_empty() || s2 == 0.0 {
        1.0
    } else {
        s * s / (x.len() as f64 * s2)
    }
}

fn simulate(run: Run, trace: &[TraceJob], hours: f64) -> Figures {
    simulate_with(run, trace, hours, None)
}

/// [`simulate`], with the autoscaler (if any) taking its turn before every step's entry.
fn simulate_with(
    run: Run,
    trace: &[TraceJob],
    hours: f64,
    mut scaler: Option<&mut Autoscaler>,
) -> Figures {
    let mut config = Config::default();
    config.scheduler.policy = run.policy;
    let mut sim = Sim {
        state: State::new(config),
        index: 0,
        now: T0_MS,
        rid: 0,
        agents: BTreeMap::new(),
        lost_gpu_ms: 0,
        delivered_gpu_ms: 0,
        preemptions: 0,
        refunded_micro: 0,
        forfeited_micro: 0,
        invariants_ok: true,
        used_samples: Vec::new(),
    };
    sim.setup(run.rules);
    let by_id: BTreeMap<u64, TraceJob> = trace.iter().map(|j| (j.job, j.clone())).collect();
    let end_arrivals = T0_MS + (hours * 3_600_000.0) as u64;
    let warmup = T0_MS + 10 * 60_000;
    let mut next = 0;
    // Per tier: org → GPU-ms received while backlogged; org → steps backlogged.
    let mut received: BTreeMap<u64, u64> = BTreeMap::new();
    let mut backlogged: BTreeMap<u64, u64> = BTreeMap::new();
    let mut window_steps = 0u64;
    // Per tier: overload-window steps it was backlogged, and those of them in which it
    // held at least its floor of the fleet's GPUs (not starved).
    let mut tier_backlogged = [0u64; 3];
    let mut tier_floor_met = [0u64; 3];
    let mut tier_floor_committed = [0u64; 3];
    // Per tier: the current and the longest run of steps below the floor, committed
    // GPUs counted.
    let mut starved_run = [0u64; 3];
    let mut starved_max = [0u64; 3];
    let floors: Vec<u64> = sim
        .state
        .config
        .scheduler
        .tiers
        .iter()
        .map(|t| t.floor_pct as u64)
        .collect();
    let drain_until = end_arrivals + 3_600_000;
    while sim.now < drain_until {
        sim.now += STEP_MS;
        let mut reqs = sim.agents(&by_id);
        if let Some(a) = scaler.as_deref_mut() {
            reqs.extend(a.step(&mut sim));
        }
        while next < trace.len() && T0_MS + trace[next].t_ms <= sim.now {
            let r = sim.submit(&trace[next]);
            reqs.push(r);
            next += 1;
        }
        sim.apply(reqs);
        if sim.index.is_multiple_of(240) && check_invariants(&sim.state).is_err() {
            sim.invariants_ok = false;
        }
        let s = &sim.state.scheduler;
        if sim.now > warmup && sim.now <= end_arrivals {
            sim.used_samples
                .push((s.used_gpus as u64, s.fleet_gpus as u64));
            window_steps += 1;
            let committed = gpus_committed(s);
            for t in 0..3u8 {
                let i = t as usize;
                let mut starved = false;
                if s.queue.get(&Tier(t)).is_some_and(|q| !q.is_empty()) {
                    tier_backlogged[i] += 1;
                    let floor = s.fleet_gpus as u64 * floors.get(i).copied().unwrap_or(0) / 100;
                    let held = s.tier_gpus.get(&Tier(t)).copied().unwrap_or(0) as u64;
                    if held >= floor {
                        tier_floor_met[i] += 1;
                    }
                    // The floor promises the tier its demand up to the floor: what it
                    // holds plus what it has queued, at most the floor.
                    let queued: u64 = s
                        .by_age
                        .get(&Tier(t))
                        .into_iter()
                        .flatten()
                        .filter_map(|(_, k)| s.jobs.get(k))
                        .map(|j| j.spec.gpus as u64)
                        .sum();
                    if held + committed[i] >= floor.min(held + queued) {
                        tier_floor_committed[i] += 1;
                    } else {
                        starved = true;
                    }
                }
                starved_run[i] = if starved { starved_run[i] + 1 } else { 0 };
                starved_max[i] = starved_max[i].max(starved_run[i]);
            }
            for (tier, orgs) in &s.queue {
                let _ = tier;
                for org in orgs.keys() {
                    *backlogged.entry(org.0).or_default() += 1;
                    let running = s.running_org.get(org).copied().unwrap_or(0) as u64;
                    *received.entry(org.0).or_default() += running * STEP_MS;
                }
            }
        }
        if sim.now > end_arrivals && s.by_age.is_empty() && s.used_gpus == 0 {
            break;
        }
    }
    sim.invariants_ok &= check_invariants(&sim.state).is_ok();
    let s = &sim.state.scheduler;
    let (used, fleet) = sim
        .used_samples
        .iter()
        .fold((0u64, 0u64), |a, (u, f)| (a.0 + u, a.1 + f));
    let names = ["free", "paid", "enterprise", "enterprise w/o flood org"];
    let flood_org = org_id(2, 0);
    let mut tiers = Vec::new();
    for group in 0..4u8 {
        let tier = group.min(2);
        let jobs: Vec<&TraceJob> = trace
            .iter()
            .filter(|j| j.tier == tier && (group < 3 || j.org != flood_org))
            .collect();
        let (mut waits, mut jcts, mut placed, mut shed) = (Vec::new(), Vec::new(), 0, 0);
        let mut sized = Vec::new();
        for tj in &jobs {
            let Some(j) = s.jobs.get(&(OrgId(tj.org), JobId(tj.job))) else {
                shed += 1;
                continue;
            };
            match j.waits_ms.first() {
                Some(w) => {
                    waits.push(*w);
                    sized.push((tj.gpus, *w, true));
                    placed += 1;
                }
                None => {
                    // Never placed: censored wait.
                    waits.push(sim.now - j.submitted_ms);
                    sized.push((tj.gpus, sim.now - j.submitted_ms, false));
                }
            }
            if j.state == JobState::Succeeded {
                jcts.push(j.finished_ms.unwrap_or(sim.now) - j.submitted_ms);
            }
        }
        // Jain's index over the tier's orgs that were backlogged ≥ 80% of the window,
        // on the GPUs each received per step while backlogged.
        let x: Vec<f64> = (0..ORGS_PER_TIER[tier as usize])
            .map(|k| org_id(tier, k))
            .filter(|o| group < 3 || *o != flood_org)
            .filter(|o| backlogged.get(o).copied().unwrap_or(0) * 5 >= window_steps * 4)
            // GPU share per backlogged step: orgs backlogged for different spans are
            // compared at the rate they were served while they wanted more.
            .map(|o| {
                received.get(&o).copied().unwrap_or(0) as f64
                    / backlogged.get(&o).copied().unwrap_or(1).max(1) as f64
            })
            .collect();
        tiers.push(TierFigures {
            tier: names[group as usize],
            jobs: jobs.len(),
            placed,
            shed,
            wait_p50_s: pct(&mut waits, 0.50),
            wait_p95_s: pct(&mut waits, 0.95),
            wait_p99_s: pct(&mut waits, 0.99),
            wait_max_s: pct(&mut waits, 1.0),
            jct_p50_s: pct(&mut jcts, 0.50),
            jain_index: jain(&x),
            backlogged_orgs: x.len(),
            backlogged_pct: 100.0 * tier_backlogged[tier as usize] as f64
                / window_steps.max(1) as f64,
            floor_met_pct: 100.0 * tier_floor_met[tier as usize] as f64
                / tier_backlogged[tier as usize].max(1) as f64,
            floor_committed_pct: 100.0 * tier_floor_committed[tier as usize] as f64
                / tier_backlogged[tier as usize].max(1) as f64,
            starved_max_s: (starved_max[tier as usize] * STEP_MS) as f64 / 1000.0,
            by_gpus: by_size(&sized),
        });
    }
    let micro = |m: u128| m as f64 / 1e6;
    Figures {
        policy: run.label(),
        jobs: trace.len(),
        allocation_pct: 100.0 * used as f64 / fleet.max(1) as f64,
        tiers,
        preemptions: sim.preemptions,
        gpu_hours_delivered: sim.delivered_gpu_ms as f64 / 3.6e6,
        gpu_hours_lost: sim.lost_gpu_ms as f64 / 3.6e6,
        gpu_hours_lost_pct: 100.0 * sim.lost_gpu_ms as f64 / sim.delivered_gpu_ms.max(1) as f64,
        credits_charged: micro(sim.state.ledger.totals.consumed),
        credits_refunded: micro(sim.refunded_micro as u128),
        credits_forfeited: micro(sim.forfeited_micro as u128),
        invariants_ok: sim.invariants_ok,
        entries: sim.index,
        autoscale: scaler.map(|a| a.figures(sim.now)),
    }
}

/// One column per policy; the columns as wide as the widest figure, so five policies
/// fit side by side.
fn print_table(all: &[Figures]) {
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |label: &str, f: &dyn Fn(&Figures) -> String| {
        rows.push((label.to_string(), all.iter().map(f).collect()));
    };
    row("policy", &|f| f.policy.clone());
    for (label, cell) in autoscale_rows(all) {
        row(label, &|f| f.autoscale.as_ref().map_or(String::new(), cell));
    }
    row("jobs", &|f| f.jobs.to_string());
    row("GPU allocation % (overload window)", &|f| {
        format!("{:.1}", f.allocation_pct)
    });
    for t in 0..all[0].tiers.len() {
        let name = match all[0].tiers[t].tier {
            "enterprise w/o flood org" => "ent. w/o flood org",
            name => name,
        };
        row(&format!("{name}: wait p50 / p95 s"), &|f| {
            format!(
                "{:.0} / {:.0}",
                f.tiers[t].wait_p50_s, f.tiers[t].wait_p95_s
            )
        });
        row(&format!("{name}: wait p99 / max s"), &|f| {
            format!(
                "{:.0} / {:.0}",
                f.tiers[t].wait_p99_s, f.tiers[t].wait_max_s
            )
        });
        row(&format!("{name}: JCT p50 s"), &|f| {
            format!("{:.0}", f.tiers[t].jct_p50_s)
        });
        row(&format!("{name}: Jain (backlogged orgs)"), &|f| {
            format!(
                "{:.3} ({})",
                f.tiers[t].jain_index, f.tiers[t].backlogged_orgs
            )
        });
        row(&format!("{name}: backlogged % / floor held %"), &|f| {
            format!(
                "{:.0} / {:.1}",
                f.tiers[t].backlogged_pct, f.tiers[t].floor_met_pct
            )
        });
        row(
            &format!("{name}: floor held % of demand, committed GPUs counted / starved max s"),
            &|f| {
                format!(
                    "{:.1} / {:.0}",
                    f.tiers[t].floor_committed_pct, f.tiers[t].starved_max_s
                )
            },
        );
        row(&format!("{name}: placed / shed / jobs"), &|f| {
            format!(
                "{}/{}/{}",
                f.tiers[t].placed, f.tiers[t].shed, f.tiers[t].jobs
            )
        });
        for (k, g) in SIZES.iter().enumerate() {
            row(&format!("{name}: {g}-GPU admission p50/p95/max s"), &|f| {
                let b = &f.tiers[t].by_gpus[k];
                format!(
                    "{:.0}/{:.0}/{:.0}",
                    b.wait_p50_s, b.wait_p95_s, b.wait_max_s
                )
            });
        }
    }
    row("preemptions", &|f| f.preemptions.to_string());
    row("GPU-h delivered / lost", &|f| {
        format!("{:.0} / {:.1}", f.gpu_hours_delivered, f.gpu_hours_lost)
    });
    row("GPU-h lost % of delivered", &|f| {
        format!("{:.2}", f.gpu_hours_lost_pct)
    });
    row("credits charged / refunded", &|f| {
        format!("{:.0} / {:.0}", f.credits_charged, f.credits_refunded)
    });
    row("invariants", &|f| {
        if f.invariants_ok {
            "ok".into()
        } else {
            "VIOLATED".into()
        }
    });
    let label_w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let cell_w = rows
        .iter()
        .flat_map(|(_, cells)| cells.iter().map(|c| c.len()))
        .max()
        .unwrap_or(0)
        + 2;
    for (label, cells) in &rows {
        print!("{label:<label_w$}");
        for c in cells {
            print!("{c:>cell_w$}");
        }
        println!();
    }
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("allot-sim: {e}");
            std::process::exit(2);
        }
    };
    let trace = match &args.trace_in {
        Some(path) => match load(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("allot-sim: cannot load {path}: {e}");
                std::process::exit(2);
            }
        },
        None => generate(&args),
    };
    if let Some(path) = &args.trace_out {
        if let Err(e) = save(path, &trace) {
            eprintln!("allot-sim: cannot write {path}: {e}");
            std::process::exit(2);
        }
    }
    let hours = trace.last().map_or(args.hours, |j| {
        (j.t_ms as f64 / 3_600_000.0).max(args.hours.min(j.t_ms as f64 / 3_600_000.0 + 0.01))
    });
    if !args.json {
        eprintln!(
            "allot-sim: seed {} · {} jobs over {:.1} h · fleet {} nodes × {} GPUs (half A100, half H100) · load {:.2}× capacity · {}% whole-node jobs · enterprise flood {} jobs at min(1 h, a quarter of the trace)",
            args.seed, trace.len(), hours, NODES, GPUS_PER_NODE, args.load, args.big_jobs_pct, args.flood
        );
    }
    let all: Vec<Figures> = if args.autoscale.is_empty() {
        args.policies
            .iter()
            .map(|p| simulate(*p, &trace, hours))
            .collect()
    } else {
        autoscale_runs(&args, &trace, hours)
    };
    if args.json {
        for f in &all {
            println!("{}", serde_json::to_string(f).unwrap_or_default());
        }
    } else {
        print_table(&all);
    }
    if all.iter().any(|f| !f.invariants_ok) {
        std::process::exit(1);
    }
}

fn load(path: &str) -> Result<Vec<TraceJob>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", n + 1))?);
    }
    out.sort_by_key(|j: &TraceJob| (j.t_ms, j.job));
    Ok(out)
}

fn save(path: &str, trace: &[TraceJob]) -> Result<(), String> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| e.to_string())?);
    for j in trace {
        writeln!(
            f,
            "{}",
            serde_json::to_string(j).map_err(|e| e.to_string())?
        )
        .map_err(|e| e.to_string())?;
    }
    f.flush().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the floor measure counts as committed to a tier: on a node reserved for a
    /// queued enterprise job, the free GPUs and those of the victims preempted for it,
    /// at most the job's GPUs; nothing before the preemption.
    #[test]
    fn committed_gpus_are_the_reserved_nodes_free_and_preempting_slots() {
        use allot_statemachine::testkit::{credits, Harness, PROJECT};
        for (gpus, committed) in [(8, 8), (4, 4)] {
            let mut config = Config::default();
            config.scheduler.node_lease_ms = 30 * 86_400_000;
            config.scheduler.job_lease_ms = 30 * 86_400_000;
            config.scheduler.preemption_loss_max_gpu_ms = u64::MAX;
            let mut h = Harness::world_with(config);
            h.grant(
                1,
                Account::Project(PROJECT),
                BucketKind::Paid,
                credits(100_000),
                None,
            );
            h.fleet(&[(1, a100(), 8, 80)]);
            h.nodes_alive();
            let mut victim = Harness::job_spec(10, Tier::FREE, vec![a100()], 6);
            victim.checkpointable = true;
            assert!(h.run(Command::SubmitJob(victim)).is_ok());
            h.advance(5 * 60_000);
            h.nodes_alive();
            h.job_heartbeat(10, 1, 0).unwrap();
            assert_eq!(gpus_committed(&h.state.scheduler), [0, 0, 0]);
            let ent = Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], gpus);
            assert!(h.run(Command::SubmitJob(ent)).is_ok());
            assert_eq!(h.job(10).state, JobState::Preempting, "{gpus} GPUs");
            assert_eq!(h.job(20).state, JobState::Queued, "{gpus} GPUs");
            assert_eq!(
                gpus_committed(&h.state.scheduler),
                [0, 0, committed],
                "{gpus} GPUs"
            );
        }
    }

    fn args(flags: &[&str]) -> Result<Args, String> {
        parse_from(flags.iter().map(|s| s.to_string()))
    }

    fn sizes(trace: &[TraceJob]) -> BTreeMap<u32, usize> {
        let mut n = BTreeMap::new();
        for j in trace {
            *n.entry(j.gpus).or_default() += 1;
        }
        n
    }

    #[test]
    fn the_default_trace_draws_as_the_original_did() {
        // The original draw, inline: one `below(10)` into [1,1,1,1,2,2,2,4,4,8].
        let mut a = Rng(7);
        let mut b = Rng(7);
        for _ in 0..10_000 {
            let original = [1, 1, 1, 1, 2, 2, 2, 4, 4, 8][a.below(10) as usize];
            assert_eq!(job_gpus(&mut b, 10), original);
        }
    }

    #[test]
    fn big_jobs_set_the_share_of_whole_node_jobs() {
        for pct in [0u64, 30, 100] {
            let a = args(&[
                "--hours",
                "2",
                "--big-jobs",
                &pct.to_string(),
                "--flood",
                "0",
            ])
            .unwrap();
            let trace = generate(&a);
            let n = sizes(&trace);
            let big = n.get(&8).copied().unwrap_or(0) as f64 / trace.len() as f64;
            assert!(
                (big - pct as f64 / 100.0).abs() < 0.02,
                "{pct}%: {big} of {} ({n:?})",
                trace.len()
            );
            // Only the four sizes; 1:2:4 stay 4:3:2 among the rest.
            assert!(n.keys().all(|g| SIZES.contains(g)), "{n:?}");
            if pct < 100 {
                let ones = n[&1] as f64;
                assert!((n[&4] as f64 / ones - 0.5).abs() < 0.1, "{n:?}");
            }
        }
        // The arrival rate follows the mean size: the offered GPU load stays the same.
        let gpu_work = |pct: &str| {
            let a = args(&["--hours", "4", "--big-jobs", pct, "--flood", "0"]).unwrap();
            generate(&a)
                .iter()
                .map(|j| j.gpus as f64 * j.work_ms as f64)
                .sum::<f64>()
        };
        let (ten, thirty) = (gpu_work("10"), gpu_work("30"));
        assert!((thirty / ten - 1.0).abs() < 0.1, "{ten} vs {thirty}");
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        for bad in [
            vec!["--big-jobs", "101"],
            vec!["--big-jobs", "x"],
            vec!["--big-jobs"],
            vec!["--load", "0"],
            vec!["--policies", "slurm?"],
            vec!["--bogus"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(args(&["--help"]).err().as_deref(), Some(USAGE));
        assert_eq!(args(&[]).unwrap().big_jobs_pct, 10);
        // Every policy by name; all six by default, in the table's order: Fair under this
        // release's rules, then under rules 1.
        let all: Vec<Run> = POLICIES.iter().map(|(_, r)| *r).collect();
        assert_eq!(all[0], Run::new(Policy::Fair));
        assert_eq!((all[1].policy, all[1].rules), (Policy::Fair, 1));
        assert_eq!(
            (all[0].label(), all[1].label()),
            ("Fair".into(), "Fair-v1".into())
        );
        assert_eq!(args(&[]).unwrap().policies, all);
        let named = args(&["--policies", "fair,fair-v1,strict,fifo,slurm,kueue"]).unwrap();
        assert_eq!(named.policies, all);
        let two = args(&["--policies", "kueue,slurm"]).unwrap();
        assert_eq!(
            two.policies,
            vec![Run::new(Policy::KueueLike), Run::new(Policy::SlurmLike)]
        );
        for bad in ["slurm,", "Slurm", "kueue,bogus"] {
            assert!(args(&["--policies", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn admission_times_are_reported_per_size_censored_included() {
        let waits = [
            (1, 1_000, true),
            (1, 3_000, true),
            (8, 60_000, true),
            (8, 900_000, false),
        ];
        let f = by_size(&waits);
        assert_eq!(f.iter().map(|x| x.gpus).collect::<Vec<_>>(), SIZES);
        assert_eq!((f[0].jobs, f[0].placed), (2, 2));
        assert_eq!(f[0].wait_max_s, 3.0);
        assert_eq!((f[1].jobs, f[1].placed, f[1].wait_p50_s), (0, 0, 0.0));
        assert_eq!((f[3].jobs, f[3].placed), (2, 1));
        assert_eq!(
            f[3].wait_max_s, 900.0,
            "a job never placed counts as waiting"
        );
    }
}

// ================================================================ autoscaling (DESIGN §52)
//
// `--autoscale DELAY_MIN[,DELAY_MIN...]`: the same trace and policies (Fair unless
// `--policies` names others), once on the fixed fleet and once per provisioning delay
// with a simulated autoscaler. Every step it reads the shard's demand signal
// (`Query::Demand`) and orders, per GPU type, the nodes that cover the most GPUs any
// tier needs, less the nodes already on order; an ordered node registers `delay`
// minutes later. An added node left without a job for `SCALE_DOWN_IDLE_MS` while its
// type needs nothing is drained and its agent stops (the node lapses, then goes down:
// there is no deregistration command, and a later order of the type re-registers it).

/// Added nodes have the initial fleet's shape.
const ADDED_NODE_GPUS: u32 = GPUS_PER_NODE;
const ADDED_NODE_MEM_GB: u32 = 80;
/// The most nodes up or on order at once: twice the initial fleet.
const AUTOSCALE_NODES_MAX: u64 = 2 * NODES;
/// An added node idle this long, while its type needs no GPUs, is released.
const SCALE_DOWN_IDLE_MS: u64 = 10 * 60_000;
/// Added nodes' ids (the initial fleet is 1..=NODES).
const ADDED_NODE_ID_BASE: u64 = 1_001;
/// Bounds of `--autoscale`: delays in minutes, and how many.
const AUTOSCALE_DELAY_MIN_MAX: u64 = 1_440;
const AUTOSCALE_DELAYS_MAX: usize = 16;

/// `--autoscale`'s value: distinct whole minutes, 0..=1440, at most 16.
fn parse_delays(s: &str) -> Result<Vec<u64>, String> {
    let mut out: Vec<u64> = Vec::new();
    for part in s.split(',') {
        let d: u64 = part
            .trim()
            .parse()
            .map_err(|_| format!("--autoscale: {part:?} is not a whole number of minutes"))?;
        if d > AUTOSCALE_DELAY_MIN_MAX {
            return Err(format!(
                "--autoscale: {d} minutes is more than {AUTOSCALE_DELAY_MIN_MAX}"
            ));
        }
        if out.contains(&d) {
            return Err(format!("--autoscale: {d} is listed twice"));
        }
        out.push(d);
    }
    if out.len() > AUTOSCALE_DELAYS_MAX {
        return Err(format!(
            "--autoscale: at most {AUTOSCALE_DELAYS_MAX} delays"
        ));
    }
    Ok(out)
}

/// `--autoscale-run-pct`'s value: 1..=100.
fn parse_run_pct(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(p @ 1..=100) => Ok(p),
        _ => Err(format!(
            "--autoscale-run-pct: {s:?} is not a percentage from 1 to 100"
        )),
    }
}

/// The share of its max duration the trace's jobs run (GPU-weighted, percent, rounded
/// up): the estimate an operator reads off past jobs, which the autoscaler passes to the
/// demand query unless `--autoscale-run-pct` says otherwise.
fn trace_run_pct(trace: &[TraceJob]) -> u32 {
    let (work, bound) = trace.iter().fold((0u128, 0u128), |(w, b), j| {
        let g = u128::from(j.gpus);
        (
            w + g * u128::from(j.work_ms.min(j.max_duration_ms)),
            b + g * u128::from(j.max_duration_ms),
        )
    });
    match bound {
        0 => 100,
        b => ((work * 100).div_ceil(b)).clamp(1, 100) as u32,
    }
}

/// One node the autoscaler ordered (its id is reused once the node is down).
#[derive(Clone, Debug)]
struct AddedNode {
    gpu_type: GpuType,
    ordered_ms: u64,
    /// Order + delay: not registered before.
    ready_ms: u64,
    registered_ms: Option<u64>,
    /// Since when it has had no job (registered and not released).
    idle_since_ms: Option<u64>,
    released_ms: Option<u64>,
}

/// The simulated autoscaler and the cloud it orders from.
struct Autoscaler {
    /// `None`: the fixed fleet (nothing is ordered; figures for reference).
    delay_ms: Option<u64>,
    run_pct: u32,
    nodes: BTreeMap<u64, AddedNode>,
    /// (node, ordered, registered) of every registration, for the mode's tests.
    registrations: Vec<(u64, u64, u64)>,
    ordered: u64,
    registered: u64,
    released: u64,
    /// GPU-ms paid for added nodes already released.
    released_gpu_ms: u128,
    /// Most nodes up (not down) at once.
    peak_nodes: u64,
    /// Breaches of the mode's invariants seen in the state: more nodes up than the
    /// maximum, an added node up before its delay passed or after its release, a node
    /// the autoscaler did not order.
    violations: u64,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
struct AutoscaleFigures {
    /// Provisioning delay in minutes; `None`: the fixed fleet.
    delay_min: Option<u64>,
    /// The `run_pct` of the autoscaler's demand queries.
    run_pct: u32,
    nodes_max: u64,
    nodes_ordered: u64,
    /// Registrations (a node released and ordered again counts again).
    nodes_added: u64,
    nodes_released: u64,
    peak_nodes: u64,
    /// GPU-hours paid over the run: the initial fleet from the start, each added node
    /// from its order (provisioning is paid) to its release or the run's end.
    gpu_hours_provisioned: f64,
    gpu_hours_added: f64,
    violations: u64,
}

impl Autoscaler {
    fn new(delay_min: Option<u64>, run_pct: u32) -> Autoscaler {
        Autoscaler {
            delay_ms: delay_min.map(|m| m * 60_000),
            run_pct,
            nodes: BTreeMap::new(),
            registrations: Vec::new(),
            ordered: 0,
            registered: 0,
            released: 0,
            released_gpu_ms: 0,
            peak_nodes: 0,
            violations: 0,
        }
    }

    /// One step, before the step's entry: check the mode's invariants on the state,
    /// order what the demand signal asks for, register the nodes whose delay has passed,
    /// release idle ones, heartbeat the rest. Returns the step's requests.
    fn step(&mut self, sim: &mut Sim) -> Vec<Request> {
        let now = sim.now;
        self.check(&sim.state.scheduler);
        let Some(delay_ms) = self.delay_ms else {
            return Vec::new();
        };
        let q = query::Query::Demand(query::DemandQuery {
            run_pct: self.run_pct,
        });
        let demand = match query::answer(&sim.state, &q) {
            query::Answer::Demand(rows) => rows,
            _ => Vec::new(),
        };
        let mut cmds: Vec<(Actor, Command)> = Vec::new();
        self.order(&sim.state.scheduler, &demand, now, delay_ms);
        self.register_due(now, &mut cmds);
        self.release_idle(&sim.state.scheduler, &demand, now, &mut cmds);
        for (id, n) in &self.nodes {
            if n.registered_ms.is_some() && n.released_ms.is_none() {
                let node = NodeId(*id);
                cmds.push((Actor::Agent(node), Command::NodeHeartbeat { node }));
            }
        }
        cmds.into_iter().map(|(a, c)| sim.req(a, c)).collect()
    }

    /// Whether an added node is gone: released, and down in the state.
    fn gone(s: &scheduler::Scheduler, id: u64, n: &AddedNode) -> bool {
        n.released_ms.is_some()
            && s.node(NodeId(id))
                .is_none_or(|x| x.state == scheduler::NodeState::Down)
    }

    /// Nodes up or on order: the initial fleet and the added nodes not gone.
    fn occupied(&self, s: &scheduler::Scheduler) -> u64 {
        let added = self
            .nodes
            .iter()
            .filter(|(id, n)| !Self::gone(s, **id, n))
            .count() as u64;
        NODES + added
    }

    /// Per type, nodes for the most GPUs any tier needs, less those on order; one
    /// node per type in turn (by type) while the maximum leaves room.
    fn order(
        &mut self,
        s: &scheduler::Scheduler,
        demand: &[query::TypeDemand],
        now: u64,
        delay_ms: u64,
    ) {
        let mut want: Vec<(GpuType, u64)> = demand
            .iter()
            .map(|r| {
                let gpus = r.tiers.iter().map(|t| t.gpus_needed).max().unwrap_or(0);
                let nodes = u64::from(gpus.div_ceil(ADDED_NODE_GPUS));
                (
                    r.gpu_type.clone(),
                    nodes.saturating_sub(self.pending(&r.gpu_type)),
                )
            })
            .collect();
        let mut room = AUTOSCALE_NODES_MAX.saturating_sub(self.occupied(s));
        while room > 0 && want.iter().any(|(_, n)| *n > 0) {
            for (t, n) in want.iter_mut() {
                if *n > 0 && room > 0 {
                    self.order_one(s, t.clone(), now, now + delay_ms);
                    *n -= 1;
                    room -= 1;
                }
            }
        }
    }

    /// Nodes of this type ordered and not registered yet.
    fn pending(&self, t: &GpuType) -> u64 {
        self.nodes
            .values()
            .filter(|n| &n.gpu_type == t && n.registered_ms.is_none())
            .count() as u64
    }

    /// Orders a node: a gone node of the type is ordered again under its id, else a new
    /// id is taken.
    fn order_one(&mut self, s: &scheduler::Scheduler, t: GpuType, now: u64, ready_ms: u64) {
        let reuse = self
            .nodes
            .iter()
            .find(|(id, n)| n.gpu_type == t && Self::gone(s, **id, n))
            .map(|(id, _)| *id);
        let id = reuse.unwrap_or(ADDED_NODE_ID_BASE + self.nodes.len() as u64);
        if let Some(old) = self.nodes.get(&id) {
            self.released_gpu_ms += Self::paid_ms(old, now);
        }
        self.nodes.insert(
            id,
            AddedNode {
                gpu_type: t,
                ordered_ms: now,
                ready_ms,
                registered_ms: None,
                idle_since_ms: None,
                released_ms: None,
            },
        );
        self.ordered += 1;
    }

    /// GPU-ms paid for a node from its order to its release (or `end`).
    fn paid_ms(n: &AddedNode, end: u64) -> u128 {
        let until = n.released_ms.unwrap_or(end);
        u128::from(ADDED_NODE_GPUS) * u128::from(until.saturating_sub(n.ordered_ms))
    }

    fn register_due(&mut self, now: u64, cmds: &mut Vec<(Actor, Command)>) {
        for (id, n) in self.nodes.iter_mut() {
            if n.registered_ms.is_none() && n.ready_ms <= now {
                cmds.push((
                    ADMIN,
                    Command::RegisterNode(NodeSpec {
                        node: NodeId(*id),
                        gpu_type: n.gpu_type.clone(),
                        gpu_count: ADDED_NODE_GPUS,
                        gpu_mem_gb: ADDED_NODE_MEM_GB,
                        labels: vec![],
                        incarnation: 0,
                    }),
                ));
                n.registered_ms = Some(now);
                n.idle_since_ms = Some(now);
                self.registered += 1;
                self.registrations.push((*id, n.ordered_ms, now));
            }
        }
    }

    /// Drains (and stops the agent of) each added node idle for the cool-down while its
    /// type needs no GPUs and has none on order.
    fn release_idle(
        &mut self,
        s: &scheduler::Scheduler,
        demand: &[query::TypeDemand],
        now: u64,
        cmds: &mut Vec<(Actor, Command)>,
    ) {
        let quiet: Vec<GpuType> = demand
            .iter()
            .filter(|r| r.tiers.iter().all(|t| t.gpus_needed == 0))
            .map(|r| r.gpu_type.clone())
            .filter(|t| self.pending(t) == 0)
            .collect();
        for (id, n) in self.nodes.iter_mut() {
            if n.registered_ms.is_none() || n.released_ms.is_some() {
                continue;
            }
            let idle = s
                .node(NodeId(*id))
                .is_some_and(|x| x.slots.iter().all(Option::is_none) && x.reserved_for.is_none());
            if !idle {
                n.idle_since_ms = None;
                continue;
            }
            let since = *n.idle_since_ms.get_or_insert(now);
            if now >= since + SCALE_DOWN_IDLE_MS && quiet.contains(&n.gpu_type) {
                cmds.push((
                    ADMIN,
                    Command::SetNodeDraining {
                        node: NodeId(*id),
                        draining: true,
                    },
                ));
                n.released_ms = Some(now);
                self.released += 1;
            }
        }
    }

    /// The mode's invariants, on the state before the step's entry.
    fn check(&mut self, s: &scheduler::Scheduler) {
        use scheduler::NodeState;
        let up = s
            .nodes
            .values()
            .filter(|n| n.state != NodeState::Down)
            .count() as u64;
        self.peak_nodes = self.peak_nodes.max(up);
        if up > AUTOSCALE_NODES_MAX {
            self.violations += 1;
        }
        for (id, x) in s.nodes.iter() {
            if id.0 <= NODES || x.state == NodeState::Down {
                continue;
            }
            let ok = self.nodes.get(&id.0).is_some_and(|n| {
                n.registered_ms.is_some_and(|r| r >= n.ready_ms)
                    && (n.released_ms.is_none() || x.state != NodeState::Ready)
            });
            if !ok {
                self.violations += 1;
            }
        }
    }

    fn figures(&self, end: u64) -> AutoscaleFigures {
        let added: u128 = self.released_gpu_ms
            + self
                .nodes
                .values()
                .map(|n| Self::paid_ms(n, end))
                .sum::<u128>();
        let initial = u128::from(NODES) * u128::from(GPUS_PER_NODE) * u128::from(end - T0_MS);
        let hours = |ms: u128| ms as f64 / 3.6e6;
        AutoscaleFigures {
            delay_min: self.delay_ms.map(|d| d / 60_000),
            run_pct: self.run_pct,
            nodes_max: AUTOSCALE_NODES_MAX,
            nodes_ordered: self.ordered,
            nodes_added: self.registered,
            nodes_released: self.released,
            peak_nodes: self.peak_nodes,
            gpu_hours_provisioned: hours(initial + added),
            gpu_hours_added: hours(added),
            violations: self.violations,
        }
    }
}

/// Per policy: the fixed fleet, then one run per provisioning delay.
fn autoscale_runs(args: &Args, trace: &[TraceJob], hours: f64) -> Vec<Figures> {
    let run_pct = args
        .autoscale_run_pct
        .unwrap_or_else(|| trace_run_pct(trace));
    if !args.json {
        eprintln!(
            "allot-sim: autoscaling · provisioning delays {:?} min · demand read every {} s at run_pct {} · +{} GPUs × {} GB per node · at most {} nodes · idle {} min → released",
            args.autoscale,
            STEP_MS / 1_000,
            run_pct,
            ADDED_NODE_GPUS,
            ADDED_NODE_MEM_GB,
            AUTOSCALE_NODES_MAX,
            SCALE_DOWN_IDLE_MS / 60_000
        );
    }
    let mut all = Vec::new();
    for p in &args.policies {
        let delays = std::iter::once(None).chain(args.autoscale.iter().map(|d| Some(*d)));
        for delay in delays {
            all.push(autoscaled(*p, trace, hours, delay, run_pct).0);
        }
    }
    all
}

/// One run with the autoscaler (`delay_min` `None`: the fixed fleet); a breach of the
/// mode's invariants fails the run like any other invariant.
fn autoscaled(
    run: Run,
    trace: &[TraceJob],
    hours: f64,
    delay_min: Option<u64>,
    run_pct: u32,
) -> (Figures, Autoscaler) {
    let mut a = Autoscaler::new(delay_min, run_pct);
    let mut f = simulate_with(run, trace, hours, Some(&mut a));
    f.invariants_ok &= a.violations == 0;
    (f, a)
}

/// The table's autoscaling rows (none without `--autoscale`).
type AutoscaleCell = fn(&AutoscaleFigures) -> String;

fn autoscale_rows(all: &[Figures]) -> Vec<(&'static str, AutoscaleCell)> {
    if all.iter().all(|f| f.autoscale.is_none()) {
        return Vec::new();
    }
    vec![
        ("autoscale: provisioning delay", |a| {
            a.delay_min
                .map_or("fixed fleet".into(), |d| format!("{d} min"))
        }),
        ("autoscale: nodes ordered / added / released", |a| {
            format!("{}/{}/{}", a.nodes_ordered, a.nodes_added, a.nodes_released)
        }),
        ("autoscale: peak nodes (max)", |a| {
            format!("{} ({})", a.peak_nodes, a.nodes_max)
        }),
        ("autoscale: GPU-h provisioned (added)", |a| {
            format!("{:.0} ({:.0})", a.gpu_hours_provisioned, a.gpu_hours_added)
        }),
    ]
}

#[cfg(test)]
mod autoscale_tests {
    use super::*;

    fn args(flags: &[&str]) -> Result<Args, String> {
        parse_from(flags.iter().map(|s| s.to_string()))
    }

    #[test]
    fn autoscale_flags_parse_and_bad_values_are_usage_errors() {
        let a = args(&["--autoscale", "0,5,15,30"]).unwrap();
        assert_eq!(a.autoscale, vec![0, 5, 15, 30]);
        assert_eq!(
            a.policies,
            vec![Run::new(Policy::Fair)],
            "Fair unless --policies"
        );
        assert_eq!(a.autoscale_run_pct, None);
        let a = args(&["--policies", "fifo", "--autoscale", "10"]).unwrap();
        assert_eq!(a.policies, vec![Run::new(Policy::Fifo)]);
        let a = args(&["--autoscale", "10", "--policies", "fifo,fair"]).unwrap();
        assert_eq!(
            a.policies,
            vec![Run::new(Policy::Fifo), Run::new(Policy::Fair)]
        );
        let a = args(&["--autoscale", "1440", "--autoscale-run-pct", "25"]).unwrap();
        assert_eq!((a.autoscale, a.autoscale_run_pct), (vec![1440], Some(25)));
        assert!(args(&[]).unwrap().autoscale.is_empty(), "off by default");
        for bad in [
            vec!["--autoscale"],
            vec!["--autoscale", ""],
            vec!["--autoscale", "5,"],
            vec!["--autoscale", ",5"],
            vec!["--autoscale", "-5"],
            vec!["--autoscale", "2.5"],
            vec!["--autoscale", "five"],
            vec!["--autoscale", "1441"],
            vec!["--autoscale", "5,5"],
            vec!["--autoscale", "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"],
            vec!["--autoscale", "5", "--autoscale-run-pct", "0"],
            vec!["--autoscale", "5", "--autoscale-run-pct", "101"],
            vec!["--autoscale", "5", "--autoscale-run-pct", "x"],
            vec!["--autoscale-run-pct", "50"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_trace_run_pct_is_the_share_of_the_bound_jobs_run() {
        let job = |gpus, work_ms, max_duration_ms| TraceJob {
            t_ms: 0,
            job: 1,
            org: 100,
            tier: 0,
            gpu_types: vec!["A100".into()],
            gpus,
            mem_floor_gb: 40,
            preemptible: true,
            checkpointable: true,
            max_duration_ms,
            work_ms,
        };
        // GPU-weighted: 8 × 10 + 1 × 100 of 8 × 100 + 1 × 100 = 180 / 900.
        assert_eq!(trace_run_pct(&[job(8, 10, 100), job(1, 100, 100)]), 20);
        assert_eq!(trace_run_pct(&[job(1, 1, 1_000)]), 1, "rounded up");
        assert_eq!(trace_run_pct(&[]), 100);
    }

    /// A short overloaded trace (1.6× the fleet, no flood).
    fn short_trace() -> (Vec<TraceJob>, f64) {
        let a = args(&["--hours", "0.75", "--flood", "0"]).unwrap();
        (generate(&a), a.hours)
    }

    #[test]
    fn autoscaled_nodes_come_only_after_the_delay_and_never_beyond_the_maximum() {
        let (trace, hours) = short_trace();
        let run_pct = trace_run_pct(&trace);
        let (f, a) = autoscaled(Run::new(Policy::Fair), &trace, hours, Some(10), run_pct);
        let fig = f.autoscale.clone().expect("autoscale figures");
        assert!(f.invariants_ok, "{fig:?}");
        assert_eq!(fig.violations, 0);
        assert!(fig.nodes_added > 0, "an overloaded fleet grows: {fig:?}");
        assert!(fig.peak_nodes <= AUTOSCALE_NODES_MAX, "{fig:?}");
        assert!(fig.peak_nodes > NODES, "{fig:?}");
        for (node, ordered, registered) in &a.registrations {
            assert!(
                registered - ordered >= 10 * 60_000,
                "node {node} registered {} ms after its order",
                registered - ordered
            );
        }
        // Added capacity is paid: more GPU-hours than the fixed fleet over the same span.
        assert!(fig.gpu_hours_added > 0.0);
        let fixed = autoscaled(Run::new(Policy::Fair), &trace, hours, None, run_pct).0;
        let fixed_fig = fixed.autoscale.expect("reference figures");
        assert_eq!(
            (
                fixed_fig.nodes_ordered,
                fixed_fig.peak_nodes,
                fixed_fig.gpu_hours_added
            ),
            (0, NODES, 0.0)
        );
        assert!(fixed.invariants_ok);
    }

    #[test]
    fn the_autoscaled_run_is_deterministic_for_a_seed() {
        let (trace, hours) = short_trace();
        let run = || {
            let (f, a) = autoscaled(Run::new(Policy::Fair), &trace, hours, Some(0), 20);
            (
                serde_json::to_string(&f).expect("figures serialise"),
                a.registrations,
            )
        };
        let (first, regs) = run();
        assert!(!regs.is_empty());
        assert_eq!(run(), (first, regs));
    }
}
