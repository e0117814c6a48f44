//! Test-only fault switches, compiled only with the cargo feature `chaos` (off by
//! default, so release builds do not contain them). They exist so the fault-injection
//! harness (`jepsen-style/`) can show that its checkers catch a broken node.

use allot_statemachine::Request;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// `--chaos-skip-idempotency`: every request id is replaced by a fresh one before it is
/// proposed, so a client's retry is applied again instead of being answered from the
/// idempotency table.
pub static SKIP_IDEMPOTENCY: AtomicBool = AtomicBool::new(false);

static COUNTER: AtomicU64 = AtomicU64::new(1);

pub fn rewrite_request_ids(requests: &mut [Request]) {
    if !SKIP_IDEMPOTENCY.load(Ordering::Relaxed) {
        return;
    }
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    for r in requests {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        // High bit set: never collides with the client library's ids in practice.
        r.request_id = (1u128 << 127) | (u128::from(salt) << 64) | u128::from(n);
    }
}
