//! Identifiers. Ids are client-chosen u64s (as in TigerBeetle): a retry with the same id
//! cannot create a second object. GPU types are short validated names.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A numeric id type: its smallest value bounds range scans over tuples that end in it.
pub trait Id: Copy + Ord {
    const MIN: Self;
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub struct $name(pub u64);

        impl Id for $name {
            const MIN: $name = $name(0);
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(/// An organisation: the tenant, and the root of the budget tree.
    OrgId, "org:");
id_type!(/// A project inside an organisation.
    ProjectId, "project:");
id_type!(/// A user inside an organisation.
    UserId, "user:");
id_type!(/// A credit bucket (one grant, or the part of one moved by a transfer).
    BucketId, "bucket:");
id_type!(/// A hold: credits reserved for one job (or one explicit reservation).
    HoldId, "hold:");
id_type!(/// A transfer of credits between accounts of one organisation.
    TransferId, "transfer:");
id_type!(/// A job (client-chosen; submission is idempotent by it). Its hold has the same id.
    JobId, "job:");
id_type!(/// A GPU node (a machine with one or more GPUs of one type).
    NodeId, "node:");
id_type!(/// A principal holding an API token (admin, org or agent identity).
    PrincipalId, "principal:");

/// Org-scoped objects are keyed by their org and their client-chosen id: each org has
/// its own namespace of project, user, hold and job ids (and of the principals it
/// creates), so no id another org uses is ever visible, taken or in the way.
pub type ProjectKey = (OrgId, ProjectId);
pub type UserKey = (OrgId, UserId);
pub type HoldKey = (OrgId, HoldId);
pub type JobKey = (OrgId, JobId);

/// Client-generated request id: generated once per logical operation and reused on
/// every retry, so a retry is recognised and answered with the first outcome.
pub type RequestId = u128;

/// A priority class. Tiers 0 (free), 1 (paid) and 2 (enterprise) exist by default;
/// higher is more important.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Tier(pub u8);

impl Tier {
    pub const FREE: Tier = Tier(0);
    pub const PAID: Tier = Tier(1);
    pub const ENTERPRISE: Tier = Tier(2);
}

/// A GPU type name such as `A100` or `H100`: 1 to 16 characters of `[A-Z0-9_-]`.
/// The wire form is a plain string; [`GpuType::is_valid`] is checked in apply.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuType(pub String);

impl GpuType {
    pub fn new(name: &str) -> GpuType {
        GpuType(name.to_string())
    }

    pub fn is_valid(&self) -> bool {
        let s = self.0.as_bytes();
        !s.is_empty()
            && s.len() <= crate::limits::GPU_TYPE_LEN_MAX
            && s.iter()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
    }
}

impl fmt::Display for GpuType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A job submission's dedup key (e.g. a hash of a prompt and its parameters): 1 to
/// [`crate::limits::DEDUP_KEY_BYTES_MAX`] bytes, chosen by the client, scoped to the
/// submitting org (two orgs' equal keys never meet).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DedupKey(pub Vec<u8>);

impl DedupKey {
    pub fn is_valid(&self) -> bool {
        !self.0.is_empty() && self.0.len() <= crate::limits::DEDUP_KEY_BYTES_MAX
    }
}

/// Who owns a bucket and whose budget a spend counts against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Account {
    Org(OrgId),
    Project(ProjectId),
}

impl fmt::Display for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Account::Org(o) => o.fmt(f),
            Account::Project(p) => p.fmt(f),
        }
    }
}

/// Who issued a command. Recorded on every audit event; the idempotency table is keyed
/// by (actor, request id) so two tenants can never collide on a request id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Actor {
    /// A cluster operator.
    Admin(PrincipalId),
    /// A token scoped to one organisation.
    Tenant { org: OrgId, principal: PrincipalId },
    /// A GPU agent, scoped to one node.
    Agent(NodeId),
    /// The replicated state machine itself (ticks, expiry, leases).
    System,
    /// A token scoped to one project of one organisation.
    Project {
        org: OrgId,
        project: ProjectId,
        principal: PrincipalId,
    },
    /// Not yet resolved: the SHA-256 of the bearer token the request came with, set by
    /// the edge node. Apply resolves it to the token's principal (or refuses the request
    /// as `Unauthenticated`) before anything else, so the actor a command runs as
    /// always comes from the replicated token table, never from the client.
    Bearer(TokenDigest),
    /// A request without credentials; only `Bootstrap` accepts it.
    Anonymous,
    // -- appended (the encoding is positional) --
    /// A token scoped to one user of one project: its holds and jobs are that user's.
    User {
        org: OrgId,
        project: ProjectId,
        user: UserId,
        principal: PrincipalId,
    },
}

impl Actor {
    /// The organisation a tenant actor is confined to (`None`: admin, agent, system,
    /// or not yet resolved).
    pub fn org(&self) -> Option<OrgId> {
        match self {
            Actor::Tenant { org, .. } | Actor::Project { org, .. } | Actor::User { org, .. } => {
                Some(*org)
            }
            _ => None,
        }
    }
}

/// SHA-256 of an API token. Only digests are stored and replicated, never tokens.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TokenDigest(pub [u8; 32]);

impl TokenDigest {
    /// The digest of a presented token.
    pub fn of(token: &[u8]) -> TokenDigest {
        use sha2::{Digest, Sha256};
        TokenDigest(Sha256::digest(token).into())
    }
}

/// Logs and audit views show an 8-byte prefix: enough to tell tokens apart, and a
/// digest reveals nothing of a 256-bit token anyway.
impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
