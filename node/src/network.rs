//! The Raft transport: openraft's RPCs over the node's gRPC `Raft` service. One HTTP/2
//! channel per peer address is shared by every shard; each message names its shard.
//! Payloads are bincode of openraft's own request and `Result<response, error>` types.

use crate::types::{NodeId, ShardId, TypeConfig};
use allot_proto::raft_client::RaftClient;
use allot_proto::RaftMessage;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// Largest gRPC message the Raft service sends or accepts (append batches, snapshot chunks).
pub const RAFT_MESSAGE_MAX: usize = 256 << 20;

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
}

impl Channels {
    pub fn new(routes: HashMap<String, String>, tls: Option<ClientTlsConfig>) -> Channels {
        Channels {
            map: Mutex::default(),
            routes,
            tls,
        }
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
}

/// The network of one shard.
#[derive(Clone)]
pub struct Network {
    pub shard: ShardId,
    pub channels: Arc<Channels>,
}

pub struct Peer {
    shard: ShardId,
    target: NodeId,
    client: Option<RaftClient<Channel>>,
    addr: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Peer {
        let client = self.channels.get(&node.addr).ok().map(|c| {
            RaftClient::new(c)
                .max_decoding_message_size(RAFT_MESSAGE_MAX)
                .max_encoding_message_size(RAFT_MESSAGE_MAX)
        });
        Peer {
            shard: self.shard,
            target,
            client,
            addr: node.addr.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

fn unreachable<E: std::error::Error>(e: &str) -> RPCError<NodeId, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&TransportError(e.to_string())))
}

fn network<E: std::error::Error>(e: &str) -> RPCError<NodeId, BasicNode, E> {
    RPCError::Network(NetworkError::new(&TransportError(e.to_string())))
}

enum Rpc {
    Append,
    Vote,
    Snapshot,
}

impl Peer {
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            return Err(unreachable(&format!("bad peer address {}", self.addr)));
        };
        let payload = bincode::serialize(req).map_err(|e| network(&e.to_string()))?;
        let mut request = tonic::Request::new(RaftMessage {
            shard: self.shard,
            payload,
        });
        request.set_timeout(option.hard_ttl());
        let reply = match rpc {
            Rpc::Append => client.append(request).await,
            Rpc::Vote => client.vote(request).await,
            Rpc::Snapshot => client.snapshot(request).await,
        };
        let reply = match reply {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Unknown => {
                        unreachable(status.message())
                    }
                    _ => network(&format!("{}: {}", self.target, status.message())),
                })
            }
        };
        let result: Result<Resp, RaftError<NodeId, E>> =
            bincode::deserialize(&reply.payload).map_err(|e| network(&e.to_string()))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Append, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(Rpc::Snapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Vote, &rpc, &option).await
    }
}
