//! The GPU node agent: registers a GPU node, watches the jobs the scheduler places on it,
//! runs each attempt, heartbeats its progress and last checkpoint, forwards preemption,
//! and reports the exit. The `allot-agent` binary is a thin shell around [`run`].
//!
//! # Running jobs
//!
//! A [`JobSpec`](allot_statemachine::JobSpec) carries no command: the platform keeps the
//! job payloads. The agent therefore starts one configured *job runner* for every attempt
//! ([`Mode::Run`]), in its own process group, with a **clean environment** — none of the
//! agent's own variables (its tokens above all) reach the job's code; only
//! [`AgentConfig::runner_env`] (by default `PATH`, `HOME`, `USER`, `LOGNAME`, `LANG`,
//! `LC_ALL`, `TZ`, `TMPDIR`) and the job's. It runs as the agent's user, the one
//! `--runner-user`, or (`--runner-uid-range`, the `uids` module) a uid of its own per
//! attempt, with its own `HOME` and `TMPDIR`, swept of every process when the attempt
//! ends:
//!
//! - `CUDA_VISIBLE_DEVICES` — the assigned GPU indices, comma-separated (`0,3`);
//! - `ALLOT_JOB_ID`, `ALLOT_ATTEMPT` — the job and its attempt (the fencing token);
//! - `ALLOT_PROGRESS_FILE` — a per-attempt file in the work directory into which the
//!   runner writes `"<progress_ppm> <checkpoint_number>"` (e.g. `500000 3`). The agent
//!   reads it before every heartbeat; a missing or garbled file keeps the last values
//!   (write a temporary file and rename it over this one to avoid torn reads).
//!
//! The runner's stdout and stderr go to `job-<id>.<attempt>.log` in the work directory.
//! [`Mode::Simulate`] runs no process: a timer fakes each job (see [`SimConfig`]).
//!
//! # What the agent does in each job state
//!
//! - **Placed / Running**, not running here: start the attempt, heartbeat at once (the
//!   first accepted heartbeat moves the job to Running) and then every
//!   [`AgentConfig::heartbeat_interval`]. Heartbeats carry no client time; `seq` is
//!   strictly increasing per attempt. A heartbeat the shard does not accept (a seq at or
//!   below one it has seen: an earlier agent process ran this attempt) makes the agent
//!   jump its seq ahead until one is accepted.
//! - **The runner exits on its own**: `FinishJob { success: exit status == 0 }` at once
//!   (no heartbeat after the exit) — as `FinishJobAt`, which also says how
//!   long after the newest accepted heartbeat's send the attempt's last process was gone,
//!   so a report delayed by a partition does not bill the partition (rule version 6; a
//!   shard below it refuses that command unrecorded, and the report goes again as
//!   `FinishJob` under the same request id).
//! - **Preempting**: SIGTERM to the runner's process group; heartbeats continue during
//!   the grace period (a checkpoint written on SIGTERM is reported, and the preempted
//!   attempt is billed up to it); after [`AgentConfig::grace`] SIGKILL — or sooner:
//!   the shard's grace less the fence margin (at most a quarter of it), since the
//!   shard's grace began at the preemption's entry, before the agent saw it, and at its
//!   end the cluster gives the GPUs to the preemptor. A heartbeat or a confirming read
//!   on its way never holds that SIGKILL back. Once it has
//!   stopped, one last heartbeat, then `FinishJob { success: false }` — which the state
//!   machine takes, while Preempting, as "stopped for preemption" and requeues the job.
//!   A runner that exits 0 after the SIGTERM is still reported as `success: false` (it
//!   stopped because it was asked to; `success: true` would end the job as Succeeded).
//!   A Preempting attempt this agent is not running (the agent restarted) is reported
//!   stopped at once.
//! - **Gone from the assignment set** (cancelled, ended by a lease or the grace timer,
//!   requeued): confirmed with a linearizable query (a lagging replica's stream must not
//!   kill a live job), then SIGKILL at once; no finish is reported. A query that fails
//!   confirms nothing: the runner keeps running, and its heartbeats or the fence decide.
//! - **A newer attempt** of a running job (fencing): SIGKILL at once, then the new
//!   attempt starts. A set showing an *older* attempt is a stale view and is ignored.
//! - **Heartbeat answered with `stop`** (out of credits: the hold is settled and the job
//!   ended) or refused with `StaleAttempt`, `JobFinished`, `JobNotPlaced`, `UnknownJob`:
//!   SIGKILL at once; no finish is reported (the job has already moved on).
//! - An attempt that has ended here is never started again by this agent process.
//! - An attempt placed on a GPU that a runner of this agent still holds (the cluster
//!   freed it when it ended that runner's job, and the runner is still being confirmed
//!   gone and killed) starts once that runner is gone: two runners never share a GPU
//!   (but a runner stuck in the kernel gives its GPUs up 10 s after its SIGKILL).
//!
//! # Fencing: a job never runs on two nodes at once
//!
//! The cluster re-places the jobs of a node whose lease ran out only `fence_margin_ms`
//! after the lease's end (logical time). The agent stops them first, on its own: it
//! counts each lease from the moment it *sent* the last renewal the cluster accepted (a
//! node heartbeat; for a job's own lease, its last accepted job heartbeat), and when the
//! renewal is overdue it sends SIGTERM `min(grace, lease/4)` before, and SIGKILL
//! `min(`[`AgentConfig::fence_margin`]`, lease/4)` before, that lease would end — so every runner is gone
//! before the lease ends, and the cluster waits a margin longer still (docs/DESIGN.md
//! §45 gives the bound). An attempt stopped this way is reported with `JobFenced`
//! (requeued, billed to its last heartbeat) once the cluster answers again; no new
//! attempt starts while the node's lease is running out.
//!
//! A replacement process started from **another work dir** (another host, a fresh
//! container) cannot stop its predecessor's runners, nor know whether that process is
//! dead or only cut off or paused. So before it registers, an agent reads its node's
//! assignment set, and if the set holds attempts of an agent process this work dir did
//! not run, it waits — logging why — until they are over: the other process's lease
//! runs out and the cluster re-places them a fence margin later (by which that process,
//! if it runs, has stopped them itself), or that process finishes them. A restart in
//! the same work dir registers at once: it has stopped its predecessor's runners.
//! While another process keeps attempts on the node, a replacement waits for good rather
//! than take the node from under running jobs. "This work dir's" process is the last one
//! that registered from it (`<work dir>/registered`).
//!
//! A paused agent (or one whose runtime is blocked whole) runs none of its timers, so it
//! fences nothing: under systemd
//! it pings the service manager's watchdog (the `notify` module), and a stopped agent's
//! missed pings make systemd kill its whole cgroup, runners included.
//!
//! One agent process uses a work dir at a time: it holds `<work dir>/lock` (an
//! exclusive `flock`) while it runs, and a second process on the same work dir is
//! refused at start.
//!
//! # Orphans
//!
//! Each runner is recorded in `<work dir>/runners/<pgid>` (its process group and start
//! time). A restarted agent stops every recorded runner still alive (SIGTERM, the grace,
//! SIGKILL to the whole group) **before** it registers, so the GPUs it offers are free.
//! The kernel also kills a runner when the agent process dies (`PR_SET_PDEATHSIG`); its
//! children are caught by the restart. Each attempt also runs in a cgroup of its own
//! (the `cgroup` module; `--cgroup`), which a process that leaves the runner's group
//! (`setsid`) cannot leave: a kill empties it with `cgroup.kill`, an attempt's end is
//! reported once it is empty, and a restarted agent empties its predecessor's before it
//! registers. Deploy the agent as a systemd service with `KillMode=control-group` and
//! `Delegate=yes` (`docs/allot-agent.service`) so a dead agent takes its whole cgroup
//! with it.
//!
//! # Shutdown
//!
//! When the `shutdown` future of [`run`] completes (the binary: SIGTERM or Ctrl-C), the
//! agent stops watching, sends SIGTERM to every runner, waits up to the grace period,
//! SIGKILLs what is left, and exits. It does **not** report those attempts as finished:
//! their work did not end, and a finish would settle them as Succeeded or Failed and bill
//! the user for the whole run. Instead the cluster's leases decide: if the agent is not
//! back before the node lease runs out, the node is marked down and its jobs end as a
//! node failure (billed up to their last heartbeat); if it restarts in time, it starts the
//! attempts still placed on it again, under the same attempt number.
//!
//! # Identity
//!
//! Heartbeats, finishes and node heartbeats go out as `Actor::Agent(node)`: in a secured
//! cluster, `token` is an agent token scoped to this node (`allotctl token create
//! --scope agent:<node>`), and the cluster lets it report only on jobs placed on this
//! node. Registering a node is an admin command, so the agent registers with a second
//! client carrying `register_token` (an admin token) or, without one, the same token; in
//! dev mode the two clients claim the agent and admin identities. The register token is
//! needed for the first registration only: a node the shard forgets later (a restore
//! from an older backup) is registered again with `register_token_file`, read then (the
//! operator may delete it after the first start). Tokens come from files
//! (`allot-agent --token-file`), never from the command line, which every local user
//! can read in `/proc`.

mod cgroup;
mod notify;
mod output;
mod uids;

pub use cgroup::CgroupMode;
pub use uids::UidRange;

use crate::error::{Error, Result};
use crate::{Assignment, AssignmentSet, Client};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::scheduler::JobState;
use allot_statemachine::{
    Actor, Command, CommandError, GpuType, JobHeartbeat, JobId, JobKey, NodeId, NodeSpec, OrgId,
    PrincipalId, Reply, RunnerExit,
};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::StreamExt;
use tracing::{debug, error, info, warn};

/// How often the agent re-reads its assignment set with a linearizable query, besides
/// the stream (covers a stream whose replica stopped applying without closing it).
const RESYNC_INTERVAL: Duration = Duration::from_secs(15);
/// How long the agent keeps trying to report an attempt's exit (about the default job
/// lease: after that the job has ended as Lost anyway).
const FINISH_PERSIST: Duration = Duration::from_secs(180);
/// Attempts this agent process ran, remembered so a stale view never restarts them.
const ENDED_REMEMBERED: usize = 65_536;
/// Bound on waiting for a runner's log to be written out after it exited.
const LOG_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on waiting for a SIGKILLed runner to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// What the agent runs for each job attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Start `program args…` for every attempt (see the module docs for its environment).
    Run { program: String, args: Vec<String> },
    /// Fake the jobs with timers (machines without GPUs: demos and tests).
    Simulate(SimConfig),
}

/// The simulated jobs of [`Mode::Simulate`].
///
/// Each job's runtime is drawn deterministically from its id within
/// `[runtime_min, runtime_max]`; an attempt resumes from the work its earlier attempts
/// preserved (the job's `run_ms`) and advances progress linearly. A checkpointable job
/// checkpoints every `checkpoint_every` (zero: never) and once more on SIGTERM; the
/// simulated runner stops at once when terminated. `fail_pct` percent of jobs (chosen
/// deterministically from the id) exit non-zero at the end of their runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    pub runtime_min: Duration,
    pub runtime_max: Duration,
    pub checkpoint_every: Duration,
    pub fail_pct: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            runtime_min: Duration::from_secs(10),
            runtime_max: Duration::from_secs(30),
            checkpoint_every: Duration::from_secs(5),
            fail_pct: 0,
        }
    }
}

/// Everything the agent needs; [`AgentConfig::new`] fills in the defaults.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Any nodes of the cluster (`host:port`).
    pub endpoints: Vec<String>,
    pub token: Option<String>,
    /// Token for node registration (an admin token); default: `token`.
    pub register_token: Option<String>,
    /// The shard owning this node's GPU pool.
    pub shard: u32,
    pub node: NodeId,
    pub gpu_type: GpuType,
    pub gpus: u32,
    pub mem_gb: u32,
    pub labels: Vec<(String, String)>,
    /// Job heartbeats (default 2 s).
    pub heartbeat_interval: Duration,
    /// Node heartbeats, which renew the node lease (default 2 s).
    pub node_heartbeat_interval: Duration,
    /// Time between SIGTERM and SIGKILL on preemption and shutdown (default 30 s, the
    /// scheduler's default grace).
    pub grace: Duration,
    /// Where progress files, runner logs and the runner records go.
    pub work_dir: PathBuf,
    pub mode: Mode,
    /// Runners are stopped (SIGKILL) this long before a lease the agent could not renew
    /// would end, counted from the last renewal the cluster accepted (default 5 s).
    pub fence_margin: Duration,
    /// Environment variables runners get from the agent's environment, besides the
    /// job's own (`CUDA_VISIBLE_DEVICES`, `ALLOT_*`).
    pub runner_env: Vec<String>,
    /// A file with the admin token for registering the node again if the shard forgets
    /// it, read only then (default: `register_token`, or none).
    pub register_token_file: Option<PathBuf>,
    /// This agent process's incarnation (`NodeSpec::incarnation`), chosen by [`run`]
    /// ([`next_incarnation`]); 0 until then.
    pub incarnation: u64,
    /// Runner logs (`job-<org>-<job>.<attempt>.log`) older than this are deleted from
    /// the work dir (`--log-retention`, default 7 days; checked at start and hourly):
    /// a node runs jobs for years, and its disk must not fill with their output.
    pub log_retention: Duration,
    /// The user runners run as (`--runner-user`; [`RunnerUser::named`]); `None`: the
    /// agent's own. Needs an agent running as root. The work dir is then closed to
    /// runners (mode 0711): each may write only its own progress file.
    pub runner_user: Option<RunnerUser>,
    /// Where each attempt's cgroup goes (`--cgroup`, default `auto`; [`CgroupMode`]):
    /// a runner's children cannot escape the agent's kills by leaving its process group.
    pub cgroup: CgroupMode,
    /// The most of a runner's output its log keeps (`--log-max`, default 256 MiB): the
    /// first bytes up to this, then the last 64 KiB (the `output` module).
    pub log_max: u64,
    /// Each attempt runs as a uid of its own from this range (`--runner-uid-range`; the
    /// `uids` module), instead of `runner_user`. Needs an agent running as root.
    pub runner_uids: Option<UidRange>,
    /// The most processes and threads a runner uid may have at once
    /// (`--runner-procs-max`, the runner's `RLIMIT_NPROC`), when runners run as another
    /// user: `None` derives it from the machine ([`procs_max_for`]), `Some(0)` sets none.
    /// With `--runner-uid-range` it bounds each attempt; with `--runner-user` all of the
    /// node's runners together.
    pub runner_procs_max: Option<u64>,
}

/// The bound on a runner uid's processes and threads (`--runner-procs-max`; 0: none):
/// `auto` is [`procs_max_for`] the machine's tasks (the lesser of `pid_max` and
/// `threads-max`), never above the agent's own hard `RLIMIT_NPROC` (which runners
/// inherited before, and which an agent without `CAP_SYS_RESOURCE` cannot raise). An
/// explicit bound above that limit raises the agent's own, or is refused at start: a
/// runner's `setrlimit` would fail, and with it every attempt.
fn runner_procs_max(config: &AgentConfig) -> Result<u64> {
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(f)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) } != 0 {
        return Err(Error::Config(format!(
            "--runner-procs-max: cannot read the agent's RLIMIT_NPROC: {}",
            std::io::Error::last_os_error()
        )));
    }
    let hard: u64 = lim.rlim_max;
    match config.runner_procs_max {
        None => {
            let tasks = read("/proc/sys/kernel/pid_max")
                .unwrap_or(32_768)
                .min(read("/proc/sys/kernel/threads-max").unwrap_or(u64::MAX));
            Ok(procs_max_for(tasks, config.gpus, config.runner_uids.is_some()).min(hard))
        }
        Some(n) if n > hard => {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_cur,
                rlim_max: n,
            };
            // SAFETY: setrlimit reads the struct it is given.
            if unsafe { libc::setrlimit(libc::RLIMIT_NPROC, &raised) } != 0 {
                return Err(Error::Config(format!(
                    "--runner-procs-max {n} is above the agent's own limit of processes \
                     ({hard}), which it may not raise: {}",
                    std::io::Error::last_os_error()
                )));
            }
            Ok(n)
        }
        Some(n) => Ok(n),
    }
}

/// The least `--runner-procs-max` derives: an ML job's data loaders and threads.
pub const RUNNER_PROCS_MIN_AUTO: u64 = 1_024;

/// The default `--runner-procs-max`, from the machine's tasks (the lesser of the
/// kernel's `pid_max` and `threads-max`): half of them for the runners, shared by the attempts a node can run at once (one per GPU,
/// each its own uid) or by all of them under one `--runner-user`; at least
/// [`RUNNER_PROCS_MIN_AUTO`]. So a fork bomb in one attempt leaves pids for the others,
/// the agent and the host.
pub fn procs_max_for(tasks: u64, gpus: u32, uid_per_attempt: bool) -> u64 {
    let share = if uid_per_attempt {
        tasks / (2 * u64::from(gpus.max(1)))
    } else {
        tasks / 2
    };
    share.max(RUNNER_PROCS_MIN_AUTO)
}

/// A user runners run as: job code cannot read the agent's token files or environment,
/// signal the agent, or rewrite the work dir's records and other jobs' files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

impl RunnerUser {
    /// Looks `name` up in the user database. Refused: an unknown user, root (no
    /// separation at all), or an agent that is not root and so cannot switch users.
    pub fn named(name: &str) -> Result<RunnerUser> {
        let bad = |m: String| Err(Error::Config(format!("--runner-user {name}: {m}")));
        let Ok(c) = std::ffi::CString::new(name) else {
            return bad("not a user name".into());
        };
        // SAFETY: getpwnam_r writes only into `pwd` and `buf`, which outlive the call;
        // the strings it points `pwd` at live in `buf`, read before it is dropped.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut buf = vec![0 as libc::c_char; 16 * 1024];
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        let rc = unsafe {
            libc::getpwnam_r(
                c.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut found,
            )
        };
        if rc != 0 || found.is_null() {
            return bad("no such user".into());
        }
        let home = unsafe { std::ffi::CStr::from_ptr(pwd.pw_dir) }
            .to_string_lossy()
            .into_owned();
        if pwd.pw_uid == 0 {
            return bad("runners must not run as root".into());
        }
        if unsafe { libc::geteuid() } != 0 {
            return bad("the agent must run as root to start runners as another user".into());
        }
        Ok(RunnerUser {
            name: name.to_string(),
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
            home: PathBuf::from(home),
        })
    }
}

/// The environment variables the agent reads its own credentials from: never passed to
/// a runner, even when named in `runner_env`.
pub const AGENT_CREDENTIAL_VARS: [&str; 2] = ["ALLOT_AGENT_TOKEN", "ALLOT_AGENT_REGISTER_TOKEN"];

/// The variables a runner gets from the agent's environment by default.
pub const RUNNER_ENV_DEFAULT: [&str; 8] = [
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR",
];

impl AgentConfig {
    pub fn new(endpoints: Vec<String>, node: NodeId, mode: Mode) -> AgentConfig {
        AgentConfig {
            endpoints,
            token: None,
            register_token: None,
            shard: 0,
            node,
            gpu_type: GpuType::new("A100"),
            gpus: 8,
            mem_gb: 80,
            labels: Vec::new(),
            heartbeat_interval: Duration::from_secs(2),
            node_heartbeat_interval: Duration::from_secs(2),
            grace: Duration::from_secs(30),
            work_dir: std::env::temp_dir().join(format!("allot-agent-{}", node.0)),
            mode,
            fence_margin: Duration::from_secs(5),
            runner_env: RUNNER_ENV_DEFAULT.iter().map(|s| s.to_string()).collect(),
            register_token_file: None,
            incarnation: 0,
            runner_user: None,
            log_retention: Duration::from_secs(7 * 86_400),
            cgroup: CgroupMode::Auto,
            log_max: 256 << 20,
            runner_uids: None,
            runner_procs_max: None,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.to_string()));
        if self.endpoints.is_empty() {
            return bad("no endpoints");
        }
        if !self.gpu_type.is_valid() {
            return bad("the GPU type must be upper-case letters, digits, '_' or '-'");
        }
        if self.gpus == 0 || self.mem_gb == 0 {
            return bad("the node needs at least one GPU and some GPU memory");
        }
        if self.heartbeat_interval.is_zero() || self.node_heartbeat_interval.is_zero() {
            return bad("heartbeat intervals must be positive");
        }
        if self.log_retention.is_zero() {
            return bad("--log-retention must be positive");
        }
        if self.log_max == 0 {
            return bad("--log-max must be positive");
        }
        if let Some(r) = &self.runner_uids {
            if self.runner_user.is_some() {
                return bad("--runner-user and --runner-uid-range exclude each other");
            }
            r.check_shape(self.gpus)
                .map_err(|e| Error::Config(format!("--runner-uid-range {e}")))?;
        }
        match &self.mode {
            Mode::Run { program, .. } if program.is_empty() => bad("no job runner given"),
            Mode::Simulate(s) if s.runtime_min > s.runtime_max => {
                bad("the simulated runtime range is empty (min above max)")
            }
            Mode::Simulate(s) if s.fail_pct > 100 => bad("--sim-fail-pct is a percentage"),
            _ if self
                .runner_env
                .iter()
                .any(|v| AGENT_CREDENTIAL_VARS.contains(&v.as_str())) =>
            {
                bad("--runner-env names the agent's own credential variable: runners never get it")
            }
            _ => Ok(()),
        }
    }

    fn node_spec(&self) -> NodeSpec {
        let mut labels = self.labels.clone();
        labels.sort();
        NodeSpec {
            node: self.node,
            gpu_type: self.gpu_type.clone(),
            gpu_count: self.gpus,
            gpu_mem_gb: self.mem_gb,
            labels,
            incarnation: self.incarnation,
        }
    }
}

// ---------------------------------------------------------------------------- helpers

/// Parses a size in bytes: a whole number with an optional binary unit (`B`, `KiB`,
/// `MiB`, `GiB`; `K`, `M`, `G` mean the same), e.g. `256MiB`.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        _ => {
            return Err(Error::Config(format!(
                "{s:?}: expected a size such as 4096, 64KiB, 256MiB or 1GiB"
            )))
        }
    };
    n.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| Error::Config(format!("{s:?}: not a size in bytes")))
}

/// Parses a `key=value` label.
pub fn parse_label(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(Error::InvalidArgument(format!(
            "label {s:?}: expected key=value"
        ))),
    }
}

/// Parses a duration range `10s..30s` (or one duration, `20s`, for a fixed value).
pub fn parse_duration_range(s: &str) -> Result<(Duration, Duration)> {
    let (lo, hi) = s.split_once("..").unwrap_or((s, s));
    let (lo, hi) = (
        crate::parse_duration_ms(lo.trim())?,
        crate::parse_duration_ms(hi.trim())?,
    );
    if lo > hi {
        return Err(Error::InvalidArgument(format!(
            "range {s:?}: the lower end is above the upper"
        )));
    }
    Ok((Duration::from_millis(lo), Duration::from_millis(hi)))
}

/// Parses a progress file's content, `"<progress_ppm> <checkpoint>"`. Progress above one
/// million ppm is taken as complete; anything else malformed is `None`.
pub fn parse_progress(s: &str) -> Option<(u32, u64)> {
    let mut it = s.split_whitespace();
    let ppm: u64 = it.next()?.parse().ok()?;
    let checkpoint: u64 = it.next()?.parse().ok()?;
    if it.next().is_some() {
        return None;
    }
    Some((ppm.min(1_000_000) as u32, checkpoint))
}

/// SplitMix64: a well-mixed hash of a job id (the simulator's deterministic choices).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A simulated job's total runtime: deterministic from its id, within the range.
pub fn sim_runtime(job: JobId, min: Duration, max: Duration) -> Duration {
    let (lo, hi) = (min.as_millis() as u64, max.as_millis() as u64);
    if hi <= lo {
        return min;
    }
    Duration::from_millis(lo + mix(job.0) % (hi - lo + 1))
}

/// Whether a simulated job fails (exits non-zero): deterministic from its id.
pub fn sim_fails(job: JobId, fail_pct: u32) -> bool {
    mix(job.0 ^ 0x5ad_f00d) % 100 < u64::from(fail_pct)
}

/// Whether a set of GPU indices the cluster assigned can be this node's: some, each
/// below the node's GPU count, none twice.
fn gpus_valid(indices: &[u8], gpus: u32) -> bool {
    let mut seen = std::collections::BTreeSet::new();
    !indices.is_empty()
        && indices
            .iter()
            .all(|&i| u32::from(i) < gpus && seen.insert(i))
}

fn gpu_list(indices: &[u8]) -> String {
    indices
        .iter()
        .map(u8::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------- runners

/// How an attempt's runner ended.
#[derive(Debug)]
struct Exit {
    success: bool,
    how: String,
    /// When the last of the attempt's processes was gone (its GPUs free), or a moment
    /// after (without a cgroup or a uid of its own: once its output is closed, or
    /// `LOG_FLUSH_TIMEOUT` after the group's SIGKILL): what the finish report counts
    /// the exit from.
    at: Instant,
}

impl Exit {
    fn now(success: bool, how: String) -> Exit {
        Exit {
            success,
            how,
            at: Instant::now(),
        }
    }
}

/// Control of a started runner; its exit arrives on the paired oneshot.
enum Runner {
    Process {
        /// The runner leads its own process group (pgid = its pid).
        pgid: u32,
        /// The attempt's cgroup, holding the runner and everything it starts.
        cgroup: Option<Arc<cgroup::Attempt>>,
        progress_file: PathBuf,
        last: Mutex<(u32, u64)>,
    },
    Sim {
        started: Instant,
        prior: Duration,
        runtime: Duration,
        checkpoint_every: Duration,
        checkpointable: bool,
        /// Checkpoints written on SIGTERM (the simulated runner saves before stopping).
        extra_checkpoints: AtomicU64,
        signal: Mutex<Option<oneshot::Sender<&'static str>>>,
    },
}

/// Sends a signal to a whole process group.
async fn signal_group(pgid: u32, signal: &str) {
    // `kill(0, ..)` would signal the agent's own group, `-1` every process.
    if pgid <= 1 {
        error!(
            pgid,
            signal, "refusing to signal a process group this small"
        );
        return;
    }
    let sig = match signal {
        "TERM" => libc::SIGTERM,
        "KILL" => libc::SIGKILL,
        other => {
            error!(signal = other, "unknown signal");
            return;
        }
    };
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is shared.
    let r = unsafe { libc::kill(-(pgid as libc::pid_t), sig) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            error!(pgid, signal, "cannot signal the runner's group: {e}");
        }
    }
}

/// Whether a process group still has members.
fn group_alive(pgid: u32) -> bool {
    // SAFETY: signal 0 only checks that the group exists and may be signalled.
    pgid > 1 && unsafe { libc::kill(-(pgid as libc::pid_t), 0) } == 0
}

/// A process's start time (clock ticks since boot, `/proc/<pid>/stat` field 22): with
/// the pid, it names one process for good (pids are reused, the pair is not).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The records of this agent's runners (`<work dir>/runners/<pgid>`).
fn runners_dir(work_dir: &Path) -> PathBuf {
    work_dir.join("runners")
}

/// Reads a small file a runner may have tampered with (the work dir is writable by the
/// runners when they run as the agent's user): never through a symlink, never blocking
/// (a FIFO or device is refused before it is read, not waited on), and at most `max`
/// bytes — a longer file is refused, not read whole.
fn read_small(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    let mut text = String::new();
    f.take(max + 1).read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("longer than {max} bytes"),
        ));
    }
    Ok(text)
}

/// Creates `path` anew for writing: whatever is there (a file, or a symlink a runner
/// planted to make the agent write elsewhere) is removed first, and the file is created
/// exclusively, never through a symlink.
fn create_fresh(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    // Owner-only: a runner's log is its job's output, not for other jobs to read.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Deletes the runner logs in `work_dir` last written more than `retention` ago (the
/// agent's own files and other files are left alone); how many it deleted.
pub fn prune_logs(work_dir: &Path, retention: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(work_dir) else {
        return 0;
    };
    let now = std::time::SystemTime::now();
    let mut deleted = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("job-") && name.ends_with(".log")) {
            continue;
        }
        // `symlink_metadata`: a link is judged (and removed) as itself.
        let old = e
            .path()
            .symlink_metadata()
            .ok()
            .and_then(|m| m.modified().ok());
        if old.is_some_and(|t| now.duration_since(t).is_ok_and(|age| age > retention))
            && std::fs::remove_file(e.path()).is_ok()
        {
            deleted += 1;
        }
    }
    deleted
}

/// Prunes the runner logs at start and every hour.
async fn prune_logs_hourly(work_dir: PathBuf, retention: Duration) {
    let mut every = tokio::time::interval(Duration::from_secs(3_600));
    loop {
        every.tick().await;
        let (dir, keep) = (work_dir.clone(), retention);
        if let Ok(n) = tokio::task::spawn_blocking(move || prune_logs(&dir, keep)).await {
            if n > 0 {
                info!(deleted = n, ?retention, "deleted old runner logs");
            }
        }
    }
}

/// The longest progress file, runner record or incarnation file the agent reads.
const SMALL_FILE_MAX: u64 = 256;

/// Picks this agent process's incarnation and records it in `work_dir` (durably, before
/// it is used): above every incarnation recorded there, and at least the wall clock in
/// milliseconds, so a replacement machine with an empty work dir still registers above
/// the node's previous agent (whose clock was not far ahead). A registration naming a
/// higher incarnation ends the previous process's attempts; a lower one is refused.
pub fn next_incarnation(work_dir: &Path) -> Result<u64> {
    let last = read_number(work_dir, INCARNATION_FILE)?.unwrap_or(0);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let next = now_ms.max(last.saturating_add(1));
    write_number(work_dir, INCARNATION_FILE, next)?;
    Ok(next)
}

/// The incarnation each agent process chooses ([`next_incarnation`]), and the one the
/// last process to register from the work dir registered with (written once the
/// cluster took it). Both files' format, kept by every release: the number first, then
/// whatever a later release appends (read and ignored here), so an agent rolled back
/// over a newer one's work dir still reads them.
const INCARNATION_FILE: &str = "incarnation";
const REGISTERED_FILE: &str = "registered";

/// The number a work-dir file starts with (`None`: no such file).
fn read_number(work_dir: &Path, name: &str) -> Result<Option<u64>> {
    let path = work_dir.join(name);
    match read_small(&path, SMALL_FILE_MAX) {
        Ok(s) => s
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{}: not an incarnation number", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Config(format!("{}: {e}", path.display()))),
    }
}

/// Replaces a work-dir file with `n`, durably (a temporary file renamed over it, both
/// synced).
fn write_number(work_dir: &Path, name: &str, n: u64) -> Result<()> {
    use std::io::Write;
    let path = work_dir.join(name);
    let io = |e: std::io::Error| Error::Config(format!("{}: {e}", path.display()));
    let tmp = work_dir.join(format!("{name}.tmp"));
    let mut f = create_fresh(&tmp).map_err(io)?;
    f.write_all(n.to_string().as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    std::fs::File::open(work_dir)
        .and_then(|d| d.sync_all())
        .map_err(io)
}

/// Holds `work_dir` for this process for as long as the returned guard lives (an
/// exclusive `flock` on `<work dir>/lock`, released by the kernel when the process dies).
/// Runners do not inherit it (close-on-exec), and the uid sweeper's forked child closes
/// its copy first thing ([`work_dir_lock_fd`]). A second agent process on the same work
/// dir — the node started twice, or a successor started while its predecessor is
/// paused — is refused here: it would stop the predecessor's runners as orphans while
/// that process still believes it runs them, and report their exits as the jobs' own
/// ends.
fn lock_work_dir(work_dir: &Path) -> Result<WorkDirLock> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let path = work_dir.join("lock");
    let io = |e: std::io::Error| Error::Config(format!("{}: {e}", path.display()));
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    match f.try_lock() {
        Ok(()) => {
            WORK_DIR_LOCK_FD.store(f.as_raw_fd(), Ordering::Relaxed);
            Ok(WorkDirLock(f))
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::Config(format!(
            "work dir {} is in use by another allot-agent process (a paused one too): \
             stop it before starting another on this work dir",
            work_dir.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// The work dir's lock, held while it lives.
struct WorkDirLock(#[allow(dead_code)] std::fs::File);

impl Drop for WorkDirLock {
    fn drop(&mut self) {
        WORK_DIR_LOCK_FD.store(-1, Ordering::Relaxed);
    }
}

static WORK_DIR_LOCK_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// The descriptor of the work dir's lock (-1: none held): a child forked without exec
/// closes it, so that it never holds the work dir for a process that is gone.
fn work_dir_lock_fd() -> i32 {
    WORK_DIR_LOCK_FD.load(Ordering::Relaxed)
}

/// The incarnation the last agent process of this work dir registered its node with (0:
/// none did). A process that chose an incarnation and stopped before the cluster took
/// it (during `stop_orphans`, a refused or failed registration) is not it. A work dir of
/// a release before the `registered` file: the chosen one.
pub fn last_registered(work_dir: &Path) -> Result<u64> {
    match read_number(work_dir, REGISTERED_FILE)? {
        Some(n) => Ok(n),
        None => Ok(read_number(work_dir, INCARNATION_FILE)?.unwrap_or(0)),
    }
}

/// Whether this process may register its node now, given the node's assignment set: it
/// may unless the set holds attempts of another agent process, one this work dir did not
/// run (`predecessor`, whose runners `stop_orphans` has stopped) — that process may be
/// cut off or paused with its runners still running (another host, a fresh container),
/// and a registration would end its attempts at once and let them start again while
/// they run. Once that process's node lease has run out and the cluster has re-placed
/// its attempts (its lease's end plus the fence margin, by which it has stopped them
/// itself), or it has finished them, the set is empty. Incarnation 0: an operator
/// registered the node and no agent process has claimed it.
fn may_register(set: &AssignmentSet, predecessor: u64) -> bool {
    set.assignments.is_empty() || set.incarnation == 0 || set.incarnation == predecessor
}

/// Waits until [`may_register`] (a linearizable read of the node's set, every second).
/// `None`: shut down while waiting.
async fn wait_for_another_process(
    client: &Client,
    cfg: &AgentConfig,
    predecessor: u64,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> Option<()> {
    let mut said = None::<Instant>;
    loop {
        tokio::select! {
            r = client.assignment_set(cfg.shard, cfg.node) => match r {
                Ok(set) if may_register(&set, predecessor) => return Some(()),
                Ok(set) => {
                    if said.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
                        said = Some(Instant::now());
                        warn!(
                            node = cfg.node.0,
                            other = set.incarnation,
                            attempts = set.assignments.len(),
                            "another agent process (not this work dir's) holds attempts on this node: \
                             waiting for them to end — that process's lease and the fence margin, \
                             or its own reports — before registering, so that no job runs twice"
                        );
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => {
                    warn!("reading the node's assignments before registering failed, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            },
            _ = &mut *shutdown => return None,
        }
    }
}

/// Records a started runner so a later incarnation of the agent can stop it.
///
/// The record's format is a contract between releases (an agent upgraded, or rolled
/// back, stops the runners its predecessor recorded): one line of space-separated
/// fields, **the process group id and its leader's start time first**, in that order in
/// every release, then the attempt (org, job, attempt), then whatever a later release
/// appends. A reader uses the first two and ignores the rest, so fields are only ever
/// appended, never reordered or removed (`stop_orphans`; test
/// `a_runner_recorded_with_fields_a_later_release_appends_is_stopped`).
fn record_runner(work_dir: &Path, pgid: u32, a: &Assignment) {
    let line = format!(
        "{pgid} {} {} {} {}\n",
        start_time(pgid).unwrap_or(0),
        a.org.0,
        a.job.0,
        a.attempt
    );
    let dir = runners_dir(work_dir);
    let tmp = dir.join(format!(".{pgid}.tmp"));
    let r = std::fs::create_dir_all(&dir)
        .and_then(|()| {
            use std::io::Write;
            create_fresh(&tmp)?.write_all(line.as_bytes())
        })
        .and_then(|()| std::fs::rename(&tmp, dir.join(pgid.to_string())));
    if let Err(e) = r {
        error!(
            pgid,
            "cannot record the runner (a restart could not stop it): {e}"
        );
    }
}

fn forget_runner(work_dir: &Path, pgid: u32) {
    let _ = std::fs::remove_file(runners_dir(work_dir).join(pgid.to_string()));
}

/// Stops every runner a previous incarnation of the agent left that is still alive —
/// each recorded process group, and everything in the cgroups under the agent's base
/// (a runner's child that left its group included): SIGTERM, up to `grace`, then SIGKILL
/// (`cgroup.kill` for a cgroup, which is then removed). Forgets the records. Run before
/// registering, so the GPUs the node offers are free. Returns how many process groups
/// and non-empty cgroups it found.
pub async fn stop_orphans(
    work_dir: &Path,
    cgroups: Option<&cgroup::Cgroups>,
    grace: Duration,
) -> usize {
    let mut live = Vec::new();
    let entries = std::fs::read_dir(runners_dir(work_dir));
    for e in entries.into_iter().flatten().flatten() {
        let path = e.path();
        let text = read_small(&path, SMALL_FILE_MAX).unwrap_or_default();
        let mut f = text.split_whitespace();
        // The first two fields (`record_runner`'s contract); later ones are ignored.
        let (Some(pgid), Some(started)) = (
            f.next().and_then(|x| x.parse::<u32>().ok()),
            f.next().and_then(|x| x.parse::<u64>().ok()),
        ) else {
            // Not a record this release wrote. Its process, if any, is in a cgroup
            // below (when cgroups are on); a record names nothing else to stop.
            error!(record = %path.display(), text = %text.trim(), "ignoring a runner record that does not parse");
            let _ = std::fs::remove_file(&path);
            continue;
        };
        // The group is ours if its leader is the very process we started, or if the
        // leader is gone but the group lives on (a group id is not reused while the group
        // exists, and a new group would have a live leader).
        let ours = match start_time(pgid) {
            Some(t) => t == started,
            None => group_alive(pgid),
        };
        if ours {
            warn!(pgid, record = %text.trim(), "stopping a runner of a previous agent process");
            signal_group(pgid, "TERM").await;
            live.push((pgid, path));
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
    let left = cgroups.map(|c| c.children()).unwrap_or_default();
    let groups: Vec<u32> = live.iter().map(|(g, _)| *g).collect();
    let mut populated = 0;
    for c in &left {
        if c.populated() {
            warn!(cgroup = %c.dir().display(), "stopping the processes of a previous agent process's attempt");
            c.signal(libc::SIGTERM, &groups).await;
            populated += 1;
        }
    }
    let found = live.len() + populated;
    let deadline = Instant::now() + grace;
    while (live.iter().any(|(g, _)| group_alive(*g)) || left.iter().any(|c| c.populated()))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (pgid, path) in live {
        if group_alive(pgid) {
            warn!(
                pgid,
                "the orphaned runner outlived its grace period: SIGKILL"
            );
            signal_group(pgid, "KILL").await;
            let reaped = Instant::now() + REAP_TIMEOUT;
            while group_alive(pgid) && Instant::now() < reaped {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let _ = std::fs::remove_file(path);
    }
    for c in &left {
        c.kill_and_remove().await;
    }
    found
}

impl Runner {
    async fn start(
        shared: &Shared,
        a: &Assignment,
    ) -> std::io::Result<(Runner, oneshot::Receiver<Exit>)> {
        if !gpus_valid(&a.gpu_indices, shared.cfg.gpus) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the cluster assigned GPUs [{}] of a node with {}",
                    gpu_list(&a.gpu_indices),
                    shared.cfg.gpus
                ),
            ));
        }
        match &shared.cfg.mode {
            Mode::Run { program, args } => {
                let dir = &shared.cfg.work_dir;
                let progress_file = progress_file(dir, a.org, a.job, a.attempt)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                // The attempt's own uid (`--runner-uid-range`), handed to the runner's
                // waiter once it runs; back to the pool here if it never started.
                let mut uid_lease = match &shared.uids {
                    Some(pool) => Some(pool.take().await?),
                    None => None,
                };
                let started =
                    Self::start_process(shared, a, program, args, progress_file, &mut uid_lease)
                        .await;
                if let (Some(l), Some(pool)) = (uid_lease, &shared.uids) {
                    pool.release(l).await;
                }
                started
            }
            Mode::Simulate(sim) => Self::start_simulated(shared, a, sim).await,
        }
    }

    /// Starts a runner process for `a` (`Mode::Run`): as the attempt's uid if `uid_lease`
    /// holds one (taken from it once the runner runs), else as the runner user, else as
    /// the agent's user.
    async fn start_process(
        shared: &Shared,
        a: &Assignment,
        program: &str,
        args: &[String],
        progress_file: PathBuf,
        uid_lease: &mut Option<uids::UidLease>,
    ) -> std::io::Result<(Runner, oneshot::Receiver<Exit>)> {
        let (tx, rx) = oneshot::channel();
        let dir = &shared.cfg.work_dir;
        let as_user: Option<(u32, u32, PathBuf, String)> =
            match (&*uid_lease, &shared.cfg.runner_user) {
                (Some(l), _) => Some((l.uid, l.uid, l.home.clone(), l.name())),
                (None, Some(u)) => Some((u.uid, u.gid, u.home.clone(), u.name.clone())),
                (None, None) => None,
            };
        if let Some((uid, gid, ..)) = &as_user {
            // The one file of the work dir the runner may write.
            let f = create_fresh(&progress_file)?;
            std::os::unix::fs::fchown(&f, Some(*uid), Some(*gid))?;
        }
        let log =
            create_fresh(&dir.join(format!("job-{}-{}.{}.log", a.org.0, a.job.0, a.attempt)))?;
        let (out_r, out_w) = output::pipe()?;
        let out_w2 = out_w.try_clone()?;
        let cgroup = match &shared.cgroups {
            Some(c) => Some(Arc::new(c.create_attempt(
                shared.cfg.incarnation,
                a.org.0,
                a.job.0,
                a.attempt,
            )?)),
            None => None,
        };
        let procs = cgroup.as_ref().map(|c| c.procs_path());
        let mut cmd = tokio::process::Command::new(program);
        // A clean environment: the agent's tokens never reach the job's code.
        cmd.env_clear();
        for name in &shared.cfg.runner_env {
            if let Some(v) = std::env::var_os(name) {
                cmd.env(name, v);
            }
        }
        if let Some((_, _, home, name)) = &as_user {
            cmd.env("HOME", home).env("USER", name).env("LOGNAME", name);
        }
        if uid_lease.is_some() {
            // The attempt's home is its own scratch space, removed with it.
            if let Some((_, _, home, _)) = &as_user {
                cmd.env("TMPDIR", home);
            }
        }
        let ids = as_user.as_ref().map(|(uid, gid, ..)| (*uid, *gid));
        // Resolved at start (`run`): a bound whenever the runner is another user.
        let nproc: Option<libc::rlim_t> = shared
            .cfg
            .runner_procs_max
            .filter(|n| *n > 0 && ids.is_some());
        // An attempt's own uid gains nothing by exec: a setuid file another attempt
        // left cannot make it that attempt's uid.
        let no_new_privs = uid_lease.is_some();
        let agent_pid = std::process::id();
        // SAFETY: only async-signal-safe calls (open, write, close, setrlimit,
        // setgroups, setgid, setuid, prctl, getppid, raise) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Into the attempt's cgroup first, while still privileged.
                if let Some(p) = &procs {
                    cgroup::join(p)?;
                }
                // The uid's processes and threads are bounded: set while still root,
                // which may set any bound (the runner may only lower it).
                if let Some(n) = nproc {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NPROC, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some((uid, gid)) = ids {
                    if libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if no_new_privs && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The kernel kills the runner if the agent dies (its children
                // are stopped by the next agent process, see `stop_orphans`).
                // Set after the user change, which clears it.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() as u32 != agent_pid {
                    libc::raise(libc::SIGKILL);
                }
                Ok(())
            });
        }
        let child = cmd
            .args(args)
            .env("CUDA_VISIBLE_DEVICES", gpu_list(&a.gpu_indices))
            .env("ALLOT_JOB_ID", a.job.0.to_string())
            .env("ALLOT_ORG_ID", a.org.0.to_string())
            .env("ALLOT_ATTEMPT", a.attempt.to_string())
            .env("ALLOT_PROGRESS_FILE", &progress_file)
            .stdin(std::process::Stdio::null())
            .stdout(out_w2)
            .stderr(out_w)
            .process_group(0)
            .kill_on_drop(true)
            .spawn();
        // The parent's copies of the pipe's write end go with the command, so
        // the log's pump sees the end once every process of the attempt has.
        drop(cmd);
        let log_max = shared.cfg.log_max;
        let (logged_tx, logged) = oneshot::channel();
        let pumped = std::thread::Builder::new()
            .name(format!("log-{}-{}", a.job.0, a.attempt))
            .spawn(move || {
                let dropped = output::pump(std::fs::File::from(out_r), log, log_max);
                let _ = logged_tx.send(dropped);
            });
        let mut child = match (child, pumped) {
            (Ok(c), Ok(_)) => c,
            (Err(e), _) | (_, Err(e)) => {
                if let Some(c) = &cgroup {
                    c.kill_and_remove().await;
                }
                return Err(e);
            }
        };
        let Some(pgid) = child.id() else {
            if let Some(c) = &cgroup {
                c.kill_and_remove().await;
            }
            return Err(std::io::Error::other(
                "the runner exited before it had a pid",
            ));
        };
        record_runner(dir, pgid, a);
        let dir = dir.clone();
        let contained = cgroup.clone();
        let uid = uid_lease.take().zip(shared.uids.clone());
        tokio::spawn(async move {
            let mut exit = match child.wait().await {
                Ok(st) => Exit::now(st.success(), st.to_string()),
                Err(e) => Exit::now(false, format!("wait failed: {e}")),
            };
            // Whatever the runner left behind goes with it: its group, and
            // everything in its cgroup (a process that left the group too). The
            // exit is reported only once the cgroup is empty.
            signal_group(pgid, "KILL").await;
            if let Some(c) = &contained {
                c.kill_and_remove().await;
            }
            // And every process of the attempt's uid, wherever it is.
            if let Some((lease, pool)) = &uid {
                pool.sweep_ended(lease).await;
            }
            forget_runner(&dir, pgid);
            // The log is whole before the exit is told (every writer is gone
            // once the cgroup is empty; without one, a process that left the
            // group may hold the pipe, so the wait is bounded).
            match tokio::time::timeout(LOG_FLUSH_TIMEOUT, logged).await {
                        Ok(Ok(dropped)) if dropped > 0 => {
                            warn!(pgid, dropped, "the runner's output passed --log-max: its middle was dropped");
                        }
                        Ok(_) => {}
                        Err(_) => warn!(pgid, "the runner's output is still open after it exited: a process it started holds it"),
                    }
            // The exit its bill runs to: every process of the attempt is gone now (its
            // cgroup empty, its uid swept) or, without either, every holder of its
            // output closed it (or the bounded wait for that ended).
            exit.at = Instant::now();
            // Its home goes and its uid is freed before the exit is told (a next attempt
            // placed on the freed GPUs may need a uid), but after the instant: removing
            // a large home is not GPU time.
            if let Some((lease, pool)) = uid {
                pool.remove_home_and_free(lease).await;
            }
            let _ = tx.send(exit);
        });
        Ok((
            Runner::Process {
                pgid,
                cgroup,
                progress_file,
                last: Mutex::new((0, 0)),
            },
            rx,
        ))
    }

    /// A simulated runner for `a` (`Mode::Simulate`): no process, a runtime chosen from
    /// the job id.
    async fn start_simulated(
        shared: &Shared,
        a: &Assignment,
        sim: &SimConfig,
    ) -> std::io::Result<(Runner, oneshot::Receiver<Exit>)> {
        let (tx, rx) = oneshot::channel();
        let job = match shared
            .client
            .query(shared.cfg.shard, &Query::Job(a.org, a.job))
            .await
        {
            Ok(Answer::Job(Some(j))) => Some(*j),
            Ok(_) => None,
            Err(e) => {
                warn!(job = a.job.0, "cannot read the job for the simulation: {e}");
                None
            }
        };
        let runtime = sim_runtime(a.job, sim.runtime_min, sim.runtime_max);
        let prior = Duration::from_millis(job.as_ref().map_or(0, |j| j.run_ms));
        let remaining = runtime.saturating_sub(prior);
        let fails = sim_fails(a.job, sim.fail_pct);
        let (sig_tx, sig_rx) = oneshot::channel::<&'static str>();
        tokio::spawn(async move {
            let exit = tokio::select! {
                _ = tokio::time::sleep(remaining) => Exit::now(
                    !fails,
                    if fails { "simulated failure".into() } else { "simulated success".into() },
                ),
                sig = sig_rx => Exit::now(false, format!("simulated {}", sig.unwrap_or("stop"))),
            };
            let _ = tx.send(exit);
        });
        Ok((
            Runner::Sim {
                started: Instant::now(),
                prior,
                runtime,
                checkpoint_every: sim.checkpoint_every,
                checkpointable: job.is_some_and(|j| j.spec.checkpointable),
                extra_checkpoints: AtomicU64::new(0),
                signal: Mutex::new(Some(sig_tx)),
            },
            rx,
        ))
    }

    /// Progress (ppm) and last durable checkpoint, as of now.
    fn progress(&self) -> (u32, u64) {
        match self {
            Runner::Process {
                progress_file,
                last,
                ..
            } => {
                let mut last = lock(last);
                if let Some((ppm, ckpt)) = read_small(progress_file, SMALL_FILE_MAX)
                    .ok()
                    .as_deref()
                    .and_then(parse_progress)
                {
                    *last = (ppm, last.1.max(ckpt));
                }
                *last
            }
            Runner::Sim {
                started,
                prior,
                runtime,
                checkpoint_every,
                checkpointable,
                extra_checkpoints,
                ..
            } => {
                let ran = started.elapsed();
                let done = (*prior + ran).as_millis() as u64;
                let total = (runtime.as_millis() as u64).max(1);
                let ppm = (done.saturating_mul(1_000_000) / total).min(1_000_000) as u32;
                let ckpt = if *checkpointable {
                    let periodic = match checkpoint_every.as_millis() as u64 {
                        0 => 0,
                        every => ran.as_millis() as u64 / every,
                    };
                    periodic + extra_checkpoints.load(Ordering::Relaxed)
                } else {
                    0
                };
                (ppm, ckpt)
            }
        }
    }

    /// SIGTERM: asks the runner to save and stop.
    async fn terminate(&self) {
        match self {
            Runner::Process { pgid, cgroup, .. } => {
                signal_group(*pgid, "TERM").await;
                if let Some(c) = cgroup {
                    c.signal(libc::SIGTERM, &[*pgid]).await;
                }
            }
            Runner::Sim {
                signal,
                extra_checkpoints,
                checkpointable,
                ..
            } => {
                if let Some(tx) = lock(signal).take() {
                    if *checkpointable {
                        extra_checkpoints.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = tx.send("SIGTERM");
                }
            }
        }
    }

    /// SIGKILL: stops the runner at once.
    async fn kill(&self) {
        match self {
            Runner::Process { pgid, cgroup, .. } => {
                signal_group(*pgid, "KILL").await;
                if let Some(c) = cgroup {
                    c.kill();
                }
            }
            Runner::Sim { signal, .. } => {
                if let Some(tx) = lock(signal).take() {
                    let _ = tx.send("SIGKILL");
                }
            }
        }
    }

    fn cleanup(&self) {
        if let Runner::Process { progress_file, .. } = self {
            let _ = std::fs::remove_file(progress_file);
        }
    }
}

// ---------------------------------------------------------------------------- tasks

/// What an attempt's task tells the main loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TaskEvent {
    /// Its runner is gone (or never started): its GPUs are free.
    GpusFree,
    /// The task is over; `ended`: the attempt counts as ended here (`false` only for
    /// one not started for now, which a later set may start).
    Done { ended: bool },
}

/// What the main loop tells an attempt's task, from the latest assignment set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Directive {
    Run,
    Preempt,
    /// Not in the latest set: confirm, then kill.
    Gone,
    /// A newer attempt of the job exists: kill.
    Fenced,
    Shutdown,
    /// A newer agent process has registered the node: kill at once, report nothing (the
    /// registration ended this process's attempts).
    Superseded,
}

struct Shared {
    cfg: AgentConfig,
    /// The agent identity.
    client: Client,
    /// What an attempt's task tells the main loop: its runner is gone, its end.
    done: mpsc::UnboundedSender<(JobKey, u32, TaskEvent)>,
    lease: Lease,
    /// The agent's directory of attempt cgroups (`None`: `--cgroup off`, or not usable).
    cgroups: Option<cgroup::Cgroups>,
    /// The runner uids, one per attempt (`--runner-uid-range`).
    uids: Option<Arc<uids::UidPool>>,
    /// Set when a linearizable read found the shard's record of the node naming an
    /// older agent process than this one (a shard restored from a backup taken before
    /// this process registered): the node heartbeat task registers the node again.
    register_again: std::sync::atomic::AtomicBool,
}

/// What the agent knows of its leases: when it sent the last node heartbeat the cluster
/// accepted, and how long the shard's node and job leases are.
struct Lease {
    renewed: Mutex<Instant>,
    node_ms: AtomicU64,
    job_ms: AtomicU64,
    /// The shard's preemption grace (`u64::MAX` until read): a preempted runner is
    /// killed at the shorter of it and the agent's own `--grace`, never after the
    /// cluster has freed its GPUs for the preemptor.
    grace_ms: AtomicU64,
    /// The (node, job, grace) lengths the last read of the shard's settings returned.
    last_read: Mutex<Option<[u64; 3]>>,
    /// Bumped whenever the lengths in force change, so that running attempts recompute
    /// their stop schedule at once (a shortened lease moves it earlier).
    changed: watch::Sender<u64>,
}

impl Lease {
    /// A lease renewed at `renewed`, with the (node, job, grace) lengths of a read made
    /// before that renewal was sent.
    fn new(renewed: Instant, read: [u64; 3]) -> Lease {
        Lease {
            renewed: Mutex::new(renewed),
            node_ms: AtomicU64::new(read[0]),
            job_ms: AtomicU64::new(read[1]),
            grace_ms: AtomicU64::new(read[2]),
            last_read: Mutex::new(Some(read)),
            changed: watch::channel(0).0,
        }
    }

    /// A renewal sent at `sent` was accepted, and a read made after it was applied
    /// returned the lengths `read`: the lease counts from `sent`, with the lengths
    /// [`Lease::learn`] takes.
    fn renewed_with(&self, sent: Instant, read: [u64; 3]) {
        let mut r = lock(&self.renewed);
        let changed = self.learn(read);
        *r = (*r).max(sent);
        drop(r);
        if changed {
            self.changed.send_modify(|v| *v += 1);
            info!(
                node_lease_ms = self.node_ms.load(Ordering::Relaxed),
                job_lease_ms = self.job_ms.load(Ordering::Relaxed),
                grace_ms = self.grace_ms.load(Ordering::Relaxed),
                "lease lengths in force"
            );
        }
    }

    /// Takes the (node lease, job lease, grace) lengths a read of the shard's settings
    /// returned; whether the lengths in force changed. A renewal is granted the length
    /// in force when it is applied, which the agent does not see: a read made after a
    /// renewal was applied may already show a later change. So the agent counts a
    /// renewal only once a read made after it was applied has answered, with the
    /// shorter of that read and the one before it — made before the renewal was sent:
    /// a shortened lease counts at once, a longer one from the next renewal on. (Two
    /// changes between two renewals — a heartbeat interval — could still be
    /// miscounted; job renewals and the preemption grace are counted with the lengths
    /// in force, not bracketed by reads of their own.)
    fn learn(&self, read: [u64; 3]) -> bool {
        let prev = lock(&self.last_read).replace(read);
        let eff = prev.map_or(read, |p| [0, 1, 2].map(|i| p[i].min(read[i])));
        let mut changed = false;
        for (slot, v) in [&self.node_ms, &self.job_ms, &self.grace_ms]
            .into_iter()
            .zip(eff)
        {
            changed |= slot.swap(v, Ordering::Relaxed) != v;
        }
        changed
    }

    /// How long a preempted runner may take to stop, from when the agent learns of the
    /// preemption: the agent's grace, at most the shard's less the fence margin (at most
    /// a quarter of it). The shard's grace counts from the preemption's entry, which the
    /// agent sees a stream's delay later; at the grace's end the cluster requeues the
    /// job and gives its GPUs to the preemptor, with no margin of its own.
    fn preemption_grace(&self, cfg: &AgentConfig) -> Duration {
        let shard = Duration::from_millis(self.grace_ms.load(Ordering::Relaxed));
        cfg.grace
            .min(shard.saturating_sub(cfg.fence_margin.min(shard / 4)))
    }

    /// When a lease that began at `from` and lasts `lease_ms` has its runners stopped:
    /// (SIGTERM at, SIGKILL at) — SIGKILL `min(margin, lease/4)` before its end (a margin
    /// longer than the lease itself would stop every attempt at once), SIGTERM a grace of
    /// `min(grace, lease/4)` earlier.
    fn schedule(
        from: Instant,
        lease_ms: u64,
        margin: Duration,
        grace: Duration,
    ) -> (Instant, Instant) {
        let lease = Duration::from_millis(lease_ms);
        let kill_at = from + lease.saturating_sub(margin.min(lease / 4));
        let term_at = kill_at - grace.min(lease / 4).min(kill_at - from);
        (term_at, kill_at)
    }

    /// The node lease's stop schedule.
    fn node_schedule(&self, cfg: &AgentConfig) -> (Instant, Instant) {
        let from = *lock(&self.renewed);
        Lease::schedule(
            from,
            self.node_ms.load(Ordering::Relaxed),
            cfg.fence_margin,
            cfg.grace,
        )
    }

    /// The stop schedule of a job attempt whose last accepted heartbeat was sent at
    /// `job_from`: whichever lease runs out first.
    fn attempt_schedule(&self, cfg: &AgentConfig, job_from: Instant) -> (Instant, Instant) {
        let node = self.node_schedule(cfg);
        let job = Lease::schedule(
            job_from,
            self.job_ms.load(Ordering::Relaxed),
            cfg.fence_margin,
            cfg.grace,
        );
        node.min(job)
    }

    /// Whether the node's lease is running out (no new attempt may start).
    fn lapsing(&self, cfg: &AgentConfig) -> bool {
        Instant::now() >= self.node_schedule(cfg).0
    }
}

/// How a heartbeat went.
enum Beat {
    /// The cluster took it: the job's lease is renewed from the moment it was sent.
    Accepted,
    /// Not taken (the cluster could not be reached); the job runs on within its lease.
    Unanswered,
    /// The job must stop here and no finish is to be reported.
    Stop(String),
}

async fn heartbeat(shared: &Shared, a: &Assignment, seq: &mut u64, progress: (u32, u64)) -> Beat {
    let shard = shared.cfg.shard;
    for _ in 0..64 {
        *seq = seq.saturating_add(1);
        let hb = JobHeartbeat {
            job: a.job,
            attempt: a.attempt,
            seq: *seq,
            progress_ppm: progress.0,
            checkpoint: progress.1,
        };
        match shared.client.job_heartbeat(shard, a.org, hb).await {
            Ok(Reply::JobHeartbeat(r)) => {
                if let Some(s) = r.stop {
                    return Beat::Stop(format!(
                        "out of credits (settled: captured {}, uncollected {})",
                        s.captured_micro, s.uncollected_micro
                    ));
                }
                if r.accepted {
                    debug!(
                        job = a.job.0,
                        attempt = a.attempt,
                        seq = *seq,
                        ppm = progress.0,
                        checkpoint = progress.1,
                        captured = r.captured_attempt_micro,
                        "heartbeat"
                    );
                    return Beat::Accepted;
                }
                // The shard has seen this seq: an earlier agent process heartbeated this
                // attempt. Jump ahead until a seq is new.
                *seq = seq.saturating_mul(2);
            }
            Ok(other) => {
                warn!(job = a.job.0, "unexpected heartbeat reply {other:?}");
                return Beat::Unanswered;
            }
            Err(Error::Rejected(e @ CommandError::JobFinished)) => {
                return Beat::Stop(format!("the job has already finished ({e})"))
            }
            Err(Error::Rejected(
                e @ (CommandError::StaleAttempt { .. }
                | CommandError::JobNotPlaced
                | CommandError::UnknownJob),
            )) => return Beat::Stop(format!("heartbeat refused: {e}")),
            Err(e) => {
                warn!(job = a.job.0, attempt = a.attempt, "heartbeat failed: {e}");
                return Beat::Unanswered;
            }
        }
    }
    Beat::Unanswered
}

/// When a runner exited, for its finish report: `at`, counted from the moment the
/// attempt's heartbeat `seq` — the newest the cluster accepted — was `sent`, rounded up
/// to the millisecond (an exit the report places early would bill less than the runner
/// used; the cluster applied that heartbeat after it was sent, so counting from the send
/// places the exit a little late, never early). An exit before the send (the final
/// heartbeat goes out after the runner has exited) counts as 0.
fn runner_exit(seq: u64, sent: Instant, at: Instant) -> RunnerExit {
    let after = at.saturating_duration_since(sent);
    RunnerExit {
        heartbeat_seq: seq,
        after_ms: u64::try_from(after.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX),
    }
}

/// What the agent reports about an attempt that ended here.
#[derive(Clone, Copy, Debug)]
enum Report {
    /// The runner exited (or, while preempting, stopped): `FinishJob`, or `FinishJobAt`
    /// with when it exited if a heartbeat of the attempt was accepted.
    Finished {
        success: bool,
        exit: Option<RunnerExit>,
    },
    /// The agent stopped it because it could not renew a lease: `JobFenced`.
    Fenced,
}

/// Reports an attempt's end without an exit instant (no runner of it ran here).
async fn report_finish(shared: &Shared, (org, job): JobKey, attempt: u32, success: bool) {
    let what = Report::Finished {
        success,
        exit: None,
    };
    report(shared, (org, job), attempt, what).await
}

/// Reports an attempt's end, retrying (same request id) while the cluster is
/// unreachable. A shard whose rule version predates `FinishJobAt` refuses it with
/// nothing recorded (`UnsupportedRulesVersion`, before the idempotency table): the
/// report goes again at once as `FinishJob`, under the same request id, and stays so.
async fn report(shared: &Shared, (org, job): JobKey, attempt: u32, mut what: Report) {
    let id = shared.client.next_request_id();
    let started = Instant::now();
    let success = matches!(what, Report::Finished { success: true, .. });
    let mut fell_back = false;
    loop {
        let cmd = match what {
            Report::Finished {
                success,
                exit: None,
            } => Command::FinishJob {
                job,
                attempt,
                success,
            },
            Report::Finished {
                success,
                exit: Some(exit),
            } => Command::FinishJobAt {
                job,
                attempt,
                success,
                exit,
            },
            Report::Fenced => Command::JobFenced { job, attempt },
        };
        match shared
            .client
            .run_in(shared.cfg.shard, Some(org), id, cmd)
            .await
        {
            Ok(Reply::JobFinished(settlement)) => {
                match (settlement, what) {
                    (Some(s), _) => info!(job = job.0, attempt, success, reason = ?s.reason,
                        captured = s.captured_micro, refunded = s.refunded_micro, "job finished"),
                    (None, Report::Fenced) => {
                        info!(job = job.0, attempt, "fenced attempt reported; requeued")
                    }
                    (None, _) => info!(job = job.0, attempt, "preempted job stopped; requeued"),
                }
                return;
            }
            Ok(other) => {
                warn!(job = job.0, attempt, "unexpected finish reply {other:?}");
                return;
            }
            Err(Error::Rejected(CommandError::JobFinished)) => {
                info!(
                    job = job.0,
                    attempt, "the job had already finished and been settled: nothing to report"
                );
                return;
            }
            Err(Error::Rejected(e @ CommandError::StaleAttempt { .. })) => {
                info!(
                    job = job.0,
                    attempt, "the attempt was already requeued or placed again ({e})"
                );
                return;
            }
            Err(Error::Rejected(
                e @ (CommandError::UnsupportedRulesVersion { .. }
                | CommandError::InvalidJob(allot_statemachine::JobProblem::RunnerExit)),
            )) if matches!(what, Report::Finished { exit: Some(_), .. }) => {
                debug!(
                    job = job.0,
                    attempt, "the exit instant was refused ({e}): reporting without it"
                );
                if let Report::Finished { exit, .. } = &mut what {
                    *exit = None;
                }
                fell_back = true;
            }
            Err(Error::Rejected(CommandError::RequestIdReused)) if fell_back => {
                // A lagging replica refused a retry of the report with its exit instant,
                // which the shard had already recorded (its answer lost): done.
                info!(
                    job = job.0,
                    attempt, "the finish had already been recorded with its exit instant"
                );
                return;
            }
            // Refused for now, nothing recorded: the shard's idempotency table (or a
            // quota) is full. Dropping the report would leave the job to its lease, and a
            // job that succeeded would be requeued, run and billed again.
            Err(Error::Rejected(
                e @ (CommandError::LimitReached(_) | CommandError::QuotaExceeded(_)),
            )) if started.elapsed() < FINISH_PERSIST => {
                warn!(
                    job = job.0,
                    attempt, "the report was refused for now, retrying: {e}"
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(Error::Rejected(e)) => {
                warn!(
                    job = job.0,
                    attempt, "report refused (the job has moved on): {e}"
                );
                return;
            }
            Err(e) if started.elapsed() < FINISH_PERSIST => {
                warn!(
                    job = job.0,
                    attempt, "reporting the finish failed, retrying: {e}"
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                error!(job = job.0, attempt, "giving up reporting the finish: {e}");
                return;
            }
        }
    }
}

/// What a running attempt does when an assignment set no longer names it, by the
/// linearizable read that checks it: preempted, still placed here, or gone (SIGKILL, no
/// report). A read that fails (an election, a rate limit) is no answer: the attempt
/// keeps running — its heartbeats stop it if the cluster has moved on (`StaleAttempt`,
/// `UnknownJob`, …), and the fence stops it if the cluster stays unreachable. Taking a
/// failed read for "gone" killed a healthy runner unreported, and the job it left
/// `Running` ended `Lost` when its lease ran out.
fn when_gone(read: std::result::Result<Option<JobState>, ()>) -> Directive {
    match read {
        Ok(Some(JobState::Preempting)) => Directive::Preempt,
        Ok(Some(_)) | Err(()) => Directive::Run,
        Ok(None) => Directive::Gone,
    }
}

/// The state of `(job, attempt)` on this node by a linearizable read: `Ok(None)` when it
/// is not placed here (moved on, or the node now belongs to a newer agent process).
async fn read_assigned(
    shared: &Shared,
    (org, job): JobKey,
    attempt: u32,
) -> Result<Option<JobState>> {
    let set = shared
        .client
        .assignment_set(shared.cfg.shard, shared.cfg.node)
        .await?;
    if set.incarnation > shared.cfg.incarnation {
        return Ok(None);
    }
    Ok(set
        .assignments
        .into_iter()
        .find(|a| a.org == org && a.job == job && a.attempt == attempt)
        .map(|a| a.state))
}

/// Whether an attempt a set brought may start here, confirmed by a linearizable read
/// first: the set came from one replica's stream, which may lag the leader, and an
/// attempt that has moved on (cancelled, re-placed, preempted, or placed for a newer
/// agent process) must not start even for a moment. A failed read is never taken for
/// an answer: it is retried every second for as long as the attempt may still be
/// this node's. `Err(ended)`: not started; `ended` says whether the attempt is over here
/// (`false`: the node's lease is running out, a later set may start it).
async fn confirm_start(
    shared: &Shared,
    a: &Assignment,
    dir: &mut watch::Receiver<Directive>,
) -> std::result::Result<(), End> {
    let (job, attempt) = (a.job.0, a.attempt);
    let mut failures = 0u32;
    loop {
        let read = read_assigned(shared, a.key(), attempt).await;
        // A directive that came while the read was on its way: a newer attempt, a
        // shutdown or a newer agent process starts nothing, whatever the read says.
        if matches!(
            *dir.borrow(),
            Directive::Fenced | Directive::Shutdown | Directive::Superseded
        ) {
            return Err(End::NotStarted { ended: true });
        }
        match read {
            Ok(Some(JobState::Placed | JobState::Running)) => {
                if shared.lease.lapsing(&shared.cfg) {
                    debug!(
                        job,
                        attempt, "the node's lease is running out: not starting"
                    );
                    return Err(End::NotStarted { ended: false });
                }
                return Ok(());
            }
            Ok(Some(JobState::Preempting)) => {
                info!(
                    job,
                    attempt, "preempted before it started here: reporting it stopped"
                );
                return Err(End::Exited {
                    success: false,
                    exit: None,
                });
            }
            Ok(_) => {
                info!(
                    job,
                    attempt, "not started: the attempt is no longer this node's (a lagging view)"
                );
                return Err(End::NotStarted { ended: true });
            }
            // Warned once, then every minute (a revoked token fails every read).
            Err(e) if failures.is_multiple_of(60) => {
                failures += 1;
                warn!(
                    job,
                    attempt, "cannot confirm the attempt before starting it, retrying: {e}"
                )
            }
            Err(e) => {
                failures += 1;
                debug!(
                    job,
                    attempt, "cannot confirm the attempt before starting it, retrying: {e}"
                )
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            changed = dir.changed() => if changed.is_err() {
                return Err(End::NotStarted { ended: true });
            },
        }
        match *dir.borrow() {
            // The read decides (a set without it may come from a lagging replica too).
            Directive::Run | Directive::Preempt | Directive::Gone => {}
            Directive::Fenced | Directive::Shutdown | Directive::Superseded => {
                return Err(End::NotStarted { ended: true });
            }
        }
    }
}

/// How an attempt ended, as far as the agent is concerned.
enum End {
    /// The runner exited: report it, and when (after which accepted heartbeat) if a
    /// heartbeat of the attempt was accepted.
    Exited {
        success: bool,
        exit: Option<RunnerExit>,
    },
    /// Stopped because a lease could not be renewed: report `JobFenced`.
    Fenced,
    /// Stopped here; nothing to report.
    Dropped,
    /// Never started here; nothing to report. `ended: false`: a later set may start it.
    NotStarted { ended: bool },
}

async fn job_task(shared: Arc<Shared>, a: Assignment, mut dir: watch::Receiver<Directive>) {
    let end = run_attempt(&shared, &a, &mut dir).await;
    // The runner is gone before anything is reported (a fenced attempt may be placed
    // again as soon as the report lands). Its GPUs are free now: an attempt waiting for
    // them does not wait for the report too (retried for minutes through a partition).
    let _ = shared.done.send((a.key(), a.attempt, TaskEvent::GpusFree));
    let ended = !matches!(end, End::NotStarted { ended: false });
    match end {
        End::Exited { success, exit } => {
            report(
                &shared,
                a.key(),
                a.attempt,
                Report::Finished { success, exit },
            )
            .await
        }
        End::Fenced => report(&shared, a.key(), a.attempt, Report::Fenced).await,
        End::Dropped | End::NotStarted { .. } => {}
    }
    let _ = shared
        .done
        .send((a.key(), a.attempt, TaskEvent::Done { ended }));
}

async fn run_attempt(shared: &Shared, a: &Assignment, dir: &mut watch::Receiver<Directive>) -> End {
    let (job, attempt) = (a.job.0, a.attempt);
    if let Err(end) = confirm_start(shared, a, dir).await {
        return end;
    }
    let (runner, mut exit) = match Runner::start(shared, a).await {
        Ok(r) => r,
        Err(e) => {
            error!(job, attempt, "cannot start the job runner: {e}");
            return End::Exited {
                success: false,
                exit: None,
            };
        }
    };
    info!(job, attempt, gpus = %gpu_list(&a.gpu_indices), "job started");
    let mut seq = 0u64;
    // The newest heartbeat the cluster accepted: its seq and when it was sent. The job's
    // own lease counts from it (from the start, until one).
    let mut accepted: Option<(u64, Instant)> = None;
    let started = Instant::now();
    let job_renewed = |accepted: Option<(u64, Instant)>| accepted.map_or(started, |(_, sent)| sent);
    let mut tick = tokio::time::interval(shared.cfg.heartbeat_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut preempting = false;
    // Set once the runner is being stopped because a lease could not be renewed.
    let mut fencing = false;
    // When the runner gets SIGKILL (preemption grace or fence deadline).
    let mut kill_at: Option<Instant> = None;
    // A change of the lease lengths (a shortened lease moves the schedule earlier).
    let mut lengths = shared.lease.changed.subscribe();
    let end = loop {
        // Recomputed every turn: node renewals move it (the tick brings a turn at least
        // every heartbeat interval).
        let (term_at, fence_kill_at) = shared
            .lease
            .attempt_schedule(&shared.cfg, job_renewed(accepted));
        // Biased: an exit is handled before another heartbeat goes out for a runner that
        // is gone (one accepted after the exit would carry the bill to its application).
        tokio::select! {
            biased;
            exited = &mut exit => {
                let exited = exited.unwrap_or_else(|_| Exit::now(false, "lost".into()));
                // A preempted attempt's final progress: a checkpoint written while
                // stopping counts (it is billed to it and resumes from it). A runner that
                // ended otherwise is reported at once: a heartbeat after its exit,
                // retried through a partition, would be the meter's newest and carry the
                // bill to the heal. A fenced attempt's cluster is unreachable: its
                // report goes out when it answers.
                let sent = Instant::now();
                let last = if fencing || !preempting {
                    Beat::Unanswered
                } else {
                    heartbeat(shared, a, &mut seq, runner.progress()).await
                };
                if let Beat::Accepted = last {
                    accepted = Some((seq, sent));
                }
                let exit = accepted.map(|(seq, sent)| runner_exit(seq, sent, exited.at));
                if let Beat::Stop(why) = last {
                    info!(job, attempt, "runner exited ({}), but {why}", exited.how);
                    break End::Dropped;
                }
                if fencing {
                    info!(job, attempt, "runner stopped: the lease could not be renewed ({})", exited.how);
                    break End::Fenced;
                }
                if preempting {
                    info!(job, attempt, "runner stopped for preemption ({})", exited.how);
                    break End::Exited { success: false, exit };
                }
                info!(job, attempt, success = exited.success, "runner exited ({})", exited.how);
                break End::Exited { success: exited.success, exit };
            }
            _ = lengths.changed() => {}
            _ = tick.tick(), if !fencing => {
                // A heartbeat to an unreachable cluster waits out the client's timeout:
                // never past the moment the runner must be stopped (as of now: the
                // lengths may have changed since this turn began).
                // Nor past a SIGKILL already due (a preemption's grace).
                let (term_at, _) = shared.lease.attempt_schedule(&shared.cfg, job_renewed(accepted));
                let sent = Instant::now();
                let beat = heartbeat(shared, a, &mut seq, runner.progress());
                let until = kill_at.map_or(term_at, |k| k.min(term_at));
                match tokio::time::timeout_at(until.max(sent), beat).await {
                    Ok(Beat::Accepted) => accepted = Some((seq, sent)),
                    Ok(Beat::Unanswered) | Err(_) => {}
                    Ok(Beat::Stop(why)) => {
                        warn!(job, attempt, "killing the runner: {why}");
                        break kill_and_reap(&runner, &mut exit).await;
                    }
                }
            }
            _ = tokio::time::sleep_until(term_at), if !fencing => {
                // No renewal for too long: the cluster will re-place this job once the
                // lease (and its margin) has run out. Stop it first.
                fencing = true;
                let left = fence_kill_at.saturating_duration_since(Instant::now());
                warn!(job, attempt, ?left, "lease not renewed: SIGTERM, SIGKILL before the lease ends");
                runner.terminate().await;
                kill_at = Some(kill_at.map_or(fence_kill_at, |k| k.min(fence_kill_at)));
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() => {
                warn!(job, attempt, fencing, preempting, "SIGKILL");
                kill_at = None;
                runner.kill().await;
            }
            changed = dir.changed() => {
                let d = if changed.is_ok() { *dir.borrow_and_update() } else { Directive::Shutdown };
                let d = match d {
                    Directive::Gone => {
                        // Confirmed within a SIGKILL already due: a read still on its way
                        // then confirms nothing, and the kill goes first.
                        let read = read_assigned(shared, a.key(), attempt);
                        let read = match kill_at {
                            Some(k) => tokio::time::timeout_at(k, read)
                                .await
                                .unwrap_or_else(|_| Err(Error::Local("no answer before the runner's SIGKILL was due".into()))),
                            None => read.await,
                        };
                        if let Err(e) = &read {
                            warn!(job, attempt, "a set without the attempt, and the cluster could not confirm it: \
                                  it keeps running (its heartbeats and the fence stop it if it moved on): {e}");
                        }
                        when_gone(read.map_err(|_| ()))
                    }
                    d => d,
                };
                match d {
                    Directive::Run => {}
                    Directive::Preempt if !preempting => {
                        preempting = true;
                        let grace = shared.lease.preemption_grace(&shared.cfg);
                        let grace_end = Instant::now() + grace;
                        kill_at = Some(kill_at.map_or(grace_end, |k| k.min(grace_end)));
                        info!(job, attempt, ?grace, "preempted: SIGTERM");
                        runner.terminate().await;
                    }
                    Directive::Preempt => {}
                    Directive::Gone | Directive::Fenced => {
                        warn!(job, attempt, "no longer assigned here ({d:?}): SIGKILL");
                        break kill_and_reap(&runner, &mut exit).await;
                    }
                    Directive::Superseded => {
                        warn!(job, attempt, "a newer agent process runs this node: SIGKILL");
                        break kill_and_reap(&runner, &mut exit).await;
                    }
                    Directive::Shutdown => {
                        info!(job, attempt, "agent shutting down: SIGTERM (not reported as finished)");
                        runner.terminate().await;
                        // SIGKILL after the agent's grace, but never later than a
                        // SIGKILL already due (a preemption's grace, the fence) nor the
                        // fence's own deadline: from now on nothing renews the leases,
                        // and the cluster re-places the job once they run out.
                        let grace_end = Instant::now() + shared.cfg.grace;
                        let deadline = kill_at.map_or(grace_end, |k| k.min(grace_end)).min(fence_kill_at);
                        if tokio::time::timeout_at(deadline, &mut exit).await.is_err() {
                            warn!(job, attempt, "still running after the grace period: SIGKILL");
                            runner.kill().await;
                            let _ = tokio::time::timeout(REAP_TIMEOUT, &mut exit).await;
                        }
                        break End::Dropped;
                    }
                }
            }
        }
    };
    runner.cleanup();
    end
}

/// SIGKILL, then waits for the runner to be gone, [`REAP_TIMEOUT`] at most: its GPUs
/// stay this attempt's until then (`Agent::start_new`). A process stuck in the kernel
/// past that gives them up with an error — held for good, every attempt placed on them
/// would wait out its job lease and end `Lost`.
async fn kill_and_reap(runner: &Runner, exit: &mut oneshot::Receiver<Exit>) -> End {
    runner.kill().await;
    if tokio::time::timeout(REAP_TIMEOUT, exit).await.is_err() {
        error!("the runner did not exit {REAP_TIMEOUT:?} after SIGKILL: its GPUs are given up");
    }
    End::Dropped
}

// ---------------------------------------------------------------------------- main loop

struct Task {
    attempt: u32,
    /// The GPUs the attempt holds here until its runner is gone ([`TaskEvent::GpusFree`]).
    gpus: Vec<u8>,
    directive: watch::Sender<Directive>,
    join: tokio::task::JoinHandle<()>,
}

struct Agent {
    shared: Arc<Shared>,
    tasks: HashMap<JobKey, Task>,
    /// Highest attempt of each job that ended here (bounded, oldest forgotten first).
    ended: HashMap<JobKey, u32>,
    ended_order: VecDeque<JobKey>,
    last_set: Vec<Assignment>,
}

impl Agent {
    fn record_ended(&mut self, job: JobKey, attempt: u32) {
        let e = self.ended.entry(job).or_insert(0);
        if *e == 0 {
            self.ended_order.push_back(job);
        }
        *e = (*e).max(attempt);
        while self.ended_order.len() > ENDED_REMEMBERED {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    /// Applies a whole assignment set: directs running attempts, starts new ones.
    /// `Err(current)`: the set names a newer agent process for this node (incarnation
    /// `current`): this process has been replaced and must stop.
    /// `linearizable`: the set is a linearizable read's (the resync), not a replica's
    /// stream.
    fn reconcile(
        &mut self,
        set: AssignmentSet,
        linearizable: bool,
    ) -> std::result::Result<(), u64> {
        let mine = self.shared.cfg.incarnation;
        if set.incarnation > mine {
            return Err(set.incarnation);
        }
        if set.incarnation != 0 && set.incarnation < mine {
            // From a replica's stream: one that has not yet applied this process's
            // registration; its set holds the previous process's attempts, which the
            // registration ended. From a linearizable read, the shard's record went
            // back (restored from a backup taken before this process registered):
            // the node is registered again, and the set is ignored either way.
            if linearizable {
                self.shared.register_again.store(true, Ordering::Relaxed);
            }
            debug!(
                seen = set.incarnation,
                mine,
                linearizable,
                "an assignment set from before this process registered: ignored"
            );
            return Ok(());
        }
        let set = set.assignments;
        let by_job: HashMap<JobKey, &Assignment> = set.iter().map(|a| (a.key(), a)).collect();
        for (job, task) in &self.tasks {
            let d = match by_job.get(job) {
                None => Directive::Gone,
                Some(a) if a.attempt > task.attempt => Directive::Fenced,
                // An older view (a lagging replica): it says nothing about this attempt.
                Some(a) if a.attempt < task.attempt => continue,
                Some(a) if a.state == JobState::Preempting => Directive::Preempt,
                Some(_) => Directive::Run,
            };
            if d == Directive::Gone {
                // Always re-checked: an earlier check may have found it still placed.
                task.directive.send_replace(d);
            } else {
                task.directive.send_if_modified(|cur| {
                    let change = *cur != d && !(*cur == Directive::Preempt && d == Directive::Run);
                    if change {
                        *cur = d;
                    }
                    change
                });
            }
        }
        self.last_set = set;
        self.start_new();
        Ok(())
    }

    /// Starts the attempts of the last set that are not running here — none while the
    /// node's lease is running out (they would be stopped at once, and the cluster may
    /// soon place them elsewhere), and none on a GPU that another attempt's runner still
    /// holds.
    ///
    /// The cluster frees a job's GPUs when it ends the job (a cancel, a lease, the
    /// ledger's stop) and may place the next job on them in the same entry, so one set
    /// can name a new attempt on GPUs whose runner is still being confirmed gone and
    /// killed here. That attempt waits until that runner is gone (`task_event` calls
    /// this again): two runners never share a GPU on this node.
    fn start_new(&mut self) {
        if self.shared.lease.lapsing(&self.shared.cfg) {
            debug!("the node's lease is running out: starting no attempt");
            return;
        }
        let mut held: BTreeSet<u8> = self
            .tasks
            .values()
            .flat_map(|t| t.gpus.iter().copied())
            .collect();
        let set = std::mem::take(&mut self.last_set);
        for a in &set {
            if self.tasks.contains_key(&a.key())
                || self.ended.get(&a.key()).is_some_and(|&e| e >= a.attempt)
            {
                continue;
            }
            match a.state {
                JobState::Placed | JobState::Running
                    if a.gpu_indices.iter().any(|g| held.contains(g)) =>
                {
                    debug!(
                        job = a.job.0,
                        attempt = a.attempt,
                        gpus = %gpu_list(&a.gpu_indices),
                        "waiting for a runner still on these GPUs to be gone"
                    );
                }
                JobState::Placed | JobState::Running => {
                    held.extend(a.gpu_indices.iter().copied());
                    let (tx, rx) = watch::channel(Directive::Run);
                    let join = tokio::spawn(job_task(self.shared.clone(), a.clone(), rx));
                    self.tasks.insert(
                        a.key(),
                        Task {
                            attempt: a.attempt,
                            gpus: a.gpu_indices.clone(),
                            directive: tx,
                            join,
                        },
                    );
                }
                JobState::Preempting => {
                    // Not running here (the agent restarted): it has already stopped.
                    info!(
                        job = a.job.0,
                        attempt = a.attempt,
                        "preempted job is not running here: reporting it stopped"
                    );
                    self.record_ended(a.key(), a.attempt);
                    let (shared, job, attempt) = (self.shared.clone(), a.key(), a.attempt);
                    tokio::spawn(async move { report_finish(&shared, job, attempt, false).await });
                }
                _ => {}
            }
        }
        self.last_set = set;
    }

    fn task_event(&mut self, job: JobKey, attempt: u32, event: TaskEvent) {
        let mine = self.tasks.get_mut(&job).filter(|t| t.attempt == attempt);
        match event {
            TaskEvent::GpusFree => {
                if let Some(t) = mine {
                    t.gpus.clear();
                }
            }
            TaskEvent::Done { ended } => {
                if mine.is_some() {
                    self.tasks.remove(&job);
                }
                if ended {
                    self.record_ended(job, attempt);
                }
            }
        }
        // An attempt may have been waiting for this one's GPUs.
        self.start_new();
    }
}

/// Registers the node; returns when the registration (which starts the node's lease) was
/// sent.
async fn register(admin: &Client, cfg: &AgentConfig) -> Result<Instant> {
    let mut backoff = Duration::from_millis(200);
    loop {
        let sent = Instant::now();
        match admin.register_node(cfg.shard, cfg.node_spec()).await {
            Ok(()) => {
                info!(node = cfg.node.0, shard = cfg.shard, gpu_type = %cfg.gpu_type,
                    gpus = cfg.gpus, "node registered");
                return Ok(sent);
            }
            Err(
                e @ (Error::Rejected(_)
                | Error::InvalidArgument(_)
                | Error::Config(_)
                | Error::NotFound(_)
                | Error::Unauthenticated(_)
                | Error::PermissionDenied(_)),
            ) => return Err(e),
            Err(e) => {
                warn!("registering the node failed, retrying: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Renews the node's lease every interval, recording when each accepted renewal was
/// sent (the agent's fence counts from it).
async fn node_heartbeats(client: Client, admin: Option<Client>, shared: Arc<Shared>) {
    let cfg = &shared.cfg;
    let mut tick = tokio::time::interval(cfg.node_heartbeat_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let sent = Instant::now();
        if shared.register_again.load(Ordering::Relaxed) {
            warn!(
                incarnation = cfg.incarnation,
                "the shard's record of this node names an older agent process (restored \
                 from a backup?): registering again"
            );
            if register_again(cfg, admin.as_ref(), &shared.lease, sent).await {
                shared.register_again.store(false, Ordering::Relaxed);
            }
            continue;
        }
        match client.node_heartbeat_at(cfg.shard, cfg.node).await {
            // The lengths may have been retuned (`ConfigureScheduler`): the renewal
            // counts once a read of them made after it was applied answers, within half
            // an interval (the next renewal is not delayed); else it is not counted.
            Ok(index) => match tokio::time::timeout(
                cfg.node_heartbeat_interval / 2,
                read_lengths(&client, cfg.shard, Some(index)),
            )
            .await
            {
                Ok(Ok(read)) => shared.lease.renewed_with(sent, read),
                Ok(Err(e)) => debug!("renewal not counted: reading the lease lengths failed: {e}"),
                Err(_) => debug!("renewal not counted: the lease lengths were not read in time"),
            },
            Err(Error::Rejected(CommandError::UnknownNode)) => {
                warn!("the shard does not know this node: registering again");
                register_again(cfg, admin.as_ref(), &shared.lease, sent).await;
            }
            Err(e) => warn!("node heartbeat failed: {e}"),
        }
    }
}

/// Registers the node again with this process's incarnation (which also renews its
/// lease, counted from `sent`); whether it was registered.
async fn register_again(
    cfg: &AgentConfig,
    kept: Option<&Client>,
    lease: &Lease,
    sent: Instant,
) -> bool {
    match reregister_client(cfg, kept) {
        Some(admin) => match admin.register_node(cfg.shard, cfg.node_spec()).await {
            Ok(()) => {
                // The renewal registering makes counts as a heartbeat's (linearizable:
                // the read follows the registration's apply).
                match read_lengths(&admin, cfg.shard, None).await {
                    Ok(read) => lease.renewed_with(sent, read),
                    Err(e) => debug!("renewal not counted: reading the lease lengths failed: {e}"),
                }
                true
            }
            Err(e) => {
                warn!("registering the node failed: {e}");
                false
            }
        },
        None => {
            error!(
                "no admin token to register the node again (--register-token-file): \
                 the node takes no work until this agent can register it (restart it \
                 with --register-token-file)"
            );
            false
        }
    }
}

/// The client to register the node again with: one built from the register-token file
/// (read now), else the one kept from start-up (a token given otherwise), if any.
fn reregister_client(cfg: &AgentConfig, kept: Option<&Client>) -> Option<Client> {
    if let Some(path) = &cfg.register_token_file {
        match std::fs::read_to_string(path) {
            Ok(t) => {
                return admin_client(cfg, Some(t.trim().to_string()))
                    .map_err(|e| error!("building the registration client: {e}"))
                    .ok()
            }
            Err(e) => warn!(path = %path.display(), "cannot read the register token: {e}"),
        }
    }
    kept.cloned()
}

/// The shard's (node lease, job lease, preemption grace) lengths, as of log index
/// `since` or later (`None`: linearizable).
async fn read_lengths(client: &Client, shard: u32, since: Option<u64>) -> Result<[u64; 3]> {
    let s = match since {
        Some(index) => client.scheduler_settings_since(shard, index).await?,
        None => client.scheduler_settings(shard).await?,
    };
    Ok([s.node_lease_ms, s.job_lease_ms, s.grace_ms])
}

/// [`read_lengths`] (linearizable) until it answers; `None` if `shutdown` comes first.
async fn read_lengths_until(
    client: &Client,
    shard: u32,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> Option<[u64; 3]> {
    loop {
        tokio::select! {
            r = read_lengths(client, shard, None) => match r {
                Ok(read) => return Some(read),
                Err(e) => {
                    warn!("reading the shard's lease lengths failed, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            },
            _ = &mut *shutdown => return None,
        }
    }
}

/// Follows the assignment stream, moving to the next endpoint (with backoff) whenever
/// it ends or fails.
async fn watch_sets(client: Client, cfg: AgentConfig, tx: mpsc::Sender<(AssignmentSet, bool)>) {
    let endpoints = client.endpoints().to_vec();
    let mut i = 0usize;
    let base = Duration::from_millis(200);
    let mut backoff = base;
    loop {
        let addr = &endpoints[i % endpoints.len()];
        match client
            .watch_assignment_sets(addr, cfg.shard, cfg.node)
            .await
        {
            Ok(mut stream) => {
                debug!(%addr, "watching assignments");
                loop {
                    match stream.next().await {
                        Some(Ok(set)) => {
                            backoff = base;
                            if tx.send((set, false)).await.is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) => {
                            warn!(%addr, "assignment stream failed: {e}");
                            break;
                        }
                        None => {
                            info!(%addr, "assignment stream ended");
                            break;
                        }
                    }
                }
            }
            Err(e) => warn!(%addr, "cannot watch assignments: {e}"),
        }
        i += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Re-reads the assignment set (linearizable) now and then (the lease lengths are read
/// after every accepted node heartbeat).
async fn resync(client: Client, shared: Arc<Shared>, tx: mpsc::Sender<(AssignmentSet, bool)>) {
    let cfg = &shared.cfg;
    loop {
        tokio::time::sleep(RESYNC_INTERVAL).await;
        match client.assignment_set(cfg.shard, cfg.node).await {
            Ok(set) => {
                if tx.send((set, true)).await.is_err() {
                    return;
                }
            }
            Err(e) => debug!("resync failed: {e}"),
        }
    }
}

fn builder(cfg: &AgentConfig) -> crate::ClientBuilder {
    Client::builder()
        .endpoints(cfg.endpoints.clone())
        .timeout(Duration::from_secs(5))
        .attempt_timeout(Duration::from_secs(2))
        .retries(1_000)
}

/// The agent's own client (its node's identity).
fn agent_client(cfg: &AgentConfig) -> Result<Client> {
    let mut b = builder(cfg).identity(Actor::Agent(cfg.node));
    if let Some(t) = &cfg.token {
        b = b.token(t.clone());
    }
    b.build()
}

/// A client that registers the node: `token` (an admin token), else the agent's own.
fn admin_client(cfg: &AgentConfig, token: Option<String>) -> Result<Client> {
    let mut b = builder(cfg).identity(Actor::Admin(PrincipalId(1)));
    if let Some(t) = token.or_else(|| cfg.token.clone()) {
        b = b.token(t);
    }
    b.build()
}

/// Runs the agent until `shutdown` completes (see the module docs). Fails only at
/// start-up: a bad configuration, or a registration the shard refuses.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    config.validate()?;
    std::fs::create_dir_all(&config.work_dir)
        .map_err(|e| Error::Config(format!("work dir {}: {e}", config.work_dir.display())))?;
    let work_dir = std::fs::canonicalize(&config.work_dir)
        .map_err(|e| Error::Config(format!("work dir {}: {e}", config.work_dir.display())))?;
    let _held = lock_work_dir(&work_dir)?;
    if let Some(r) = &config.runner_uids {
        r.check_host()
            .map_err(|e| Error::Config(format!("--runner-uid-range {e}")))?;
    }
    if config.runner_user.is_some() || config.runner_uids.is_some() {
        // Runners (other users) may pass through to their progress files (and homes),
        // nothing more.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&work_dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| Error::Config(format!("work dir {}: {e}", work_dir.display())))?;
    }
    let uids = match config.runner_uids {
        Some(r) => Some(
            uids::UidPool::new(r, &work_dir)
                .map_err(|e| Error::Config(format!("work dir {}: {e}", work_dir.display())))?,
        ),
        None => None,
    };
    let cgroups = cgroup::Cgroups::open(&config.cgroup, &work_dir).map_err(Error::Config)?;
    let predecessor = last_registered(&work_dir)?;
    let incarnation = next_incarnation(&work_dir)?;
    let runner_procs_max = if config.runner_user.is_some() || config.runner_uids.is_some() {
        let n = runner_procs_max(&config)?;
        if n > 0 && matches!(config.mode, Mode::Run { .. }) {
            info!(
                max = n,
                per = if config.runner_uids.is_some() {
                    "attempt"
                } else {
                    "node"
                },
                "runner processes and threads bounded (RLIMIT_NPROC of the runner uid)"
            );
        }
        Some(n)
    } else {
        Some(0)
    };
    let config = AgentConfig {
        work_dir,
        incarnation,
        runner_procs_max,
        ..config
    };
    tokio::pin!(shutdown);
    // A previous agent process's runners go before the node offers its GPUs again.
    let orphans = tokio::select! {
        n = stop_orphans(&config.work_dir, cgroups.as_ref(), config.grace) => n,
        _ = &mut shutdown => return Ok(()),
    };
    if orphans > 0 {
        warn!(
            orphans,
            "stopped the runners a previous agent process left behind"
        );
    }
    // Started: the service manager's watchdog runs from here (the `notify` module).
    // `STOPPING=1` when this is dropped, whichever way the function returns.
    let mut started = notify::Notifier::from_env().map(notify::Notifier::ready);
    if let Some(pool) = &uids {
        let swept = pool.recover().await;
        if swept > 0 {
            warn!(
                swept,
                "swept the runner uids a previous agent process left in use"
            );
        }
    }
    remove_stale_progress_files(&config.work_dir);
    let client = agent_client(&config)?;
    // The register token: the one given, else the file's (read once here).
    let register_token = match (&config.register_token, &config.register_token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("register token {}: {e}", path.display())))?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    let admin = admin_client(&config, register_token)?;
    if wait_for_another_process(&client, &config, predecessor, &mut shutdown)
        .await
        .is_none()
    {
        return Ok(());
    }
    // The lease lengths are read before registering and again after (the renewal a
    // registration makes is counted like a heartbeat's: `Lease::learn`).
    let Some(before) = read_lengths_until(&client, config.shard, &mut shutdown).await else {
        return Ok(());
    };
    let node_lease = Duration::from_millis(before[0]);
    if let Some(w) = started.as_ref().and_then(notify::Started::watchdog) {
        if w >= node_lease / 2 {
            warn!(
                watchdog = ?w,
                ?node_lease,
                "the service manager's watchdog is not shorter than half the node lease: \
                 a paused agent's runners may outlive it past the cluster's re-placement"
            );
        }
    }
    let registered = tokio::select! {
        r = register(&admin, &config) => r?,
        _ = &mut shutdown => return Ok(()),
    };
    // This work dir's process now holds the node: a restart here registers at once.
    if let Err(e) = write_number(&config.work_dir, REGISTERED_FILE, config.incarnation) {
        warn!("recording the registration failed (a restart here may wait for this process's lease): {e}");
    }
    // Kept only when there is no file to read it from again (a token given otherwise).
    let admin = config.register_token_file.is_none().then_some(admin);
    let lease = Lease::new(registered, before);
    let Some(after) = read_lengths_until(&client, config.shard, &mut shutdown).await else {
        return Ok(());
    };
    lease.renewed_with(registered, after);

    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let (sets_tx, mut sets_rx) = mpsc::channel(16);
    let grace = config.grace;
    let shared = Arc::new(Shared {
        cfg: config,
        client: client.clone(),
        done: done_tx,
        lease,
        cgroups,
        uids,
        register_again: Default::default(),
    });
    let background = [
        tokio::spawn(node_heartbeats(client.clone(), admin, shared.clone())),
        tokio::spawn(watch_sets(
            client.clone(),
            shared.cfg.clone(),
            sets_tx.clone(),
        )),
        tokio::spawn(resync(client, shared.clone(), sets_tx)),
        tokio::spawn(prune_logs_hourly(
            shared.cfg.work_dir.clone(),
            shared.cfg.log_retention,
        )),
    ];
    let mut agent = Agent {
        shared,
        tasks: HashMap::new(),
        ended: HashMap::new(),
        ended_order: VecDeque::new(),
        last_set: Vec::new(),
    };
    let mut superseded = None;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some((set, linearizable)) = sets_rx.recv() => if let Err(current) = agent.reconcile(set, linearizable) {
                superseded = Some(current);
                break;
            },
            Some((job, attempt, event)) = done_rx.recv() => agent.task_event(job, attempt, event),
        }
    }

    for b in &background {
        b.abort();
    }
    if let Some(s) = &mut started {
        s.stopping();
    }
    let stop = match superseded {
        Some(current) => {
            // Another agent process registered this node after this one did (this one
            // was paused, or its host cloned): its registration ended every attempt this
            // process runs, and re-placed jobs may already run under it. Nothing of this
            // process may run, renew or report any more.
            error!(
                mine = agent.shared.cfg.incarnation,
                current,
                running = agent.tasks.len(),
                "a newer agent process has registered this node: killing every runner and exiting"
            );
            Directive::Superseded
        }
        None => {
            info!(running = agent.tasks.len(), "shutting down");
            Directive::Shutdown
        }
    };
    for t in agent.tasks.values() {
        t.directive.send_replace(stop);
    }
    let deadline = Instant::now() + grace + REAP_TIMEOUT + Duration::from_secs(1);
    for (job, t) in agent.tasks.drain() {
        let mut join = t.join;
        if tokio::time::timeout_at(deadline, &mut join).await.is_err() {
            warn!(
                org = job.0 .0,
                job = job.1 .0,
                "the job's task did not stop in time"
            );
            join.abort();
        }
    }
    if let Some(c) = &agent.shared.cgroups {
        c.close();
    }
    match superseded {
        Some(current) => Err(Error::Rejected(CommandError::StaleIncarnation {
            given: agent.shared.cfg.incarnation,
            current,
        })),
        None => Ok(()),
    }
}

/// A new progress file name for an attempt in the work directory:
/// `job-<org>-<job>.<attempt>.<128 random bits in hex>.progress`. The random part keeps
/// it from every other runner: runners of every org may share one uid
/// (`--runner-user`), and the work dir lets them pass through to a file whose name they
/// know (0711), so a name made of the org, job and attempt let any runner on the node
/// read another org's progress and checkpoint, or write them — a billing input. Its
/// runner learns it from `ALLOT_PROGRESS_FILE`.
pub fn progress_file(work_dir: &Path, org: OrgId, job: JobId, attempt: u32) -> Result<PathBuf> {
    let mut secret = [0u8; 16];
    getrandom::fill(&mut secret).map_err(|e| Error::Config(format!("no OS randomness: {e}")))?;
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    Ok(work_dir.join(format!(
        "job-{}-{}.{}.{hex}.progress",
        org.0, job.0, attempt
    )))
}

/// Progress files a previous agent process left (it ended without cleaning up): the
/// runners they belonged to are stopped before this one registers.
fn remove_stale_progress_files(work_dir: &Path) {
    let Ok(dir) = std::fs::read_dir(work_dir) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("job-") && name.ends_with(".progress") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    /// A runner's exit is placed a whole millisecond late rather than a fraction early
    /// (an early exit bills less than the runner used), and an exit before the
    /// heartbeat counted from (the final one goes out after the runner exited) is 0.
    #[test]
    fn a_runner_exit_counts_whole_milliseconds_up_from_the_heartbeats_send() {
        use std::time::Duration;
        let sent = tokio::time::Instant::now();
        let at = |us| sent + Duration::from_micros(us);
        let ms = |a| super::runner_exit(4, sent, a).after_ms;
        assert_eq!(super::runner_exit(4, sent, at(0)).heartbeat_seq, 4);
        assert_eq!(ms(at(0)), 0);
        assert_eq!(ms(at(1)), 1);
        assert_eq!(ms(at(1_000)), 1);
        assert_eq!(ms(at(1_001)), 2);
        assert_eq!(ms(at(2_500_000)), 2_500);
        assert_eq!(super::runner_exit(4, at(5_000), sent).after_ms, 0);
    }

    /// `--runner-procs-max auto`: half of `pid_max`, one share per GPU when each attempt
    /// has a uid of its own, never below the floor.
    #[test]
    fn the_derived_bound_on_runner_processes_shares_half_the_pids() {
        use super::{procs_max_for, RUNNER_PROCS_MIN_AUTO};
        assert_eq!(procs_max_for(4_194_304, 8, true), 262_144);
        assert_eq!(procs_max_for(4_194_304, 8, false), 2_097_152);
        assert_eq!(procs_max_for(32_768, 1, true), 16_384);
        assert_eq!(procs_max_for(32_768, 8, true), 2_048);
        assert_eq!(procs_max_for(32_768, 64, true), RUNNER_PROCS_MIN_AUTO);
        assert_eq!(procs_max_for(32_768, 0, true), 16_384);
    }

    /// A runner cannot find another attempt's progress file by its org, job and
    /// attempt: the name carries 128 random bits, new for every attempt started (before,
    /// it was `job-<org>-<job>.<attempt>.progress`, which any runner on the node sharing
    /// the runner uid could open, read and write in the pass-through work dir).
    #[test]
    fn progress_file_names_cannot_be_guessed() {
        use allot_statemachine::{JobId, OrgId};
        let dir = std::path::Path::new("/w");
        let a = super::progress_file(dir, OrgId(7), JobId(3), 1).unwrap();
        let b = super::progress_file(dir, OrgId(7), JobId(3), 1).unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_str().unwrap();
        let secret = name
            .strip_prefix("job-7-3.1.")
            .and_then(|r| r.strip_suffix(".progress"))
            .expect("job-<org>-<job>.<attempt>.<secret>.progress");
        assert_eq!(secret.len(), 32);
        assert!(secret.chars().all(|c| c.is_ascii_hexdigit()));
    }

    /// A set without a running attempt is acted on only by what the cluster answers:
    /// gone, preempted or still here; a read that failed keeps the runner (before, it
    /// was killed as gone, and the job ended `Lost`).
    #[test]
    fn an_attempt_missing_from_a_set_is_killed_only_if_the_cluster_says_it_is_gone() {
        use super::{when_gone, Directive, JobState};
        assert_eq!(when_gone(Ok(None)), Directive::Gone);
        assert_eq!(
            when_gone(Ok(Some(JobState::Preempting))),
            Directive::Preempt
        );
        assert_eq!(when_gone(Ok(Some(JobState::Running))), Directive::Run);
        assert_eq!(when_gone(Ok(Some(JobState::Placed))), Directive::Run);
        assert_eq!(
            when_gone(Err(())),
            Directive::Run,
            "a failed read is no answer"
        );
    }

    use super::*;

    /// Each agent process's incarnation is above the last one recorded in its work dir,
    /// even when the recorded one is ahead of the clock, and at least the clock (ms).
    #[test]
    fn incarnations_only_go_up() {
        let dir = tempfile::tempdir().unwrap();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let a = next_incarnation(dir.path()).unwrap();
        assert!(a >= now_ms, "{a} < {now_ms}");
        let b = next_incarnation(dir.path()).unwrap();
        assert!(b > a, "{b} <= {a}");
        // A recorded incarnation ahead of the clock (a clock stepped back) still rises.
        let ahead = now_ms + 86_400_000;
        std::fs::write(dir.path().join("incarnation"), ahead.to_string()).unwrap();
        assert_eq!(next_incarnation(dir.path()).unwrap(), ahead + 1);
        // Fields a later release appends after the number are ignored (an agent rolled
        // back over a newer one's work dir still rises above it).
        std::fs::write(
            dir.path().join("incarnation"),
            format!("{} v2 host=gpu-7\n", ahead + 10),
        )
        .unwrap();
        assert_eq!(next_incarnation(dir.path()).unwrap(), ahead + 11);
        // A damaged record is an error, not a silent restart from the clock.
        std::fs::write(dir.path().join("incarnation"), "x").unwrap();
        assert!(matches!(
            next_incarnation(dir.path()),
            Err(Error::Config(_))
        ));
    }

    /// A runner record in the layout a later release may write — the two fields every
    /// release reads first, then fields this one does not know — still gets its runner
    /// stopped by this release (an agent rolled back over a newer one's work dir), and the
    /// record is forgotten.
    #[tokio::test]
    async fn a_runner_recorded_with_fields_a_later_release_appends_is_stopped() {
        let dir = tempfile::tempdir().unwrap();
        // A process group of its own that the test does not parent (so no zombie of
        // ours keeps the group alive): `setsid` in a background job does not fork.
        let out = std::process::Command::new("sh")
            .args(["-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!"])
            .output()
            .unwrap();
        let pgid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let gone = || {
            std::fs::read_to_string(format!("/proc/{pgid}/stat")).map_or(true, |s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
        };
        let started = (0..100)
            .find_map(|_| {
                std::thread::sleep(Duration::from_millis(10));
                start_time(pgid).filter(|_| group_alive(pgid))
            })
            .expect("the runner's group");
        let runners = runners_dir(dir.path());
        std::fs::create_dir_all(&runners).unwrap();
        let record = runners.join(pgid.to_string());
        std::fs::write(
            &record,
            format!("{pgid} {started} 7 9 1 v2 cgroup=a1-7-9-1\n"),
        )
        .unwrap();
        let found = stop_orphans(dir.path(), None, Duration::from_secs(5)).await;
        assert_eq!(found, 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(), "the recorded runner {pgid} is still running");
        assert!(!record.exists(), "the record was not forgotten");
    }

    /// The agent's own credential variables cannot be allow-listed for runners.
    #[test]
    fn runners_never_get_the_agents_credential_variables() {
        for var in AGENT_CREDENTIAL_VARS {
            let mut c = AgentConfig::new(
                vec!["x:1".into()],
                NodeId(1),
                Mode::Simulate(SimConfig::default()),
            );
            c.runner_env.push(var.to_string());
            assert!(matches!(c.validate(), Err(Error::Config(_))), "{var}");
        }
        let mut c = AgentConfig::new(
            vec!["x:1".into()],
            NodeId(1),
            Mode::Simulate(SimConfig::default()),
        );
        c.runner_env.push("HF_TOKEN".into());
        assert!(c.validate().is_ok(), "a job's own token may be passed on");
    }

    #[test]
    fn runners_stop_inside_every_lease_however_short() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // A long lease: SIGKILL the margin before its end, SIGTERM the grace before that.
        assert_eq!(
            Lease::schedule(t0, 30_000, s(5), s(5)),
            (t0 + s(20), t0 + s(25))
        );
        // A 3 s lease with a 5 s margin: stopping at once would fence every attempt on
        // its first heartbeat; a quarter of the lease is kept for each step instead.
        assert_eq!(
            Lease::schedule(t0, 3_000, s(5), s(5)),
            (t0 + ms(1_500), t0 + ms(2_250))
        );
        // The grace never reaches back before the lease began.
        let (term, kill) = Lease::schedule(t0, 1, s(5), s(5));
        assert!(t0 <= term && term <= kill && kill <= t0 + ms(1));
    }

    /// A shortened lease counts at once; a longer one only from the read after the
    /// one that showed it (the renewal counted from may have been granted the old one).
    #[test]
    fn lease_lengths_count_with_the_shorter_of_the_last_two_reads() {
        let t = Instant::now();
        let l = Lease::new(t, [60_000, 180_000, 30_000]);
        let now =
            |l: &Lease| [&l.node_ms, &l.job_ms, &l.grace_ms].map(|a| a.load(Ordering::Relaxed));
        let mut changed = l.changed.subscribe();
        l.renewed_with(t, [60_000, 180_000, 30_000]);
        assert_eq!(now(&l), [60_000, 180_000, 30_000]);
        assert!(!changed.has_changed().unwrap());
        // Shortened: at once, and running attempts hear of it.
        let t1 = t + Duration::from_secs(1);
        l.renewed_with(t1, [5_000, 20_000, 10_000]);
        assert_eq!(now(&l), [5_000, 20_000, 10_000]);
        assert_eq!(*lock(&l.renewed), t1);
        assert!(changed.has_changed().unwrap());
        changed.mark_unchanged();
        // Lengthened: not for the renewal the read followed (it may have been granted
        // the shorter one) ...
        l.renewed_with(t1 + Duration::from_secs(1), [60_000, 180_000, 30_000]);
        assert_eq!(now(&l), [5_000, 20_000, 10_000]);
        assert!(!changed.has_changed().unwrap());
        // ... but from the next one.
        l.renewed_with(t1 + Duration::from_secs(2), [60_000, 180_000, 30_000]);
        assert_eq!(now(&l), [60_000, 180_000, 30_000]);
        assert!(changed.has_changed().unwrap());
        // A renewal never moves the lease back.
        l.renewed_with(t, [60_000, 180_000, 30_000]);
        assert_eq!(*lock(&l.renewed), t1 + Duration::from_secs(2));
    }

    #[test]
    fn progress_lines_parse_or_are_ignored() {
        assert_eq!(parse_progress("500000 3\n"), Some((500_000, 3)));
        assert_eq!(parse_progress("  0   0 "), Some((0, 0)));
        assert_eq!(parse_progress("2000000 1"), Some((1_000_000, 1)));
        for bad in ["", "5", "a b", "1 2 3", "-1 2", "1.5 2", "500000"] {
            assert_eq!(parse_progress(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        for bad in [
            "",
            "MiB",
            "1.5GiB",
            "-1",
            "12TB",
            "99999999999999999999",
            "17179869184GiB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn labels_and_ranges() {
        assert_eq!(
            parse_label("zone=eu-1").unwrap(),
            ("zone".to_string(), "eu-1".to_string())
        );
        assert_eq!(parse_label("k=").unwrap(), ("k".to_string(), String::new()));
        assert!(parse_label("=v").is_err());
        assert!(parse_label("novalue").is_err());
        assert_eq!(
            parse_duration_range("10s..30s").unwrap(),
            (Duration::from_secs(10), Duration::from_secs(30))
        );
        assert_eq!(
            parse_duration_range("1500ms").unwrap(),
            (Duration::from_millis(1500), Duration::from_millis(1500))
        );
        assert!(parse_duration_range("30s..10s").is_err());
        assert!(parse_duration_range("1s..x").is_err());
    }

    #[test]
    fn simulated_runtimes_are_deterministic_and_in_range() {
        let (lo, hi) = (Duration::from_secs(2), Duration::from_secs(4));
        let mut seen = std::collections::BTreeSet::new();
        for j in 0..200 {
            let r = sim_runtime(JobId(j), lo, hi);
            assert!(r >= lo && r <= hi, "{r:?}");
            assert_eq!(r, sim_runtime(JobId(j), lo, hi));
            seen.insert(r);
        }
        assert!(seen.len() > 100, "runtimes should spread over the range");
        assert_eq!(sim_runtime(JobId(7), lo, lo), lo);
        let fails = (0..1000).filter(|j| sim_fails(JobId(*j), 30)).count();
        assert!((200..400).contains(&fails), "{fails}");
        assert!((0..1000).all(|j| !sim_fails(JobId(j), 0)));
        assert!((0..1000).all(|j| sim_fails(JobId(j), 100)));
    }

    #[test]
    fn gpu_lists_are_comma_separated() {
        assert_eq!(gpu_list(&[0, 3, 12]), "0,3,12");
        assert_eq!(gpu_list(&[]), "");
        assert!(gpus_valid(&[0, 3, 7], 8));
        assert!(!gpus_valid(&[0, 8], 8), "past the node's GPUs");
        assert!(!gpus_valid(&[1, 1], 8), "one GPU twice");
        assert!(!gpus_valid(&[], 8), "none");
    }

    /// Runner logs past their retention go; newer logs and every other file stay.
    #[test]
    fn old_runner_logs_are_pruned_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        for f in [
            "job-1-2.1.log",
            "job-1-3.1.log",
            "incarnation",
            "job-1-2.1.progress",
        ] {
            std::fs::write(p.join(f), "x").unwrap();
        }
        let day_ago = std::time::SystemTime::now() - Duration::from_secs(86_400);
        for f in ["job-1-2.1.log", "incarnation", "job-1-2.1.progress"] {
            std::fs::File::options()
                .write(true)
                .open(p.join(f))
                .unwrap()
                .set_modified(day_ago)
                .unwrap();
        }
        assert_eq!(prune_logs(p, Duration::from_secs(3_600)), 1);
        let mut left: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["incarnation", "job-1-2.1.progress", "job-1-3.1.log"]);
        assert_eq!(prune_logs(p, Duration::from_secs(3_600)), 0);
    }

    /// Files a runner can reach are read without blocking, without following a
    /// symlink and only when small; files the agent writes replace whatever a runner
    /// put in their place.
    #[test]
    fn runner_reachable_files_are_read_and_written_defensively() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::write(p.join("ok"), "500000 7").unwrap();
        assert_eq!(
            read_small(&p.join("ok"), SMALL_FILE_MAX).unwrap(),
            "500000 7"
        );
        // A FIFO with no writer: refused at once, not waited on.
        let fifo = p.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_small(&fifo, SMALL_FILE_MAX).is_err());
        // A symlink (to an endless device): refused.
        std::os::unix::fs::symlink("/dev/zero", p.join("link")).unwrap();
        assert!(read_small(&p.join("link"), SMALL_FILE_MAX).is_err());
        // A long file: refused, not read whole.
        std::fs::write(p.join("long"), vec![b'1'; 10_000]).unwrap();
        assert!(read_small(&p.join("long"), SMALL_FILE_MAX).is_err());
        // A symlink planted where the agent writes: replaced, its target untouched.
        std::fs::write(p.join("victim"), "keep").unwrap();
        std::os::unix::fs::symlink(p.join("victim"), p.join("job.log")).unwrap();
        {
            use std::io::Write;
            create_fresh(&p.join("job.log"))
                .unwrap()
                .write_all(b"runner output")
                .unwrap();
        }
        assert_eq!(std::fs::read_to_string(p.join("victim")).unwrap(), "keep");
        assert_eq!(
            std::fs::read_to_string(p.join("job.log")).unwrap(),
            "runner output"
        );
        assert!(!std::fs::symlink_metadata(p.join("job.log"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    /// A work dir's predecessor is the last process that registered from it: one that
    /// chose an incarnation and stopped before registering (found by review: a SIGTERM
    /// during `stop_orphans`, a refused registration) does not make the next restart
    /// wait for the node's lease. A work dir of an earlier release has no `registered`
    /// file: its chosen incarnation stands in.
    #[test]
    fn the_predecessor_is_the_last_process_that_registered() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(last_registered(dir.path()).unwrap(), 0);
        let first = next_incarnation(dir.path()).unwrap();
        assert_eq!(
            last_registered(dir.path()).unwrap(),
            first,
            "an earlier release's dir"
        );
        write_number(dir.path(), REGISTERED_FILE, first).unwrap();
        let second = next_incarnation(dir.path()).unwrap();
        assert!(second > first);
        assert_eq!(
            last_registered(dir.path()).unwrap(),
            first,
            "never registered"
        );
        let set = |incarnation| AssignmentSet {
            incarnation,
            assignments: vec![Assignment {
                org: OrgId(1),
                job: JobId(1),
                attempt: 1,
                gpu_indices: vec![0],
                state: JobState::Running,
            }],
        };
        let predecessor = last_registered(dir.path()).unwrap();
        assert!(may_register(&set(first), predecessor));
        assert!(!may_register(&set(first + 99), predecessor));
        assert!(
            may_register(&set(0), predecessor),
            "an operator's registration"
        );
        assert!(may_register(&AssignmentSet::default(), predecessor));
        std::fs::write(dir.path().join(REGISTERED_FILE), "x").unwrap();
        assert!(last_registered(dir.path()).is_err());
    }

    /// A preempted runner is killed the fence margin (at most a quarter of the shard's
    /// grace) before the shard's grace would end counted from when the agent learnt of
    /// it: the shard's grace began at the preemption's entry, earlier, and at its end
    /// the cluster gives the GPUs to the preemptor. The agent's own shorter grace wins.
    #[test]
    fn a_preempted_runner_is_killed_a_margin_before_the_shards_grace_ends() {
        let mut cfg = AgentConfig::new(
            vec!["127.0.0.1:9".into()],
            NodeId(1),
            Mode::Simulate(SimConfig::default()),
        );
        cfg.grace = Duration::from_secs(60);
        cfg.fence_margin = Duration::from_secs(5);
        let grace = |shard_ms| {
            Lease::new(Instant::now(), [60_000, 60_000, shard_ms]).preemption_grace(&cfg)
        };
        assert_eq!(grace(30_000), Duration::from_secs(25));
        // A short grace keeps three quarters of itself.
        assert_eq!(grace(8_000), Duration::from_secs(6));
        assert_eq!(grace(0), Duration::ZERO);
        cfg.grace = Duration::from_secs(2);
        assert_eq!(
            Lease::new(Instant::now(), [60_000, 60_000, 30_000]).preemption_grace(&cfg),
            Duration::from_secs(2)
        );
    }

    /// The cluster frees a job's GPUs when it ends the job and may place the next job on
    /// them in the same entry: the set that says the first job is gone names the next on
    /// its GPUs while the first's runner is still being confirmed gone and killed. The
    /// next attempt starts only once that runner's task has ended; an attempt on other
    /// GPUs starts at once.
    #[tokio::test]
    async fn an_attempt_waits_for_the_runner_still_on_its_gpus() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = AgentConfig::new(
            vec!["127.0.0.1:9".into()],
            NodeId(1),
            Mode::Simulate(SimConfig::default()),
        );
        cfg.work_dir = dir.path().into();
        let (done, _done) = mpsc::unbounded_channel();
        let mut agent = Agent {
            shared: Arc::new(Shared {
                client: agent_client(&cfg).unwrap(),
                cfg,
                done,
                lease: Lease::new(Instant::now(), [600_000, 600_000, 30_000]),
                cgroups: None,
                uids: None,
                register_again: Default::default(),
            }),
            tasks: HashMap::new(),
            ended: HashMap::new(),
            ended_order: VecDeque::new(),
            last_set: Vec::new(),
        };
        let org = OrgId(7);
        let placed = |job, gpus: &[u8]| Assignment {
            org,
            job: JobId(job),
            attempt: 1,
            gpu_indices: gpus.to_vec(),
            state: JobState::Placed,
        };
        // Job 1's runner holds GPUs 0 and 1 (its task stands for the runner: it ends when
        // the runner is gone).
        let first = (org, JobId(1));
        agent.tasks.insert(
            first,
            Task {
                attempt: 1,
                gpus: vec![0, 1],
                directive: watch::channel(Directive::Run).0,
                join: tokio::spawn(std::future::pending()),
            },
        );
        // Job 1 is cancelled; job 2 is placed on GPU 1, job 3 on GPU 2.
        let set = AssignmentSet {
            incarnation: 0,
            assignments: vec![placed(2, &[1]), placed(3, &[2])],
        };
        agent.reconcile(set, false).unwrap();
        assert_eq!(*agent.tasks[&first].directive.borrow(), Directive::Gone);
        assert!(
            !agent.tasks.contains_key(&(org, JobId(2))),
            "job 2 started on GPU 1 while job 1's runner still holds it"
        );
        assert_eq!(agent.tasks[&(org, JobId(3))].gpus, vec![2]);
        // Job 1's runner is gone: job 2 starts, while job 1's task still reports.
        agent.task_event(first, 1, TaskEvent::GpusFree);
        assert!(agent.tasks[&first].gpus.is_empty());
        assert_eq!(agent.tasks[&(org, JobId(2))].gpus, vec![1]);
        agent.tasks[&first].join.abort();
        agent.task_event(first, 1, TaskEvent::Done { ended: true });
        assert!(!agent.tasks.contains_key(&first));
        for t in agent.tasks.values() {
            t.join.abort();
        }
    }
}
