//! The replicated state and the pure `apply` function.

use crate::audit::{
    command_digest, AuditChain, AuditEvent, EventBody, Hash32, PendingEvent, Stamp,
};
use crate::authz::authorize;
use crate::codec;
use crate::command::{BudgetScope, Command, Entry, Quota, Request};
use crate::idempotency::{fingerprint, IdempotencyTable, Lookup};
use crate::ids::Actor;
use crate::ids::{Account, HoldId, OrgId};
use crate::ledger::{Ctx, Ledger, LedgerConfig};
use crate::limits::{
    COMMANDS_PER_ENTRY_MAX, DIGESTS_PER_TENANT_PRINCIPAL_V4, RETIRED_KEYS_PER_PRINCIPAL_MAX,
    RETIRED_KEYS_PER_TENANT_PRINCIPAL_V4, TENANT_KEYS_WITHIN_CALLER_LIFE_FROM, TOKENS_MAX,
    TOKENS_OPERATOR_RESERVE, TOKEN_BOUNDS_FROM,
};
use crate::outcome::{CommandError, Limit, Outcome, QuotaKind, Reply};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::security::Scope;
use crate::security::Security;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Settings fixed when a shard is created; replicated as part of the state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub ledger: LedgerConfig,
    /// How long a request id is remembered (logical time). Clients must not retry a
    /// request longer than this after first sending it.
    pub idempotency_retention_ms: u64,
    pub scheduler: SchedulerConfig,
    /// How long a finished job stays queryable (and blocks reuse of its id).
    pub job_retention_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ledger: LedgerConfig::default(),
            idempotency_retention_ms: 24 * 3_600_000,
            scheduler: SchedulerConfig::default(),
            job_retention_ms: 7 * 86_400_000,
        }
    }
}

/// A shard's whole replicated state. Everything in it is ordered (BTreeMap, VecDeque in
/// log order), so its encoding, and so [`State::state_hash`], is canonical. It is
/// encoded in the format of its rule version ([`crate::version::state_format`]: the
/// idempotency table's layout differs), and decoded from any format of the window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    pub config: Config,
    /// Logical time of the last applied entry; never goes back.
    pub time_ms: u64,
    pub last_applied: Option<u64>,
    pub ledger: Ledger,
    pub scheduler: Scheduler,
    pub idempotency: IdempotencyTable,
    pub audit: AuditChain,
    /// API tokens (digests) and whether the shard is secured.
    pub security: Security,
    /// Low-balance and budget-threshold alerts (`crate::alerts`).
    pub alerts: crate::alerts::Alerts,
    /// The active rule version (`crate::version`). Last: a format-5 state is this
    /// struct without it ([`StateV5`]).
    pub rules: crate::version::Rules,
}

/// Written field by field so that the idempotency table takes the layout of the state's
/// format: format 6's (what the previous release reads) until rule version 3, the
/// compact one of format 7 from it on.
impl Serialize for State {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("State", 13)?;
        st.serialize_field("config", &self.config)?;
        st.serialize_field("time_ms", &self.time_ms)?;
        st.serialize_field("last_applied", &self.last_applied)?;
        st.serialize_field("ledger", &self.ledger)?;
        st.serialize_field("scheduler", &self.scheduler)?;
        if self.format() >= 7 {
            st.serialize_field("idempotency", &self.idempotency.compact())?;
        } else {
            st.serialize_field("idempotency", &self.idempotency.layout_v6())?;
        }
        st.serialize_field("audit", &self.audit)?;
        st.serialize_field("security", &self.security)?;
        st.serialize_field("alerts", &self.alerts)?;
        st.serialize_field("rules", &self.rules)?;
        if self.format() >= 7 {
            // Format 7 appended the result-dedup tables (empty before rule version 3).
            st.serialize_field("dedup", &self.scheduler.dedup)?;
        }
        if self.format() >= 8 {
            // Format 8 appended the fence instants and the retired grant ids (both
            // empty before rule version 5).
            st.serialize_field("fence", &self.scheduler.fence)?;
            st.serialize_field("retired_grants", &self.ledger.books.retired_grants)?;
        }
        st.end()
    }
}

/// The state as format 8 lays it out: format 7's ([`StateV7`]), then the scheduler's
/// fence instants (`scheduler::Fence`) and the ledger's retired grant ids
/// (`ledger::Books::retired_grants`). bincode lays a nested struct out as its fields in
/// order, so format 7's shape is this one's prefix.
#[derive(Deserialize)]
struct StateV8 {
    v7: StateV7,
    fence: crate::scheduler::Fence,
    retired_grants: std::collections::BTreeSet<crate::ids::BucketId>,
}

impl From<StateV8> for State {
    fn from(s: StateV8) -> State {
        let mut state = State::from(s.v7);
        state.scheduler.fence = s.fence;
        state.ledger.books.retired_grants = s.retired_grants;
        state
    }
}

/// The state as format 7 lays it out: [`State`]'s fields, then the scheduler's
/// result-dedup tables (`scheduler::dedup`). Frozen: it changes only when format 7
/// leaves the support window.
#[derive(Deserialize)]
struct StateV7 {
    config: Config,
    time_ms: u64,
    last_applied: Option<u64>,
    ledger: Ledger,
    scheduler: Scheduler,
    idempotency: IdempotencyTable,
    audit: AuditChain,
    security: Security,
    alerts: crate::alerts::Alerts,
    rules: crate::version::Rules,
    dedup: crate::scheduler::dedup::Dedup,
}

impl From<StateV7> for State {
    /// A format-7 state is below rule version 5 (format 8 from it on), so it has no
    /// fence instants and no retired grant ids to read.
    fn from(s: StateV7) -> State {
        let mut scheduler = s.scheduler;
        scheduler.dedup = s.dedup;
        State {
            config: s.config,
            time_ms: s.time_ms,
            last_applied: s.last_applied,
            ledger: s.ledger,
            scheduler,
            idempotency: s.idempotency,
            audit: s.audit,
            security: s.security,
            alerts: s.alerts,
            rules: s.rules,
        }
    }
}

/// The state as format 6 wrote it: [`State`] with the idempotency table in its old
/// layout (`idempotency::FromV6`). Frozen: it changes only when format 6 leaves the
/// support window.
#[derive(Deserialize)]
struct StateV6 {
    config: Config,
    time_ms: u64,
    last_applied: Option<u64>,
    ledger: Ledger,
    scheduler: Scheduler,
    idempotency: crate::idempotency::FromV6,
    audit: AuditChain,
    security: Security,
    alerts: crate::alerts::Alerts,
    rules: crate::version::Rules,
}

impl From<StateV6> for State {
    fn from(s: StateV6) -> State {
        State {
            config: s.config,
            time_ms: s.time_ms,
            last_applied: s.last_applied,
            ledger: s.ledger,
            scheduler: s.scheduler,
            idempotency: s.idempotency.0,
            audit: s.audit,
            security: s.security,
            alerts: s.alerts,
            rules: s.rules,
        }
    }
}

/// The state as format 5 wrote it (before rule versions): read by [`State::decode`]
/// and converted, so that a data dir or backup of the previous release is read in
/// place. Frozen: it changes only when format 5 leaves the support window.
#[derive(Deserialize)]
struct StateV5 {
    config: Config,
    time_ms: u64,
    last_applied: Option<u64>,
    ledger: Ledger,
    scheduler: Scheduler,
    idempotency: crate::idempotency::FromV6,
    audit: AuditChain,
    security: Security,
    alerts: crate::alerts::Alerts,
}

impl From<StateV5> for State {
    fn from(s: StateV5) -> State {
        State {
            config: s.config,
            time_ms: s.time_ms,
            last_applied: s.last_applied,
            ledger: s.ledger,
            scheduler: s.scheduler,
            idempotency: s.idempotency.0,
            audit: s.audit,
            security: s.security,
            alerts: s.alerts,
            rules: crate::version::Rules::default(),
        }
    }
}

/// What applying one entry produced: one outcome per request, in order, and the audit
/// events (already numbered and chained).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutput {
    pub outcomes: Vec<Outcome>,
    pub events: Vec<AuditEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("entry {given} was already applied (last applied {last})")]
    AlreadyApplied { given: u64, last: u64 },
}

impl Default for State {
    fn default() -> Self {
        State::new(Config::default())
    }
}

/// A value kept beside the state for apply's own use, not part of it: skipped by the
/// encoding (`#[serde(skip)]` on the field) and equal to every other in comparisons, so
/// two states equal in everything else are equal (the ledger's copy of the rule
/// version, the scheduler's count of queue joins).
#[derive(Clone, Copy, Debug, Default)]
pub struct NotState<T>(pub T);

impl<T> PartialEq for NotState<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> Eq for NotState<T> {}

impl State {
    /// Would apply let `actor` (resolved) run `req` on this state, as far as the request
    /// itself and who sends it go: its fields, its namespace and the caller's right to
    /// it — the checks apply makes before the idempotency table and the command's own
    /// rules, by the same functions. The edge asks it where a request must not even
    /// reach the log unless apply would act on it (a rule-version activation: an entry
    /// holding one stops a replica that does not support the version, whoever sent it,
    /// on the releases before this one).
    pub fn admits(&self, actor: Actor, req: &Request) -> Result<(), CommandError> {
        let ns = request_namespace(self, actor, req)?;
        let command = &*req.command.resolved_at(self.time_ms);
        authorize(
            &self.ledger,
            &self.scheduler,
            &self.security,
            actor,
            ns,
            command,
        )
    }

    pub fn new(config: Config) -> State {
        State {
            time_ms: 0,
            last_applied: None,
            ledger: Ledger::new(config.ledger),
            scheduler: Scheduler::default(),
            idempotency: IdempotencyTable::new(config.idempotency_retention_ms),
            audit: AuditChain::default(),
            security: Security::default(),
            alerts: Default::default(),
            rules: Default::default(),
            config,
        }
    }

    /// SHA-256 of the canonical encoding of the whole state. Two replicas that applied
    /// the same log have the same hash.
    pub fn state_hash(&self) -> [u8; 32] {
        use std::io::Write;
        // Streamed through the hash: a large state's encoding is never held whole.
        struct Hashing(Sha256);
        impl std::io::Write for Hashing {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.update(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut h = Hashing(Sha256::new());
        let mut w = std::io::BufWriter::with_capacity(64 << 10, &mut h);
        // Serialising an in-memory value into a writer that never fails cannot fail.
        if let Err(e) = codec::encode_body_to(&mut w, self).and_then(|()| w.flush()) {
            unreachable!("hashing the state failed: {e}");
        }
        drop(w);
        h.0.finalize().into()
    }

    /// The format this state is encoded in: that of its rule version
    /// ([`crate::version::state_format`]).
    pub fn format(&self) -> u8 {
        crate::version::state_format(self.rules.active)
    }

    /// Snapshot encoding (versioned, in [`State::format`]).
    pub fn encode(&self) -> Vec<u8> {
        codec::encode_as(self.format(), self)
    }

    /// [`State::encode`] streamed into `w` (a backup): never held whole.
    pub fn encode_to(&self, w: impl std::io::Write) -> std::io::Result<()> {
        codec::encode_to(w, self.format(), self)
    }

    /// Decodes a snapshot of any format in the support window (format 5: converted
    /// from [`StateV5`], at the baseline rule version; format 6 through [`StateV6`]).
    pub fn decode(bytes: &[u8]) -> Result<State, codec::CodecError> {
        Self::decode_from(bytes, bytes.len() as u64)
    }

    /// [`State::decode`] from a reader of at most `size` bytes (a snapshot received into
    /// a file): no length prefix in it is trusted beyond what is left of `size`.
    pub fn decode_from(r: impl std::io::Read, size: u64) -> Result<State, codec::CodecError> {
        use codec::decode_body_within as body;
        let mut state = codec::decode_versioned_from(r, |version, r| {
            let state = match version {
                5 => body::<StateV5, _>(r, size).map(State::from),
                6 => body::<StateV6, _>(r, size).map(State::from),
                7 => body::<StateV7, _>(r, size).map(State::from),
                _ => body::<StateV8, _>(r, size).map(State::from),
            }?;
            // A state's format follows from its rule version (format 5 had none): a
            // format-7 state claiming version 5 would load without the fence instants
            // and retired grant ids every version-5 replica keeps, and act apart.
            if version >= 6 && state.format() != version {
                return Err(codec::CodecError::Malformed(format!(
                    "a format-{version} state at rule version {}, which is written as format {}",
                    state.rules.active,
                    state.format()
                )));
            }
            Ok(state)
        })?;
        state.scheduler.rebuild_derived();
        Ok(state)
    }
}

/// Applies one log entry. Pure: the result depends only on `state` and `entry`.
pub fn apply(state: &mut State, entry: &Entry) -> Result<ApplyOutput, ApplyError> {
    let mut out = ApplyOutput::default();
    apply_into(state, entry, &mut out)?;
    Ok(out)
}

/// [`apply`] into a caller-owned output whose buffers are cleared and reused (the
/// apply loop of a busy shard avoids reallocating megabytes of events per entry).
pub fn apply_into(
    state: &mut State,
    entry: &Entry,
    out: &mut ApplyOutput,
) -> Result<(), ApplyError> {
    if let Some(last) = state.last_applied {
        if entry.log_index <= last {
            return Err(ApplyError::AlreadyApplied {
                given: entry.log_index,
                last,
            });
        }
    }
    state.last_applied = Some(entry.log_index);
    state.time_ms = state.time_ms.max(entry.logical_time_ms);
    state.ledger.books.rules = NotState(state.rules.active);
    let now = state.time_ms;
    out.outcomes.clear();
    out.events.clear();
    out.outcomes.reserve(entry.requests.len());
    let mut scratch = Vec::with_capacity(256);
    let mut effects = Vec::new();

    // Time-driven work first, so nothing in this entry can spend an expired credit or
    // report on a job whose lease ran out.
    state.ledger.expire_due(&mut Ctx {
        now,
        effects: &mut effects,
    });
    state.ledger.archive_closed(&mut Ctx {
        now,
        effects: &mut effects,
    });
    state.scheduler.fire_timers(
        &mut Ctx {
            now,
            effects: &mut effects,
        },
        &mut state.ledger,
        &state.config.scheduler,
        state.rules.active,
    );
    let system = Stamp {
        log_index: entry.log_index,
        time_ms: now,
        actor: crate::ids::Actor::System,
        request_id: 0,
    };
    for ev in effects.drain(..) {
        state
            .audit
            .append(&system, ev, &mut out.events, &mut scratch);
    }
    state.idempotency.prune(now);
    state.ledger.prune_settled(now);
    state
        .scheduler
        .prune_finished(now, state.config.job_retention_ms);

    for (i, req) in entry.requests.iter().enumerate() {
        // Who the request runs as comes from the replicated token table, resolved here
        // at the request's log position (a revoked token is refused from the revoking
        // entry on, on every replica). An unresolved bearer is audited by its digest.
        let actor = state.security.resolve(req.actor, now);
        let stamp = Stamp {
            log_index: entry.log_index,
            time_ms: now,
            actor: *actor.as_ref().unwrap_or(&req.actor),
            request_id: req.request_id,
        };
        let digest = command_digest(&req.command, &mut scratch);
        let (outcome, replayed) = match actor {
            _ if i >= COMMANDS_PER_ENTRY_MAX => (
                Err(CommandError::LimitReached(Limit::CommandsPerEntry)),
                false,
            ),
            Ok(actor) => apply_request(state, actor, req, &digest, now, &mut effects),
            Err(_) => (Err(CommandError::Unauthenticated), false),
        };
        let head = PendingEvent {
            org: None,
            account: None,
            hold: None,
            body: EventBody::Command {
                request: i as u32,
                digest,
                outcome: outcome.clone(),
                replayed,
            },
        };
        // The event is the attempting org's: a tenant's request is in its own
        // namespace whatever it names (another org's trail never shows it).
        let ns = actor
            .as_ref()
            .ok()
            .and_then(|a| req.namespace(a).ok().flatten().or(a.org()));
        let head = refs_of(state, ns, &req.command, head);
        state
            .audit
            .append(&stamp, head, &mut out.events, &mut scratch);
        for ev in effects.drain(..) {
            state
                .audit
                .append(&stamp, ev, &mut out.events, &mut scratch);
        }
        out.outcomes.push(outcome);
    }

    // One bounded scheduling pass over the queue as this entry left it, under the rule
    // version active at this entry.
    state.scheduler.run_pass(
        &mut Ctx {
            now,
            effects: &mut effects,
        },
        &mut state.ledger,
        &state.config.scheduler,
        state.rules.active,
    );
    for ev in effects.drain(..) {
        state
            .audit
            .append(&system, ev, &mut out.events, &mut scratch);
    }
    // Alerts whose scopes this entry's events touched, as the entry left them.
    state
        .alerts
        .evaluate(&state.ledger, &out.events, now, &mut effects);
    for ev in effects.drain(..) {
        state
            .audit
            .append(&system, ev, &mut out.events, &mut scratch);
    }
    Ok(())
}

/// Idempotency around one command. Returns the outcome and whether it was a replay.
/// The request's own fields (the same check the edge ran before proposing), then the
/// namespace it acts in: an invalid request is refused before it takes an idempotency
/// record.
fn request_namespace(
    state: &State,
    actor: Actor,
    req: &Request,
) -> Result<Option<OrgId>, CommandError> {
    crate::validate::validate(req, state.rules.active)?;
    // A tenant naming another org: a command it may never send is refused as such
    // whatever it names; otherwise the other org is unknown to it.
    req.namespace(&actor)
        .map_err(|e| crate::authz::tenant_refusal(&req.command).unwrap_or(e))
}

fn apply_request(
    state: &mut State,
    actor: Actor,
    req: &Request,
    digest: &Hash32,
    now: u64,
    effects: &mut Vec<PendingEvent>,
) -> (Outcome, bool) {
    let ns = match request_namespace(state, actor, req) {
        Ok(ns) => ns,
        Err(e) => return (Err(e), false),
    };
    if !req.command.uses_idempotency_table() {
        return (execute(state, actor, ns, &req.command, now, effects), false);
    }
    // The namespace is part of what a request id stands for.
    let fp = fingerprint_in(digest, ns);
    match state.idempotency.lookup(actor, req.request_id, &fp) {
        Lookup::Replay(outcome) => return (outcome, true),
        Lookup::Conflict => return (Err(CommandError::RequestIdReused), false),
        Lookup::New => {}
    }
    // A tenant's records count against its org's quota (refused commands included:
    // its own share, never the shard's), before the shard-wide cap.
    if let Some(org) = actor.org() {
        let max = state
            .scheduler
            .quota(&state.config.scheduler, org)
            .records_max;
        if state.idempotency.of_org(org) >= max {
            return (Err(CommandError::QuotaExceeded(QuotaKind::Records)), false);
        }
    }
    if state
        .idempotency
        .is_full(actor.org().is_some(), state.rules.active)
    {
        return (
            Err(CommandError::LimitReached(Limit::IdempotencyEntries)),
            false,
        );
    }
    let outcome = execute(state, actor, ns, &req.command, now, effects);
    state
        .idempotency
        .insert(actor, req.request_id, fp, now, &outcome);
    (outcome, false)
}

/// The fingerprint of a command in a namespace.
fn fingerprint_in(digest: &Hash32, ns: Option<OrgId>) -> [u8; 16] {
    let mut fp = fingerprint(digest);
    let org = ns.map_or(u64::MAX, |o| o.0).to_le_bytes();
    for (b, o) in fp.iter_mut().zip(org) {
        *b ^= o;
    }
    fp
}

/// The org namespace an org-scoped command needs.
fn need(ns: Option<OrgId>) -> Result<OrgId, CommandError> {
    ns.ok_or(CommandError::OrgRequired)
}

/// Runs one command. On error, its effects are discarded (every operation validates
/// before it mutates, so an error leaves the state as it was).
fn execute(
    state: &mut State,
    actor: Actor,
    ns: Option<OrgId>,
    command: &Command,
    now: u64,
    effects: &mut Vec<PendingEvent>,
) -> Outcome {
    let command = &*command.resolved_at(now);
    let mark = effects.len();
    let quota = ns
        .map(|o| state.scheduler.quota(&state.config.scheduler, o))
        .unwrap_or_default();
    let result = authorize(
        &state.ledger,
        &state.scheduler,
        &state.security,
        actor,
        ns,
        command,
    )
    .and_then(|()| {
        let ctx = &mut Ctx { now, effects };
        match command {
            Command::ConfigureScheduler(settings) => {
                if state.rules.active >= crate::limits::TIER_PRICES_NONZERO_FROM
                    && prices_a_tier_at_zero(
                        state.ledger.prices.prices.values().copied(),
                        settings.tiers.iter().map(|t| t.price_pct),
                    )
                {
                    return Err(CommandError::InvalidConfig(
                        crate::outcome::ConfigProblem::TierPrice,
                    ));
                }
                state
                    .config
                    .scheduler
                    .apply_settings(settings)
                    .map(|()| Reply::SchedulerConfigured)
            }
            Command::SetAlert { scope, alert } => {
                let org = need(ns)?;
                crate::authz::scope_exists(&state.ledger, org, *scope)?;
                state.alerts.set(org, *scope, alert.clone())?;
                // Thresholds already passed fire at once.
                state
                    .alerts
                    .check((org, *scope), &state.ledger, now, ctx.effects);
                Ok(Reply::AlertSet)
            }
            Command::ActivateVersion { version } => {
                // `last_applied` is this entry's index (set before its requests run).
                let at = state.last_applied.unwrap_or(0);
                let before = state.rules.active;
                crate::version::activate(&mut state.rules, *version, at, now)?;
                let after = state.rules.active;
                let counted = crate::ledger::CLOSED_BUCKETS_COUNTED_FROM;
                if before < counted && after >= counted {
                    state.ledger.books.count_closed_in_quota();
                }
                if before < TOKEN_BOUNDS_FROM && after >= TOKEN_BOUNDS_FROM {
                    let keep = RETIRED_KEYS_PER_TENANT_PRINCIPAL_V4;
                    state.security.trim_tenant_retired(keep);
                }
                let fence = crate::scheduler::FENCE_INSTANTS_FROM;
                if before < fence && after >= fence {
                    let cfg = &state.config.scheduler;
                    state.scheduler.fill_fence(cfg);
                }
                state.ledger.books.rules = NotState(after);
                Ok(Reply::RulesActive {
                    version: state.rules.active,
                })
            }
            command if command.is_scheduler() => dispatch_scheduler(state, actor, ns, command, ctx),
            command if command.is_security() => {
                dispatch_security(state, actor, ns, &quota, command, ctx)
            }
            command => {
                reject_job_hold(&state.ledger, ns, command)?;
                check_hold_tier(&state.scheduler, &state.config.scheduler, ns, command)?;
                let cfg = &state.config.scheduler;
                dispatch(&mut state.ledger, cfg, ns, &quota, command, ctx)
            }
        }
    });
    if result.is_err() {
        effects.truncate(mark);
    }
    // A hold this command settled may take the org past its tombstone quota.
    if let Some(org) = ns {
        state.ledger.trim_settled(org, quota.settled_holds_max);
    }
    result
}

/// A hold names a tier its org (and project) is entitled to, like a job.
fn check_hold_tier(
    sched: &Scheduler,
    cfg: &SchedulerConfig,
    ns: Option<OrgId>,
    command: &Command,
) -> Result<(), CommandError> {
    let Command::CreateHold(spec) = command else {
        return Ok(());
    };
    if spec.tier.0 as usize >= cfg.tiers.len() {
        return Err(CommandError::UnknownTier);
    }
    if !sched.entitled(cfg, need(ns)?, spec.project, spec.tier) {
        return Err(CommandError::TierNotEntitled(spec.tier));
    }
    Ok(())
}

/// A job's hold is metered and settled only through the job commands.
fn reject_job_hold(
    ledger: &Ledger,
    ns: Option<OrgId>,
    command: &Command,
) -> Result<(), CommandError> {
    let hold = match command {
        Command::Capture { hold, .. }
        | Command::TopUp { hold, .. }
        | Command::ReleaseHold { hold }
        | Command::StartMeter { hold, .. }
        | Command::Settle { hold, .. } => *hold,
        Command::Heartbeat(hb) => hb.hold,
        _ => return Ok(()),
    };
    if ledger.hold(need(ns)?, hold).is_some_and(|h| h.job) {
        return Err(CommandError::HoldOwnedByJob);
    }
    Ok(())
}

/// Whether some tier of some GPU type would be priced at 0 µcredits per GPU-hour: the
/// lowest list price at the lowest tier percentage rounds down to nothing
/// (`limits::TIER_PRICES_NONZERO_FROM`). No prices or no tiers: none is.
fn prices_a_tier_at_zero(
    prices: impl Iterator<Item = u64>,
    pcts: impl Iterator<Item = u32>,
) -> bool {
    match (prices.min(), pcts.min()) {
        (Some(price), Some(pct)) => crate::ledger::tier_price(price, pct) == 0,
        _ => false,
    }
}

/// Whether `command`, run by a tenant whose own principal expires, would issue a key
/// that lives longer than that principal: a new token without an expiry or with a later
/// one, or a rotation of a principal that lives longer (its new key keeps its life).
/// Operators' tokens are not bounded so.
fn key_outlives_caller(sec: &Security, actor: Actor, command: &Command) -> bool {
    let (org, own) = match actor {
        Actor::Tenant { org, principal }
        | Actor::Project { org, principal, .. }
        | Actor::User { org, principal, .. } => (org, principal),
        _ => return false,
    };
    let Some(end) = sec.principal(Some(org), own).and_then(|p| p.expires_at_ms) else {
        return false;
    };
    let later = |life: Option<u64>| life.is_none_or(|e| e > end);
    match command {
        Command::CreateToken { expires_at_ms, .. } => later(*expires_at_ms),
        Command::RotateToken { principal, .. } => sec
            .principal(Some(org), *principal)
            .is_some_and(|p| later(p.expires_at_ms)),
        _ => false,
    }
}

fn dispatch_security(
    state: &mut State,
    actor: Actor,
    ns: Option<OrgId>,
    quota: &Quota,
    command: &Command,
    ctx: &mut Ctx,
) -> Outcome {
    let now = ctx.now;
    let rules = state.rules.active;
    let sec = &mut state.security;
    // From rule version 4 the tenants' principals, each at its most digests, leave the
    // last `TOKENS_OPERATOR_RESERVE` of the token table to the operator's (admin and
    // agent tokens). Only a new principal is refused for it, never a rotation.
    let new_tenant_principal =
        matches!(command, Command::CreateToken { scope, .. } if scope.org().is_some());
    if rules >= TOKEN_BOUNDS_FROM
        && new_tenant_principal
        && (sec.tenant_principals() + 1) * DIGESTS_PER_TENANT_PRINCIPAL_V4
            > TOKENS_MAX - TOKENS_OPERATOR_RESERVE
    {
        return Err(CommandError::LimitReached(Limit::Tokens));
    }
    if rules >= TENANT_KEYS_WITHIN_CALLER_LIFE_FROM && key_outlives_caller(sec, actor, command) {
        return Err(CommandError::Unauthorized);
    }
    match command {
        Command::Bootstrap { principal, digest } => sec
            .bootstrap(now, *principal, *digest)
            .map(|()| Reply::TokenSet),
        Command::CreateToken {
            principal,
            digest,
            scope,
            expires_at_ms,
        } => {
            // The scope must name live objects of the org: an org token for the org, a
            // project (user) token for a project (and user) of it.
            let ledger = &state.ledger;
            match *scope {
                Scope::Org(o) if !ledger.orgs.contains_key(&o) => {
                    return Err(CommandError::UnknownOrg)
                }
                Scope::Project { org, project } | Scope::User { org, project, .. }
                    if !ledger.projects.contains_key(&(org, project)) =>
                {
                    return Err(CommandError::UnknownProject)
                }
                Scope::User { org, user, .. } if !ledger.users.contains_key(&(org, user)) => {
                    return Err(CommandError::UnknownUser)
                }
                _ => {}
            }
            if let Some(org) = scope.org() {
                if sec.principals_of(org) >= quota.principals_max as usize {
                    return Err(CommandError::QuotaExceeded(QuotaKind::Principals));
                }
            }
            sec.create(now, *principal, *digest, *scope, *expires_at_ms)
                .map(|()| Reply::TokenSet)
        }
        Command::RotateToken {
            principal,
            digest,
            overlap_ms,
        } => {
            let retired_max = if rules >= TOKEN_BOUNDS_FROM && ns.is_some() {
                RETIRED_KEYS_PER_TENANT_PRINCIPAL_V4
            } else {
                RETIRED_KEYS_PER_PRINCIPAL_MAX
            };
            sec.rotate(now, ns, *principal, *digest, *overlap_ms, retired_max)
                .map(|()| Reply::TokenSet)
        }
        Command::RevokeToken { principal } => sec.revoke(ns, *principal).map(|()| Reply::TokenSet),
        Command::RecordDenials { node, denials } => {
            for d in denials {
                ctx.effects.push(PendingEvent {
                    org: d.actor.org(),
                    account: None,
                    hold: None,
                    body: EventBody::Denied {
                        node: *node,
                        caller: d.actor,
                        api: d.api.clone(),
                        reason: d.reason,
                    },
                });
            }
            Ok(Reply::DenialsRecorded {
                count: denials.len() as u32,
            })
        }
        _ => Err(CommandError::Unauthorized),
    }
}

fn dispatch_scheduler(
    state: &mut State,
    actor: Actor,
    ns: Option<OrgId>,
    command: &Command,
    ctx: &mut Ctx,
) -> Outcome {
    let rules = state.rules.active;
    let (sched, ledger, cfg) = (
        &mut state.scheduler,
        &mut state.ledger,
        &state.config.scheduler,
    );
    let now = ctx.now;
    match command {
        Command::RegisterNode(spec) => sched.register_node(ctx, ledger, cfg, spec),
        Command::NodeHeartbeat { node } => {
            let reply = sched.node_heartbeat(now, cfg.node_lease_ms, *node, ctx.effects, rules)?;
            if rules >= crate::scheduler::GRACE_WAITS_FOR_THE_NODE_FROM {
                sched.end_waiting_graces(ctx, ledger, cfg, *node);
            }
            Ok(reply)
        }
        Command::SetNodeDraining { node, draining } => {
            sched.set_draining(*node, *draining, ctx.effects)
        }
        Command::SubmitJob(spec) => sched.submit(ctx, ledger, cfg, need(ns)?, spec),
        Command::SubmitJobDedup { spec, key } => {
            sched.submit_dedup(ctx, ledger, cfg, need(ns)?, spec, key)
        }
        Command::CancelJob { job } => sched.cancel(ctx, ledger, cfg, actor, (need(ns)?, *job)),
        Command::JobHeartbeat(hb) => sched.heartbeat(ctx, ledger, cfg, actor, need(ns)?, hb),
        Command::FinishJob { .. } | Command::FinishJobAt { .. } => {
            let Some((job, attempt, success, exit)) = command.finish_report() else {
                return Err(CommandError::Unauthorized);
            };
            sched.finish(
                ctx,
                ledger,
                cfg,
                actor,
                ((need(ns)?, job), attempt, success),
                exit,
            )
        }
        Command::JobFenced { job, attempt } => {
            sched.fenced(ctx, ledger, cfg, actor, ((need(ns)?, *job), *attempt))
        }
        Command::SetQuota { org, quota } => sched.set_quota(ledger, *org, *quota),
        Command::SetShareWeight { scope, weight } => {
            sched.set_share_weight(ledger, need(ns)?, *scope, *weight)
        }
        Command::SetPlan { org, plan } => sched.set_plan(ledger, cfg, *org, plan.as_ref()),
        _ => Err(CommandError::Unauthorized),
    }
}

fn dispatch(
    ledger: &mut Ledger,
    cfg: &SchedulerConfig,
    ns: Option<OrgId>,
    quota: &Quota,
    command: &Command,
    ctx: &mut Ctx,
) -> Outcome {
    let now = ctx.now;
    match command {
        Command::CreateOrg { org } => ledger.create_org(*org).map(|()| Reply::Created),
        Command::CreateProject { project, org } => ledger
            .create_project(*project, *org, quota)
            .map(|()| Reply::Created),
        Command::CreateUser { user, org } => ledger
            .create_user(*user, *org, quota)
            .map(|()| Reply::Created),
        Command::SetPrices { prices } => {
            if ledger.rules.0 >= crate::limits::TIER_PRICES_NONZERO_FROM
                && prices_a_tier_at_zero(
                    prices.iter().map(|(_, p)| *p),
                    cfg.tiers.iter().map(|t| t.price_pct),
                )
            {
                return Err(CommandError::InvalidPrice);
            }
            ledger
                .set_prices(now, prices)
                .map(|version| Reply::PricesSet { version })
        }
        Command::IssueGrant(g) => ledger
            .issue_grant(ctx, need(ns)?, quota, g)
            .map(|()| Reply::GrantIssued { bucket: g.bucket }),
        Command::SetBudget { scope, budget } => ledger
            .set_budget(need(ns)?, *scope, *budget)
            .map(|()| Reply::BudgetSet),
        Command::CreateHold(spec) => ledger
            .create_hold(ctx, need(ns)?, quota, spec)
            .map(|draws| Reply::HoldCreated {
                hold: spec.hold,
                draws,
            }),
        Command::Capture { hold, amount_micro } => {
            let hc = ledger.open_hold(need(ns)?, *hold)?;
            if hc.hold.meter.is_some() {
                return Err(CommandError::HoldMetered);
            }
            hc.books.capture(ctx, hc.hold, *amount_micro)?;
            Ok(Reply::Captured {
                captured_micro: hc.hold.captured,
                held_micro: hc.hold.held,
            })
        }
        Command::TopUp { hold, amount_micro } => {
            let hc = ledger.open_hold(need(ns)?, *hold)?;
            hc.books.draw(ctx, hc.hold, *amount_micro)?;
            Ok(Reply::ToppedUp {
                added_micro: *amount_micro,
                held_micro: hc.hold.held,
            })
        }
        Command::ReleaseHold { hold } => {
            let org = need(ns)?;
            if ledger.open_hold(org, *hold)?.hold.meter.is_some() {
                return Err(CommandError::HoldMetered);
            }
            ledger
                .settle(ctx, org, *hold, 0, crate::command::SettleReason::Cancelled)
                .map(Reply::Settled)
        }
        Command::StartMeter {
            hold,
            attempt,
            gpu_type,
            gpus,
        } => ledger
            .start_meter(
                need(ns)?,
                *hold,
                crate::ledger::MeterStart {
                    attempt: *attempt,
                    gpu_type,
                    gpus: *gpus,
                },
                now,
                |t| cfg.price_pct(t),
            )
            .map(
                |(price_micro_per_gpu_hour, price_version)| Reply::MeterStarted {
                    price_micro_per_gpu_hour,
                    price_version,
                },
            ),
        Command::Heartbeat(hb) => ledger.heartbeat(ctx, need(ns)?, hb).map(Reply::Heartbeat),
        Command::Settle {
            hold,
            attempt,
            reason,
        } => ledger
            .settle(ctx, need(ns)?, *hold, *attempt, *reason)
            .map(Reply::Settled),
        Command::Transfer {
            from,
            to,
            amount_micro,
        } => ledger
            .transfer(ctx, need(ns)?, quota, *from, *to, *amount_micro)
            .map(|buckets| Reply::Transferred { buckets }),
        Command::Tick => Ok(Reply::Ticked),
        // Scheduler commands (`Command::is_scheduler`) go to `dispatch_scheduler`.
        _ => Err(CommandError::Unauthorized),
    }
}

/// Fills a command event's query references (org, account, hold): the request's
/// namespace `ns` (the attempting org, for a tenant) and the objects the command names
/// in it — never another org's.
fn refs_of(
    state: &State,
    ns: Option<OrgId>,
    command: &Command,
    mut ev: PendingEvent,
) -> PendingEvent {
    let ledger = &state.ledger;
    let hold_refs = |id| {
        let project = ns.and_then(|o| ledger.hold(o, id)).map(|h| h.project);
        (project.map(Account::Project), Some(id))
    };
    let (account, hold) = match command {
        Command::CreateOrg { org } => (Some(Account::Org(*org)), None),
        Command::CreateProject { project, .. } => (Some(Account::Project(*project)), None),
        Command::CreateUser { org, .. } => (Some(Account::Org(*org)), None),
        Command::IssueGrant(g) | Command::IssueGrantIn { grant: g, .. } => (Some(g.owner), None),
        Command::CreateHold(s) => (Some(Account::Project(s.project)), Some(s.hold)),
        Command::Capture { hold, .. }
        | Command::TopUp { hold, .. }
        | Command::ReleaseHold { hold }
        | Command::StartMeter { hold, .. }
        | Command::Settle { hold, .. } => hold_refs(*hold),
        Command::Heartbeat(hb) => hold_refs(hb.hold),
        Command::Transfer { from, .. } => (Some(*from), None),
        Command::SubmitJob(spec) | Command::SubmitJobDedup { spec, .. } => (
            Some(Account::Project(spec.project)),
            Some(HoldId(spec.job.0)),
        ),
        Command::CancelJob { job }
        | Command::FinishJob { job, .. }
        | Command::FinishJobAt { job, .. }
        | Command::JobFenced { job, .. } => hold_refs(HoldId(job.0)),
        Command::JobHeartbeat(hb) => hold_refs(HoldId(hb.job.0)),
        Command::SetQuota { org, .. } => (Some(Account::Org(*org)), None),
        Command::SetShareWeight { scope, .. }
        | Command::SetBudget { scope, .. }
        | Command::SetAlert { scope, .. } => {
            let account = match scope {
                BudgetScope::Org(o) => Some(Account::Org(*o)),
                BudgetScope::Project(p) => Some(Account::Project(*p)),
                BudgetScope::User(_) => ns.map(Account::Org),
            };
            (account, None)
        }
        Command::CreateToken { scope, .. } => (scope.org().map(Account::Org), None),
        Command::SetPrices { .. }
        | Command::ConfigureScheduler(_)
        | Command::Tick
        | Command::RegisterNode(_)
        | Command::NodeHeartbeat { .. }
        | Command::SetNodeDraining { .. }
        | Command::Bootstrap { .. }
        | Command::RotateToken { .. }
        | Command::RevokeToken { .. }
        | Command::RecordDenials { .. }
        | Command::ActivateVersion { .. } => (None, None),
        Command::SetPlan { org, .. } => (Some(Account::Org(*org)), None),
    };
    ev.org = ns;
    ev.account = account;
    ev.hold = hold;
    ev
}
