"""Least-recently-used eviction over one region's pages: pure, no I/O.

An exact LRU that costs one array store per touch and about 21 bytes per
page, where an ``OrderedDict`` costs ~100 bytes and a linked list re-links
on every hit. Pages wait in a FIFO ring, each with the stamp it was queued
at. A touch only writes the page's last-used stamp. When the page reaches
the head of the ring, it is the least recently used page if and only if it
was not used since it was queued; otherwise it is queued again at its
last-used stamp. Every page behind the head was queued later, so no page
left in the ring was used before the head: the victim is exact, and each
touch costs at most one re-queue, later.

The owner says which pages may go (``evictable``): pinned pages are
requeued as if just used, freed ones are dropped.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

_KEEP = 0  # evictable() verdicts
_DROP = 1  # not in the cache any more: forget it
_BUSY = 2  # in use (pinned): treat as just used


class LazyLRU:
    KEEP = _KEEP
    DROP = _DROP
    BUSY = _BUSY

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.clock = 1
        self._used = array("Q", bytes(8 * num_pages))
        self._queued_at = array("Q", bytes(8 * num_pages))
        self._in_ring = bytearray(num_pages)
        self._ring = array("i", bytes(4 * num_pages))
        self._head = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def insert(self, page: int) -> None:
        """``page`` joins the cache now (a commit): most recently used."""
        now = self.clock
        self.clock = now + 1
        self._used[page] = now
        if not self._in_ring[page]:
            self._push(page, now)

    def touch(self, page: int) -> None:
        now = self.clock
        self.clock = now + 1
        self._used[page] = now

    def touch_many(self, pages: list[int]) -> None:
        """Touch in order: the last page is the most recent."""
        used = self._used
        now = self.clock
        for page in pages:
            used[page] = now
            now += 1
        self.clock = now

    def last_used(self, page: int) -> int:
        return self._used[page]

    def pop_victim(self, verdict: Callable[[int], int]) -> int | None:
        """The least recently used page that ``verdict`` lets go, removed; None if none.

        ``verdict(page)`` answers KEEP (may be evicted), DROP (no longer
        cached) or BUSY (pinned). Each queued page is looked at most twice,
        so a region full of pinned pages answers None in bounded time.
        """
        budget = 2 * self._count + 1
        while self._count and budget:
            budget -= 1
            page = self._pop()
            v = verdict(page)
            if v == _DROP:
                continue
            if v == _BUSY:
                self.touch(page)
                self._push(page, self._used[page])
                continue
            if self._used[page] > self._queued_at[page]:
                self._push(page, self._used[page])
                continue
            return page
        return None

    def _push(self, page: int, stamp: int) -> None:
        self._queued_at[page] = stamp
        self._in_ring[page] = 1
        self._ring[(self._head + self._count) % self.num_pages] = page
        self._count += 1

    def _pop(self) -> int:
        page = self._ring[self._head]
        self._head = (self._head + 1) % self.num_pages
        self._count -= 1
        self._in_ring[page] = 0
        return page

    @staticmethod
    def bytes_per_page() -> int:
        return 8 + 8 + 1 + 4
