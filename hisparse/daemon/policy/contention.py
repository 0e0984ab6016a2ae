"""Contention: whether a namespace's shares bind now. Shares are work-conserving.

A share exists so that one tenant cannot keep another from its part of a
region; it has nothing to protect while nobody else wants pages. So
``quotas.py`` applies a share only under contention, as seen here:

- **per peer** (``peer_*_share``): another uid has a live session on the
  namespace (attached: it will ask, and what a tenant took before that
  could not be taken back), or an ended session of another uid still holds
  pages there (fenced reservations or pins, counted against that uid);
- **per session** (``session_*_share``): another session of the namespace
  (any uid) asked for pages within the last lease (``lease_ttl``) and did
  not get them all (a reserve cut short or refused, by room or by quota; a
  pin refused). Sessions that get what they ask for, however much they
  hold, cost each other nothing: the engines of one uid share the whole
  region.

Alone, a session or a uid may hold the whole region. What it already holds
when contention starts is never taken back (a reservation is being written,
a pin is being read), but from then on it takes nothing new past its share,
so the other side's part frees as its holds settle: a store's reservations
within its copy, a load's pins within its copy, a dead engine's within
``lease_ttl``. Committed pages belong to nobody: anyone's reserve evicts
the least recently used of them, whoever stored them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hisparse.daemon.ops.context import DaemonContext
    from hisparse.daemon.store.namespaces import Namespace
    from hisparse.daemon.store.sessions import Session

MAX_SHORT = 1 << 16  # entries kept before old ones are dropped (one per session: max_sessions is far less)
_short_s: dict[int, float] = {}  # session id -> when it last asked for pages and got fewer (monotonic)


def note_short(session: Session) -> None:
    """``session`` asked for pages and did not get them all: it contends for a lease."""
    if len(_short_s) >= MAX_SHORT:
        _short_s.clear()  # what is lost: until their next ask, these sessions' contention
    _short_s[session.id] = time.monotonic()


def peer_contended(ctx: DaemonContext, session: Session, ns: Namespace) -> bool:
    """Another uid is attached to ``ns``, or its ended sessions hold pages there."""
    mine = session.owner.key
    for other in ctx.sessions.sessions.values():
        if other.namespace is ns and other.owner.key != mine:
            return True
    for zombie in ctx.sessions.zombies.values():
        if (zombie.namespace is ns and zombie.owner is not None and zombie.owner.key != mine
                and (zombie.fenced_pages or zombie.pins)):
            return True
    return False


def session_contended(ctx: DaemonContext, session: Session, ns: Namespace) -> bool:
    """Another session of ``ns`` asked for pages within the last lease and got fewer."""
    if not _short_s:
        return False
    since = time.monotonic() - ctx.sessions.lease_ttl_s
    for other in ctx.sessions.sessions.values():
        if other is not session and other.namespace is ns and _short_s.get(other.id, since) > since:
            return True
    return False
