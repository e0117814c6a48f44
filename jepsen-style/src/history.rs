//! The history of a run: every client operation as an `invoke` followed by its
//! completion (`ok`: happened; `fail`: definitely did not happen; `info`: unknown —
//! a timeout or lost connection), and every nemesis action (process -1). Written as
//! JSON lines: `{index, time_ns, process, type, f, value, node, error}`.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

/// The process number of the nemesis.
pub const NEMESIS: i64 = -1;
/// The process number of set-up and final reads (run alone, no faults active).
pub const CONTROL: i64 = -2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpType {
    Invoke,
    Ok,
    Fail,
    Info,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Op {
    pub index: u64,
    pub time_ns: u64,
    pub process: i64,
    #[serde(rename = "type")]
    pub kind: OpType,
    pub f: String,
    pub value: Value,
    pub node: Option<u64>,
    pub error: Option<String>,
}

pub struct History {
    start: Instant,
    ops: Mutex<Vec<Op>>,
}

impl Default for History {
    fn default() -> Self {
        History {
            start: Instant::now(),
            ops: Mutex::default(),
        }
    }
}

impl History {
    pub fn record(
        &self,
        process: i64,
        kind: OpType,
        f: &str,
        value: Value,
        node: Option<u64>,
        error: Option<String>,
    ) -> u64 {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let index = ops.len() as u64;
        ops.push(Op {
            index,
            time_ns: self.start.elapsed().as_nanos() as u64,
            process,
            kind,
            f: f.to_string(),
            value,
            node,
            error,
        });
        index
    }

    pub fn invoke(&self, process: i64, f: &str, value: Value) -> u64 {
        self.record(process, OpType::Invoke, f, value, None, None)
    }

    pub fn nemesis(&self, f: &str, value: Value, node: Option<u64>) {
        self.record(NEMESIS, OpType::Info, f, value, node, None);
    }

    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn write_jsonl(&self, path: &Path) -> anyhow::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for op in self.ops() {
            serde_json::to_writer(&mut f, &op)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
        Ok(())
    }
}

pub fn read_jsonl(path: &Path) -> anyhow::Result<Vec<Op>> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| anyhow::anyhow!("line {}: {e}", i + 1)))
        .collect()
}

/// An operation with its completion (if any).
#[derive(Clone, Copy, Debug)]
pub struct Pair<'a> {
    pub invoke: &'a Op,
    pub done: Option<&'a Op>,
}

impl Pair<'_> {
    pub fn kind(&self) -> OpType {
        self.done.map_or(OpType::Info, |d| d.kind)
    }

    /// The completion's index, or `u64::MAX` for an op that never completed.
    pub fn done_index(&self) -> u64 {
        self.done.map_or(u64::MAX, |d| d.index)
    }
}

/// Pairs each client invocation with the next operation of the same process (each
/// process has at most one operation outstanding). Nemesis ops are skipped.
pub fn pairs(ops: &[Op]) -> Vec<Pair<'_>> {
    let mut open: std::collections::HashMap<i64, usize> = Default::default();
    let mut out: Vec<Pair> = Vec::new();
    for op in ops {
        if op.process == NEMESIS {
            continue;
        }
        match op.kind {
            OpType::Invoke => {
                open.insert(op.process, out.len());
                out.push(Pair {
                    invoke: op,
                    done: None,
                });
            }
            _ => {
                if let Some(i) = open.remove(&op.process) {
                    out[i].done = Some(op);
                }
            }
        }
    }
    out
}
