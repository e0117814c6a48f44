//! The follow-up walk-throughs of `gpu-credit-system-and-scheduler.txt`, step by step,
//! with the exact ledger movements and audit events, and a check that the audit trail
//! alone rebuilds every bucket.

use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);
const PROMO: u64 = 1;
const PAID: u64 = 2;
/// The platform's metering service reports on explicit (non-job) metered holds with an
/// admin credential; agent tokens report only on jobs placed on their node.
const AGENT: Actor = Actor::Admin(PrincipalId(7));

fn hb(h: &mut Harness, seq: u64, checkpoint: u64) -> HeartbeatReply {
    let cmd = Command::Heartbeat(Heartbeat {
        hold: HoldId(1),
        attempt: 1,
        seq,
        progress_ppm: 0,
        checkpoint,
    });
    match h.run_as(AGENT, cmd) {
        Ok(Reply::Heartbeat(r)) => r,
        other => panic!("heartbeat: {other:?}"),
    }
}

/// A job (2 GPUs, up to 10 h, A100 or H100) reserves 10 h × 2 × 4 credits (the highest
/// acceptable price) = 80 credits; it is placed on H100s; it checkpoints at 5 h; the
/// platform preempts it at 6 h, when 48 credits (60% of the hold) are captured.
#[test]
fn job_preempted_at_60_percent_of_its_hold() {
    let mut h = Harness::world();
    h.grant(PROMO, P, BucketKind::Promotional, credits(30), None);
    h.grant(PAID, P, BucketKind::Paid, credits(100), None);
    let mark = h.events.len();

    // 1. Reservation: promo first, then paid, each draw recorded.
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(80))));
    assert_eq!(
        h.movements_since(mark),
        vec![("drawn", PROMO, credits(30)), ("drawn", PAID, credits(50))]
    );

    // 2. Placement fixes the H100 price on the meter.
    let started = h.ok(Command::StartMeter {
        hold: HoldId(1),
        attempt: 1,
        gpu_type: h100(),
        gpus: 2,
    });
    assert_eq!(
        started,
        Reply::MeterStarted {
            price_micro_per_gpu_hour: H100_PRICE,
            price_version: 1
        }
    );

    // 3. Hourly heartbeats capture 8 credits each (2 GPUs × 4 credits × 1 h); the
    //    heartbeat at 5 h reports checkpoint 1.
    let mark = h.events.len();
    for hour in 1..=6 {
        h.advance(HOUR_MS);
        let r = hb(&mut h, hour, if hour >= 5 { 1 } else { 0 });
        assert_eq!(r.captured_delta_micro, credits(8));
    }
    assert_eq!(h.hold(1).captured, credits(48), "60% of the 80-credit hold");
    assert_eq!(
        h.movements_since(mark),
        vec![
            ("captured", PROMO, credits(8)),
            ("captured", PROMO, credits(8)),
            ("captured", PROMO, credits(8)),
            ("captured", PROMO, credits(6)),
            ("captured", PAID, credits(2)),
            ("captured", PAID, credits(8)),
            ("captured", PAID, credits(8)),
        ]
    );

    // 4. Preemption (platform-caused): work after the 5 h checkpoint is not charged.
    //    8 credits of capture are reversed (last draw first), then the whole unused
    //    hold returns to the exact bucket it came from.
    let mark = h.events.len();
    let reply = h.ok(Command::Settle {
        hold: HoldId(1),
        attempt: 1,
        reason: SettleReason::Preempted,
    });
    assert_eq!(
        reply,
        Reply::Settled(Settlement {
            reason: SettleReason::Preempted,
            captured_micro: credits(40),
            refunded_micro: credits(40),
            forfeited_micro: 0,
            uncollected_micro: 0,
        })
    );
    assert_eq!(
        h.movements_since(mark),
        vec![
            ("reversed", PAID, credits(8)),
            ("refunded", PAID, credits(40))
        ]
    );
    let settle_event = &h.events[mark];
    let EventBody::Command { outcome, .. } = &settle_event.body else {
        panic!("the settlement's command event comes first")
    };
    let command = audit::command_of(settle_event, h.entries.last().unwrap());
    assert!(matches!(command, Some(Command::Settle { .. })) && outcome.is_ok());
    assert_eq!(settle_event.hold, Some(HoldId(1)));

    // 5. End state: 40 credits consumed (30 promo + 10 paid), paid back to 90.
    assert_eq!(
        (h.bucket(PROMO).consumed, h.bucket(PROMO).remaining),
        (credits(30), 0)
    );
    assert_eq!(
        (
            h.bucket(PAID).consumed,
            h.bucket(PAID).remaining,
            h.bucket(PAID).held
        ),
        (credits(10), credits(90), 0)
    );
    h.assert_audit_rebuilds_ledger();
}

/// The finish call is lost (the agent crashes after the job stops). The job's lease
/// runs out and it is settled as Lost: billed to its last heartbeat, the rest refunded.
/// A late finish, or a retry of the Lost settlement, refunds nothing more.
#[test]
fn lost_finish_is_refunded_once() {
    let mut h = Harness::world();
    h.grant(PAID, P, BucketKind::Paid, credits(100), None);
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(40))));
    h.ok(Command::StartMeter {
        hold: HoldId(1),
        attempt: 1,
        gpu_type: a100(),
        gpus: 1,
    });
    for seq in 1..=3 {
        h.advance(HOUR_MS);
        hb(&mut h, seq, 0);
    }
    // The job stops at ~3.5 h; the finish never arrives. Lease expiry at 5 h settles it.
    h.advance(2 * HOUR_MS);
    let lost = Request {
        actor: ADMIN,
        request_id: 77,
        org: None,
        command: Command::Settle {
            hold: HoldId(1),
            attempt: 1,
            reason: SettleReason::Lost,
        },
    };
    let first = h.apply(vec![lost.clone()]).remove(0);
    let Ok(Reply::Settled(s)) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(
        (s.captured_micro, s.refunded_micro),
        (credits(6), credits(34)),
        "billed to the last heartbeat"
    );
    let remaining = h.bucket(PAID).remaining;
    assert_eq!(remaining, credits(94));

    // A retry of the same settlement (same request id) returns the first outcome.
    assert_eq!(h.apply(vec![lost]).remove(0), first);
    // The late finish from the agent (a new request) is refused: already settled.
    let late = h.run_as(
        AGENT,
        Command::Settle {
            hold: HoldId(1),
            attempt: 1,
            reason: SettleReason::Succeeded,
        },
    );
    assert_eq!(late, Err(CommandError::HoldSettled));
    // A late heartbeat is refused too.
    let cmd = Command::Heartbeat(Heartbeat {
        hold: HoldId(1),
        attempt: 1,
        seq: 9,
        progress_ppm: 0,
        checkpoint: 0,
    });
    assert_eq!(h.run_as(AGENT, cmd), Err(CommandError::HoldSettled));
    assert_eq!(h.bucket(PAID).remaining, remaining, "no double refund");
    h.assert_audit_rebuilds_ledger();
}

/// A promotional bucket expires while a job runs on it. The credit already held stays
/// valid for the running job; the unheld remainder expires at the instant; the refund
/// of the promo part that lands after the expiry is forfeited at once, with an event,
/// while the paid part is refunded normally.
#[test]
fn promo_expiring_mid_run() {
    let mut h = Harness::world();
    let expiry = T0_MS + HOUR_MS + HOUR_MS / 2;
    h.grant(PROMO, P, BucketKind::Promotional, credits(25), Some(expiry));
    h.grant(PAID, P, BucketKind::Paid, credits(100), None);
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(20)))); // all from promo
    h.ok(Command::StartMeter {
        hold: HoldId(1),
        attempt: 1,
        gpu_type: a100(),
        gpus: 1,
    });
    assert_eq!(h.bucket(PROMO).held, credits(20));

    h.advance(HOUR_MS);
    hb(&mut h, 1, 0); // 2 credits captured from promo
                      // The expiry instant passes: the 5 unheld promo credits expire; the 18 held stay.
    h.advance(HOUR_MS);
    let mark = h.events.len();
    let r = hb(&mut h, 2, 0);
    assert_eq!(
        r.captured_delta_micro,
        credits(2),
        "the job keeps running on held promo credit"
    );
    assert_eq!(
        h.movements_since(mark),
        vec![
            ("expired", PROMO, credits(5)),
            ("captured", PROMO, credits(2))
        ],
        "expiry runs first in the entry, then the capture from the still-valid hold"
    );
    let bal = h.state.ledger.balance(ORG, P, h.now, 0).unwrap();
    assert_eq!(bal.promotional_available_micro, 0);

    // Finish at 2 h: 4 credits billed; the 16 unused promo credits would go back to an
    // expired bucket: forfeited at once.
    let mark = h.events.len();
    let Ok(Reply::Settled(s)) = h.run_as(
        AGENT,
        Command::Settle {
            hold: HoldId(1),
            attempt: 1,
            reason: SettleReason::Succeeded,
        },
    ) else {
        panic!()
    };
    assert_eq!(
        (s.captured_micro, s.refunded_micro, s.forfeited_micro),
        (credits(4), 0, credits(16))
    );
    assert_eq!(
        h.movements_since(mark),
        vec![("forfeited", PROMO, credits(16))]
    );
    assert_eq!(
        (
            h.bucket(PROMO).consumed,
            h.bucket(PROMO).expired,
            h.bucket(PROMO).remaining
        ),
        (credits(4), credits(21), 0)
    );
    // And the paid bucket was never touched.
    assert_eq!(h.bucket(PAID).remaining, credits(100));
    h.assert_audit_rebuilds_ledger();
}
