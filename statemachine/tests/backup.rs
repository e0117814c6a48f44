//! The backup format's verification: a faithful copy verifies; an edited state, a missing
//! or edited audit event, an edited or misplaced command batch, or a trail that stops
//! short of the state's chain head does not. And shards whose token tables disagree are
//! named.

use allot_statemachine::backup::{
    token_disagreements, AuditRow, AuditRowKind, BackupError, LogPosition, ShardBackup,
};
use allot_statemachine::testkit::*;
use allot_statemachine::*;

/// A shard with some history, copied the way the node copies it: one events row per
/// event (keyed by its sequence number) and one batch row per entry.
fn backup_of(h: &Harness) -> ShardBackup {
    let mut audit: Vec<AuditRow> = h
        .events
        .iter()
        .map(|e| AuditRow {
            kind: AuditRowKind::Events,
            key: e.seq,
            value: codec::encode(&vec![e.clone()]),
        })
        .collect();
    audit.extend(h.entries.iter().map(|e| AuditRow {
        kind: AuditRowKind::Batch,
        key: e.log_index,
        value: codec::encode(e),
    }));
    ShardBackup {
        shard: 0,
        shards: 1,
        position: Some(LogPosition {
            term: 1,
            index: h.index,
        }),
        members: vec![(1, "127.0.0.1:7101".into())],
        state: h.state.encode(),
        state_hash: h.state.state_hash(),
        logical_time_ms: h.state.time_ms,
        audit,
    }
}

fn history() -> Harness {
    let mut h = Harness::world();
    h.grant(
        1,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(100),
        None,
    );
    h.ok(Command::CreateHold(Harness::hold_spec(5, credits(10))));
    h.ok(Command::Capture {
        hold: HoldId(5),
        amount_micro: credits(3),
    });
    h.ok(Command::ReleaseHold { hold: HoldId(5) });
    h
}

#[test]
fn a_faithful_copy_verifies_and_round_trips() {
    let h = history();
    let b = backup_of(&h);
    let (state, summary) = b.verify().unwrap();
    assert_eq!(state.state_hash(), h.state.state_hash());
    assert_eq!(summary.audit_events, h.events.len() as u64);
    assert_eq!(summary.audit_batches, h.entries.len() as u64);
    let again = ShardBackup::decode(&b.encode()).unwrap();
    assert_eq!(again, b);
}

#[test]
fn every_kind_of_damage_is_refused() {
    let h = history();
    let good = backup_of(&h);
    let events = |b: &ShardBackup| {
        b.audit
            .iter()
            .position(|r| r.kind == AuditRowKind::Events)
            .unwrap()
    };
    let batch = |b: &ShardBackup| {
        b.audit
            .iter()
            .rposition(|r| r.kind == AuditRowKind::Batch)
            .unwrap()
    };

    let mut b = good.clone();
    b.state_hash[0] ^= 1;
    assert_eq!(b.verify().unwrap_err(), BackupError::HashMismatch);

    // An event missing from the middle of the trail.
    let mut b = good.clone();
    b.audit.remove(events(&b) + 1);
    assert!(matches!(b.verify(), Err(BackupError::AuditChain(_))));

    // The trail stops before the state's head.
    let mut b = good.clone();
    let last_event = b
        .audit
        .iter()
        .rposition(|r| r.kind == AuditRowKind::Events)
        .unwrap();
    b.audit.remove(last_event);
    assert!(matches!(
        b.verify(),
        Err(BackupError::AuditIncomplete { .. })
    ));

    // An edited event (its hash no longer chains).
    let mut b = good.clone();
    let i = events(&b) + 2;
    let mut ev: Vec<AuditEvent> = codec::decode(&b.audit[i].value).unwrap();
    ev[0].time_ms += 1;
    b.audit[i].value = codec::encode(&ev);
    assert!(matches!(b.verify(), Err(BackupError::AuditChain(_))));

    // An edited command: the events still chain, but its digest does not match.
    let mut b = good.clone();
    let i = batch(&b);
    let mut entry: Entry = codec::decode(&b.audit[i].value).unwrap();
    entry.requests[0].command = Command::ReleaseHold { hold: HoldId(6) };
    b.audit[i].value = codec::encode(&entry);
    assert!(matches!(b.verify(), Err(BackupError::AuditCommands(_))));

    // A batch row missing: its commands cannot be checked.
    let mut b = good.clone();
    b.audit.remove(batch(&b));
    assert!(matches!(b.verify(), Err(BackupError::AuditCommands(_))));

    // A batch filed under another entry's key, or past the backup's position.
    let mut b = good.clone();
    let i = batch(&b);
    b.audit[i].key += 1;
    assert!(matches!(b.verify(), Err(BackupError::AuditRow { .. })));
    let mut b = good.clone();
    b.position = Some(LogPosition {
        term: 1,
        index: h.index - 1,
    });
    assert!(matches!(b.verify(), Err(BackupError::AuditRow { .. })));

    // Not a backup at all, and a shard outside its cluster.
    assert!(matches!(
        ShardBackup::decode(b"nonsense"),
        Err(BackupError::Codec(_))
    ));
    let mut b = good;
    b.shard = 3;
    assert!(matches!(
        b.verify(),
        Err(BackupError::ShardOutOfRange { .. })
    ));
}

/// The operator's principals (admin and agent: installed on every shard) are compared
/// across a backup's shards; an org's own principals live only on its home shard and
/// are not (issue 20: tenant tokens on a multi-shard cluster).
#[test]
fn shards_whose_token_tables_disagree_are_named() {
    let token = |h: &mut Harness, principal: u64, scope| {
        h.ok(Command::CreateToken {
            principal: PrincipalId(principal),
            digest: TokenDigest::of(format!("token-{principal}").as_bytes()),
            scope,
            expires_at_ms: None,
        });
    };
    let mut a = Harness::world();
    let mut b = Harness::world();
    for h in [&mut a, &mut b] {
        token(h, 40, security::Scope::Admin);
        token(h, 41, security::Scope::Agent(NodeId(7)));
    }
    // An org token on one shard only (its org's home) is no disagreement.
    token(&mut a, 42, security::Scope::Org(ORG));
    assert!(token_disagreements(&[&a.state, &b.state]).is_empty());
    // A revocation reached shard a but not yet shard b when they were copied.
    a.ok(Command::RevokeToken {
        principal: PrincipalId(41),
    });
    assert_eq!(
        token_disagreements(&[&a.state, &b.state]),
        vec![PrincipalId(41)]
    );
}

/// Streams `b` in frames of `frame` bytes.
fn streamed(b: &ShardBackup, frame: usize) -> Vec<u8> {
    backup::write_streamed(b, Vec::new(), frame).unwrap()
}

fn read(bytes: &[u8]) -> Result<backup::VerifiedBackup, BackupError> {
    backup::read_verified(bytes, |_| Ok::<(), ()>(())).map_err(|e| match e {
        backup::stream::ReadError::Backup(e) => e,
        backup::stream::ReadError::Sink(()) => unreachable!("the sink accepts every row"),
    })
}

/// The streamed layout carries the same backup: every frame size (the state cut at odd
/// places, one row per frame or all in one) reads back to the same state, summary and
/// rows, in log order (each entry's commands before its events).
#[test]
fn a_streamed_backup_reads_back_whatever_its_frame_size() {
    let h = history();
    let b = backup_of(&h);
    let (_, expected) = b.verify().unwrap();
    let mut sizes = Vec::new();
    for frame in [1, 7, 64, 4096, backup::stream::FRAME_TARGET] {
        let bytes = streamed(&b, frame);
        sizes.push(bytes.len());
        let mut rows = Vec::new();
        let v = backup::read_verified(&bytes[..], |r| {
            rows.extend_from_slice(r);
            Ok::<(), ()>(())
        })
        .unwrap_or_else(|e| panic!("frame {frame}: {e:?}"));
        assert_eq!(v.summary, expected, "frame {frame}");
        assert_eq!(v.state, b.state);
        assert_eq!(v.header.audit_head, h.state.audit);
        assert_eq!(rows.len(), b.audit.len());
        let mut sorted = rows.clone();
        sorted.sort_by_key(|r| (r.kind == AuditRowKind::Batch, r.key));
        let mut original = b.audit.clone();
        original.sort_by_key(|r| (r.kind == AuditRowKind::Batch, r.key));
        assert_eq!(sorted, original);
        // Log order: no events row precedes the batch row of an earlier entry.
        let index = |r: &AuditRow| match r.kind {
            AuditRowKind::Batch => (r.key, 0),
            AuditRowKind::Events => (backup::stream::events_row_index(&r.value).unwrap(), 1),
        };
        assert!(rows.windows(2).all(|w| index(&w[0]) <= index(&w[1])));
        // The whole-file reader takes it too.
        let whole = ShardBackup::decode(&bytes).unwrap();
        assert_eq!(whole.verify().unwrap().1, expected);
    }
    assert!(sizes[0] > sizes[4], "smaller frames, more frame heads");
}

/// The layout of the releases before streaming (one encoded `ShardBackup`) is still read.
#[test]
fn a_backup_of_the_previous_layout_is_still_read() {
    let h = history();
    let b = backup_of(&h);
    let v = read(&b.encode()).unwrap();
    assert_eq!(v.summary, b.verify().unwrap().1);
    assert_eq!(v.state, b.state);
}

/// A file cut anywhere, or with any byte changed, is refused with a typed error and
/// never read as a backup (nor panics).
#[test]
fn a_truncated_or_corrupted_streamed_backup_is_refused() {
    let h = history();
    let bytes = streamed(&backup_of(&h), 97);
    for cut in 0..bytes.len() {
        match read(&bytes[..cut]) {
            Err(BackupError::Truncated) => {}
            // Fewer than 7 bytes are not recognisably a streamed backup; the old-layout
            // reader refuses them.
            Err(BackupError::Codec(_)) if cut < 7 => {}
            other => panic!("cut at {cut}: {:?}", other.map(|v| v.summary)),
        }
    }
    for at in (0..bytes.len()).step_by(3) {
        let mut bad = bytes.clone();
        bad[at] ^= 0x40;
        assert!(read(&bad).is_err(), "byte {at} changed, still read");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(read(&longer), Err(BackupError::Frame(_))));
}

/// The header is checked against the decoded state; a newer layout and a hostile frame
/// length are refused before anything is allocated for them.
#[test]
fn a_header_that_lies_a_newer_layout_or_a_huge_frame_is_refused() {
    let h = history();
    let b = backup_of(&h);
    let mut header =
        backup::BackupHeader::of(&h.state, 0, 1, b.clone().position, b.members.clone());
    header
        .tokens
        .insert(PrincipalId(99), (false, Default::default()));
    let mut w = backup::BackupWriter::start(Vec::new(), &header).unwrap();
    w.state(&h.state).unwrap();
    let ok = |r: &AuditRow| Ok::<AuditRow, BackupError>(r.clone());
    let (ev, ba): (Vec<&AuditRow>, Vec<&AuditRow>) =
        b.audit.iter().partition(|r| r.kind == AuditRowKind::Events);
    for row in backup::stream::merge_rows(ev.into_iter().map(ok), ba.into_iter().map(ok)) {
        w.audit_row(row.unwrap()).unwrap();
    }
    let lying = w.finish().unwrap();
    assert_eq!(
        read(&lying).err(),
        Some(BackupError::HeaderMismatch("operator tokens"))
    );

    let mut newer = streamed(&b, 4096);
    newer[7] += 1;
    assert_eq!(read(&newer).err(), Some(BackupError::NewerLayout(2)));

    let mut huge = backup::stream::MAGIC.to_vec();
    huge.push(1);
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(read(&huge), Err(BackupError::Frame(_))));
}

/// Rows out of log order (all events before all batches, as the old layout kept them)
/// cannot be checked in one pass and are refused.
#[test]
fn audit_rows_out_of_log_order_are_refused() {
    let h = history();
    let b = backup_of(&h);
    let mut w = backup::BackupWriter::start(
        Vec::new(),
        &backup::BackupHeader::of(&h.state, 0, 1, b.position, b.members.clone()),
    )
    .unwrap();
    w.state(&h.state).unwrap();
    for row in &b.audit {
        w.audit_row(row.clone()).unwrap();
    }
    let bytes = w.finish().unwrap();
    assert!(matches!(read(&bytes), Err(BackupError::AuditCommands(_))));
}

/// Entries the state machine never sees (a new leader's blank entry, a membership
/// change) advance a backup's position past the state's own last index: still a
/// faithful copy (a backup taken right after a node started was refused by `verify`).
#[test]
fn a_position_past_the_states_last_entry_is_a_faithful_copy() {
    let h = history();
    let mut b = backup_of(&h);
    b.position = Some(LogPosition {
        term: 2,
        index: h.index + 2,
    });
    let v = read(&streamed(&b, 4096)).unwrap();
    assert_eq!(v.summary.position.unwrap().index, h.index + 2);
}
