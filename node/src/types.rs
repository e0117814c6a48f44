//! The openraft type configuration of a shard: what a log entry carries and what applying
//! it answers.

use allot_statemachine::{Outcome, Request};
use serde::{Deserialize, Serialize};
use std::io::Cursor;

/// The application payload of one Raft log entry: a batch of client requests stamped by
/// the leader with the logical time. An empty batch is a tick (time advances, expiry and
/// leases fire, nothing else).
///
/// The requests travel and are stored as the state machine's codec bytes of
/// `Vec<Request>` (versioned), encoded once by the leader's proposer and decoded only by
/// apply: the log store and the Raft transport copy bytes instead of re-encoding every
/// request (and a peer's message costs memory in proportion to its bytes, not to how
/// many small objects they decode into).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub logical_time_ms: u64,
    #[serde(with = "serde_bytes")]
    pub requests: Vec<u8>,
}

impl Batch {
    pub fn new(logical_time_ms: u64, requests: &[Request]) -> Batch {
        Batch {
            logical_time_ms,
            requests: allot_statemachine::codec::encode(requests),
        }
    }

    /// The batch's requests. Every replica decodes the same bytes, so a batch that does
    /// not decode (only a faulty leader could propose one) is refused alike everywhere.
    pub fn decode(&self) -> Result<Vec<Request>, allot_statemachine::codec::CodecError> {
        allot_statemachine::codec::decode(&self.requests)
    }
}

/// What applying one entry answered: one outcome per request of the batch, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub log_index: u64,
    pub logical_time_ms: u64,
    pub outcomes: Vec<Outcome>,
}

openraft::declare_raft_types!(
    /// A shard's Raft types: node ids are u64, nodes are addressed by their gRPC endpoint.
    pub TypeConfig:
        D = Batch,
        R = Applied,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type NodeId = u64;
pub type ShardId = u32;
pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type LogEntry = openraft::Entry<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;
