//! The gRPC services of a node: client (`Allot`), `Agent`, `Admin` and the internal `Raft`
//! transport, all on one listener; `/metrics` on another.

use crate::auth;
use crate::node::{Node, Shard};
use crate::proposer::{leader_of, ProposeError};
use crate::ratelimit::RateLimiter;
use crate::store;
use crate::types::{NodeId, ShardId};
use allot_proto::admin_client::AdminClient;
use allot_proto::admin_server::Admin;
use allot_proto::agent_server::Agent;
use allot_proto::allot_client::AllotClient;
use allot_proto::allot_server::Allot;
use allot_proto::raft_server::Raft as RaftService;
use allot_proto::*;
use allot_statemachine::query::{self, Query};
use allot_statemachine::{codec, Actor, DenialReason, HoldId, ProjectId, Request};
use openraft::BasicNode;
use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::Stream;
use tonic::metadata::MetadataValue;
use tonic::Status;

pub use allot_proto::meta::{FORWARDED, LEADER_ADDR, LEADER_ID, RETRY_AFTER_MS};
/// Most events in one audit page, and most events one audit call looks at.
pub const AUDIT_PAGE_MAX: usize = 10_000;
pub const AUDIT_SCAN_MAX: usize = 100_000;
/// Most requests in one `Execute` call.
pub const REQUESTS_PER_CALL_MAX: usize = 4096;
/// Largest client message (bytes); Raft messages have their own larger bound.
pub const CLIENT_MESSAGE_MAX: usize = 8 << 20;

#[derive(Clone)]
pub struct Services {
    pub node: Arc<Node>,
    pub limiter: Arc<RateLimiter>,
}

fn shard_of(node: &Node, shard: ShardId) -> Result<&Shard, Status> {
    node.shard(shard).ok_or_else(|| {
        Status::not_found(format!(
            "unknown shard {shard} (this cluster has {})",
            node.shards.len()
        ))
    })
}

/// The typed gRPC form of a proposal error.
pub fn status_of(e: ProposeError) -> Status {
    match e {
        ProposeError::NotLeader { leader, addr } => {
            let mut s = Status::unavailable("not leader");
            if let Some(l) = leader {
                if let Ok(v) = MetadataValue::try_from(l.to_string()) {
                    s.metadata_mut().insert(LEADER_ID, v);
                }
            }
            if let Some(a) = addr {
                if let Ok(v) = MetadataValue::try_from(a) {
                    s.metadata_mut().insert(LEADER_ADDR, v);
                }
            }
            s
        }
        ProposeError::Overloaded => {
            let mut s = Status::resource_exhausted("shard overloaded");
            s.metadata_mut()
                .insert(RETRY_AFTER_MS, MetadataValue::from_static("50"));
            s
        }
        ProposeError::Raft(m) => Status::unavailable(format!("raft: {m}")),
        ProposeError::ShuttingDown => Status::unavailable("node shutting down"),
        ProposeError::ClockNotReady => Status::unavailable("shard clock not ready; retry"),
        ProposeError::Rejected(m) => Status::failed_precondition(m),
    }
}

/// Whether the request was forwarded by a peer. With TLS, only a caller presenting a
/// certificate of the cluster CA (a peer) may say so; without TLS the marker only
/// skips a second forward and the edge rate limit (credentials are checked anyway).
fn forwarded<T>(node: &Node, req: &tonic::Request<T>) -> bool {
    req.metadata().get(FORWARDED).is_some() && (node.tls.is_none() || from_peer(req))
}

/// The caller presented a client certificate that chains to the cluster CA (rustls
/// verified it during the handshake).
fn from_peer<T>(req: &tonic::Request<T>) -> bool {
    req.peer_certs().is_some_and(|c| !c.is_empty())
}

/// Peer-only services (Raft, clock, denial reports) under TLS: mutual TLS required.
fn require_peer<T>(node: &Node, req: &tonic::Request<T>) -> Result<(), Status> {
    if node.tls.is_some() && !from_peer(req) {
        return Err(Status::permission_denied(
            "peer service: a cluster certificate is required",
        ));
    }
    Ok(())
}

/// A request to forward to the leader: marked as forwarded (so it is not forwarded
/// again) and carrying the caller's credentials, which the leader checks itself.
fn forward_with<T>(msg: T, meta: &tonic::metadata::MetadataMap) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert(FORWARDED, MetadataValue::from_static("1"));
    if let Some(a) = meta.get("authorization") {
        r.metadata_mut().insert("authorization", a.clone());
    }
    if let Some(t) = meta.get("grpc-timeout") {
        r.metadata_mut().insert("grpc-timeout", t.clone());
    }
    r
}

impl Services {
    fn observe(&self, method: &str, started: Instant, ok: bool) {
        let m = &self.node.metrics;
        m.latency
            .with_label_values(&[method])
            .observe(started.elapsed().as_secs_f64());
        m.requests
            .with_label_values(&[method, if ok { "ok" } else { "error" }])
            .inc();
    }

    async fn leader_client(
        &self,
        addr: &str,
    ) -> Result<AllotClient<tonic::transport::Channel>, Status> {
        let ch = self
            .node
            .channels
            .get(addr)
            .map_err(|e| Status::unavailable(format!("leader address {addr}: {e}")))?;
        Ok(AllotClient::new(ch)
            .max_decoding_message_size(CLIENT_MESSAGE_MAX)
            .max_encoding_message_size(CLIENT_MESSAGE_MAX))
    }

    async fn execute_inner(
        &self,
        req: tonic::Request<ExecuteRequest>,
    ) -> Result<ExecuteReply, Status> {
        let was_forwarded = forwarded(&self.node, &req);
        let meta = req.metadata().clone();
        let bearer = auth::bearer(&meta)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        if msg.requests.is_empty() {
            return Err(Status::invalid_argument("no requests"));
        }
        if msg.requests.len() > REQUESTS_PER_CALL_MAX {
            return Err(Status::invalid_argument(format!(
                "{} requests in one call; at most {REQUESTS_PER_CALL_MAX}",
                msg.requests.len()
            )));
        }
        let mut requests = Vec::with_capacity(msg.requests.len());
        for (i, b) in msg.requests.iter().enumerate() {
            let mut r: Request = codec::decode(b)
                .map_err(|e| Status::invalid_argument(format!("request {i}: {e}")))?;
            auth::stamp(&self.node, shard.id, bearer, &mut r)?;
            requests.push(r);
        }
        if !was_forwarded {
            self.limiter.admit(&requests)?;
        }
        #[cfg(feature = "chaos")]
        crate::chaos::rewrite_request_ids(&mut requests);
        match shard.proposer.propose(requests).await {
            Ok(c) => Ok(ExecuteReply {
                outcomes: c.outcomes.iter().map(codec::encode).collect(),
                log_index: c.log_index,
                logical_time_ms: c.logical_time_ms,
            }),
            Err(ProposeError::NotLeader {
                addr: Some(addr), ..
            }) if !was_forwarded => {
                // Forward once; the leader answers (or says who leads now).
                let mut client = self.leader_client(&addr).await?;
                client
                    .execute(forward_with(msg, &meta))
                    .await
                    .map(|r| r.into_inner())
            }
            Err(e) => Err(status_of(e)),
        }
    }

    async fn query_inner(&self, req: tonic::Request<QueryRequest>) -> Result<QueryReply, Status> {
        let was_forwarded = forwarded(&self.node, &req);
        let meta = req.metadata().clone();
        let caller = auth::caller(&self.node, auth::bearer(&meta)?);
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let q: Query = codec::decode(&msg.query)
            .map_err(|e| Status::invalid_argument(format!("query: {e}")))?;
        if msg.consistency() == Consistency::Linearizable {
            if let Err(e) = shard.raft.ensure_linearizable().await {
                let err = crate::proposer::from_raft_error(&shard.raft, e);
                return match err {
                    ProposeError::NotLeader {
                        addr: Some(addr), ..
                    } if !was_forwarded => {
                        let mut client = self.leader_client(&addr).await?;
                        client
                            .query(forward_with(msg, &meta))
                            .await
                            .map(|r| r.into_inner())
                    }
                    e => Err(status_of(e)),
                };
            }
        }
        let g = shard.view.read();
        let answer = query::answer_as(&g.state, caller, &q).map_err(|e| {
            let reason = match e {
                query::QueryDenied::Unauthenticated => DenialReason::Unauthenticated,
                query::QueryDenied::PermissionDenied => DenialReason::PermissionDenied,
            };
            let who = g
                .state
                .security
                .resolve(caller, g.state.time_ms)
                .unwrap_or(caller);
            auth::refuse(
                &self.node,
                shard.id,
                who,
                &format!("query:{}", q.name()),
                reason,
            )
        })?;
        Ok(QueryReply {
            answer: codec::encode(&answer),
            applied_index: g.last_applied.map(|l| l.index).unwrap_or(0),
            logical_time_ms: g.state.time_ms,
        })
    }
}

#[tonic::async_trait]
impl Allot for Services {
    async fn execute(
        &self,
        req: tonic::Request<ExecuteRequest>,
    ) -> Result<tonic::Response<ExecuteReply>, Status> {
        let started = Instant::now();
        let r = self.execute_inner(req).await;
        self.observe("execute", started, r.is_ok());
        r.map(tonic::Response::new)
    }

    async fn query(
        &self,
        req: tonic::Request<QueryRequest>,
    ) -> Result<tonic::Response<QueryReply>, Status> {
        let started = Instant::now();
        let r = self.query_inner(req).await;
        self.observe("query", started, r.is_ok());
        r.map(tonic::Response::new)
    }

    async fn audit(
        &self,
        req: tonic::Request<AuditRequest>,
    ) -> Result<tonic::Response<AuditReply>, Status> {
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        let mut msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        // A tenant reads only its own org's events (a project token its project's);
        // filters naming another org or project match nothing, like unknown ids.
        let (org_only, project_only) =
            match auth::authenticate(&self.node, shard.id, caller, "audit")? {
                Actor::Admin(_) => (None, None),
                Actor::Tenant { org, .. } => (Some(org.0), None),
                Actor::Project { org, project, .. } => (Some(org.0), Some(project.0)),
                other => return Err(auth::forbidden(&self.node, shard.id, other, "audit")),
            };
        let mut nothing = false;
        if let Some(o) = org_only {
            nothing |= msg.org.is_some_and(|m| m != o);
            msg.org = Some(o);
        }
        if let Some(p) = project_only {
            nothing |= msg.project.is_some_and(|m| m != p);
            msg.project = Some(p);
        }
        let head_seq = shard.view.read().state.audit.next_seq;
        let limit = (msg.limit as usize).clamp(1, AUDIT_PAGE_MAX);
        let keep = |ev: &allot_statemachine::AuditEvent| {
            !nothing
                && msg
                    .org
                    .is_none_or(|o| ev.org == Some(allot_statemachine::OrgId(o)))
                && msg.project.is_none_or(|p| {
                    ev.account == Some(allot_statemachine::Account::Project(ProjectId(p)))
                })
                && msg.hold.is_none_or(|h| ev.hold == Some(HoldId(h)))
                && ev.time_ms >= msg.from_ms
                && (msg.to_ms == 0 || ev.time_ms < msg.to_ms)
        };
        let (events, next_seq) = store::read_audit(
            &self.node.db,
            msg.shard,
            msg.from_seq,
            limit,
            AUDIT_SCAN_MAX,
            keep,
        )
        .map_err(|e| match e {
            store::AuditReadError::Gap { .. } => Status::unavailable(e.to_string()),
            e => Status::internal(format!("audit store: {e}")),
        })?;
        Ok(tonic::Response::new(AuditReply {
            events,
            next_seq,
            head_seq,
        }))
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<Assignments, Status>> + Send>>;
type BackupStream = Pin<Box<dyn Stream<Item = Result<BackupChunk, Status>> + Send>>;
/// Backup chunks stay well under every gRPC message bound.
const BACKUP_CHUNK_BYTES: usize = 1 << 20;

#[tonic::async_trait]
impl Agent for Services {
    type WatchAssignmentsStream = AssignmentStream;

    async fn watch_assignments(
        &self,
        req: tonic::Request<WatchRequest>,
    ) -> Result<tonic::Response<AssignmentStream>, Status> {
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let node_id: u64 = msg
            .node_id
            .parse()
            .map_err(|_| Status::invalid_argument("node_id must be a number"))?;
        // Only the node's own agent (or an admin) may watch its assignments.
        match auth::authenticate(&self.node, shard.id, caller, "watch_assignments")? {
            Actor::Admin(_) => {}
            Actor::Agent(n) if n.0 == node_id => {}
            other => {
                return Err(auth::forbidden(
                    &self.node,
                    shard.id,
                    other,
                    "watch_assignments",
                ))
            }
        }
        let view = shard.view.clone();
        let mut applied = view.applied_watch();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut last: Option<Vec<u8>> = None;
            loop {
                let (bytes, idx) = {
                    let g = view.read();
                    let a = g
                        .state
                        .scheduler
                        .assignments(allot_statemachine::NodeId(node_id));
                    (
                        codec::encode(&a),
                        g.last_applied.map(|l| l.index).unwrap_or(0),
                    )
                };
                if last.as_ref() != Some(&bytes) {
                    last = Some(bytes.clone());
                    let msg = Assignments {
                        assignments: bytes,
                        applied_index: idx,
                    };
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
                if applied.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

fn shard_status(node: &Node, shard: &Shard) -> ShardStatus {
    let m = shard.raft.metrics().borrow().clone();
    let (_, leader_addr, _) = leader_of(&shard.raft);
    let membership = m.membership_config.membership();
    let voters: Vec<u64> = membership.voter_ids().collect();
    let learners: Vec<u64> = membership.learner_ids().collect();
    let time = shard.view.read().state.time_ms;
    ShardStatus {
        shard: shard.id,
        node_id: node.id,
        leader: m.current_leader.unwrap_or(0),
        leader_addr: leader_addr.unwrap_or_default(),
        is_leader: m.current_leader == Some(node.id),
        term: m.current_term,
        applied_index: m.last_applied.map(|l| l.index).unwrap_or(0),
        last_log_index: m.last_log_index.unwrap_or(0),
        logical_time_ms: time,
        voters,
        learners,
        state: format!("{:?}", m.state),
        snapshot_index: m.snapshot.map(|l| l.index).unwrap_or(0),
        purged_index: m.purged.map(|l| l.index).unwrap_or(0),
    }
}

impl Services {
    fn target_shards(&self, shard: ShardId, all: bool) -> Result<Vec<&Shard>, Status> {
        if all {
            Ok(self.node.shards.iter().collect())
        } else {
            Ok(vec![shard_of(&self.node, shard)?])
        }
    }
}

impl Services {
    /// Runs a membership call for `shard` on its leader when this node is not it
    /// (forwarded once), or turns the error into a status.
    async fn on_leader<E, F, Fut>(
        &self,
        shard: &Shard,
        e: openraft::error::RaftError<NodeId, E>,
        was_forwarded: bool,
        call: F,
    ) -> Result<MembershipReply, Status>
    where
        E: std::error::Error
            + openraft::TryAsRef<openraft::error::ForwardToLeader<NodeId, BasicNode>>,
        F: FnOnce(AdminClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<MembershipReply>, Status>>,
    {
        match crate::proposer::from_raft_error(&shard.raft, e) {
            ProposeError::NotLeader {
                addr: Some(addr), ..
            } if !was_forwarded => {
                let ch = self
                    .node
                    .channels
                    .get(&addr)
                    .map_err(|e| Status::unavailable(format!("leader address {addr}: {e}")))?;
                Ok(call(AdminClient::new(ch)).await?.into_inner())
            }
            other => Err(status_of(other)),
        }
    }
}

fn raft_status<E: std::fmt::Display>(e: E) -> Status {
    Status::failed_precondition(e.to_string())
}

#[tonic::async_trait]
impl Admin for Services {
    async fn init(
        &self,
        req: tonic::Request<InitRequest>,
    ) -> Result<tonic::Response<InitReply>, Status> {
        auth::require_admin(&self.node, req.metadata(), "admin:init", true)?;
        let msg = req.into_inner();
        if msg.members.is_empty() {
            return Err(Status::invalid_argument("no members"));
        }
        let mut members = BTreeMap::new();
        for m in msg.members.iter().cloned() {
            if m.node_id == 0 || m.addr.is_empty() {
                return Err(Status::invalid_argument(
                    "member ids must be positive and addresses set",
                ));
            }
            members.insert(m.node_id, BasicNode::new(m.addr));
        }
        if !members.contains_key(&self.node.id) {
            return Err(Status::invalid_argument(
                "the members must include this node",
            ));
        }
        for id in &msg.shards {
            shard_of(&self.node, *id)?;
        }
        for s in &self.node.shards {
            if !msg.shards.is_empty() && !msg.shards.contains(&s.id) {
                continue;
            }
            match s.raft.initialize(members.clone()).await {
                Ok(()) => {}
                // Idempotent: a retried init of an initialised shard is fine.
                Err(openraft::error::RaftError::APIError(
                    openraft::error::InitializeError::NotAllowed(_),
                )) => {}
                Err(e) => return Err(raft_status(e)),
            }
        }
        Ok(tonic::Response::new(InitReply {
            shards: self.node.shards.len() as u32,
        }))
    }

    async fn add_learner(
        &self,
        req: tonic::Request<MemberRequest>,
    ) -> Result<tonic::Response<MembershipReply>, Status> {
        let req_meta = req.metadata().clone();
        let was_forwarded = forwarded(&self.node, &req);
        auth::require_admin(&self.node, &req_meta, "admin:add_learner", false)?;
        let msg = req.into_inner();
        let member = msg
            .member
            .ok_or_else(|| Status::invalid_argument("member missing"))?;
        if member.node_id == 0 || member.addr.is_empty() {
            return Err(Status::invalid_argument(
                "member id must be positive and address set",
            ));
        }
        let mut out = Vec::new();
        for s in self.target_shards(msg.shard, msg.all_shards)? {
            let r = s
                .raft
                .add_learner(member.node_id, BasicNode::new(member.addr.clone()), true)
                .await;
            match r {
                Ok(_) => out.push(shard_status(&self.node, s)),
                Err(e) => {
                    let leader = self
                        .on_leader(s, e, was_forwarded, |mut c| {
                            let m = MemberRequest {
                                shard: s.id,
                                all_shards: false,
                                member: Some(member.clone()),
                            };
                            let r = forward_with(m, &req_meta);
                            async move { c.add_learner(r).await }
                        })
                        .await?;
                    out.extend(leader.shards);
                }
            }
        }
        Ok(tonic::Response::new(MembershipReply { shards: out }))
    }

    async fn change_membership(
        &self,
        req: tonic::Request<ChangeMembershipRequest>,
    ) -> Result<tonic::Response<MembershipReply>, Status> {
        let req_meta = req.metadata().clone();
        let was_forwarded = forwarded(&self.node, &req);
        auth::require_admin(&self.node, &req_meta, "admin:change_membership", false)?;
        let msg = req.into_inner();
        let voters: BTreeSet<NodeId> = msg.voters.iter().copied().collect();
        if voters.is_empty() || voters.contains(&0) {
            return Err(Status::invalid_argument(
                "voters must be a non-empty set of positive ids",
            ));
        }
        let mut out = Vec::new();
        for s in self.target_shards(msg.shard, msg.all_shards)? {
            match s.raft.change_membership(voters.clone(), false).await {
                Ok(_) => out.push(shard_status(&self.node, s)),
                Err(e) => {
                    let leader = self
                        .on_leader(s, e, was_forwarded, |mut c| {
                            let m = ChangeMembershipRequest {
                                shard: s.id,
                                all_shards: false,
                                voters: voters.iter().copied().collect(),
                            };
                            let r = forward_with(m, &req_meta);
                            async move { c.change_membership(r).await }
                        })
                        .await?;
                    out.extend(leader.shards);
                }
            }
        }
        Ok(tonic::Response::new(MembershipReply { shards: out }))
    }

    async fn status(
        &self,
        req: tonic::Request<StatusRequest>,
    ) -> Result<tonic::Response<StatusReply>, Status> {
        auth::require_authenticated(&self.node, req.metadata(), "admin:status")?;
        Ok(tonic::Response::new(StatusReply {
            node_id: self.node.id,
            shards: self
                .node
                .shards
                .iter()
                .map(|s| shard_status(&self.node, s))
                .collect(),
        }))
    }

    type BackupStream = BackupStream;

    async fn backup(
        &self,
        req: tonic::Request<ShardRequest>,
    ) -> Result<tonic::Response<BackupStream>, Status> {
        auth::require_admin(&self.node, req.metadata(), "admin:backup", false)?;
        let id = shard_of(&self.node, req.into_inner().shard)?.id;
        let node = self.node.clone();
        // Encoding a large state takes a while: off the runtime's workers.
        let bytes = tokio::task::spawn_blocking(move || {
            crate::backup::take(&node, &node.shards[id as usize]).map(|b| b.encode())
        })
        .await
        .map_err(|e| Status::internal(format!("backup task: {e}")))?
        .map_err(|e| match e {
            crate::backup::BackupError::AuditGap(_) => Status::unavailable(e.to_string()),
            e => Status::internal(e.to_string()),
        })?;
        let chunks: Vec<Result<BackupChunk, Status>> = bytes
            .chunks(BACKUP_CHUNK_BYTES)
            .map(|c| Ok(BackupChunk { data: c.to_vec() }))
            .collect();
        Ok(tonic::Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn shard_hash(
        &self,
        req: tonic::Request<ShardRequest>,
    ) -> Result<tonic::Response<ShardHashReply>, Status> {
        auth::require_admin(&self.node, req.metadata(), "admin:shard_hash", false)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let g = shard.view.read();
        Ok(tonic::Response::new(ShardHashReply {
            state_hash: g.state.state_hash().to_vec(),
            applied_index: g.last_applied.map(|l| l.index).unwrap_or(0),
            logical_time_ms: g.state.time_ms,
        }))
    }
}

fn decode<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, Status> {
    bincode::deserialize(b).map_err(|e| Status::invalid_argument(format!("raft payload: {e}")))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<tonic::Response<RaftMessage>, Status> {
    let payload = bincode::serialize(v).map_err(|e| Status::internal(e.to_string()))?;
    Ok(tonic::Response::new(RaftMessage { shard: 0, payload }))
}

#[tonic::async_trait]
impl RaftService for Services {
    async fn append(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        require_peer(&self.node, &req)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let started = std::time::Instant::now();
        let r = shard.raft.append_entries(decode(&msg.payload)?).await;
        let reply = encode(&r);
        self.node
            .metrics
            .follower_append
            .with_label_values(&[&msg.shard.to_string()])
            .observe(started.elapsed().as_secs_f64());
        reply
    }

    async fn vote(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        require_peer(&self.node, &req)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let r = shard.raft.vote(decode(&msg.payload)?).await;
        encode(&r)
    }

    async fn snapshot(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        require_peer(&self.node, &req)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let r = shard.raft.install_snapshot(decode(&msg.payload)?).await;
        encode(&r)
    }

    async fn report_denials(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        require_peer(&self.node, &req)?;
        let msg = req.into_inner();
        shard_of(&self.node, msg.shard)?;
        let (reporter, denials): (u64, Vec<allot_statemachine::Denial>) = decode(&msg.payload)?;
        auth::report(&self.node, msg.shard, reporter, denials)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        encode(&())
    }

    async fn clock(
        &self,
        req: tonic::Request<ClockRequest>,
    ) -> Result<tonic::Response<ClockReply>, Status> {
        require_peer(&self.node, &req)?;
        Ok(tonic::Response::new(ClockReply {
            wall_ms: self.node.clock.wall_ms(),
            node_id: self.node.id,
        }))
    }
}
