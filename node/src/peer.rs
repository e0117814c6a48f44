//! Peers: who may speak for one (authentication before anything is decoded), and what a
//! peer's message may say before openraft sees it.
//!
//! **Authentication.** A peer proves it is one by mutual TLS (a certificate of the
//! cluster CA) and/or a shared peer secret (`--peer-secret-file`, sent as metadata and
//! compared by digest in constant time). The internal `Raft` service refuses an
//! unauthenticated caller in an interceptor, before the message body is read; a
//! forwarded client call is trusted as forwarded (exempt from the second rate limit)
//! only from an authenticated peer. A node with neither TLS nor a secret cannot tell a
//! peer from anyone (development, or a network only the nodes reach): it says so at
//! start, and every peer message still has the bounded cost of `crate::limits`.
//!
//! **Guards.** openraft 0.9 trusts its peers: a term of `u64::MAX` overflows its
//! `term + 1`, entries that do not follow `prev_log_id` or a commit index that
//! contradicts this node's committed log trip its assertions or stop the group. Every
//! check below is on the decoded message (and this node's committed log id) and refuses
//! it with a typed error before openraft is called; answers from peers are checked the
//! same way before they are handed back to openraft.

use crate::identity::{ClusterId, Identity};
use crate::limits::{INDEX_MAX, SNAPSHOT_BYTES_MAX, TERM_MAX};
use crate::network::{AppendWire, SnapshotChunk};
use crate::types::{LogEntry, LogId, NodeId, SnapshotMeta, Vote};
use openraft::raft::{AppendEntriesResponse, VoteRequest, VoteResponse};
use openraft::{EntryPayload, Membership};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tonic::metadata::{MetadataMap, MetadataValue};

/// Metadata key of the peer secret.
pub const PEER_SECRET: &str = "allot-peer-secret";
/// Shortest peer secret accepted (128 bits of base64).
pub const PEER_SECRET_LEN_MIN: usize = 22;
/// Longest peer secret accepted: what a peer-link hello carries
/// (`LINK_HELLO_SECRET_MAX`).
pub const PEER_SECRET_LEN_MAX: usize = crate::limits::LINK_HELLO_SECRET_MAX;
/// How long a follower may take to install a snapshot once its last chunk arrived
/// (decode and store the whole state).
pub const SNAPSHOT_INSTALL_TIMEOUT: Duration = Duration::from_secs(300);

/// What this node presents to its peers.
#[derive(Clone, Default)]
pub struct PeerCredential {
    secret: Option<MetadataValue<tonic::metadata::Ascii>>,
    /// The cluster this node belongs to, sent with every peer message.
    identity: Option<Arc<Identity>>,
}

impl PeerCredential {
    pub fn new(secret: Option<&str>) -> anyhow::Result<PeerCredential> {
        let secret = match secret {
            None => None,
            Some(s) => {
                let s = s.trim();
                if s.len() < PEER_SECRET_LEN_MIN
                    || s.len() > PEER_SECRET_LEN_MAX
                    || !s.bytes().all(|b| b.is_ascii_graphic())
                {
                    anyhow::bail!(
                        "the peer secret must be {PEER_SECRET_LEN_MIN} to {PEER_SECRET_LEN_MAX} \
                         printable characters"
                    );
                }
                Some(MetadataValue::try_from(s)?)
            }
        };
        Ok(PeerCredential {
            secret,
            identity: None,
        })
    }

    pub fn with_identity(mut self, identity: Arc<Identity>) -> PeerCredential {
        self.identity = Some(identity);
        self
    }

    /// The cluster id this node sends (none: a data dir of an earlier release, or a new
    /// node that has not heard a peer yet).
    pub fn cluster_id(&self) -> Option<ClusterId> {
        self.identity.as_ref().and_then(|i| i.current())
    }

    /// The secret's bytes (empty without one): what a peer-link hello carries.
    pub fn secret_bytes(&self) -> &[u8] {
        self.secret.as_ref().map_or(&[], |s| s.as_bytes())
    }

    pub fn attach(&self, meta: &mut MetadataMap) {
        if let Some(s) = &self.secret {
            meta.insert(PEER_SECRET, s.clone());
        }
        if let Some(id) = self.cluster_id() {
            if let Ok(v) = MetadataValue::try_from(crate::identity::hex(&id)) {
                meta.insert(crate::identity::HEADER, v);
            }
        }
    }
}

/// What this node accepts from its peers.
#[derive(Clone, Default)]
pub struct PeerAuth {
    /// Require a client certificate of the cluster CA (the node serves TLS).
    pub tls: bool,
    /// SHA-256 of the peer secret, when one is configured.
    pub secret_digest: Option<[u8; 32]>,
    /// The cluster this node belongs to: a peer of another is refused.
    pub identity: Option<Arc<Identity>>,
}

impl PeerAuth {
    pub fn new(tls: bool, secret: Option<&str>) -> PeerAuth {
        PeerAuth {
            tls,
            secret_digest: secret.map(|s| Sha256::digest(s.trim().as_bytes()).into()),
            identity: None,
        }
    }

    pub fn with_identity(mut self, identity: Arc<Identity>) -> PeerAuth {
        self.identity = Some(identity);
        self
    }

    /// Whether a peer of cluster `theirs` is one of this node's cluster (a new node
    /// takes the first authenticated peer's: `Identity::admit`). The refusal: reason
    /// `OTHER_CLUSTER`.
    #[allow(clippy::result_large_err)]
    pub fn admits_cluster(&self, theirs: Option<ClusterId>) -> Result<(), tonic::Status> {
        let Some(identity) = &self.identity else {
            return Ok(());
        };
        identity.admit(theirs).map_err(|why| {
            crate::edge::with_reason(tonic::Status::failed_precondition(why), "OTHER_CLUSTER")
        })
    }

    /// Whether peers are authenticated at all (TLS or a secret).
    pub fn configured(&self) -> bool {
        self.tls || self.secret_digest.is_some()
    }

    /// Positive evidence that the caller is a peer: every configured credential was
    /// presented. Without any configured, nobody is known to be a peer.
    pub fn is_peer<T>(&self, req: &tonic::Request<T>) -> bool {
        self.configured() && self.credentials_ok(req.metadata(), has_peer_cert(req))
    }

    /// Whether a peer-link hello carrying `secret` is a peer's (`crate::link`): the same
    /// rule as the interceptor's. `peer_cert`: the link runs inside a TLS session whose
    /// client presented a certificate of the cluster CA (a node that requires
    /// certificates refuses a link without one). Open when no peer authentication is
    /// set up.
    pub fn admits_link(&self, secret: &[u8], peer_cert: bool) -> bool {
        if !self.configured() {
            return true;
        }
        let mut meta = MetadataMap::new();
        if let Ok(v) = MetadataValue::try_from(secret) {
            meta.insert(PEER_SECRET, v);
        }
        self.credentials_ok(&meta, peer_cert)
    }

    fn credentials_ok(&self, meta: &MetadataMap, peer_cert: bool) -> bool {
        if self.tls && !peer_cert {
            return false;
        }
        match &self.secret_digest {
            None => true,
            Some(want) => meta.get(PEER_SECRET).is_some_and(|v| {
                let got: [u8; 32] = Sha256::digest(v.as_bytes()).into();
                constant_time_eq(&got, want)
            }),
        }
    }

    /// The interceptor of the internal Raft service: runs on the request's headers,
    /// before its body is read or decoded. Open when no peer authentication is set up.
    #[allow(clippy::result_large_err)]
    pub fn intercept(&self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if !self.configured() || self.credentials_ok(req.metadata(), has_peer_cert(&req)) {
            let theirs = match req.metadata().get(crate::identity::HEADER) {
                None => None,
                Some(v) => Some(crate::identity::parse(v.as_bytes()).map_err(|e| {
                    crate::edge::with_reason(
                        tonic::Status::invalid_argument(format!(
                            "{}: {e}",
                            crate::identity::HEADER
                        )),
                        "MALFORMED",
                    )
                })?),
            };
            self.admits_cluster(theirs)?;
            return Ok(req);
        }
        Err(crate::edge::with_reason(
            tonic::Status::permission_denied(
                "peer service: a cluster certificate or the peer secret is required",
            ),
            "PEER_UNAUTHENTICATED",
        ))
    }
}

fn has_peer_cert<T>(req: &tonic::Request<T>) -> bool {
    req.peer_certs().is_some_and(|c| !c.is_empty())
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------- guards

fn check_log_id(what: &str, l: &LogId) -> Result<(), String> {
    if l.leader_id.term > TERM_MAX || l.index > INDEX_MAX {
        return Err(format!("{what}: term or index out of range ({l})"));
    }
    Ok(())
}

/// A vote's term is within range.
pub fn check_vote(v: &Vote) -> Result<(), String> {
    if v.leader_id().term > TERM_MAX {
        return Err(format!("term out of range ({v})"));
    }
    Ok(())
}

/// A vote that claims leadership (AppendEntries, snapshots): committed, in range, not
/// this node's own.
fn check_leader_vote(v: &Vote, me: NodeId) -> Result<(), String> {
    check_vote(v)?;
    if !v.is_committed() {
        return Err(format!("a leader's message with an uncommitted vote ({v})"));
    }
    if v.leader_id().voted_for() == Some(me) {
        return Err(format!(
            "a message claiming this node's own leadership ({v})"
        ));
    }
    Ok(())
}

/// `l` was written by a leader no later than the sender's vote.
fn not_after_vote(what: &str, l: &LogId, vote: &Vote) -> Result<(), String> {
    check_log_id(what, l)?;
    if l.leader_id > *vote.leader_id() {
        return Err(format!("{what} {l} is newer than the sender's vote {vote}"));
    }
    Ok(())
}

/// A log id at or below this node's committed index must be the committed log's own
/// (a leader never contradicts what a majority committed).
fn agrees_with_committed(what: &str, l: &LogId, committed: Option<&LogId>) -> Result<(), String> {
    match committed {
        Some(c) if l.index <= c.index && l > c => Err(format!(
            "{what} {l} contradicts this node's committed log ({c})"
        )),
        _ => Ok(()),
    }
}

fn check_membership(m: &Membership<NodeId, openraft::BasicNode>) -> Result<(), String> {
    let configs = m.get_joint_config();
    if configs.is_empty() || configs.len() > 2 || configs.iter().any(|c| c.is_empty()) {
        return Err("a membership with no, more than two, or an empty configuration".into());
    }
    if let Some(v) = m.voter_ids().find(|v| m.get_node(v).is_none()) {
        return Err(format!("voter {v} has no node address in the membership"));
    }
    Ok(())
}

fn check_entry(e: &LogEntry) -> Result<(), String> {
    use allot_statemachine::limits::LOGICAL_TIME_MS_MAX;
    match &e.payload {
        EntryPayload::Membership(m) => check_membership(m),
        EntryPayload::Normal(b) if b.logical_time_ms > LOGICAL_TIME_MS_MAX => Err(format!(
            "entry {} is stamped {} ms, past the latest logical time ({LOGICAL_TIME_MS_MAX})",
            e.log_id, b.logical_time_ms
        )),
        EntryPayload::Blank | EntryPayload::Normal(_) => Ok(()),
    }
}

/// An AppendEntries from a peer, against this node's id and committed log id.
pub fn check_append(req: &AppendWire, me: NodeId, committed: Option<&LogId>) -> Result<(), String> {
    let vote = &req.vote;
    check_leader_vote(vote, me)?;
    if let Some(p) = &req.prev_log_id {
        not_after_vote("prev_log_id", p, vote)?;
        agrees_with_committed("prev_log_id", p, committed)?;
    }
    let first = req.prev_log_id.map_or(0, |p| p.index + 1);
    let mut last = req.prev_log_id;
    for (i, e) in req.entries.iter().enumerate() {
        let l = &e.log_id;
        not_after_vote("entry", l, vote)?;
        if l.index != first + i as u64 {
            return Err(format!(
                "entry {l} does not follow the previous one (expected index {})",
                first + i as u64
            ));
        }
        if last.is_some_and(|p| l.leader_id < p.leader_id) {
            return Err(format!(
                "entry {l} has an older leader than the one before it"
            ));
        }
        agrees_with_committed("entry", l, committed)?;
        check_entry(e)?;
        last = Some(*l);
    }
    if let Some(lc) = &req.leader_commit {
        not_after_vote("leader_commit", lc, vote)?;
        agrees_with_committed("leader_commit", lc, committed)?;
        check_leader_commit(lc, req.prev_log_id.as_ref(), &req.entries, last.as_ref())?;
    }
    // A leader proposes a membership only once the one before it is committed: of the
    // membership entries in one message, all but the last are within its commit index.
    let memberships: Vec<&LogId> = req
        .entries
        .iter()
        .filter(|e| matches!(e.payload, EntryPayload::Membership(_)))
        .map(|e| &e.log_id)
        .collect();
    if let Some((_, earlier)) = memberships.split_last() {
        if earlier
            .iter()
            .any(|m| req.leader_commit.as_ref().is_none_or(|lc| *m > lc))
        {
            return Err("a membership entry after one that is not committed".into());
        }
    }
    Ok(())
}

/// The leader's commit index is consistent with the log the message describes.
fn check_leader_commit(
    lc: &LogId,
    prev: Option<&LogId>,
    entries: &[LogEntry],
    last: Option<&LogId>,
) -> Result<(), String> {
    let bad = || Err(format!("leader_commit {lc} contradicts the entries sent"));
    let prev_index = prev.map(|p| p.index);
    if let Some(e) = entries.iter().find(|e| e.log_id.index == lc.index) {
        return if e.log_id == *lc { Ok(()) } else { bad() };
    }
    match (prev, last) {
        (Some(p), _) if lc.index == p.index => {
            if lc == p {
                Ok(())
            } else {
                bad()
            }
        }
        (Some(p), _) if lc.index < p.index => {
            if lc.leader_id <= p.leader_id {
                Ok(())
            } else {
                bad()
            }
        }
        (_, Some(l)) if Some(lc.index) > Some(l.index).max(prev_index) => {
            if lc.leader_id >= l.leader_id {
                Ok(())
            } else {
                bad()
            }
        }
        (None, None) => Ok(()),
        _ => Ok(()),
    }
}

/// A RequestVote from a peer.
pub fn check_vote_request(req: &VoteRequest<NodeId>, me: NodeId) -> Result<(), String> {
    check_vote(&req.vote)?;
    if req.vote.is_committed() {
        return Err(format!(
            "a vote request with a committed vote ({})",
            req.vote
        ));
    }
    if req.vote.leader_id().voted_for() == Some(me) {
        return Err(format!("a vote request in this node's name ({})", req.vote));
    }
    if let Some(l) = &req.last_log_id {
        check_log_id("last_log_id", l)?;
    }
    Ok(())
}

/// A snapshot chunk from a peer: the vote and metadata, and the chunk within the
/// snapshot's declared size and the bound.
pub fn check_snapshot_chunk(
    c: &SnapshotChunk,
    me: NodeId,
    committed: Option<&LogId>,
) -> Result<(), String> {
    check_leader_vote(&c.vote, me)?;
    check_snapshot_meta(&c.meta, &c.vote, committed)?;
    if c.total_bytes > SNAPSHOT_BYTES_MAX {
        return Err(format!(
            "snapshot of {} bytes declared; at most {SNAPSHOT_BYTES_MAX}",
            c.total_bytes
        ));
    }
    match c.offset.checked_add(c.data.len() as u64) {
        Some(end) if end <= c.total_bytes => Ok(()),
        _ => Err(format!(
            "chunk at {} of {} bytes passes the declared size {}",
            c.offset,
            c.data.len(),
            c.total_bytes
        )),
    }
}

fn check_snapshot_meta(
    m: &SnapshotMeta,
    vote: &Vote,
    committed: Option<&LogId>,
) -> Result<(), String> {
    let Some(last) = &m.last_log_id else {
        return Err("a snapshot without a last log id".into());
    };
    not_after_vote("snapshot last_log_id", last, vote)?;
    agrees_with_committed("snapshot last_log_id", last, committed)?;
    if let Some(ml) = m.last_membership.log_id() {
        check_log_id("snapshot membership", ml)?;
        if ml > last || ml.index > last.index {
            return Err(format!(
                "snapshot membership at {ml} is after the snapshot's last log id {last}"
            ));
        }
    }
    check_membership(m.last_membership.membership())
}

/// A peer's answer to our AppendEntries (`vote`, `prev` and the log ids we sent;
/// `acked`: the highest log id the peer acknowledged under this vote).
pub fn check_append_response(
    resp: &AppendEntriesResponse<NodeId>,
    vote: &Vote,
    me: NodeId,
    prev: Option<LogId>,
    sent: &[LogId],
    acked: Option<LogId>,
) -> Result<(), String> {
    match resp {
        AppendEntriesResponse::Success => Ok(()),
        AppendEntriesResponse::PartialSuccess(m) => {
            if *m == prev || m.is_some_and(|m| sent.contains(&m)) {
                Ok(())
            } else {
                Err(format!("partial success at a log id not sent ({m:?})"))
            }
        }
        AppendEntriesResponse::Conflict if prev.is_none() => {
            Err("a conflict reported on an empty prefix".into())
        }
        AppendEntriesResponse::Conflict if prev.is_some() && prev <= acked => Err(format!(
            "a conflict at {prev:?}, at or below what the peer acknowledged ({acked:?})"
        )),
        AppendEntriesResponse::Conflict => Ok(()),
        AppendEntriesResponse::HigherVote(v) => check_higher_vote(v, vote, me),
    }
}

/// A vote a peer says is higher than ours must be, and must not be in our name.
pub fn check_higher_vote(v: &Vote, ours: &Vote, me: NodeId) -> Result<(), String> {
    check_vote(v)?;
    if v <= ours {
        return Err(format!("a 'higher' vote {v} that is not above ours {ours}"));
    }
    if v.leader_id().voted_for() == Some(me) {
        return Err(format!("a higher vote in this node's name ({v})"));
    }
    Ok(())
}

/// A peer's answer to our RequestVote.
pub fn check_vote_response(
    resp: &VoteResponse<NodeId>,
    req: &VoteRequest<NodeId>,
    me: NodeId,
) -> Result<(), String> {
    check_vote(&resp.vote)?;
    if resp.vote.leader_id().voted_for() == Some(me) && resp.vote != req.vote {
        return Err(format!(
            "a vote in this node's name that it did not ask for ({})",
            resp.vote
        ));
    }
    if let Some(l) = &resp.last_log_id {
        check_log_id("last_log_id", l)?;
    }
    Ok(())
}

/// A peer's answer to a snapshot chunk.
pub fn check_snapshot_response(v: &Vote, ours: &Vote, me: NodeId) -> Result<(), String> {
    check_vote(v)?;
    if v.leader_id().voted_for() == Some(me) && v != ours {
        return Err(format!(
            "a vote in this node's name that it did not send ({v})"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- snapshot receiving

/// A snapshot arriving in chunks on one shard. Chunks must come in order (each at the
/// offset already received) within the size the first chunk declared. The bytes go to
/// one file per shard under the data dir, not to memory: a snapshot being received costs
/// one chunk of memory however large it is declared, and a complete one is decoded from
/// the file ([`Received::decode`]) before any of it is held in memory.
pub struct SnapshotReceiver {
    path: PathBuf,
    receiving: Option<Receiving>,
}

struct Receiving {
    snapshot_id: String,
    vote: Vote,
    total: u64,
    received: u64,
    file: tokio::fs::File,
}

/// Why a chunk was not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChunkError {
    #[error("chunk out of order: at {got}, expected {expected} (start again at 0)")]
    OutOfOrder { got: u64, expected: u64 },
    #[error("cannot keep a snapshot of {total} bytes: {error}")]
    Storage { total: u64, error: String },
}

impl SnapshotReceiver {
    /// Receives into `path` (a file of its own; one left by an earlier process is
    /// removed).
    pub fn new(path: PathBuf) -> SnapshotReceiver {
        let _ = std::fs::remove_file(&path);
        SnapshotReceiver {
            path,
            receiving: None,
        }
    }

    /// Takes a checked chunk; returns the whole snapshot once the last arrived.
    pub async fn receive(&mut self, c: SnapshotChunk) -> Result<Option<Received>, ChunkError> {
        let done = c.done();
        let storage = |error: std::io::Error| ChunkError::Storage {
            total: c.total_bytes,
            error: error.to_string(),
        };
        if c.offset == 0 {
            self.receiving = None;
            if let Some(dir) = self.path.parent() {
                tokio::fs::create_dir_all(dir).await.map_err(storage)?;
            }
            self.receiving = Some(Receiving {
                snapshot_id: c.meta.snapshot_id.clone(),
                vote: c.vote,
                total: c.total_bytes,
                received: 0,
                file: tokio::fs::File::create(&self.path).await.map_err(storage)?,
            });
        }
        let expected = match &self.receiving {
            Some(r)
                if r.snapshot_id == c.meta.snapshot_id
                    && r.vote == c.vote
                    && r.total == c.total_bytes =>
            {
                r.received
            }
            _ => 0,
        };
        let Some(r) = self.receiving.as_mut().filter(|_| c.offset == expected) else {
            return Err(ChunkError::OutOfOrder {
                got: c.offset,
                expected,
            });
        };
        use tokio::io::AsyncWriteExt;
        let written = async {
            // Flushed: a chunk is acknowledged once it is in the file.
            r.file.write_all(&c.data).await?;
            r.file.flush().await
        }
        .await;
        if let Err(e) = written {
            self.receiving = None;
            let _ = tokio::fs::remove_file(&self.path).await;
            return Err(storage(e));
        }
        r.received += c.data.len() as u64;
        if done {
            let r = self.receiving.take();
            return Ok(r.map(|r| Received {
                path: self.path.clone(),
                len: r.received,
            }));
        }
        Ok(None)
    }
}

/// A snapshot received whole, in its file (removed when this is dropped).
pub struct Received {
    path: PathBuf,
    len: u64,
}

impl Received {
    /// Decodes the state straight from the file (input that is not a state fails after
    /// reading what shows it, holding no more than the decoder's buffer), then reads the
    /// bytes openraft installs. Blocking: run it off the runtime's workers.
    pub fn decode(&self) -> Result<(allot_statemachine::State, Vec<u8>), String> {
        use std::io::Read;
        let file = std::fs::File::open(&self.path).map_err(|e| e.to_string())?;
        let state = allot_statemachine::State::decode_from(std::io::BufReader::new(file), self.len)
            .map_err(|e| format!("snapshot does not decode: {e}"))?;
        let mut bytes = Vec::with_capacity(usize::try_from(self.len).unwrap_or(0));
        std::fs::File::open(&self.path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| e.to_string())?;
        Ok((state, bytes))
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    //! The guards on what peers answer (our own AppendEntries, votes and snapshots):
    //! each refusal and each answer a correct peer gives.
    use super::*;
    use openraft::CommittedLeaderId;

    const ME: NodeId = 1;

    fn log_id(term: u64, node: NodeId, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn leader(term: u64) -> Vote {
        Vote::new_committed(term, ME)
    }

    /// An entry stamped past the latest logical time is refused: one would pin the
    /// shard's time there for good (time never goes back), firing every expiry, and the
    /// sums of time and a lease in apply would overflow. Before, any stamp was taken.
    #[test]
    fn an_entry_stamped_past_the_latest_logical_time_is_refused() {
        use crate::types::Batch;
        use allot_statemachine::limits::LOGICAL_TIME_MS_MAX;
        let append = |stamp: u64| AppendWire {
            vote: Vote::new_committed(5, 2),
            prev_log_id: Some(log_id(5, 2, 1)),
            leader_commit: None,
            entries: vec![LogEntry {
                log_id: log_id(5, 2, 2),
                payload: EntryPayload::Normal(Batch::new(stamp, &[])),
            }],
        };
        let ok = check_append(&append(LOGICAL_TIME_MS_MAX), ME, None);
        assert!(ok.is_ok(), "{ok:?}");
        for stamp in [LOGICAL_TIME_MS_MAX + 1, u64::MAX] {
            let e = check_append(&append(stamp), ME, None).unwrap_err();
            assert!(e.contains("past the latest logical time"), "{e}");
        }
    }

    #[test]
    fn append_answers() {
        let vote = leader(5);
        let prev = Some(log_id(5, ME, 10));
        let sent = [log_id(5, ME, 11), log_id(5, ME, 12)];
        let check = |r: AppendEntriesResponse<NodeId>, acked: Option<LogId>| {
            check_append_response(&r, &vote, ME, prev, &sent, acked)
        };
        assert!(check(AppendEntriesResponse::Success, None).is_ok());
        // A partial success names what we sent (or the prefix), nothing else.
        assert!(check(AppendEntriesResponse::PartialSuccess(Some(sent[0])), None).is_ok());
        assert!(check(AppendEntriesResponse::PartialSuccess(prev), None).is_ok());
        assert!(check(
            AppendEntriesResponse::PartialSuccess(Some(log_id(5, ME, 99))),
            None
        )
        .is_err());
        assert!(check(AppendEntriesResponse::PartialSuccess(None), None).is_err());
        // A conflict above what the peer acknowledged is real; at or below, a lie.
        assert!(check(AppendEntriesResponse::Conflict, Some(log_id(5, ME, 9))).is_ok());
        assert!(check(AppendEntriesResponse::Conflict, Some(log_id(5, ME, 10))).is_err());
        assert!(check(AppendEntriesResponse::Conflict, Some(log_id(5, ME, 12))).is_err());
        assert!(check_append_response(
            &AppendEntriesResponse::Conflict,
            &vote,
            ME,
            None,
            &sent,
            None
        )
        .is_err());
        // A higher vote must be higher, in range and not in our name.
        assert!(check(AppendEntriesResponse::HigherVote(Vote::new(6, 2)), None).is_ok());
        assert!(check(AppendEntriesResponse::HigherVote(Vote::new(4, 2)), None).is_err());
        assert!(check(AppendEntriesResponse::HigherVote(leader(5)), None).is_err());
        assert!(check(AppendEntriesResponse::HigherVote(Vote::new(7, ME)), None).is_err());
        assert!(check(
            AppendEntriesResponse::HigherVote(Vote::new(TERM_MAX + 1, 2)),
            None
        )
        .is_err());
        assert!(check(
            AppendEntriesResponse::HigherVote(Vote::new(u64::MAX, 2)),
            None
        )
        .is_err());
    }

    #[test]
    fn vote_answers() {
        let req = VoteRequest::new(Vote::new(5, ME), Some(log_id(4, 2, 10)));
        let answer = |vote: Vote, granted: bool, last: Option<LogId>| VoteResponse {
            vote,
            vote_granted: granted,
            last_log_id: last,
        };
        // Granted: our own vote back. Refused: the voter's own, higher or not.
        assert!(check_vote_response(&answer(Vote::new(5, ME), true, None), &req, ME).is_ok());
        assert!(check_vote_response(
            &answer(Vote::new(6, 3), false, Some(log_id(6, 3, 20))),
            &req,
            ME
        )
        .is_ok());
        // A vote in our name we did not ask for, a term or index out of range: refused.
        assert!(check_vote_response(&answer(Vote::new(9, ME), true, None), &req, ME).is_err());
        assert!(
            check_vote_response(&answer(Vote::new(u64::MAX, 3), false, None), &req, ME).is_err()
        );
        assert!(check_vote_response(
            &answer(Vote::new(6, 3), false, Some(log_id(6, 3, INDEX_MAX + 1))),
            &req,
            ME
        )
        .is_err());
        assert!(check_vote_response(
            &answer(Vote::new(6, 3), false, Some(log_id(TERM_MAX + 1, 3, 1))),
            &req,
            ME
        )
        .is_err());
    }

    #[test]
    fn vote_requests() {
        assert!(check_vote_request(&VoteRequest::new(Vote::new(5, 2), None), ME).is_ok());
        // Committed (a candidate has none), in our name, or out of range: refused.
        assert!(
            check_vote_request(&VoteRequest::new(Vote::new_committed(5, 2), None), ME).is_err()
        );
        assert!(check_vote_request(&VoteRequest::new(Vote::new(5, ME), None), ME).is_err());
        assert!(check_vote_request(&VoteRequest::new(Vote::new(u64::MAX, 2), None), ME).is_err());
        let far = Some(log_id(3, 2, u64::MAX));
        assert!(check_vote_request(&VoteRequest::new(Vote::new(5, 2), far), ME).is_err());
    }

    #[test]
    fn snapshot_answers() {
        let ours = leader(5);
        assert!(check_snapshot_response(&ours, &ours, ME).is_ok());
        assert!(check_snapshot_response(&Vote::new(6, 2), &ours, ME).is_ok());
        assert!(check_snapshot_response(&Vote::new(6, ME), &ours, ME).is_err());
        assert!(check_snapshot_response(&Vote::new(u64::MAX, 2), &ours, ME).is_err());
    }

    fn chunk(id: &str, offset: u64, total: u64, data: &[u8]) -> SnapshotChunk {
        SnapshotChunk {
            vote: Vote::new_committed(5, 2),
            meta: SnapshotMeta {
                last_log_id: Some(log_id(5, 2, 10)),
                last_membership: Default::default(),
                snapshot_id: id.into(),
            },
            total_bytes: total,
            offset,
            data: data.to_vec(),
        }
    }

    fn contents(r: Option<Received>) -> Option<Vec<u8>> {
        r.map(|r| std::fs::read(&r.path).unwrap())
    }

    #[tokio::test]
    async fn snapshots_arrive_in_order_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("incoming").join("shard-0.snapshot");
        let mut r = SnapshotReceiver::new(path.clone());
        // A chunk past the start with nothing begun: refused, nothing kept.
        assert_eq!(
            r.receive(chunk("a", 4, 8, b"5678")).await.err(),
            Some(ChunkError::OutOfOrder {
                got: 4,
                expected: 0
            })
        );
        assert!(!path.exists());
        assert!(r
            .receive(chunk("a", 0, 8, b"1234"))
            .await
            .unwrap()
            .is_none());
        // Kept on disk, not in memory.
        assert_eq!(std::fs::read(&path).unwrap(), b"1234");
        // A gap, a repeat, or another snapshot's chunk: refused; the first stays.
        assert!(r.receive(chunk("a", 6, 8, b"78")).await.is_err());
        assert!(r.receive(chunk("a", 0, 9, b"1")).await.unwrap().is_none());
        assert_eq!(
            r.receive(chunk("b", 1, 9, b"2")).await.err(),
            Some(ChunkError::OutOfOrder {
                got: 1,
                expected: 0
            })
        );
        // Starting again at 0 replaces what was received; completes in order.
        assert!(r
            .receive(chunk("a", 0, 8, b"1234"))
            .await
            .unwrap()
            .is_none());
        let done = r.receive(chunk("a", 4, 8, b"5678")).await.unwrap();
        assert_eq!(contents(done), Some(b"12345678".to_vec()));
        assert!(!path.exists(), "the file goes with the received snapshot");
        // Done: a further chunk of it begins nothing.
        assert!(r.receive(chunk("a", 4, 8, b"5678")).await.is_err());
        // A file left by an earlier process is removed.
        std::fs::write(&path, b"stale").unwrap();
        let _ = SnapshotReceiver::new(path.clone());
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn a_received_snapshot_decodes_from_its_file_or_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = SnapshotReceiver::new(dir.path().join("s"));
        let state = allot_statemachine::State::default();
        let bytes = state.encode();
        let n = bytes.len() as u64;
        let got = r.receive(chunk("a", 0, n, &bytes)).await.unwrap().unwrap();
        let (decoded, raw) = got.decode().unwrap();
        assert_eq!(decoded.state_hash(), state.state_hash());
        assert_eq!(raw, bytes);
        // Not a state (here: the version byte and then a length prefix of 2^60): refused
        // without allocating what the prefix claims.
        let mut garbage = vec![allot_statemachine::codec::FORMAT_VERSION];
        garbage.extend_from_slice(&[0xff; 9]);
        garbage.extend_from_slice(&[0x10; 64]);
        let n = garbage.len() as u64;
        let got = r
            .receive(chunk("b", 0, n, &garbage))
            .await
            .unwrap()
            .unwrap();
        assert!(got.decode().is_err());
        // Trailing bytes after a state: refused too.
        let mut long = bytes.clone();
        long.push(0);
        let n = long.len() as u64;
        let got = r.receive(chunk("c", 0, n, &long)).await.unwrap().unwrap();
        assert!(got.decode().is_err());
    }

    #[test]
    fn snapshot_chunks_within_the_declared_size_and_the_bound() {
        let committed = Some(log_id(5, 2, 10));
        let c = |offset: u64, total: u64, len: usize| {
            let mut c = chunk("a", offset, total, &vec![0; len]);
            c.meta.last_membership = crate::types::StoredMembership::new(
                Some(log_id(1, 2, 1)),
                Membership::new(vec![[1, 2, 3].into()], None),
            );
            c
        };
        assert!(check_snapshot_chunk(&c(0, 8, 8), ME, committed.as_ref()).is_ok());
        assert!(check_snapshot_chunk(&c(4, 8, 8), ME, committed.as_ref()).is_err());
        assert!(check_snapshot_chunk(&c(u64::MAX, 8, 1), ME, committed.as_ref()).is_err());
        assert!(
            check_snapshot_chunk(&c(0, SNAPSHOT_BYTES_MAX + 1, 1), ME, committed.as_ref()).is_err()
        );
    }
}
