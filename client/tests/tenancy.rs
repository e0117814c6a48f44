//! Tenants on a secured cluster with the README's four shards (issue 20): org tokens are
//! created (atomically, a retry with the same request id completing), used, rotated
//! inside overlaps and revoked through `allotctl`; backups are taken and verified with
//! several orgs' tokens present; an org's plan and quotas are set and shown; and one
//! org flooding every table it can grow leaves another org's work unharmed.

mod common;

use allot_client::{Client, Error};
use allot_node::local_cluster::{node_binary, LocalCluster};
use allot_statemachine::backup::ShardBackup;
use allot_statemachine::testkit::{a100, credits};
use allot_statemachine::*;
use common::*;
use std::time::{Duration, Instant};

const SHARDS: u32 = 4;

fn client(endpoints: Vec<String>, token: &str) -> Client {
    Client::builder()
        .endpoints(endpoints)
        .timeout(Duration::from_secs(15))
        .attempt_timeout(Duration::from_secs(3))
        .retries(20)
        .shards(SHARDS)
        .token(token)
        .build()
        .unwrap()
}

/// A secured 3-node cluster with four shards, initialised through `allotctl cluster
/// init`; returns it with the admin token.
async fn secured(dir: &std::path::Path, node_args: &[&str]) -> (LocalCluster, String) {
    let mut c = LocalCluster::new(node_binary().unwrap(), dir.into(), 3, SHARDS).unwrap();
    c.dev_mode = false;
    for n in &mut c.nodes {
        n.extra_args = node_args.iter().map(|a| a.to_string()).collect();
    }
    c.start_all().unwrap();
    let eps = c.endpoints().join(",");
    let token_file = dir.join("admin-token");
    let mut init = vec![
        "cluster".to_string(),
        "init".into(),
        "--admin-token-file".into(),
        token_file.display().to_string(),
    ];
    for n in &c.nodes {
        init.extend(["--member".into(), format!("{}={}", n.id, n.addr)]);
    }
    let args: Vec<&str> = init.iter().map(String::as_str).collect();
    let v = json(&eps, &args);
    assert_eq!(v["secured"], true);
    let admin = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    c.admin_token = Some(admin.clone());
    c.wait_leaders(Duration::from_secs(30)).await.unwrap();
    (c, admin)
}

fn hold(id: u64, project: u64, user: u64) -> HoldSpec {
    HoldSpec {
        hold: HoldId(id),
        project: ProjectId(project),
        user: UserId(user),
        tier: Tier::PAID,
        gpu_types: vec![],
        amount_micro: credits(1),
    }
}

fn unauthenticated(e: &Error) -> bool {
    matches!(
        e,
        Error::Unauthenticated(_) | Error::Rejected(CommandError::Unauthenticated)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn org_tokens_and_backups_on_a_secured_four_shard_cluster() {
    let dir = tempfile::Builder::new()
        .prefix("allot-tenancy-")
        .tempdir()
        .unwrap();
    let (c, admin_token) = secured(dir.path(), &[]).await;
    let eps = c.endpoints().join(",");
    let admin = client(c.endpoints(), &admin_token);
    let as_admin = |args: &[&str]| {
        let mut all = vec!["--token", admin_token.as_str()];
        all.extend_from_slice(args);
        json(&eps, &all)
    };
    // Three orgs, on three different home shards (7 % 4 = 3, 8 % 4 = 0, 9 % 4 = 1).
    for org in [7u64, 8, 9] {
        let o = org.to_string();
        as_admin(&["org", "create", "--org", &o]);
        as_admin(&[
            "project",
            "create",
            "--org",
            &o,
            "--project",
            &(org * 10).to_string(),
        ]);
        as_admin(&[
            "user",
            "create",
            "--org",
            &o,
            "--user",
            &(org * 100).to_string(),
        ]);
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

    // An operator's token lives on every shard, so creating one runs on each. The same
    // client's next commands keep request ids of their own whichever shard they reach:
    // the creation used id n + s on shard s, the ids the client hands out next, and org
    // 9's next command (shard 1) was refused `RequestIdReused`.
    admin
        .create_token(PrincipalId(990), Scope::Agent(NodeId(99)), None)
        .await
        .unwrap();
    for org in [9u64, 7, 8] {
        let made = admin
            .create_project(OrgId(org), ProjectId(org * 10 + 1))
            .await;
        assert!(made.is_ok(), "org {org}: {made:?}");
    }

    // An org token, created with a chosen request id from a token file: the command
    // retried (a lost answer) completes with the same principal and token.
    let file = dir.path().join("org7-token");
    std::fs::write(&file, allot_client::security::generate_token().unwrap()).unwrap();
    let create = [
        "token",
        "create",
        "--scope",
        "org:7",
        "--principal",
        "700",
        "--request-id",
        "77001",
        "--token-file",
        file.to_str().unwrap(),
    ];
    let first = as_admin(&create);
    let again = as_admin(&create);
    assert_eq!(first, again, "a retry completes with the first result");
    let mut tokens = vec![first["token"].as_str().unwrap().to_string()];
    // Another org's token of the same principal id lives in that org's namespace.
    let org8 = as_admin(&["token", "create", "--scope", "org:8", "--principal", "700"]);
    let org8 = org8["token"].as_str().unwrap().to_string();
    let proj9 = as_admin(&["token", "create", "--scope", "project:9/90"]);
    let proj9 = proj9["token"].as_str().unwrap().to_string();

    // Used: a hold in org 7 on its home shard; the balance reads back.
    let t7 = client(c.endpoints(), &tokens[0]);
    t7.create_hold(OrgId(7), hold(1, 70, 700)).await.unwrap();
    let b = t7
        .balance(OrgId(7), Account::Project(ProjectId(70)), 0)
        .await
        .unwrap();
    assert_eq!(b.held_micro, credits(1));
    client(c.endpoints(), &org8)
        .create_hold(OrgId(8), hold(1, 80, 800))
        .await
        .unwrap();
    client(c.endpoints(), &proj9)
        .create_hold(OrgId(9), hold(1, 90, 900))
        .await
        .unwrap();

    // Rotated three times inside the overlap (org found from the principal): every key
    // still inside its overlap works, the newest too.
    for i in 0..3u64 {
        let v = as_admin(&[
            "token",
            "rotate",
            "--principal",
            "700",
            "--org",
            "7",
            "--overlap",
            "10m",
        ]);
        tokens.push(v["token"].as_str().unwrap().to_string());
        for (k, t) in tokens.iter().enumerate() {
            client(c.endpoints(), t)
                .create_hold(OrgId(7), hold(10 + i * 10 + k as u64, 70, 700))
                .await
                .unwrap_or_else(|e| panic!("key {k} after rotation {i}: {e:?}"));
        }
    }
    // Backups with three orgs' tokens present: every shard, verified offline.
    let out = dir.path().join("backup");
    let rows = as_admin(&["backup", "create", "--out", out.to_str().unwrap()]);
    let rows = rows.as_array().unwrap().clone();
    assert_eq!(rows.len(), SHARDS as usize);
    let files: Vec<String> = rows
        .iter()
        .map(|r| r["file"].as_str().unwrap().to_string())
        .collect();
    let mut verify = vec!["backup", "verify"];
    verify.extend(files.iter().map(String::as_str));
    let verified = json(&eps, &verify);
    for (v, r) in verified.as_array().unwrap().iter().zip(&rows) {
        assert_eq!(v["state_hash"], r["state_hash"]);
    }
    // The org tokens are in their home shards' files only; the operator's in every one.
    for f in &files {
        let b = ShardBackup::decode(&std::fs::read(f).unwrap()).unwrap();
        let (state, _) = b.verify().unwrap();
        let orgs: Vec<Option<OrgId>> = state
            .security
            .principals
            .keys()
            .map(|(o, _)| *o)
            .filter(|o| o.is_some())
            .collect();
        for o in orgs.iter().flatten() {
            assert_eq!(
                o.0 % SHARDS as u64,
                b.shard as u64,
                "{o} on shard {}",
                b.shard
            );
        }
        assert!(state.security.principal(None, PrincipalId(1)).is_some());
    }

    // Revoked: every key of the principal stops working at once; other orgs' do not.
    as_admin(&["token", "revoke", "--principal", "700", "--org", "7"]);
    for t in &tokens {
        let e = client(c.endpoints(), t)
            .create_hold(OrgId(7), hold(99, 70, 700))
            .await
            .unwrap_err();
        assert!(unauthenticated(&e), "{e:?}");
    }
    client(c.endpoints(), &org8)
        .create_hold(OrgId(8), hold(2, 80, 800))
        .await
        .unwrap();
    // A second backup still verifies (revoked principals included).
    let out2 = dir.path().join("backup2");
    let rows = as_admin(&["backup", "create", "--out", out2.to_str().unwrap()]);
    let rows = rows.as_array().unwrap().clone();
    assert_eq!(rows.len(), SHARDS as usize);
    let files: Vec<std::path::PathBuf> = rows
        .iter()
        .map(|r| r["file"].as_str().unwrap().into())
        .collect();

    // Restored into a new secured cluster on other ports: the tenants' tokens come
    // with it — org 8's works, org 7's revoked keys stay refused, the operator's works.
    drop(c);
    let mut r = LocalCluster::new(node_binary().unwrap(), dir.path().join("r"), 3, SHARDS).unwrap();
    r.dev_mode = false;
    r.admin_token = Some(admin_token.clone());
    restore_cluster(&r, &files);
    r.start_all().unwrap();
    r.wait_leaders(Duration::from_secs(60)).await.unwrap();
    client(r.endpoints(), &org8)
        .create_hold(OrgId(8), hold(3, 80, 800))
        .await
        .expect("org 8's token on the restored cluster");
    for t in &tokens {
        let e = client(r.endpoints(), t)
            .create_hold(OrgId(7), hold(98, 70, 700))
            .await
            .unwrap_err();
        assert!(unauthenticated(&e), "a revoked key after restore: {e:?}");
    }
    client(r.endpoints(), &admin_token)
        .create_org(OrgId(11))
        .await
        .expect("the operator's token on the restored cluster");
}

/// Quotas and plans through `allotctl`, on the org's home shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_and_quotas_through_allotctl() {
    let dir = tempfile::Builder::new()
        .prefix("allot-plans-")
        .tempdir()
        .unwrap();
    let (c, admin_token) = secured(dir.path(), &[]).await;
    let eps = c.endpoints().join(",");
    let as_admin = |args: &[&str]| {
        let mut all = vec!["--token", admin_token.as_str()];
        all.extend_from_slice(args);
        json(&eps, &all)
    };
    as_admin(&["org", "create", "--org", "6"]);
    as_admin(&["project", "create", "--org", "6", "--project", "60"]);
    as_admin(&["project", "create", "--org", "6", "--project", "61"]);
    // The default: every tier but the highest.
    let v = as_admin(&["plan", "show", "--org", "6"]);
    assert_eq!(v["tiers"], serde_json::json!([0, 1]));
    assert_eq!(v["plan"], serde_json::Value::Null);
    let v = as_admin(&[
        "plan",
        "set",
        "--org",
        "6",
        "--tiers",
        "free,paid,enterprise",
        "--project",
        "61=free",
    ]);
    assert_eq!(v["tiers"], serde_json::json!([0, 1, 2]));
    assert_eq!(
        v["plan"]["project_tiers"],
        serde_json::json!([[60 + 1, [0]]])
    );
    // Quotas: one field changes, the others keep their values.
    let before = as_admin(&["quota", "show", "--org", "6"]);
    assert_eq!(before["quota_set"], false);
    let v = as_admin(&["quota", "set", "--org", "6", "--holds-open-max", "5"]);
    assert_eq!(v["quota"]["holds_open_max"], 5);
    assert_eq!(v["quota"]["queued_max"], before["quota"]["queued_max"]);
    assert_eq!(v["quota_set"], true);
    // The old form still works.
    let v = as_admin(&[
        "quota",
        "set",
        "--org",
        "6",
        "--queued-max",
        "3",
        "--running-max",
        "2",
    ]);
    assert_eq!(v["quota"]["queued_max"], 3);
    assert_eq!(v["quota"]["holds_open_max"], 5);
    let v = as_admin(&["quota", "set", "--org", "6", "--clear"]);
    assert_eq!(v["quota"], serde_json::Value::Null);
    assert_eq!(v["effective"], before["quota"]);
    // An org token reads its own quotas, not another org's; it cannot set its plan.
    let t = as_admin(&["token", "create", "--scope", "org:6"]);
    let t = t["token"].as_str().unwrap();
    json(&eps, &["--token", t, "quota", "show", "--org", "6"]);
    let o = ctl(
        &eps,
        &[
            "--token", t, "plan", "set", "--org", "6", "--tiers", "0,1,2",
        ],
    );
    assert_ne!(o.code, 0);
    assert!(
        o.stderr.contains("UNAUTHORIZED") || o.stderr.contains("not allowed"),
        "{}",
        o.stderr
    );
}

/// One org floods every table it can grow, past its quotas, with many concurrent
/// writers, while another org's submit, heartbeat, finish and grant keep succeeding;
/// prints both orgs' figures and the second org's latency before and during the flood.
/// The nodes run with a per-tenant write rate (300/s) sized for this 2-core machine,
/// which runs all three nodes and the flood: the rate bounds the CPU one tenant's
/// flood takes, the quotas bound the state it can grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_org_flooding_its_quotas_leaves_another_unharmed() {
    let dir = tempfile::Builder::new()
        .prefix("allot-flood-")
        .tempdir()
        .unwrap();
    let rate = ["--rate-limit", "300", "--rate-burst", "300"];
    let (c, admin_token) = secured(dir.path(), &rate).await;
    let admin = client(c.endpoints(), &admin_token);
    // Org 4 (the flooder) and org 8: both on shard 0, so they share its tables.
    let (a, b) = (OrgId(4), OrgId(8));
    for org in [a, b] {
        admin.create_org(org).await.unwrap();
        admin
            .create_project(org, ProjectId(org.0 * 10))
            .await
            .unwrap();
        admin.create_user(org, UserId(org.0 * 100)).await.unwrap();
        admin
            .issue_grant(
                org,
                Grant {
                    bucket: BucketId(org.0),
                    owner: Account::Org(org),
                    kind: BucketKind::Paid,
                    amount_micro: credits(1_000_000),
                    expires_at_ms: None,
                    priority: 0,
                    policy: None,
                    source_ref: None,
                },
            )
            .await
            .unwrap();
    }
    admin
        .set_quota(
            a,
            Some(Quota {
                queued_max: 50,
                running_max: 4,
                holds_open_max: 200,
                records_max: 3_000,
                buckets_max: 64,
                principals_max: 20,
                projects_max: 100,
                users_max: 100,
                finished_jobs_max: 100,
                settled_holds_max: 100,
                streams_max: 4,
            }),
        )
        .await
        .unwrap();
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
    let tok = |scope| {
        let admin = admin.clone();
        async move {
            let t = allot_client::security::generate_token().unwrap();
            let p = PrincipalId(rand_id());
            admin
                .create_token_with(p, scope, None, &t, admin.next_request_id())
                .await
                .unwrap();
            t
        }
    };
    let ta = tok(Scope::Org(a)).await;
    let ta2 = tok(Scope::Org(a)).await;
    let tb = tok(Scope::Org(b)).await;
    let agent = tok(Scope::Agent(NodeId(1))).await;
    let (ca, cb, cn) = (
        client(c.endpoints(), &ta),
        client(c.endpoints(), &tb),
        client(c.endpoints(), &agent),
    );
    cn.node_heartbeat(0, NodeId(1)).await.unwrap();

    // Org 8's cycle: a grant (admin), a submitted job that is placed, heartbeats and
    // finishes; each step timed.
    async fn cycle(
        round: u64,
        admin: &Client,
        cb: &Client,
        cn: &Client,
        b: OrgId,
        lat: &mut [Vec<Duration>; 4],
    ) {
        let t = Instant::now();
        admin
            .issue_grant(
                b,
                Grant {
                    bucket: BucketId(100_000 + round),
                    owner: Account::Org(b),
                    kind: BucketKind::Paid,
                    amount_micro: credits(1),
                    expires_at_ms: None,
                    priority: 0,
                    policy: None,
                    source_ref: None,
                },
            )
            .await
            .unwrap_or_else(|e| panic!("grant {round}: {e:?}"));
        lat[0].push(t.elapsed());
        let job = JobId(200_000 + round);
        let t = Instant::now();
        cb.submit_job(
            b,
            JobSpec {
                job,
                project: ProjectId(b.0 * 10),
                user: UserId(b.0 * 100),
                tier: Tier::PAID,
                gpu_types: vec![a100()],
                gpus: 1,
                mem_floor_gb: 0,
                preemptible: false,
                checkpointable: true,
                max_duration_ms: 3_600_000,
            },
        )
        .await
        .unwrap_or_else(|e| panic!("submit {round}: {e:?}"));
        lat[1].push(t.elapsed());
        let deadline = Instant::now() + Duration::from_secs(20);
        let attempt = loop {
            cn.node_heartbeat(0, NodeId(1)).await.unwrap();
            let j = cb.job(b, job).await.unwrap();
            if j.placement.is_some() {
                break j.attempt;
            }
            assert!(Instant::now() < deadline, "job {round} never placed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let t = Instant::now();
        cn.job_heartbeat(
            0,
            b,
            JobHeartbeat {
                job,
                attempt,
                seq: 1,
                progress_ppm: 0,
                checkpoint: 0,
            },
        )
        .await
        .unwrap_or_else(|e| panic!("heartbeat {round}: {e:?}"));
        lat[2].push(t.elapsed());
        let t = Instant::now();
        cn.finish_job(0, b, job, attempt, true)
            .await
            .unwrap_or_else(|e| panic!("finish {round}: {e:?}"));
        lat[3].push(t.elapsed());
    }

    const ROUNDS: u64 = 20;
    let mut quiet: [Vec<Duration>; 4] = Default::default();
    for round in 0..ROUNDS {
        cycle(round, &admin, &cb, &cn, b, &mut quiet).await;
    }
    // Org 8's own settled hold, whose tombstone org 4's churn must not evict.
    let b_hold = HoldId(300_000);
    cb.create_hold(b, hold(b_hold.0, b.0 * 10, b.0 * 100))
        .await
        .unwrap();
    cb.release_hold(b, b_hold).await.unwrap();

    // The flood: four concurrent writers of org 4, each command kind in turn, until
    // org 8's rounds are done.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (ca, stop) = (ca.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let (mut ok, mut quota, mut limited, mut other) = (0u64, 0u64, 0u64, Vec::new());
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let id = 1_000_000 * (w + 1) + i;
                // Half of the first 60 holds of each writer (120 in all: past the
                // settled-hold quota of 100) and every job are settled again a few
                // steps later, so the flood also churns its tombstone tables; later
                // holds stay open, so the open-hold quota (200) fills well before the
                // records quota (3,000: about 2,560 records in).
                let r = match i % 8 {
                    0 => ca
                        .create_hold(a, hold(id, a.0 * 10, a.0 * 100))
                        .await
                        .map(drop),
                    1 => ca
                        .submit_job(
                            a,
                            JobSpec {
                                job: JobId(id),
                                project: ProjectId(a.0 * 10),
                                user: UserId(a.0 * 100),
                                tier: Tier::PAID,
                                gpu_types: vec![a100()],
                                gpus: 1,
                                mem_floor_gb: 0,
                                preemptible: true,
                                checkpointable: true,
                                max_duration_ms: 3_600_000,
                            },
                        )
                        .await
                        .map(drop),
                    2 => ca.create_project(a, ProjectId(id)).await,
                    3 => ca.create_user(a, UserId(id)).await,
                    4 => ca
                        .transfer(
                            a,
                            Account::Org(a),
                            Account::Project(ProjectId(a.0 * 10)),
                            1 + i,
                        )
                        .await
                        .map(drop),
                    5 => {
                        ca.create_token_with(
                            PrincipalId(id),
                            Scope::Org(a),
                            None,
                            &allot_client::security::generate_token().unwrap(),
                            ca.next_request_id(),
                        )
                        .await
                    }
                    6 if i < 480 && (i / 8).is_multiple_of(2) => {
                        ca.release_hold(a, HoldId(id - 6)).await.map(drop)
                    }
                    6 => continue,
                    _ => ca.cancel_job(a, JobId(id - 6)).await.map(drop),
                };
                match r {
                    Ok(()) => ok += 1,
                    Err(Error::Rejected(CommandError::QuotaExceeded(_))) => quota += 1,
                    // Settling what a refused create never made.
                    Err(Error::Rejected(CommandError::UnknownHold | CommandError::UnknownJob)) => {}
                    // Rate limited past the client's retries.
                    Err(Error::Unavailable { .. }) => limited += 1,
                    Err(e) => other.push(format!("{e:?}")),
                }
            }
            (ok, quota, limited, other)
        }));
    }
    // Let the flood reach its quotas first: its records last (every tabled command of
    // org 4 is refused from then on, org 8's still run), its tombstones churning.
    let reached = Instant::now() + Duration::from_secs(90);
    loop {
        let v = admin.tenancy(a).await.unwrap();
        if v.used.holds_open >= v.quota.holds_open_max
            && v.used.projects >= v.quota.projects_max
            && v.used.records >= v.quota.records_max
            && v.used.settled_holds >= v.quota.settled_holds_max
            && v.used.finished_jobs >= v.quota.finished_jobs_max
        {
            break;
        }
        assert!(
            Instant::now() < reached,
            "the flood never reached its quotas: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut flooded: [Vec<Duration>; 4] = Default::default();
    for round in ROUNDS..2 * ROUNDS {
        cycle(round, &admin, &cb, &cn, b, &mut flooded).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut quota, mut limited) = (0, 0, 0);
    for w in writers {
        let (o, q, l, other) = w.await.unwrap();
        assert!(
            other.is_empty(),
            "the flood's refusals are typed: {other:?}"
        );
        ok += o;
        quota += q;
        limited += l;
    }
    let va = admin.tenancy(a).await.unwrap();
    let vb = admin.tenancy(b).await.unwrap();
    assert!(quota > 0, "the flood met its quotas");
    assert!(va.used.holds_open <= va.quota.holds_open_max);
    assert!(va.used.projects <= va.quota.projects_max);
    assert!(va.used.buckets <= va.quota.buckets_max);
    assert!(va.used.principals <= va.quota.principals_max);
    assert!(va.used.records <= va.quota.records_max);
    assert!(va.used.settled_holds <= va.quota.settled_holds_max);
    assert!(va.used.finished_jobs <= va.quota.finished_jobs_max);
    // Org 4's churn evicted its own oldest tombstones, never org 8's: org 8's first
    // finished job and its settled hold are still known as such.
    let first = cb.job(b, JobId(200_000)).await.unwrap();
    assert_eq!(
        first.state,
        allot_statemachine::scheduler::JobState::Succeeded,
        "{first:?}"
    );
    match cb.release_hold(b, b_hold).await {
        Err(Error::Rejected(CommandError::HoldSettled)) => {}
        other => panic!("org 8's settled hold was forgotten: {other:?}"),
    }
    // Org 4 at its records quota is refused, while org 8's commands still ran above.
    match ca.create_project(a, ProjectId(999_999)).await {
        Err(Error::Rejected(CommandError::QuotaExceeded(_))) => {}
        other => panic!("org 4 past its records quota: {other:?}"),
    }
    // Streams: org 4's principals together hold at most its quota's 4 open on a node
    // (each principal alone could hold 16); org 8 still opens one; org 4's close and
    // their places are free again.
    let streams_of_4 = streams_within_the_org_quota(&c, &[&ta, &ta2], &tb, a, b).await;
    assert_eq!(streams_of_4, 4);
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let names = ["grant", "submit", "heartbeat", "finish"];
    println!("flood: org 4 sent {ok} accepted, {quota} over quota, {limited} rate-limited");
    println!("flood: org 4 uses {:?}", va.used);
    println!("flood: org 8 uses {:?}", vb.used);
    for (i, name) in names.iter().enumerate() {
        let (q, f) = (median(&mut quiet[i]), median(&mut flooded[i]));
        println!(
            "flood: org 8 {name:<9} median {:>7.2} ms quiet, {:>7.2} ms during the flood ({:.2}x)",
            q.as_secs_f64() * 1e3,
            f.as_secs_f64() * 1e3,
            f.as_secs_f64() / q.as_secs_f64()
        );
    }
}

/// Opens `WatchEvents` streams on node 1 with `tokens` of org `a` in turn until one is
/// refused; checks the refusal, that org `b` can still open one, and that once org
/// `a`'s streams are dropped their places are free again. Returns how many opened.
async fn streams_within_the_org_quota(
    c: &LocalCluster,
    tokens: &[&str],
    other: &str,
    a: OrgId,
    b: OrgId,
) -> usize {
    use allot_proto::api::v1 as pb;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.node(1).addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut api = pb::api_client::ApiClient::new(ch);
    let watch = |token: &str, org: OrgId| {
        let mut r = tonic::Request::new(pb::WatchEventsRequest {
            shard: None,
            org: Some(org.0),
            from_seq: 0,
        });
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    };
    let open_until_refused = |api: &mut pb::api_client::ApiClient<_>| {
        let mut api = api.clone();
        async move {
            let mut open = Vec::new();
            for i in 0.. {
                match api.watch_events(watch(tokens[i % tokens.len()], a)).await {
                    Ok(s) => open.push(s.into_inner()),
                    Err(e) => {
                        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
                        assert!(e.message().contains("org's quota"), "{e:?}");
                        return open;
                    }
                }
                assert!(open.len() <= 64, "no bound on org {a:?}'s streams");
            }
            unreachable!()
        }
    };
    let open = open_until_refused(&mut api).await;
    let opened = open.len();
    let theirs = api
        .watch_events(watch(other, b))
        .await
        .expect("another org's stream");
    drop(open);
    // The places come back as soon as the node sees the clients gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let again = open_until_refused(&mut api).await;
        if again.len() == opened {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "org {a:?}'s closed streams were never released"
        );
        drop(again);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(theirs);
    opened
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(1);
    h.finish() >> 2
}
