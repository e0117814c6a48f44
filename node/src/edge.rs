//! What a client's `Execute` call must pass at a node before anything is proposed: its
//! bytes, each request's validity (the state machine's own `validate`: the rule lives
//! there, not here), its credentials against this replica's token table, and its
//! tenant's rate limit. Every refusal is a typed gRPC status with a machine-readable
//! reason in the `allot-reason` metadata; nothing refused is proposed.

use crate::auth;
use crate::limits::{REQUESTS_PER_CALL_MAX, REQUEST_BYTES_MAX};
use crate::node::{Node, Shard};
use allot_proto::meta;
use allot_statemachine::{
    codec, validate, Actor, Command, CommandError, Limit, Request, TokenDigest,
};
use std::time::Duration;
use tonic::metadata::{BinaryMetadataValue, MetadataValue};
use tonic::Status;

/// How long a leader waits for its replica to apply what its log already holds before
/// it refuses a token its table does not know (a token created by the entry before).
pub const TOKEN_CATCH_UP_MAX: Duration = Duration::from_secs(1);

/// A status carrying a machine-readable reason.
pub fn with_reason(mut s: Status, reason: &str) -> Status {
    if let Ok(v) = MetadataValue::try_from(reason) {
        s.metadata_mut().insert(meta::REASON, v);
    }
    s
}

/// The state machine refused request `index` of the call before it was proposed
/// (`INVALID_ARGUMENT`). The typed error travels as JSON in `allot-error-json-bin` (the
/// typed API's `Error.details_json`) and its name in `allot-reason`, so a client reports
/// it exactly as it would the same refusal from apply.
/// A rule-version activation reaches the log only if apply would act on it (the
/// caller may, and the request is well formed: `State::admits`). Apply refuses the
/// others alike on every replica, but an entry holding one stops every replica of the
/// releases before this one that does not support the version it names — a node
/// rolled back, or a learner held back with `--max-rules-version` — for good.
pub fn activations_admitted(
    shard: &Shard,
    requests: &[Request],
    actors: &[Option<Actor>],
) -> Result<(), Status> {
    let g = shard.view.read();
    for (i, (r, a)) in requests.iter().zip(actors).enumerate() {
        if !matches!(r.command, Command::ActivateVersion { .. }) {
            continue;
        }
        let admitted = a.map_or(Err(CommandError::Unauthenticated), |a| g.state.admits(a, r));
        if let Err(e) = admitted {
            return Err(rejected(i, &e));
        }
    }
    Ok(())
}

pub fn rejected(index: usize, e: &CommandError) -> Status {
    let mut s = with_reason(
        Status::invalid_argument(format!("request {index}: {e}")),
        e.reason(),
    );
    s.metadata_mut().insert_bin(
        meta::ERROR_JSON,
        BinaryMetadataValue::from_bytes(allot_proto::typed::error_to(e).details_json.as_bytes()),
    );
    if let Ok(v) = MetadataValue::try_from(index.to_string()) {
        s.metadata_mut().insert(meta::REQUEST_INDEX, v);
    }
    s
}

/// Decodes the call's requests, sets whom each runs as (`auth::stamp`) and validates
/// each (`allot_statemachine::validate`). A request's bytes are checked against
/// [`REQUEST_BYTES_MAX`] before it is decoded.
pub fn decode_requests(
    node: &Node,
    shard: u32,
    bearer: Option<TokenDigest>,
    raw: &[Vec<u8>],
) -> Result<Vec<Request>, Status> {
    admit_each(node, shard, bearer, raw.iter(), |i, b| {
        check_size(i, b.len())?;
        codec::decode(b).map_err(|e| {
            with_reason(
                Status::invalid_argument(format!("request {i}: {e}")),
                "MALFORMED",
            )
        })
    })
}

/// A request's encoded size against [`REQUEST_BYTES_MAX`] (checked before it is
/// decoded or converted).
pub fn check_size(index: usize, len: usize) -> Result<(), Status> {
    if len > REQUEST_BYTES_MAX {
        return Err(rejected(
            index,
            &CommandError::LimitReached(Limit::CommandBytes),
        ));
    }
    Ok(())
}

/// The one admission path of a call's requests, whatever their wire form: the count
/// bound, then each one read by `read` (its size bound, decoding or conversion), stamped
/// with its caller and validated by the state machine's own rules.
pub fn admit_each<R>(
    node: &Node,
    shard: u32,
    bearer: Option<TokenDigest>,
    raw: impl ExactSizeIterator<Item = R>,
    mut read: impl FnMut(usize, R) -> Result<Request, Status>,
) -> Result<Vec<Request>, Status> {
    if raw.len() == 0 {
        return Err(with_reason(
            Status::invalid_argument("no requests"),
            "NO_REQUESTS",
        ));
    }
    if raw.len() > REQUESTS_PER_CALL_MAX {
        return Err(with_reason(
            Status::invalid_argument(format!(
                "{} requests in one call; at most {REQUESTS_PER_CALL_MAX}",
                raw.len()
            )),
            "TOO_MANY_REQUESTS",
        ));
    }
    // Validated under the rule version this replica has applied (apply checks again
    // under the version active at the request's own position in the log).
    let rules = node
        .shard(shard)
        .map_or(allot_statemachine::version::RULES_BASELINE, |s| {
            s.view.read().state.rules.active
        });
    let mut requests = Vec::with_capacity(raw.len());
    for (i, b) in raw.enumerate() {
        let mut r = read(i, b)?;
        auth::stamp(node, shard, bearer, &mut r)?;
        validate::validate(&r, rules).map_err(|e| rejected(i, &e))?;
        requests.push(r);
    }
    Ok(requests)
}

/// Whom each request runs as on this replica's token table (`None`: its token does
/// not resolve here). On the shard's leader — the replica that would propose — a
/// request whose token does not resolve is refused `UNAUTHENTICATED` and recorded as a
/// denial, after the replica has applied everything its log held when the call came
/// (so a token created just before is known). A follower forwards it: the leader
/// decides.
pub async fn credentials(
    node: &Node,
    shard: &Shard,
    requests: &[Request],
    leader: bool,
) -> Result<Vec<Option<Actor>>, Status> {
    let resolve = || {
        let g = shard.view.read();
        requests
            .iter()
            .map(|r| g.state.security.resolve(r.actor, g.state.time_ms).ok())
            .collect::<Vec<_>>()
    };
    // The one command an anonymous caller may send: once the shard is secured, it can
    // only be refused (unless it repeats the bootstrap itself), so it is refused here.
    {
        let g = shard.view.read();
        for (i, r) in requests.iter().enumerate() {
            if let Command::Bootstrap { principal, digest } = r.command {
                if let Some(Err(e)) = g.state.security.bootstrap_when_secured(principal, digest) {
                    return Err(rejected(i, &e));
                }
            }
        }
    }
    let mut actors = resolve();
    if !leader || actors.iter().all(Option::is_some) {
        vouch_if_resolved(requests, &actors);
        return Ok(actors);
    }
    let logged = shard.raft.metrics().borrow().last_log_index.unwrap_or(0);
    let mut applied = shard.view.applied_watch();
    let caught_up = tokio::time::timeout(TOKEN_CATCH_UP_MAX, applied.wait_for(|i| *i >= logged));
    if caught_up.await.is_ok() {
        actors = resolve();
    }
    if let Some(i) = actors.iter().position(Option::is_none) {
        let r = &requests[i];
        return Err(with_reason(
            auth::refuse(
                node,
                shard.id,
                r.actor,
                &format!("execute:{}", r.command.name()),
                allot_statemachine::DenialReason::Unauthenticated,
            ),
            "UNAUTHENTICATED",
        ));
    }
    vouch_if_resolved(requests, &actors);
    Ok(actors)
}

/// Every request carried a token and it resolved to a principal: the call's connection
/// has authenticated (`crate::connections::vouch`).
fn vouch_if_resolved(requests: &[Request], actors: &[Option<Actor>]) {
    if !requests.is_empty()
        && requests
            .iter()
            .zip(actors)
            .all(|(r, a)| matches!(r.actor, Actor::Bearer(_)) && a.is_some())
    {
        crate::connections::vouch();
    }
}
