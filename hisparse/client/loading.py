"""The load path: pin the committed prefix -> copy out of the region -> unpin.

Pins keep the pages from eviction and overwrite while they are copied; the
session's fence keeps them unchanged even if this thread stalls past its
lease, but a copy whose holds were lost meanwhile (lease expiry, daemon
restart) is never trusted: the load is done again on a new session. Every
pin of a call carries the call's tag (``hisparse.client.calls``), so a pin
whose reply was lost is given back by tag, and only it. A large load goes
in pieces (``hisparse.client.pipeline``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hisparse.client import backends, pipeline
from hisparse.client.calls import new_tag, waits_after
from hisparse.client.pending import Pending
from hisparse.client.session import LOST_SESSION_RETRIES, ClientSession, Sessions, chunks
from hisparse.errors import HisparseError, LeaseExpired
from hisparse.protocol import Op

log = logging.getLogger(__name__)



def load(sessions: Sessions, keys: list[bytes], out: Any, backend: backends.Backend) -> int:
    """Copy the committed prefix of ``keys`` into ``out[:m]``; returns ``m``."""
    bounds = pipeline.pieces(len(keys), sessions.layout.page_bytes) if backend.overlaps else []
    for attempt in range(LOST_SESSION_RETRIES + 1):
        try:
            if len(bounds) > 1:
                return _load_pieces(sessions, keys, out, backend, bounds)
            return _load_whole(sessions, keys, out, backend)
        except LeaseExpired:
            # Lost mid-copy (lease, restart): the fence kept the pages unchanged,
            # but a lost hold is never trusted: copy again on a new session.
            if attempt == LOST_SESSION_RETRIES:
                raise
    raise AssertionError("unreachable")


def _load_whole(sessions: Sessions, keys: list[bytes], out: Any, backend: backends.Backend) -> int:
    tag = new_tag()
    session, pinned, page_ids = pin_prefix(sessions, keys, tag)
    if not pinned:
        return 0
    try:
        with session.fence.use("load"):
            backend.gather(session.region, page_ids, out[:len(pinned)])
            session.fence.check("load")
    except LeaseExpired:
        raise  # the pins went with the session
    except BaseException:
        unpin_quietly(sessions, session, page_ids, tag)
        raise
    try:
        sessions.unpin(session, page_ids, tag)
    except LeaseExpired:
        raise  # the pins died with the session mid-copy: the copy is not trusted
    except BaseException as exc:
        give_back_pins(sessions, session, tag, exc)  # the unpin may never have been sent
        raise
    return len(pinned)


def _load_pieces(sessions: Sessions, keys: list[bytes], out: Any, backend: backends.OverlappingBackend,
                 bounds: list[tuple[int, int]]) -> int:
    """Every piece's pin sent at once; each piece's copy queued as its pins come in, and
    unpinned once it has landed, while the next one copies. Stops where the prefix ends."""
    tag = new_tag()
    session = sessions.current()
    pins = sessions.submit_all_in(session, Op.PIN, [{"keys": keys[a:b], "tag": tag} for a, b in bounds])
    copying: list[tuple[backends.Landing, list[int]]] = []  # queued copies, and their pages
    unpins: list[Pending] = []
    settled = loaded = 0
    try:
        with session.fence.use("load"):
            try:
                for (a, b), pending in zip(bounds, pins):
                    pinned = pending.result(sessions.timeout_s)["pages"]
                    settled += 1
                    if pinned:
                        copying.append((backend.gather_async(
                            session.region, np.asarray(pinned, dtype=np.int64), out[a:a + len(pinned)]),
                            pinned))
                    if len(copying) > 1:  # the previous piece is unpinned while this one copies
                        unpins.append(_unpin(sessions, session, tag, *copying[0]))
                        copying.pop(0)  # (only once landed: a failure before lands it first)
                    loaded = a + len(pinned)
                    if len(pinned) < b - a:
                        break  # the committed prefix ends in this piece
                while copying:
                    unpins.append(_unpin(sessions, session, tag, *copying[0]))
                    copying.pop(0)
            finally:
                pipeline.land(copying)  # nothing is unpinned while a copy out of it may still run
        if settled < len(bounds):
            # The later pieces may have pinned keys past the gap. Their pins are the only ones
            # of this tag not unpinned by a request sent before this one.
            pipeline.abandon(pins[settled:])
            give_back_pins(sessions, session, tag)
        for pending in unpins:
            pending.result(sessions.timeout_s)
    except LeaseExpired:
        # The pins died with the session, maybe mid-copy: the copy is not trusted.
        pipeline.abandon(pins[settled:] + unpins)
        sessions.rehello(session)  # (unless another thread did): the next try runs on the new one
        raise
    except BaseException as exc:
        pipeline.abandon(pins[settled:] + unpins)
        give_back_pins(sessions, session, tag, exc)
        raise
    return loaded


def _unpin(sessions: Sessions, session: ClientSession, tag: int, landing: backends.Landing,
           pinned: list[int]) -> Pending:
    """Once a piece's copy has landed (and the holds were live throughout): its unpin, sent."""
    landing.wait()
    session.fence.check("load")
    return sessions.submit_in(session, Op.UNPIN, pages=pinned, tag=tag)


def pin_prefix(sessions: Sessions, keys: list[bytes], tag: int) -> tuple[ClientSession, list[bytes], np.ndarray]:
    """Pin the committed prefix, all under one session and ``tag``: (session, keys pinned,
    page ids). A request without its reply gives back every pin of the call, by tag."""
    for _ in range(LOST_SESSION_RETRIES + 1):
        session: ClientSession | None = None
        pages: list[int] = []
        try:
            for chunk in chunks(keys):
                if session is None:
                    body, session = sessions.call(Op.PIN, keys=chunk, tag=tag)
                else:
                    body = sessions.call_in(session, Op.PIN, keys=chunk, tag=tag)
                pages.extend(body["pages"])
                if int(body["count"]) < len(chunk):
                    break
        except LeaseExpired:
            continue  # lost between chunks: the pins taken so far are gone, start over
        except BaseException as exc:
            # Timeout, Ctrl-C: the daemon may pin later what we never learn of.
            give_back_pins(sessions, session or sessions.session, tag, exc)
            raise
        assert session is not None
        return session, keys[:len(pages)], np.asarray(pages, dtype=np.int64)
    raise LeaseExpired("pin: the session was lost repeatedly")


def give_back_pins(sessions: Sessions, session: ClientSession, tag: int,
                   after: BaseException | None = None) -> None:
    sessions.owed.give_back(session, Op.UNPIN, wait=waits_after(after), tag=tag)


def unpin_quietly(sessions: Sessions, session: ClientSession, page_ids: Any, tag: int) -> None:
    try:
        sessions.unpin(session, page_ids, tag)
    except LeaseExpired:
        pass  # released with the session
    except HisparseError as exc:
        log.warning("unpin of %d pages failed (%s); given back by tag", len(page_ids), exc)
        give_back_pins(sessions, session, tag, exc)
