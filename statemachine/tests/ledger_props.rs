//! Property tests: thousands of random command sequences (grants, holds, captures,
//! top-ups, releases, metering, settlements, transfers, budgets, expiry, retries with
//! the same and with a different payload). After every entry the harness asserts every
//! invariant (conservation per bucket, account and shard; no negative balance; draws
//! sum to holds) and the audit chain; this file adds the properties below.

use allot_statemachine::testkit::*;
use allot_statemachine::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const ACCOUNTS: [Account; 3] = [
    Account::Project(PROJECT),
    Account::Project(PROJECT_B),
    Account::Org(ORG),
];
const HOLDS: u64 = 6;

#[derive(Clone, Debug)]
enum Op {
    Grant {
        owner: usize,
        kind: u8,
        amount: u64,
        expires_in: Option<u64>,
        priority: u8,
        promo_a100_only: bool,
    },
    Hold {
        hold: u64,
        project_b: bool,
        user_b: bool,
        amount: u64,
        a100_only: bool,
    },
    Capture {
        hold: u64,
        amount: u64,
    },
    TopUp {
        hold: u64,
        amount: u64,
    },
    Release {
        hold: u64,
    },
    /// `stale`: reuse the current attempt instead of the next one.
    Meter {
        hold: u64,
        stale: bool,
        h100: bool,
        gpus: u32,
    },
    /// `stale`: an older attempt; `dup`: repeat the last seq; `checkpoint`: report one more.
    Heartbeat {
        hold: u64,
        stale: bool,
        dup: bool,
        checkpoint: bool,
    },
    Settle {
        hold: u64,
        stale: bool,
        reason: u8,
    },
    Transfer {
        from: usize,
        to: usize,
        amount: u64,
    },
    Budget {
        scope: u8,
        limit: Option<u64>,
        hard: bool,
        monthly: bool,
    },
    Advance {
        ms: u64,
    },
    /// Resend an earlier request unchanged.
    Retry {
        pick: usize,
    },
    /// Reuse an earlier request id with a different payload.
    RetryDifferent {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let amount = prop_oneof![1u64..=1_000, 1_000u64..=credits(50)];
    let hold = 1..=HOLDS;
    prop_oneof![
        3 => (0..3usize, 0..3u8, amount.clone(), proptest::option::of(1u64..=10 * HOUR_MS), 0..3u8, any::<bool>())
            .prop_map(|(owner, kind, amount, expires_in, priority, promo_a100_only)| Op::Grant { owner, kind, amount, expires_in, priority, promo_a100_only }),
        3 => (hold.clone(), any::<bool>(), any::<bool>(), 1u64..=credits(30), any::<bool>())
            .prop_map(|(hold, project_b, user_b, amount, a100_only)| Op::Hold { hold, project_b, user_b, amount, a100_only }),
        2 => (hold.clone(), amount.clone()).prop_map(|(hold, amount)| Op::Capture { hold, amount }),
        1 => (hold.clone(), amount.clone()).prop_map(|(hold, amount)| Op::TopUp { hold, amount }),
        1 => hold.clone().prop_map(|hold| Op::Release { hold }),
        2 => (hold.clone(), prop::bool::weighted(0.1), any::<bool>(), 1..=8u32).prop_map(|(hold, stale, h100, gpus)| Op::Meter { hold, stale, h100, gpus }),
        6 => (hold.clone(), prop::bool::weighted(0.1), prop::bool::weighted(0.1), prop::bool::weighted(0.3))
            .prop_map(|(hold, stale, dup, checkpoint)| Op::Heartbeat { hold, stale, dup, checkpoint }),
        2 => (hold, prop::bool::weighted(0.1), 0..7u8).prop_map(|(hold, stale, reason)| Op::Settle { hold, stale, reason }),
        1 => (0..3usize, 0..3usize, amount).prop_map(|(from, to, amount)| Op::Transfer { from, to, amount }),
        1 => (0..3u8, proptest::option::of(0u64..=credits(80)), any::<bool>(), any::<bool>())
            .prop_map(|(scope, limit, hard, monthly)| Op::Budget { scope, limit, hard, monthly }),
        3 => prop_oneof![1u64..=60_000, 60_000u64..=3 * HOUR_MS].prop_map(|ms| Op::Advance { ms }),
        2 => any::<usize>().prop_map(|pick| Op::Retry { pick }),
        1 => any::<usize>().prop_map(|pick| Op::RetryDifferent { pick }),
    ]
}

/// Preemption twice: it is the one ending billed to the checkpoint, so the one that
/// reverses captures.
const REASONS: [SettleReason; 7] = [
    SettleReason::Succeeded,
    SettleReason::Failed,
    SettleReason::Cancelled,
    SettleReason::Preempted,
    SettleReason::Preempted,
    SettleReason::NodeFailure,
    SettleReason::Lost,
];

/// Test-side bookkeeping: fresh hold ids for new holds; other hold ops pick among the
/// open holds (or an unknown id when none is open).
#[derive(Default)]
struct Model {
    next_bucket: u64,
    next_hold: u64,
}

impl Model {
    fn new_hold(&mut self) -> HoldId {
        self.next_hold += 1;
        HoldId(self.next_hold)
    }

    fn hold_id(&mut self, h: &Harness, pick: u64) -> HoldId {
        let open: Vec<HoldId> = h
            .state
            .ledger
            .holds
            .values()
            .filter(|x| x.is_open())
            .map(|x| x.id)
            .collect();
        if open.is_empty() {
            return HoldId(999_999);
        }
        open[pick as usize % open.len()]
    }
}

fn meter(h: &Harness, hold: HoldId) -> Option<&ledger::Meter> {
    h.state
        .ledger
        .hold(ORG, hold)
        .and_then(|x| x.meter.as_ref())
}

fn command(h: &mut Harness, op: &Op, model: &mut Model) -> Option<Command> {
    let next_bucket = &mut model.next_bucket;
    Some(match *op {
        Op::Grant {
            owner,
            kind,
            amount,
            expires_in,
            priority,
            promo_a100_only,
        } => {
            *next_bucket += 1;
            let kind = [
                BucketKind::Paid,
                BucketKind::Promotional,
                BucketKind::Granted,
            ][kind as usize];
            Command::IssueGrant(Grant {
                bucket: BucketId(*next_bucket),
                owner: ACCOUNTS[owner],
                kind,
                amount_micro: amount,
                expires_at_ms: expires_in.map(|d| h.now + d),
                priority,
                policy: (promo_a100_only && kind == BucketKind::Promotional).then(|| {
                    BucketPolicy {
                        gpu_types: vec![a100()],
                        tiers: vec![],
                    }
                }),
                source_ref: None,
            })
        }
        Op::Hold {
            hold,
            project_b,
            user_b,
            amount,
            a100_only,
        } => {
            let mut spec = Harness::hold_spec(0, amount);
            let _ = hold;
            spec.hold = model.new_hold();
            if project_b {
                spec.project = PROJECT_B;
            }
            if user_b {
                spec.user = USER_B;
            }
            if a100_only {
                spec.gpu_types = vec![a100()];
            }
            Command::CreateHold(spec)
        }
        Op::Capture { hold, amount } => Command::Capture {
            hold: model.hold_id(h, hold),
            amount_micro: amount,
        },
        Op::TopUp { hold, amount } => Command::TopUp {
            hold: model.hold_id(h, hold),
            amount_micro: amount,
        },
        Op::Release { hold } => Command::ReleaseHold {
            hold: model.hold_id(h, hold),
        },
        Op::Meter {
            hold,
            stale,
            h100: big,
            gpus,
        } => {
            let hold = model.hold_id(h, hold);
            let current = meter(h, hold).map_or(0, |m| m.attempt);
            Command::StartMeter {
                hold,
                attempt: if stale { current } else { current + 1 },
                gpu_type: if big { h100() } else { a100() },
                gpus,
            }
        }
        Op::Heartbeat {
            hold,
            stale,
            dup,
            checkpoint,
        } => {
            let hold = model.hold_id(h, hold);
            let (attempt, seq, cp) =
                meter(h, hold).map_or((1, 1, 0), |m| (m.attempt, m.last_seq, m.checkpoint));
            Command::Heartbeat(Heartbeat {
                hold,
                attempt: if stale {
                    attempt.saturating_sub(1)
                } else {
                    attempt
                },
                seq: if dup { seq } else { seq + 1 },
                progress_ppm: 0,
                checkpoint: cp + checkpoint as u64,
            })
        }
        Op::Settle {
            hold,
            stale,
            reason,
        } => {
            let hold = model.hold_id(h, hold);
            let attempt = meter(h, hold).map_or(0, |m| m.attempt);
            Command::Settle {
                hold,
                attempt: if stale {
                    attempt.wrapping_sub(1)
                } else {
                    attempt
                },
                reason: REASONS[reason as usize % REASONS.len()],
            }
        }
        Op::Transfer { from, to, amount } => Command::Transfer {
            from: ACCOUNTS[from],
            to: ACCOUNTS[to],
            amount_micro: amount,
        },
        Op::Budget {
            scope,
            limit,
            hard,
            monthly,
        } => Command::SetBudget {
            scope: [
                BudgetScope::User(USER),
                BudgetScope::Project(PROJECT),
                BudgetScope::Org(ORG),
            ][scope as usize],
            budget: limit.map(|limit_micro| BudgetSpec {
                limit_micro,
                period: if monthly {
                    BudgetPeriod::Month
                } else {
                    BudgetPeriod::Day
                },
                mode: if hard {
                    BudgetMode::Hard
                } else {
                    BudgetMode::Soft
                },
            }),
        },
        Op::Advance { .. } | Op::Retry { .. } | Op::RetryDifferent { .. } => return None,
    })
}

/// Every draw and every transfer takes only from buckets that were spendable at the
/// entry's logical time (captures from held credit are allowed after expiry).
fn assert_no_expired_spend(h: &Harness, from_event: usize) {
    for e in &h.events[from_event..] {
        if let EventBody::HoldDrawn { bucket, .. } | EventBody::TransferredOut { bucket, .. } =
            e.body
        {
            let b = &h.state.ledger.buckets[&bucket];
            assert!(
                b.expires_at_ms.is_none_or(|at| at > e.time_ms),
                "{bucket} spent at/after its expiry"
            );
        }
    }
}

fn run_sequence(ops: &[Op]) -> Harness {
    let mut h = Harness::world();
    // A base of credit so that most holds succeed and metering paths are exercised.
    h.grant(
        900_001,
        Account::Org(ORG),
        BucketKind::Paid,
        credits(500),
        None,
    );
    h.grant(
        900_002,
        Account::Project(PROJECT),
        BucketKind::Promotional,
        credits(50),
        Some(h.now + 20 * HOUR_MS),
    );
    let mut model = Model::default();
    // Every request sent, and the first outcome for each request id.
    let mut sent: Vec<Request> = Vec::new();
    let mut first: BTreeMap<RequestId, Outcome> = BTreeMap::new();
    let remembered = |r: &Request| {
        r.command.uses_idempotency_table()
            && allot_statemachine::validate::validate(
                r,
                allot_statemachine::version::RULES_BASELINE,
            )
            .is_ok()
    };
    for op in ops {
        let request = match op {
            Op::Advance { ms } => {
                h.advance(*ms);
                h.tick();
                continue;
            }
            Op::Retry { pick } if !sent.is_empty() => sent[pick % sent.len()].clone(),
            Op::RetryDifferent { pick } if sent.iter().any(remembered) => {
                // Only ids the table remembers can conflict: heartbeats are keyed by
                // seq, and a request that failed static validation took no record.
                let keyed: Vec<&Request> = sent.iter().filter(|r| remembered(r)).collect();
                let mut r = keyed[pick % keyed.len()].clone();
                r.command = Command::CreateOrg {
                    org: OrgId(1_000 + r.request_id as u64),
                };
                r
            }
            _ => match command(&mut h, op, &mut model) {
                Some(command) => Request {
                    actor: ADMIN,
                    request_id: h.fresh_request_id(),
                    org: None,
                    command,
                },
                None => continue,
            },
        };
        let mark = h.events.len();
        let before = h.state.ledger.clone();
        let outcome = h.apply(vec![request.clone()]).remove(0);
        assert_no_expired_spend(&h, mark);
        match first.get(&request.request_id) {
            None => {
                first.insert(request.request_id, outcome);
                sent.push(request);
            }
            Some(_) if matches!(op, Op::RetryDifferent { .. }) => {
                assert_eq!(outcome, Err(CommandError::RequestIdReused));
                assert_eq!(h.state.ledger.holds, before.holds);
                assert_eq!(h.state.ledger.buckets, before.buckets);
            }
            Some(original) if matches!(request.command, Command::Heartbeat(_)) => {
                // Heartbeats are idempotent by (hold, attempt, seq), not by request id:
                // a resend of an accepted heartbeat is a duplicate and changes nothing.
                // (A resend of a refused one may be accepted: it was never applied.)
                let accepted = |o: &Outcome| {
                    matches!(
                        o,
                        Ok(Reply::Heartbeat(HeartbeatReply { accepted: true, .. }))
                    )
                };
                if accepted(original) {
                    assert!(!accepted(&outcome), "{outcome:?}");
                    assert_eq!(h.state.ledger, before, "a resent heartbeat applies nothing");
                }
            }
            Some(original) => {
                assert_eq!(&outcome, original, "a retry returns the first outcome");
                assert_eq!(
                    h.state.ledger.buckets, before.buckets,
                    "a retry applies nothing"
                );
            }
        }
    }
    h.assert_audit_rebuilds_ledger();
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_every_invariant(ops in proptest::collection::vec(op(), 1..80)) {
        run_sequence(&ops);
    }

    /// Same log ⇒ same state: a replica restored from a snapshot taken mid-way and fed
    /// the rest of the log reaches the same state hash and emits the same events as the
    /// replica that applied everything.
    #[test]
    fn replay_from_snapshot_reaches_the_same_state(ops in proptest::collection::vec(op(), 1..60), cut in any::<prop::sample::Index>()) {
        let h = run_sequence(&ops);
        let cut = cut.index(h.entries.len() + 1);
        let mut replica = State::default();
        let mut events = Vec::new();
        for e in &h.entries[..cut] {
            events.extend(apply(&mut replica, e).unwrap().events);
        }
        let mut restored = State::decode(&replica.encode()).unwrap();
        prop_assert_eq!(restored.state_hash(), replica.state_hash());
        for e in &h.entries[cut..] {
            events.extend(apply(&mut restored, e).unwrap().events);
        }
        prop_assert_eq!(restored.state_hash(), h.state.state_hash());
        prop_assert_eq!(&restored, &h.state);
        prop_assert_eq!(events, h.events.clone());
    }
}

/// The generator must reach the interesting paths, or the properties above prove
/// little: count them over a fixed-seed sample of sequences.
#[test]
fn generator_reaches_the_interesting_paths() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    let strategy = proptest::collection::vec(op(), 40..80);
    let mut seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut rejected: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..300 {
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        let h = run_sequence(&ops);
        for e in &h.events {
            let entry = &h.entries[e.log_index as usize - 1];
            let name = audit::command_of(e, entry).map_or("", |c| c.name());
            let key = match &e.body {
                EventBody::Command { replayed: true, .. } => "replayed",
                EventBody::Command {
                    outcome: Err(CommandError::RequestIdReused),
                    ..
                } => "request_id_reused",
                EventBody::Command {
                    outcome: Err(CommandError::BudgetExceeded { .. }),
                    ..
                } => "budget_rejected",
                EventBody::Command {
                    outcome: Err(CommandError::InsufficientCredits { .. }),
                    ..
                } => "insufficient",
                EventBody::Command {
                    outcome: Ok(Reply::Heartbeat(r)),
                    ..
                } if r.stop.is_some() => "out_of_credits",
                EventBody::Command {
                    outcome: Ok(Reply::Settled(s)),
                    ..
                } if s.reason == SettleReason::Preempted => "settled_preempted",
                EventBody::Command { outcome: Ok(_), .. } => name,
                EventBody::Command {
                    outcome: Err(e), ..
                } => {
                    let reason = format!("{e:?}");
                    let reason = reason
                        .split([' ', '(', '{'])
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    *rejected.entry(format!("{} {reason}", name)).or_default() += 1;
                    "rejected"
                }
                EventBody::CaptureReversed { .. } => "capture_reversed",
                EventBody::RefundForfeited { .. } => "refund_forfeited",
                EventBody::BucketExpired { .. } => "bucket_expired",
                EventBody::BudgetAlert { .. } => "budget_alert",
                EventBody::TransferredIn { .. } => "transferred",
                EventBody::Captured { .. } => "captured",
                _ => continue,
            };
            *seen.entry(key).or_default() += 1;
        }
    }
    println!("{seen:#?}\n{rejected:#?}");
    for key in [
        "replayed",
        "request_id_reused",
        "budget_rejected",
        "insufficient",
        "settled_preempted",
        "capture_reversed",
        "refund_forfeited",
        "bucket_expired",
        "budget_alert",
        "transferred",
        "captured",
        "heartbeat",
        "top_up",
        "release_hold",
        "start_meter",
        "settle",
        "create_hold",
        "issue_grant",
    ] {
        assert!(
            seen.get(key).copied().unwrap_or(0) >= 5,
            "path {key} reached only {:?} times",
            seen.get(key)
        );
    }
}
