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
    let mut config = Config::default();
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    config.scheduler.preemption_loss_max_gpu_ms = u64::MAX;
    let mut h = Harness::world_with(config);
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h
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
    h.fleet(&[(1, a100(), 8, 40), (2, a100(), 2, 80), (3, a100(), 2, 80)]);
    let mut big_mem = Harness::job_spec(10, Tier::PAID, vec![a100()], 2);
    big_mem.mem_floor_gb = 80;
    submit(&mut h, big_mem);
    assert_eq!(node_of(&h, 10), Some(2), "node 1 has too little memory");
    let mut gang = Harness::job_spec(11, Tier::PAID, vec![a100()], 4);
    gang.mem_floor_gb = 80;
    submit(&mut h, gang);
    // 2 free on node 3 and 0 on node 2: 4 GPUs with 80 GB exist only split: stays queued.
    assert_eq!(h.job(11).state, JobState::Queued);
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
    // The late finish is refused: no double refund.
    let late = h.run_as(
        Actor::Agent(NodeId(1)),
        Command::FinishJob {
            job: JobId(10),
            attempt: 1,
            success: true,
        },
    );
    assert_eq!(late, Err(CommandError::UnknownJob));
}

#[test]
fn node_lease_expiry_fails_its_jobs_as_platform_faults() {
    let mut h = world_default_leases();
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(&mut h, Harness::job_spec(10, Tier::PAID, vec![a100()], 4));
    h.advance(30_000);
    h.job_heartbeat(10, 1, 1).unwrap(); // checkpoint at 30 s
    h.advance(25_000);
    h.job_heartbeat(10, 2, 1).unwrap();
    h.advance(10 * 60_000);
    h.tick();
    assert_eq!(
        h.state.scheduler.node(NodeId(1)).unwrap().state,
        NodeState::Down
    );
    assert_eq!(
        (h.job(10).state, h.job(10).last_reason),
        (JobState::Failed, Reason::NodeDown)
    );
    // Billed only to the checkpoint (30 s of 4 A100s), the rest refunded.
    assert_eq!(
        h.hold(10).captured,
        ledger::cost_micro(30_000, A100_PRICE, 4)
    );
    assert_eq!(h.state.scheduler.fleet_gpus, 0);
    // The node comes back empty and takes work again.
    h.nodes_alive();
    assert_eq!(
        h.state.scheduler.node(NodeId(1)).unwrap().state,
        NodeState::Ready
    );
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
    // The old attempt's agent is fenced off: the job is no longer placed on its node.
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
        Err(CommandError::UnknownJob)
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
        (spec(|s| s.user = OTHER_USER), CommandError::WrongOrg),
        (
            Command::RegisterNode(NodeSpec {
                node: NodeId(1),
                gpu_type: a100(),
                gpu_count: 4,
                gpu_mem_gb: 80,
                labels: vec![],
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
        .any(|(j, a, _, _)| *j == JobId(10) && *a == 1));
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
