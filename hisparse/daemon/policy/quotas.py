"""Quotas: what one session and one peer may hold of a namespace's pages at once.

Two levels, each a share of the namespace's pages, checked on every path
that takes a page (``reserve``; ``pin``; ``publish`` with ``pin``):

- per **session** (``session_reserve_share``, ``session_pin_share``): one
  engine cannot take everything by mistake;
- per **peer** (``peer_reserve_share``, ``peer_pin_share``; unset: the
  session's share): every session of one uid together, ended sessions whose
  pages are still fenced included (``peers`` says why the uid). Opening more
  sessions, connections or processes buys nothing. And what a peer holds in
  all (reserved + pinned) stays within the larger of its two shares, so with
  the defaults (0.5) one uid never holds more than half a region, whatever
  mix of pins and reservations it tries: the rest stays evictable for others.

A reserve beyond a share is cut short, and its reply says so
(``shortfall``: by ``quota``, naming the share, or by ``room``, saying who
holds the region); one made with the share already used, and a pin that
would pass a share, are refused with ``QUOTA_EXCEEDED`` naming the key. A
store is never silently zero: the daemon also logs the first cut per peer
and namespace every ``WARN_INTERVAL_S``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hisparse.protocol import ErrorCode, WireError

if TYPE_CHECKING:
    from hisparse.daemon.ops.context import DaemonContext
    from hisparse.daemon.store.namespaces import Namespace
    from hisparse.daemon.store.sessions import Session

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 10.0
_warned: dict[tuple[object, str], float] = {}  # (peer key, namespace) -> when last logged


def limit_pages(share: float, num_pages: int) -> int:
    return max(1, int(share * num_pages))


def peer_usage(ctx: DaemonContext, session: Session, ns: Namespace) -> tuple[int, int]:
    """(reserved, distinct pinned) pages of ``session``'s peer in ``ns``: live sessions and fenced ones."""
    reserved = 0
    for held in ctx.sessions.owned_by(session.owner.key):
        if held.namespace is ns:
            reserved += held.held_pages()[0]
    return reserved, ctx.sessions.pinned_by(session.owner.key, ns.name)


def _shares(ctx: DaemonContext) -> tuple[float, float, float, float]:
    cfg = ctx.config
    peer_reserve = cfg.peer_reserve_share if cfg.peer_reserve_share is not None else cfg.session_reserve_share
    peer_pin = cfg.peer_pin_share if cfg.peer_pin_share is not None else cfg.session_pin_share
    return cfg.session_reserve_share, peer_reserve, cfg.session_pin_share, peer_pin


def _hold_limit(ctx: DaemonContext, num_pages: int) -> int:
    """Pages one peer may hold in all, reserved and pinned together."""
    _, peer_reserve, _, peer_pin = _shares(ctx)
    return limit_pages(max(peer_reserve, peer_pin), num_pages)


def reserve_room(ctx: DaemonContext, session: Session) -> tuple[int, str]:
    """New pages ``session`` may reserve, and the limit that says so; ``QUOTA_EXCEEDED`` when none."""
    ns = session.namespace
    assert ns is not None
    num_pages = ns.geometry.num_pages
    session_share, peer_share, _, _ = _shares(ctx)
    rooms = [(limit_pages(session_share, num_pages) - len(session.reservations),
              f"session_reserve_share {session_share} of {num_pages} pages")]
    # a peer limit of the whole region is none: the region's own size bounds it (room, not quota)
    hold, peer_limit = _hold_limit(ctx, num_pages), limit_pages(peer_share, num_pages)
    if peer_limit < num_pages or hold < num_pages:
        reserved, pinned = peer_usage(ctx, session, ns)
    if peer_limit < num_pages:
        rooms.append((peer_limit - reserved,
                      f"peer_reserve_share {peer_share} of {num_pages} pages, for every session of "
                      f"{session.owner.describe()} together"))
    if hold < num_pages:
        rooms.append((hold - reserved - pinned,
                      f"peer_reserve_share: {reserved + pinned} pages reserved or pinned by every session "
                      f"of {session.owner.describe()} together, at most {hold} (the larger of "
                      f"peer_pin_share and peer_reserve_share of {num_pages} pages)"))
    room, limit = min(rooms, key=lambda r: r[0])
    if room <= 0:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"reserve: no room left within {limit}; commit, abort or unpin some first")
    return room, limit


def shortfall(ctx: DaemonContext, session: Session, asked: int, answered: int, got: int, room: int,
              limit: str) -> dict[str, Any] | None:
    """Why a reserve reply is shorter than its keys (None when it is not): the reply's ``shortfall``.

    ``answered``: slots in the reply; ``got``: new pages among them; ``room``: what quotas allowed.
    """
    if answered >= asked:
        return None
    ns = session.namespace
    assert ns is not None
    if got >= room:
        body = {"by": "quota", "limit": limit.split()[0].rstrip(":"),
                "message": f"reserve cut short after {got} new pages: {limit}"}
    else:
        snap = ns.index.snapshot()
        body = {"by": "room", "limit": "",
                "message": (f"region full after {got} new pages: {snap['pinned_pages']} of "
                            f"{snap['num_pages']} pages pinned, {snap['writing_pages']} being written, "
                            f"{snap['fenced_pages']} fenced; nothing left to evict")}
    _warn(session, ns.name, body["message"])
    return body


def _warn(session: Session, namespace: str, message: str) -> None:
    key = (session.owner.key, namespace)
    now = time.monotonic()
    if now - _warned.get(key, -WARN_INTERVAL_S) < WARN_INTERVAL_S:
        return
    if len(_warned) > 4096:
        _warned.clear()
    _warned[key] = now
    log.warning("store short for %s (%s): %s", session.describe(), session.owner.describe(), message)


def check_pin_quota(ctx: DaemonContext, session: Session, pages: list[int],
                    reserved_now: bool = False) -> None:
    """Refuse (nothing pinned) a pin that would take ``session`` or its peer past its pin share.

    ``reserved_now``: the pages are this session's reservations (publish): pinning them
    does not add to what the peer holds in all.
    """
    ns = session.namespace
    assert ns is not None
    num_pages = ns.geometry.num_pages
    _, _, session_share, peer_share = _shares(ctx)
    new = len(set(pages) - session.pins.keys())
    if not new:
        return
    limit = limit_pages(session_share, num_pages)
    after = len(session.pins) + new
    if after > limit:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"pin: {after} pinned pages would pass this session's limit of {limit} "
                        f"(session_pin_share {session_share} of {num_pages} pages); unpin some first")
    hold, limit = _hold_limit(ctx, num_pages), limit_pages(peer_share, num_pages)
    if hold >= num_pages and limit >= num_pages:
        return  # peer shares of 1: no peer limit
    reserved, pinned = peer_usage(ctx, session, ns)
    new = len(set(pages) - ctx.sessions.peer_pinned_pages(session.owner.key, ns.name).keys())
    if not new:
        return
    after = pinned + new
    if after > limit:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"pin: {after} pinned pages would pass the limit of {limit} for every session "
                        f"of {session.owner.describe()} together (peer_pin_share {peer_share} of "
                        f"{num_pages} pages); unpin some first")
    if not reserved_now and hold < num_pages and reserved + pinned + new > hold:
        raise WireError(ErrorCode.QUOTA_EXCEEDED,
                        f"pin: {reserved + pinned + new} pages reserved or pinned would pass the limit "
                        f"of {hold} for every session of {session.owner.describe()} together (the "
                        f"larger of peer_pin_share and peer_reserve_share of {num_pages} pages); "
                        "unpin or commit some first")
