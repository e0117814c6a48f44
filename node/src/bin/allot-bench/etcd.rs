//! The baseline: a 3-member etcd on loopback (fsync on, etcd's defaults) and this
//! benchmark's own load generator for it — `KV.Put` of a fixed-size value over gRPC
//! (or, with `--reads`, a serializable `KV.Range` of one key),
//! with the few etcd messages it needs declared by hand (field numbers from etcd's
//! `rpc.proto`; fields left out are skipped on decode).

use allot_node::local_cluster::free_port;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: bytes::Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: bytes::Bytes,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    #[prost(uint64, tag = "1")]
    pub cluster_id: u64,
    #[prost(uint64, tag = "2")]
    pub member_id: u64,
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

/// `KV.Range` of one key; `serializable` answers from the member's own state, without
/// a round of consensus (etcd's cheapest read).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub key: bytes::Bytes,
    #[prost(bool, tag = "7")]
    pub serializable: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RangeResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(uint64, tag = "4")]
    pub leader: u64,
}

async fn unary<Req, Resp>(ch: &Channel, path: &'static str, req: Req) -> anyhow::Result<Resp>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.context("etcd channel")?;
    let reply = grpc
        .unary(
            tonic::Request::new(req),
            http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::default(),
        )
        .await?;
    Ok(reply.into_inner())
}

/// One put; the reply's revision (> 0 once written).
pub async fn put(ch: &Channel, key: bytes::Bytes, value: bytes::Bytes) -> anyhow::Result<i64> {
    let r: PutResponse = unary(ch, "/etcdserverpb.KV/Put", PutRequest { key, value }).await?;
    Ok(r.header.map_or(0, |h| h.revision))
}

/// One serializable read of `key`; the revision the member answered at (> 0).
pub async fn get(ch: &Channel, key: bytes::Bytes) -> anyhow::Result<i64> {
    let req = RangeRequest {
        key,
        serializable: true,
    };
    let r: RangeResponse = unary(ch, "/etcdserverpb.KV/Range", req).await?;
    Ok(r.header.map_or(0, |h| h.revision))
}

async fn status(ch: &Channel) -> anyhow::Result<StatusResponse> {
    unary(ch, "/etcdserverpb.Maintenance/Status", StatusRequest {}).await
}

pub async fn connect(addr: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .connect()
        .await?)
}

/// A local etcd cluster; its members are killed when it is dropped.
pub struct EtcdCluster {
    pub client_addrs: Vec<String>,
    children: Vec<Child>,
}

impl EtcdCluster {
    /// Starts `n` members of `bin` with data under `dir`, and waits until a put commits.
    pub async fn start(bin: &Path, dir: &Path, n: usize) -> anyhow::Result<EtcdCluster> {
        let mut peers = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..n {
            peers.push(free_port()?);
            clients.push(free_port()?);
        }
        let initial: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("e{}=http://127.0.0.1:{p}", i + 1))
            .collect();
        let mut c = EtcdCluster {
            client_addrs: clients.iter().map(|p| format!("127.0.0.1:{p}")).collect(),
            children: Vec::new(),
        };
        for i in 0..n {
            let name = format!("e{}", i + 1);
            let data: PathBuf = dir.join(&name);
            std::fs::create_dir_all(&data)?;
            let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
            let peer = format!("http://127.0.0.1:{}", peers[i]);
            let client = format!("http://127.0.0.1:{}", clients[i]);
            let child = Command::new(bin)
                .args(["--name", &name, "--data-dir"])
                .arg(&data)
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-token", "allot-bench"])
                .args(["--initial-cluster-state", "new"])
                .args(["--logger", "zap", "--log-level", "warn"])
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            c.children.push(child);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(ch) = connect(&c.client_addrs[0]).await {
                if put(&ch, "ready".into(), "1".into()).await.unwrap_or(0) > 0 {
                    return Ok(c);
                }
            }
            for (i, ch) in c.children.iter_mut().enumerate() {
                if let Some(st) = ch.try_wait()? {
                    bail!(
                        "etcd member {} exited ({st}); see {}",
                        i + 1,
                        dir.join(format!("e{}.log", i + 1)).display()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "etcd did not commit a put within 60 s (logs in {})",
                    dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// The client address of the current leader: clients sent there skip a forward,
    /// etcd's best case.
    pub async fn leader(&self) -> anyhow::Result<String> {
        for addr in &self.client_addrs {
            let ch = connect(addr).await?;
            let st = status(&ch).await?;
            if st.header.map(|h| h.member_id) == Some(st.leader) && st.leader != 0 {
                return Ok(addr.clone());
            }
        }
        bail!("no etcd member says it is the leader")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
