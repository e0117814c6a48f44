//! Request builders shared by the integration tests, the benchmarks (replicated and
//! the ledger's memory figures) and the demo: the standard world on a shard, funding,
//! and a hold → capture → release cycle. Test data only, like [`crate::testkit`].

use crate::testkit::{tenant, world_commands, ADMIN, ORG, PROJECT, USER};
use crate::{Account, BucketId, BucketKind, Command, Grant, HoldId, HoldSpec, Request, Tier};

/// A request of the operator, in the org of the standard world its ids are in.
pub fn admin(request_id: u128, command: Command) -> Request {
    Request {
        actor: ADMIN,
        request_id,
        org: crate::testkit::fixture_org(&command),
        command,
    }
}

pub fn as_tenant(request_id: u128, command: Command) -> Request {
    Request {
        actor: tenant(ORG),
        request_id,
        org: None,
        command,
    }
}

/// What an operator gives the benchmark's tenant for a sustained run: an idempotency
/// records quota of the shard's whole table but its operator reserve (a day of its
/// traffic would pass the default), as an admin request with an id from stream 0.
pub fn sustained_quota() -> Request {
    use crate::limits::{IDEMPOTENCY_ENTRIES_MAX, IDEMPOTENCY_RESERVED_MAX};
    admin(
        rid(0, 1001),
        Command::SetQuota {
            org: ORG,
            quota: Some(crate::Quota {
                records_max: (IDEMPOTENCY_ENTRIES_MAX - IDEMPOTENCY_RESERVED_MAX) as u32,
                ..crate::Quota::default()
            }),
        },
    )
}

/// Request ids of a run: `(stream << 64) | n`, so workers never collide.
pub fn rid(stream: u64, n: u64) -> u128 {
    ((stream as u128) << 64) | n as u128
}

/// The standard world plus `credits_micro` of paid credit on the fixture project
/// (bucket id 1), as admin requests with ids from stream 0.
pub fn setup(credits_micro: u64) -> Vec<Request> {
    let mut out: Vec<Request> = world_commands()
        .into_iter()
        .enumerate()
        .map(|(i, c)| admin(rid(0, i as u64 + 1), c))
        .collect();
    out.push(admin(
        rid(0, 1000),
        Command::IssueGrant(grant(1, Account::Project(PROJECT), credits_micro)),
    ));
    out
}

/// Activates this build's newest rule version (`version::RULES_MAX`): what an operator
/// does once every node runs this release, and what the benchmarks measure.
pub fn activate_newest() -> Request {
    admin(
        rid(0, 999),
        Command::ActivateVersion {
            version: crate::version::RULES_MAX,
        },
    )
}

pub fn grant(bucket: u64, owner: Account, amount_micro: u64) -> Grant {
    Grant {
        bucket: BucketId(bucket),
        owner,
        kind: BucketKind::Paid,
        amount_micro,
        expires_at_ms: None,
        priority: 100,
        policy: None,
        source_ref: None,
    }
}

/// One tenant's ledger traffic: for hold `h` (ids from `first_hold`), the three
/// requests CreateHold(amount), Capture(amount/3), ReleaseHold, in that order.
pub struct HoldCycle {
    pub stream: u64,
    pub next: u64,
    pub amount_micro: u64,
}

impl HoldCycle {
    pub fn new(stream: u64, amount_micro: u64) -> HoldCycle {
        HoldCycle {
            stream,
            next: 0,
            amount_micro,
        }
    }

    /// The `step`-th request of the cycle (0: create, 1: capture, 2: release).
    pub fn request(&mut self) -> Request {
        let n = self.next;
        self.next += 1;
        let hold = HoldId((self.stream << 32) | (n / 3));
        let command = match n % 3 {
            0 => Command::CreateHold(HoldSpec {
                hold,
                project: PROJECT,
                user: USER,
                tier: Tier::PAID,
                gpu_types: vec![],
                amount_micro: self.amount_micro,
            }),
            1 => Command::Capture {
                hold,
                amount_micro: self.amount_micro / 3,
            },
            _ => Command::ReleaseHold { hold },
        };
        as_tenant(rid(self.stream, n + 1), command)
    }
}
