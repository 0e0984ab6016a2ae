"""DaemonHostBlockPool's edges: page 0, duplicate publication, stale mirror, one batch per step, free counts, stalls."""

from __future__ import annotations

import time

import pytest

from tests.vllm_hisparse.engine import SchedulerSide


PROMPT = list(range(100, 124))


def test_page_zero_is_the_null_block_and_never_handed_out(sides):
    a = sides(num_host_blocks=16, step_blocks=4)
    a.pool._refill(64)  # everything the region has
    assert 0 not in a.pool._stock and len(a.pool._stock) == 15
    assert a.pool.null_block.block_id == 0 and a.pool.null_block.is_null
    blocks = a.pool.get_new_blocks(15)
    assert sorted(b.block_id for b in blocks) == list(range(1, 16))


def test_a_block_published_twice_stays_private_and_goes_back_to_the_stock(sides):
    a, b = sides(name="A"), sides(name="B")
    ra, rb = a.add("ra", PROMPT), b.add("rb", PROMPT)
    # both miss (neither published yet) and compute the same prompt
    assert a.admit(ra) == 0 and b.admit(rb) == 0
    a.write(ra)
    b.write(rb)
    a.publish(ra)
    a.step()
    b.publish(rb)
    b.step()
    assert a.pool.counters["published"] == 6
    assert b.pool.counters["duplicates"] == 6 and b.pool.counters["published"] == 0
    assert b.read_ok(rb, 24)  # B keeps reading its own copy
    b_pages = set(b.host_blocks(rb))
    b.finish(rb)
    b.step()
    assert b_pages <= set(b.pool._stock)  # duplicates are B's reservations again, no round trip
    # B's next lookup finds A's published pages
    again = b.add("rb2", PROMPT)
    assert b.admit(again) == 20
    assert set(b.host_blocks(again)[:5]) == set(a.host_blocks(ra)[:5])


def published_and_let_go(sides) -> SchedulerSide:
    """Engine A computes PROMPT, publishes its 6 pages and finishes: they are committed, unpinned."""
    a = sides(num_host_blocks=16, step_blocks=2, name="A")
    ra = a.add("ra", PROMPT)
    assert a.admit(ra) == 0
    a.write(ra)
    a.publish(ra)
    a.step()
    a.finish(ra)
    a.step()
    a.step()
    return a


def test_a_page_evicted_since_the_mirror_saw_it_is_a_miss_never_a_foreign_page(sides):
    b = sides(num_host_blocks=16, step_blocks=2, name="B")
    published_and_let_go(sides)  # A's pages are evictable
    b.pool._mirror.refresh()
    assert len(b.pool._mirror) == 6
    b.pool._mirror.max_age_s = 1e9  # B's mirror goes stale
    c = sides(num_host_blocks=16, step_blocks=2, name="C")
    c.pool._refill(64)  # C takes every page it can: A's committed pages are evicted
    rb = b.add("rb", PROMPT)
    blocks, hit, _ = b.manager.get_computed_blocks(rb)
    assert hit == 0 and b.pool.counters["lookup_pin_misses"] >= 1
    assert b.pool._lookup == set()


def test_a_long_request_costs_a_few_requests_not_one_per_block(sides):
    a = sides(num_host_blocks=128, step_blocks=8, max_model_len=1024)
    long = a.add("long", list(range(5000, 5000 + 4 * 100)))  # 100 blocks
    assert a.admit(long) == 0
    a.write(long)
    a.publish(long)
    a.step()
    counters = a.pool.counters
    assert counters["published"] == 100
    assert counters["reserve_requests"] <= 3 and counters["publish_requests"] == 1
    # and a second engine's hit on all of it: one pin request
    b = sides(num_host_blocks=128, step_blocks=8, max_model_len=1024)
    again = b.add("again", list(range(5000, 5000 + 4 * 100)))
    assert b.admit(again) == 396
    assert b.pool.counters["pin_requests"] == 1 and b.pool.counters["lookup_pins"] == 99
    assert b.read_ok(again, 396)


@pytest.mark.parametrize("stop_before", ["flush", "publish"])
def test_a_prefix_that_just_finished_is_a_held_hit_while_the_daemon_is_stopped(hisparsed, sides, stop_before):
    # A request finishes while its blocks' publish is queued (the daemon stopped before
    # the flush) or on its way (stopped during it); the next request with its prompt hits
    # those blocks locally: they are this engine's reservations, so touching them is
    # fine ("host page N touched but not held" crashed schedule() before).
    import os
    import signal

    a = sides(num_host_blocks=32, step_blocks=4)
    first = a.add("first", PROMPT)
    assert a.admit(first) == 0
    a.write(first)
    a.step()  # the stock is topped up
    os.kill(hisparsed.pid, signal.SIGSTOP)
    try:
        a.publish(first)
        if stop_before == "publish":
            a.step()  # the publish goes out; no answer within the step's budget
        a.finish(first)
        again = a.add("again", PROMPT)
        assert a.admit(again) == 20  # the first five blocks, held by this engine
        assert a.read_ok(again, 20)
    finally:
        os.kill(hisparsed.pid, signal.SIGCONT)
    a.finish(again)
    for _ in range(3):
        a.step()


def test_lookup_pins_no_request_took_are_never_counted_as_free_blocks(sides):
    # Request X's lookup pinned another engine's pages, then X was skipped (the
    # indexer connector answered RETRY); request Y is admitted in the same pass. The
    # free count used to include X's pins, so Y was admitted against pages the pool
    # cannot hand out and get_new_blocks raised ValueError out of schedule().
    published_and_let_go(sides).close()
    b = sides(num_host_blocks=16, step_blocks=2, name="B")
    hog = sides(num_host_blocks=16, step_blocks=2, name="hog")
    stats = hog.pool._ops.client.stats()["namespaces"][hog.namespace]
    hog.pool._refill(int(stats["free_pages"]) - 1)  # (+ page 0, withheld) every free page; A's stay
    x = b.add("x", PROMPT)
    blocks, hit, _ = b.manager.get_computed_blocks(x)  # pins A's first 5 pages; x goes no further
    assert hit == 20 and len(b.pool._lookup) == 5
    y = b.add("y", list(range(700, 712)))  # 3 blocks, none cached
    assert b.admit(y) is None  # no pages now: y waits (it raised ValueError before)
    assert b.pool.get_num_free_blocks() == len(b.pool._stock) < 3
    hog.close()  # room again, once the daemon has let the hog's pages go
    deadline = time.monotonic() + 30
    while b.admit(y) is None:
        assert time.monotonic() < deadline, "y never got its blocks"
        b.step()
        time.sleep(0.05)
    assert len(b.host_blocks(y)) == 3
