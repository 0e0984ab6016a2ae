"""HiSparseOffloadingWorker on CPU: real copies between vLLM's device pointers and region pages."""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import ReqContext

from hisparse.client import attach
from hisparse.layout import KVLayout
from hisparse.vllm.manager import HiSparseLoadStoreSpec
from hisparse.vllm.worker import PagePlan
from tests.vllm.conftest import block_bytes, device_pointers, req, run_jobs, settle, settled_lookups, to_keys


def store_blocks(engine, caches, ints: list[int], block_ids: list[int], job_id: int = 1, **ptr_kw):
    """The scheduler's and the worker's halves of one store, as the connector runs them."""
    manager, worker = engine.manager, engine.worker(caches)
    out = manager.prepare_store(to_keys(ints), req())
    assert out.keys_to_store == to_keys(ints)
    worker.submit_store(job_id, device_pointers(caches, block_ids, **ptr_kw), out.store_spec)
    assert run_jobs(worker, {job_id}) == {job_id: True}
    manager.complete_store(out.keys_to_store, req())
    settle(manager)
    return out


def load_blocks(engine, caches, ints: list[int], block_ids: list[int], job_id: int = 2,
                ctx: ReqContext | None = None, **ptr_kw) -> bool:
    ctx = ctx or req("load")
    manager, worker = engine.manager, engine.workers[0]
    settled_lookups(manager, to_keys(ints), ctx)
    spec = manager.prepare_load(to_keys(ints), ctx)
    worker.submit_load(job_id, spec, device_pointers(caches, block_ids, **ptr_kw))
    ok = run_jobs(worker, {job_id})[job_id]
    manager.complete_load(to_keys(ints), ctx)
    return ok


def test_round_trip_is_byte_exact(engines):
    engine = engines()
    src = engine.kv_caches(seed=1)
    store_blocks(engine, src, [1, 2, 3], [5, 9, 2])

    # the region holds vLLM layer l of each block in region layer l
    with attach(engine.spec.namespace, engine.spec.layout, socket=engines.daemon.socket) as c:
        with c.pin(to_keys([1, 2, 3])) as pin:
            for i, block in enumerate([5, 9, 2]):
                view = pin.view(i).numpy()
                for layer in range(2):
                    assert view[layer].tobytes() == block_bytes(src, 0, layer, block)

    # and loads back into other blocks of other caches, byte for byte
    dst = engine.kv_caches(seed=2)
    assert load_blocks(engine, dst, [1, 2, 3], [0, 30, 17])
    for block_src, block_dst in zip([5, 9, 2], [0, 30, 17]):
        for layer in range(2):
            assert block_bytes(dst, 0, layer, block_dst) == block_bytes(src, 0, layer, block_src)
    # blocks not named were not written
    assert block_bytes(dst, 0, 0, 1) == block_bytes(engine.kv_caches(seed=2), 0, 0, 1)


def test_another_engine_loads_what_one_stored(engines):
    a = engines(engine_id="engine-a")
    b = engines(engine_id="engine-b")
    src = a.kv_caches(seed=3)
    store_blocks(a, src, [1, 2], [4, 6])
    dst = b.kv_caches(seed=4)
    b.worker(dst)
    assert load_blocks(b, dst, [1, 2], [10, 11])
    for s, d in zip([4, 6], [10, 11]):
        assert block_bytes(dst, 0, 1, d) == block_bytes(src, 0, 1, s)


def test_chunks_of_several_blocks_with_an_unaligned_start(engines):
    # two vLLM blocks per offloaded chunk; a load may start mid-chunk
    engine = engines(blocks_per_chunk=2)
    assert engine.spec.layout == KVLayout(num_layers=2, block_tokens=8, row_bytes=16)
    src = engine.kv_caches(seed=5)
    store_blocks(engine, src, [1, 2], [3, 4, 7, 8])

    dst = engine.kv_caches(seed=6)
    # block index 1: skip the first block of chunk [1], load its second and all of [2]
    assert load_blocks(engine, dst, [1, 2], [20, 21, 22], group_sizes=[3], block_indices=[1])
    for s, d in zip([4, 7, 8], [20, 21, 22]):
        for layer in range(2):
            assert block_bytes(dst, 0, layer, d) == block_bytes(src, 0, layer, s)


def test_two_groups_of_unequal_layers(engines):
    # group 0: layers of 64 and 32 bytes per block; group 1: one layer of 48 (4 tokens per block)
    engine = engines(groups=((2, 4), (1, 4)), worker_kv_bytes_per_block=144)
    sizes = [[64, 32], [48]]
    src = engine.kv_caches(sizes, seed=7)
    manager, worker = engine.manager, engine.worker(src)
    keys = to_keys([1, 2], group=0) + to_keys([1, 2], group=1)
    out = manager.prepare_store(keys, req())
    ptrs = device_pointers(src, [3, 4, 5, 6], group_sizes=[2, 2], block_indices=[0, 0])
    worker.submit_store(1, ptrs, out.store_spec)
    assert run_jobs(worker, {1}) == {1: True}
    manager.complete_store(keys, req())
    settle(manager)

    dst = engine.kv_caches(sizes, seed=8)
    settled_lookups(manager, keys, req("l"))
    spec = manager.prepare_load(keys, req("l"))
    worker.submit_load(2, spec, device_pointers(dst, [9, 10, 11, 12], group_sizes=[2, 2], block_indices=[0, 0]))
    assert run_jobs(worker, {2}) == {2: True}
    for group, pairs in ((0, [(3, 9), (4, 10)]), (1, [(5, 11), (6, 12)])):
        for ref in range(len(sizes[group])):
            for s, d in pairs:
                assert block_bytes(dst, group, ref, d) == block_bytes(src, group, ref, s)


def test_tensor_parallel_ranks_share_a_page(engines):
    # two ranks holding distinct halves of each block: each writes its share of the page
    ranks = [engines(world_size=2, rank=r, engine_id="tp") for r in (0, 1)]
    assert ranks[0].spec.namespace == ranks[1].spec.namespace
    assert ranks[0].spec.layout.row_bytes == 32  # both copies of 16-byte rows
    caches = [rank.kv_caches(seed=10 + r) for r, rank in enumerate(ranks)]
    out = ranks[0].manager.prepare_store(to_keys([1]), req())
    for r, rank in enumerate(ranks):
        rank.worker(caches[r]).submit_store(1, device_pointers(caches[r], [2]), out.store_spec)
        assert run_jobs(rank.workers[0], {1}) == {1: True}
    ranks[0].manager.complete_store(to_keys([1]), req())
    settle(ranks[0].manager)

    settled_lookups(ranks[0].manager, to_keys([1]), req("l"))
    spec = ranks[0].manager.prepare_load(to_keys([1]), req("l"))
    for r, rank in enumerate(ranks):
        dst = rank.kv_caches(seed=20 + r)
        rank.workers[0].submit_load(2, spec, device_pointers(dst, [5]))
        assert run_jobs(rank.workers[0], {2}) == {2: True}
        for layer in range(2):
            assert block_bytes(dst, 0, layer, 5) == block_bytes(caches[r], 0, layer, 2)
    ranks[0].manager.complete_load(to_keys([1]), req("l"))


def test_worker_refuses_caches_larger_than_the_page(engines):
    engine = engines()
    with pytest.raises(Exception, match="needs 256 B per chunk"):
        engine.worker(engine.kv_caches([[128, 128]]))


def test_page_plan_splits_at_layer_slices():
    # 3 layers of 24-byte slices; refs of 20 and 30 bytes pack across slice ends
    plan = PagePlan(KVLayout(3, 4, 6), [[20, 30]], blocks_per_chunk=1, copies=1, copy_index=0)
    first, second = plan.pieces[0][0][0], plan.pieces[0][1][0]
    assert first.layer.tolist() == [0] and first.size.tolist() == [20]
    assert second.layer.tolist() == [0, 1, 2] and second.size.tolist() == [4, 24, 2]
    assert second.within.tolist() == [20, 0, 0] and second.src_offset.tolist() == [0, 4, 28]


def test_load_spec_with_a_missing_page_fails_only_that_job(engines):
    engine = engines()
    src = engine.kv_caches(seed=1)
    store_blocks(engine, src, [1], [3])
    worker = engine.workers[0]
    worker.submit_load(5, HiSparseLoadStoreSpec([-1]), device_pointers(src, [4]))
    assert run_jobs(worker, {5}) == {5: False}
    assert block_bytes(src, 0, 0, 4) == block_bytes(engine.kv_caches(seed=1), 0, 0, 4)  # untouched
    # the next load on the same lane runs as usual
    dst = engine.kv_caches(seed=2)
    assert load_blocks(engine, dst, [1], [4], job_id=6)
    assert block_bytes(dst, 0, 0, 4) == block_bytes(src, 0, 0, 3)
