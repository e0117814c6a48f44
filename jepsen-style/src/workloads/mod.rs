//! Workloads: each has a set-up, a generator run by concurrent client processes, a
//! final read after the faults are healed, and checkers over the history.

pub mod bank;
pub mod idempotency;
pub mod register;
pub mod scheduler;

use crate::history::{History, OpType};
use crate::rng::Rng;
use crate::Verdict;
use allot_client::{Client, Error};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::AuditEvent;
use allot_statemachine::{Command, Outcome, Reply, Request, RequestId};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const SHARD: u32 = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    LedgerBank,
    Idempotency,
    Scheduler,
    Register,
}

impl Workload {
    pub const ALL: [Workload; 4] = [
        Workload::LedgerBank,
        Workload::Idempotency,
        Workload::Scheduler,
        Workload::Register,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::LedgerBank => "ledger-bank",
            Workload::Idempotency => "idempotency",
            Workload::Scheduler => "scheduler",
            Workload::Register => "register",
        }
    }
}

/// What every client process shares.
pub struct Ctx {
    pub history: Arc<History>,
    /// Endpoints of every node (clients dial nodes directly).
    pub endpoints: Vec<String>,
    pub deadline: Instant,
}

impl Ctx {
    /// A client for one process: bounded retries (same request id on every retry)
    /// within `timeout`; after that the operation is recorded as `info`.
    pub fn client(&self) -> Client {
        Client::builder()
            .endpoints(self.endpoints.clone())
            .timeout(Duration::from_secs(4))
            .attempt_timeout(Duration::from_millis(1500))
            .retries(30)
            .backoff(Duration::from_millis(20), Duration::from_millis(300))
            .shards(1)
            .build()
            .expect("loopback endpoints are valid")
    }

    pub fn done(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// A client whose final reads wait out slow recoveries.
pub fn patient_client(endpoints: Vec<String>) -> Client {
    Client::builder()
        .endpoints(endpoints)
        .timeout(Duration::from_secs(30))
        .attempt_timeout(Duration::from_secs(3))
        .retries(u32::MAX)
        .build()
        .expect("loopback endpoints are valid")
}

/// A request of the operator, in the org of the standard world its ids are in.
pub fn admin_req(request_id: RequestId, command: Command) -> Request {
    Request {
        actor: allot_statemachine::testkit::ADMIN,
        request_id,
        org: allot_statemachine::testkit::fixture_org(&command),
        command,
    }
}

/// Request ids: `(stream << 64) | n`; stream 0 is set-up, stream `1000 + p` process p.
pub fn rid(stream: u64, n: u64) -> RequestId {
    ((stream as u128) << 64) | n as u128
}

/// The result of one command as the history records it.
pub enum Res {
    Ok(Reply),
    /// Applied and refused (nothing changed), or refused before proposing.
    Fail(String),
    /// Unknown: timed out, unreachable.
    Info(String),
}

/// Whether a client error leaves the operation's fate unknown.
pub fn indeterminate(e: &Error) -> bool {
    !matches!(
        e,
        Error::Rejected(_)
            | Error::InvalidArgument(_)
            | Error::NotFound(_)
            | Error::Unauthenticated(_)
            | Error::PermissionDenied(_)
            | Error::Config(_)
    )
}

pub async fn exec(client: &Client, req: &Request) -> (Res, Option<Outcome>) {
    match client.execute(SHARD, std::slice::from_ref(req)).await {
        Ok((mut outs, _)) => match outs.pop() {
            Some(Ok(r)) => (Res::Ok(r.clone()), Some(Ok(r))),
            Some(Err(e)) => (Res::Fail(format!("{e:?}")), Some(Err(e))),
            None => (Res::Info("no outcome".into()), None),
        },
        Err(e) if indeterminate(&e) => (Res::Info(e.to_string()), None),
        Err(e) => (Res::Fail(e.to_string()), None),
    }
}

/// Invokes, executes and completes one command in the history. Returns the result;
/// `value` is the invocation's value, `reply_value` turns an ok reply into the
/// completion's value.
pub async fn run_op(
    ctx: &Ctx,
    client: &Client,
    process: i64,
    f: &str,
    value: Value,
    req: &Request,
    reply_value: impl FnOnce(&Reply) -> Value,
) -> Res {
    ctx.history.invoke(process, f, value.clone());
    let (res, _) = exec(client, req).await;
    complete(ctx, process, f, value, &res, reply_value);
    res
}

pub fn complete(
    ctx: &Ctx,
    process: i64,
    f: &str,
    value: Value,
    res: &Res,
    reply_value: impl FnOnce(&Reply) -> Value,
) {
    match res {
        Res::Ok(r) => {
            let mut v = value;
            v["reply"] = reply_value(r);
            ctx.history.record(process, OpType::Ok, f, v, None, None)
        }
        Res::Fail(e) => ctx
            .history
            .record(process, OpType::Fail, f, value, None, Some(e.clone())),
        Res::Info(e) => ctx
            .history
            .record(process, OpType::Info, f, value, None, Some(e.clone())),
    };
}

/// A linearizable query recorded as a read operation.
pub async fn read_op(
    ctx: &Ctx,
    client: &Client,
    process: i64,
    f: &str,
    value: Value,
    q: &Query,
    answer_value: impl FnOnce(&Answer) -> Value,
) -> Option<Answer> {
    ctx.history.invoke(process, f, value.clone());
    match client.query(SHARD, q).await {
        Ok(a) => {
            let mut v = value;
            v["answer"] = answer_value(&a);
            ctx.history.record(process, OpType::Ok, f, v, None, None);
            Some(a)
        }
        Err(e) => {
            let kind = if indeterminate(&e) {
                OpType::Info
            } else {
                OpType::Fail
            };
            ctx.history
                .record(process, kind, f, value, None, Some(e.to_string()));
            None
        }
    }
}

/// The standard world with a large paid grant on projects 11 and 12 (the idempotency
/// and scheduler workloads' starting point).
pub fn funded_world() -> Vec<Command> {
    use allot_statemachine::testkit::{world_commands, PROJECT, PROJECT_B};
    use allot_statemachine::{Account, BucketId, BucketKind, Grant};
    let mut cmds = world_commands();
    for (i, p) in [PROJECT, PROJECT_B].iter().enumerate() {
        cmds.push(Command::IssueGrant(Grant {
            bucket: BucketId(i as u64 + 1),
            owner: Account::Project(*p),
            kind: BucketKind::Paid,
            amount_micro: 1_000_000_000_000,
            expires_at_ms: None,
            priority: 100,
            policy: None,
            source_ref: None,
        }));
    }
    cmds
}

/// Runs the set-up commands (alone, no faults), failing on any refusal.
pub async fn setup(client: &Client, commands: Vec<Command>) -> anyhow::Result<()> {
    let reqs: Vec<Request> = commands
        .into_iter()
        .enumerate()
        .map(|(i, c)| admin_req(rid(0, i as u64 + 1), c))
        .collect();
    for chunk in reqs.chunks(64) {
        let (outs, _) = client
            .execute(SHARD, chunk)
            .await
            .map_err(|e| anyhow::anyhow!("set-up: {e}"))?;
        for (o, r) in outs.iter().zip(chunk) {
            if let Err(e) = o {
                anyhow::bail!("set-up command {} refused: {e}", r.command.name());
            }
        }
    }
    Ok(())
}

/// The whole audit trail of the shard (after the faults), and the chain's head as
/// the serving node reports it (the sequence number the next event will get).
/// The head is read first, and the export reads until it (pages may come from
/// replicas at different points: the export never stops at a lagging one's head).
pub async fn audit_all(client: &Client) -> anyhow::Result<(Vec<AuditEvent>, u64)> {
    let head = client
        .audit(SHARD, Default::default(), 0, 1)
        .await
        .map_err(|e| anyhow::anyhow!("reading the audit head: {e}"))?
        .head_seq;
    let mut events = Vec::new();
    client
        .audit_export_to(SHARD, Default::default(), 0, head, |e| {
            events.push(e.clone());
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("reading the audit trail: {e}"))?;
    Ok((events, head))
}

/// The first break in the audit chain's sequence numbers (events must be numbered
/// 0, 1, 2, … without gaps), if any.
pub fn seq_gap(events: &[AuditEvent], head: u64) -> Option<String> {
    if (events.len() as u64) < head {
        return Some(format!(
            "the trail served ends after {} events but the chain head is at seq {head}",
            events.len()
        ));
    }
    events.iter().enumerate().find_map(|(i, e)| {
        (e.seq != i as u64)
            .then(|| format!("event #{i} has seq {} (log index {})", e.seq, e.log_index))
    })
}

/// Verdict on the gap recorded in a final value's `audit_seq_gap`.
pub fn gap_verdict(fin: &Value) -> Verdict {
    Verdict::from(
        "audit/chain-without-gaps",
        fin["audit_seq_gap"]
            .as_str()
            .map(|g| format!("the audit trail read at the end skips events: {g}")),
        format!("{} events, seq 0..n contiguous", u(fin, "audit_events")),
    )
}

/// Generator entry point: runs `processes` client processes until the deadline.
pub async fn run_clients(ctx: Arc<Ctx>, workload: Workload, processes: u32, rng: &mut Rng) {
    let mut tasks = Vec::new();
    match workload {
        Workload::Scheduler => {
            tasks.extend(scheduler::spawn(ctx.clone(), processes, rng));
        }
        _ => {
            for p in 0..processes {
                let ctx = ctx.clone();
                let prng = rng.fork(p as u64);
                tasks.push(tokio::spawn(async move {
                    match workload {
                        Workload::LedgerBank => bank::process(ctx, p as i64, prng).await,
                        Workload::Idempotency => idempotency::process(ctx, p as i64, prng).await,
                        Workload::Register => register::process(ctx, p as i64, prng).await,
                        Workload::Scheduler => {}
                    }
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

pub async fn set_up(workload: Workload, client: &Client) -> anyhow::Result<()> {
    match workload {
        Workload::LedgerBank => bank::setup(client).await,
        Workload::Idempotency => idempotency::setup(client).await,
        Workload::Scheduler => scheduler::setup(client).await,
        Workload::Register => register::setup(client).await,
    }
}

/// The final read after healing, recorded as an ok `final` op by the control process.
pub async fn final_read(
    workload: Workload,
    client: &Client,
    history: &History,
) -> anyhow::Result<()> {
    let v = match workload {
        Workload::LedgerBank => bank::final_read(client, &history.ops()).await?,
        Workload::Idempotency => idempotency::final_read(client).await?,
        Workload::Scheduler => scheduler::final_read(client).await?,
        Workload::Register => json!({}),
    };
    history.invoke(crate::history::CONTROL, "final", json!({}));
    history.record(crate::history::CONTROL, OpType::Ok, "final", v, None, None);
    Ok(())
}

/// Every checker of the workload over a history.
pub fn check(workload: Workload, ops: &[crate::history::Op]) -> Vec<Verdict> {
    match workload {
        Workload::LedgerBank => bank::check(ops),
        Workload::Idempotency => idempotency::check(ops),
        Workload::Scheduler => scheduler::check(ops),
        Workload::Register => register::check(ops),
    }
}

/// The value of the last ok `final` op.
pub fn final_value(ops: &[crate::history::Op]) -> Option<&Value> {
    ops.iter()
        .rev()
        .find(|o| o.f == "final" && o.kind == OpType::Ok)
        .map(|o| &o.value)
}

pub fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// Sleep a little between operations (bounded op rate on a small machine).
pub async fn pace(rng: &mut Rng) {
    tokio::time::sleep(Duration::from_millis(rng.range(5, 40))).await;
}
