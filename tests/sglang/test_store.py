"""``HisparseStore`` call by call, on an SGLang engine's real host pool and a real hisparsed.

The engine (``tests.sglang.engine``, SGLang's own cache stack with the CPU
stand-ins listed in ``tests/sglang/test_engines.py``) only supplies the
registered ``MLATokenToKVPoolHost`` and the storage config SGLang built;
the calls are the ones SGLang's controller makes (``batch_exists``,
``batch_get_v1``, ``batch_set_v1``, the v2 calls for sidecar pools).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from hisparse.client import attach
from hisparse.errors import InvalidArgument, LayoutMismatch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)

from hisparse.sglang.store import HisparseStore  # noqa: E402
from hisparse.sglang.versions import UnsupportedSglangVersion, check_sglang_version  # noqa: E402


def page_keys(tag: str, n: int) -> list[str]:
    """A chain of SGLang-shaped page hashes (64 hex digits)."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def host_pages(engine, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Take ``n`` pages of host slots and fill them: (host_indices, page bytes [n, page_bytes])."""
    tier = engine.backend.tiers["kv"]
    pool = tier.codec.pool
    indices = pool.alloc(n * pool.page_size)
    assert indices is not None
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (n, tier.geometry.page_bytes), dtype=torch.uint8, generator=gen)
    for i in range(n):
        tier.codec.write(int(indices[i * pool.page_size]), pages[i])
    return indices, pages


def read_back(engine, indices: torch.Tensor, n: int) -> torch.Tensor:
    tier = engine.backend.tiers["kv"]
    ps = tier.geometry.page_size
    return torch.stack([tier.codec.read(int(indices[i * ps])) for i in range(n)])


def storage_config(**overrides) -> HiCacheStorageConfig:
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                  model_name="org/model", extra_config={"interface_v1": 1})
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


def test_set_then_exists_then_get_round_trips_byte_exact(sglang_engines):
    engine = sglang_engines()
    store = engine.backend
    keys = page_keys("round", 5)
    src, pages = host_pages(engine, 5, seed=1)
    assert store.batch_set_v1(keys, src) == [True] * 5

    # exists pins what it reports; get copies from those pins
    assert store.batch_exists(keys + page_keys("absent", 2)) == 5
    assert len(store.tiers["kv"].holds) == 5
    dst, _ = host_pages(engine, 5, seed=2)
    assert store.batch_get_v1(keys, dst) == [True] * 5
    assert torch.equal(read_back(engine, dst, 5), pages)
    assert len(store.tiers["kv"].holds) == 0  # each page let go as it was read

    # a get with no exists before it loads (pin, copy, unpin) in one go
    dst2, _ = host_pages(engine, 5, seed=3)
    assert store.batch_get_v1(keys[:3] + page_keys("absent", 2), dst2) == [True] * 3 + [False] * 2
    assert torch.equal(read_back(engine, dst2, 3), pages[:3])


def test_eviction_between_exists_and_get_cannot_take_a_pinned_hit(sglang_engines):
    engine = sglang_engines(extra={"namespace": "test/evict", "capacity": 24 * 1536})
    store = engine.backend
    tier = store.tiers["kv"]
    region_pages = tier.connect().num_pages
    keys = page_keys("hit", 4)
    src, pages = host_pages(engine, 4, seed=4)
    assert store.batch_set_v1(keys, src) == [True] * 4
    assert store.batch_exists(keys) == 4

    # another engine floods the namespace with more pages than it holds
    flood = [bytes.fromhex(k) for k in page_keys("flood", region_pages)]
    with attach("test/evict/kv", tier.geometry.layout, socket=sglang_engines.daemon.socket) as other:
        stored = other.store(flood, torch.zeros((len(flood), tier.geometry.page_bytes), dtype=torch.uint8))
        assert stored == region_pages - 4  # the four pinned pages were not evicted
        dst, _ = host_pages(engine, 4, seed=5)
        assert store.batch_get_v1(keys, dst) == [True] * 4
        assert torch.equal(read_back(engine, dst, 4), pages)

        # unpinned (read; the unpin goes in the background, never waited for on SGLang's IO
        # thread), the same flood evicts them: a short read, never wrong bytes
        from tests.waiting import wait_for

        wait_for(lambda: other.stats()["namespaces"]["test/evict/kv"]["pinned_pages"] == 0, "the unpins")
        assert other.store([bytes.fromhex(k) for k in page_keys("flood2", region_pages)],
                           torch.zeros((region_pages, tier.geometry.page_bytes), dtype=torch.uint8)) > 0
    dst3, before = host_pages(engine, 4, seed=6)
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys, dst3) == [False] * 4
    assert torch.equal(read_back(engine, dst3, 4), before)  # host slots untouched


def test_unread_pins_are_released_after_hold_s(sglang_engines):
    engine = sglang_engines(extra={"hold_s": 0.2})
    store = engine.backend
    keys = page_keys("hold", 3)
    src, _ = host_pages(engine, 3, seed=7)
    store.batch_set_v1(keys, src)
    assert store.batch_exists(keys) == 3 and len(store.tiers["kv"].holds) == 3
    from tests.waiting import wait_for

    wait_for(lambda: store.tiers["kv"].holds.expire() or len(store.tiers["kv"].holds) == 0,
             "unread pins to be released")
    assert store.tiers["kv"].holds.expired_pages == 3


def test_layout_mismatch_is_named(sglang_engines):
    sglang_engines(extra={"namespace": "test/shared"}, layers=3)
    with pytest.raises(LayoutMismatch, match=r"layout mismatch.*test/shared/kv"):
        sglang_engines(extra={"namespace": "test/shared"}, layers=4)


def test_hash_mismatch_is_named(sglang_engines):
    store = sglang_engines().backend
    with pytest.raises(InvalidArgument, match="hash mismatch.*not an SGLang page hash"):
        store.batch_exists(["block-7"])


def test_only_tp_rank_0_writes_an_mla_page_and_every_rank_reads_it(sglang_engines):
    engine = sglang_engines()
    pool = engine.backend.tiers["kv"].codec.pool
    socket = {"socket": sglang_engines.daemon.socket, "capacity": "16MiB", "interface_v1": 1}
    ranks = []
    for rank in (0, 1):
        store = HisparseStore(storage_config(tp_rank=rank, tp_size=2, model_name="zai-org/GLM-test",
                                             extra_config=socket))
        store.register_mem_pool_host(pool)
        ranks.append(store)
    # MLA KV: one namespace for both ranks (the rank is not part of it)
    assert ranks[0].tiers["kv"].namespace == ranks[1].tiers["kv"].namespace
    keys = page_keys("tp", 2)
    src, pages = host_pages(engine, 2, seed=8)
    assert ranks[1].batch_set_v1(keys, src) == [True] * 2  # reported done: rank 0 writes
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[0].batch_set_v1(keys, src) == [True] * 2
    dst, _ = host_pages(engine, 2, seed=9)
    assert ranks[1].batch_exists(keys) == 2 and ranks[1].batch_get_v1(keys, dst) == [True] * 2
    assert torch.equal(read_back(engine, dst, 2), pages)
    for store in ranks:
        store.close()


def test_non_mla_pools_are_per_tp_rank():
    from hisparse.sglang.namespace import PoolGeometry, derive_namespace

    g = PoolGeometry("kv", "MHATokenToKVPoolHost", "layer_first", "bfloat16", 2, 0, 4, 512, 4096, False)
    mha = [derive_namespace(g, storage_config(is_mla_model=False, tp_rank=r, tp_size=2)) for r in (0, 1)]
    assert mha[0] != mha[1]
    m = PoolGeometry("kv", "MLATokenToKVPoolHost", "page_first", "bfloat16", 2, 0, 4, 128, 1024, True)
    mla = [derive_namespace(m, storage_config(tp_rank=r, tp_size=2)) for r in (0, 1)]
    assert mla[0] == mla[1]
    assert derive_namespace(m, storage_config(model_name="other")) != mla[0]
    assert derive_namespace(m, storage_config(pp_rank=1, pp_size=2)) != mla[0]


def test_sidecar_pools_through_the_v2_calls(sglang_engines):
    # A second pool (as SGLang registers the DSA indexer's) lives in a namespace of its own.
    engine = sglang_engines()
    store = engine.backend
    pool = store.tiers["kv"].codec.pool
    store.register_mem_host_pool_v2(pool, PoolName.INDEXER)
    assert store.tiers["indexer"].namespace != store.tiers["kv"].namespace
    keys = page_keys("dsa", 3)
    src, pages = host_pages(engine, 3, seed=10)
    assert store.batch_set_v1(keys, src) == [True] * 3
    only_two = PoolTransfer(name=PoolName.INDEXER, keys=keys[:2], host_indices=src[:2 * pool.page_size])
    assert store.batch_set_v2([only_two]) == {"indexer": [True] * 2}

    # the usable prefix is where both pools have the page
    result = store.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER)])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (2, {"kv": 3, "indexer": 2})
    dst, _ = host_pages(engine, 2, seed=11)
    got = store.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys[:2],
                                           host_indices=dst[:2 * pool.page_size])])
    assert got == {"indexer": [True, True]}
    assert torch.equal(read_back(engine, dst, 2), pages[:2])


def test_wrong_sglang_version_is_refused(monkeypatch):
    assert check_sglang_version() == "0.5.23"
    with pytest.raises(UnsupportedSglangVersion, match=r"supports SGLang 0\.5\.23 only; this is SGLang 0\.5\.24"):
        check_sglang_version("0.5.24")
    import hisparse.sglang.store as store_module

    monkeypatch.setattr(store_module, "check_sglang_version",
                        lambda: check_sglang_version("0.6.0"))
    with pytest.raises(UnsupportedSglangVersion, match="0.6.0"):
        HisparseStore(storage_config())


def test_interface_v1_and_known_keys_are_required():
    with pytest.raises(InvalidArgument, match="interface_v1"):
        HisparseStore(storage_config(extra_config={}))
    with pytest.raises(InvalidArgument, match="unknown extra-config keys.*'capacty'"):
        HisparseStore(storage_config(extra_config={"interface_v1": 1, "capacty": "1GiB"}))


def test_a_set_that_a_clear_voided_answers_false(sglang_engines, monkeypatch):
    # A clear between the set's reserve and its commit: the daemon frees those pages at the
    # commit (``cleared``). The set answered True for pages the namespace does not hold.
    from hisparse.client.backends import cpu
    from hisparse.protocol import Op
    from tests.rawclient import RawClient

    engine = sglang_engines()
    store, tier = engine.backend, engine.backend.tiers["kv"]
    keys = page_keys("voided", 3)
    src, _ = host_pages(engine, 3, seed=9)
    daemon = sglang_engines.daemon
    admin = RawClient(daemon.socket)
    admin.hello()
    real = cpu.CpuBackend.scatter

    def scatter_after_a_clear(self, region, page_ids, pages, rows):
        admin.call(Op.CLEAR, token=daemon.token, namespace=tier.namespace)
        return real(self, region, page_ids, pages, rows)

    try:
        monkeypatch.setattr(cpu.CpuBackend, "scatter", scatter_after_a_clear)
        assert store.batch_set_v1(keys, src) == [False] * 3
        monkeypatch.setattr(cpu.CpuBackend, "scatter", real)
        assert tier.counters["stored_pages"] == 0
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, src) == [True] * 3  # after the clear: stored
    finally:
        admin.close()
