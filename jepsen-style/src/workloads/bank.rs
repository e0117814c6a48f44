//! ledger-bank: grants (some expiring soon), holds with partial captures and releases,
//! and transfers between an org and its two projects, with linearizable balance and
//! totals reads. Checkers: per-account conservation at every ok read; issued totals
//! within what was acknowledged and attempted; at the final read, shard-wide
//! conservation, transfers and captures applied once (totals within the bounds of ok
//! and ok+info operations), no balance wrapped below zero, and no spend of a credit at
//! or after its expiry instant (from the audit trail).

use super::*;
use crate::history::{pairs, Op};
use allot_statemachine::ledger::{Balance, Totals};
use allot_statemachine::testkit::{world_commands, ORG, PROJECT, PROJECT_B, USER};
use allot_statemachine::{
    Account, AuditEvent, BucketId, BucketKind, EventBody, Grant, HoldId, HoldSpec, Tier,
};
use std::collections::BTreeMap;

pub const ACCOUNTS: [Account; 3] = [
    Account::Org(ORG),
    Account::Project(PROJECT),
    Account::Project(PROJECT_B),
];
/// Set-up grants: 1000 credits on each account.
pub const INITIAL_MICRO: u64 = 1_000_000_000;

fn acct_name(a: Account) -> String {
    match a {
        Account::Org(o) => format!("org:{}", o.0),
        Account::Project(p) => format!("project:{}", p.0),
    }
}

fn grant(bucket: u64, owner: Account, amount: u64, expires: Option<u64>) -> Grant {
    Grant {
        bucket: BucketId(bucket),
        owner,
        kind: if expires.is_some() {
            BucketKind::Promotional
        } else {
            BucketKind::Paid
        },
        amount_micro: amount,
        expires_at_ms: expires,
        priority: if expires.is_some() { 10 } else { 100 },
        policy: None,
        source_ref: None,
    }
}

pub async fn setup(client: &Client) -> anyhow::Result<()> {
    let mut cmds = world_commands();
    for (i, a) in ACCOUNTS.iter().enumerate() {
        cmds.push(Command::IssueGrant(grant(
            i as u64 + 1,
            *a,
            INITIAL_MICRO,
            None,
        )));
    }
    super::setup(client, cmds).await
}

fn balance_json(b: &Balance) -> Value {
    json!({
        "available": b.available_micro(),
        "held": b.held_micro,
        "consumed": b.consumed_micro,
        "expired": b.expired_micro,
        "issued": b.issued_micro,
        "moved_in": b.moved_in_micro,
        "moved_out": b.moved_out_micro,
    })
}

fn totals_json(t: &Totals) -> Value {
    json!({
        "issued": t.issued as u64,
        "consumed": t.consumed as u64,
        "expired": t.expired as u64,
        "moved": t.moved as u64,
    })
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub async fn process(ctx: Arc<Ctx>, p: i64, mut rng: Rng) {
    let client = ctx.client();
    let stream = 1000 + p as u64;
    let mut n = 0u64;
    let mut next_id = || {
        n += 1;
        rid(stream, n)
    };
    let mut seq = 0u64;
    while !ctx.done() {
        let roll = rng.below(100);
        if roll < 35 {
            let from = *rng.pick(&ACCOUNTS);
            let to = loop {
                let t = *rng.pick(&ACCOUNTS);
                if t != from {
                    break t;
                }
            };
            let amount = rng.range(1, 20) * 1_000_000;
            let req = admin_req(
                next_id(),
                Command::Transfer {
                    from,
                    to,
                    amount_micro: amount,
                },
            );
            let v = json!({"from": acct_name(from), "to": acct_name(to), "amount": amount});
            run_op(&ctx, &client, p, "transfer", v, &req, |_| {
                json!("transferred")
            })
            .await;
        } else if roll < 50 {
            seq += 1;
            let bucket = 10_000_000 + (p as u64) * 1_000_000 + seq;
            let owner = *rng.pick(&ACCOUNTS);
            let amount = rng.range(1, 10) * 1_000_000;
            let expires = rng.chance(50).then(|| wall_ms() + rng.range(500, 4000));
            let req = admin_req(
                next_id(),
                Command::IssueGrant(grant(bucket, owner, amount, expires)),
            );
            let v = json!({"bucket": bucket, "account": acct_name(owner), "amount": amount,
                           "expires_at_ms": expires});
            run_op(&ctx, &client, p, "grant", v, &req, |_| json!("issued")).await;
        } else if roll < 70 {
            seq += 1;
            let hold = HoldId(20_000_000 + (p as u64) * 1_000_000 + seq);
            let project = if rng.chance(50) { PROJECT } else { PROJECT_B };
            let amount = rng.range(2, 12) * 1_000_000;
            let req = admin_req(
                next_id(),
                Command::CreateHold(HoldSpec {
                    hold,
                    project,
                    user: USER,
                    tier: Tier::PAID,
                    gpu_types: vec![],
                    amount_micro: amount,
                }),
            );
            let v = json!({"hold": hold.0, "project": project.0, "amount": amount});
            let draws = |r: &Reply| match r {
                Reply::HoldCreated { draws, .. } => json!(draws
                    .iter()
                    .map(|d| (d.bucket.0, d.amount_micro))
                    .collect::<Vec<_>>()),
                _ => json!(null),
            };
            if let Res::Ok(_) = run_op(&ctx, &client, p, "hold", v, &req, draws).await {
                let cap = amount / 2;
                let req = admin_req(
                    next_id(),
                    Command::Capture {
                        hold,
                        amount_micro: cap,
                    },
                );
                let v = json!({"hold": hold.0, "amount": cap});
                run_op(&ctx, &client, p, "capture", v, &req, |_| json!("captured")).await;
                let req = admin_req(next_id(), Command::ReleaseHold { hold });
                let v = json!({"hold": hold.0});
                run_op(&ctx, &client, p, "release", v, &req, |_| json!("released")).await;
            }
        } else if roll < 90 {
            let account = *rng.pick(&ACCOUNTS);
            let q = Query::Balance {
                org: ORG,
                account,
                horizon_ms: 0,
            };
            let v = json!({"account": acct_name(account)});
            read_op(&ctx, &client, p, "read", v, &q, |a| match a {
                Answer::Balance(Some(b)) => balance_json(b),
                other => json!(format!("{other:?}")),
            })
            .await;
        } else {
            read_op(
                &ctx,
                &client,
                p,
                "totals",
                json!({}),
                &Query::Totals,
                |a| match a {
                    Answer::Totals(t) => totals_json(t),
                    other => json!(format!("{other:?}")),
                },
            )
            .await;
        }
        pace(&mut rng).await;
    }
}

/// Final balances and totals, and the spends of expiring buckets at or after expiry.
pub async fn final_read(client: &Client, ops: &[Op]) -> anyhow::Result<Value> {
    let mut balances = serde_json::Map::new();
    for a in ACCOUNTS {
        match client
            .query(
                SHARD,
                &Query::Balance {
                    org: ORG,
                    account: a,
                    horizon_ms: 0,
                },
            )
            .await
        {
            Ok(Answer::Balance(Some(b))) => {
                balances.insert(acct_name(a), balance_json(&b));
            }
            other => anyhow::bail!("final balance of {}: {other:?}", acct_name(a)),
        }
    }
    let totals = match client.query(SHARD, &Query::Totals).await {
        Ok(Answer::Totals(t)) => totals_json(&t),
        other => anyhow::bail!("final totals: {other:?}"),
    };
    // Expiry of every grant the history attempted.
    let mut expiry: BTreeMap<u64, u64> = BTreeMap::new();
    for op in ops {
        if op.f == "grant" && op.kind == crate::history::OpType::Invoke {
            if let Some(e) = op.value.get("expires_at_ms").and_then(Value::as_u64) {
                expiry.insert(u(&op.value, "bucket"), e);
            }
        }
    }
    let (events, head) = audit_all(client).await?;
    let late = late_spends(&events, &mut expiry);
    Ok(json!({
        "balances": balances,
        "totals": totals,
        "late_spends": late,
        "audit_events": events.len(),
        "audit_seq_gap": seq_gap(&events, head),
        "expiring_buckets": expiry.len(),
    }))
}

/// Draws and transfers out of a bucket at or after its expiry instant. A transfer's
/// new buckets inherit the expiry of the bucket they came from.
pub fn late_spends(events: &[AuditEvent], expiry: &mut BTreeMap<u64, u64>) -> Vec<Value> {
    let mut late = Vec::new();
    let mut last_out: Option<u64> = None;
    for e in events {
        match &e.body {
            EventBody::HoldDrawn {
                bucket,
                amount_micro,
            }
            | EventBody::TransferredOut {
                bucket,
                amount_micro,
            } => {
                if let EventBody::TransferredOut { .. } = e.body {
                    last_out = Some(bucket.0);
                }
                if let Some(x) = expiry.get(&bucket.0) {
                    if e.time_ms >= *x {
                        late.push(json!({"seq": e.seq, "log_index": e.log_index,
                            "time_ms": e.time_ms, "bucket": bucket.0, "expires_at_ms": x,
                            "amount": amount_micro}));
                    }
                }
            }
            EventBody::TransferredIn { bucket, .. } => {
                if let Some(src) = last_out {
                    if let Some(x) = expiry.get(&src).copied() {
                        expiry.insert(bucket.0, x);
                    }
                }
            }
            _ => {}
        }
    }
    late
}

const BALANCE_FIELDS: [&str; 7] = [
    "available",
    "held",
    "consumed",
    "expired",
    "moved_out",
    "issued",
    "moved_in",
];

/// The account's equation holds — and the read carries every figure: a read that is not
/// a balance (an unexpected answer recorded as text) must not pass as 0 = 0.
fn conserved(b: &Value) -> bool {
    if !BALANCE_FIELDS
        .iter()
        .all(|k| b.get(*k).is_some_and(Value::is_u64))
    {
        return false;
    }
    let lhs = u(b, "available") as u128
        + u(b, "held") as u128
        + u(b, "consumed") as u128
        + u(b, "expired") as u128
        + u(b, "moved_out") as u128;
    let rhs = u(b, "issued") as u128 + u(b, "moved_in") as u128;
    lhs == rhs
}

/// Sum of `amount` over ops of `f` completed ok before `before` (history index), and
/// over ops of `f` invoked before `until` and not failed.
fn bounds(ps: &[crate::history::Pair], f: &str, before: u64, until: u64) -> (u128, u128) {
    let mut lo = 0u128;
    let mut hi = 0u128;
    for p in ps.iter().filter(|p| p.invoke.f == f) {
        let amount = u(&p.invoke.value, "amount") as u128;
        if p.kind() == OpType::Ok && p.done_index() < before {
            lo += amount;
        }
        if p.kind() != OpType::Fail && p.invoke.index < until {
            hi += amount;
        }
    }
    (lo, hi)
}

pub fn check(ops: &[Op]) -> Vec<Verdict> {
    let ps = pairs(ops);
    let initial = INITIAL_MICRO as u128 * ACCOUNTS.len() as u128;
    let mut out = Vec::new();

    // Conservation per account at every ok read.
    let mut reads = 0;
    let mut bad = None;
    for p in ps
        .iter()
        .filter(|p| p.invoke.f == "read" && p.kind() == OpType::Ok)
    {
        reads += 1;
        let b = &p.done.unwrap().value["answer"];
        if bad.is_none() && !conserved(b) {
            bad = Some(format!(
                "op {}: {} breaks available+held+consumed+expired+moved_out = issued+moved_in: {b}",
                p.invoke.index, p.invoke.value["account"]
            ));
        }
    }
    out.push(Verdict::from(
        "bank/conservation-at-every-read",
        bad,
        format!("{reads} ok balance reads"),
    ));

    // Issued totals within [acknowledged, attempted] at every ok totals read.
    let mut n = 0;
    let mut bad = None;
    for p in ps
        .iter()
        .filter(|p| p.invoke.f == "totals" && p.kind() == OpType::Ok)
    {
        n += 1;
        let t = &p.done.unwrap().value["answer"];
        let issued = u(t, "issued") as u128;
        let (lo, hi) = bounds(&ps, "grant", p.invoke.index, p.done_index());
        if bad.is_none() && !(initial + lo <= issued && issued <= initial + hi) {
            bad = Some(format!(
                "op {}: issued {issued} outside [{}, {}] (acknowledged grants lost or phantom grants)",
                p.invoke.index,
                initial + lo,
                initial + hi
            ));
        }
    }
    out.push(Verdict::from(
        "bank/issued-within-acknowledged-and-attempted",
        bad,
        format!("{n} ok totals reads"),
    ));

    let Some(fin) = final_value(ops) else {
        out.push(Verdict::fail("bank/final", "no final read in the history"));
        return out;
    };
    let t = &fin["totals"];
    let balances: Vec<&Value> = fin["balances"]
        .as_object()
        .map(|m| m.values().collect())
        .unwrap_or_default();
    let sum = |k: &str| balances.iter().map(|b| u(b, k) as u128).sum::<u128>();
    let mut problems = Vec::new();
    for k in ["issued", "consumed", "expired", "moved"] {
        if !t.get(k).is_some_and(Value::is_u64) {
            problems.push(format!("the final totals lack {k}: {t}"));
        }
    }
    for b in &balances {
        if !conserved(b) {
            problems.push(format!(
                "an account breaks its equation at the final read: {b}"
            ));
        }
    }
    if sum("issued") != u(t, "issued") as u128 {
        problems.push(format!(
            "Σ issued of accounts {} ≠ totals.issued {}",
            sum("issued"),
            u(t, "issued")
        ));
    }
    if sum("moved_in") != sum("moved_out") {
        problems.push(format!(
            "Σ moved_in {} ≠ Σ moved_out {}",
            sum("moved_in"),
            sum("moved_out")
        ));
    }
    if sum("consumed") != u(t, "consumed") as u128 {
        problems.push(format!(
            "Σ consumed {} ≠ totals.consumed {}",
            sum("consumed"),
            u(t, "consumed")
        ));
    }
    if sum("expired") != u(t, "expired") as u128 {
        problems.push(format!(
            "Σ expired {} ≠ totals.expired {}",
            sum("expired"),
            u(t, "expired")
        ));
    }
    let money = sum("available") + sum("held") + sum("consumed") + sum("expired");
    if money != u(t, "issued") as u128 {
        problems.push(format!(
            "available+held+consumed+expired {money} ≠ issued {}",
            u(t, "issued")
        ));
    }
    out.push(Verdict::from(
        "bank/final-conservation",
        problems.first().cloned(),
        format!("{} accounts, issued {} µ", balances.len(), u(t, "issued")),
    ));

    let mut problems = Vec::new();
    let end = u64::MAX;
    for (f, key, extra) in [
        ("grant", "issued", initial),
        ("transfer", "moved", 0),
        ("capture", "consumed", 0),
    ] {
        let (lo, hi) = bounds(&ps, f, end, end);
        let got = u(t, key) as u128;
        if !(extra + lo <= got && got <= extra + hi) {
            problems.push(format!(
                "totals.{key} {got} outside [{}, {}] from ok and ok+info {f}s (lost or applied twice)",
                extra + lo,
                extra + hi
            ));
        }
    }
    out.push(Verdict::from(
        "bank/each-operation-applied-once",
        problems.first().cloned(),
        "grants, transfers, captures within their ok / ok+info bounds",
    ));

    // A balance can never hold more than was ever issued; a cumulative
    // transfer counter can exceed that (money moves back and forth) but
    // never the total moved by all transfers. A value past its cap is a
    // negative figure that wrapped.
    let mut bad = None;
    for b in &balances {
        for (k, cap_key) in [
            ("available", "issued"),
            ("held", "issued"),
            ("consumed", "issued"),
            ("expired", "issued"),
            ("moved_in", "moved"),
            ("moved_out", "moved"),
        ] {
            let cap = u(t, cap_key);
            if u(b, k) > cap && bad.is_none() {
                bad = Some(format!(
                    "{k} = {} exceeds totals.{cap_key} ({cap}): a negative figure wrapped",
                    u(b, k)
                ));
            }
        }
    }
    out.push(Verdict::from(
        "bank/no-negative-balance",
        bad,
        "balances within issued, transfer counters within moved",
    ));

    out.push(gap_verdict(fin));
    let late = fin["late_spends"].as_array().cloned().unwrap_or_default();
    out.push(Verdict::from(
        "bank/no-spend-of-expired-credit",
        late.first()
            .map(|l| format!("spent at or after expiry: {l}")),
        format!(
            "{} audit events, {} expiring buckets",
            u(fin, "audit_events"),
            u(fin, "expiring_buckets")
        ),
    ));
    out
}
