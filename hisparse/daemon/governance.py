"""What one session, one tenant or one operator may take: quotas and the namespace lifecycle.

- **Quotas** (per session, a share of its namespace's pages): at most
  ``session_reserve_share`` of the pages reserved at once, at most
  ``session_pin_share`` pinned. A reserve beyond the share is cut short
  (as when the region is full); one when the share is already used, and a
  pin that would pass it, are refused with ``QUOTA_EXCEEDED`` naming the
  limit. So one client can neither pin everything (every other ``store``
  would write nothing) nor hoard reservations while it heartbeats.
- **drop** (admin): remove a namespace, its table and region; what it cost
  goes back to ``--capacity`` at once. Sessions attached to it are ended
  only with ``force`` (their next call is ``UNKNOWN_SESSION``; a client
  attaches again and gets a new region). A process that still maps the
  region keeps its mapping until it unmaps: tmpfs frees the memory then.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hisparse.layout import format_size
from hisparse.protocol import AdminRequest, ErrorCode, WireError

if TYPE_CHECKING:
    from hisparse.daemon.handlers import DaemonContext
    from hisparse.daemon.sessions import Session

log = logging.getLogger(__name__)


def _limit_pages(share: float, num_pages: int) -> int:
    return max(1, int(share * num_pages))


def reserve_room(ctx: DaemonContext, session: Session) -> int:
    """New pages ``session`` may still reserve; ``QUOTA_EXCEEDED`` when none."""
    assert session.namespace is not None
    share = ctx.config.session_reserve_share
    limit = _limit_pages(share, session.namespace.geometry.num_pages)
    room = limit - len(session.reservations)
    if room <= 0:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"reserve: this session holds {len(session.reservations)} reservations, its "
                        f"limit (session_reserve_share {share} of {session.namespace.geometry.num_pages} "
                        "pages); commit or abort some first")
    return room


def check_pin_quota(ctx: DaemonContext, session: Session, pages: list[int]) -> None:
    """Refuse (nothing pinned) a pin that would take ``session`` past ``session_pin_share``."""
    assert session.namespace is not None
    share = ctx.config.session_pin_share
    num_pages = session.namespace.geometry.num_pages
    limit = _limit_pages(share, num_pages)
    after = len(session.pins) + len(set(pages) - session.pins.keys())
    if after > limit:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"pin: {after} pinned pages would pass this session's limit of {limit} "
                        f"(session_pin_share {share} of {num_pages} pages); unpin some first")


def handle_drop(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    from hisparse.daemon.handlers import _authorize

    _authorize(ctx, req)
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
