//! `check_invariants`: the ledger's conservation laws and cross-checks between
//! independently maintained figures. Cheap enough to run after every entry in tests and
//! in the simulator; the node runs it on snapshot.

use crate::ids::{Account, BucketId, HoldId, OrgId, ProjectId, UserId};
use crate::State;
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("{0}: issued + moved_in != remaining + held + consumed + expired + moved_out")]
    BucketUnbalanced(BucketId),
    #[error("{0}: expired bucket still has remaining credit")]
    ExpiredWithRemaining(BucketId),
    #[error("{0}: held {1} but open holds draw {2} from it")]
    BucketHeldMismatch(BucketId, u64, u64),
    #[error("{0}: live spend index disagrees with the bucket")]
    LiveIndexMismatch(BucketId),
    #[error("{0}: bucket with an expiry is missing from the expiry queue")]
    NotInExpiryQueue(BucketId),
    #[error("{0}: draws do not sum to the hold's held/captured amounts")]
    HoldDrawsMismatch(HoldId),
    #[error("{0}: settled hold still holds credit")]
    SettledHoldHolds(HoldId),
    #[error("open-hold count {counted} != {recorded}")]
    OpenHoldCount { counted: usize, recorded: usize },
    #[error("shard totals disagree with the buckets: {0}")]
    ShardTotals(&'static str),
    #[error("scheduler: {0}")]
    Scheduler(String),
    #[error("{0}: budget usage held {1} != open holds {2}")]
    UsageHeldMismatch(String, u64, u64),
    #[error("{0}: a retired grant id {1}")]
    RetiredGrant(BucketId, &'static str),
}

pub fn check_invariants(state: &State) -> Result<(), Violation> {
    check_buckets(state)?;
    check_holds(state)?;
    check_totals(state)?;
    check_usage(state)?;
    crate::scheduler::check(state).map_err(Violation::Scheduler)
}

fn check_buckets(state: &State) -> Result<(), Violation> {
    let l = &state.ledger;
    let mut drawn: BTreeMap<BucketId, u64> = BTreeMap::new();
    for (_, h) in l.holds.sorted().into_iter().filter(|(_, h)| h.is_open()) {
        for d in &h.draws {
            *drawn.entry(d.bucket).or_default() += d.held;
        }
    }
    // Retired grant ids (rule version 5 on): grants' ids, none of a live bucket.
    let retiring = state.rules.active >= crate::ledger::GRANT_IDS_RETIRED_FROM;
    for &id in &l.retired_grants {
        if !retiring {
            return Err(Violation::RetiredGrant(
                id,
                "recorded before rule version 5",
            ));
        }
        if id.0 >= crate::limits::INTERNAL_ID_BASE {
            return Err(Violation::RetiredGrant(id, "in the ledger's own id range"));
        }
        if l.buckets.get(&id).is_some() {
            return Err(Violation::RetiredGrant(id, "still names a bucket"));
        }
    }
    for (_, b) in l.buckets.sorted() {
        if !b.is_balanced() {
            return Err(Violation::BucketUnbalanced(b.id));
        }
        if b.is_expired && b.remaining != 0 {
            return Err(Violation::ExpiredWithRemaining(b.id));
        }
        let d = drawn.get(&b.id).copied().unwrap_or(0);
        if d != b.held {
            return Err(Violation::BucketHeldMismatch(b.id, b.held, d));
        }
        let live = l
            .account(b.org, b.owner)
            .is_some_and(|r| r.live.binary_search(&(b.spend_key(), b.id)).is_ok());
        if live != (b.remaining > 0 && !b.is_expired) {
            return Err(Violation::LiveIndexMismatch(b.id));
        }
        if let Some(at) = b.expires_at_ms {
            if !b.is_expired && !l.expiry_queue.contains(&(at, b.id)) {
                return Err(Violation::NotInExpiryQueue(b.id));
            }
        }
    }
    Ok(())
}

fn check_holds(state: &State) -> Result<(), Violation> {
    let l = &state.ledger;
    let mut open = 0;
    for (_, h) in l.holds.sorted() {
        let held: u64 = h.draws.iter().map(|d| d.held).sum();
        let captured: u64 = h.draws.iter().map(|d| d.captured).sum();
        if held != h.held || captured != h.captured {
            return Err(Violation::HoldDrawsMismatch(h.id));
        }
        if h.is_open() {
            open += 1;
        } else if h.held != 0 {
            return Err(Violation::SettledHoldHolds(h.id));
        }
    }
    if open != l.holds.open {
        return Err(Violation::OpenHoldCount {
            counted: open,
            recorded: l.holds.open,
        });
    }
    Ok(())
}

fn check_totals(state: &State) -> Result<(), Violation> {
    let l = &state.ledger;
    // Archived buckets are gone from the table; their figures are in the archive.
    let a = &l.archived;
    let (mut issued, mut moved_in, mut moved_out, mut consumed, mut expired, mut rest) = (
        a.issued,
        a.moved_in,
        a.moved_out,
        a.consumed,
        a.expired,
        0u128,
    );
    for (_, b) in l.buckets.sorted() {
        issued += b.issued as u128;
        moved_in += b.moved_in as u128;
        moved_out += b.moved_out as u128;
        consumed += b.consumed as u128;
        expired += b.expired as u128;
        rest += b.remaining as u128 + b.held as u128;
    }
    let t = &l.totals;
    if issued != t.issued {
        return Err(Violation::ShardTotals("issued"));
    }
    if consumed != t.consumed {
        return Err(Violation::ShardTotals("consumed"));
    }
    if expired != t.expired {
        return Err(Violation::ShardTotals("expired"));
    }
    if moved_in != moved_out || moved_in != t.moved {
        return Err(Violation::ShardTotals("moved in/out"));
    }
    // The shard's conservation: issued = available + held + consumed + expired.
    if issued != rest + consumed + expired {
        return Err(Violation::ShardTotals("conservation"));
    }
    Ok(())
}

fn check_usage(state: &State) -> Result<(), Violation> {
    let l = &state.ledger;
    let mut orgs: BTreeMap<OrgId, u64> = BTreeMap::new();
    let mut projects: BTreeMap<(OrgId, ProjectId), u64> = BTreeMap::new();
    let mut users: BTreeMap<(OrgId, UserId), u64> = BTreeMap::new();
    for (_, h) in l.holds.sorted().into_iter().filter(|(_, h)| h.is_open()) {
        *orgs.entry(h.org).or_default() += h.held;
        *projects.entry((h.org, h.project)).or_default() += h.held;
        *users.entry((h.org, h.user)).or_default() += h.held;
    }
    // Each org's namespace index lists exactly its projects and users.
    let indexed = |o: &OrgId| l.orgs.get(o);
    if l.projects
        .keys()
        .any(|(o, p)| !indexed(o).is_some_and(|r| r.projects.contains(p)))
        || l.users
            .keys()
            .any(|(o, u)| !indexed(o).is_some_and(|r| r.users.contains(u)))
        || l.orgs.values().map(|r| r.projects.len()).sum::<usize>() != l.projects.len()
        || l.orgs.values().map(|r| r.users.len()).sum::<usize>() != l.users.len()
    {
        return Err(Violation::Scheduler(
            "an org's project or user index disagrees with the tables".into(),
        ));
    }
    let mismatch = |what: String, recorded: u64, counted: u64| {
        (recorded != counted).then_some(Violation::UsageHeldMismatch(what, recorded, counted))
    };
    for (id, r) in l.orgs.sorted() {
        if let Some(v) = mismatch(
            Account::Org(*id).to_string(),
            r.account.usage.held,
            orgs.get(id).copied().unwrap_or(0),
        ) {
            return Err(v);
        }
    }
    for (id, r) in l.projects.sorted() {
        if let Some(v) = mismatch(
            format!("{}/{}", id.0, id.1),
            r.account.usage.held,
            projects.get(id).copied().unwrap_or(0),
        ) {
            return Err(v);
        }
    }
    for (id, r) in l.users.sorted() {
        if let Some(v) = mismatch(
            format!("{}/{}", id.0, id.1),
            r.usage.held,
            users.get(id).copied().unwrap_or(0),
        ) {
            return Err(v);
        }
    }
    Ok(())
}
