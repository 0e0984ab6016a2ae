"""The CUDA worker path: GPU KV blocks -> registered region pages -> other GPU blocks, byte-exact."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from tests.vllm.conftest import (
    NUM_GPU_BLOCKS,
    block_bytes,
    device_pointers,
    req,
    run_jobs,
    settle,
    settled_lookups,
    to_keys,
)

pytestmark = pytest.mark.gpu


def cuda_caches(sizes: list[int], seed: int) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors, refs = [], []
    for size in sizes:
        t = torch.randint(-128, 128, (NUM_GPU_BLOCKS, size), dtype=torch.int8, generator=gen).cuda()
        tensors.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=size))
        refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1, page_size_bytes=size))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[refs])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_round_trip(engines):
    # GLM-5-like rows (656 bytes, 64-token blocks) over 4 layers, two blocks per chunk
    engine = engines(groups=((4, 64),), layer_block_bytes=64 * 656, blocks_per_chunk=2, capacity_pages=16)
    src = cuda_caches([64 * 656] * 4, seed=1)
    manager, worker = engine.manager, engine.worker(src)
    out = manager.prepare_store(to_keys([1, 2, 3]), req())
    worker.submit_store(1, device_pointers(src, [3, 4, 9, 10, 20, 21]), out.store_spec)
    assert run_jobs(worker, {1}) == {1: True}
    manager.complete_store(out.keys_to_store, req())
    settle(manager)

    dst = cuda_caches([64 * 656] * 4, seed=2)
    settled_lookups(manager, to_keys([1, 2, 3]), req("l"))
    spec = manager.prepare_load(to_keys([1, 2, 3]), req("l"))
    assert spec.fence_path  # the worker copies under the session's fence
    # an expedited load, starting at the second block of the first chunk
    worker.submit_load(2, spec, device_pointers(dst, [5, 6, 7, 8, 11], group_sizes=[5], block_indices=[1]),
                       expedited=True)
    assert run_jobs(worker, {2}) == {2: True}
    manager.complete_load(to_keys([1, 2, 3]), req("l"))
    torch.cuda.synchronize()
    for s, d in zip([4, 9, 10, 20, 21], [5, 6, 7, 8, 11]):
        for layer in range(4):
            assert block_bytes(_on_cpu(dst), 0, layer, d) == block_bytes(_on_cpu(src), 0, layer, s)


def _on_cpu(caches: CanonicalKVCaches) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t.tensor.cpu(), t.page_size_bytes) for t in caches.tensors],
        group_data_refs=caches.group_data_refs)
