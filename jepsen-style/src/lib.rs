//! `allot-jepsen`: a fault-injection harness in the manner of Jepsen — generators,
//! nemeses, histories of invoke/ok/fail/info operations and checkers — in Rust, on one
//! machine, against real `allot-node` processes on loopback.
//!
//! - [`proxy`]: an in-process TCP proxy per directed peer link (partitions black-hole
//!   or reset links; delay is added per chunk; bytes are never altered).
//! - [`cluster`]: the nodes (own data dirs, every peer dial routed through its link's
//!   proxy with `--peer-route`) and the fault operations on them.
//! - [`nemesis`]: the fault schedule (kill, pause, partitions, clock, membership, disk).
//! - [`history`]: the recorded operations (JSON lines).
//! - [`workloads`]: ledger-bank, idempotency, scheduler, register — generators and
//!   checkers; [`linear`]: the WGL linearizability checker used by the register.
//! - [`run`]: one run end to end, and its report.

pub mod cluster;
pub mod history;
pub mod linear;
pub mod nemesis;
pub mod proxy;
pub mod rng;
pub mod run;
pub mod workloads;

/// A checker's verdict on one property.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Verdict {
    pub checker: String,
    /// No violation found (true also for `unknown`).
    pub ok: bool,
    /// The checker could not decide (e.g. its search budget ran out): no violation was
    /// found, but none was ruled out either. Like Jepsen's `:valid? :unknown`, it does
    /// not fail the run, and it is never printed as a pass.
    #[serde(default)]
    pub unknown: bool,
    /// What was checked (counts), or the first counter-example.
    pub detail: String,
}

impl Verdict {
    pub fn pass(checker: &str, detail: impl Into<String>) -> Verdict {
        Verdict {
            checker: checker.to_string(),
            ok: true,
            unknown: false,
            detail: detail.into(),
        }
    }

    pub fn fail(checker: &str, detail: impl Into<String>) -> Verdict {
        Verdict {
            checker: checker.to_string(),
            ok: false,
            unknown: false,
            detail: detail.into(),
        }
    }

    pub fn unknown(checker: &str, detail: impl Into<String>) -> Verdict {
        Verdict {
            checker: checker.to_string(),
            ok: true,
            unknown: true,
            detail: detail.into(),
        }
    }

    /// How a report marks it: `ok`, `??` (unknown) or `FAIL`.
    pub fn mark(&self) -> &'static str {
        match (self.ok, self.unknown) {
            (false, _) => "FAIL",
            (true, true) => "??  ",
            (true, false) => "ok  ",
        }
    }

    /// Passes when `violation` is `None`; otherwise fails with it.
    pub fn from(checker: &str, violation: Option<String>, checked: impl Into<String>) -> Verdict {
        match violation {
            None => Verdict::pass(checker, checked),
            Some(v) => Verdict::fail(checker, v),
        }
    }
}
