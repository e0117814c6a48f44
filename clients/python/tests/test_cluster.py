"""The Python client against a real 3-node allot cluster (scripts/cluster.sh, dev mode).

The cluster is started once for the module on its own ports (ALLOT_PY_PORT, default
7401) and stopped at the end. Two shards, so routing by org is exercised: org 5's home
shard is 1, org 6's is 0.
"""

import os
import pathlib
import subprocess
import tempfile

import pytest

from allot import Client, Refused, new_request_id, pb
from allot.client import job_state_name

ROOT = pathlib.Path(__file__).resolve().parents[3]
PORT = int(os.environ.get("ALLOT_PY_PORT", "7401"))
C = 1_000_000  # micro-credits per credit


@pytest.fixture(scope="module")
def endpoints():
    data = tempfile.mkdtemp(prefix="allot-py-")
    env = dict(os.environ, ALLOT_PROFILE=os.environ.get("ALLOT_PROFILE", "debug"))
    up = [str(ROOT / "scripts" / "cluster.sh"), "up", "--dir", data, "--port", str(PORT), "--shards", "2"]
    subprocess.run(up, check=True, env=env, stdout=subprocess.DEVNULL)
    try:
        admin = Client([f"127.0.0.1:{PORT}"], dev_actor="admin")
        for shard in (0, 1):
            assert admin.set_prices({"A100": 3_600 * C, "H100": 7_200 * C}, shard=shard) >= 1
        yield [f"127.0.0.1:{PORT + i}" for i in range(3)]
    finally:
        subprocess.run([str(ROOT / "scripts" / "cluster.sh"), "down", "--dir", data], env=env, check=False,
                       stdout=subprocess.DEVNULL)


def test_a_state_a_newer_server_added_is_named_by_its_number():
    # A JobState value this package's proto does not know (a newer server's): the name
    # is its number, not a ValueError in the middle of a caller's loop.
    assert job_state_name(pb.JobState.Value("JOB_STATE_RUNNING")) == "RUNNING"
    unknown = max(pb.JobState.values()) + 1
    assert job_state_name(unknown) == str(unknown)


def tenant(c: Client, org: int):
    c.create_org(org)
    c.create_project(org, org * 10)
    c.create_user(org, org * 100)


def test_grant_balance_job_lifecycle_and_audit(endpoints):
    admin = Client(endpoints, dev_actor="admin")
    org, project, user = 5, 50, 500
    shard = 1  # org 5's home shard of 2
    tenant(admin, org)
    # A grant retried with the same request id is applied once.
    rid = new_request_id()
    admin.issue_grant(org=org, project=project, bucket=1, amount_micro=100 * C, kind="paid", request_id=rid,
                      source_ref="po-1")
    admin.issue_grant(org=org, project=project, bucket=1, amount_micro=100 * C, kind="paid", request_id=rid,
                      source_ref="po-1")
    admin.issue_grant(org=org, project=project, bucket=2, amount_micro=10 * C, kind="promotional")
    b = admin.balance(org=org, project=project)
    assert b.paid_available_micro == 100 * C
    assert b.promotional_available_micro == 10 * C
    assert b.available_micro == 110 * C
    assert b.held_micro == 0

    # A GPU node on the org's home shard, and its agent.
    admin.register_node(node=1, gpu_type="A100", gpus=2, mem_gb=80, shard=shard)
    agent = Client(endpoints, dev_actor="agent:1")
    agent.node_heartbeat(node=1, shard=shard)

    submitted = admin.submit_job(org=org, job=77, project=project, user=user, tier=1, gpu_types=["A100"],
                                 gpus=1, max_duration_ms=60_000)
    assert submitted.job == 77
    assert submitted.hold_micro > 0
    placed = admin.wait_job(org, 77, {"PLACED", "RUNNING"})
    assert placed.placement.node == 1
    assert placed.attempt == 1
    assert admin.balance(org=org, project=project).held_micro == submitted.hold_micro

    hb = agent.job_heartbeat(org=org, job=77, attempt=1, seq=1, progress_ppm=500_000, shard=shard)
    assert hb.accepted
    running = admin.wait_job(org, 77, {"RUNNING"})
    assert job_state_name(running.state) == "RUNNING"
    # A repeated sequence number changes nothing.
    again = agent.job_heartbeat(org=org, job=77, attempt=1, seq=1, shard=shard)
    assert not again.accepted

    # Saying when the runner exited needs rule version 6, which this cluster has not
    # activated: refused, nothing recorded, and the same request id then reports it plainly.
    rid = new_request_id()
    with pytest.raises(Refused) as e:
        agent.finish_job(org=org, job=77, attempt=1, success=True, shard=shard, request_id=rid,
                         exit_after=(1, 250))
    assert e.value.reason == "UNSUPPORTED_RULES_VERSION"
    assert job_state_name(admin.get_job(org, 77).state) == "RUNNING"
    settlement = agent.finish_job(org=org, job=77, attempt=1, success=True, shard=shard, request_id=rid)
    assert settlement is not None
    assert settlement.reason == pb.SETTLE_REASON_SUCCEEDED
    assert settlement.captured_micro + settlement.refunded_micro + settlement.forfeited_micro == submitted.hold_micro
    done = admin.get_job(org, 77)
    assert job_state_name(done.state) == "SUCCEEDED"
    after = admin.balance(org=org, project=project)
    assert after.held_micro == 0
    assert after.consumed_micro == settlement.captured_micro
    assert after.available_micro == 110 * C - settlement.captured_micro

    # The audit trail, typed: the grant, the job's transitions, the settlement, in order.
    events = list(admin.audit_events(org=org))
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs)
    kinds = {e.kind for e in events}
    assert {"Issued", "HoldDrawn", "JobTransition", "Captured", "Refunded"} <= kinds, kinds
    grants = [e for e in events if e.kind == "Issued"]
    assert len(grants) == 2, grants  # the retried grant is issued once
    assert all(e.org == org for e in events if e.HasField("org"))
    assert all(len(e.hash) == 64 for e in events)
    for prev, nxt in zip(events, events[1:]):
        if nxt.seq == prev.seq + 1:
            assert nxt.prev_hash == prev.hash


def test_refusals_are_typed_and_change_nothing(endpoints):
    admin = Client(endpoints, dev_actor="admin")
    tenant(admin, 6)  # home shard 0
    admin.register_node(node=2, gpu_type="A100", gpus=1, mem_gb=80, shard=0)
    with pytest.raises(Refused) as e:
        admin.submit_job(org=6, job=1, project=60, user=600, tier=1, gpu_types=["A100"], gpus=1,
                         max_duration_ms=60_000)
    assert e.value.reason == "INSUFFICIENT_CREDITS"
    assert "needed" in e.value.details
    assert admin.get_job(6, 1) is None
    with pytest.raises(Refused) as e:
        admin.create_org(6)
    assert e.value.reason == "ALREADY_EXISTS"
    # Another org's ids answer as unknown; an unknown org's balance is absent.
    assert admin.balance(org=999) is None
    # A field the state machine refuses at the edge (validation), before the log.
    with pytest.raises(Refused) as e:
        admin.issue_grant(org=6, bucket=9, amount_micro=0)
    assert e.value.reason == "AMOUNT_ZERO"
    # A malformed call names its field.
    stub_client = Client(endpoints, dev_actor="admin")
    with pytest.raises(Refused) as e:
        stub_client._call("CreateOrg", pb.CreateOrgRequest(call=pb.Call(request_id=0), org=8))
    assert e.value.reason == "INVALID_ARGUMENT"
    assert e.value.details.get("field") == "call.request_id"
    with pytest.raises(Refused) as e:
        stub_client._call(
            "IssueGrant",
            pb.IssueGrantRequest(call=pb.Call(request_id=new_request_id()), bucket=3,
                                 owner=pb.Account(org=6), kind=42, amount_micro=1),
        )
    assert e.value.details.get("field") == "kind"
    assert admin.balance(org=6).available_micro == 0


def test_a_dead_endpoint_in_the_list_is_skipped(endpoints):
    # The first endpoint refuses connections: the client moves on within its deadline.
    c = Client(["127.0.0.1:1"] + endpoints, dev_actor="admin", timeout=10.0)
    c.create_org(9)
    assert c.balance(org=9) is not None


def test_alerts_fire_once_and_watch_events_resumes(endpoints):
    admin = Client(endpoints, dev_actor="admin")
    org, project = 7, 70  # home shard 1
    tenant(admin, org)
    admin.issue_grant(org=org, project=project, bucket=71, amount_micro=10 * C, kind="paid")
    # Below 20 credits already: the alert fires once, at once.
    reply = admin.set_alert(org=org, project=project, low_balance_micro=20 * C)
    assert reply.WhichOneof("result") == "alert_set"
    events = admin.watch_events(org=org)
    seen = []
    for ev in events:
        seen.append(ev)
        if ev.kind == "LowBalance":
            break
    events.close()
    low = seen[-1]
    assert low.fields["available_micro"] == str(10 * C)
    assert low.fields["threshold_micro"] == str(20 * C)
    # Still below after another grant: no second event. Back above and below again
    # would be a second crossing; here a resumed watcher sees the grant, not an alert.
    admin.issue_grant(org=org, project=project, bucket=72, amount_micro=1 * C, kind="paid")
    resumed = admin.watch_events(org=org, from_seq=low.seq + 1)
    more = []
    for ev in resumed:
        more.append(ev)
        if ev.kind == "Issued":
            break
    resumed.close()
    trail = list(admin.audit_events(org=org))
    assert [e.seq for e in seen + more] == [e.seq for e in trail][: len(seen) + len(more)]
    assert [e.kind for e in trail].count("LowBalance") == 1
    # Bad alerts are typed refusals.
    with pytest.raises(Refused) as err:
        admin.set_alert(org=org, project=project, budget_pcts=[80, 50])
    assert err.value.reason == "DUPLICATE_ENTRY"


def test_any_command_in_a_batch_and_any_read(endpoints):
    admin = Client(endpoints, dev_actor="admin")
    org, project, user = 11, 110, 1100  # home shard 1 of 2
    tenant(admin, org)
    admin.issue_grant(org=org, project=project, bucket=1101, amount_micro=50 * C, kind="paid")
    # An explicit hold, a capture, a top-up and a release in one call: one log entry.
    replies = admin.execute([
        pb.Command(create_hold=pb.CreateHoldRequest(org=org, hold=9, project=project, user=user, tier=1,
                                                    gpu_types=["A100"], amount_micro=10 * C)),
        pb.Command(capture=pb.CaptureRequest(org=org, hold=9, amount_micro=4 * C)),
        pb.Command(top_up=pb.TopUpRequest(org=org, hold=9, amount_micro=1 * C)),
        pb.Command(release_hold=pb.ReleaseHoldRequest(org=org, hold=9)),
        # Refused on its own (unknown hold): the others still apply.
        pb.Command(capture=pb.CaptureRequest(org=org, hold=999, amount_micro=1)),
    ], shard=1)
    kinds = [r.WhichOneof("result") for r in replies]
    assert kinds == ["hold_created", "captured", "topped_up", "settled", "error"], kinds
    assert replies[0].hold_created.hold == 9
    assert replies[1].captured.captured_micro == 4 * C
    assert replies[3].settled.by == pb.SETTLED_BY_SETTLE
    assert len({r.log_index for r in replies}) == 1
    assert replies[4].error.reason == pb.REASON_UNKNOWN_HOLD
    b = admin.balance(org=org, project=project)
    assert b.consumed_micro == 4 * C and b.held_micro == 0
    # Any read: the org's buckets and a page of its jobs, typed.
    buckets = admin.query(buckets=pb.BucketsQuery(org=org, account=pb.Account(org=org, project=project)))
    assert buckets.WhichOneof("answer") == "buckets"
    jobs = admin.query(jobs=pb.JobFilter(org=org, limit=10))
    assert jobs.WhichOneof("answer") == "jobs" and len(jobs.jobs.jobs) == 0
    totals = admin.query(shard=1, totals=pb.Empty())
    assert totals.WhichOneof("answer") == "totals"


def _leader_hint(endpoint: str, shard: int):
    """The ``allot-leader-addr`` header of a linearizable read of ``shard`` sent to
    ``endpoint`` alone: ``None`` when that node leads the shard (it answered itself)."""
    import grpc
    from allot._gen import allot_api_pb2_grpc as pbg

    with grpc.insecure_channel(endpoint) as ch:
        req = pb.QueryRequest(read=pb.Read(shard=shard), totals=pb.Empty())
        _, call = pbg.ApiStub(ch).Query.with_call(req, timeout=10)
        return dict(call.initial_metadata() or ()).get("allot-leader-addr")


def _leader(endpoints, shard: int) -> str:
    """Shard ``shard``'s leader: the one endpoint whose answer names no other leader."""
    hints = {ep: _leader_hint(ep, shard) for ep in endpoints}
    leaders = [ep for ep, h in hints.items() if h is None]
    assert len(leaders) == 1, hints
    assert all(h == leaders[0] for ep, h in hints.items() if ep != leaders[0]), hints
    return leaders[0]


def test_a_client_sent_to_a_follower_goes_to_the_leader_next_time(endpoints):
    for shard in (0, 1):
        leader = _leader(endpoints, shard)
        # A client whose first endpoint is a follower: forwarded once, then the leader.
        follower = next(ep for ep in endpoints if ep != leader)
        c = Client([follower] + [ep for ep in endpoints if ep != follower], dev_actor="admin")
        c.query(shard=shard, totals=pb.Empty())
        c.query(shard=shard, totals=pb.Empty())
        # Judged only if leadership stayed put meanwhile (a quiet cluster's does).
        assert _leader(endpoints, shard) == leader, "leadership moved during the test"
        assert c._leaders[("shard", shard)] == leader, c._leaders
        # A hint naming a node the client was not given is not followed on a success.
        lone = Client([follower], dev_actor="admin")
        lone.query(shard=shard, totals=pb.Empty())
        assert lone._leaders[("shard", shard)] == follower, lone._leaders


def test_calls_are_remembered_by_the_shard_or_org_they_route_by():
    from allot.client import _route_key

    assert _route_key(pb.QueryRequest(read=pb.Read(shard=1), totals=pb.Empty())) == ("shard", 1)
    assert _route_key(pb.QueryRequest(jobs=pb.JobFilter(org=7, limit=1))) == ("org", 7)
    assert _route_key(pb.GetJobRequest(org=9, job=1)) == ("org", 9)
    assert _route_key(pb.BalanceRequest(account=pb.Account(org=5))) == ("org", 5)
    assert _route_key(pb.ExecuteRequest(commands=[pb.Command(capture=pb.CaptureRequest(org=4, hold=1))])) == (
        "org", 4)
    assert _route_key(pb.ExecuteRequest(shard=0, commands=[pb.Command(capture=pb.CaptureRequest(org=4))])) == (
        "shard", 0)
    assert _route_key(pb.CreateOrgRequest(call=pb.Call(request_id=1), org=3)) == ("org", 3)
    assert _route_key(pb.SetPricesRequest(call=pb.Call(request_id=1, shard=1))) == ("shard", 1)
    # As the node routes: a message with its own org field is routed by it alone (a
    # transfer naming only `from.org` goes to shard 0), and a map is not looked into.
    assert _route_key(pb.TransferRequest(**{"from": pb.Account(org=8)})) == ("shard", 0)
    assert _route_key(pb.ExecuteRequest(commands=[pb.Command(
        register_node=pb.RegisterNodeRequest(node=1, labels={"zone": "a"}))])) == ("shard", 0)
