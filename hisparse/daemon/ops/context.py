"""What every handler gets: the daemon's context, and the shape of a reply that waits.

``DaemonContext`` carries the daemon's state (config, namespaces, sessions,
the cluster tier) and what the server knows of the request being handled
(the connection's routing id and the kernel's word on its peer).
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hisparse.daemon.conf.config import Config
from hisparse.daemon.ops.opstats import OpStats
from hisparse.daemon.policy.access import AccessControl
from hisparse.daemon.store.namespaces import Namespace, Registry
from hisparse.daemon.store.sessions import Session, SessionTable
from hisparse.protocol import AdminRequest, ErrorCode, WireError
from hisparse.shm.fence import FENCE_DIR_MODE, fence_dir_for


@dataclass
class DaemonContext:
    config: Config
    registry: Registry
    sessions: SessionTable
    admin_token: str
    fence_dir: str = ""  # fences/ beside the socket (hisparse.shm.fence); "": derived and created
    peer: bytes = b""  # ZeroMQ routing id of the request being handled
    peer_address: str | None = None  # its connection's Peer-Address while it is handled: the kernel's credentials (peers.py)
    started_s: float = field(default_factory=time.monotonic)
    request_shutdown: Callable[[str], None] = lambda reason: None
    evictions_since_log: dict[str, int] = field(default_factory=dict)
    cluster: Any = None  # hisparse.daemon.cluster.tier.ClusterTier when [cluster] is on
    requests_total: int = 0
    errors_total: int = 0
    requests_in_slices: int = 0  # large writes begun, not yet answered (daemon.slicing)
    request_slices_total: int = 0  # their slices served after the first
    opstats: OpStats = field(default_factory=OpStats)
    transport_stats: Callable[[], dict[str, int]] = lambda: {}
    access: AccessControl | None = None  # None: every namespace open (no prepare)
    privileged: set[int] = field(default_factory=set)  # admin sessions that showed the token
    fence_sweep: Any = None  # hisparse.daemon.ops.sweep.FenceSweep: the start-up sweep (None: none)

    def __post_init__(self) -> None:
        if not self.fence_dir:
            self.fence_dir = fence_dir_for(self.config.socket)
            os.makedirs(self.fence_dir, mode=FENCE_DIR_MODE, exist_ok=True)


Handler = Callable[[DaemonContext, Any, Any], dict[str, Any]]


def ns_of(session: Session) -> Namespace:
    if session.namespace is None:
        raise WireError(ErrorCode.NOT_ATTACHED, "this session has no namespace (hello without one)")
    return session.namespace


@dataclass
class Deferred:
    """A reply that waits for work off the loop: ``finish(result)`` builds its body on the loop."""

    future: Any  # asyncio.Future
    finish: Callable[[Any], dict[str, Any]]
    errors: Callable[[BaseException], WireError | None] = lambda exc: None


def authorize(ctx: DaemonContext, req: AdminRequest) -> None:
    """Admin ops: the admin token, compared in constant time."""
    if not hmac.compare_digest(req.token.encode(), ctx.admin_token.encode()):
        raise WireError(ErrorCode.PERMISSION_DENIED, f"{req.op.value}: wrong admin token")
