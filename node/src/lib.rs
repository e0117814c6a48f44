//! `allot-node`: hosts many shards (openraft groups) whose state machine is
//! [`allot_statemachine`], on one RocksDB, behind one gRPC listener.
//!
//! Code map: [`types`] (openraft type config), [`store`] (RocksDB log and state-machine
//! storage), [`network`] (Raft over gRPC), [`clock`] (logical time), [`proposer`]
//! (batching), [`node`] (the shards of a process), [`server`] (gRPC services),
//! [`auth`] (credentials at the edge), [`ratelimit`] (edge protection), [`metrics`], [`serve`].

pub mod admission;
pub mod api;
pub mod audit_fill;
pub mod auth;
pub mod backup;
#[cfg(feature = "chaos")]
pub mod chaos;
pub mod clock;
pub mod connections;
pub mod decoded;
pub mod disk;
pub mod edge;
pub mod identity;
pub mod limits;
pub mod link;
pub mod local_cluster;
pub mod metrics;
pub mod network;
pub mod node;
pub mod peer;
pub mod proposer;
pub mod ratelimit;
pub mod rejoin;
pub mod serve;
pub mod server;
pub mod store;
pub mod tls;
pub mod transfer;
pub mod types;
pub mod versions;
pub mod workload;

pub use allot_statemachine as statemachine;
