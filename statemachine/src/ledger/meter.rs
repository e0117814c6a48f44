//! Metering: usage is billed from *logical* time between accepted heartbeats of the
//! current attempt, never from client timestamps. The price is fixed on the meter when
//! the attempt starts (the price of the GPU type actually placed on).

use super::holds::HoldCtx;
use super::{Books, Ctx, Hold, Ledger};
use crate::command::{Heartbeat, SettleReason};
use crate::ids::{GpuType, HoldId, OrgId, Tier};
use crate::outcome::{CommandError, HeartbeatReply, Settlement};
use serde::{Deserialize, Serialize};

const MS_PER_HOUR: u128 = 3_600_000;

/// The cost of `ms` of run time on `gpus` GPUs at `price` micro-credits per GPU-hour,
/// rounded down. Billing always recomputes from the attempt's total billed time, so
/// rounding never accumulates across heartbeats.
pub fn cost_micro(ms: u64, price_micro_per_gpu_hour: u64, gpus: u32) -> u64 {
    let c = ms as u128 * price_micro_per_gpu_hour as u128 * gpus as u128 / MS_PER_HOUR;
    c.min(u64::MAX as u128) as u64
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meter {
    /// The fencing token of the attempt being metered.
    pub attempt: u32,
    pub gpu_type: GpuType,
    pub gpus: u32,
    pub price_micro_per_gpu_hour: u64,
    pub price_version: u32,
    pub started_ms: u64,
    pub last_seq: u64,
    pub last_heartbeat_ms: u64,
    pub progress_ppm: u32,
    /// Last checkpoint number reported, and the logical time of the heartbeat that first
    /// reported it (the earliest instant the ledger knew the checkpoint was durable).
    pub checkpoint: u64,
    pub checkpoint_ms: Option<u64>,
    /// Captured for this attempt, net of reversals.
    pub captured_attempt: u64,
    /// The attempt's captures by the day they were billed on (day index, amount), net of
    /// reversals, oldest first: a reversal is credited to the budget period it was
    /// billed in. At most `BILLED_DAYS_MAX` entries (the oldest merge).
    pub billed_days: Vec<(u32, u64)>,
    /// The attempt has been billed to its end (settled or requeued).
    pub closed: bool,
}

/// Days of captures a meter remembers separately (a job runs at most 30 days).
pub const BILLED_DAYS_MAX: usize = 64;

impl Meter {
    fn record_billed(&mut self, day: u32, amount: u64) {
        if amount == 0 {
            return;
        }
        match self.billed_days.last_mut() {
            Some((d, a)) if *d == day => *a += amount,
            _ => self.billed_days.push((day, amount)),
        }
        if self.billed_days.len() > BILLED_DAYS_MAX {
            // Merge the two oldest into the newer day: a reversal reaches back only to
            // the last checkpoint, never this far.
            let (_, oldest) = self.billed_days.remove(0);
            self.billed_days[0].1 += oldest;
        }
    }

    /// How much run time of this attempt a given ending bills.
    pub fn billable_ms(&self, reason: SettleReason, now: u64) -> u64 {
        let end = if reason.bills_to_checkpoint() {
            self.checkpoint_ms.unwrap_or(self.started_ms)
        } else if reason.bills_to_last_heartbeat() {
            self.last_heartbeat_ms
        } else {
            now
        };
        end.saturating_sub(self.started_ms)
    }

    fn cost(&self, ms: u64) -> u64 {
        cost_micro(ms, self.price_micro_per_gpu_hour, self.gpus)
    }
}

/// The price per GPU-hour of a tier priced at `pct` percent of `list`, rounded down
/// (exact: list prices are at most 10^12 and percentages at most 10^4).
pub fn tier_price(list: u64, pct: u32) -> u64 {
    (list as u128 * pct as u128 / 100).min(u64::MAX as u128) as u64
}

/// What a meter starts with: the attempt (fencing token) and what it runs on.
pub(crate) struct MeterStart<'a> {
    pub attempt: u32,
    pub gpu_type: &'a GpuType,
    pub gpus: u32,
}

impl Ledger {
    /// Starts metering hold `hold_id` at `now`, at the tier's price of the type
    /// (`tier_price_pct` gives each tier's percentage of list price).
    pub(crate) fn start_meter(
        &mut self,
        org: OrgId,
        hold_id: HoldId,
        start: MeterStart,
        now: u64,
        tier_price_pct: impl Fn(Tier) -> u32,
    ) -> Result<(u64, u32), CommandError> {
        let MeterStart {
            attempt,
            gpu_type,
            gpus,
        } = start;
        // The type's name and the GPU count: `crate::validate` (or the placement).
        let hc = self.open_hold(org, hold_id)?;
        let list = hc
            .books
            .price_of(gpu_type)
            .ok_or(CommandError::UnknownPrice(gpu_type.clone()))?;
        let price = tier_price(list, tier_price_pct(hc.hold.tier));
        if !hc.hold.gpu_types.is_empty() && !hc.hold.gpu_types.contains(gpu_type) {
            return Err(CommandError::InvalidGpuType(gpu_type.clone()));
        }
        if let Some(m) = &hc.hold.meter {
            if attempt <= m.attempt || !m.closed {
                return Err(CommandError::StaleAttempt {
                    given: attempt,
                    current: m.attempt,
                });
            }
        }
        let version = hc.books.prices.version;
        hc.hold.meter = Some(Meter {
            attempt,
            gpu_type: gpu_type.clone(),
            gpus,
            price_micro_per_gpu_hour: price,
            price_version: version,
            started_ms: now,
            last_seq: 0,
            last_heartbeat_ms: now,
            progress_ppm: 0,
            checkpoint: 0,
            checkpoint_ms: None,
            captured_attempt: 0,
            billed_days: Vec::new(),
            closed: false,
        });
        Ok((price, version))
    }

    /// A scheduler job's meter that has had no heartbeat yet (its runner has not
    /// started) counts from `now` instead of its placement — from rule version
    /// [`super::METER_FROM_FIRST_HEARTBEAT_FROM`]; before it, nothing changes. Called at
    /// the attempt's first heartbeat and when an attempt that never started ends.
    pub(crate) fn meter_from_now_if_unstarted(&mut self, org: OrgId, hold_id: HoldId, now: u64) {
        if self.books.rules.0 < super::METER_FROM_FIRST_HEARTBEAT_FROM {
            return;
        }
        let Ok(hc) = self.open_hold(org, hold_id) else {
            return;
        };
        if let Some(m) = hc
            .hold
            .meter
            .as_mut()
            .filter(|m| !m.closed && m.last_seq == 0)
        {
            m.started_ms = m.started_ms.max(now);
            m.last_heartbeat_ms = m.started_ms;
        }
    }

    pub(crate) fn heartbeat(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        hb: &Heartbeat,
    ) -> Result<HeartbeatReply, CommandError> {
        if let Some(retry) = self.retried_after_settlement(org, hb) {
            return Ok(retry);
        }
        let mut hc = self.open_hold(org, hb.hold)?;
        let meter = current_meter(hc.hold, hb.attempt)?;
        if hb.seq <= meter.last_seq {
            return Ok(HeartbeatReply {
                accepted: false,
                captured_delta_micro: 0,
                captured_attempt_micro: meter.captured_attempt,
                held_micro: hc.hold.held,
                stop: None,
            });
        }
        meter.last_seq = hb.seq;
        meter.last_heartbeat_ms = ctx.now;
        meter.progress_ppm = hb.progress_ppm;
        if hb.checkpoint > meter.checkpoint {
            meter.checkpoint = hb.checkpoint;
            meter.checkpoint_ms = Some(ctx.now);
        }
        let billed_ms = ctx.now.saturating_sub(meter.started_ms);
        let before = meter.captured_attempt;
        let (uncollected, _) = hc.books.bill_to(ctx, hc.hold, billed_ms);
        let stop =
            (uncollected > 0).then(|| hc.finish(ctx, SettleReason::OutOfCredits, uncollected));
        let captured_attempt = hc.hold.meter.as_ref().map_or(0, |m| m.captured_attempt);
        Ok(HeartbeatReply {
            accepted: true,
            captured_delta_micro: captured_attempt - before,
            captured_attempt_micro: captured_attempt,
            held_micro: hc.hold.held,
            stop,
        })
    }

    /// The answer to a heartbeat the meter has already seen (`attempt` and a `seq` no
    /// later than its last) on a hold settled since, from rule version
    /// [`super::RETRIED_HEARTBEATS_SEE_THEIR_SETTLEMENT_FROM`]: a duplicate, nothing
    /// changed, with the settlement that tells the agent to stop. `None` for every
    /// other heartbeat, which goes through the open hold as before.
    fn retried_after_settlement(&self, org: OrgId, hb: &Heartbeat) -> Option<HeartbeatReply> {
        if self.rules.0 < super::RETRIED_HEARTBEATS_SEE_THEIR_SETTLEMENT_FROM {
            return None;
        }
        let h = self.hold(org, hb.hold)?;
        let (_, settlement) = h.settled.as_ref()?;
        let m = h
            .meter
            .as_ref()
            .filter(|m| m.attempt == hb.attempt && hb.seq <= m.last_seq)?;
        Some(HeartbeatReply {
            accepted: false,
            captured_delta_micro: 0,
            captured_attempt_micro: m.captured_attempt,
            held_micro: h.held,
            stop: Some(*settlement),
        })
    }

    /// Settles a hold: bills the current attempt as `reason` says, returns the unused
    /// hold to its buckets, and closes it.
    pub(crate) fn settle(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        hold_id: HoldId,
        attempt: u32,
        reason: SettleReason,
    ) -> Result<Settlement, CommandError> {
        self.settle_until(ctx, org, hold_id, attempt, reason, None)
    }

    /// [`Ledger::settle`], an ending that bills to now billing no later than
    /// `bill_until` (the end of a lapsed node's lease: its runner is stopped by then).
    pub(crate) fn settle_until(
        &mut self,
        ctx: &mut Ctx,
        org: OrgId,
        hold_id: HoldId,
        attempt: u32,
        reason: SettleReason,
        bill_until: Option<u64>,
    ) -> Result<Settlement, CommandError> {
        let mut hc = self.open_hold(org, hold_id)?;
        let (uncollected, _) = hc
            .books
            .end_attempt(ctx, hc.hold, attempt, reason, bill_until)?;
        Ok(hc.finish(ctx, reason, uncollected))
    }
}

impl HoldCtx<'_> {
    /// Releases what is left and closes the hold.
    pub(crate) fn finish(
        &mut self,
        ctx: &mut Ctx,
        reason: SettleReason,
        uncollected: u64,
    ) -> Settlement {
        if let Some(m) = self.hold.meter.as_mut() {
            m.closed = true;
        }
        let released = self.books.release(ctx, self.hold);
        let settlement = Settlement {
            reason,
            captured_micro: self.hold.captured,
            refunded_micro: released.refunded,
            forfeited_micro: released.forfeited,
            uncollected_micro: uncollected,
        };
        self.close(ctx.now, settlement);
        // The hold no longer draws on its buckets: those now closed are archived.
        for d in &self.hold.draws {
            if let Some(b) = self.books.buckets.get_mut(&d.bucket) {
                b.open_draws = b.open_draws.saturating_sub(1);
            }
            self.books.close_if_done(ctx.now, d.bucket);
        }
        settlement
    }
}

impl Books {
    /// Bills the open attempt (if any) to its end as `reason` says and closes its meter;
    /// the hold stays open (a requeued job keeps its reservation). Returns what could not
    /// be collected.
    pub(crate) fn end_attempt(
        &mut self,
        ctx: &mut Ctx,
        hold: &mut Hold,
        attempt: u32,
        reason: SettleReason,
        bill_until: Option<u64>,
    ) -> Result<(u64, u64), CommandError> {
        let Some(meter) = hold.meter.as_mut().filter(|m| !m.closed) else {
            return Ok((0, 0));
        };
        if meter.attempt != attempt {
            return Err(CommandError::StaleAttempt {
                given: attempt,
                current: meter.attempt,
            });
        }
        let billed_ms = meter.billable_ms(reason, bill_until.map_or(ctx.now, |u| u.min(ctx.now)));
        let billed = self.bill_to(ctx, hold, billed_ms);
        if let Some(m) = hold.meter.as_mut() {
            m.closed = true;
        }
        Ok(billed)
    }

    /// Brings the attempt's captures to exactly the cost of `billed_ms`: captures more
    /// (topping the hold up when it runs low) or reverses captures already made. Returns
    /// the part of the cost the account could not pay, and the part of a reversal that
    /// had been billed on an earlier day than today.
    fn bill_to(&mut self, ctx: &mut Ctx, hold: &mut Hold, billed_ms: u64) -> (u64, u64) {
        let Some(meter) = hold.meter.as_ref() else {
            return (0, 0);
        };
        let today = crate::calendar::day_index(ctx.now);
        let mut before_today = 0u64;
        let target = meter.cost(billed_ms);
        let captured = meter.captured_attempt;
        let topup_chunk = meter.cost(self.config.hold_topup_ms);
        if target < captured {
            // Newest captures first, each credited to the day it was billed on.
            let mut left = captured - target;
            let mut days = hold
                .meter
                .as_mut()
                .map(|m| std::mem::take(&mut m.billed_days))
                .unwrap_or_default();
            while left > 0 {
                let Some((day, amount)) = days.last_mut() else {
                    break;
                };
                let part = left.min(*amount);
                if *day != today {
                    before_today += part;
                }
                self.uncapture(ctx, hold, part, *day);
                *amount -= part;
                left -= part;
                if *amount == 0 {
                    days.pop();
                }
            }
            if left > 0 {
                self.uncapture(ctx, hold, left, today);
            }
            if let Some(m) = hold.meter.as_mut() {
                m.billed_days = days;
            }
        } else if target > captured {
            let need = target - captured;
            if need > hold.held {
                let short = need - hold.held;
                // Shortfall plus a chunk of run time; failing that, the shortfall alone;
                // failing that, whatever the account still has.
                if self
                    .draw(ctx, hold, short.saturating_add(topup_chunk))
                    .is_err()
                {
                    if let Err(CommandError::InsufficientCredits { available, .. }) =
                        self.draw(ctx, hold, short)
                    {
                        if available > 0 {
                            let _ = self.draw(ctx, hold, available);
                        }
                    }
                }
            }
            let take = need.min(hold.held);
            // `take <= hold.held`, so the capture cannot fail.
            let _ = self.capture(ctx, hold, take);
            if let Some(m) = hold.meter.as_mut() {
                m.captured_attempt = captured + take;
                m.record_billed(today, take);
            }
            return (need - take, 0);
        }
        if let Some(m) = hold.meter.as_mut() {
            m.captured_attempt = target;
        }
        (0, before_today)
    }
}

/// The hold's open meter, if `attempt` is its current attempt.
fn current_meter(hold: &mut Hold, attempt: u32) -> Result<&mut Meter, CommandError> {
    let meter = hold
        .meter
        .as_mut()
        .filter(|m| !m.closed)
        .ok_or(CommandError::HoldNotMetered)?;
    if meter.attempt != attempt {
        return Err(CommandError::StaleAttempt {
            given: attempt,
            current: meter.attempt,
        });
    }
    Ok(meter)
}
