//! Bad input: every malformed, out-of-range, unknown-id or conflicting command gets a
//! typed error and leaves the ledger exactly as it was. Limits are tested at the bound.

use allot_statemachine::limits::*;
use allot_statemachine::testkit::*;
use allot_statemachine::*;

const P: Account = Account::Project(PROJECT);

fn grant(bucket: u64, owner: Account, amount: u64, expires_at_ms: Option<u64>) -> Command {
    Command::IssueGrant(Grant {
        bucket: BucketId(bucket),
        owner,
        kind: BucketKind::Paid,
        amount_micro: amount,
        expires_at_ms,
        priority: 0,
        policy: None,
        source_ref: None,
    })
}

/// A world with a bucket (1), an open unmetered hold (1) and a metered hold (2).
fn world() -> Harness {
    let mut h = Harness::world();
    h.grant(1, P, BucketKind::Paid, credits(100), None);
    h.ok(Command::CreateHold(Harness::hold_spec(1, credits(5))));
    h.ok(Command::CreateHold(Harness::hold_spec(2, credits(5))));
    h.ok(Command::StartMeter {
        hold: HoldId(2),
        attempt: 1,
        gpu_type: a100(),
        gpus: 1,
    });
    h
}

fn check(command: Command, expected: CommandError) {
    let mut h = world();
    let before = h.state.ledger.clone();
    let name = command.name();
    assert_eq!(h.run(command), Err(expected), "{name}");
    assert_eq!(
        h.state.ledger, before,
        "{name}: a rejected command changed the ledger"
    );
}

#[test]
fn rejected_commands_change_nothing() {
    let spec = Harness::hold_spec;
    let mut unknown_user = spec(9, 1);
    unknown_user.user = UserId(99);
    let mut unknown_project = spec(9, 1);
    unknown_project.project = ProjectId(99);
    let mut wrong_org = spec(9, 1);
    wrong_org.user = OTHER_USER;
    let mut bad_type = spec(9, 1);
    bad_type.gpu_types = vec![GpuType::new("a100")];
    let mut dup_type = spec(9, 1);
    dup_type.gpu_types = vec![a100(), a100()];
    let mut too_many_types = spec(9, 1);
    too_many_types.gpu_types = (0..=GPU_TYPES_PER_LIST_MAX)
        .map(|i| GpuType(format!("T{i}")))
        .collect();
    let long_ref = Grant {
        bucket: BucketId(9),
        owner: P,
        kind: BucketKind::Paid,
        amount_micro: 1,
        expires_at_ms: None,
        priority: 0,
        policy: None,
        source_ref: Some("x".repeat(SOURCE_REF_LEN_MAX + 1)),
    };
    let hb = |hold, attempt, progress_ppm| {
        Command::Heartbeat(Heartbeat {
            hold: HoldId(hold),
            attempt,
            seq: 1,
            progress_ppm,
            checkpoint: 0,
        })
    };
    let cases: Vec<(Command, CommandError)> = vec![
        // unknown ids
        (
            Command::CreateProject {
                project: ProjectId(99),
                org: OrgId(99),
            },
            CommandError::UnknownOrg,
        ),
        (
            Command::CreateUser {
                user: UserId(99),
                org: OrgId(99),
            },
            CommandError::UnknownOrg,
        ),
        (
            grant(9, Account::Project(ProjectId(99)), 1, None),
            CommandError::UnknownProject,
        ),
        (
            grant(9, Account::Org(OrgId(99)), 1, None),
            CommandError::UnknownOrg,
        ),
        (
            Command::CreateHold(unknown_project),
            CommandError::UnknownProject,
        ),
        (Command::CreateHold(unknown_user), CommandError::UnknownUser),
        (
            Command::Capture {
                hold: HoldId(99),
                amount_micro: 1,
            },
            CommandError::UnknownHold,
        ),
        (
            Command::TopUp {
                hold: HoldId(99),
                amount_micro: 1,
            },
            CommandError::UnknownHold,
        ),
        (
            Command::ReleaseHold { hold: HoldId(99) },
            CommandError::UnknownHold,
        ),
        (hb(99, 1, 0), CommandError::UnknownHold),
        (
            Command::Settle {
                hold: HoldId(99),
                attempt: 1,
                reason: SettleReason::Succeeded,
            },
            CommandError::UnknownHold,
        ),
        (
            Command::SetBudget {
                scope: BudgetScope::User(UserId(99)),
                budget: None,
            },
            CommandError::UnknownUser,
        ),
        (
            Command::StartMeter {
                hold: HoldId(1),
                attempt: 1,
                gpu_type: GpuType::new("B200"),
                gpus: 1,
            },
            CommandError::UnknownPrice(GpuType::new("B200")),
        ),
        (
            Command::Transfer {
                from: Account::Project(ProjectId(99)),
                to: P,
                amount_micro: 1,
            },
            CommandError::UnknownProject,
        ),
        // zero, negative-by-overflow and oversized amounts
        (grant(9, P, 0, None), CommandError::AmountZero),
        (
            grant(9, P, AMOUNT_MICRO_MAX + 1, None),
            CommandError::AmountTooLarge,
        ),
        (grant(9, P, u64::MAX, None), CommandError::AmountTooLarge),
        (Command::CreateHold(spec(9, 0)), CommandError::AmountZero),
        (
            Command::CreateHold(spec(9, u64::MAX)),
            CommandError::AmountTooLarge,
        ),
        (
            Command::Capture {
                hold: HoldId(1),
                amount_micro: 0,
            },
            CommandError::AmountZero,
        ),
        (
            Command::Capture {
                hold: HoldId(1),
                amount_micro: u64::MAX,
            },
            CommandError::AmountTooLarge,
        ),
        (
            Command::TopUp {
                hold: HoldId(1),
                amount_micro: 0,
            },
            CommandError::AmountZero,
        ),
        (
            Command::Transfer {
                from: P,
                to: Account::Org(ORG),
                amount_micro: 0,
            },
            CommandError::AmountZero,
        ),
        (
            Command::Capture {
                hold: HoldId(1),
                amount_micro: credits(6),
            },
            CommandError::CaptureExceedsHold {
                requested: credits(6),
                held: credits(5),
            },
        ),
        (
            Command::CreateHold(spec(9, credits(1_000))),
            CommandError::InsufficientCredits {
                available: credits(90),
                needed: credits(1_000),
            },
        ),
        // expiry in the past (or now)
        (grant(9, P, 1, Some(T0_MS)), CommandError::ExpiryInPast),
        (grant(9, P, 1, Some(0)), CommandError::ExpiryInPast),
        // malformed names, lists, prices
        (
            Command::CreateHold(bad_type),
            CommandError::InvalidGpuType(GpuType::new("a100")),
        ),
        (Command::CreateHold(dup_type), CommandError::DuplicateEntry),
        (
            Command::CreateHold(too_many_types),
            CommandError::LimitReached(Limit::GpuTypesPerList),
        ),
        (
            Command::SetPrices {
                prices: vec![(a100(), 0)],
            },
            CommandError::InvalidPrice,
        ),
        (
            Command::SetPrices {
                prices: vec![(a100(), PRICE_MICRO_PER_GPU_HOUR_MAX + 1)],
            },
            CommandError::InvalidPrice,
        ),
        (
            Command::SetPrices {
                prices: vec![(a100(), 1), (a100(), 2)],
            },
            CommandError::DuplicateEntry,
        ),
        (
            Command::SetPrices {
                prices: vec![(GpuType::new(""), 1)],
            },
            CommandError::InvalidGpuType(GpuType::new("")),
        ),
        (
            Command::SetPrices {
                prices: vec![(GpuType::new("H100-80GB-SXM-TOO-LONG"), 1)],
            },
            CommandError::InvalidGpuType(GpuType::new("H100-80GB-SXM-TOO-LONG")),
        ),
        (
            Command::IssueGrant(long_ref),
            CommandError::SourceRefTooLong,
        ),
        (
            grant(INTERNAL_ID_BASE, P, 1, None),
            CommandError::IdOutOfRange,
        ),
        (
            Command::CreateOrg {
                org: OrgId(u64::MAX),
            },
            CommandError::IdOutOfRange,
        ),
        (
            Command::StartMeter {
                hold: HoldId(1),
                attempt: 1,
                gpu_type: a100(),
                gpus: 0,
            },
            CommandError::InvalidGpuCount,
        ),
        (
            Command::StartMeter {
                hold: HoldId(1),
                attempt: 1,
                gpu_type: a100(),
                gpus: 9,
            },
            CommandError::InvalidGpuCount,
        ),
        (hb(2, 1, 1_000_001), CommandError::InvalidProgress),
        // conflicts
        (Command::CreateOrg { org: ORG }, CommandError::AlreadyExists),
        (
            Command::CreateProject {
                project: PROJECT,
                org: ORG,
            },
            CommandError::AlreadyExists,
        ),
        (grant(1, P, 1, None), CommandError::AlreadyExists),
        (Command::CreateHold(spec(1, 1)), CommandError::AlreadyExists),
        (Command::CreateHold(wrong_org), CommandError::UnknownUser),
        (
            Command::Capture {
                hold: HoldId(2),
                amount_micro: 1,
            },
            CommandError::HoldMetered,
        ),
        (
            Command::ReleaseHold { hold: HoldId(2) },
            CommandError::HoldMetered,
        ),
        (hb(1, 1, 0), CommandError::HoldNotMetered),
        (
            hb(2, 2, 0),
            CommandError::StaleAttempt {
                given: 2,
                current: 1,
            },
        ),
        (
            Command::Settle {
                hold: HoldId(2),
                attempt: 0,
                reason: SettleReason::Succeeded,
            },
            CommandError::StaleAttempt {
                given: 0,
                current: 1,
            },
        ),
        (
            Command::StartMeter {
                hold: HoldId(2),
                attempt: 2,
                gpu_type: a100(),
                gpus: 1,
            },
            CommandError::StaleAttempt {
                given: 2,
                current: 1,
            },
        ),
        (
            Command::Transfer {
                from: P,
                to: P,
                amount_micro: 1,
            },
            CommandError::InvalidTransfer,
        ),
        (
            // Another org's project is not in this org's namespace.
            Command::Transfer {
                from: P,
                to: Account::Project(OTHER_PROJECT),
                amount_micro: 1,
            },
            CommandError::UnknownProject,
        ),
    ];
    for (command, expected) in cases {
        check(command, expected);
    }
}

#[test]
fn missing_request_id_and_reused_request_id() {
    let mut h = world();
    let before = h.state.ledger.clone();
    let req = |id, amount| Request {
        actor: ADMIN,
        request_id: id,
        org: None,
        command: grant(50, P, amount, None),
    };
    assert_eq!(
        h.apply(vec![req(0, 1)]).remove(0),
        Err(CommandError::MissingRequestId)
    );
    assert_eq!(h.state.ledger, before);
    assert!(h.apply(vec![req(500, 1)]).remove(0).is_ok());
    let after = h.state.ledger.clone();
    assert_eq!(
        h.apply(vec![req(500, 2)]).remove(0),
        Err(CommandError::RequestIdReused)
    );
    assert_eq!(h.state.ledger, after);
}

#[test]
fn buckets_per_account_at_the_bound() {
    let mut h = Harness::world();
    let reqs: Vec<Request> = (0..BUCKETS_PER_ACCOUNT_MAX as u64)
        .map(|i| Request {
            actor: ADMIN,
            request_id: 10_000 + i as u128,
            org: None,
            command: grant(1_000 + i, P, 1, None),
        })
        .collect();
    assert!(h.apply(reqs).iter().all(|o| o.is_ok()));
    let before = h.state.ledger.clone();
    assert_eq!(
        h.run(grant(5_000, P, 1, None)),
        Err(CommandError::LimitReached(Limit::BucketsPerAccount))
    );
    assert_eq!(h.state.ledger, before);
    // The org's own account is a separate bound.
    assert!(h.run(grant(5_001, Account::Org(ORG), 1, None)).is_ok());
}

#[test]
fn draws_per_hold_at_the_bound() {
    let mut h = Harness::world();
    let n = DRAWS_PER_HOLD_MAX as u64;
    let reqs: Vec<Request> = (0..=n)
        .map(|i| Request {
            actor: ADMIN,
            request_id: 10_000 + i as u128,
            org: None,
            command: grant(1_000 + i, P, 1, None),
        })
        .collect();
    assert!(h.apply(reqs).iter().all(|o| o.is_ok()));
    // Exactly DRAWS_PER_HOLD_MAX buckets: fine. One more: refused, nothing drawn.
    assert!(h.run(Command::CreateHold(Harness::hold_spec(1, n))).is_ok());
    h.ok(Command::ReleaseHold { hold: HoldId(1) });
    let before = h.state.ledger.clone();
    assert_eq!(
        h.run(Command::CreateHold(Harness::hold_spec(2, n + 1))),
        Err(CommandError::LimitReached(Limit::DrawsPerHold))
    );
    assert_eq!(h.state.ledger, before);
}

#[test]
fn commands_per_entry_at_the_bound() {
    let mut h = Harness::world();
    let reqs: Vec<Request> = (0..=COMMANDS_PER_ENTRY_MAX as u64)
        .map(|i| Request {
            actor: ADMIN,
            request_id: 10_000 + i as u128,
            org: None,
            command: Command::CreateUser {
                user: UserId(1_000 + i),
                org: ORG,
            },
        })
        .collect();
    let out = h.apply(reqs);
    assert!(out[..COMMANDS_PER_ENTRY_MAX].iter().all(|o| o.is_ok()));
    assert_eq!(
        out[COMMANDS_PER_ENTRY_MAX],
        Err(CommandError::LimitReached(Limit::CommandsPerEntry))
    );
    assert!(!h
        .state
        .ledger
        .users
        .contains_key(&(ORG, UserId(1_000 + COMMANDS_PER_ENTRY_MAX as u64))));
}

/// The expiry pass is bounded per entry; buckets it has not reached yet are still not
/// spendable, and later entries finish the work.
#[test]
fn expiry_pass_is_bounded_but_never_lets_expired_credit_through() {
    let mut h = Harness::world();
    let projects = (EXPIRATIONS_PER_ENTRY_MAX / 1_000 + 1) as u64;
    let mut reqs = Vec::new();
    for p in 0..projects {
        reqs.push(Request {
            actor: ADMIN,
            request_id: 1_000_001 + p as u128 * 2_000,
            org: None,
            command: Command::CreateProject {
                project: ProjectId(1_000 + p),
                org: ORG,
            },
        });
        for i in 0..1_000u64 {
            reqs.push(Request {
                actor: ADMIN,
                request_id: 1_000_002 + p as u128 * 2_000 + i as u128,
                org: Some(ORG),
                command: grant(
                    100_000 + p * 1_000 + i,
                    Account::Project(ProjectId(1_000 + p)),
                    1,
                    Some(T0_MS + HOUR_MS),
                ),
            });
        }
    }
    for chunk in reqs.chunks(COMMANDS_PER_ENTRY_MAX) {
        assert!(h.apply(chunk.to_vec()).iter().all(|o| o.is_ok()));
    }
    h.now = T0_MS + HOUR_MS;
    let mut spec = Harness::hold_spec(1, 1);
    spec.project = ProjectId(1_000 + projects - 1);
    assert_eq!(
        h.run(Command::CreateHold(spec)),
        Err(CommandError::InsufficientCredits {
            available: 0,
            needed: 1
        })
    );
    let expired = h
        .state
        .ledger
        .buckets
        .values()
        .filter(|b| b.is_expired)
        .count();
    assert_eq!(expired, EXPIRATIONS_PER_ENTRY_MAX);
    h.tick();
    assert_eq!(
        h.state
            .ledger
            .buckets
            .values()
            .filter(|b| b.is_expired)
            .count(),
        (projects * 1_000) as usize
    );
}

/// The largest legal command of every size-varying kind validates (it is legal) and
/// fits `COMMAND_BYTES_MAX` with room to spare; one more list element or byte past
/// each bound is refused by the same validation.
#[test]
fn the_largest_legal_commands_fit_the_command_bound() {
    use allot_statemachine::limits::COMMAND_BYTES_MAX;
    use allot_statemachine::validate::validate_command;
    let all = allot_statemachine::testkit::largest_commands();
    for c in &all {
        validate_command(c, allot_statemachine::version::RULES_BASELINE)
            .unwrap_or_else(|e| panic!("{}: {e:?}", c.name()));
        let len = allot_statemachine::codec::encoded_len(c) as usize;
        eprintln!("{:<20} {len:>6} bytes", c.name());
        assert!(len <= COMMAND_BYTES_MAX, "{}: {len}", c.name());
    }
    let largest = allot_statemachine::testkit::largest_command();
    let len = allot_statemachine::codec::encoded_len(&largest) as usize;
    assert!(all
        .iter()
        .all(|c| allot_statemachine::codec::encoded_len(c) as usize <= len));
    // Past a bound: each list one longer is refused before the state is looked at.
    for c in all {
        let mut over = c.clone();
        let grown = match &mut over {
            Command::SetPrices { prices } => {
                prices.push((allot_statemachine::ids::GpuType::new("X"), 1));
                true
            }
            Command::RecordDenials { denials, .. } => {
                denials.push(denials[0].clone());
                true
            }
            Command::SetPlan { plan: Some(p), .. } => {
                let extra = (ProjectId(1), vec![]);
                p.project_tiers.push(extra);
                true
            }
            Command::RegisterNode(spec) => {
                spec.labels.push(("extra".into(), String::new()));
                true
            }
            Command::ConfigureScheduler(s) => {
                s.tiers.push(s.tiers[0].clone());
                true
            }
            _ => false,
        };
        if grown {
            assert!(
                validate_command(&over, allot_statemachine::version::RULES_BASELINE).is_err(),
                "{} past its bound",
                c.name()
            );
        }
    }
}
