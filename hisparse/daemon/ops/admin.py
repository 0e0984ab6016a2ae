"""Admin ops (the admin token required): clear a namespace, end a session, stop the daemon.

``drop`` lives with the namespace lifecycle in ``governance``.
"""

from __future__ import annotations

import logging
from typing import Any

from hisparse.daemon.ops.context import DaemonContext, authorize
from hisparse.daemon.store.sessions import Session, Zombie
from hisparse.errors import InvalidArgument
from hisparse.protocol import AdminRequest, ErrorCode, WireError

log = logging.getLogger(__name__)


def handle_clear(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    authorize(ctx, req)
    assert req.namespace is not None
    ns = ctx.registry.namespaces.get(req.namespace)
    if ns is None:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"no namespace {req.namespace!r}")
    freed, doomed = ns.index.clear()
    log.info("clear %r by %s: %d pages freed, %d freed on their last unpin",
             ns.name, session.describe(), freed, doomed)
    return {"freed_pages": freed, "doomed_pages": doomed}


def handle_evict_session(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    """Free a session's pages now, whether it is live or fenced: the operator's call."""
    authorize(ctx, req)
    assert req.target is not None
    try:
        target = ctx.sessions.find(req.target)
    except InvalidArgument as exc:
        raise WireError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
    if target is None:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"no session {req.target} (live or fenced)")
    what = target.describe()
    if isinstance(target, Zombie):
        freed, released = ctx.sessions.release_zombie(target)
    else:
        reserved, pins = len(target.reservations), sum(h.count for h in target.pins.values())
        ctx.sessions.evict(target)
        freed, released = reserved, pins
    log.warning("evict-session %s by %s: %d fenced pages freed, %d pins released",
                what, session.describe(), freed, released)
    return {"freed_pages": freed, "released_pins": released}


def handle_shutdown(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    authorize(ctx, req)
    ctx.request_shutdown(f"shutdown requested by {session.describe()}")
    return {}
