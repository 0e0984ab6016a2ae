"""One namespace's page index: which key is in which page, in which state.

Everything here is in memory and O(1) per key; every state change is also
written to the ``MetaTable`` (shared memory), which is what a restarted
daemon rebuilds this index from. Session bookkeeping (who holds which
reservation or pin) lives in ``sessions``; this module only counts pins.

Page states: FREE -> WRITING -> COMMITTED -> FREE, plus DOOMED in memory
only: a page ``clear`` dropped while pinned, freed at its last unpin (its
table record is already FREE, so a restart does not bring it back).
"""

from __future__ import annotations

import logging
from array import array

import numpy as np
from dataclasses import dataclass, field

from hisparse.daemon.eviction import StampLRU
from hisparse.protocol import EVENT_COMMIT, EVENT_EVICT, SLOT_BUSY, SLOT_COMMITTED
from hisparse.shm.table import COMMITTED, FREE, WRITING, MetaTable

log = logging.getLogger(__name__)

DOOMED = 3
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

    def since(self, after: int, limit: int) -> tuple[list[tuple[int, bytes, int]], int, bool]:
        """Events after ``after``: (events, seq of the last returned, reset)."""
        self.enabled = True
        if after < self.first_seq - 1 or after > self.last_seq:
            return [], self.last_seq, True
        start = after - self.first_seq + 1
        chunk = self.events[start:start + limit]
        return chunk, after + len(chunk), False


class NamespaceIndex:
    def __init__(self, table: MetaTable) -> None:
        num_pages = table.header.geometry.num_pages
        self.table = table
        self.num_pages = num_pages
        self.keys: dict[bytes, int] = {}  # WRITING and COMMITTED pages
        self.state = bytearray(num_pages)
        self.pins = array("I", bytes(4 * num_pages))
        self.generation = array("I", bytes(4 * num_pages))
        self.lru = StampLRU(num_pages)
        # A stack of free page ids; 4 bytes a page (a list would cost 40).
        self.free = array("i", range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self.num_committed = 0
        self.num_writing = 0
        self.num_pinned_pages = 0
        self.counters = IndexCounters()
        self.events = EventLog()

    # -- adoption --

    def adopt(self) -> tuple[int, int]:
        """Rebuild from the table: COMMITTED pages come back, WRITING ones are freed."""
        committed, writing = self.table.scan()
        for page in writing.tolist():
            self.table.set_state(page, FREE)
        keys = self.table.committed_keys(committed)
        gens = self.table.records["generation"]
        duplicates = 0
        for page, key in zip(committed.tolist(), keys):
            if key in self.keys:  # cannot happen unless the file was edited; keep one copy
                self.table.set_state(page, FREE)
                duplicates += 1
                continue
            self.keys[key] = page
            self.state[page] = COMMITTED
            self.generation[page] = int(gens[page])
            self.lru.release(page)
        self.num_committed = len(self.keys)
        taken = np.zeros(self.num_pages, dtype=bool)
        taken[list(self.keys.values())] = True
        self.free = array("i", np.flatnonzero(~taken)[::-1].astype(np.int32).tobytes())
        return self.num_committed, len(writing) + duplicates

    # -- reads --

    def lookup(self, keys: tuple[bytes, ...]) -> int:
        """Leading committed keys; touches them so a prefix's head outlives its tail."""
        index, state = self.keys, self.state
        hits: list[int] = []
        for key in keys:
            page = index.get(key)
            if page is None or state[page] != COMMITTED:
                break
            hits.append(page)
        hits.reverse()
        self.lru.touch_many(hits)
        c = self.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        c.hit_keys += len(hits)
        return len(hits)

    # -- writes --

    def reserve(self, keys: tuple[bytes, ...], held: dict[bytes, int]) -> tuple[list[int], int]:
        """Slots for ``keys`` (see protocol.SLOT_*) and how many pages were evicted.

        ``held`` is the calling session's reservations (key -> page); new
        ones are added to it. Stops at the first key that finds no room.
        """
        slots: list[int] = []
        evicted = new = 0
        index, state = self.keys, self.state
        for key in keys:
            page = index.get(key)
            if page is not None:
                if state[page] == COMMITTED:
                    self.lru.touch(page)
                    slots.append(SLOT_COMMITTED)
                else:
                    slots.append(page if held.get(key) == page else SLOT_BUSY)
                continue
            if not self.free:
                if not self._evict_one():
                    break
                evicted += 1
            page = self.free.pop()
            gen = self.generation[page] = (self.generation[page] + 1) & 0xFFFFFFFF
            self.table.set_writing(page, key, gen)
            state[page] = WRITING
            index[key] = page
            held[key] = page
            slots.append(page)
            new += 1
        self.num_writing += new
        self.counters.reserved_pages += new
        return slots, evicted

    def commit(self, key: bytes, page: int) -> None:
        self.table.set_state(page, COMMITTED)
        self.state[page] = COMMITTED
        self.lru.release(page)
        self.num_writing -= 1
        self.num_committed += 1
        self.counters.committed_pages += 1
        self.events.append(EVENT_COMMIT, key, page)

    def abort(self, key: bytes, page: int) -> None:
        self.table.set_state(page, FREE)
        self.state[page] = FREE
        del self.keys[key]
        self.free.append(page)
        self.num_writing -= 1
        self.counters.aborted_pages += 1

    def pin(self, keys: tuple[bytes, ...]) -> list[int]:
        """Pin the committed prefix; returns its pages (the caller records the holds)."""
        index, state, pins = self.keys, self.state, self.pins
        pages: list[int] = []
        for key in keys:
            page = index.get(key)
            if page is None or state[page] != COMMITTED:
                break
            pages.append(page)
        self.lru.touch_many(pages[::-1])
        for page in pages:
            if pins[page] == 0:
                self.num_pinned_pages += 1
                self.lru.hold(page)
            pins[page] += 1
        self.counters.pins += len(pages)
        return pages

    def unpin(self, page: int) -> None:
        pins = self.pins
        pins[page] -= 1
        if pins[page] == 0:
            self.num_pinned_pages -= 1
            if self.state[page] == DOOMED:
                self.state[page] = FREE
                self.free.append(page)
            elif self.state[page] == COMMITTED:
                self.lru.release(page)  # in use until now: the most recently used

    def clear(self) -> tuple[int, int]:
        """Drop every committed page: (freed now, doomed until unpinned). WRITING stays."""
        freed = doomed = 0
        for key, page in list(self.keys.items()):
            if self.state[page] != COMMITTED:
                continue
            del self.keys[key]
            self.table.set_state(page, FREE)
            self.lru.hold(page)
            self.events.append(EVENT_EVICT, key, page)
            if self.pins[page]:
                self.state[page] = DOOMED
                doomed += 1
            else:
                self.state[page] = FREE
                self.free.append(page)
                freed += 1
        self.num_committed = 0
        return freed, doomed

    def _evict_one(self) -> bool:
        page = self.lru.pop_victim()
        if page is None:
            return False
        key = self.table.key_of(page)
        del self.keys[key]
        self.table.set_state(page, FREE)
        self.state[page] = FREE
        self.free.append(page)
        self.num_committed -= 1
        self.counters.evicted_pages += 1
        self.events.append(EVENT_EVICT, key, page)
        return True

    # -- mirror resync --

    def committed_page(self, cursor: int, limit: int) -> tuple[list[tuple[bytes, int]], int]:
        """Committed (key, page) with page >= cursor, up to ``limit``; next cursor or -1."""
        out: list[tuple[bytes, int]] = []
        page = cursor
        state = self.state
        while page < self.num_pages and len(out) < limit:
            if state[page] == COMMITTED:
                out.append((self.table.key_of(page), page))
            page += 1
        return out, (page if page < self.num_pages else -1)

    def snapshot(self) -> dict[str, int | float]:
        c = self.counters
        return {
            "num_pages": self.num_pages,
            "committed_pages": self.num_committed,
            "writing_pages": self.num_writing,
            "pinned_pages": self.num_pinned_pages,
            "free_pages": len(self.free),
            "lookups": c.lookups,
            "lookup_keys": c.lookup_keys,
            "hit_keys": c.hit_keys,
            "hit_rate": c.hit_rate(),
            "reserved_pages": c.reserved_pages,
            "committed_total": c.committed_pages,
            "aborted_pages": c.aborted_pages,
            "evicted_pages": c.evicted_pages,
            "pins": c.pins,
        }
