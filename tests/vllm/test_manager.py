"""HiSparseOffloadingManager scenarios against a real hisparsed, in the style of vLLM's CPU manager tests."""

from __future__ import annotations

import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, PrepareStoreOutput

from hisparse.client import attach
from hisparse.vllm.manager import DOWN_BACKOFF_S, HiSparseLoadStoreSpec
from tests.vllm.conftest import device_pointers, req, run_jobs, to_key, to_keys

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def store(manager, ints: list[int], ctx=None) -> PrepareStoreOutput:
    ctx = ctx or req()
    out = manager.prepare_store(to_keys(ints), ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return out


def lookups(manager, ints: list[int]) -> list[LookupResult]:
    return [manager.lookup(k, req()) for k in to_keys(ints)]


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
    assert lookups(manager, [1, 2]) == [LookupResult.HIT_PENDING] * 2
    assert list(manager.take_events()) == []

    # complete store [1, 2] -> loadable, announced
    manager.complete_store(to_keys([1, 2]), req())
    assert lookups(manager, [1, 2, 3]) == [HIT, HIT, MISS]
    assert split_events(manager.take_events()) == ([set(to_keys([1, 2]))], [])

    # store [1, 2, 3] again -> only 3 is new
    out = manager.prepare_store(to_keys([1, 2, 3]), req())
    assert out.keys_to_store == to_keys([3])


def test_eviction_order(engines):
    engine = engines(capacity_pages=4)
    manager = engine.manager
    store(manager, [1, 2, 3, 4])

    # load [1]: touches it, so 2 is now the least recently used
    spec = manager.prepare_load(to_keys([1]), req("a"))
    manager.complete_load(to_keys([1]), req("a"))
    assert (spec.page_ids >= 0).all()

    # prepare store [5] -> evicts [2]
    out = manager.prepare_store(to_keys([5]), req())
    assert out.keys_to_store == to_keys([5])
    assert out.evicted_keys == to_keys([2])
    manager.complete_store(to_keys([5]), req())

    # prepare store [6, 7] -> evicts [3, 4] (oldest first)
    out = manager.prepare_store(to_keys([6, 7]), req())
    assert out.evicted_keys == to_keys([3, 4])
    manager.complete_store(to_keys([6, 7]), req())
    assert lookups(manager, [1, 2, 3, 4, 5, 6, 7]) == [HIT, MISS, MISS, MISS, HIT, HIT, HIT]
    stores, removals = split_events(manager.take_events())
    assert removals == [set(to_keys([2])), set(to_keys([3, 4]))]


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

    # prepare load [1, 2] (pinned until complete_load)
    spec = manager.prepare_load(to_keys([1, 2]), req("a"))
    assert (spec.page_ids >= 0).all()

    # prepare store [5, 6, 7] -> only [3, 4] can go: [5, 6] stored, [7] has no room
    out = manager.prepare_store(to_keys([5, 6, 7]), req("b"))
    assert out.keys_to_store == to_keys([5, 6])
    assert sorted(out.evicted_keys) == sorted(to_keys([3, 4]))

    # prepare store with no space ([1, 2] being loaded, [5, 6] being written)
    assert manager.prepare_store(to_keys([8]), req("b")) is None
    assert lookups(manager, [1, 2]) == [HIT, HIT]

    # complete load [1, 2] -> evictable again; [2] is older than [1]
    manager.complete_load(to_keys([1, 2]), req("a"))
    out = manager.prepare_store(to_keys([8]), req("b"))
    assert out.evicted_keys == to_keys([2])
    assert namespace_stats(engine)["pinned_pages"] == 0


def test_failed_store_leaves_nothing(engines):
    engine = engines()
    manager = engine.manager
    out = manager.prepare_store(to_keys([1, 2]), req())
    manager.complete_store(to_keys([1, 2]), req(), success=False)

    assert lookups(manager, [1, 2]) == [MISS, MISS]
    stats = namespace_stats(engine)
    assert stats["committed_pages"] == 0 and stats["writing_pages"] == 0
    events = list(manager.take_events())
    assert [e.metadata_only for e in events] == [True]
    # the same keys store again, as if never offered
    again = manager.prepare_store(to_keys([1, 2]), req())
    assert again.keys_to_store == out.keys_to_store


def test_two_engines_of_one_model_share(engines):
    a = engines(engine_id="engine-a")
    b = engines(engine_id="engine-b")
    assert a.spec.namespace == b.spec.namespace

    out = store(a.manager, [1, 2, 3])
    # B hits what A committed, and pins the very pages A wrote
    assert lookups(b.manager, [1, 2, 3, 4]) == [HIT, HIT, HIT, MISS]
    spec = b.manager.prepare_load(to_keys([1, 2, 3]), req("b"))
    assert spec.page_ids.tolist() == out.store_spec.page_ids.tolist()
    b.manager.complete_load(to_keys([1, 2, 3]), req("b"))
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


def test_key_evicted_between_lookup_and_load_fails_the_load(engines):
    engine = engines(capacity_pages=2, extra={"mirror_refresh_s": 60})
    manager = engine.manager
    store(manager, [1, 2])
    assert lookups(manager, [1, 2]) == [HIT, HIT]

    # another engine evicts both before this one pins (this mirror is stale)
    with attach(engine.spec.namespace, engine.spec.layout, socket=engines.daemon.socket) as other:
        assert other.store(to_keys([7, 8]), np.zeros((2, engine.spec.layout.page_bytes), np.uint8)) == 2

    # the pin finds neither: the load spec says so, the worker fails the job
    spec = manager.prepare_load(to_keys([1, 2]), req("a"))
    assert spec.page_ids.tolist() == [-1, -1]
    caches = engine.kv_caches()
    worker = engine.worker(caches)
    worker.submit_load(7, spec, device_pointers(caches, [0, 1]))
    assert run_jobs(worker, {7}) == {7: False}
    manager.complete_load(to_keys([1, 2]), req("a"))  # nothing was pinned: nothing to release
    assert manager.stats_snapshot()["pin_failures"] == 2
    assert lookups(manager, [1, 2]) == [MISS, MISS]


def test_key_written_by_another_engine_answers_retry(engines):
    a = engines(engine_id="engine-a")
    b = engines(engine_id="engine-b")
    a.manager.prepare_store(to_keys([1]), req("a"))

    # B offers [1] too: A is writing it, so B leaves it to A
    assert b.manager.prepare_store(to_keys([1]), req("b")).keys_to_store == []
    assert b.manager.lookup(to_key(1), req("b")) is LookupResult.RETRY

    a.manager.complete_store(to_keys([1]), req("a"))
    assert b.manager.lookup(to_key(1), req("b")) is HIT


def test_finished_request_keeps_pins_of_a_load_in_flight(engines):
    engine = engines()
    manager = engine.manager
    store(manager, [1, 2])
    manager.prepare_load(to_keys([1, 2]), req("a"))
    manager.on_request_finished(req("a"))
    # the worker may still be copying: the pages stay pinned ...
    assert namespace_stats(engine)["pinned_pages"] == 2
    # ... until the load completes
    manager.complete_load(to_keys([1, 2]), req("a"))
    assert namespace_stats(engine)["pinned_pages"] == 0


def test_reset_cache_clears_the_namespace(engines):
    engine = engines()
    manager = engine.manager
    store(manager, [1, 2])
    manager.prepare_load(to_keys([1]), req("a"))
    manager.prepare_store(to_keys([3]), req("b"))

    manager.reset_cache()
    assert lookups(manager, [1, 2, 3]) == [MISS, MISS, MISS]
    stats = namespace_stats(engine)
    assert stats["committed_pages"] == 0
    # the flushed jobs' holds stay until vLLM says their copies are done
    assert stats["pinned_pages"] == 1 and stats["writing_pages"] == 1
    manager.on_reset_flushed()
    stats = namespace_stats(engine)
    assert stats["pinned_pages"] == 0 and stats["writing_pages"] == 0


def test_stats(engines):
    manager = engines(capacity_pages=4).manager
    store(manager, [1, 2])
    lookups(manager, [1, 2, 3])
    snap = manager.stats_snapshot(reset=True)
    assert (snap["lookup_hits"], snap["lookup_misses"]) == (2, 1)
    assert snap["usage_perc"] == pytest.approx(0.5)
    assert manager.stats_snapshot()["lookup_hits"] == 0
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: F401
            OffloadingConnectorStats,
        )
    except ImportError:
        assert manager.get_stats() is None  # vLLM without its dependencies: no metrics stack
    else:
        assert manager.get_stats() is not None


def test_events_off_when_kv_events_are_off(engines):
    manager = engines(enable_events=False).manager
    store(manager, [1])
    assert list(manager.take_events()) == []


def test_daemon_away_costs_one_timeout_then_misses_fast(engines):
    engine = engines(extra={"timeout_s": 0.3})
    manager = engine.manager
    store(manager, [1, 2])
    engines.daemon.kill()

    # the first refresh waits out its timeout; then lookups answer MISS from memory
    t0 = time.monotonic()
    assert lookups(manager, [1]) == [MISS]
    assert time.monotonic() - t0 < 0.3 * 3
    t0 = time.monotonic()
    assert lookups(manager, [1, 2] * 500) == [MISS] * 1000
    assert manager.prepare_store(to_keys([3]), req()) is None
    assert time.monotonic() - t0 < 0.05

    # a restarted daemon adopts the committed pages; the mirror resyncs after the pause
    engines.daemon.start()
    time.sleep(DOWN_BACKOFF_S)
    assert lookups(manager, [1, 2, 3]) == [HIT, HIT, MISS]


def test_a_store_across_a_daemon_restart_publishes_nothing(engines):
    manager = engines().manager
    store(manager, [1])
    manager.prepare_store(to_keys([2]), req())
    engines.daemon.restart()  # committed [1] is adopted; the reservation of [2] dies

    manager.complete_store(to_keys([2]), req())
    assert lookups(manager, [1, 2]) == [HIT, MISS]
    # the next store of [2] reserves on the new session
    assert store(manager, [2]).keys_to_store == to_keys([2])
    assert lookups(manager, [2]) == [HIT]
