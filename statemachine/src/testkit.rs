//! Shared fixtures for tests, benchmarks and the simulator: a harness that applies
//! commands entry by entry, checks every invariant and the audit chain after each entry,
//! and a standard small world. Pure like the rest of the crate.

use crate::audit::{verify_chain, AuditChain, AuditEvent};
use crate::command::*;
use crate::ids::*;
use crate::invariants::check_invariants;
use crate::outcome::Outcome;
use crate::state::{apply, Config, State};

/// 2026-11-01T00:00:00Z in ms: the fixtures' logical epoch.
pub const T0_MS: u64 = 1_793_491_200_000;
pub const HOUR_MS: u64 = 3_600_000;
pub const ORG: OrgId = OrgId(1);
pub const OTHER_ORG: OrgId = OrgId(2);
pub const PROJECT: ProjectId = ProjectId(11);
pub const PROJECT_B: ProjectId = ProjectId(12);
pub const OTHER_PROJECT: ProjectId = ProjectId(13);
pub const USER: UserId = UserId(21);
pub const USER_B: UserId = UserId(22);
pub const OTHER_USER: UserId = UserId(23);
pub const ADMIN: Actor = Actor::Admin(PrincipalId(1));
/// Fixture prices: A100 at 2 credits per GPU-hour, H100 at 4.
pub const A100_PRICE: u64 = 2_000_000;
pub const H100_PRICE: u64 = 4_000_000;

/// Whole credits in micro-credits.
pub const fn credits(c: u64) -> u64 {
    c * 1_000_000
}

pub fn a100() -> GpuType {
    GpuType::new("A100")
}

pub fn h100() -> GpuType {
    GpuType::new("H100")
}

pub fn tenant(org: OrgId) -> Actor {
    Actor::Tenant {
        org,
        principal: PrincipalId(100 + org.0),
    }
}

/// Applies entries one at a time, asserting invariants and chain continuity after each.
pub struct Harness {
    pub state: State,
    pub index: u64,
    pub now: u64,
    pub events: Vec<AuditEvent>,
    /// Every entry applied, for replay and determinism checks.
    pub entries: Vec<Entry>,
    chain: AuditChain,
    next_request_id: u128,
    /// The identity `run`/`ok` (and the fixtures built on them) act as: the claimed
    /// [`ADMIN`] on an unsecured shard, an admin bearer token on a secured one.
    pub admin: Actor,
}

/// The commands (all by the admin) that build the standard world: orgs 1 and 2;
/// projects 11, 12 in org 1 and 13 in org 2; users 21, 22 in org 1 and 23 in org 2;
/// prices for A100 and H100. Shared by the harness, the node's tests and benches.
pub fn world_commands() -> Vec<Command> {
    vec![
        Command::CreateOrg { org: ORG },
        Command::CreateOrg { org: OTHER_ORG },
        Command::CreateProject {
            project: PROJECT,
            org: ORG,
        },
        Command::CreateProject {
            project: PROJECT_B,
            org: ORG,
        },
        Command::CreateProject {
            project: OTHER_PROJECT,
            org: OTHER_ORG,
        },
        Command::CreateUser {
            user: USER,
            org: ORG,
        },
        Command::CreateUser {
            user: USER_B,
            org: ORG,
        },
        Command::CreateUser {
            user: OTHER_USER,
            org: OTHER_ORG,
        },
        Command::SetPrices {
            prices: vec![(a100(), A100_PRICE), (h100(), H100_PRICE)],
        },
        // Both orgs are entitled to every tier (the default withholds the highest).
        Command::SetPlan {
            org: ORG,
            plan: Some(all_tiers()),
        },
        Command::SetPlan {
            org: OTHER_ORG,
            plan: Some(all_tiers()),
        },
    ]
}

/// A plan with the three standard tiers.
pub fn all_tiers() -> crate::command::Plan {
    crate::command::Plan {
        tiers: vec![Tier::FREE, Tier::PAID, Tier::ENTERPRISE],
        project_tiers: Vec::new(),
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new(Config::default())
    }
}

impl Harness {
    pub fn new(config: Config) -> Harness {
        Harness {
            state: State::new(config),
            index: 0,
            now: T0_MS,
            events: Vec::new(),
            entries: Vec::new(),
            chain: AuditChain::default(),
            next_request_id: 1,
            admin: ADMIN,
        }
    }

    /// The standard world: orgs 1 and 2; projects 11, 12 in org 1 and 13 in org 2;
    /// users 21, 22 in org 1 and 23 in org 2; prices for A100 and H100.
    pub fn world() -> Harness {
        Harness::world_with(Config::default())
    }

    /// The standard world on a given shard configuration.
    pub fn world_with(config: Config) -> Harness {
        let mut h = Harness::new(config);
        for cmd in world_commands() {
            h.ok(cmd);
        }
        h
    }

    pub fn fresh_request_id(&mut self) -> RequestId {
        let id = self.next_request_id;
        self.next_request_id += 1;
        id
    }

    pub fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    /// Applies one entry of requests at the current time. A request without an org
    /// gets the one its command's ids are in ([`infer_org`]: the fixtures' ids are
    /// distinct across orgs, so tests need not name it).
    pub fn apply(&mut self, mut requests: Vec<Request>) -> Vec<Outcome> {
        for r in &mut requests {
            let operator = self
                .state
                .security
                .resolve(r.actor, self.now)
                .is_ok_and(|a| matches!(a, Actor::Admin(_) | Actor::Agent(_) | Actor::System));
            if r.org.is_none() && operator {
                r.org = infer_org(&self.state, &r.command);
            }
        }
        self.index += 1;
        let entry = Entry {
            log_index: self.index,
            logical_time_ms: self.now,
            requests,
        };
        let out = apply(&mut self.state, &entry).expect("fresh log index");
        self.entries.push(entry);
        if let Err(v) = check_invariants(&self.state) {
            panic!("invariant violated after entry {}: {v}", self.index);
        }
        self.chain = verify_chain(&self.chain, &out.events).expect("audit chain continues");
        crate::audit::verify_commands(
            &out.events,
            std::slice::from_ref(self.entries.last().expect("just pushed")),
        )
        .expect("command digests match");
        assert_eq!(
            self.chain, self.state.audit,
            "chain head matches the state's"
        );
        self.events.extend(out.events);
        out.outcomes
    }

    pub fn run_as(&mut self, actor: Actor, command: Command) -> Outcome {
        let request_id = self.fresh_request_id();
        self.apply(vec![Request {
            actor,
            request_id,
            org: None,
            command,
        }])
        .remove(0)
    }

    pub fn run(&mut self, command: Command) -> Outcome {
        self.run_as(self.admin, command)
    }

    /// Runs `command` as `actor` in `org`'s namespace.
    pub fn run_in(&mut self, actor: Actor, org: OrgId, command: Command) -> Outcome {
        let request_id = self.fresh_request_id();
        self.apply(vec![Request {
            actor,
            request_id,
            org: Some(org),
            command,
        }])
        .remove(0)
    }

    /// Runs a command as admin and panics with its error if it fails.
    pub fn ok(&mut self, command: Command) -> crate::outcome::Reply {
        let name = command.name();
        match self.run(command) {
            Ok(r) => r,
            Err(e) => panic!("{name} failed: {e:?}"),
        }
    }

    pub fn tick(&mut self) {
        self.apply(vec![Request {
            actor: Actor::System,
            request_id: 0,
            org: None,
            command: Command::Tick,
        }]);
    }

    /// Issues a grant with the common defaults (no policy, priority 100).
    pub fn grant(
        &mut self,
        bucket: u64,
        owner: Account,
        kind: BucketKind,
        amount: u64,
        expires_at_ms: Option<u64>,
    ) {
        self.ok(Command::IssueGrant(Grant {
            bucket: BucketId(bucket),
            owner,
            kind,
            amount_micro: amount,
            expires_at_ms,
            priority: 100,
            policy: None,
            source_ref: None,
        }));
    }

    /// One "account" of the memory benchmark and the 1,000,000-account backup: org `o`
    /// and a paid bucket (also numbered `o`) of 100 credits.
    pub fn account_commands(o: u64) -> [Command; 2] {
        [
            Command::CreateOrg { org: OrgId(o) },
            Command::IssueGrant(Grant {
                bucket: BucketId(o),
                owner: Account::Org(OrgId(o)),
                kind: BucketKind::Paid,
                amount_micro: credits(100),
                expires_at_ms: None,
                priority: 100,
                policy: None,
                source_ref: None,
            }),
        ]
    }

    pub fn hold_spec(hold: u64, amount: u64) -> HoldSpec {
        HoldSpec {
            hold: HoldId(hold),
            project: PROJECT,
            user: USER,
            tier: Tier::PAID,
            gpu_types: vec![a100(), h100()],
            amount_micro: amount,
        }
    }

    pub fn bucket(&self, id: u64) -> &crate::ledger::Bucket {
        &self.state.ledger.buckets[&BucketId(id)]
    }

    /// Hold `id` of whichever org has it (fixture ids are distinct across orgs).
    pub fn hold(&self, id: u64) -> &crate::ledger::Hold {
        self.state
            .ledger
            .holds
            .iter()
            .find(|((_, h), _)| *h == HoldId(id))
            .map(|(_, h)| h)
            .unwrap_or_else(|| panic!("no hold {id}"))
    }

    /// The non-command events emitted since event `from`, as (kind, bucket, amount).
    pub fn movements_since(&self, from: usize) -> Vec<(&'static str, u64, u64)> {
        use crate::audit::EventBody::*;
        self.events[from..]
            .iter()
            .filter_map(|e| match &e.body {
                Command { .. }
                | BudgetAlert { .. }
                | LowBalance { .. }
                | BudgetThreshold { .. }
                | JobTransition { .. }
                | NodeStateChanged { .. }
                | Denied { .. } => None,
                BucketArchived { bucket } => Some(("archived", bucket.0, 0)),
                Issued {
                    bucket,
                    amount_micro,
                } => Some(("issued", bucket.0, *amount_micro)),
                HoldDrawn {
                    bucket,
                    amount_micro,
                } => Some(("drawn", bucket.0, *amount_micro)),
                Captured {
                    bucket,
                    amount_micro,
                } => Some(("captured", bucket.0, *amount_micro)),
                CaptureReversed {
                    bucket,
                    amount_micro,
                } => Some(("reversed", bucket.0, *amount_micro)),
                Refunded {
                    bucket,
                    amount_micro,
                } => Some(("refunded", bucket.0, *amount_micro)),
                RefundForfeited {
                    bucket,
                    amount_micro,
                } => Some(("forfeited", bucket.0, *amount_micro)),
                BucketExpired {
                    bucket,
                    amount_micro,
                } => Some(("expired", bucket.0, *amount_micro)),
                TransferredOut {
                    bucket,
                    amount_micro,
                } => Some(("moved_out", bucket.0, *amount_micro)),
                TransferredIn {
                    bucket,
                    amount_micro,
                } => Some(("moved_in", bucket.0, *amount_micro)),
            })
            .collect()
    }
}

/// A bucket's figures as rebuilt from the audit trail alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BucketFigures {
    pub issued: u64,
    pub moved_in: u64,
    pub remaining: u64,
    pub held: u64,
    pub consumed: u64,
    pub expired: u64,
    pub moved_out: u64,
}

impl From<&crate::ledger::Bucket> for BucketFigures {
    fn from(b: &crate::ledger::Bucket) -> Self {
        BucketFigures {
            issued: b.issued,
            moved_in: b.moved_in,
            remaining: b.remaining,
            held: b.held,
            consumed: b.consumed,
            expired: b.expired,
            moved_out: b.moved_out,
        }
    }
}

/// Rebuilds every bucket's figures from the audit events only (grants from successful
/// `IssueGrant` command events, movements from movement events). Equal to the state's
/// figures exactly when the audit trail is a complete account of the ledger.
pub fn replay_buckets(
    events: &[AuditEvent],
) -> std::collections::BTreeMap<BucketId, BucketFigures> {
    use crate::audit::EventBody::*;
    let mut m: std::collections::BTreeMap<BucketId, BucketFigures> = Default::default();
    for e in events {
        match &e.body {
            Issued {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.issued += a;
                f.remaining += a;
            }
            HoldDrawn {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.remaining -= a;
                f.held += a;
            }
            Captured {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.held -= a;
                f.consumed += a;
            }
            CaptureReversed {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.consumed -= a;
                f.held += a;
            }
            Refunded {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.held -= a;
                f.remaining += a;
            }
            RefundForfeited {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.held -= a;
                f.expired += a;
            }
            BucketExpired {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.remaining -= a;
                f.expired += a;
            }
            TransferredOut {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.remaining -= a;
                f.moved_out += a;
            }
            TransferredIn {
                bucket,
                amount_micro: a,
            } => {
                let f = m.entry(*bucket).or_default();
                f.moved_in += a;
                f.remaining += a;
            }
            BucketArchived { bucket } => {
                m.remove(bucket);
            }
            Command { .. }
            | BudgetAlert { .. }
            | LowBalance { .. }
            | BudgetThreshold { .. }
            | JobTransition { .. }
            | NodeStateChanged { .. }
            | Denied { .. } => {}
        }
    }
    m
}

impl Harness {
    /// Asserts that the audit trail alone rebuilds every bucket exactly.
    pub fn assert_audit_rebuilds_ledger(&self) {
        let rebuilt = replay_buckets(&self.events);
        let actual: std::collections::BTreeMap<BucketId, BucketFigures> = self
            .state
            .ledger
            .buckets
            .iter()
            .map(|(id, b)| (*id, BucketFigures::from(b)))
            .collect();
        assert_eq!(
            rebuilt, actual,
            "the audit trail is a complete account of the ledger"
        );
    }
}

// -- scheduler fixtures --

impl Harness {
    /// Registers nodes `(id, type, GPUs, memory GB)`.
    pub fn fleet(&mut self, nodes: &[(u64, GpuType, u32, u32)]) {
        for (id, gpu_type, gpu_count, gpu_mem_gb) in nodes {
            self.ok(Command::RegisterNode(NodeSpec {
                node: NodeId(*id),
                gpu_type: gpu_type.clone(),
                gpu_count: *gpu_count,
                gpu_mem_gb: *gpu_mem_gb,
                labels: vec![],
                incarnation: 0,
            }));
        }
    }

    /// A job in the fixture project: preemptible, checkpointable, up to 10 hours.
    pub fn job_spec(job: u64, tier: Tier, gpu_types: Vec<GpuType>, gpus: u32) -> JobSpec {
        JobSpec {
            job: JobId(job),
            project: PROJECT,
            user: USER,
            tier,
            gpu_types,
            gpus,
            mem_floor_gb: 0,
            preemptible: true,
            checkpointable: true,
            max_duration_ms: 10 * HOUR_MS,
        }
    }

    /// Job `id` of whichever org has it (fixture ids are distinct across orgs).
    pub fn job(&self, id: u64) -> &crate::scheduler::Job {
        self.state
            .scheduler
            .jobs
            .iter()
            .find(|((_, j), _)| *j == JobId(id))
            .map(|(_, j)| j)
            .unwrap_or_else(|| panic!("no job {id}"))
    }

    /// Renews every node's lease (agents alive) in one entry.
    pub fn nodes_alive(&mut self) {
        let nodes: Vec<NodeId> = self
            .state
            .scheduler
            .nodes
            .sorted()
            .into_iter()
            .map(|(id, _)| *id)
            .collect();
        let reqs = nodes
            .into_iter()
            .map(|node| Request {
                actor: Actor::Agent(node),
                request_id: 0,
                org: None,
                command: Command::NodeHeartbeat { node },
            })
            .collect();
        self.apply(reqs);
    }

    /// The job's agent reports a heartbeat for its current attempt.
    pub fn job_heartbeat(&mut self, job: u64, seq: u64, checkpoint: u64) -> Outcome {
        let j = self.job(job);
        let (node, org) = (j.placement.as_ref().map_or(NodeId(0), |p| p.node), j.org);
        let hb = JobHeartbeat {
            job: JobId(job),
            attempt: j.attempt,
            seq,
            progress_ppm: 0,
            checkpoint,
        };
        self.run_in(Actor::Agent(node), org, Command::JobHeartbeat(hb))
    }

    pub fn finish_job(&mut self, job: u64, success: bool) -> Outcome {
        self.finish_job_with(job, success, None)
    }

    /// The job's agent reports its attempt's exit: `FinishJob`, or with `exit`
    /// (when the runner exited) `FinishJobAt`.
    pub fn finish_job_with(
        &mut self,
        job: u64,
        success: bool,
        exit: Option<crate::command::RunnerExit>,
    ) -> Outcome {
        let j = self.job(job);
        let (node, org) = (j.placement.as_ref().map_or(NodeId(0), |p| p.node), j.org);
        let (job, attempt) = (JobId(job), j.attempt);
        let command = match exit {
            None => Command::FinishJob {
                job,
                attempt,
                success,
            },
            Some(exit) => Command::FinishJobAt {
                job,
                attempt,
                success,
                exit,
            },
        };
        self.run_in(Actor::Agent(node), org, command)
    }
}

/// The org whose namespace `command`'s ids are in, as far as the state shows — for tests
/// only, whose fixture ids are distinct across orgs (a real client names the org): the
/// org the command names itself, else the org owning the project, user, hold, job or
/// principal it names, else the fixtures' [`ORG`] (so an unknown id answers as unknown
/// in it).
pub fn infer_org(state: &State, command: &Command) -> Option<OrgId> {
    if let Some(o) = command.own_org() {
        return Some(o);
    }
    let fixture = state.ledger.orgs.contains_key(&ORG).then_some(ORG);
    if let Command::RotateToken { principal, .. } | Command::RevokeToken { principal } = command {
        return state
            .security
            .principals
            .keys()
            .find(|(_, p)| p == principal)
            .and_then(|(o, _)| *o);
    }
    let l = &state.ledger;
    let s = &state.scheduler;
    let project = |p: ProjectId| l.projects.keys().find(|(_, x)| *x == p).map(|(o, _)| *o);
    let user = |u: UserId| l.users.keys().find(|(_, x)| *x == u).map(|(o, _)| *o);
    let hold = |h: HoldId| l.holds.keys().find(|(_, x)| *x == h).map(|(o, _)| *o);
    let job = |j: JobId| s.jobs.keys().find(|(_, x)| *x == j).map(|(o, _)| *o);
    let account = |a: &Account| match a {
        Account::Org(o) => Some(*o),
        Account::Project(p) => project(*p),
    };
    match command {
        Command::IssueGrant(g) | Command::IssueGrantIn { grant: g, .. } => account(&g.owner),
        Command::Transfer { from, to, .. } => account(from).or(account(to)),
        Command::CreateHold(h) => project(h.project),
        Command::SubmitJob(j) | Command::SubmitJobDedup { spec: j, .. } => project(j.project),
        Command::Capture { hold: h, .. }
        | Command::TopUp { hold: h, .. }
        | Command::ReleaseHold { hold: h }
        | Command::StartMeter { hold: h, .. }
        | Command::Settle { hold: h, .. } => hold(*h),
        Command::Heartbeat(hb) => hold(hb.hold),
        Command::CancelJob { job: j }
        | Command::FinishJob { job: j, .. }
        | Command::FinishJobAt { job: j, .. }
        | Command::JobFenced { job: j, .. } => job(*j),
        Command::JobHeartbeat(hb) => job(hb.job),
        Command::SetBudget { scope, .. }
        | Command::SetShareWeight { scope, .. }
        | Command::SetAlert { scope, .. } => match scope {
            BudgetScope::Org(o) => Some(*o),
            BudgetScope::Project(p) => project(*p),
            BudgetScope::User(u) => user(*u),
        },
        _ => None,
    }
    .or(fixture)
    .filter(|_| {
        !matches!(
            command,
            Command::RegisterNode(_) | Command::SetPrices { .. }
        )
    })
}

/// The org a command of the standard world acts in, from the fixtures' ids alone (no
/// state): what a harness outside the state machine (the node's tests, benchmark and
/// demo, the fault-injection workloads) names as the request's org. The org the command
/// names itself; [`OTHER_ORG`] for [`OTHER_PROJECT`] and [`OTHER_USER`]; else [`ORG`]
/// for commands on org-scoped ids; `None` for pool and shard commands.
pub fn fixture_org(command: &Command) -> Option<OrgId> {
    if let Some(o) = command.own_org() {
        return Some(o);
    }
    let other = |p: ProjectId, u: Option<UserId>| {
        if p == OTHER_PROJECT || u == Some(OTHER_USER) {
            OTHER_ORG
        } else {
            ORG
        }
    };
    let account = |a: &Account| match a {
        Account::Org(o) => *o,
        Account::Project(p) => other(*p, None),
    };
    Some(match command {
        Command::IssueGrant(g) | Command::IssueGrantIn { grant: g, .. } => account(&g.owner),
        Command::Transfer { from, .. } => account(from),
        Command::CreateHold(h) => other(h.project, Some(h.user)),
        Command::SubmitJob(j) | Command::SubmitJobDedup { spec: j, .. } => {
            other(j.project, Some(j.user))
        }
        Command::SetBudget { scope, .. }
        | Command::SetShareWeight { scope, .. }
        | Command::SetAlert { scope, .. } => match scope {
            BudgetScope::Org(o) => *o,
            BudgetScope::Project(p) => other(*p, None),
            BudgetScope::User(u) => other(PROJECT, Some(*u)),
        },
        Command::Capture { .. }
        | Command::TopUp { .. }
        | Command::ReleaseHold { .. }
        | Command::StartMeter { .. }
        | Command::Settle { .. }
        | Command::Heartbeat(_)
        | Command::CancelJob { .. }
        | Command::FinishJob { .. }
        | Command::FinishJobAt { .. }
        | Command::JobFenced { .. }
        | Command::JobHeartbeat(_) => ORG,
        _ => return None,
    })
}

/// The largest legal instance of every command kind whose size the caller chooses
/// (lists and strings, each at its bound; ids and numbers at their largest). Every
/// other kind is a few fixed-size fields. `tests/bad_input.rs` checks that each one
/// validates and fits `COMMAND_BYTES_MAX`; the node's hostile tests commit the largest.
pub fn largest_commands() -> Vec<Command> {
    use crate::alerts::AlertSpec;
    use crate::limits::*;
    use crate::scheduler::{settings_bounds as sb, SchedulerSettings, TierConfig};
    let id = INTERNAL_ID_BASE - 1;
    let gpu_types = |n: usize| -> Vec<GpuType> {
        (0..n)
            .map(|i| GpuType::new(&format!("{i:H>width$}", width = GPU_TYPE_LEN_MAX)))
            .collect()
    };
    let tiers = |n: usize| -> Vec<Tier> { (0..n).map(|t| Tier(t as u8)).collect() };
    let grant = Grant {
        bucket: BucketId(id),
        owner: Account::Project(ProjectId(id)),
        kind: BucketKind::Promotional,
        amount_micro: AMOUNT_MICRO_MAX,
        expires_at_ms: Some(u64::MAX),
        priority: u8::MAX,
        policy: Some(BucketPolicy {
            gpu_types: gpu_types(GPU_TYPES_PER_LIST_MAX),
            tiers: tiers(TIERS_PER_POLICY_MAX),
        }),
        source_ref: Some("r".repeat(SOURCE_REF_LEN_MAX)),
    };
    let mut settings: SchedulerSettings = crate::scheduler::SchedulerConfig::default().settings();
    settings.tiers = (0..sb::TIERS_MAX)
        .map(|i| TierConfig {
            name: format!("{i:t>width$}", width = sb::TIER_NAME_LEN_MAX),
            weight: sb::TIER_WEIGHT_MAX,
            floor_pct: 100 / sb::TIERS_MAX as u32,
            ceiling_pct: 100,
            max_wait_ms: sb::TIER_WAIT_MS_MAX,
            price_pct: sb::TIER_PRICE_PCT_MAX,
        })
        .collect();
    let label = "v".repeat(LABEL_LEN_MAX);
    vec![
        Command::SetPrices {
            prices: gpu_types(PRICE_TABLE_TYPES_MAX)
                .into_iter()
                .map(|t| (t, PRICE_MICRO_PER_GPU_HOUR_MAX))
                .collect(),
        },
        Command::IssueGrant(grant.clone()),
        Command::IssueGrantIn {
            grant,
            expires_in_ms: u64::MAX,
        },
        Command::CreateHold(HoldSpec {
            hold: HoldId(id),
            project: ProjectId(id),
            user: UserId(id),
            tier: Tier(u8::MAX),
            gpu_types: gpu_types(GPU_TYPES_PER_LIST_MAX),
            amount_micro: AMOUNT_MICRO_MAX,
        }),
        Command::RegisterNode(NodeSpec {
            node: NodeId(id),
            gpu_type: gpu_types(1).remove(0),
            gpu_count: GPUS_PER_NODE_MAX,
            gpu_mem_gb: GPU_MEM_GB_MAX,
            labels: (0..LABELS_PER_NODE_MAX)
                .map(|i| {
                    (
                        format!("{i:k>width$}", width = LABEL_LEN_MAX),
                        label.clone(),
                    )
                })
                .collect(),
            incarnation: u64::MAX,
        }),
        Command::SubmitJob(JobSpec {
            job: JobId(id),
            project: ProjectId(id),
            user: UserId(id),
            tier: Tier(u8::MAX),
            gpu_types: gpu_types(GPU_TYPES_PER_LIST_MAX),
            gpus: GPUS_PER_JOB_MAX,
            mem_floor_gb: GPU_MEM_GB_MAX,
            preemptible: true,
            checkpointable: true,
            max_duration_ms: JOB_DURATION_MS_MAX,
        }),
        Command::ConfigureScheduler(settings),
        Command::RecordDenials {
            node: u64::MAX,
            denials: (0..DENIALS_PER_RECORD_MAX)
                .map(|i| Denial {
                    actor: Actor::Project {
                        org: OrgId(id),
                        project: ProjectId(id),
                        principal: PrincipalId(id - i as u64),
                    },
                    api: "a".repeat(DENIAL_API_LEN_MAX),
                    reason: DenialReason::PermissionDenied,
                })
                .collect(),
        },
        Command::SetPlan {
            org: OrgId(id),
            plan: Some(Plan {
                tiers: tiers(TIERS_PER_POLICY_MAX),
                project_tiers: (0..PLAN_PROJECTS_MAX as u64)
                    .map(|p| (ProjectId(id - p), tiers(TIERS_PER_POLICY_MAX)))
                    .collect(),
            }),
        },
        Command::SetAlert {
            scope: BudgetScope::Project(ProjectId(id)),
            alert: Some(AlertSpec {
                low_balance_micro: Some(u64::MAX),
                budget_pcts: (0..ALERT_PCTS_MAX as u32)
                    .map(|i| ALERT_PCT_MAX - i)
                    .rev()
                    .collect(),
            }),
        },
    ]
}

/// The largest of [`largest_commands`] by encoded size.
pub fn largest_command() -> Command {
    largest_commands()
        .into_iter()
        .max_by_key(crate::codec::encoded_len)
        .expect("at least one command")
}
