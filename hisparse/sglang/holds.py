"""Pages pinned between a lookup and the read that uses it: a hit stays a hit, for each lookup.

SGLang asks which leading pages exist (``batch_exists``, a linker
``lookup``), takes slots for that many, and only then reads them, from
another thread and possibly much later. A page the daemon evicts in between
turns the hit into a short read (the storage backend) or a failed batch (the
linker). So a lookup pins what it reports, and each read copies straight out
of the pinned pages and lets them go.

A hold belongs to the lookup that reported it. Several lookups may report
the same page (two requests sharing a prefix, loaded in consecutive
batches): each one claims it, and the page stays pinned until every claim
is gone, so one request's read never ends another's hold. A claim is let go
by its owner's read (``done``, ``drop``), or ``hold_s`` after it was made
(the request was aborted, another rank's MIN-reduce cut the hit), so pins
never pile up. A pin none of whose pages is claimed is released in the
background (``Pin.release(wait=False)``): letting go never waits for the
daemon, whatever thread does it.

A pin belongs to the client session that took it; one lost with its session
(daemon restart, lease expiry) reads as not held and the page is loaded
afresh, never from a page that is no longer ours.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from hisparse.client.pins import Pin
from hisparse.errors import HisparseError

log = logging.getLogger(__name__)

_anonymous = itertools.count()


@dataclass(eq=False)
class _Held:
    pin: Pin
    claimed: int = 0  # keys of this pin that some claim still holds


@dataclass(eq=False)
class _Entry:
    held: _Held
    index: int  # the key's page in ``held.pin``
    owners: dict[Hashable, None] = field(default_factory=dict)  # claims, oldest first


@dataclass(eq=False)
class _Claim:
    taken_at: float
    keys: set[bytes] = field(default_factory=set)


class PinHolds:
    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_key: dict[bytes, _Entry] = {}
        self._claims: dict[Hashable, _Claim] = {}
        self.expired_pages = 0

    def __len__(self) -> int:
        return len(self._by_key)

    @staticmethod
    def new_owner() -> Hashable:
        """An owner for a lookup that names none (``batch_exists``): its claims are anonymous."""
        return ("anonymous", next(_anonymous))

    def claims(self, key: bytes) -> int:
        """How many lookups hold ``key`` now."""
        with self._lock:
            entry = self._by_key.get(key)
            return 0 if entry is None else len(entry.owners)

    def claim(self, keys: list[bytes], owner: Hashable) -> int:
        """How many leading keys are held by a pin that is still good; ``owner`` claims each."""
        with self._lock:
            n = 0
            for key in keys:
                entry = self._by_key.get(key)
                if entry is None or not entry.held.pin.held:
                    break
                self._claim_locked(key, entry, owner)
                n += 1
            return n

    def add(self, pin: Pin, owner: Hashable) -> None:
        """Hold ``pin``'s pages for ``owner`` (a key held already keeps its older pin, and is claimed)."""
        held = _Held(pin)
        with self._lock:
            for i, key in enumerate(pin.keys[:pin.count]):
                entry = self._by_key.get(key)
                if entry is None:
                    entry = self._by_key[key] = _Entry(held, i)
                    held.claimed += 1
                self._claim_locked(key, entry, owner)
        if not held.claimed:
            _release(pin)

    def get(self, key: bytes) -> tuple[Pin, int] | None:
        with self._lock:
            entry = self._by_key.get(key)
        return None if entry is None else (entry.held.pin, entry.index)

    def done(self, key: bytes, owner: Hashable | None = None) -> None:
        """``owner``'s read of ``key`` is over (None: the oldest claim's); the page goes with its
        last claim."""
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None or not entry.owners:
                return
            if owner is None:
                owner = next(iter(entry.owners))
            free = self._unclaim_locked(key, owner)
        _release_all(free)

    def drop(self, owner: Hashable) -> None:
        """Every claim of ``owner`` (its load is over, or its lookup was given up)."""
        with self._lock:
            claim = self._claims.get(owner)
            free = [pin for key in list(claim.keys) for pin in self._unclaim_locked(key, owner)] if claim else []
        _release_all(free)

    def expire(self) -> int:
        """Drop claims made more than ``hold_s`` ago; returns the pages let go unread."""
        cutoff = self._clock() - self.hold_s
        free: list[Pin] = []
        count = 0
        with self._lock:
            for owner in [o for o, c in self._claims.items() if c.taken_at <= cutoff]:
                for key in list(self._claims[owner].keys):
                    before = len(self._by_key)
                    free += self._unclaim_locked(key, owner)
                    count += before - len(self._by_key)
            self.expired_pages += count
        _release_all(free)
        return count

    def release_all(self) -> None:
        with self._lock:
            pins = {id(e.held): e.held.pin for e in self._by_key.values()}
            self._by_key.clear()
            self._claims.clear()
        _release_all(list(pins.values()))

    def _claim_locked(self, key: bytes, entry: _Entry, owner: Hashable) -> None:
        entry.owners[owner] = None
        claim = self._claims.get(owner)
        if claim is None:
            claim = self._claims[owner] = _Claim(self._clock())
        claim.keys.add(key)

    def _unclaim_locked(self, key: bytes, owner: Hashable) -> list[Pin]:
        """Remove one claim; the pins that no key holds any longer (to release, unlocked)."""
        entry = self._by_key.get(key)
        claim = self._claims.get(owner)
        if claim is not None:
            claim.keys.discard(key)
            if not claim.keys:
                del self._claims[owner]
        if entry is None or entry.owners.pop(owner, False) is False or entry.owners:
            return []
        del self._by_key[key]
        entry.held.claimed -= 1
        return [entry.held.pin] if entry.held.claimed == 0 else []


def _release_all(pins: list[Pin]) -> None:
    for pin in pins:
        _release(pin)


def _release(pin: Pin) -> None:
    try:
        pin.release(wait=False)  # by tag, in the background: never waits for the daemon
    except HisparseError as exc:
        # The client closed meanwhile: the pins went with its session (bye or lease expiry).
        log.debug("unpin of %d pages failed (%s); they are released with the session", pin.count, exc)
