"""The worker side on a GPU: the region mapped and registered as vLLM HiSparse's host pool, read on device."""

from __future__ import annotations

import pytest
import torch

from hisparse.vllm.hisparse_connector import attach_host_region
from hisparse.vllm.config import AdapterConfig
from hisparse.vllm.host_region import HostGeometry, derive_namespace, region_host_pool_class
from tests.vllm_hisparse.engine import kv_cache_config, token_bytes

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_region_host_pool_registers_in_vllm_ranges_and_kernels_read_it(hisparsed):
    from hisparse.client.backends import cuda

    config = kv_cache_config(64, num_layers=3, block_tokens=64, head_size=328)  # 656-byte rows
    geometry = HostGeometry.from_kv_cache_config(config)
    namespace = derive_namespace(model="org/glm-gpu", kv_cache_dtype="auto", geometry=geometry,
                                 hash_algo="sha256", tp_size=1)
    client = attach_host_region(namespace, geometry, AdapterConfig(socket=hisparsed.socket), "gpu test")
    try:
        pool = region_host_pool_class()(None, config, client=client, geometry=geometry, device_index=0)
        backing = pool.allocate(geometry.size_bytes)
        region = client.session.region
        assert backing.data_ptr() == region.address and backing.numel() == geometry.region_bytes
        reg = cuda.register(region, 0)  # already registered by allocate: the same registration
        assert [(a - region.address, a - region.address + n) for a, n in reg.chunks] == \
            list(geometry.registration_ranges(cuda.MAX_REGISTER_CHUNK_BYTES))
        # host rows written on the CPU side, gathered by a CUDA kernel through the UVA view:
        # what vLLM's HiSparse kernels do with host_block_id * block_size + row
        lay = geometry.layout
        page = 17
        for layer in range(lay.num_layers):
            region.pages_view()[layer, page] = torch.from_numpy(
                token_bytes(list(range(64)), lay.row_bytes, layer).reshape(-1)).numpy()
        rows = torch.arange(page * 64, page * 64 + 64, device="cuda")
        for layer in range(lay.num_layers):
            got = client.layer_rows(layer, device="cuda").index_select(0, rows).cpu()
            assert torch.equal(got, torch.from_numpy(token_bytes(list(range(64)), lay.row_bytes, layer)))
    finally:
        client.close()
