//! The typed API (`allot.api.v1.Api`, `proto/allot_api.proto`): each call is converted
//! (`allot_proto::typed`, the one conversion module) into the request the `Allot`
//! service takes and run through the very same path — the state machine's validation at
//! the edge, credentials, rate limits, forwarding to the leader, idempotency — so the two
//! APIs cannot disagree about a rule. Only the conversion is new here.

use crate::server::Services;
use allot_proto::allot_server::Allot;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_server::Api;
use allot_proto::typed::{self, FieldError, TypedCommand};
use allot_proto::{AuditRequest, Consistency, ExecuteRequest, QueryRequest};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::{codec, Actor, JobId, OrgId, Outcome, PrincipalId, Request};
use std::pin::Pin;
use tokio_stream::Stream;
use tonic::metadata::MetadataValue;
use tonic::{Request as Call, Response, Status};

type Reply<T> = Result<Response<T>, Status>;

/// The metadata key naming the field an `INVALID_ARGUMENT` refers to.
pub const FIELD: &str = "allot-field";

fn invalid(e: FieldError) -> Status {
    let mut s =
        crate::edge::with_reason(Status::invalid_argument(e.to_string()), "INVALID_ARGUMENT");
    if let Ok(v) = MetadataValue::try_from(e.field.as_str()) {
        s.metadata_mut().insert(FIELD, v);
    }
    s
}

fn malformed(what: &str, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}

impl Services {
    /// The shard a call runs on: the one it names, else its org's home shard, else 0.
    fn route(&self, shard: Option<u32>, org: Option<OrgId>) -> u32 {
        shard.unwrap_or_else(|| {
            org.map_or(0, |o| {
                allot_proto::shard_of_org(o.0, self.node.shards.len() as u32)
            })
        })
    }

    /// Runs one typed command through `Allot.Execute`'s path.
    async fn typed_command<T: TypedCommand>(
        &self,
        req: Call<T>,
    ) -> Result<pb::CommandReply, Status> {
        let (meta, ext, msg) = req.into_parts();
        let header = typed::header(msg.call()).map_err(invalid)?;
        let (command, org) = msg.command().map_err(invalid)?;
        let request = Request {
            // Replaced by the token's digest when the call has one (`auth::stamp`); in dev
            // mode the claimed identity, by default the operator.
            actor: header.dev_actor.unwrap_or(Actor::Admin(PrincipalId(1))),
            request_id: header.request_id,
            org,
            command,
        };
        let exec = ExecuteRequest {
            shard: self.route(header.shard, org),
            requests: vec![codec::encode(&request)],
        };
        let reply = self
            .execute_inner(Call::from_parts(meta, ext, exec))
            .await?;
        let raw = reply
            .outcomes
            .first()
            .ok_or_else(|| Status::internal("no outcome"))?;
        let outcome: Outcome = codec::decode(raw).map_err(|e| malformed("outcome", e))?;
        Ok(pb::CommandReply {
            log_index: reply.log_index,
            logical_time_ms: reply.logical_time_ms,
            result: Some(typed::outcome_to(&outcome)),
        })
    }

    /// A typed command RPC, observed like every other call.
    async fn command_rpc<T: TypedCommand>(
        &self,
        method: &str,
        req: Call<T>,
    ) -> Reply<pb::CommandReply> {
        let started = std::time::Instant::now();
        let r = self.typed_command(req).await;
        self.observe(method, started, r.is_ok());
        r.map(Response::new)
    }

    /// Runs one query through `Allot.Query`'s path: (answer, applied index, time).
    async fn typed_query<T>(
        &self,
        req: &Call<T>,
        read: Option<&pb::Read>,
        org: Option<OrgId>,
        query: Query,
    ) -> Result<(Answer, u64, u64), Status> {
        let (shard, stale_ok) = typed::read_header(read);
        let mut q = Call::new(QueryRequest {
            shard: self.route(shard, org),
            consistency: if stale_ok {
                Consistency::Stale
            } else {
                Consistency::Linearizable
            } as i32,
            query: codec::encode(&query),
        });
        *q.metadata_mut() = req.metadata().clone();
        let reply = self.query_inner(q).await?;
        let answer: Answer = codec::decode(&reply.answer).map_err(|e| malformed("answer", e))?;
        Ok((answer, reply.applied_index, reply.logical_time_ms))
    }
}

/// Events one `WatchEvents` page reads (each is then sent as its own message).
const WATCH_PAGE: u32 = 1_000;

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::AuditEvent, Status>> + Send>>;

impl Services {
    /// One page of audit events through `Allot.Audit`'s path (credentials, the tenant's
    /// confinement to its org, the read rate limit), typed.
    async fn events_page(
        &self,
        meta: &tonic::metadata::MetadataMap,
        shard: u32,
        org: Option<u64>,
        from_seq: u64,
        limit: u32,
    ) -> Result<(Vec<pb::AuditEvent>, u64, u64), Status> {
        let mut call = Call::new(AuditRequest {
            shard,
            from_seq,
            limit,
            org,
            ..AuditRequest::default()
        });
        *call.metadata_mut() = meta.clone();
        let reply = Allot::audit(self, call).await?.into_inner();
        let events = reply
            .events
            .iter()
            .map(|raw| {
                codec::decode::<allot_statemachine::AuditEvent>(raw)
                    .map(|e| typed::audit_event_to(&e))
                    .map_err(|e| malformed("audit event", e))
            })
            .collect::<Result<_, _>>()?;
        Ok((events, reply.next_seq, reply.head_seq))
    }
}

#[tonic::async_trait]
impl Api for Services {
    type WatchEventsStream = EventStream;

    async fn set_alert(&self, req: Call<pb::SetAlertRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.set_alert", req).await
    }

    /// The first page is read before the stream opens, so a refused caller (no token,
    /// another org's shard...) gets the refusal as the call's status. Then the stream
    /// follows the shard's applied index: at least once, in sequence order, bounded per
    /// principal like every stream, ended as soon as the client goes away.
    async fn watch_events(
        &self,
        req: Call<pb::WatchEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let started = std::time::Instant::now();
        let (meta, _, m) = req.into_parts();
        let shard_id = self.route(m.shard, m.org.map(OrgId));
        let shard = self
            .node
            .shard(shard_id)
            .ok_or_else(|| Status::not_found(format!("unknown shard {shard_id}")))?;
        let first = self
            .events_page(&meta, shard_id, m.org, m.from_seq, WATCH_PAGE)
            .await;
        self.observe("api.watch_events", started, first.is_ok());
        let first = first?;
        let who = crate::auth::authenticate(
            &self.node,
            shard_id,
            crate::auth::caller(&self.node, crate::auth::bearer(&meta)?),
            "watch_events",
        )?;
        let slot = crate::ratelimit::key_of(Some(who))
            .map(|k| self.limiter.open_stream(k))
            .transpose()?;
        let mut applied = shard.view.applied_watch();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let svc = self.clone();
        let open = self.node.metrics.streams.clone();
        open.inc();
        tokio::spawn(async move {
            let _slot = slot;
            let _open = crate::server::scopeguard(move || open.dec());
            let mut cursor = m.from_seq;
            let mut page: Result<_, Status> = Ok(first);
            loop {
                let (events, next, head) = match page {
                    Ok(p) => p,
                    Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                        // Rate limited: the stream waits its turn instead of failing.
                        let pause = s
                            .metadata()
                            .get(allot_proto::meta::RETRY_AFTER_MS)
                            .and_then(|v| v.to_str().ok()?.parse().ok())
                            .unwrap_or(200u64);
                        tokio::select! {
                            _ = tokio::time::sleep(std::time::Duration::from_millis(pause)) => {}
                            _ = tx.closed() => return,
                        }
                        page = svc
                            .events_page(&meta, shard_id, m.org, cursor, WATCH_PAGE)
                            .await;
                        continue;
                    }
                    Err(s) => {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                };
                let empty = events.is_empty();
                for ev in events {
                    if tx.send(Ok(ev)).await.is_err() {
                        return;
                    }
                }
                if next >= head {
                    // Caught up: wait for the shard to apply more (or the client to go).
                    tokio::select! {
                        changed = applied.changed() => if changed.is_err() { return },
                        _ = tx.closed() => return,
                    }
                } else if empty {
                    // The local trail is behind the applied state for a moment.
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                cursor = next;
                page = svc
                    .events_page(&meta, shard_id, m.org, cursor, WATCH_PAGE)
                    .await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn create_org(&self, req: Call<pb::CreateOrgRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.create_org", req).await
    }

    async fn create_project(&self, req: Call<pb::CreateProjectRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.create_project", req).await
    }

    async fn create_user(&self, req: Call<pb::CreateUserRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.create_user", req).await
    }

    async fn issue_grant(&self, req: Call<pb::IssueGrantRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.issue_grant", req).await
    }

    async fn set_prices(&self, req: Call<pb::SetPricesRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.set_prices", req).await
    }

    async fn submit_job(&self, req: Call<pb::SubmitJobRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.submit_job", req).await
    }

    async fn cancel_job(&self, req: Call<pb::CancelJobRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.cancel_job", req).await
    }

    async fn register_node(&self, req: Call<pb::RegisterNodeRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.register_node", req).await
    }

    async fn node_heartbeat(&self, req: Call<pb::NodeHeartbeatRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.node_heartbeat", req).await
    }

    async fn job_heartbeat(&self, req: Call<pb::JobHeartbeatRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.job_heartbeat", req).await
    }

    async fn finish_job(&self, req: Call<pb::FinishJobRequest>) -> Reply<pb::CommandReply> {
        self.command_rpc("api.finish_job", req).await
    }

    async fn balance(
        &self,
        req: Call<pb::BalanceRequest>,
    ) -> Result<Response<pb::BalanceReply>, Status> {
        let m = req.get_ref();
        let account = typed::account_from(m.account.as_ref(), "account").map_err(invalid)?;
        let org = OrgId(m.account.as_ref().map_or(0, |a| a.org));
        let query = Query::Balance {
            org,
            account,
            horizon_ms: m.horizon_ms,
        };
        let (answer, applied_index, logical_time_ms) = self
            .typed_query(&req, m.read.as_ref(), Some(org), query)
            .await?;
        let Answer::Balance(b) = answer else {
            return Err(malformed("answer", "not a balance"));
        };
        Ok(Response::new(pb::BalanceReply {
            balance: b.as_ref().map(typed::balance_to),
            applied_index,
            logical_time_ms,
        }))
    }

    async fn get_job(
        &self,
        req: Call<pb::GetJobRequest>,
    ) -> Result<Response<pb::GetJobReply>, Status> {
        let m = req.get_ref();
        let org = OrgId(m.org);
        let query = Query::Job(org, JobId(m.job));
        let (answer, applied_index, logical_time_ms) = self
            .typed_query(&req, m.read.as_ref(), Some(org), query)
            .await?;
        let Answer::Job(j) = answer else {
            return Err(malformed("answer", "not a job"));
        };
        Ok(Response::new(pb::GetJobReply {
            job: j.as_deref().map(typed::job_to),
            applied_index,
            logical_time_ms,
        }))
    }

    async fn audit(&self, req: Call<pb::AuditRequest>) -> Result<Response<pb::AuditReply>, Status> {
        let (meta, _, m) = req.into_parts();
        let (shard, _) = typed::read_header(m.read.as_ref());
        let shard = self.route(shard, m.org.map(OrgId));
        let (events, next_seq, head_seq) = self
            .events_page(&meta, shard, m.org, m.from_seq, m.limit)
            .await?;
        Ok(Response::new(pb::AuditReply {
            events,
            next_seq,
            head_seq,
        }))
    }
}
