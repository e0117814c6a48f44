//! The Raft transport: openraft's RPCs over the node's gRPC `Raft` service. One HTTP/2
//! channel per peer address is shared by every shard; each message names its shard.
//!
//! Payloads are the state machine's versioned codec (a format-version byte, then varint
//! bincode: an empty string costs one byte, not eight), of allot's own wire forms of
//! openraft's messages ([`AppendWire`], [`SnapshotChunk`]) and of openraft's vote and
//! result types. What a peer sends is bounded before and while it is decoded and checked
//! by [`crate::peer`] before openraft sees it; what a peer answers is checked the same
//! way before it is returned to openraft.

use crate::limits::{APPEND_BYTES_MAX, APPEND_ENTRIES_MAX, RAFT_MESSAGE_MAX, SNAPSHOT_CHUNK_BYTES};
use crate::link::LinkError;
use crate::peer::{self, PeerCredential};
use crate::types::{LogEntry, LogId, NodeId, ShardId, SnapshotMeta, TypeConfig, Vote};
use allot_proto::raft_client::RaftClient;
use allot_proto::RaftMessage;
use allot_statemachine::codec;
use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed,
    StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Snapshot};
use serde::de::{DeserializeOwned, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// Lazily connected channels, one per peer address.
#[derive(Default)]
pub struct Channels {
    map: Mutex<HashMap<String, Channel>>,
    /// Peer routes (`--peer-route ADDR=VIA`): a peer advertised at `ADDR` is dialled at
    /// `VIA` instead (e.g. through a test proxy). The map is keyed by the advertised
    /// address either way, so Raft, forwarding and clock sampling all follow the route.
    routes: HashMap<String, String>,
    /// Dial peers over TLS (presenting this node's certificate) when set.
    tls: Option<ClientTlsConfig>,
    /// What this node presents to its peers (the peer secret, when configured).
    pub credential: PeerCredential,
    /// The peer links (`crate::link`), when this node dials them (not `--peer-link off`).
    links: Option<crate::link::Links>,
}

impl Channels {
    pub fn new(
        routes: HashMap<String, String>,
        tls: Option<&crate::tls::Tls>,
        credential: PeerCredential,
        link: bool,
    ) -> Channels {
        Channels {
            map: Mutex::default(),
            links: link.then(|| crate::link::Links::new(tls.map(|t| t.link.clone()))),
            routes,
            tls: tls.map(|t| t.client.clone()),
            credential,
        }
    }

    /// The peer link to `addr` (dialled at its route), if this node uses links.
    pub fn link(&self, addr: &str) -> Option<Arc<crate::link::Link>> {
        let links = self.links.as_ref()?;
        Some(links.get(addr, self.route(addr), &self.credential))
    }

    /// The address actually dialled for a peer advertised at `addr`.
    pub fn route<'a>(&'a self, addr: &'a str) -> &'a str {
        self.routes.get(addr).map_or(addr, String::as_str)
    }

    pub fn get(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let dial = self.route(addr);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{dial}"))?;
        if let Some(tls) = &self.tls {
            ep = ep.tls_config(tls.clone())?;
        }
        let ch = ep
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .connect_lazy();
        map.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }

    /// A Raft-service client for `addr` with the Raft message bounds.
    pub fn raft_client(&self, addr: &str) -> Result<RaftClient<Channel>, tonic::transport::Error> {
        Ok(RaftClient::new(self.get(addr)?)
            .max_decoding_message_size(RAFT_MESSAGE_MAX)
            .max_encoding_message_size(RAFT_MESSAGE_MAX))
    }

    /// A request to a peer, carrying this node's peer credential.
    pub fn peer_request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        self.credential.attach(r.metadata_mut());
        r
    }
}

/// openraft's `AppendEntriesRequest` on the wire. The entries' count is bounded while
/// they are decoded ([`APPEND_ENTRIES_MAX`]): a message of many tiny entries is refused
/// before they are all allocated.
#[derive(Serialize, Deserialize)]
pub struct AppendWire {
    pub vote: Vote,
    pub prev_log_id: Option<LogId>,
    pub leader_commit: Option<LogId>,
    #[serde(deserialize_with = "bounded_entries")]
    pub entries: Vec<LogEntry>,
}

impl From<AppendWire> for AppendEntriesRequest<TypeConfig> {
    fn from(w: AppendWire) -> Self {
        AppendEntriesRequest {
            vote: w.vote,
            prev_log_id: w.prev_log_id,
            entries: w.entries,
            leader_commit: w.leader_commit,
        }
    }
}

fn bounded_entries<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<LogEntry>, D::Error> {
    struct Bounded;
    impl<'de> Visitor<'de> for Bounded {
        type Value = Vec<LogEntry>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "at most {APPEND_ENTRIES_MAX} log entries")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            if seq.size_hint().is_some_and(|n| n > APPEND_ENTRIES_MAX) {
                return Err(serde::de::Error::custom(format!(
                    "more than {APPEND_ENTRIES_MAX} entries in one AppendEntries"
                )));
            }
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
            while let Some(e) = seq.next_element()? {
                if out.len() == APPEND_ENTRIES_MAX {
                    return Err(serde::de::Error::custom("too many entries"));
                }
                out.push(e);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded)
}

/// One chunk of a snapshot on the wire. Unlike openraft's chunk it declares the
/// snapshot's whole size, so the receiver checks every chunk against it (and a bound)
/// before it keeps any of it.
#[derive(Serialize, Deserialize)]
pub struct SnapshotChunk {
    pub vote: Vote,
    pub meta: SnapshotMeta,
    pub total_bytes: u64,
    pub offset: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl SnapshotChunk {
    pub fn done(&self) -> bool {
        self.offset + self.data.len() as u64 == self.total_bytes
    }
}

/// The network of one shard.
#[derive(Clone)]
pub struct Network {
    pub shard: ShardId,
    /// This node (answers are checked against it: no peer may vote in its name).
    pub me: NodeId,
    pub channels: Arc<Channels>,
    /// The shard's `allot_peer_append_seconds`: each AppendEntries' round trip.
    pub append_rtt: prometheus::Histogram,
    /// `allot_peer_rpcs_total{transport}`: the peer calls this node sent, by transport.
    pub sent: prometheus::IntCounterVec,
}

pub struct Peer {
    shard: ShardId,
    me: NodeId,
    target: NodeId,
    client: Option<RaftClient<Channel>>,
    addr: String,
    channels: Arc<Channels>,
    /// The highest log id the peer acknowledged, and under which vote (a peer that
    /// later reports a conflict at or below it is lying or broken).
    acked: Option<(Vote, LogId)>,
    append_rtt: prometheus::Histogram,
    /// The peer link, when this node uses links (gRPC otherwise, and for a peer that
    /// does not speak it).
    link: Option<Arc<crate::link::Link>>,
    sent_link: prometheus::IntCounter,
    sent_grpc: prometheus::IntCounter,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Peer {
        Peer {
            shard: self.shard,
            me: self.me,
            target,
            client: self.channels.raft_client(&node.addr).ok(),
            addr: node.addr.clone(),
            channels: self.channels.clone(),
            acked: None,
            append_rtt: self.append_rtt.clone(),
            link: self.channels.link(&node.addr),
            sent_link: self.sent.with_label_values(&["link"]),
            sent_grpc: self.sent.with_label_values(&["grpc"]),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

fn unreachable<E: std::error::Error>(e: &str) -> RPCError<NodeId, openraft::BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&TransportError(e.to_string())))
}

fn network<E: std::error::Error>(e: &str) -> RPCError<NodeId, openraft::BasicNode, E> {
    RPCError::Network(NetworkError::new(&TransportError(e.to_string())))
}

use crate::link::Kind as Rpc;

/// A failed call to a peer, before it is typed for the openraft method that made it.
enum CallError {
    Unreachable(String),
    Network(String),
}

impl CallError {
    /// A peer's (or the transport's) error status, as either transport reports it.
    fn status(target: NodeId, status: tonic::Status) -> CallError {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown => {
                CallError::Unreachable(status.message().to_string())
            }
            _ => CallError::Network(format!("{target}: {}", status.message())),
        }
    }

    fn rpc<E: std::error::Error>(self) -> RPCError<NodeId, openraft::BasicNode, E> {
        match self {
            CallError::Unreachable(m) => unreachable(&m),
            CallError::Network(m) => network(&m),
        }
    }
}

impl Peer {
    /// Sends one message and decodes the peer's `Result<Resp, RaftError<E>>`.
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        timeout: Duration,
    ) -> Result<Result<Resp, RaftError<NodeId, E>>, CallError>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let payload = codec::encode(req);
        if let Some(link) = &self.link {
            let reply = link.call(rpc, self.shard, &payload, timeout).await;
            if !matches!(reply, Err(LinkError::Unsupported | LinkError::NotReady)) {
                self.sent_link.inc();
            }
            match reply {
                Ok(reply) => {
                    return codec::decode(&reply).map_err(|e| CallError::Network(e.to_string()));
                }
                // An older release (this call and the peer's for a while), or no link
                // connection up yet (this call): by gRPC.
                Err(LinkError::Unsupported | LinkError::NotReady) => {}
                Err(LinkError::Unreachable(m)) => return Err(CallError::Unreachable(m)),
                Err(LinkError::Status(s)) => return Err(CallError::status(self.target, s)),
            }
        }
        let Some(client) = self.client.as_mut() else {
            return Err(CallError::Unreachable(format!(
                "bad peer address {}",
                self.addr
            )));
        };
        let mut request = self.channels.peer_request(RaftMessage {
            shard: self.shard,
            payload,
        });
        request.set_timeout(timeout);
        self.sent_grpc.inc();
        let reply = match rpc {
            Rpc::Append => client.append(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::Snapshot => client.snapshot(request).await,
        };
        let reply = match reply {
            Ok(r) => r.into_inner(),
            Err(status) => return Err(CallError::status(self.target, status)),
        };
        codec::decode(&reply.payload).map_err(|e| CallError::Network(e.to_string()))
    }

    fn remote<E: std::error::Error>(
        &self,
        e: RaftError<NodeId, E>,
    ) -> RPCError<NodeId, openraft::BasicNode, RaftError<NodeId, E>> {
        RPCError::RemoteError(RemoteError::new(self.target, e))
    }
}

/// How many of `entries` to send in one AppendEntries: as many as fit in
/// [`APPEND_BYTES_MAX`] and [`APPEND_ENTRIES_MAX`], and always at least one.
pub fn append_prefix(entries: &[LogEntry]) -> usize {
    let mut bytes = 0u64;
    for (i, e) in entries.iter().enumerate() {
        bytes += codec::encoded_len(e);
        if i > 0 && (bytes > APPEND_BYTES_MAX as u64 || i >= APPEND_ENTRIES_MAX) {
            return i;
        }
    }
    entries.len()
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let mut entries = rpc.entries;
        let n = append_prefix(&entries);
        let truncated = n < entries.len();
        entries.truncate(n);
        let sent: Vec<LogId> = entries.iter().map(|e| e.log_id).collect();
        let sent_last = sent.last().copied().or(rpc.prev_log_id);
        let wire = AppendWire {
            vote: rpc.vote,
            prev_log_id: rpc.prev_log_id,
            leader_commit: rpc.leader_commit,
            entries,
        };
        let sent_at = std::time::Instant::now();
        let resp: AppendEntriesResponse<NodeId> = self
            .call(Rpc::Append, &wire, option.hard_ttl())
            .await
            .map_err(CallError::rpc)?
            .map_err(|e| self.remote(e))?;
        self.append_rtt.observe(sent_at.elapsed().as_secs_f64());
        let acked = self.acked.filter(|(v, _)| *v == rpc.vote).map(|(_, l)| l);
        peer::check_append_response(&resp, &rpc.vote, self.me, rpc.prev_log_id, &sent, acked)
            .map_err(|e| network(&e))?;
        let matched = match &resp {
            AppendEntriesResponse::Success => sent_last,
            AppendEntriesResponse::PartialSuccess(m) => *m,
            _ => None,
        };
        if let Some(m) = matched.filter(|m| acked.is_none_or(|a| *m > a)) {
            self.acked = Some((rpc.vote, m));
        }
        Ok(match resp {
            // The entries not sent go in the next message; openraft continues from the
            // last one the follower now has.
            AppendEntriesResponse::Success if truncated => {
                AppendEntriesResponse::PartialSuccess(sent_last)
            }
            other => other,
        })
    }

    async fn install_snapshot(
        &mut self,
        _rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        // Snapshots go through `full_snapshot` (allot's own chunks, which declare the
        // snapshot's size); openraft 0.9 calls this only from the default
        // `full_snapshot`, which is overridden.
        Err(network(
            "chunked InstallSnapshot is not used: see full_snapshot",
        ))
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let meta = snapshot.meta;
        let data = snapshot.snapshot.into_inner();
        let total = data.len() as u64;
        tokio::pin!(cancel);
        let mut offset = 0usize;
        loop {
            let end = (offset + SNAPSHOT_CHUNK_BYTES).min(data.len());
            let chunk = SnapshotChunk {
                vote,
                meta: meta.clone(),
                total_bytes: total,
                offset: offset as u64,
                data: data[offset..end].to_vec(),
            };
            // The last chunk's answer waits for the follower to install the snapshot
            // (decode the state, write it): minutes for a large shard, not a chunk's time.
            let timeout = if chunk.done() {
                option.hard_ttl().max(peer::SNAPSHOT_INSTALL_TIMEOUT)
            } else {
                option.hard_ttl()
            };
            let call = self.call::<_, SnapshotResponse<NodeId>, openraft::error::Infallible>(
                Rpc::Snapshot,
                &chunk,
                timeout,
            );
            let resp = tokio::select! {
                closed = &mut cancel => return Err(StreamingError::Closed(closed)),
                r = call => r,
            };
            let resp = match resp {
                Err(CallError::Unreachable(m)) => {
                    return Err(Unreachable::new(&TransportError(m)).into())
                }
                Err(CallError::Network(m)) => {
                    return Err(NetworkError::new(&TransportError(m)).into())
                }
                Ok(Err(e)) => {
                    return Err(NetworkError::new(&TransportError(format!(
                        "{}: snapshot refused: {e}",
                        self.target
                    )))
                    .into())
                }
                Ok(Ok(r)) => r,
            };
            peer::check_snapshot_response(&resp.vote, &vote, self.me)
                .map_err(|e| NetworkError::new(&TransportError(e)))?;
            if resp.vote > vote || end == data.len() {
                return Ok(resp);
            }
            offset = end;
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let resp: VoteResponse<NodeId> = self
            .call(Rpc::Vote, &rpc, option.hard_ttl())
            .await
            .map_err(CallError::rpc)?
            .map_err(|e| self.remote(e))?;
        peer::check_vote_response(&resp, &rpc, self.me).map_err(|e| network(&e))?;
        Ok(resp)
    }
}

/// Deserializes `Result<T, E>` of a peer's answer (used by tests of the wire forms).
pub fn decode_payload<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, String> {
    codec::decode(bytes).map_err(|e| e.to_string())
}
