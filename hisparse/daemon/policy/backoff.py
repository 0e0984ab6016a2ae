"""Who sits out a backoff after sending large frames the daemon refused: a process, then its uid.

A sender refused a large frame (past ``max_request_bytes_in_flight``) or
caught sending one that is no request at all is shed, and for a backoff its
new connections are shed as they are accepted, before libzmq reads their
frames into memory: reconnecting buys it no room (``LARGE_BACKOFF_S``,
doubling while it keeps at it, at most ``LARGE_BACKOFF_MAX_S``).

The backoff is the sending **process's** (uid and pid, from the kernel:
``SO_PEERCRED``), not its uid's: on the most common node one service user runs
every engine, and a uid-wide backoff made one buggy process lock every other
engine of that user out, a restarting one and ``hisparsectl ping`` included
(a flood then cost more than the flooder). A tenant that forks to dodge it
meets the uid's turn: once ``UID_PROCESSES`` processes of one uid are backing
off at once, the whole uid does, until they are all done.
"""

from __future__ import annotations

import time

LARGE_BACKOFF_S = 1.0  # a process refused large frames has its new connections shed this long,
LARGE_BACKOFF_MAX_S = 2.0  # doubling while it keeps trying, up to this: short, since a client's
# calls wait it out (it resends on reconnect)
UID_PROCESSES = 4  # processes of one uid backing off at once: then the whole uid does
MAX_ENTRIES = 4096  # entries kept before expired ones are swept (a forking flooder makes many)

Process = tuple[int | None, int | None]  # (uid, pid), as the kernel names a peer


class Backoffs:
    def __init__(self) -> None:
        self.entries: dict[Process, tuple[float, float]] = {}  # (uid, pid) -> (until, length)

    def start(self, uid: int | None, pid: int | None) -> float:
        """Start (or lengthen) the backoff of process ``pid`` of ``uid``; its length in seconds."""
        now = time.monotonic()
        if len(self.entries) >= MAX_ENTRIES:
            self._sweep(now)
        until, length = self.entries.get((uid, pid), (0.0, 0.0))
        length = min(LARGE_BACKOFF_MAX_S, 2 * length) if now < until + LARGE_BACKOFF_MAX_S else 0.0
        length = max(length, LARGE_BACKOFF_S)
        self.entries[(uid, pid)] = (now + length, length)
        return length

    def holds(self, uid: int | None, pid: int | None) -> bool:
        """Whether a new connection of process ``pid`` of ``uid`` is shed: that process backs off,
        or ``UID_PROCESSES`` of its uid's do."""
        now = time.monotonic()
        entry = self.entries.get((uid, pid))
        if entry is not None and entry[0] > now:
            return True
        if entry is not None and entry[0] + LARGE_BACKOFF_MAX_S < now:
            del self.entries[(uid, pid)]  # long over: forgotten
        return self.uid_wide(uid)

    def uid_wide(self, uid: int | None) -> bool:
        """Whether every process of ``uid`` backs off: ``UID_PROCESSES`` of them do."""
        if uid is None or len(self.entries) < UID_PROCESSES:
            return False
        now = time.monotonic()
        return sum(1 for (u, _), (until, _) in self.entries.items() if u == uid and until > now) >= UID_PROCESSES

    def _sweep(self, now: float) -> None:
        for key in [k for k, (until, _) in self.entries.items() if until + LARGE_BACKOFF_MAX_S < now]:
            del self.entries[key]
