"""The stores this engine has in flight: reserved pages, from ``prepare_store`` until the commit is done.

A reservation belongs to the daemon session that took it, and holds one
reference on that session's fence while the worker may write the page
(``prepare_store`` -> ``complete_store``): the daemon reuses none of the
session's pages meanwhile. After ``complete_store(success=True)`` the key is
``committing`` until the background thread's commit is done. Keys another
session is writing (the reserve said SLOT_BUSY) are remembered for a short
while, so lookups answer RETRY instead of MISS.

Nothing here talks to the daemon; every method runs under the manager's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hisparse.errors import LeaseExpired

Session = Any  # hisparse.client.client.ClientSession
BUSY_RETRY_S = 0.5  # how long a key another session is writing answers RETRY


@dataclass
class Reservation:
    page: int
    session: Session
    committing: bool = False
    fenced: bool = True  # holds a reference on the session's fence until the worker is done


class Writes:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: dict[bytes, Reservation] = {}
        self._busy_until: dict[bytes, float] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    # -- keys another session writes --

    def mark_busy(self, key: bytes) -> None:
        self._busy_until[key] = self._clock() + BUSY_RETRY_S

    def busy(self, key: bytes) -> bool:
        until = self._busy_until.get(key)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._busy_until[key]
        return False

    def not_busy(self, key: bytes) -> None:
        """Committed (by whoever wrote it): no longer worth a RETRY."""
        self._busy_until.pop(key, None)

    # -- ours --

    def add(self, keys: list[bytes], pages: list[int], session: Session) -> bool:
        """Reserved pages, one fence reference each; False (nothing added) if the fence was let go."""
        acquired = 0
        try:
            for _ in keys:
                session.fence.acquire()
                acquired += 1
        except LeaseExpired:  # the session was replaced under us: these pages are not ours
            for _ in range(acquired):
                session.fence.release()
            return False
        for key, page in zip(keys, pages):
            self._held[key] = Reservation(page, session)
        return True

    def by_session(self, keys: Iterable[bytes]) -> list[tuple[Session, list[bytes]]]:
        """Our reservations among ``keys`` not yet being committed, by the session that holds them."""
        groups: dict[int, tuple[Session, list[bytes]]] = {}
        for key in keys:
            held = self._held.get(key)
            if held is not None and not held.committing:
                groups.setdefault(id(held.session), (held.session, []))[1].append(key)
        return list(groups.values())

    def worker_done(self, keys: list[bytes], success: bool) -> None:
        """The worker finished writing: fence references go; committing on success, dropped else."""
        for key in keys:
            held = self._held[key]
            if held.fenced:
                held.fenced = False
                held.session.fence.release()
            if success:
                held.committing = True
            else:
                del self._held[key]

    def committed(self, job_keys: list[bytes], published: list[bytes]) -> list[tuple[bytes, int]]:
        """A commit job is over: (key, page) of those published; all of ``job_keys`` leave."""
        done = set(published)
        pages = []
        for key in job_keys:
            held = self._held.pop(key, None)
            if held is not None and key in done:
                pages.append((key, held.page))
        return pages

    def reset(self) -> tuple[list[tuple[Session, list[bytes]]], list[Any]]:
        """``reset_cache``: (reservations to abort, fences to release) once the flushed jobs are
        done. Commits already queued stay until their job is done: the daemon's clear made
        their reservations uncommittable, so they come back as cleared, never published."""
        aborts = self.by_session(list(self._held))
        fences = [r.session.fence for r in self._held.values() if r.fenced and not r.committing]
        self._held = {k: r for k, r in self._held.items() if r.committing}
        self._busy_until.clear()
        return aborts, fences
