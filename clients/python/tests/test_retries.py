"""The client's retries and errors against a stub (no cluster): which gRPC codes are
retried with the same request id, which are final, what an exhausted deadline tells the
caller, and that ``execute`` leaves the caller's commands as they were."""

import grpc
import pytest

from allot import Client, Refused, Unavailable, pb


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ()


class _Answered:
    def initial_metadata(self):
        return ()


class _Stub:
    """Every method answers from ``outcomes`` in turn (an exception is raised, anything
    else returned); the last one repeats. The requests sent are kept in ``sent``."""

    def __init__(self, outcomes):
        self.outcomes, self.sent = list(outcomes), []

    def __getattr__(self, method):
        stub = self

        class _Method:
            def with_call(self, request, timeout=None, metadata=None):
                stub.sent.append(request)
                out = stub.outcomes.pop(0) if len(stub.outcomes) > 1 else stub.outcomes[0]
                if isinstance(out, Exception):
                    raise out
                return out, _Answered()

        return _Method()


def _client(stub: _Stub, timeout: float = 5.0) -> Client:
    c = Client(["127.0.0.1:1"], dev_actor="admin", timeout=timeout, backoff_base=0.001, backoff_max=0.002)
    c._stub = lambda endpoint: stub
    return c


def test_a_call_the_transport_broke_is_retried_with_the_same_request_id():
    # A leader stopped while a follower forwarded the call, a node shutting down: the
    # command may have been applied. These used to raise Refused ("nothing changed"),
    # and a caller resubmitting with a new id applied it twice.
    stub = _Stub(
        [
            _Status(grpc.StatusCode.CANCELLED, "Cancelled"),
            _Status(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
            _Status(grpc.StatusCode.UNKNOWN, "transport error"),
            _Status(grpc.StatusCode.ABORTED, "aborted"),
            pb.CommandReply(),
        ]
    )
    _client(stub).create_org(5, request_id=77)
    assert [r.call.request_id for r in stub.sent] == [77] * 5


def test_the_nodes_own_internal_answer_is_final():
    stub = _Stub([_Status(grpc.StatusCode.INTERNAL, "state machine stopped"), pb.CommandReply()])
    with pytest.raises(Refused) as e:
        _client(stub).create_org(5)
    assert e.value.reason == "INTERNAL"
    assert len(stub.sent) == 1


def test_an_exhausted_deadline_names_the_request_ids_to_resend():
    stub = _Stub([_Status(grpc.StatusCode.UNAVAILABLE, "no leader")])
    with pytest.raises(Unavailable) as e:
        _client(stub, timeout=0.2).create_org(5, request_id=91)
    assert e.value.request_ids == [91]
    commands = [
        pb.Command(capture=pb.CaptureRequest(org=7, hold=9, amount_micro=5)),
        pb.Command(capture=pb.CaptureRequest(call=pb.Call(request_id=44), org=7, hold=9, amount_micro=6)),
    ]
    with pytest.raises(Unavailable) as e:
        _client(stub, timeout=0.2).execute(commands)
    sent = stub.sent[-1].commands
    assert e.value.request_ids == [sent[0].capture.call.request_id, 44]
    assert sent[0].capture.call.request_id != 0


def test_execute_leaves_the_callers_commands_unchanged():
    # The header used to be written into the caller's object: reused for a later
    # capture, it carried the first one's request id and was answered as its replay.
    stub = _Stub([pb.ExecuteReply(replies=[pb.CommandReply()])])
    c = _client(stub)
    cmd = pb.Command(capture=pb.CaptureRequest(org=7, hold=9, amount_micro=5))
    c.execute([cmd])
    c.execute([cmd])
    assert not cmd.capture.HasField("call")
    first, second = (r.commands[0].capture.call.request_id for r in stub.sent)
    assert first != 0 and second != 0 and first != second
