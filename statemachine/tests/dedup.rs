//! Result dedup (`Command::SubmitJobDedup`, rule version 3; docs/DESIGN.md §53), one
//! rule a test, through `apply` only (the harness checks the ledger's and the
//! scheduler's invariants — the dedup tables' included — after every entry).

use allot_statemachine::scheduler::{JobState, Reason};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);

/// The standard world at rule version 3, funded, with one 8-GPU A100 node.
fn world() -> Harness {
    let mut config = Config::default();
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    let mut h = Harness::world_with(config);
    h.ok(Command::ActivateVersion { version: 3 });
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h.grant(
        2,
        Account::Org(OTHER_ORG),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    h.fleet(&[(1, a100(), 8, 80)]);
    h
}

fn key(k: &str) -> DedupKey {
    DedupKey(k.as_bytes().to_vec())
}

fn spec(job: u64, gpus: u32) -> JobSpec {
    Harness::job_spec(job, Tier::PAID, vec![a100()], gpus)
}

fn dedup(h: &mut Harness, job: u64, gpus: u32, k: &str) -> Outcome {
    h.run(Command::SubmitJobDedup {
        spec: spec(job, gpus),
        key: key(k),
    })
}

/// What the org's project has been charged so far.
fn consumed(h: &Harness) -> u64 {
    h.bucket(1).consumed
}

#[test]
fn a_duplicate_of_a_running_job_attaches_and_succeeds_with_it_charging_nothing() {
    let mut h = world();
    assert!(matches!(
        dedup(&mut h, 10, 2, "prompt-a"),
        Ok(Reply::JobSubmitted {
            state: JobState::Queued,
            ..
        })
    ));
    assert_eq!(
        h.job(10).state,
        JobState::Placed,
        "placed by the entry's pass"
    );
    let hold = h.job(10).hold_micro;
    let reply = dedup(&mut h, 11, 2, "prompt-a").expect("attached");
    assert_eq!(
        reply,
        Reply::JobAttached {
            job: JobId(11),
            to: JobId(10),
            hold_micro: hold,
            state: JobState::Attached,
        },
        "reserved like any job, not run"
    );
    assert_eq!(h.job(11).state, JobState::Attached);
    assert!(h.job(11).placement.is_none());
    assert_eq!(h.state.scheduler.used_gpus, 2, "only the first runs");
    let before = consumed(&h);
    h.advance(30 * 60_000);
    h.nodes_alive();
    let _ = h.job_heartbeat(10, 1, 0);
    h.finish_job(10, true).expect("finish");
    assert_eq!(h.job(10).state, JobState::Succeeded);
    assert_eq!(h.job(11).state, JobState::Succeeded);
    assert_eq!(h.job(11).last_reason, Reason::Deduplicated);
    assert_eq!(
        h.state.scheduler.dedup.result_of((ORG, JobId(11))),
        Some(JobId(10))
    );
    // The run was charged once (the job that ran): half an hour of 2 A100s.
    let run = ledger::cost_micro(30 * 60_000, A100_PRICE, 2);
    assert_eq!(consumed(&h) - before, run);
    assert_eq!(
        h.hold(11).captured,
        0,
        "the attached job's hold returned in full"
    );
    assert!(!h.hold(11).is_open());
    h.assert_audit_rebuilds_ledger();
}

#[test]
fn a_duplicate_of_a_retained_success_succeeds_at_once_reserving_nothing() {
    let mut h = world();
    dedup(&mut h, 10, 1, "k").expect("runs");
    h.advance(60_000);
    h.finish_job(10, true).expect("finish");
    let before = (consumed(&h), h.bucket(1).remaining);
    let reply = dedup(&mut h, 11, 1, "k").expect("answered from the result");
    assert!(
        matches!(
            reply,
            Reply::JobAttached {
                to: JobId(10),
                state: JobState::Succeeded,
                ..
            }
        ),
        "{reply:?}"
    );
    assert_eq!(
        (consumed(&h), h.bucket(1).remaining),
        before,
        "nothing charged or held"
    );
    assert_eq!(h.state.scheduler.used_gpus, 0);
}

/// Found by review (tenth session, DESIGN §59): a keyed submission that takes a retained
/// result went through `submit`'s reservation, so an org out of credit was refused a
/// result that costs nothing. From rule version 4 it reserves nothing; under version 3
/// it is refused as before (entries already in a log apply as they did).
#[test]
fn a_retained_result_needs_no_credit_from_rule_version_4() {
    let drained = |version: u32| {
        let mut h = world();
        dedup(&mut h, 10, 1, "k").expect("runs");
        h.advance(60_000);
        h.finish_job(10, true).expect("finish");
        if version > 3 {
            h.ok(Command::ActivateVersion { version });
        }
        // Everything the project has left is held by a ledger hold.
        let left = h.bucket(1).remaining;
        h.ok(Command::CreateHold(Harness::hold_spec(500, left)));
        h
    };
    let mut h = drained(3);
    assert!(
        matches!(
            dedup(&mut h, 11, 1, "k"),
            Err(CommandError::InsufficientCredits { .. })
        ),
        "version 3 reserves first"
    );
    let mut h = drained(4);
    let hash = h.state.state_hash();
    let reply = dedup(&mut h, 11, 1, "k").expect("answered from the result");
    assert_eq!(
        reply,
        Reply::JobAttached {
            job: JobId(11),
            to: JobId(10),
            hold_micro: 0,
            state: JobState::Succeeded,
        }
    );
    assert_ne!(h.state.state_hash(), hash, "the job is recorded");
    assert!(
        h.state.ledger.hold(ORG, HoldId(11)).is_none(),
        "no hold was made for it"
    );
    assert_eq!(h.bucket(1).remaining, 0, "nothing moved");
    // Its id still names its hold: a ledger hold of that id does not make it look like
    // a finished job holding credit (the harness checks the invariants), and a keyed
    // job whose id a ledger hold has taken is refused as `submit` refuses it.
    h.grant(3, P, BucketKind::Paid, credits(10), None);
    h.ok(Command::CreateHold(Harness::hold_spec(11, credits(1))));
    h.ok(Command::CreateHold(Harness::hold_spec(12, credits(1))));
    assert_eq!(dedup(&mut h, 12, 1, "k"), Err(CommandError::AlreadyExists));
    h.assert_audit_rebuilds_ledger();
}

#[test]
fn when_the_job_it_waits_for_fails_the_oldest_attached_job_runs_and_the_rest_follow_it() {
    let mut h = world();
    dedup(&mut h, 10, 8, "k").expect("runs");
    dedup(&mut h, 11, 8, "k").expect("attached");
    dedup(&mut h, 12, 8, "k").expect("attached");
    h.advance(60_000);
    h.finish_job(10, false).expect("fails");
    assert_eq!(h.job(10).state, JobState::Failed);
    // 11 runs now (the node is free again), 12 waits for 11.
    assert!(h.job(11).state.holds_gpus(), "{:?}", h.job(11).state);
    assert_eq!(h.job(11).attempt, 1);
    assert_eq!(h.job(12).state, JobState::Attached);
    assert_eq!(
        h.state.scheduler.dedup.result_of((ORG, JobId(12))),
        Some(JobId(11))
    );
    let released = h.events.iter().any(|e| {
        matches!(
            e.body,
            EventBody::JobTransition {
                job: JobId(11),
                reason: Reason::DedupReleased,
                ..
            }
        )
    });
    assert!(released, "the hand-over is in the audit trail");
    h.advance(60_000);
    h.finish_job(11, true).expect("finish");
    assert_eq!(h.job(12).state, JobState::Succeeded);
    // A later duplicate takes 11's result.
    assert!(matches!(
        dedup(&mut h, 13, 8, "k"),
        Ok(Reply::JobAttached {
            to: JobId(11),
            state: JobState::Succeeded,
            ..
        })
    ));
}

/// A released job queues with the time it was submitted, not the time it was
/// released: it waited for the result since then, and a plain job submitted after it
/// does not pass it.
#[test]
fn a_released_job_keeps_its_place_by_submission_time() {
    let mut h = world();
    dedup(&mut h, 10, 8, "k").expect("runs");
    h.advance(1_000);
    dedup(&mut h, 11, 8, "k").expect("attached");
    let submitted = h.job(11).submitted_ms;
    h.advance(60_000);
    h.run(Command::SubmitJob(spec(20, 8))).expect("queued");
    assert_eq!(h.job(20).state, JobState::Queued);
    h.advance(60_000);
    h.finish_job(10, false).expect("fails");
    assert_eq!(h.job(11).queued_since_ms, submitted);
    assert!(h.job(11).state.holds_gpus(), "{:?}", h.job(11).state);
    assert_eq!(h.job(20).state, JobState::Queued);
}

#[test]
fn cancelling_an_attached_job_refunds_it_and_leaves_the_others() {
    let mut h = world();
    dedup(&mut h, 10, 2, "k").expect("runs");
    dedup(&mut h, 11, 2, "k").expect("attached");
    dedup(&mut h, 12, 2, "k").expect("attached");
    let reply = h.ok(Command::CancelJob { job: JobId(11) });
    assert!(
        matches!(reply, Reply::JobCancelled(Some(ref s)) if s.captured_micro == 0),
        "{reply:?}"
    );
    assert_eq!(h.job(11).state, JobState::Cancelled);
    assert_eq!(h.state.scheduler.dedup.attached_of(ORG), 1);
    h.advance(60_000);
    h.finish_job(10, true).expect("finish");
    assert_eq!(h.job(12).state, JobState::Succeeded);
    assert_eq!(
        h.job(11).state,
        JobState::Cancelled,
        "a cancelled job stays cancelled"
    );
}

#[test]
fn keys_are_scoped_to_the_org_never_shared_across_orgs() {
    let mut h = world();
    dedup(&mut h, 10, 2, "same-prompt").expect("org 1 runs it");
    // Org 2 submits the same key: it runs its own job, learns nothing of org 1's.
    let other = JobSpec {
        project: OTHER_PROJECT,
        user: OTHER_USER,
        ..spec(10, 2)
    };
    let reply = h
        .run_in(
            ADMIN,
            OTHER_ORG,
            Command::SubmitJobDedup {
                spec: other,
                key: key("same-prompt"),
            },
        )
        .expect("submitted");
    assert!(
        matches!(reply, Reply::JobSubmitted { job: JobId(10), .. }),
        "{reply:?}"
    );
    assert!(h
        .state
        .scheduler
        .dedup
        .result_of((OTHER_ORG, JobId(10)))
        .is_none());
    assert_eq!(h.state.scheduler.used_gpus, 4, "both run");
}

#[test]
fn a_tenant_attaches_only_within_its_own_org() {
    let mut h = world();
    dedup(&mut h, 10, 2, "k").expect("runs");
    let reply = h.run_as(
        tenant(ORG),
        Command::SubmitJobDedup {
            spec: spec(11, 2),
            key: key("k"),
        },
    );
    assert!(
        matches!(reply, Ok(Reply::JobAttached { to: JobId(10), .. })),
        "{reply:?}"
    );
    // Another org's tenant naming this org's project is refused as for any job.
    let reply = h.run_as(
        tenant(OTHER_ORG),
        Command::SubmitJobDedup {
            spec: spec(12, 2),
            key: key("k"),
        },
    );
    assert_eq!(reply, Err(CommandError::UnknownProject));
}

#[test]
fn attached_jobs_count_against_the_queued_jobs_quota() {
    let mut h = world();
    h.ok(Command::SetQuota {
        org: ORG,
        quota: Some(Quota {
            queued_max: 2,
            ..Quota::default()
        }),
    });
    dedup(&mut h, 10, 8, "k").expect("runs");
    dedup(&mut h, 11, 8, "k").expect("attached");
    dedup(&mut h, 12, 8, "k").expect("attached");
    assert_eq!(
        dedup(&mut h, 13, 8, "k"),
        Err(CommandError::QuotaExceeded(QuotaKind::QueuedJobs))
    );
    assert_eq!(
        h.run(Command::SubmitJob(spec(14, 1))),
        Err(CommandError::QuotaExceeded(QuotaKind::QueuedJobs)),
        "plain submissions too"
    );
}

#[test]
fn a_resubmission_is_idempotent_by_job_id_and_key() {
    let mut h = world();
    let hold = match dedup(&mut h, 10, 2, "k") {
        Ok(Reply::JobSubmitted { hold_micro, .. }) => hold_micro,
        other => panic!("{other:?}"),
    };
    // Another request with the same job and key: the job as it stands (placed now).
    assert_eq!(
        dedup(&mut h, 10, 2, "k"),
        Ok(Reply::JobSubmitted {
            job: JobId(10),
            hold_micro: hold,
            state: JobState::Placed
        })
    );
    assert_eq!(
        dedup(&mut h, 10, 2, "other"),
        Err(CommandError::AlreadyExists)
    );
    // A plain submission of the same spec is answered as `SubmitJob` always is.
    assert!(matches!(
        h.run(Command::SubmitJob(spec(10, 2))),
        Ok(Reply::JobSubmitted { job: JobId(10), .. })
    ));
    assert_eq!(
        h.run(Command::SubmitJob(spec(10, 3))),
        Err(CommandError::AlreadyExists)
    );
}

#[test]
fn bad_keys_and_the_rule_version_are_refused_and_change_nothing() {
    let mut h = world();
    let long = DedupKey(vec![7; limits::DEDUP_KEY_BYTES_MAX + 1]);
    let at_bound = DedupKey(vec![7; limits::DEDUP_KEY_BYTES_MAX]);
    for (k, want) in [
        (
            DedupKey(Vec::new()),
            Err(CommandError::InvalidJob(JobProblem::DedupKey)),
        ),
        (long, Err(CommandError::InvalidJob(JobProblem::DedupKey))),
    ] {
        let before = h.state.state_hash();
        let got = h.run(Command::SubmitJobDedup {
            spec: spec(10, 1),
            key: k,
        });
        assert_eq!(got, want);
        assert!(h.state.scheduler.jobs.get(&(ORG, JobId(10))).is_none());
        // Only the refused command's record and events were added.
        assert_ne!(before, h.state.state_hash());
    }
    assert!(h
        .run(Command::SubmitJobDedup {
            spec: spec(10, 1),
            key: at_bound
        })
        .is_ok());
    // Before rule version 3 the command does not exist for the shard.
    let mut old = Harness::world();
    old.grant(1, P, BucketKind::Paid, credits(100), None);
    assert_eq!(
        old.run(Command::SubmitJobDedup {
            spec: spec(10, 1),
            key: key("k")
        }),
        Err(CommandError::UnsupportedRulesVersion {
            active: 1,
            newest: version::RULES_MAX
        })
    );
    // And no caller may settle a hold as deduplicated.
    assert_eq!(
        h.run(Command::Settle {
            hold: HoldId(10),
            attempt: 0,
            reason: SettleReason::Deduplicated
        }),
        Err(CommandError::Unauthorized)
    );
}

#[test]
fn the_tables_survive_a_snapshot_and_replay_identically() {
    let mut h = world();
    dedup(&mut h, 10, 8, "k").expect("runs");
    dedup(&mut h, 11, 8, "k").expect("attached");
    dedup(&mut h, 12, 1, "j").expect("waits for the node");
    let snap = h.state.encode();
    assert_eq!(snap[0], 7, "format 7 at rule version 3");
    let back = State::decode(&snap).expect("decodes");
    assert_eq!(back, h.state);
    assert_eq!(back.scheduler.dedup, h.state.scheduler.dedup);
    let mut again = State::new(h.state.config.clone());
    for e in &h.entries {
        apply(&mut again, e).expect("apply");
    }
    assert_eq!(again.state_hash(), h.state.state_hash());
}

#[test]
fn a_forgotten_job_releases_its_key() {
    let config = Config {
        job_retention_ms: 3_600_000,
        ..Config::default()
    };
    let mut h = Harness::world_with(config);
    h.ok(Command::ActivateVersion { version: 3 });
    h.grant(1, P, BucketKind::Paid, credits(1_000), None);
    h.fleet(&[(1, a100(), 8, 80)]);
    h.nodes_alive();
    dedup(&mut h, 10, 1, "k").expect("runs");
    h.advance(60_000);
    h.finish_job(10, true).expect("finish");
    h.advance(2 * 3_600_000);
    h.nodes_alive();
    assert!(
        h.state.scheduler.jobs.get(&(ORG, JobId(10))).is_none(),
        "pruned"
    );
    assert!(h.state.scheduler.dedup.is_empty());
    assert!(
        matches!(dedup(&mut h, 11, 1, "k"), Ok(Reply::JobSubmitted { .. })),
        "runs again: the result is gone"
    );
}

/// A runner that fails during a scheduling pass (its only GPU type lost its price) hands
/// its attached job the run, and that job joins the queue in the same pass — here in
/// another project. The pass sees it and places it at once, as a fresh look at the
/// queue does. (The pass's per-pass ranking of projects, when it was first written,
/// did not notice the join: the org's ranking held only the failed runner's project,
/// and the pass ended.)
#[test]
fn a_runner_released_during_a_pass_is_placed_in_that_pass() {
    let mut h = world();
    h.grant(
        3,
        Account::Project(PROJECT_B),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    // An H100 node that takes no work: job 10 (H100 only) is admitted and waits.
    h.fleet(&[(2, h100(), 8, 80)]);
    h.ok(Command::SetNodeDraining {
        node: NodeId(2),
        draining: true,
    });
    let runner = Harness::job_spec(10, Tier::PAID, vec![h100()], 1);
    h.run(Command::SubmitJobDedup {
        spec: runner,
        key: key("k"),
    })
    .unwrap();
    // Job 11, same key, another project, A100: attached to job 10.
    let mut attached = Harness::job_spec(11, Tier::PAID, vec![a100()], 1);
    attached.project = PROJECT_B;
    h.run(Command::SubmitJobDedup {
        spec: attached,
        key: key("k"),
    })
    .unwrap();
    assert!(h.job(11).placement.is_none(), "attached, not placed");
    // H100 leaves the price table: in this entry's pass job 10 fails, job 11 takes over
    // and is placed on the A100 node.
    h.ok(Command::SetPrices {
        prices: vec![(a100(), A100_PRICE)],
    });
    let j10 = h.job(10);
    assert_eq!(
        (j10.state, j10.last_reason),
        (JobState::Failed, Reason::Unpriced)
    );
    assert_eq!(
        h.job(11).placement.as_ref().map(|p| p.node),
        Some(NodeId(1)),
        "placed in the pass it joined"
    );
}
