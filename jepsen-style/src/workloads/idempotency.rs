//! idempotency: every logical operation has one request id, and is sent again with the
//! same id — after a timeout (until its fate is known) and, often, once more after it
//! succeeded, across whatever fault is active. Operations: create a hold, capture from
//! it (the reply carries the amount still held, so a second application answers
//! differently), transfer between two projects, release. Checkers: every attempt of an
//! id that got an answer got the first answer; in the audit trail each id was applied
//! (not replayed) at most once, and every acknowledged id exactly once; the transferred
//! total counts each logical transfer once.

use super::*;
use crate::history::{pairs, Op};
use allot_statemachine::testkit::{PROJECT, PROJECT_B, USER};
use allot_statemachine::{Account, EventBody, HoldId, HoldSpec, Tier};
use std::collections::BTreeMap;

const STREAM_BASE: u64 = 1000;

pub async fn setup(client: &Client) -> anyhow::Result<()> {
    let cmds = funded_world();
    super::setup(client, cmds).await
}

async fn attempt(
    ctx: &Ctx,
    client: &Client,
    p: i64,
    f: &str,
    base: &Value,
    n: u32,
    req: &Request,
) -> Res {
    let mut v = base.clone();
    v["attempt"] = json!(n);
    ctx.history.invoke(p, f, v.clone());
    let (res, outcome) = exec(client, req).await;
    if let Some(o) = &outcome {
        v["outcome"] = json!(format!("{o:?}"));
    }
    complete(ctx, p, f, v, &res, |_| json!(null));
    res
}

pub async fn process(ctx: Arc<Ctx>, p: i64, mut rng: Rng) {
    let client = ctx.client();
    let stream = STREAM_BASE + p as u64;
    let mut n = 0u64;
    let mut hold: Option<HoldId> = None;
    let mut holds = 0u64;
    while !ctx.done() {
        n += 1;
        let id = rid(stream, n);
        let (f, command, amount) = match (hold, rng.below(10)) {
            (None, _) => {
                holds += 1;
                let h = HoldId(30_000_000 + (p as u64) * 1_000_000 + holds);
                hold = Some(h);
                (
                    "hold",
                    Command::CreateHold(HoldSpec {
                        hold: h,
                        project: PROJECT,
                        user: USER,
                        tier: Tier::PAID,
                        gpu_types: vec![],
                        amount_micro: 50_000_000,
                    }),
                    0,
                )
            }
            (Some(h), 0..=4) => (
                "capture",
                Command::Capture {
                    hold: h,
                    amount_micro: 100_000,
                },
                100_000,
            ),
            (Some(_), 5..=8) => {
                let (from, to) = if rng.chance(50) {
                    (PROJECT, PROJECT_B)
                } else {
                    (PROJECT_B, PROJECT)
                };
                (
                    "transfer",
                    Command::Transfer {
                        from: Account::Project(from),
                        to: Account::Project(to),
                        amount_micro: 1_000_000,
                    },
                    1_000_000,
                )
            }
            (Some(h), _) => {
                hold = None;
                ("release", Command::ReleaseHold { hold: h }, 0)
            }
        };
        let req = admin_req(id, command);
        let base = json!({"rid": id.to_string(), "amount": amount});
        let mut k = 1;
        let mut res = attempt(&ctx, &client, p, f, &base, k, &req).await;
        // Unknown fate: resend with the same id until known (bounded).
        while matches!(res, Res::Info(_)) && k < 6 {
            tokio::time::sleep(Duration::from_millis(rng.range(200, 1000))).await;
            k += 1;
            res = attempt(&ctx, &client, p, f, &base, k, &req).await;
        }
        // Often send it once more after it was answered, maybe across a fault.
        if rng.chance(40) {
            tokio::time::sleep(Duration::from_millis(rng.range(0, 600))).await;
            k += 1;
            attempt(&ctx, &client, p, f, &base, k, &req).await;
        }
        pace(&mut rng).await;
    }
}

pub async fn final_read(client: &Client) -> anyhow::Result<Value> {
    let (events, head) = audit_all(client).await?;
    let mut applied: BTreeMap<String, u64> = BTreeMap::new();
    let mut replays = 0u64;
    for e in &events {
        if let EventBody::Command { replayed, .. } = &e.body {
            if (e.request_id >> 64) as u64 >= STREAM_BASE {
                if *replayed {
                    replays += 1;
                } else {
                    *applied.entry(e.request_id.to_string()).or_default() += 1;
                }
            }
        }
    }
    let totals = match client.query(SHARD, &Query::Totals).await {
        Ok(Answer::Totals(t)) => json!({"moved": t.moved as u64, "consumed": t.consumed as u64}),
        other => anyhow::bail!("final totals: {other:?}"),
    };
    Ok(
        json!({"applied": applied, "replays": replays, "totals": totals,
              "audit_events": events.len(), "audit_seq_gap": seq_gap(&events, head)}),
    )
}

pub fn check(ops: &[Op]) -> Vec<Verdict> {
    let ps = pairs(ops);
    let mut out = Vec::new();
    // Attempts of each id that got an answer (ok or a typed refusal).
    let mut first: BTreeMap<String, (String, u64)> = BTreeMap::new();
    let mut answered = 0;
    let mut bad = None;
    let mut ok_ids: BTreeMap<String, (&str, u64)> = BTreeMap::new();
    let mut info_ids: BTreeMap<String, (&str, u64)> = BTreeMap::new();
    for p in &ps {
        let Some(d) = p.done else { continue };
        let rid = p.invoke.value["rid"].as_str().unwrap_or("").to_string();
        if rid.is_empty() {
            continue;
        }
        let amount = u(&p.invoke.value, "amount");
        match d.kind {
            OpType::Ok => {
                ok_ids.insert(rid.clone(), (p.invoke.f.as_str(), amount));
            }
            OpType::Info => {
                info_ids.insert(rid.clone(), (p.invoke.f.as_str(), amount));
            }
            _ => {}
        }
        let Some(o) = d.value.get("outcome").and_then(Value::as_str) else {
            continue;
        };
        answered += 1;
        match first.get(&rid) {
            None => {
                first.insert(rid, (o.to_string(), d.index));
            }
            Some((f0, i0)) if f0 != o && bad.is_none() => {
                bad = Some(format!(
                    "request id {rid} ({}): first answer (op {i0}) {f0}, a retry (op {}) got {o}",
                    p.invoke.f, d.index
                ));
            }
            _ => {}
        }
    }
    out.push(Verdict::from(
        "idempotency/every-retry-gets-the-first-outcome",
        bad,
        format!(
            "{answered} answered attempts of {} request ids",
            first.len()
        ),
    ));

    let Some(fin) = final_value(ops) else {
        out.push(Verdict::fail(
            "idempotency/final",
            "no final read in the history",
        ));
        return out;
    };
    out.push(gap_verdict(fin));
    let applied = fin["applied"].as_object().cloned().unwrap_or_default();
    let mut bad = applied
        .iter()
        .find(|(_, c)| c.as_u64().unwrap_or(0) > 1)
        .map(|(id, c)| format!("request id {id} applied {c} times (audit trail)"));
    if bad.is_none() {
        bad = ok_ids
            .keys()
            .find(|id| !applied.contains_key(*id))
            .map(|id| format!("request id {id} was acknowledged but never applied"));
    }
    out.push(Verdict::from(
        "idempotency/each-id-applied-at-most-once",
        bad,
        format!(
            "{} ids applied, {} replays answered from the table",
            applied.len(),
            u(fin, "replays")
        ),
    ));

    let moved = u(&fin["totals"], "moved") as u128;
    let lo: u128 = ok_ids
        .values()
        .filter(|(f, _)| *f == "transfer")
        .map(|(_, a)| *a as u128)
        .sum();
    let hi: u128 = lo
        + info_ids
            .iter()
            .filter(|(id, (f, _))| *f == "transfer" && !ok_ids.contains_key(*id))
            .map(|(_, (_, a))| *a as u128)
            .sum::<u128>();
    out.push(Verdict::from(
        "idempotency/transfers-counted-once",
        (!(lo <= moved && moved <= hi)).then(|| {
            format!("moved {moved} outside [{lo}, {hi}] (one amount per distinct transfer id)")
        }),
        format!("moved {moved} within [{lo}, {hi}]"),
    ));
    out
}
