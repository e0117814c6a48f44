//! The idempotency table: `(actor, request_id) → (fingerprint, outcome)`, written in the
//! same apply as the command's effect, kept for a retention window of logical time.

use crate::idmap::{SharedMap, SharedQueue};
use crate::ids::{Actor, RequestId};
use crate::limits::{IDEMPOTENCY_ENTRIES_MAX, IDEMPOTENCY_RESERVED_MAX, PRUNE_PER_ENTRY_MAX};
use crate::outcome::Outcome;
use serde::{Deserialize, Serialize};

pub type Fingerprint = [u8; 16];

/// The fingerprint of a command: the first 128 bits of its digest.
pub fn fingerprint(digest: &crate::audit::Hash32) -> Fingerprint {
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&digest[..16]);
    fp
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdemRecord {
    pub fingerprint: Fingerprint,
    pub at_ms: u64,
    pub outcome: Outcome,
}

pub(crate) enum Lookup {
    New,
    Replay(Outcome),
    Conflict,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyTable {
    pub retention_ms: u64,
    /// Persistent (O(1) clone): the table grows with every command in the retention
    /// window, and a snapshot clones the state under the apply lock.
    pub records: SharedMap<(Actor, RequestId), IdemRecord>,
    /// Keys in insertion order (= logical time order), for pruning.
    pub queue: SharedQueue<(u64, Actor, RequestId)>,
    /// Records per org (of its tenants' principals), against the org's quota.
    pub by_org: std::collections::BTreeMap<crate::ids::OrgId, u32>,
}

impl IdempotencyTable {
    pub fn new(retention_ms: u64) -> Self {
        IdempotencyTable {
            retention_ms,
            ..Default::default()
        }
    }

    pub(crate) fn lookup(&self, actor: Actor, id: RequestId, fp: &Fingerprint) -> Lookup {
        match self.records.get(&(actor, id)) {
            None => Lookup::New,
            Some(r) if &r.fingerprint == fp => Lookup::Replay(r.outcome.clone()),
            Some(_) => Lookup::Conflict,
        }
    }

    /// Whether a new record is refused: for a tenant (`tenant`), once only the reserved
    /// room is left; for the operator, agents and the system, at the table's bound.
    pub(crate) fn is_full(&self, tenant: bool) -> bool {
        full_at(self.records.len(), tenant)
    }

    /// Records held by `org`'s principals.
    pub fn of_org(&self, org: crate::ids::OrgId) -> u32 {
        self.by_org.get(&org).copied().unwrap_or(0)
    }

    pub(crate) fn insert(
        &mut self,
        actor: Actor,
        id: RequestId,
        fingerprint: Fingerprint,
        now: u64,
        outcome: Outcome,
    ) {
        self.records.insert(
            (actor, id),
            IdemRecord {
                fingerprint,
                at_ms: now,
                outcome,
            },
        );
        self.queue.push_back((now, actor, id));
        if let Some(org) = actor.org() {
            *self.by_org.entry(org).or_default() += 1;
        }
    }

    /// Drops records older than the retention window (bounded per entry).
    pub(crate) fn prune(&mut self, now: u64) {
        for _ in 0..PRUNE_PER_ENTRY_MAX {
            match self.queue.front() {
                Some(&(at, actor, id)) if at.saturating_add(self.retention_ms) <= now => {
                    self.queue.pop_front();
                    if self.records.remove(&(actor, id)).is_some() {
                        if let Some(org) = actor.org() {
                            if let Some(n) = self.by_org.get_mut(&org) {
                                *n -= 1;
                                if *n == 0 {
                                    self.by_org.remove(&org);
                                }
                            }
                        }
                    }
                }
                _ => return,
            }
        }
    }
}

/// Whether a table of `len` records takes no new record from a tenant (`tenant`) or from
/// anyone else.
fn full_at(len: usize, tenant: bool) -> bool {
    let bound = if tenant {
        IDEMPOTENCY_ENTRIES_MAX - IDEMPOTENCY_RESERVED_MAX
    } else {
        IDEMPOTENCY_ENTRIES_MAX
    };
    len >= bound
}

#[cfg(test)]
mod reserve_tests {
    use super::*;

    /// Tenants together stop at the reserve; the operator and agents go on to the bound.
    #[test]
    fn tenants_never_take_the_reserved_room() {
        let tenants_stop = IDEMPOTENCY_ENTRIES_MAX - IDEMPOTENCY_RESERVED_MAX;
        assert!(!full_at(tenants_stop - 1, true));
        assert!(full_at(tenants_stop, true));
        assert!(!full_at(tenants_stop, false));
        assert!(!full_at(IDEMPOTENCY_ENTRIES_MAX - 1, false));
        assert!(full_at(IDEMPOTENCY_ENTRIES_MAX, false));
        // Sixteen orgs at the default records quota fit below the tenants' bound.
        let quota = crate::command::Quota::default().records_max as usize;
        assert!(16 * quota <= tenants_stop, "{}", 16 * quota);
    }
}
