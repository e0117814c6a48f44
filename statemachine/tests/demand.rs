//! The demand signal's rules (`scheduler/demand.rs`, DESIGN §52), one test each, on
//! states built through `apply` (the harness checks every invariant after each entry),
//! and who may read it (`query::answer_as`).

use allot_statemachine::query::{
    answer, answer_as, Answer, DemandQuery, Query, QueryDenied, TierDemand, TypeDemand,
};
use allot_statemachine::scheduler::{JobState, NodeState};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);
const MIN_MS: u64 = 60_000;
/// Default tier targets (`max_wait_ms`): free 30 min, paid 10 min, enterprise 5 min.
const TARGETS_MS: [u64; 3] = [30 * MIN_MS, 10 * MIN_MS, 5 * MIN_MS];

fn world() -> Harness {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(1_000_000), None);
    h
}

fn submit(h: &mut Harness, spec: JobSpec) {
    let id = spec.job.0;
    match h.run(Command::SubmitJob(spec)) {
        Ok(Reply::JobSubmitted { .. }) => {}
        other => panic!("submit {id}: {other:?}"),
    }
}

/// A job of `gpus` GPUs of `types` running at most `max_ms`.
fn job(id: u64, tier: Tier, types: Vec<GpuType>, gpus: u32, max_ms: u64) -> JobSpec {
    JobSpec {
        max_duration_ms: max_ms,
        ..Harness::job_spec(id, tier, types, gpus)
    }
}

fn demand_at(h: &Harness, run_pct: u32) -> Vec<TypeDemand> {
    match answer(&h.state, &Query::Demand(DemandQuery { run_pct })) {
        Answer::Demand(rows) => rows,
        other => panic!("{other:?}"),
    }
}

fn demand(h: &Harness) -> Vec<TypeDemand> {
    demand_at(h, 0)
}

fn row<'a>(rows: &'a [TypeDemand], t: &GpuType) -> &'a TypeDemand {
    rows.iter()
        .find(|r| &r.gpu_type == t)
        .unwrap_or_else(|| panic!("no row for {t:?} in {rows:?}"))
}

fn tier(r: &TypeDemand, t: Tier) -> TierDemand {
    r.tiers[t.0 as usize]
}

fn needed(r: &TypeDemand) -> Vec<u32> {
    r.tiers.iter().map(|t| t.gpus_needed).collect()
}

#[test]
fn an_empty_queue_needs_nothing() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, h100(), 8, 80)]);
    // A running job is no demand either: only queued work is.
    submit(&mut h, job(10, Tier::PAID, vec![a100()], 4, HOUR_MS));
    assert_eq!(h.job(10).state, JobState::Placed);
    let rows = demand(&h);
    assert_eq!(
        rows.iter().map(|r| r.gpu_type.clone()).collect::<Vec<_>>(),
        vec![a100(), h100()],
        "one row per type of the pool, by type"
    );
    for r in &rows {
        assert_eq!((r.capacity_gpus, r.queued_jobs, r.queued_gpu_ms), (8, 0, 0));
        assert_eq!(r.wait_ms, Some(0));
        assert_eq!(r.tiers.len(), 3);
        for (i, t) in r.tiers.iter().enumerate() {
            assert_eq!(
                (
                    t.tier,
                    t.queued_jobs,
                    t.wait_ms,
                    t.overdue_jobs,
                    t.gpus_needed
                ),
                (Tier(i as u8), 0, Some(0), 0, 0)
            );
            assert_eq!(t.target_wait_ms, TARGETS_MS[i]);
        }
    }
    assert_eq!(row(&rows, &a100()).used_gpus, 4);
    assert_eq!(row(&rows, &h100()).used_gpus, 0);
    // No pool at all: no rows.
    assert!(demand(&world()).is_empty());
}

#[test]
fn queued_work_asks_only_for_the_type_it_counts_against() {
    let mut h = world();
    // A100 nodes have 40 GB per GPU, H100 nodes 80.
    h.fleet(&[(1, a100(), 8, 40), (2, h100(), 8, 80)]);
    submit(&mut h, job(10, Tier::PAID, vec![h100()], 8, HOUR_MS));
    // H100 only: waits for the H100 node.
    submit(&mut h, job(11, Tier::PAID, vec![h100()], 2, HOUR_MS));
    // Prefers A100 but needs 80 GB, which no A100 shape has: its work counts against
    // H100, the first of its types that can hold it.
    let mut big_mem = job(12, Tier::PAID, vec![a100(), h100()], 4, 2 * HOUR_MS);
    big_mem.mem_floor_gb = 80;
    submit(&mut h, big_mem);
    assert_eq!(h.job(11).state, JobState::Queued);
    assert_eq!(h.job(12).state, JobState::Queued);
    let rows = demand(&h);
    let (a, hh) = (row(&rows, &a100()), row(&rows, &h100()));
    assert_eq!((a.queued_jobs, a.queued_gpu_ms), (0, 0));
    assert_eq!(needed(a), vec![0, 0, 0], "nothing asks for A100");
    assert_eq!(a.capacity_gpus, 8, "an idle A100 node is capacity");
    let work = 2 * HOUR_MS + 4 * 2 * HOUR_MS;
    assert_eq!((hh.queued_jobs, hh.queued_gpu_ms), (2, work));
    assert_eq!((hh.capacity_gpus, hh.used_gpus), (8, 8));
    assert_eq!(hh.wait_ms, Some(work.div_ceil(8)));
    let paid = tier(hh, Tier::PAID);
    assert_eq!((paid.queued_jobs, paid.queued_gpu_ms), (2, work));
    // ⌈10 GPU-hours / 10 minutes⌉ = 60 GPUs, less the 8 there are.
    assert_eq!(paid.gpus_needed, 60 - 8);
    // The free tier waits behind the paid work: 20 GPUs would run it within 30 minutes,
    // but nothing of the free tier is queued, so it asks for nothing; neither does the
    // enterprise tier, above the paid work.
    assert_eq!(tier(hh, Tier::FREE).wait_ms, Some(work.div_ceil(8)));
    assert_eq!(needed(hh), vec![0, 52, 0]);
}

#[test]
fn a_tier_within_its_target_needs_no_gpus() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    submit(&mut h, job(10, Tier::FREE, vec![a100()], 8, HOUR_MS));
    // 1 GPU for at most 10 minutes: 8 GPUs run it in 75 s, within every target.
    submit(&mut h, job(11, Tier::PAID, vec![a100()], 1, 10 * MIN_MS));
    let r = demand(&h).remove(0);
    let paid = tier(&r, Tier::PAID);
    assert_eq!(paid.wait_ms, Some(10 * MIN_MS / 8));
    assert_eq!(needed(&r), vec![0, 0, 0]);

    // At the edge: 80 GPU-minutes of paid work is exactly 10 minutes on 8 GPUs.
    submit(&mut h, job(12, Tier::PAID, vec![a100()], 7, 10 * MIN_MS));
    let r = demand(&h).remove(0);
    assert_eq!(tier(&r, Tier::PAID).wait_ms, Some(10 * MIN_MS));
    assert_eq!(needed(&r), vec![0, 0, 0], "at the target is within it");

    // One GPU-minute more, and the paid tier asks for one GPU.
    submit(&mut h, job(13, Tier::PAID, vec![a100()], 1, MIN_MS));
    let r = demand(&h).remove(0);
    assert_eq!(needed(&r), vec![0, 1, 0]);

    // A free job behind it: the free tier waits for all of it (81 GPU-minutes + its own
    // 8 GPU-hours), against a 30-minute target.
    submit(&mut h, job(14, Tier::FREE, vec![a100()], 8, HOUR_MS));
    let r = demand(&h).remove(0);
    let work = 81 * MIN_MS + 8 * HOUR_MS;
    assert_eq!(tier(&r, Tier::FREE).wait_ms, Some(work.div_ceil(8)));
    assert_eq!(
        tier(&r, Tier::FREE).gpus_needed as u64,
        work.div_ceil(30 * MIN_MS) - 8
    );
    assert_eq!(
        tier(&r, Tier::PAID).gpus_needed,
        1,
        "unchanged by lower tiers"
    );

    // With jobs expected to run a quarter of their bound, the paid tier is within its
    // target again: the caller's estimate scales the work.
    let r = demand_at(&h, 25).remove(0);
    assert_eq!(tier(&r, Tier::PAID).queued_gpu_ms, 81 * MIN_MS / 4);
    assert_eq!(tier(&r, Tier::PAID).gpus_needed, 0);
    // 0 and anything above 100 read as 100 (no job runs past its bound).
    assert_eq!(demand_at(&h, 0), demand_at(&h, 100));
    assert_eq!(demand_at(&h, 101), demand_at(&h, 100));
    assert_eq!(demand_at(&h, u32::MAX), demand_at(&h, 100));
}

#[test]
fn a_job_queued_past_its_target_needs_its_gpus_whatever_the_drain_time() {
    // Leases outlast the time jumps (lease expiry is not this test's business).
    let mut config = Config::default();
    config.scheduler.node_lease_ms = 30 * 86_400_000;
    config.scheduler.job_lease_ms = 30 * 86_400_000;
    let mut h = Harness::world_with(config);
    h.grant(1, P, BucketKind::Paid, credits(1_000_000), None);
    h.fleet(&[(1, a100(), 8, 80)]);
    // Half the node stays busy for hours: a whole-node job cannot start, however short.
    submit(&mut h, job(10, Tier::PAID, vec![a100()], 4, 10 * HOUR_MS));
    submit(&mut h, job(11, Tier::FREE, vec![a100()], 8, MIN_MS));
    assert_eq!(h.job(11).state, JobState::Queued);
    let r = demand(&h).remove(0);
    let free = tier(&r, Tier::FREE);
    assert_eq!(free.wait_ms, Some(MIN_MS), "8 GPU-minutes on 8 GPUs");
    assert_eq!(
        (free.overdue_jobs, free.gpus_needed),
        (0, 0),
        "within target"
    );
    // Just short of the free tier's 30 minutes: still within.
    h.advance(30 * MIN_MS - 1);
    h.tick();
    assert_eq!(needed(&demand(&h).remove(0)), vec![0, 0, 0]);
    // At 30 minutes it is overdue: the tier needs the job's 8 GPUs, though its queued
    // work would drain in a minute on the capacity there is.
    h.advance(1);
    h.tick();
    let r = demand(&h).remove(0);
    let free = tier(&r, Tier::FREE);
    assert_eq!(free.wait_ms, Some(MIN_MS));
    assert_eq!((free.overdue_jobs, free.overdue_gpus), (1, 8));
    assert_eq!(needed(&r), vec![8, 0, 0]);
}

#[test]
fn draining_and_down_nodes_are_not_capacity() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
    submit(&mut h, job(10, Tier::PAID, vec![a100()], 8, HOUR_MS));
    let on = h.job(10).placement.as_ref().unwrap().node;
    let other = if on == NodeId(1) {
        NodeId(2)
    } else {
        NodeId(1)
    };
    submit(&mut h, job(11, Tier::PAID, vec![a100()], 8, HOUR_MS));
    submit(&mut h, job(12, Tier::PAID, vec![a100()], 8, HOUR_MS));
    assert_eq!(h.job(12).state, JobState::Queued);
    let r = demand(&h).remove(0);
    assert_eq!((r.capacity_gpus, r.used_gpus), (16, 16));

    // The busy node drains: its running job still uses GPUs, but it is not capacity.
    h.ok(Command::SetNodeDraining {
        node: on,
        draining: true,
    });
    let r = demand(&h).remove(0);
    assert_eq!((r.capacity_gpus, r.used_gpus), (8, 16));
    let work = 8 * HOUR_MS;
    assert_eq!(r.wait_ms, Some(work.div_ceil(8)));
    assert_eq!(
        tier(&r, Tier::PAID).gpus_needed as u64,
        work.div_ceil(10 * MIN_MS) - 8
    );

    // The other node falls silent: lapsed at its lease's end, down a fence margin later
    // (its job is requeued). Only the draining node's agent keeps beating.
    let lease = h.state.config.scheduler.node_lease_ms;
    h.advance(lease / 2);
    h.run_as(Actor::Agent(on), Command::NodeHeartbeat { node: on })
        .unwrap();
    h.advance(lease / 2 + 1);
    h.tick();
    assert!(h.state.scheduler.node(other).unwrap().lapsed);
    let r = demand(&h).remove(0);
    assert_eq!(r.capacity_gpus, 0, "a lapsed node takes no work");
    h.run_as(Actor::Agent(on), Command::NodeHeartbeat { node: on })
        .unwrap();
    h.advance(h.state.config.scheduler.fence_margin_ms);
    h.tick();
    assert_eq!(
        h.state.scheduler.node(other).unwrap().state,
        NodeState::Down
    );
    let r = demand(&h).remove(0);
    // Both queued jobs (12 and the requeued 11) wait, with no capacity at all.
    assert_eq!((r.capacity_gpus, r.used_gpus, r.queued_jobs), (0, 8, 2));
    assert_eq!(r.wait_ms, None, "work and no capacity: no finite wait");
    let paid = tier(&r, Tier::PAID);
    assert_eq!(paid.wait_ms, None);
    assert_eq!(
        paid.gpus_needed as u64,
        (2 * work).div_ceil(10 * MIN_MS),
        "the whole capacity is needed"
    );
    // A tier with nothing queued and nothing above it still has a zero wait.
    assert_eq!(tier(&r, Tier::ENTERPRISE).wait_ms, Some(0));

    // Undrained, the node is capacity again.
    h.ok(Command::SetNodeDraining {
        node: on,
        draining: false,
    });
    assert_eq!(demand(&h)[0].capacity_gpus, 8);
}

#[test]
fn the_signal_is_a_pure_deterministic_function_of_the_state() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80), (2, h100(), 8, 80), (3, h100(), 4, 80)]);
    for (i, t) in [Tier::FREE, Tier::PAID, Tier::ENTERPRISE]
        .into_iter()
        .cycle()
        .take(24)
        .enumerate()
    {
        let types = match i % 3 {
            0 => vec![h100()],
            1 => vec![a100(), h100()],
            _ => vec![h100(), a100()],
        };
        let gpus = [1, 2, 4, 8][i % 4];
        submit(
            &mut h,
            job(100 + i as u64, t, types, gpus, (i as u64 + 1) * MIN_MS),
        );
        h.advance(1_000);
    }
    let before = h.state.state_hash();
    let first = demand(&h);
    assert!(first.iter().any(|r| r.queued_jobs > 0), "{first:?}");
    assert_eq!(h.state.state_hash(), before, "reading it changes nothing");
    assert_eq!(demand(&h), first, "asked twice, answered the same");
    // Another replica (other hash keys) fed the same log answers the same.
    let mut replica = State::new(Config::default());
    for e in &h.entries {
        apply(&mut replica, e).unwrap();
    }
    assert_eq!(replica.state_hash(), before);
    match answer(&replica, &Query::Demand(DemandQuery::default())) {
        Answer::Demand(rows) => assert_eq!(rows, first),
        other => panic!("{other:?}"),
    }
}

#[test]
fn only_the_operator_reads_the_demand_signal() {
    let mut h = world();
    h.fleet(&[(1, a100(), 8, 80)]);
    let q = Query::Demand(DemandQuery::default());
    let expected = answer(&h.state, &q);
    assert_eq!(answer_as(&h.state, ADMIN, &q), Ok(expected.clone()));
    assert_eq!(answer_as(&h.state, Actor::System, &q), Ok(expected));
    // Every org's queued work, summed: a tenant could subtract its own and learn the
    // others'. Tenants, projects, users and agents are refused.
    let project = Actor::Project {
        org: ORG,
        project: PROJECT,
        principal: PrincipalId(7),
    };
    let user = Actor::User {
        org: ORG,
        project: PROJECT,
        user: USER,
        principal: PrincipalId(8),
    };
    for caller in [
        tenant(ORG),
        tenant(OTHER_ORG),
        project,
        user,
        Actor::Agent(NodeId(1)),
    ] {
        assert_eq!(
            answer_as(&h.state, caller, &q),
            Err(QueryDenied::PermissionDenied),
            "{caller:?}"
        );
    }
    assert_eq!(
        answer_as(&h.state, Actor::Anonymous, &q),
        Err(QueryDenied::Unauthenticated)
    );
    assert_eq!(q.name(), "demand");
}
