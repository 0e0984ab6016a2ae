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

from hisparse.client import backends, pipeline
from hisparse.client.calls import new_tag, waits_after
from hisparse.client.pending import Pending
from hisparse.client.session import LOST_SESSION_RETRIES, ClientSession, Sessions, chunks
from hisparse.errors import HisparseError, LeaseExpired, Timeout
from hisparse.protocol import SLOT_BUSY, SLOT_COMMITTED, Op

log = logging.getLogger(__name__)

BUSY_POLL_MIN_S = 0.001
BUSY_POLL_MAX_S = 0.05


def store_chunk(sessions: Sessions, keys: list[bytes], pages: Any,
                backend: backends.Backend) -> tuple[int, int, bool]:
    """Store one request's worth of keys: (newly written, already committed, ran out of room)."""
    todo = list(range(len(keys)))  # indices not yet committed by anyone, in key order
    written = present = 0
    full = False
    bounds = pipeline.pieces(len(keys), sessions.layout.page_bytes) if backend.overlaps else []
    if len(bounds) > 1:
        written, present, full, todo = _store_pieces(sessions, keys, pages, backend, bounds)
    if not todo:
        return written, present, full
    n, there, short = _store_whole(sessions, keys, pages, backend, todo)
    return written + n, present + there, full or short


def _store_pieces(sessions: Sessions, keys: list[bytes], pages: Any, backend: backends.OverlappingBackend,
                  bounds: list[tuple[int, int]]) -> tuple[int, int, bool, list[int]]:
    """The first pass of a large store, in pieces (``hisparse.client.pipeline``): (written,
    already committed, ran out of room, indices left to ``_store_whole``: keys another session
    was writing, or every key not committed here when the session was lost)."""
    tag = new_tag()
    session = sessions.current()
    reserves = sessions.submit_all_in(session, Op.RESERVE, [{"keys": keys[a:b], "tag": tag} for a, b in bounds])
    copying: list[tuple[backends.Landing, list[int]]] = []  # queued copies, and their indices
    commits: list[tuple[Pending, list[int]]] = []  # sent, with the indices each commits
    present, full, busy, settled = 0, False, [], 0
    try:
        # The fence keeps these pages ours however long this thread stalls in the copies;
        # the daemon refuses a commit if the lease ran out.
        with session.fence.use("store"):
            try:
                for (a, b), reserve in zip(bounds, reserves):
                    slots = reserve.result(sessions.timeout_s)["slots"]
                    settled += 1
                    present += sum(1 for s in slots if s == SLOT_COMMITTED)
                    busy += [a + j for j, s in enumerate(slots) if s == SLOT_BUSY]
                    mine = [(a + j, s) for j, s in enumerate(slots) if s >= 0]
                    if mine:
                        rows = [i for i, _ in mine]
                        copying.append((backend.scatter_async(
                            session.region, np.array([p for _, p in mine], dtype=np.int64), pages,
                            np.array(rows, dtype=np.int64)), rows))
                    if len(copying) > 1:  # the previous piece is committed while this one copies
                        commits.append(_commit(sessions, session, keys, *copying[0]))
                        copying.pop(0)  # (only once landed: a failure before lands it first)
                    if len(slots) < b - a:
                        full = True  # no room from here on: what the later pieces reserved goes back
                        break
                while copying:
                    commits.append(_commit(sessions, session, keys, *copying[0]))
                    copying.pop(0)
            finally:
                pipeline.land(copying)  # nothing is given back while a copy into it may still run
        committed: list[int] = []
        for pending, chunk in commits:
            committed += _kept(keys, chunk, pending.result(sessions.timeout_s))
    except LeaseExpired:
        # Every reservation died with the session: what was not committed is stored again
        # (by the whole path, which attaches again); what was committed counts as written.
        pipeline.abandon(reserves[settled:])
        committed = _committed_anyway(sessions, keys, commits)
        return len(committed), 0, False, sorted(set(range(len(keys))) - set(committed))
    except BaseException as exc:
        # Timeout, Ctrl-C, a copy that failed: give back everything this call reserved. An
        # abort goes after every request sent before it, so it finds the late ones too.
        pipeline.abandon(reserves[settled:] + [pending for pending, _ in commits])
        _give_back(sessions, session, keys, tag, exc)
        raise
    if settled < len(bounds):
        pipeline.abandon(reserves[settled:])
        _give_back(sessions, session, keys[bounds[settled][0]:], tag)
    return len(committed), present, full, busy


def _commit(sessions: Sessions, session: ClientSession, keys: list[bytes], landing: backends.Landing,
            rows: list[int]) -> tuple[Pending, list[int]]:
    """Once a piece's copy has landed: its commit, sent (not waited for)."""
    landing.wait()
    return sessions.submit_in(session, Op.COMMIT, keys=[keys[i] for i in rows]), rows


def _committed_anyway(sessions: Sessions, keys: list[bytes],
                      commits: list[tuple[Pending, list[int]]]) -> list[int]:
    """The indices whose commit the daemon answered ok (sent before the session was lost)."""
    done: list[int] = []
    for pending, chunk in commits:
        try:
            body = pending.result(sessions.timeout_s)
        except HisparseError:
            continue
        done += _kept(keys, chunk, body)
    return done


def _kept(keys: list[bytes], chunk: list[int], body: dict[str, Any]) -> list[int]:
    """The indices of ``chunk`` its commit made visible: not those a ``clear`` voided
    (reserved before it, the daemon freed them at the commit: ``cleared``)."""
    cleared = set(body.get("cleared") or ())
    return [i for i in chunk if keys[i] not in cleared] if cleared else chunk


def _store_whole(sessions: Sessions, keys: list[bytes], pages: Any, backend: backends.Backend,
                 todo: list[int]) -> tuple[int, int, bool]:
    """Store ``keys[i]`` for each index of ``todo`` in one reserve (then one copy, one commit),
    waiting out keys another session is writing: (written, already committed, out of room)."""
    tag = new_tag()  # every reserve of this call carries it (hisparse.client.calls)
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
                cleared = _write(sessions, session, keys, pages, mine, backend, tag)
            except LeaseExpired:
                lost += 1
                if lost > LOST_SESSION_RETRIES:
                    raise
                todo = sorted([i for i, _ in mine] + busy)  # reservations died with the session
                continue
            written += len(mine) - cleared
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
    except BaseException as exc:
        # Timeout, Ctrl-C: the daemon may have reserved pages whose ids we never learned.
        # Without this they would stay WRITING while heartbeats keep the lease. By tag:
        # another thread of this process may hold live reservations of the same keys.
        _give_back(sessions, sessions.session, keys, tag, exc)
        raise


def _write(sessions: Sessions, session: ClientSession, keys: list[bytes], pages: Any,
           mine: list[tuple[int, int]], backend: backends.Backend, tag: int) -> int:
    """Copy reserved pages in and commit them; give them back on any failure before the commit.
    Returns how many the commit voided (``cleared``: reserved before a ``clear``)."""
    mine_keys = [keys[i] for i, _ in mine]
    try:
        # The fence keeps these pages ours however long this thread stalls
        # in the copy; the daemon refuses the commit if the lease ran out.
        with session.fence.use("store"):
            backend.scatter(session.region, np.array([p for _, p in mine], dtype=np.int64),
                            pages, np.array([i for i, _ in mine], dtype=np.int64))
        cleared = 0
        for chunk in chunks(mine_keys):
            cleared += len(sessions.call_in(session, Op.COMMIT, keys=chunk).get("cleared") or ())
    except LeaseExpired:
        raise
    except BaseException as exc:
        # A commit whose reply was lost may still be applied: the abort by tag comes after
        # it and then finds nothing; otherwise it frees this call's pages, and only them.
        _give_back(sessions, session, mine_keys, tag, exc)
        raise
    return cleared


def _give_back(sessions: Sessions, session: ClientSession, keys: list[bytes], tag: int,
               after: BaseException | None = None) -> None:
    wait = waits_after(after)
    for chunk in chunks(keys):
        sessions.owed.give_back(session, Op.ABORT, wait=wait, keys=chunk, tag=tag)
