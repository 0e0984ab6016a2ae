"""Least-recently-used eviction over one region's pages: pure, no I/O.

An exact LRU at 8 bytes per page whose touch is one array store: a linked
list (or ``OrderedDict``) re-links on every hit and costs ~100 bytes a page.

Each page has a last-use stamp from a monotonic clock; pages that may not be
evicted (free, being written, pinned) hold ``HELD``, above every stamp.
Victims come from a batch of the oldest stamps, found with one vectorised
``argpartition`` and sorted. A batch entry is still valid when its page's
stamp is unchanged. The first valid entry is exactly the LRU page: when the
batch was taken, every page outside it was at least as recent as every page
in it, and since then stamps have only moved to the clock's present, newer
than anything in the batch, so no page outside it can be older than a valid
entry. When the batch runs out,
a new one is taken: amortised O(N / batch) per eviction.

A lookup's run of pages (a chain stored at once) is touched late: noted, and
written with the other runs noted in a few numpy calls before any stamp is
read or written (``flush``), so every answer is the one touching at once
would give.
"""

from __future__ import annotations

import bisect
from array import array

import numpy as np

HELD = (1 << 64) - 1
RUN_MAX = 4096  # longest run ``flush`` finds its offsets ready for (a longer one makes them)
MAX_RUNS = 256  # touch_run's runs noted before they are written ...
MAX_RUN_PAGES = 8192  # ... or their pages: a flush's arrays stay small (a long run is written at once)
MIN_BATCH = 1024
BATCH_FRACTION = 512  # batch = max(MIN_BATCH, N / BATCH_FRACTION)


class StampLRU:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.clock = 1
        self._stamps = array("Q", [HELD]) * num_pages
        self._view = np.frombuffer(self._stamps, dtype=np.uint64)
        self._runs: list[tuple[int, int, int]] = []  # touch_run's, not yet written: (first, n, clock)
        self._run_pages = 0  # pages in them
        self._desc = np.arange(RUN_MAX - 1, -1, -1, dtype=np.uint64)  # RUN_MAX-1 .. 0
        self._batch = max(MIN_BATCH, num_pages // BATCH_FRACTION)
        self._cand: list[int] = []
        self._cand_stamps: list[int] = []
        self._pos = 0
        # Pages not HELD: with none, pop_victim answers at once instead of
        # scanning the region (a reserve on a full, all-pinned region).
        self.evictable = 0

    def release(self, page: int) -> None:
        """``page`` may be evicted from now on, as the most recently used (commit, last unpin)."""
        if self._runs:
            self.flush()
        if self._stamps[page] == HELD:
            self.evictable += 1
        self._stamps[page] = self.clock
        self.clock += 1

    def release_many(self, pages: np.ndarray) -> None:
        """``release`` each page, in order (adoption)."""
        if self._runs:
            self.flush()
        n = len(pages)
        self.evictable += int(np.count_nonzero(self._view[pages] == HELD))
        self._view[pages] = np.arange(self.clock, self.clock + n, dtype=np.uint64)
        self.clock += n

    def hold(self, page: int) -> None:
        """``page`` may not be evicted (freed, pinned)."""
        if self._runs:
            self.flush()
        if self._stamps[page] != HELD:
            self.evictable -= 1
        self._stamps[page] = HELD

    def hold_many(self, pages: np.ndarray) -> None:
        """``hold`` each page (vectorised)."""
        if self._runs:
            self.flush()
        self.evictable -= int(np.count_nonzero(self._view[pages] != HELD))
        self._view[pages] = HELD

    def is_held(self, page: int) -> bool:
        if self._runs:
            self.flush()
        return self._stamps[page] == HELD

    def restore(self, page: int, stamp: int) -> None:
        """Release ``page`` at an earlier stamp (``hold`` for a read that must not reorder it).

        A stamp older than the current victim batch's newest goes into the batch,
        in order, so the first valid entry is still exactly the LRU page.
        """
        if self._runs:
            self.flush()
        if stamp == HELD:
            return
        if self._stamps[page] == HELD:
            self.evictable += 1
        self._stamps[page] = stamp
        cand_stamps = self._cand_stamps
        if self._pos < len(cand_stamps) and stamp < cand_stamps[-1]:
            at = bisect.bisect_left(cand_stamps, stamp, self._pos)
            cand_stamps.insert(at, stamp)
            self._cand.insert(at, page)

    @staticmethod
    def is_held_stamp(stamp: int) -> bool:
        return stamp == HELD

    def peek_victims(self, limit: int) -> list[int]:
        """Up to ``limit`` of the next victims, least recently used first, without taking them."""
        if self._runs:
            self.flush()
        out: list[int] = []
        stamps, cand, cand_stamps = self._stamps, self._cand, self._cand_stamps
        for pos in range(self._pos, len(cand)):
            if stamps[cand[pos]] == cand_stamps[pos]:
                out.append(cand[pos])
                if len(out) >= limit:
                    break
        if not out and self._refill():
            return self.peek_victims(limit) if self._cand else []
        return out

    def touch(self, page: int) -> None:
        if self._runs:
            self.flush()
        stamps = self._stamps
        if stamps[page] != HELD:
            stamps[page] = self.clock
            self.clock += 1

    def touch_many(self, pages: list[int]) -> None:
        """Touch in order: the last page ends up the most recent."""
        if self._runs:
            self.flush()
        stamps = self._stamps
        now = self.clock
        for page in pages:
            if stamps[page] != HELD:
                stamps[page] = now
                now += 1
        self.clock = now

    def touch_run(self, first: int, n: int) -> None:
        """``touch_many(range(first + n - 1, first - 1, -1))``: a chain stored at once, its
        head touched last; the run lies within the region.

        Deferred: the run and its clock are noted, and written with the others noted
        (``flush``) before anything reads or writes a stamp, or when ``MAX_RUNS``
        (or ``MAX_RUN_PAGES`` pages) wait. What any reader sees is exactly what touching now would have left:
        each page not held gets a stamp from the clock's present (its run's, the
        head newest), and a held page stays held (``HELD`` is the largest stamp,
        and every other is below the clock, so the element-wise maximum picks
        exactly these; a page in several runs keeps the latest, the largest).
        A lookup's touch is then a list append: written at once, its numpy calls
        cost a busy loop several times their warm cost, the largest share of a lookup.
        """
        self._runs.append((first, n, self.clock))
        self.clock += n
        self._run_pages += n
        if len(self._runs) >= MAX_RUNS or self._run_pages >= MAX_RUN_PAGES:
            self.flush()

    def flush(self) -> None:
        """Write the stamps of the runs ``touch_run`` noted: a few numpy calls for them all."""
        runs, self._runs, self._run_pages = self._runs, [], 0
        if len(runs) == 1:
            first, n, clock = runs[0]
            desc = self._desc[RUN_MAX - n:] if n <= RUN_MAX else np.arange(n - 1, -1, -1, dtype=np.uint64)
            run = self._view[first:first + n]
            np.maximum(run, desc + np.uint64(clock), out=run)
            return
        firsts, lengths, clocks = (np.array(column, dtype=np.int64) for column in zip(*runs))
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        within = np.arange(len(starts), dtype=np.int64) - starts  # 0 at each run's head
        pages = np.repeat(firsts, lengths) + within
        stamps = (np.repeat(clocks + lengths - 1, lengths) - within).astype(np.uint64)
        np.maximum.at(self._view, pages, stamps)

    @property
    def stamps(self) -> array:
        """Every page's stamp (``HELD`` or a clock value), the deferred touches written."""
        if self._runs:
            self.flush()
        return self._stamps

    def pop_victim(self) -> int | None:
        """The least recently used evictable page, now held; None when none is evictable."""
        if self._runs:
            self.flush()
        if self.evictable <= 0:
            return None
        stamps = self._stamps
        while True:
            cand, cand_stamps = self._cand, self._cand_stamps
            pos = self._pos
            while pos < len(cand):
                page = cand[pos]
                pos += 1
                if stamps[page] == cand_stamps[pos - 1]:
                    self._pos = pos
                    stamps[page] = HELD
                    self.evictable -= 1
                    return page
            self._pos = pos
            if not self._refill():
                return None

    def _refill(self) -> bool:
        view = self._view
        m = min(self._batch, self.num_pages)
        idx = np.argpartition(view, m - 1)[:m] if m < self.num_pages else np.arange(self.num_pages)
        st = view[idx]
        live = st != HELD
        idx, st = idx[live], st[live]
        order = np.argsort(st, kind="stable")
        self._cand = idx[order].tolist()
        self._cand_stamps = st[order].tolist()
        self._pos = 0
        return bool(self._cand)

    @staticmethod
    def bytes_per_page() -> int:
        return 8
