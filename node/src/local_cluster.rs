//! A local cluster of real `allot-node` processes on loopback, and the client set-up
//! they use. Used by the integration tests, the replicated benchmark and
//! `scripts/cluster.sh` (through the same binary and flags), so they all start clusters
//! the same way.

use allot_proto::admin_client::AdminClient;
use allot_proto::StatusReply;
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};

pub struct LocalNode {
    pub id: u64,
    pub addr: String,
    pub metrics_addr: String,
    pub extra_args: Vec<String>,
    child: Option<Child>,
}

pub struct LocalCluster {
    pub dir: PathBuf,
    pub shards: u32,
    pub nodes: Vec<LocalNode>,
    /// The nodes `wait_leaders` and `leader_of` consult (the initial voters, by default
    /// every node).
    pub members: Vec<u64>,
    /// Start the nodes with `--insecure-dev-mode` (claimed identities accepted until an
    /// admin token is bootstrapped). On by default for the tests that exercise other
    /// things; the security tests turn it off.
    pub dev_mode: bool,
    /// Sent with the admin status calls once the cluster is secured.
    pub admin_token: Option<String>,
    /// A directory of `allot-node dev-certs` output: nodes serve TLS with it and the
    /// cluster's own calls (init, status) trust its CA.
    pub tls_dir: Option<PathBuf>,
    /// The peer secret every node is started with (`--peer-secret-file`, written into
    /// `dir`); `None` leaves peers unauthenticated (tests of that mode).
    pub peer_secret: Option<String>,
    bin: PathBuf,
}

/// A fresh random secret for a test cluster's peers.
pub fn random_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::from("peer-");
    for i in 0..4u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

/// A loopback port nobody listens on now, for a node started later.
///
/// A port from `bind(127.0.0.1:0)` comes from the kernel's ephemeral range, and once
/// the probe socket is closed the very same range hands out the source ports of every
/// outgoing connection (and the `bind(0)` of every other test process): under a
/// parallel test run the port can be taken before the node binds it, and the node exits
/// with "address in use". So the port is drawn at random from *below* the ephemeral
/// range (`/proc/sys/net/ipv4/ip_local_port_range`), where the kernel never allocates
/// on its own, checked free by binding it, and never handed out twice by one process.
/// If the ephemeral range leaves no room below it, the kernel's choice is used.
pub fn free_port() -> anyhow::Result<u16> {
    use std::collections::BTreeSet;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::Mutex;
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    const FLOOR: u16 = 12_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_low > FLOOR + 1_000 {
        let span = u64::from(ephemeral_low - FLOOR);
        let seed = std::collections::hash_map::RandomState::new();
        for attempt in 0u64..500 {
            let mut h = seed.build_hasher();
            h.write_u64(attempt);
            h.write_u32(std::process::id());
            let port = FLOOR + (h.finish() % span) as u16;
            let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
            if given.contains(&port) || std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            given.insert(port);
            return Ok(port);
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// The `allot-node` binary next to the running executable (tests, benches and bins of
/// this workspace are all built into the same target directory).
pub fn node_binary() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("ALLOT_NODE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    for _ in 0..2 {
        let candidate = dir.join("allot-node");
        if candidate.exists() {
            return Ok(candidate);
        }
        dir = dir.parent().map(Path::to_path_buf).unwrap_or_default();
    }
    bail!(
        "allot-node binary not found near {} (set ALLOT_NODE_BIN)",
        exe.display()
    )
}

impl LocalCluster {
    /// Lays out `n` nodes in `dir` (ports picked now); nothing is started yet.
    pub fn new(bin: PathBuf, dir: PathBuf, n: u64, shards: u32) -> anyhow::Result<LocalCluster> {
        std::fs::create_dir_all(&dir)?;
        let mut nodes = Vec::new();
        for id in 1..=n {
            nodes.push(LocalNode {
                id,
                addr: format!("127.0.0.1:{}", free_port()?),
                metrics_addr: format!("127.0.0.1:{}", free_port()?),
                extra_args: Vec::new(),
                child: None,
            });
        }
        Ok(LocalCluster {
            dir,
            shards,
            members: (1..=n).collect(),
            nodes,
            dev_mode: true,
            admin_token: None,
            tls_dir: None,
            peer_secret: Some(random_secret()),
            bin,
        })
    }

    fn node_mut(&mut self, id: u64) -> &mut LocalNode {
        &mut self.nodes[(id - 1) as usize]
    }

    pub fn node(&self, id: u64) -> &LocalNode {
        &self.nodes[(id - 1) as usize]
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.addr.clone()).collect()
    }

    /// Starts (or restarts) node `id` with its data dir under `dir/node-<id>`.
    pub fn start(&mut self, id: u64) -> anyhow::Result<()> {
        let bin = self.bin.clone();
        let dir = self.dir.join(format!("node-{id}"));
        let shards = self.shards;
        let dev_mode = self.dev_mode;
        let tls: Vec<String> = match &self.tls_dir {
            Some(d) => [
                ("--tls-cert", "node.pem"),
                ("--tls-key", "node-key.pem"),
                ("--tls-ca", "ca.pem"),
            ]
            .iter()
            .flat_map(|(flag, f)| [flag.to_string(), d.join(f).display().to_string()])
            .collect(),
            None => Vec::new(),
        };
        let log_path = self.log_path(id);
        let peer: Vec<String> = match &self.peer_secret {
            Some(secret) => {
                let f = self.dir.join("peer-secret");
                write_private(&f, secret)?;
                vec!["--peer-secret-file".into(), f.display().to_string()]
            }
            None => Vec::new(),
        };
        let n = self.node_mut(id);
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)?;
        let child = Command::new(&bin)
            .arg("run")
            .arg("--node-id")
            .arg(id.to_string())
            .arg("--listen")
            .arg(&n.addr)
            .arg("--metrics-listen")
            .arg(&n.metrics_addr)
            .arg("--data-dir")
            .arg(&dir)
            .arg("--shards")
            .arg(shards.to_string())
            .args(dev_mode.then_some("--insecure-dev-mode"))
            .args(&tls)
            .args(&peer)
            .args(&n.extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        n.child = Some(child);
        Ok(())
    }

    /// Starts every node and waits until each accepts connections; a node that exits
    /// first (a port taken, a bad flag) is an error carrying the tail of its log.
    pub fn start_all(&mut self) -> anyhow::Result<()> {
        for id in 1..=self.nodes.len() as u64 {
            self.start(id)?;
        }
        for id in 1..=self.nodes.len() as u64 {
            self.wait_listening(id, Duration::from_secs(60))?;
        }
        Ok(())
    }

    /// Waits until node `id` accepts TCP connections on its gRPC address.
    pub fn wait_listening(&mut self, id: u64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let addr: std::net::SocketAddr = self
            .node(id)
            .addr
            .parse()
            .with_context(|| format!("node {id} address"))?;
        loop {
            if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Some(status) = self.exited(id) {
                bail!(
                    "node {id} exited ({status}) before listening on {addr}; its log ends:\n{}",
                    self.log_tail(id, 10)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "node {id} is not listening on {addr} after {timeout:?}; its log ends:\n{}",
                    self.log_tail(id, 10)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The path of node `id`'s log (stdout and stderr of every start, appended).
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node-{id}")).join("node.log")
    }

    /// The last `lines` lines of node `id`'s log.
    pub fn log_tail(&self, id: u64, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut c) = self.node_mut(id).child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits up to `timeout` for a clean exit; returns the exit status
    /// (`None` if the node had to be killed or was not running).
    pub fn terminate(&mut self, id: u64, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut c = self.node_mut(id).child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id of node `id`, if it was started (and not killed) by this cluster.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.node(id).child.as_ref().map(Child::id)
    }

    /// SIGTERM without waiting (see [`exited`](Self::exited)).
    pub fn sigterm(&self, id: u64) -> bool {
        self.signal(id, "-TERM")
    }

    /// SIGSTOP: the process stays, frozen (sockets open, nothing answered).
    pub fn pause(&self, id: u64) -> bool {
        self.signal(id, "-STOP")
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self, id: u64) -> bool {
        self.signal(id, "-CONT")
    }

    fn signal(&self, id: u64, sig: &str) -> bool {
        let Some(pid) = self.pid(id) else {
            return false;
        };
        Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Whether node `id` exited by itself; reaps it and returns its exit status if so.
    pub fn exited(&mut self, id: u64) -> Option<std::process::ExitStatus> {
        let n = self.node_mut(id);
        let status = n.child.as_mut()?.try_wait().ok().flatten()?;
        n.child = None;
        Some(status)
    }

    pub fn is_running(&self, id: u64) -> bool {
        self.node(id).child.is_some()
    }

    /// Initialises every shard with all nodes as voters, through node 1.
    pub async fn init(&mut self) -> anyhow::Result<()> {
        let all: Vec<u64> = self.nodes.iter().map(|n| n.id).collect();
        self.init_members(&all).await
    }

    /// Initialises every shard with `ids` as voters, through the first of them.
    pub async fn init_members(&mut self, ids: &[u64]) -> anyhow::Result<()> {
        if ids.is_empty() {
            bail!("no members");
        }
        self.members = ids.to_vec();
        let members: Vec<(u64, String)> = ids
            .iter()
            .map(|id| (*id, self.node(*id).addr.clone()))
            .collect();
        self.admin_client()?
            .init_cluster(&members, self.shards, Duration::from_secs(20))
            .await?;
        Ok(())
    }

    /// A client of this cluster as its operator: the admin token (once secured) and
    /// the dev CA (with TLS).
    pub fn admin_client(&self) -> anyhow::Result<Client> {
        let mut b = self.client_builder()?;
        if let Some(t) = &self.admin_token {
            b = b.token(t.clone());
        }
        Ok(b.build()?)
    }

    /// A client of this cluster as [`client`] makes it, trusting the dev CA (with TLS).
    pub fn client(&self) -> anyhow::Result<Client> {
        Ok(self.client_builder()?.build()?)
    }

    fn client_builder(&self) -> anyhow::Result<allot_client::ClientBuilder> {
        let mut b = Client::builder()
            .endpoints(self.endpoints())
            .retries(u32::MAX)
            .timeout(Duration::from_secs(30))
            .attempt_timeout(Duration::from_secs(5));
        if let Some(d) = &self.tls_dir {
            b = b.tls_ca(std::fs::read(d.join("ca.pem"))?);
        }
        Ok(b)
    }

    pub async fn status(&self, id: u64) -> anyhow::Result<StatusReply> {
        Ok(self.admin_client()?.status_of(&self.node(id).addr).await?)
    }

    /// Waits until every running node sees a leader for every shard, and the leader is
    /// a running node.
    pub async fn wait_leaders(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut ok = true;
            for n in &self.nodes {
                if n.child.is_none() || !self.members.contains(&n.id) {
                    continue;
                }
                match self.status(n.id).await {
                    Ok(s) => {
                        ok &= s.shards.len() == self.shards as usize
                            && s.shards
                                .iter()
                                .all(|sh| sh.leader != 0 && self.is_running(sh.leader));
                    }
                    Err(_) => ok = false,
                }
            }
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("not every shard has a leader after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The node that leads `shard`, as node 1..n running see it.
    pub async fn leader_of(&self, shard: u32) -> anyhow::Result<u64> {
        for n in &self.nodes {
            if n.child.is_none() || !self.members.contains(&n.id) {
                continue;
            }
            if let Ok(s) = self.status(n.id).await {
                if let Some(sh) = s.shards.iter().find(|x| x.shard == shard) {
                    if sh.leader != 0 {
                        return Ok(sh.leader);
                    }
                }
            }
        }
        bail!("no leader known for shard {shard}")
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Initialises a new cluster through the client library (shard s through member
/// `s mod n`, so the first leaders are spread), retrying while nodes start.
pub async fn init_spread(members: &[(u64, String)], shards: u32) -> anyhow::Result<()> {
    client(members.iter().map(|(_, a)| a.clone()).collect())
        .init_cluster(members, shards, Duration::from_secs(20))
        .await?;
    Ok(())
}

async fn channel(addr: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .connect()
        .await?)
}

pub async fn admin(addr: &str) -> anyhow::Result<AdminClient<Channel>> {
    Ok(AdminClient::new(channel(addr).await?))
}

pub use allot_client::Client;

/// The client the tests, the benchmark and the demo use: any endpoint, leader
/// following, and retries until a 30 s deadline (request ids kept across retries).
pub fn client(endpoints: Vec<String>) -> Client {
    Client::builder()
        .endpoints(endpoints)
        .retries(u32::MAX)
        .timeout(Duration::from_secs(30))
        .attempt_timeout(Duration::from_secs(5))
        .build()
        .expect("loopback endpoints are valid")
}

/// Writes `text` to `path`, readable by its owner only, atomically (a node starting
/// meanwhile reads the old file or the new one, never a half-written one); a file
/// that already holds `text` is left alone.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::free_port;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(32_768);
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        for p in ports {
            if low > 13_000 {
                assert!(p < low, "port {p} is in the ephemeral range (from {low})");
            }
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
        }
    }
}
