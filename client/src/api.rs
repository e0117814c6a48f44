//! The typed API: one method per operation. Tenant operations take the org and go to
//! its home shard (the directory); GPU-pool operations take the shard that owns the
//! pool. Each mutating call generates one request id and reuses it on every retry.

use crate::error::{Error, Result};
use crate::transport::Client;
use allot_proto::api::v1 as pb;
use allot_proto::typed;
use allot_statemachine::ledger::{Balance, BucketView, PriceTable, Totals};
use allot_statemachine::query::{
    Answer, BudgetView, DemandQuery, JobFilter, JobsPage, Query, TenancyView, TierQueue,
    TypeDemand, UsageQuery, UsageRow,
};
use allot_statemachine::scheduler::{GpuNode, Job, JobState, SchedulerSettings};
use allot_statemachine::{
    Account, AuditEvent, BucketId, BudgetScope, BudgetSpec, Command, GpuType, Grant, HoldId,
    HoldSpec, JobHeartbeat, JobId, JobSpec, NodeId, NodeSpec, OrgId, Plan, ProjectId, Quota, Reply,
    Request, RequestId, UserId,
};
use std::pin::Pin;
use tokio_stream::{Stream, StreamExt};

/// A job placed on a node, as its agent sees it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Assignment {
    /// The org the job is in: the agent reports on it in that org's namespace.
    pub org: OrgId,
    pub job: JobId,
    /// The fencing token: heartbeats and finishes must carry it.
    pub attempt: u32,
    pub gpu_indices: Vec<u8>,
    pub state: JobState,
}

/// A node's assignments with the agent incarnation the node runs now (one read).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AssignmentSet {
    /// The node's current agent incarnation (`RegisterNode`'s; 0: none named, or a
    /// server older than the field). Higher than an agent's own: that agent has been
    /// replaced and must stop. Lower: a view from before the agent registered.
    pub incarnation: u64,
    pub assignments: Vec<Assignment>,
}

/// Which audit events to return; unset fields match everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditFilter {
    pub org: Option<OrgId>,
    pub project: Option<ProjectId>,
    /// A job's events (its hold has the job's id) or an explicit hold's.
    pub hold: Option<HoldId>,
    /// Logical-time range `[from_ms, to_ms)`; 0 = unbounded.
    pub from_ms: u64,
    pub to_ms: u64,
}

/// One page of audit events.
#[derive(Clone, Debug)]
pub struct AuditPage {
    pub events: Vec<AuditEvent>,
    /// Where the next page starts.
    pub next_seq: u64,
    /// The chain's length when answered: `next_seq == head_seq` means caught up.
    pub head_seq: u64,
}

pub type AssignmentStream = Pin<Box<dyn Stream<Item = Result<Vec<Assignment>>> + Send>>;
/// A stream of whole assignment sets with the node's incarnation ([`Client::watch_assignment_sets`]).
pub type AssignmentSetStream = Pin<Box<dyn Stream<Item = Result<AssignmentSet>> + Send>>;

fn unexpected<T>(what: &str, got: impl std::fmt::Debug) -> Result<T> {
    Err(Error::Unexpected(format!("{what}: got {got:?}")))
}

impl Client {
    /// Runs one command on a shard as this client's identity, with a fresh request id.
    pub async fn run(&self, shard: u32, command: Command) -> Result<Reply> {
        self.run_with_id(shard, self.next_request_id(), command)
            .await
    }

    /// Runs one command with a caller-chosen request id (to retry an operation whose
    /// first attempt's fate is unknown: the shard answers with the first outcome).
    pub async fn run_with_id(
        &self,
        shard: u32,
        request_id: RequestId,
        command: Command,
    ) -> Result<Reply> {
        self.run_in(shard, None, request_id, command).await
    }

    /// Runs one command in `org`'s namespace (the org its project, user, hold and job
    /// ids are in) with a caller-chosen request id.
    pub async fn run_in(
        &self,
        shard: u32,
        org: Option<OrgId>,
        request_id: RequestId,
        command: Command,
    ) -> Result<Reply> {
        Ok(self.run_in_at(shard, org, request_id, command).await?.0)
    }

    /// [`Client::run_in`], with the log index the command was applied at.
    pub async fn run_in_at(
        &self,
        shard: u32,
        org: Option<OrgId>,
        request_id: RequestId,
        command: Command,
    ) -> Result<(Reply, u64)> {
        let req = Request {
            actor: self.identity(),
            request_id,
            org,
            command,
        };
        let (mut outcomes, index) = self.execute(shard, std::slice::from_ref(&req)).await?;
        match outcomes.pop() {
            Some(Ok(reply)) => Ok((reply, index)),
            Some(Err(e)) => Err(Error::Rejected(e)),
            None => Err(Error::Unexpected("no outcome".into())),
        }
    }

    /// Runs a command on an org's home shard (the directory), in the org's namespace.
    pub async fn run_for_org(&self, org: OrgId, command: Command) -> Result<Reply> {
        let shard = self.shard_of_org(org).await?;
        self.run_in(shard, Some(org), self.next_request_id(), command)
            .await
    }

    async fn query_org(&self, org: OrgId, q: &Query) -> Result<Answer> {
        let shard = self.shard_of_org(org).await?;
        self.query(shard, q).await
    }

    // ------------------------------------------------------------------ tenancy

    pub async fn create_org(&self, org: OrgId) -> Result<()> {
        self.run_for_org(org, Command::CreateOrg { org })
            .await
            .map(drop)
    }

    pub async fn create_project(&self, org: OrgId, project: ProjectId) -> Result<()> {
        self.run_for_org(org, Command::CreateProject { project, org })
            .await
            .map(drop)
    }

    pub async fn create_user(&self, org: OrgId, user: UserId) -> Result<()> {
        self.run_for_org(org, Command::CreateUser { user, org })
            .await
            .map(drop)
    }

    /// Replaces the price table (micro-credits per GPU-hour) on every shard. Returns
    /// each shard's new price-table version.
    pub async fn set_prices(&self, prices: Vec<(GpuType, u64)>) -> Result<Vec<u32>> {
        let mut versions = Vec::new();
        for shard in 0..self.shards().await? {
            match self
                .run(
                    shard,
                    Command::SetPrices {
                        prices: prices.clone(),
                    },
                )
                .await?
            {
                Reply::PricesSet { version } => versions.push(version),
                other => return unexpected("set prices", other),
            }
        }
        Ok(versions)
    }

    pub async fn prices(&self, shard: u32) -> Result<PriceTable> {
        match self.query(shard, &Query::Prices).await? {
            Answer::Prices(p) => Ok(p),
            other => unexpected("prices", other),
        }
    }

    // ------------------------------------------------------------------ credits

    /// Issues a grant into an org's or project's bucket (the bucket id is the caller's:
    /// issuing the same grant again is answered as the first time).
    pub async fn issue_grant(&self, org: OrgId, grant: Grant) -> Result<BucketId> {
        match self.run_for_org(org, Command::IssueGrant(grant)).await? {
            Reply::GrantIssued { bucket } => Ok(bucket),
            other => unexpected("issue grant", other),
        }
    }

    /// An account's buckets in spend order, and the logical time they were read at.
    pub async fn buckets_at(&self, org: OrgId, account: Account) -> Result<(Vec<BucketView>, u64)> {
        let shard = self.shard_of_org(org).await?;
        match self
            .query_timed(shard, &Query::Buckets { org, account }, false)
            .await?
        {
            (Answer::Buckets(Some(b)), now) => Ok((b, now)),
            (Answer::Buckets(None), _) => Err(Error::NotFound(account.to_string())),
            (other, _) => unexpected("buckets", other),
        }
    }

    /// An account's buckets in spend order.
    pub async fn buckets(&self, org: OrgId, account: Account) -> Result<Vec<BucketView>> {
        Ok(self.buckets_at(org, account).await?.0)
    }

    /// Issues a grant whose bucket expires `expires_in_ms` after the logical time the
    /// cluster applies it at (the grant's `expires_at_ms` is ignored).
    pub async fn issue_grant_in(
        &self,
        org: OrgId,
        grant: Grant,
        expires_in_ms: u64,
    ) -> Result<BucketId> {
        let command = Command::IssueGrantIn {
            grant,
            expires_in_ms,
        };
        match self.run_for_org(org, command).await? {
            Reply::GrantIssued { bucket } => Ok(bucket),
            other => unexpected("issue grant", other),
        }
    }

    /// Balance with its breakdown and the buckets expiring within `horizon_ms`.
    pub async fn balance(&self, org: OrgId, account: Account, horizon_ms: u64) -> Result<Balance> {
        match self
            .query_org(
                org,
                &Query::Balance {
                    org,
                    account,
                    horizon_ms,
                },
            )
            .await?
        {
            Answer::Balance(Some(b)) => Ok(b),
            Answer::Balance(None) => Err(Error::NotFound(format!("{account}"))),
            other => unexpected("balance", other),
        }
    }

    pub async fn set_budget(
        &self,
        org: OrgId,
        scope: BudgetScope,
        budget: Option<BudgetSpec>,
    ) -> Result<()> {
        self.run_for_org(org, Command::SetBudget { scope, budget })
            .await
            .map(drop)
    }

    /// Sets (`Some`) or removes an alert on an org's, project's or user's available
    /// credit and budget use: each crossing appends a `LowBalance` or `BudgetThreshold`
    /// audit event (once per crossing; `allot_statemachine::alerts`).
    pub async fn set_alert(
        &self,
        org: OrgId,
        scope: BudgetScope,
        alert: Option<allot_statemachine::alerts::AlertSpec>,
    ) -> Result<()> {
        self.run_for_org(org, Command::SetAlert { scope, alert })
            .await
            .map(drop)
    }

    pub async fn budget(&self, org: OrgId, scope: BudgetScope) -> Result<BudgetView> {
        match self.query_org(org, &Query::Budget(org, scope)).await? {
            Answer::Budget(Some(b)) => Ok(b),
            Answer::Budget(None) => Err(Error::NotFound(format!("{scope:?}"))),
            other => unexpected("budget", other),
        }
    }

    pub async fn transfer(
        &self,
        org: OrgId,
        from: Account,
        to: Account,
        amount_micro: u64,
    ) -> Result<Vec<BucketId>> {
        match self
            .run_for_org(
                org,
                Command::Transfer {
                    from,
                    to,
                    amount_micro,
                },
            )
            .await?
        {
            Reply::Transferred { buckets } => Ok(buckets),
            other => unexpected("transfer", other),
        }
    }

    /// An explicit reservation outside the scheduler (e.g. for work metered elsewhere).
    pub async fn create_hold(&self, org: OrgId, spec: HoldSpec) -> Result<Reply> {
        self.run_for_org(org, Command::CreateHold(spec)).await
    }

    pub async fn capture(&self, org: OrgId, hold: HoldId, amount_micro: u64) -> Result<Reply> {
        self.run_for_org(org, Command::Capture { hold, amount_micro })
            .await
    }

    pub async fn release_hold(&self, org: OrgId, hold: HoldId) -> Result<Reply> {
        self.run_for_org(org, Command::ReleaseHold { hold }).await
    }

    pub async fn totals(&self, shard: u32) -> Result<Totals> {
        match self.query(shard, &Query::Totals).await? {
            Answer::Totals(t) => Ok(t),
            other => unexpected("totals", other),
        }
    }

    // ------------------------------------------------------------------ jobs

    /// Submits a job: validates, applies quotas, reserves its hold and enqueues it, all
    /// or nothing. Idempotent by job id. Returns the job's state and hold.
    pub async fn submit_job(&self, org: OrgId, spec: JobSpec) -> Result<Reply> {
        self.run_for_org(org, Command::SubmitJob(spec)).await
    }

    /// [`Client::submit_job`] with a dedup key (rule version 3): the answer is
    /// `Reply::JobAttached` when the job attached to another of the org with the same
    /// key (in flight: it waits for its result; succeeded: it succeeded at once), else
    /// `Reply::JobSubmitted` (it runs).
    pub async fn submit_job_dedup(
        &self,
        org: OrgId,
        spec: JobSpec,
        key: allot_statemachine::DedupKey,
    ) -> Result<Reply> {
        self.run_for_org(org, Command::SubmitJobDedup { spec, key })
            .await
    }

    pub async fn job(&self, org: OrgId, job: JobId) -> Result<Job> {
        match self.query_org(org, &Query::Job(org, job)).await? {
            Answer::Job(Some(j)) => Ok(*j),
            Answer::Job(None) => Err(Error::NotFound(format!("{job}"))),
            other => unexpected("job", other),
        }
    }

    /// One page of an org's jobs (the filter's `org` is set to `org`).
    pub async fn jobs(&self, org: OrgId, mut filter: JobFilter) -> Result<JobsPage> {
        filter.org = Some(org);
        match self.query_org(org, &Query::Jobs(filter)).await? {
            Answer::Jobs(p) => Ok(p),
            other => unexpected("jobs", other),
        }
    }

    pub async fn cancel_job(&self, org: OrgId, job: JobId) -> Result<Reply> {
        self.run_for_org(org, Command::CancelJob { job }).await
    }

    pub async fn set_quota(&self, org: OrgId, quota: Option<Quota>) -> Result<()> {
        self.run_for_org(org, Command::SetQuota { org, quota })
            .await
            .map(drop)
    }

    /// Sets (`Some`) or removes `org`'s plan: the tiers its jobs and holds may use (admin).
    pub async fn set_plan(&self, org: OrgId, plan: Option<Plan>) -> Result<()> {
        self.run_for_org(org, Command::SetPlan { org, plan })
            .await
            .map(drop)
    }

    /// `org`'s quota, plan and what it uses of each quota (its org token or an admin).
    pub async fn tenancy(&self, org: OrgId) -> Result<TenancyView> {
        match self.query_org(org, &Query::Tenancy(org)).await? {
            Answer::Tenancy(Some(v)) => Ok(*v),
            Answer::Tenancy(None) => Err(Error::NotFound(org.to_string())),
            other => unexpected("tenancy", other),
        }
    }

    /// The fair-share weight of an org (admin), or of a project or user of `org` (its
    /// org token may set those); `None` returns it to the default (100).
    pub async fn set_share_weight(
        &self,
        org: OrgId,
        scope: BudgetScope,
        weight: Option<u32>,
    ) -> Result<()> {
        self.run_for_org(org, Command::SetShareWeight { scope, weight })
            .await
            .map(drop)
    }

    /// The top consumers at `q.level` by credits used in `q.period`, largest first, each
    /// with the shard it lives on. With `q.org` set, from that org's home shard;
    /// otherwise from every shard, merged.
    pub async fn usage(&self, q: UsageQuery) -> Result<Vec<(u32, UsageRow)>> {
        let shards = match q.org {
            Some(org) => vec![self.shard_of_org(org).await?],
            None => (0..self.shards().await?).collect(),
        };
        let mut rows = Vec::new();
        for shard in shards {
            match self.query(shard, &Query::Usage(q)).await? {
                Answer::Usage(r) => rows.extend(r.into_iter().map(|row| (shard, row))),
                other => return unexpected("usage", other),
            }
        }
        rows.sort_by(|(sa, a), (sb, b)| {
            b.used_micro
                .cmp(&a.used_micro)
                .then(a.scope.cmp(&b.scope))
                .then(sa.cmp(sb))
        });
        let limit = match q.limit {
            0 => allot_statemachine::limits::USAGE_ROWS_MAX,
            n => n.min(allot_statemachine::limits::USAGE_ROWS_MAX),
        };
        rows.truncate(limit as usize);
        Ok(rows)
    }

    /// Per tier of a shard: queued jobs, the oldest one's wait, GPUs running.
    pub async fn queue(&self, shard: u32) -> Result<Vec<TierQueue>> {
        match self.query(shard, &Query::Queue).await? {
            Answer::Queue(q) => Ok(q),
            other => unexpected("queue", other),
        }
    }

    /// The demand signal of a shard's pool (admin only): per GPU type, the capacity
    /// taking work, the queued work and the wait it implies, and per tier the GPUs that
    /// would bring the tier within its target wait. `run_pct`: the share of its max
    /// duration a queued job is expected to run (0: 100, every job to its bound).
    pub async fn demand(&self, shard: u32, run_pct: u32) -> Result<Vec<TypeDemand>> {
        match self
            .query(shard, &Query::Demand(DemandQuery { run_pct }))
            .await?
        {
            Answer::Demand(d) => Ok(d),
            other => unexpected("demand", other),
        }
    }

    pub async fn scheduler_settings(&self, shard: u32) -> Result<SchedulerSettings> {
        match self.query(shard, &Query::SchedulerSettings).await? {
            Answer::SchedulerSettings(s) => Ok(s),
            other => unexpected("scheduler settings", other),
        }
    }

    /// The shard's scheduler settings as of log index `index` or later: a replica's
    /// own state (no read index) when it has applied `index`, else a linearizable read.
    /// What an agent reads after a renewal it knows the index of.
    pub async fn scheduler_settings_since(
        &self,
        shard: u32,
        index: u64,
    ) -> Result<SchedulerSettings> {
        match self
            .query_at(shard, &Query::SchedulerSettings, true)
            .await?
        {
            (Answer::SchedulerSettings(s), applied, _) if applied >= index => Ok(s),
            (Answer::SchedulerSettings(_), _, _) => self.scheduler_settings(shard).await,
            (other, _, _) => unexpected("scheduler settings", other),
        }
    }

    /// Retunes a shard's scheduler (admin only; validated whole, applied whole).
    pub async fn configure_scheduler(&self, shard: u32, settings: SchedulerSettings) -> Result<()> {
        self.run(shard, Command::ConfigureScheduler(settings))
            .await
            .map(drop)
    }

    // ------------------------------------------------------------------ GPU pool

    pub async fn register_node(&self, shard: u32, spec: NodeSpec) -> Result<()> {
        self.run(shard, Command::RegisterNode(spec)).await.map(drop)
    }

    pub async fn set_node_draining(&self, shard: u32, node: NodeId, draining: bool) -> Result<()> {
        self.run(shard, Command::SetNodeDraining { node, draining })
            .await
            .map(drop)
    }

    pub async fn nodes(&self, shard: u32) -> Result<Vec<GpuNode>> {
        match self.query(shard, &Query::Nodes).await? {
            Answer::Nodes(n) => Ok(n),
            other => unexpected("nodes", other),
        }
    }

    // ------------------------------------------------------------------ agent

    /// The node agent is alive (renews the node lease).
    pub async fn node_heartbeat(&self, shard: u32, node: NodeId) -> Result<()> {
        self.node_heartbeat_at(shard, node).await.map(drop)
    }

    /// [`Client::node_heartbeat`], answering the log index the renewal was applied at.
    pub async fn node_heartbeat_at(&self, shard: u32, node: NodeId) -> Result<u64> {
        let command = Command::NodeHeartbeat { node };
        let (_, index) = self
            .run_in_at(shard, None, self.next_request_id(), command)
            .await?;
        Ok(index)
    }

    /// Meters a placed job's attempt and renews its lease (the job of `org`).
    pub async fn job_heartbeat(&self, shard: u32, org: OrgId, hb: JobHeartbeat) -> Result<Reply> {
        self.run_in(
            shard,
            Some(org),
            self.next_request_id(),
            Command::JobHeartbeat(hb),
        )
        .await
    }

    /// Reports that the agent stopped an attempt itself because it could not renew its
    /// lease (it is requeued, billed to its last heartbeat).
    pub async fn job_fenced(
        &self,
        shard: u32,
        org: OrgId,
        job: JobId,
        attempt: u32,
    ) -> Result<Reply> {
        self.run_in(
            shard,
            Some(org),
            self.next_request_id(),
            Command::JobFenced { job, attempt },
        )
        .await
    }

    /// Reports an attempt's exit (or, while preempting, that it stopped).
    pub async fn finish_job(
        &self,
        shard: u32,
        org: OrgId,
        job: JobId,
        attempt: u32,
        success: bool,
    ) -> Result<Reply> {
        self.run_in(
            shard,
            Some(org),
            self.next_request_id(),
            Command::FinishJob {
                job,
                attempt,
                success,
            },
        )
        .await
    }

    /// The jobs placed on a node now (linearizable).
    pub async fn assignments(&self, shard: u32, node: NodeId) -> Result<Vec<Assignment>> {
        Ok(self.assignment_set(shard, node).await?.assignments)
    }

    /// The jobs placed on a node now and the node's agent incarnation, in one
    /// linearizable read.
    pub async fn assignment_set(&self, shard: u32, node: NodeId) -> Result<AssignmentSet> {
        match self.query(shard, &Query::Assignments(node)).await? {
            Answer::Assignments { incarnation, rows } => Ok(AssignmentSet {
                incarnation,
                assignments: rows.into_iter().map(assignment).collect(),
            }),
            other => unexpected("assignments", other),
        }
    }

    /// A stream of a node's assignments from one endpoint: the current set first, then
    /// a new set whenever it changes. It ends when the connection does; call again
    /// (any endpoint) to resume — each message is the whole set, so nothing is missed.
    pub async fn watch_assignments(
        &self,
        addr: &str,
        shard: u32,
        node: NodeId,
    ) -> Result<AssignmentStream> {
        let sets = self.watch_assignment_sets(addr, shard, node).await?;
        Ok(Box::pin(sets.map(|s| s.map(|s| s.assignments))))
    }

    /// [`Client::watch_assignments`], each set with the node's agent incarnation. The
    /// endpoint answers from its own replica, which may lag the leader: confirm with
    /// [`Client::assignment_set`] before acting on a set as current.
    pub async fn watch_assignment_sets(
        &self,
        addr: &str,
        shard: u32,
        node: NodeId,
    ) -> Result<AssignmentSetStream> {
        let stream = self
            .api_at(addr)?
            .watch_assignments(self.authorized(pb::WatchAssignmentsRequest {
                shard,
                node: node.0,
            }))
            .await
            .map_err(|s| Error::from_status(&s))?
            .into_inner();
        Ok(Box::pin(stream.map(|m| {
            let m = m.map_err(|s| Error::from_status(&s))?;
            let assignments = m
                .assignments
                .iter()
                .map(|a| {
                    typed::query::assignment_from(a, "assignments")
                        .map(assignment)
                        .map_err(|e| Error::Decode(e.to_string()))
                })
                .collect::<Result<_>>()?;
            Ok(AssignmentSet {
                incarnation: m.incarnation,
                assignments,
            })
        })))
    }

    // ------------------------------------------------------------------ audit

    /// One page of a shard's audit trail from `from_seq`, filtered.
    pub async fn audit(
        &self,
        shard: u32,
        filter: AuditFilter,
        from_seq: u64,
        limit: u32,
    ) -> Result<AuditPage> {
        let (events, next_seq, head_seq) = self
            .audit_page(
                shard,
                pb::AuditRequest {
                    read: None,
                    from_seq,
                    limit,
                    org: filter.org.map(|o| o.0),
                    project: filter.project.map(|p| p.0),
                    hold: filter.hold.map(|h| h.0),
                    from_ms: filter.from_ms,
                    to_ms: filter.to_ms,
                },
            )
            .await?;
        Ok(AuditPage {
            events,
            next_seq,
            head_seq,
        })
    }

    /// Every matching audit event of a shard from `from_seq` up to the chain's head when
    /// called, page by page, passed to `sink` in order.
    pub async fn audit_export(
        &self,
        shard: u32,
        filter: AuditFilter,
        from_seq: u64,
        sink: impl FnMut(&AuditEvent) -> Result<()>,
    ) -> Result<u64> {
        self.audit_export_to(shard, filter, from_seq, 0, sink).await
    }

    /// [`Client::audit_export`] up to at least sequence `head_at_least` (a head read
    /// before, e.g. from the leader). Pages may come from different replicas: the export
    /// ends at the highest head any of them reported, never at a lagging replica's own
    /// head; a replica that has not applied that far yet is asked again (within the
    /// client's timeout).
    pub async fn audit_export_to(
        &self,
        shard: u32,
        filter: AuditFilter,
        mut from_seq: u64,
        head_at_least: u64,
        mut sink: impl FnMut(&AuditEvent) -> Result<()>,
    ) -> Result<u64> {
        let started = std::time::Instant::now();
        let mut head = head_at_least;
        let mut stalled = 0u32;
        loop {
            let page = self.audit(shard, filter, from_seq, 1_000).await?;
            for ev in &page.events {
                sink(ev)?;
            }
            head = head.max(page.head_seq);
            let progressed = page.next_seq > from_seq;
            from_seq = page.next_seq;
            if from_seq >= head {
                return Ok(from_seq);
            }
            if progressed {
                stalled = 0;
                continue;
            }
            // This replica is behind the head another one reported: wait for it (or the
            // next attempt's replica) to catch up.
            stalled += 1;
            if started.elapsed() > self.timeout() {
                return Err(Error::Unavailable {
                    attempts: stalled,
                    elapsed: started.elapsed(),
                    last: format!("the audit trail served stops at {from_seq}, head {head}"),
                    cause: Some("AUDIT_GAP".into()),
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(
                20 * stalled.min(25) as u64,
            ))
            .await;
        }
    }
}

impl Assignment {
    /// The job's key: its org and id (each org has its own job ids).
    pub fn key(&self) -> (OrgId, JobId) {
        (self.org, self.job)
    }
}

fn assignment(
    ((org, job), attempt, gpu_indices, state): allot_statemachine::scheduler::AssignmentRow,
) -> Assignment {
    Assignment {
        org,
        job,
        attempt,
        gpu_indices,
        state,
    }
}
