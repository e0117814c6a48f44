//! Rule versions: which behaviour `apply` runs, switched on cluster-wide through the log.
//!
//! A new release may change what a command does (a limit, a rounding, a new check). If
//! each binary applied its own rules, a cluster in the middle of a rolling upgrade would
//! apply the same log differently on old and new replicas and diverge. So behaviour is
//! versioned: the state carries the **active rule version** ([`Rules::active`]), every
//! entry is applied under the version active at its position in the log, and a new
//! version's behaviour switches on only through a replicated `ActivateVersion` command
//! (the pattern of CockroachDB's cluster versions and TigerBeetle's release in every
//! prepare). The node accepts `ActivateVersion` only when every voter reports a binary
//! that supports the version, and a binary never applies or starts on a version it does
//! not support: it stops instead (docs/DESIGN.md §48).
//!
//! The versions, oldest first:
//! - **1** — the baseline: every rule up to format 6 (a shard created or restored starts
//!   here, whatever binary creates it, so that every replica's initial state is equal).
//! - **2** — jobs may run up to [`JOB_DURATION_MS_MAX_V2`] (90 days) instead of
//!   [`crate::limits::JOB_DURATION_MS_MAX`] (30): long training runs no longer need to be
//!   split, and a longer maximum is a longer reservation, so old and new replicas must
//!   agree on which applies.
//! - **3** — the idempotency table holds up to
//!   [`crate::limits::IDEMPOTENCY_ENTRIES_MAX_V3`] records (4× version 2's bound, in
//!   less memory: `crate::idempotency`), and snapshots are written in format 7 (the
//!   table's compact encoding, [`crate::codec::FORMAT_VERSION`]); before it, this
//!   release writes format 6, which the previous release reads, so that a rolling
//!   upgrade can still be rolled back until the operator activates version 3.
//!   Under the `Fair` policy (`crate::scheduler`, DESIGN §21–§24) version 3 also
//!   changes what the scheduling pass decides: (a) only aged multi-GPU jobs reserve
//!   nodes — each org's oldest one, in fair-share order within a tier and by how
//!   overdue across tiers — and a job whose reserved node is ready is placed before
//!   the fair order; (b) the reserved node is the one where the job's GPUs are free
//!   soonest by the running jobs' estimated ends (from the progress their agents
//!   report, capped by their deadlines), not the one with the most free GPUs now;
//!   (c) only the top tier preempts a job that would lose work: a lower tier takes
//!   only checkpointable victims. The other policies decide as before.
//!   Result dedup (`Command::SubmitJobDedup`, `crate::scheduler::dedup`) is refused
//!   before version 3.
//! - **4** — a closed bucket counts against its org's bucket quota (`buckets_max`)
//!   until it is archived (`bucket_retention_ms` after closing), not only while it is
//!   in use: an org that closes buckets as fast as it makes them (transfers back and
//!   forth) meets its own quota instead of filling the shard's bucket table for
//!   everyone (`crate::ledger::CLOSED_BUCKETS_COUNTED_FROM`). Its activation adds the
//!   buckets already closed to their orgs' counters. Tokens: a tenant's principal
//!   remembers one retired key digest instead of 16 (the activation trims longer
//!   lists), and tenants' new principals leave the last `TOKENS_OPERATOR_RESERVE` of the
//!   shard's token table to the operator's admin and agent tokens
//!   (`crate::limits::TOKEN_BOUNDS_FROM`); rotations are never refused for it.
//!   Preemption: at the end of its grace, a victim whose node has not renewed its
//!   lease since the preemption began keeps its GPUs until the node renews or goes
//!   down (`crate::scheduler::GRACE_WAITS_FOR_THE_NODE_FROM`): a cut-off agent may
//!   not have learnt of the preemption. Billing: a scheduler job's meter runs from its
//!   attempt's first accepted heartbeat (its runner's start), not its placement, and
//!   an attempt that never started bills nothing
//!   (`crate::ledger::METER_FROM_FIRST_HEARTBEAT_FROM`). Agents: a report on a job
//!   not placed on the agent's node answers `UnknownJob` whatever became of the job
//!   (`crate::scheduler::AGENTS_SEE_ONLY_THEIR_JOBS_FROM`; before, `JobFinished`,
//!   `JobNotPlaced` and `StaleAttempt` told any agent about any org's jobs). A job that
//!   ends while its node's lease has run out (cancelled, at its deadline) is billed no
//!   later than the lease's end, by which its agent has stopped the runner
//!   (`crate::scheduler::ENDINGS_ON_A_LAPSED_NODE_BILL_TO_THE_LEASE_FROM`). Budgets:
//!   when a requeued attempt is billed back to its checkpoint, the captures reversed
//!   from an earlier day go back to their buckets instead of staying held for the next
//!   attempt, which spent them today without a budget check
//!   (`crate::ledger::PAST_DAY_REVERSALS_RETURN_FROM`). Result dedup: a keyed
//!   submission that takes a retained result reserves nothing, so credit and budgets
//!   cannot refuse it (`crate::scheduler::dedup::RETAINED_RESULTS_RESERVE_NOTHING_FROM`).
//!   Metering: a retried heartbeat whose hold was settled since the meter saw it (the
//!   one that ran out of credit, its reply lost) is answered as a duplicate with the
//!   settlement instead of `HoldSettled`
//!   (`crate::ledger::RETRIED_HEARTBEATS_SEE_THEIR_SETTLEMENT_FROM`).
//!   The state's format is unchanged (7).
//! - **5** — snapshots are written in format 8. The scheduler keeps each node's last
//!   renewal and each preemption's start (`crate::scheduler::Fence`,
//!   `crate::scheduler::FENCE_INSTANTS_FROM`), which version 4's silent-node grace
//!   rule compares, instead of rebuilding them from today's `node_lease_ms` and
//!   `grace_ms` (a setting changed while a node was silent made it look renewed); its
//!   activation fills them in from the leases and grace timers in flight. A grant's id
//!   is retired when its bucket is archived and never issued again
//!   (`crate::ledger::GRANT_IDS_RETIRED_FROM`; before, a replay of an old
//!   `IssueGrant` after the archive issued the credit twice). A version of its own,
//!   not part of 4: commits that already implemented version 4 wrote format 7 under
//!   it, and every replica must start recording at one point of the log.
//! - **6** — `Command::FinishJobAt`: an agent's finish report may say when the runner
//!   exited (after its newest accepted heartbeat, on the agent's monotonic clock), and
//!   an ending that bills to now bills no later than that instant
//!   (`crate::scheduler::RUNNER_EXIT_BILLS_FROM`; before, a runner that exited while
//!   its agent was cut off was billed until the report got through). A new kind of
//!   command, so refused until the version is active. A `RegisterNode` of a known node
//!   by its own agent process, which renews its lease, ends the preemptions waiting for
//!   that renewal as a `NodeHeartbeat` does
//!   (`crate::scheduler::REGISTRATION_ENDS_WAITING_GRACES_FROM`; before, they waited for
//!   the next heartbeat); an operator's (incarnation 0) of a node an agent process has
//!   claimed changes its labels only — it renewed the lease, which made a silent node
//!   look alive to the grace rule
//!   (`crate::scheduler::OPERATOR_REGISTRATIONS_RENEW_NOTHING_FROM`). The state's format
//!   is unchanged (8).
//! - **7** — a tenant whose own principal expires cannot issue a key that outlives it:
//!   a `CreateToken` without an expiry or with a later one, or a `RotateToken` of a
//!   principal that lives longer, is refused `Unauthorized`
//!   (`crate::limits::TENANT_KEYS_WITHIN_CALLER_LIFE_FROM`; before, an org token given
//!   for an hour could mint an org principal that never expires). A project token's
//!   `Transfer` credits only its org's account; another project of the org answers
//!   `UnknownProject`, existing or not (`crate::limits::PROJECT_TRANSFERS_STAY_HOME_FROM`).
//!   The state's format is unchanged (8).
//! - **8** — a job being preempted when its node fails (the node stays silent to its
//!   lease's end plus the fence margin, or a new agent process registers it) is
//!   requeued as preempted: billed to its checkpoint and not counted against its
//!   node-failure requeues, as it already was when its agent reported it fenced
//!   (`crate::scheduler::PREEMPTED_ON_A_FAILED_NODE_FROM`; before, it was billed to its
//!   last heartbeat as a node failure, and three such ended it `Failed`). A price list
//!   and tier percentages that would price some tier at 0 µcredits per GPU-hour (the
//!   lowest price times the lowest percentage below 100) are refused: `SetPrices`
//!   `InvalidPrice`, `ConfigureScheduler` `InvalidConfig(TierPrice)`
//!   (`crate::limits::TIER_PRICES_NONZERO_FROM`; before, that tier's jobs ran free).
//!   A job not yet placed gives up the credit its hold holds from buckets that expired
//!   while it waited: forfeited and drawn again from spendable credit, or the job ends
//!   `Failed` (`OutOfCredits`) without running
//!   (`crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM`; before, a queued job ran on
//!   expired promotional credit however long it had waited).
//!   The state's format is unchanged (8).

use serde::{Deserialize, Serialize};

/// The rule version every shard starts at.
pub const RULES_BASELINE: u32 = 1;
/// The newest rule version this build implements. A node may be told to support less
/// (`allot-node --max-rules-version`, to rehearse an upgrade or to hold one back), never
/// more.
pub const RULES_MAX: u32 = 8;
/// A job's longest `max_duration_ms` from rule version 2 on.
pub const JOB_DURATION_MS_MAX_V2: u64 = 90 * 86_400_000;

/// The active rule version of a shard and when each version was activated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rules {
    pub active: u32,
    /// `(version, log index, logical time)` of every activation, oldest first (one per
    /// version at most, so bounded by [`RULES_MAX`]).
    pub activations: Vec<(u32, u64, u64)>,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            active: RULES_BASELINE,
            activations: Vec::new(),
        }
    }
}

/// The format a state is encoded in under rule version `rules` (snapshots, backups,
/// the state hash): format 6's layout until version 3, so that a node of the previous
/// release can still read every snapshot until the operator activates the new rules;
/// format 7 (the compact idempotency table) under versions 3 and 4; format 8 (the
/// fence instants and retired grant ids appended) from version 5.
pub fn state_format(rules: u32) -> u8 {
    if rules >= crate::scheduler::FENCE_INSTANTS_FROM {
        crate::codec::FORMAT_VERSION
    } else if rules >= 3 {
        crate::codec::COMPACT_TABLE_FORMAT
    } else {
        crate::codec::WIRE_FORMAT
    }
}

/// The longest `max_duration_ms` of a job under rule version `rules`.
pub fn job_duration_max(rules: u32) -> u64 {
    if rules >= 2 {
        JOB_DURATION_MS_MAX_V2
    } else {
        crate::limits::JOB_DURATION_MS_MAX
    }
}

/// What `ActivateVersion { version }` does to `rules`, applied at `log_index`/`now`:
/// the same version again is accepted and changes nothing (a retried activation); an
/// older one, or one this build does not implement, is refused.
pub fn activate(
    rules: &mut Rules,
    version: u32,
    log_index: u64,
    now: u64,
) -> Result<(), crate::outcome::CommandError> {
    use crate::outcome::CommandError;
    if version > RULES_MAX || version < rules.active {
        return Err(CommandError::UnsupportedRulesVersion {
            active: rules.active,
            newest: RULES_MAX,
        });
    }
    if version > rules.active {
        rules.active = version;
        rules.activations.push((version, log_index, now));
    }
    Ok(())
}
