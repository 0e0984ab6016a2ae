"""HiSparseOffloadingManager scenarios against a real hisparsed, in the style of vLLM's CPU manager tests."""

from __future__ import annotations

import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, PrepareStoreOutput, ScheduleEndContext

from hisparse.client import attach
from hisparse.vllm.manager import HiSparseLoadStoreSpec
from tests.vllm.conftest import (
    device_pointers,
    req,
    run_jobs,
    settle,
    settled_lookups,
    to_key,
    to_keys,
    wait_until,
)

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def store(manager, ints: list[int], ctx=None) -> PrepareStoreOutput:
    ctx = ctx or req()
    out = manager.prepare_store(to_keys(ints), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    settle(manager)  # the commit runs on the background thread
    return out


def lookups(manager, ints: list[int], req_id: str = "r") -> list[LookupResult]:
    """What the scheduler sees once the background thread has pinned what it asked for."""
    results = settled_lookups(manager, to_keys(ints), req(req_id))
    manager.on_request_finished(req(req_id))  # give the holds back
    settle(manager)
    return results


def load(manager, ints: list[int], req_id: str = "a") -> HiSparseLoadStoreSpec:
    """lookup (HIT) -> prepare_load -> complete_load -> request finished, as the scheduler runs them."""
    assert settled_lookups(manager, to_keys(ints), req(req_id)) == [HIT] * len(ints)
    spec = manager.prepare_load(to_keys(ints), req(req_id))
    manager.complete_load(to_keys(ints), req(req_id))
    manager.on_request_finished(req(req_id))
    settle(manager)
    return spec


def namespace_stats(engine) -> dict:
    return engine.manager._ops.client.stats()["namespaces"][engine.spec.namespace]


def split_events(events) -> tuple[list[set], list[set]]:
    stores, removals = [], []
    for event in events:
        assert isinstance(event, OffloadingEvent)
        (removals if event.removed else stores).append(set(event.keys))
    return stores, removals


def test_store_then_lookup(engines):
    manager = engines().manager

    # prepare store [1, 2]: two fresh pages, nothing evicted
    out = manager.prepare_store(to_keys([1, 2]), req())
    assert out.keys_to_store == to_keys([1, 2])
    assert isinstance(out.store_spec, HiSparseLoadStoreSpec)
    assert len(set(out.store_spec.page_ids.tolist())) == 2
    assert out.evicted_keys == []

    # lookup [1, 2] -> our own write in flight
    assert [manager.lookup(k, req()) for k in to_keys([1, 2])] == [LookupResult.HIT_PENDING] * 2
    assert manager.take_events() == []

    # complete store [1, 2] -> committed in the background, then loadable, announced
    manager.complete_store(to_keys([1, 2]), req())
    settle(manager)
    assert lookups(manager, [1, 2, 3]) == [HIT, HIT, MISS]
    assert split_events(manager.take_events()) == ([set(to_keys([1, 2]))], [])

    # store [1, 2, 3] again -> only 3 is new
    out = manager.prepare_store(to_keys([1, 2, 3]), req())
    assert out.keys_to_store == to_keys([3])


def test_a_committed_key_answers_retry_until_it_is_pinned_then_hit(engines):
    engine = engines(extra={"mirror_refresh_s": 60})  # the background thread runs only when woken
    manager = engine.manager
    store(manager, [1])
    # the first look asks for a pin and says RETRY: vLLM asks again next step
    assert manager.lookup(to_key(1), req("a")) is RETRY
    assert namespace_stats(engine)["pinned_pages"] == 0
    manager.on_schedule_end(ScheduleEndContext((), ()))  # the end of the step wakes the pinning
    wait_until(lambda: manager.stats_snapshot()["held_keys"] == 1, what="the pin")
    assert namespace_stats(engine)["pinned_pages"] == 1
    assert manager.lookup(to_key(1), req("a")) is HIT
    assert manager.get_load_source(to_key(1), req("a")) == "host"


def test_a_hit_is_a_promise_no_eviction_comes_between(engines):
    # issue 10, item 1: HIT, another engine fills the region, prepare_load still loads
    engine = engines(capacity_pages=2, extra={"mirror_refresh_s": 60})
    manager = engine.manager
    caches = engine.kv_caches(seed=1)
    worker = engine.worker(caches)
    out = manager.prepare_store(to_keys([1, 2]), req("w"))
    worker.submit_store(1, device_pointers(caches, [3, 4]), out.store_spec)
    assert run_jobs(worker, {1}) == {1: True}
    manager.complete_store(to_keys([1, 2]), req("w"))
    settle(manager)
    assert settled_lookups(manager, to_keys([1, 2]), req("a")) == [HIT, HIT]

    # another engine of the namespace wants the whole region: nothing it may evict
    with attach(engine.spec.namespace, engine.spec.layout, socket=engines.daemon.socket) as other:
        assert other.store(to_keys([7, 8]), np.zeros((2, engine.spec.layout.page_bytes), np.uint8)) == 0

    spec = manager.prepare_load(to_keys([1, 2]), req("a"))
    assert (spec.page_ids >= 0).all()
    dst = engine.kv_caches(seed=2)
    worker.submit_load(2, spec, device_pointers(dst, [10, 11]))
    assert run_jobs(worker, {2}) == {2: True}
    for s_block, d_block in ((3, 10), (4, 11)):
        assert engine.block_bytes(dst, d_block) == engine.block_bytes(caches, s_block)
    manager.complete_load(to_keys([1, 2]), req("a"))
    manager.on_request_finished(req("a"))
    settle(manager)
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 0, what="the unpins")
    assert manager.stats_snapshot()["pin_failures"] == 0


def test_holds_of_a_finished_request_go_and_unused_holds_age_out(engines):
    engine = engines(extra={"hold_s": 0.3})
    manager = engine.manager
    store(manager, [1, 2, 3])
    settled_lookups(manager, to_keys([1, 2]), req("a"))
    settled_lookups(manager, to_keys([2, 3]), req("b"))
    assert namespace_stats(engine)["pinned_pages"] == 3
    manager.on_request_finished(req("a"))  # [1] goes; [2] is still b's
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 2, what="a's unpin")
    # b is never scheduled: its holds age out
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 0, what="the age-out")
    assert manager.stats_snapshot()["held_keys"] == 0


def test_eviction_order(engines):
    engine = engines(capacity_pages=4)
    manager = engine.manager
    store(manager, [1, 2, 3, 4])

    # load [1]: touches it, so 2 is now the least recently used
    spec = load(manager, [1])
    assert (spec.page_ids >= 0).all()

    # prepare store [5] -> evicts [2]
    out = manager.prepare_store(to_keys([5]), req())
    assert out.keys_to_store == to_keys([5])
    assert out.evicted_keys == to_keys([2])
    manager.complete_store(to_keys([5]), req())
    settle(manager)

    # prepare store [6, 7] -> evicts [3, 4] (oldest first)
    out = manager.prepare_store(to_keys([6, 7]), req())
    assert out.evicted_keys == to_keys([3, 4])
    manager.complete_store(to_keys([6, 7]), req())
    settle(manager)
    assert lookups(manager, [1, 2, 3, 4, 5, 6, 7]) == [HIT, MISS, MISS, MISS, HIT, HIT, HIT]
    stores, removals = split_events(manager.take_events())
    assert removals == [set(to_keys([2])), set(to_keys([3, 4]))]


def test_own_evictions_leave_the_mirror_at_once(engines):
    # issue 10, item 3: no HIT (nor RETRY) for a key our own reserve just evicted
    manager = engines(capacity_pages=2, extra={"mirror_refresh_s": 60}).manager
    store(manager, [1, 2])
    out = manager.prepare_store(to_keys([3]), req())
    assert out.evicted_keys == to_keys([1])
    assert manager.lookup(to_key(1), req("x")) is MISS
    assert manager.lookup(to_key(2), req("x")) is RETRY  # still committed: pinned next


def test_already_stored_keys_are_not_evicted_by_their_own_store(engines):
    manager = engines(capacity_pages=4).manager
    store(manager, [1, 2])
    store(manager, [9, 10])
    # [1] is the LRU page, but it is part of this offer: [9] goes instead
    out = manager.prepare_store(to_keys([1, 3]), req())
    assert out.keys_to_store == to_keys([3])
    assert out.evicted_keys == to_keys([2])  # [1] was touched by the offer; [2] is next


def test_pins_from_prepare_load_hold_against_eviction(engines):
    engine = engines(capacity_pages=4)
    manager = engine.manager
    store(manager, [1, 2, 3, 4])

    # lookup and prepare load [1, 2] (pinned until complete_load)
    assert settled_lookups(manager, to_keys([1, 2]), req("a")) == [HIT, HIT]
    spec = manager.prepare_load(to_keys([1, 2]), req("a"))
    assert (spec.page_ids >= 0).all()

    # prepare store [5, 6, 7] -> only [3, 4] can go: [5, 6] stored, [7] has no room
    out = manager.prepare_store(to_keys([5, 6, 7]), req("b"))
    assert out.keys_to_store == to_keys([5, 6])
    assert sorted(out.evicted_keys) == sorted(to_keys([3, 4]))

    # prepare store with no space ([1, 2] being loaded, [5, 6] being written)
    assert manager.prepare_store(to_keys([8]), req("b")) is None

    # complete load [1, 2] -> evictable again; [2] is older than [1]
    manager.complete_load(to_keys([1, 2]), req("a"))
    manager.on_request_finished(req("a"))
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 0, what="the unpins")
    out = manager.prepare_store(to_keys([8]), req("b"))
    assert out.evicted_keys == to_keys([2])


def test_failed_store_leaves_nothing(engines):
    engine = engines()
    manager = engine.manager
    out = manager.prepare_store(to_keys([1, 2]), req())
    manager.complete_store(to_keys([1, 2]), req(), success=False)
    settle(manager)

    assert lookups(manager, [1, 2]) == [MISS, MISS]
    stats = namespace_stats(engine)
    assert stats["committed_pages"] == 0 and stats["writing_pages"] == 0
    events = manager.take_events()
    assert [e.metadata_only for e in events] == [True]
    # the same keys store again, as if never offered
    again = manager.prepare_store(to_keys([1, 2]), req())
    assert again.keys_to_store == out.keys_to_store


def test_two_engines_of_one_model_share(engines):
    a = engines(engine_id="engine-a")
    b = engines(engine_id="engine-b")
    assert a.spec.namespace == b.spec.namespace

    out = store(a.manager, [1, 2, 3])
    # B hits what A committed, and loads the very pages A wrote
    assert lookups(b.manager, [1, 2, 3, 4]) == [HIT, HIT, HIT, MISS]
    spec = load(b.manager, [1, 2, 3], "b")
    assert spec.page_ids.tolist() == out.store_spec.page_ids.tolist()
    # and stores only what A did not
    assert b.manager.prepare_store(to_keys([1, 2, 3, 4]), req("b")).keys_to_store == to_keys([4])


def test_engine_of_another_model_shares_nothing(engines):
    a = engines(model="org/model-a", capacity_pages=2)
    c = engines(model="org/model-b", capacity_pages=2)
    assert a.spec.namespace != c.spec.namespace

    store(a.manager, [1, 2])
    assert lookups(c.manager, [1, 2]) == [MISS, MISS]
    # C's stores fill C's own region and never evict A's pages
    store(c.manager, [1, 2])
    out = c.manager.prepare_store(to_keys([3]), req())
    assert out.evicted_keys == to_keys([1])
    assert lookups(a.manager, [1, 2]) == [HIT, HIT]


def test_load_of_keys_never_looked_up_fails_only_that_job(engines):
    # vLLM loads only what lookup said HIT for; anything else gets -1 and the worker fails the job
    engine = engines()
    manager = engine.manager
    store(manager, [1])
    spec = manager.prepare_load(to_keys([1]), req("a"))
    assert spec.page_ids.tolist() == [-1]
    caches = engine.kv_caches()
    worker = engine.worker(caches)
    worker.submit_load(7, spec, device_pointers(caches, [0]))
    assert run_jobs(worker, {7}) == {7: False}
    manager.complete_load(to_keys([1]), req("a"))
    assert manager.stats_snapshot()["pin_failures"] == 1


def test_key_written_by_another_engine_answers_retry(engines):
    a = engines(engine_id="engine-a")
    b = engines(engine_id="engine-b")
    a.manager.prepare_store(to_keys([1]), req("a"))

    # B offers [1] too: A is writing it, so B leaves it to A
    assert b.manager.prepare_store(to_keys([1]), req("b")).keys_to_store == []
    assert b.manager.lookup(to_key(1), req("b")) is RETRY

    a.manager.complete_store(to_keys([1]), req("a"))
    settle(a.manager)
    assert settled_lookups(b.manager, to_keys([1]), req("b")) == [HIT]


def test_finished_request_keeps_pins_of_a_load_in_flight(engines):
    engine = engines()
    manager = engine.manager
    store(manager, [1, 2])
    settled_lookups(manager, to_keys([1, 2]), req("a"))
    manager.prepare_load(to_keys([1, 2]), req("a"))
    manager.on_request_finished(req("a"))
    settle(manager)
    # the worker may still be copying: the pages stay pinned ...
    assert namespace_stats(engine)["pinned_pages"] == 2
    # ... until the load completes
    manager.complete_load(to_keys([1, 2]), req("a"))
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 0, what="the unpins")


def test_reset_cache_clears_the_namespace(engines):
    engine = engines()
    manager = engine.manager
    store(manager, [1, 2])
    settled_lookups(manager, to_keys([1]), req("a"))
    manager.prepare_load(to_keys([1]), req("a"))
    manager.prepare_store(to_keys([3]), req("b"))

    manager.reset_cache()
    assert [manager.lookup(k, req("c")) for k in to_keys([1, 2, 3])] == [MISS, MISS, MISS]
    stats = namespace_stats(engine)
    assert stats["committed_pages"] == 0
    # the flushed jobs' holds stay until vLLM says their copies are done
    assert stats["pinned_pages"] == 1 and stats["writing_pages"] == 1
    manager.on_reset_flushed()
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 0
               and namespace_stats(engine)["writing_pages"] == 0, what="the released holds")


def test_stats(engines):
    manager = engines(capacity_pages=4).manager
    store(manager, [1, 2])
    settled_lookups(manager, to_keys([1, 2]), req("s"))  # held: the next lookups answer at once
    manager.stats_snapshot(reset=True)
    assert [manager.lookup(k, req("s")) for k in to_keys([1, 2, 3])] == [HIT, HIT, MISS]
    snap = manager.stats_snapshot(reset=True)
    assert (snap["lookup_hits"], snap["lookup_misses"]) == (2, 1)
    assert snap["usage_perc"] == pytest.approx(0.5)
    assert manager.stats_snapshot()["lookup_hits"] == 0
    assert manager.get_stats() is not None


def test_events_off_when_kv_events_are_off(engines):
    manager = engines(enable_events=False).manager
    store(manager, [1])
    assert manager.take_events() == []


def test_daemon_away_never_blocks_the_scheduler(engines):
    # issue 10, item 4: the scheduler's own calls wait at most deadline_s, then nothing waits
    # A call that waited on the daemon would take a whole timeout_s (2 s); the bounds
    # below sit well under it and far above the expected time, for a busy machine.
    engine = engines(extra={"timeout_s": 2.0, "deadline_s": 0.05})
    manager = engine.manager
    store(manager, [1, 2])
    engines.daemon.kill()

    t0 = time.monotonic()
    assert manager.prepare_store(to_keys([3]), req()) is None  # one deadline at most
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    assert [manager.lookup(k, req()) for k in to_keys([1, 2] * 500)] == [MISS] * 1000
    assert manager.prepare_store(to_keys([4]), req()) is None
    assert time.monotonic() - t0 < 1.5

    # a restarted daemon adopts the committed pages; the background thread finds it
    engines.daemon.start()
    wait_until(lambda: manager.stats_snapshot()["daemon_up"], what="the daemon to be seen again")
    assert lookups(manager, [1, 2, 3]) == [HIT, HIT, MISS]


def test_a_store_across_a_daemon_restart_publishes_nothing(engines):
    manager = engines().manager
    store(manager, [1])
    manager.prepare_store(to_keys([2]), req())
    engines.daemon.restart()  # committed [1] is adopted; the reservation of [2] dies

    manager.complete_store(to_keys([2]), req())
    settle(manager)
    assert lookups(manager, [1, 2]) == [HIT, MISS]
    # the next store of [2] reserves on the new session
    assert store(manager, [2]).keys_to_store == to_keys([2])
    assert lookups(manager, [2]) == [HIT]


def test_holds_lost_with_a_daemon_restart_are_taken_again(engines):
    engine = engines()
    manager = engine.manager
    store(manager, [1])
    assert settled_lookups(manager, to_keys([1]), req("a")) == [HIT]
    engines.daemon.restart()
    # the background thread re-attaches, forgets the dead pin, and the next lookups pin again
    wait_until(lambda: manager.stats_snapshot()["held_keys"] == 0, what="the lost hold to go")
    assert settled_lookups(manager, to_keys([1]), req("a")) == [HIT]
    wait_until(lambda: namespace_stats(engine)["pinned_pages"] == 1, what="the new pin")
