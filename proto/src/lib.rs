//! `allot-proto`: the wire contract of allot — the typed client and agent API
//! (`proto/allot_api.proto`), the admin API and the internal Raft transport
//! (`proto/allot.proto`) — generated at build time with `protox` (pure Rust, no system
//! `protoc`) and `tonic-prost-build`.

#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("allot.v1");
}

pub use v1::*;

/// The typed, language-neutral API (`proto/allot_api.proto`).
pub mod api {
    pub mod v1 {
        tonic::include_proto!("allot.api.v1");
    }
}

/// Conversions between the typed API's messages and the state machine's types.
pub mod typed;

/// Every service's file descriptors (for gRPC server reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("allot_descriptor");

/// gRPC metadata keys of allot's wire contract (shared by node and client).
pub mod meta {
    /// Marks a request another node already forwarded (one hop at most).
    pub const FORWARDED: &str = "allot-forwarded";
    /// On a NotLeader (`UNAVAILABLE`) answer: the leader's node id and address, if known.
    pub const LEADER_ID: &str = "allot-leader-id";
    /// Also on a successful reply (response headers) from a replica that does not lead
    /// the call's shard — it forwarded the call, or answered a stale read itself — so
    /// the client's next call goes to the leader, not through it again.
    pub const LEADER_ADDR: &str = "allot-leader-addr";
    /// On a `RESOURCE_EXHAUSTED` answer: when to retry, in milliseconds.
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
    /// The caller's API token: `authorization: Bearer <token>`.
    pub const AUTHORIZATION: &str = "authorization";
    /// On a refusal: its machine-readable reason (`INVALID_GPU_TYPE`, `RATE_LIMITED`,
    /// `UNAUTHENTICATED`, ...): the state machine's `CommandError::reason` names, or an
    /// edge reason.
    pub const REASON: &str = "allot-reason";
    /// On a request refused by the state machine's validation at the edge: the index of
    /// the request in the call, and its `CommandError` as JSON (the typed API's
    /// `Error.details_json`).
    pub const REQUEST_INDEX: &str = "allot-request-index";
    pub const ERROR_JSON: &str = "allot-error-json-bin";
}

/// The shard directory: an organisation's home shard. Tenants' commands and queries go
/// to this shard; a shard's GPU pool serves only the jobs of the orgs it is home to.
pub fn shard_of_org(org: u64, shards: u32) -> u32 {
    (org % u64::from(shards.max(1))) as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_org_has_one_home_shard_in_range() {
        for shards in [1u32, 2, 4, 7] {
            for org in [0u64, 1, 2, 3, 1_000_003, u64::MAX] {
                let s = super::shard_of_org(org, shards);
                assert!(s < shards);
                assert_eq!(s, super::shard_of_org(org, shards));
            }
        }
        assert_eq!(super::shard_of_org(5, 0), 0);
    }
}
