"""Typed errors: every refusal carries allot's stable machine-readable reason."""

from typing import Dict, List, Optional


class AllotError(Exception):
    """Base of every error this client raises."""

    def __init__(self, reason: str, message: str, details: Optional[Dict[str, str]] = None):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.details = dict(details or {})


class Refused(AllotError):
    """The cluster refused the command; nothing changed. `reason` is the state machine's
    reason name (``INSUFFICIENT_CREDITS``, ``UNKNOWN_ORG``, ...) or, for a malformed call,
    ``INVALID_ARGUMENT`` with the offending field in ``details["field"]``."""


class Unauthenticated(AllotError):
    """No token, or a token the cluster does not know (``UNAUTHENTICATED``)."""


class PermissionDenied(AllotError):
    """The token may not do this (``PERMISSION_DENIED``)."""


class Unavailable(AllotError):
    """No endpoint answered within the deadline (every retry failed). The outcome is
    unknown: a command may have been applied and its answer lost. ``request_ids`` are the
    ids the call carried; sending the same command again with them is answered with the
    first outcome if it was applied, and applies it once if it was not."""

    def __init__(
        self,
        reason: str,
        message: str,
        details: Optional[Dict[str, str]] = None,
        request_ids: Optional[List[int]] = None,
    ):
        super().__init__(reason, message, details)
        self.request_ids = list(request_ids or [])
