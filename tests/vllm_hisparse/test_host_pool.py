"""vLLM HiSparse's host pool on one hisparsed namespace: vLLM's real scheduler classes, a real daemon.

Two engines in two processes, and a restart, run in test_real_scheduler.py
(vLLM's whole Scheduler); here, in one process, the pool's behaviour under
shared capacity, outage, restart and fencing.

Geometry everywhere: 2 MLA layers, 4-token blocks, 16-byte rows (one page
is 128 B); ``num_host_blocks`` pages in the region.
"""

from __future__ import annotations

import time

import pytest

from hisparse.vllm.host_region import GeometryMismatch
from hisparse.vllm.versions import TESTED_VLLM_VERSIONS, UnsupportedVllmVersion, check_vllm_version
from tests.vllm_hisparse.engine import SchedulerSide
from tests.waiting import wait_for

PROMPT = list(range(100, 124))  # 24 tokens: 6 blocks; a hit stops at 20 (the last token is recomputed)


def test_capacity_is_shared_and_held_pages_are_never_taken(sides):
    # 64-page region; each engine keeps a stock of a few blocks (two steps' worth)
    b = sides(num_host_blocks=64, step_blocks=3, name="B")
    a = sides(num_host_blocks=64, step_blocks=3, name="A")
    held = b.add("b-held", list(range(1000, 1024)))
    assert b.admit(held) == 0
    b.write(held)
    b.publish(held)
    b.step()
    b.step()  # B keeps no more than two steps of stock: the rest goes back to the daemon
    assert b.pool.held_pages <= 6 + 2 * 3
    long = a.add("a-long", list(range(5000, 5000 + 4 * 34)))  # 34 blocks: more than half the region
    assert a.admit(long) == 0
    a.write(long)
    a.publish(long)
    a.step()
    assert not set(a.host_blocks(long)) & set(b.host_blocks(held))
    assert 0 not in a.host_blocks(long) + b.host_blocks(held)  # page 0 is the null block
    assert b.read_ok(held, 24) and a.read_ok(long, 4 * 34)
    # more than the region has left does not fit (admission says so) and takes nothing B holds
    too_long = a.add("a-too-long", list(range(9000, 9000 + 4 * 30)))
    assert a.admit(too_long) is None
    assert b.read_ok(held, 24)
    # once A's first request is done its published pages are evictable: the next one fits
    a.finish(long)
    a.step()
    a.step()
    assert a.admit(too_long) == 0
    a.write(too_long)
    assert b.read_ok(held, 24) and a.read_ok(too_long, 4 * 30)


def test_daemon_outage_and_restart_mid_run_fail_no_request(daemon_factory):
    daemon = daemon_factory(lease_ttl=1)
    side = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4)
    try:
        running = side.add("running", PROMPT)
        assert side.admit(running) == 0
        side.write(running)
        side.step()
        # outage: the daemon is gone; steps keep going, new blocks come from the stock
        daemon.kill()
        side.publish(running)
        side.step()
        short = side.add("during-outage", list(range(300, 306)))
        assert side.admit(short) == 0
        side.write(short)
        side.publish(short)
        side.step()
        # the daemon comes back (a new run: every session is gone); nothing fails,
        # blocks in use stay in use, new requests get fresh pages
        daemon.start()
        wait_for(lambda: side.pool.answering, "the pool's courier hears from the daemon again")
        for _ in range(3):
            side.step()
        assert side.read_ok(running, 24)
        side.finish(running)
        side.finish(short)
        side.step()
        after = side.add("after", list(range(600, 624)))
        assert side.admit(after) is not None
        side.write(after)
        side.publish(after)
        side.step()
        assert side.pool.counters["published"] >= 6
        assert side.read_ok(after, 24)
    finally:
        side.close()


def test_geometry_check_refuses_a_region_of_another_size(sides):
    sides(num_host_blocks=16)
    with pytest.raises(GeometryMismatch, match="host_pool_gib"):
        sides(num_host_blocks=20)


def test_version_pin_names_the_tested_versions():
    assert check_vllm_version() in TESTED_VLLM_VERSIONS
    with pytest.raises(UnsupportedVllmVersion, match="0.34.0"):
        check_vllm_version("0.35.0")


def never_gets(side: SchedulerSide, pages: set[int], window_s: float = 1.5) -> None:
    """``side`` reserves all it can, over several of the daemon's reaper periods: never ``pages``."""
    until = time.monotonic() + window_s
    while time.monotonic() < until:
        side.pool._refill(64)
        assert not pages & set(side.pool._stock)
        time.sleep(0.05)


def test_a_lost_sessions_pages_stay_fenced_while_the_engine_or_its_worker_uses_them(daemon_factory):
    from hisparse.vllm.fences import WorkerFences

    daemon = daemon_factory(lease_ttl=1)
    a = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4, name="A")
    b = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4, name="B")
    worker = WorkerFences()
    try:
        running = a.add("running", PROMPT)
        assert a.admit(running) == 0
        a.write(running)
        a.step()
        in_use = set(a.host_blocks(running))
        old_fences = {a.pool._ops.client.session.fence.path}
        # the daemon restarts: A's session and its reservations are gone, but the
        # pages A's running request uses are fenced while A (and its worker) hold the fence
        daemon.kill()
        daemon.start()
        for engine in (a, b):
            wait_for(lambda: engine.pool.answering, "the pool's courier hears from the daemon again")
            engine.step()
        # the lost session's fence (the new session's may be there too, once a reserve on it
        # has been answered: the pool's thread sends it, the answer may come a step later)
        assert old_fences <= set(a.pool.fence_paths())
        # B takes everything the daemon will give, for well past the daemon's
        # reaper period and quarantine: never a page A's request uses
        never_gets(b, in_use)
        assert a.read_ok(running, 24)
        worker.update(a.pool.fence_paths())  # the worker's step holds them too
        # A's request ends; a few steps later A lets go of the old fence, the worker still holds it
        a.finish(running)
        for _ in range(4):
            a.step()
        assert not old_fences & set(a.pool.fence_paths())
        never_gets(b, in_use)
        # the worker lets go too: the daemon may now reuse those pages
        worker.close()
        deadline = time.monotonic() + 10
        while not in_use & set(b.pool._stock):
            assert time.monotonic() < deadline, "the old session's pages were never freed"
            b.pool._refill(64)
            time.sleep(0.05)
    finally:
        worker.close()
        a.close()
        b.close()
