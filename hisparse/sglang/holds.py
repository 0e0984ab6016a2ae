"""Pages pinned between SGLang's ``batch_exists`` and its ``batch_get``: a hit stays a hit.

SGLang asks which leading pages exist, takes host slots for that many, and
only then reads them, from another thread and possibly much later. A page
the daemon evicts in between turns the hit into a short read (SGLang
tolerates it, but loses the prefix). So ``batch_exists`` pins what it
reports; ``batch_get`` copies straight out of the pinned pages (no second
round trip, no staging copy) and lets each go as it is read. A pin never
read (the request was aborted, another rank's MIN-reduce cut the hit) is
released ``hold_s`` after it was taken, so pins never pile up.

A pin belongs to the client session that took it; one lost with its session
(daemon restart, lease expiry) reads as not held and the page is loaded
afresh, never from a page that is no longer ours.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hisparse.client.pins import Pin
from hisparse.errors import HisparseError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    pin: Pin
    taken_at: float
    unread: set[bytes] = field(default_factory=set)


class PinHolds:
    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_key: dict[bytes, tuple[_Held, int]] = {}
        self._held: list[_Held] = []
        self.expired_pages = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, pin: Pin) -> None:
        """Hold ``pin``'s pages for their keys (a key held already keeps its older pin)."""
        held = _Held(pin, self._clock())
        with self._lock:
            for i, key in enumerate(pin.keys[:pin.count]):
                if key not in self._by_key:
                    self._by_key[key] = (held, i)
                    held.unread.add(key)
            if held.unread:
                self._held.append(held)
                return
        _release(pin)

    def leading(self, keys: list[bytes]) -> int:
        """How many leading keys are held by a pin that is still good."""
        with self._lock:
            n = 0
            for key in keys:
                entry = self._by_key.get(key)
                if entry is None or not entry[0].pin.held:
                    break
                n += 1
            return n

    def get(self, key: bytes) -> tuple[Pin, int] | None:
        with self._lock:
            entry = self._by_key.get(key)
        return None if entry is None else (entry[0].pin, entry[1])

    def done(self, key: bytes) -> None:
        """``key`` was read (or its pin found lost): let its page go."""
        with self._lock:
            entry = self._by_key.pop(key, None)
            if entry is None:
                return
            held = entry[0]
            held.unread.discard(key)
            finished = not held.unread
            if finished:
                self._held.remove(held)
        if finished:
            _release(held.pin)

    def expire(self) -> int:
        """Release pins taken more than ``hold_s`` ago; returns the pages let go unread."""
        cutoff = self._clock() - self.hold_s
        with self._lock:
            old = [h for h in self._held if h.taken_at <= cutoff]
            for h in old:
                for key in h.unread:
                    self._by_key.pop(key, None)
                self._held.remove(h)
            count = sum(len(h.unread) for h in old)
            self.expired_pages += count
        for h in old:
            _release(h.pin)
        return count

    def release_all(self) -> None:
        with self._lock:
            old, self._held = self._held, []
            self._by_key.clear()
        for h in old:
            _release(h.pin)


def _release(pin: Pin) -> None:
    try:
        pin.release()
    except HisparseError as exc:
        # Unreachable daemon: the pins go with the session (bye or lease expiry).
        log.debug("unpin of %d pages failed (%s); they are released with the session", pin.count, exc)
