//! The ledger demo: the seed's walk-throughs narrated event by event, then a
//! multi-tenant metering workload with a progress line, ending with balances, the
//! invariant check and the state hash. Runs the real state machine; no cluster yet
//! (the replicated node lands with issue 4).
//!
//! `cargo run --release -p allot-statemachine --example demo`

use allot_statemachine::testkit::*;
use allot_statemachine::*;
use std::io::Write;

fn c(micro: u64) -> String {
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn narrate(h: &Harness, from: usize) {
    for e in &h.events[from..] {
        let t = (e.time_ms - T0_MS) as f64 / HOUR_MS as f64;
        let what = match &e.body {
            EventBody::Command {
                outcome, replayed, ..
            } => {
                let entry = &h.entries[e.log_index as usize - 1];
                let name = audit::command_of(e, entry).map_or("?", |c| c.name());
                let result = match outcome {
                    Ok(_) => "ok".to_string(),
                    Err(err) => format!("rejected: {err}"),
                };
                format!(
                    "{name:<13} {result}{}",
                    if *replayed {
                        " (retry: first outcome)"
                    } else {
                        ""
                    }
                )
            }
            EventBody::Issued {
                bucket,
                amount_micro,
            } => format!("  issued    {bucket} +{}", c(*amount_micro)),
            EventBody::HoldDrawn {
                bucket,
                amount_micro,
            } => format!("  drawn     {bucket} {}", c(*amount_micro)),
            EventBody::Captured {
                bucket,
                amount_micro,
            } => format!("  captured  {bucket} {}", c(*amount_micro)),
            EventBody::CaptureReversed {
                bucket,
                amount_micro,
            } => {
                format!(
                    "  reversed  {bucket} {} (after last checkpoint)",
                    c(*amount_micro)
                )
            }
            EventBody::Refunded {
                bucket,
                amount_micro,
            } => format!("  refunded  {bucket} {}", c(*amount_micro)),
            EventBody::RefundForfeited {
                bucket,
                amount_micro,
            } => {
                format!("  FORFEITED {bucket} {} (bucket expired)", c(*amount_micro))
            }
            EventBody::BucketExpired {
                bucket,
                amount_micro,
            } => format!("  expired   {bucket} {}", c(*amount_micro)),
            other => format!("  {other:?}"),
        };
        println!("  [{:>4}] t+{t:>5.2}h  {what}", e.seq);
    }
}

fn walkthrough_preempted() {
    println!("\n== A job preempted at 60% of its hold (2×H100, ≤10 h, checkpoint at 5 h) ==");
    let mut h = Harness::world();
    let p = Account::Project(PROJECT);
    h.grant(1, p, BucketKind::Promotional, credits(30), None);
    h.grant(2, p, BucketKind::Paid, credits(100), None);
    let mark = h.events.len();
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(80))));
    h.ok(Command::StartMeter {
        hold: HoldId(1),
        attempt: 1,
        gpu_type: h100(),
        gpus: 2,
    });
    for seq in 1..=6 {
        h.advance(HOUR_MS);
        let hb = Heartbeat {
            hold: HoldId(1),
            attempt: 1,
            seq,
            progress_ppm: 0,
            checkpoint: (seq >= 5) as u64,
        };
        h.run_as(Actor::Agent(NodeId(7)), Command::Heartbeat(hb))
            .expect("heartbeat");
    }
    h.ok(Command::Settle {
        hold: HoldId(1),
        attempt: 1,
        reason: SettleReason::Preempted,
    });
    narrate(&h, mark);
    h.assert_audit_rebuilds_ledger();
}

fn walkthrough_promo_expiry() {
    println!("\n== A promotional bucket expires mid-run; the late refund is forfeited ==");
    let mut h = Harness::world();
    let p = Account::Project(PROJECT);
    h.grant(
        1,
        p,
        BucketKind::Promotional,
        credits(25),
        Some(T0_MS + HOUR_MS + HOUR_MS / 2),
    );
    let mark = h.events.len();
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(20))));
    h.ok(Command::StartMeter {
        hold: HoldId(1),
        attempt: 1,
        gpu_type: a100(),
        gpus: 1,
    });
    for seq in 1..=2 {
        h.advance(HOUR_MS);
        let hb = Heartbeat {
            hold: HoldId(1),
            attempt: 1,
            seq,
            progress_ppm: 0,
            checkpoint: 0,
        };
        h.run_as(Actor::Agent(NodeId(7)), Command::Heartbeat(hb))
            .expect("heartbeat");
    }
    h.run_as(
        Actor::Agent(NodeId(7)),
        Command::Settle {
            hold: HoldId(1),
            attempt: 1,
            reason: SettleReason::Succeeded,
        },
    )
    .expect("finish");
    narrate(&h, mark);
}

/// A deterministic pseudo-random sequence (no `rand` dependency in this crate).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

fn workload() {
    const ORGS: u64 = 200;
    const ENTRIES: u64 = 600;
    println!("\n== Multi-tenant metering workload: {ORGS} orgs, {ENTRIES} entries (≈1 s of logical time each) ==");
    let mut h = Harness::world();
    let mut rng = Lcg(42);
    let mut reqs = Vec::new();
    for o in 0..ORGS {
        let (org, project, user) = (OrgId(1_000 + o), ProjectId(1_000 + o), UserId(1_000 + o));
        for command in [
            Command::CreateOrg { org },
            Command::CreateProject { project, org },
            Command::CreateUser { user, org },
            Command::IssueGrant(Grant {
                bucket: BucketId(10_000 + o),
                owner: Account::Org(org),
                kind: BucketKind::Paid,
                amount_micro: credits(20 + rng.next(200)),
                expires_at_ms: None,
                priority: 100,
                policy: None,
                source_ref: Some(format!("purchase-{o}")),
            }),
        ] {
            let request_id = h.fresh_request_id();
            reqs.push(Request {
                actor: ADMIN,
                request_id,
                org: None,
                command,
            });
        }
    }
    h.apply(reqs);
    let (mut next_hold, mut open): (u64, Vec<(u64, u64, u64)>) = (0, Vec::new());
    let (mut settled, mut stopped) = (0, 0);
    for i in 0..ENTRIES {
        h.advance(1_000 * (1 + rng.next(60)));
        let mut reqs = Vec::new();
        for _ in 0..20 {
            let roll = rng.next(10);
            let org;
            let command = if roll < 2 || open.is_empty() {
                next_hold += 1;
                let o = rng.next(ORGS);
                let spec = HoldSpec {
                    hold: HoldId(next_hold),
                    project: ProjectId(1_000 + o),
                    user: UserId(1_000 + o),
                    tier: Tier::PAID,
                    gpu_types: vec![a100(), h100()],
                    amount_micro: credits(1 + rng.next(10)),
                };
                let request_id = h.fresh_request_id();
                org = Some(OrgId(1_000 + o));
                reqs.push(Request {
                    actor: ADMIN,
                    request_id,
                    org,
                    command: Command::CreateHold(spec),
                });
                open.push((next_hold, 0, 1_000 + o));
                Command::StartMeter {
                    hold: HoldId(next_hold),
                    attempt: 1,
                    gpu_type: a100(),
                    gpus: 1 + rng.next(8) as u32,
                }
            } else if roll < 3 {
                let (hold, _, o) = open.swap_remove(rng.next(open.len() as u64) as usize);
                org = Some(OrgId(o));
                settled += 1;
                let reason = [
                    SettleReason::Succeeded,
                    SettleReason::Preempted,
                    SettleReason::Lost,
                ][rng.next(3) as usize];
                Command::Settle {
                    hold: HoldId(hold),
                    attempt: 1,
                    reason,
                }
            } else {
                let k = rng.next(open.len() as u64) as usize;
                open[k].1 += 1;
                org = Some(OrgId(open[k].2));
                Command::Heartbeat(Heartbeat {
                    hold: HoldId(open[k].0),
                    attempt: 1,
                    seq: open[k].1,
                    progress_ppm: 0,
                    checkpoint: open[k].1 / 3,
                })
            };
            let actor = if matches!(command, Command::CreateHold(_) | Command::StartMeter { .. }) {
                ADMIN
            } else {
                Actor::Agent(NodeId(1))
            };
            reqs.push(Request {
                actor,
                request_id: h.fresh_request_id(),
                org,
                command,
            });
        }
        for out in h.apply(reqs) {
            if let Ok(Reply::Heartbeat(HeartbeatReply { stop: Some(_), .. })) = out {
                stopped += 1;
            }
        }
        open.retain(|(hold, _, o)| {
            h.state
                .ledger
                .hold(OrgId(*o), HoldId(*hold))
                .is_some_and(|x| x.is_open())
        });
        if i % 20 == 0 || i + 1 == ENTRIES {
            let t = &h.state.ledger.totals;
            print!(
                "\r  entry {:>4}/{ENTRIES}  running {:>4}  settled {:>5}  out-of-credit {:>3}  consumed {:>12}  events {:>7}",
                i + 1,
                h.state.ledger.holds.open,
                settled,
                stopped,
                c(t.consumed as u64),
                h.events.len()
            );
            let _ = std::io::stdout().flush();
        }
    }
    println!();
    let t = h.state.ledger.totals;
    let held: u64 = h.state.ledger.buckets.values().map(|b| b.held).sum();
    let available: u64 = h.state.ledger.buckets.values().map(|b| b.remaining).sum();
    println!(
        "\n  shard totals   issued {}  = available {} + held {} + consumed {} + expired {}",
        c(t.issued as u64),
        c(available),
        c(held),
        c(t.consumed as u64),
        c(t.expired as u64)
    );
    println!(
        "  invariants     {}",
        match check_invariants(&h.state) {
            Ok(()) => "ok".to_string(),
            Err(v) => format!("VIOLATED: {v}"),
        }
    );
    h.assert_audit_rebuilds_ledger();
    println!(
        "  audit trail    {} events, chain verified, rebuilds every bucket exactly",
        h.events.len()
    );
    let hash: String = h
        .state
        .state_hash()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("  state hash     {hash}… (same log ⇒ same hash on every replica)");
}

fn main() {
    walkthrough_preempted();
    walkthrough_promo_expiry();
    workload();
}
