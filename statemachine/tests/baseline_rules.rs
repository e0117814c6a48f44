//! The simulator's Slurm-like and Kueue-like baselines (DESIGN §24), one test per rule,
//! through `apply` only (the harness checks ledger and scheduler invariants after every
//! entry). Each rule's test fails if the baseline did not follow it.

use allot_statemachine::scheduler::{JobState, Policy, TierConfig, SLURM_WEIGHT_AGE};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);

/// A world on `policy` whose leases outlast the tests' time jumps and whose preemption
/// loss cap does not interfere (the shard's victim rules have their own tests); both
/// orgs funded.
fn world(policy: Policy) -> Harness {
    world_with(policy, |_| {})
}

fn world_with(policy: Policy, tune: impl FnOnce(&mut Config)) -> Harness {
    let mut config = Config::default();
    config.scheduler.policy = policy;
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    config.scheduler.preemption_loss_max_gpu_ms = u64::MAX;
    tune(&mut config);
    let mut h = Harness::world_with(config);
    h.grant(1, P, BucketKind::Paid, credits(100_000), None);
    h.grant(
        2,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(100_000),
        None,
    );
    h
}

fn submit(h: &mut Harness, spec: JobSpec) {
    let id = spec.job.0;
    match h.run(Command::SubmitJob(spec)) {
        Ok(Reply::JobSubmitted { .. }) => {}
        other => panic!("submit {id}: {other:?}"),
    }
}

/// A job of the fixture org (`USER`), A100 only.
fn job(id: u64, tier: Tier, gpus: u32) -> JobSpec {
    Harness::job_spec(id, tier, vec![a100()], gpus)
}

/// The same, by the fixture org's second user.
fn job_b(id: u64, tier: Tier, gpus: u32) -> JobSpec {
    JobSpec {
        user: USER_B,
        ..job(id, tier, gpus)
    }
}

/// A job of the other org.
fn other(id: u64, tier: Tier, gpus: u32) -> JobSpec {
    JobSpec {
        project: OTHER_PROJECT,
        user: OTHER_USER,
        ..job(id, tier, gpus)
    }
}

fn pinned(spec: JobSpec) -> JobSpec {
    JobSpec {
        preemptible: false,
        ..spec
    }
}

fn state(h: &Harness, id: u64) -> JobState {
    h.job(id).state
}

/// Lets the job run a minute (heartbeat: Running), then finishes it.
fn run_and_finish(h: &mut Harness, id: u64) {
    h.job_heartbeat(id, 1, 0).unwrap();
    h.finish_job(id, true).unwrap();
}

fn preempting(h: &Harness, ids: impl IntoIterator<Item = u64>) -> Vec<u64> {
    ids.into_iter()
        .filter(|j| state(h, *j) == JobState::Preempting)
        .collect()
}

// ------------------------------------------------------------------------ Slurm-like

fn priority(h: &Harness, id: u64) -> allot_statemachine::scheduler::SlurmPriority {
    let key = (h.job(id).org, JobId(id));
    let cfg = &h.state.config.scheduler;
    h.state
        .scheduler
        .slurm_priority(cfg, h.now, key)
        .expect("queued")
}

/// Age: of two jobs of one org and QOS whose users tie in Fair Tree (neither has used
/// anything), the one queued longer has the higher priority, by the age weight times the
/// share of PriorityMaxAge (the usage half-life) it waited, and starts first — even
/// though the newer one's user has the lower id.
#[test]
fn slurm_age_orders_jobs_of_one_org_and_qos() {
    let mut h = world(Policy::SlurmLike);
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, pinned(other(1, Tier::PAID, 1))); // holds the only GPU
    submit(&mut h, job_b(10, Tier::PAID, 1));
    let half_life = h.state.config.scheduler.usage_half_life_ms;
    h.advance(half_life / 2);
    submit(&mut h, job(11, Tier::PAID, 1));
    let (older, newer) = (priority(&h, 10), priority(&h, 11));
    assert_eq!(older.fairshare, newer.fairshare, "tied users share a rank");
    assert_eq!((older.age, newer.age), (SLURM_WEIGHT_AGE / 2, 0));
    assert_eq!(older.total - newer.total, SLURM_WEIGHT_AGE / 2);
    run_and_finish(&mut h, 1);
    assert_eq!(
        (state(&h, 10), state(&h, 11)),
        (JobState::Placed, JobState::Queued)
    );
}

/// Fair Tree: the org with less decayed usage ranks first (level fairshare = shares /
/// usage), whichever job is older. Usage decays with the half-life: heavy use ten
/// half-lives ago counts less than light use now.
#[test]
fn slurm_fair_tree_puts_the_org_with_less_decayed_usage_first() {
    struct Case {
        /// Org 1 ran a GPU for this long, this long ago.
        org1_ran_ms: u64,
        ago_ms: u64,
        expect_first: u64,
    }
    let cases = [
        // Org 1 used an hour just now, org 2 ten minutes: org 2 first.
        Case {
            org1_ran_ms: HOUR_MS,
            ago_ms: 0,
            expect_first: 20,
        },
        // Org 1 used four hours ten half-lives ago (≈ 14 GPU-seconds now), org 2 ten
        // minutes just now: org 1 first.
        Case {
            org1_ran_ms: 4 * HOUR_MS,
            ago_ms: 10 * HOUR_MS,
            expect_first: 10,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        let mut h = world(Policy::SlurmLike);
        h.fleet(&[(1, a100(), 1, 80)]);
        submit(&mut h, job(1, Tier::PAID, 1));
        h.advance(c.org1_ran_ms);
        h.nodes_alive();
        run_and_finish(&mut h, 1);
        h.advance(c.ago_ms);
        h.nodes_alive();
        // Org 2 runs ten minutes; meanwhile org 1's job, then org 2's, queue.
        submit(&mut h, other(2, Tier::PAID, 1));
        submit(&mut h, job(10, Tier::PAID, 1));
        submit(&mut h, other(20, Tier::PAID, 1));
        h.advance(10 * 60_000);
        h.nodes_alive();
        run_and_finish(&mut h, 2);
        let placed: Vec<u64> = [10, 20]
            .into_iter()
            .filter(|j| state(&h, *j) == JobState::Placed)
            .collect();
        assert_eq!(placed, vec![c.expect_first], "case {i}");
    }
}

/// QOS: a paid job outranks an older free job of the same user.
#[test]
fn slurm_higher_qos_outranks_an_older_job() {
    let mut h = world(Policy::SlurmLike);
    h.fleet(&[(1, a100(), 1, 80)]);
    submit(&mut h, pinned(other(1, Tier::PAID, 1)));
    submit(&mut h, job(10, Tier::FREE, 1));
    h.advance(30 * 60_000);
    submit(&mut h, job(11, Tier::PAID, 1));
    assert!(priority(&h, 11).total > priority(&h, 10).total);
    run_and_finish(&mut h, 1);
    assert_eq!(
        (state(&h, 10), state(&h, 11)),
        (JobState::Queued, JobState::Placed)
    );
}

/// EASY backfill: the top job that cannot start reserves the node where enough GPUs are
/// free earliest (by the running jobs' time limits); a later job may start there only if
/// its own time limit ends before the reservation does — so a 2-h job waits and a 30-min
/// job runs, and the top job starts when the reservation comes due.
#[test]
fn slurm_easy_backfill_protects_the_top_jobs_reservation() {
    let mut h = world(Policy::SlurmLike);
    h.fleet(&[(1, a100(), 8, 80)]);
    let limited = |spec: JobSpec, ms: u64| JobSpec {
        max_duration_ms: ms,
        ..spec
    };
    // Half the node, for at most an hour: the 8-GPU job's reservation is at +1 h.
    submit(&mut h, pinned(limited(other(1, Tier::PAID, 4), HOUR_MS)));
    submit(&mut h, job(10, Tier::PAID, 8));
    submit(&mut h, limited(job(11, Tier::FREE, 2), 2 * HOUR_MS));
    submit(&mut h, limited(job(12, Tier::FREE, 2), 30 * 60_000));
    assert_eq!(state(&h, 10), JobState::Queued, "does not fit yet");
    assert_eq!(
        state(&h, 11),
        JobState::Queued,
        "would delay the reservation"
    );
    assert_eq!(
        state(&h, 12),
        JobState::Placed,
        "ends before the reservation"
    );
    h.advance(HOUR_MS);
    h.nodes_alive();
    assert_eq!(
        state(&h, 10),
        JobState::Placed,
        "started at its reservation"
    );
    assert_eq!(state(&h, 11), JobState::Queued);
}

/// QOS preemption (preempt/qos, PreemptMode=REQUEUE): the top tier's QOS preempts the
/// lower ones; a paid job does not preempt a free one.
#[test]
fn slurm_only_the_top_qos_preempts() {
    let mut h = world(Policy::SlurmLike);
    h.fleet(&[(1, a100(), 2, 80)]);
    submit(&mut h, job(10, Tier::FREE, 2));
    h.advance(5 * 60_000);
    h.job_heartbeat(10, 1, 0).unwrap();
    submit(&mut h, other(20, Tier::PAID, 2));
    assert_eq!(state(&h, 10), JobState::Running, "paid does not preempt");
    submit(&mut h, other(30, Tier::ENTERPRISE, 2));
    assert_eq!(state(&h, 10), JobState::Preempting);
    h.advance(h.state.config.scheduler.grace_ms);
    h.nodes_alive();
    assert_eq!(
        (state(&h, 30), state(&h, 20)),
        (JobState::Placed, JobState::Queued)
    );
}

// ------------------------------------------------------------------------ Kueue-like

/// Tiers (weight, floor %, ceiling %) for free, paid, enterprise; on a 16-GPU fleet
/// (two 8-GPU A100 nodes) weights 1, 1, 2 give nominal quotas 4, 4 and 8.
fn kueue_world(tiers: [(u32, u32, u32); 3]) -> Harness {
    let mut h = world_with(Policy::KueueLike, |c| {
        for (t, (weight, floor_pct, ceiling_pct)) in c.scheduler.tiers.iter_mut().zip(tiers) {
            *t = TierConfig {
                weight,
                floor_pct,
                ceiling_pct,
                ..t.clone()
            };
        }
    });
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
    h
}

/// The GPUs tier `t`'s jobs hold.
fn held(h: &Harness, t: Tier) -> u32 {
    h.state.scheduler.tier_gpus.get(&t).copied().unwrap_or(0)
}

fn submit_n(h: &mut Harness, first: u64, n: u64, spec: impl Fn(u64) -> JobSpec) {
    for id in first..first + n {
        submit(h, spec(id));
    }
}

/// Quotas follow the tier config (DESIGN §24): nominal = capacity × weight / Σ weights
/// (the remainder to the top tier), borrowing limit = ceiling − nominal, lending limit
/// = nominal − floor.
#[test]
fn kueue_quotas_derive_from_the_tier_config() {
    let mut h = world(Policy::KueueLike); // weights 1, 3, 8; floors 5, 15, 30; ceilings 50, 90, 70
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80), (3, a100(), 8, 80)]);
    let cqs = h
        .state
        .scheduler
        .kueue_cluster_queues(&h.state.config.scheduler);
    let got: Vec<(u64, u64, u64)> = cqs
        .iter()
        .map(|q| (q.nominal, q.borrowing_limit, q.lending_limit))
        .collect();
    // 24 GPUs: nominal 2, 6, 16; ceilings 12, 21, 16; floors 1, 3, 7.
    assert_eq!(got, vec![(2, 10, 1), (6, 15, 3), (16, 0, 9)]);
    submit(&mut h, job(10, Tier::PAID, 4));
    let paid = &h
        .state
        .scheduler
        .kueue_cluster_queues(&h.state.config.scheduler)[1];
    assert_eq!((paid.tier, paid.usage), (Tier::PAID, 4));
}

/// A ClusterQueue within its nominal quota is admitted before one that would borrow
/// (fair sharing: its dominant resource share stays 0), though the borrower's job is
/// older.
#[test]
fn kueue_within_nominal_admits_before_a_borrower() {
    let mut h = kueue_world([(1, 0, 100), (1, 0, 100), (2, 0, 100)]);
    submit_n(&mut h, 1, 8, |j| pinned(other(j, Tier::ENTERPRISE, 1)));
    submit_n(&mut h, 10, 8, |j| pinned(job(j, Tier::FREE, 1))); // borrows 4
    submit(&mut h, pinned(job(30, Tier::FREE, 1))); // would borrow a fifth
    submit(&mut h, pinned(other(40, Tier::PAID, 1)));
    assert_eq!(
        (state(&h, 30), state(&h, 40)),
        (JobState::Queued, JobState::Queued)
    );
    // One GPU frees: the paid queue, within nominal, takes it.
    run_and_finish(&mut h, 10);
    assert_eq!(
        (state(&h, 30), state(&h, 40)),
        (JobState::Queued, JobState::Placed)
    );
}

/// Borrowing: a queue borrows unused quota up to its borrowing limit and not past it,
/// even with GPUs idle.
#[test]
fn kueue_borrows_up_to_the_borrowing_limit() {
    // Free: nominal 4, ceiling 50 % of 16 = 8, so it may borrow 4.
    let mut h = kueue_world([(1, 0, 50), (1, 0, 100), (2, 0, 100)]);
    submit_n(&mut h, 10, 10, |j| job(j, Tier::FREE, 1));
    assert_eq!(held(&h, Tier::FREE), 8);
    assert_eq!(
        (state(&h, 18), state(&h, 19)),
        (JobState::Queued, JobState::Queued)
    );
    assert_eq!(h.state.scheduler.used_gpus, 8, "8 GPUs idle");
}

/// Lending: a queue lends only its nominal quota above its floor; the rest stays
/// unused for it, even while another queue waits.
#[test]
fn kueue_lends_no_more_than_the_lending_limit() {
    // Free 4 nominal, may borrow anything; paid lends all its 4; enterprise lends 4 of
    // its 8 (floor 25 %). Free reaches 4 + 4 + 4 = 12.
    let mut h = kueue_world([(1, 0, 100), (1, 0, 100), (2, 25, 100)]);
    submit_n(&mut h, 10, 16, |j| job(j, Tier::FREE, 1));
    assert_eq!(held(&h, Tier::FREE), 12);
    assert_eq!(
        h.state.scheduler.used_gpus, 12,
        "enterprise's floor stays unlent"
    );
    // The guaranteed part is there at once for enterprise.
    submit_n(&mut h, 40, 4, |j| other(j, Tier::ENTERPRISE, 1));
    assert!((40..44).all(|j| state(&h, j) == JobState::Placed));
}

/// Reclaim within the cohort: a queue within its nominal quota preempts a borrower's
/// preemptible jobs, never a non-preemptible one, and only up to its nominal quota.
/// (A preemption reserves the victims' node for one waiting job, so the paid jobs come
/// in one grace period after another.)
#[test]
fn kueue_reclaims_from_borrowers_but_never_a_non_preemptible_job() {
    for all_pinned in [false, true] {
        let mut h = kueue_world([(1, 0, 100), (1, 0, 100), (2, 0, 100)]);
        // Free borrows everything: 8 non-preemptible jobs (node 1), then 8 preemptible
        // ones (node 2), or 16 non-preemptible.
        submit_n(&mut h, 10, 8, |j| pinned(job(j, Tier::FREE, 1)));
        submit_n(&mut h, 18, 8, |j| JobSpec {
            preemptible: !all_pinned,
            ..job(j, Tier::FREE, 1)
        });
        h.advance(5 * 60_000);
        for j in 10..26 {
            h.job_heartbeat(j, 1, 0).unwrap();
        }
        // Paid (nominal 4) wants 6: 4 within nominal may reclaim, 2 would borrow.
        submit_n(&mut h, 40, 6, |j| other(j, Tier::PAID, 1));
        assert_eq!(preempting(&h, 10..26).len(), usize::from(!all_pinned));
        for _ in 0..6 {
            h.advance(h.state.config.scheduler.grace_ms);
            h.nodes_alive();
        }
        let preempted: Vec<u64> = h
            .events
            .iter()
            .filter_map(|e| match e.body {
                EventBody::JobTransition {
                    job: JobId(j),
                    to: JobState::Preempting,
                    ..
                } => Some(j),
                _ => None,
            })
            .collect();
        if all_pinned {
            assert!(preempted.is_empty(), "{preempted:?}");
            assert_eq!(held(&h, Tier::PAID), 0);
        } else {
            assert_eq!(preempted.len(), 4, "{preempted:?}");
            assert!(
                preempted.iter().all(|j| (18..26).contains(j)),
                "{preempted:?}"
            );
            assert_eq!(held(&h, Tier::PAID), 4, "its nominal quota, no more");
        }
    }
}

/// Reclaim counts the preemptions under way as done (their victims gone, the jobs they
/// make room for placed): waiting jobs reclaim at once, each on its own node, but
/// together never past their queue's nominal quota — within one pass and across passes.
#[test]
fn kueue_reclaim_counts_preemptions_under_way() {
    // 24 GPUs, weights 1, 3, 20: nominal 1, 3, 20; free may borrow everything.
    let mut h = kueue_world([(1, 0, 100), (3, 0, 100), (20, 0, 100)]);
    h.fleet(&[(3, a100(), 8, 80)]);
    submit_n(&mut h, 10, 24, |j| job(j, Tier::FREE, 1));
    h.advance(5 * 60_000);
    for j in 10..34 {
        h.job_heartbeat(j, 1, 0).unwrap();
    }
    // Two in one entry (one pass), then one more per entry.
    let reqs = [40, 41]
        .map(|j| Request {
            actor: ADMIN,
            request_id: h.fresh_request_id(),
            org: Some(OTHER_ORG),
            command: Command::SubmitJob(other(j, Tier::PAID, 1)),
        })
        .to_vec();
    assert!(h.apply(reqs).iter().all(|o| o.is_ok()));
    assert_eq!(preempting(&h, 10..34).len(), 2, "both in one pass");
    submit(&mut h, other(42, Tier::PAID, 1));
    assert_eq!(preempting(&h, 10..34).len(), 3, "the third in the next");
    submit(&mut h, other(43, Tier::PAID, 1));
    assert_eq!(preempting(&h, 10..34).len(), 3, "nominal quota reached");
}

/// Reclaim takes victims from a queue only while it borrows: a 2-GPU job whose node
/// holds jobs of a queue that borrows by one GPU (the other jobs there non-preemptible)
/// preempts none; by two, it preempts two.
#[test]
fn kueue_reclaims_only_while_the_source_borrows() {
    // Nominal 4, 4, 8. Enterprise (pinned) fills node 1 and part of node 2, free the
    // rest of node 2: borrowing 3 and 1, or 2 and 2.
    for (enterprise, free, expect) in [(11, 5, 0), (10, 6, 2)] {
        let mut h = kueue_world([(1, 0, 100), (1, 0, 100), (2, 0, 100)]);
        submit_n(&mut h, 1, enterprise, |j| {
            pinned(other(j, Tier::ENTERPRISE, 1))
        });
        submit_n(&mut h, 20, free, |j| job(j, Tier::FREE, 1));
        h.advance(5 * 60_000);
        for j in 20..20 + free {
            h.job_heartbeat(j, 1, 0).unwrap();
        }
        submit(&mut h, other(40, Tier::PAID, 2));
        assert_eq!(
            preempting(&h, 20..20 + free).len(),
            expect,
            "free borrows {}",
            free - 4
        );
    }
}

/// Within a ClusterQueue, a higher-priority (non-preemptible) job preempts a
/// lower-priority (preemptible) job of its own queue to fit within nominal; a job of
/// the same priority does not.
#[test]
fn kueue_preempts_lower_priority_within_a_cluster_queue() {
    // Paid: nominal 4, ceiling 25 % = 4 (no borrowing).
    let mut h = kueue_world([(1, 0, 100), (1, 0, 25), (2, 0, 100)]);
    submit_n(&mut h, 10, 4, |j| job(j, Tier::PAID, 1));
    h.advance(5 * 60_000);
    for j in 10..14 {
        h.job_heartbeat(j, 1, 0).unwrap();
    }
    submit(&mut h, job(20, Tier::PAID, 1));
    assert!(preempting(&h, 10..14).is_empty(), "same priority: it waits");
    submit(&mut h, pinned(job(21, Tier::PAID, 1)));
    assert_eq!(preempting(&h, 10..14).len(), 1);
    h.advance(h.state.config.scheduler.grace_ms);
    h.nodes_alive();
    assert_eq!(
        (state(&h, 21), state(&h, 20)),
        (JobState::Placed, JobState::Queued)
    );
    assert_eq!(held(&h, Tier::PAID), 4);
}

// -------------------------------------------------------------------- both baselines

/// splitmix64, for a reproducible mixed workload.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A mixed workload (three tiers, both orgs, 1–8 GPUs on two types, preemptible or
/// not, checkpoints, finishes, a drained node, time passing) on `policy`; the harness
/// checks every invariant after every entry.
fn mixed(policy: Policy, seed: u64) -> Harness {
    let mut h = world(policy);
    h.fleet(&[
        (1, a100(), 8, 80),
        (2, a100(), 4, 80),
        (3, h100(), 8, 80),
        (4, h100(), 2, 80),
    ]);
    let mut rng = Rng(seed);
    let mut seq = 0;
    for id in 1..=160u64 {
        let tier = Tier(rng.below(3) as u8);
        let gpus = [1, 1, 2, 4, 8][rng.below(5) as usize];
        let types = match rng.below(3) {
            0 => vec![a100()],
            1 => vec![h100(), a100()],
            _ => vec![a100(), h100()],
        };
        let base = Harness::job_spec(id, tier, types, gpus);
        let spec = JobSpec {
            preemptible: rng.below(5) > 0,
            max_duration_ms: (5 + rng.below(120)) * 60_000,
            ..if rng.below(2) == 0 {
                base
            } else {
                JobSpec {
                    project: OTHER_PROJECT,
                    user: OTHER_USER,
                    ..base
                }
            }
        };
        submit(&mut h, spec);
        h.advance(rng.below(90_000));
        h.nodes_alive();
        if id == 80 {
            h.ok(Command::SetNodeDraining {
                node: NodeId(1),
                draining: true,
            });
        }
        let placed: Vec<u64> = h
            .state
            .scheduler
            .jobs
            .sorted()
            .into_iter()
            .filter(|(_, j)| j.state.holds_gpus())
            .map(|(k, _)| k.1 .0)
            .collect();
        for j in placed {
            seq += 1;
            let _ = h.job_heartbeat(j, seq, rng.below(2));
            if rng.below(6) == 0 {
                let _ = h.finish_job(j, true);
            }
        }
    }
    h
}

/// Determinism: on mixed workloads, a replica fed the same entries (restored from a
/// snapshot half-way) reaches the same state hash, for both baselines (the harness
/// checked every invariant after every entry); and the two baselines decide differently
/// on the same workload.
#[test]
fn baselines_are_deterministic() {
    for seed in 1..=6 {
        let mut hashes = Vec::new();
        for policy in [Policy::SlurmLike, Policy::KueueLike] {
            let h = mixed(policy, seed);
            let cut = h.entries.len() / 2;
            let mut replica = State::new(h.state.config.clone());
            for e in &h.entries[..cut] {
                apply(&mut replica, e).unwrap();
            }
            let mut restored = State::decode(&replica.encode()).unwrap();
            for e in &h.entries[cut..] {
                apply(&mut restored, e).unwrap();
            }
            assert_eq!(
                restored.state_hash(),
                h.state.state_hash(),
                "{policy:?}, seed {seed}"
            );
            hashes.push((h.state.state_hash(), preemptions(&h)));
        }
        assert_ne!(hashes[0].0, hashes[1].0, "seed {seed}");
        assert!(
            hashes.iter().all(|(_, p)| *p > 0),
            "seed {seed}: both reach preemption: {hashes:?}"
        );
    }
}

fn preemptions(h: &Harness) -> usize {
    h.events
        .iter()
        .filter(|e| {
            matches!(
                e.body,
                EventBody::JobTransition {
                    to: JobState::Preempting,
                    ..
                }
            )
        })
        .count()
}
