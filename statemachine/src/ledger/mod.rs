//! The credit ledger: tenancy, buckets, holds, metering, budgets, balances.
//!
//! Money is integer micro-credits. Every bucket keeps its own conservation equation
//! `issued + moved_in = remaining + held + consumed + expired + moved_out`, and every
//! movement below changes two of those terms by the same amount, so accounts and the
//! shard conserve by construction; [`crate::invariants`] checks it independently.

mod balance;
mod buckets;
mod budget;
mod holds;
mod meter;
mod tenancy;

pub(crate) use crate::validate::check_amount;
pub use balance::{Balance, BucketView, UpcomingExpiry};
pub(crate) use budget::period_index;
pub use budget::{Budget, Usage};
pub(crate) use meter::MeterStart;
pub use meter::{cost_micro, tier_price, Meter};

use crate::audit::{EventBody, PendingEvent};
use crate::command::{BucketKind, BucketPolicy};
use crate::idmap::{IdMap, SharedMap};
use crate::ids::{
    Account, BucketId, GpuType, HoldId, HoldKey, OrgId, ProjectId, ProjectKey, Tier, UserId,
    UserKey,
};
use crate::outcome::Settlement;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Ledger settings, fixed at shard creation (replicated with the state).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerConfig {
    /// When a metered hold runs out, it is topped up by the shortfall plus this much
    /// run time at the attempt's price.
    pub hold_topup_ms: u64,
    /// How long a settled hold is kept as a tombstone ("already settled").
    pub settled_retention_ms: u64,
    /// How long a closed bucket (drained or expired, nothing held) stays queryable
    /// before it is archived.
    pub bucket_retention_ms: u64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            hold_topup_ms: 15 * 60_000,
            settled_retention_ms: 7 * 86_400_000,
            bucket_retention_ms: 7 * 86_400_000,
        }
    }
}

/// Spend order key: priority, then earliest expiry (none = last), then promotional
/// before granted before paid, then the project's own buckets before the org's shared
/// ones, then oldest (creation sequence).
pub type SpendKey = (u8, u64, u8, u8, u64);

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    pub id: BucketId,
    pub owner: Account,
    pub org: OrgId,
    pub kind: BucketKind,
    pub priority: u8,
    pub expires_at_ms: Option<u64>,
    pub policy: Option<BucketPolicy>,
    pub source_ref: Option<String>,
    /// Creation order in the shard (the "oldest first" key).
    pub seq: u64,
    pub issued: u64,
    pub moved_in: u64,
    pub remaining: u64,
    pub held: u64,
    pub consumed: u64,
    pub expired: u64,
    pub moved_out: u64,
    /// Set by the expiry pass; from then on `remaining` is 0 and refunds are forfeited.
    pub is_expired: bool,
    /// Open holds with a draw on this bucket (a reversal may still return credit to
    /// it): a bucket is closed only once none is left.
    pub open_draws: u32,
    /// When the bucket closed (see `Books::close_if_done`); archived a retention later.
    pub closed_at_ms: Option<u64>,
}

impl Bucket {
    /// Spendable at `now`: not expired, and not past its expiry instant even if the
    /// bounded expiry pass has not reached it yet.
    pub fn spendable_at(&self, now: u64) -> bool {
        !self.is_expired && self.expires_at_ms.is_none_or(|e| e > now)
    }

    pub fn spend_key(&self) -> SpendKey {
        let owner_rank = match self.owner {
            Account::Project(_) => 0,
            Account::Org(_) => 1,
        };
        (
            self.priority,
            self.expires_at_ms.unwrap_or(u64::MAX),
            self.kind.spend_rank(),
            owner_rank,
            self.seq,
        )
    }

    pub(crate) fn refs(&self) -> BucketRef {
        BucketRef {
            id: self.id,
            org: self.org,
            owner: self.owner,
            key: self.spend_key(),
        }
    }

    /// May this bucket pay for a hold of `tier` that may run on any of `gpu_types`?
    pub fn pays_for(&self, tier: Tier, gpu_types: &[GpuType]) -> bool {
        match &self.policy {
            None => true,
            Some(p) => {
                (p.tiers.is_empty() || p.tiers.contains(&tier))
                    && (p.gpu_types.is_empty()
                        || (!gpu_types.is_empty()
                            && gpu_types.iter().all(|t| p.gpu_types.contains(t))))
            }
        }
    }

    /// The bucket's own conservation equation.
    pub fn is_balanced(&self) -> bool {
        let lhs = self.issued as u128 + self.moved_in as u128;
        let rhs = self.remaining as u128
            + self.held as u128
            + self.consumed as u128
            + self.expired as u128
            + self.moved_out as u128;
        lhs == rhs
    }
}

/// The lifetime figures of archived buckets (an account's, or the shard's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Archived {
    pub buckets: u64,
    pub issued: u128,
    pub moved_in: u128,
    pub moved_out: u128,
    pub consumed: u128,
    pub expired: u128,
}

impl Archived {
    pub(crate) fn add(&mut self, b: &Bucket) {
        self.buckets += 1;
        self.issued += b.issued as u128;
        self.moved_in += b.moved_in as u128;
        self.moved_out += b.moved_out as u128;
        self.consumed += b.consumed as u128;
        self.expired += b.expired as u128;
    }
}

/// An org's or project's credit account.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountRec {
    /// The buckets the account owns that are not archived (bounded by
    /// `BUCKETS_PER_ACCOUNT_MAX`: drained and expired buckets leave it, so a long-lived
    /// account never meets a lifetime limit).
    pub buckets: Vec<BucketId>,
    /// How many of `buckets` are closed and wait to be archived.
    pub closed: u32,
    /// What its archived buckets issued, moved, consumed and expired.
    pub archived: Archived,
    /// Buckets with remaining credit, sorted by spend order.
    pub live: Vec<(SpendKey, BucketId)>,
    pub usage: Usage,
    pub budget: Option<Budget>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrgRec {
    pub account: AccountRec,
    /// The org's projects and users (its namespace), in id order: per-org listings and
    /// quotas without scanning the shard.
    pub projects: BTreeSet<ProjectId>,
    pub users: BTreeSet<UserId>,
    /// Buckets in use (not closed) across the org's and its projects' accounts, and
    /// holds open: the org's quota counters.
    pub buckets_in_use: u32,
    pub holds_open: u32,
    /// The next bucket's spend-order sequence number (ties in spend order).
    pub next_bucket_seq: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectRec {
    pub org: OrgId,
    pub account: AccountRec,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRec {
    pub org: OrgId,
    pub usage: Usage,
    pub budget: Option<Budget>,
}

/// One bucket's part of a hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Draw {
    pub bucket: BucketId,
    /// Still reserved.
    pub held: u64,
    /// Captured (consumed) from this draw, net of reversals.
    pub captured: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub id: HoldId,
    pub org: OrgId,
    pub project: ProjectId,
    pub user: UserId,
    pub tier: Tier,
    pub gpu_types: Vec<GpuType>,
    /// In spend order at the time of each draw; top-ups append.
    pub draws: Vec<Draw>,
    pub held: u64,
    pub captured: u64,
    pub created_ms: u64,
    pub meter: Option<Meter>,
    /// The hold belongs to a scheduler job: only the job commands may meter or settle it.
    pub job: bool,
    /// Set once, at settlement (with its logical time).
    pub settled: Option<(u64, Settlement)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceTable {
    pub version: u32,
    pub since_ms: u64,
    pub prices: BTreeMap<GpuType, u64>,
}

/// Shard totals kept alongside the buckets, so invariant checks can compare two
/// independent accounts of the same money.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    pub issued: u128,
    pub consumed: u128,
    pub expired: u128,
    pub moved: u128,
}

/// The ledger: the books (accounts, buckets, prices, totals) and the hold table, kept
/// apart so an operation can borrow one hold and the books at once (one lookup, no
/// moves). `Ledger` dereferences to its [`Books`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub books: Books,
    pub holds: HoldTable,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Books {
    pub config: LedgerConfig,
    pub orgs: IdMap<OrgId, OrgRec>,
    /// Projects and users by (org, id): each org has its own namespace.
    pub projects: IdMap<ProjectKey, ProjectRec>,
    pub users: IdMap<UserKey, UserRec>,
    pub buckets: IdMap<BucketId, Bucket>,
    /// The expiry min-queue: (expires_at_ms, bucket), smallest first. An ordered set
    /// rather than a binary heap so its encoding (and the state hash) is canonical.
    pub expiry_queue: BTreeSet<(u64, BucketId)>,
    pub prices: PriceTable,
    /// Next id for buckets the ledger creates itself (transfers), from `INTERNAL_ID_BASE`.
    pub next_internal_id: u64,
    pub totals: Totals,
    /// The shard's archived buckets, all accounts together (conservation still sums).
    pub archived: Archived,
    /// Closed buckets in closing order, archived `bucket_retention_ms` later.
    pub closed_queue: std::collections::VecDeque<(u64, BucketId)>,
    /// The ids of grants whose buckets were archived (rule version 5 on,
    /// [`GRANT_IDS_RETIRED_FROM`]): never issued again. Grows with the grants an admin
    /// issues (tenants issue none), one id each. Not part of the ledger's own encoding:
    /// the state writes it after its other fields in format 8 only (it is empty before
    /// version 5, whose snapshots are format 8).
    #[serde(skip)]
    pub retired_grants: BTreeSet<BucketId>,
    /// The shard's active rule version as apply last set it (`crate::version`), for the
    /// ledger's rules that depend on it. Not state: not encoded, not compared.
    #[serde(skip)]
    pub(crate) rules: RulesSeen,
}

/// A copy of the state's active rule version, refreshed by apply before every entry
/// and at every activation ([`crate::state::apply_into`]). It is derived from encoded
/// state, so it is neither encoded nor compared.
pub type RulesSeen = crate::state::NotState<u32>;

/// From this rule version a closed bucket counts against its org's bucket quota until
/// it is archived (DESIGN §44, "Buckets closed by churn").
pub const CLOSED_BUCKETS_COUNTED_FROM: u32 = 4;

/// From this rule version a grant's id is retired when its bucket is archived, and a
/// grant naming it again is refused `AlreadyExists` like one naming a live bucket:
/// before, a retry of an `IssueGrant` arriving after the bucket's archive (the
/// idempotency window is a day, the archive comes `bucket_retention_ms` after the
/// bucket closes) issued the credit a second time (DESIGN §59).
pub const GRANT_IDS_RETIRED_FROM: u32 = 5;

/// From this rule version a placed job's meter runs from its attempt's first accepted
/// heartbeat (the runner's start), not from its placement: a placement its node's agent
/// could not start at once (cut off, restarting) bills nothing until it does, and one
/// that ends before it ever starts bills nothing (DESIGN §45, "Billing starts with the
/// runner").
pub const METER_FROM_FIRST_HEARTBEAT_FROM: u32 = 4;
/// The rule version from which the part of a requeued attempt's reversed captures that
/// had been billed on an earlier day goes back to its buckets at once, instead of
/// staying held for the next attempt (which spent it today without a budget check).
pub const PAST_DAY_REVERSALS_RETURN_FROM: u32 = 4;
/// From this rule version a retried metering heartbeat whose hold has been settled since
/// the meter saw its `(attempt, seq)` (the heartbeat that ran out of credit, whose reply
/// was lost, or one overtaken by a settlement) is answered as a duplicate with the
/// hold's settlement in `stop`, as a duplicate on an open hold is answered; before, it
/// was refused `HoldSettled`, which a client reads as "refused, nothing changed"
/// (DESIGN §9, "Heartbeats").
pub const RETRIED_HEARTBEATS_SEE_THEIR_SETTLEMENT_FROM: u32 = 4;
/// From this rule version the credit a scheduler job holds stays valid past its
/// bucket's expiry only once the job has been placed ("held credits stay valid for the
/// running job"): before its first placement, the part held from buckets that expired
/// meanwhile is forfeited and reserved again from spendable credit, or the job ends
/// `Failed` (`OutOfCredits`) without running. Before, a job queued behind others — or
/// submitted at a tier that waits — carried a promotional grant's credit past its
/// expiry for as long as it waited (DESIGN §5, "Held credit and expiry").
pub const QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM: u32 = 8;

/// Open holds and settled tombstones.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldTable {
    /// Persistent (O(1) clone): settled tombstones stay for the retention window, so
    /// the table grows with history, and a snapshot clones the state under the apply lock.
    pub map: SharedMap<HoldKey, Hold>,
    pub open: usize,
    /// Settled holds, pruned after `settled_retention_ms`, beyond the org's quota (its
    /// own oldest) or the shard's cap.
    pub settled: crate::tombstones::Tombstones<HoldId>,
}

impl std::ops::Deref for HoldTable {
    type Target = SharedMap<HoldKey, Hold>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::Deref for Ledger {
    type Target = Books;
    fn deref(&self) -> &Books {
        &self.books
    }
}

impl std::ops::DerefMut for Ledger {
    fn deref_mut(&mut self) -> &mut Books {
        &mut self.books
    }
}

/// What a ledger operation needs from the apply loop: the instant, and where to put
/// the events it emits (discarded if the command fails).
pub(crate) struct Ctx<'a> {
    pub now: u64,
    pub effects: &'a mut Vec<PendingEvent>,
}

impl Ctx<'_> {
    fn bucket_event(&mut self, bucket: BucketRef, hold: Option<HoldId>, body: EventBody) {
        self.effects.push(PendingEvent {
            org: Some(bucket.org),
            account: Some(bucket.owner),
            hold,
            body,
        });
    }
}

/// The few facts about a bucket that events and the spend index need (cheap to copy
/// out while the bucket itself is borrowed).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BucketRef {
    pub id: BucketId,
    pub org: OrgId,
    pub owner: Account,
    pub key: SpendKey,
}

/// The typed "unknown id" error for an account.
pub(crate) fn unknown_account(account: Account) -> crate::outcome::CommandError {
    match account {
        Account::Org(_) => crate::outcome::CommandError::UnknownOrg,
        Account::Project(_) => crate::outcome::CommandError::UnknownProject,
    }
}

impl Ledger {
    pub fn new(config: LedgerConfig) -> Ledger {
        Ledger {
            books: Books {
                config,
                next_internal_id: crate::limits::INTERNAL_ID_BASE,
                ..Books::default()
            },
            holds: HoldTable::default(),
        }
    }

    pub fn hold(&self, org: OrgId, id: HoldId) -> Option<&Hold> {
        self.holds.map.get(&(org, id))
    }
}

impl Books {
    /// `account` in `org`'s namespace (another org's account is no account of it).
    pub fn account(&self, org: OrgId, account: Account) -> Option<&AccountRec> {
        match account {
            Account::Org(o) if o == org => self.orgs.get(&o).map(|r| &r.account),
            Account::Org(_) => None,
            Account::Project(p) => self.projects.get(&(org, p)).map(|r| &r.account),
        }
    }

    fn account_mut(&mut self, org: OrgId, account: Account) -> Option<&mut AccountRec> {
        match account {
            Account::Org(o) if o == org => self.orgs.get_mut(&o).map(|r| &mut r.account),
            Account::Org(_) => None,
            Account::Project(p) => self.projects.get_mut(&(org, p)).map(|r| &mut r.account),
        }
    }

    /// Whether `account` exists in `org`'s namespace.
    pub fn has_account(&self, org: OrgId, account: Account) -> bool {
        self.account(org, account).is_some()
    }
}
