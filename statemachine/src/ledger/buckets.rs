//! Buckets: issuance, the spend-order index, expiry, and transfers.

use super::{unknown_account, AccountRec, Books, Bucket, BucketRef, Ctx};
use super::{CLOSED_BUCKETS_COUNTED_FROM, GRANT_IDS_RETIRED_FROM};
use crate::audit::EventBody;
use crate::command::{Grant, Quota};
use crate::ids::{Account, BucketId, OrgId};
use crate::limits::*;
use crate::outcome::{CommandError, Limit, QuotaKind};
use std::collections::{BTreeMap, BTreeSet};

impl AccountRec {
    pub(crate) fn live_insert(&mut self, bucket: BucketRef) {
        let entry = (bucket.key, bucket.id);
        if let Err(pos) = self.live.binary_search(&entry) {
            self.live.insert(pos, entry);
        }
    }

    pub(crate) fn live_remove(&mut self, bucket: BucketRef) {
        if let Ok(pos) = self.live.binary_search(&(bucket.key, bucket.id)) {
            self.live.remove(pos);
        }
    }
}

impl Books {
    /// Adds or removes a bucket from its owner's spend index.
    pub(crate) fn set_live(&mut self, bucket: BucketRef, live: bool) {
        if let Some(rec) = self.account_mut(bucket.org, bucket.owner) {
            if live {
                rec.live_insert(bucket);
            } else {
                rec.live_remove(bucket);
            }
        }
    }
}

impl Books {
    /// Checks that `account` may own `extra` more buckets, its org (quota) and the shard.
    fn check_bucket_room(
        &self,
        org: OrgId,
        quota: &Quota,
        account: Account,
        extra: usize,
    ) -> Result<(), CommandError> {
        let in_use = self.orgs.get(&org).map_or(0, |r| r.buckets_in_use as usize);
        if in_use + extra > quota.buckets_max as usize {
            return Err(CommandError::QuotaExceeded(QuotaKind::Buckets));
        }
        let rec = self.account(org, account).ok_or(unknown_account(account))?;
        // Closed buckets (awaiting archive) do not count: the bound is on buckets in use.
        if rec.buckets.len() - rec.closed as usize + extra > BUCKETS_PER_ACCOUNT_MAX {
            return Err(CommandError::LimitReached(Limit::BucketsPerAccount));
        }
        if self.buckets.len() + extra > BUCKETS_MAX {
            return Err(CommandError::LimitReached(Limit::Buckets));
        }
        Ok(())
    }

    /// The spend-order sequence number of `org`'s next bucket (per org: another org's
    /// grants and transfers never change an org's numbers).
    fn next_bucket_seq(&self, org: OrgId) -> u64 {
        self.orgs.get(&org).map_or(0, |r| r.next_bucket_seq)
    }

    /// Adds a fully built bucket: to the map, its account, the spend index and the
    /// expiry queue.
    fn insert_bucket(&mut self, bucket: Bucket) {
        if let Some(at) = bucket.expires_at_ms {
            self.expiry_queue.insert((at, bucket.id));
        }
        if let Some(rec) = self.account_mut(bucket.org, bucket.owner) {
            rec.buckets.push(bucket.id);
            rec.live_insert(bucket.refs());
        }
        if let Some(rec) = self.orgs.get_mut(&bucket.org) {
            rec.buckets_in_use += 1;
            rec.next_bucket_seq += 1;
        }
        self.buckets.insert(bucket.id, bucket);
    }

    pub(crate) fn issue_grant(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        quota: &Quota,
        g: &Grant,
    ) -> Result<(), CommandError> {
        let now = ctx.now;
        // Amount, id, source reference and policy: `crate::validate`.
        if g.expires_at_ms.is_some_and(|at| at <= now) {
            return Err(CommandError::ExpiryInPast);
        }
        if !self.has_account(org, g.owner) {
            return Err(unknown_account(g.owner));
        }
        if self.buckets.contains_key(&g.bucket)
            || (self.rules.0 >= GRANT_IDS_RETIRED_FROM && self.retired_grants.contains(&g.bucket))
        {
            return Err(CommandError::AlreadyExists);
        }
        self.check_bucket_room(org, quota, g.owner, 1)?;
        self.insert_bucket(Bucket {
            id: g.bucket,
            owner: g.owner,
            org,
            kind: g.kind,
            priority: g.priority,
            expires_at_ms: g.expires_at_ms,
            policy: g.policy.clone(),
            source_ref: g.source_ref.clone(),
            seq: self.next_bucket_seq(org),
            issued: g.amount_micro,
            moved_in: 0,
            remaining: g.amount_micro,
            held: 0,
            consumed: 0,
            expired: 0,
            moved_out: 0,
            is_expired: false,
            open_draws: 0,
            closed_at_ms: None,
        });
        self.totals.issued += g.amount_micro as u128;
        if let Some(b) = self.buckets.get(&g.bucket) {
            ctx.bucket_event(
                b.refs(),
                None,
                EventBody::Issued {
                    bucket: g.bucket,
                    amount_micro: g.amount_micro,
                },
            );
        }
        Ok(())
    }

    /// The expiry pass, run at the start of every entry: expires every bucket whose
    /// instant has come (up to `EXPIRATIONS_PER_ENTRY_MAX`; the rest next entry, and in
    /// the meantime the spend paths' own instant check keeps them unspendable).
    pub(crate) fn expire_due(&mut self, ctx: &mut Ctx) {
        for _ in 0..EXPIRATIONS_PER_ENTRY_MAX {
            let Some(&(at, id)) = self.expiry_queue.first() else {
                return;
            };
            if at > ctx.now {
                return;
            }
            self.expiry_queue.pop_first();
            let Some(bucket) = self.buckets.get_mut(&id) else {
                continue;
            };
            let amount = bucket.remaining;
            bucket.expired += amount;
            bucket.remaining = 0;
            bucket.is_expired = true;
            self.totals.expired += amount as u128;
            let r = bucket.refs();
            self.set_live(r, false);
            ctx.bucket_event(
                r,
                None,
                EventBody::BucketExpired {
                    bucket: id,
                    amount_micro: amount,
                },
            );
            self.close_if_done(ctx.now, id);
        }
    }

    /// Marks bucket `id` closed if it now is: nothing remaining, nothing held, and no
    /// open hold drawn on it (a reversal could still return credit to it). Closed is
    /// final — nothing can put credit into such a bucket again — so from now on it no
    /// longer counts against its account's bucket bound, and it is archived once it has
    /// been closed for `bucket_retention_ms` (until then it stays queryable).
    pub(crate) fn close_if_done(&mut self, now: u64, id: BucketId) {
        let Some(b) = self.buckets.get_mut(&id) else {
            return;
        };
        if b.closed_at_ms.is_some() || b.remaining != 0 || b.held != 0 || b.open_draws != 0 {
            return;
        }
        b.closed_at_ms = Some(now);
        let (org, owner) = (b.org, b.owner);
        self.closed_queue.push_back((now, id));
        if let Some(rec) = self.account_mut(org, owner) {
            rec.closed += 1;
        }
        // Before rule version 4 a closed bucket left its org's quota at once, so an org
        // that closed buckets as fast as it made them (transfers back and forth) filled
        // the shard's table for the retention window; from it, at its archiving.
        if self.rules.0 < CLOSED_BUCKETS_COUNTED_FROM {
            if let Some(rec) = self.orgs.get_mut(&org) {
                rec.buckets_in_use = rec.buckets_in_use.saturating_sub(1);
            }
        }
    }

    /// Rule version 4's activation: the buckets already closed and awaiting archive
    /// join their orgs' quota counters, which from now on count a bucket until it is
    /// archived (one pass over the closed buckets, once).
    pub(crate) fn count_closed_in_quota(&mut self) {
        let Books {
            closed_queue,
            buckets,
            orgs,
            ..
        } = self;
        for (_, id) in closed_queue.iter() {
            if let Some(rec) = buckets.get(id).and_then(|b| orgs.get_mut(&b.org)) {
                rec.buckets_in_use = rec.buckets_in_use.saturating_add(1);
            }
        }
    }

    /// Archives the buckets closed for at least `bucket_retention_ms` (a bounded number
    /// per entry): each leaves its account's list, the bucket table and the expiry
    /// queue; its figures join the account's and the shard's archived totals.
    pub(crate) fn archive_closed(&mut self, ctx: &mut Ctx) {
        let retention = self.config.bucket_retention_ms;
        // Each account's list is filtered once for all its buckets archived here (one
        // `retain` per bucket was quadratic in a long list: an org that closes buckets
        // as fast as it makes them lists up to its bucket quota in one account).
        let mut unlisted: BTreeMap<(OrgId, Account), BTreeSet<BucketId>> = BTreeMap::new();
        for _ in 0..PRUNE_PER_ENTRY_MAX {
            let Some(&(at, id)) = self.closed_queue.front() else {
                break;
            };
            if at.saturating_add(retention) > ctx.now {
                break;
            }
            self.closed_queue.pop_front();
            let Some(b) = self.buckets.remove(&id) else {
                continue;
            };
            if let Some(at) = b.expires_at_ms {
                self.expiry_queue.remove(&(at, id));
            }
            if let Some(rec) = self.account_mut(b.org, b.owner) {
                unlisted.entry((b.org, b.owner)).or_default().insert(id);
                rec.closed = rec.closed.saturating_sub(1);
                rec.archived.add(&b);
            }
            if self.rules.0 >= CLOSED_BUCKETS_COUNTED_FROM {
                if let Some(rec) = self.orgs.get_mut(&b.org) {
                    rec.buckets_in_use = rec.buckets_in_use.saturating_sub(1);
                }
            }
            self.archived.add(&b);
            if self.rules.0 >= GRANT_IDS_RETIRED_FROM && id.0 < crate::limits::INTERNAL_ID_BASE {
                // A grant's (client-chosen) id; transfer buckets take ids of their own.
                self.retired_grants.insert(id);
            }
            ctx.bucket_event(b.refs(), None, EventBody::BucketArchived { bucket: id });
        }
        for ((org, owner), ids) in unlisted {
            if let Some(rec) = self.account_mut(org, owner) {
                rec.buckets.retain(|x| !ids.contains(x));
            }
        }
    }

    /// Moves `amount` from `from`'s own buckets (spend order, spendable only) to `to`,
    /// as new buckets that keep each part's kind, expiry, priority and policy.
    pub(crate) fn transfer(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        quota: &Quota,
        from: Account,
        to: Account,
        amount: u64,
    ) -> Result<Vec<BucketId>, CommandError> {
        // Both accounts in the request's org (another org's accounts are unknown here);
        // distinct accounts and the amount: `crate::validate`.
        if !self.has_account(org, from) {
            return Err(unknown_account(from));
        }
        if !self.has_account(org, to) {
            return Err(unknown_account(to));
        }
        let plan = self.plan_from_live(ctx.now, org, &[from], amount, |_| true)?;
        // A part with the same terms as a transfer bucket `to` already has joins it, so
        // repeated transfers (a rebalancer, or a flood of tiny ones) do not fill the
        // account's bucket list.
        // A bucket joined keeps `issued + moved_in` within u64 (every counter of a
        // bucket is bounded by it), however often credit goes to and fro; a part that
        // would take it past starts a new bucket.
        let mut joined: Vec<(BucketId, u128)> = Vec::new();
        let joins: Vec<Option<BucketId>> = plan
            .iter()
            .map(|(src, part)| {
                let dst = self
                    .buckets
                    .get(src)
                    .and_then(|s| self.same_terms(org, to, s, ctx.now))?;
                let b = self.buckets.get(&dst)?;
                let before = joined.iter().find(|(id, _)| *id == dst).map_or(0, |j| j.1);
                let after =
                    u128::from(b.issued) + u128::from(b.moved_in) + before + u128::from(*part);
                if after > u128::from(u64::MAX) {
                    return None;
                }
                match joined.iter_mut().find(|(id, _)| *id == dst) {
                    Some(j) => j.1 += u128::from(*part),
                    None => joined.push((dst, u128::from(*part))),
                }
                Some(dst)
            })
            .collect();
        self.check_bucket_room(org, quota, to, joins.iter().filter(|j| j.is_none()).count())?;
        let mut created = Vec::with_capacity(plan.len());
        for ((src_id, part), join) in plan.into_iter().zip(joins) {
            let Some(src) = self.buckets.get_mut(&src_id) else {
                continue;
            };
            src.remaining -= part;
            src.moved_out += part;
            let src = src.clone();
            if src.remaining == 0 {
                self.set_live(src.refs(), false);
            }
            ctx.bucket_event(
                src.refs(),
                None,
                EventBody::TransferredOut {
                    bucket: src_id,
                    amount_micro: part,
                },
            );
            self.close_if_done(ctx.now, src_id);
            if let Some(dst) = join.and_then(|j| self.buckets.get_mut(&j)) {
                dst.moved_in += part;
                dst.remaining += part;
                let r = dst.refs();
                ctx.bucket_event(
                    r,
                    None,
                    EventBody::TransferredIn {
                        bucket: r.id,
                        amount_micro: part,
                    },
                );
                if !created.contains(&r.id) {
                    created.push(r.id);
                }
                continue;
            }
            let id = BucketId(self.next_internal_id);
            self.next_internal_id += 1;
            let dst = Bucket {
                id,
                owner: to,
                seq: self.next_bucket_seq(org),
                issued: 0,
                moved_in: part,
                remaining: part,
                held: 0,
                consumed: 0,
                expired: 0,
                moved_out: 0,
                open_draws: 0,
                closed_at_ms: None,
                ..src
            };
            ctx.bucket_event(
                dst.refs(),
                None,
                EventBody::TransferredIn {
                    bucket: id,
                    amount_micro: part,
                },
            );
            self.insert_bucket(dst);
            created.push(id);
        }
        self.totals.moved += amount as u128;
        Ok(created)
    }

    /// A live transfer bucket of `to` (one the ledger created) with the terms of `src`
    /// — kind, priority, expiry, policy, source — that credit moved from `src` may join.
    fn same_terms(&self, org: OrgId, to: Account, src: &Bucket, now: u64) -> Option<BucketId> {
        let rec = self.account(org, to)?;
        rec.live.iter().map(|(_, id)| *id).find(|id| {
            self.buckets.get(id).is_some_and(|b| {
                b.id.0 >= INTERNAL_ID_BASE
                    && b.spendable_at(now)
                    && b.kind == src.kind
                    && b.priority == src.priority
                    && b.expires_at_ms == src.expires_at_ms
                    && b.policy == src.policy
                    && b.source_ref == src.source_ref
            })
        })
    }

    /// Plans taking `amount` from the live buckets of `accounts` (merged in spend
    /// order), skipping unspendable ones and those `eligible` refuses. Read-only.
    pub(crate) fn plan_from_live(
        &self,
        now: u64,
        org: OrgId,
        accounts: &[Account],
        amount: u64,
        eligible: impl Fn(&Bucket) -> bool,
    ) -> Result<Vec<(BucketId, u64)>, CommandError> {
        let lists: Vec<&[(super::SpendKey, BucketId)]> = accounts
            .iter()
            .filter_map(|a| self.account(org, *a))
            .map(|r| r.live.as_slice())
            .collect();
        let mut pos = vec![0usize; lists.len()];
        let mut plan = Vec::new();
        let mut left = amount;
        let mut available: u64 = 0;
        loop {
            // Next bucket in spend order across the lists (keys are unique: seq).
            let next = (0..lists.len())
                .filter(|&i| pos[i] < lists[i].len())
                .min_by_key(|&i| lists[i][pos[i]]);
            let Some(i) = next else { break };
            let id = lists[i][pos[i]].1;
            pos[i] += 1;
            let Some(b) = self.buckets.get(&id) else {
                continue;
            };
            if !b.spendable_at(now) || b.remaining == 0 || !eligible(b) {
                continue;
            }
            available = available.saturating_add(b.remaining);
            if left > 0 {
                let take = b.remaining.min(left);
                plan.push((id, take));
                left -= take;
            }
            if left == 0 {
                return Ok(plan);
            }
        }
        Err(CommandError::InsufficientCredits {
            available,
            needed: amount,
        })
    }
}
