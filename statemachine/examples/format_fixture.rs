//! Writes the persisted-format fixture of the format this build writes: a log of
//! entries touching every table (ledger, scheduler, tokens, alerts), the state after
//! it (a snapshot), and its audit events, each as the codec writes them.
//!
//! `cargo run -p allot-statemachine --example format_fixture -- <dir> [<rule version>]`
//!
//! Run on the last commit of a format before its version is bumped, so that the next
//! release's tests read what this one wrote (`statemachine/tests/formats.rs`;
//! `tests/fixtures/format5` was written by commit 62f6f77, format 5, and
//! `tests/fixtures/format6` by commit d1226df, format 6, both at the baseline rules;
//! `tests/fixtures/format7` by commit dc6b65a, format 7, at rule version 4). It writes
//! the state in the format of the fixture's rule version (`State::format`). With a rule
//! version above the baseline, the log activates it first and ends with a preemption
//! in its grace (format 8 keeps its start).
use allot_statemachine::testkit::*;
use allot_statemachine::*;

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: <dir>"));
    std::fs::create_dir_all(&dir).expect("fixture dir");
    let rules: u32 = std::env::args()
        .nth(2)
        .map_or(1, |v| v.parse().expect("a rule version"));
    let mut h = Harness::world();
    if rules > 1 {
        h.ok(Command::ActivateVersion { version: rules });
    }
    h.grant(1, Account::Org(ORG), BucketKind::Paid, credits(1_000), None);
    h.grant(
        2,
        Account::Project(PROJECT),
        BucketKind::Promotional,
        credits(50),
        Some(T0_MS + 2 * HOUR_MS),
    );
    h.grant(
        3,
        Account::Org(OTHER_ORG),
        BucketKind::Paid,
        credits(300),
        None,
    );
    h.ok(Command::SetBudget {
        scope: BudgetScope::Project(PROJECT),
        budget: Some(BudgetSpec {
            limit_micro: credits(5_000),
            period: BudgetPeriod::Month,
            mode: BudgetMode::Hard,
        }),
    });
    h.ok(Command::CreateHold(Harness::hold_spec(100, credits(20))));
    h.ok(Command::Capture {
        hold: HoldId(100),
        amount_micro: credits(5),
    });
    h.fleet(&[(1, a100(), 8, 80), (2, h100(), 8, 80)]);
    h.nodes_alive();
    for (job, tier, gpus) in [
        (500, Tier::PAID, 4),
        (501, Tier::FREE, 8),
        (502, Tier::ENTERPRISE, 2),
    ] {
        h.ok(Command::SubmitJob(Harness::job_spec(
            job,
            tier,
            vec![a100(), h100()],
            gpus,
        )));
    }
    h.advance(60_000);
    h.nodes_alive();
    let _ = h.job_heartbeat(500, 1, 1);
    h.advance(30 * 60_000);
    h.nodes_alive();
    let _ = h.finish_job(500, true);
    h.ok(Command::CancelJob { job: JobId(501) });
    h.ok(Command::CreateToken {
        principal: PrincipalId(7),
        digest: TokenDigest([7; 32]),
        scope: security::Scope::Org(ORG),
        expires_at_ms: None,
    });
    h.advance(3 * HOUR_MS);
    h.tick();
    if rules > 1 {
        // A free job on node 2's GPUs, then an enterprise one that needs them: the
        // free one is preempted and its grace is still running when the log ends.
        h.nodes_alive();
        h.ok(Command::SubmitJob(Harness::job_spec(
            503,
            Tier::FREE,
            vec![h100()],
            4,
        )));
        h.nodes_alive();
        let _ = h.job_heartbeat(503, 1, 1);
        h.advance(61_000);
        h.nodes_alive();
        let _ = h.job_heartbeat(503, 2, 1);
        h.advance(1_000);
        h.ok(Command::SubmitJob(Harness::job_spec(
            504,
            Tier::ENTERPRISE,
            vec![h100()],
            8,
        )));
        let preempting = h.job(503).state;
        assert_eq!(preempting, scheduler::JobState::Preempting, "job 503");
    }
    let write = |name: &str, bytes: Vec<u8>| {
        std::fs::write(dir.join(name), bytes).expect("fixture file");
    };
    write("entries.bin", codec::encode(&h.entries));
    write("state.bin", h.state.encode());
    write("events.bin", codec::encode(&h.events));
    println!(
        "format {}: {} entries, {} events, state {} bytes",
        h.state.format(),
        h.entries.len(),
        h.events.len(),
        h.state.encode().len()
    );
}
