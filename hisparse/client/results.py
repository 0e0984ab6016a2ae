"""What ``Client.store`` returns, and its warning when keys find no room.

``StoreResult`` is an ``int``, the pages this call newly wrote (what ``store``
has always returned: ``==``, arithmetic and ``int()`` work as before), that
also says what became of every key:

- ``stored``: newly written and committed by this call (the int value);
- ``present``: already committed (by anyone) and left as they were;
- ``not_stored``: not written because the region had no room for them (every
  page is pinned or being written, so nothing could be evicted) or the
  session's reserve quota ran out. ``store`` places keys in order and stops at the first that finds no
  room, so these are the tail of the keys; none of them is committed by this
  call.

``stored + present + not_stored == len(keys)``. ``complete`` is true when every
key is committed now (``not_stored == 0``).
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
        """Every key is committed now: written by this call or already there."""
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

    def note(self, result: StoreResult) -> None:
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
            "store into namespace %r: %d of %d keys not stored, no room (the rest: %d written, "
            "%d already there): every page of the region is pinned or being written, or the "
            "session's reserve quota is spent; give the namespace more capacity or release pins "
            "(at most one such warning "
            "per %.0f s%s)", self._namespace, result.not_stored,
            result.stored + result.present + result.not_stored, result.stored, result.present,
            self._interval_s, since)
