//! `bench`: a closed-loop load generator. It sets up its own org, project, user and a
//! paid grant, then runs workers that each send one operation at a time (create a hold,
//! capture from one, release one, or read the balance, by the --mix weights) for the
//! duration, and reports throughput and latency percentiles.

use crate::connect::{fresh_id, Ctx};
use crate::output::{show, Table};
use crate::values;
use allot_client::{Client, Error};
use allot_statemachine::{
    Account, BucketId, BucketKind, CommandError, Grant, HoldId, HoldSpec, OrgId, ProjectId, Tier,
    UserId,
};
use anyhow::Context;
use clap::Args;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Concurrent closed-loop workers.
    #[arg(long, default_value_t = 16)]
    concurrency: u32,
    /// How long to run.
    #[arg(long, default_value = "10s", value_parser = values::duration)]
    duration: Duration,
    /// Operation weights: hold (create a hold), capture (from an open hold), release (an
    /// open hold), balance (a linearizable read).
    #[arg(long, default_value = "hold=1,capture=1,release=1", value_parser = values::mix)]
    mix: values::Mix,
    /// Org to use (created if missing; default: a fresh one).
    #[arg(long)]
    org: Option<u64>,
    /// Credits per hold.
    #[arg(long, default_value = "1", value_parser = values::credits)]
    hold_amount: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Hold,
    Capture,
    Release,
    Balance,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Hold => "hold",
            Op::Capture => "capture",
            Op::Release => "release",
            Op::Balance => "balance",
        }
    }
}

/// What the workers share.
struct Shared {
    client: Client,
    org: OrgId,
    project: ProjectId,
    user: UserId,
    hold_amount: u64,
    weights: Vec<(Op, u32)>,
    /// Hold ids: a fresh base plus a counter, unique within the run.
    hold_base: u64,
    next_hold: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
    stop: AtomicBool,
    first_error: std::sync::Mutex<Option<String>>,
}

/// One worker's results.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    per_op: [u64; 4],
}

pub async fn run(ctx: &Ctx, a: BenchArgs) -> anyhow::Result<()> {
    if a.concurrency == 0 || a.duration.is_zero() || a.hold_amount < 100 {
        return Err(crate::failure::usage(
            "--concurrency and --duration must be positive, --hold-amount at least 0.0001",
        ));
    }
    let shared = Arc::new(setup(ctx, &a).await?);
    let started = Instant::now();
    let progress = tokio::spawn(progress(shared.clone(), started));
    let mut workers = Vec::new();
    for w in 0..a.concurrency {
        workers.push(tokio::spawn(worker(shared.clone(), w)));
    }
    tokio::time::sleep(a.duration).await;
    shared.stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for w in workers {
        let t = w.await.context("a bench worker panicked")?;
        all.latencies_us.extend(t.latencies_us);
        for i in 0..4 {
            all.per_op[i] += t.per_op[i];
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.abort();
    report(ctx, &a, &shared, all, seconds)
}

async fn setup(ctx: &Ctx, a: &BenchArgs) -> anyhow::Result<Shared> {
    let c = &ctx.client;
    let org = OrgId(a.org.unwrap_or_else(fresh_id));
    let (project, user) = (ProjectId(fresh_id()), UserId(fresh_id()));
    exists_ok(c.create_org(org).await).with_context(|| format!("bench set-up: creating {org}"))?;
    c.create_project(org, project)
        .await
        .context("bench set-up: creating a project")?;
    c.create_user(org, user)
        .await
        .context("bench set-up: creating a user")?;
    let grant = Grant {
        bucket: BucketId(fresh_id()),
        owner: Account::Project(project),
        kind: BucketKind::Paid,
        amount_micro: 1_000_000_000 * 1_000_000,
        expires_at_ms: None,
        priority: 100,
        policy: None,
        source_ref: Some("allotctl bench".into()),
    };
    c.issue_grant(org, grant)
        .await
        .context("bench set-up: funding the project")?;
    let weights = a
        .mix
        .0
        .iter()
        .map(|(k, w)| {
            let op = match k.as_str() {
                "hold" => Op::Hold,
                "capture" => Op::Capture,
                "release" => Op::Release,
                _ => Op::Balance,
            };
            (op, *w)
        })
        .collect();
    eprintln!(
        "bench: org {} project {} ({} workers, {:?})",
        org.0, project.0, a.concurrency, a.duration
    );
    Ok(Shared {
        client: c.clone(),
        org,
        project,
        user,
        hold_amount: a.hold_amount,
        weights,
        hold_base: fresh_id(),
        next_hold: AtomicU64::new(0),
        done: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        first_error: std::sync::Mutex::new(None),
    })
}

fn exists_ok(r: Result<(), Error>) -> Result<(), Error> {
    match r {
        Err(Error::Rejected(CommandError::AlreadyExists)) => Ok(()),
        r => r,
    }
}

async fn progress(s: Arc<Shared>, started: Instant) {
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let done = s.done.load(Ordering::Relaxed);
        eprintln!(
            "bench: {:>5.1}s  {done} ops  {}/s  errors {}",
            started.elapsed().as_secs_f64(),
            done - last,
            s.errors.load(Ordering::Relaxed)
        );
        last = done;
    }
}

/// An open hold of a worker and what is left of it.
struct Open {
    hold: HoldId,
    left: u64,
}

async fn worker(s: Arc<Shared>, w: u32) -> Tally {
    let mut tally = Tally::default();
    let mut rng = Rng((fresh_id() ^ (u64::from(w) << 40)) | 1);
    let mut open: Vec<Open> = Vec::new();
    while !s.stop.load(Ordering::Relaxed) {
        let op = pick(&s.weights, &mut rng, &open);
        let id = s.hold_base + s.next_hold.fetch_add(1, Ordering::Relaxed);
        let t = Instant::now();
        let r = step(&s, op, &mut open, id, &mut rng).await;
        tally.latencies_us.push(t.elapsed().as_micros() as u64);
        tally.per_op[op as usize] += 1;
        s.done.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = r {
            s.errors.fetch_add(1, Ordering::Relaxed);
            let mut first = s.first_error.lock().unwrap_or_else(|p| p.into_inner());
            first.get_or_insert_with(|| e.to_string());
        }
    }
    for o in open {
        let _ = s.client.release_hold(s.org, o.hold).await;
    }
    tally
}

/// The next operation by weight; one that needs an open hold creates one instead, and
/// a worker with many open holds releases one.
fn pick(weights: &[(Op, u32)], rng: &mut Rng, open: &[Open]) -> Op {
    let total: u64 = weights.iter().map(|(_, w)| u64::from(*w)).sum();
    let mut x = rng.next() % total.max(1);
    let mut op = Op::Hold;
    for (o, w) in weights {
        if x < u64::from(*w) {
            op = *o;
            break;
        }
        x -= u64::from(*w);
    }
    match op {
        Op::Capture | Op::Release if open.is_empty() => Op::Hold,
        Op::Hold if open.len() >= 8 => Op::Release,
        op => op,
    }
}

async fn step(
    s: &Shared,
    op: Op,
    open: &mut Vec<Open>,
    id: u64,
    rng: &mut Rng,
) -> Result<(), Error> {
    let c = &s.client;
    match op {
        Op::Hold => {
            let spec = HoldSpec {
                hold: HoldId(id),
                project: s.project,
                user: s.user,
                tier: Tier::PAID,
                gpu_types: vec![],
                amount_micro: s.hold_amount,
            };
            c.create_hold(s.org, spec).await?;
            open.push(Open {
                hold: HoldId(id),
                left: s.hold_amount,
            });
        }
        Op::Capture => {
            let i = (rng.next() % open.len() as u64) as usize;
            let amount = s.hold_amount / 100;
            if open[i].left < amount {
                let o = open.swap_remove(i);
                c.release_hold(s.org, o.hold).await?;
            } else {
                open[i].left -= amount;
                c.capture(s.org, open[i].hold, amount).await?;
            }
        }
        Op::Release => {
            let i = (rng.next() % open.len() as u64) as usize;
            let o = open.swap_remove(i);
            c.release_hold(s.org, o.hold).await?;
        }
        Op::Balance => {
            c.balance(s.org, Account::Project(s.project), 0).await?;
        }
    }
    Ok(())
}

/// xorshift64: enough to spread operations; no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

fn percentile_ms(sorted_us: &[u64], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted_us.len() as f64).ceil() as usize;
    sorted_us[rank.clamp(1, sorted_us.len()) - 1] as f64 / 1_000.0
}

fn report(ctx: &Ctx, a: &BenchArgs, s: &Shared, mut t: Tally, seconds: f64) -> anyhow::Result<()> {
    t.latencies_us.sort_unstable();
    let ops = t.latencies_us.len() as u64;
    let errors = s.errors.load(Ordering::Relaxed);
    let l = &t.latencies_us;
    let per_s = if seconds > 0.0 {
        ops as f64 / seconds
    } else {
        0.0
    };
    let round = |v: f64| (v * 1_000.0).round() / 1_000.0;
    let per_op: serde_json::Map<String, serde_json::Value> =
        [Op::Hold, Op::Capture, Op::Release, Op::Balance]
            .iter()
            .map(|o| (o.name().to_string(), t.per_op[*o as usize].into()))
            .collect();
    let json = serde_json::json!({
        "commands": ops,
        "errors": errors,
        "seconds": round(seconds),
        "commands_per_s": round(per_s),
        "p50_ms": percentile_ms(l, 50.0),
        "p90_ms": percentile_ms(l, 90.0),
        "p99_ms": percentile_ms(l, 99.0),
        "max_ms": percentile_ms(l, 100.0),
        "concurrency": a.concurrency,
        "per_op": per_op,
        "org": s.org.0,
        "first_error": s.first_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
    });
    let table = Table::fields([
        ("operations", ops.to_string()),
        ("errors", errors.to_string()),
        ("seconds", format!("{seconds:.2}")),
        ("operations/s", format!("{per_s:.0}")),
        ("p50 ms", format!("{:.2}", percentile_ms(l, 50.0))),
        ("p90 ms", format!("{:.2}", percentile_ms(l, 90.0))),
        ("p99 ms", format!("{:.2}", percentile_ms(l, 99.0))),
        ("max ms", format!("{:.2}", percentile_ms(l, 100.0))),
    ]);
    show(ctx.format, &json, &[table])
}
