//! The command line: global flags (each also from an `ALLOTCTL_*` variable) and the
//! command tree. Each command's own flags live in the module that runs it.

use crate::output::Format;
use crate::values;
use allot_statemachine::Actor;
use clap::{Args, Parser, Subcommand};
use std::time::Duration;

const AFTER_HELP: &str = "\
Exit codes: 0 success; 1 the operation failed (refused by the cluster, an unknown id, \
unreachable endpoints); 2 usage errors (bad flags or values: nothing was sent).
Amounts are credits with up to 6 decimals (12.5); durations 1500ms, 90s, 30m, 2h, 7d; \
instants unix milliseconds or 2025-01-31T12:00:00Z.";

#[derive(Parser, Debug)]
#[command(
    name = "allotctl",
    version,
    about = "Operate an allot cluster: GPU credits, budgets, GPU nodes and jobs",
    after_help = AFTER_HELP,
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// Cluster endpoints, comma-separated host:port (any node will do).
    #[arg(
        long,
        global = true,
        env = "ALLOTCTL_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103"
    )]
    pub endpoints: Vec<String>,
    /// Connect over TLS, trusting this CA certificate (PEM): the cluster CA.
    #[arg(long, global = true, env = "ALLOTCTL_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// API token, sent as `authorization: Bearer <token>`.
    #[arg(long, global = true, env = "ALLOTCTL_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Output format: aligned text, or exactly one JSON document on stdout.
    #[arg(short, long, global = true, env = "ALLOTCTL_OUTPUT", value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// Deadline of each call to the cluster, retries included.
    #[arg(long, global = true, env = "ALLOTCTL_TIMEOUT", default_value = "10s", value_parser = values::duration)]
    pub timeout: Duration,
    /// Most retries per call (unreachable endpoints, no leader, overload). Default:
    /// retry, backing off (50 ms doubling to 1 s, jittered), until --timeout — an
    /// election in progress is waited out, not counted against a fixed budget.
    #[arg(long, global = true, env = "ALLOTCTL_RETRIES")]
    pub retries: Option<u32>,
    /// DEV MODE ONLY (nodes started with --insecure-dev-mode, cluster not bootstrapped):
    /// the identity claimed without a token: admin, org:<id> or agent:<node id>. With
    /// --token the token's identity is used and this is ignored.
    #[arg(long = "as", global = true, env = "ALLOTCTL_AS", default_value = "admin", value_parser = values::identity)]
    pub identity: Actor,
    /// The request id of the command's first mutation (decimal, or hex with 0x); its
    /// further mutations take the next ids in order. Run the same command again with
    /// the same id after an unknown outcome (a timeout, a lost connection): each shard
    /// answers what it applied the first time and applies nothing twice. Default: fresh
    /// random ids.
    #[arg(long, global = true, env = "ALLOTCTL_REQUEST_ID", value_parser = values::request_id)]
    pub request_id: Option<u128>,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Cluster set-up (initialise a new cluster).
    #[command(subcommand)]
    Cluster(crate::cluster::ClusterCmd),
    /// Raft membership of the shards (voters, learners, leaders).
    #[command(subcommand)]
    Member(crate::membership::MemberCmd),
    /// API tokens: create, rotate, revoke.
    #[command(subcommand)]
    Token(crate::tokens::TokenCmd),
    /// Health of each endpoint.
    #[command(subcommand)]
    Endpoint(crate::cluster::EndpointCmd),
    /// Checks every replica of every shard: the ledger's invariants (conservation
    /// included) and equal state hashes at one applied index. Exit 1 on any failure.
    Check(crate::cluster::CheckArgs),
    /// Replica state hashes, to compare replicas.
    #[command(subcommand)]
    Shard(crate::cluster::ShardCmd),
    /// Backups of shards (restore with `allot-node restore`).
    #[command(subcommand)]
    Backup(crate::backup::BackupCmd),
    /// Organisations.
    #[command(subcommand)]
    Org(crate::tenancy::OrgCmd),
    /// Projects of an organisation.
    #[command(subcommand)]
    Project(crate::tenancy::ProjectCmd),
    /// Users of an organisation.
    #[command(subcommand)]
    User(crate::tenancy::UserCmd),
    /// Quotas of an organisation (every table it can grow) and what it uses of them.
    #[command(subcommand)]
    Quota(crate::tenancy::QuotaCmd),
    /// Plans: the tiers an organisation (and each of its projects) may use.
    #[command(subcommand)]
    Plan(crate::tenancy::PlanCmd),
    /// Fair-share weights of orgs, projects and users.
    #[command(subcommand)]
    Share(crate::tenancy::ShareCmd),
    /// Top consumers (orgs, projects or users) by credits used in a period.
    Usage(crate::tenancy::UsageArgs),
    /// Credit grants (paid, promotional, granted buckets).
    #[command(subcommand)]
    Grant(crate::credits::GrantCmd),
    /// Balance of an org or project with its breakdown and upcoming expirations.
    Balance(crate::credits::BalanceArgs),
    /// Budgets of an org, project or user.
    #[command(subcommand)]
    Budget(crate::credits::BudgetCmd),
    /// GPU prices (credits per GPU-hour).
    #[command(subcommand)]
    Price(crate::credits::PriceCmd),
    /// Credit totals of each shard (issued, consumed, expired, moved).
    Totals(crate::credits::TotalsArgs),
    /// Scheduler settings of a shard.
    #[command(subcommand)]
    Scheduler(crate::scheduler::SchedulerCmd),
    /// Queue per tier: queued jobs, oldest wait, running GPUs.
    Queue(crate::scheduler::QueueArgs),
    /// Demand per GPU type (admin): capacity, queued GPU-hours, the wait they imply, and
    /// per tier the GPUs that would bring the tier within its target wait.
    Demand(crate::demand::DemandArgs),
    /// GPU nodes of a shard's pool.
    #[command(subcommand)]
    Node(crate::nodes::NodeCmd),
    /// GPU jobs.
    #[command(subcommand)]
    Job(crate::jobs::JobCmd),
    /// Audit trail: events of an org, project or job (`audit export` for JSON lines).
    Audit(crate::audit::AuditArgs),
    /// Load generator: closed-loop hold/capture/release workers against the cluster.
    Bench(crate::bench::BenchArgs),
    /// Rule versions and formats: what each node supports, what each shard runs, and
    /// activating a new version after a rolling upgrade.
    #[command(subcommand)]
    Version(crate::version::VersionCmd),
}
