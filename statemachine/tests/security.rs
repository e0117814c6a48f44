//! Tokens, resolution inside apply, scoped authorisation and scoped queries.

use allot_statemachine::query::{answer_as, Answer, JobFilter, Query, QueryDenied};
use allot_statemachine::testkit::*;
use allot_statemachine::*;
use proptest::prelude::*;

const ADMIN_TOKEN: &str = "alt_admin-token-for-tests-0000000000000000000";

fn bearer(token: &str) -> Actor {
    Actor::Bearer(TokenDigest::of(token.as_bytes()))
}

/// The standard world, secured with an admin token; org tokens for both orgs, a
/// project token for project 11, agent tokens for nodes 1 and 2.
fn secured() -> Harness {
    let mut h = Harness::world();
    let boot = Command::Bootstrap {
        principal: PrincipalId(1),
        digest: TokenDigest::of(ADMIN_TOKEN.as_bytes()),
    };
    assert_eq!(h.run_as(Actor::Anonymous, boot), Ok(Reply::TokenSet));
    let admin = bearer(ADMIN_TOKEN);
    h.admin = admin;
    for (principal, token, scope) in [
        (10, "tok-org-1-aaaaaaaaaaaaaaaaaaaaaaaa", Scope::Org(ORG)),
        (
            20,
            "tok-org-2-bbbbbbbbbbbbbbbbbbbbbbbb",
            Scope::Org(OTHER_ORG),
        ),
        (
            30,
            "tok-project-11-cccccccccccccccccccc",
            Scope::Project {
                org: ORG,
                project: PROJECT,
            },
        ),
        (
            41,
            "tok-agent-1-dddddddddddddddddddddd",
            Scope::Agent(NodeId(1)),
        ),
        (
            42,
            "tok-agent-2-eeeeeeeeeeeeeeeeeeeeee",
            Scope::Agent(NodeId(2)),
        ),
    ] {
        let cmd = Command::CreateToken {
            principal: PrincipalId(principal),
            digest: TokenDigest::of(token.as_bytes()),
            scope,
            expires_at_ms: None,
        };
        assert_eq!(h.run_as(admin, cmd), Ok(Reply::TokenSet));
    }
    h
}

const ORG1: &str = "tok-org-1-aaaaaaaaaaaaaaaaaaaaaaaa";
const ORG2: &str = "tok-org-2-bbbbbbbbbbbbbbbbbbbbbbbb";
const PROJ11: &str = "tok-project-11-cccccccccccccccccccc";
const AGENT1: &str = "tok-agent-1-dddddddddddddddddddddd";
const AGENT2: &str = "tok-agent-2-eeeeeeeeeeeeeeeeeeeeee";

fn ledger_fingerprint(h: &Harness) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    (
        codec::encode(&h.state.ledger),
        codec::encode(&h.state.scheduler),
        codec::encode(&h.state.security),
    )
}

#[test]
fn bootstrap_secures_the_shard_once_and_claims_stop_working() {
    let mut h = Harness::world();
    // Unsecured: a claimed admin works (dev mode).
    assert!(h.run(Command::CreateOrg { org: OrgId(5) }).is_ok());
    let boot = |t: &str| Command::Bootstrap {
        principal: PrincipalId(1),
        digest: TokenDigest::of(t.as_bytes()),
    };
    assert_eq!(
        h.run_as(Actor::Anonymous, boot(ADMIN_TOKEN)),
        Ok(Reply::TokenSet)
    );
    // Idempotent for the same token; refused for another.
    assert_eq!(
        h.run_as(Actor::Anonymous, boot(ADMIN_TOKEN)),
        Ok(Reply::TokenSet)
    );
    assert_eq!(
        h.run_as(
            Actor::Anonymous,
            boot("another-token-0000000000000000000000")
        ),
        Err(CommandError::AlreadyBootstrapped)
    );
    // Claims are refused now, whatever they claim.
    for claim in [ADMIN, tenant(ORG), Actor::Agent(NodeId(1))] {
        assert_eq!(
            h.run_as(claim, Command::CreateOrg { org: OrgId(6) }),
            Err(CommandError::Unauthenticated)
        );
    }
    assert_eq!(
        h.run_as(Actor::Anonymous, Command::CreateOrg { org: OrgId(6) }),
        Err(CommandError::Unauthenticated)
    );
    // The token works and runs as principal 1.
    assert!(h
        .run_as(bearer(ADMIN_TOKEN), Command::CreateOrg { org: OrgId(6) })
        .is_ok());
    let last = h.events.last().unwrap();
    assert_eq!(last.actor, Actor::Admin(PrincipalId(1)));
}

#[test]
fn an_org_token_cannot_touch_another_org_and_learns_nothing() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(10),
        None,
    );
    let mut foreign = Harness::hold_spec(5, credits(1));
    foreign.project = OTHER_PROJECT;
    foreign.user = OTHER_USER;
    let mut missing = foreign.clone();
    missing.project = ProjectId(999);
    let before = ledger_fingerprint(&h);
    let t = bearer(ORG1);
    // Spend in org 2 = the same answer as a project that does not exist.
    assert_eq!(
        h.run_as(t, Command::CreateHold(foreign.clone())),
        Err(CommandError::UnknownProject)
    );
    assert_eq!(
        h.run_as(t, Command::CreateHold(missing)),
        Err(CommandError::UnknownProject)
    );
    let mut job = Harness::job_spec(77, Tier(1), vec![a100()], 1);
    job.project = OTHER_PROJECT;
    job.user = OTHER_USER;
    assert_eq!(
        h.run_as(t, Command::SubmitJob(job)),
        Err(CommandError::UnknownProject)
    );
    assert_eq!(
        h.run_as(
            t,
            Command::Transfer {
                from: Account::Org(OTHER_ORG),
                to: Account::Project(PROJECT),
                amount_micro: 1
            }
        ),
        Err(CommandError::UnknownOrg)
    );
    assert_eq!(
        h.run_as(
            t,
            Command::CreateProject {
                project: ProjectId(50),
                org: OTHER_ORG
            }
        ),
        Err(CommandError::UnknownOrg)
    );
    // Admin-only commands.
    for cmd in [
        Command::CreateOrg { org: OrgId(9) },
        Command::SetPrices {
            prices: vec![(a100(), 1)],
        },
        Command::RegisterNode(NodeSpec {
            node: NodeId(9),
            gpu_type: a100(),
            gpu_count: 8,
            gpu_mem_gb: 80,
            labels: vec![],
            incarnation: 0,
        }),
        Command::SetNodeDraining {
            node: NodeId(9),
            draining: true,
        },
        Command::SetQuota {
            org: ORG,
            quota: None,
        },
        Command::Tick,
    ] {
        assert_eq!(h.run_as(t, cmd), Err(CommandError::Unauthorized));
    }
    // Org 2's hold, created by org 2's token, is invisible to org 1's token.
    assert!(h.run_as(bearer(ORG2), Command::CreateHold(foreign)).is_ok());
    let mid = ledger_fingerprint(&h);
    assert_ne!(before, mid);
    for cmd in [
        Command::ReleaseHold { hold: HoldId(5) },
        Command::Capture {
            hold: HoldId(5),
            amount_micro: 1,
        },
        Command::TopUp {
            hold: HoldId(5),
            amount_micro: 1,
        },
    ] {
        assert_eq!(h.run_as(t, cmd.clone()), Err(CommandError::UnknownHold));
    }
    assert_eq!(
        h.run_as(t, Command::ReleaseHold { hold: HoldId(404) }),
        Err(CommandError::UnknownHold)
    );
    assert_eq!(mid, ledger_fingerprint(&h), "refusals change nothing");
}

#[test]
fn queries_are_confined_to_the_callers_org() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(OTHER_PROJECT),
        BucketKind::Paid,
        credits(10),
        None,
    );
    h.grant(
        2,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(10),
        None,
    );
    let s = &h.state;
    let t = bearer(ORG1);
    let balance = |a| Query::Balance {
        org: ORG,
        account: a,
        horizon_ms: 0,
    };
    // Own balance: visible. Foreign one: answered exactly like a nonexistent account.
    assert!(matches!(
        answer_as(s, t, &balance(Account::Project(PROJECT))),
        Ok(Answer::Balance(Some(_)))
    ));
    assert_eq!(
        answer_as(s, t, &balance(Account::Project(OTHER_PROJECT))),
        answer_as(s, t, &balance(Account::Project(ProjectId(999))))
    );
    assert_eq!(
        answer_as(s, t, &balance(Account::Project(OTHER_PROJECT))),
        Ok(Answer::Balance(None))
    );
    assert_eq!(
        answer_as(s, t, &Query::Budget(OTHER_ORG, BudgetScope::Org(OTHER_ORG))),
        Ok(Answer::Budget(None))
    );
    // Job lists are forced to the caller's org.
    let page = answer_as(
        s,
        t,
        &Query::Jobs(JobFilter {
            org: Some(OTHER_ORG),
            ..Default::default()
        }),
    );
    assert!(matches!(page, Ok(Answer::Jobs(p)) if p.jobs.is_empty()));
    // Shard-wide views are admin only.
    for q in [
        Query::Totals,
        Query::Invariants,
        Query::StateHash,
        Query::Nodes,
        Query::Assignments(NodeId(1)),
    ] {
        assert_eq!(
            answer_as(s, t, &q),
            Err(QueryDenied::PermissionDenied),
            "{q:?}"
        );
        assert!(answer_as(s, bearer(ADMIN_TOKEN), &q).is_ok());
    }
    // A project token sees only its project.
    let p = bearer(PROJ11);
    assert_eq!(
        answer_as(s, p, &balance(Account::Project(PROJECT_B))),
        Ok(Answer::Balance(None))
    );
    assert_eq!(
        answer_as(s, p, &balance(Account::Org(ORG))),
        Ok(Answer::Balance(None))
    );
    assert!(matches!(
        answer_as(s, p, &balance(Account::Project(PROJECT))),
        Ok(Answer::Balance(Some(_)))
    ));
    // Agents: their own node's assignments only.
    assert!(answer_as(s, bearer(AGENT1), &Query::Assignments(NodeId(1))).is_ok());
    assert_eq!(
        answer_as(s, bearer(AGENT1), &Query::Assignments(NodeId(2))),
        Err(QueryDenied::PermissionDenied)
    );
    // Claims and unknown tokens on a secured shard.
    assert_eq!(
        answer_as(s, ADMIN, &Query::Totals),
        Err(QueryDenied::Unauthenticated)
    );
    assert_eq!(
        answer_as(s, bearer("nope-nope-nope-nope-nope-nope"), &Query::Prices),
        Err(QueryDenied::Unauthenticated)
    );
}

#[test]
fn project_tokens_act_only_inside_their_project() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(10),
        None,
    );
    h.grant(
        2,
        Account::Project(PROJECT_B),
        BucketKind::Paid,
        credits(10),
        None,
    );
    let p = bearer(PROJ11);
    assert!(h
        .run_as(p, Command::CreateHold(Harness::hold_spec(1, credits(1))))
        .is_ok());
    let mut other = Harness::hold_spec(2, credits(1));
    other.project = PROJECT_B;
    other.user = USER_B;
    assert_eq!(
        h.run_as(p, Command::CreateHold(other.clone())),
        Err(CommandError::UnknownProject)
    );
    // The org token may; then the project token cannot release it.
    assert!(h.run_as(bearer(ORG1), Command::CreateHold(other)).is_ok());
    assert_eq!(
        h.run_as(p, Command::ReleaseHold { hold: HoldId(2) }),
        Err(CommandError::UnknownHold)
    );
    // Org-level management is not for project tokens.
    assert_eq!(
        h.run_as(
            p,
            Command::CreateProject {
                project: ProjectId(60),
                org: ORG
            }
        ),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(
        h.run_as(
            p,
            Command::CreateToken {
                principal: PrincipalId(99),
                digest: TokenDigest::of(b"x-x-x-x-x-x-x-x-x-x-x-x-x-x-x"),
                scope: Scope::Project {
                    org: ORG,
                    project: PROJECT
                },
                expires_at_ms: None
            }
        ),
        Err(CommandError::Unauthorized)
    );
}

/// A user token acts as its user only (issue 20, finding 7): the hold's and job's user
/// is the token's, so a user's hard budget holds whatever user the request names; it
/// cannot move the project's credit; a project token may still act for any user of the
/// org (a platform service), within each user's budget.
#[test]
fn user_tokens_act_only_as_their_user_so_user_budgets_hold() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(100),
        None,
    );
    let token = "tok-user-21-ffffffffffffffffffffffff";
    let cmd = Command::CreateToken {
        principal: PrincipalId(60),
        digest: TokenDigest::of(token.as_bytes()),
        scope: Scope::User {
            org: ORG,
            project: PROJECT,
            user: USER,
        },
        expires_at_ms: None,
    };
    assert_eq!(h.run_as(bearer(ORG1), cmd), Ok(Reply::TokenSet));
    let me = bearer(token);
    // User 22 has a hard budget of 2 credits; user 21 none.
    h.ok(Command::SetBudget {
        scope: BudgetScope::User(USER_B),
        budget: Some(BudgetSpec {
            limit_micro: credits(2),
            period: BudgetPeriod::Month,
            mode: BudgetMode::Hard,
        }),
    });
    assert!(h
        .run_as(me, Command::CreateHold(Harness::hold_spec(1, credits(5))))
        .is_ok());
    // Naming another user answers as an unknown one: user 22's budget cannot be
    // spent (or dodged) through user 21's token.
    let mut theirs = Harness::hold_spec(2, credits(5));
    theirs.user = USER_B;
    let before = ledger_fingerprint(&h);
    assert_eq!(
        h.run_as(me, Command::CreateHold(theirs.clone())),
        Err(CommandError::UnknownUser)
    );
    let mut job = Harness::job_spec(3, Tier::PAID, vec![a100()], 1);
    job.user = USER_B;
    assert_eq!(
        h.run_as(me, Command::SubmitJob(job)),
        Err(CommandError::UnknownUser)
    );
    assert_eq!(
        h.run_as(
            me,
            Command::Transfer {
                from: Account::Project(PROJECT),
                to: Account::Org(ORG),
                amount_micro: 1
            }
        ),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(ledger_fingerprint(&h), before, "refusals change nothing");
    // The project token acts for user 22 — within user 22's budget.
    assert!(matches!(
        h.run_as(bearer(PROJ11), Command::CreateHold(theirs)),
        Err(CommandError::BudgetExceeded { .. })
    ));
    let mut small = Harness::hold_spec(2, credits(2));
    small.user = USER_B;
    assert!(h.run_as(bearer(PROJ11), Command::CreateHold(small)).is_ok());
    // The user token cannot release user 22's hold, and sees only its own jobs.
    assert_eq!(
        h.run_as(me, Command::ReleaseHold { hold: HoldId(2) }),
        Err(CommandError::UnknownHold)
    );
    assert!(h
        .run_as(me, Command::ReleaseHold { hold: HoldId(1) })
        .is_ok());
}

/// From rule version 4 an agent learns nothing of any job not placed on its node: a
/// report on one — whatever org it belongs to, whatever became of it — answers as a
/// report on an id no job has. Before, node 2's agent told a queued job
/// (`JobNotPlaced`), a finished one (`JobFinished`) and a requeued one (`StaleAttempt`,
/// with its attempt count) from an unused id, for any org: a GPU node could list every
/// org's jobs and their states. Under rule version 1 the answers stay what they were.
#[test]
fn an_agent_learns_nothing_of_jobs_not_placed_on_its_node() {
    let answers = |rules: u32| {
        let mut h = secured();
        if rules > 1 {
            h.ok(Command::ActivateVersion { version: rules });
        }
        h.grant(
            1,
            Account::Project(PROJECT),
            BucketKind::Paid,
            credits(1000),
            None,
        );
        h.fleet(&[(1, a100(), 8, 80)]);
        assert!(h
            .run_as(bearer(AGENT1), Command::NodeHeartbeat { node: NodeId(1) })
            .is_ok());
        // Jobs 7 and 9 run on node 1; 7 finishes; job 8 (all 8 GPUs) waits behind 9.
        let submit = |h: &mut Harness, job, gpus| {
            let spec = Harness::job_spec(job, Tier(1), vec![a100()], gpus);
            assert!(h.run_as(bearer(ORG1), Command::SubmitJob(spec)).is_ok());
        };
        submit(&mut h, 7, 1);
        submit(&mut h, 9, 1);
        h.tick();
        let finish = |job, attempt| Command::FinishJob {
            job: JobId(job),
            attempt,
            success: true,
        };
        let attempt = h.job(7).attempt;
        assert!(h.run_as(bearer(AGENT1), finish(7, attempt)).is_ok());
        submit(&mut h, 8, 8);
        h.tick();
        assert_eq!(
            h.job(8).state,
            allot_statemachine::scheduler::JobState::Queued
        );
        let heartbeat = |job, attempt| {
            Command::JobHeartbeat(JobHeartbeat {
                job: JobId(job),
                attempt,
                seq: 1,
                progress_ppm: 0,
                checkpoint: 0,
            })
        };
        let mut seen = Vec::new();
        for job in [7, 8, 9, 99] {
            for attempt in [0, 1, 2] {
                for command in [
                    finish(job, attempt),
                    heartbeat(job, attempt),
                    Command::JobFenced {
                        job: JobId(job),
                        attempt,
                    },
                ] {
                    seen.push((job, h.run_in(bearer(AGENT2), ORG, command)));
                }
            }
        }
        seen
    };
    for (job, answer) in answers(4) {
        assert_eq!(answer, Err(CommandError::UnknownJob), "job {job}");
    }
    let before: Vec<_> = answers(1).into_iter().map(|(_, a)| a).collect();
    assert!(
        before.contains(&Err(CommandError::JobFinished)),
        "{before:?}"
    );
    assert!(
        before.contains(&Err(CommandError::JobNotPlaced)),
        "{before:?}"
    );
}

#[test]
fn an_agent_token_cannot_finish_another_nodes_job() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(1000),
        None,
    );
    h.fleet(&[(1, a100(), 8, 80)]);
    assert!(h
        .run_as(bearer(AGENT1), Command::NodeHeartbeat { node: NodeId(1) })
        .is_ok());
    let spec = Harness::job_spec(7, Tier(1), vec![a100()], 1);
    assert!(h.run_as(bearer(ORG1), Command::SubmitJob(spec)).is_ok());
    h.tick();
    let attempt = h.job(7).attempt;
    assert_eq!(h.job(7).placement.as_ref().map(|p| p.node), Some(NodeId(1)));
    let finish = Command::FinishJob {
        job: JobId(7),
        attempt,
        success: true,
    };
    // Node 2's agent: the job does not exist as far as it is concerned.
    assert_eq!(
        h.run_as(bearer(AGENT2), finish.clone()),
        Err(CommandError::UnknownJob)
    );
    // A tenant cannot report a finish either; node 1's agent can. So for a finish that
    // says when the runner exited (rule version 6), which node 2's agent does not see
    // either.
    let finish_at = Command::FinishJobAt {
        job: JobId(7),
        attempt,
        success: true,
        exit: RunnerExit {
            heartbeat_seq: 1,
            after_ms: 0,
        },
    };
    h.ok(Command::ActivateVersion { version: 6 });
    for f in [&finish, &finish_at] {
        assert_eq!(
            h.run_as(bearer(ORG1), f.clone()),
            Err(CommandError::Unauthorized)
        );
    }
    assert_eq!(
        h.run_as(bearer(AGENT2), finish_at),
        Err(CommandError::UnknownJob)
    );
    assert!(h.run_as(bearer(AGENT1), finish).is_ok());
    // Agents cannot settle or meter arbitrary holds, nor heartbeat another node.
    assert_eq!(
        h.run_as(bearer(AGENT1), Command::NodeHeartbeat { node: NodeId(2) }),
        Err(CommandError::Unauthorized)
    );
    assert_eq!(
        h.run_as(
            bearer(AGENT1),
            Command::Settle {
                hold: HoldId(7),
                attempt,
                reason: SettleReason::Succeeded
            }
        ),
        Err(CommandError::Unauthorized)
    );
}

/// Org 1's principal 10 rotates from token `from` to token `to`.
fn rotate_org1(h: &mut Harness, from: &str, to: &str, overlap_ms: u64) -> Outcome {
    h.run_as(
        bearer(from),
        Command::RotateToken {
            principal: PrincipalId(10),
            digest: TokenDigest::of(to.as_bytes()),
            overlap_ms,
        },
    )
}

/// Any number of rotations inside the overlap keeps the newest key and those still in
/// their overlap alive (issue 20: the second rotation used to copy the first key's
/// overlap end onto the new key, locking the principal out when it passed — for the
/// admin principal, the operator out of the cluster). Retired digests are never issued
/// again, and rotating forever keeps the principal's entries bounded.
#[test]
fn rotations_inside_the_overlap_never_lock_a_principal_out() {
    let mut h = secured();
    let q = Query::Budget(ORG, BudgetScope::Org(ORG));
    let token = |i: usize| format!("tok-org-1-rotation-{i:04}-fffffffffffffffff");
    let mut current = ORG1.to_string();
    for i in 0..3 {
        let next = token(i);
        assert_eq!(
            rotate_org1(&mut h, &current, &next, 60_000),
            Ok(Reply::TokenSet),
            "rotation {i}"
        );
        h.advance(10_000);
        h.tick();
        current = next;
    }
    // Rotations at +0, +10 and +20 s, each with a 60 s overlap: at +30 s every key
    // works; then each replaced key stops exactly 60 s after the rotation that replaced
    // it (the original at +60, the first rotated key at +70, the second at +80), and
    // the newest works throughout.
    let keys = [ORG1.to_string(), token(0), token(1), token(2)];
    let alive = |h: &Harness| -> Vec<bool> {
        keys.iter()
            .map(|k| answer_as(&h.state, bearer(k), &q).is_ok())
            .collect()
    };
    assert_eq!(alive(&h), [true, true, true, true], "+30 s");
    for (step_ms, expect) in [
        (35_000, [false, true, true, true]),
        (10_000, [false, false, true, true]),
        (10_000, [false, false, false, true]),
    ] {
        h.advance(step_ms);
        h.tick();
        assert_eq!(alive(&h), expect, "+{} ms", h.state.time_ms);
    }
    // Every overlap has now passed; the newest key works, and keeps working.
    h.advance(3_600_000);
    h.tick();
    assert!(answer_as(&h.state, bearer(&current), &q).is_ok());
    assert_eq!(
        answer_as(&h.state, bearer(ORG1), &q),
        Err(QueryDenied::Unauthenticated)
    );
    // The admin rotates twice inside one overlap and keeps access.
    let a1 = "tok-admin-rotated-1-ffffffffffffffffffffff";
    let a2 = "tok-admin-rotated-2-ffffffffffffffffffffff";
    for (from, to) in [(ADMIN_TOKEN, a1), (a1, a2)] {
        assert_eq!(
            h.run_as(
                bearer(from),
                Command::RotateToken {
                    principal: PrincipalId(1),
                    digest: TokenDigest::of(to.as_bytes()),
                    overlap_ms: 60_000,
                }
            ),
            Ok(Reply::TokenSet)
        );
    }
    h.advance(120_000);
    h.tick();
    assert!(answer_as(&h.state, bearer(a2), &Query::Totals).is_ok());
    // A retired digest cannot come back.
    assert_eq!(
        h.run_as(
            bearer(&current),
            Command::RotateToken {
                principal: PrincipalId(10),
                digest: TokenDigest::of(ORG1.as_bytes()),
                overlap_ms: 0,
            }
        ),
        Err(CommandError::AlreadyExists)
    );
    // A hundred rotations: the principal's keys and remembered digests stay bounded.
    for i in 100..200 {
        let next = token(i);
        assert!(h
            .run_as(
                bearer(&current),
                Command::RotateToken {
                    principal: PrincipalId(10),
                    digest: TokenDigest::of(next.as_bytes()),
                    overlap_ms: 1_000_000,
                }
            )
            .is_ok());
        current = next;
    }
    let p = h
        .state
        .security
        .principal(Some(ORG), PrincipalId(10))
        .unwrap();
    assert!(p.keys.len() <= limits::TOKEN_KEYS_PER_PRINCIPAL_MAX);
    assert!(p.retired.len() <= limits::RETIRED_KEYS_PER_PRINCIPAL_MAX);
    assert!(answer_as(&h.state, bearer(&current), &q).is_ok());
}

#[test]
fn revocation_rotation_and_expiry_take_effect_at_their_log_position() {
    let mut h = secured();
    let admin = bearer(ADMIN_TOKEN);
    let t = bearer(ORG1);
    let q = Query::Budget(ORG, BudgetScope::Org(ORG));
    assert!(h
        .run_as(
            t,
            Command::SetBudget {
                scope: BudgetScope::Org(ORG),
                budget: None
            }
        )
        .is_ok());
    // Rotation with a 1 s overlap: both work, then only the new one.
    let new = "tok-org-1-rotated-ffffffffffffffffffff";
    assert_eq!(
        h.run_as(
            t,
            Command::RotateToken {
                principal: PrincipalId(10),
                digest: TokenDigest::of(new.as_bytes()),
                overlap_ms: 1_000
            }
        ),
        Ok(Reply::TokenSet)
    );
    assert!(answer_as(&h.state, t, &q).is_ok());
    assert!(answer_as(&h.state, bearer(new), &q).is_ok());
    h.advance(1_000);
    h.tick();
    assert_eq!(
        answer_as(&h.state, t, &q),
        Err(QueryDenied::Unauthenticated)
    );
    assert_eq!(
        h.run_as(
            t,
            Command::SetBudget {
                scope: BudgetScope::Org(ORG),
                budget: None
            }
        ),
        Err(CommandError::Unauthenticated)
    );
    // The rotated principal keeps its identity (same principal id in the audit trail).
    assert!(h
        .run_as(
            bearer(new),
            Command::SetBudget {
                scope: BudgetScope::Org(ORG),
                budget: None
            }
        )
        .is_ok());
    assert_eq!(
        h.events
            .iter()
            .rev()
            .find(|e| matches!(e.body, EventBody::Command { .. }))
            .unwrap()
            .actor,
        Actor::Tenant {
            org: ORG,
            principal: PrincipalId(10)
        }
    );
    // Org 2 cannot revoke org 1's principal (answered as unknown); the admin can.
    assert_eq!(
        h.run_as(
            bearer(ORG2),
            Command::RevokeToken {
                principal: PrincipalId(10)
            }
        ),
        Err(CommandError::UnknownPrincipal)
    );
    assert_eq!(
        h.run_as(
            admin,
            Command::RevokeToken {
                principal: PrincipalId(10)
            }
        ),
        Ok(Reply::TokenSet)
    );
    assert_eq!(
        answer_as(&h.state, bearer(new), &q),
        Err(QueryDenied::Unauthenticated)
    );
    assert_eq!(
        h.run_as(
            bearer(new),
            Command::SetBudget {
                scope: BudgetScope::Org(ORG),
                budget: None
            }
        ),
        Err(CommandError::Unauthenticated)
    );
    // A principal id and a digest are never reused.
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(10),
                digest: TokenDigest::of(b"fresh-fresh-fresh-fresh-fresh"),
                scope: Scope::Org(ORG),
                expires_at_ms: None
            }
        ),
        Err(CommandError::AlreadyExists)
    );
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(11),
                digest: TokenDigest::of(new.as_bytes()),
                scope: Scope::Org(ORG),
                expires_at_ms: None
            }
        ),
        Err(CommandError::AlreadyExists)
    );
    // Expiry: a token created to expire in 500 ms stops working then.
    let exp = "tok-expiring-gggggggggggggggggggggggg";
    let at = h.now + 500;
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(12),
                digest: TokenDigest::of(exp.as_bytes()),
                scope: Scope::Org(ORG),
                expires_at_ms: Some(at)
            }
        ),
        Ok(Reply::TokenSet)
    );
    assert!(answer_as(&h.state, bearer(exp), &q).is_ok());
    h.advance(500);
    h.tick();
    assert_eq!(
        answer_as(&h.state, bearer(exp), &q),
        Err(QueryDenied::Unauthenticated)
    );
    // Bad token commands: typed errors.
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(13),
                digest: TokenDigest([0; 32]),
                scope: Scope::Admin,
                expires_at_ms: None
            }
        ),
        Err(CommandError::InvalidToken)
    );
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(13),
                digest: TokenDigest::of(b"past-past-past-past-past-past"),
                scope: Scope::Admin,
                expires_at_ms: Some(h.now)
            }
        ),
        Err(CommandError::ExpiryInPast)
    );
    assert_eq!(
        h.run_as(
            admin,
            Command::CreateToken {
                principal: PrincipalId(13),
                digest: TokenDigest::of(b"nope-org-nope-org-nope-org-no"),
                scope: Scope::Org(OrgId(404)),
                expires_at_ms: None
            }
        ),
        Err(CommandError::UnknownOrg)
    );
    assert_eq!(
        h.run_as(
            admin,
            Command::RevokeToken {
                principal: PrincipalId(404)
            }
        ),
        Err(CommandError::UnknownPrincipal)
    );
}

#[test]
fn edge_denials_enter_the_audit_trail_only_from_the_system() {
    let mut h = secured();
    let denial = Denial {
        actor: bearer(ORG1),
        api: "query:totals".into(),
        reason: DenialReason::PermissionDenied,
    };
    let cmd = Command::RecordDenials {
        node: 2,
        denials: vec![denial.clone()],
    };
    assert_eq!(
        h.run_as(bearer(ADMIN_TOKEN), cmd.clone()),
        Err(CommandError::Unauthorized)
    );
    let from = h.events.len();
    assert_eq!(
        h.run_as(Actor::System, cmd),
        Ok(Reply::DenialsRecorded { count: 1 })
    );
    assert!(h.events[from..].iter().any(
        |e| matches!(&e.body, EventBody::Denied { node: 2, api, .. } if api == "query:totals")
    ));
    let too_many = Command::RecordDenials {
        node: 2,
        denials: vec![denial; limits::DENIALS_PER_RECORD_MAX + 1],
    };
    assert_eq!(
        h.run_as(Actor::System, too_many),
        Err(CommandError::LimitReached(Limit::Denials))
    );
}

#[test]
fn same_log_same_security_state() {
    let h = secured();
    let mut again = Harness::default();
    for e in &h.entries {
        apply(&mut again.state, e).unwrap();
    }
    assert_eq!(again.state.state_hash(), h.state.state_hash());
}

fn any_command() -> impl Strategy<Value = Command> {
    prop_oneof![
        Just(Command::CreateOrg { org: OrgId(9) }),
        Just(Command::Tick),
        Just(Command::IssueGrant(Grant {
            bucket: BucketId(900),
            owner: Account::Org(ORG),
            kind: BucketKind::Paid,
            amount_micro: 5,
            expires_at_ms: None,
            priority: 0,
            policy: None,
            source_ref: None,
        })),
        Just(Command::CreateHold(Harness::hold_spec(901, 1))),
        Just(Command::RevokeToken {
            principal: PrincipalId(1)
        }),
        Just(Command::CreateToken {
            principal: PrincipalId(902),
            digest: TokenDigest::of(b"attacker-attacker-attacker-att"),
            scope: Scope::Admin,
            expires_at_ms: None
        }),
        Just(Command::Bootstrap {
            principal: PrincipalId(903),
            digest: TokenDigest::of(b"attacker-boot-attacker-boot-at")
        }),
    ]
}

fn any_claim() -> impl Strategy<Value = Actor> {
    prop_oneof![
        any::<[u8; 32]>().prop_map(|d| Actor::Bearer(TokenDigest(d))),
        any::<u64>().prop_map(|p| Actor::Admin(PrincipalId(p))),
        (any::<u64>(), any::<u64>()).prop_map(|(o, p)| Actor::Tenant {
            org: OrgId(o),
            principal: PrincipalId(p)
        }),
        any::<u64>().prop_map(|n| Actor::Agent(NodeId(n))),
        Just(Actor::Anonymous),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// On a secured shard, random tokens and any claimed identity never authorise
    /// anything: every command is refused and the ledger, scheduler and token table
    /// are unchanged (the refusal itself is audited).
    #[test]
    fn random_credentials_never_authorise(
        ops in proptest::collection::vec((any_claim(), any_command()), 1..12),
        query_digest in any::<[u8; 32]>(),
    ) {
        let mut h = secured();
        let before = ledger_fingerprint(&h);
        for (actor, cmd) in ops {
            let out = h.run_as(actor, cmd.clone());
            let refused = matches!(
                out,
                Err(CommandError::Unauthenticated) | Err(CommandError::AlreadyBootstrapped)
            );
            prop_assert!(refused, "{actor:?} {cmd:?} -> {out:?}");
        }
        prop_assert_eq!(&before.0, &ledger_fingerprint(&h).0);
        prop_assert_eq!(&before.2, &ledger_fingerprint(&h).2);
        let q = answer_as(&h.state, Actor::Bearer(TokenDigest(query_digest)), &Query::Prices);
        prop_assert_eq!(q, Err(QueryDenied::Unauthenticated));
    }
}

/// Found by review (2026-11-27): the token table's bound (`TOKENS_MAX`) counted every
/// key digest, revoked and retired ones included, while an org's quota counted its
/// principals: 10,000 principals rotated 19 times each held ~200,000 digests, so five
/// orgs filled the table and then nobody — the operator's agent tokens for new GPU
/// nodes included — could create or rotate a token on the shard. From rule version 4 a
/// tenant's principal remembers one retired digest (the activation trims the longer
/// lists), and tenants' new principals leave the last `TOKENS_OPERATOR_RESERVE` digests
/// to the operator; a rotation is never refused for it.
#[test]
fn tenants_cannot_take_the_operators_part_of_the_token_table_from_rule_version_4() {
    for rules in [3, 4] {
        let mut h = secured();
        h.ok(Command::ActivateVersion { version: 3 });
        // Ten rotations under version 3: each retires the key the one before ended
        // (overlap 0), nine in all.
        let token = |i: usize| format!("tok-org-1-v{rules}-rotation-{i:04}-fffffffffffff");
        let mut current = ORG1.to_string();
        for i in 0..10 {
            let next = token(i);
            assert_eq!(rotate_org1(&mut h, &current, &next, 0), Ok(Reply::TokenSet));
            current = next;
        }
        let retired = |h: &Harness| {
            h.state
                .security
                .principal(Some(ORG), PrincipalId(10))
                .unwrap()
                .retired
                .len()
        };
        assert_eq!(retired(&h), 9);
        if rules == 4 {
            let before = h.state.security.digests.len();
            h.ok(Command::ActivateVersion { version: 4 });
            assert_eq!(
                retired(&h),
                1,
                "the activation trims a tenant's retired digests"
            );
            assert_eq!(h.state.security.digests.len(), before - 8);
        }
        // Other tenants' principals up to the tenants' part of the table, each counted
        // at its most digests.
        let most = (limits::TOKENS_MAX - limits::TOKENS_OPERATOR_RESERVE)
            / limits::DIGESTS_PER_TENANT_PRINCIPAL_V4;
        let mut n = 0u64;
        while h.state.security.tenant_principals() < most {
            n += 1;
            let p = h
                .state
                .security
                .principal(Some(OTHER_ORG), PrincipalId(20))
                .unwrap()
                .clone();
            h.state
                .security
                .principals
                .insert((Some(OTHER_ORG), PrincipalId(1_000_000 + n)), p);
        }
        let org_token = Command::CreateToken {
            principal: PrincipalId(11),
            digest: TokenDigest::of(b"tok-org-1-another-one-xxxxxxxxxxxxxx"),
            scope: Scope::Org(ORG),
            expires_at_ms: None,
        };
        let rotation = Command::RotateToken {
            principal: PrincipalId(10),
            digest: TokenDigest::of(b"tok-org-1-after-the-filler-xxxxxxxxxx"),
            overlap_ms: 0,
        };
        let agent_token = Command::CreateToken {
            principal: PrincipalId(43),
            digest: TokenDigest::of(b"tok-agent-3-ffffffffffffffffffffffff"),
            scope: Scope::Agent(NodeId(3)),
            expires_at_ms: None,
        };
        let new_principal = h.run_as(bearer(&current), org_token);
        if rules == 4 {
            assert_eq!(
                new_principal,
                Err(CommandError::LimitReached(Limit::Tokens))
            );
        } else {
            assert_eq!(new_principal, Ok(Reply::TokenSet));
        }
        // A rotation (the answer to a leaked token) is never refused for the reserve,
        // and the operator still creates an agent token for a new GPU node.
        assert_eq!(h.run_as(bearer(&current), rotation), Ok(Reply::TokenSet));
        assert_eq!(h.run(agent_token), Ok(Reply::TokenSet));
    }
}

/// A project token pages through its own project's jobs only: no page's cursor names a
/// sibling project's job. Before, the scan behind a page went through the whole org's
/// jobs and stopped after `JOBS_SCAN_MAX` of them; its cursor (`next`) was the last job
/// it looked at, whatever its project, so a project token could read its sibling
/// projects' job ids off the cursors (choosing `after` to binary-search them).
#[test]
fn a_project_tokens_job_pages_never_name_a_siblings_job() {
    let mut h = secured();
    h.grant(
        1,
        Account::Project(PROJECT_B),
        BucketKind::Paid,
        credits(100_000_000),
        None,
    );
    h.grant(
        2,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(1_000),
        None,
    );
    h.fleet(&[(1, a100(), 8, 80)]);
    let sibling_jobs = query::JOBS_SCAN_MAX as u64 + 1;
    let ids: Vec<u64> = (1..=sibling_jobs).collect();
    for chunk in ids.chunks(1_000) {
        // Submitted and cancelled (finished jobs are listed too), so the org's queue
        // quota is never in the way.
        let mut reqs = Vec::new();
        for &job in chunk {
            let spec = JobSpec {
                project: PROJECT_B,
                ..Harness::job_spec(job, Tier(1), vec![a100()], 1)
            };
            for command in [
                Command::SubmitJob(spec),
                Command::CancelJob { job: JobId(job) },
            ] {
                let request_id = h.fresh_request_id();
                reqs.push(Request {
                    actor: bearer(ADMIN_TOKEN),
                    request_id,
                    org: Some(ORG),
                    command,
                });
            }
        }
        let out = h.apply(reqs);
        assert!(
            out.iter().all(|o| o.is_ok()),
            "{:?}",
            out.iter().find(|o| o.is_err())
        );
    }
    let mine = Harness::job_spec(20_000, Tier(1), vec![a100()], 1);
    assert!(h.run_as(bearer(PROJ11), Command::SubmitJob(mine)).is_ok());

    let mut after = None;
    let mut seen = Vec::new();
    for _ in 0..100 {
        let q = Query::Jobs(JobFilter {
            after,
            ..Default::default()
        });
        let Ok(Answer::Jobs(page)) = answer_as(&h.state, bearer(PROJ11), &q) else {
            panic!("a page");
        };
        seen.extend(page.jobs.iter().map(|j| j.spec.job.0));
        match page.next {
            None => break,
            Some(next) => {
                assert!(
                    h.state.scheduler.job(ORG, next).map(|j| j.spec.project) == Some(PROJECT),
                    "a cursor named job {}, not the project's",
                    next.0
                );
                after = Some(next);
            }
        }
    }
    assert_eq!(seen, vec![20_000]);
}

/// A tenant whose own token expires cannot issue a key that outlives it (rule version
/// 7): not a new principal without an expiry or with a later one, and not a rotation of
/// a longer-lived principal of its org (the new key, which the caller chose, keeps that
/// principal's life). Under version 6 it could, and the org's hour-long token became a
/// credential for good. Keys within its life are still issued, and an operator's are
/// not bounded so.
#[test]
fn a_tenant_cannot_issue_a_key_that_outlives_its_own() {
    let mut h = secured();
    let admin = h.admin;
    let short = "tok-org-1-short-lived-hhhhhhhhhhhhhhhhh";
    let end = h.now + 3_600_000;
    h.ok(Command::CreateToken {
        principal: PrincipalId(15),
        digest: TokenDigest::of(short.as_bytes()),
        scope: Scope::Org(ORG),
        expires_at_ms: Some(end),
    });
    let create = |principal: u64, token: &str, expires_at_ms: Option<u64>| Command::CreateToken {
        principal: PrincipalId(principal),
        digest: TokenDigest::of(token.as_bytes()),
        scope: Scope::Org(ORG),
        expires_at_ms,
    };
    // Principal 10 (the org's token from `secured`) never expires.
    let rotate_10 = |token: &str| Command::RotateToken {
        principal: PrincipalId(10),
        digest: TokenDigest::of(token.as_bytes()),
        overlap_ms: 0,
    };
    h.ok(Command::ActivateVersion { version: 6 });
    // Version 6: the short-lived token mints a principal that never expires.
    let forever = "tok-org-1-forever-iiiiiiiiiiiiiiiiiiiii";
    assert_eq!(
        h.run_as(bearer(short), create(16, forever, None)),
        Ok(Reply::TokenSet)
    );

    h.ok(Command::ActivateVersion { version: 7 });
    let before = h.state.state_hash();
    for (principal, expiry) in [(17, None), (18, Some(end + 1))] {
        let token = format!("tok-org-1-new-{principal}-jjjjjjjjjjjjjjjjjjjj");
        assert_eq!(
            h.run_as(bearer(short), create(principal, &token, expiry)),
            Err(CommandError::Unauthorized),
            "principal {principal}, expiry {expiry:?}"
        );
    }
    assert_eq!(
        h.run_as(
            bearer(short),
            rotate_10("tok-org-1-taken-over-kkkkkkkkkkkkkkk")
        ),
        Err(CommandError::Unauthorized)
    );
    // Nothing changed but the refusals' own audit and idempotency records: principal
    // 10's token still works and no new principal resolves.
    assert_ne!(h.state.state_hash(), before);
    let q = Query::Budget(ORG, BudgetScope::Org(ORG));
    assert!(answer_as(&h.state, bearer(ORG1), &q).is_ok());
    assert_eq!(
        answer_as(
            &h.state,
            bearer("tok-org-1-new-17-jjjjjjjjjjjjjjjjjjjj"),
            &q
        ),
        Err(QueryDenied::Unauthenticated)
    );
    // Within its life: issued. A rotation of itself keeps its life: issued.
    assert_eq!(
        h.run_as(
            bearer(short),
            create(19, "tok-org-1-within-llllllllllllllllllll", Some(end))
        ),
        Ok(Reply::TokenSet)
    );
    let renewed = "tok-org-1-short-renewed-mmmmmmmmmmmmmmm";
    assert_eq!(
        h.run_as(
            bearer(short),
            Command::RotateToken {
                principal: PrincipalId(15),
                digest: TokenDigest::of(renewed.as_bytes()),
                overlap_ms: 0,
            }
        ),
        Ok(Reply::TokenSet)
    );
    // A token without an expiry still issues what it likes in its org, and the operator
    // anything.
    assert_eq!(
        h.run_as(
            bearer(ORG1),
            create(20, "tok-org-1-from-forever-nnnnnnnnnnnnnnn", None)
        ),
        Ok(Reply::TokenSet)
    );
    assert_eq!(
        h.run_as(
            admin,
            create(21, "tok-org-1-from-admin-oooooooooooooooo", None)
        ),
        Ok(Reply::TokenSet)
    );
}

/// A project token moves its project's credits only back to its org (rule version 7):
/// a transfer to another project of the org answers `UnknownProject` whether that
/// project exists or not, and moves nothing. Under version 6 it credited the sibling,
/// and the answers told existing sibling ids from unknown ones.
#[test]
fn a_project_token_transfers_only_to_its_org() {
    let mut h = secured();
    h.grant(
        900,
        Account::Project(PROJECT),
        BucketKind::Paid,
        credits(10),
        None,
    );
    let to = |account| Command::Transfer {
        from: Account::Project(PROJECT),
        to: account,
        amount_micro: 1,
    };
    let sibling = Account::Project(PROJECT_B);
    let missing = Account::Project(ProjectId(999));
    let balance = |h: &Harness, a| {
        h.state
            .ledger
            .balance(ORG, a, h.now, 0)
            .unwrap()
            .available_micro()
    };
    h.ok(Command::ActivateVersion { version: 6 });
    assert!(h.run_as(bearer(PROJ11), to(sibling)).is_ok());
    assert_eq!(balance(&h, sibling), 1, "version 6 credited the sibling");
    assert_eq!(
        h.run_as(bearer(PROJ11), to(missing)),
        Err(CommandError::UnknownProject)
    );

    h.ok(Command::ActivateVersion { version: 7 });
    for target in [sibling, missing] {
        assert_eq!(
            h.run_as(bearer(PROJ11), to(target)),
            Err(CommandError::UnknownProject),
            "{target:?}"
        );
    }
    assert_eq!(balance(&h, sibling), 1, "nothing moved");
    // Back to its org: allowed; the org token still moves credit between projects.
    assert!(h.run_as(bearer(PROJ11), to(Account::Org(ORG))).is_ok());
    assert!(h
        .run_as(
            bearer(ORG1),
            Command::Transfer {
                from: Account::Project(PROJECT),
                to: sibling,
                amount_micro: 1,
            }
        )
        .is_ok());
    assert_eq!(balance(&h, sibling), 2);
}
