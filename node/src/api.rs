//! The typed API (`allot.api.v1.Api`, `proto/allot_api.proto`), the one client and agent
//! API: each call is converted (`allot_proto::typed`, the one conversion module) into the
//! state machine's requests or query and run through the node's shared paths
//! (`crate::server`): the state machine's validation at the edge, credentials, rate
//! limits, forwarding to the leader, idempotency. Only the conversion lives here.

use crate::server::Services;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_server::Api;
use allot_proto::typed::{self, FieldError, TypedCommand};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::{Actor, JobId, OrgId, Outcome, PrincipalId, Request};
use prost::Message as _;
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

    /// The shard typed commands run on: `shard`, else the home shard of the first
    /// command's org.
    fn command_shard(
        &self,
        shard: Option<u32>,
        items: &[(usize, Result<Converted, FieldError>)],
    ) -> u32 {
        let first_org = items
            .first()
            .and_then(|(_, c)| c.as_ref().ok())
            .and_then(|(_, _, org)| *org);
        self.route(shard, first_org)
    }

    /// The shard a read runs on: the one its header names, else `org`'s home shard;
    /// and whether the caller accepts this replica's state.
    fn read_shard(&self, read: Option<&pb::Read>, org: Option<OrgId>) -> (u32, bool) {
        let (shard, stale_ok) = typed::read_header(read);
        (self.route(shard, org), stale_ok)
    }

    /// A reply to a call on `shard`, naming the shard's leader (`allot-leader-addr`)
    /// when this replica does not lead it — it forwarded the call, or answered a read
    /// from its own state — so the client sends its next call to the leader instead of
    /// paying the forward on every call (DESIGN §31).
    fn reply<T>(&self, shard: u32, msg: T) -> Response<T> {
        let mut r = Response::new(msg);
        if let Some(addr) = crate::server::leader_elsewhere(&self.node, shard) {
            r.metadata_mut()
                .insert(allot_proto::meta::LEADER_ADDR, addr);
        }
        r
    }

    /// Runs typed commands (each converted, or the field it cannot take) on shard
    /// `shard_id` (`command_shard`): the size bound, the state machine's own
    /// validation, credentials, rate limit, proposer or leader.
    async fn run_typed<T>(
        &self,
        req: &Call<T>,
        shard_id: u32,
        items: Vec<(usize, Result<Converted, FieldError>)>,
    ) -> Result<(Vec<Outcome>, u64, u64), Status> {
        // The shard first: nothing below (a denial queued for its audit trail included)
        // may act for a shard this node does not host.
        let shard = crate::server::shard_of(&self.node, shard_id)?;
        let bearer = crate::auth::bearer(req.metadata())?;
        let n = items.len();
        let admitted = crate::edge::admit_each(
            &self.node,
            shard_id,
            bearer,
            items.into_iter(),
            |i, (len, converted)| {
                crate::edge::check_size(i, len)?;
                let (header, command, org) = converted.map_err(|e| invalid_at(i, n, e))?;
                if header.shard.is_some_and(|s| s != shard_id) {
                    return Err(invalid_at(
                        i,
                        n,
                        FieldError {
                            field: "call.shard".into(),
                            problem: format!("the call runs on shard {shard_id}"),
                        },
                    ));
                }
                Ok(Request {
                    // Replaced by the token's digest when the call has one
                    // (`auth::stamp`); in dev mode the claimed identity, by default the
                    // operator.
                    actor: header.dev_actor.unwrap_or(Actor::Admin(PrincipalId(1))),
                    request_id: header.request_id,
                    org,
                    command,
                })
            },
        );
        let requests = admitted.inspect_err(|s| self.refused("api.execute", s))?;
        let done = self.execute_admitted(req, shard, requests).await?;
        Ok((done.outcomes, done.log_index, done.logical_time_ms))
    }

    /// Runs one typed command.
    async fn typed_command<T: TypedCommand + prost::Message>(
        &self,
        req: Call<T>,
    ) -> Result<Response<pb::CommandReply>, Status> {
        let msg = req.get_ref();
        let shard = msg.call().and_then(|c| c.shard);
        let item = typed::header(msg.call()).and_then(|h| {
            let (command, org) = msg.command()?;
            Ok((h, command, org))
        });
        let items = vec![(msg.encoded_len(), item)];
        let shard = self.command_shard(shard, &items);
        let (outcomes, log_index, logical_time_ms) = self.run_typed(&req, shard, items).await?;
        let outcome = outcomes
            .first()
            .ok_or_else(|| Status::internal("no outcome"))?;
        Ok(self.reply(
            shard,
            pb::CommandReply {
                log_index,
                logical_time_ms,
                result: Some(typed::outcome_to(outcome)),
            },
        ))
    }

    /// A typed command RPC, observed like every other call.
    async fn command_rpc<T: TypedCommand + prost::Message>(
        &self,
        method: &str,
        req: Call<T>,
    ) -> Reply<pb::CommandReply> {
        let started = std::time::Instant::now();
        let r = self.typed_command(req).await;
        self.observe(method, started, r.is_ok());
        r
    }

    /// Answers one query (`Services::answer`): (answer, applied index, time), and
    /// the shard that answered it.
    async fn typed_query<T>(
        &self,
        req: &Call<T>,
        read: Option<&pb::Read>,
        org: Option<OrgId>,
        query: Query,
    ) -> Result<((Answer, u64, u64), u32), Status> {
        let (shard, stale_ok) = self.read_shard(read, org);
        Ok((self.answer(req, shard, !stale_ok, query).await?, shard))
    }
}

/// A converted batch entry: its header, command and org.
type Converted = (typed::Header, allot_statemachine::Command, Option<OrgId>);

/// A field of command `index` (of `n`) the server cannot take.
fn invalid_at(index: usize, n: usize, e: FieldError) -> Status {
    let e = if n > 1 {
        FieldError {
            field: format!("commands[{index}].{}", e.field),
            problem: e.problem,
        }
    } else {
        e
    };
    let mut s = invalid(e);
    if let Ok(v) = MetadataValue::try_from(index.to_string()) {
        s.metadata_mut().insert(allot_proto::meta::REQUEST_INDEX, v);
    }
    s
}

/// Events one `WatchEvents` page reads (each is then sent as its own message).
const WATCH_PAGE: u32 = 1_000;

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::AuditEvent, Status>> + Send>>;
type AssignmentStream = Pin<Box<dyn Stream<Item = Result<pb::AssignmentsUpdate, Status>> + Send>>;

impl Services {
    /// One page of `shard`'s audit events (`Services::audit_page`: credentials, the
    /// tenant's confinement to its org, the read rate limit), typed.
    async fn events_page(
        &self,
        meta: &tonic::metadata::MetadataMap,
        shard: u32,
        filter: &pb::AuditRequest,
    ) -> Result<(Vec<pb::AuditEvent>, u64, u64), Status> {
        let mut call = Call::new(());
        *call.metadata_mut() = meta.clone();
        let (events, next, head) = self.audit_page(&call, shard, filter, false).await?;
        Ok((
            events.iter().map(typed::audit_event_to).collect(),
            next,
            head,
        ))
    }
}

#[tonic::async_trait]
impl Api for Services {
    type WatchEventsStream = EventStream;

    /// Any read: converted, routed by the org it names (else `read.shard`), answered
    /// through `Services::answer`.
    async fn query(&self, req: Call<pb::QueryRequest>) -> Reply<pb::QueryReply> {
        let started = std::time::Instant::now();
        let r = async {
            let m = req.get_ref();
            let query = typed::query::query_from(m.query.as_ref()).map_err(invalid)?;
            let org = typed::query::query_org(&query);
            let ((answer, applied_index, logical_time_ms), shard) =
                self.typed_query(&req, m.read.as_ref(), org, query).await?;
            Ok(self.reply(
                shard,
                pb::QueryReply {
                    applied_index,
                    logical_time_ms,
                    answer: Some(typed::query::answer_to(&answer)),
                },
            ))
        }
        .await;
        self.observe("api.query", started, r.is_ok());
        r
    }

    type WatchAssignmentsStream = AssignmentStream;

    async fn watch_assignments(
        &self,
        req: Call<pb::WatchAssignmentsRequest>,
    ) -> Result<Response<AssignmentStream>, Status> {
        let (shard, node) = (req.get_ref().shard, req.get_ref().node);
        let rx = self.assignments_stream(&req, shard, node)?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    /// A batch of typed commands on one shard: one proposal, one log entry.
    async fn execute(&self, req: Call<pb::ExecuteRequest>) -> Reply<pb::ExecuteReply> {
        let started = std::time::Instant::now();
        let m = req.get_ref();
        let items: Vec<_> = m
            .commands
            .iter()
            .map(|c| (c.encoded_len(), typed::command_from(c)))
            .collect();
        let shard = self.command_shard(m.shard, &items);
        let r = self.run_typed(&req, shard, items).await.map(
            |(outcomes, log_index, logical_time_ms)| {
                self.reply(
                    shard,
                    pb::ExecuteReply {
                        replies: outcomes
                            .iter()
                            .map(|o| pb::CommandReply {
                                log_index,
                                logical_time_ms,
                                result: Some(typed::outcome_to(o)),
                            })
                            .collect(),
                        log_index,
                        logical_time_ms,
                    },
                )
            },
        );
        self.observe("api.execute", started, r.is_ok());
        r
    }

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
        let shard = crate::server::shard_of(&self.node, shard_id)?;
        let page = move |from_seq| pb::AuditRequest {
            from_seq,
            limit: WATCH_PAGE,
            org: m.org,
            ..pb::AuditRequest::default()
        };
        let first = self.events_page(&meta, shard_id, &page(m.from_seq)).await;
        self.observe("api.watch_events", started, first.is_ok());
        let first = first?;
        let who = crate::auth::authenticate(
            &self.node,
            shard_id,
            crate::auth::caller(&self.node, crate::auth::bearer(&meta)?),
            "watch_events",
        )?;
        let slot = self.open_stream(shard, who, "watch_events")?;
        let mut applied = shard.view.applied_watch();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let svc = self.clone();
        let open = self.node.metrics.streams.clone();
        open.inc();
        let next_page = page;
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
                        page = svc.events_page(&meta, shard_id, &next_page(cursor)).await;
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
                page = svc.events_page(&meta, shard_id, &next_page(cursor)).await;
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
        let org = m
            .account
            .as_ref()
            .and_then(|a| a.org)
            .map(OrgId)
            .ok_or_else(|| {
                invalid(FieldError {
                    field: "account.org".into(),
                    problem: "required".into(),
                })
            })?;
        let query = Query::Balance {
            org,
            account,
            horizon_ms: m.horizon_ms,
        };
        let ((answer, applied_index, logical_time_ms), shard) = self
            .typed_query(&req, m.read.as_ref(), Some(org), query)
            .await?;
        let Answer::Balance(b) = answer else {
            return Err(malformed("answer", "not a balance"));
        };
        Ok(self.reply(
            shard,
            pb::BalanceReply {
                balance: b.as_ref().map(typed::balance_to),
                applied_index,
                logical_time_ms,
            },
        ))
    }

    async fn get_job(
        &self,
        req: Call<pb::GetJobRequest>,
    ) -> Result<Response<pb::GetJobReply>, Status> {
        let m = req.get_ref();
        let org = OrgId(m.org);
        let query = Query::Job(org, JobId(m.job));
        let ((answer, applied_index, logical_time_ms), shard) = self
            .typed_query(&req, m.read.as_ref(), Some(org), query)
            .await?;
        let Answer::Job(j) = answer else {
            return Err(malformed("answer", "not a job"));
        };
        Ok(self.reply(
            shard,
            pb::GetJobReply {
                job: j.as_deref().map(typed::job_to),
                applied_index,
                logical_time_ms,
            },
        ))
    }

    async fn audit(&self, req: Call<pb::AuditRequest>) -> Result<Response<pb::AuditReply>, Status> {
        let m = req.get_ref();
        let (shard, stale_ok) = self.read_shard(m.read.as_ref(), m.org.map(OrgId));
        // Linearizable unless the caller accepts this replica's state (DESIGN §56): a
        // replica still catching up must not report an old head as the chain's.
        if !stale_ok {
            if let Some(reply) = self.audit_at_leader(&req, shard).await? {
                return Ok(self.reply(shard, reply));
            }
        }
        let (events, next_seq, head_seq) = self.audit_page(&req, shard, m, !stale_ok).await?;
        let events = events.iter().map(typed::audit_event_to).collect();
        Ok(self.reply(
            shard,
            pb::AuditReply {
                events,
                next_seq,
                head_seq,
            },
        ))
    }
}
