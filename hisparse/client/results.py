"""What ``Client.store`` returns, and its warning when keys find no room.

``StoreResult`` is an ``int``, the pages this call newly wrote (what ``store``
has always returned: ``==``, arithmetic and ``int()`` work as before), that
also says what became of every key:

- ``stored``: newly written and committed by this call (the int value);
- ``present``: already committed (by anyone) when the store reached them, so not
  written again;
- ``not_stored``: not written because the region had no room for them (every
  page is pinned or being written, so nothing could be evicted) or the
  session's reserve quota ran out. ``store`` places keys in order and stops at the first that finds no
  room, so these are the tail of the keys; none of them is committed by this
  call.

``stored + present + not_stored == len(keys)``. ``complete`` is true when no key
was left out (``not_stored == 0``): each was written or found committed. (A
store of more keys than the region holds can evict its own earlier keys to
place later ones, as any store evicts the least recently used pages.)
"""

from __future__ import annotations

import logging
import threading
import time

SHORT_STORE_WARNING_INTERVAL_S = 60.0  # at most one "keys not stored" warning per client per minute


class StoreResult(int):
    """Pages newly written (the int), with ``stored``, ``present`` and ``not_stored`` counts."""

    stored: int
    present: int
    not_stored: int

    def __new__(cls, stored: int, present: int = 0, not_stored: int = 0) -> StoreResult:
        self = super().__new__(cls, stored)
        self.stored, self.present, self.not_stored = int(stored), int(present), int(not_stored)
        return self

    @property
    def complete(self) -> bool:
        """No key was left out for want of room: each was written or found committed."""
        return self.not_stored == 0

    def __getnewargs__(self) -> tuple[int, int, int]:  # type: ignore[override]
        return self.stored, self.present, self.not_stored

    __str__ = int.__repr__  # print(c.store(...)) and f"{n}" show the count, as before

    def __repr__(self) -> str:
        return f"StoreResult(stored={self.stored}, present={self.present}, not_stored={self.not_stored})"


class ShortStoreWarnings:
    """Logs "keys not stored" at the first short store, then at most once per interval.

    A region that is full stays full for a while; an engine storing every step
    would otherwise log every step. Each warning counts what the quiet ones
    in between left out.
    """

    def __init__(self, log: logging.Logger, namespace: str,
                 interval_s: float = SHORT_STORE_WARNING_INTERVAL_S) -> None:
        self._log = log
        self._namespace = namespace
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last_s: float | None = None
        self._quiet_stores = 0
        self._quiet_keys = 0

    def note(self, result: StoreResult, num_pages: int) -> None:
        """Warn about ``result`` if it left keys out, unless a warning went out within the interval."""
        if result.not_stored == 0:
            return
        now = time.monotonic()
        with self._lock:
            if self._last_s is not None and now - self._last_s < self._interval_s:
                self._quiet_stores += 1
                self._quiet_keys += result.not_stored
                return
            quiet_stores, quiet_keys = self._quiet_stores, self._quiet_keys
            self._last_s, self._quiet_stores, self._quiet_keys = now, 0, 0
        since = (f"; since the last warning {quiet_stores} more stores left {quiet_keys} keys out"
                 if quiet_stores else "")
        self._log.warning(
            "store into namespace %r (%d pages): %d of %d keys not stored (%d written, %d already "
            "there): no page left to write or evict, as all are pinned or being written (this "
            "store's own included), or the session's reserve quota is spent; give the namespace "
            "more capacity, release pins or store fewer keys at once (at most one such warning "
            "per %.0f s%s)", self._namespace, num_pages, result.not_stored,
            result.stored + result.present + result.not_stored, result.stored, result.present,
            self._interval_s, since)
