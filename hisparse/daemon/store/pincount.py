"""Pins of a namespace's pages: the part of ``NamespaceIndex`` that counts holds against eviction.

A pinned page is out of the LRU until its last unpin; a DOOMED page (one
``clear`` dropped while pinned) is freed then. The daemon's own reads (the
cluster tier copying a page out) hold a page the same way, and give its LRU
stamp back after, so such a read does not make the page look recently used.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from hisparse.daemon.store.index_log import IndexCounters
from hisparse.shm.table import COMMITTED, FREE

if TYPE_CHECKING:
    from hisparse.daemon.store.eviction import StampLRU

DOOMED = 3  # a page ``clear`` dropped while pinned: freed at its last unpin


class PinCounts:
    """Mixed into ``NamespaceIndex``, whose state (pins, state, lru, free, keys) and
    ``_committed_prefix`` it uses."""

    pins: array
    state: bytearray
    lru: StampLRU
    free: array
    keys: dict[bytes, int]
    num_pinned_pages: int
    counters: IndexCounters

    def pin(self, keys: tuple[bytes, ...]) -> list[int]:
        """Pin the committed prefix; returns its pages (the caller records the holds)."""
        pages = self._committed_prefix(keys)
        self.pin_pages(pages)
        return pages

    def pin_pages(self, pages: list[int]) -> None:
        """Pin pages a ``committed_prefix_pages`` just found (the chain's head is touched last)."""
        self.lru.touch_many(pages[::-1])
        for page in pages:
            self._pin_page(page)
        self.counters.pins += len(pages)

    def _pin_page(self, page: int) -> None:
        if self.pins[page] == 0:
            self.num_pinned_pages += 1
            self.lru.hold(page)
        self.pins[page] += 1

    def unpin(self, page: int) -> None:
        pins = self.pins
        assert pins[page] > 0, f"page {page} is not pinned"
        pins[page] -= 1
        if pins[page] == 0:
            self.num_pinned_pages -= 1
            if self.state[page] == DOOMED:
                self.state[page] = FREE
                self.free.append(page)
            elif self.state[page] == COMMITTED:
                self.lru.release(page)  # in use until now: the most recently used

    def unpin_many(self, pages: list[int], counts: list[int]) -> None:
        """``unpin`` each of ``pages`` (distinct) ``counts`` times: vectorised, for a session
        ending with millions of pins (a ``bye`` of 4M pins takes milliseconds, not seconds)."""
        if len(pages) < 1024:
            for page, count in zip(pages, counts):
                for _ in range(count):
                    self.unpin(page)
            return
        p = np.asarray(pages, dtype=np.int64)
        c = np.asarray(counts, dtype=np.uint32)
        pins = np.frombuffer(self.pins, dtype=np.uint32)
        assert (pins[p] >= c).all(), "unpinning pages that are not pinned that often"
        pins[p] -= c
        zero = p[pins[p] == 0]
        self.num_pinned_pages -= len(zero)
        states = np.frombuffer(self.state, dtype=np.uint8)
        now = states[zero]
        doomed = zero[now == DOOMED]
        states[doomed] = FREE
        self.free.frombytes(doomed.astype(np.int32).tobytes())
        self.lru.release_many(zero[now == COMMITTED])

    def hold_committed(self, key: bytes, page: int) -> int | None:
        """Pin ``page`` for the daemon's own read (the cluster tier copying it out).

        None when ``key`` is no longer committed in ``page`` (evicted, reused).
        Returns the page's LRU stamp, which ``end_hold`` puts back: a page
        read for the cluster keeps its place in the eviction order.
        """
        if self.keys.get(key) != page or self.state[page] != COMMITTED:
            return None
        stamp = self.lru.stamps[page]
        if self.pins[page] == 0:
            self.num_pinned_pages += 1
            self.lru.hold(page)
        self.pins[page] += 1
        return stamp

    def end_hold(self, page: int, stamp: int) -> None:
        if self.pins[page] == 1 and self.state[page] == COMMITTED and not self.lru.is_held_stamp(stamp):
            self.pins[page] = 0
            self.num_pinned_pages -= 1
            self.lru.restore(page, stamp)
            return
        self.unpin(page)
