//! Persisted formats across releases (docs/DESIGN.md §48, §51): this build reads what
//! the two previous releases wrote — their log entries, their snapshots and their
//! audit rows — and replaying an old log under the baseline rule version rebuilds
//! exactly the old snapshot; until rule version 3 is activated it writes the previous
//! release's format, byte for byte; a blob of a newer format is refused by name, never
//! misread.
//!
//! `tests/fixtures/format5` was written by commit 62f6f77 (format 5),
//! `tests/fixtures/format6` by commit d1226df (format 6) and `tests/fixtures/format7` by
//! commit b97dccb (format 7, at rule version 4), with `examples/format_fixture.rs`.

use allot_statemachine::codec::{self, CodecError, FORMAT_VERSION, WIRE_FORMAT};
use allot_statemachine::version::{Rules, RULES_BASELINE};
use allot_statemachine::{apply, check_invariants, verify_chain, AuditEvent, Entry, State};

fn fixture(format: u8, name: &str) -> Vec<u8> {
    // The crate's directory as the test runner reports it when the test runs (cargo and
    // nextest set it), not as compiled in: a build reused from a checkout at another
    // path (a shared target directory) still finds this checkout's fixtures.
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    let path = format!("{dir}/tests/fixtures/format{format}/{name}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Reads a release's fixture, replays its log under this build and checks that the
/// state and the audit events are the old ones; returns the old state.
fn replays_to_its_own_snapshot(format: u8) -> State {
    let (entries, state, events) = (
        fixture(format, "entries.bin"),
        fixture(format, "state.bin"),
        fixture(format, "events.bin"),
    );
    for blob in [&entries, &state, &events] {
        assert_eq!(blob[0], format, "the fixture is format {format}");
    }
    let entries: Vec<Entry> = codec::decode(&entries).expect("old log entries read");
    let old: State = State::decode(&state).expect("old snapshot read");
    let old_events: Vec<AuditEvent> = codec::decode(&events).expect("old audit rows read");
    assert_eq!(
        old.rules,
        Rules::default(),
        "the fixtures are at the baseline rules"
    );
    assert_eq!(old.rules.active, RULES_BASELINE);
    assert!(check_invariants(&old).is_ok());
    assert!(old.ledger.buckets.len() >= 3 && !old.scheduler.jobs.is_empty());
    assert!(old.idempotency.len() >= 20, "{}", old.idempotency.len());

    // The same log applied by this build, under the baseline rules, gives the state and
    // the audit trail the old release wrote, event for event.
    let mut replayed = State::new(old.config.clone());
    let mut events = Vec::new();
    for e in &entries {
        events.extend(apply(&mut replayed, e).expect("apply").events);
    }
    assert_eq!(
        replayed, old,
        "replaying the old log rebuilds the old snapshot"
    );
    assert_eq!(events, old_events, "and the old audit events");
    assert!(verify_chain(&Default::default(), &events).is_ok());
    old
}

#[test]
fn the_release_before_lasts_log_replays_to_its_own_snapshot() {
    let old = replays_to_its_own_snapshot(5);
    // Written again, it is format 6 (the rules are still the baseline) and reads back.
    let now = old.encode();
    assert_eq!(now[0], WIRE_FORMAT);
    assert_eq!(State::decode(&now).expect("format 6"), old);
}

#[test]
fn the_previous_releases_log_replays_to_its_own_snapshot_and_is_written_as_it_wrote_it() {
    let old = replays_to_its_own_snapshot(6);
    // Until rule version 3 this build writes the previous release's format, byte for
    // byte, so a node of that release reads every snapshot (and the state hashes agree).
    let written = fixture(6, "state.bin");
    assert_eq!(old.encode(), written, "format 6, byte for byte");
    let mut h = sha2_of(&written[1..]);
    assert_eq!(old.state_hash(), std::mem::take(&mut h));
}

fn sha2_of(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).into()
}

#[test]
fn rule_version_3_writes_format_7_and_it_reads_back() {
    use allot_statemachine::testkit::*;
    use allot_statemachine::Command;
    let mut h = Harness::world();
    h.grant(
        1,
        allot_statemachine::Account::Org(ORG),
        allot_statemachine::BucketKind::Paid,
        credits(100),
        None,
    );
    let before = h.state.encode();
    assert_eq!(before[0], WIRE_FORMAT);
    h.ok(Command::ActivateVersion { version: 3 });
    h.ok(Command::CreateHold(Harness::hold_spec(5, credits(2))));
    let after = h.state.encode();
    assert_eq!(after[0], codec::COMPACT_TABLE_FORMAT);
    assert_eq!(codec::COMPACT_TABLE_FORMAT, 7);
    let back = State::decode(&after).expect("format 7");
    assert_eq!(back, h.state);
    assert_eq!(back.encode(), after, "canonical");
    assert_eq!(back.state_hash(), h.state.state_hash());
    assert_eq!(sha2_of(&after[1..]), h.state.state_hash());
    // The compact layout is smaller than format 6's for the same records.
    let mut as_v6 = h.state.clone();
    as_v6.rules = Rules::default();
    assert!(
        after.len() < as_v6.encode().len(),
        "{} vs {}",
        after.len(),
        as_v6.encode().len()
    );
    // And a decoded state goes on applying as the original does.
    let mut twin = back;
    let mut h2 = h;
    h2.ok(Command::Capture {
        hold: allot_statemachine::HoldId(5),
        amount_micro: credits(1),
    });
    let e = h2.entries.last().expect("an entry").clone();
    apply(&mut twin, &e).expect("apply");
    assert_eq!(twin.state_hash(), h2.state.state_hash());
}

/// `tests/fixtures/format7`, written by commit b97dccb (format 7, the last commit
/// before format 8) at rule version 4 — as every node of that commit wrote snapshots
/// once version 4 was active — with a preemption in its grace when the log ends. This
/// build replays its log to the same state and events, and writes it again byte for
/// byte as that commit did: a node of it reads every snapshot until version 5 is
/// activated. Version 5's activation then fills in the fence instants from the leases
/// and the grace timer, and the state is written in format 8.
#[test]
fn a_format_7_state_at_rule_version_4_is_read_and_written_as_it_was_until_version_5() {
    use allot_statemachine::scheduler::JobState;
    use allot_statemachine::{Command, Request};
    let (entries, state, events) = (
        fixture(7, "entries.bin"),
        fixture(7, "state.bin"),
        fixture(7, "events.bin"),
    );
    assert_eq!(state[0], 7, "the snapshot is format 7");
    assert_eq!((entries[0], events[0]), (WIRE_FORMAT, WIRE_FORMAT));
    let entries: Vec<Entry> = codec::decode(&entries).expect("old log entries read");
    let old = State::decode(&state).expect("old snapshot read");
    let old_events: Vec<AuditEvent> = codec::decode(&events).expect("old audit rows read");
    assert_eq!(old.rules.active, 4);
    assert!(
        check_invariants(&old).is_ok(),
        "{:?}",
        check_invariants(&old)
    );
    let mut replayed = State::new(old.config.clone());
    let mut replayed_events = Vec::new();
    for e in &entries {
        replayed_events.extend(apply(&mut replayed, e).expect("apply").events);
    }
    assert_eq!(replayed, old, "the log replays to the old snapshot");
    assert_eq!(replayed_events, old_events, "and to the old audit events");
    assert_eq!(
        old.encode(),
        state,
        "format 7, byte for byte, under version 4"
    );

    // Version 5: the fence instants are filled in from the leases and grace timers.
    let mut now = old.clone();
    let activation = Entry {
        log_index: old.last_applied.unwrap_or(0) + 1,
        logical_time_ms: old.time_ms + 1,
        requests: vec![Request {
            actor: allot_statemachine::testkit::ADMIN,
            request_id: 9_999_999,
            org: None,
            command: Command::ActivateVersion { version: 5 },
        }],
    };
    apply(&mut now, &activation).expect("activation");
    assert_eq!(now.rules.active, 5);
    let cfg = &now.config.scheduler;
    let fence = &now.scheduler.fence;
    let renewals: Vec<_> = (now.scheduler.nodes.sorted().into_iter())
        .map(|(id, n)| (*id, n.lease_until_ms - cfg.node_lease_ms))
        .collect();
    assert_eq!(renewals.len(), 2);
    assert_eq!(
        fence.renewed_ms.clone().into_iter().collect::<Vec<_>>(),
        renewals
    );
    let preempting: Vec<_> = (now.scheduler.jobs.sorted().into_iter())
        .filter(|(_, j)| j.state == JobState::Preempting)
        .map(|(id, j)| (*id, j.grace_at.expect("in its grace") - cfg.grace_ms))
        .collect();
    assert_eq!(preempting.len(), 1, "the fixture ends mid-grace");
    assert_eq!(
        fence.preempted_ms.clone().into_iter().collect::<Vec<_>>(),
        preempting
    );
    assert!(check_invariants(&now).is_ok());
    let written = now.encode();
    assert_eq!(written[0], FORMAT_VERSION);
    assert_eq!(FORMAT_VERSION, 8);
    let back = State::decode(&written).expect("format 8");
    assert_eq!(back, now);
    assert_eq!(back.encode(), written, "canonical");
    assert_eq!(back.state_hash(), now.state_hash());
}

/// Found by the second review of the twelfth session: a state's format follows from
/// its rule version, and nothing checked it. A format-7 state claiming version 5 (whose
/// snapshots are format 8) loaded with no fence instants and no retired grant ids,
/// and would have acted apart from every version-5 replica. Such a blob is refused.
#[test]
fn a_state_whose_format_does_not_match_its_rule_version_is_refused() {
    let state = fixture(7, "state.bin");
    let old = State::decode(&state).expect("format 7 at version 4");
    // The rules are encoded right before the result-dedup tables, last in format 7.
    let mut tail = Vec::new();
    codec::encode_into(&mut tail, &old.rules);
    codec::encode_into(&mut tail, &old.scheduler.dedup);
    assert!(state.ends_with(&tail), "the layout this test edits");
    let mut claimed = old.rules.clone();
    claimed.active = 5;
    for a in &mut claimed.activations {
        if a.0 == 4 {
            a.0 = 5;
        }
    }
    let mut forged_tail = Vec::new();
    codec::encode_into(&mut forged_tail, &claimed);
    codec::encode_into(&mut forged_tail, &old.scheduler.dedup);
    assert_eq!(forged_tail.len(), tail.len());
    let mut forged = state[..state.len() - tail.len()].to_vec();
    forged.extend_from_slice(&forged_tail);
    match State::decode(&forged) {
        Err(CodecError::Malformed(m)) => {
            assert!(m.contains("format-7 state at rule version 5"), "{m}")
        }
        other => panic!(
            "a format-7 state at version 5 was read: {:?}",
            other.map(|s| s.rules)
        ),
    }
}

#[test]
fn a_newer_truncated_or_corrupted_snapshot_is_refused_without_panicking() {
    for format in [5, 6, 7] {
        corrupted_snapshots_are_refused(fixture(format, "state.bin"));
    }
    let mut h = allot_statemachine::testkit::Harness::world();
    h.ok(allot_statemachine::Command::ActivateVersion { version: 3 });
    corrupted_snapshots_are_refused(h.state.encode());
}

fn corrupted_snapshots_are_refused(state: Vec<u8>) {
    let mut newer = state.clone();
    newer[0] = FORMAT_VERSION + 1;
    assert_eq!(
        State::decode(&newer),
        Err(CodecError::NewerFormat(FORMAT_VERSION + 1))
    );
    let msg = State::decode(&newer).unwrap_err().to_string();
    assert!(msg.contains("newer release"), "{msg}");
    let mut older = state.clone();
    older[0] = 4;
    assert_eq!(
        State::decode(&older),
        Err(CodecError::UnsupportedVersion(4))
    );
    // Every truncation and a flipped byte anywhere: a typed error (or, for a flip that
    // lands in a value, a state that decodes), never a panic.
    for len in 0..state.len() {
        assert!(State::decode(&state[..len]).is_err(), "truncated to {len}");
    }
    let mut trailing = state.clone();
    trailing.push(0);
    assert!(matches!(
        State::decode(&trailing),
        Err(CodecError::Malformed(_))
    ));
    for i in (1..state.len()).step_by(7) {
        let mut flipped = state.clone();
        flipped[i] ^= 0x5a;
        let _ = State::decode(&flipped);
    }
}

mod rule_versions {
    use allot_statemachine::outcome::{CommandError, JobProblem, Reply};
    use allot_statemachine::testkit::*;
    use allot_statemachine::version::{JOB_DURATION_MS_MAX_V2, RULES_MAX};
    use allot_statemachine::{Command, Tier};

    fn long_job(h: &mut Harness, id: u64) -> Result<Reply, CommandError> {
        h.grant(
            900 + id,
            allot_statemachine::Account::Org(ORG),
            allot_statemachine::BucketKind::Paid,
            credits(1_000_000),
            None,
        );
        let mut spec = Harness::job_spec(id, Tier::PAID, vec![a100()], 1);
        spec.max_duration_ms = 60 * 86_400_000;
        h.run(Command::SubmitJob(spec))
    }

    /// A rule of version 2 (jobs up to 90 days) is off until `ActivateVersion`, then on
    /// from that entry; versions never go back and only an admin moves them.
    /// Every kind of command newer than the baseline is refused, as a whole, before
    /// the rule version that introduced it is active (an older replica would read it as
    /// malformed and apply a tick), and taken from that version on.
    #[test]
    fn a_command_kind_is_refused_before_its_rule_version() {
        use allot_statemachine::validate::validate_command;
        use allot_statemachine::DedupKey;
        let mut commands = largest_commands();
        commands.extend(world_commands());
        commands.push(Command::SubmitJobDedup {
            spec: Harness::job_spec(1, Tier::PAID, vec![a100()], 1),
            key: DedupKey(b"k".to_vec()),
        });
        let newer: Vec<_> = commands.iter().filter(|c| c.introduced_in() > 1).collect();
        assert!(!newer.is_empty(), "the check covers a newer kind");
        for c in &commands {
            let v = c.introduced_in();
            for rules in 1..v {
                assert_eq!(
                    validate_command(c, rules),
                    Err(CommandError::UnsupportedRulesVersion {
                        active: rules,
                        newest: RULES_MAX
                    }),
                    "{} under rule version {rules}",
                    c.name()
                );
            }
            assert!(
                !matches!(
                    validate_command(c, v),
                    Err(CommandError::UnsupportedRulesVersion { .. })
                ),
                "{} under its own rule version {v}",
                c.name()
            );
        }
    }

    #[test]
    fn a_new_rule_switches_on_only_at_its_activation() {
        let mut h = Harness::world();
        h.fleet(&[(1, a100(), 8, 80)]);
        assert_eq!(
            long_job(&mut h, 1),
            Err(CommandError::InvalidJob(JobProblem::MaxDuration)),
            "60-day jobs are refused under the baseline rules"
        );
        let tenant_try = h.run_as(tenant(ORG), Command::ActivateVersion { version: 2 });
        assert_eq!(tenant_try, Err(CommandError::Unauthorized));
        assert_eq!(
            h.run(Command::ActivateVersion {
                version: RULES_MAX + 1
            }),
            Err(CommandError::UnsupportedRulesVersion {
                active: 1,
                newest: RULES_MAX
            })
        );
        assert_eq!(h.state.rules.active, 1, "refusals change nothing");
        assert_eq!(
            h.ok(Command::ActivateVersion { version: 2 }),
            Reply::RulesActive { version: 2 }
        );
        let at = h.index;
        assert_eq!(h.state.rules.activations, vec![(2, at, h.now)]);
        assert!(matches!(
            long_job(&mut h, 2),
            Ok(Reply::JobSubmitted { .. })
        ));
        let mut too_long = Harness::job_spec(3, Tier::PAID, vec![a100()], 1);
        too_long.max_duration_ms = JOB_DURATION_MS_MAX_V2 + 1;
        assert_eq!(
            h.run(Command::SubmitJob(too_long)),
            Err(CommandError::InvalidJob(JobProblem::MaxDuration))
        );
        // A repeat is a no-op; going back is refused.
        assert_eq!(
            h.ok(Command::ActivateVersion { version: 2 }),
            Reply::RulesActive { version: 2 }
        );
        assert_eq!(h.state.rules.activations.len(), 1);
        assert_eq!(
            h.run(Command::ActivateVersion { version: 1 }),
            Err(CommandError::UnsupportedRulesVersion {
                active: 2,
                newest: RULES_MAX
            })
        );
        // Version 3 may follow; it does not undo version 2.
        assert_eq!(
            h.ok(Command::ActivateVersion { version: 3 }),
            Reply::RulesActive { version: 3 }
        );
        assert!(matches!(
            long_job(&mut h, 4),
            Ok(Reply::JobSubmitted { .. })
        ));
        // The same log gives the same state (activation included).
        let mut again = allot_statemachine::State::new(h.state.config.clone());
        for e in &h.entries {
            allot_statemachine::apply(&mut again, e).expect("apply");
        }
        assert_eq!(again.state_hash(), h.state.state_hash());
    }
}
