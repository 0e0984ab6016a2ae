"""What an operator may take back: the namespace lifecycle (quotas: ``quotas.py``).

- **drop** (admin): remove a namespace, its table and region; what it cost
  goes back to ``--capacity`` at once. Sessions attached to it are ended
  only with ``force`` (their next call is ``UNKNOWN_SESSION``; a client
  attaches again and gets a new region). A process that still maps the
  region keeps its mapping until it unmaps: tmpfs frees the memory then.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hisparse.daemon.ops.context import DaemonContext, authorize
from hisparse.layout import format_size
from hisparse.protocol import AdminRequest, ErrorCode, WireError

if TYPE_CHECKING:
    from hisparse.daemon.store.sessions import Session

log = logging.getLogger(__name__)


def handle_drop(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    authorize(ctx, req)
    assert req.namespace is not None
    name = req.namespace
    if name in ctx.registry.creating:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"namespace {name!r} is being created; drop it "
                        "once its attach has been answered")
    ns = ctx.registry.namespaces.get(name)
    if ns is None:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"no namespace {name!r}")
    attached = list(ctx.sessions.all_for(ns))
    if attached and not req.force:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"namespace {name!r} has {len(attached)} attached sessions: they would lose it; "
                        "send force (hisparsectl drop --force) to end them")
    for s in attached:
        ctx.sessions.evict(s)
    for zombie in [z for z in ctx.sessions.zombies.values() if z.namespace is ns]:
        ctx.sessions.release_zombie(zombie)
    dropped = ctx.registry.drop(name)
    log.warning("drop %r by %s: %s back to the capacity, %d sessions ended", name,
                session.describe(), format_size(dropped.cost_bytes), len(attached))
    return {"freed_bytes": dropped.cost_bytes, "ended_sessions": len(attached)}
