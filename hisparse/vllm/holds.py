"""Pins the scheduler holds from ``lookup`` on, so that a HIT is a promise.

vLLM's contract: what ``lookup`` answers HIT, the ``prepare_load`` that
follows can load; no eviction may come between. The daemon evicts only
unpinned pages, so the manager answers HIT only for keys this engine has
pinned (``Holds``): a committed key that is not held yet answers RETRY and
is queued (``want``); the background thread pins the queued keys in one
batch, and the scheduler's next look finds them held.

A hold is per key and shared by the requests that looked it up; it also
counts the loads bound to it (``prepare_load`` -> ``complete_load``). It
goes (the page is unpinned) when no request wants it and no load reads it:
at ``complete_load``, at ``on_request_finished``, or when it has not been
looked at for ``hold_s`` (``expired``), so a request that never gets
scheduled does not keep pages pinned. A hold whose daemon session was lost
protects nothing any more: ``drop_session`` forgets it (the daemon already
released the pin with the session).

Nothing here talks to the daemon; every method runs under the manager's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Session = Any  # hisparse.client.client.ClientSession


@dataclass
class Hold:
    page: int
    session: Session
    touched_s: float  # last lookup or load of the key
    reqs: set[str] = field(default_factory=set)  # requests that looked it up
    loads: int = 0  # loads bound to it and not completed


@dataclass(frozen=True)
class Release:
    """A pin to give back: the key, its page and the session that took it."""

    key: bytes
    page: int
    session: Session


class Holds:
    """``key -> Hold`` plus the keys wanted (looked up, committed, not yet pinned)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._holds: dict[bytes, Hold] = {}
        self._by_req: dict[str, set[bytes]] = {}
        self.wanted: dict[bytes, set[str]] = {}  # key -> requests waiting for its pin

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, key: bytes) -> bool:
        return key in self._holds

    def get(self, key: bytes) -> Hold | None:
        return self._holds.get(key)

    # -- the scheduler's side --

    def touch(self, key: bytes, req_id: str) -> bool:
        """True (and the request noted) when ``key`` is held: a HIT."""
        hold = self._holds.get(key)
        if hold is None:
            return False
        hold.touched_s = self._clock()
        if req_id not in hold.reqs:
            hold.reqs.add(req_id)
            self._by_req.setdefault(req_id, set()).add(key)
        return True

    def want(self, key: bytes, req_id: str) -> None:
        """Ask the background thread to pin ``key`` for ``req_id``."""
        self.wanted.setdefault(key, set()).add(req_id)

    def take_wanted(self) -> dict[bytes, set[str]]:
        wanted, self.wanted = self.wanted, {}
        return wanted

    def bind_load(self, key: bytes, req_id: str) -> int | None:
        """The page of a held key, counted as read by a load until ``unbind_load``; None if not held."""
        hold = self._holds.get(key)
        if hold is None:
            return None
        self.touch(key, req_id)
        hold.loads += 1
        return hold.page

    def unbind_load(self, key: bytes, req_id: str) -> Release | None:
        """A load of ``key`` for ``req_id`` is done; the release due if nothing else holds it."""
        hold = self._holds.get(key)
        if hold is None:
            return None
        hold.loads = max(0, hold.loads - 1)
        self._forget_req(key, hold, req_id)
        return self._maybe_release(key, hold)

    def finish(self, req_id: str) -> list[Release]:
        """The request is done: its holds go unless another request or a load keeps them."""
        releases = []
        for key in self._by_req.pop(req_id, ()):
            hold = self._holds.get(key)
            if hold is not None:
                hold.reqs.discard(req_id)
                release = self._maybe_release(key, hold)
                if release is not None:
                    releases.append(release)
        for reqs in self.wanted.values():
            reqs.discard(req_id)
        return releases

    # -- the background thread's side --

    def add(self, key: bytes, page: int, session: Session, reqs: set[str]) -> Release | None:
        """A pin taken for ``reqs``; returned as a release if the key is held already."""
        if key in self._holds:
            hold = self._holds[key]
            for req_id in reqs:
                self.touch(key, req_id)
            return Release(key, page, session)
        hold = Hold(page, session, self._clock())
        self._holds[key] = hold
        for req_id in reqs:
            hold.reqs.add(req_id)
            self._by_req.setdefault(req_id, set()).add(key)
        return None

    def expired(self, hold_s: float) -> list[Release]:
        """Holds untouched for ``hold_s`` with no load reading them."""
        cutoff = self._clock() - hold_s
        old = [k for k, h in self._holds.items() if h.loads == 0 and h.touched_s < cutoff]
        releases = []
        for key in old:
            hold = self._holds.pop(key)
            for req_id in hold.reqs:
                self._by_req.get(req_id, set()).discard(key)
            releases.append(Release(key, hold.page, hold.session))
        return releases

    def drop_session(self, is_live: Callable[[Session], bool]) -> list[bytes]:
        """Forget holds whose session is gone (the daemon dropped their pins); returns their keys."""
        gone = [k for k, h in self._holds.items() if not is_live(h.session)]
        for key in gone:
            hold = self._holds.pop(key)
            for req_id in hold.reqs:
                self._by_req.get(req_id, set()).discard(key)
        return gone

    def clear(self) -> list[Release]:
        """Everything (``reset_cache``): each hold as a release."""
        releases = [Release(k, h.page, h.session) for k, h in self._holds.items()]
        self._holds.clear()
        self._by_req.clear()
        self.wanted.clear()
        return releases

    # -- internals --

    def _forget_req(self, key: bytes, hold: Hold, req_id: str) -> None:
        hold.reqs.discard(req_id)
        keys = self._by_req.get(req_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_req[req_id]

    def _maybe_release(self, key: bytes, hold: Hold) -> Release | None:
        if hold.reqs or hold.loads:
            return None
        del self._holds[key]
        return Release(key, hold.page, hold.session)
