"""The store path: reserve -> copy into the region -> commit, for one request's worth of keys.

A page becomes visible only at its commit; any failure between reserve and
commit aborts the reservations this call took, so no partial page is ever
seen. Each call tags its reserves (``hisparse.client.calls``): what it
gives back after a lost reply is only what it reserved. Keys another
session (or thread) is writing (``SLOT_BUSY``) are waited for: its commit
makes them committed here too, its abort hands them to this call.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from hisparse.client import backends
from hisparse.client.calls import new_tag
from hisparse.client.session import ClientSession, Sessions, chunks
from hisparse.errors import LeaseExpired, Timeout
from hisparse.protocol import SLOT_BUSY, SLOT_COMMITTED, Op

log = logging.getLogger(__name__)

LOST_SESSION_RETRIES = 2  # a store/load redone after its session was lost mid-way
BUSY_POLL_MIN_S = 0.001
BUSY_POLL_MAX_S = 0.05


def store_chunk(sessions: Sessions, keys: list[bytes], pages: Any,
                backend: backends.Backend) -> tuple[int, int, bool]:
    """Store one request's worth of keys: (newly written, already committed, ran out of room)."""
    tag = new_tag()  # every reserve of this call carries it (hisparse.client.calls)
    todo = list(range(len(keys)))  # indices not yet committed by anyone, in key order
    written, present, full, lost = 0, 0, False, 0
    busy_deadline = None
    poll_s = BUSY_POLL_MIN_S
    while todo:
        body, session = _reserve(sessions, [keys[i] for i in todo], tag)
        slots = body["slots"]
        full = full or len(slots) < len(todo)
        present += sum(1 for s in slots if s == SLOT_COMMITTED)
        mine = [(todo[j], s) for j, s in enumerate(slots) if s >= 0]
        busy = [todo[j] for j, s in enumerate(slots) if s == SLOT_BUSY]
        if mine:
            try:
                _write(sessions, session, keys, pages, mine, backend, tag)
            except LeaseExpired:
                lost += 1
                if lost > LOST_SESSION_RETRIES:
                    raise
                todo = sorted([i for i, _ in mine] + busy)  # reservations died with the session
                continue
            written += len(mine)
        if not busy:
            break
        # Another session (a TP rank storing the same chain) is writing these:
        # wait for its commit, or for its abort (then they are reserved here).
        now = time.monotonic()
        if busy_deadline is None:
            busy_deadline = now + sessions.timeout_s + session.lease_ttl_s
        elif now > busy_deadline:
            raise Timeout(f"store: {len(busy)} keys are still being written by another session")
        time.sleep(poll_s)
        poll_s = min(poll_s * 2, BUSY_POLL_MAX_S)
        todo = busy
    return written, present, full


def _reserve(sessions: Sessions, keys: list[bytes], tag: int) -> tuple[dict[str, Any], ClientSession]:
    """reserve under the call's tag; if its reply is lost, give back what it may have reserved."""
    try:
        return sessions.call(Op.RESERVE, keys=keys, tag=tag)
    except LeaseExpired:
        raise
    except BaseException:
        # Timeout, Ctrl-C: the daemon may have reserved pages whose ids we never learned.
        # Without this they would stay WRITING while heartbeats keep the lease. By tag:
        # another thread of this process may hold live reservations of the same keys.
        _give_back(sessions, sessions.session, keys, tag)
        raise


def _write(sessions: Sessions, session: ClientSession, keys: list[bytes], pages: Any,
           mine: list[tuple[int, int]], backend: backends.Backend, tag: int) -> None:
    """Copy reserved pages in and commit them; give them back on any failure before the commit."""
    mine_keys = [keys[i] for i, _ in mine]
    try:
        # The fence keeps these pages ours however long this thread stalls
        # in the copy; the daemon refuses the commit if the lease ran out.
        with session.fence.use("store"):
            backend.scatter(session.region, np.array([p for _, p in mine], dtype=np.int64),
                            pages, np.array([i for i, _ in mine], dtype=np.int64))
        for chunk in chunks(mine_keys):
            sessions.call_in(session, Op.COMMIT, keys=chunk)
    except LeaseExpired:
        raise
    except BaseException:
        # A commit whose reply was lost may still be applied: the abort by tag comes after
        # it and then finds nothing; otherwise it frees this call's pages, and only them.
        _give_back(sessions, session, mine_keys, tag)
        raise


def _give_back(sessions: Sessions, session: ClientSession, keys: list[bytes], tag: int) -> None:
    for chunk in chunks(keys):
        sessions.owed.give_back(session, Op.ABORT, wait=True, keys=chunk, tag=tag)
