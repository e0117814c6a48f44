//! Authentication at the node's edge. The edge only *carries* credentials: it puts the
//! SHA-256 of the presented bearer token on every request (overwriting whatever actor
//! the client claimed), and apply resolves it against the replicated token table on
//! the leader (`allot_statemachine::security`). Queries, audit reads and admin calls
//! are answered by this node, so they resolve the digest against this replica's
//! applied state (after the read index for linearizable reads).
//!
//! Without a bearer token a request keeps its claimed actor only when this node runs
//! with `--insecure-dev-mode` *and* the shard is not secured (no admin token was ever
//! bootstrapped); `Bootstrap` alone is accepted anonymously (it succeeds only on an
//! unsecured shard). Clients can never claim `System` or a token digest.

use crate::node::Node;
use allot_statemachine::security::Refusal;
use allot_statemachine::{Actor, Command, Denial, DenialReason, PrincipalId, Request, TokenDigest};
use tonic::metadata::MetadataMap;
use tonic::Status;

/// Longest accepted token (generated tokens are 47 characters).
pub const TOKEN_LEN_MAX: usize = 512;
/// Shortest accepted token: 128 bits in base64 is 22 characters; operator-chosen
/// secrets shorter than 32 characters are refused when created (allotctl), and a
/// shorter bearer cannot match any digest in practice, but is refused here as malformed.
pub const TOKEN_LEN_MIN: usize = 22;

/// The digest of the `authorization: Bearer <token>` metadata, if any. A malformed
/// header is refused (not ignored: a client that meant to authenticate must not fall
/// back to dev mode).
pub fn bearer(meta: &MetadataMap) -> Result<Option<TokenDigest>, Status> {
    let Some(v) = meta.get("authorization") else {
        return Ok(None);
    };
    let malformed = || {
        crate::edge::with_reason(
            Status::unauthenticated("malformed authorization metadata"),
            "UNAUTHENTICATED",
        )
    };
    let v = v.to_str().map_err(|_| malformed())?;
    let token = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .ok_or_else(malformed)?
        .trim();
    if token.len() < TOKEN_LEN_MIN
        || token.len() > TOKEN_LEN_MAX
        || !token.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(malformed());
    }
    Ok(Some(TokenDigest::of(token.as_bytes())))
}

/// The actor a read (query, audit, admin call) runs as before resolution.
pub fn caller(node: &Node, bearer: Option<TokenDigest>) -> Actor {
    match bearer {
        Some(d) => Actor::Bearer(d),
        // Dev mode: an unauthenticated reader is the operator (resolution refuses the
        // claim once the shard is secured).
        None if node.config.insecure_dev_mode => Actor::Admin(PrincipalId(0)),
        None => Actor::Anonymous,
    }
}

/// Sets the actor a request for `shard` is proposed with (see the module doc). A
/// request refused here (no token outside dev mode, or a claim no client may make) is
/// recorded like every other edge denial.
pub fn stamp(
    node: &Node,
    shard: u32,
    bearer: Option<TokenDigest>,
    r: &mut Request,
) -> Result<(), Status> {
    if let Some(d) = bearer {
        r.actor = Actor::Bearer(d);
        return Ok(());
    }
    if let Command::Bootstrap { .. } = r.command {
        r.actor = Actor::Anonymous;
        return Ok(());
    }
    match r.actor {
        Actor::System | Actor::Bearer(_) | Actor::Anonymous => {}
        _ if node.config.insecure_dev_mode => return Ok(()),
        _ => {}
    }
    let api = format!("execute:{}", r.command.name());
    Err(refuse(
        node,
        shard,
        Actor::Anonymous,
        &api,
        DenialReason::Unauthenticated,
    ))
}

/// The status for a refused read; the reason is logged (never the token) and queued
/// for the audit trail.
pub fn refuse(node: &Node, shard: u32, caller: Actor, api: &str, reason: DenialReason) -> Status {
    // Counted always; logged at most once a second (a flood of refused calls must not
    // become a flood of log lines).
    if node.log_throttle.due() {
        tracing::warn!(
            shard,
            ?caller,
            api,
            ?reason,
            "authorisation denied (at most one line a second)"
        );
    }
    node.metrics
        .auth_denials
        .with_label_values(&[api, reason_label(reason)])
        .inc();
    // Queued for the audit trail of a shard this node hosts only (a call naming any
    // other is refused `UNKNOWN_SHARD`; each unknown id would be a buffer of its own).
    // Not while the disk is low, for the callers whose writes are refused then: their
    // denials would grow the log as much (counted and logged all the same).
    if node.shard(shard).is_some() && !node.disk.refuses(Some(caller), None) {
        node.denials.record(
            shard,
            Denial {
                actor: caller,
                api: api
                    .chars()
                    .take(allot_statemachine::limits::DENIAL_API_LEN_MAX)
                    .collect(),
                reason,
            },
        );
    }
    match reason {
        DenialReason::Unauthenticated => crate::edge::with_reason(
            Status::unauthenticated("unauthenticated"),
            "UNAUTHENTICATED",
        ),
        DenialReason::PermissionDenied => crate::edge::with_reason(
            Status::permission_denied("permission denied"),
            "PERMISSION_DENIED",
        ),
    }
}

fn reason_label(r: DenialReason) -> &'static str {
    match r {
        DenialReason::Unauthenticated => "unauthenticated",
        DenialReason::PermissionDenied => "permission_denied",
    }
}

/// Resolves a reader against one shard's applied state. A token that resolves to a
/// principal vouches for the call's connection (`crate::connections::vouch`; a dev-mode
/// caller without a token vouches for nothing).
pub fn resolve(node: &Node, shard: u32, caller: Actor) -> Result<Actor, Refusal> {
    let s = node.shard(shard).ok_or(Refusal::UnknownToken)?;
    let g = s.view.read();
    let resolved = g.state.security.resolve(caller, g.state.time_ms);
    if matches!(caller, Actor::Bearer(_)) && resolved.is_ok() {
        crate::connections::vouch();
    }
    resolved
}

/// Resolves a reader against `shard`'s replica; an unknown, expired or revoked token
/// (or none, outside dev mode) is refused as UNAUTHENTICATED and recorded.
pub fn authenticate(node: &Node, shard: u32, caller: Actor, api: &str) -> Result<Actor, Status> {
    match resolve(node, shard, caller) {
        Ok(Actor::Anonymous) | Err(_) => Err(refuse(
            node,
            shard,
            caller,
            api,
            DenialReason::Unauthenticated,
        )),
        Ok(actor) => Ok(actor),
    }
}

/// An authenticated caller outside its scope: PERMISSION_DENIED, recorded.
pub fn forbidden(node: &Node, shard: u32, actor: Actor, api: &str) -> Status {
    refuse(node, shard, actor, api, DenialReason::PermissionDenied)
}

/// Admin calls: an admin token, or in dev mode on an unsecured cluster anyone.
/// `before_bootstrap`: also anyone while shard 0 is unsecured (cluster init and the
/// status calls that wait for leaders happen before the admin token is installed).
/// Resolved against shard 0 (tokens are installed on every shard).
pub fn require_admin(
    node: &Node,
    meta: &MetadataMap,
    api: &str,
    before_bootstrap: bool,
) -> Result<(), Status> {
    let caller = caller(node, bearer(meta)?);
    match resolve(node, 0, caller) {
        Ok(Actor::Admin(_)) => Ok(()),
        Ok(Actor::Anonymous) if before_bootstrap && !secured(node) => Ok(()),
        Ok(Actor::Anonymous) => Err(refuse(node, 0, caller, api, DenialReason::Unauthenticated)),
        Ok(other) => Err(refuse(node, 0, other, api, DenialReason::PermissionDenied)),
        Err(_) => Err(refuse(node, 0, caller, api, DenialReason::Unauthenticated)),
    }
}

/// Any authenticated caller (the endpoint status: shard count, leaders and terms,
/// which every client needs for routing; no tenant data). Anyone before bootstrap. A
/// tenant's token lives on its org's home shard only, so the caller is authenticated if
/// any shard of this node knows it. Returns who it is (`None`: anyone, before
/// bootstrap or in dev mode), so the answer can leave out what is not for a tenant.
pub fn require_authenticated(
    node: &Node,
    meta: &MetadataMap,
    api: &str,
) -> Result<Option<Actor>, Status> {
    let caller = caller(node, bearer(meta)?);
    let known = node.shards.iter().find_map(|s| {
        resolve(node, s.id, caller)
            .ok()
            .filter(|a| *a != Actor::Anonymous)
    });
    if known.is_some() {
        return Ok(known);
    }
    if !secured(node) && resolve(node, 0, caller).is_ok() {
        return Ok(None);
    }
    Err(refuse(node, 0, caller, api, DenialReason::Unauthenticated))
}

fn secured(node: &Node) -> bool {
    node.shard(0)
        .is_some_and(|s| s.view.read().state.security.secured)
}

/// Edge denials waiting to be proposed into their shard's audit trail (bounded; what
/// does not fit is counted — one log line per shard and flush, and the
/// `auth_denials_total` metric — not kept). Each caller (an org, an agent node, an
/// admin principal — `ratelimit::key_of` — or every unresolved caller together) has a
/// share of the buffer, so that one caller's flood of refused calls cannot crowd
/// everyone else's denials out of the trail.
#[derive(Default)]
pub struct Denials {
    pending: std::sync::Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    by_shard: std::collections::BTreeMap<u32, Vec<Denial>>,
    /// Denials kept since the last flush, per shard and share.
    kept: std::collections::HashMap<(u32, Share), usize>,
    /// Denials that did not fit since the last flush, per shard.
    dropped: std::collections::BTreeMap<u32, u64>,
}

/// Denials to propose, per shard.
type PendingDenials = Vec<(u32, Vec<Denial>)>;

/// Whose share of the denial buffer a denial takes: a resolved caller's (the rate
/// limiter's key: an org, an agent node, an admin principal), every anonymous call's,
/// or every call with a token this replica does not resolve (unknown, revoked,
/// expired) — apart from anonymous ones, so that a flood that needs no credentials
/// cannot crowd out the denials of stolen or revoked tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Share {
    Caller(crate::ratelimit::Key),
    Anonymous,
    UnresolvedToken,
}

impl Denials {
    pub fn record(&self, shard: u32, d: Denial) {
        use crate::limits::{
            DENIALS_PENDING_PER_CALLER_MAX, DENIALS_PENDING_PER_SHARD_MAX,
            DENIALS_PENDING_UNRESOLVED_MAX,
        };
        use crate::ratelimit::{key_of, Key};
        let (share, most) = match d.actor {
            Actor::Anonymous => (Share::Anonymous, DENIALS_PENDING_UNRESOLVED_MAX),
            Actor::Bearer(_) => (Share::UnresolvedToken, DENIALS_PENDING_UNRESOLVED_MAX),
            a => (
                Share::Caller(key_of(Some(a)).unwrap_or(Key::Unresolved)),
                DENIALS_PENDING_PER_CALLER_MAX,
            ),
        };
        let mut g = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let g = &mut *g;
        let v = g.by_shard.entry(shard).or_default();
        let fits = v.len() < DENIALS_PENDING_PER_SHARD_MAX && {
            let kept = g.kept.entry((shard, share)).or_default();
            *kept < most && {
                *kept += 1;
                true
            }
        };
        if fits {
            v.push(d);
        } else {
            *g.dropped.entry(shard).or_default() += 1;
        }
    }

    /// The buffered denials per shard, and how many did not fit, since the last take.
    fn take(&self) -> (PendingDenials, Vec<(u32, u64)>) {
        let p = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        (
            p.by_shard.into_iter().collect(),
            p.dropped.into_iter().collect(),
        )
    }
}

/// Every second, proposes the buffered denials of each shard as one `RecordDenials`
/// command: on this node when it leads the shard, else through the leader's internal
/// (peer) service.
pub async fn flush_denials(node: std::sync::Weak<Node>) {
    let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        every.tick().await;
        let Some(node) = node.upgrade() else { return };
        let (pending, dropped) = node.denials.take();
        for (shard, n) in dropped {
            tracing::warn!(
                shard,
                dropped = n,
                "denials over their caller's share of the buffer (or the buffer's bound): \
                 logged and counted but not audited"
            );
        }
        for (shard, denials) in pending {
            for chunk in denials.chunks(allot_statemachine::limits::DENIALS_PER_RECORD_MAX) {
                if let Err(e) = report(&node, shard, node.id, chunk.to_vec()).await {
                    tracing::warn!(shard, error = %e, n = chunk.len(), "denials not audited");
                }
            }
        }
    }
}

/// Proposes `RecordDenials` for `shard` here if this node leads it, else sends it to
/// the leader's peer service.
pub async fn report(
    node: &Node,
    shard: u32,
    reporter: u64,
    denials: Vec<Denial>,
) -> anyhow::Result<()> {
    let s = node
        .shard(shard)
        .ok_or_else(|| anyhow::anyhow!("unknown shard {shard}"))?;
    let req = denial_request(reporter, denials.clone());
    match s.proposer.propose(vec![req]).await {
        Ok(c) => match c.outcomes.first() {
            Some(Err(e)) => anyhow::bail!("refused: {e}"),
            _ => Ok(()),
        },
        Err(crate::proposer::ProposeError::NotLeader {
            addr: Some(addr), ..
        }) if reporter == node.id => {
            let payload = allot_statemachine::codec::encode(&(reporter, denials));
            let mut c = node.channels.raft_client(&addr)?;
            c.report_denials(
                node.channels
                    .peer_request(allot_proto::RaftMessage { shard, payload }),
            )
            .await?;
            Ok(())
        }
        Err(e) => anyhow::bail!("{e:?}"),
    }
}

/// The command a denial report is proposed as.
fn denial_request(reporter: u64, denials: Vec<Denial>) -> Request {
    Request {
        actor: Actor::System,
        request_id: 0,
        org: None,
        command: Command::RecordDenials {
            node: reporter,
            denials,
        },
    }
}

/// A peer's denial report, checked before this leader proposes it: the reporter is a
/// member of the shard (a voter or a learner), and the report passes the state
/// machine's own validation under the shard's active rule version (the bound on its
/// denials and their fields), so an invalid report never enters the log.
pub fn check_report(
    node: &Node,
    shard: u32,
    reporter: u64,
    denials: &[Denial],
) -> Result<(), String> {
    let s = node
        .shard(shard)
        .ok_or_else(|| format!("unknown shard {shard}"))?;
    let member = s
        .raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .nodes()
        .any(|(id, _)| *id == reporter);
    if !member {
        return Err(format!("node {reporter} is not a member of shard {shard}"));
    }
    let rules = s.view.read().state.rules.active;
    let req = denial_request(reporter, denials.to_vec());
    allot_statemachine::validate::validate(&req, rules).map_err(|e| format!("the report: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_denial_buffer_is_bounded_and_counts_what_it_drops() {
        use crate::limits::{DENIALS_PENDING_PER_SHARD_MAX, DENIALS_PENDING_UNRESOLVED_MAX};
        use allot_statemachine::{Actor, Denial, DenialReason, OrgId, PrincipalId};
        let d = super::Denials::default();
        let denial = |actor| Denial {
            actor,
            api: "query".into(),
            reason: DenialReason::Unauthenticated,
        };
        for _ in 0..DENIALS_PENDING_UNRESOLVED_MAX + 10 {
            d.record(3, denial(Actor::Anonymous));
        }
        d.record(4, denial(Actor::Anonymous));
        let (pending, dropped) = d.take();
        let kept: Vec<_> = pending.iter().map(|(s, v)| (*s, v.len())).collect();
        assert_eq!(kept, vec![(3, DENIALS_PENDING_UNRESOLVED_MAX), (4, 1)]);
        assert_eq!(dropped, vec![(3, 10)]);
        // Taken: the next flush starts empty.
        let (pending, dropped) = d.take();
        assert!(pending.is_empty() && dropped.is_empty());
        // Many callers, each within its share: the shard's bound still holds.
        for org in 0..100 {
            for _ in 0..20 {
                let actor = Actor::Tenant {
                    org: OrgId(org),
                    principal: PrincipalId(org),
                };
                d.record(3, denial(actor));
            }
        }
        let (pending, dropped) = d.take();
        assert_eq!(pending[0].1.len(), DENIALS_PENDING_PER_SHARD_MAX);
        assert_eq!(
            dropped,
            vec![(3, 2_000 - DENIALS_PENDING_PER_SHARD_MAX as u64)]
        );
    }

    /// One caller's flood keeps only its share; the next caller's denial is kept.
    #[test]
    fn a_caller_keeps_its_share_of_the_denial_buffer_and_no_more() {
        use crate::limits::{DENIALS_PENDING_PER_CALLER_MAX, DENIALS_PENDING_UNRESOLVED_MAX};
        use allot_statemachine::{
            Actor, Denial, DenialReason, NodeId, OrgId, PrincipalId, TokenDigest,
        };
        let d = super::Denials::default();
        let denial = |actor| Denial {
            actor,
            api: "query:totals".into(),
            reason: DenialReason::PermissionDenied,
        };
        let tenant = |org, principal| Actor::Tenant {
            org: OrgId(org),
            principal: PrincipalId(principal),
        };
        // Org 7 through two of its principals, anonymous callers, an agent: floods.
        for i in 0..5_000u64 {
            d.record(0, denial(tenant(7, 70 + i % 2)));
            d.record(0, denial(Actor::Anonymous));
            d.record(0, denial(Actor::Agent(NodeId(9))));
        }
        d.record(0, denial(tenant(8, 80)));
        // A revoked token's denial has a share apart from anonymous calls'.
        d.record(0, denial(Actor::Bearer(TokenDigest([7; 32]))));
        let (pending, _) = d.take();
        let count =
            |f: &dyn Fn(&Actor) -> bool| pending[0].1.iter().filter(|x| f(&x.actor)).count();
        assert_eq!(
            count(&|a| matches!(a, Actor::Tenant { org: OrgId(7), .. })),
            DENIALS_PENDING_PER_CALLER_MAX
        );
        assert_eq!(
            count(&|a| *a == Actor::Anonymous),
            DENIALS_PENDING_UNRESOLVED_MAX
        );
        assert_eq!(
            count(&|a| *a == Actor::Agent(NodeId(9))),
            DENIALS_PENDING_PER_CALLER_MAX
        );
        assert_eq!(
            count(&|a| *a == tenant(8, 80)),
            1,
            "org 8's one denial is kept"
        );
        assert_eq!(
            count(&|a| matches!(a, Actor::Bearer(_))),
            1,
            "the token's denial is kept"
        );
    }

    use super::*;
    use allot_statemachine::{apply, Entry, State};

    const TOKEN: &str = "alt_the-one-real-token-of-this-test-0000000000";

    fn secured() -> State {
        let mut s = State::default();
        let boot = Request {
            actor: Actor::Anonymous,
            request_id: 1,
            org: None,
            command: Command::Bootstrap {
                principal: PrincipalId(1),
                digest: TokenDigest::of(TOKEN.as_bytes()),
            },
        };
        let out = apply(
            &mut s,
            &Entry {
                log_index: 1,
                logical_time_ms: 1_000,
                requests: vec![boot],
            },
        )
        .unwrap();
        assert!(out.outcomes[0].is_ok());
        s
    }

    fn meta_with(v: &str) -> Option<MetadataMap> {
        let mut m = MetadataMap::new();
        m.insert("authorization", v.parse().ok()?);
        Some(m)
    }

    /// Random `authorization` metadata (printable and not, with and without the
    /// `Bearer ` prefix, near-misses of the real token) never panics and never
    /// resolves to anyone on a secured shard; only the exact token does.
    #[test]
    fn random_metadata_never_authorises() {
        let s = secured();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut parsed = 0;
        for i in 0..20_000 {
            let len = (next() % 90) as usize;
            let graphic = i % 4 != 3;
            let mut v: String = (0..len)
                .map(|_| {
                    let r = next();
                    char::from(if graphic {
                        0x21 + (r % 0x5e) as u8
                    } else {
                        (r % 0x7f) as u8
                    })
                })
                .collect();
            match i % 4 {
                0 => v = format!("Bearer {v}"),
                1 => {
                    // A near miss: the real token with one character changed or cut.
                    let mut t: Vec<u8> = TOKEN.bytes().collect();
                    let at = (next() as usize) % t.len();
                    if next() % 2 == 0 {
                        t[at] = b'A' + (next() % 26) as u8;
                        if t == TOKEN.as_bytes() {
                            t[at] = b'0';
                        }
                    } else {
                        t.truncate(at);
                    }
                    v = format!("Bearer {}", String::from_utf8(t).unwrap());
                }
                _ => {}
            }
            let Some(meta) = meta_with(&v) else { continue };
            if let Ok(Some(d)) = bearer(&meta) {
                parsed += 1;
                assert!(
                    s.security.resolve(Actor::Bearer(d), s.time_ms).is_err(),
                    "{v:?} authorised"
                );
            }
        }
        assert!(
            parsed > 2_000,
            "the generator reached the resolver ({parsed})"
        );
        let d = bearer(&meta_with(&format!("Bearer {TOKEN}")).unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(
            s.security.resolve(Actor::Bearer(d), s.time_ms),
            Ok(Actor::Admin(PrincipalId(1)))
        );
        // Missing and malformed headers.
        assert_eq!(bearer(&MetadataMap::new()).unwrap(), None);
        for bad in [
            "Basic abc",
            "Bearer",
            "Bearer short",
            "token-without-scheme-000000000",
        ] {
            assert_eq!(
                bearer(&meta_with(bad).unwrap()).unwrap_err().code(),
                tonic::Code::Unauthenticated,
                "{bad}"
            );
        }
    }
}
