"""StampLRU against a plain OrderedDict LRU: the same victims for any history."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.daemon.store import eviction
from hisparse.daemon.store.eviction import StampLRU


def test_victim_is_least_recently_used():
    lru = StampLRU(4)
    for page in (0, 1, 2, 3):
        lru.release(page)
    lru.touch(0)  # 1 is now the oldest
    assert [lru.pop_victim() for _ in range(5)] == [1, 2, 3, 0, None]


def test_held_pages_are_never_victims():
    lru = StampLRU(3)
    for page in (0, 1, 2):
        lru.release(page)
    lru.hold(0)  # pinned
    assert lru.pop_victim() == 1
    lru.touch(0)  # a touch must not make a held page evictable
    assert lru.is_held(0)
    assert lru.pop_victim() == 2
    assert lru.pop_victim() is None


def test_touch_many_orders_last_as_most_recent():
    lru = StampLRU(3)
    for page in (0, 1, 2):
        lru.release(page)
    lru.touch_many([2, 1, 0])  # 0 most recent, 2 oldest
    assert [lru.pop_victim() for _ in range(3)] == [2, 1, 0]


def test_release_after_batch_is_taken_is_newest(monkeypatch):
    monkeypatch.setattr(eviction, "MIN_BATCH", 2)
    lru = StampLRU(8)
    for page in range(6):
        lru.release(page)
    assert lru.pop_victim() == 0  # batch holds pages 0, 1
    lru.touch(1)  # invalidates the batch entry for 1
    lru.release(7)
    assert [lru.pop_victim() for _ in range(6)] == [2, 3, 4, 5, 1, 7]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(
    st.tuples(st.sampled_from(["release", "touch", "hold", "evict"]), st.integers(0, 11)),
    max_size=150))
def test_matches_reference_lru(min_batch, ops):
    eviction.MIN_BATCH, saved = min_batch, eviction.MIN_BATCH  # tiny batches force refills
    try:
        n = 12
        lru = StampLRU(n)
        ref: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        for op, page in ops:
            if op == "release":
                ref.pop(page, None)
                ref[page] = None
                lru.release(page)
            elif op == "touch":
                if page in ref:
                    ref.move_to_end(page)
                lru.touch(page)
            elif op == "hold":
                ref.pop(page, None)
                lru.hold(page)
            else:
                want = next(iter(ref), None)
                assert lru.pop_victim() == want
                if want is not None:
                    del ref[want]
    finally:
        eviction.MIN_BATCH = saved


def test_evictable_count_follows_every_operation_and_short_cuts_a_full_pinned_region():
    import random

    import numpy as np

    from hisparse.daemon.store.eviction import HELD, StampLRU

    rng = random.Random(11)
    lru = StampLRU(2048)
    for _ in range(20_000):
        page = rng.randrange(2048)
        op = rng.randrange(6)
        if op == 0:
            lru.release(page)
        elif op == 1:
            lru.hold(page)
        elif op == 2:
            lru.touch(page)
        elif op == 3:
            lru.release_many(np.array(sorted(set(rng.sample(range(2048), 8)))))
        elif op == 4:
            lru.hold_many(np.array(sorted(set(rng.sample(range(2048), 8)))))
        else:
            lru.pop_victim()
        assert lru.evictable == int(np.count_nonzero(lru._view != HELD))
    # nothing evictable: answered without scanning the region
    lru.hold_many(np.arange(2048))
    lru._refill = None  # a scan would now fail loudly
    assert lru.evictable == 0 and lru.pop_victim() is None


def test_touch_run_is_touch_many_of_the_run_head_last():
    for held in (None, 3):
        a, b = StampLRU(8), StampLRU(8)
        for lru in (a, b):
            for page in range(8):
                lru.release(page)
            if held is not None:
                lru.hold(held)
        a.touch_run(2, 4)
        b.touch_many([5, 4, 3, 2])
        if held is None:
            assert list(a.stamps) == list(b.stamps) and a.clock == b.clock
        assert a.is_held(3) == b.is_held(3) == (held == 3)
        assert [a.pop_victim() for _ in range(9)] == [b.pop_victim() for _ in range(9)]


def test_a_run_longer_than_run_max_is_touched_as_touch_many_touches_it():
    from hisparse.daemon.store.eviction import RUN_MAX

    n = RUN_MAX + 5  # a 16,384-key lookup of one stored chain: vectorised too, not a Python loop
    for held in (None, 7):
        a, b = StampLRU(n + 16), StampLRU(n + 16)
        for lru in (a, b):
            for page in range(n + 16):
                lru.release(page)
            if held is not None:
                lru.hold(held)
        a.touch_run(3, n)
        b.touch_many(range(n + 2, 2, -1))
        if held is None:
            assert list(a.stamps) == list(b.stamps) and a.clock == b.clock
        assert a.is_held(7) == b.is_held(7) == (held == 7)
        assert [a.pop_victim() for _ in range(40)] == [b.pop_victim() for _ in range(40)]


def test_deferred_runs_leave_exactly_what_touching_at_once_would():
    # touch_run notes runs (up to MAX_RUNS) and writes them before any stamp is read or written.
    # Against the same runs written at once (c), the stamps are equal at every look; against
    # touch_many of each run head last (b), every victim is the same.
    import random

    from hisparse.daemon.store.eviction import MAX_RUNS

    rng = random.Random(7)
    a, b, c = StampLRU(512), StampLRU(512), StampLRU(512)
    for lru in (a, b, c):
        for page in range(512):
            lru.release(page)
    for step in range(6 * MAX_RUNS):
        op = rng.random()
        if op < 0.8:  # lookups of stored chains, often the same hot ones, a held page among them
            first = rng.choice((0, 10, 100, rng.randrange(500)))
            n = rng.randint(1, min(64, 512 - first))
            a.touch_run(first, n)
            b.touch_many(range(first + n - 1, first - 1, -1))
            c.touch_run(first, n)
            c.flush()
            continue
        page = rng.randrange(512)
        if op < 0.85:
            a.hold(page), b.hold(page), c.hold(page)
        elif op < 0.9:
            a.release(page), b.release(page), c.release(page)
        elif op < 0.95:
            assert a.pop_victim() == b.pop_victim() == c.pop_victim()
        else:
            assert a.peek_victims(8) == b.peek_victims(8) == c.peek_victims(8)
        assert a.evictable == b.evictable == c.evictable
        assert list(a.stamps) == list(c.stamps) and a.clock == c.clock
    assert [p for p in range(512) if a.is_held(p)] == [p for p in range(512) if b.is_held(p)]
    assert [a.pop_victim() for _ in range(600)] == [b.pop_victim() for _ in range(600)]


def test_runs_noted_stay_few_in_pages_and_a_long_run_is_written_at_once():
    from hisparse.daemon.store.eviction import MAX_RUN_PAGES

    lru = StampLRU(4 * MAX_RUN_PAGES)
    for page in range(4 * MAX_RUN_PAGES):
        lru.release(page)
    lru.touch_run(0, 64)
    assert len(lru._runs) == 1  # noted
    lru.touch_run(100, 2 * MAX_RUN_PAGES)  # a 16,384-key lookup: written now, with the one noted
    assert lru._runs == [] and lru._run_pages == 0
    assert lru._stamps[100] == lru.clock - 1 and lru._stamps[0] == 64 + 4 * MAX_RUN_PAGES
