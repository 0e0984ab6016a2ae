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
  the defaults (0.5) one uid never takes more than half a region while
  another wants it, whatever mix of pins and reservations it tries.

Shares are work-conserving (``contention``): a share binds only while
someone else contends for the namespace (another uid attached, for the
peer shares; another session asking and getting fewer pages than it asked,
for the session shares).
Alone, one engine, or the engines of one uid, may hold the whole region.

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

from hisparse.daemon.policy.contention import note_short, peer_contended, session_contended
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


def _shares(ctx: DaemonContext, session: Session, ns: Namespace) -> tuple[float, float, float, float]:
    """(session reserve, peer reserve, session pin, peer pin) shares in force now: 1 where uncontended."""
    cfg = ctx.config
    peer_reserve = cfg.peer_reserve_share if cfg.peer_reserve_share is not None else cfg.session_reserve_share
    peer_pin = cfg.peer_pin_share if cfg.peer_pin_share is not None else cfg.session_pin_share
    if min(cfg.session_reserve_share, cfg.session_pin_share) < 1 and not session_contended(ctx, session, ns):
        session_reserve = session_pin = 1.0
    else:
        session_reserve, session_pin = cfg.session_reserve_share, cfg.session_pin_share
    if min(peer_reserve, peer_pin) < 1 and not peer_contended(ctx, session, ns):
        peer_reserve = peer_pin = 1.0
    return session_reserve, peer_reserve, session_pin, peer_pin


def _hold_limit(num_pages: int, peer_reserve: float, peer_pin: float) -> int:
    """Pages one peer may hold in all, reserved and pinned together."""
    return limit_pages(max(peer_reserve, peer_pin), num_pages)


def reserve_room(ctx: DaemonContext, session: Session) -> tuple[int, str]:
    """New pages ``session`` may reserve, and the limit that says so; ``QUOTA_EXCEEDED`` when none."""
    ns = session.namespace
    assert ns is not None
    num_pages = ns.geometry.num_pages
    session_share, peer_share, _, peer_pin = _shares(ctx, session, ns)
    rooms = [(num_pages, "")]  # no share binds: the region's own size bounds it (room, not quota)
    if session_share < 1:
        rooms.append((limit_pages(session_share, num_pages) - len(session.reservations),
                      f"session_reserve_share {session_share} of {num_pages} pages, while another "
                      "session of the namespace holds or asks for pages"))
    # a peer limit of the whole region is none: the region's own size bounds it (room, not quota)
    hold, peer_limit = _hold_limit(num_pages, peer_share, peer_pin), limit_pages(peer_share, num_pages)
    if peer_limit < num_pages or hold < num_pages:
        reserved, pinned = peer_usage(ctx, session, ns)
    if peer_limit < num_pages:
        rooms.append((peer_limit - reserved,
                      f"peer_reserve_share {peer_share} of {num_pages} pages, for every session of "
                      f"{session.owner.describe()} together, while another uid is attached"))
    if hold < num_pages:
        rooms.append((hold - reserved - pinned,
                      f"peer_reserve_share: {reserved + pinned} pages reserved or pinned by every session "
                      f"of {session.owner.describe()} together, at most {hold} (the larger of "
                      f"peer_pin_share and peer_reserve_share of {num_pages} pages), while another uid "
                      "is attached"))
    room, limit = min(rooms, key=lambda r: r[0])
    if room <= 0:
        note_short(session)
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
    note_short(session)
    ns = session.namespace
    assert ns is not None
    if got >= room and limit:  # "" : no share bound it, the region did
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


def _refused(session: Session, message: str) -> WireError:
    """A pin refused by a share: ``session`` got fewer pages than it asked for (it contends)."""
    note_short(session)
    return WireError(ErrorCode.QUOTA_EXCEEDED, message)


def check_pin_quota(ctx: DaemonContext, session: Session, pages: list[int],
                    reserved_now: bool = False) -> None:
    """Refuse (nothing pinned) a pin that would take ``session`` or its peer past its pin share.

    ``reserved_now``: the pages are this session's reservations (publish): pinning them
    does not add to what the peer holds in all.
    """
    ns = session.namespace
    assert ns is not None
    num_pages = ns.geometry.num_pages
    new = len(set(pages) - session.pins.keys())
    if not new:
        return
    _, peer_reserve, session_share, peer_share = _shares(ctx, session, ns)
    limit = limit_pages(session_share, num_pages)
    after = len(session.pins) + new
    if after > limit:
        raise _refused(session,
                       f"pin: {after} pinned pages would pass this session's limit of {limit} "
                       f"(session_pin_share {session_share} of {num_pages} pages); unpin some first")
    hold, limit = _hold_limit(num_pages, peer_reserve, peer_share), limit_pages(peer_share, num_pages)
    if hold >= num_pages and limit >= num_pages:
        return  # peer shares of 1, or no other uid here: no peer limit
    reserved, pinned = peer_usage(ctx, session, ns)
    new = len(set(pages) - ctx.sessions.peer_pinned_pages(session.owner.key, ns.name).keys())
    if not new:
        return
    after = pinned + new
    if after > limit:
        raise _refused(session,
                       f"pin: {after} pinned pages would pass the limit of {limit} for every session "
                       f"of {session.owner.describe()} together (peer_pin_share {peer_share} of "
                       f"{num_pages} pages); unpin some first")
    if not reserved_now and hold < num_pages and reserved + pinned + new > hold:
        raise _refused(session,
                       f"pin: {reserved + pinned + new} pages reserved or pinned would pass the limit "
                       f"of {hold} for every session of {session.owner.describe()} together (the "
                       f"larger of peer_pin_share and peer_reserve_share of {num_pages} pages); "
                       "unpin or commit some first")
