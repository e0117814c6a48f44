//! Tombstones: what is left of settled holds and finished jobs, kept for a retention
//! window so status queries answer and a reused id is refused.
//!
//! Each org keeps at most its quota of them (its own oldest leave first when it passes
//! it), and the shard at most a shard-wide cap (the oldest of all leave first), so one
//! tenant's churn never evicts another's history while the quotas fit the cap. Both
//! orders are kept as persistent ordered sets: O(log n) to add, expire or evict one,
//! O(1) to clone for a snapshot.

use crate::idmap::SharedSet;
use crate::ids::{Id, OrgId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstones<I: Id> {
    /// (sequence, instant, org, id), oldest first: expiry by time and the shard-wide
    /// cap. Sequence numbers follow insertion, and logical time never goes back, so
    /// sequence order is time order with ties in insertion order.
    by_time: SharedSet<(u64, u64, OrgId, I)>,
    /// (org, sequence, instant, id): each org's oldest first, for its quota.
    by_org: SharedSet<(OrgId, u64, u64, I)>,
    /// Tombstones per org.
    count: BTreeMap<OrgId, u32>,
    next_seq: u64,
}

impl<I: Id> Default for Tombstones<I> {
    fn default() -> Self {
        Tombstones {
            by_time: SharedSet::default(),
            by_org: SharedSet::default(),
            count: BTreeMap::new(),
            next_seq: 0,
        }
    }
}

impl<I: Id> Tombstones<I> {
    pub fn len(&self) -> usize {
        self.by_time.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_time.is_empty()
    }

    /// Tombstones `org` keeps.
    pub fn of_org(&self, org: OrgId) -> u32 {
        self.count.get(&org).copied().unwrap_or(0)
    }

    pub(crate) fn push(&mut self, at: u64, org: OrgId, id: I) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_time.insert((seq, at, org, id));
        self.by_org.insert((org, seq, at, id));
        *self.count.entry(org).or_default() += 1;
    }

    fn forget(&mut self, seq: u64, at: u64, org: OrgId, id: I) {
        self.by_time.remove(&(seq, at, org, id));
        self.by_org.remove(&(org, seq, at, id));
        if let Some(n) = self.count.get_mut(&org) {
            *n -= 1;
            if *n == 0 {
                self.count.remove(&org);
            }
        }
    }

    /// Takes `org`'s oldest tombstone if it keeps more than `max`.
    pub(crate) fn pop_over_quota(&mut self, org: OrgId, max: u32) -> Option<(OrgId, I)> {
        if self.of_org(org) <= max {
            return None;
        }
        let &(o, seq, at, id) = self.by_org.range((org, 0, 0, I::MIN)..).next()?;
        self.forget(seq, at, o, id);
        Some((o, id))
    }

    /// Takes the oldest tombstone if it is due (kept `retention_ms`) or the shard keeps
    /// more than `cap`.
    pub(crate) fn pop_due(
        &mut self,
        now: u64,
        retention_ms: u64,
        cap: usize,
    ) -> Option<(OrgId, I)> {
        let &(seq, at, org, id) = self.by_time.get_min()?;
        if at.saturating_add(retention_ms) > now && self.len() <= cap {
            return None;
        }
        self.forget(seq, at, org, id);
        Some((org, id))
    }
}
