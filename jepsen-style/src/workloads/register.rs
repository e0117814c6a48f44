//! register: per-key read/write registers checked for linearizability. allot has no
//! key-value store; the register is a project's budget limit:
//! - key = a project (11, 12, 13 of the standard world),
//! - write(v) = `SetBudget { scope: Project(k), budget: Some(limit v, lifetime, soft) }`
//!   (soft, so it never blocks anything),
//! - read = linearizable `Query::Budget(Project(k))` → the limit (0 before any write).
//!
//! Values written are unique per run. The checker is [`crate::linear`] (WGL), run per
//! key (registers compose: P-compositionality).

use super::*;
use crate::history::{pairs, Op};
use crate::linear::{check_register, Call, Outcome, RegOp};
use allot_statemachine::testkit::{world_commands, OTHER_PROJECT, PROJECT, PROJECT_B};
use allot_statemachine::{BudgetMode, BudgetPeriod, BudgetScope, BudgetSpec, ProjectId};
use std::collections::BTreeMap;

pub const KEYS: [ProjectId; 3] = [PROJECT, PROJECT_B, OTHER_PROJECT];
/// Search steps per key before the verdict is "unknown".
pub const SEARCH_BUDGET: u64 = 20_000_000;

pub async fn setup(client: &Client) -> anyhow::Result<()> {
    super::setup(client, world_commands()).await
}

pub async fn process(ctx: Arc<Ctx>, p: i64, mut rng: Rng) {
    let client = ctx.client();
    let stream = 1000 + p as u64;
    let mut n = 0u64;
    while !ctx.done() {
        let key = *rng.pick(&KEYS);
        n += 1;
        if rng.chance(50) {
            let v = (p as u64 + 1) * 1_000_000 + n;
            let req = admin_req(
                rid(stream, n),
                Command::SetBudget {
                    scope: BudgetScope::Project(key),
                    budget: Some(BudgetSpec {
                        limit_micro: v,
                        period: BudgetPeriod::Lifetime,
                        mode: BudgetMode::Soft,
                    }),
                },
            );
            let val = json!({"key": key.0, "value": v});
            run_op(&ctx, &client, p, "write", val, &req, |_| json!(null)).await;
        } else {
            let scope = BudgetScope::Project(key);
            let q = Query::Budget(
                allot_statemachine::testkit::fixture_org(&Command::SetBudget {
                    scope,
                    budget: None,
                })
                .unwrap_or(allot_statemachine::testkit::ORG),
                scope,
            );
            read_op(
                &ctx,
                &client,
                p,
                "read",
                json!({"key": key.0}),
                &q,
                |a| match a {
                    Answer::Budget(Some(b)) => json!(b.budget.map_or(0, |s| s.limit_micro)),
                    other => json!(format!("{other:?}")),
                },
            )
            .await;
        }
        pace(&mut rng).await;
    }
}

/// The per-key histories of a run: writes that did not fail (unknown ones with no
/// completion) and ok reads.
pub fn histories(ops: &[Op]) -> BTreeMap<u64, Vec<Call>> {
    let mut by_key: BTreeMap<u64, Vec<Call>> = BTreeMap::new();
    for p in pairs(ops) {
        let key = u(&p.invoke.value, "key");
        let call = match (p.invoke.f.as_str(), p.kind()) {
            ("write", OpType::Ok) => Call {
                op: RegOp::Write(u(&p.invoke.value, "value")),
                invoke: p.invoke.index,
                complete: Some(p.done_index()),
                id: p.invoke.index,
            },
            ("write", OpType::Info) => Call {
                op: RegOp::Write(u(&p.invoke.value, "value")),
                invoke: p.invoke.index,
                complete: None,
                id: p.invoke.index,
            },
            ("read", OpType::Ok) => {
                let Some(v) = p.done.and_then(|d| d.value["answer"].as_u64()) else {
                    continue;
                };
                Call {
                    op: RegOp::Read(v),
                    invoke: p.invoke.index,
                    complete: Some(p.done_index()),
                    id: p.invoke.index,
                }
            }
            _ => continue,
        };
        by_key.entry(key).or_default().push(call);
    }
    by_key
}

pub fn check(ops: &[Op]) -> Vec<Verdict> {
    let mut out = Vec::new();
    let mut summary = Vec::new();
    let mut bad = None;
    let mut unknown = None;
    for (key, calls) in histories(ops) {
        match check_register(0, &calls, SEARCH_BUDGET) {
            Outcome::Linearizable => summary.push(format!("key {key}: {} ops", calls.len())),
            Outcome::NotLinearizable {
                stuck_at,
                linearized,
            } => {
                if bad.is_none() {
                    bad = Some(format!(
                        "key {key}: not linearizable — no order explains op {} ({:?}, invoked at {}, \
                         completed at {:?}); at most {linearized} of {} ops linearized",
                        stuck_at.id,
                        stuck_at.op,
                        stuck_at.invoke,
                        stuck_at.complete,
                        calls.len()
                    ));
                }
            }
            Outcome::Unknown { explored } => {
                unknown.get_or_insert(format!("key {key}: search budget spent ({explored} steps)"));
            }
        }
    }
    if bad.is_none() {
        if let Some(u) = unknown {
            out.push(Verdict::unknown(
                "register/linearizable",
                format!("not refuted, not proven: {u}"),
            ));
            return out;
        }
    }
    out.push(Verdict::from(
        "register/linearizable",
        bad,
        summary.join(", "),
    ));
    out
}
