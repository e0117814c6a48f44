//! Cluster administration through the `Admin` service: initialising a new cluster, and
//! backups of shards.

use crate::error::{Error, Result};
use crate::transport::Client;
use allot_proto::{InitRequest, Member, ShardRequest};
use allot_statemachine::backup::ShardBackup;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
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
        let mut through = BTreeMap::new();
        for (i, (id, addr)) in members.iter().enumerate() {
            let mine: Vec<u32> = (0..shards)
                .filter(|s| *s as usize % members.len() == i)
                .collect();
            if mine.is_empty() {
                continue;
            }
            self.init_through(addr, &voters, &mine, deadline).await?;
            through.extend(mine.into_iter().map(|s| (s, *id)));
        }
        Ok(through)
    }

    async fn init_through(
        &self,
        addr: &str,
        voters: &[Member],
        shards: &[u32],
        deadline: Instant,
    ) -> Result<()> {
        loop {
            let req = self.grpc_request(InitRequest {
                members: voters.to_vec(),
                shards: shards.to_vec(),
            });
            match self.admin_at(addr)?.init(req).await {
                Ok(_) => return Ok(()),
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
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
    /// audit rows), verified here before it is returned. Asked of the shard's leader
    /// first (its copy is the most recent: a follower's may lag), then of each endpoint
    /// in turn: a replica that caught up from a snapshot lacks part of the audit trail and
    /// declines, and an unreachable one, or one whose copy does not verify, is skipped.
    /// The deadline is per replica and grows with the state (`attempt_timeout` × 10: the
    /// copy is encoded whole).
    pub async fn backup(&self, shard: u32) -> Result<ShardBackup> {
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
            match self.backup_from(addr, shard).await {
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

    async fn backup_from(&self, addr: &str, shard: u32) -> Result<ShardBackup, BackupAttempt> {
        let req = self.request(ShardRequest { shard }, self.attempt_timeout() * 10);
        let mut chunks = match self
            .admin_at(addr)
            .map_err(BackupAttempt::Final)?
            .backup(req)
            .await
        {
            Ok(s) => s.into_inner(),
            Err(s) => {
                let e = Error::from_status(&s);
                return Err(match s.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        BackupAttempt::Next(e.to_string(), reason_of(&s))
                    }
                    _ => BackupAttempt::Final(e),
                });
            }
        };
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(c) => bytes.extend_from_slice(&c.data),
                Err(s) => {
                    return Err(BackupAttempt::Next(
                        Error::from_status(&s).to_string(),
                        reason_of(&s),
                    ))
                }
            }
        }
        let backup =
            ShardBackup::decode(&bytes).map_err(|e| BackupAttempt::Next(e.to_string(), None))?;
        backup
            .verify()
            .map_err(|e| BackupAttempt::Next(format!("the copy does not verify: {e}"), None))?;
        Ok(backup)
    }
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
