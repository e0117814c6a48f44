//! Security against a real 3-node cluster started WITHOUT dev mode: bootstrap through
//! `allotctl cluster init`, tokens through `allotctl token`, then tenant isolation on
//! every API by direct call and via a follower, revocation on every node, agent scope,
//! and malformed/unknown/expired tokens.

mod common;

use allot_client::{AuditFilter, Client, Error};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_statemachine::query::{Answer, JobFilter, Query};
use allot_statemachine::testkit::{a100, credits};
use allot_statemachine::*;
use common::*;
use std::time::{Duration, Instant};

fn client(endpoints: Vec<String>, token: Option<&str>) -> Client {
    let mut b = Client::builder()
        .endpoints(endpoints)
        .timeout(Duration::from_secs(15))
        .attempt_timeout(Duration::from_secs(3))
        .retries(20)
        .shards(1);
    if let Some(t) = token {
        b = b.token(t);
    }
    b.build().unwrap()
}

fn token_of(eps: &str, admin: &str, scope: &str) -> String {
    let v = json(
        eps,
        &["--token", admin, "token", "create", "--scope", scope],
    );
    v["token"].as_str().unwrap().to_string()
}

fn rejected(e: Error) -> CommandError {
    match e {
        Error::Rejected(c) => c,
        other => panic!("expected a typed refusal, got {other:?}"),
    }
}

fn is_unauthenticated(e: &Error) -> bool {
    matches!(
        e,
        Error::Unauthenticated(_) | Error::Rejected(CommandError::Unauthenticated)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_isolation_revocation_and_agent_scope_on_a_real_cluster() {
    let dir = tempfile::Builder::new()
        .prefix("allot-security-")
        .tempdir()
        .unwrap();
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.path().into(), 3, 1).unwrap();
    c.dev_mode = false;
    c.start_all().unwrap();
    let eps = c.endpoints().join(",");

    // Init + bootstrap: the admin token is generated and written to a 0600 file.
    let token_file = dir.path().join("admin-token");
    let mut init = vec![
        "cluster".to_string(),
        "init".into(),
        "--admin-token-file".into(),
        token_file.display().to_string(),
    ];
    for n in &c.nodes {
        init.extend(["--member".into(), format!("{}={}", n.id, n.addr)]);
    }
    let mut init_json: Vec<&str> = init.iter().map(String::as_str).collect();
    init_json.extend(["-o", "json"]);
    let o = ctl(&eps, &init_json);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["secured"], true);
    let admin_token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(v["admin_token"].as_str(), Some(admin_token.as_str()));
    // Init says how to use the token (on stderr, so stdout stays one JSON document).
    assert!(
        o.stderr.contains("export ALLOTCTL_TOKEN") && o.stderr.contains(&admin_token),
        "{}",
        o.stderr
    );
    // These nodes run without --insecure-dev-mode: none of them logged the dev-mode
    // warning (the dev-mode clusters' nodes do: node/tests/api.rs).
    for n in &c.nodes {
        assert!(!c.log_tail(n.id, 500).contains("INSECURE DEV MODE"));
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    c.admin_token = Some(admin_token.clone());
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    // Re-running init (now as the admin: the cluster is secured) with the same token
    // file is idempotent; without a token it is refused.
    let rerun: Vec<&str> = init.iter().map(String::as_str).collect();
    assert_ne!(ctl(&eps, &rerun).code, 0);
    let mut with_token = vec!["--token", admin_token.as_str()];
    with_token.extend(rerun.iter().copied());
    json(&eps, &with_token);

    // No token: refused on every API (not dev mode), with nothing applied.
    let anon = client(c.endpoints(), None);
    let e = anon.create_org(OrgId(1)).await.unwrap_err();
    assert!(is_unauthenticated(&e), "{e:?}");
    let e = anon.totals(0).await.unwrap_err();
    assert!(is_unauthenticated(&e), "{e:?}");
    let out = ctl(&eps, &["org", "create", "--org", "1"]);
    assert_ne!(out.code, 0, "{}", out.stdout);
    // The operator is told the token is missing, not that the cluster is unreachable.
    assert!(
        out.stderr.contains("requires a token") && !out.stderr.contains("unreachable"),
        "{}",
        out.stderr
    );
    let out = ctl(
        &eps,
        &[
            "--token",
            "not-a-token-of-this-cluster-0123456789",
            "org",
            "create",
            "--org",
            "1",
        ],
    );
    assert!(
        out.stderr.contains("refused the token") && !out.stderr.contains("unreachable"),
        "{}",
        out.stderr
    );

    // The admin sets up two orgs with credit, a GPU node, prices.
    let admin = client(c.endpoints(), Some(&admin_token));
    for org in [1, 2] {
        admin.create_org(OrgId(org)).await.unwrap();
        admin
            .create_project(OrgId(org), ProjectId(org * 10))
            .await
            .unwrap();
        admin
            .create_user(OrgId(org), UserId(org * 100))
            .await
            .unwrap();
        admin
            .issue_grant(
                OrgId(org),
                Grant {
                    bucket: BucketId(org),
                    owner: Account::Project(ProjectId(org * 10)),
                    kind: BucketKind::Paid,
                    amount_micro: credits(1_000),
                    expires_at_ms: None,
                    priority: 0,
                    policy: None,
                    source_ref: None,
                },
            )
            .await
            .unwrap();
    }
    admin.set_prices(vec![(a100(), 3_600_000)]).await.unwrap();
    admin
        .register_node(
            0,
            NodeSpec {
                node: NodeId(1),
                gpu_type: a100(),
                gpu_count: 8,
                gpu_mem_gb: 80,
                labels: vec![],
                incarnation: 0,
            },
        )
        .await
        .unwrap();

    // Tokens through the CLI (admin token in --token).
    let org1 = token_of(&eps, &admin_token, "org:1");
    let org2 = token_of(&eps, &admin_token, "org:2");
    let agent1 = token_of(&eps, &admin_token, "agent:1");
    let agent2 = token_of(&eps, &admin_token, "agent:2");

    // Org 2 submits a job; node 1's agent heartbeats so it gets placed.
    let b2 = client(c.endpoints(), Some(&org2));
    let job = JobSpec {
        job: JobId(500),
        project: ProjectId(20),
        user: UserId(200),
        tier: Tier(1),
        gpu_types: vec![a100()],
        gpus: 1,
        mem_floor_gb: 0,
        preemptible: true,
        checkpointable: true,
        max_duration_ms: 3_600_000,
    };
    b2.submit_job(OrgId(2), job.clone()).await.unwrap();
    let a1 = client(c.endpoints(), Some(&agent1));
    a1.node_heartbeat(0, NodeId(1)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let placed = loop {
        let j = b2.job(OrgId(2), JobId(500)).await.unwrap();
        if let Some(p) = j.placement {
            break (p.node, j.attempt);
        }
        assert!(Instant::now() < deadline, "job never placed");
        a1.node_heartbeat(0, NodeId(1)).await.unwrap();
    };
    assert_eq!(placed.0, NodeId(1));

    // Org 1's token against org 2, at every node (leader and followers alike): every
    // answer is the one a nonexistent object gets.
    let leader = c.leader_of(0).await.unwrap();
    for n in &c.nodes {
        let via = if n.id == leader { "leader" } else { "follower" };
        let a = client(vec![n.addr.clone()], Some(&org1));
        // read
        let foreign = a
            .query(
                0,
                &Query::Balance {
                    org: OrgId(2),
                    account: Account::Project(ProjectId(20)),
                    horizon_ms: 0,
                },
            )
            .await
            .unwrap();
        let missing = a
            .query(
                0,
                &Query::Balance {
                    org: OrgId(2),
                    account: Account::Project(ProjectId(999)),
                    horizon_ms: 0,
                },
            )
            .await
            .unwrap();
        assert_eq!(foreign, missing, "{via}");
        assert_eq!(foreign, Answer::Balance(None), "{via}");
        let j = a.query(0, &Query::Job(OrgId(2), JobId(500))).await.unwrap();
        assert_eq!(
            j,
            a.query(0, &Query::Job(OrgId(2), JobId(999))).await.unwrap(),
            "{via}"
        );
        assert_eq!(j, Answer::Job(None));
        let page = a
            .jobs(
                OrgId(2),
                JobFilter {
                    org: Some(OrgId(2)),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(page.jobs.is_empty(), "{via}: {page:?}");
        let e = a.query(0, &Query::Totals).await.unwrap_err();
        assert!(matches!(e, Error::PermissionDenied(_)), "{via}: {e:?}");
        // spend
        let hold = HoldSpec {
            hold: HoldId(900 + n.id),
            project: ProjectId(20),
            user: UserId(200),
            tier: Tier(1),
            gpu_types: vec![a100()],
            amount_micro: 1,
        };
        // Naming another org is answered as naming an org that does not exist.
        assert_eq!(
            rejected(a.create_hold(OrgId(999), hold.clone()).await.unwrap_err()),
            CommandError::UnknownOrg,
            "{via}"
        );
        assert_eq!(
            rejected(a.create_hold(OrgId(2), hold).await.unwrap_err()),
            CommandError::UnknownOrg,
            "{via}"
        );
        let e = a
            .transfer(
                OrgId(2),
                Account::Project(ProjectId(20)),
                Account::Org(OrgId(2)),
                1,
            )
            .await
            .unwrap_err();
        assert_eq!(rejected(e), CommandError::UnknownOrg, "{via}");
        // submit
        let mut j2 = job.clone();
        j2.job = JobId(600 + n.id);
        assert_eq!(
            rejected(a.submit_job(OrgId(2), j2.clone()).await.unwrap_err()),
            CommandError::UnknownOrg,
            "{via}"
        );
        // In its own namespace, org 2's project is no project of org 1's.
        assert_eq!(
            rejected(a.submit_job(OrgId(1), j2).await.unwrap_err()),
            CommandError::UnknownProject,
            "{via}"
        );
        // cancel: same as a job that does not exist
        assert_eq!(
            rejected(a.cancel_job(OrgId(2), JobId(500)).await.unwrap_err()),
            rejected(a.cancel_job(OrgId(2), JobId(999)).await.unwrap_err()),
        );
        // audit: a filter on org 2 yields nothing; unfiltered, only org 1's events.
        let p = a
            .audit(
                0,
                AuditFilter {
                    org: Some(OrgId(2)),
                    ..Default::default()
                },
                0,
                1000,
            )
            .await
            .unwrap();
        assert!(p.events.is_empty(), "{via}: {} events", p.events.len());
        let p = a.audit(0, AuditFilter::default(), 0, 1000).await.unwrap();
        assert!(!p.events.is_empty());
        assert!(p.events.iter().all(|e| e.org == Some(OrgId(1))), "{via}");
        // admin-only
        let e = a.set_prices(vec![(a100(), 1)]).await.unwrap_err();
        assert_eq!(rejected(e), CommandError::Unauthorized);
        let out = ctl(&n.addr, &["--token", &org1, "shard", "hash"]);
        assert_ne!(out.code, 0);
    }
    // Org 2's job is untouched.
    let j = b2.job(OrgId(2), JobId(500)).await.unwrap();
    assert!(!j.state.is_final());

    // An agent token cannot finish another node's job, nor watch its assignments.
    let a2 = client(c.endpoints(), Some(&agent2));
    let e = a2
        .finish_job(0, OrgId(2), JobId(500), placed.1, true)
        .await
        .unwrap_err();
    assert_eq!(rejected(e), CommandError::UnknownJob);
    let e = a2.assignments(0, NodeId(1)).await.unwrap_err();
    assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}");
    assert!(a1.assignments(0, NodeId(1)).await.is_ok());

    // Malformed and unknown tokens.
    for bad in [
        "short",
        "has space in it 0000000000000000",
        "tab\tin-it-000000000000000000000",
    ] {
        let e = client(c.endpoints(), Some(bad))
            .totals(0)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Unauthenticated(_)), "{bad:?}: {e:?}");
    }
    // A token that cannot even be a header value is refused by the client library.
    let unprintable = Client::builder()
        .endpoints(c.endpoints())
        .token("\u{7f}nonprintable-000000000000000")
        .build();
    assert!(matches!(unprintable, Err(Error::Config(_))));
    let random = allot_client::security::generate_token().unwrap();
    let e = client(c.endpoints(), Some(&random))
        .balance(OrgId(1), Account::Org(OrgId(1)), 0)
        .await
        .unwrap_err();
    assert!(is_unauthenticated(&e), "{e:?}");

    // Revocation through the CLI; refused on every node, immediately.
    let org1_client = client(c.endpoints(), Some(&org1));
    assert!(org1_client
        .balance(OrgId(1), Account::Project(ProjectId(10)), 0)
        .await
        .is_ok());
    let principal = json(
        &eps,
        &[
            "--token",
            &admin_token,
            "token",
            "create",
            "--scope",
            "org:1",
        ],
    );
    let (p_id, p_tok) = (
        principal["principal"].as_u64().unwrap(),
        principal["token"].as_str().unwrap().to_string(),
    );
    let revoked_at = Instant::now();
    json(
        &eps,
        &[
            "--token",
            &admin_token,
            "token",
            "revoke",
            "--principal",
            &p_id.to_string(),
        ],
    );
    for n in &c.nodes {
        let a = client(vec![n.addr.clone()], Some(&p_tok));
        // Commands resolve on the leader at their log position: refused at once.
        let e = a.create_project(OrgId(1), ProjectId(11)).await.unwrap_err();
        assert!(is_unauthenticated(&e), "node {}: {e:?}", n.id);
        // Linearizable reads: refused at once on every node.
        let e = a
            .query(0, &Query::Budget(OrgId(1), BudgetScope::Org(OrgId(1))))
            .await
            .unwrap_err();
        assert!(is_unauthenticated(&e), "node {}: {e:?}", n.id);
    }
    // Stale reads from each replica: refused as soon as the replica applied the revoke
    // (one Raft round); bounded wait.
    for n in &c.nodes {
        let a = client(vec![n.addr.clone()], Some(&p_tok));
        loop {
            match a.query_replica(&n.addr, 0, &Query::Prices).await {
                Err(e) if is_unauthenticated(&e) => break,
                other => assert!(
                    revoked_at.elapsed() < Duration::from_secs(5),
                    "node {} still answers a revoked token: {other:?}",
                    n.id
                ),
            }
        }
    }

    // Rotation through the CLI (no overlap): the new token works at once, the old one
    // is refused at once, and the principal (its identity) is the same.
    let r = json(
        &eps,
        &[
            "--token",
            &admin_token,
            "token",
            "create",
            "--scope",
            "org:1",
        ],
    );
    let (r_id, old_tok) = (
        r["principal"].as_u64().unwrap(),
        r["token"].as_str().unwrap().to_string(),
    );
    let rot = json(
        &eps,
        &[
            "--token",
            &admin_token,
            "token",
            "rotate",
            "--principal",
            &r_id.to_string(),
        ],
    );
    assert_eq!(rot["principal"].as_u64(), Some(r_id));
    let new_tok = rot["token"].as_str().unwrap().to_string();
    assert_ne!(new_tok, old_tok);
    let e = client(c.endpoints(), Some(&old_tok))
        .balance(OrgId(1), Account::Project(ProjectId(10)), 0)
        .await
        .unwrap_err();
    assert!(is_unauthenticated(&e), "{e:?}");
    assert!(client(c.endpoints(), Some(&new_tok))
        .balance(OrgId(1), Account::Project(ProjectId(10)), 0)
        .await
        .is_ok());

    // An expired token (created to live 1 s): allotctl fails with a clear error and
    // a non-zero exit, and what it sent is not applied.
    let exp = json(
        &eps,
        &[
            "--token",
            &admin_token,
            "token",
            "create",
            "--scope",
            "org:1",
            "--expires-in",
            "1s",
        ],
    );
    let exp_tok = exp["token"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = ctl(&eps, &["--token", &exp_tok, "balance", "--org", "1"]);
        if out.code != 0 {
            assert!(
                out.stderr.to_lowercase().contains("unauthenticated"),
                "{}",
                out.stderr
            );
            break;
        }
        assert!(Instant::now() < deadline, "the token never expired");
    }
    let out = ctl(
        &eps,
        &[
            "--token",
            &exp_tok,
            "project",
            "create",
            "--org",
            "1",
            "--project",
            "13",
        ],
    );
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.to_lowercase().contains("unauthenticated"),
        "{}",
        out.stderr
    );
    let b = admin
        .query(
            0,
            &Query::Balance {
                org: OrgId(1),
                account: Account::Project(ProjectId(13)),
                horizon_ms: 0,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        b,
        Answer::Balance(None),
        "nothing applied with an expired token"
    );

    // Denials at the edge are in the audit trail, with the caller and no secret.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = admin
            .audit(0, AuditFilter::default(), 0, 10_000)
            .await
            .unwrap();
        let denied: Vec<_> = p
            .events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::Denied { caller, api, .. } => Some((*caller, api.clone())),
                _ => None,
            })
            .collect();
        let found = denied.iter().any(|(caller, api)| {
            matches!(caller, Actor::Tenant { org: OrgId(1), .. }) && api == "query:totals"
        });
        if found {
            let all = format!("{denied:?}");
            assert!(!all.contains(&org1) && !all.contains(&admin_token));
            break;
        }
        assert!(Instant::now() < deadline, "denials not audited: {denied:?}");
    }
    // And the apply-side refusals are audited as command events with their caller.
    let p = admin
        .audit(0, AuditFilter::default(), 0, 10_000)
        .await
        .unwrap();
    assert!(p.events.iter().any(|e| matches!(
        (&e.body, e.actor),
        (
            EventBody::Command {
                outcome: Err(CommandError::UnknownProject),
                ..
            },
            Actor::Tenant { org: OrgId(1), .. }
        )
    )));
}
