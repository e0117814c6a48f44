//! Holds: reservation in spend order with per-bucket draws, partial captures, capture
//! reversal, top-ups, and release to the exact source buckets.

use super::budget::{SpendPath, UsageMove};
use super::{Books, Bucket, Ctx, Draw, Hold, HoldTable, Ledger};
use crate::audit::EventBody;
use crate::command::{HoldSpec, Quota};
use crate::ids::{Account, BucketId, HoldId, OrgId};
use crate::limits::*;
use crate::outcome::{CommandError, DrawReport, Limit, QuotaKind, Settlement};
use crate::tombstones::Tombstones;

impl Hold {
    pub(crate) fn path(&self) -> SpendPath {
        SpendPath {
            org: self.org,
            project: self.project,
            user: self.user,
        }
    }

    pub fn is_open(&self) -> bool {
        self.settled.is_none()
    }
}

/// What a release did.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Released {
    pub refunded: u64,
    pub forfeited: u64,
}

/// One open hold borrowed together with the books and the hold table's counters, so
/// operations can change both without moving the hold out of its table.
pub(crate) struct HoldCtx<'a> {
    pub books: &'a mut Books,
    pub hold: &'a mut Hold,
    open: &'a mut usize,
    settled: &'a mut Tombstones<HoldId>,
}

impl HoldCtx<'_> {
    /// Marks the hold settled and queues its tombstone for pruning.
    pub(crate) fn close(&mut self, now: u64, settlement: Settlement) {
        self.hold.settled = Some((now, settlement));
        *self.open -= 1;
        if let Some(rec) = self.books.orgs.get_mut(&self.hold.org) {
            rec.holds_open = rec.holds_open.saturating_sub(1);
        }
        self.settled.push(now, self.hold.org, self.hold.id);
    }
}

impl Ledger {
    /// The open hold `id` of `org` with the books, or `UnknownHold` / `HoldSettled`.
    pub(crate) fn open_hold(
        &mut self,
        org: OrgId,
        id: HoldId,
    ) -> Result<HoldCtx<'_>, CommandError> {
        let Ledger { books, holds } = self;
        let HoldTable { map, open, settled } = holds;
        let hold = map.get_mut(&(org, id)).ok_or(CommandError::UnknownHold)?;
        if !hold.is_open() {
            return Err(CommandError::HoldSettled);
        }
        Ok(HoldCtx {
            books,
            hold,
            open,
            settled,
        })
    }

    pub(crate) fn create_hold(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        quota: &Quota,
        spec: &HoldSpec,
    ) -> Result<Vec<DrawReport>, CommandError> {
        // Amount and GPU types: `crate::validate` (commands) or the job's own checks.
        // The project and the user are the org's own (its namespace).
        if !self.projects.contains_key(&(org, spec.project)) {
            return Err(CommandError::UnknownProject);
        }
        if !self.users.contains_key(&(org, spec.user)) {
            return Err(CommandError::UnknownUser);
        }
        if self.holds.map.contains_key(&(org, spec.hold)) {
            return Err(CommandError::AlreadyExists);
        }
        let open_in_org = self.orgs.get(&org).map_or(0, |r| r.holds_open);
        if open_in_org >= quota.holds_open_max {
            return Err(CommandError::QuotaExceeded(QuotaKind::HoldsOpen));
        }
        if self.holds.open >= HOLDS_OPEN_MAX {
            return Err(CommandError::LimitReached(Limit::HoldsOpen));
        }
        let mut hold = Hold {
            id: spec.hold,
            org,
            project: spec.project,
            user: spec.user,
            tier: spec.tier,
            gpu_types: spec.gpu_types.clone(),
            draws: Vec::new(),
            held: 0,
            captured: 0,
            created_ms: ctx.now,
            meter: None,
            job: false,
            settled: None,
        };
        let drawn = self.books.draw(ctx, &mut hold, spec.amount_micro)?;
        self.holds.map.insert((org, spec.hold), hold);
        self.holds.open += 1;
        if let Some(rec) = self.books.orgs.get_mut(&org) {
            rec.holds_open += 1;
        }
        Ok(drawn)
    }

    /// The open hold `id`, if any (for callers that have already validated it).
    pub(crate) fn open_hold_ctx(&mut self, org: OrgId, id: HoldId) -> Option<HoldCtx<'_>> {
        self.open_hold(org, id).ok()
    }

    /// Marks a hold as owned by a scheduler job.
    pub(crate) fn mark_job_hold(&mut self, org: OrgId, id: HoldId) {
        if let Some(h) = self.holds.map.get_mut(&(org, id)) {
            h.job = true;
        }
    }

    /// Drops settled tombstones older than the retention window (bounded per entry), and
    /// the oldest ones early if the tombstone table is full.
    pub(crate) fn prune_settled(&mut self, now: u64) {
        let retention = self.books.config.settled_retention_ms;
        let t = &mut self.holds;
        for _ in 0..PRUNE_PER_ENTRY_MAX {
            let Some(key) = t.settled.pop_due(now, retention, HOLDS_SETTLED_MAX) else {
                return;
            };
            t.map.remove(&key);
        }
    }

    /// Drops `org`'s oldest settled tombstones while it keeps more than `max` (its
    /// quota): its churn shortens its own history, never another org's.
    pub(crate) fn trim_settled(&mut self, org: OrgId, max: u32) {
        let t = &mut self.holds;
        while let Some(key) = t.settled.pop_over_quota(org, max) {
            t.map.remove(&key);
        }
    }
}

impl Books {
    /// Reserves `amount` more for `hold` from its project's and org's buckets in spend
    /// order, after checking budgets. All or nothing.
    pub(crate) fn draw(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
        amount: u64,
    ) -> Result<Vec<DrawReport>, CommandError> {
        let accounts = [Account::Project(hold.project), Account::Org(hold.org)];
        let plan = self.plan_from_live(ctx.now, hold.org, &accounts, amount, |b| {
            b.pays_for(hold.tier, &hold.gpu_types)
        })?;
        let new_draws = plan
            .iter()
            .filter(|(b, _)| !hold.draws.iter().any(|d| d.bucket == *b))
            .count();
        if hold.draws.len() + new_draws > DRAWS_PER_HOLD_MAX {
            return Err(CommandError::LimitReached(Limit::DrawsPerHold));
        }
        hold.held
            .checked_add(amount)
            .ok_or(CommandError::Overflow)?;
        self.check_budgets(ctx, hold.path(), amount)?;
        let mut reports = Vec::with_capacity(plan.len());
        for (id, part) in plan {
            let Some(bucket) = self.buckets.get_mut(&id) else {
                continue;
            };
            bucket.remaining -= part;
            bucket.held += part;
            if !hold.draws.iter().any(|d| d.bucket == id) {
                bucket.open_draws += 1;
            }
            let (r, empty) = (bucket.refs(), bucket.remaining == 0);
            if empty {
                self.set_live(r, false);
            }
            match hold.draws.iter_mut().find(|d| d.bucket == id) {
                Some(d) => d.held += part,
                None => hold.draws.push(Draw {
                    bucket: id,
                    held: part,
                    captured: 0,
                }),
            }
            ctx.bucket_event(
                r,
                Some(hold.id),
                EventBody::HoldDrawn {
                    bucket: id,
                    amount_micro: part,
                },
            );
            reports.push(DrawReport {
                bucket: id,
                amount_micro: part,
            });
        }
        hold.held += amount;
        self.move_usage(ctx.now, hold.path(), UsageMove::Hold(amount));
        Ok(reports)
    }

    /// Captures `amount` (≤ held) from the hold's draws in order: held → consumed.
    pub(crate) fn capture(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
        amount: u64,
    ) -> Result<(), CommandError> {
        if amount > hold.held {
            return Err(CommandError::CaptureExceedsHold {
                requested: amount,
                held: hold.held,
            });
        }
        let mut left = amount;
        for d in hold.draws.iter_mut() {
            if left == 0 {
                break;
            }
            let take = d.held.min(left);
            if take == 0 {
                continue;
            }
            d.held -= take;
            d.captured += take;
            left -= take;
            move_in_bucket(
                ctx,
                &mut self.buckets,
                d.bucket,
                hold.id,
                take,
                Movement::Capture,
            );
        }
        hold.held -= amount;
        hold.captured += amount;
        self.totals.consumed += amount as u128;
        self.move_usage(ctx.now, hold.path(), UsageMove::Spend(amount));
        Ok(())
    }

    /// Reverses `amount` (≤ captured) of earlier captures, last draw first:
    /// consumed → held, credited to the budget period of `billed_day`, the day those
    /// captures were billed on. Used when work after the last checkpoint is not billable.
    pub(crate) fn uncapture(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
        amount: u64,
        billed_day: u32,
    ) {
        let amount = amount.min(hold.captured);
        let mut left = amount;
        for d in hold.draws.iter_mut().rev() {
            if left == 0 {
                break;
            }
            let take = d.captured.min(left);
            if take == 0 {
                continue;
            }
            d.captured -= take;
            d.held += take;
            left -= take;
            move_in_bucket(
                ctx,
                &mut self.buckets,
                d.bucket,
                hold.id,
                take,
                Movement::Uncapture,
            );
        }
        hold.held += amount;
        hold.captured -= amount;
        self.totals.consumed -= amount as u128;
        self.move_usage(ctx.now, hold.path(), UsageMove::Unspend(amount, billed_day));
    }

    /// Returns everything still held to the exact buckets it came from. A bucket that
    /// has expired (or reached its instant) meanwhile forfeits the refund at once.
    pub(crate) fn release(&mut self, ctx: &mut Ctx, hold: &mut Hold) -> Released {
        self.give_back(ctx, hold, u64::MAX, GiveBack::All)
    }

    /// Returns up to `amount` of what `hold` holds to the buckets it came from, newest
    /// draws first; the hold stays open with the rest.
    pub(crate) fn release_part(&mut self, ctx: &mut Ctx, hold: &mut Hold, amount: u64) -> Released {
        self.give_back(ctx, hold, amount, GiveBack::NewestFirst)
    }

    /// Forfeits what `hold` still holds from buckets that can no longer be spent (expired,
    /// or at their instant), then reserves as much again in spend order, all or nothing
    /// ([`Self::draw`]: budgets, `DrawsPerHold`). Returns the amount forfeited (0: the hold
    /// was left as it was). On an error the forfeit stands and the hold is that much
    /// smaller: the caller ends what the hold pays for. A scheduler job's hold, before its
    /// first placement, from rule version [`super::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM`].
    pub(crate) fn renew_expired_draws(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
    ) -> Result<u64, CommandError> {
        let now = ctx.now;
        let stale = hold.draws.iter().any(|d| {
            d.held > 0
                && self
                    .buckets
                    .get(&d.bucket)
                    .is_some_and(|b| !b.spendable_at(now))
        });
        if !stale {
            return Ok(0);
        }
        let gone = self.give_back(ctx, hold, u64::MAX, GiveBack::Unspendable);
        // Nothing was refunded: every draw given back was unspendable.
        debug_assert_eq!(gone.refunded, 0);
        if gone.forfeited > 0 {
            self.draw(ctx, hold, gone.forfeited)?;
        }
        Ok(gone.forfeited)
    }

    /// Returns up to `limit` held credit to its draws' buckets (a refund, or forfeited if
    /// the bucket is no longer spendable), from the draws `which` selects.
    fn give_back(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
        limit: u64,
        which: GiveBack,
    ) -> Released {
        let mut out = Released::default();
        let (mut left, mut taken) = (limit, 0u64);
        let order: Vec<usize> = match which {
            GiveBack::NewestFirst => (0..hold.draws.len()).rev().collect(),
            GiveBack::All => (0..hold.draws.len()).collect(),
            GiveBack::Unspendable => (0..hold.draws.len())
                .filter(|&i| {
                    let id = hold.draws[i].bucket;
                    self.buckets
                        .get(&id)
                        .is_some_and(|b| !b.spendable_at(ctx.now))
                })
                .collect(),
        };
        for i in order {
            if left == 0 {
                break;
            }
            let d = &mut hold.draws[i];
            let part = d.held.min(left);
            if part == 0 {
                continue;
            }
            d.held -= part;
            left -= part;
            taken += part;
            let Some(bucket) = self.buckets.get_mut(&d.bucket) else {
                continue;
            };
            bucket.held -= part;
            if bucket.spendable_at(ctx.now) {
                let was_empty = bucket.remaining == 0;
                bucket.remaining += part;
                out.refunded += part;
                let r = bucket.refs();
                if was_empty {
                    self.set_live(r, true);
                }
                ctx.bucket_event(
                    r,
                    Some(hold.id),
                    EventBody::Refunded {
                        bucket: d.bucket,
                        amount_micro: part,
                    },
                );
            } else {
                bucket.expired += part;
                out.forfeited += part;
                self.totals.expired += part as u128;
                ctx.bucket_event(
                    bucket.refs(),
                    Some(hold.id),
                    EventBody::RefundForfeited {
                        bucket: d.bucket,
                        amount_micro: part,
                    },
                );
            }
        }
        // The whole of it: the hold's own count (equal to its draws' by the invariants).
        let taken = if which == GiveBack::All && limit == u64::MAX {
            hold.held
        } else {
            taken
        };
        self.move_usage(ctx.now, hold.path(), UsageMove::Unhold(taken));
        hold.held = hold.held.saturating_sub(taken);
        out
    }
}

/// Which of a hold's draws [`Books::give_back`] takes from, and in what order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GiveBack {
    /// Every draw, in draw order.
    All,
    /// Every draw, newest first.
    NewestFirst,
    /// The draws whose bucket can no longer be spent, in draw order.
    Unspendable,
}

#[derive(Clone, Copy)]
enum Movement {
    Capture,
    Uncapture,
}

fn move_in_bucket(
    ctx: &mut Ctx,
    buckets: &mut crate::idmap::IdMap<BucketId, Bucket>,
    id: BucketId,
    hold: HoldId,
    amount: u64,
    mv: Movement,
) {
    let Some(b) = buckets.get_mut(&id) else {
        return;
    };
    let body = match mv {
        Movement::Capture => {
            b.held -= amount;
            b.consumed += amount;
            EventBody::Captured {
                bucket: id,
                amount_micro: amount,
            }
        }
        Movement::Uncapture => {
            b.consumed -= amount;
            b.held += amount;
            EventBody::CaptureReversed {
                bucket: id,
                amount_micro: amount,
            }
        }
    };
    ctx.bucket_event(b.refs(), Some(hold), body);
}
