//! `allot-node`: hosts shards (Raft groups) whose state machine is
//! [`allot_statemachine`]. Only this crate will know RocksDB, tokio and the network.
pub use allot_statemachine as statemachine;
