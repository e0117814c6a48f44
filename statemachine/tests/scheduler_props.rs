//! Property tests of the scheduler: random submit / heartbeat / finish / cancel /
//! drain / node-failure / time sequences. After every entry the harness checks the
//! ledger's and the scheduler's invariants (no GPU allocated twice, no job on two nodes,
//! every job holding GPUs has an open metered hold at its attempt, counters and indexes
//! match); here we add determinism and coverage. Every property runs under rule version 1
//! and under version 3 (whose fair policy reserves nodes for aged gang jobs by the
//! progress agents report, `fair_v3_rules.rs`).

use allot_statemachine::scheduler::JobState;
use allot_statemachine::testkit::*;
use allot_statemachine::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Submit {
        tier: u8,
        h100_first: bool,
        both: bool,
        gpus: u32,
        mem_floor: bool,
        preemptible: bool,
        short: bool,
        /// Under version 3, one of three dedup keys (DESIGN §53): the job attaches to an
        /// in-flight job with the same key, or runs and owns it.
        dedup: Option<u8>,
    },
    Heartbeat {
        pick: usize,
        checkpoint: bool,
        /// Progress reported, in parts per million (version 3 estimates ends from it).
        progress_ppm: u32,
    },
    /// Every placed job's agent reports.
    HeartbeatAll,
    Finish {
        pick: usize,
        success: bool,
    },
    Cancel {
        pick: usize,
    },
    Drain {
        node: u64,
        draining: bool,
    },
    NodesAlive,
    /// Time passes in steps of at most 30 s; `alive`: the node agents keep heartbeating.
    Advance {
        ms: u64,
        alive: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u8, any::<bool>(), any::<bool>(), prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], prop::bool::weighted(0.2), prop::bool::weighted(0.8), any::<bool>(), prop::option::weighted(0.3, 0..3u8))
            .prop_map(|(tier, h100_first, both, gpus, mem_floor, preemptible, short, dedup)| Op::Submit { tier, h100_first, both, gpus, mem_floor, preemptible, short, dedup }),
        6 => (any::<usize>(), prop::bool::weighted(0.3), prop_oneof![Just(0u32), 1u32..=1_000_000]).prop_map(|(pick, checkpoint, progress_ppm)| Op::Heartbeat { pick, checkpoint, progress_ppm }),
        3 => Just(Op::HeartbeatAll),
        2 => (any::<usize>(), prop::bool::weighted(0.8)).prop_map(|(pick, success)| Op::Finish { pick, success }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (1..=4u64, any::<bool>()).prop_map(|(node, draining)| Op::Drain { node, draining }),
        3 => Just(Op::NodesAlive),
        4 => (prop_oneof![1_000u64..=40_000, 40_000u64..=900_000], prop::bool::weighted(0.9)).prop_map(|(ms, alive)| Op::Advance { ms, alive }),
    ]
}

fn placed(h: &Harness) -> Vec<u64> {
    h.state
        .scheduler
        .jobs
        .sorted()
        .into_iter()
        .filter(|(_, j)| j.state.holds_gpus())
        .map(|(id, _)| id.1 .0)
        .collect()
}

/// One requeue after a node failure, so both the requeue and the final platform failure
/// are reached; tiers' max waits of two minutes, so that jobs age within a sequence (the
/// aging lane, and version 3's reservations for aged gang jobs, are reached).
fn props_config() -> Config {
    let mut config = Config::default();
    config.scheduler.node_failure_requeues_max = 1;
    for t in &mut config.scheduler.tiers {
        t.max_wait_ms = 2 * 60_000;
    }
    config
}

/// The ops applied after the standard world's set-up, under rule version `rules`
/// (activated first when it is not the baseline).
fn run(ops: &[Op], rules: u32) -> Harness {
    run_counting(ops, rules, &mut 0)
}

/// [`run`], counting the ops after which a queued job holds a node reserved without a
/// preemption under way for it (an anti-fragmentation reservation).
fn run_counting(ops: &[Op], rules: u32, reservations: &mut usize) -> Harness {
    let mut h = Harness::world_with(props_config());
    if rules > 1 {
        h.ok(Command::ActivateVersion { version: rules });
    }
    h.grant(1, Account::Org(ORG), BucketKind::Paid, credits(2_000), None);
    h.grant(
        2,
        Account::Project(PROJECT),
        BucketKind::Promotional,
        credits(100),
        Some(h.now + 3 * HOUR_MS),
    );
    h.fleet(&[
        (1, a100(), 8, 80),
        (2, a100(), 4, 40),
        (3, h100(), 8, 80),
        (4, h100(), 2, 80),
    ]);
    let mut next_job = 0;
    let mut seqs: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    let mut cps: BTreeMap<u64, u64> = BTreeMap::new();
    for op in ops {
        match *op {
            Op::Submit {
                tier,
                h100_first,
                both,
                gpus,
                mem_floor,
                preemptible,
                short,
                dedup,
            } => {
                next_job += 1;
                let types = match (h100_first, both) {
                    (true, true) => vec![h100(), a100()],
                    (false, true) => vec![a100(), h100()],
                    (true, false) => vec![h100()],
                    (false, false) => vec![a100()],
                };
                let mut spec = Harness::job_spec(next_job, Tier(tier), types, gpus);
                // Two projects and two users, crossed: the pass's fair-share descent
                // below the org (and its per-pass ranking) has choices to make.
                spec.project = [PROJECT, PROJECT_B][next_job as usize % 2];
                spec.user = [USER, USER_B][next_job as usize / 2 % 2];
                spec.preemptible = preemptible;
                spec.mem_floor_gb = if mem_floor { 80 } else { 0 };
                spec.max_duration_ms = if short { 3 * 60_000 } else { 2 * HOUR_MS };
                let command = match dedup {
                    Some(k) if rules >= 3 => Command::SubmitJobDedup {
                        spec,
                        key: DedupKey(vec![b'k', k]),
                    },
                    _ => Command::SubmitJob(spec),
                };
                h.run(command).ok();
            }
            Op::Heartbeat {
                pick,
                checkpoint,
                progress_ppm,
            } => {
                let jobs = placed(&h);
                if jobs.is_empty() {
                    continue;
                }
                let job = jobs[pick % jobs.len()];
                let attempt = h.job(job).attempt;
                let seq = seqs.entry((job, attempt)).or_default();
                *seq += 1;
                let cp = cps.entry(job).or_default();
                *cp += checkpoint as u64;
                let (seq, cp) = (*seq, *cp);
                let j = h.job(job);
                let (node, org) = (j.placement.as_ref().map_or(NodeId(0), |p| p.node), j.org);
                let hb = JobHeartbeat {
                    job: JobId(job),
                    attempt,
                    seq,
                    progress_ppm,
                    checkpoint: cp,
                };
                h.run_in(Actor::Agent(node), org, Command::JobHeartbeat(hb))
                    .ok();
            }
            Op::HeartbeatAll => {
                for job in placed(&h) {
                    let attempt = h.job(job).attempt;
                    let seq = seqs.entry((job, attempt)).or_default();
                    *seq += 1;
                    let (seq, cp) = (*seq, cps.get(&job).copied().unwrap_or(0));
                    h.job_heartbeat(job, seq, cp).ok();
                }
            }
            Op::Finish { pick, success } => {
                let jobs = placed(&h);
                if !jobs.is_empty() {
                    h.finish_job(jobs[pick % jobs.len()], success).ok();
                }
            }
            Op::Cancel { pick } => {
                if next_job > 0 {
                    h.run(Command::CancelJob {
                        job: JobId(1 + pick as u64 % next_job),
                    })
                    .ok();
                }
            }
            Op::Drain { node, draining } => {
                h.run(Command::SetNodeDraining {
                    node: NodeId(node),
                    draining,
                })
                .ok();
            }
            Op::NodesAlive => h.nodes_alive(),
            Op::Advance { ms, alive } => {
                let mut left = ms;
                while left > 0 {
                    let step = left.min(30_000);
                    h.advance(step);
                    left -= step;
                    if alive {
                        h.nodes_alive();
                    } else {
                        h.tick();
                    }
                }
            }
        }
        *reservations += holds_plain_reservation(&h) as usize;
    }
    h.assert_audit_rebuilds_ledger();
    tenants_see_their_own_gpus_in_use(&h);
    h
}

/// A tenant's `Queue` answer (its GPUs in use per tier, read from the fleet's GPU
/// slots) agrees with its jobs that hold GPUs.
fn tenants_see_their_own_gpus_in_use(h: &Harness) {
    use allot_statemachine::query::{answer_as, Answer, Query};
    let s = &h.state.scheduler;
    let orgs: std::collections::BTreeSet<OrgId> = s.jobs.values().map(|j| j.org).collect();
    for org in orgs {
        let mut want: BTreeMap<Tier, u32> = BTreeMap::new();
        for j in s
            .jobs
            .values()
            .filter(|j| j.org == org && j.state.holds_gpus())
        {
            *want.entry(j.spec.tier).or_default() += j.spec.gpus;
        }
        let Ok(Answer::Queue(tiers)) = answer_as(&h.state, tenant(org), &Query::Queue) else {
            panic!("org {org:?}'s queue view");
        };
        for t in tiers {
            assert_eq!(
                t.running_gpus,
                want.get(&t.tier).copied().unwrap_or(0),
                "org {org:?}, tier {:?}",
                t.tier
            );
        }
    }
}

/// Whether a queued job holds a node that no preemption is freeing for it.
fn holds_plain_reservation(h: &Harness) -> bool {
    let s = &h.state.scheduler;
    s.jobs.values().any(|j| {
        j.state == JobState::Queued
            && j.reserved_node.is_some()
            && !s.jobs.values().any(|v| {
                v.state == JobState::Preempting && v.preempted_for == Some((j.org, j.spec.job))
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

    #[test]
    fn random_scheduling_keeps_every_invariant(ops in proptest::collection::vec(op(), 1..120), rules in prop::sample::select(vec![1u32, 3, 4, 8])) {
        run(&ops, rules);
    }

    /// Same log ⇒ same state: replaying the entries on a replica restored from a
    /// snapshot taken at a random point reaches the same state hash.
    #[test]
    fn scheduling_is_deterministic(ops in proptest::collection::vec(op(), 1..80), cut in any::<prop::sample::Index>(), rules in prop::sample::select(vec![1u32, 3, 4, 8])) {
        let h = run(&ops, rules);
        let cut = cut.index(h.entries.len() + 1);
        let mut replica = State::new(props_config());
        for e in &h.entries[..cut] {
            apply(&mut replica, e).unwrap();
        }
        let mut restored = State::decode(&replica.encode()).unwrap();
        for e in &h.entries[cut..] {
            apply(&mut restored, e).unwrap();
        }
        prop_assert_eq!(restored.state_hash(), h.state.state_hash());
    }
}

/// The generator reaches every lifecycle path, under rule version 1 and under version 3
/// (where gang jobs also take nodes reserved for them once aged).
#[test]
fn generator_reaches_every_lifecycle_path() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let strategy = proptest::collection::vec(op(), 80..120);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..200 {
        let rules = if i % 2 == 0 { 1 } else { 3 };
        let mut reservations = 0;
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        let h = run_counting(&ops, rules, &mut reservations);
        *seen.entry(format!("v{rules} reservation")).or_default() += reservations;
        for e in &h.events {
            if let EventBody::JobTransition { to, reason, .. } = e.body {
                let reason = format!("{reason:?}");
                let reason = reason
                    .split([' ', '{'])
                    .next()
                    .unwrap_or_default()
                    .to_string();
                *seen.entry(format!("{to:?}/{reason}")).or_default() += 1;
            }
            if let EventBody::NodeStateChanged { state, .. } = e.body {
                *seen.entry(format!("node {state:?}")).or_default() += 1;
            }
        }
    }
    println!("{seen:#?}");
    for key in [
        "Placed/Placed",
        "Running/Started",
        "Preempting/Preempted",
        "Queued/Requeued",
        "Succeeded/Succeeded",
        "Failed/Failed",
        "Cancelled/Cancelled",
        "Lost/LeaseExpired",
        "Queued/NodeDown",
        "Failed/NodeDown",
        "Failed/MaxDuration",
        "node Down",
        "node Draining",
        "v1 reservation",
        "v3 reservation",
        "Attached/Deduplicated",
        "Queued/DedupReleased",
        "Succeeded/Deduplicated",
    ] {
        assert!(
            seen.get(key).copied().unwrap_or(0) >= 3,
            "{key} reached {:?} times",
            seen.get(key)
        );
    }
    let _ = JobState::Queued;
}
