"""``HisparseLinker`` through SGLang's own direct-linker plumbing, on a real hisparsed.

SGLang's ``create_unified_cache_linker`` (backend ``dynamic``) builds the
linker from its module path over a ``DSATokenToKVPool`` (MLA KV plus the
DSA indexer, DeepSeek-V3.2 / GLM-5's pool) resolved by SGLang's own
``resolve_hybrid_device_pool_group``; ``UnifiedRadixCache.init_cache_linker``
wraps it, and the tree drives it (``tests.sglang.engine.LinkerEngine``):
write-through offloads, ``match_prefix`` lookups, ``load_back``, the layer
counter a forward consumes, ``finish_loads``. On CPU the "device" is the
CPU pool, so this covers everything up to the copy, and the copy itself as
torch indexing of the region's layer slab (on a GPU the same indexing runs
on the slab's device-mapped view: scripts/gpu-check). Stand-ins: the
import one of ``tests/sglang/cpu_stubs.py`` (no host pool exists here).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from hisparse.client import attach
from hisparse.protocol import Op
from tests.rawclient import RawClient

pytest.importorskip("sglang")

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from tests.sglang.engine import LinkerEngine  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

PAGE = 64
EXTRA = {"capacity": "16MiB", "timeout_s": 2.0, "down_s": 0.3}


@pytest.fixture
def linker_engines(hisparsed):
    made = []

    def make(**extra):
        engine = LinkerEngine(hisparsed.socket, extra={**EXTRA, **extra})
        made.append(engine)
        return engine

    make.daemon = hisparsed
    yield make
    for engine in made:
        engine.close()


def tokens(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def test_two_linker_engines_share_kv_and_indexer_pages_byte_exact(linker_engines):
    a, b = linker_engines(), linker_engines()
    prefix = tokens(100, 3)
    kv, indexer = a.put(prefix, seed=1)
    assert a.linker.stats["offloaded_pages"] == 3

    got_kv, got_indexer, failed = b.get(prefix)
    assert failed == []
    assert got_kv.shape == kv.shape and torch.equal(got_kv, kv)
    assert torch.equal(got_indexer, indexer)
    # both pools on namespaces of their own, and nothing left pinned after the load
    lanes = b.linker.lanes.values()
    assert len({lane.namespace for lane in lanes}) == 2
    assert all(len(lane.holds) == 0 for lane in lanes)


def test_a_page_lost_between_lookup_and_load_fails_only_its_request(linker_engines):
    a, b = linker_engines(), linker_engines()
    prefix = tokens(1000, 2)
    a.put(prefix, seed=2)
    # the pins lookup took are gone before the load (as after a daemon restart)
    original = b.linker.lookup

    def lookup_then_lose(rid, transfers):
        found = original(rid, transfers)
        for lane in b.linker.lanes.values():
            lane.holds.release_all()
        return found

    b.linker.lookup = lookup_then_lose
    _, _, failed = b.get(prefix)
    assert failed == ["linker-req-1"]  # SGLang aborts (and the client retries) this request alone
    b.linker.lookup = original
    kv, _, failed = b.get(prefix)
    assert failed == [] and kv.shape[1] == len(prefix)


def test_daemon_outage_costs_the_linker_misses_not_requests(linker_engines):
    a = linker_engines()
    prefix = tokens(2000, 2)
    kv, _ = a.put(prefix, seed=3)
    daemon = linker_engines.daemon
    daemon.kill()

    # offloads report failure (SGLang keeps the node on device), lookups find nothing
    a.put(tokens(3000, 1), seed=4)
    assert not a.linker.gate.up
    got, _, failed = a.get(tokens(4000, 2))
    assert got.shape[1] == 0 and failed == []

    daemon.start()
    wait_for(a.linker.gate.allows, "the gate's down window")
    reader = linker_engines()
    got, _, failed = reader.get(prefix)
    assert failed == [] and torch.equal(got, kv)


def test_two_requests_sharing_a_prefix_load_in_consecutive_batches(linker_engines):
    # Both requests look the prefix up before either loads (overlap scheduling): the second
    # lookup finds the pages held by the first. Each lookup owns its hold, so the first
    # batch's load must not end the second's: it failed whole ("External KV cache load failed").
    a, b = linker_engines(), linker_engines()
    prefix = tokens(5000, 3)
    kv, indexer = a.put(prefix, seed=5)
    first, second = b.match(prefix), b.match(prefix)
    assert first is not None and second is not None
    kv_lane = b.linker.lanes[PoolName.KV]

    (got_kv, got_indexer), failed = b.load([first])
    assert failed == [] and torch.equal(got_kv[0], kv) and torch.equal(got_indexer[0], indexer)
    (got_kv, got_indexer), failed = b.load([second])
    assert failed == [], "one request's load ended another's hold"
    assert torch.equal(got_kv[0], kv) and torch.equal(got_indexer[0], indexer)
    wait_for(lambda: all(len(lane.holds) == 0 for lane in b.linker.lanes.values()),
             "both requests' holds to be let go")
    wait_for(lambda: pinned(linker_engines.daemon, kv_lane.namespace) == 0, "the pins to be released")


def test_pins_lost_mid_copy_fail_the_batch_never_reporting_wrong_bytes(linker_engines):
    # After layer 0 has landed, the load's pins are let go and another engine rewrites every
    # page of the namespace (a region filled with new keys evicts them). Layers 1 and 2 then
    # copy someone else's bytes: the batch must fail (SGLang aborts and recomputes it); it
    # reported them landed, since each layer was marked complete before the pins were checked.
    a, b = linker_engines(), linker_engines()
    prefix = tokens(6000, 3)
    kv, _ = a.put(prefix, seed=6)
    req = b.match(prefix)
    assert req is not None
    kv_lane = b.linker.lanes[PoolName.KV]
    counter = b.linker.layer_done_counter
    real_complete = counter.complete

    def complete_then_lose_the_pins(index: int, layer: int) -> None:
        real_complete(index, layer)
        if layer == 0:
            for lane in b.linker.lanes.values():
                lane.holds.release_all()
            wait_for(lambda: pinned(linker_engines.daemon, kv_lane.namespace) == 0, "the unpins")
            overwrite_namespace(linker_engines.daemon.socket, kv_lane)

    counter.complete = complete_then_lose_the_pins
    (got_kv, _), failed = b.load([req])
    counter.complete = real_complete
    assert not torch.equal(got_kv[0], kv)  # the copy did read rewritten pages...
    assert failed == [req.rid]  # ...and the batch says so: its request recomputes
    assert b.match(prefix) is None  # the pages are gone; nothing stale is found


def pinned(daemon, namespace: str) -> int:
    c = RawClient(daemon.socket)
    try:
        c.hello()
        ns = c.call(Op.STATS)["namespaces"].get(namespace, {})
        c.call(Op.BYE)
        return int(ns.get("pinned_pages", 0))
    finally:
        c.close()


def overwrite_namespace(socket: str, lane) -> None:
    """Another engine stores a region's worth of new pages: every unpinned page is rewritten."""
    with attach(lane.namespace, lane.geometry.layout, socket=socket, timeout_s=5.0) as writer:
        n = writer.num_pages
        pages = torch.full((n, lane.geometry.page_bytes), 0xA5, dtype=torch.uint8)
        keys = [hashlib.sha256(f"overwrite/{i}".encode()).digest() for i in range(n)]
        writer.store(keys, pages)
