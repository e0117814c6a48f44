//! Persisted formats across releases (docs/DESIGN.md §48): this build reads what the
//! previous release wrote — its log entries, its snapshot and its audit rows — and
//! replaying the old log under the baseline rule version rebuilds exactly the old
//! snapshot; a blob of a newer format is refused by name, never misread.
//!
//! `tests/fixtures/format5` was written by commit 62f6f77 (format 5) with
//! `examples/format_fixture.rs`.

use allot_statemachine::codec::{self, CodecError, FORMAT_VERSION};
use allot_statemachine::version::{Rules, RULES_BASELINE};
use allot_statemachine::{apply, check_invariants, verify_chain, AuditEvent, Entry, State};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/format5/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_previous_releases_log_replays_to_its_own_snapshot() {
    let (entries, state, events) = (
        fixture("entries.bin"),
        fixture("state.bin"),
        fixture("events.bin"),
    );
    for blob in [&entries, &state, &events] {
        assert_eq!(blob[0], 5, "the fixture is format 5");
    }
    let entries: Vec<Entry> = codec::decode(&entries).expect("format-5 log entries read");
    let old: State = State::decode(&state).expect("format-5 snapshot read");
    let old_events: Vec<AuditEvent> = codec::decode(&events).expect("format-5 audit rows read");
    assert_eq!(
        old.rules,
        Rules::default(),
        "a format-5 state is at the baseline rules"
    );
    assert_eq!(old.rules.active, RULES_BASELINE);
    assert!(check_invariants(&old).is_ok());
    assert!(old.ledger.buckets.len() >= 3 && !old.scheduler.jobs.is_empty());

    // The same log applied by this build, under the baseline rules, gives the state and
    // the audit trail the previous release wrote, event for event.
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

    // Written again, it is the current format and reads back the same.
    let now = old.encode();
    assert_eq!(now[0], FORMAT_VERSION);
    assert_eq!(State::decode(&now).expect("current format"), old);
}

#[test]
fn a_newer_truncated_or_corrupted_snapshot_is_refused_without_panicking() {
    let state = fixture("state.bin");
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
        // The same log gives the same state (activation included).
        let mut again = allot_statemachine::State::new(h.state.config.clone());
        for e in &h.entries {
            allot_statemachine::apply(&mut again, e).expect("apply");
        }
        assert_eq!(again.state_hash(), h.state.state_hash());
    }
}
