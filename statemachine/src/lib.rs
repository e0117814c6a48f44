//! `allot-statemachine`: the pure, deterministic core of allot.
//!
//! A shard is a Raft group; its state machine is [`apply`]: `(State, Entry) → (State',
//! outcomes, audit events)`. No clock, no randomness, no IO, no unordered iteration, no
//! floating point in money: every replica that applies the same log reaches the same
//! [`State::state_hash`].
//!
//! ```
//! use allot_statemachine::*;
//! let mut state = State::default();
//! let admin = Actor::Admin(PrincipalId(1));
//! let req = |id, command| Request { actor: admin, request_id: id, org: None, command };
//! let entry = Entry {
//!     log_index: 1,
//!     logical_time_ms: 1_000,
//!     requests: vec![
//!         req(1, Command::CreateOrg { org: OrgId(1) }),
//!         req(2, Command::IssueGrant(Grant {
//!             bucket: BucketId(10),
//!             owner: Account::Org(OrgId(1)),
//!             kind: BucketKind::Paid,
//!             amount_micro: 5_000_000,
//!             expires_at_ms: None,
//!             priority: 0,
//!             policy: None,
//!             source_ref: Some("purchase-42".into()),
//!         })),
//!     ],
//! };
//! let out = apply(&mut state, &entry).unwrap();
//! assert!(out.outcomes.iter().all(|o| o.is_ok()));
//! let balance = state.ledger.balance(OrgId(1), Account::Org(OrgId(1)), 1_000, 0).unwrap();
//! assert_eq!(balance.paid_available_micro, 5_000_000);
//! assert!(check_invariants(&state).is_ok());
//! ```

pub mod alerts;
pub mod audit;
mod authz;
pub mod backup;
pub mod calendar;
pub mod codec;
pub mod command;
pub mod idempotency;
pub mod idmap;
pub mod ids;
pub mod invariants;
pub mod ledger;
pub mod limits;
pub mod outcome;
pub mod query;
pub mod redact;
pub mod scheduler;
pub mod security;
pub mod state;
pub mod testkit;
pub mod tombstones;
pub mod units;
pub mod validate;
pub mod version;
pub mod workload;

pub use audit::{verify_chain, AuditChain, AuditEvent, EventBody};
pub use command::*;
pub use idempotency::IdempotencyTable;
pub use ids::*;
pub use invariants::{check_invariants, Violation};
pub use outcome::*;
pub use state::{apply, apply_into, ApplyError, ApplyOutput, Config, State};
