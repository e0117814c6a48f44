"""Typed errors: every refusal carries allot's stable machine-readable reason."""

from typing import Dict, Optional


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
    """No endpoint answered within the deadline (every retry failed)."""
