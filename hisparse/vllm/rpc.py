"""The daemon operations the adapter needs that ``Client`` does not offer, as thin calls on it.

``Client`` covers whole stores and loads (reserve -> copy -> commit, pin ->
copy -> unpin) inside one call. vLLM splits each of them across processes
and steps: the scheduler reserves and the worker copies, and the commit
comes steps later, so the adapter needs the steps one by one. Every call
here goes through the client's own request path (``Client.request`` /
``Client.request_in``: its transport, timeout, and re-attach when the daemon
forgot the session), so there is one RPC stack.

Reservations and pins belong to the session that took them. Each call that
takes one returns that session, and the calls that release one take it back:
if the session was lost meanwhile (daemon restart, lease expiry) the
release raises ``LeaseExpired`` instead of touching a new session, where
the same keys would be ``NOT_HELD`` or, worse, held by something else.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from hisparse.client.calls import new_tag
from hisparse.errors import LeaseExpired
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op

if TYPE_CHECKING:
    from hisparse.client import Client
    from hisparse.client.client import ClientSession
    from hisparse.shm.region import RegionMap

log = logging.getLogger(__name__)

Session = Any  # hisparse.client.client.ClientSession: an opaque handle here


class NamespaceOps:
    """Low-level requests on a client's namespace; chunked to the protocol's key limit."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._events_session: ClientSession | None = None
        # A mirror's lookups never reach the daemon: with mirror_lookups (the manager's ops) each
        # pin carries the keys the mirror missed since the last one, so the namespace counts them
        # as lookups (its hits: the keys pinned) in hisparsectl stats and the metrics.
        self.mirror_lookups = False
        self.missed_keys = 0

    # -- writes: reserve, then commit or abort on the same session --

    def reserve(self, keys: list[bytes], *, session: Session | None = None,
                timeout_s: float | None = None) -> tuple[list[int], list[bytes], Session]:
        """(slots, evicted keys, session): page id / SLOT_COMMITTED / SLOT_BUSY per key,
        shorter when the region is full; the keys the daemon evicted to make room.

        With ``session``, on that session exactly (``LeaseExpired`` if it is gone,
        never a re-attach): the scheduler's thread never waits for a ``hello``.
        A request without its reply gives back what this call reserved, by its
        tag, in the background (``hisparse.client.calls``): never another
        thread's reservation of the same keys."""
        slots: list[int] = []
        evicted: list[bytes] = []
        tag = new_tag()
        try:
            for chunk in _chunks(keys):
                body, session = self._call(session, Op.RESERVE, timeout_s, keys=chunk, tag=tag)
                got = [int(s) for s in body["slots"]]
                slots.extend(got)
                evicted.extend(body.get("evicted", ()))
                if len(got) < len(chunk):
                    break
        except LeaseExpired:
            raise
        except BaseException:
            # Chunks answered before are given back too: the caller learns none of them.
            for chunk in _chunks(keys):
                self.client.give_back(session or self.client.session, Op.ABORT, keys=chunk, tag=tag)
            raise
        return slots, evicted, session

    def commit(self, session: Session, keys: list[bytes]) -> list[bytes]:
        """Commit reservations; returns the keys the daemon aborted instead, because a clear
        (``reset_cache`` anywhere, ``hisparsectl clear``) came after they were reserved."""
        cleared: list[bytes] = []
        for chunk in _chunks(keys):
            body = self.client.request_in(session, Op.COMMIT, keys=chunk)
            cleared.extend(body.get("cleared", ()))
        return cleared

    def abort(self, session: Session, keys: list[bytes]) -> None:
        """Drop reservations this engine holds (after a lost reply, ``reserve`` gives back by tag)."""
        for chunk in _chunks(keys):
            self.client.request_in(session, Op.ABORT, keys=chunk)

    def publish(self, session: Session, keys: list[bytes], as_keys: list[bytes], *,
                pin: bool) -> list[int]:
        """Commit reservations held under ``keys`` as ``as_keys``: page ids, ``-1`` where
        ``as_keys[i]`` was already taken (that reservation stays held)."""
        pages: list[int] = []
        for start in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            end = start + MAX_KEYS_PER_REQUEST
            body = self.client.request_in(session, Op.PUBLISH, keys=keys[start:end],
                                          as_keys=as_keys[start:end], pin=pin)
            pages.extend(int(p) for p in body["pages"])
        return pages

    # -- reads: pin, then unpin on the same session --

    def pin_each(self, keys: list[bytes], *, session: Session | None = None,
                 timeout_s: float | None = None) -> tuple[list[int], Session]:
        """Pin every committed key of ``keys``, prefix or not: page ids, ``-1`` where not committed.

        ``pin`` holds a committed *prefix*; vLLM's load set is per group and
        may have a hole where a key was evicted since its lookup, so after a
        short prefix the rest is pinned again past the hole. One request when
        everything is there; one more per hole. A request without its reply
        gives back every pin of this call, by its tag, in the background.
        """
        pages: list[int] = []
        start = 0
        tag = new_tag()
        try:
            while start < len(keys):
                chunk = keys[start:start + MAX_KEYS_PER_REQUEST]
                missed = None
                if self.mirror_lookups:
                    missed, self.missed_keys = self.missed_keys, 0
                body, session = self._call(session, Op.PIN, timeout_s, keys=chunk, tag=tag, missed=missed)
                got = [int(p) for p in body["pages"]]
                pages.extend(got)
                start += len(got)
                if len(got) < len(chunk):
                    pages.append(-1)  # keys[start] is not committed: skip it
                    start += 1
        except LeaseExpired:
            raise  # the pins taken so far went with the session
        except BaseException:
            self.client.give_back(session or self.client.session, Op.UNPIN, tag=tag)
            raise
        return pages, session

    def unpin(self, session: Session, pages: list[int]) -> None:
        """Unpin by page id, as ``pin_each`` returned them."""
        for start in range(0, len(pages), MAX_KEYS_PER_REQUEST):
            self.client.request_in(session, Op.UNPIN, pages=pages[start:start + MAX_KEYS_PER_REQUEST])

    # -- one request: the first of a sequence takes the current session, the rest keep it --

    def _call(self, session: Session | None, op: Op, timeout_s: float | None = None,
              **fields: Any) -> tuple[dict[str, Any], Session]:
        if session is None:
            return self.client.request(op, timeout_s, **fields)
        return self.client.request_in(session, op, timeout_s, **fields), session

    # -- the mirror's reads --

    def events(self, after: int, limit: int) -> dict[str, Any]:
        body, session = self.client.request(Op.EVENTS, after=after, limit=limit)
        if self._events_session is not None and session is not self._events_session:
            # A new session may mean a new daemon whose sequence numbers restarted
            # and could overlap ours: treat the stream as broken.
            self._events_session = session
            return {"seq": body["seq"], "events": [], "reset": True}
        self._events_session = session
        return body

    def keys_page(self, cursor: int, limit: int) -> dict[str, Any]:
        body, session = self.client.request(Op.KEYS, cursor=cursor, limit=limit)
        self._events_session = session
        return body

    # -- admin --

    def clear(self) -> int | None:
        """Drop every committed page of the namespace; None when the admin token is unreadable."""
        token = _read_admin_token(self.client.socket_path)
        if token is None:
            return None
        body, _ = self.client.request(Op.CLEAR, token=token, namespace=self.client.namespace)
        return int(body["freed_pages"]) + int(body["doomed_pages"])

    # -- the region --

    def region(self) -> RegionMap:
        """The current session's mapping of the region (replaced if the daemon re-created it)."""
        return self.client.session.region

    def session(self) -> Session:
        return self.client.session

    def session_is_live(self, session: Session) -> bool:
        return self.client.session_is_live(session)


def _chunks(keys: list[bytes]) -> list[list[bytes]]:
    return [keys[i:i + MAX_KEYS_PER_REQUEST] for i in range(0, len(keys), MAX_KEYS_PER_REQUEST)]


def _read_admin_token(socket_path: str) -> str | None:
    # The daemon writes it beside its socket, readable by its own user and root only.
    path = os.path.join(os.path.dirname(os.path.abspath(socket_path)), "hisparsed.token")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        log.debug("admin token %s unreadable: %s", path, exc)
        return None

