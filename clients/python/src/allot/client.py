"""The client: endpoints, leader hints, retries with backoff and jitter within a deadline,
request ids chosen once per request and reused on every retry, typed errors.

It behaves like the Rust client (``allot-client``):

* **Endpoints** — any node answers: a follower forwards a write to its shard's leader.
  When a node answers ``UNAVAILABLE`` with the leader's address (``allot-leader-addr``)
  the next attempt goes there; otherwise the next endpoint in the list. A successful
  reply from a follower names the leader in its headers too: the client remembers it
  (when it is one of the endpoints it was given) for the shard, or the org, the call was
  routed by, so the next call there goes to the leader instead of through the follower.
* **Retries** — ``UNAVAILABLE``, ``RESOURCE_EXHAUSTED`` (after ``retry-after-ms`` when
  given), a lost answer (``DEADLINE_EXCEEDED`` of one attempt) and a call the transport
  broke (``CANCELLED``, ``ABORTED``, ``UNKNOWN``, and ``INTERNAL`` for a stream reset —
  a node shutting down, or a leader stopped while a follower forwarded the call) are
  retried with full jitter exponential backoff until the call's deadline, the same codes
  the Rust client retries. A mutating call is retried with the **same request id**, so
  the shard applies it at most once and answers the retry with the first answer.
* **Errors** — a refusal raises :class:`Refused` with the reason name (nothing
  changed); credentials problems :class:`Unauthenticated` / :class:`PermissionDenied`;
  an exhausted deadline :class:`Unavailable` — the outcome is *unknown* (a command may
  have been applied with its answer lost): send it again with the request ids in its
  ``request_ids`` to learn the outcome without applying it twice.
* **Routing** — tenant calls name their org and the node routes them to its home shard;
  pool and agent calls take ``shard=`` (the pool's shard).
"""

import random
import secrets
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from ._gen import allot_api_pb2 as pb
from ._gen import allot_api_pb2_grpc as pbg
from .errors import AllotError, PermissionDenied, Refused, Unauthenticated, Unavailable

_KINDS = {
    "paid": pb.BUCKET_KIND_PAID,
    "promotional": pb.BUCKET_KIND_PROMOTIONAL,
    "granted": pb.BUCKET_KIND_GRANTED,
}

# The most routes (shards and orgs) whose leader a client remembers.
_ROUTES_MAX = 4_096

_RETRIED = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
}


def _retryable(code: grpc.StatusCode, details: str) -> bool:
    """Worth another attempt, with the same request ids: the node is busy or gone, or the
    transport broke the call — an HTTP/2 stream reset (a node shutting down gracefully
    resets its streams) reaches gRPC as ``INTERNAL``. The node's own ``INTERNAL``
    answers are final."""
    if code in _RETRIED:
        return True
    d = details or ""
    return code == grpc.StatusCode.INTERNAL and ("RST_STREAM" in d or d.startswith("h2 protocol error"))


def _request_ids(request) -> List[int]:
    """The request ids a call carries (its ``call`` header, or each command's of an
    ``Execute``): what a caller resends to learn an unknown outcome."""
    calls = []
    if _field(request, "call") is not None:
        calls.append(request.call)
    for c in getattr(request, "commands", ()):
        arm = c.WhichOneof("command")
        if arm is not None and getattr(c, arm).HasField("call"):
            calls.append(getattr(c, arm).call)
    return [c.request_id for c in calls if c.request_id]


def new_request_id() -> int:
    """A fresh idempotency key: 63 random bits, never 0."""
    return secrets.randbits(63) or 1


def _enum_name(enum, prefix: str, value: int) -> str:
    """``prefix`` + name → name; a value a newer server added that this package does not
    know yet is its number (``"12"``), never an error."""
    name = enum.Name(value) if value in enum.values() else f"{prefix}{value}"
    return name[len(prefix):] if name.startswith(prefix) else name


def _reason_name(value: int) -> str:
    return _enum_name(pb.Reason, "REASON_", value)


def job_state_name(value: int) -> str:
    """``JOB_STATE_RUNNING`` → ``"RUNNING"``; an unknown state's number as text."""
    return _enum_name(pb.JobState, "JOB_STATE_", value)


class Client:
    """A connection to an allot cluster.

    :param endpoints: ``host:port`` of any of its nodes.
    :param token: API token (``authorization: Bearer``); ``None`` in a dev cluster.
    :param dev_actor: dev mode only — whom calls run as (``"admin"``, ``"org:7"``,
        ``"agent:3"``).
    :param timeout: the deadline of one call, retries included, in seconds.
    :param attempt_timeout: the deadline of one attempt, in seconds.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        token: Optional[str] = None,
        dev_actor: str = "",
        timeout: float = 10.0,
        attempt_timeout: float = 3.0,
        backoff_base: float = 0.02,
        backoff_max: float = 1.0,
    ):
        if not endpoints:
            raise ValueError("at least one endpoint")
        self.endpoints: List[str] = list(endpoints)
        # The endpoints this client was given: the only addresses a successful reply's
        # leader hint is followed to (`self.endpoints` also gains hinted addresses).
        self._given = frozenset(self.endpoints)
        self.token = token
        self.dev_actor = dev_actor
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._channels: Dict[str, grpc.Channel] = {}
        self._next = 0
        # The leader last seen per route (`_route_key`): an explicit shard, or an org
        # (whose home shard the node routes it to).
        self._leaders: Dict[tuple, str] = {}

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stub(self, endpoint: str) -> pbg.ApiStub:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = grpc.insecure_channel(endpoint)
            self._channels[endpoint] = ch
        return pbg.ApiStub(ch)

    def _metadata(self):
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _endpoint(self, route: tuple) -> str:
        leader = self._leaders.get(route)
        if leader is not None:
            return leader
        return self.endpoints[self._next % len(self.endpoints)]

    def _rotate(self, route: tuple) -> None:
        self._leaders.pop(route, None)
        self._next += 1

    def _call(self, method: str, request):
        """One RPC with retries within the deadline; the same request (and so the same
        request id) is resent on every attempt."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        last: Optional[grpc.RpcError] = None
        route = _route_key(request)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            endpoint = self._endpoint(route)
            try:
                rpc = getattr(self._stub(endpoint), method)
                reply, call = rpc.with_call(
                    request, timeout=min(left, self.attempt_timeout), metadata=self._metadata()
                )
                # A follower that forwarded the call (or answered a stale read) names
                # the leader: go there next time. Only an address this client was given:
                # a peer's own address may not be reachable from here.
                hint = dict(call.initial_metadata() or ()).get("allot-leader-addr")
                if len(self._leaders) >= _ROUTES_MAX:
                    self._leaders.clear()  # relearned as calls go on
                self._leaders[route] = hint if hint in self._given else endpoint
                return reply
            except grpc.RpcError as e:  # noqa: PERF203 (retry loop)
                last = e
                code = e.code()
                trailers = dict(e.trailing_metadata() or ())
                if not _retryable(code, e.details()):
                    raise _typed(e, trailers) from None
                leader = trailers.get("allot-leader-addr")
                if leader and code == grpc.StatusCode.UNAVAILABLE:
                    if leader not in self.endpoints:
                        self.endpoints.append(leader)
                    self._leaders[route] = leader
                else:
                    self._rotate(route)
                wait = random.uniform(0, min(self.backoff_max, self.backoff_base * (2 ** attempt)))
                if "retry-after-ms" in trailers:
                    try:
                        wait = max(wait, int(trailers["retry-after-ms"]) / 1000.0)
                    except ValueError:
                        pass
                attempt += 1
                time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
        detail = last.details() if last is not None else "no attempt"
        raise Unavailable(
            "UNAVAILABLE", f"no answer within {self.timeout}s: {detail}", request_ids=_request_ids(request)
        )

    def _call_header(self, request_id: Optional[int], shard: Optional[int]) -> pb.Call:
        call = pb.Call(request_id=request_id or new_request_id(), dev_actor=self.dev_actor)
        if shard is not None:
            call.shard = shard
        return call

    def _command(self, method: str, request) -> pb.CommandReply:
        reply = self._call(method, request)
        if reply.WhichOneof("result") == "error":
            err = reply.error
            raise Refused(_reason_name(err.reason), err.message, dict(err.details))
        return reply

    def execute(self, commands: Iterable[pb.Command], shard: Optional[int] = None) -> List[pb.CommandReply]:
        """Any commands in one call (one log entry): each ``pb.Command`` holds one arm,
        e.g. ``pb.Command(capture=pb.CaptureRequest(org=7, hold=9, amount_micro=5))``.
        A command without a ``call`` header is sent with one holding a fresh request id,
        chosen once per ``execute`` and resent unchanged on every retry; the caller's
        ``pb.Command`` objects are not changed (reusing one for a later operation is a
        new operation, not a replay of this one). To resend after :class:`Unavailable`,
        give each command the id in the error's ``request_ids``, or set its ``call``
        header yourself. Refusals are per command (the ``error`` arm of its reply);
        nothing is raised for them."""
        batch = []
        for c in commands:
            arm = c.WhichOneof("command")
            if arm is None:
                raise ValueError("a command needs one arm")
            if not getattr(c, arm).HasField("call"):
                copy = pb.Command()
                copy.CopyFrom(c)
                getattr(copy, arm).call.CopyFrom(self._call_header(None, None))
                c = copy
            batch.append(c)
        req = pb.ExecuteRequest(commands=batch)
        if shard is not None:
            req.shard = shard
        return list(self._call("Execute", req).replies)

    def query(self, shard: Optional[int] = None, stale_ok: bool = False, **arm) -> pb.QueryReply:
        """Any read: one keyword naming the query's arm, e.g.
        ``query(jobs=pb.JobFilter(org=7, limit=10))`` or ``query(shard=0, totals=pb.Empty())``.
        Routed by the org the query names, else to ``shard``."""
        if len(arm) != 1:
            raise ValueError("name exactly one query, e.g. jobs=pb.JobFilter(...)")
        (name, value), = arm.items()
        req = pb.QueryRequest(read=self._read(shard, stale_ok))
        getattr(req, name).CopyFrom(value)
        return self._call("Query", req)

    @staticmethod
    def _read(shard: Optional[int], stale_ok: bool) -> pb.Read:
        r = pb.Read(stale_ok=stale_ok)
        if shard is not None:
            r.shard = shard
        return r

    # ------------------------------------------------------------------ ledger

    def create_org(self, org: int, request_id: Optional[int] = None) -> pb.CommandReply:
        return self._command("CreateOrg", pb.CreateOrgRequest(call=self._call_header(request_id, None), org=org))

    def create_project(self, org: int, project: int, request_id: Optional[int] = None) -> pb.CommandReply:
        return self._command(
            "CreateProject",
            pb.CreateProjectRequest(call=self._call_header(request_id, None), org=org, project=project),
        )

    def create_user(self, org: int, user: int, request_id: Optional[int] = None) -> pb.CommandReply:
        return self._command(
            "CreateUser", pb.CreateUserRequest(call=self._call_header(request_id, None), org=org, user=user)
        )

    def issue_grant(
        self,
        org: int,
        bucket: int,
        amount_micro: int,
        kind: str = "paid",
        project: Optional[int] = None,
        expires_at_ms: Optional[int] = None,
        priority: int = 0,
        source_ref: str = "",
        request_id: Optional[int] = None,
    ) -> pb.CommandReply:
        """Credits for an org's account (or one of its projects'), in micro-credits."""
        owner = pb.Account(org=org)
        if project is not None:
            owner.project = project
        req = pb.IssueGrantRequest(
            call=self._call_header(request_id, None),
            bucket=bucket,
            owner=owner,
            kind=_KINDS[kind],
            amount_micro=amount_micro,
            priority=priority,
            source_ref=source_ref,
        )
        if expires_at_ms is not None:
            req.expires_at_ms = expires_at_ms
        return self._command("IssueGrant", req)

    def set_prices(self, prices: Dict[str, int], shard: int, request_id: Optional[int] = None) -> int:
        """Replaces a shard's price table (micro-credits per GPU-hour); returns its version."""
        req = pb.SetPricesRequest(
            call=self._call_header(request_id, shard),
            prices=[pb.GpuPrice(gpu_type=t, micro_per_gpu_hour=p) for t, p in sorted(prices.items())],
        )
        return self._command("SetPrices", req).prices_set.version

    def balance(
        self,
        org: int,
        project: Optional[int] = None,
        horizon_ms: int = 0,
        stale_ok: bool = False,
    ) -> Optional[pb.Balance]:
        """The account's balance with its breakdown by kind; ``None``: no such account."""
        account = pb.Account(org=org)
        if project is not None:
            account.project = project
        reply = self._call(
            "Balance",
            pb.BalanceRequest(read=self._read(None, stale_ok), account=account, horizon_ms=horizon_ms),
        )
        return reply.balance if reply.HasField("balance") else None

    # ------------------------------------------------------------------ jobs

    def submit_job(
        self,
        org: int,
        job: int,
        project: int,
        user: int,
        tier: int,
        gpu_types: Iterable[str],
        gpus: int,
        max_duration_ms: int,
        mem_floor_gb: int = 0,
        preemptible: bool = True,
        checkpointable: bool = False,
        request_id: Optional[int] = None,
        dedup_key: Optional[bytes] = None,
    ) -> pb.JobSubmitted:
        """Submits a job. With ``dedup_key`` (rule version 3; 1 to 64 bytes, e.g. a hash of
        the prompt and its parameters) a job of the org with the same key in flight or
        recently succeeded gives this one its result: the reply's ``attached_to`` names it."""
        spec = pb.JobSpec(
            job=job,
            project=project,
            user=user,
            tier=tier,
            gpu_types=list(gpu_types),
            gpus=gpus,
            mem_floor_gb=mem_floor_gb,
            preemptible=preemptible,
            checkpointable=checkpointable,
            max_duration_ms=max_duration_ms,
        )
        request = pb.SubmitJobRequest(call=self._call_header(request_id, None), org=org, spec=spec)
        if dedup_key is not None:
            request.dedup_key = dedup_key
        reply = self._command("SubmitJob", request)
        return reply.job_submitted

    def cancel_job(self, org: int, job: int, request_id: Optional[int] = None) -> pb.CommandReply:
        return self._command(
            "CancelJob", pb.CancelJobRequest(call=self._call_header(request_id, None), org=org, job=job)
        )

    def get_job(self, org: int, job: int, stale_ok: bool = False) -> Optional[pb.Job]:
        reply = self._call("GetJob", pb.GetJobRequest(read=self._read(None, stale_ok), org=org, job=job))
        return reply.job if reply.HasField("job") else None

    def wait_job(self, org: int, job: int, states: Iterable[str], timeout: float = 30.0, poll: float = 0.1) -> pb.Job:
        """Polls until the job is in one of ``states`` (names such as ``"RUNNING"``)."""
        wanted = set(states)
        end = time.monotonic() + timeout
        while True:
            j = self.get_job(org, job)
            if j is not None and job_state_name(j.state) in wanted:
                return j
            if time.monotonic() >= end:
                seen = job_state_name(j.state) if j is not None else "absent"
                raise AllotError("TIMEOUT", f"job {job} of org {org} is {seen}, not {sorted(wanted)}")
            time.sleep(poll)

    # ------------------------------------------------------------------ nodes and agents

    def register_node(
        self,
        node: int,
        gpu_type: str,
        gpus: int,
        mem_gb: int,
        shard: int,
        labels: Optional[Dict[str, str]] = None,
        request_id: Optional[int] = None,
    ) -> pb.CommandReply:
        return self._command(
            "RegisterNode",
            pb.RegisterNodeRequest(
                call=self._call_header(request_id, shard),
                node=node,
                gpu_type=gpu_type,
                gpus=gpus,
                mem_gb=mem_gb,
                labels=labels or {},
            ),
        )

    def node_heartbeat(self, node: int, shard: int, request_id: Optional[int] = None) -> pb.CommandReply:
        return self._command(
            "NodeHeartbeat", pb.NodeHeartbeatRequest(call=self._call_header(request_id, shard), node=node)
        )

    def job_heartbeat(
        self,
        org: int,
        job: int,
        attempt: int,
        seq: int,
        shard: int,
        progress_ppm: int = 0,
        checkpoint: int = 0,
        request_id: Optional[int] = None,
    ) -> pb.HeartbeatResult:
        reply = self._command(
            "JobHeartbeat",
            pb.JobHeartbeatRequest(
                call=self._call_header(request_id, shard),
                org=org,
                job=job,
                attempt=attempt,
                seq=seq,
                progress_ppm=progress_ppm,
                checkpoint=checkpoint,
            ),
        )
        return reply.heartbeat

    def finish_job(
        self,
        org: int,
        job: int,
        attempt: int,
        success: bool,
        shard: int,
        request_id: Optional[int] = None,
        exit_after: Optional[Tuple[int, int]] = None,
    ) -> Optional[pb.Settlement]:
        """Reports an attempt's end. ``exit_after=(heartbeat_seq, after_ms)`` says the
        runner exited ``after_ms`` after this agent sent heartbeat ``heartbeat_seq``, the
        newest it saw accepted: the job is billed to that instant rather than to the
        report's arrival (rule version 6; a shard below it refuses the call with
        ``UNSUPPORTED_RULES_VERSION`` and records nothing — send it again without
        ``exit_after``, under the same ``request_id``)."""
        exit_ = None
        if exit_after is not None:
            exit_ = pb.RunnerExit(heartbeat_seq=exit_after[0], after_ms=exit_after[1])
        reply = self._command(
            "FinishJob",
            pb.FinishJobRequest(
                call=self._call_header(request_id, shard),
                org=org,
                job=job,
                attempt=attempt,
                success=success,
                exit=exit_,
            ),
        )
        s = reply.settled
        return s.settlement if s.HasField("settlement") else None

    # ------------------------------------------------------------------ audit

    def audit(
        self, org: Optional[int] = None, from_seq: int = 0, limit: int = 500, shard: Optional[int] = None
    ) -> pb.AuditReply:
        req = pb.AuditRequest(read=self._read(shard, False), from_seq=from_seq, limit=limit)
        if org is not None:
            req.org = org
        return self._call("Audit", req)

    def audit_events(self, org: Optional[int] = None, shard: Optional[int] = None) -> Iterator[pb.AuditEvent]:
        """Every event of the trail (an org's, on its home shard), page by page, up to the
        head when called."""
        seq = 0
        while True:
            page = self.audit(org=org, from_seq=seq, shard=shard)
            yield from page.events
            if page.next_seq >= page.head_seq or page.next_seq == seq:
                return
            seq = page.next_seq


    # ------------------------------------------------------------------ alerts and events

    def set_alert(
        self,
        org: int,
        project: Optional[int] = None,
        user: Optional[int] = None,
        low_balance_micro: Optional[int] = None,
        budget_pcts: Iterable[int] = (),
        remove: bool = False,
        request_id: Optional[int] = None,
    ) -> pb.CommandReply:
        """An alert on an org's (or a project's, or a user's) available credit and budget
        use: each crossing appends a LowBalance or BudgetThreshold event, once."""
        req = pb.SetAlertRequest(call=self._call_header(request_id, None), org=org,
                                 budget_pcts=list(budget_pcts), remove=remove)
        if project is not None:
            req.project = project
        if user is not None:
            req.user = user
        if low_balance_micro is not None:
            req.low_balance_micro = low_balance_micro
        return self._command("SetAlert", req)

    def watch_events(
        self, org: Optional[int] = None, shard: Optional[int] = None, from_seq: int = 0
    ) -> Iterator[pb.AuditEvent]:
        """The audit events as they are applied, from `from_seq` on, forever. The stream
        is at least once; this generator reconnects (another endpoint, backing off)
        from the last sequence it yielded + 1, so each event is yielded once, in order.
        Keep the last `seq` you processed to resume after a restart."""
        next_seq = from_seq
        attempt = 0
        while True:
            req = pb.WatchEventsRequest(from_seq=next_seq)
            if org is not None:
                req.org = org
            if shard is not None:
                req.shard = shard
            route = _route_key(req)
            endpoint = self._endpoint(route)
            try:
                for ev in self._stub(endpoint).WatchEvents(req, metadata=self._metadata()):
                    attempt = 0
                    if ev.seq < next_seq:
                        continue  # a duplicate after a reconnect
                    next_seq = ev.seq + 1
                    yield ev
            except grpc.RpcError as e:
                if e.code() not in _RETRIED:
                    raise _typed(e, dict(e.trailing_metadata() or ())) from None
            self._rotate(route)
            time.sleep(random.uniform(0, min(self.backoff_max, self.backoff_base * (2 ** attempt))))
            attempt += 1


def _repeated(f) -> bool:
    # `label` is gone from newer protobuf runtimes, `is_repeated` absent from older ones.
    rep = getattr(f, "is_repeated", None)
    return bool(rep) if rep is not None else f.label == f.LABEL_REPEATED


def _field(msg, name: str):
    """Field ``name`` of ``msg`` if it has one and it is set (``None`` otherwise); a
    scalar without presence is returned as it is."""
    f = msg.DESCRIPTOR.fields_by_name.get(name)
    if f is None or _repeated(f):
        return None
    try:
        if not msg.HasField(name):
            return None
    except ValueError:  # a scalar without presence
        pass
    return getattr(msg, name)


def _org_in(msg, depth: int = 0) -> Optional[int]:
    """The org the node routes a message by: its own ``org`` field when it has one (unset
    or 0: none — the node does not look deeper, e.g. at a transfer's ``from.org``);
    otherwise, for a message without one (a request wrapping an account, a command or
    a query arm), the first such org among the messages set in it, in field order (a
    repeated field's first element), up to three levels down."""
    if "org" in msg.DESCRIPTOR.fields_by_name:
        org = _field(msg, "org")
        return org if isinstance(org, int) and org else None
    if depth >= 3:
        return None
    for f, value in msg.ListFields():
        if f.type != f.TYPE_MESSAGE or f.message_type.GetOptions().map_entry:
            continue
        if _repeated(f):
            value = value[0] if len(value) else None
        if value is not None:
            found = _org_in(value, depth + 1)
            if found is not None:
                return found
    return None


def _route_key(request) -> tuple:
    """What the node routes a call by, as the key the client remembers its shard's
    leader under: the shard the call names (``shard``, ``call.shard`` or
    ``read.shard``), else the org it names (the node sends it to the org's home shard),
    else shard 0."""
    shard = _field(request, "shard")
    for header in ("call", "read"):
        h = _field(request, header)
        if shard is None and h is not None:
            shard = _field(h, "shard")
    if shard is not None:
        return ("shard", shard)
    org = _org_in(request)
    return ("org", org) if org is not None else ("shard", 0)


def _typed(e: grpc.RpcError, trailers: Dict[str, str]) -> AllotError:
    code = e.code()
    reason = trailers.get("allot-reason") or code.name
    details = {}
    if "allot-field" in trailers:
        details["field"] = trailers["allot-field"]
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(reason, e.details() or "", details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(reason, e.details() or "", details)
    return Refused(reason, e.details() or "", details)
