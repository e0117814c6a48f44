//! Every table, queue, batch and loop in the state machine has a named bound here.
//! Each bound is checked with a typed error (or a bounded loop) where it applies, and
//! tested at the bound.

/// Fair-share weights (`Command::SetShareWeight`): the default, and the largest.
pub const SHARE_WEIGHT_DEFAULT: u32 = 100;
pub const SHARE_WEIGHT_MAX: u32 = 10_000;
/// Rows one usage ranking (`Query::Usage`) returns at most.
pub const USAGE_ROWS_MAX: u32 = 1_000;
/// Largest encoded command (the codec's bytes, without the request's actor and id). The
/// largest legal command of every kind is below it (`testkit::largest_commands` builds
/// each at its bounds; the largest, a full `RecordDenials`, is ~24 KB). A request above
/// it is refused at the edge before it is decoded further, and by apply. It bounds what
/// one request costs every replica's log, memory and apply.
pub const COMMAND_BYTES_MAX: usize = 32 * 1024;
/// Commands one log entry may carry; the node's batching proposer stays below it.
pub const COMMANDS_PER_ENTRY_MAX: usize = 8_192;
/// Organisations per shard.
pub const ORGS_MAX: usize = 4_000_000;
/// Projects per shard.
pub const PROJECTS_MAX: usize = 8_000_000;
/// Users per shard.
pub const USERS_MAX: usize = 8_000_000;
/// Buckets (grants and transfer-created buckets) per shard, closed ones not yet archived
/// included.
pub const BUCKETS_MAX: usize = 16_000_000;
/// Buckets in use (not closed) one org or project may own at once: bounds the
/// spend-order scan. A drained or expired bucket with nothing held is closed, stops
/// counting at once and is archived a retention later, so a long-lived account never
/// meets a lifetime limit.
pub const BUCKETS_PER_ACCOUNT_MAX: usize = 1_024;
/// Holds that are open (not yet settled) per shard.
pub const HOLDS_OPEN_MAX: usize = 1_000_000;
/// Settled holds kept as tombstones (so a late finish is told "already settled").
pub const HOLDS_SETTLED_MAX: usize = 4_000_000;
/// Bucket draws one hold may record (top-ups add draws).
pub const DRAWS_PER_HOLD_MAX: usize = 64;
/// Longest dedup key of a job submission (`Command::SubmitJobDedup`): room for a
/// SHA-512 digest.
pub const DEDUP_KEY_BYTES_MAX: usize = 64;
/// Entries in the idempotency table per shard (rule versions 1 and 2).
pub const IDEMPOTENCY_ENTRIES_MAX: usize = 18_000_000;
/// Entries in the idempotency table per shard from rule version 3 on: four times as
/// many, in less memory than the 18,000,000 took before the compact table
/// (`crate::idempotency`, docs/DESIGN.md §51).
pub const IDEMPOTENCY_ENTRIES_MAX_V3: usize = 72_000_000;
/// Of those, the entries only the operator, agents and the system may take: tenants
/// together are refused at `IDEMPOTENCY_ENTRIES_MAX - IDEMPOTENCY_RESERVED_MAX`, so
/// however many orgs fill their quotas, agents' heartbeats and finishes and the
/// operator's commands still apply.
pub const IDEMPOTENCY_RESERVED_MAX: usize = 2_000_000;
/// Idempotency records and settled-hold tombstones pruned per entry (amortised; the
/// bound keeps one entry's apply time bounded, the rest is pruned by later entries).
pub const PRUNE_PER_ENTRY_MAX: usize = 65_536;
/// Buckets expired by one entry's expiry pass. Buckets past their expiry that the pass
/// has not reached yet are still never spendable: every spend path checks the instant.
pub const EXPIRATIONS_PER_ENTRY_MAX: usize = 16_384;
/// Largest amount in one command, in micro-credits (one billion credits).
pub const AMOUNT_MICRO_MAX: u64 = 1_000_000_000_000_000;
/// Largest price, micro-credits per GPU-hour (one million credits per GPU-hour).
pub const PRICE_MICRO_PER_GPU_HOUR_MAX: u64 = 1_000_000_000_000;
/// GPU types in one price table.
pub const PRICE_TABLE_TYPES_MAX: usize = 64;
/// Length of a GPU type name ("A100", "H100-80G").
pub const GPU_TYPE_LEN_MAX: usize = 16;
/// Projects with their own tiers in one org's plan.
pub const PLAN_PROJECTS_MAX: usize = 256;
/// Alerts of one org (one per org, project or user scope): `LimitReached(Alerts)`.
pub const ALERTS_PER_ORG_MAX: usize = 10_000;
/// Alerts in a shard: `LimitReached(Alerts)`.
pub const ALERTS_MAX: usize = 1_000_000;
/// Budget percentages one alert lists: `LimitReached(AlertPcts)`.
pub const ALERT_PCTS_MAX: usize = 8;
/// Largest budget percentage of an alert (soft budgets may be passed): `InvalidAlert`.
pub const ALERT_PCT_MAX: u32 = 1_000;
/// GPU types one bucket policy or one hold may name.
pub const GPU_TYPES_PER_LIST_MAX: usize = 16;
/// Tiers one bucket policy may name.
pub const TIERS_PER_POLICY_MAX: usize = 16;
/// Length of a bucket's source reference (purchase id).
pub const SOURCE_REF_LEN_MAX: usize = 128;
/// GPUs one metered hold may bill for (a job's GPUs all sit on one node).
pub const GPUS_PER_HOLD_MAX: u32 = 8;
/// Ids at or above this are reserved for ids the state machine allocates itself
/// (buckets created by transfers); a client-chosen id there is rejected.
pub const INTERNAL_ID_BASE: u64 = 1 << 63;
/// GPU nodes per shard.
pub const NODES_MAX: usize = 10_000;
/// GPUs on one node.
pub const GPUS_PER_NODE_MAX: u32 = 16;
/// Labels on one node, and the length of a label key or value.
pub const LABELS_PER_NODE_MAX: usize = 16;
pub const LABEL_LEN_MAX: usize = 64;
/// GPUs one job may ask for (all on one node).
pub const GPUS_PER_JOB_MAX: u32 = 8;
/// The latest logical time an entry may carry: 9999-12-31T23:59:59.999Z. A replica
/// refuses a peer's entry stamped later (`allot-node`'s peer checks) and a leader never
/// stamps later: logical time only goes forward (§12), so one such stamp would pin the
/// shard there for good — every expiry fired, every lease past — and the sums of time
/// and a duration in apply would overflow.
pub const LOGICAL_TIME_MS_MAX: u64 = 253_402_300_799_999;
/// Longest `max_duration` a job may ask for (30 days).
pub const JOB_DURATION_MS_MAX: u64 = 30 * 86_400_000;
/// Memory floor a job may ask for, and node memory, in GB.
pub const GPU_MEM_GB_MAX: u32 = 4_096;
/// Jobs not yet finished, per shard.
pub const JOBS_ACTIVE_MAX: usize = 1_000_000;
/// Finished jobs kept (status queries; tombstones against resubmission).
pub const JOBS_FINISHED_MAX: usize = 4_000_000;
/// Timers fired by one entry (the rest fire in the next entries).
pub const TIMERS_PER_ENTRY_MAX: usize = 16_384;
/// API-token keys (digests) per shard, revoked and rotated-out ones included.
pub const TOKENS_MAX: usize = 1_000_000;
/// Live keys one principal may hold at once (rotation with overlap adds one; at the
/// bound, the oldest overlap ends at the next rotation).
pub const TOKEN_KEYS_PER_PRINCIPAL_MAX: usize = 4;
/// Digests of a principal's retired keys remembered (never issued again); older ones
/// are forgotten, so rotation cannot grow the token table without bound.
pub const RETIRED_KEYS_PER_PRINCIPAL_MAX: usize = 16;
/// From rule version 4, for a tenant's principal (an org's namespace): one retired
/// digest (the activation trims longer lists), so an org at its default principal quota
/// holds at most 10,000 × (4 + 1) digests and eighteen such orgs fit the tenants' part
/// of `TOKENS_MAX` (DESIGN §44, "Tokens on any number of shards").
pub const RETIRED_KEYS_PER_TENANT_PRINCIPAL_V4: usize = 1;
/// The most digests a tenant's principal holds from rule version 4: its live keys and
/// one retired digest.
pub const DIGESTS_PER_TENANT_PRINCIPAL_V4: usize =
    TOKEN_KEYS_PER_PRINCIPAL_MAX + RETIRED_KEYS_PER_TENANT_PRINCIPAL_V4;
/// From rule version 4, the part of `TOKENS_MAX` only the operator's own principals
/// (admin and agent tokens) may take: a tenant's new principal is refused
/// `LimitReached(Tokens)` when the tenants' principals, each at its most digests, would
/// pass `TOKENS_MAX - TOKENS_OPERATOR_RESERVE` (180,000 principals). Rotations are never
/// refused for it: each tenant principal's digests are bounded already.
pub const TOKENS_OPERATOR_RESERVE: usize = 100_000;
/// The rule version from which the two bounds above apply.
pub const TOKEN_BOUNDS_FROM: u32 = 4;
/// From rule version 7, a tenant whose own principal expires cannot issue a key that
/// outlives it: a `CreateToken` without an expiry or with a later one, and a
/// `RotateToken` of a principal that lives longer (the new key keeps that principal's
/// life), are refused `Unauthorized`. Before, an org token given for an hour could mint
/// a second org principal that never expires, or rotate the org's long-lived principal
/// to a key it knows, and keep the org for good.
pub const TENANT_KEYS_WITHIN_CALLER_LIFE_FROM: u32 = 7;
/// From rule version 7, a project token's `Transfer` may credit only its org's account
/// (or its own project): another project of the org is refused `UnknownProject` whether
/// it exists or not.
pub const PROJECT_TRANSFERS_STAY_HOME_FROM: u32 = 7;
/// From rule version 8, a price list and the tiers' price percentages must give every
/// tier of every type a price of at least 1 µcredit per GPU-hour
/// (`ledger::tier_price`, which rounds down): `SetPrices` is refused `InvalidPrice`, and
/// `ConfigureScheduler` `InvalidConfig(TierPrice)`, when the lowest price times the
/// lowest percentage is below 100. Before, such a tier's jobs ran free.
pub const TIER_PRICES_NONZERO_FROM: u32 = 8;
/// Denials one `RecordDenials` command may carry, and the length of a denial's api name.
pub const DENIALS_PER_RECORD_MAX: usize = 256;
pub const DENIAL_API_LEN_MAX: usize = 64;
