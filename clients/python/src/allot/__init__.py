"""allot's Python client: the typed gRPC API (``proto/allot_api.proto``).

    from allot import Client
    c = Client(["127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"])
    c.create_org(7)
    c.issue_grant(org=7, bucket=1, amount_micro=100_000_000, kind="paid")
    print(c.balance(org=7).paid_available_micro)
"""

from .client import Client, new_request_id
from .errors import AllotError, PermissionDenied, Refused, Unauthenticated, Unavailable
from ._gen import allot_api_pb2 as pb

__all__ = [
    "Client",
    "new_request_id",
    "AllotError",
    "Refused",
    "Unauthenticated",
    "PermissionDenied",
    "Unavailable",
    "pb",
]
