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

import pytest
import torch

pytest.importorskip("sglang")

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
