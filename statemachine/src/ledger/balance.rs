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
/// consumed + expired + moved_out` holds for every balance whose figures are below
/// `u64::MAX` (a figure past it — cumulative ones can get there — shows `u64::MAX`).
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
        self.paid_available_micro
            .saturating_add(self.promotional_available_micro)
            .saturating_add(self.granted_available_micro)
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
        // Summed in u128 (an account's cumulative figures — its archived buckets' and
        // the live ones' — may pass u64 when credit goes to and fro for long enough),
        // each shown saturated at u64::MAX.
        let a = &rec.archived;
        let mut sum = [0u128; 9];
        let [paid, promotional, granted, held, consumed, expired, issued, moved_in, moved_out] =
            &mut sum;
        (*consumed, *expired, *issued, *moved_in, *moved_out) =
            (a.consumed, a.expired, a.issued, a.moved_in, a.moved_out);
        let mut upcoming_expirations = Vec::new();
        for id in &rec.buckets {
            let Some(bucket) = self.buckets.get(id) else {
                continue;
            };
            *held += u128::from(bucket.held);
            *consumed += u128::from(bucket.consumed);
            *expired += u128::from(bucket.expired);
            *issued += u128::from(bucket.issued);
            *moved_in += u128::from(bucket.moved_in);
            *moved_out += u128::from(bucket.moved_out);
            if !bucket.spendable_at(now) {
                *expired += u128::from(bucket.remaining);
                continue;
            }
            *match bucket.kind {
                BucketKind::Paid => &mut *paid,
                BucketKind::Promotional => &mut *promotional,
                BucketKind::Granted => &mut *granted,
            } += u128::from(bucket.remaining);
            if let Some(at) = bucket.expires_at_ms {
                if at <= now.saturating_add(horizon_ms) && bucket.remaining > 0 {
                    upcoming_expirations.push(UpcomingExpiry {
                        bucket: bucket.id,
                        kind: bucket.kind,
                        expires_at_ms: at,
                        remaining_micro: bucket.remaining,
                    });
                }
            }
        }
        let sat = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
        let mut b = Balance {
            paid_available_micro: sat(*paid),
            promotional_available_micro: sat(*promotional),
            granted_available_micro: sat(*granted),
            held_micro: sat(*held),
            consumed_micro: sat(*consumed),
            expired_micro: sat(*expired),
            issued_micro: sat(*issued),
            moved_in_micro: sat(*moved_in),
            moved_out_micro: sat(*moved_out),
            upcoming_expirations,
        };
        b.upcoming_expirations
            .sort_by_key(|u| (u.expires_at_ms, u.bucket));
        Some(b)
    }
}
