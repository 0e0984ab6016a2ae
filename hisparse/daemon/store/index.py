"""One namespace's page index: which key is in which page, in which state.

Everything here is in memory and O(1) per key; every state change is also
written to the ``MetaTable`` (shared memory), which is what a restarted
daemon rebuilds this index from. Session bookkeeping (who holds which
reservation or pin) lives in ``sessions``; this module only counts pins.

Page states: FREE -> WRITING -> COMMITTED -> FREE, plus two in memory only
(their table record is already FREE): DOOMED, a page ``clear`` dropped while
pinned, freed at its last unpin; FENCED, a page an ended session had
reserved, freed only once no process can still be writing into it (its
fence, ``sessions.Zombie``). A restarted daemon re-fences FENCED pages from
the fence files, not from the table.
"""

from __future__ import annotations

import logging
from array import array

import numpy as np

from hisparse.daemon.store.eviction import StampLRU
from hisparse.daemon.store.index_log import EventLog, IndexCounters
from hisparse.daemon.store.pincount import DOOMED, PinCounts
from hisparse.protocol import EVENT_COMMIT, EVENT_EVICT, SLOT_BUSY, SLOT_COMMITTED
from hisparse.shm.table import COMMITTED, FREE, WRITING, MetaTable

log = logging.getLogger(__name__)

FENCED = 4  # an ended session's reservation: not reused while its process may write
SCAN_WINDOW_PAGES = 1 << 20  # pages a `keys` call looks at, at most


class NamespaceIndex(PinCounts):
    def __init__(self, table: MetaTable) -> None:
        num_pages = table.header.geometry.num_pages
        self.table = table
        self.num_pages = num_pages
        self.keys: dict[bytes, int] = {}  # WRITING and COMMITTED pages
        # page -> its key (the dict's own key object, so 8 bytes a page). A
        # request's keys usually sit in neighbouring pages, and following
        # them here reads memory in order where a dict probe is a cache miss.
        self.page_keys: list[bytes | None] = [None] * num_pages
        self.state = bytearray(num_pages)
        self.pins = array("I", bytes(4 * num_pages))
        self.lru = StampLRU(num_pages)
        # A stack of free page ids; 4 bytes a page (a list would cost 40).
        self.free = array("i", range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self.num_committed = 0
        self.num_writing = 0
        self.num_pinned_pages = 0
        self.num_fenced = 0
        self.counters = IndexCounters()
        self.events = EventLog()
        # WRITING pages reserved before the last clear: a clear is a barrier, so their
        # commit aborts them instead (their bytes predate it). A publish is exempt: the
        # HiSparse pool reserves pages long before it writes them.
        self.cleared_writes: set[int] = set()

    # -- adoption --

    def adopt(self, chunk_pages: int = 1 << 20) -> tuple[int, int]:
        """Rebuild from the table: COMMITTED pages come back, WRITING ones are freed."""
        committed, writing = self.table.scan()
        self.table.records["state"][writing] = FREE
        duplicates = 0
        for start in range(0, len(committed), chunk_pages):
            pages = committed[start:start + chunk_pages]
            keys = self.table.committed_keys(pages)
            before = len(self.keys)
            self.keys.update(zip(keys, pages.tolist()))
            if len(self.keys) - before != len(keys):  # only a hand-edited table repeats a key
                duplicates += self._drop_duplicates(keys, pages)
        live = np.fromiter(self.keys.values(), dtype=np.int64, count=len(self.keys))
        live.sort()
        for key, page in self.keys.items():
            self.page_keys[page] = key
        np.frombuffer(self.state, dtype=np.uint8)[live] = COMMITTED
        self.lru.release_many(live)
        self.num_committed = len(live)
        taken = np.zeros(self.num_pages, dtype=bool)
        taken[live] = True
        self.free = array("i", np.flatnonzero(~taken)[::-1].astype(np.int32).tobytes())
        return self.num_committed, len(writing) + duplicates

    def _drop_duplicates(self, keys: list[bytes], pages: np.ndarray) -> int:
        dropped = 0
        for key, page in zip(keys, pages.tolist()):
            if self.keys.get(key) != page:
                self.table.set_state(page, FREE)
                dropped += 1
        return dropped

    # -- reads --

    def _committed_prefix(self, keys: tuple[bytes, ...]) -> list[int]:
        """Pages of the leading committed keys."""
        first = self._committed_run(keys)
        if first >= 0:
            return list(range(first, first + len(keys)))
        return self._walk_prefix(keys)

    def _walk_prefix(self, keys: tuple[bytes, ...]) -> list[int]:
        """``_committed_prefix`` key by key: any order of pages, a prefix cut anywhere."""
        index, state, page_keys = self.keys, self.state, self.page_keys
        last = self.num_pages - 1
        pages: list[int] = []
        page = -1
        for key in keys:
            # The neighbours of the previous key's page first (a chain stored
            # at once gets ascending pages; one stored over evicted pages,
            # descending ones), then the dict.
            if 0 <= page < last and page_keys[page + 1] == key:
                page += 1
            elif page > 0 and page_keys[page - 1] == key:
                page -= 1
            else:
                found = index.get(key)
                if found is None:
                    break
                page = found
            if state[page] != COMMITTED:
                break
            pages.append(page)
        return pages

    def _committed_run(self, keys: tuple[bytes, ...]) -> int:
        """The first page when every key is committed in consecutive ascending pages (a
        chain stored at once: what ``_committed_prefix`` finds then), else -1. Checked
        with slice compares, no loop."""
        n = len(keys)
        if not n:
            return -1
        first = self.keys.get(keys[0])
        if first is None:
            return -1
        end = first + n
        if end > self.num_pages or self.state.count(COMMITTED, first, end) != n:
            return -1
        return first if self.page_keys[first:end] == list(keys) else -1

    def committed_prefix_pages(self, keys: tuple[bytes, ...]) -> list[int]:
        """Pages of the leading committed keys, touching nothing (a quota check before a pin)."""
        return self._committed_prefix(keys)

    def lookup(self, keys: tuple[bytes, ...]) -> int:
        """Leading committed keys; touches them so a prefix's head outlives its tail."""
        first = self._committed_run(keys)
        if first >= 0:
            found = len(keys)
            self.lru.touch_run(first, found)
        else:
            hits = self._walk_prefix(keys)
            hits.reverse()
            self.lru.touch_many(hits)
            found = len(hits)
        self.count_lookup(len(keys), found)
        return found

    def count_lookup(self, keys: int, hits: int) -> None:
        """One lookup of ``keys`` keys, ``hits`` of them committed (also a mirror's, reported by pin)."""
        c = self.counters
        c.lookups += 1
        c.lookup_keys += keys
        c.hit_keys += hits

    # -- writes --

    def reserve(self, keys: tuple[bytes, ...], held: dict[bytes, int],
                max_new: int | None = None) -> tuple[list[int], list[bytes]]:
        """Slots for ``keys`` (see protocol.SLOT_*) and the keys evicted to make room.

        ``held`` is the calling session's reservations (key -> page); new
        ones are added to it. A key already WRITING is BUSY for everyone,
        its own session included. Stops at the first key that finds no room,
        or that would take more than ``max_new`` pages (the session's quota).
        """
        slots: list[int] = []
        evicted: list[bytes] = []
        new = 0
        index, state = self.keys, self.state
        for key in keys:
            page = index.get(key)
            if page is not None:
                if state[page] == COMMITTED:
                    self.lru.touch(page)
                    slots.append(SLOT_COMMITTED)
                else:
                    # Being written, even by this very session (another thread of
                    # one client): one reservation has exactly one writer.
                    slots.append(SLOT_BUSY)
                continue
            if max_new is not None and new >= max_new:
                break
            if not self.free:
                victim = self._evict_one()
                if victim is None:
                    break
                evicted.append(victim)
            page = self.free.pop()
            self.table.set_writing(page, key, self.table.generation_of(page) + 1)
            state[page] = WRITING
            index[key] = page
            self.page_keys[page] = key
            held[key] = page
            slots.append(page)
            new += 1
        self.num_writing += new
        self.counters.reserved_pages += new
        return slots, evicted

    def rename(self, key: bytes, new_key: bytes, page: int) -> None:
        """A WRITING page's key becomes ``new_key`` (which nobody holds); the table follows."""
        if new_key == key:
            return
        del self.keys[key]
        self.keys[new_key] = page
        self.page_keys[page] = new_key
        self.table.set_writing(page, new_key, self.table.generation_of(page))

    def commit(self, key: bytes, page: int) -> None:
        self.cleared_writes.discard(page)
        self.table.set_state(page, COMMITTED)
        self.state[page] = COMMITTED
        self.lru.release(page)
        self.num_writing -= 1
        self.num_committed += 1
        self.counters.committed_pages += 1
        self.events.append(EVENT_COMMIT, key, page)

    def abort(self, key: bytes, page: int, fenced: bool = False) -> None:
        """WRITING -> FREE, never visible; ``fenced``: FENCED until ``release_fenced``."""
        self.cleared_writes.discard(page)
        self.table.set_state(page, FREE)
        del self.keys[key]
        self.page_keys[page] = None
        if fenced:
            self.state[page] = FENCED
            self.num_fenced += 1
        else:
            self.state[page] = FREE
            self.free.append(page)
        self.num_writing -= 1
        self.counters.aborted_pages += 1

    def release_fenced(self, page: int) -> None:
        """FENCED -> FREE: no process can write into the page any more."""
        assert self.state[page] == FENCED, f"page {page} is not fenced"
        self.state[page] = FREE
        self.free.append(page)
        self.num_fenced -= 1

    def adopt_fence(self, pages: list[int], reserved: list[bool],
                    pins: list[int]) -> tuple[list[int], dict[int, int]]:
        """After a restart: hold the pages an earlier session's fence names.

        A committed page is pinned for the fence (a commit whose hold was not
        yet cleared counts as one pin); any other page is FENCED, taken off
        the free list. Returns (fenced pages, pins taken by page).
        """
        fenced: list[int] = []
        pinned: dict[int, int] = {}
        for page, was_reserved, count in zip(pages, reserved, pins):
            if not 0 <= page < self.num_pages:
                continue
            if self.state[page] == COMMITTED:
                n = count + (1 if was_reserved and not count else 0)
                for _ in range(n):
                    self._pin_page(page)
                pinned[page] = n
            elif self.state[page] == FREE:
                self.state[page] = FENCED
                self.num_fenced += 1
                fenced.append(page)
        if fenced:  # off the free stack, order kept (vectorised: adoption of millions of pages)
            free = np.frombuffer(self.free, dtype=np.int32)
            self.free = array("i", free[~np.isin(free, fenced)].tobytes())
        return fenced, pinned

    def clear(self) -> tuple[int, int]:
        """Drop every committed page: (freed now, doomed until unpinned). WRITING stays
        reserved, but is never committed (``cleared_writes``): nothing written before a
        clear is visible after it.

        Vectorised over the region: no per-page event (mirrors are told to
        resync instead), so 4M pages take well under a second, not tens.
        """
        states = np.frombuffer(self.state, dtype=np.uint8)
        self.cleared_writes.update(np.flatnonzero(states == WRITING).tolist())
        committed = np.flatnonzero(states == COMMITTED)
        if not len(committed):
            return 0, 0
        pinned = np.frombuffer(self.pins, dtype=np.uint32)[committed] != 0
        doomed, freed = committed[pinned], committed[~pinned]
        self.table.records["state"][committed] = FREE
        self.lru.hold_many(committed)
        states[doomed] = DOOMED
        states[freed] = FREE
        page_keys = self.page_keys
        if 2 * len(committed) > len(self.keys):
            self.keys = {key: page for key, page in self.keys.items() if states[page] == WRITING}
        else:
            for page in committed.tolist():
                del self.keys[page_keys[page]]
        for page in committed.tolist():
            page_keys[page] = None
        self.free.frombytes(freed[::-1].astype(np.int32).tobytes())
        self.events.forget(len(committed))
        self.num_committed = 0
        return len(freed), len(doomed)

    def _evict_one(self) -> bytes | None:
        """Free the least recently used unpinned page; its key, or None when none may go."""
        page = self.lru.pop_victim()
        if page is None:
            return None
        key = self.page_keys[page]
        assert key is not None, f"victim page {page} has no key"
        del self.keys[key]
        self.page_keys[page] = None
        self.table.set_state(page, FREE)
        self.state[page] = FREE
        self.free.append(page)
        self.num_committed -= 1
        self.counters.evicted_pages += 1
        self.events.append(EVENT_EVICT, key, page)
        return key

    # -- mirror resync --

    def committed_page(self, cursor: int, limit: int) -> tuple[list[tuple[bytes, int]], int]:
        """Committed (key, page) with page >= cursor, up to ``limit``; next cursor or -1.

        Looks at most ``SCAN_WINDOW_PAGES`` pages per call (one vectorised
        compare), so a call costs O(window + answer), never O(region): a
        sparse region answers with fewer keys and a cursor to go on from.
        """
        if cursor >= self.num_pages:
            return [], -1
        end = min(self.num_pages, cursor + SCAN_WINDOW_PAGES)
        states = np.frombuffer(self.state, dtype=np.uint8, count=end - cursor, offset=cursor)
        found = np.flatnonzero(states == COMMITTED)[:limit]
        page_keys = self.page_keys
        out = [(page_keys[page], page) for page in (found + cursor).tolist()]
        if len(found) == limit:
            nxt = cursor + int(found[-1]) + 1
        else:
            nxt = end
        return out, (nxt if nxt < self.num_pages else -1)

    def snapshot(self) -> dict[str, int | float]:
        c = self.counters
        return {
            "num_pages": self.num_pages,
            "committed_pages": self.num_committed,
            "writing_pages": self.num_writing,
            "pinned_pages": self.num_pinned_pages,
            "free_pages": len(self.free),
            "fenced_pages": self.num_fenced,
            "lookups": c.lookups,
            "lookup_keys": c.lookup_keys,
            "hit_keys": c.hit_keys,
            "hit_rate": c.hit_rate(),
            "reserved_total": c.reserved_pages,  # a running total, as committed_total; not pages reserved now
            "committed_total": c.committed_pages,
            "aborted_pages": c.aborted_pages,
            "evicted_pages": c.evicted_pages,
            "pins": c.pins,
        }
