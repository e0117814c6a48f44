//! The scheduler's invariants, checked with the ledger's (`check_invariants`): no GPU
//! allocated to two jobs, no job on two nodes, every job holding GPUs has an open
//! metered hold at its current attempt (and, placed for the first time, nothing held
//! from an expired bucket), queues and counters match the jobs.

use super::{JobState, NodeState};
use crate::State;
use std::collections::BTreeMap;

pub fn check(state: &State) -> Result<(), String> {
    let s = &state.scheduler;
    let mut used = 0u32;
    let mut tier_gpus: BTreeMap<_, u32> = BTreeMap::new();
    let mut queued = 0usize;
    for (id, j) in s.jobs.sorted() {
        // The job's own hold: a ledger hold of the same id (made once the job's hold is
        // forgotten, or for a job that never reserved one) is not the job's.
        let hold = state
            .ledger
            .hold(id.0, super::jobs::hold_of(*id))
            .filter(|h| h.job);
        if j.state.holds_gpus() {
            let p = j
                .placement
                .as_ref()
                .ok_or(format!("{id:?} holds GPUs without a placement"))?;
            let n = s
                .nodes
                .get(&p.node)
                .ok_or(format!("{id:?} placed on unknown {}", p.node))?;
            if p.gpu_indices.len() != j.spec.gpus as usize {
                return Err(format!(
                    "{id:?} has {} GPU indices for {} GPUs",
                    p.gpu_indices.len(),
                    j.spec.gpus
                ));
            }
            for &i in &p.gpu_indices {
                if n.slots.get(i as usize) != Some(&Some(*id)) {
                    return Err(format!(
                        "{id:?}: GPU {i} of {} is not assigned to it",
                        p.node
                    ));
                }
            }
            let meter = hold.filter(|h| h.is_open()).and_then(|h| h.meter.as_ref());
            if !meter.is_some_and(|m| m.attempt == j.attempt && !m.closed) {
                return Err(format!(
                    "{id:?} runs without an open meter at attempt {}",
                    j.attempt
                ));
            }
            // From rule version 8, a job placed for the first time (in this entry, under
            // the active rules) holds nothing a bucket could no longer pay at its
            // placement: `Scheduler::renew_unplaced_hold` ran on every placement path.
            let first_placed_now = j.attempt == 1 && p.started_ms == state.time_ms;
            // Under those rules: activated at an earlier instant (an activation later in
            // this entry, or at the same logical ms, may follow a placement made before it).
            let from = crate::ledger::QUEUED_HOLDS_LOSE_EXPIRED_CREDIT_FROM;
            let ruled = state
                .rules
                .activations
                .iter()
                .find(|(v, _, _)| *v >= from)
                .is_some_and(|(_, _, at)| *at < p.started_ms);
            if first_placed_now && ruled {
                let stale = hold.into_iter().flat_map(|h| &h.draws).find(|d| {
                    d.held > 0
                        && state
                            .ledger
                            .buckets
                            .get(&d.bucket)
                            .is_some_and(|b| !b.spendable_at(p.started_ms))
                });
                if let Some(d) = stale {
                    return Err(format!(
                        "{id:?} was placed holding {} µcredits of expired {:?}",
                        d.held, d.bucket
                    ));
                }
            }
            used += j.spec.gpus;
            *tier_gpus.entry(j.spec.tier).or_default() += j.spec.gpus;
        } else if j.placement.is_some() {
            return Err(format!("{id:?} in {:?} keeps a placement", j.state));
        }
        if let Some(node) = j.reserved_node {
            if s.nodes.get(&node).and_then(|n| n.reserved_for) != Some(*id) {
                return Err(format!("{id:?} holds a reservation {node} does not record"));
            }
        }
        match j.state {
            JobState::Queued => {
                queued += 1;
                if !hold.is_some_and(|h| h.is_open()) {
                    return Err(format!("queued {id:?} has no open hold"));
                }
                let key = (j.queued_since_ms, *id);
                if !s.by_age.get(&j.spec.tier).is_some_and(|q| q.contains(&key)) {
                    return Err(format!("queued {id:?} missing from its tier's queue"));
                }
            }
            JobState::Attached if !hold.is_some_and(|h| h.is_open() && h.meter.is_none()) => {
                return Err(format!("attached {id:?} has no open, unmetered hold"));
            }
            st if st.is_final() && hold.is_some_and(|h| h.is_open()) => {
                return Err(format!("finished {id:?} still holds credit"));
            }
            _ => {}
        }
    }
    // The per-org job index lists exactly the jobs.
    if s.org_jobs.len() != s.jobs.len() || s.jobs.keys().any(|k| !s.org_jobs.contains(k)) {
        return Err("the per-org job index disagrees with the jobs".into());
    }
    // So do the per-project and per-user ones.
    let scoped = &s.scoped_jobs;
    if scoped.by_project.len() != s.jobs.len()
        || scoped.by_user.len() != s.jobs.len()
        || s.jobs.iter().any(|((org, id), j)| {
            !scoped.by_project.contains(&(*org, j.spec.project, *id))
                || !scoped
                    .by_user
                    .contains(&(*org, j.spec.project, j.spec.user, *id))
        })
    {
        return Err("the per-project or per-user job index disagrees with the jobs".into());
    }
    // Every slot points at a job that holds GPUs there.
    let mut fleet = 0;
    for (nid, n) in s.nodes.sorted() {
        if n.state != NodeState::Down {
            fleet += n.gpu_count;
        }
        for (i, slot) in n.slots.iter().enumerate() {
            let Some(job) = slot else { continue };
            let ok = s.jobs.get(job).is_some_and(|j| {
                j.state.holds_gpus()
                    && j.placement
                        .as_ref()
                        .is_some_and(|p| p.node == *nid && p.gpu_indices.contains(&(i as u8)))
            });
            if !ok {
                return Err(format!(
                    "{nid} GPU {i} assigned to {job:?}, which is not running there"
                ));
            }
        }
        // A reservation names a queued job that names this node back.
        if let Some(r) = n.reserved_for {
            let ok = s
                .jobs
                .get(&r)
                .is_some_and(|j| j.state == JobState::Queued && j.reserved_node == Some(*nid));
            if !ok {
                return Err(format!(
                    "{nid} is reserved for {r:?}, which is not waiting for it"
                ));
            }
        }
        let indexed = s
            .free_index
            .get(&n.gpu_type)
            .is_some_and(|x| x.contains(&(n.free_gpus(), *nid)));
        if indexed != (n.placeable() && n.free_gpus() > 0) {
            return Err(format!("{nid}: free index disagrees with the node"));
        }
    }
    let indexed: usize = s.free_index.values().map(|x| x.len()).sum();
    let expected = s
        .nodes
        .values()
        .filter(|n| n.placeable() && n.free_gpus() > 0)
        .count();
    if indexed != expected {
        return Err(format!(
            "free index has {indexed} entries for {expected} nodes"
        ));
    }
    if used != s.used_gpus || fleet != s.fleet_gpus {
        return Err(format!(
            "GPU counters: used {} (counted {used}), fleet {} (counted {fleet})",
            s.used_gpus, s.fleet_gpus
        ));
    }
    if s.tier_gpus
        .iter()
        .any(|(t, g)| tier_gpus.get(t).copied().unwrap_or(0) != *g)
    {
        return Err("per-tier GPU counters disagree with the jobs".into());
    }
    if let Some(v) = s.dedup_violations().into_iter().next() {
        return Err(v);
    }
    let in_queues: usize = s.by_age.values().map(|q| q.len()).sum();
    if in_queues != queued {
        return Err(format!(
            "{in_queues} queue entries for {queued} queued jobs"
        ));
    }
    fence(state)
}

/// The fence instants (rule version 5 on; empty before): one renewal per node, and a
/// preemption start for exactly the jobs in their grace (`Preempting`, timer pending).
fn fence(state: &State) -> Result<(), String> {
    let (s, f) = (&state.scheduler, &state.scheduler.fence);
    if state.rules.active < super::FENCE_INSTANTS_FROM {
        if f.renewed_ms.is_empty() && f.preempted_ms.is_empty() {
            return Ok(());
        }
        return Err("fence instants recorded before rule version 5".into());
    }
    if f.renewed_ms.len() != s.nodes.len() || f.renewed_ms.keys().any(|n| s.nodes.get(n).is_none())
    {
        return Err(format!(
            "{} renewal instants for {} nodes",
            f.renewed_ms.len(),
            s.nodes.len()
        ));
    }
    if let Some(j) = f.preempted_ms.keys().find(|j| {
        s.jobs
            .get(j)
            .is_none_or(|j| j.state != JobState::Preempting || j.grace_at.is_none())
    }) {
        return Err(format!(
            "{j:?} has a preemption start but is not in its grace"
        ));
    }
    for (id, j) in s.jobs.sorted() {
        if j.state == JobState::Preempting
            && j.grace_at.is_some()
            && !f.preempted_ms.contains_key(id)
        {
            return Err(format!("{id:?} is in its grace without a preemption start"));
        }
    }
    Ok(())
}
