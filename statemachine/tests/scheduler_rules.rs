//! Scheduler rules, one test each, through `apply` only (the harness checks ledger and
//! scheduler invariants after every entry).

use allot_statemachine::scheduler::{JobState, NodeState, Reason};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);

/// A world whose node and job leases outlast the tests' time jumps (lease expiry has
/// its own tests on the default configuration), and whose preemption loss cap does not
/// interfere with the other preemption rules (it has its own test).
fn world() -> Harness {
    let mut h = world_without_credit();
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h
}

/// [`world`] before its grant.
fn world_without_credit() -> Harness {
    let mut config = Config::default();
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    config.scheduler.preemption_loss_max_gpu_ms = u64::MAX;
    Harness::world_with(config)
}

/// The default configuration (real leases).
fn world_default_leases() -> Harness {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h
}

fn submit(h: &mut Harness, spec: JobSpec) {
    let id = spec.job.0;
    match h.run(Command::SubmitJob(spec)) {
        Ok(Reply::JobSubmitted { .. }) => {}
        other => panic!("submit {id}: {other:?}"),
    }
}

fn node_of(h: &Harness, job: u64) -> Option<u64> {
    h.job(job).placement.as_ref().map(|p| p.node.0)
}

#[test]
fn gpu_type_preference_order_and_price_of_the_placed_type() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, h100(), 8, 80)]);
    submit(
        &mut h,
        Harness::job_spec(10, Tier::PAID, vec![h100(), a100()], 8),
    );
    submit(
        &mut h,
        Harness::job_spec(11, Tier::PAID, vec![h100(), a100()], 8),
    );
    assert_eq!(node_of(&h, 10), Some(2), "first preference");
    assert_eq!(
        node_of(&h, 11),
        Some(1),
        "second preference when the first is full"
    );
    let price = |j| {
        h.job(j)
            .placement
            .as_ref()
            .unwrap()
            .price_micro_per_gpu_hour
    };
    assert_eq!((price(10), price(11)), (H100_PRICE, A100_PRICE));
    // The hold was priced at the highest acceptable type: 10 h × 8 × 4 credits.
    assert_eq!(h.job(11).hold_micro, credits(320));
}

#[test]
fn memory_floor_and_gang_all_on_one_node() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 40), (2, a100(), 2, 80), (3, a100(), 4, 80)]);
    let mut big_mem = Harness::job_spec(10, Tier::PAID, vec![a100()], 2);
    big_mem.mem_floor_gb = 80;
    submit(&mut h, big_mem.clone());
    assert_eq!(node_of(&h, 10), Some(2), "node 1 has too little memory");
    big_mem.job = JobId(12);
    submit(&mut h, big_mem);
    assert_eq!(node_of(&h, 12), Some(3));
    let mut gang = Harness::job_spec(11, Tier::PAID, vec![a100()], 4);
    gang.mem_floor_gb = 80;
    submit(&mut h, gang);
    // 2 free on node 3, 0 on node 2, 8 of 40 GB on node 1: 4 GPUs with 80 GB exist only
    // split, so the gang job stays queued rather than taking part of them.
    assert_eq!(h.job(11).state, JobState::Queued);
    // Node 3's other job ends: now the gang fits there, whole.
    h.job_heartbeat(12, 1, 0).unwrap();
    h.finish_job(12, true).unwrap();
    assert_eq!(node_of(&h, 11), Some(3));
}

#[test]
fn best_fit_keeps_whole_nodes_free() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 6));
    submit(&mut h, Harness::job_spec(11, Tier::PAID, vec![a100()], 2));
    assert_eq!(node_of(&h, 10), Some(1));
    assert_eq!(node_of(&h, 11), Some(1), "fills node 1's remaining 2 GPUs");
    submit(&mut h, Harness::job_spec(12, Tier::PAID, vec![a100()], 8));
    assert_eq!(
        node_of(&h, 12),
        Some(2),
        "the whole node stayed free for the 8-GPU job"
    );
    assert_eq!(
        h.job(11).placement.as_ref().unwrap().gpu_indices,
        vec![6, 7]
    );
}

#[test]
fn lifecycle_with_metering_and_settlement() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 2));
    assert_eq!(h.job(10).state, JobState::Placed);
    h.advance(HOUR_MS);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    assert_eq!(h.job(10).state, JobState::Running);
    assert_eq!(h.hold(10).captured, credits(4), "1 h × 2 GPUs × 2 credits");
    h.advance(HOUR_MS / 2);
    let Ok(Reply::JobFinished(Some(s))) = h.finish_job(10, true) else {
        panic!()
    };
    assert_eq!(
        (s.captured_micro, s.reason),
        (credits(6), SettleReason::Succeeded)
    );
    assert_eq!(h.job(10).state, JobState::Succeeded);
    assert_eq!(h.state.scheduler.used_gpus, 0);
    // Every transition is audited.
    let transitions: Vec<JobState> = h
        .events
        .iter()
        .filter_map(|e| match e.body {
            EventBody::JobTransition {
                job: JobId(10), to, ..
            } => Some(to),
            _ => None,
        })
        .collect();
    assert_eq!(
        transitions,
        vec![
            JobState::Queued,
            JobState::Placed,
            JobState::Running,
            JobState::Succeeded
        ]
    );
}

#[test]
fn stale_attempts_and_foreign_agents_are_fenced() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 8));
    let node = NodeId(node_of(&h, 10).unwrap());
    let other = Actor::Agent(NodeId(if node.0 == 1 { 2 } else { 1 }));
    let hb = |attempt, seq| {
        Command::JobHeartbeat(JobHeartbeat {
            job: JobId(10),
            attempt,
            seq,
            progress_ppm: 0,
            checkpoint: 0,
        })
    };
    assert_eq!(
        h.run_as(other, hb(1, 1)),
        Err(CommandError::UnknownJob),
        "another node's agent"
    );
    assert_eq!(
        h.run_as(Actor::Agent(node), hb(0, 1)),
        Err(CommandError::StaleAttempt {
            given: 0,
            current: 1
        })
    );
    assert_eq!(
        h.run_as(
            other,
            Command::FinishJob {
                job: JobId(10),
                attempt: 1,
                success: true
            }
        ),
        Err(CommandError::UnknownJob)
    );
    assert_eq!(
        h.run_as(tenant(ORG), hb(1, 1)),
        Err(CommandError::Unauthorized)
    );
    assert!(h.run_as(Actor::Agent(node), hb(1, 1)).is_ok());
}

#[test]
fn job_lease_expiry_ends_a_job_as_lost_billed_to_its_last_heartbeat() {
    let mut h = world_default_leases();
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    h.advance(30_000);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    // The agent stops reporting on the job (the finish call is lost); the node lives.
    for _ in 0..8 {
        h.advance(30_000);
        h.nodes_alive();
    }
    assert_eq!(h.job(10).state, JobState::Lost);
    assert_eq!(h.job(10).last_reason, Reason::LeaseExpired);
    // Billed to the last heartbeat (the last evidence it ran), the rest refunded.
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(30_000, A100_PRICE, 1)
    );
    assert!(!h.hold(10).is_open());
    // The late finish is refused as "already finished" (issue 21: it used to answer
    // UnknownJob, which the agent logged as an unknown job): no double refund.
    let late = h.run_as(
        Actor::Agent(NodeId(1)),
        Command::FinishJob {
            job: JobId(10),
            attempt: 1,
            success: true,
        },
    );
    assert_eq!(late, Err(CommandError::JobFinished));
}

/// Job 10 (4 A100s) runs on node 1, checkpoints at 30 s, heartbeats at 55 s; then the
/// node goes silent past its lease.
fn run_job_10_then_lose_its_node(h: &mut Harness) {
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(h, Harness::job_spec(10, Tier::PAID, vec![a100()], 4));
    h.advance(30_000);
    h.job_heartbeat(10, 1, 1).unwrap(); // checkpoint at 30 s
    h.advance(25_000);
    h.job_heartbeat(10, 2, 1).unwrap();
    h.advance(10 * 60_000);
    h.tick();
}

/// A node that misses its lease is down (after the fence margin): its jobs go back to
/// the queue billed to their last heartbeat — the GPU time the cluster saw used; only
/// preemption, which the platform decides, bills to the checkpoint (issue 21, finding 8)
/// — and run again as a new attempt when a node is available; the dead node's reports
/// of the old attempt are fenced.
#[test]
fn node_lease_expiry_requeues_its_jobs_billed_to_the_last_heartbeat() {
    let mut h = world_default_leases();
    run_job_10_then_lose_its_node(&mut h);
    assert_eq!(
        h.state.scheduler.node(NodeId(1)).unwrap().state,
        NodeState::Down
    );
    let j = h.job(10);
    assert_eq!(
        (j.state, j.last_reason, j.node_failures, j.attempt),
        (JobState::Queued, Reason::NodeDown, 1, 1)
    );
    // Billed to the last heartbeat (55 s of 4 A100s), not only to the checkpoint (30 s);
    // the hold stays open for the rerun.
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(55_000, A100_PRICE, 4)
    );
    assert!(h.hold(10).settled.is_none(), "the hold stays reserved");
    assert_eq!(h.state.scheduler.fleet_gpus, 0);
    // The node comes back empty, and the job runs again as attempt 2.
    h.nodes_alive();
    assert_eq!(
        h.state.scheduler.node(NodeId(1)).unwrap().state,
        NodeState::Ready
    );
    assert_eq!((h.job(10).state, h.job(10).attempt), (JobState::Placed, 2));
    // The old attempt's late reports are refused and change nothing.
    let captured = h.hold(10).captured;
    let late = h.run_as(
        Actor::Agent(NodeId(1)),
        Command::JobHeartbeat(JobHeartbeat {
            job: JobId(10),
            attempt: 1,
            seq: 3,
            progress_ppm: 0,
            checkpoint: 0,
        }),
    );
    assert_eq!(
        late,
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    let late_finish = h.run_as(
        Actor::Agent(NodeId(1)),
        Command::FinishJob {
            job: JobId(10),
            attempt: 1,
            success: true,
        },
    );
    assert_eq!(
        late_finish,
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    assert_eq!(h.job(10).state, JobState::Placed);
    assert_eq!(h.hold(10).captured, captured);
    // The new attempt runs to completion and is settled once.
    h.job_heartbeat(10, 1, 0).unwrap();
    for seq in 2..=3 {
        h.advance(30_000);
        h.nodes_alive();
        h.job_heartbeat(10, seq, 0).unwrap();
    }
    h.finish_job(10, true).unwrap();
    assert_eq!(h.job(10).state, JobState::Succeeded);
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(55_000, A100_PRICE, 4) + ledger::cost_micro(60_000, A100_PRICE, 4),
        "each attempt billed on its own: 55 s to the last heartbeat, then 60 s"
    );
}

/// A job that has used up its node-failure requeues fails when its node goes down again
/// (billed to its last heartbeat, the rest refunded).
#[test]
fn a_job_out_of_node_failure_requeues_fails_as_a_platform_fault() {
    let mut config = Config::default();
    config.scheduler.node_failure_requeues_max = 0;
    let mut h = Harness::world_with(config);
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    run_job_10_then_lose_its_node(&mut h);
    assert_eq!(
        (h.job(10).state, h.job(10).last_reason),
        (JobState::Failed, Reason::NodeDown)
    );
    let hold = h.hold(10);
    assert_eq!(hold.captured, ledger::cost_micro(55_000, A100_PRICE, 4));
    assert!(hold.settled.is_some(), "settled: the rest is refunded");
    h.nodes_alive();
    assert!(h.state.scheduler.assignments(NodeId(1)).is_empty());
}

/// Preemption: an enterprise job preempts a preemptible lower-tier job after its
/// minimum runtime, with the least work lost since checkpoint; the victim gets a grace
/// period, is requeued billed only to its checkpoint, and the GPUs are reserved for the
/// waiting job.
#[test]
fn preemption_rules_grace_and_reservation() {
    let mut h = world();
    h.fleet(&[(1, a100(), 4, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
    submit(&mut h, Harness::job_spec(11, Tier::FREE, vec![a100()], 2));
    h.advance(5 * 60_000);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 1).unwrap(); // job 10 checkpoints now: little work to lose
    h.job_heartbeat(11, 1, 0).unwrap();
    h.advance(60_000);
    h.nodes_alive();
    h.job_heartbeat(10, 2, 1).unwrap();
    h.job_heartbeat(11, 2, 0).unwrap();
    submit(
        &mut h,
        Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
    );
    assert_eq!(
        h.job(10).state,
        JobState::Preempting,
        "least work lost since checkpoint"
    );
    assert_eq!(h.job(11).state, JobState::Running);
    assert_eq!(h.job(20).state, JobState::Queued);
    // A paid job arriving now cannot take the reserved GPUs.
    h.advance(h.state.config.scheduler.grace_ms);
    h.nodes_alive();
    assert_eq!(
        h.job(10).state,
        JobState::Queued,
        "requeued after the grace period"
    );
    assert_eq!(
        h.job(20).state,
        JobState::Placed,
        "placed on the freed, reserved GPUs"
    );
    // Job 10 was billed to its checkpoint (5 min of 2 A100s), the rest stays on its hold.
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(5 * 60_000, A100_PRICE, 2)
    );
    assert!(h.hold(10).is_open());
    assert_eq!(h.job(10).preemptions, 1);
    // The old attempt's agent is fenced off: the job is waiting in the queue, placed
    // nowhere (a typed answer, not "unknown job").
    assert_eq!(
        h.run_as(
            Actor::Agent(NodeId(1)),
            Command::JobHeartbeat(JobHeartbeat {
                job: JobId(10),
                attempt: 1,
                seq: 9,
                progress_ppm: 0,
                checkpoint: 1
            })
        ),
        Err(CommandError::JobNotPlaced)
    );
}

#[test]
fn no_preemption_of_non_preemptible_same_tier_or_young_jobs() {
    struct Case {
        victim_tier: Tier,
        preemptible: bool,
        runtime_ms: u64,
        expect_preempt: bool,
    }
    let cases = [
        Case {
            victim_tier: Tier::FREE,
            preemptible: true,
            runtime_ms: 5 * 60_000,
            expect_preempt: true,
        },
        Case {
            victim_tier: Tier::FREE,
            preemptible: false,
            runtime_ms: 5 * 60_000,
            expect_preempt: false,
        },
        Case {
            victim_tier: Tier::ENTERPRISE,
            preemptible: true,
            runtime_ms: 5 * 60_000,
            expect_preempt: false,
        },
        Case {
            victim_tier: Tier::FREE,
            preemptible: true,
            runtime_ms: 30_000,
            expect_preempt: false,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        let mut h = world();
        h.fleet(&[(1, a100(), 2, 80)]);
        let mut victim = Harness::job_spec(10, c.victim_tier, vec![a100()], 2);
        victim.preemptible = c.preemptible;
        submit(&mut h, victim);
        h.advance(c.runtime_ms);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        submit(
            &mut h,
            Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
        );
        assert_eq!(
            h.job(10).state == JobState::Preempting,
            c.expect_preempt,
            "case {i}"
        );
    }
}

/// Victims lose at most `preemption_loss_max_gpu_ms` of work: a job that has run long
/// without a checkpoint is not preempted; the same job with a recent checkpoint is.
#[test]
fn preemption_spares_a_victim_that_would_lose_too_much_work() {
    for (checkpoint_at_ms, expect) in [
        (None, JobState::Running),
        (Some(4 * 60_000 + 30_000), JobState::Preempting),
    ] {
        let mut h = world();
        h.state.config.scheduler.preemption_loss_max_gpu_ms = 8 * 60_000;
        h.fleet(&[(1, a100(), 2, 80)]);
        submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
        let mut seq = 1;
        if let Some(at) = checkpoint_at_ms {
            h.advance(at);
            h.nodes_alive();
            h.job_heartbeat(10, seq, 1).unwrap();
            seq += 1;
        }
        // At 5 min: 2 GPUs × 5 min = 10 GPU-min since start, or 1 GPU-min since the
        // checkpoint at 4.5 min.
        h.advance(5 * 60_000 - checkpoint_at_ms.unwrap_or(0));
        h.nodes_alive();
        h.job_heartbeat(10, seq, checkpoint_at_ms.map_or(0, |_| 1))
            .unwrap();
        submit(
            &mut h,
            Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
        );
        assert_eq!(
            h.job(10).state,
            expect,
            "checkpoint at {checkpoint_at_ms:?}"
        );
    }
}

/// Hysteresis: no preemption when a running job on a fitting node ends soon anyway.
#[test]
fn hysteresis_waits_for_a_soon_finishing_job() {
    let mut h = world();
    h.fleet(&[(1, a100(), 2, 80)]);
    let mut short = Harness::job_spec(10, Tier::FREE, vec![a100()], 2);
    short.max_duration_ms = 10 * 60_000;
    submit(&mut h, short);
    h.advance(9 * 60_000 + 30_000); // 30 s before its deadline
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    submit(
        &mut h,
        Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
    );
    assert_eq!(h.job(10).state, JobState::Running, "not preempted");
    h.advance(30_000);
    h.nodes_alive();
    assert_eq!(
        (h.job(10).state, h.job(10).last_reason),
        (JobState::Failed, Reason::MaxDuration)
    );
    assert_eq!(h.job(20).state, JobState::Placed);
}

#[test]
fn preemption_cap_per_job() {
    let mut h = world();
    h.fleet(&[(1, a100(), 2, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
    let cap = h.state.config.scheduler.preemptions_per_job_max;
    for round in 0..=cap as u64 {
        h.advance(5 * 60_000);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        submit(
            &mut h,
            Harness::job_spec(100 + round, Tier::ENTERPRISE, vec![a100()], 2),
        );
        let preempted = h.job(10).state == JobState::Preempting;
        assert_eq!(preempted, round < cap as u64, "round {round}");
        if !preempted {
            break;
        }
        h.advance(h.state.config.scheduler.grace_ms);
        h.nodes_alive();
        // The enterprise job ran; finish it so job 10 is placed again.
        h.job_heartbeat(100 + round, 1, 0).unwrap();
        h.finish_job(100 + round, true).unwrap();
        h.tick();
        assert!(
            h.job(10).state.holds_gpus(),
            "round {round}: requeued job placed again"
        );
    }
}

/// Aging: a job that waited past its tier's max wait goes before newer higher-tier work.
#[test]
fn aging_lets_no_tier_starve() {
    let mut h = world();
    h.fleet(&[(1, a100(), 1, 80)]);
    let mut blocker = Harness::job_spec(1, Tier::ENTERPRISE, vec![a100()], 1);
    blocker.preemptible = false;
    submit(&mut h, blocker);
    submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 1));
    let max_wait = h.state.config.scheduler.tiers[0].max_wait_ms;
    h.advance(max_wait);
    h.nodes_alive();
    h.job_heartbeat(1, 1, 0).unwrap();
    submit(
        &mut h,
        Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 1),
    );
    h.finish_job(1, true).unwrap();
    h.tick();
    assert_eq!(
        h.job(10).state,
        JobState::Placed,
        "the aged free job goes first"
    );
    assert_eq!(h.job(20).state, JobState::Queued);
}

/// Fair share inside a tier: equal-weight orgs alternate; a flood by one org does not
/// take the capacity from another (the seed's 10,000-job follow-up, in miniature).
#[test]
fn fair_share_between_orgs_in_a_tier() {
    let mut h = world();
    h.grant(
        2,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    h.fleet(&[(1, a100(), 4, 80)]);
    for j in 0..20 {
        submit(
            &mut h,
            Harness::job_spec(100 + j, Tier::ENTERPRISE, vec![a100()], 1),
        );
    }
    let other = |j| {
        let mut s = Harness::job_spec(j, Tier::ENTERPRISE, vec![a100()], 1);
        s.project = OTHER_PROJECT;
        s.user = OTHER_USER;
        s
    };
    // All four GPUs went to org 1's flood; org 2 arrives later.
    submit(&mut h, other(200));
    submit(&mut h, other(201));
    // As org 1's jobs finish one by one, org 2 gets every other GPU until it holds 2.
    for j in 100..104 {
        h.advance(60_000);
        h.nodes_alive();
        h.job_heartbeat(j, 1, 0).unwrap();
        h.finish_job(j, true).unwrap();
    }
    assert!(h.job(200).state.holds_gpus() && h.job(201).state.holds_gpus());
    let running_org2 = h
        .state
        .scheduler
        .running_org
        .get(&OTHER_ORG)
        .copied()
        .unwrap_or(0);
    assert_eq!(running_org2, 2);
}

#[test]
fn fair_share_holds_within_one_pass() {
    // Both orgs queue while the only node drains; its return lets one pass place four
    // jobs: each placement raises its org's share, so the pass alternates between the
    // orgs instead of serving the first org four times.
    let mut h = world();
    h.fleet(&[(1, a100(), 4, 80)]);
    let drain = |draining| Command::SetNodeDraining {
        node: NodeId(1),
        draining,
    };
    h.ok(drain(true));
    h.grant(
        2,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    for j in 0..6 {
        submit(
            &mut h,
            Harness::job_spec(100 + j, Tier::PAID, vec![a100()], 1),
        );
        let mut s = Harness::job_spec(200 + j, Tier::PAID, vec![a100()], 1);
        s.project = OTHER_PROJECT;
        s.user = OTHER_USER;
        submit(&mut h, s);
    }
    assert_eq!(h.state.scheduler.used_gpus, 0);
    h.ok(drain(false));
    let running = |org| {
        h.state
            .scheduler
            .running_org
            .get(&org)
            .copied()
            .unwrap_or(0)
    };
    assert_eq!((running(ORG), running(OTHER_ORG)), (2, 2));
}

#[test]
fn tier_floor_guarantees_a_share() {
    let mut h = world();
    // 20 GPUs; free tier floor 5% = 1 GPU.
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80), (3, a100(), 4, 80)]);
    for j in 0..30 {
        submit(
            &mut h,
            Harness::job_spec(100 + j, Tier::ENTERPRISE, vec![a100()], 1),
        );
    }
    // Enterprise fills the fleet (no free job yet). Now a free job arrives; one
    // enterprise job finishes: the floor gives the GPU to the free tier.
    submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 1));
    h.advance(60_000);
    h.nodes_alive();
    h.job_heartbeat(100, 1, 0).unwrap();
    h.finish_job(100, true).unwrap();
    assert!(
        h.job(10).state.holds_gpus(),
        "free tier under its floor is served first"
    );
}

/// The hold is priced at submission; if prices rise before placement, the meter's
/// price is higher and the hold runs low. Top-up draws more; when the account cannot
/// pay, the job is stopped with OutOfCredits — even a non-preemptible one.
#[test]
fn out_of_credits_stops_even_a_non_preemptible_job() {
    let mut h = world();
    // Spend the fixture's big grant down so only 1 credit stays free.
    h.ok(Command::CreateHold(Harness::hold_spec(
        99,
        credits(100_000) - credits(1),
    )));
    let mut spec = Harness::job_spec(10, Tier::PAID, vec![a100()], 1);
    spec.preemptible = false;
    spec.max_duration_ms = HOUR_MS;
    h.grant(2, P, BucketKind::Paid, credits(2), None); // exactly the 1-hour hold at 2/h
    h.fleet(&[(1, a100(), 8, 80)]);
    h.ok(Command::SetNodeDraining {
        node: NodeId(1),
        draining: true,
    });
    submit(&mut h, spec);
    assert_eq!(h.job(10).state, JobState::Queued, "no ready node yet");
    h.ok(Command::SetPrices {
        prices: vec![(a100(), 2 * A100_PRICE), (h100(), H100_PRICE)],
    });
    h.ok(Command::SetNodeDraining {
        node: NodeId(1),
        draining: false,
    });
    assert_eq!(
        h.job(10)
            .placement
            .as_ref()
            .unwrap()
            .price_micro_per_gpu_hour,
        2 * A100_PRICE
    );
    h.advance(HOUR_MS / 2 + 60_000); // 2.13 credits due: hold 2 + 1 free credit
    let Ok(Reply::JobHeartbeat(r)) = h.job_heartbeat(10, 1, 0) else {
        panic!()
    };
    assert!(r.stop.is_none(), "topped up from the last free credit");
    h.advance(HOUR_MS / 4);
    let Ok(Reply::JobHeartbeat(r)) = h.job_heartbeat(10, 2, 0) else {
        panic!()
    };
    let stop = r.stop.expect("the account cannot pay: stop");
    assert_eq!(stop.reason, SettleReason::OutOfCredits);
    assert!(stop.uncollected_micro > 0);
    assert_eq!(
        (h.job(10).state, h.job(10).last_reason),
        (JobState::Failed, Reason::OutOfCredits)
    );
    assert_eq!(h.state.scheduler.used_gpus, 0, "its GPU is free again");
}

#[test]
fn admission_quota_and_idempotent_submit() {
    let mut h = world();
    h.fleet(&[(1, a100(), 1, 80)]);
    h.ok(Command::SetQuota {
        org: ORG,
        quota: Some(Quota {
            queued_max: 2,
            running_max: 10,
            ..Quota::default()
        }),
    });
    for j in 10..13 {
        submit(&mut h, Harness::job_spec(j, Tier::PAID, vec![a100()], 1));
    }
    // 1 running, 2 queued: the next is refused.
    assert_eq!(
        h.run(Command::SubmitJob(Harness::job_spec(
            13,
            Tier::PAID,
            vec![a100()],
            1
        ))),
        Err(CommandError::QuotaExceeded(QuotaKind::QueuedJobs))
    );
    // Resubmitting a job with the same spec (a new request id) returns it as it is.
    let again = h.run(Command::SubmitJob(Harness::job_spec(
        10,
        Tier::PAID,
        vec![a100()],
        1,
    )));
    assert!(matches!(
        again,
        Ok(Reply::JobSubmitted {
            state: JobState::Placed,
            ..
        })
    ));
    // The same id with another spec is refused.
    assert_eq!(
        h.run(Command::SubmitJob(Harness::job_spec(
            10,
            Tier::PAID,
            vec![a100()],
            2
        ))),
        Err(CommandError::AlreadyExists)
    );
}

#[test]
fn cancel_queued_and_running_jobs() {
    let mut h = world();
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    submit(&mut h, Harness::job_spec(11, Tier::PAID, vec![a100()], 1));
    let Ok(Reply::JobCancelled(Some(s))) =
        h.run_as(tenant(ORG), Command::CancelJob { job: JobId(11) })
    else {
        panic!()
    };
    assert_eq!(
        (s.captured_micro, s.refunded_micro),
        (0, h.job(11).hold_micro)
    );
    h.advance(HOUR_MS);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    let Ok(Reply::JobCancelled(Some(s))) =
        h.run_as(tenant(ORG), Command::CancelJob { job: JobId(10) })
    else {
        panic!()
    };
    assert_eq!(s.captured_micro, credits(2));
    assert_eq!(h.job(10).state, JobState::Cancelled);
    assert_eq!(
        h.run_as(tenant(OTHER_ORG), Command::CancelJob { job: JobId(10) }),
        Err(CommandError::UnknownJob)
    );
    assert_eq!(
        h.run(Command::CancelJob { job: JobId(10) }),
        Err(CommandError::JobFinished)
    );
}

#[test]
fn a_jobs_hold_is_only_touched_through_the_job() {
    let mut h = world();
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    assert_eq!(
        h.run(Command::ReleaseHold { hold: HoldId(10) }),
        Err(CommandError::HoldOwnedByJob)
    );
    let hb = Heartbeat {
        hold: HoldId(10),
        attempt: 1,
        seq: 5,
        progress_ppm: 0,
        checkpoint: 0,
    };
    assert_eq!(
        h.run(Command::Heartbeat(hb.clone())),
        Err(CommandError::HoldOwnedByJob)
    );
    // An agent may not meter holds at all (only its own node's jobs, by job id).
    assert_eq!(
        h.run_as(Actor::Agent(NodeId(1)), Command::Heartbeat(hb)),
        Err(CommandError::Unauthorized)
    );
}

#[test]
fn bad_job_and_node_input_changes_nothing() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    let spec = |f: fn(&mut JobSpec)| {
        let mut s = Harness::job_spec(50, Tier::PAID, vec![a100()], 1);
        f(&mut s);
        Command::SubmitJob(s)
    };
    let cases: Vec<(Command, CommandError)> = vec![
        (spec(|s| s.gpus = 0), CommandError::InvalidGpuCount),
        (spec(|s| s.gpus = 9), CommandError::InvalidGpuCount),
        (
            spec(|s| s.gpu_types = vec![]),
            CommandError::InvalidJob(JobProblem::NoGpuTypes),
        ),
        (
            spec(|s| s.gpu_types = vec![GpuType::new("b200")]),
            CommandError::InvalidGpuType(GpuType::new("b200")),
        ),
        (
            spec(|s| s.gpu_types = vec![a100(), GpuType::new("B200")]),
            CommandError::UnknownGpuType(GpuType::new("B200")),
        ),
        (
            spec(|s| s.gpu_types = vec![h100()]),
            CommandError::Unsatisfiable,
        ),
        (spec(|s| s.mem_floor_gb = 81), CommandError::Unsatisfiable),
        (
            spec(|s| s.max_duration_ms = 0),
            CommandError::InvalidJob(JobProblem::MaxDuration),
        ),
        (spec(|s| s.tier = Tier(9)), CommandError::UnknownTier),
        (
            spec(|s| s.project = ProjectId(99)),
            CommandError::UnknownProject,
        ),
        (spec(|s| s.user = OTHER_USER), CommandError::UnknownUser),
        (
            Command::RegisterNode(NodeSpec {
                node: NodeId(1),
                gpu_type: a100(),
                gpu_count: 4,
                gpu_mem_gb: 80,
                labels: vec![],
                incarnation: 0,
            }),
            CommandError::NodeShapeConflict,
        ),
        (
            Command::RegisterNode(NodeSpec {
                node: NodeId(2),
                gpu_type: a100(),
                gpu_count: 0,
                gpu_mem_gb: 80,
                labels: vec![],
                incarnation: 0,
            }),
            CommandError::InvalidNode(NodeProblem::GpuCount),
        ),
        (
            Command::SetNodeDraining {
                node: NodeId(9),
                draining: true,
            },
            CommandError::UnknownNode,
        ),
        (
            Command::CancelJob { job: JobId(99) },
            CommandError::UnknownJob,
        ),
    ];
    for (command, expected) in cases {
        let (ledger, sched) = (h.state.ledger.clone(), h.state.scheduler.clone());
        let name = command.name();
        assert_eq!(h.run(command), Err(expected), "{name}");
        assert_eq!(
            (&h.state.ledger, &h.state.scheduler),
            (&ledger, &sched),
            "{name} changed state"
        );
    }
}

/// Admission checks count and memory on one node shape: a type with an 8 × 40 GB node
/// and a 1 × 80 GB node cannot run an 8-GPU job that needs 80 GB per GPU, which would
/// otherwise wait forever holding its credits.
#[test]
fn admission_needs_one_node_shape_that_fits_the_whole_job() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 40), (2, a100(), 1, 80)]);
    let mut big = Harness::job_spec(50, Tier::PAID, vec![a100()], 8);
    big.mem_floor_gb = 80;
    let before = (h.state.ledger.clone(), h.state.scheduler.clone());
    assert_eq!(
        h.run(Command::SubmitJob(big.clone())),
        Err(CommandError::Unsatisfiable)
    );
    assert_eq!(
        (&h.state.ledger, &h.state.scheduler),
        (&before.0, &before.1)
    );
    // Each half of it fits a shape: 8 GPUs of 40 GB, or one GPU of 80 GB.
    let mut wide = big.clone();
    wide.job = JobId(51);
    wide.mem_floor_gb = 40;
    submit(&mut h, wide);
    assert_eq!(node_of(&h, 51), Some(1));
    let mut deep = big;
    deep.job = JobId(52);
    deep.gpus = 1;
    submit(&mut h, deep);
    assert_eq!(node_of(&h, 52), Some(2));
}

#[test]
fn draining_node_takes_no_new_work() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
    h.ok(Command::SetNodeDraining {
        node: NodeId(1),
        draining: true,
    });
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    assert_eq!(node_of(&h, 10), Some(2));
    assert!(h
        .state
        .scheduler
        .assignments(NodeId(2))
        .iter()
        .any(|(j, a, _, _)| j.1 == JobId(10) && *a == 1));
}

/// The running quota caps an org's running jobs; the rest wait in the queue (they are
/// not refused) and run as earlier jobs finish.
#[test]
fn running_quota_holds_jobs_in_the_queue() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    h.ok(Command::SetQuota {
        org: ORG,
        quota: Some(Quota {
            queued_max: 10,
            running_max: 2,
            ..Quota::default()
        }),
    });
    for j in 10..13 {
        submit(&mut h, Harness::job_spec(j, Tier::PAID, vec![a100()], 1));
    }
    let states: Vec<JobState> = (10..13).map(|j| h.job(j).state).collect();
    assert_eq!(
        states,
        vec![JobState::Placed, JobState::Placed, JobState::Queued],
        "GPUs are free, the quota is not"
    );
    h.advance(60_000);
    h.job_heartbeat(10, 1, 0).unwrap();
    h.finish_job(10, true).unwrap();
    assert_eq!(h.job(12).state, JobState::Placed);
}

/// Queues `n` one-GPU jobs for each of the given (project, user) pairs while the only
/// node drains, then lets one pass place them all: what each pair got shows the
/// weighted fair share (ties go to the lower id).
fn one_pass_split(h: &mut Harness, gpus: u32, groups: &[(ProjectId, UserId)]) -> Vec<u32> {
    h.fleet(&[(1, a100(), gpus, 80)]);
    let drain = |draining| Command::SetNodeDraining {
        node: NodeId(1),
        draining,
    };
    h.ok(drain(true));
    let mut ids = Vec::new();
    for (g, (project, user)) in groups.iter().enumerate() {
        let mut mine = Vec::new();
        for j in 0..gpus as u64 {
            let mut s = Harness::job_spec(1_000 * (g as u64 + 1) + j, Tier::PAID, vec![a100()], 1);
            s.project = *project;
            s.user = *user;
            mine.push(s.job.0);
            submit(h, s);
        }
        ids.push(mine);
    }
    h.ok(drain(false));
    ids.iter()
        .map(|mine| {
            mine.iter()
                .filter(|j| h.job(**j).state.holds_gpus())
                .count() as u32
        })
        .collect()
}

/// Share weights divide decayed usage at every level: weight 200 against the default
/// 100 gets twice the GPUs between orgs; 300 gets three times between projects of one
/// org and between users of one project.
#[test]
fn share_weights_divide_fair_share_at_every_level() {
    let weight = |scope, w| Command::SetShareWeight {
        scope,
        weight: Some(w),
    };
    // A world whose `project` can pay for its jobs too.
    let funded = |project| {
        let mut h = world();
        h.grant(
            2,
            Account::Project(project),
            BucketKind::Paid,
            credits(100_000),
            None,
        );
        h
    };
    let orgs = [(PROJECT, USER), (OTHER_PROJECT, OTHER_USER)];
    // Orgs: org 1 at 200, org 2 at the default.
    let mut h = funded(OTHER_PROJECT);
    h.ok(weight(BudgetScope::Org(ORG), 200));
    assert_eq!(
        one_pass_split(&mut h, 6, &orgs),
        vec![4, 2],
        "2:1 between orgs"
    );
    // Without the weight, the same queue splits evenly.
    let mut h = funded(OTHER_PROJECT);
    assert_eq!(
        one_pass_split(&mut h, 6, &orgs),
        vec![3, 3],
        "even without weights"
    );
    // Projects of one org: project 12 at 300.
    let mut h = funded(PROJECT_B);
    h.ok(weight(BudgetScope::Project(PROJECT_B), 300));
    let split = one_pass_split(&mut h, 8, &[(PROJECT, USER), (PROJECT_B, USER_B)]);
    assert_eq!(split, vec![2, 6], "3:1 between projects");
    // Users of one project: user 21 at 300.
    let mut h = world();
    h.ok(weight(BudgetScope::User(USER), 300));
    let split = one_pass_split(&mut h, 8, &[(PROJECT, USER), (PROJECT, USER_B)]);
    assert_eq!(split, vec![6, 2], "3:1 between users");
    // Resetting a weight restores the default; bad weights change nothing.
    let before = h.state.scheduler.clone();
    for bad in [0, 10_001] {
        assert_eq!(
            h.run(weight(BudgetScope::User(USER), bad)),
            Err(CommandError::InvalidShareWeight)
        );
    }
    assert_eq!(
        h.run(weight(BudgetScope::User(UserId(99)), 200)),
        Err(CommandError::UnknownUser)
    );
    assert_eq!(h.state.scheduler, before);
    h.ok(Command::SetShareWeight {
        scope: BudgetScope::User(USER),
        weight: None,
    });
    assert_eq!(
        h.state.scheduler.share_weight(ORG, BudgetScope::User(USER)),
        100
    );
}

/// Who may weigh whom: org weights are the operator's; an org weighs its own projects
/// and users (another org's answer as unknown); a project token weighs nothing.
#[test]
fn share_weights_are_scoped() {
    let mut h = world();
    let set = |scope| Command::SetShareWeight {
        scope,
        weight: Some(200),
    };
    assert_eq!(
        h.run_as(tenant(ORG), set(BudgetScope::Org(ORG))),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(
        h.run_as(tenant(ORG), set(BudgetScope::Project(PROJECT_B))),
        Ok(Reply::ShareWeightSet)
    );
    assert_eq!(
        h.run_as(tenant(ORG), set(BudgetScope::User(USER_B))),
        Ok(Reply::ShareWeightSet)
    );
    let before = h.state.scheduler.clone();
    assert_eq!(
        h.run_as(tenant(ORG), set(BudgetScope::Project(OTHER_PROJECT))),
        Err(CommandError::UnknownProject)
    );
    assert_eq!(
        h.run_as(tenant(ORG), set(BudgetScope::User(OTHER_USER))),
        Err(CommandError::UnknownUser)
    );
    let project_token = Actor::Project {
        org: ORG,
        project: PROJECT,
        principal: PrincipalId(500),
    };
    assert_eq!(
        h.run_as(project_token, set(BudgetScope::Project(PROJECT))),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(h.state.scheduler, before);
    // And an org token may not issue grants (paid credit is the operator's).
    let grant = Command::IssueGrant(Grant {
        bucket: BucketId(77),
        owner: Account::Org(ORG),
        kind: BucketKind::Paid,
        amount_micro: credits(10),
        expires_at_ms: None,
        priority: 0,
        policy: None,
        source_ref: None,
    });
    let ledger = h.state.ledger.clone();
    assert_eq!(
        h.run_as(tenant(ORG), grant),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(h.state.ledger, ledger);
}

/// A tier at its burst ceiling waits while another tier has demand, which gets the
/// rest; below the ceilings, GPUs split by tier weight (enterprise 8 : free 1).
#[test]
fn tier_ceilings_and_weights() {
    let flood = |h: &mut Harness| {
        h.fleet(&[(1, a100(), 10, 80), (2, a100(), 10, 80)]);
        for n in [1, 2] {
            h.ok(Command::SetNodeDraining {
                node: NodeId(n),
                draining: true,
            });
        }
        for j in 0..20 {
            submit(
                h,
                Harness::job_spec(100 + j, Tier::ENTERPRISE, vec![a100()], 1),
            );
            submit(h, Harness::job_spec(200 + j, Tier::FREE, vec![a100()], 1));
        }
        h.apply(
            [1, 2]
                .into_iter()
                .map(|n| Request {
                    actor: ADMIN,
                    request_id: 900 + n as u128,
                    org: None,
                    command: Command::SetNodeDraining {
                        node: NodeId(n),
                        draining: false,
                    },
                })
                .collect(),
        );
        let tier = |t| h.state.scheduler.tier_gpus.get(&t).copied().unwrap_or(0);
        (tier(Tier::ENTERPRISE), tier(Tier::FREE))
    };
    // Enterprise's ceiling (70% of 20 GPUs) binds: 14; the free tier gets the other 6.
    let mut h = world_default_leases();
    assert_eq!(flood(&mut h), (14, 6));
    // With the ceiling lifted, floors first (enterprise 30% = 6, free 5% = 1), then
    // least GPUs per weight, ties to the higher tier: 17 : 3.
    let mut h = world_default_leases();
    let mut s = h.state.config.scheduler.settings();
    s.tiers[Tier::ENTERPRISE.0 as usize].ceiling_pct = 100;
    h.ok(Command::ConfigureScheduler(s));
    assert_eq!(flood(&mut h), (17, 3));
}

/// The victim set is the cheapest, not the greedy one: two 1-GPU jobs that would lose
/// 3 GPU-minutes each are spared for one 2-GPU job that loses 5 in all.
#[test]
fn preemption_picks_the_victim_set_that_loses_least() {
    let mut h = world();
    h.fleet(&[(1, a100(), 4, 80)]);
    for (j, gpus) in [(10, 1), (11, 1), (12, 2)] {
        submit(&mut h, Harness::job_spec(j, Tier::FREE, vec![a100()], gpus));
        h.job_heartbeat(j, 1, 0).unwrap();
    }
    h.advance(17 * 60_000);
    h.job_heartbeat(10, 2, 1).unwrap(); // checkpoints at 17 min
    h.job_heartbeat(11, 2, 1).unwrap();
    h.advance(30_000);
    h.job_heartbeat(12, 2, 1).unwrap(); // checkpoint at 17.5 min
    h.advance(150_000); // 20 min: losses 1×3, 1×3 and 2×2.5 GPU-minutes
    submit(
        &mut h,
        Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2),
    );
    let states: Vec<JobState> = [10, 11, 12].iter().map(|j| h.job(*j).state).collect();
    assert_eq!(
        states,
        vec![JobState::Running, JobState::Running, JobState::Preempting]
    );
}

/// A gang job that reserved a node to drain (no victim was eligible yet) still preempts
/// once victims become eligible, instead of waiting for the node to drain by itself.
#[test]
fn a_reserved_gang_job_preempts_once_victims_are_eligible() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    for j in 0..8 {
        submit(
            &mut h,
            Harness::job_spec(10 + j, Tier::FREE, vec![a100()], 1),
        );
        h.job_heartbeat(10 + j, 1, 0).unwrap();
    }
    h.advance(10_000);
    submit(
        &mut h,
        Harness::job_spec(30, Tier::ENTERPRISE, vec![a100()], 8),
    );
    // The victims are younger than the minimum runtime: the job reserves the node.
    assert_eq!(h.job(30).reserved_node, Some(NodeId(1)));
    assert!((10..18).all(|j| h.job(j).state == JobState::Running));
    h.advance(h.state.config.scheduler.min_runtime_ms);
    h.tick();
    assert!(
        (10..18).all(|j| h.job(j).state == JobState::Preempting),
        "every victim is being preempted for the reserved job"
    );
    assert_eq!(h.job(30).reserved_node, Some(NodeId(1)));
    // After the grace period the GPUs go to the waiting job.
    h.advance(h.state.config.scheduler.grace_ms);
    h.tick();
    assert_eq!(node_of(&h, 30), Some(1));
}

// ------------------------------------------------------------------ fencing (issue 21)

/// Job 10 (1 A100) runs on node 1 (one GPU) with default leases (node 60 s, margin
/// 10 s); its last heartbeat is at 20 s, after which node 1 falls silent. Node 2 (also
/// one A100) stays alive. Returns the instant node 1's lease ends.
fn silent_node_world() -> (Harness, u64) {
    let mut h = world_default_leases();
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    h.advance(20_000);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    let lease_end = h.state.scheduler.node(NodeId(1)).unwrap().lease_until_ms;
    h.fleet(&[(2, a100(), 1, 80)]);
    (h, lease_end)
}

/// Renews node 2's lease only (node 1 is silent).
fn node_2_alive(h: &mut Harness) {
    h.run_as(
        Actor::Agent(NodeId(2)),
        Command::NodeHeartbeat { node: NodeId(2) },
    )
    .unwrap();
}

/// A silent node's job is not re-placed until the fence margin has passed after its
/// lease (issue 21, finding 1: it used to be re-placed at the lease's end, while the old
/// runner could still be running); meanwhile the node takes no new work.
#[test]
fn a_silent_nodes_jobs_are_replaced_only_after_the_fence_margin() {
    let (mut h, lease_end) = silent_node_world();
    let margin = h.state.config.scheduler.fence_margin_ms;
    assert!(margin > 0);
    h.now = lease_end;
    node_2_alive(&mut h);
    let n1 = h.state.scheduler.node(NodeId(1)).unwrap();
    assert!(n1.lapsed && n1.state == NodeState::Ready);
    assert_eq!(
        h.job(10).state,
        JobState::Running,
        "not re-placed at the lease's end"
    );
    // A new job goes to node 2, never to the lapsed node.
    submit(&mut h, Harness::job_spec(11, Tier::PAID, vec![a100()], 1));
    assert_eq!(node_of(&h, 11), Some(2));
    h.ok(Command::FinishJob {
        job: JobId(11),
        attempt: 1,
        success: true,
    });
    h.now = lease_end + margin - 1;
    node_2_alive(&mut h);
    assert_eq!(h.job(10).state, JobState::Running);
    assert_eq!(node_of(&h, 10), Some(1));
    // At lease + margin: node 1 is down, job 10 runs again on node 2 as attempt 2, its
    // first attempt billed to its last heartbeat (20 s).
    h.now = lease_end + margin;
    node_2_alive(&mut h);
    assert_eq!(
        h.state.scheduler.node(NodeId(1)).unwrap().state,
        NodeState::Down
    );
    assert_eq!((node_of(&h, 10), h.job(10).attempt), (Some(2), 2));
    assert_eq!(h.job(10).last_reason, Reason::Placed);
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(20_000, A100_PRICE, 1)
    );
}

/// After a whole-cluster outage longer than every lease and the job's max duration,
/// logical time resumes at the real instant and all of them are due in one entry: the
/// job's node is silent too, so its fate decides — requeued as a platform fault, billed to
/// its last heartbeat — rather than Lost by its job lease (fired first: it is shorter) or
/// billed to now by its deadline for GPU time its agent, cut off, did not use.
#[test]
fn after_a_whole_cluster_outage_jobs_are_requeued_not_lost_nor_billed_for_it() {
    // Both timers due before the node's fate is decided (lease 60 s + margin 10 s after
    // the last node heartbeat at 20 s): a job lease of 30 s, a max duration of 50 s.
    for (job_lease_ms, max_duration_ms) in [(30_000, 10 * 60_000), (180_000, 50_000)] {
        let mut config = Config::default();
        config.scheduler.job_lease_ms = job_lease_ms;
        let mut h = Harness::world_with(config);
        h.grant(1, P, BucketKind::Paid, credits(100_000), None);
        h.fleet(&[(1, a100(), 1, 80)]);
        let mut spec = Harness::job_spec(10, Tier::PAID, vec![a100()], 1);
        spec.max_duration_ms = max_duration_ms;
        submit(&mut h, spec);
        h.advance(20_000);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        let cfg = h.state.config.scheduler.clone();
        assert!(20_000 + cfg.job_lease_ms.min(max_duration_ms) < 20_000 + cfg.node_lease_ms);
        h.advance(10 * (cfg.job_lease_ms + cfg.node_lease_ms + cfg.fence_margin_ms));
        h.tick();
        let j = h.job(10);
        assert_eq!(j.state, JobState::Queued, "{:?}", j.last_reason);
        assert_eq!(j.last_reason, Reason::NodeDown);
        assert_eq!(j.node_failures, 1);
        assert_eq!(
            h.hold(10).captured,
            ledger::cost_micro(20_000, A100_PRICE, 1)
        );
        assert_eq!(
            h.state.scheduler.node(NodeId(1)).unwrap().state,
            NodeState::Down
        );
    }
}

/// With its node alive, a job's silence is the job's: its lease ends it as Lost.
#[test]
fn a_silent_job_on_a_live_node_is_lost_at_its_lease() {
    let mut h = world_default_leases();
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    h.advance(20_000);
    h.job_heartbeat(10, 1, 0).unwrap();
    let job_lease = h.state.config.scheduler.job_lease_ms;
    let mut t = 0;
    while h.job(10).state == JobState::Running {
        h.advance(5_000);
        h.nodes_alive();
        t += 5_000;
        assert!(t <= job_lease + 5_000, "still running after its lease");
    }
    assert_eq!(h.job(10).state, JobState::Lost);
    assert_eq!(h.job(10).last_reason, Reason::LeaseExpired);
}

/// A node back within the margin keeps its jobs; the attempts its agent stopped while
/// it could not renew the lease are reported with `JobFenced` and requeued, billed to
/// their last heartbeat; the report is fenced like any other.
#[test]
fn a_fenced_attempt_is_requeued_and_billed_to_its_last_heartbeat() {
    let (mut h, lease_end) = silent_node_world();
    h.now = lease_end + 1_000;
    h.tick();
    assert!(h.state.scheduler.node(NodeId(1)).unwrap().lapsed);
    // Node 1's agent is back within the margin: the node takes work again.
    h.run_as(
        Actor::Agent(NodeId(1)),
        Command::NodeHeartbeat { node: NodeId(1) },
    )
    .unwrap();
    assert!(!h.state.scheduler.node(NodeId(1)).unwrap().lapsed);
    assert_eq!(node_of(&h, 10), Some(1));
    // Another node's agent cannot report it.
    let fenced = |attempt| Command::JobFenced {
        job: JobId(10),
        attempt,
    };
    assert_eq!(
        h.run_as(Actor::Agent(NodeId(2)), fenced(1)),
        Err(CommandError::UnknownJob)
    );
    // The agent stopped attempt 1 when its lease ran short, and says so.
    assert_eq!(
        h.run_as(Actor::Agent(NodeId(1)), fenced(1)),
        Ok(Reply::JobFinished(None))
    );
    let j = h.job(10);
    assert_eq!(j.node_failures, 1);
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(20_000, A100_PRICE, 1)
    );
    // Placed again (node 2 is free) as attempt 2; the old report's resend is stale.
    assert_eq!(h.job(10).attempt, 2);
    assert_eq!(
        h.run_as(Actor::Agent(NodeId(1)), fenced(1)),
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    // A tenant cannot send it.
    assert_eq!(
        h.run_as(tenant(ORG), fenced(2)),
        Err(CommandError::Unauthorized)
    );
}

/// A queued job whose preferred GPU type lost its price runs on its next type; one with
/// no priced type left fails (`Unpriced`) and its hold returns (issue 21, finding 6: it
/// used to be parked on every pass, its credits held, forever).
#[test]
fn a_price_edit_never_strands_a_queued_job() {
    let mut h = world();
    h.fleet(&[(1, h100(), 1, 80), (2, a100(), 1, 80)]);
    // Both nodes busy.
    submit(&mut h, Harness::job_spec(1, Tier::PAID, vec![h100()], 1));
    submit(&mut h, Harness::job_spec(2, Tier::PAID, vec![a100()], 1));
    // Job 3 prefers H100, takes A100; job 4 takes H100 only.
    submit(
        &mut h,
        Harness::job_spec(3, Tier::PAID, vec![h100(), a100()], 1),
    );
    submit(&mut h, Harness::job_spec(4, Tier::PAID, vec![h100()], 1));
    let balance = h.bucket(1).remaining + h.bucket(1).held;
    // H100 is withdrawn from the price table.
    h.ok(Command::SetPrices {
        prices: vec![(a100(), A100_PRICE)],
    });
    // The running H100 job keeps its price; both nodes free up.
    h.advance(HOUR_MS);
    h.finish_job(1, true).unwrap();
    assert_eq!(
        h.hold(1).captured,
        ledger::cost_micro(HOUR_MS, H100_PRICE, 1)
    );
    h.finish_job(2, true).unwrap();
    assert_eq!(node_of(&h, 3), Some(2), "its next type, which has a price");
    assert_eq!(h.job(3).placement.as_ref().unwrap().gpu_type, a100());
    let j4 = h.job(4);
    assert_eq!(
        (j4.state, j4.last_reason),
        (JobState::Failed, Reason::Unpriced)
    );
    assert!(!h.hold(4).is_open());
    assert_eq!(h.hold(4).captured, 0, "its whole hold returned");
    // Nothing is held for job 4 any more.
    assert_eq!(
        h.bucket(1).remaining + h.bucket(1).held,
        balance
            - ledger::cost_micro(HOUR_MS, H100_PRICE, 1)
            - ledger::cost_micro(HOUR_MS, A100_PRICE, 1)
    );
}

/// A node's agent registering as a new incarnation (a restarted agent process) ends the
/// attempts the previous process ran — requeued as attempt 2, billed to the last
/// heartbeat — so the dead process's late heartbeat or finish is stale and changes
/// nothing, and an older incarnation cannot register again (issue 21: a restarted agent
/// re-ran the same attempt, and the old process's finish settled the job the new runner
/// was running).
#[test]
fn a_new_agent_incarnation_fences_the_old_ones_reports() {
    let mut h = world();
    let register = |incarnation: u64| {
        Command::RegisterNode(NodeSpec {
            node: NodeId(1),
            gpu_type: a100(),
            gpu_count: 1,
            gpu_mem_gb: 80,
            labels: vec![],
            incarnation,
        })
    };
    // An operator registers the node (no incarnation) and a job is placed on it; the
    // node's first agent process adopts the placement (no earlier runner exists).
    h.run(register(0)).unwrap();
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    assert_eq!((node_of(&h, 10), h.job(10).attempt), (Some(1), 1));
    assert_eq!(h.run(register(100)), Ok(Reply::NodeUpdated));
    assert_eq!(h.state.scheduler.node(NodeId(1)).unwrap().incarnation, 100);
    assert_eq!((h.job(10).attempt, h.job(10).node_failures), (1, 0));
    h.advance(20_000);
    h.job_heartbeat(10, 1, 0).unwrap();
    h.advance(5_000);
    let billed = h.hold(10).captured;
    assert_eq!(billed, ledger::cost_micro(20_000, A100_PRICE, 1));
    // The same incarnation again renews the node and touches no job.
    assert_eq!(h.run(register(100)), Ok(Reply::NodeUpdated));
    assert_eq!(h.job(10).attempt, 1);
    // The agent restarts (incarnation 101): attempt 1 ends, billed to its heartbeat, and
    // the job is placed again as attempt 2 on the free node.
    assert_eq!(h.run(register(101)), Ok(Reply::NodeUpdated));
    assert_eq!(h.state.scheduler.node(NodeId(1)).unwrap().incarnation, 101);
    assert_eq!(h.job(10).node_failures, 1);
    assert_eq!(h.hold(10).captured, billed, "billed to the last heartbeat");
    assert_eq!((node_of(&h, 10), h.job(10).attempt), (Some(1), 2));
    // The old process's late reports name attempt 1: refused, nothing changes.
    let snapshot = |h: &Harness| {
        format!(
            "{:?} {:?} {:?}",
            h.job(10),
            h.hold(10),
            h.state.scheduler.node(NodeId(1))
        )
    };
    let before = snapshot(&h);
    let org = h.job(10).org;
    let old_finish = Command::FinishJob {
        job: JobId(10),
        attempt: 1,
        success: true,
    };
    assert_eq!(
        h.run_in(Actor::Agent(NodeId(1)), org, old_finish),
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    let old_heartbeat = Command::JobHeartbeat(JobHeartbeat {
        job: JobId(10),
        attempt: 1,
        seq: 2,
        progress_ppm: 0,
        checkpoint: 0,
    });
    assert_eq!(
        h.run_in(Actor::Agent(NodeId(1)), org, old_heartbeat),
        Err(CommandError::StaleAttempt {
            given: 1,
            current: 2
        })
    );
    // The old process cannot take the node back.
    assert_eq!(
        h.run(register(100)),
        Err(CommandError::StaleIncarnation {
            given: 100,
            current: 101
        })
    );
    // The job, its hold and the node are as they were (a refusal takes an idempotency
    // record and an audit event, nothing else).
    assert_eq!(snapshot(&h), before);
    assert_eq!(
        h.job(10).state,
        JobState::Placed,
        "attempt 2 awaits its runner"
    );
    // An operator's registration (no incarnation) renews without ending anything.
    assert_eq!(h.run(register(0)), Ok(Reply::NodeUpdated));
    assert_eq!(h.job(10).attempt, 2);
    // The new process's reports are current.
    h.advance(10_000);
    assert!(h.job_heartbeat(10, 1, 0).is_ok());
    assert!(h.finish_job(10, true).is_ok());
    assert_eq!(h.job(10).state, JobState::Succeeded);
}

/// Node 1 (4 A100s) runs free jobs 10 and 11 (job 10 checkpointed); the node renews
/// its lease for the last time, falls silent, and a second later an enterprise job
/// preempts job 10 on it. The instant of that last renewal.
fn preempt_a_second_after_the_last_renewal(h: &mut Harness) -> u64 {
    preempt_a_second_after_the_last_renewal_on(h, 0)
}

/// Node 1 (4 GPUs) registered by an operator, then by the agent process `incarnation`
/// (none for 0).
fn register_node_1(h: &mut Harness, incarnation: u64) {
    h.ok(Command::RegisterNode(NodeSpec {
        node: NodeId(1),
        gpu_type: a100(),
        gpu_count: 4,
        gpu_mem_gb: 80,
        labels: vec![],
        incarnation,
    }));
}

/// [`preempt_a_second_after_the_last_renewal`] on a node the agent process
/// `incarnation` has registered (0: only the operator has).
fn preempt_a_second_after_the_last_renewal_on(h: &mut Harness, incarnation: u64) -> u64 {
    register_node_1(h, 0);
    if incarnation != 0 {
        register_node_1(h, incarnation);
    }
    submit(h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
    submit(h, Harness::job_spec(11, Tier::FREE, vec![a100()], 2));
    h.advance(5 * 60_000);
    h.nodes_alive();
    h.job_heartbeat(10, 1, 1).unwrap();
    h.job_heartbeat(11, 1, 0).unwrap();
    h.advance(60_000);
    h.nodes_alive();
    let renewed = h.now;
    h.job_heartbeat(10, 2, 1).unwrap();
    h.job_heartbeat(11, 2, 0).unwrap();
    h.advance(1_000);
    submit(h, Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2));
    assert_eq!(h.job(10).state, JobState::Preempting);
    renewed
}

/// Found by review (2026-11-27): a preemption's grace ended by the clock alone. When the
/// victim's node had gone silent before the preemption (its agent cut off, its runner
/// still running, the preemption never seen), the victim was requeued at the grace's end
/// and could start elsewhere while its old runner ran on until the agent's own fence —
/// up to ~24 s of one job running twice with the default leases. From rule version 4 the
/// victim keeps its GPUs until the node's fate: its next renewal (requeued then), or its
/// lease's end plus the fence margin (the node goes down; by then its agent has stopped
/// every runner).
#[test]
fn a_preemption_on_a_silent_node_waits_for_the_nodes_fate_from_rule_version_4() {
    for (rules, comes_back) in [(3, true), (4, true), (4, false)] {
        let mut h = world();
        h.ok(Command::ActivateVersion { version: rules });
        preempt_a_second_after_the_last_renewal(&mut h);
        let cfg = h.state.config.scheduler.clone();
        h.advance(cfg.grace_ms + 1);
        h.tick();
        if rules == 3 {
            assert_eq!(
                h.job(10).state,
                JobState::Queued,
                "version 3: requeued by the clock, though its node never heard of it"
            );
            continue;
        }
        assert_eq!(
            h.job(10).state,
            JobState::Preempting,
            "version 4: the silent node's victim keeps its GPUs"
        );
        assert_eq!(h.job(20).state, JobState::Queued);
        if comes_back {
            // The node renews (its agent is back and learns of the preemption): the
            // victim is requeued and the preemptor placed.
            h.nodes_alive();
            assert_eq!(h.job(10).state, JobState::Queued);
            assert_eq!(h.job(20).state, JobState::Placed);
        } else {
            // Still silent at its lease's end plus the margin: the node goes down, and
            // its agent has fenced itself by then.
            let fate = cfg.node_lease_ms + cfg.fence_margin_ms;
            h.advance(fate);
            h.tick();
            assert_eq!(h.state.scheduler.nodes[&NodeId(1)].state, NodeState::Down);
            assert_ne!(h.job(10).state, JobState::Preempting);
            assert!(h.job(10).placement.is_none(), "{:?}", h.job(10).state);
        }
    }
}

/// Found by review (twenty-first session): a preemption victim whose node then failed —
/// it stayed silent to its fate, or a new agent process registered it — was requeued as
/// a node failure: billed past its checkpoint to its last heartbeat, and counted against
/// its node-failure requeues (three such, and it failed). The platform had chosen to
/// stop it; had the node come back, or had the agent reported the attempt fenced, it
/// would have been billed to its checkpoint and counted as a preemption. From rule
/// version 8 every way its node can fail ends it so.
#[test]
fn a_preemption_victim_whose_node_fails_is_billed_as_preempted_from_rule_version_8() {
    for rules in [7, 8] {
        for new_process in [false, true] {
            let mut h = preempted_on_an_agents_node(rules);
            let cfg = h.state.config.scheduler.clone();
            if new_process {
                // Mid-grace, another agent process registers the node: the previous
                // one's attempts end.
                register_node_1(&mut h, 8);
            } else {
                // The node stays silent to its fate: its lease's end plus the margin.
                h.advance(cfg.grace_ms + 1);
                h.tick();
                assert_eq!(h.job(10).state, JobState::Preempting);
                h.advance(cfg.node_lease_ms + cfg.fence_margin_ms);
                h.tick();
                assert_eq!(h.state.scheduler.nodes[&NodeId(1)].state, NodeState::Down);
            }
            let j = h.job(10);
            // Requeued (and placed again where it fits).
            assert!(matches!(j.state, JobState::Queued | JobState::Placed));
            let seen = (j.node_failures, j.preemptions, h.hold(10).captured);
            // Version 7: a node failure, billed to the last heartbeat (a minute after the
            // checkpoint, on 2 GPUs at 2 credits per GPU-hour).
            let want = if rules == 7 {
                (1, 1, 66_666)
            } else {
                (0, 1, 0)
            };
            assert_eq!(seen, want, "version {rules}, new process {new_process}");
        }
    }
}

/// [`preempt_a_second_after_the_last_renewal_on`] a node of agent process 7, under rule
/// version `rules`.
fn preempted_on_an_agents_node(rules: u32) -> Harness {
    let mut h = world();
    h.ok(Command::ActivateVersion { version: rules });
    preempt_a_second_after_the_last_renewal_on(&mut h, 7);
    h
}

/// The node's agent heartbeats: job 10's waiting grace ends, job 20 takes its GPUs.
fn a_heartbeat_ends_the_grace(h: &mut Harness) {
    h.nodes_alive();
    assert_eq!(h.job(10).state, JobState::Queued);
    assert_eq!(h.job(20).state, JobState::Placed);
}

/// A registration of a known node by its own agent process (the incarnation it holds)
/// renews the node's lease as a heartbeat does, but did not end the preemptions waiting
/// for that renewal: the victim kept its GPUs, and the preemptor waited, until the next
/// heartbeat. From rule version 6 it ends them as a heartbeat does.
#[test]
fn an_agents_registration_ends_the_preemptions_waiting_for_the_node_from_rule_version_6() {
    for rules in [5, 6] {
        let mut h = preempted_on_an_agents_node(rules);
        let cfg = h.state.config.scheduler.clone();
        h.advance(cfg.grace_ms + 1);
        h.tick();
        assert_eq!(h.job(10).state, JobState::Preempting);
        // The node's agent process registers it again.
        register_node_1(&mut h, 7);
        let renewed = h.state.scheduler.nodes[&NodeId(1)].lease_until_ms;
        assert_eq!(renewed, h.now + cfg.node_lease_ms, "the lease is renewed");
        let (victim, preemptor) = if rules == 5 {
            (JobState::Preempting, JobState::Queued)
        } else {
            (JobState::Queued, JobState::Placed)
        };
        assert_eq!(
            (h.job(10).state, h.job(20).state),
            (victim, preemptor),
            "version {rules}"
        );
        // Under version 5 the next heartbeat ends it.
        a_heartbeat_ends_the_grace(&mut h);
    }
}

/// Found by review (thirteenth session): an operator's registration of a node
/// (`allotctl node register`, incarnation 0, e.g. to change its labels) renewed the
/// node's lease and noted a renewal. On a node whose agent is cut off, with a preemption
/// in its grace, that made the node look renewed: at the grace's end the victim was
/// requeued and its GPUs given to the preemptor while its runner still ran (until the
/// agent's fence). From rule version 6 such a registration of a node an agent process
/// has claimed changes its labels only.
#[test]
fn an_operators_registration_does_not_renew_a_silent_node_from_rule_version_6() {
    for rules in [5, 6] {
        let mut h = preempted_on_an_agents_node(rules);
        let cfg = h.state.config.scheduler.clone();
        let lease = h.state.scheduler.nodes[&NodeId(1)].lease_until_ms;
        // Mid-grace, the operator relabels the silent node.
        h.advance(cfg.grace_ms / 2);
        h.ok(Command::RegisterNode(NodeSpec {
            node: NodeId(1),
            gpu_type: a100(),
            gpu_count: 4,
            gpu_mem_gb: 80,
            labels: vec![("zone".into(), "b".into())],
            incarnation: 0,
        }));
        let n = &h.state.scheduler.nodes[&NodeId(1)];
        assert_eq!(n.labels, vec![("zone".to_string(), "b".to_string())]);
        h.advance(cfg.grace_ms);
        h.tick();
        if rules == 5 {
            assert!(h.state.scheduler.nodes[&NodeId(1)].lease_until_ms > lease);
            assert_eq!(
                h.job(10).state,
                JobState::Queued,
                "version 5: requeued, though the node's agent never heard of it"
            );
        } else {
            assert_eq!(h.state.scheduler.nodes[&NodeId(1)].lease_until_ms, lease);
            assert_eq!(h.job(10).state, JobState::Preempting);
            assert_eq!(h.job(20).state, JobState::Queued);
            // The agent comes back: its heartbeat ends the grace.
            a_heartbeat_ends_the_grace(&mut h);
        }
    }
}

/// Found by review (tenth session, 2026-11-27; fixed in the twelfth): rule version 4's
/// grace check rebuilt both instants it compares from the settings of the moment — the
/// preemption's start as the grace timer's end minus `grace_ms`, the node's last renewal
/// as its lease's end minus `node_lease_ms`. An operator lengthening the grace, or
/// shortening the node lease, while a node was silent with a preemption in its grace
/// made the node look renewed: the victim was requeued (and its GPUs given to the
/// preemptor) while its cut-off agent might still run it. From rule version 5 the
/// instants are kept as they happened (`scheduler::Fence`, state format 8).
#[test]
fn a_silent_nodes_preemption_waits_whatever_the_settings_become_meanwhile_from_rule_version_5() {
    for (rules, change) in [
        (4, "a longer grace"),
        (5, "a longer grace"),
        (4, "a shorter node lease"),
        (5, "a shorter node lease"),
    ] {
        // Leases as long as settings may make them (a day), so that nothing but the
        // preemption happens in the test's minutes.
        let mut config = Config::default();
        config.scheduler.node_lease_ms = 86_400_000;
        config.scheduler.job_lease_ms = 86_400_000;
        let mut h = Harness::world_with(config);
        h.grant(1, P, BucketKind::Paid, credits(100_000), None);
        h.ok(Command::ActivateVersion { version: rules });
        let renewed = preempt_a_second_after_the_last_renewal(&mut h);
        let fence = &h.state.scheduler.fence;
        if rules == 5 {
            assert_eq!(fence.renewed_ms[&NodeId(1)], renewed);
            assert_eq!(fence.preempted_ms[&(ORG, JobId(10))], renewed + 1_000);
        } else {
            assert!(fence.renewed_ms.is_empty() && fence.preempted_ms.is_empty());
        }
        // The operator retunes while the node is silent (each change is far more than
        // the second between the renewal and the preemption).
        let old = h.state.config.scheduler.clone();
        let mut s = old.settings();
        match change {
            "a longer grace" => s.grace_ms = old.grace_ms + 20_000,
            _ => s.node_lease_ms = old.node_lease_ms - 5_000,
        }
        h.ok(Command::ConfigureScheduler(s));
        // The grace timer set at the preemption ends; the node has not renewed.
        h.advance(old.grace_ms);
        h.tick();
        if rules == 4 {
            assert_eq!(
                h.job(10).state,
                JobState::Queued,
                "version 4, after {change}: the silent node looks renewed"
            );
            continue;
        }
        assert_eq!(
            h.job(10).state,
            JobState::Preempting,
            "after {change}: the silent node's victim keeps its GPUs"
        );
        assert_eq!(h.job(20).state, JobState::Queued, "after {change}");
        // The node renews: the victim is requeued and the preemptor placed.
        h.nodes_alive();
        assert_eq!(h.job(10).state, JobState::Queued, "after {change}");
        assert_eq!(h.job(20).state, JobState::Placed, "after {change}");
        assert!(h.state.scheduler.fence.preempted_ms.is_empty());
        assert_eq!(h.state.scheduler.fence.renewed_ms[&NodeId(1)], h.now);
    }
}

/// Rule version 5 activated while a preemption is in its grace: the activation fills
/// in each node's last renewal and the preemption's start from the leases and grace
/// timers (the invariants, checked after every entry, require them from version 5 on),
/// and the grace rule acts on them at once.
#[test]
fn activating_version_5_mid_grace_fills_in_the_fence_instants() {
    let mut h = world();
    h.ok(Command::ActivateVersion { version: 4 });
    let renewed = preempt_a_second_after_the_last_renewal(&mut h);
    let fence = h.state.scheduler.fence.clone();
    assert!(
        fence.renewed_ms.is_empty() && fence.preempted_ms.is_empty(),
        "version 4 keeps none"
    );
    h.advance(1_000);
    h.ok(Command::ActivateVersion { version: 5 });
    let fence = &h.state.scheduler.fence;
    assert_eq!(
        fence.renewed_ms.clone().into_iter().collect::<Vec<_>>(),
        vec![(NodeId(1), renewed)]
    );
    assert_eq!(
        fence.preempted_ms.clone().into_iter().collect::<Vec<_>>(),
        vec![((ORG, JobId(10)), renewed + 1_000)]
    );
    let grace = h.state.config.scheduler.grace_ms;
    h.advance(grace);
    h.tick();
    assert_eq!(
        h.job(10).state,
        JobState::Preempting,
        "the silent node's victim waits"
    );
}

/// Found by review (2026-11-26, left open until 2026-11-27): a placed job's meter ran
/// from its placement, so a placement its node's agent could not start at once (cut
/// off, restarting within its lease) billed the wait before the runner started, and an
/// attempt that ended before it ever started billed its whole placement. From rule
/// version 4 a job's bill starts with its attempt's first accepted heartbeat (the agent
/// sends one as its runner starts), and an attempt that never started bills nothing.
#[test]
fn billing_starts_with_the_runner_from_rule_version_4() {
    for rules in [3, 4] {
        let mut h = world();
        h.ok(Command::ActivateVersion { version: rules });
        h.fleet(&[(1, a100(), 8, 80)]);
        submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 2));
        submit(&mut h, Harness::job_spec(11, Tier::PAID, vec![a100()], 2));
        assert_eq!(h.job(10).state, JobState::Placed);
        // The node's agent starts job 10's runner an hour late.
        h.advance(HOUR_MS);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        assert_eq!(h.job(10).state, JobState::Running);
        let late = if rules == 4 { 0 } else { credits(4) };
        assert_eq!(
            h.hold(10).captured,
            late,
            "version {rules}: the hour before the runner started (2 GPUs × 2 credits)"
        );
        h.advance(HOUR_MS / 2);
        let Ok(Reply::JobFinished(Some(s))) = h.finish_job(10, true) else {
            panic!()
        };
        assert_eq!(
            s.captured_micro,
            late + credits(2),
            "version {rules}: the half hour it ran, plus the wait before version 4"
        );
        // Job 11 never started: cancelled 1.5 h after its placement.
        assert_eq!(h.job(11).state, JobState::Placed);
        let Ok(Reply::JobCancelled(Some(s))) =
            h.run_in(tenant(ORG), ORG, Command::CancelJob { job: JobId(11) })
        else {
            panic!()
        };
        let never_ran = if rules == 4 { 0 } else { credits(6) };
        assert_eq!(s.captured_micro, never_ran, "version {rules}");
    }
}

/// Found by review (2026-11-27): a job ended while its node's lease had run out —
/// cancelled by its user, or at its deadline — was billed to the moment it ended, though
/// its agent (cut off, the node silent) had stopped the runner by the lease's end (the
/// fence: §45). From rule version 4 such an ending bills at most to the end of the node's
/// lease; with the node renewing, it bills to now as before.
#[test]
fn an_ending_on_a_lapsed_node_bills_to_the_lease_from_rule_version_4() {
    for rules in [3, 4] {
        let mut h = world_default_leases();
        h.ok(Command::ActivateVersion { version: rules });
        h.fleet(&[(1, a100(), 8, 80)]);
        submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        assert_eq!(h.job(10).state, JobState::Running);
        let started = h.now;
        // The node renews once more, then goes silent; its lease ends at `lease_end`.
        h.advance(20_000);
        h.nodes_alive();
        h.job_heartbeat(10, 2, 0).unwrap();
        let lease_end = h.state.scheduler.nodes[&NodeId(1)].lease_until_ms;
        // Five seconds past the lease (within the fence margin: the job still holds its
        // GPUs), its user cancels it.
        h.now = lease_end + 5_000;
        h.tick();
        assert!(h.job(10).state.holds_gpus());
        let price = meter_price(&h, 10);
        let Ok(Reply::JobCancelled(Some(s))) =
            h.run_in(tenant(ORG), ORG, Command::CancelJob { job: JobId(10) })
        else {
            panic!()
        };
        let billed_to = if rules == 4 { lease_end } else { h.now };
        assert_eq!(
            s.captured_micro,
            ledger::cost_micro(billed_to - started, price, 1),
            "version {rules}"
        );
    }
}

fn exit(heartbeat_seq: u64, after_ms: u64) -> RunnerExit {
    RunnerExit {
        heartbeat_seq,
        after_ms,
    }
}

/// Job 10 running on node 1 under rule version `rules`, with two heartbeats 20 s apart:
/// the harness, the attempt's start and heartbeat 2's time.
fn running_with_two_heartbeats(rules: u32) -> (Harness, u64, u64) {
    let mut h = world_default_leases();
    h.ok(Command::ActivateVersion { version: rules });
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 1));
    h.nodes_alive();
    h.job_heartbeat(10, 1, 0).unwrap();
    let started = h.now;
    h.advance(20_000);
    h.nodes_alive();
    h.job_heartbeat(10, 2, 0).unwrap();
    let last_beat = h.now;
    (h, started, last_beat)
}

/// A runner that exits while its agent is cut off from the cluster (a partition
/// shorter than the node's lease, so the node never lapses) was billed until its
/// `FinishJob` got through. From rule version 6 the agent's report may say when the
/// runner exited — `after_ms` after the newest heartbeat it saw accepted — and the
/// ending bills to that heartbeat's logical time plus `after_ms`, never past now.
#[test]
fn a_finish_that_says_when_the_runner_exited_bills_to_the_exit_from_rule_version_6() {
    for rules in [5, 6] {
        let (mut h, started, last_beat) = running_with_two_heartbeats(rules);
        // The runner exits 3 s after heartbeat 2; the report lands 40 s later (the
        // node's lease, 60 s, has not run out).
        h.advance(43_000);
        let price = meter_price(&h, 10);
        let before_finish = (h.state.ledger.clone(), h.state.scheduler.clone());
        let outcome = h.finish_job_with(10, true, Some(exit(2, 3_000)));
        if rules == 5 {
            // A kind of command the shard does not know yet: refused, nothing changes;
            // the agent then reports with `FinishJob`, billed to its arrival.
            assert_eq!(
                outcome,
                Err(CommandError::UnsupportedRulesVersion {
                    active: 5,
                    newest: allot_statemachine::version::RULES_MAX,
                })
            );
            assert!((h.state.ledger.clone(), h.state.scheduler.clone()) == before_finish);
            let Ok(Reply::JobFinished(Some(s))) = h.finish_job(10, true) else {
                panic!()
            };
            assert_eq!(
                s.captured_micro,
                ledger::cost_micro(h.now - started, price, 1)
            );
        } else {
            let Ok(Reply::JobFinished(Some(s))) = outcome else {
                panic!("{outcome:?}")
            };
            assert_eq!(
                s.captured_micro,
                ledger::cost_micro(last_beat + 3_000 - started, price, 1)
            );
            assert_eq!(h.job(10).state, JobState::Succeeded);
        }
    }
}

/// The exit a report names bounds a bill from above only as far as the meter can vouch
/// for it: counted from the newest heartbeat the meter saw (a later heartbeat than the
/// report counts from, whose answer the agent missed, bills more, never less); a report
/// counting from a heartbeat the meter has not seen, or naming an exit after now, bills
/// to now; and a malformed one is refused with nothing changed.
#[test]
fn a_runner_exit_bounds_the_bill_only_from_a_heartbeat_the_meter_saw() {
    // (captured, billed to heartbeat 2's time + 4 s, billed to now)
    let run = |report: RunnerExit| {
        let (mut h, started, last_beat) = running_with_two_heartbeats(6);
        h.advance(10_000);
        let price = meter_price(&h, 10);
        let Ok(Reply::JobFinished(Some(s))) = h.finish_job_with(10, false, Some(report)) else {
            panic!()
        };
        let billed = |to: u64| ledger::cost_micro(to - started, price, 1);
        (s.captured_micro, billed(last_beat + 4_000), billed(h.now))
    };
    // Counted from heartbeat 2, the meter's newest: to its time plus 4 s.
    let (captured, to_exit, to_now) = run(exit(2, 4_000));
    assert_eq!(captured, to_exit);
    assert!(captured < to_now);
    // Counted from heartbeat 1, but the meter's newest is 2: from heartbeat 2's time.
    assert_eq!(run(exit(1, 4_000)).0, to_exit);
    // A heartbeat the meter never saw: to now.
    assert_eq!(run(exit(3, 4_000)).0, to_now);
    // An exit after now: to now.
    assert_eq!(run(exit(2, 60_000)).0, to_now);

    let (mut h, _, _) = running_with_two_heartbeats(6);
    let before = (h.state.ledger.clone(), h.state.scheduler.clone());
    for bad in [
        exit(0, 1_000),
        exit(1, allot_statemachine::version::JOB_DURATION_MS_MAX_V2 + 1),
    ] {
        assert_eq!(
            h.finish_job_with(10, true, Some(bad)),
            Err(CommandError::InvalidJob(JobProblem::RunnerExit))
        );
    }
    assert!((h.state.ledger.clone(), h.state.scheduler.clone()) == before);
    assert_eq!(h.job(10).state, JobState::Running);
}

/// Found by review (2026-11-27): a preempted job's attempt is billed back to its
/// checkpoint and its hold stays open for the next attempt; captures reversed from a
/// day already over went back to the hold, counted in today's usage, and the next
/// attempt spent them today without a budget check (spending held credit is not a
/// draw) — a hard daily budget could be overshot by them. From rule version 4 the part
/// of a reversal billed on an earlier day goes back to its buckets at once; the next
/// attempt draws it again, through the budget checks, if it needs it.
#[test]
fn a_reversal_from_a_past_day_returns_to_its_buckets_from_rule_version_4() {
    let project = |h: &Harness| {
        let p = &h.state.ledger.projects[&(ORG, PROJECT)].account;
        (p.usage.held, h.bucket(1).remaining)
    };
    let mut seen = Vec::new();
    for rules in [3, 4] {
        let mut h = world();
        h.ok(Command::ActivateVersion { version: rules });
        h.fleet(&[(1, a100(), 2, 80)]);
        // 23:50 of the first day.
        h.advance(23 * HOUR_MS + 50 * 60_000);
        submit(&mut h, Harness::job_spec(10, Tier::FREE, vec![a100()], 2));
        h.nodes_alive();
        h.job_heartbeat(10, 1, 1).unwrap();
        // Checkpoint at 23:55; billed at 23:59 (the first day) and at 00:02.
        h.advance(5 * 60_000);
        h.nodes_alive();
        h.job_heartbeat(10, 2, 2).unwrap();
        h.advance(4 * 60_000);
        h.nodes_alive();
        h.job_heartbeat(10, 3, 2).unwrap();
        h.advance(3 * 60_000);
        h.nodes_alive();
        h.job_heartbeat(10, 4, 2).unwrap();
        let price = meter_price(&h, 10);
        // An enterprise job takes the node; at the grace's end job 10 is requeued,
        // billed to its checkpoint: 23:55–00:02 is reversed, the captures made at 23:59
        // (the first day's) and at 00:02 (today's).
        // (Another project's: its hold draws on that project's buckets.)
        h.grant(
            2,
            Account::Project(PROJECT_B),
            BucketKind::Paid,
            credits(100_000),
            None,
        );
        let before = project(&h);
        let preemptor = JobSpec {
            project: PROJECT_B,
            ..Harness::job_spec(20, Tier::ENTERPRISE, vec![a100()], 2)
        };
        submit(&mut h, preemptor);
        assert_eq!(h.job(10).state, JobState::Preempting);
        let grace = h.state.config.scheduler.grace_ms;
        h.advance(grace + 1);
        h.nodes_alive();
        h.tick();
        assert_eq!(h.job(10).state, JobState::Queued);
        let after = project(&h);
        let past_day =
            ledger::cost_micro(9 * 60_000, price, 2) - ledger::cost_micro(5 * 60_000, price, 2);
        let today_part =
            ledger::cost_micro(12 * 60_000, price, 2) - ledger::cost_micro(9 * 60_000, price, 2);
        assert!(today_part > 0);
        seen.push((rules, before, after, past_day, today_part));
    }
    for (rules, (held_before, left_before), (held_after, left_after), past_day, today_part) in seen
    {
        let today = held_after as i128 - held_before as i128;
        let refunded = left_after as i128 - left_before as i128;
        // Held for the next attempt: the reversal (less what goes back), held as today's.
        let reversed = (past_day + today_part) as i128;
        if rules == 3 {
            assert_eq!(refunded, 0, "version 3: everything reversed stays held");
            assert_eq!(today, reversed, "version 3");
        } else {
            assert_eq!(
                refunded, past_day as i128,
                "version 4: the first day's part goes back to its bucket"
            );
            assert_eq!(today, reversed - past_day as i128, "version 4");
        }
    }
}

/// The price per GPU-hour job `job`'s running attempt is metered at.
fn meter_price(h: &Harness, job: u64) -> u64 {
    h.hold(job)
        .meter
        .as_ref()
        .expect("metered")
        .price_micro_per_gpu_hour
}

/// A job that waits in the queue while the promotional grant its hold drew from expires.
/// Under rule version 7 it then ran on that credit, for as long as it had waited; from
/// version 8 held credit stays valid past its bucket's expiry only for a job that runs:
/// at the job's first placement the expired part is forfeited and reserved again from
/// spendable credit, or, with none left, the job ends `Failed` (`OutOfCredits`) without
/// running. (`crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM`.)
#[test]
fn credit_that_expired_while_its_job_waited_is_forfeited_at_placement_from_rule_version_8() {
    const BLOCKER_PAID: u64 = 1;
    const PROMO: u64 = 2;
    const PAID: u64 = 3;
    for rules in [7, 8] {
        for paid in [credits(30), 0] {
            let mut h = world_without_credit();
            h.ok(Command::ActivateVersion { version: rules });
            h.fleet(&[(1, a100(), 8, 80)]);
            // Another project's job fills the node (its credit is its project's own).
            let b = Account::Project(PROJECT_B);
            h.grant(BLOCKER_PAID, b, BucketKind::Paid, credits(160), None);
            let mut blocker = Harness::job_spec(10, Tier::PAID, vec![a100()], 8);
            blocker.project = PROJECT_B;
            submit(&mut h, blocker);
            assert_eq!(h.job(10).state, JobState::Placed);
            // Job 20 (10 h on one A100: 20 credits) queues, held from the promotion,
            // which is spent first (it expires first).
            let expiry = h.now + HOUR_MS;
            h.grant(PROMO, P, BucketKind::Promotional, credits(20), Some(expiry));
            if paid > 0 {
                h.grant(PAID, P, BucketKind::Paid, paid, None);
            }
            submit(&mut h, Harness::job_spec(20, Tier::PAID, vec![a100()], 1));
            assert_eq!(h.job(20).state, JobState::Queued);
            assert_eq!(h.bucket(PROMO).held, credits(20));
            // The promotion expires while job 20 waits (the passes of these entries
            // consider it), then the blocker ends: job 20's turn.
            let mark = h.events.len();
            h.advance(2 * HOUR_MS);
            h.nodes_alive();
            h.job_heartbeat(10, 1, 0).unwrap();
            h.finish_job(10, true).unwrap();
            let moved: Vec<_> = h
                .movements_since(mark)
                .into_iter()
                .filter(|&(_, bucket, amount)| bucket != BLOCKER_PAID && amount > 0)
                .collect();
            let j = h.job(20);
            let seen = (j.state, j.last_reason);
            let case = format!("version {rules}, paid credit {paid}");
            if rules == 7 {
                // It runs on the expired promotion's credit.
                assert_eq!(seen, (JobState::Placed, Reason::Placed), "{case}");
                assert_eq!(moved, vec![], "{case}");
                assert_eq!(h.bucket(PROMO).held, credits(20), "{case}");
            } else if paid > 0 {
                // The expired part is forfeited; the hold draws as much again.
                assert_eq!(seen, (JobState::Placed, Reason::Placed), "{case}");
                assert_eq!(
                    moved,
                    vec![
                        ("forfeited", PROMO, credits(20)),
                        ("drawn", PAID, credits(20))
                    ],
                    "{case}"
                );
                let promo = h.bucket(PROMO);
                assert_eq!((promo.held, promo.expired), (0, credits(20)), "{case}");
                assert_eq!(h.bucket(PAID).held, credits(20), "{case}");
                assert_eq!(h.hold(20).held, credits(20), "{case}");
                // And it is billed from the paid credit.
                h.advance(HOUR_MS);
                h.job_heartbeat(20, 1, 0).unwrap();
                h.advance(HOUR_MS);
                h.job_heartbeat(20, 2, 0).unwrap();
                assert_eq!(h.bucket(PAID).consumed, credits(2), "{case}");
                assert_eq!(h.bucket(PROMO).consumed, 0, "{case}");
            } else {
                // Nothing can be reserved in its place: it ends without running.
                assert_eq!(seen, (JobState::Failed, Reason::OutOfCredits), "{case}");
                assert_eq!(moved, vec![("forfeited", PROMO, credits(20))], "{case}");
                assert_eq!(h.bucket(PROMO).expired, credits(20), "{case}");
                assert!(!h.hold(20).is_open(), "{case}");
                assert_eq!(h.hold(20).captured, 0, "{case}");
            }
        }
    }
}

/// Version 8 leaves the running job's held credit alone: a job placed before its
/// promotion expires runs on to its end on the credit held for it (SPEC: "held credits
/// stay valid for the running job even if their bucket expires mid-run").
#[test]
fn a_placed_job_keeps_its_held_credit_past_its_buckets_expiry_under_rule_version_8() {
    let mut h = world_without_credit();
    h.ok(Command::ActivateVersion { version: 8 });
    h.fleet(&[(1, a100(), 8, 80)]);
    let expiry = h.now + HOUR_MS + HOUR_MS / 2;
    h.grant(2, P, BucketKind::Promotional, credits(20), Some(expiry));
    h.grant(3, P, BucketKind::Paid, credits(100), None);
    submit(&mut h, Harness::job_spec(20, Tier::PAID, vec![a100()], 1));
    assert_eq!(h.job(20).state, JobState::Placed);
    h.advance(HOUR_MS);
    h.job_heartbeat(20, 1, 0).unwrap();
    h.advance(HOUR_MS);
    let mark = h.events.len();
    h.job_heartbeat(20, 2, 0).unwrap();
    // The promotion's unheld remainder (none) expires; the capture comes from it still.
    assert_eq!(
        h.movements_since(mark),
        vec![("expired", 2, 0), ("captured", 2, credits(2))]
    );
    assert_eq!(h.bucket(2).held, credits(18));
    assert_eq!(h.bucket(3).held, 0);
}
