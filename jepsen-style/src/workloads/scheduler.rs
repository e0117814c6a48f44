//! scheduler: two GPU nodes (4 × A100 each) driven by simulated agents (node
//! heartbeats, linearizable assignment reads, job heartbeats with the attempt as the
//! fencing token, finishes; a preempting job is stopped), submitters of jobs in three
//! tiers (free-tier jobs are preemptible, so higher tiers preempt them), occasional
//! cancels, and a monitor reading every job. Checkers: no GPU held by two placed jobs
//! in any one read; no heartbeat of an older attempt accepted after a newer attempt's
//! was; every acknowledged submit present at the end; every finished job settled
//! exactly once (one final transition in the audit trail, nothing captured after it).

use super::*;
use crate::history::{pairs, Op};
use allot_statemachine::query::JobFilter;
use allot_statemachine::testkit::{a100, PROJECT, PROJECT_B, USER, USER_B};
use allot_statemachine::{EventBody, JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, Tier};
use std::collections::{BTreeMap, HashMap};

pub const GPU_NODES: [u64; 2] = [1, 2];

pub async fn setup(client: &Client) -> anyhow::Result<()> {
    let mut cmds = funded_world();
    for n in GPU_NODES {
        cmds.push(Command::RegisterNode(NodeSpec {
            node: NodeId(n),
            gpu_type: a100(),
            gpu_count: 4,
            gpu_mem_gb: 80,
            labels: vec![],
            incarnation: 0,
        }));
    }
    super::setup(client, cmds).await
}

pub fn spawn(ctx: Arc<Ctx>, processes: u32, rng: &mut Rng) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for n in GPU_NODES {
        let (ctx, r) = (ctx.clone(), rng.fork(100 + n));
        tasks.push(tokio::spawn(agent(ctx, n, r)));
    }
    for p in 0..processes.max(1) {
        let (ctx, r) = (ctx.clone(), rng.fork(p as u64));
        tasks.push(tokio::spawn(submitter(ctx, p as i64, r)));
    }
    tasks
}

fn assignments_json(a: &Answer) -> Value {
    match a {
        Answer::Assignments { rows: list, .. } => json!(list
            .iter()
            .map(|(j, att, gpus, st)| json!([j.0, att, gpus, format!("{st:?}")]))
            .collect::<Vec<_>>()),
        other => json!(format!("{other:?}")),
    }
}

async fn agent(ctx: Arc<Ctx>, node: u64, mut rng: Rng) {
    let client = ctx.client();
    let p = 100 + node as i64;
    let stream = 2000 + node;
    let mut n = 0u64;
    let mut seqs: HashMap<(u64, u32), (u64, Instant, Duration)> = HashMap::new();
    while !ctx.done() {
        n += 1;
        let req = admin_req(
            rid(stream, n),
            Command::NodeHeartbeat { node: NodeId(node) },
        );
        run_op(
            &ctx,
            &client,
            p,
            "node-heartbeat",
            json!({"node": node}),
            &req,
            |_| json!(null),
        )
        .await;
        let q = Query::Assignments(NodeId(node));
        let got = read_op(
            &ctx,
            &client,
            p,
            "assignments",
            json!({"node": node}),
            &q,
            assignments_json,
        )
        .await;
        if let Some(Answer::Assignments { rows: list, .. }) = got {
            for ((_, job), attempt, _, state) in list {
                use allot_statemachine::scheduler::JobState as S;
                let key = (job.0, attempt);
                let entry = seqs.entry(key).or_insert_with(|| {
                    (
                        0,
                        Instant::now(),
                        Duration::from_millis(rng.range(1000, 3000)),
                    )
                });
                entry.0 += 1;
                let (seq, started, planned) = *entry;
                n += 1;
                let (f, cmd, v) = match state {
                    S::Preempting => (
                        "finish",
                        Command::FinishJob {
                            job,
                            attempt,
                            success: false,
                        },
                        json!({"job": job.0, "attempt": attempt, "success": false}),
                    ),
                    S::Placed | S::Running if started.elapsed() >= planned => (
                        "finish",
                        Command::FinishJob {
                            job,
                            attempt,
                            success: true,
                        },
                        json!({"job": job.0, "attempt": attempt, "success": true}),
                    ),
                    S::Placed | S::Running => (
                        "job-heartbeat",
                        Command::JobHeartbeat(JobHeartbeat {
                            job,
                            attempt,
                            seq,
                            progress_ppm: 0,
                            checkpoint: 0,
                        }),
                        json!({"job": job.0, "attempt": attempt, "seq": seq}),
                    ),
                    _ => continue,
                };
                let req = admin_req(rid(stream, n), cmd);
                run_op(&ctx, &client, p, f, v, &req, |r| match r {
                    Reply::JobHeartbeat(h) => json!({"accepted": h.accepted}),
                    _ => json!({"accepted": true}),
                })
                .await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(200, 400))).await;
    }
}

async fn submitter(ctx: Arc<Ctx>, p: i64, mut rng: Rng) {
    let client = ctx.client();
    let stream = 1000 + p as u64;
    let mut n = 0u64;
    let mut submitted: Vec<u64> = Vec::new();
    while !ctx.done() {
        n += 1;
        let roll = rng.below(100);
        if roll < 45 {
            let job = 40_000_000 + (p as u64) * 1_000_000 + n;
            let tier = Tier(rng.below(3) as u8);
            let gpus = rng.range(1, 4) as u32;
            let spec = JobSpec {
                job: JobId(job),
                project: if rng.chance(50) { PROJECT } else { PROJECT_B },
                user: if rng.chance(50) { USER } else { USER_B },
                tier,
                gpu_types: vec![a100()],
                gpus,
                mem_floor_gb: 0,
                preemptible: tier == Tier::FREE,
                checkpointable: true,
                max_duration_ms: 600_000,
            };
            let req = admin_req(rid(stream, n), Command::SubmitJob(spec));
            let v = json!({"job": job, "gpus": gpus, "tier": tier.0});
            if let Res::Ok(_) = run_op(&ctx, &client, p, "submit", v, &req, |_| json!(null)).await {
                submitted.push(job);
            }
        } else if roll < 55 && !submitted.is_empty() {
            let job = *rng.pick(&submitted);
            let req = admin_req(rid(stream, n), Command::CancelJob { job: JobId(job) });
            run_op(
                &ctx,
                &client,
                p,
                "cancel",
                json!({"job": job}),
                &req,
                |_| json!(null),
            )
            .await;
        } else {
            let q = Query::Jobs(JobFilter {
                limit: 1000,
                ..Default::default()
            });
            read_op(&ctx, &client, p, "jobs", json!({}), &q, |a| match a {
                Answer::Jobs(page) => json!(page
                    .jobs
                    .iter()
                    .filter_map(|j| j.placement.as_ref().map(|pl| json!([
                        j.spec.job.0,
                        j.attempt,
                        pl.node.0,
                        pl.gpu_indices,
                        format!("{:?}", j.state)
                    ])))
                    .collect::<Vec<_>>()),
                other => json!(format!("{other:?}")),
            })
            .await;
        }
        tokio::time::sleep(Duration::from_millis(rng.range(100, 300))).await;
    }
}

pub async fn final_read(client: &Client) -> anyhow::Result<Value> {
    let mut jobs = serde_json::Map::new();
    let mut after = None;
    for _ in 0..1000 {
        let q = Query::Jobs(JobFilter {
            after,
            limit: 1000,
            ..Default::default()
        });
        match client.query(SHARD, &q).await {
            Ok(Answer::Jobs(page)) => {
                for j in &page.jobs {
                    jobs.insert(
                        j.spec.job.0.to_string(),
                        json!([format!("{:?}", j.state), j.attempt, j.state.is_final()]),
                    );
                }
                match page.next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            other => anyhow::bail!("final jobs read: {other:?}"),
        }
    }
    let (events, head) = audit_all(client).await?;
    let mut finals: BTreeMap<u64, u64> = BTreeMap::new();
    let mut late_captures: Vec<Value> = Vec::new();
    for e in &events {
        match &e.body {
            EventBody::JobTransition { job, to, .. } if to.is_final() => {
                *finals.entry(job.0).or_default() += 1;
            }
            EventBody::Captured { amount_micro, .. } => {
                if let Some(h) = e.hold {
                    if finals.get(&h.0).copied().unwrap_or(0) > 0 {
                        late_captures
                            .push(json!({"job": h.0, "seq": e.seq, "amount": amount_micro}));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(
        json!({"jobs": jobs, "final_transitions": finals, "late_captures": late_captures,
              "audit_events": events.len(), "audit_seq_gap": seq_gap(&events, head)}),
    )
}

fn placed(state: &str) -> bool {
    matches!(state, "Placed" | "Running" | "Preempting")
}

pub fn check(ops: &[Op]) -> Vec<Verdict> {
    let ps = pairs(ops);
    let mut out = Vec::new();

    // No GPU twice within any one read.
    let mut reads = 0;
    let mut bad = None;
    for p in ps.iter().filter(|p| p.kind() == OpType::Ok) {
        let d = p.done.unwrap();
        let node = u(&p.invoke.value, "node");
        let rows = match p.invoke.f.as_str() {
            "assignments" | "jobs" => d.value["answer"].as_array().cloned().unwrap_or_default(),
            _ => continue,
        };
        reads += 1;
        let mut used: HashMap<(u64, u64), u64> = HashMap::new();
        for r in rows {
            let (job, gpus, state, n) = if p.invoke.f == "assignments" {
                (
                    r[0].as_u64().unwrap_or(0),
                    r[2].clone(),
                    r[3].as_str().unwrap_or("").to_string(),
                    node,
                )
            } else {
                (
                    r[0].as_u64().unwrap_or(0),
                    r[3].clone(),
                    r[4].as_str().unwrap_or("").to_string(),
                    r[2].as_u64().unwrap_or(0),
                )
            };
            if !placed(&state) {
                continue;
            }
            for g in gpus.as_array().cloned().unwrap_or_default() {
                let g = g.as_u64().unwrap_or(0);
                if let Some(other) = used.insert((n, g), job) {
                    bad.get_or_insert(format!(
                        "op {}: GPU {g} of node {n} held by jobs {other} and {job} at once",
                        p.invoke.index
                    ));
                }
            }
        }
    }
    out.push(Verdict::from(
        "scheduler/no-gpu-allocated-twice",
        bad,
        format!("{reads} ok assignment and job reads"),
    ));

    // Fencing: an older attempt's heartbeat is never accepted after a newer one's.
    let mut newest: HashMap<u64, (u32, u64)> = HashMap::new(); // job → (attempt, done index)
    let mut accepted: Vec<(u64, u32, u64, u64)> = Vec::new(); // job, attempt, invoke, done
    for p in ps
        .iter()
        .filter(|p| p.kind() == OpType::Ok && p.invoke.f == "job-heartbeat")
    {
        let d = p.done.unwrap();
        if d.value["reply"]["accepted"].as_bool() == Some(true) {
            accepted.push((
                u(&p.invoke.value, "job"),
                u(&p.invoke.value, "attempt") as u32,
                p.invoke.index,
                d.index,
            ));
        }
    }
    let mut bad = None;
    let mut by_done = accepted.clone();
    by_done.sort_by_key(|a| a.3);
    for (job, attempt, _, done) in &by_done {
        let e = newest.entry(*job).or_insert((*attempt, *done));
        if *attempt > e.0 {
            *e = (*attempt, *done);
        }
    }
    for (job, attempt, invoke, _) in &accepted {
        // A newer attempt acknowledged before this (older) one was even invoked.
        for (j2, a2, _, d2) in &by_done {
            if j2 == job && a2 > attempt && d2 < invoke {
                bad.get_or_insert(format!(
                    "job {job}: attempt {attempt}'s heartbeat (op {invoke}) accepted after attempt {a2}'s (completed at op {d2})"
                ));
                break;
            }
        }
    }
    out.push(Verdict::from(
        "scheduler/no-job-running-under-two-attempts",
        bad,
        format!("{} accepted job heartbeats", accepted.len()),
    ));

    let Some(fin) = final_value(ops) else {
        out.push(Verdict::fail(
            "scheduler/final",
            "no final read in the history",
        ));
        return out;
    };
    let jobs = fin["jobs"].as_object().cloned().unwrap_or_default();
    let acked: Vec<u64> = ps
        .iter()
        .filter(|p| p.invoke.f == "submit" && p.kind() == OpType::Ok)
        .map(|p| u(&p.invoke.value, "job"))
        .collect();
    let missing = acked.iter().find(|j| !jobs.contains_key(&j.to_string()));
    out.push(Verdict::from(
        "scheduler/every-acknowledged-submit-present",
        missing.map(|j| format!("job {j} was acknowledged but is missing at the end")),
        format!(
            "{} acknowledged submits, {} jobs at the end",
            acked.len(),
            jobs.len()
        ),
    ));

    out.push(gap_verdict(fin));
    let finals = fin["final_transitions"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let mut bad = None;
    let mut settled = 0;
    for (id, j) in &jobs {
        let is_final = j[2].as_bool().unwrap_or(false);
        let count = finals.get(id).and_then(Value::as_u64).unwrap_or(0);
        settled += is_final as u64;
        if (is_final && count != 1) || (!is_final && count != 0) {
            bad.get_or_insert(format!("job {id} ({}) has {count} final transitions", j[0]));
        }
    }
    if let Some(l) = fin["late_captures"].as_array().and_then(|a| a.first()) {
        bad.get_or_insert(format!("a capture after the job was settled: {l}"));
    }
    out.push(Verdict::from(
        "scheduler/every-settled-job-charged-once",
        bad,
        format!("{settled} settled jobs"),
    ));
    out
}
