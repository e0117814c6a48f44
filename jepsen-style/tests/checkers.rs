//! Each checker on hand-written histories: correct ones pass, broken ones fail with a
//! counter-example.

use allot_jepsen::history::{Op, OpType};
use allot_jepsen::workloads::{check, Workload};
use serde_json::{json, Value};

struct H(Vec<Op>);

impl H {
    fn new() -> H {
        H(Vec::new())
    }
    fn op(&mut self, process: i64, kind: OpType, f: &str, value: Value) -> &mut H {
        let index = self.0.len() as u64;
        self.0.push(Op {
            index,
            time_ns: index * 1000,
            process,
            kind,
            f: f.into(),
            value,
            node: None,
            error: None,
        });
        self
    }
    fn call(&mut self, p: i64, f: &str, v: Value, kind: OpType, done: Value) -> &mut H {
        self.op(p, OpType::Invoke, f, v);
        self.op(p, kind, f, done)
    }
}

fn verdict(ops: &[Op], w: Workload, name: &str) -> allot_jepsen::Verdict {
    check(w, ops)
        .into_iter()
        .find(|v| v.checker == name)
        .unwrap_or_else(|| panic!("no verdict {name}"))
}

// ------------------------------------------------------------------ register

#[test]
fn register_sequential_history_passes() {
    let mut h = H::new();
    h.call(
        0,
        "write",
        json!({"key": 11, "value": 5}),
        OpType::Ok,
        json!({"key": 11, "value": 5}),
    )
    .call(
        1,
        "read",
        json!({"key": 11}),
        OpType::Ok,
        json!({"key": 11, "answer": 5}),
    )
    .call(
        0,
        "write",
        json!({"key": 12, "value": 7}),
        OpType::Info,
        json!({"key": 12, "value": 7}),
    )
    .call(
        1,
        "read",
        json!({"key": 12}),
        OpType::Ok,
        json!({"key": 12, "answer": 0}),
    )
    .call(
        1,
        "read",
        json!({"key": 12}),
        OpType::Ok,
        json!({"key": 12, "answer": 7}),
    );
    let v = verdict(&h.0, Workload::Register, "register/linearizable");
    assert!(v.ok, "{v:?}");
}

#[test]
fn register_stale_read_fails() {
    let mut h = H::new();
    h.call(
        0,
        "write",
        json!({"key": 11, "value": 5}),
        OpType::Ok,
        json!({"key": 11, "value": 5}),
    )
    .call(
        0,
        "write",
        json!({"key": 11, "value": 6}),
        OpType::Ok,
        json!({"key": 11, "value": 6}),
    )
    .call(
        1,
        "read",
        json!({"key": 11}),
        OpType::Ok,
        json!({"key": 11, "answer": 5}),
    );
    let v = verdict(&h.0, Workload::Register, "register/linearizable");
    assert!(!v.ok, "{v:?}");
    assert!(v.detail.contains("key 11"), "{}", v.detail);
}

#[test]
fn register_value_that_appears_then_vanishes_fails() {
    // Concurrent write of 9 never acknowledged; one read sees it, a later read does not.
    let mut h = H::new();
    h.op(0, OpType::Invoke, "write", json!({"key": 13, "value": 9}));
    h.call(
        1,
        "read",
        json!({"key": 13}),
        OpType::Ok,
        json!({"key": 13, "answer": 9}),
    )
    .call(
        2,
        "read",
        json!({"key": 13}),
        OpType::Ok,
        json!({"key": 13, "answer": 0}),
    );
    let v = verdict(&h.0, Workload::Register, "register/linearizable");
    assert!(!v.ok, "{v:?}");
}

// ------------------------------------------------------------------ idempotency

fn idem_final(applied: Value, moved: u64) -> Value {
    json!({"applied": applied, "replays": 1, "totals": {"moved": moved, "consumed": 0}, "audit_events": 9})
}

#[test]
fn idempotency_consistent_retries_pass() {
    let mut h = H::new();
    let v = json!({"rid": "77", "amount": 1_000_000});
    let done =
        json!({"rid": "77", "amount": 1_000_000, "outcome": "Ok(Transferred { buckets: [] })"});
    h.call(0, "transfer", v.clone(), OpType::Ok, done.clone())
        .call(0, "transfer", v, OpType::Ok, done)
        .call(
            -2,
            "final",
            json!({}),
            OpType::Ok,
            idem_final(json!({"77": 1}), 1_000_000),
        );
    for v in check(Workload::Idempotency, &h.0) {
        assert!(v.ok, "{v:?}");
    }
}

#[test]
fn idempotency_retry_with_a_different_outcome_fails() {
    let mut h = H::new();
    let v = json!({"rid": "78", "amount": 100_000});
    h.call(0, "capture", v.clone(), OpType::Ok,
            json!({"rid": "78", "outcome": "Ok(Captured { captured_micro: 100000, held_micro: 900000 })"}))
        .call(0, "capture", v, OpType::Ok,
            json!({"rid": "78", "outcome": "Ok(Captured { captured_micro: 100000, held_micro: 800000 })"}))
        .call(-2, "final", json!({}), OpType::Ok, idem_final(json!({"78": 1}), 0));
    let v = verdict(
        &h.0,
        Workload::Idempotency,
        "idempotency/every-retry-gets-the-first-outcome",
    );
    assert!(!v.ok && v.detail.contains("78"), "{v:?}");
}

#[test]
fn idempotency_id_applied_twice_fails() {
    let mut h = H::new();
    let v = json!({"rid": "79", "amount": 1_000_000});
    let done =
        json!({"rid": "79", "amount": 1_000_000, "outcome": "Ok(Transferred { buckets: [] })"});
    h.call(0, "transfer", v, OpType::Ok, done).call(
        -2,
        "final",
        json!({}),
        OpType::Ok,
        idem_final(json!({"79": 2}), 2_000_000),
    );
    let v = verdict(
        &h.0,
        Workload::Idempotency,
        "idempotency/each-id-applied-at-most-once",
    );
    assert!(!v.ok && v.detail.contains("applied 2 times"), "{v:?}");
    let v = verdict(
        &h.0,
        Workload::Idempotency,
        "idempotency/transfers-counted-once",
    );
    assert!(!v.ok, "{v:?}");
}

// ------------------------------------------------------------------ ledger-bank

fn bal(avail: u64, held: u64, consumed: u64, issued: u64, moved_in: u64, moved_out: u64) -> Value {
    json!({"available": avail, "held": held, "consumed": consumed, "expired": 0,
           "issued": issued, "moved_in": moved_in, "moved_out": moved_out})
}

const I: u64 = 1_000_000_000;

fn bank_final(b: [Value; 3], issued: u64, moved: u64, consumed: u64, late: Value) -> Value {
    json!({"balances": {"org:1": b[0], "project:11": b[1], "project:12": b[2]},
           "totals": {"issued": issued, "consumed": consumed, "expired": 0, "moved": moved},
           "late_spends": late, "audit_events": 10, "expiring_buckets": 1})
}

fn bank_history(read: Value, fin: Value) -> Vec<Op> {
    let mut h = H::new();
    h.call(
        0,
        "transfer",
        json!({"from": "org:1", "to": "project:11", "amount": 5}),
        OpType::Ok,
        json!({}),
    )
    .call(
        1,
        "read",
        json!({"account": "project:11"}),
        OpType::Ok,
        json!({"account": "project:11", "answer": read}),
    )
    .call(
        1,
        "totals",
        json!({}),
        OpType::Ok,
        json!({"answer": {"issued": 3 * I, "consumed": 0, "expired": 0, "moved": 5}}),
    )
    .call(-2, "final", json!({}), OpType::Ok, fin);
    h.0
}

fn good_final() -> Value {
    bank_final(
        [
            bal(I - 5, 0, 0, I, 0, 5),
            bal(I + 5, 0, 0, I, 5, 0),
            bal(I, 0, 0, I, 0, 0),
        ],
        3 * I,
        5,
        0,
        json!([]),
    )
}

#[test]
fn bank_correct_history_passes() {
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), good_final());
    for v in check(Workload::LedgerBank, &ops) {
        assert!(v.ok, "{v:?}");
    }
}

#[test]
fn bank_conservation_break_at_a_read_fails() {
    // One credit appeared from nowhere.
    let ops = bank_history(bal(I + 6, 0, 0, I, 5, 0), good_final());
    let v = verdict(
        &ops,
        Workload::LedgerBank,
        "bank/conservation-at-every-read",
    );
    assert!(!v.ok, "{v:?}");
}

#[test]
fn bank_read_that_is_not_a_balance_fails() {
    // An unexpected answer (recorded as text) must not pass as 0 = 0.
    let ops = bank_history(json!("Balance(None)"), good_final());
    let v = verdict(
        &ops,
        Workload::LedgerBank,
        "bank/conservation-at-every-read",
    );
    assert!(!v.ok, "{v:?}");
    // Nor a read missing one figure.
    let mut partial = bal(I + 5, 0, 0, I, 5, 0);
    partial.as_object_mut().unwrap().remove("moved_out");
    let ops = bank_history(partial, good_final());
    let v = verdict(
        &ops,
        Workload::LedgerBank,
        "bank/conservation-at-every-read",
    );
    assert!(!v.ok, "{v:?}");
}

#[test]
fn bank_transfer_applied_twice_fails() {
    let fin = bank_final(
        [
            bal(I - 10, 0, 0, I, 0, 10),
            bal(I + 10, 0, 0, I, 10, 0),
            bal(I, 0, 0, I, 0, 0),
        ],
        3 * I,
        10,
        0,
        json!([]),
    );
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), fin);
    let v = verdict(
        &ops,
        Workload::LedgerBank,
        "bank/each-operation-applied-once",
    );
    assert!(!v.ok && v.detail.contains("moved"), "{v:?}");
}

#[test]
fn bank_final_conservation_break_fails() {
    let fin = bank_final(
        [
            bal(I - 5, 0, 0, I, 0, 5),
            bal(I + 5, 0, 0, I, 5, 0),
            bal(I, 0, 0, I, 0, 0),
        ],
        3 * I + 1,
        5,
        0,
        json!([]),
    );
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), fin);
    let v = verdict(&ops, Workload::LedgerBank, "bank/final-conservation");
    assert!(!v.ok, "{v:?}");
}

#[test]
fn bank_counters_that_cycle_past_issued_pass_and_a_wrapped_balance_fails() {
    // Found by jepsen long seed 8924: money moved out of and back into the
    // org many times, so its cumulative moved_out exceeded all credit ever
    // issued. That is legal; a counter above totals.moved is not, nor is a
    // balance above totals.issued.
    let cycled = 4 * I;
    let fin = |org_avail: u64| {
        bank_final(
            [
                bal(org_avail, 0, 0, I, cycled - 5, cycled),
                bal(I + 5, 0, 0, I, cycled, cycled - 5),
                bal(I, 0, 0, I, 0, 0),
            ],
            3 * I,
            2 * cycled - 5,
            0,
            json!([]),
        )
    };
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), fin(I - 5));
    let v = verdict(&ops, Workload::LedgerBank, "bank/no-negative-balance");
    assert!(v.ok, "{v:?}");
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), fin(u64::MAX - 4));
    let v = verdict(&ops, Workload::LedgerBank, "bank/no-negative-balance");
    assert!(!v.ok && v.detail.contains("available"), "{v:?}");
}

#[test]
fn bank_spend_of_expired_credit_fails() {
    let late = json!([{"seq": 3, "bucket": 10000001, "time_ms": 2000, "expires_at_ms": 1500, "amount": 1}]);
    let fin = bank_final(
        [
            bal(I - 5, 0, 0, I, 0, 5),
            bal(I + 5, 0, 0, I, 5, 0),
            bal(I, 0, 0, I, 0, 0),
        ],
        3 * I,
        5,
        0,
        late,
    );
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), fin);
    let v = verdict(
        &ops,
        Workload::LedgerBank,
        "bank/no-spend-of-expired-credit",
    );
    assert!(!v.ok, "{v:?}");
}

// ------------------------------------------------------------------ scheduler

fn sched_final(jobs: Value, finals: Value) -> Value {
    json!({"jobs": jobs, "final_transitions": finals, "late_captures": [], "audit_events": 5})
}

#[test]
fn scheduler_correct_history_passes() {
    let mut h = H::new();
    h.call(
        0,
        "submit",
        json!({"job": 1, "gpus": 2}),
        OpType::Ok,
        json!({}),
    )
    .call(
        101,
        "assignments",
        json!({"node": 1}),
        OpType::Ok,
        json!({"node": 1, "answer": [[1, 1, [0, 1], "Running"], [2, 1, [2], "Placed"]]}),
    )
    .call(
        101,
        "job-heartbeat",
        json!({"job": 1, "attempt": 1}),
        OpType::Ok,
        json!({"reply": {"accepted": true}}),
    )
    .call(
        -2,
        "final",
        json!({}),
        OpType::Ok,
        sched_final(json!({"1": ["Succeeded", 1, true]}), json!({"1": 1})),
    );
    for v in check(Workload::Scheduler, &h.0) {
        assert!(v.ok, "{v:?}");
    }
}

#[test]
fn scheduler_gpu_held_twice_fails() {
    let mut h = H::new();
    h.call(
        101,
        "assignments",
        json!({"node": 1}),
        OpType::Ok,
        json!({"node": 1, "answer": [[1, 1, [0, 1], "Running"], [2, 1, [1], "Placed"]]}),
    )
    .call(
        -2,
        "final",
        json!({}),
        OpType::Ok,
        sched_final(json!({}), json!({})),
    );
    let v = verdict(
        &h.0,
        Workload::Scheduler,
        "scheduler/no-gpu-allocated-twice",
    );
    assert!(!v.ok && v.detail.contains("GPU 1"), "{v:?}");
}

#[test]
fn scheduler_stale_attempt_accepted_fails() {
    let mut h = H::new();
    h.call(
        101,
        "job-heartbeat",
        json!({"job": 5, "attempt": 2}),
        OpType::Ok,
        json!({"reply": {"accepted": true}}),
    )
    .call(
        102,
        "job-heartbeat",
        json!({"job": 5, "attempt": 1}),
        OpType::Ok,
        json!({"reply": {"accepted": true}}),
    )
    .call(
        -2,
        "final",
        json!({}),
        OpType::Ok,
        sched_final(json!({}), json!({})),
    );
    let v = verdict(
        &h.0,
        Workload::Scheduler,
        "scheduler/no-job-running-under-two-attempts",
    );
    assert!(!v.ok, "{v:?}");
}

#[test]
fn scheduler_lost_submit_and_double_settlement_fail() {
    let mut h = H::new();
    h.call(
        0,
        "submit",
        json!({"job": 1, "gpus": 1}),
        OpType::Ok,
        json!({}),
    )
    .call(
        0,
        "submit",
        json!({"job": 2, "gpus": 1}),
        OpType::Ok,
        json!({}),
    )
    .call(
        -2,
        "final",
        json!({}),
        OpType::Ok,
        sched_final(json!({"2": ["Succeeded", 1, true]}), json!({"2": 2})),
    );
    let v = verdict(
        &h.0,
        Workload::Scheduler,
        "scheduler/every-acknowledged-submit-present",
    );
    assert!(!v.ok && v.detail.contains("job 1"), "{v:?}");
    let v = verdict(
        &h.0,
        Workload::Scheduler,
        "scheduler/every-settled-job-charged-once",
    );
    assert!(!v.ok && v.detail.contains("2 final transitions"), "{v:?}");
}

#[test]
fn history_round_trips_through_json_lines() {
    let ops = bank_history(bal(I + 5, 0, 0, I, 5, 0), good_final());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.jsonl");
    let text: String = ops
        .iter()
        .map(|o| serde_json::to_string(o).unwrap() + "\n")
        .collect();
    std::fs::write(&path, text).unwrap();
    let back = allot_jepsen::history::read_jsonl(&path).unwrap();
    assert_eq!(back.len(), ops.len());
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains("\"type\":\"invoke\""));
}
