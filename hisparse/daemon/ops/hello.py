"""``hello``: open a session, on a namespace (attaching it, or creating its region) or none.

The session is bound to the connection that said hello, and its owner is
the kernel's word on that connection's peer (``peers``), which quotas and
the namespace-creation limit count by.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import hisparse
from hisparse.daemon.ops.context import DaemonContext, Deferred
from hisparse.daemon.policy.peers import Peer, from_address
from hisparse.daemon.store.namespaces import Namespace
from hisparse.errors import CapacityError, InvalidArgument, LayoutMismatch, QuotaExceeded
from hisparse.protocol import ErrorCode, HelloRequest, WireError

log = logging.getLogger(__name__)


def _attach_errors(exc: BaseException) -> WireError | None:
    if isinstance(exc, LayoutMismatch):
        return WireError(ErrorCode.LAYOUT_MISMATCH, str(exc))
    if isinstance(exc, QuotaExceeded):
        return WireError(ErrorCode.QUOTA_EXCEEDED, str(exc))
    if isinstance(exc, CapacityError):
        return WireError(ErrorCode.CAPACITY, str(exc))
    if isinstance(exc, InvalidArgument):
        return WireError(ErrorCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, OSError):  # e.g. shm_dir full or gone: the daemon serves on
        return WireError(ErrorCode.CAPACITY, f"the region could not be created: {exc}")
    return None


def peer_of(ctx: DaemonContext) -> Peer:
    """Who sent the request being handled (uid, gid, pid from SO_PEERCRED when the kernel says)."""
    return from_address(ctx.peer_address, ctx.peer)


def handle_hello(ctx: DaemonContext, _: None, req: HelloRequest) -> dict[str, Any] | Deferred:
    owner = peer_of(ctx)
    if req.namespace is None:
        body = _open_session(ctx, None, req, [], owner)
        if req.token is not None and hmac.compare_digest(req.token.encode(), ctx.admin_token.encode()):
            ctx.privileged.add(body["session"])
        return body
    assert req.layout is not None
    if ctx.access is not None:
        ctx.access.check(req.namespace, req.access_key)
    warnings: list[str] = []
    try:
        got = ctx.registry.attach(req.namespace, req.layout, req.capacity_bytes, warnings,
                                  creator=owner, client=req.client)
    except (LayoutMismatch, CapacityError, InvalidArgument) as exc:
        raise _attach_errors(exc) from None  # type: ignore[misc]
    if not isinstance(got, Namespace):  # its region is being allocated off the loop
        return Deferred(got, lambda ns: _open_session(ctx, ns, req, warnings, owner), _attach_errors)
    return _open_session(ctx, got, req, warnings, owner)


def _open_session(ctx: DaemonContext, ns: Namespace | None, req: HelloRequest,
                  warnings: list[str], owner: Peer) -> dict[str, Any]:
    # bound to the connection that said hello (owner.connection), also when answered later
    session = ctx.sessions.open(ns, req.client, owner.connection, ctx.fence_dir, owner)
    if ns is not None:
        log.info("attach: %s", session.describe())
    else:
        log.debug("attach: %s", session.describe())
    return {
        "session": session.id,
        "lease_ttl_s": ctx.sessions.lease_ttl_s,
        "daemon_pid": os.getpid(),
        "daemon_version": hisparse.__version__,
        "region": ns.region_info() if ns else None,
        "events_seq": ns.index.events.last_seq if ns else 0,
        "warnings": warnings,
        "fence": session.fence.name if session.fence else None,
    }
