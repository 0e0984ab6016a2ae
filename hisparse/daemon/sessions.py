"""Sessions and their leases: who holds which reservation and which pin.

A session is opened by ``hello`` and lives while it is heard from: any
request renews its lease. One silent for ``lease_ttl`` is expired: its
reservations are aborted (never visible) and its pins released. The daemon
never waits on a client; the reaper runs on a timer.

Session ids are random 62-bit numbers, so an id from an earlier daemon run
(or a guess) is simply unknown.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from hisparse.daemon.namespaces import Namespace

log = logging.getLogger(__name__)

# How long an expired session's reserved pages wait before reuse. Its process
# may be stalled, not dead; the client never starts a copy into a reservation
# older than half the lease, so a stale write needs a stall of half a lease plus
# this in mid-copy. Short enough that a dead client's pages are free again well
# within lease_ttl + 1 s (the reaper runs every 0.2 s at most).
QUARANTINE_S = 0.4


@dataclass
class Session:
    id: int
    namespace: Namespace | None  # None: an admin session (hisparsectl)
    client: str
    opened_s: float
    last_seen_s: float
    reservations: dict[bytes, int] = field(default_factory=dict)  # key -> page, WRITING
    pins: dict[bytes, list[int]] = field(default_factory=dict)  # key -> [page, count]

    def describe(self) -> str:
        ns = self.namespace.name if self.namespace else "(admin)"
        return f"session {self.id:#x} [{self.client or 'anonymous'}] on {ns}"

    def release_all(self, quarantine_until: float | None = None) -> tuple[int, int]:
        """Abort every reservation and drop every pin: (aborted pages, pins released).

        ``quarantine_until``: the reserved pages wait until then before reuse
        (an expired session's process may still be writing into them).
        """
        if self.namespace is None:
            return 0, 0
        index = self.namespace.index
        aborted = len(self.reservations)
        for key, page in self.reservations.items():
            index.abort(key, page, quarantine_until)
        self.reservations.clear()
        released = 0
        for page, count in self.pins.values():
            for _ in range(count):
                index.unpin(page)
            released += count
        self.pins.clear()
        return aborted, released


class SessionTable:
    def __init__(self, lease_ttl_s: float, clock=time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self.sessions: dict[int, Session] = {}
        self.expired_total = 0

    def open(self, namespace: Namespace | None, client: str) -> Session:
        now = self._clock()
        sid = secrets.randbits(62)
        while sid in self.sessions or sid == 0:
            sid = secrets.randbits(62)
        session = Session(sid, namespace, client, now, now)
        self.sessions[sid] = session
        return session

    def get(self, sid: int) -> Session | None:
        """The live session with this id, its lease renewed; None when unknown."""
        session = self.sessions.get(sid)
        if session is not None:
            session.last_seen_s = self._clock()
        return session

    def close(self, session: Session, quarantine_until: float | None = None) -> tuple[int, int]:
        self.sessions.pop(session.id, None)
        return session.release_all(quarantine_until)

    def expire(self) -> list[tuple[Session, int, int]]:
        """Expire every session silent for the lease ttl: [(session, aborted, released)]."""
        now = self._clock()
        deadline = now - self.lease_ttl_s
        out = []
        for session in [s for s in self.sessions.values() if s.last_seen_s < deadline]:
            aborted, released = self.close(session, quarantine_until=now + QUARANTINE_S)
            self.expired_total += 1
            out.append((session, aborted, released))
        return out

    def now(self) -> float:
        return self._clock()

    def count_for(self, namespace: Namespace) -> int:
        return sum(1 for s in self.sessions.values() if s.namespace is namespace)
