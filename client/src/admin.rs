//! Cluster administration through the `Admin` service: initialising a new cluster, and
//! backups of shards.

use crate::error::{Error, Result};
use crate::transport::Client;
use allot_proto::{InitRequest, Member, ShardRequest};
use allot_statemachine::backup::{BackupHeader, BackupReader, BackupSummary, ShardBackup};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;

impl Client {
    /// A request for a raw gRPC call (e.g. on [`Client::admin_at`]) carrying this
    /// client's token and attempt deadline.
    pub fn grpc_request<T>(&self, msg: T) -> tonic::Request<T> {
        self.request(msg, self.attempt_timeout())
    }

    /// Initialises every shard of a new cluster with `members` (node id, address) as
    /// voters: shard `s` through member `s mod n`, so the first leaders are spread over
    /// the members. Retried while nodes start, until `wait` has passed; idempotent (an
    /// initialised shard accepts the same init again). Returns shard → the member it was
    /// initialised through.
    pub async fn init_cluster(
        &self,
        members: &[(u64, String)],
        shards: u32,
        wait: Duration,
    ) -> Result<BTreeMap<u32, u64>> {
        if members.is_empty() {
            return Err(Error::Config("no members".into()));
        }
        let deadline = Instant::now() + wait;
        let voters: Vec<Member> = members
            .iter()
            .map(|(id, addr)| Member {
                node_id: *id,
                addr: addr.clone(),
            })
            .collect();
        // One id for the new cluster, sent with every shard's init (DESIGN §68): the one
        // a member already has (an earlier init that did not finish), or a new random
        // one — so a node left from an earlier cluster on these addresses is not a peer.
        let mut cluster_id = String::new();
        let mut held: Vec<(u64, String)> = Vec::new();
        for (id, addr) in members {
            if let Ok(s) = self.status_of(addr).await {
                if !s.cluster_id.is_empty() {
                    held.push((*id, s.cluster_id.clone()));
                    cluster_id = s.cluster_id;
                }
            }
        }
        if held.iter().any(|(_, c)| *c != cluster_id) {
            return Err(Error::Config(format!(
                "the members belong to different clusters ({}): a new cluster's members \
                 must be empty, or of one earlier init of it",
                held.iter()
                    .map(|(id, c)| format!("node {id}: {c}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if cluster_id.is_empty() {
            let mut b = [0u8; 16];
            getrandom::fill(&mut b).map_err(|e| Error::Config(format!("no OS randomness: {e}")))?;
            cluster_id = b.iter().map(|x| format!("{x:02x}")).collect();
        }
        let mut through = BTreeMap::new();
        for (i, (id, addr)) in members.iter().enumerate() {
            let mine: Vec<u32> = (0..shards)
                .filter(|s| *s as usize % members.len() == i)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let theirs = self
                .init_through(addr, &voters, &mine, &cluster_id, deadline)
                .await?;
            // A node that already belonged to another cluster (its shards initialised,
            // so nothing to refuse there): said, not taken for success.
            if !theirs.is_empty() && theirs != cluster_id {
                return Err(Error::Config(format!(
                    "node {id} ({addr}) belongs to cluster {theirs}, not to {cluster_id}: it \
                     holds another cluster's data (empty its data dir), or an earlier init \
                     of this one chose that id (run init again once every member is up)"
                )));
            }
            through.extend(mine.into_iter().map(|s| (s, *id)));
        }
        Ok(through)
    }

    async fn init_through(
        &self,
        addr: &str,
        voters: &[Member],
        shards: &[u32],
        cluster_id: &str,
        deadline: Instant,
    ) -> Result<String> {
        loop {
            let req = self.grpc_request(InitRequest {
                members: voters.to_vec(),
                shards: shards.to_vec(),
                cluster_id: cluster_id.to_string(),
            });
            match self.admin_at(addr)?.init(req).await {
                Ok(r) => return Ok(r.into_inner().cluster_id),
                // A bad argument, or a node of another cluster: a retry changes nothing.
                Err(s)
                    if s.code() == tonic::Code::InvalidArgument
                        || (s.code() == tonic::Code::FailedPrecondition
                            && s.metadata()
                                .get(allot_proto::meta::REASON)
                                .is_some_and(|r| r == "OTHER_CLUSTER")) =>
                {
                    return Err(Error::from_status(&s))
                }
                Err(s) if Instant::now() >= deadline => {
                    return Err(Error::Unavailable {
                        attempts: 0,
                        elapsed: Duration::ZERO,
                        last: format!("init through {addr}: {:?}: {}", s.code(), s.message()),
                        cause: None,
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// A consistent copy of one shard (state at an applied index, Raft position, voters,
    /// audit rows), verified here before it is returned, whole in memory (small shards
    /// and tests; [`Client::backup_to_file`] streams). Replicas are asked as
    /// [`Client::backup_to_file`] asks them.
    pub async fn backup(&self, shard: u32) -> Result<ShardBackup> {
        self.ask_replicas(shard, async |addr: String| {
            let mut chunks = self.open_backup(&addr, shard).await?;
            let mut bytes = Vec::new();
            while let Some(c) = self.next_chunk(&mut chunks).await? {
                bytes.extend_from_slice(&c);
            }
            let backup = ShardBackup::decode(&bytes)
                .map_err(|e| BackupAttempt::Next(e.to_string(), None))?;
            backup
                .verify()
                .map_err(|e| BackupAttempt::Next(format!("the copy does not verify: {e}"), None))?;
            Ok(backup)
        })
        .await
    }

    /// Streams a consistent copy of one shard into the file `path`, never holding it
    /// whole: the chunks are written to `<path>.partial` as they arrive, synced, read
    /// back and checked as a stream (checksum, state hash, audit chain from genesis to the
    /// state's head, commands against their events), then renamed to `path`. The
    /// decoded-state checks (invariants, the state against its header) are `backup
    /// verify`'s and the restore's.
    ///
    /// Asked of the shard's leader first (its copy is the most recent: a follower's may
    /// lag), then of each endpoint in turn: a replica that lacks part of the audit trail
    /// declines (`AUDIT_GAP`), and an unreachable one, or one whose copy does not verify,
    /// is skipped. No deadline bounds the whole copy (it grows with the shard); a stream
    /// idle for `attempt_timeout` × 10 is given up on.
    pub async fn backup_to_file(&self, shard: u32, path: &Path) -> Result<SavedBackup> {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let local = |e: std::io::Error, what: &Path| {
            BackupAttempt::Final(Error::Local(format!("{}: {e}", what.display())))
        };
        let saved = self
            .ask_replicas(shard, async |addr: String| {
                let mut chunks = self.open_backup(&addr, shard).await?;
                let mut file = tokio::fs::File::create(&partial)
                    .await
                    .map_err(|e| local(e, &partial))?;
                let mut bytes = 0u64;
                while let Some(c) = self.next_chunk(&mut chunks).await? {
                    file.write_all(&c).await.map_err(|e| local(e, &partial))?;
                    bytes += c.len() as u64;
                }
                file.sync_all().await.map_err(|e| local(e, &partial))?;
                drop(file);
                let check = partial.clone();
                let (header, summary) = tokio::task::spawn_blocking(move || read_stream(&check))
                    .await
                    .map_err(|e| BackupAttempt::Final(Error::Local(e.to_string())))?
                    .map_err(|e| {
                        BackupAttempt::Next(format!("the copy does not verify: {e}"), None)
                    })?;
                Ok(SavedBackup {
                    header,
                    summary,
                    bytes,
                })
            })
            .await;
        let saved = match saved {
            Ok(s) => s,
            Err(e) => {
                let _ = tokio::fs::remove_file(&partial).await;
                return Err(e);
            }
        };
        tokio::fs::rename(&partial, path)
            .await
            .map_err(|e| Error::Local(format!("{}: {e}", path.display())))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = tokio::fs::File::open(dir).await {
                let _ = d.sync_all().await;
            }
        }
        Ok(saved)
    }

    /// Hands `shard`'s leadership to voter `to` (`None`: the most up-to-date other one)
    /// without an unplanned election (`Admin.TransferLeader`, asked of the leader; see
    /// docs/DESIGN.md §49). Writes wait (callers retry) for the transfer's few hundred
    /// milliseconds. Retried, until the client's timeout, while the shard has no leader
    /// or its leader changes under the call.
    pub async fn transfer_leader(
        &self,
        shard: u32,
        to: Option<u64>,
    ) -> Result<allot_proto::TransferLeaderReply> {
        let deadline = Instant::now() + self.timeout();
        loop {
            let last = match self.leader_addr(shard).await {
                None => "no leader".to_string(),
                Some(addr) => {
                    let req = self.request(
                        allot_proto::TransferLeaderRequest {
                            shard,
                            to: to.unwrap_or(0),
                        },
                        self.attempt_timeout().max(Duration::from_secs(15)),
                    );
                    match self.admin_at(&addr)?.transfer_leader(req).await {
                        Ok(r) => return Ok(r.into_inner()),
                        Err(s) if reason_of(&s).as_deref() == Some("NOT_LEADER") => {
                            s.message().to_string()
                        }
                        Err(s) => return Err(Error::from_status(&s)),
                    }
                }
            };
            if Instant::now() >= deadline {
                return Err(Error::Unavailable {
                    attempts: 0,
                    elapsed: self.timeout(),
                    last,
                    cause: None,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Tries `attempt` on the shard's leader, then on every other endpoint, until one
    /// succeeds or fails finally.
    async fn ask_replicas<T>(
        &self,
        shard: u32,
        mut attempt: impl AsyncFnMut(String) -> Result<T, BackupAttempt>,
    ) -> Result<T> {
        let mut order: Vec<String> = Vec::new();
        if let Some(leader) = self.leader_addr(shard).await {
            order.push(leader);
        }
        for e in self.endpoints() {
            if !order.contains(e) {
                order.push(e.clone());
            }
        }
        let mut last = String::from("no endpoints");
        let mut cause = None;
        for addr in &order {
            match attempt(addr.clone()).await {
                Ok(b) => return Ok(b),
                Err(BackupAttempt::Final(e)) => return Err(e),
                Err(BackupAttempt::Next(why, reason)) => {
                    last = format!("{addr}: {why}");
                    cause = reason;
                }
            }
        }
        Err(Error::Unavailable {
            attempts: order.len() as u32,
            elapsed: Duration::ZERO,
            last,
            cause,
        })
    }

    /// The address of the shard's leader as the first answering endpoint sees it.
    async fn leader_addr(&self, shard: u32) -> Option<String> {
        for e in self.endpoints() {
            if let Ok(status) = self.status_of(e).await {
                return status
                    .shards
                    .into_iter()
                    .find(|s| s.shard == shard && s.leader != 0)
                    .map(|s| s.leader_addr)
                    .filter(|a| !a.is_empty());
            }
        }
        None
    }

    async fn open_backup(
        &self,
        addr: &str,
        shard: u32,
    ) -> Result<tonic::Streaming<allot_proto::BackupChunk>, BackupAttempt> {
        let req = self.authorized(ShardRequest { shard });
        let mut admin = self.admin_at(addr).map_err(BackupAttempt::Final)?;
        let call = admin.backup(req);
        match tokio::time::timeout(self.backup_idle(), call).await {
            Ok(Ok(s)) => Ok(s.into_inner()),
            Ok(Err(s)) => {
                let e = Error::from_status(&s);
                Err(match s.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        BackupAttempt::Next(e.to_string(), reason_of(&s))
                    }
                    _ => BackupAttempt::Final(e),
                })
            }
            Err(_) => Err(BackupAttempt::Next("no answer".into(), None)),
        }
    }

    /// The next chunk of a backup stream (`None`: complete).
    async fn next_chunk(
        &self,
        chunks: &mut tonic::Streaming<allot_proto::BackupChunk>,
    ) -> Result<Option<Vec<u8>>, BackupAttempt> {
        match tokio::time::timeout(self.backup_idle(), chunks.next()).await {
            Ok(None) => Ok(None),
            Ok(Some(Ok(c))) => Ok(Some(c.data)),
            Ok(Some(Err(s))) => Err(BackupAttempt::Next(
                Error::from_status(&s).to_string(),
                reason_of(&s),
            )),
            Err(_) => Err(BackupAttempt::Next(
                format!("the stream stalled for {:?}", self.backup_idle()),
                None,
            )),
        }
    }

    fn backup_idle(&self) -> Duration {
        self.attempt_timeout() * 10
    }
}

/// A backup written to a file by [`Client::backup_to_file`].
#[derive(Clone, Debug)]
pub struct SavedBackup {
    pub header: BackupHeader,
    pub summary: BackupSummary,
    pub bytes: u64,
}

/// Reads a backup file as a stream, with the checks that need no decoded state.
pub fn read_stream(
    path: &Path,
) -> std::result::Result<(BackupHeader, BackupSummary), allot_statemachine::backup::BackupError> {
    use allot_statemachine::backup::BackupError;
    let file = std::fs::File::open(path)
        .map_err(|e| BackupError::Io(format!("{}: {e}", path.display())))?;
    let mut reader = BackupReader::open(std::io::BufReader::with_capacity(1 << 20, file))?;
    while reader.next_item()?.is_some() {}
    let summary = reader.summary().cloned().ok_or(BackupError::Truncated)?;
    Ok((reader.header().clone(), summary))
}

/// How one replica's backup attempt ended: try the next replica, or give up (refused:
/// no admin rights, unknown shard).
enum BackupAttempt {
    /// Try the next replica: why this one failed, and the node's reason if it gave one.
    Next(String, Option<String>),
    Final(Error),
}

/// The node's reason for a refusal (`allot-reason` metadata), if any.
fn reason_of(s: &tonic::Status) -> Option<String> {
    s.metadata()
        .get(allot_proto::meta::REASON)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}
