//! Read queries against a shard's applied state. Sent as codec bytes in `QueryRequest`;
//! answered from the replica's state after the consistency the caller asked for.

use allot_statemachine::ledger::{Balance, Totals};
use allot_statemachine::scheduler::{Job, JobState};
use allot_statemachine::{check_invariants, Account, JobId, NodeId, State, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Query {
    /// Balance of an account with the buckets expiring within `horizon_ms`.
    Balance {
        account: Account,
        horizon_ms: u64,
    },
    Job(JobId),
    /// The jobs placed on a GPU node: (job, attempt, GPU indices, state).
    Assignments(NodeId),
    QueueDepth,
    Totals,
    /// Runs the state machine's invariant check (conservation included) on this replica.
    Invariants,
    /// SHA-256 of the canonical state encoding.
    StateHash,
    /// GPUs of the shard's pool: (registered, allocated).
    Fleet,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Balance(Option<Balance>),
    Job(Option<Box<Job>>),
    Assignments(Vec<(JobId, u32, Vec<u8>, JobState)>),
    QueueDepth(BTreeMap<Tier, usize>),
    Totals(Totals),
    Invariants(Result<(), String>),
    StateHash([u8; 32]),
    Fleet { gpus: u32, used: u32 },
}

pub fn answer(state: &State, q: &Query) -> Answer {
    match q {
        Query::Balance {
            account,
            horizon_ms,
        } => Answer::Balance(state.ledger.balance(*account, state.time_ms, *horizon_ms)),
        Query::Job(id) => Answer::Job(state.scheduler.job(*id).cloned().map(Box::new)),
        Query::Assignments(node) => Answer::Assignments(state.scheduler.assignments(*node)),
        Query::QueueDepth => Answer::QueueDepth(state.scheduler.queue_depth()),
        Query::Totals => Answer::Totals(state.ledger.totals),
        Query::Invariants => Answer::Invariants(check_invariants(state).map_err(|v| v.to_string())),
        Query::StateHash => Answer::StateHash(state.state_hash()),
        Query::Fleet => Answer::Fleet {
            gpus: state.scheduler.fleet_gpus,
            used: state.scheduler.used_gpus,
        },
    }
}
