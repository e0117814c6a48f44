//! GPU inventory: registration, leases, draining, down; the free-GPU index.

use super::{GpuNode, NodeState, Reason, Scheduler, SchedulerConfig, Timer};
use crate::audit::{EventBody, PendingEvent};
use crate::command::NodeSpec;
use crate::ids::{GpuType, NodeId};
use crate::ledger::{Ctx, Ledger};
use crate::limits::*;
use crate::outcome::{CommandError, Limit, Reply};

impl Scheduler {
    /// Removes a node from the free index (call before changing its slots or state).
    pub(crate) fn unindex(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get(&id) {
            if let Some(set) = self.free_index.get_mut(&n.gpu_type) {
                set.remove(&(n.free_gpus(), id));
            }
        }
    }

    /// Adds a node to the free index if it is ready and has free GPUs.
    pub(crate) fn index(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get(&id) {
            let free = n.free_gpus();
            if n.placeable() && free > 0 {
                self.free_index
                    .entry(n.gpu_type.clone())
                    .or_default()
                    .insert((free, id));
            }
        }
    }

    pub(crate) fn node_event(
        &self,
        effects: &mut Vec<PendingEvent>,
        node: NodeId,
        state: NodeState,
    ) {
        effects.push(PendingEvent {
            org: None,
            account: None,
            hold: None,
            body: EventBody::NodeStateChanged { node, state },
        });
    }

    /// A renewed lease: a lapsed node takes work again (its agent was back within the
    /// fence margin; it reports any attempt it stopped meanwhile with `JobFenced`).
    fn renew_node_lease(&mut self, id: NodeId, until: u64) {
        let lapsed = self.nodes.get(&id).is_some_and(|n| n.lapsed);
        if lapsed {
            self.unindex(id);
        }
        if let Some(n) = self.nodes.get_mut(&id) {
            self.timers
                .remove(&(n.lease_until_ms, Timer::NodeLease(id)));
            n.lease_until_ms = until;
            n.lapsed = false;
            self.timers.insert((until, Timer::NodeLease(id)));
        }
        if lapsed {
            self.index(id);
        }
    }

    pub(crate) fn register_node(
        &mut self,
        ctx: &mut Ctx,
        ledger: &mut Ledger,
        cfg: &SchedulerConfig,
        spec: &NodeSpec,
    ) -> Result<Reply, CommandError> {
        let (now, lease_ms) = (ctx.now, cfg.node_lease_ms);
        // The spec itself (type name, counts, labels): `crate::validate`.
        if let Some(n) = self.nodes.get(&spec.node) {
            if (&n.gpu_type, n.gpu_count, n.gpu_mem_gb)
                != (&spec.gpu_type, spec.gpu_count, spec.gpu_mem_gb)
            {
                return Err(CommandError::NodeShapeConflict);
            }
            let current = n.incarnation;
            if spec.incarnation != 0 && spec.incarnation < current {
                return Err(CommandError::StaleIncarnation {
                    given: spec.incarnation,
                    current,
                });
            }
            if spec.incarnation > current && current != 0 {
                // A new agent process: the previous one's runners are gone (the agent
                // stops them before it registers), so their attempts end here, as a
                // node failure would end them — requeued (or failed past the retry
                // bound), billed to their last heartbeat. The old process's late reports
                // then name stale attempts and change nothing.
                for job in n.jobs() {
                    self.node_failure(ctx, ledger, cfg, job, Reason::NodeDown);
                }
            }
            if spec.incarnation > current {
                // The first agent process of a node an operator registered (incarnation
                // 0) adopts its placements: no runner of an earlier process exists.
                if let Some(n) = self.nodes.get_mut(&spec.node) {
                    n.incarnation = spec.incarnation;
                }
            }
            if spec.incarnation == 0
                && current != 0
                && ledger.rules.0 >= super::OPERATOR_REGISTRATIONS_RENEW_NOTHING_FROM
            {
                // An operator's registration of a node an agent process has claimed
                // (new labels): the node's lease and state are its agent's to renew. A
                // renewal here made a silent node — its agent cut off, its runners still
                // running until the agent's fence — look alive: a preemption's grace
                // ended by the clock and the victim's GPUs went to the preemptor.
                let mut labels = spec.labels.clone();
                labels.sort();
                if let Some(n) = self.nodes.get_mut(&spec.node) {
                    n.labels = labels;
                }
                return Ok(Reply::NodeUpdated);
            }
            let effects = &mut *ctx.effects;
            let Some(n) = self.nodes.get(&spec.node) else {
                return Err(CommandError::UnknownNode);
            };
            let was_down = n.state == NodeState::Down;
            if was_down {
                self.set_node_state(spec.node, NodeState::Ready, effects);
            }
            if let Some(n) = self.nodes.get_mut(&spec.node) {
                n.labels = spec.labels.clone();
            }
            self.renew_node_lease(spec.node, now + lease_ms);
            self.note_renewal(spec.node, now, ledger.rules.0);
            // The node's own agent process registering it again is a renewal as its
            // heartbeat is: from rule version 6 it also ends the preemptions that waited
            // for one. (An operator's registration proves nothing about the agent.)
            if spec.incarnation != 0
                && spec.incarnation == current
                && ledger.rules.0 >= super::REGISTRATION_ENDS_WAITING_GRACES_FROM
            {
                self.end_waiting_graces(ctx, ledger, cfg, spec.node);
            }
            return Ok(Reply::NodeUpdated);
        }
        if self.nodes.len() >= NODES_MAX {
            return Err(CommandError::LimitReached(Limit::Nodes));
        }
        let mut labels = spec.labels.clone();
        labels.sort();
        self.nodes.insert(
            spec.node,
            GpuNode {
                id: spec.node,
                gpu_type: spec.gpu_type.clone(),
                gpu_count: spec.gpu_count,
                gpu_mem_gb: spec.gpu_mem_gb,
                labels,
                state: NodeState::Ready,
                lease_until_ms: now + lease_ms,
                lapsed: false,
                slots: vec![None; spec.gpu_count as usize],
                reserved_for: None,
                incarnation: spec.incarnation,
            },
        );
        self.timers
            .insert((now + lease_ms, Timer::NodeLease(spec.node)));
        self.note_renewal(spec.node, now, ledger.rules.0);
        self.type_nodes
            .entry(spec.gpu_type.clone())
            .or_default()
            .insert(spec.node);
        self.type_shapes
            .entry(spec.gpu_type.clone())
            .or_default()
            .insert((spec.gpu_count, spec.gpu_mem_gb));
        self.fleet_gpus += spec.gpu_count;
        self.index(spec.node);
        self.node_event(ctx.effects, spec.node, NodeState::Ready);
        Ok(Reply::NodeRegistered)
    }

    pub(crate) fn node_heartbeat(
        &mut self,
        now: u64,
        lease_ms: u64,
        id: NodeId,
        effects: &mut Vec<PendingEvent>,
        rules: u32,
    ) -> Result<Reply, CommandError> {
        let n = self.nodes.get(&id).ok_or(CommandError::UnknownNode)?;
        if n.state == NodeState::Down {
            // Its jobs ended when it went down; it comes back empty.
            self.set_node_state(id, NodeState::Ready, effects);
        }
        self.renew_node_lease(id, now + lease_ms);
        self.note_renewal(id, now, rules);
        Ok(Reply::NodeUpdated)
    }

    /// Records a renewal's instant for the silent-node grace rule (rule version 5 on:
    /// `Fence::renewed_ms`).
    fn note_renewal(&mut self, id: NodeId, now: u64, rules: u32) {
        if rules >= super::FENCE_INSTANTS_FROM {
            self.fence.renewed_ms.insert(id, now);
        }
    }

    pub(crate) fn set_draining(
        &mut self,
        id: NodeId,
        draining: bool,
        effects: &mut Vec<PendingEvent>,
    ) -> Result<Reply, CommandError> {
        let n = self.nodes.get(&id).ok_or(CommandError::UnknownNode)?;
        let target = match (n.state, draining) {
            (NodeState::Down, _) => return Err(CommandError::NodeDown),
            (_, true) => NodeState::Draining,
            (_, false) => NodeState::Ready,
        };
        if n.state != target {
            self.set_node_state(id, target, effects);
        }
        Ok(Reply::NodeUpdated)
    }

    /// Changes a node's state, keeping the free index and fleet size right. (Jobs on a
    /// node going down are ended by the caller first.)
    pub(crate) fn set_node_state(
        &mut self,
        id: NodeId,
        state: NodeState,
        effects: &mut Vec<PendingEvent>,
    ) {
        self.unindex(id);
        let Some(n) = self.nodes.get_mut(&id) else {
            return;
        };
        let (was, count) = (n.state, n.gpu_count);
        n.state = state;
        // A down node's reservation is void: the waiting job reserves anew.
        let released = if state == NodeState::Down {
            n.reserved_for.take()
        } else {
            None
        };
        if let Some(j) = released.and_then(|r| self.jobs.get_mut(&r)) {
            if j.reserved_node == Some(id) {
                j.reserved_node = None;
            }
        }
        match (was == NodeState::Down, state == NodeState::Down) {
            (false, true) => self.fleet_gpus -= count,
            (true, false) => self.fleet_gpus += count,
            _ => {}
        }
        self.index(id);
        self.node_event(effects, id, state);
    }

    /// Could one registered node ever run `gpus` GPUs with `mem_floor_gb` of one of
    /// these types? Count and memory are checked on the same node shape: an 8 × 40 GB
    /// node and a 1 × 80 GB node of one type cannot run an 8-GPU, 80 GB job.
    pub(crate) fn satisfiable(&self, types: &[GpuType], gpus: u32, mem_floor_gb: u32) -> bool {
        types.iter().any(|t| {
            self.type_shapes.get(t).is_some_and(|shapes| {
                shapes
                    .iter()
                    .any(|&(count, mem)| count >= gpus && mem >= mem_floor_gb)
            })
        })
    }

    /// Whether any node of this type was ever registered.
    pub(crate) fn knows_type(&self, t: &GpuType) -> bool {
        self.type_shapes.contains_key(t)
    }
}
