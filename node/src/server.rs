//! The gRPC services of a node: the typed client and agent API (`crate::api`), `Admin`
//! and the internal `Raft` transport, all on one listener; `/metrics` on another. Here:
//! the paths every client call shares (admission, forwarding to the leader, reads, audit
//! pages, assignment streams), `Admin` and `Raft`.

use crate::auth;
use crate::edge;
use crate::network::{AppendWire, SnapshotChunk};
use crate::node::{Node, Shard};
use crate::peer;
use crate::proposer::{leader_of, Committed, ProposeError};
use crate::ratelimit::RateLimiter;
use crate::ratelimit::{key_of, Class, Key};
use crate::store;
use crate::types::{NodeId, ShardId};

fn class_label(c: Class) -> &'static str {
    match c {
        Class::Write => "write",
        Class::Read => "read",
    }
}
use allot_proto::admin_client::AdminClient;
use allot_proto::admin_server::Admin;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_client::ApiClient;
use allot_proto::raft_server::Raft as RaftService;
use allot_proto::typed;
use allot_proto::*;
use allot_statemachine::query::{self, Query};
use allot_statemachine::redact::Viewer;
use allot_statemachine::scheduler::AssignmentRow;
use allot_statemachine::{codec, Actor, DenialReason, HoldId, ProjectId, Request};
use openraft::raft::SnapshotResponse;
use openraft::BasicNode;
use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::Stream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::Status;

pub use crate::limits::{
    AUDIT_PAGE_MAX, AUDIT_SCAN_MAX, AUDIT_SCAN_MAX_TENANT, CLIENT_MESSAGE_MAX, REPLY_MESSAGE_MAX,
    REQUESTS_PER_CALL_MAX,
};
pub use allot_proto::meta::{FORWARDED, LEADER_ADDR, LEADER_ID, RETRY_AFTER_MS};

#[derive(Clone)]
pub struct Services {
    pub node: Arc<Node>,
    pub limiter: Arc<RateLimiter>,
}

/// The shard a call names, or `NOT_FOUND` with reason `UNKNOWN_SHARD`.
#[allow(clippy::result_large_err)]
pub(crate) fn shard_of(node: &Node, shard: ShardId) -> Result<&Shard, Status> {
    node.shard(shard).ok_or_else(|| {
        edge::with_reason(
            Status::not_found(format!(
                "unknown shard {shard} (this cluster has {})",
                node.shards.len()
            )),
            "UNKNOWN_SHARD",
        )
    })
}

/// The address of `shard`'s leader when this replica knows one and is not it (the
/// `allot-leader-addr` a successful reply carries, `api::Services::reply`).
pub(crate) fn leader_elsewhere(node: &Node, shard: ShardId) -> Option<MetadataValue<Ascii>> {
    let metrics = node.shard(shard)?.raft.metrics();
    let m = metrics.borrow();
    let leader = m.current_leader.filter(|l| *l != node.id)?;
    let addr = &m.membership_config.membership().get_node(&leader)?.addr;
    MetadataValue::try_from(addr.as_str()).ok()
}

/// An admin call's argument refused (`INVALID_ARGUMENT`, reason `INVALID_ARGUMENT`).
fn bad_argument(m: &'static str) -> Status {
    edge::with_reason(Status::invalid_argument(m), "INVALID_ARGUMENT")
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
        ProposeError::NoQuorum(m) => {
            let mut s = edge::with_reason(Status::unavailable(m), "NO_QUORUM");
            s.metadata_mut()
                .insert(RETRY_AFTER_MS, MetadataValue::from_static("50"));
            s
        }
        ProposeError::Rejected(m) => Status::failed_precondition(m),
    }
}

/// Whether the call carries the forwarded marker: it is not forwarded a second time
/// (whoever sent it; a client that sets it only gets NotLeader sooner).
fn forwarded<T>(req: &tonic::Request<T>) -> bool {
    req.metadata().get(FORWARDED).is_some()
}

/// A forwarded call from an authenticated peer (`crate::peer`): the peer already
/// applied its rate limit, so this node does not count it again. Without peer
/// authentication nobody is known to be a peer, and every call is counted.
fn from_peer<T>(node: &Node, req: &tonic::Request<T>) -> bool {
    forwarded(req) && node.peer_auth.is_peer(req)
}

/// A request to forward to the leader: marked as forwarded (so it is not forwarded
/// again), carrying the caller's credentials, which the leader checks itself, and this
/// node's peer credential.
fn forward_with<T>(node: &Node, msg: T, meta: &tonic::metadata::MetadataMap) -> tonic::Request<T> {
    let mut r = node.channels.peer_request(msg);
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
    pub(crate) fn observe(&self, method: &str, started: Instant, ok: bool) {
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
    ) -> Result<ApiClient<tonic::transport::Channel>, Status> {
        let ch = self
            .node
            .channels
            .get(addr)
            .map_err(|e| Status::unavailable(format!("leader address {addr}: {e}")))?;
        Ok(ApiClient::new(ch)
            .max_decoding_message_size(REPLY_MESSAGE_MAX)
            .max_encoding_message_size(CLIENT_MESSAGE_MAX))
    }

    /// Takes `n` tokens of `class` from the tenant of `actor` (resolved on `shard`'s
    /// replica), unless the call was forwarded by an authenticated peer.
    #[allow(clippy::result_large_err)]
    fn limit<T>(
        &self,
        req: &tonic::Request<T>,
        class: Class,
        need: &[(Option<Actor>, u32)],
    ) -> Result<(), Status> {
        if from_peer(&self.node, req) {
            return Ok(());
        }
        let keys: Vec<(Key, u32)> = need
            .iter()
            .filter_map(|(a, n)| key_of(*a).map(|k| (k, *n)))
            .collect();
        self.limiter.admit(class, &keys).inspect_err(|_| {
            self.node
                .metrics
                .refusals
                .with_label_values(&[class_label(class), "rate_limited"])
                .inc();
        })
    }

    /// Whom a reader runs as on `shard`'s replica (`None`: its token does not resolve).
    fn reader(&self, shard: u32, caller: Actor) -> Option<Actor> {
        auth::resolve(&self.node, shard, caller).ok()
    }

    /// Runs requests the edge admitted (converted, stamped with their callers, validated)
    /// on `shard`: credentials, the tenant's rate limit, then the proposer — or, on a
    /// follower, forwarded once to the leader as an `Api.Execute` call carrying the
    /// caller's token (the leader admits it again; a follower never vouches for a
    /// caller). Every command of the typed API runs through here.
    pub(crate) async fn execute_admitted<T>(
        &self,
        req: &tonic::Request<T>,
        shard: &Shard,
        #[allow(unused_mut)] mut requests: Vec<Request>,
    ) -> Result<Committed, Status> {
        let was_forwarded = forwarded(req);
        let leader = shard.raft.metrics().borrow().current_leader == Some(self.node.id);
        let actors = edge::credentials(&self.node, shard, &requests, leader).await?;
        let activation = crate::versions::activation_in(&requests);
        if leader && activation.is_some() {
            edge::activations_admitted(shard, &requests, &actors)?;
        }
        // Who will read each outcome, for the answer's redaction (`redact`): as resolved
        // here, or — a token this replica did not know yet — after the commit.
        let readers: Vec<Result<Actor, Actor>> = actors
            .iter()
            .zip(&requests)
            .map(|(a, r)| a.ok_or(r.actor))
            .collect();
        // The call a follower forwards, built before the requests go to the proposer
        // (only when this replica does not lead).
        let forward = (!leader && !was_forwarded)
            .then(|| typed::execute_request(Some(shard.id), &requests))
            .flatten();
        let need: Vec<(Option<Actor>, u32)> = actors.into_iter().map(|a| (a, 1)).collect();
        self.limit(req, Class::Write, &need)?;
        self.node.disk.admit(&requests, &need).inspect_err(|_| {
            self.node
                .metrics
                .refusals
                .with_label_values(&["write", "disk_low"])
                .inc();
        })?;
        // The cluster version gate, on the replica that proposes (a follower forwards).
        if let (true, Some(version)) = (leader, activation) {
            crate::versions::check_activation(&self.node, shard, version).await?;
        }
        #[cfg(feature = "chaos")]
        crate::chaos::rewrite_request_ids(&mut requests);
        // An activation the gate has not passed is never proposed here: this replica may
        // be elected before its proposer takes the call, and would propose it unchecked.
        // It goes to the leader, which checks it.
        let proposed = match (leader, activation) {
            (false, Some(_)) => Err(crate::proposer::not_leader(&shard.raft)),
            _ => shard.proposer.propose(requests).await,
        };
        let committed = match proposed {
            Ok(c) => Ok(c),
            Err(e @ ProposeError::NotLeader { addr: Some(_), .. }) if !was_forwarded => {
                // Forward once; the leader answers (or says who leads now).
                let ProposeError::NotLeader {
                    addr: Some(addr), ..
                } = &e
                else {
                    return Err(status_of(e));
                };
                let Some(msg) = forward else {
                    return Err(status_of(e));
                };
                let n = msg.commands.len();
                let mut client = self.leader_client(addr).await?;
                let reply = client
                    .execute(forward_with(&self.node, msg, req.metadata()))
                    .await?
                    .into_inner();
                Ok(Committed {
                    outcomes: typed::outcomes_from(&reply, n)
                        .map_err(|e| Status::internal(format!("the leader's reply: {e}")))?,
                    log_index: reply.log_index,
                    logical_time_ms: reply.logical_time_ms,
                })
            }
            Err(e) => Err(status_of(e)),
        };
        committed.map(|c| redacted(shard, &readers, c))
    }

    /// Answers a query on `shard` (the read rate limit; linearizable through the leader's
    /// read index, or this replica's state): (answer, applied index, logical time). A
    /// follower that cannot confirm forwards it to the leader once, as `Api.Query`.
    /// Every read of the typed API runs through here.
    pub(crate) async fn answer<T>(
        &self,
        req: &tonic::Request<T>,
        shard: ShardId,
        linearizable: bool,
        q: Query,
    ) -> Result<(query::Answer, u64, u64), Status> {
        let was_forwarded = forwarded(req);
        let meta = req.metadata();
        let caller = auth::caller(&self.node, auth::bearer(meta)?);
        let shard = shard_of(&self.node, shard)?;
        let reader = self.reader(shard.id, caller);
        // What the query costs the reader's budget: a usage ranking pays for the
        // accounts it ranks, a balance or bucket list for the buckets it reads
        // (`query::read_units`), at most the whole read burst (it would never be
        // admitted otherwise; a batch of more writes than the write burst is refused,
        // but a read cannot be split). Only those need the state to say (every other
        // read costs 1, without a second look at the lock).
        let units = if query::priced_by_rows(&q) {
            let org = reader.and_then(|a| a.org());
            query::read_units(&shard.view.read().state, org, &q)
                .min(self.limiter.limits().read.burst.max(1))
        } else {
            1
        };
        self.limit(req, Class::Read, &[(reader, units)])?;
        if linearizable {
            if let Err(e) = shard.raft.ensure_linearizable().await {
                let err = crate::proposer::from_read_error(&shard.raft, e);
                return match err {
                    ProposeError::NotLeader {
                        addr: Some(ref addr),
                        ..
                    } if !was_forwarded => {
                        let mut client = self.leader_client(addr).await?;
                        let msg = typed::query::query_request(shard.id, false, &q);
                        let reply = client
                            .query(forward_with(&self.node, msg, meta))
                            .await?
                            .into_inner();
                        let answer = typed::query::answer_from(reply.answer.as_ref())
                            .map_err(|e| Status::internal(format!("the leader's answer: {e}")))?;
                        Ok((answer, reply.applied_index, reply.logical_time_ms))
                    }
                    e => Err(status_of(e)),
                };
            }
        }
        // A whole-shard query of an operator (state hash, invariants, shard-wide usage
        // ranking, principal search) works on a copy taken under the lock and computed
        // on a blocking thread, so it holds apply back for the copy only.
        let copy = {
            let g = shard.view.read();
            let operator = matches!(
                g.state.security.resolve(caller, g.state.time_ms),
                Ok(Actor::Admin(_) | Actor::System)
            );
            (operator && whole_shard(&q)).then(|| (g.state.clone(), g.last_applied))
        };
        if let Some((state, applied)) = copy {
            let (answer, time_ms) =
                tokio::task::spawn_blocking(move || (query::answer(&state, &q), state.time_ms))
                    .await
                    .map_err(|e| Status::internal(format!("query: {e}")))?;
            return Ok((answer, applied.map(|l| l.index).unwrap_or(0), time_ms));
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
        Ok((
            answer,
            g.last_applied.map(|l| l.index).unwrap_or(0),
            g.state.time_ms,
        ))
    }
}

impl Services {
    /// A linearizable audit page: `None` when this replica is the leader and its read
    /// index confirms its state is current (serve the page here, already counted); a
    /// follower forwards the page to the leader once and returns its reply. The call is
    /// counted against the read rate first, as [`Services::answer`] does, so an
    /// over-rate caller costs no read-index round.
    pub(crate) async fn audit_at_leader(
        &self,
        req: &tonic::Request<pb::AuditRequest>,
        shard: ShardId,
    ) -> Result<Option<pb::AuditReply>, Status> {
        let s = shard_of(&self.node, shard)?;
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        self.limit(req, Class::Read, &[(self.reader(s.id, caller), 1)])?;
        let Err(e) = s.raft.ensure_linearizable().await else {
            return Ok(None);
        };
        match crate::proposer::from_read_error(&s.raft, e) {
            ProposeError::NotLeader {
                addr: Some(ref addr),
                ..
            } if !forwarded(req) => {
                let mut client = self.leader_client(addr).await?;
                let msg = forward_with(&self.node, *req.get_ref(), req.metadata());
                Ok(Some(client.audit(msg).await?.into_inner()))
            }
            e => Err(status_of(e)),
        }
    }

    /// One page of `shard`'s audit events matching `filter`, from this replica (the
    /// caller handles the `read` header: [`Services::audit_at_leader`]): the caller's
    /// credentials, the read rate limit (unless `counted` already), and a tenant's confinement
    /// to its own org (a project token to its project) — filters naming another org or
    /// project match nothing, as unknown ids do. (events, next_seq, head_seq).
    pub(crate) async fn audit_page<T>(
        &self,
        req: &tonic::Request<T>,
        shard: ShardId,
        filter: &pb::AuditRequest,
        counted: bool,
    ) -> Result<(Vec<allot_statemachine::AuditEvent>, u64, u64), Status> {
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        let shard = shard_of(&self.node, shard)?;
        if !counted {
            self.limit(req, Class::Read, &[(self.reader(shard.id, caller), 1)])?;
        }
        let (mut org, mut project) = (filter.org, filter.project);
        let reader = auth::authenticate(&self.node, shard.id, caller, "audit")?;
        let (org_only, project_only) = match reader {
            Actor::Admin(_) => (None, None),
            Actor::Tenant { org, .. } => (Some(org.0), None),
            Actor::Project { org, project, .. } => (Some(org.0), Some(project.0)),
            other => return Err(auth::forbidden(&self.node, shard.id, other, "audit")),
        };
        let mut nothing = false;
        if let Some(o) = org_only {
            nothing |= org.is_some_and(|m| m != o);
            org = Some(o);
        }
        if let Some(p) = project_only {
            nothing |= project.is_some_and(|m| m != p);
            project = Some(p);
        }
        // A tenant's scan: bounded, and at most `AUDIT_SCANS_PER_ORG_MAX` of its org at
        // once on this node (the slot goes with the scan, which outlives a cancelled
        // call).
        let (scan_max, slot) = match org_only {
            Some(o) => match self.node.audit_scans.take(o).await {
                Some(slot) => (AUDIT_SCAN_MAX_TENANT, Some(slot)),
                None => {
                    self.node
                        .metrics
                        .refusals
                        .with_label_values(&["read", "audit_busy"])
                        .inc();
                    return Err(crate::ratelimit::exhausted_for(
                        "AUDIT_BUSY",
                        "this org's audit reads have kept running on this node: retry",
                        100,
                    ));
                }
            },
            None => (AUDIT_SCAN_MAX, None),
        };
        let head_seq = shard.view.read().state.audit.next_seq;
        let limit = (filter.limit as usize).clamp(1, AUDIT_PAGE_MAX);
        let (hold, from_ms, to_ms, from_seq) =
            (filter.hold, filter.from_ms, filter.to_ms, filter.from_seq);
        let keep = move |ev: &allot_statemachine::AuditEvent| {
            !nothing
                && org.is_none_or(|o| ev.org == Some(allot_statemachine::OrgId(o)))
                && project.is_none_or(|p| {
                    ev.account == Some(allot_statemachine::Account::Project(ProjectId(p)))
                })
                && hold.is_none_or(|h| ev.hold == Some(HoldId(h)))
                && ev.time_ms >= from_ms
                && (to_ms == 0 || ev.time_ms < to_ms)
        };
        // Up to `scan_max` events read and decoded: off the runtime's workers, which
        // also carry this node's Raft traffic (as `AuditRows` is).
        let (db, shard_id) = (self.node.db.clone(), shard.id);
        let read = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            let (rows, next_seq) =
                store::read_audit(&db, shard_id, from_seq, limit, scan_max, keep)?;
            let events = rows
                .iter()
                .map(|raw| codec::decode_kept(raw))
                .collect::<Result<Vec<_>, codec::CodecError>>()?;
            Ok::<_, store::AuditReadError>((events, next_seq))
        });
        let (mut events, next_seq): (Vec<allot_statemachine::AuditEvent>, u64) = read
            .await
            .map_err(|e| Status::internal(format!("audit read: {e}")))?
            .map_err(|e| match e {
                store::AuditReadError::Gap { .. } => {
                    edge::with_reason(Status::unavailable(e.to_string()), "AUDIT_GAP")
                }
                e => Status::internal(format!("audit store: {e}")),
            })?;
        if let Some(viewer) = Viewer::of(&reader) {
            // The chain runs through every org's events: a tenant holding the hashes
            // around another org's event could check guesses about it (DESIGN §44,
            // "The chain is the operator's"). Tenants get the events, not the chain,
            // each as its reader may see it (`redact`).
            let g = shard.view.read();
            events = events
                .into_iter()
                .filter_map(|mut e| {
                    e.prev_hash = [0; 32];
                    e.hash = [0; 32];
                    viewer.event(&g.state, e)
                })
                .collect();
        }
        Ok((events, next_seq, head_seq))
    }
}

/// Each outcome as its caller may see it (a project or user token: `redact`; a fresh
/// outcome, a replay and a forwarded leader's reply alike — redacting twice changes
/// nothing). The replicated outcome and the audit trail stay whole.
fn redacted(shard: &Shard, readers: &[Result<Actor, Actor>], mut c: Committed) -> Committed {
    let narrow = |a: &Actor| Viewer::of(a).is_some_and(|v| v.narrow());
    if readers.iter().all(|r| r.as_ref().is_ok_and(|a| !narrow(a))) {
        return c;
    }
    let g = shard.view.read();
    for (o, r) in c.outcomes.iter_mut().zip(readers) {
        let reader = match r {
            Ok(a) => Some(*a),
            // Resolved by the apply that produced the outcome: the token is known now
            // (revoked or expired since, its scope is unknown: redacted for anyone).
            Err(raw) => g.state.security.resolve(*raw, g.state.time_ms).ok(),
        };
        let viewer = match reader {
            Some(a) => Viewer::of(&a).filter(Viewer::narrow),
            None => Some(Viewer::NOBODY),
        };
        if let Some(v) = viewer {
            let whole = std::mem::replace(o, Ok(allot_statemachine::Reply::Ticked));
            *o = v.outcome(&g.state, whole);
        }
    }
    c
}

/// Queries whose work grows with the whole shard (see `query_inner`).
fn whole_shard(q: &Query) -> bool {
    matches!(
        q,
        Query::StateHash
            | Query::Invariants
            | Query::Principals(_)
            | Query::Demand(_)
            | Query::Usage(query::UsageQuery { org: None, .. })
    )
}

/// Runs `f` when dropped.
impl Services {
    /// A place for one more server stream of `who` on `shard`: bounded per principal,
    /// per org (its quota's `streams_max` on this shard) and per node. The slot is
    /// released when the stream's task ends, which it does as soon as the client goes.
    #[allow(clippy::result_large_err)]
    pub(crate) fn open_stream(
        &self,
        shard: &crate::node::Shard,
        who: Actor,
        api: &str,
    ) -> Result<StreamHold, Status> {
        let org_max = who.org().map(|org| {
            let g = shard.view.read();
            g.state
                .scheduler
                .quota(&g.state.config.scheduler, org)
                .streams_max
        });
        let rate = crate::ratelimit::stream_keys(who, org_max)
            .map(|keys| self.limiter.open_stream(&keys))
            .transpose()
            .inspect_err(|_| {
                self.node
                    .metrics
                    .refusals
                    .with_label_values(&[api, "streams"])
                    .inc()
            })?;
        Ok(StreamHold {
            _rate: rate,
            _connection: crate::connections::busy(),
        })
    }
}

/// What an open stream holds until it ends: its place under the stream bounds, and its
/// connection's slot marked busy (`crate::connections`: a connection serving a stream
/// keeps its slot; the bounds cap how many one principal or org can keep that way).
pub(crate) struct StreamHold {
    _rate: Option<crate::ratelimit::StreamSlot>,
    _connection: Option<crate::connections::Active>,
}

pub(crate) fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f()
            }
        }
    }
    Guard(Some(f))
}

type BackupStream = Pin<Box<dyn Stream<Item = Result<BackupChunk, Status>> + Send>>;
/// Backup chunks stay well under every gRPC message bound.
const BACKUP_CHUNK_BYTES: usize = 1 << 20;

/// The backup's output: bytes cut into chunks and handed to the RPC's stream, waiting
/// while it is full (the client's pace). A closed stream is a broken pipe.
struct ChunkSender {
    tx: tokio::sync::mpsc::Sender<Result<BackupChunk, Status>>,
    buf: Vec<u8>,
}

impl ChunkSender {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(BACKUP_CHUNK_BYTES));
        self.tx
            .blocking_send(Ok(BackupChunk { data }))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let take = bytes.len().min(BACKUP_CHUNK_BYTES - self.buf.len());
        self.buf.extend_from_slice(&bytes[..take]);
        if self.buf.len() == BACKUP_CHUNK_BYTES {
            self.send()?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

impl Services {
    /// A GPU node's assignments as a stream of whole sets (`Api.WatchAssignments`): the
    /// current one, then a new one whenever the set changes. Only the node's own agent or
    /// an admin may watch; bounded per principal; ended as soon as the client goes away.
    pub(crate) fn assignments_stream<T>(
        &self,
        req: &tonic::Request<T>,
        shard: ShardId,
        node_id: u64,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<pb::AssignmentsUpdate, Status>>, Status> {
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        let shard = shard_of(&self.node, shard)?;
        let reader = self.reader(shard.id, caller);
        self.limit(req, Class::Read, &[(reader, 1)])?;
        // Only the node's own agent (or an admin) may watch its assignments.
        let who = auth::authenticate(&self.node, shard.id, caller, "watch_assignments")?;
        match who {
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
        let slot = self.open_stream(shard, who, "watch_assignments")?;
        let shard_id = shard.id;
        let view = shard.view.clone();
        let mut applied = view.applied_watch();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let open = self.node.metrics.streams.clone();
        open.inc();
        let this = self.node.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _open = scopeguard(move || open.dec());
            let node = allot_statemachine::NodeId(node_id);
            // The set and the node's incarnation: a change of either sends a new set.
            let mut last: Option<(u64, Vec<AssignmentRow>)> = None;
            loop {
                let (now, idx, still) = {
                    let g = view.read();
                    let sched = &g.state.scheduler;
                    (
                        (sched.node_incarnation(node), sched.assignments(node)),
                        g.last_applied.map(|l| l.index).unwrap_or(0),
                        // The caller's token, resolved again at every change of the
                        // state: a stream outlives no revocation or expiry of it.
                        g.state.security.resolve(caller, g.state.time_ms) == Ok(who),
                    )
                };
                if !still {
                    let refused = auth::refuse(
                        &this,
                        shard_id,
                        caller,
                        "watch_assignments",
                        DenialReason::Unauthenticated,
                    );
                    let _ = tx.send(Err(refused)).await;
                    return;
                }
                if last.as_ref() != Some(&now) {
                    let msg = pb::AssignmentsUpdate {
                        assignments: now.1.iter().map(typed::query::assignment_to).collect(),
                        applied_index: idx,
                        incarnation: now.0,
                    };
                    last = Some(now);
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = applied.changed() => if changed.is_err() { return },
                    // The client went away (cancelled, disconnected): stop now, not at
                    // the next change of this node's assignments.
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(rx)
    }
}

/// The log index of the membership in effect on a replica (`ShardStatus.membership_index`,
/// what a membership change's compare-and-set names).
fn membership_index(m: &openraft::RaftMetrics<NodeId, BasicNode>) -> u64 {
    m.membership_config.log_id().map_or(0, |l| l.index)
}

fn shard_status(node: &Node, shard: &Shard) -> ShardStatus {
    let m = shard.raft.metrics().borrow().clone();
    let (_, leader_addr, _) = leader_of(&shard.raft);
    let membership = m.membership_config.membership();
    let voters: Vec<u64> = membership.voter_ids().collect();
    let learners: Vec<u64> = membership.learner_ids().collect();
    let (time, rules_active, audit_head_seq) = {
        let g = shard.view.read();
        (
            g.state.time_ms,
            g.state.rules.active,
            g.state.audit.next_seq,
        )
    };
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
        rules_active,
        audit_head_seq,
        audit_verified_seq: crate::audit_fill::verified_to(&node.db, shard.id),
        rejoining: !shard.rejoin.is_whole(),
        membership_index: membership_index(&m),
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
        let err = match crate::proposer::from_raft_error(&shard.raft, e) {
            // openraft checks a membership change against this replica's own view before
            // it checks leadership, so a follower that has not yet learned the commit of
            // the previous change answers "a change is in progress" instead of "not the
            // leader". Another node leads: it decides.
            rejected @ ProposeError::Rejected(_) => match crate::proposer::leader_of(&shard.raft) {
                (Some(leader), addr, _) if leader != self.node.id => ProposeError::NotLeader {
                    leader: Some(leader),
                    addr,
                },
                _ => rejected,
            },
            other => other,
        };
        match err {
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

/// openraft's own "forward to the leader", for a membership change this replica does
/// not propose because another node leads the shard (or none is known).
fn not_the_leader(
    raft: &crate::types::Raft,
) -> openraft::error::RaftError<NodeId, openraft::error::ClientWriteError<NodeId, BasicNode>> {
    let to = match crate::proposer::leader_of(raft) {
        (Some(id), Some(addr), _) => {
            openraft::error::ForwardToLeader::new(id, BasicNode::new(addr))
        }
        _ => openraft::error::ForwardToLeader::empty(),
    };
    openraft::error::RaftError::APIError(openraft::error::ClientWriteError::ForwardToLeader(to))
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
        // Two inits at once (two operators, a harness and an operator): the second sees
        // the first's shard initialised, not half-way (review: it could take the
        // first's "initialised here" flag back and leave no replica able to stand).
        let _one_init = self.node.init_lock.lock().await;
        if msg.members.is_empty() {
            return Err(bad_argument("no members"));
        }
        let mut members = BTreeMap::new();
        for m in msg.members.iter().cloned() {
            if m.node_id == 0 || m.addr.is_empty() {
                return Err(bad_argument(
                    "member ids must be positive and addresses set",
                ));
            }
            members.insert(m.node_id, BasicNode::new(m.addr));
        }
        if !members.contains_key(&self.node.id) {
            return Err(bad_argument("the members must include this node"));
        }
        for id in &msg.shards {
            shard_of(&self.node, *id)?;
        }
        // A new node takes the cluster's id before its shard's first vote request goes
        // out (`crate::identity`): the one the caller chose (`allotctl` picks one for
        // all the nodes it initialises), or, from an older caller, one derived from the
        // members. A node of another cluster is not initialised into this one.
        let genesis = if msg.cluster_id.is_empty() {
            crate::identity::of_genesis(members.iter().map(|(id, n)| (*id, n.addr.as_str())))
        } else {
            crate::identity::parse(msg.cluster_id.as_bytes()).map_err(|e| {
                edge::with_reason(
                    Status::invalid_argument(format!("cluster_id: {e}")),
                    "INVALID_ARGUMENT",
                )
            })?
        };
        let mut every_shard_empty = true;
        let mut would_initialise = false;
        for s in &self.node.shards {
            let empty = s
                .last_log_id()
                .await
                .map_err(Status::unavailable)?
                .is_none();
            every_shard_empty &= empty;
            would_initialise |= empty && (msg.shards.is_empty() || msg.shards.contains(&s.id));
        }
        self.node
            .identity
            .initialise(genesis, every_shard_empty, would_initialise)
            .map_err(|why| edge::with_reason(Status::failed_precondition(why), "OTHER_CLUSTER"))?;
        for s in &self.node.shards {
            if !msg.shards.is_empty() && !msg.shards.contains(&s.id) {
                continue;
            }
            // A shard this node initialises stands for election, also after a restart
            // (kept before `initialize`): its genesis configuration is its log.
            let set = if s.is_empty_replica().await.map_err(Status::unavailable)? {
                s.rejoin.initialising_here().map_err(Status::internal)?
            } else {
                false
            };
            match s.raft.initialize(members.clone()).await {
                Ok(()) => {
                    crate::transfer::rejoined(s);
                    crate::rejoin::whole_once_led(s.raft.clone(), s.rejoin.clone(), self.node.id);
                }
                // Idempotent: a retried init of an initialised shard is fine.
                Err(openraft::error::RaftError::APIError(
                    openraft::error::InitializeError::NotAllowed(_),
                )) => {
                    // It voted, or took a leader's entries, between the check and the
                    // call: not the genesis node.
                    if set {
                        s.rejoin.not_initialised_here();
                        crate::transfer::resume_elections(&s.raft, &s.rejoin);
                    }
                }
                Err(e) => return Err(raft_status(e)),
            }
        }
        Ok(tonic::Response::new(InitReply {
            shards: self.node.shards.len() as u32,
            cluster_id: self
                .node
                .identity
                .current()
                .map(|id| crate::identity::hex(&id))
                .unwrap_or_default(),
        }))
    }

    async fn add_learner(
        &self,
        req: tonic::Request<MemberRequest>,
    ) -> Result<tonic::Response<MembershipReply>, Status> {
        let req_meta = req.metadata().clone();
        let was_forwarded = forwarded(&req);
        auth::require_admin(&self.node, &req_meta, "admin:add_learner", false)?;
        let msg = req.into_inner();
        let member = msg.member.ok_or_else(|| bad_argument("member missing"))?;
        if member.node_id == 0 || member.addr.is_empty() {
            return Err(bad_argument("member id must be positive and address set"));
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
                            let r = forward_with(&self.node, m, &req_meta);
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
        let was_forwarded = forwarded(&req);
        auth::require_admin(&self.node, &req_meta, "admin:change_membership", false)?;
        let msg = req.into_inner();
        let voters: BTreeSet<NodeId> = msg.voters.iter().copied().collect();
        if voters.is_empty() || voters.contains(&0) {
            return Err(bad_argument(
                "voters must be a non-empty set of positive ids",
            ));
        }
        if msg.all_shards && msg.expected_membership_index.is_some() {
            return Err(bad_argument(
                "expected_membership_index names one shard's membership: not with all_shards",
            ));
        }
        let mut out = Vec::new();
        for s in self.target_shards(msg.shard, msg.all_shards)? {
            // The guard runs where the change is proposed: on the leader. A replica that
            // does not lead the shard leaves the change (and the guard) to the leader.
            let leads = crate::proposer::leader_of(&s.raft).0 == Some(self.node.id);
            if leads && !msg.allow_audit_loss {
                crate::audit_fill::check_removal(&self.node, s, &voters).await?;
            }
            if leads {
                new_voters_live(self.node.id, s, &voters).await?;
            }
            // Last, right before the change (the guards above wait).
            if let Some(expected) = msg.expected_membership_index.filter(|_| leads) {
                let now = membership_index(&s.raft.metrics().borrow());
                if now != expected {
                    return Err(edge::with_reason(
                        Status::failed_precondition(format!(
                            "the membership of shard {} changed since it was read (now at log \
                             index {now}, read at {expected}): read it again; nothing changed",
                            s.id
                        )),
                        "MEMBERSHIP_CHANGED",
                    ));
                }
            }
            let r = if leads {
                s.raft.change_membership(voters.clone(), false).await
            } else {
                Err(not_the_leader(&s.raft))
            };
            match r {
                Ok(_) => out.push(shard_status(&self.node, s)),
                Err(e) => {
                    let leader = self
                        .on_leader(s, e, was_forwarded, |mut c| {
                            let m = ChangeMembershipRequest {
                                shard: s.id,
                                all_shards: false,
                                voters: voters.iter().copied().collect(),
                                allow_audit_loss: msg.allow_audit_loss,
                                expected_membership_index: msg.expected_membership_index,
                            };
                            let r = forward_with(&self.node, m, &req_meta);
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
        let who = auth::require_authenticated(&self.node, req.metadata(), "admin:status")?;
        let caller = auth::caller(&self.node, auth::bearer(req.metadata())?);
        self.limit(&req, Class::Read, &[(self.reader(0, caller), 1)])?;
        // A tenant gets the routing (leaders, terms, voters, rule versions), not the
        // shards' progress: their log and audit positions are every org's activity.
        let tenant = who.is_some_and(|a| a.org().is_some());
        Ok(tonic::Response::new(StatusReply {
            node_id: self.node.id,
            shards: self
                .node
                .shards
                .iter()
                .map(|s| {
                    let st = shard_status(&self.node, s);
                    if tenant {
                        ShardStatus {
                            applied_index: 0,
                            last_log_index: 0,
                            snapshot_index: 0,
                            purged_index: 0,
                            audit_head_seq: 0,
                            audit_verified_seq: 0,
                            membership_index: 0,
                            ..st
                        }
                    } else {
                        st
                    }
                })
                .collect(),
            versions: Some(crate::versions::local_versions(&self.node)),
            disk_free_bytes: self.node.disk.free().unwrap_or(0),
            disk_low: self.node.disk.low(),
            min_free_disk_bytes: self.node.disk.min_free(),
            cluster_id: self
                .node
                .identity
                .current()
                .filter(|_| !tenant)
                .map(|id| crate::identity::hex(&id))
                .unwrap_or_default(),
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
        // Cloning the state and scanning the audit rows' coverage: off the runtime's
        // workers. A replica missing rows refuses before a byte is sent.
        let prepared = {
            let node = node.clone();
            tokio::task::spawn_blocking(move || {
                crate::backup::prepare(&node, &node.shards[id as usize])
            })
        }
        .await
        .map_err(|e| Status::internal(format!("backup task: {e}")))?
        .map_err(|e| match e {
            crate::backup::BackupError::AuditGap(_) => {
                edge::with_reason(Status::unavailable(e.to_string()), "AUDIT_GAP")
            }
            e => Status::internal(e.to_string()),
        })?;
        // Streamed as it is written, a few chunks ahead of the client at most: the node
        // never holds the copy whole, and a client that stops reading stops the writer.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            let out = ChunkSender {
                tx: tx.clone(),
                buf: Vec::with_capacity(BACKUP_CHUNK_BYTES),
            };
            match prepared.write(&node, out) {
                Ok(_) => {}
                Err(crate::backup::BackupError::Output(e))
                    if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) => {
                    tracing::warn!(shard = id, "backup failed: {e}");
                    let _ = tx.blocking_send(Err(Status::internal(e.to_string())));
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn transfer_leader(
        &self,
        req: tonic::Request<allot_proto::TransferLeaderRequest>,
    ) -> Result<tonic::Response<allot_proto::TransferLeaderReply>, Status> {
        auth::require_admin(&self.node, req.metadata(), "admin:transfer_leader", false)?;
        let msg = req.into_inner();
        shard_of(&self.node, msg.shard)?;
        let to = (msg.to != 0).then_some(msg.to);
        // A task of its own, so that it runs to its end whatever happens to this call:
        // a transfer turns this leader's heartbeats and elections off while it hands
        // over, and only its end turns them back on. Dropped with the call (a client's
        // deadline, a cancel), it left them off for good — the node never campaigned
        // again, and led without heartbeats if made leader later.
        let node = self.node.clone();
        let transfer = tokio::spawn(async move {
            let shard = shard_of(&node, msg.shard)?;
            crate::transfer::transfer(&node, shard, to).await
        });
        let reply = transfer
            .await
            .map_err(|e| Status::internal(format!("the leader transfer task failed: {e}")))??;
        Ok(tonic::Response::new(reply))
    }

    async fn shard_hash(
        &self,
        req: tonic::Request<ShardRequest>,
    ) -> Result<tonic::Response<ShardHashReply>, Status> {
        auth::require_admin(&self.node, req.metadata(), "admin:shard_hash", false)?;
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        // Hashed from a copy, off the lock (as a whole-shard query is).
        let (state, applied) = {
            let g = shard.view.read();
            (g.state.clone(), g.last_applied)
        };
        let (hash, time_ms) =
            tokio::task::spawn_blocking(move || (state.state_hash(), state.time_ms))
                .await
                .map_err(|e| Status::internal(format!("shard hash: {e}")))?;
        Ok(tonic::Response::new(ShardHashReply {
            state_hash: hash.to_vec(),
            applied_index: applied.map(|l| l.index).unwrap_or(0),
            logical_time_ms: time_ms,
        }))
    }
}

/// A peer's message, decoded (the Raft service's interceptor has authenticated it
/// when peer authentication is configured; its bytes are within `RAFT_MESSAGE_MAX`).
#[allow(clippy::result_large_err)]
fn decode_peer<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, Status> {
    codec::decode(b).map_err(|e| {
        edge::with_reason(
            Status::invalid_argument(format!("raft payload: {e}")),
            "MALFORMED",
        )
    })
}

#[allow(clippy::result_large_err)]
fn encode_peer<T: serde::Serialize>(v: &T) -> Result<tonic::Response<RaftMessage>, Status> {
    Ok(tonic::Response::new(RaftMessage {
        shard: 0,
        payload: codec::encode(v),
    }))
}

impl Services {
    /// A peer message refused by a guard (`crate::peer`): counted, logged at most once a
    /// second, answered INVALID_ARGUMENT with reason `PEER_MESSAGE_REFUSED`.
    fn peer_refused(&self, api: &str, why: String) -> Status {
        self.node
            .metrics
            .refusals
            .with_label_values(&[api, "peer"])
            .inc();
        if self.node.log_throttle.due() {
            tracing::warn!(api, reason = %why, "peer message refused (at most one line a second)");
        }
        edge::with_reason(
            Status::invalid_argument(format!("peer message refused: {why}")),
            "PEER_MESSAGE_REFUSED",
        )
    }

    /// A refusal at the edge, counted by reason.
    pub(crate) fn refused(&self, api: &str, s: &Status) {
        let reason = s
            .metadata()
            .get(allot_proto::meta::REASON)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("other")
            .to_ascii_lowercase();
        self.node
            .metrics
            .refusals
            .with_label_values(&[api, &reason])
            .inc();
    }

    /// A rejoining replica (`crate::rejoin`) whose commit reached the mark a leader
    /// announced becomes whole: it votes and stands for election again.
    async fn rejoin_progress(&self, shard: &Shard) {
        if shard.rejoin.is_whole() {
            return;
        }
        let Ok(committed) = self.committed(shard).await else {
            return;
        };
        if shard.rejoin.progress(committed) {
            crate::transfer::rejoined(shard);
            tracing::info!(
                shard = shard.id,
                committed = ?committed,
                "this replica, started with an empty log, holds a leader's commit: it votes \
                 and stands for election again"
            );
        }
    }

    /// This replica's committed log id of `shard` (guards compare peer log ids with it).
    async fn committed(&self, shard: &Shard) -> Result<Option<crate::types::LogId>, Status> {
        shard
            .raft
            .with_raft_state(|s| s.committed)
            .await
            .map_err(|e| Status::unavailable(format!("raft: {e}")))
    }
}

#[tonic::async_trait]
impl RaftService for Services {
    async fn append(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let started = std::time::Instant::now();
        let _permit = self.node.raft_permit().await?;
        let wire: AppendWire = decode_peer(&msg.payload)?;
        drop(msg);
        // One inbound message per shard at a time: the committed log id the guard
        // compares with cannot move between the check and openraft's handling.
        let _inbound = shard.inbound.lock().await;
        let committed = self.committed(shard).await?;
        peer::check_append(&wire, self.node.id, committed.as_ref())
            .map_err(|e| self.peer_refused("raft:append", e))?;
        let entries = wire.entries.len();
        let rejoining = !shard.rejoin.is_whole();
        if rejoining {
            shard
                .rejoin
                .heard(wire.vote.leader_id().term, wire.leader_commit);
        }
        let r = shard.raft.append_entries(wire.into()).await;
        if rejoining {
            self.rejoin_progress(shard).await;
        }
        let reply = encode_peer(&r);
        let label = shard.id.to_string();
        let m = &self.node.metrics;
        m.follower_append
            .with_label_values(&[&label])
            .observe(started.elapsed().as_secs_f64());
        m.follower_append_entries
            .with_label_values(&[&label])
            .observe(entries as f64);
        reply
    }

    async fn vote(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let _permit = self.node.raft_permit().await?;
        let vote: openraft::raft::VoteRequest<NodeId> = decode_peer(&msg.payload)?;
        peer::check_vote_request(&vote, self.node.id)
            .map_err(|e| self.peer_refused("raft:vote", e))?;
        self.rejoin_progress(shard).await;
        let own_last = if shard.rejoin.is_whole() {
            None
        } else {
            shard.last_log_id().await.map_err(Status::unavailable)?
        };
        if let Some(why) = shard.rejoin.vote_refusal(vote.last_log_id, own_last) {
            self.node
                .metrics
                .refusals
                .with_label_values(&["raft:vote", "rejoining"])
                .inc();
            return Err(edge::with_reason(
                Status::failed_precondition(why),
                "REJOINING",
            ));
        }
        let r = shard.raft.vote(vote).await;
        encode_peer(&r)
    }

    async fn snapshot(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let permit = self.node.raft_permit().await?;
        let chunk: SnapshotChunk = decode_peer(&msg.payload)?;
        drop(msg);
        let mut inbound = shard.inbound.lock().await;
        let committed = self.committed(shard).await?;
        peer::check_snapshot_chunk(&chunk, self.node.id, committed.as_ref())
            .map_err(|e| self.peer_refused("raft:snapshot", e))?;
        let mine = shard.raft.metrics().borrow().vote;
        if chunk.vote < mine {
            // A stale leader: tell it our vote (it steps down), keep nothing.
            let r: Result<SnapshotResponse<NodeId>, openraft::error::RaftError<NodeId>> =
                Ok(SnapshotResponse { vote: mine });
            return encode_peer(&r);
        }
        let (vote, meta) = (chunk.vote, chunk.meta.clone());
        let received = inbound.receive(chunk).await.map_err(|e| {
            edge::with_reason(Status::failed_precondition(e.to_string()), "SNAPSHOT_CHUNK")
        })?;
        drop(permit);
        let r: Result<SnapshotResponse<NodeId>, openraft::error::RaftError<NodeId>> = match received
        {
            None => Ok(SnapshotResponse { vote: mine }),
            Some(received) => {
                // Decode it here, from its file and off the runtime's workers: a snapshot
                // that is not a state is refused, where openraft would stop the shard on it.
                let decoded = tokio::task::spawn_blocking(move || received.decode())
                    .await
                    .map_err(|e| Status::internal(format!("snapshot decode task: {e}")))?;
                let (state, data) = decoded.map_err(|e| self.peer_refused("raft:snapshot", e))?;
                *shard.preloaded.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((meta.snapshot_id.clone(), Box::new(state)));
                shard
                    .raft
                    .install_full_snapshot(
                        vote,
                        openraft::Snapshot {
                            meta,
                            snapshot: Box::new(std::io::Cursor::new(data)),
                        },
                    )
                    .await
                    .map_err(openraft::error::RaftError::Fatal)
            }
        };
        self.rejoin_progress(shard).await;
        encode_peer(&r)
    }

    async fn report_denials(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        shard_of(&self.node, msg.shard)?;
        let permit = self.node.raft_permit().await?;
        let (reporter, denials): (u64, Vec<allot_statemachine::Denial>) =
            decode_peer(&msg.payload)?;
        auth::check_report(&self.node, msg.shard, reporter, &denials)
            .map_err(|e| self.peer_refused("raft:report_denials", e))?;
        // Held while the report is decoded and checked, not while it commits.
        drop(permit);
        auth::report(&self.node, msg.shard, reporter, denials)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        encode_peer(&())
    }

    async fn audit_rows(
        &self,
        req: tonic::Request<RaftMessage>,
    ) -> Result<tonic::Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        shard_of(&self.node, msg.shard)?;
        let _permit = self.node.raft_permit().await?;
        let rows_req: crate::audit_fill::RowsRequest = decode_peer(&msg.payload)?;
        let db = self.node.db.clone();
        let rows = tokio::task::spawn_blocking(move || {
            crate::audit_fill::read_rows(&db, msg.shard, &rows_req)
        })
        .await
        .map_err(|e| Status::internal(format!("audit rows task: {e}")))?
        .map_err(|e| edge::with_reason(Status::failed_precondition(e), "AUDIT_ROWS"))?;
        encode_peer(&rows)
    }

    async fn handoff(
        &self,
        req: tonic::Request<allot_proto::HandoffRequest>,
    ) -> Result<tonic::Response<allot_proto::HandoffReply>, Status> {
        if self.node.config.test_without_handoff {
            return Err(Status::unimplemented(
                "Raft.Handoff (test: a release without it)",
            ));
        }
        let msg = req.into_inner();
        let shard = shard_of(&self.node, msg.shard)?;
        let step = allot_proto::handoff_request::Step::try_from(msg.step)
            .map_err(|_| Status::invalid_argument(format!("unknown handoff step {}", msg.step)))?;
        crate::transfer::step(shard, step, Duration::from_millis(msg.hold_ms)).await?;
        Ok(tonic::Response::new(allot_proto::HandoffReply {}))
    }

    async fn audit_coverage(
        &self,
        req: tonic::Request<allot_proto::AuditCoverageRequest>,
    ) -> Result<tonic::Response<allot_proto::AuditCoverageReply>, Status> {
        let id = shard_of(&self.node, req.into_inner().shard)?.id;
        // A scan from the replica's checkpoint: off the workers, within the Raft budget.
        let _permit = self.node.raft_permit().await?;
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || {
            crate::audit_fill::coverage(&node, &node.shards[id as usize])
        })
        .await
        .map_err(|e| Status::internal(format!("audit coverage task: {e}")))?
        .map(tonic::Response::new)
        .map_err(|e| edge::with_reason(Status::failed_precondition(e), "AUDIT_ROWS"))
    }

    async fn versions(
        &self,
        _req: tonic::Request<allot_proto::VersionsRequest>,
    ) -> Result<tonic::Response<allot_proto::VersionsReply>, Status> {
        Ok(tonic::Response::new(crate::versions::local_versions(
            &self.node,
        )))
    }

    async fn clock(
        &self,
        _req: tonic::Request<ClockRequest>,
    ) -> Result<tonic::Response<ClockReply>, Status> {
        Ok(tonic::Response::new(ClockReply {
            wall_ms: self.node.clock.wall_ms(),
            node_id: self.node.id,
        }))
    }
}

/// Tenants' audit scans running on this node, per org (`AUDIT_SCANS_PER_ORG_MAX`).
#[derive(Default)]
pub struct AuditScans {
    by_org: std::sync::Mutex<std::collections::HashMap<u64, usize>>,
}

/// One running scan of an org's; its place is free again when dropped.
pub struct AuditScanSlot {
    scans: std::sync::Arc<AuditScans>,
    org: u64,
}

impl AuditScans {
    /// A place for one more scan of `org`, waiting up to `AUDIT_SCAN_WAIT_MAX` for one
    /// of its running scans to end (they are short: a bounded number of events).
    pub async fn take(self: &std::sync::Arc<Self>, org: u64) -> Option<AuditScanSlot> {
        let deadline = tokio::time::Instant::now() + crate::limits::AUDIT_SCAN_WAIT_MAX;
        loop {
            if let Some(slot) = self.try_take(org) {
                return Some(slot);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// A place for one more scan of `org`, if it has fewer than the bound running.
    pub fn try_take(self: &std::sync::Arc<Self>, org: u64) -> Option<AuditScanSlot> {
        let mut m = self.by_org.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(org).or_default();
        if *n >= crate::limits::AUDIT_SCANS_PER_ORG_MAX {
            return None;
        }
        *n += 1;
        Some(AuditScanSlot {
            scans: self.clone(),
            org,
        })
    }
}

impl Drop for AuditScanSlot {
    fn drop(&mut self) {
        let mut m = self.scans.by_org.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.org) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.org);
            }
        }
    }
}

/// How long a voter change waits for a majority of its new voters to acknowledge an entry
/// appended after it was asked (the guard appends one at once). Well inside the 5 s an
/// `allotctl` attempt allows, so that the refusal, not a deadline, reaches the operator.
const NEW_VOTERS_WAIT: Duration = Duration::from_millis(2_500);

/// Refuses a voter change whose new voter set has no live majority (`FAILED_PRECONDITION`,
/// reason `VOTERS_UNREACHABLE`; nothing changed). openraft first commits a joint
/// configuration, which needs a majority of the new voters as well as of the old; until it
/// does, every write of the shard waits on it and every other change is refused
/// (`InProgress`): one mistyped `member remove` while a node was down stopped the shard's
/// writes for as long as that node stayed down. Live: the leader itself, and each voter
/// whose replication has acknowledged an entry appended after the request arrived. A
/// majority of the new set that answers is all the change needs to complete; what it can
/// refuse that would have completed is a change whose majority needs a voter slower than
/// [`NEW_VOTERS_WAIT`] to acknowledge (a learner still installing a snapshot).
async fn new_voters_live(
    me: NodeId,
    shard: &Shard,
    voters: &BTreeSet<NodeId>,
) -> Result<(), Status> {
    let mut metrics = shard.raft.metrics();
    let start = metrics.borrow().last_log_index.unwrap_or(0);
    let deadline = tokio::time::Instant::now() + NEW_VOTERS_WAIT;
    // An entry after `start` now (an empty batch, as a tick), rather than at the next
    // tick. A leader handing over (or no longer leading) answers "not leader": the
    // caller retries on the next one. Any other outcome — committed, or not within the
    // wait — leaves the acknowledgements to decide.
    let appended = tokio::time::timeout_at(deadline, shard.proposer.propose(Vec::new())).await;
    // Not leading, or unable to append now (no clock sample yet, overloaded): a
    // retryable answer of its own, not "voters unreachable" about healthy voters.
    let unable = match appended {
        Ok(Err(e @ ProposeError::NotLeader { .. })) => return Err(status_of(e)),
        Ok(Err(e)) => Some(e),
        _ => None,
    };
    loop {
        let (leader, addr, _) = leader_of(&shard.raft);
        if leader != Some(me) {
            return Err(status_of(ProposeError::NotLeader { leader, addr }));
        }
        let silent: Vec<NodeId> = {
            let m = metrics.borrow();
            let acked = |v: &NodeId| {
                *v == me
                    || m.replication
                        .as_ref()
                        .and_then(|r| r.get(v))
                        .and_then(|l| l.as_ref())
                        .is_some_and(|l| l.index > start)
            };
            voters.iter().copied().filter(|v| !acked(v)).collect()
        };
        if (voters.len() - silent.len()) * 2 > voters.len() {
            return Ok(());
        }
        let waited = tokio::time::timeout_at(deadline, metrics.changed()).await;
        if !matches!(waited, Ok(Ok(()))) {
            if let Some(e) = unable {
                return Err(status_of(e));
            }
            let status = Status::failed_precondition(format!(
                "shard {}: the new voters {voters:?} have no live majority — {silent:?} \
                 acknowledged no entry within {} ms (down, cut off, or not members); the \
                 change would stop every write of the shard until they answer. Nothing was \
                 changed",
                shard.id,
                NEW_VOTERS_WAIT.as_millis()
            ));
            return Err(edge::with_reason(status, "VOTERS_UNREACHABLE"));
        }
    }
}

#[cfg(test)]
mod audit_scan_tests {
    /// An org holds at most its bound of scans; another org is not affected; a
    /// finished scan frees its place.
    #[test]
    fn an_org_runs_a_bounded_number_of_audit_scans() {
        let scans = std::sync::Arc::new(super::AuditScans::default());
        let held: Vec<_> = (0..crate::limits::AUDIT_SCANS_PER_ORG_MAX)
            .map(|_| scans.try_take(7).expect("within the bound"))
            .collect();
        assert!(scans.try_take(7).is_none(), "one past the bound");
        assert!(scans.try_take(8).is_some(), "another org");
        drop(held);
        assert!(scans.try_take(7).is_some(), "free again");
        assert!(
            scans.by_org.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }
}
