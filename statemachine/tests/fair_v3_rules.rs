//! The fair policy's rules of rule version 3 (`crate::version`, DESIGN §21–§24), one
//! test each, through `apply` only (the harness checks every invariant after every
//! entry). Each test runs the same log under version 1 and under version 3 and shows
//! the new decision under 3 and the old one under 1.

use allot_statemachine::scheduler::JobState;
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const MINUTE_MS: u64 = 60_000;

/// The standard world with leases that outlast the tests' time jumps and no preemption
/// loss cap (it has its own test), both orgs funded, under rule version `rules`.
fn world(rules: u32, reserved_nodes_max: u32) -> Harness {
    let mut config = Config::default();
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    config.scheduler.preemption_loss_max_gpu_ms = u64::MAX;
    config.scheduler.reserved_nodes_max = reserved_nodes_max;
    let mut h = Harness::world_with(config);
    h.grant(
        1,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    h.grant(
        2,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    if rules > 1 {
        h.ok(Command::ActivateVersion { version: rules });
    }
    h
}

fn submit(h: &mut Harness, spec: JobSpec) {
    let id = spec.job.0;
    match h.run(Command::SubmitJob(spec)) {
        Ok(Reply::JobSubmitted { .. }) => {}
        other => panic!("submit {id}: {other:?}"),
    }
}

/// A job of `gpus` A100s in `tier`, of org 1 (or of org 2 if `other`).
fn job(id: u64, tier: Tier, gpus: u32, other: bool) -> JobSpec {
    let mut s = Harness::job_spec(id, tier, vec![a100()], gpus);
    if other {
        s.project = OTHER_PROJECT;
        s.user = OTHER_USER;
    }
    s
}

/// An enterprise job nobody may preempt.
fn pinned(id: u64, gpus: u32) -> JobSpec {
    let mut s = job(id, Tier::ENTERPRISE, gpus, false);
    s.preemptible = false;
    s
}

fn node_of(h: &Harness, job: u64) -> Option<u64> {
    h.job(job).placement.as_ref().map(|p| p.node.0)
}

fn reserved(h: &Harness, job: u64) -> Option<u64> {
    h.job(job).reserved_node.map(|n| n.0)
}

/// The job's agent reports `progress_ppm` of its work done.
fn progress(h: &mut Harness, id: u64, seq: u64, progress_ppm: u32) {
    let j = h.job(id);
    let (node, org, attempt) = (j.placement.as_ref().unwrap().node, j.org, j.attempt);
    let hb = JobHeartbeat {
        job: JobId(id),
        attempt,
        seq,
        progress_ppm,
        checkpoint: 0,
    };
    h.run_in(Actor::Agent(node), org, Command::JobHeartbeat(hb))
        .unwrap();
}

fn paid_max_wait(h: &Harness) -> u64 {
    h.state.config.scheduler.tiers[Tier::PAID.0 as usize].max_wait_ms
}

/// Rule (b): the node reserved for a blocked gang job is the one where its GPUs are
/// free soonest by the running jobs' estimated ends (progress from their agents), not
/// the one with the most free GPUs now; so the node about to free is kept for it, and it
/// starts when that node's job ends.
#[test]
fn the_reserved_node_is_the_one_that_frees_soonest() {
    for rules in [1, 3] {
        let mut h = world(rules, 4);
        h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
        submit(&mut h, job(10, Tier::PAID, 6, false));
        submit(&mut h, job(11, Tier::PAID, 4, false));
        assert_eq!((node_of(&h, 10), node_of(&h, 11)), (Some(1), Some(2)));
        h.advance(9 * MINUTE_MS);
        h.nodes_alive();
        progress(&mut h, 10, 1, 900_000); // about a minute left
        progress(&mut h, 11, 1, 100_000); // about 81 minutes left
        submit(&mut h, job(20, Tier::PAID, 8, false)); // fits nowhere
        if rules >= 3 {
            assert_eq!(reserved(&h, 20), None, "v3: not aged yet");
            let wait = paid_max_wait(&h);
            h.advance(wait);
            h.nodes_alive();
        }
        let expect = if rules >= 3 { 1 } else { 2 };
        assert_eq!(
            reserved(&h, 20),
            Some(expect),
            "v{rules}: v1 takes the node with the most free GPUs (2: 4 free), v3 the one \
             whose job ends first (1: 2 free, its 6-GPU job nearly done)"
        );
        // A 2-GPU job arriving now may not use the reserved node.
        submit(&mut h, job(30, Tier::PAID, 2, false));
        assert_eq!(node_of(&h, 30), Some(3 - expect));
        // Job 10 ends: under v3 node 1 is whole again and the gang job starts there;
        // under v1 job 30 took two of its GPUs and node 2 runs job 11 for an hour more.
        h.advance(MINUTE_MS);
        h.nodes_alive();
        h.finish_job(10, true).unwrap();
        assert_eq!(
            h.job(20).state == JobState::Placed,
            rules >= 3,
            "v{rules}: the gang job starts when the job nearest its end finishes"
        );
        if rules >= 3 {
            assert_eq!(node_of(&h, 20), Some(1));
        }
    }
}

/// Rule (a): only a gang job that waited past its tier's max wait reserves, and an org
/// holds one such reservation at a time (its oldest job's); under v1 every blocked gang
/// job reserved at once.
#[test]
fn only_aged_gang_jobs_reserve_one_per_org() {
    for rules in [1, 3] {
        let mut h = world(rules, 4);
        h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
        submit(&mut h, pinned(1, 8));
        submit(&mut h, pinned(2, 8));
        submit(&mut h, job(20, Tier::PAID, 8, false));
        h.advance(MINUTE_MS);
        submit(&mut h, job(21, Tier::PAID, 8, false));
        let fresh = (reserved(&h, 20), reserved(&h, 21));
        let wait = paid_max_wait(&h);
        h.advance(wait);
        h.nodes_alive();
        let aged = (reserved(&h, 20), reserved(&h, 21));
        if rules >= 3 {
            assert_eq!(
                fresh,
                (None, None),
                "v3: nothing reserved before the max wait"
            );
            assert_eq!(aged, (Some(1), None), "v3: the org's oldest gang job only");
        } else {
            assert_eq!(fresh, (Some(1), Some(2)), "v1: every blocked gang job");
            assert_eq!(aged, fresh);
        }
    }
}

/// Rule (a): within a tier, the reservation budget goes to aged gang jobs in fair-share
/// order (the org that used less first), not to the first one blocked.
#[test]
fn aged_gang_reservations_follow_fair_share_within_a_tier() {
    for rules in [1, 3] {
        let mut h = world(rules, 1);
        h.fleet(&[(1, a100(), 8, 80), (2, a100(), 1, 80)]);
        submit(&mut h, job(5, Tier::PAID, 1, false)); // org 1 runs a GPU: it used more
        assert_eq!(node_of(&h, 5), Some(2));
        submit(&mut h, pinned(6, 8));
        submit(&mut h, job(20, Tier::PAID, 8, false)); // org 1, first
        h.advance(MINUTE_MS);
        submit(&mut h, job(21, Tier::PAID, 8, true)); // org 2, a minute later
        let wait = paid_max_wait(&h);
        h.advance(wait + MINUTE_MS);
        h.nodes_alive();
        let got = (reserved(&h, 20), reserved(&h, 21));
        if rules >= 3 {
            assert_eq!(got, (None, Some(1)), "v3: org 2, which used less");
        } else {
            assert_eq!(got, (Some(1), None), "v1: the first job blocked");
        }
    }
}

/// Rule (a): across tiers, the reservation goes to the job whose wait passed its tier's
/// max wait longest ago (a free job 10 minutes overdue before a paid one 5 minutes
/// overdue), where v1 went by the pass's tier order (the paid tier below its floor).
#[test]
fn aged_gang_reservations_go_to_the_most_overdue_tier_first() {
    for rules in [1, 3] {
        let mut h = world(rules, 1);
        h.fleet(&[(1, a100(), 8, 80), (2, a100(), 1, 80)]);
        // The free tier holds a GPU (so v1's aging lane does not serve it first).
        submit(&mut h, job(5, Tier::FREE, 1, false));
        submit(&mut h, pinned(6, 8));
        let t0 = h.now;
        submit(&mut h, job(30, Tier::PAID, 8, true)); // org 2: holds the budget
        h.advance(MINUTE_MS);
        submit(&mut h, job(20, Tier::FREE, 8, false)); // org 1, due at t0 + 31 min
        h.now = t0 + 12 * MINUTE_MS;
        h.nodes_alive();
        assert_eq!(reserved(&h, 30), Some(1));
        h.now = t0 + 25 * MINUTE_MS;
        submit(&mut h, job(21, Tier::PAID, 8, true)); // org 2, due at t0 + 35 min
        h.now = t0 + 40 * MINUTE_MS;
        h.nodes_alive();
        h.ok(Command::CancelJob { job: JobId(30) });
        let got = (reserved(&h, 20), reserved(&h, 21));
        if rules >= 3 {
            assert_eq!(got, (Some(1), None), "v3: the free job, overdue longer");
        } else {
            assert_eq!(got, (None, Some(1)), "v1: the paid tier, below its floor");
        }
    }
}

/// Rule (c): only the top tier preempts a job that would lose work; a lower tier takes
/// only checkpointable victims. Strict priority, under v3 too, is unchanged.
#[test]
fn only_the_top_tier_preempts_a_job_that_would_lose_work() {
    struct Case {
        rules: u32,
        policy: scheduler::Policy,
        by: Tier,
        checkpointable: bool,
        preempted: bool,
    }
    use scheduler::Policy::{Fair, StrictPriority};
    let cases = [
        (1, Fair, Tier::PAID, false, true),
        (3, Fair, Tier::PAID, false, false),
        (3, Fair, Tier::PAID, true, true),
        (3, Fair, Tier::ENTERPRISE, false, true),
        (3, StrictPriority, Tier::PAID, false, true),
    ]
    .map(|(rules, policy, by, checkpointable, preempted)| Case {
        rules,
        policy,
        by,
        checkpointable,
        preempted,
    });
    for (i, c) in cases.iter().enumerate() {
        let mut h = world(c.rules, 4);
        h.state.config.scheduler.policy = c.policy;
        h.fleet(&[(1, a100(), 2, 80)]);
        let mut victim = job(10, Tier::FREE, 2, false);
        victim.checkpointable = c.checkpointable;
        submit(&mut h, victim);
        h.advance(5 * MINUTE_MS);
        h.nodes_alive();
        h.job_heartbeat(10, 1, 0).unwrap();
        submit(&mut h, job(20, c.by, 2, true));
        assert_eq!(
            h.job(10).state == JobState::Preempting,
            c.preempted,
            "case {i}: v{} {:?} by {:?}, checkpointable {}",
            c.rules,
            c.policy,
            c.by,
            c.checkpointable
        );
    }
}

/// Rule version 8 on the aged gang path: a gang job placed on its reserved node (before
/// the fair order's candidates, `serve_aged_gangs`) in the very entry its hold's
/// promotional credit expired does not run on that credit: it is forfeited and reserved
/// again from the paid grant (`crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM`).
/// Under version 7 the job ran on the expired credit. The harness's invariants check
/// every first placement under version 8 (`scheduler::check`).
#[test]
fn an_aged_gang_job_placed_on_its_reservation_does_not_run_on_expired_credit_from_rule_version_8() {
    const PROMO: u64 = 3;
    for rules in [7, 8] {
        let mut h = world(rules, 4);
        h.fleet(&[(1, a100(), 8, 80)]);
        submit(&mut h, job(10, Tier::PAID, 6, false));
        let wait = paid_max_wait(&h);
        let expiry = h.now + wait + 2 * MINUTE_MS;
        let p = Account::Project(PROJECT);
        h.grant(
            PROMO,
            p,
            BucketKind::Promotional,
            credits(160),
            Some(expiry),
        );
        submit(&mut h, job(20, Tier::PAID, 8, false)); // 10 h × 8 A100s: 160 credits
        assert_eq!(h.bucket(PROMO).held, credits(160));
        h.advance(wait + MINUTE_MS);
        h.nodes_alive();
        assert_eq!(
            reserved(&h, 20),
            Some(1),
            "v{rules}: aged, it reserves node 1"
        );
        // The first entry past the expiry is job 10's end: the aged gang job takes its
        // reserved node in that entry's pass.
        h.advance(MINUTE_MS);
        h.finish_job(10, true).unwrap();
        assert_eq!(node_of(&h, 20), Some(1), "v{rules}");
        let held = (h.bucket(PROMO).held, h.bucket(1).held);
        let want = if rules >= 8 {
            (0, credits(160))
        } else {
            (credits(160), 0)
        };
        assert_eq!(held, want, "v{rules}: (promo held, paid held)");
    }
}
