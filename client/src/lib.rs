//! `allot-client`: the library platform services embed to talk to an allot cluster,
//! and the home of `allotctl` (the CLI) and `allot-agent` (the GPU node agent).
//!
//! - Give it any endpoints of the cluster: it finds each shard's leader, follows
//!   NotLeader hints, retries retryable failures with exponential backoff and full
//!   jitter within a deadline, and caches leaders per shard.
//! - Every mutating call generates its request id once and sends the same bytes on
//!   every retry, so a retry after a timeout is answered with the first outcome and
//!   never charges twice.
//! - Tenant operations are routed to the org's home shard (the directory,
//!   [`allot_proto::shard_of_org`]); GPU-pool operations name the shard owning the pool.
//! - Errors are typed: [`Error::Rejected`] carries the state machine's
//!   [`CommandError`](allot_statemachine::CommandError).
//!
//! ```no_run
//! use allot_client::{parse_credits, Client};
//! use allot_statemachine::*;
//!
//! # async fn demo() -> allot_client::Result<()> {
//! let client = Client::builder()
//!     .endpoints(["127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"])
//!     .token("my-api-token")
//!     .timeout(std::time::Duration::from_secs(10))
//!     .retries(8)
//!     .build()?;
//! let org = OrgId(42);
//! client.create_org(org).await?;
//! client.create_project(org, ProjectId(420)).await?;
//! client
//!     .issue_grant(org, Grant {
//!         bucket: BucketId(4200),
//!         owner: Account::Org(org),
//!         kind: BucketKind::Paid,
//!         amount_micro: parse_credits("1000.50")?,
//!         expires_at_ms: None,
//!         priority: 100,
//!         policy: None,
//!         source_ref: Some("purchase-17".into()),
//!     })
//!     .await?;
//! let balance = client.balance(org, Account::Org(org), 7 * 86_400_000).await?;
//! assert_eq!(balance.paid_available_micro, 1_000_500_000);
//! # Ok(())
//! # }
//! ```

mod admin;
pub mod agent;
mod api;
mod error;
pub mod security;
mod transport;
mod units;

pub use admin::{read_stream, SavedBackup};
pub use api::{
    Assignment, AssignmentSet, AssignmentSetStream, AssignmentStream, AuditFilter, AuditPage,
};
pub use error::{Error, Result};
pub use transport::{retry_after_of, Client, ClientBuilder};
pub use units::{format_credits, parse_credits, parse_duration_ms, MICRO_PER_CREDIT};

pub use allot_proto as proto;
pub use allot_statemachine as statemachine;
