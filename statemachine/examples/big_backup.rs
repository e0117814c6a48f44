//! Writes a streamed backup of a one-shard cluster whose shard holds N accounts (an org
//! and a paid bucket each), built by applying real entries — 4,000 orgs per entry —
//! with the audit rows the node would have stored for them (one events row and one
//! batch row per entry), then ticks past the idempotency retention so the records are
//! pruned as on a live shard. `allot-node restore` turns it into a data dir: how the
//! backup benchmark of a 1,000,000-account shard gets its shard (DESIGN §41).
//!
//! cargo run --release -p allot-statemachine --example big_backup -- \
//!     --accounts 1000000 --member 1=127.0.0.1:7301 --out /tmp/big/shard-0.allot-backup

use allot_statemachine::backup::stream::FRAME_TARGET;
use allot_statemachine::backup::{AuditRow, AuditRowKind, BackupHeader, BackupWriter, LogPosition};
use allot_statemachine::testkit::*;
use allot_statemachine::*;
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut accounts = 1_000_000u64;
    let mut out = std::path::PathBuf::from("shard-0.allot-backup");
    let mut member = (1u64, "127.0.0.1:7301".to_string());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--accounts" => accounts = v.parse()?,
            "--out" => out = v.into(),
            "--member" => {
                let (id, addr) = v.split_once('=').ok_or("--member id=host:port")?;
                member = (id.parse()?, addr.to_string());
            }
            _ => return Err(format!("unknown flag {a}").into()),
        }
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let started = std::time::Instant::now();
    let mut state = State::default();
    // Rows as the node stores them, in log order, spooled to a temporary file.
    let spool_path = out.with_extension("rows");
    let mut spool = std::io::BufWriter::new(std::fs::File::create(&spool_path)?);
    let mut rows = 0u64;
    let mut index = 0u64;
    let mut rid = 0u128;
    let mut apply_entry = |state: &mut State,
                           requests: Vec<Request>,
                           t: u64|
     -> Result<(), Box<dyn std::error::Error>> {
        index += 1;
        let entry = Entry {
            log_index: index,
            logical_time_ms: t,
            requests,
        };
        let out = apply(state, &entry)?;
        let mut put = |row: AuditRow| -> std::io::Result<()> {
            let bytes = codec::encode(&row);
            spool.write_all(&(bytes.len() as u64).to_le_bytes())?;
            spool.write_all(&bytes)
        };
        put(AuditRow {
            kind: AuditRowKind::Batch,
            key: index,
            value: codec::encode(&entry),
        })?;
        rows += 1;
        if let Some(first) = out.events.first() {
            put(AuditRow {
                kind: AuditRowKind::Events,
                key: first.seq,
                value: codec::encode(&out.events),
            })?;
            rows += 1;
        }
        Ok(())
    };
    let req = |rid: &mut u128, command| {
        *rid += 1;
        Request {
            actor: ADMIN,
            request_id: *rid,
            org: None,
            command,
        }
    };
    for start in (1..=accounts).step_by(4_000) {
        let mut reqs = Vec::with_capacity(8_000);
        for o in start..(start + 4_000).min(accounts + 1) {
            for command in Harness::account_commands(o) {
                reqs.push(req(&mut rid, command));
            }
        }
        apply_entry(&mut state, reqs, T0_MS)?;
    }
    let mut t = T0_MS + state.config.idempotency_retention_ms;
    while !state.idempotency.is_empty() {
        t += 1_000;
        apply_entry(&mut state, vec![], t)?;
    }
    spool.flush()?;
    drop(spool);
    let rows_written = rows;
    eprintln!(
        "applied {index} entries ({accounts} accounts, {} audit events, {rows_written} rows) in {:?}",
        state.audit.next_seq,
        started.elapsed()
    );

    let header = BackupHeader::of(
        &state,
        0,
        1,
        Some(LogPosition { term: 1, index }),
        vec![member],
    );
    let file = std::io::BufWriter::with_capacity(FRAME_TARGET, std::fs::File::create(&out)?);
    let mut w = BackupWriter::start(file, &header)?;
    w.state(&state)?;
    drop(state);
    let mut spool = std::io::BufReader::new(std::fs::File::open(&spool_path)?);
    let mut len = [0u8; 8];
    for _ in 0..rows_written {
        std::io::Read::read_exact(&mut spool, &mut len)?;
        let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
        std::io::Read::read_exact(&mut spool, &mut bytes)?;
        w.audit_row(codec::decode(&bytes)?)?;
    }
    let file = w.finish()?;
    file.into_inner()?.sync_all()?;
    std::fs::remove_file(&spool_path)?;
    eprintln!(
        "wrote {} ({} bytes) in {:?}",
        out.display(),
        std::fs::metadata(&out)?.len(),
        started.elapsed()
    );
    Ok(())
}
