//! `allotctl`: the operator and tenant CLI of an allot cluster.
//!
//! Exit codes: 0 success; 1 the operation failed (refused by the cluster, unreachable
//! endpoints, an unknown id); 2 usage errors (bad flags or values: nothing was sent).
//! Errors go to stderr; `-o json` prints exactly one JSON document on stdout.

mod args;
mod audit;
mod backup;
mod bench;
mod cluster;
mod connect;
mod credits;
mod demand;
mod failure;
mod jobs;
mod membership;
mod nodes;
mod output;
mod scheduler;
mod tenancy;
mod timefmt;
mod tokens;
mod values;
mod version;

use args::{Cli, Cmd};
use clap::Parser;
use connect::Ctx;

fn main() {
    let cli = Cli::parse();
    failure::set_token_given(cli.global.token.is_some());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => failure::exit(&anyhow::anyhow!("starting the async runtime: {e}")),
    };
    let result = runtime.block_on(async move {
        let ctx = Ctx::new(&cli.global)?;
        dispatch(&ctx, cli.cmd).await
    });
    // Background connection tasks must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    if let Err(e) = result {
        failure::exit(&e);
    }
}

async fn dispatch(ctx: &Ctx, cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Cluster(c) => cluster::run(ctx, c).await,
        Cmd::Member(c) => membership::run(ctx, c).await,
        Cmd::Token(c) => tokens::run(ctx, c).await,
        Cmd::Endpoint(c) => cluster::run_endpoint(ctx, c).await,
        Cmd::Shard(c) => cluster::run_shard(ctx, c).await,
        Cmd::Check(a) => cluster::check(ctx, a).await,
        Cmd::Backup(c) => backup::run(ctx, c).await,
        Cmd::Org(c) => tenancy::run_org(ctx, c).await,
        Cmd::Project(c) => tenancy::run_project(ctx, c).await,
        Cmd::User(c) => tenancy::run_user(ctx, c).await,
        Cmd::Quota(c) => tenancy::run_quota(ctx, c).await,
        Cmd::Plan(c) => tenancy::run_plan(ctx, c).await,
        Cmd::Share(c) => tenancy::run_share(ctx, c).await,
        Cmd::Usage(a) => tenancy::usage_top(ctx, a).await,
        Cmd::Grant(c) => credits::run_grant(ctx, c).await,
        Cmd::Balance(a) => credits::balance(ctx, a).await,
        Cmd::Budget(c) => credits::run_budget(ctx, c).await,
        Cmd::Price(c) => credits::run_price(ctx, c).await,
        Cmd::Totals(a) => credits::totals(ctx, a).await,
        Cmd::Scheduler(c) => scheduler::run(ctx, c).await,
        Cmd::Queue(a) => scheduler::queue(ctx, a).await,
        Cmd::Demand(a) => demand::run(ctx, a).await,
        Cmd::Node(c) => nodes::run(ctx, c).await,
        Cmd::Job(c) => jobs::run(ctx, c).await,
        Cmd::Audit(a) => audit::run(ctx, a).await,
        Cmd::Bench(a) => bench::run(ctx, a).await,
        Cmd::Version(c) => version::run(ctx, c).await,
    }
}
