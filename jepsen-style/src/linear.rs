//! A linearizability checker for a read/write register, after Wing & Gong with Lowe's
//! memoisation (the algorithm of Knossos' `wgl` and Porcupine): depth-first search over
//! the history's call/return list, linearizing calls whose effect is consistent with
//! the model, backtracking at a return whose call is not yet linearized, and caching
//! (linearized set, state) pairs already explored.
//!
//! Operations whose outcome is unknown (`info`) get a return at the end of time: they
//! may take effect at any point after their call, or (for a write) never — being
//! linearized last, after every other operation, is equivalent to never.

use std::collections::HashSet;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegOp {
    Write(u64),
    /// The value read (0: no value written yet).
    Read(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub op: RegOp,
    /// Invocation and completion positions in the history (completion `None`: unknown).
    pub invoke: u64,
    pub complete: Option<u64>,
    /// The history index of the invocation, for counter-examples.
    pub id: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Linearizable,
    /// No linearization: the search could not get past this operation's return, after
    /// linearizing at most `linearized` operations.
    NotLinearizable {
        stuck_at: Call,
        linearized: usize,
    },
    /// Search budget exhausted: neither proven nor refuted.
    Unknown {
        explored: u64,
    },
}

#[derive(Clone, Copy)]
struct Entry {
    call: usize,
    is_return: bool,
    prev: usize,
    next: usize,
    /// For a call entry: its return entry.
    match_: usize,
}

const HEAD: usize = 0;

/// Checks one register's history (initial value `init`). `budget` bounds the number
/// of search steps.
pub fn check_register(init: u64, calls: &[Call], budget: u64) -> Outcome {
    // Events: (position, is_return, call); returns of unknown calls at the end.
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(calls.len() * 2);
    for (i, c) in calls.iter().enumerate() {
        events.push((c.invoke, false, i));
        events.push((c.complete.unwrap_or(u64::MAX), true, i));
    }
    // At the same position, returns after calls (positions are distinct in practice).
    events.sort_by_key(|e| (e.0, e.1, e.2));
    let n = events.len();
    // Entry 0 is the list head; events are entries 1..=n.
    let mut list: Vec<Entry> = Vec::with_capacity(n + 1);
    list.push(Entry {
        call: usize::MAX,
        is_return: false,
        prev: HEAD,
        next: if n > 0 { 1 } else { usize::MAX },
        match_: 0,
    });
    let mut ret_of = vec![0usize; calls.len()];
    for (k, e) in events.iter().enumerate() {
        list.push(Entry {
            call: e.2,
            is_return: e.1,
            prev: k,
            next: if k + 1 < n { k + 2 } else { usize::MAX },
            match_: 0,
        });
        if e.1 {
            ret_of[e.2] = k + 1;
        }
    }
    for k in 1..=n {
        if !list[k].is_return {
            list[k].match_ = ret_of[list[k].call];
        }
    }
    let words = calls.len().div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Vec<u64>, u64)> = HashSet::new();
    let mut stack: Vec<(usize, u64)> = Vec::new(); // (call entry, state before)
    let mut state = init;
    let mut entry = list[HEAD].next;
    let mut steps = 0u64;
    let mut best = 0usize;
    let mut stuck: Option<Call> = None;

    let lift = |list: &mut Vec<Entry>, e: usize| {
        let (p, nx) = (list[e].prev, list[e].next);
        list[p].next = nx;
        if nx != usize::MAX {
            list[nx].prev = p;
        }
        let r = list[e].match_;
        let (rp, rn) = (list[r].prev, list[r].next);
        list[rp].next = rn;
        if rn != usize::MAX {
            list[rn].prev = rp;
        }
    };
    let unlift = |list: &mut Vec<Entry>, e: usize| {
        let r = list[e].match_;
        let (rp, rn) = (list[r].prev, list[r].next);
        list[rp].next = r;
        if rn != usize::MAX {
            list[rn].prev = r;
        }
        let (p, nx) = (list[e].prev, list[e].next);
        list[p].next = e;
        if nx != usize::MAX {
            list[nx].prev = e;
        }
    };

    loop {
        if list[HEAD].next == usize::MAX {
            return Outcome::Linearizable;
        }
        steps += 1;
        if steps > budget {
            return Outcome::Unknown { explored: steps };
        }
        if entry == usize::MAX {
            // Cannot happen: a return always ends the list of remaining events.
            return Outcome::Unknown { explored: steps };
        }
        let e = list[entry];
        if !e.is_return {
            let c = calls[e.call];
            let next_state = match c.op {
                RegOp::Write(v) => Some(v),
                RegOp::Read(v) => (v == state).then_some(state),
            };
            if let Some(ns) = next_state {
                let (w, b) = (e.call / 64, e.call % 64);
                linearized[w] |= 1 << b;
                if cache.insert((linearized.clone(), ns)) {
                    stack.push((entry, state));
                    state = ns;
                    lift(&mut list, entry);
                    entry = list[HEAD].next;
                    if stack.len() > best {
                        best = stack.len();
                    }
                    continue;
                }
                linearized[w] &= !(1 << b);
            }
            entry = e.next;
        } else {
            // A return whose call is not linearized: backtrack.
            if stuck.is_none() || stack.len() >= best {
                stuck = Some(calls[e.call]);
            }
            let Some((call_entry, before)) = stack.pop() else {
                return Outcome::NotLinearizable {
                    stuck_at: stuck.unwrap_or(calls[e.call]),
                    linearized: best,
                };
            };
            let ci = list[call_entry].call;
            linearized[ci / 64] &= !(1 << (ci % 64));
            state = before;
            unlift(&mut list, call_entry);
            entry = list[call_entry].next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: RegOp, invoke: u64, complete: Option<u64>) -> Call {
        Call {
            op,
            invoke,
            complete,
            id: invoke,
        }
    }

    #[test]
    fn sequential_history_is_linearizable() {
        let h = [
            call(RegOp::Write(1), 0, Some(1)),
            call(RegOp::Read(1), 2, Some(3)),
            call(RegOp::Write(2), 4, Some(5)),
            call(RegOp::Read(2), 6, Some(7)),
        ];
        assert_eq!(check_register(0, &h, 1 << 20), Outcome::Linearizable);
    }

    #[test]
    fn concurrent_reads_may_see_either_value() {
        let h = [
            call(RegOp::Write(1), 0, Some(10)),
            call(RegOp::Read(0), 1, Some(2)),
            call(RegOp::Read(1), 3, Some(4)),
            call(RegOp::Read(1), 11, Some(12)),
        ];
        assert_eq!(check_register(0, &h, 1 << 20), Outcome::Linearizable);
    }

    #[test]
    fn stale_read_after_acknowledged_write_is_not_linearizable() {
        let h = [
            call(RegOp::Write(1), 0, Some(1)),
            call(RegOp::Read(0), 2, Some(3)),
        ];
        assert!(matches!(
            check_register(0, &h, 1 << 20),
            Outcome::NotLinearizable { .. }
        ));
    }

    #[test]
    fn unknown_write_may_or_may_not_happen() {
        let h = [
            call(RegOp::Write(1), 0, None),
            call(RegOp::Read(0), 2, Some(3)),
            call(RegOp::Read(1), 4, Some(5)),
        ];
        assert_eq!(check_register(0, &h, 1 << 20), Outcome::Linearizable);
        // But once read, the value cannot vanish.
        let h = [
            call(RegOp::Write(1), 0, None),
            call(RegOp::Read(1), 2, Some(3)),
            call(RegOp::Read(0), 4, Some(5)),
        ];
        assert!(matches!(
            check_register(0, &h, 1 << 20),
            Outcome::NotLinearizable { .. }
        ));
    }
}
