//! The cluster under test: `n` real `allot-node` processes on loopback, each with its
//! own data dir, every peer dial routed (`--peer-route`) through the proxy of its
//! directed link, and the fault operations the nemeses use. Clients dial the nodes
//! directly.

use crate::proxy::{Cut, Link};
use allot_client::Client;
use allot_node::local_cluster::{admin, LocalCluster};
use allot_proto::{ChangeMembershipRequest, Member, MemberRequest, ShardRequest};
use allot_statemachine::query::{Answer, Query};
use anyhow::{bail, Context};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub struct Cluster {
    pub lc: LocalCluster,
    pub links: BTreeMap<(u64, u64), Link>,
    pub n: u64,
    pub shards: u32,
    /// Base arguments of each node (routes, timings), without the clock offset.
    base_args: BTreeMap<u64, Vec<String>>,
    pub clock_offsets: BTreeMap<u64, i64>,
    /// The node whose RocksDB directory is a small tmpfs (disk-fault nemesis), if any.
    /// Only the database is on it: the node's log stays on the real disk, so a full
    /// disk cannot hide what the node logged.
    pub disk_node: Option<u64>,
    pub tmpfs: Option<PathBuf>,
    /// Current voters (membership nemesis removes and re-adds one).
    pub voters: Vec<u64>,
}

/// Timings for a small loaded machine: faster elections than the defaults so faults
/// heal within a few seconds.
const NODE_ARGS: &[&str] = &[
    "--heartbeat-ms",
    "100",
    "--election-min-ms",
    "800",
    "--election-max-ms",
    "1600",
    "--worker-threads",
    "2",
    "--tick-ms",
    "500",
];

fn check_binary(bin: &Path) -> anyhow::Result<()> {
    let meta = std::fs::metadata(bin)
        .with_context(|| format!("node binary {} is not reachable", bin.display()))?;
    if !meta.is_file() {
        bail!("node binary {} is not a file", bin.display());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o111 == 0 {
            bail!("node binary {} is not executable", bin.display());
        }
    }
    let out = std::process::Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", bin.display()))?;
    if !out.status.success() {
        bail!(
            "{} --version failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Cluster {
    /// Lays out and starts the cluster, initialises it and waits for leaders. On
    /// failure the error says why (with the tail of each node's log).
    pub async fn start(
        bin: PathBuf,
        dir: PathBuf,
        n: u64,
        shards: u32,
        extra_args: &[String],
        disk_node: Option<(u64, u64)>,
    ) -> anyhow::Result<Cluster> {
        check_binary(&bin)?;
        // Proxy ports first: the nodes' ports are picked afterwards, so they differ.
        let mut listeners = Vec::new();
        for _ in 0..n * (n - 1) {
            listeners.push(std::net::TcpListener::bind("127.0.0.1:0")?);
        }
        let lc = LocalCluster::new(bin, dir.clone(), n, shards)?;
        let mut links = BTreeMap::new();
        for i in 1..=n {
            for j in 1..=n {
                if i != j {
                    let l = listeners.pop().expect("one listener per link");
                    let link = Link::start_on(l, i, j, lc.node(j).addr.clone())?;
                    links.insert((i, j), link);
                }
            }
        }
        let mut base_args = BTreeMap::new();
        for i in 1..=n {
            let mut args: Vec<String> = NODE_ARGS.iter().map(|s| s.to_string()).collect();
            args.extend(extra_args.iter().cloned());
            args.push("--test-fsync-fail-file".into());
            args.push(fsync_fail_file(&dir, i).display().to_string());
            args.push("--test-clock-offset-file".into());
            args.push(clock_offset_file(&dir, i).display().to_string());
            for j in 1..=n {
                if i != j {
                    args.push("--peer-route".into());
                    args.push(format!("{}={}", lc.node(j).addr, links[&(i, j)].listen));
                }
            }
            base_args.insert(i, args);
        }
        let mut tmpfs = None;
        if let Some((node, mb)) = disk_node {
            let path = dir.join(format!("node-{node}")).join("db");
            std::fs::create_dir_all(&path)?;
            let mounted = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "tmpfs"])
                .arg(&path)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|st| st.success());
            if mounted {
                tmpfs = Some(path);
            } else {
                eprintln!(
                    "note: cannot mount a {mb} MiB tmpfs at {} (needs root): the disk nemesis \
                     injects fsync failures only, no ENOSPC",
                    path.display()
                );
            }
        }
        let mut c = Cluster {
            lc,
            links,
            n,
            shards,
            base_args,
            clock_offsets: BTreeMap::new(),
            disk_node: disk_node.filter(|_| tmpfs.is_some()).map(|d| d.0),
            tmpfs,
            voters: (1..=n).collect(),
        };
        for id in 1..=n {
            c.apply_args(id);
        }
        c.lc.start_all().context("the cluster did not start")?;
        let up = async {
            c.lc.init().await.context("initialising the cluster")?;
            c.lc.wait_leaders(Duration::from_secs(40))
                .await
                .context("waiting for leaders")
        };
        if let Err(e) = up.await {
            let mut why = format!("{e:#}");
            for id in 1..=n {
                if let Some(st) = c.lc.exited(id) {
                    why.push_str(&format!("\nnode {id} exited: {st}"));
                }
                why.push_str(&format!("\nnode {id} log tail:\n{}", c.log_tail(id, 5)));
            }
            bail!("the cluster did not start: {why}");
        }
        Ok(c)
    }

    fn apply_args(&mut self, id: u64) {
        let mut args = self.base_args[&id].clone();
        if let Some(o) = self.clock_offsets.get(&id) {
            args.push(format!("--test-clock-offset-ms={o}"));
        }
        self.lc.nodes[(id - 1) as usize].extra_args = args;
    }

    /// The size of node `id`'s log now (to read only what it logs after a point).
    pub fn log_len(&self, id: u64) -> u64 {
        std::fs::metadata(self.lc.log_path(id)).map_or(0, |m| m.len())
    }

    /// What node `id` logged after byte `from` of its log.
    pub fn log_since(&self, id: u64, from: u64) -> String {
        let bytes = std::fs::read(self.lc.log_path(id)).unwrap_or_default();
        String::from_utf8_lossy(bytes.get(from as usize..).unwrap_or_default()).into_owned()
    }

    pub fn log_tail(&self, id: u64, lines: usize) -> String {
        self.lc.log_tail(id, lines)
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.lc.endpoints()
    }

    pub fn is_running(&self, id: u64) -> bool {
        self.lc.is_running(id)
    }

    pub fn kill(&mut self, id: u64) {
        self.lc.kill(id);
    }

    pub fn restart(&mut self, id: u64) -> anyhow::Result<()> {
        if !self.lc.is_running(id) {
            self.apply_args(id);
            self.lc.start(id)?;
        }
        Ok(())
    }

    pub fn pause(&self, id: u64) -> bool {
        self.lc.pause(id)
    }

    pub fn resume(&self, id: u64) -> bool {
        self.lc.resume(id)
    }

    /// Restarts node `id` (SIGTERM, then start) with a new wall-clock offset.
    pub fn set_clock(&mut self, id: u64, offset_ms: i64) -> anyhow::Result<()> {
        if offset_ms == 0 {
            self.clock_offsets.remove(&id);
        } else {
            self.clock_offsets.insert(id, offset_ms);
        }
        self.lc.terminate(id, Duration::from_secs(5));
        self.restart(id)
    }

    /// Cuts every link between nodes in different groups (both directions).
    pub fn partition(&self, groups: &[Vec<u64>], how: Cut) {
        let group_of = |id: u64| groups.iter().position(|g| g.contains(&id));
        for ((a, b), link) in &self.links {
            if group_of(*a) != group_of(*b) {
                link.cut(how);
            }
        }
    }

    /// Cuts the links between each listed pair (both directions).
    pub fn cut_pairs(&self, pairs: &[(u64, u64)], how: Cut) {
        for (a, b) in pairs {
            for key in [(*a, *b), (*b, *a)] {
                if let Some(l) = self.links.get(&key) {
                    l.cut(how);
                }
            }
        }
    }

    pub fn heal(&self) {
        for l in self.links.values() {
            l.heal();
            l.set_delay(0);
        }
    }

    pub fn set_delay(&self, ms: u64) {
        for l in self.links.values() {
            l.set_delay(ms);
        }
    }

    /// The leader of `shard` as the running voters see it.
    pub async fn leader_of(&self, shard: u32) -> Option<u64> {
        self.lc.leader_of(shard).await.ok()
    }

    /// Removes `id` from every shard's voters (through any node that answers).
    pub async fn remove_voter(&mut self, id: u64) -> anyhow::Result<()> {
        let voters: Vec<u64> = self.voters.iter().copied().filter(|v| *v != id).collect();
        self.change_voters(voters).await
    }

    /// Adds `id` back as a learner of every shard, then promotes it to voter.
    pub async fn readd_voter(&mut self, id: u64) -> anyhow::Result<()> {
        let addr = self.lc.node(id).addr.clone();
        self.admin_call(|mut a| {
            let addr = addr.clone();
            async move {
                a.add_learner(MemberRequest {
                    shard: 0,
                    all_shards: true,
                    member: Some(Member { node_id: id, addr }),
                })
                .await
                .map(drop)
            }
        })
        .await
        .context("adding the learner")?;
        let mut voters = self.voters.clone();
        voters.push(id);
        voters.sort_unstable();
        self.change_voters(voters).await
    }

    async fn change_voters(&mut self, voters: Vec<u64>) -> anyhow::Result<()> {
        let v = voters.clone();
        self.admin_call(|mut a| {
            let v = v.clone();
            async move {
                a.change_membership(ChangeMembershipRequest {
                    shard: 0,
                    all_shards: true,
                    voters: v,
                    allow_audit_loss: false,
                    // The harness is the only one changing membership, on every shard.
                    expected_membership_index: None,
                })
                .await
                .map(drop)
            }
        })
        .await
        .context("changing membership")?;
        self.voters = voters.clone();
        self.lc.members = voters;
        Ok(())
    }

    /// Runs an admin call through the running voters in turn until one succeeds
    /// (bounded: 20 s).
    async fn admin_call<F, Fut>(&self, call: F) -> anyhow::Result<()>
    where
        F: Fn(allot_proto::admin_client::AdminClient<tonic_channel::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<(), tonic_channel::Status>>,
    {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = String::from("no running voter");
        while Instant::now() < deadline {
            for id in &self.voters {
                if !self.is_running(*id) {
                    continue;
                }
                let Ok(a) = admin(&self.lc.node(*id).addr).await else {
                    continue;
                };
                match tokio::time::timeout(Duration::from_secs(8), call(a)).await {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(s)) => last = format!("node {id}: {}", s.message()),
                    Err(_) => last = format!("node {id}: timed out"),
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        bail!("{last}")
    }

    /// Fills the disk-fault node's tmpfs (leaving nothing free).
    pub fn fill_disk(&self) -> anyhow::Result<u64> {
        let Some(dir) = &self.tmpfs else {
            bail!("no disk-fault node");
        };
        use std::io::Write;
        let mut f = std::fs::File::create(dir.join("filler"))?;
        let chunk = vec![0u8; 1 << 20];
        let mut written = 0u64;
        for _ in 0..4096 {
            match f.write(&chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => written += n as u64,
            }
        }
        let _ = f.sync_all();
        Ok(written)
    }

    /// The file node `id` reads its run-time clock offset from.
    pub fn clock_file(&self, id: u64) -> PathBuf {
        clock_offset_file(self.lc.dir.as_path(), id)
    }

    /// Sets (`Some`) or clears node `id`'s run-time clock offset (no restart).
    pub fn write_clock(&self, id: u64, offset_ms: Option<i64>) {
        let f = self.clock_file(id);
        match offset_ms {
            Some(o) => {
                let _ = std::fs::write(&f, format!("{o}\n"));
            }
            None => {
                let _ = std::fs::remove_file(&f);
            }
        }
    }

    /// Makes node `id`'s WAL fsyncs fail (`on`) or succeed again.
    pub fn fail_fsync(&self, id: u64, on: bool) {
        let f = fsync_fail_file(self.lc.dir.as_path(), id);
        if on {
            let _ = std::fs::write(&f, b"injected by allot-jepsen\n");
        } else {
            let _ = std::fs::remove_file(&f);
        }
    }

    pub fn free_disk(&self) {
        if let Some(dir) = &self.tmpfs {
            let _ = std::fs::remove_file(dir.join("filler"));
        }
    }

    /// After the faults: every running member's replica of every shard reaches the same
    /// applied index with the same state hash, and passes the invariant check
    /// (conservation included). Bounded by `timeout`.
    pub async fn replicas_agree(
        &self,
        client: &Client,
        timeout: Duration,
    ) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        let mut checked = 0;
        for shard in 0..self.shards {
            let got = loop {
                let mut got: Vec<(u64, Vec<u8>, u64)> = Vec::new();
                let mut running = 0;
                for id in &self.voters {
                    if !self.is_running(*id) {
                        continue;
                    }
                    running += 1;
                    if let Ok(mut a) = admin(&self.lc.node(*id).addr).await {
                        if let Ok(r) = a.shard_hash(ShardRequest { shard }).await {
                            let r = r.into_inner();
                            got.push((*id, r.state_hash, r.applied_index));
                        }
                    }
                }
                if running > 0 && got.len() == running && got.windows(2).all(|w| w[0].2 == w[1].2) {
                    break got;
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "shard {shard}: replicas never reached one applied index: {:?}",
                        got.iter().map(|g| (g.0, g.2)).collect::<Vec<_>>()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            for w in got.windows(2) {
                if w[0].1 != w[1].1 {
                    return Err(format!(
                        "shard {shard}: nodes {} and {} hold different states at index {}",
                        w[0].0, w[1].0, w[0].2
                    ));
                }
            }
            for id in &self.voters {
                if !self.is_running(*id) {
                    continue;
                }
                match client
                    .query_replica(&self.lc.node(*id).addr, shard, &Query::Invariants)
                    .await
                {
                    Ok(Answer::Invariants(Ok(()))) => checked += 1,
                    Ok(Answer::Invariants(Err(v))) => {
                        return Err(format!("node {id} shard {shard}: invariant violated: {v}"))
                    }
                    other => return Err(format!("node {id} shard {shard}: invariants: {other:?}")),
                }
            }
        }
        Ok(format!(
            "{} shard(s): same state hash on every member at one index; invariants hold on {checked} replica(s)",
            self.shards
        ))
    }

    /// Ends every fault: resumes, restarts, heals links, clears clock offsets of nodes
    /// (restarting them), frees the disk and re-adds removed voters.
    pub async fn heal_all(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        self.heal();
        for id in 1..=self.n {
            self.resume(id);
        }
        self.free_disk();
        for id in 1..=self.n {
            if let Some(st) = self.lc.exited(id) {
                notes.push(format!("node {id} had exited: {st}"));
            }
            if !self.is_running(id) {
                if let Err(e) = self.restart(id) {
                    notes.push(format!("restarting node {id}: {e:#}"));
                }
            }
        }
        for id in 1..=self.n {
            self.write_clock(id, None);
        }
        let skewed: Vec<u64> = self.clock_offsets.keys().copied().collect();
        for id in skewed {
            if let Err(e) = self.set_clock(id, 0) {
                notes.push(format!("resetting the clock of node {id}: {e:#}"));
            }
        }
        for id in 1..=self.n {
            if !self.voters.contains(&id) {
                if let Err(e) = self.readd_voter(id).await {
                    notes.push(format!("re-adding node {id}: {e:#}"));
                }
            }
        }
        if let Err(e) = self.lc.wait_leaders(Duration::from_secs(40)).await {
            notes.push(format!("after healing: {e:#}"));
        }
        notes
    }

    pub fn voter_set(&self) -> BTreeSet<u64> {
        self.voters.iter().copied().collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for id in 1..=self.n {
            self.lc.resume(id);
            self.lc.kill(id);
        }
        if let Some(p) = &self.tmpfs {
            let _ = std::process::Command::new("umount").arg(p).status();
        }
    }
}

/// The tonic types the admin client uses.
mod tonic_channel {
    pub use tonic::transport::Channel;
    pub use tonic::Status;
}

/// The file whose existence makes node `id`'s fsyncs fail (outside its data dir, so a
/// full disk cannot stop the harness from creating or removing it).
fn fsync_fail_file(dir: &std::path::Path, id: u64) -> PathBuf {
    dir.join(format!("node-{id}.fail-fsync"))
}

/// The file holding node `id`'s run-time clock offset (`--test-clock-offset-file`).
fn clock_offset_file(dir: &std::path::Path, id: u64) -> PathBuf {
    dir.join(format!("node-{id}.clock-offset"))
}
