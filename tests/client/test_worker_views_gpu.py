"""vLLM HiSparse's worker views of a region on a real GPU, without vLLM (run by scripts/gpu-check).

The device machine has torch and Triton but no vLLM, so this test rebuilds
what ``RegionHostPool.allocate`` and vLLM's ``bind_hisparse_kv_caches`` make of
a region, from hisparse alone: the region registered in the ranges vLLM's
``host_registration_ranges`` cuts for this geometry (``RANGES``, checked
against vLLM itself on CPU by ``tests/vllm_hisparse/test_worker.py``), and
each layer's host cache as the worker holds it (``[num_blocks * block_size,
row]`` over the layer's slab). Then the worker's three copies, on CUDA:
spills (device-to-host into host block ``p``'s rows, as
``swap_blocks_batch`` does), restores (host-to-device, as
``_restore_pages``), and a kernel reading host rows through the UVA view, at
blocks on both sides of every registration cut.
"""

from __future__ import annotations

import pytest
import torch

import hisparse
from hisparse import client

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYOUT = hisparse.KVLayout(num_layers=3, block_tokens=64, row_bytes=656)  # GLM-5's fp8_ds_mla rows
NUM_BLOCKS = 64
MAX_CHUNK_BYTES = 3 << 20
# vllm.utils.host_memory.host_registration_ranges([slab] * 3, 64, 3 * slab, 3 MiB): cuts at
# layer 1's host block 8 and layer 2's host block 16, never inside a block
RANGES = ((0, 3022848), (3022848, 6045696), (6045696, 8060928))
CUT_BLOCKS = (7, 8, 15, 16, 0, NUM_BLOCKS - 1)


def test_region_registered_in_vllms_ranges_takes_spills_restores_and_uva_reads(hisparsed):
    from hisparse.client.backends import cuda

    bt, rb = LAYOUT.block_tokens, LAYOUT.row_bytes
    with client.attach("gpu/worker-views", LAYOUT, socket=hisparsed.socket,
                       capacity=NUM_BLOCKS * LAYOUT.page_bytes) as c:
        region = c.session.region
        assert region.geometry.num_pages == NUM_BLOCKS and region.geometry.size_bytes == RANGES[-1][1]
        reg = cuda.register(region, 0, ranges=RANGES)
        assert [(a - region.address, a - region.address + n) for a, n in reg.chunks] == list(RANGES)
        registered = torch.from_numpy(region.array).view(torch.int8)  # RegionHostPool.registered
        slab = NUM_BLOCKS * bt * rb
        host_caches = [registered[l * slab:(l + 1) * slab].view(torch.uint8).view(-1, rb)
                       for l in range(LAYOUT.num_layers)]  # HiSparseRuntime.host_cache, per layer
        gen = torch.Generator(device="cuda").manual_seed(5)
        resident = torch.randint(0, 256, (LAYOUT.num_layers, len(CUT_BLOCKS), bt, rb), dtype=torch.uint8,
                                 device="cuda", generator=gen)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # the worker's DMA stream: spills
            for l, host in enumerate(host_caches):
                for i, block in enumerate(CUT_BLOCKS):
                    host[block * bt:(block + 1) * bt].copy_(resident[l, i], non_blocking=True)
        stream.synchronize()
        expect = resident.cpu()
        pages = region.pages_view()
        for l in range(LAYOUT.num_layers):
            for i, block in enumerate(CUT_BLOCKS):
                assert torch.equal(torch.from_numpy(pages[l, block].copy()), expect[l, i].reshape(-1)), (l, block)
        restored = torch.empty_like(resident)
        for l, host in enumerate(host_caches):  # restores: host rows back into resident blocks
            for i, block in enumerate(CUT_BLOCKS):
                restored[l, i].copy_(host[block * bt:(block + 1) * bt], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(restored, resident)
        for l in range(LAYOUT.num_layers):  # a kernel gathering host rows through the UVA view
            rows = torch.cat([torch.arange(b * bt, (b + 1) * bt, device="cuda") for b in CUT_BLOCKS])
            got = c.layer_rows(l, device="cuda").index_select(0, rows)
            assert torch.equal(got.view(len(CUT_BLOCKS), bt, rb), resident[l])
