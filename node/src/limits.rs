//! Every bound the node enforces on what arrives from the network, by name. The state
//! machine's own bounds (tables, lists, one command's size) are in
//! `allot_statemachine::limits`; these bound what one call, one log entry and one peer
//! message may cost before anything is decoded or proposed. docs/DESIGN.md §43 has the
//! table: each limit, where it is checked, what the caller gets, what it costs at most.

use allot_statemachine::limits::COMMAND_BYTES_MAX;

/// One encoded request (codec bytes: version, actor, request id, command). Checked on
/// the bytes before the request is decoded.
pub const REQUEST_BYTES_MAX: usize = COMMAND_BYTES_MAX + 128;
/// Requests in one `Execute` call.
pub const REQUESTS_PER_CALL_MAX: usize = 4096;
/// One client message (`Execute`, `Query`, `Audit`, agent and admin calls): gRPC refuses
/// a larger message from its length prefix, before buffering it.
pub const CLIENT_MESSAGE_MAX: usize = 1 << 20;
/// Server reflection streams open at once on a node (each holds a slot for at most
/// `CLIENT_STREAM_LIFE_MAX`), and one reflection request's bound (a symbol
/// or file name): so the messages a reflection stream sends after its first cost at most
/// this many times this much.
pub const REFLECTION_STREAMS_MAX: usize = 16;
pub const REFLECTION_MESSAGE_MAX: usize = 64 << 10;
/// How long a client stream (server reflection) may stay open, idle or not: its request
/// and its response bodies end with `DEADLINE_EXCEEDED` then (`crate::admission`).
pub const CLIENT_STREAM_LIFE_MAX: std::time::Duration = std::time::Duration::from_secs(60);
/// One reply (a page of jobs or audit events, the node list): what the node encodes and
/// the client accepts.
pub const REPLY_MESSAGE_MAX: usize = 64 << 20;
/// A log entry's requests, encoded: the proposer closes a batch before it would pass
/// this (a single call larger than it — at most `CLIENT_MESSAGE_MAX` plus the actors the
/// edge stamps — goes alone).
pub const BATCH_BYTES_MAX: usize = 1 << 20;
/// Entries' bytes in one AppendEntries: the transport sends a prefix of the entries
/// openraft hands it and reports a partial success, so that one message always
/// completes well within the replication timeout (at least one entry is always sent).
pub const APPEND_BYTES_MAX: usize = 2 << 20;
/// Entries in one AppendEntries (openraft's `max_payload_entries`; a peer message with
/// more is refused while it is decoded, before the rest is allocated).
pub const APPEND_ENTRIES_MAX: usize = 64;
/// One Raft message on the wire (an AppendEntries of `APPEND_BYTES_MAX` plus one entry,
/// or a snapshot chunk); gRPC refuses a larger one from its length prefix.
pub const RAFT_MESSAGE_MAX: usize = 4 << 20;
/// One snapshot chunk's data.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;
/// Audit rows in one `Raft.AuditRows` answer (a replica filling the gap a snapshot
/// install left, `crate::audit_fill`): at least one row, more while they fit. A single
/// row larger than a Raft message is refused (`FAILED_PRECONDITION` `AUDIT_ROWS`).
pub const AUDIT_PAGE_BYTES: usize = 1 << 20;
/// A snapshot's declared size: what the state codec decodes at most (a larger one could
/// never be installed). Chunks arrive in order (each at the offset already received) and
/// go to a file under the data dir (`incoming/shard-N.snapshot`), so a snapshot being
/// received costs one chunk of memory and at most this much disk per shard.
pub const SNAPSHOT_BYTES_MAX: u64 = allot_statemachine::codec::DECODE_BYTES_MAX;
/// Terms and log indexes a peer may name. A real cluster never comes near (2^62 is an
/// election a millisecond for a hundred million years); a larger one is refused before
/// openraft sees it (openraft computes `term + 1` and `index + 1` without checking).
pub const TERM_MAX: u64 = 1 << 62;
/// The most shards (Raft groups) a cluster may have (`--shards`, and a restored backup's
/// shard count).
pub const SHARDS_MAX: u32 = 1024;
pub const INDEX_MAX: u64 = 1 << 62;
/// The peer link (`crate::link`, DESIGN §61), before anything else a connection sends
/// is read: its first bytes (the link's magic, or anything else for gRPC) within this
/// long, a part of the magic within `LINK_HELLO_TIMEOUT`.
pub const LINK_FIRST_BYTES_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// A TLS handshake on the node's listener (every connection of a node serving TLS,
/// gRPC or peer link; DESIGN §65) finishes within this long, or the connection is
/// dropped. It runs on the connection's own task, holding its connection slot.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The link's hello (magic and peer secret) and its answer within this long.
pub const LINK_HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Longest peer secret a link hello may carry: what gRPC's header bound lets a peer send,
/// so no secret that worked over gRPC is refused by the link.
pub const LINK_HELLO_SECRET_MAX: usize = HEADER_LIST_BYTES_MAX as usize;
/// Longest link frame either way after its length field: one Raft message and the
/// request header (id, kind, shard, timeout: 17 bytes). Checked before the body is read.
pub const LINK_FRAME_MAX: usize = RAFT_MESSAGE_MAX + 17;
/// Requests one link connection may have in handling at once; beyond it the connection
/// is not read until one is answered (back-pressure on the sender).
pub const LINK_REQUESTS_IN_FLIGHT_MAX: usize = 256;
/// A frame's rest, once its write began, is written within this long, or the connection
/// ends (a peer that stopped reading).
pub const LINK_REPLY_WRITE_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// Raft messages a node decodes and handles at once (all shards); more wait. Bounds the
/// memory of a burst of large peer messages to this many `RAFT_MESSAGE_MAX`.
pub const RAFT_MESSAGES_IN_FLIGHT_MAX: usize = 16;
/// Most events in one audit page, and most events one audit call looks at.
pub const AUDIT_PAGE_MAX: usize = 10_000;
pub const AUDIT_SCAN_MAX: usize = 100_000;
/// A tenant's audit page looks at most this many events of the shard-wide trail (it
/// reads only its own org's, but finds them among everyone's), and an org has at most
/// `AUDIT_SCANS_PER_ORG_MAX` such scans running on a node at once (one more is refused
/// `RESOURCE_EXHAUSTED` `AUDIT_BUSY` with a retry hint; its event streams wait their
/// turn): a tenant without events of its own cannot make the node decode the whole
/// trail over and over on its read budget.
pub const AUDIT_SCAN_MAX_TENANT: usize = 10_000;
pub const AUDIT_SCANS_PER_ORG_MAX: usize = 2;
/// How long a tenant's audit read waits for one of its org's scans to end before it is
/// refused `AUDIT_BUSY`.
pub const AUDIT_SCAN_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);
/// Concurrent server streams (`WatchEvents`, `WatchAssignments`) per principal (a
/// token's identity; an agent's node) on one node. An org's principals together are
/// also bounded by its quota's `streams_max` (admin-settable, default 64); the node by
/// `STREAMS_PER_NODE_MAX`.
pub const STREAMS_PER_PRINCIPAL_MAX: usize = 16;
pub const STREAMS_PER_NODE_MAX: usize = 4096;
/// Message bytes being read or handled at once (`crate::admission`), all client calls
/// together (typed API, admin, health, reflection) and all Raft messages together: a
/// call waits for its message's bytes at most `ADMISSION_WAIT_MAX`, then is refused
/// (`RESOURCE_EXHAUSTED`, `NODE_BUSY`). Separate, so a client flood never delays Raft.
pub const CLIENT_BYTES_IN_FLIGHT_MAX: usize = 64 << 20;
/// Encoded request bytes a shard's proposer holds queued (calls admitted and waiting to
/// be batched). The call's admission permit ends when its caller stops waiting (a
/// deadline, a cancel), but its requests stay queued until the proposer takes them:
/// this bounds them on their own. Beyond it callers are told to back off
/// (`RESOURCE_EXHAUSTED`, retried).
pub const PROPOSER_QUEUE_BYTES_MAX: usize = 64 << 20;
pub const RAFT_BYTES_IN_FLIGHT_MAX: usize = 16 * RAFT_MESSAGE_MAX;
pub const ADMISSION_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);
/// A call's message must arrive within this of the call (`DEADLINE_EXCEEDED`,
/// `SLOW_BODY`): a caller that trickles its body holds its bytes no longer.
pub const BODY_READ_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// Open connections per node (`--max-connections`). One past it takes the slot of a
/// connection that never authenticated, else of an authenticated one with no call open,
/// else is closed at once (`crate::connections`, DESIGN §66).
pub const CONNECTIONS_MAX: usize = 1024;
/// HTTP/2 flow-control windows the node grants: a connection holds at most
/// `CONNECTION_WINDOW_BYTES` that nothing has read yet (calls waiting for admission).
pub const CONNECTION_WINDOW_BYTES: u32 = 256 << 10;
pub const STREAM_WINDOW_BYTES: u32 = 256 << 10;
/// gRPC/HTTP2: concurrent calls per connection, and header bytes per request.
pub const CONCURRENT_STREAMS_PER_CONNECTION_MAX: u32 = 256;
pub const HEADER_LIST_BYTES_MAX: u32 = 16 << 10;
/// Edge denials kept per shard between two flushes into its audit trail (about a
/// second, `crate::auth::Denials`); of those, at most `DENIALS_PENDING_PER_CALLER_MAX`
/// of one resolved caller (an org, an agent node, an admin principal), and
/// `DENIALS_PENDING_UNRESOLVED_MAX` of every anonymous call together and as many of
/// every token that does not resolve (unknown, revoked, expired) together. Denials
/// past them are logged and counted, not audited: one org's, agent's or admin's flood
/// cannot crowd another caller's denials out of the trail, nor an anonymous flood a
/// revoked token's (a flood of made-up tokens still shares one share with them).
pub const DENIALS_PENDING_PER_SHARD_MAX: usize = 1024;
pub const DENIALS_PENDING_PER_CALLER_MAX: usize = 64;
pub const DENIALS_PENDING_UNRESOLVED_MAX: usize = 256;
