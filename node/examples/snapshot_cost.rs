//! What a snapshot of a busy shard costs, by part: the state is filled with the replicated
//! benchmark's traffic (hold → capture → release, 64 client streams, 512 commands per
//! entry), then cloned (what the snapshot builder does under the apply lock) and encoded
//! (what it does on its background thread).
//!
//! `cargo run --release -p allot-node --example snapshot_cost [-- COMMANDS]`
use allot_node::workload::{setup, HoldCycle};
use allot_statemachine::{apply, Config, Entry, State};
use std::time::Instant;

fn main() {
    let commands: usize = std::env::args()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(750_000);
    let mut state = State::new(Config::default());
    let (mut index, mut time_ms) = (1, 1_700_000_000_000u64);
    let first = Entry {
        log_index: index,
        logical_time_ms: time_ms,
        requests: setup(u64::MAX / 1_000_000),
    };
    apply(&mut state, &first).expect("setup applies");
    let mut streams: Vec<HoldCycle> = (0..64)
        .map(|w| HoldCycle::new((1 << 20) + w, 3_000_000))
        .collect();
    let mut done = 0;
    while done < commands {
        index += 1;
        time_ms += 1;
        let requests: Vec<_> = (0..512).map(|i| streams[i % 64].request()).collect();
        done += requests.len();
        let entry = Entry {
            log_index: index,
            logical_time_ms: time_ms,
            requests,
        };
        apply(&mut state, &entry).expect("in log order");
    }
    for round in 1..=2 {
        let t = Instant::now();
        let copy = state.clone();
        let whole = t.elapsed();
        let t = Instant::now();
        let idempotency = state.idempotency.clone();
        let idem = t.elapsed();
        let t = Instant::now();
        let ledger = state.ledger.clone();
        let led = t.elapsed();
        let t = Instant::now();
        let bytes = copy.encode().len();
        let encode = t.elapsed();
        drop((copy, idempotency, ledger));
        println!(
            "round {round}: {done} commands, {} idempotency records: clone {whole:?} \
             (idempotency {idem:?}, ledger {led:?}), encode {encode:?}, {bytes} bytes",
            state.idempotency.len()
        );
    }
}
