//! `allot-agent`: the GPU node agent. Registers a GPU node, watches its assignments,
//! runs each job attempt with the configured runner (or simulates it), heartbeats
//! progress and checkpoints, forwards preemption as SIGTERM then SIGKILL after the
//! grace period, and reports exits. SIGTERM or Ctrl-C stops it cleanly (runners get
//! SIGTERM; their jobs are not reported finished). The behaviour is documented in
//! `allot_client::agent`.
//!
//!   allot-agent --endpoints 127.0.0.1:7101,127.0.0.1:7102 --shard 0 --node 7 \
//!       --gpu-type A100 --gpus 8 --mem-gb 80 --token-file /etc/allot/agent-token \
//!       --work-dir /var/lib/allot-agent -- /opt/jobs/run-job.sh
//!   allot-agent --endpoints 127.0.0.1:7101 --node 7 --simulate --sim-runtime 10s..30s

use allot_client::agent::{self, AgentConfig, Mode, SimConfig};
use allot_client::statemachine::{GpuType, NodeId};
use clap::{CommandFactory, FromArgMatches, Parser};
use std::path::PathBuf;
use std::time::Duration;

fn duration(s: &str) -> Result<Duration, String> {
    allot_client::parse_duration_ms(s)
        .map(Duration::from_millis)
        .map_err(|e| e.to_string())
}

fn range(s: &str) -> Result<(Duration, Duration), String> {
    agent::parse_duration_range(s).map_err(|e| e.to_string())
}

/// `--runner-procs-max`: `auto` (`None`) or a number.
#[derive(Clone, Copy, Debug)]
struct ProcsMax(Option<u64>);

fn procs_max(s: &str) -> Result<ProcsMax, String> {
    if s == "auto" {
        return Ok(ProcsMax(None));
    }
    s.parse()
        .map(|n| ProcsMax(Some(n)))
        .map_err(|_| format!("{s:?} is neither a number nor auto"))
}

fn size(s: &str) -> Result<u64, String> {
    agent::parse_size(s).map_err(|e| e.to_string())
}

fn label(s: &str) -> Result<(String, String), String> {
    agent::parse_label(s).map_err(|e| e.to_string())
}

#[derive(Parser, Debug)]
#[command(
    name = "allot-agent",
    version,
    about = "The allot GPU node agent: runs the jobs the scheduler places on this node.",
    after_help = "The job runner after `--` is started for every job attempt with a clean \
environment (the --runner-env variables only) plus CUDA_VISIBLE_DEVICES (the assigned GPU \
indices), ALLOT_JOB_ID, ALLOT_ORG_ID, ALLOT_ATTEMPT and ALLOT_PROGRESS_FILE (write \
\"<progress_ppm> <checkpoint>\" there). Exit 0 reports success. On preemption it gets \
SIGTERM, then SIGKILL after the grace period; when the agent cannot renew its lease it \
stops the runner the same way before the lease ends. Run the agent under systemd with \
KillMode=control-group (docs/allot-agent.service)."
)]
struct Args {
    /// Cluster endpoints, host:port, comma-separated (any nodes of the cluster).
    #[arg(
        long,
        env = "ALLOT_AGENT_ENDPOINTS",
        value_delimiter = ',',
        required = true
    )]
    endpoints: Vec<String>,
    /// The shard owning this node's GPU pool.
    #[arg(long, default_value_t = 0)]
    shard: u32,
    /// This GPU node's id.
    #[arg(long)]
    node: u64,
    #[arg(long, default_value = "A100")]
    gpu_type: String,
    /// GPUs on this node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Memory per GPU, in GB.
    #[arg(long, default_value_t = 80)]
    mem_gb: u32,
    /// A node label, key=value (repeatable).
    #[arg(long = "label", value_parser = label)]
    labels: Vec<(String, String)>,
    /// Job heartbeat interval.
    #[arg(long, default_value = "2s", value_parser = duration)]
    heartbeat_interval: Duration,
    /// Node heartbeat interval (renews the node lease).
    #[arg(long, default_value = "2s", value_parser = duration)]
    node_heartbeat_interval: Duration,
    /// Time between SIGTERM and SIGKILL on preemption and shutdown.
    #[arg(long, default_value = "30s", value_parser = duration)]
    grace: Duration,
    /// Directory for progress files, runner logs and the records of running runners
    /// (default: a temp dir per node). Keep it across restarts: a restarted agent stops
    /// the runners recorded there before it registers.
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// File with the API token: an agent token for this node (`allotctl token create
    /// --scope agent:<node>`) in a secured cluster.
    #[arg(long, conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// File with an admin token, read to register the node (and to register it again
    /// if the shard forgets it; the file may be removed after the first registration).
    #[arg(long, conflicts_with = "register_token")]
    register_token_file: Option<PathBuf>,
    /// The API token itself, from the environment only: on the command line, where
    /// every local user can read it, it is refused (use --token-file).
    #[arg(long, env = "ALLOT_AGENT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Admin token used only to register the node, from the environment only (refused
    /// on the command line: use --register-token-file).
    #[arg(long, env = "ALLOT_AGENT_REGISTER_TOKEN", hide_env_values = true)]
    register_token: Option<String>,
    /// Runners are killed this long before a lease the agent could not renew ends.
    #[arg(long, default_value = "5s", value_parser = duration)]
    fence_margin: Duration,
    /// A variable runners get from the agent's environment (repeatable; default: PATH,
    /// HOME, USER, LOGNAME, LANG, LC_ALL, TZ, TMPDIR). Never a credential.
    #[arg(long = "runner-env", value_name = "NAME")]
    runner_env: Vec<String>,
    /// Runs every runner as this user (the agent must run as root): job code then
    /// cannot read the agent's token files or environment, signal the agent, or rewrite
    /// the work dir (made 0711; each runner may write only its own progress file, which
    /// it must write in place). Runners get this user's HOME, USER and LOGNAME.
    #[arg(long, env = "ALLOT_RUNNER_USER", value_name = "USER")]
    runner_user: Option<String>,
    /// Runs every attempt as a uid (and gid) of its own from this range, FIRST-LAST
    /// (the agent must run as root; no user or group of the host may have an id in it;
    /// at least one per GPU): runners of different jobs cannot signal, trace or read each
    /// other, and every process of an attempt's uid is killed when the attempt ends.
    /// Each attempt gets a fresh home (HOME and TMPDIR) under the work dir, made 0711.
    /// Instead of --runner-user.
    #[arg(
        long,
        env = "ALLOT_RUNNER_UID_RANGE",
        value_name = "FIRST-LAST",
        conflicts_with = "runner_user"
    )]
    runner_uid_range: Option<agent::UidRange>,
    /// The most processes and threads a runner uid may have at once (its RLIMIT_NPROC),
    /// when runners run as another user (--runner-uid-range: each attempt;
    /// --runner-user: all of the node's runners together): a number, 0 for no bound,
    /// or `auto` — half the machine's tasks (the lesser of pid_max and threads-max)
    /// shared by the node's GPUs (one share each with --runner-uid-range), at least
    /// 1024, at most the agent's own hard limit. A number above the agent's own limit
    /// needs an agent that may raise it (CAP_SYS_RESOURCE); else the agent exits 2.
    #[arg(
        long,
        env = "ALLOT_RUNNER_PROCS_MAX",
        default_value = "auto",
        value_name = "N|auto",
        value_parser = procs_max
    )]
    runner_procs_max: ProcsMax,
    /// Runner logs (job-<org>-<job>.<attempt>.log in the work dir) older than this are
    /// deleted, at start and hourly.
    #[arg(long, default_value = "7d", value_parser = duration)]
    log_retention: Duration,
    /// The most of a runner's output (stdout and stderr) its log keeps: its first bytes
    /// up to this, then a line counting what was dropped, then its last 64 KiB.
    #[arg(long, default_value = "256MiB", value_parser = size)]
    log_max: u64,
    /// Where each attempt's cgroup (v2) goes, so that nothing a runner starts outlives
    /// its attempt: under `<parent>/allot-runners-<hash of the work dir>`, the parent
    /// being the agent's own cgroup with `auto` (no cgroups, with a warning, where cgroup
    /// v2 is not writable), or the absolute cgroup directory given (which must work);
    /// `off`: none. Under systemd the unit needs Delegate=yes.
    #[arg(
        long,
        env = "ALLOT_AGENT_CGROUP",
        default_value = "auto",
        value_name = "auto|off|DIR"
    )]
    cgroup: agent::CgroupMode,
    /// Fake GPUs and job runtimes (no runner is started).
    #[arg(long)]
    simulate: bool,
    /// Simulated runtime of each job, MIN..MAX (chosen from the job id).
    #[arg(long, default_value = "10s..30s", value_parser = range)]
    sim_runtime: (Duration, Duration),
    /// Simulated checkpoint period of checkpointable jobs (0: none).
    #[arg(long, default_value = "5s", value_parser = duration)]
    sim_checkpoint_every: Duration,
    /// Percentage of simulated jobs that fail.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    sim_fail_pct: u32,
    /// More logging (-v: info, -vv: debug, -vvv: trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// The job runner and its arguments.
    #[arg(last = true, value_name = "RUNNER")]
    runner: Vec<String>,
}

fn init_logs(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "warn,allot_client=info,allot_agent=info",
        2 => "info,allot_client=debug,allot_agent=debug",
        _ => "debug,allot_client=trace,allot_agent=trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let matches = Args::command().get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    init_logs(args.verbose);
    // A token on the command line is readable by every local user in
    // /proc/<pid>/cmdline for as long as the agent runs: refused (DESIGN §45).
    for (id, file, var) in [
        ("token", "--token-file", "ALLOT_AGENT_TOKEN"),
        (
            "register_token",
            "--register-token-file",
            "ALLOT_AGENT_REGISTER_TOKEN",
        ),
    ] {
        if matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine) {
            eprintln!(
                "allot-agent: --{} on the command line is visible to every local user in \
                 /proc/<pid>/cmdline: give it in a file ({file}) or the environment ({var})",
                id.replace('_', "-")
            );
            return std::process::ExitCode::from(2);
        }
    }
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if replaced(&e) => {
            eprintln!(
                "allot-agent: {e:#}: a newer agent process runs this node; this one stopped \
                 its runners and exits {EXIT_REPLACED} (do not restart it: a restart would \
                 take the node back from the newer process)"
            );
            std::process::ExitCode::from(EXIT_REPLACED)
        }
        Err(e) => {
            eprintln!("allot-agent: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// The exit status of an agent process that found a newer one registered for its node
/// (its own registration refused, or a set naming a newer incarnation): a supervisor
/// must not restart it (`RestartPreventExitStatus=3` in docs/allot-agent.service), or
/// two agent processes of one node would take it from each other in turn, each
/// registration ending the other's attempts.
const EXIT_REPLACED: u8 = 3;

fn replaced(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<allot_client::Error>(),
        Some(allot_client::Error::Rejected(
            allot_client::statemachine::CommandError::StaleIncarnation { .. }
        ))
    )
}

/// A token from a file (surrounding whitespace trimmed).
fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    let t = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading the token file {}: {e}", path.display()))?;
    let t = t.trim();
    anyhow::ensure!(!t.is_empty(), "the token file {} is empty", path.display());
    Ok(t.to_string())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mode = match (args.simulate, args.runner.split_first()) {
        (true, None) => Mode::Simulate(SimConfig {
            runtime_min: args.sim_runtime.0,
            runtime_max: args.sim_runtime.1,
            checkpoint_every: args.sim_checkpoint_every,
            fail_pct: args.sim_fail_pct,
        }),
        (true, Some(_)) => anyhow::bail!("--simulate starts no runner: drop the command after --"),
        (false, Some((program, rest))) => Mode::Run {
            program: program.clone(),
            args: rest.to_vec(),
        },
        (false, None) => anyhow::bail!(
            "give the job runner after --, e.g. `allot-agent ... -- ./run-job.sh`, or use --simulate"
        ),
    };
    let node = NodeId(args.node);
    let mut config = AgentConfig::new(args.endpoints, node, mode);
    config.token = match &args.token_file {
        Some(f) => Some(read_token(f)?),
        None => args.token,
    };
    config.register_token = args.register_token;
    config.register_token_file = args.register_token_file;
    config.fence_margin = args.fence_margin;
    if !args.runner_env.is_empty() {
        config.runner_env = args.runner_env;
    }
    config.log_retention = args.log_retention;
    config.log_max = args.log_max;
    config.cgroup = args.cgroup;
    config.runner_user = args
        .runner_user
        .as_deref()
        .map(allot_client::agent::RunnerUser::named)
        .transpose()?;
    config.runner_uids = args.runner_uid_range;
    config.runner_procs_max = args.runner_procs_max.0;
    config.shard = args.shard;
    config.gpu_type = GpuType::new(&args.gpu_type);
    config.gpus = args.gpus;
    config.mem_gb = args.mem_gb;
    config.labels = args.labels;
    config.heartbeat_interval = args.heartbeat_interval;
    config.node_heartbeat_interval = args.node_heartbeat_interval;
    config.grace = args.grace;
    if let Some(d) = args.work_dir {
        config.work_dir = d;
    }
    agent::run(config, shutdown_signal()).await?;
    Ok(())
}
