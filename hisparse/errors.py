"""The exceptions every part of hisparse raises to its users.

The daemon never raises these across the socket: it replies with an
``ErrorCode`` (``hisparse.protocol``) and the client turns the code back into
one of these classes with ``hisparse.protocol.error_for_code``.
"""

from __future__ import annotations


class HisparseError(Exception):
    """Base class of every error hisparse raises on purpose."""


class DaemonUnavailable(HisparseError):
    """No daemon answered on the socket within the call's timeout."""


class ProtocolError(HisparseError):
    """A frame was malformed, of another protocol version, or named an unknown op."""


class LayoutMismatch(HisparseError):
    """The namespace exists under another ``KVLayout``."""


class CapacityError(HisparseError):
    """A region could not be created within the daemon's capacity."""


class QuotaExceeded(CapacityError):
    """A per-session or per-peer limit of the daemon (pinned or reserved pages, namespaces
    created) would be passed; the message names the limit (``session_pin_share``,
    ``peer_reserve_share``, ``peer_max_namespaces``, ...)."""


class InvalidArgument(HisparseError):
    """A request was well formed but its values were not acceptable."""


class LeaseExpired(HisparseError):
    """The session is unknown to the daemon: it expired or the daemon restarted."""


class Timeout(HisparseError):
    """An operation did not complete within its deadline."""


class ClusterUnavailable(HisparseError):
    """The daemon has no cluster tier, or the cluster did not answer in time (docs/cluster.md)."""


class PermissionDenied(HisparseError):
    """An admin op was sent without the daemon's admin token."""


class MissingExtra(HisparseError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


__all__ = [
    "CapacityError",
    "ClusterUnavailable",
    "DaemonUnavailable",
    "HisparseError",
    "InvalidArgument",
    "LayoutMismatch",
    "LeaseExpired",
    "MissingExtra",
    "PermissionDenied",
    "ProtocolError",
    "QuotaExceeded",
    "Timeout",
]
