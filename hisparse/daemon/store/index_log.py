"""What a namespace's index records besides its pages: counters, and the event log mirrors read."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_EVENTS = 1 << 18  # kept per namespace for mirrors; older ones force a resync


@dataclass
class IndexCounters:
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys: int = 0
    reserved_pages: int = 0
    committed_pages: int = 0
    aborted_pages: int = 0
    evicted_pages: int = 0
    pins: int = 0

    def hit_rate(self) -> float:
        return self.hit_keys / self.lookup_keys if self.lookup_keys else 0.0


@dataclass
class EventLog:
    """Commit/evict events for the mirrors of clients (vLLM's scheduler-side lookup).

    Events are recorded only once some client asked for them, so a
    namespace nobody mirrors pays nothing.
    """

    enabled: bool = False
    first_seq: int = 1  # sequence number of events[0]
    events: list[tuple[int, bytes, int]] = field(default_factory=list)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.events) - 1

    def append(self, kind: int, key: bytes, page: int) -> None:
        if not self.enabled:
            self.first_seq += 1  # keep counting, so cursors from before stay comparable
            return
        self.events.append((kind, key, page))
        if len(self.events) > MAX_EVENTS:
            drop = len(self.events) // 2
            del self.events[:drop]
            self.first_seq += drop

    def forget(self, count: int) -> None:
        """``count`` events happened that are not kept: every mirror resyncs (``reset``)."""
        self.first_seq = self.last_seq + count + 1
        self.events.clear()

    def since(self, after: int, limit: int) -> tuple[list[tuple[int, bytes, int]], int, bool]:
        """Events after ``after``: (events, seq of the last returned, reset)."""
        self.enabled = True
        if after < self.first_seq - 1 or after > self.last_seq:
            return [], self.last_seq, True
        start = after - self.first_seq + 1
        chunk = self.events[start:start + limit]
        return chunk, after + len(chunk), False
