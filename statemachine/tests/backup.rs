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
