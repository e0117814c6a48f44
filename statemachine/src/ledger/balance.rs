//! Balance queries with a breakdown. Pure reads of the state at an instant.

use super::Books;
use crate::command::BucketKind;
use crate::ids::{Account, BucketId, OrgId};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpcomingExpiry {
    pub bucket: BucketId,
    pub kind: BucketKind,
    pub expires_at_ms: u64,
    pub remaining_micro: u64,
}

/// An account's credits at one instant. `issued + moved_in = available + held +
/// consumed + expired + moved_out` holds for every balance.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    pub paid_available_micro: u64,
    pub promotional_available_micro: u64,
    pub granted_available_micro: u64,
    pub held_micro: u64,
    pub consumed_micro: u64,
    pub expired_micro: u64,
    pub issued_micro: u64,
    pub moved_in_micro: u64,
    pub moved_out_micro: u64,
    /// Spendable buckets expiring within the horizon, soonest first.
    pub upcoming_expirations: Vec<UpcomingExpiry>,
}

/// One bucket of an account as `balance --buckets` shows it: where its credit came
/// from, what is left and held, and when it expires.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketView {
    pub bucket: BucketId,
    pub kind: BucketKind,
    /// Spend order's first key (lower first).
    pub priority: u8,
    pub expires_at_ms: Option<u64>,
    pub policy: Option<crate::command::BucketPolicy>,
    pub source_ref: Option<String>,
    /// Spendable now: `remaining_micro`; past its expiry it counts as expired.
    pub spendable: bool,
    pub remaining_micro: u64,
    pub held_micro: u64,
    pub issued_micro: u64,
    pub moved_in_micro: u64,
    pub consumed_micro: u64,
    pub expired_micro: u64,
    pub moved_out_micro: u64,
    /// Nothing left, held or drawn: archived a retention after this instant.
    pub closed_at_ms: Option<u64>,
}

impl Balance {
    pub fn available_micro(&self) -> u64 {
        self.paid_available_micro + self.promotional_available_micro + self.granted_available_micro
    }
}

impl Books {
    /// `account`'s own buckets (at most `BUCKETS_PER_ACCOUNT_MAX` are kept per account;
    /// archived ones are in the account's figures only), in spend order at `now`.
    pub fn bucket_views(&self, org: OrgId, account: Account, now: u64) -> Option<Vec<BucketView>> {
        let rec = self.account(org, account)?;
        let mut buckets: Vec<&super::Bucket> = rec
            .buckets
            .iter()
            .filter_map(|id| self.buckets.get(id))
            .collect();
        buckets.sort_by_key(|b| b.spend_key());
        Some(
            buckets
                .into_iter()
                .map(|b| BucketView {
                    bucket: b.id,
                    kind: b.kind,
                    priority: b.priority,
                    expires_at_ms: b.expires_at_ms,
                    policy: b.policy.clone(),
                    source_ref: b.source_ref.clone(),
                    spendable: b.spendable_at(now),
                    remaining_micro: b.remaining,
                    held_micro: b.held,
                    issued_micro: b.issued,
                    moved_in_micro: b.moved_in,
                    consumed_micro: b.consumed,
                    expired_micro: b.expired,
                    moved_out_micro: b.moved_out,
                    closed_at_ms: b.closed_at_ms,
                })
                .collect(),
        )
    }

    /// The balance of `account`'s own buckets at `now`. Credit past its expiry instant
    /// counts as expired even before the expiry pass has processed its bucket.
    pub fn balance(
        &self,
        org: OrgId,
        account: Account,
        now: u64,
        horizon_ms: u64,
    ) -> Option<Balance> {
        let rec = self.account(org, account)?;
        let sat = |x: u128| x.min(u64::MAX as u128) as u64;
        let mut b = Balance {
            consumed_micro: sat(rec.archived.consumed),
            expired_micro: sat(rec.archived.expired),
            issued_micro: sat(rec.archived.issued),
            moved_in_micro: sat(rec.archived.moved_in),
            moved_out_micro: sat(rec.archived.moved_out),
            ..Balance::default()
        };
        for id in &rec.buckets {
            let Some(bucket) = self.buckets.get(id) else {
                continue;
            };
            b.held_micro += bucket.held;
            b.consumed_micro += bucket.consumed;
            b.expired_micro += bucket.expired;
            b.issued_micro += bucket.issued;
            b.moved_in_micro += bucket.moved_in;
            b.moved_out_micro += bucket.moved_out;
            if !bucket.spendable_at(now) {
                b.expired_micro += bucket.remaining;
                continue;
            }
            *match bucket.kind {
                BucketKind::Paid => &mut b.paid_available_micro,
                BucketKind::Promotional => &mut b.promotional_available_micro,
                BucketKind::Granted => &mut b.granted_available_micro,
            } += bucket.remaining;
            if let Some(at) = bucket.expires_at_ms {
                if at <= now.saturating_add(horizon_ms) && bucket.remaining > 0 {
                    b.upcoming_expirations.push(UpcomingExpiry {
                        bucket: bucket.id,
                        kind: bucket.kind,
                        expires_at_ms: at,
                        remaining_micro: bucket.remaining,
                    });
                }
            }
        }
        b.upcoming_expirations
            .sort_by_key(|u| (u.expires_at_ms, u.bucket));
        Some(b)
    }
}
