"""One SGLang "engine" on CPU: SGLang 0.5.23's own cache stack with hisparsed as its HiCache storage.

What runs is SGLang's: ``UnifiedRadixCache`` over an ``MLATokenToKVPool``
(DeepSeek/GLM's KV), ``init_hicache`` with ``--hicache-storage-backend
dynamic`` loading ``hisparse.sglang.store.HisparseStore`` by module path, the
``HybridCacheController`` with its prefetch and backup threads, and the MLA
host pool, driven through SGLang's unit-test kit
(``sglang.test.kits.unified_radix_cache``). The only replacements are the
three CPU stand-ins of ``tests.sglang.cpu_stubs``.

``put(tokens)`` fills the KV of a prefix with seeded bytes on "GPU", backs it
up to the host pool and on to storage, and returns those bytes; ``get(tokens)``
asks a fresh request's prefix from storage (SGLang's ``prefetch_from_storage``),
loads it back to "GPU" and returns what arrived there.
"""

from __future__ import annotations

import contextlib
import json
import time
import unittest
from array import array
from typing import Any

import torch

from tests.sglang import cpu_stubs

cpu_stubs.install()

from unittest import mock  # noqa: E402

from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.tree_core_registry import _TREE_CORE_REGISTRY  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin  # noqa: E402
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures  # noqa: E402
from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import (  # noqa: E402
    UnifiedTreeCoreInspector,
)

STORE = {"backend_name": "hisparse", "module_path": "hisparse.sglang.store",
         "class_name": "HisparseStore", "interface_v1": 1}


class _Kit(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    """SGLang's kit helpers need a TestCase to report through; this one only hosts them."""

    def runTest(self) -> None:  # pragma: no cover
        pass


class Engine:
    def __init__(self, socket: str, *, model: str = "zai-org/GLM-test", page_size: int = 4,
                 layers: int = 3, kv_lora_rank: int = 48, rope_dim: int = 16,
                 dtype: torch.dtype = torch.bfloat16, host_layout: str = "layer_first",
                 mode: str = "buffer_only", kv_size: int = 512, extra: dict[str, Any] | None = None,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.page_size = page_size
        self.kit = kit = _Kit()
        kit.cfg = CacheConfig(page_size=page_size, kv_size=kv_size, max_context_len=kv_size,
                              num_layers=layers, dtype=dtype)
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(get_parallel().override(tp_rank=tp_rank, tp_size=tp_size,
                                                         pp_rank=0, pp_size=1))
        args = dict(model_path="dummy", served_model_name=model, page_size=page_size)
        set_global_server_args_for_scheduler(ServerArgs(**args))
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=kv_size, device="cpu",
                                                enable_memory_saver=False)
        self.kv_pool = MLATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype,
                                        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
                                        layer_num=layers, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=kv_size, dtype=dtype, device="cpu",
                                                kvcache=self.kv_pool, need_sort=False)
        params = CacheInitParams(req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=page_size,
                                 disable=False, tree_components=kit.cfg.components,
                                 eviction_policy="lru")
        # The kit's tree core (python, with its inspection interface), as build_fixture makes it.
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"), \
                mock.patch.dict(_TREE_CORE_REGISTRY,
                                {"python": lambda p, components: UnifiedTreeCoreInspector(p, components)}):
            self.cache = cache = UnifiedRadixCache(params=params)
        cache.cache_init_params = params
        server_args = ServerArgs(
            **args, hicache_io_backend="kernel", hicache_write_policy="write_through",
            hicache_mem_layout=host_layout, hicache_host_memory_mode=mode,
            hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend_extra_config=json.dumps(
                {**STORE, "socket": socket, "prefetch_threshold": 1, **(extra or {})}))
        set_global_server_args_for_scheduler(server_args)
        cache.init_hicache(server_args, params)
        drop_hicache_atexit_pin(cache)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        controller = cache.cache_controller
        controller.prefetch_capacity_limit = max(controller.prefetch_capacity_limit,
                                                 controller.mem_pool_host.size)
        self.backend = controller.storage_backend
        self._rid = 0

    # -- helpers --

    def _rows(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV rows of ``indices`` in every layer, as bytes: uint8 [layers, tokens, row_bytes]."""
        row_bytes = self.kv_pool.kv_buffer[0][0].numel() * self.kv_pool.kv_buffer[0].element_size()
        return torch.stack([self.kv_pool.kv_buffer[layer][indices.long()].view(torch.uint8).reshape(
            len(indices), row_bytes) for layer in range(self.kv_pool.layer_num)])

    def _key(self, tokens: list[int]) -> RadixKey:
        return RadixKey(array("q", tokens))

    # -- the two directions --

    def put(self, tokens: list[int], seed: int) -> torch.Tensor:
        """Compute (seeded bytes) and cache ``tokens``, write them through to storage; their KV bytes."""
        kit = self.kit
        kit._insert(self.cache, self.allocator, self.req_to_token_pool, tokens)
        leaf = self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens))).last_device_node
        indices = self.cache.path_device_indices(leaf)
        gen = torch.Generator().manual_seed(seed)
        for layer in range(self.kv_pool.layer_num):
            buf = self.kv_pool.kv_buffer[layer]
            noise = torch.randint(0, 256, (len(indices), buf[0].numel() * buf.element_size()),
                                  dtype=torch.uint8, generator=gen)
            buf[indices.long()] = noise.view(buf.dtype).reshape(len(indices), *buf.shape[1:])
        expected = self._rows(indices)
        if self.cache.buffer_pipeline is not None:
            kit._buffer_backup_and_wait(self.cache, leaf)
        else:
            kit._backup_node(self.cache, leaf)
            kit._write_path_to_l3(self.cache, leaf)
            kit._flush_l3_backups(self.cache)
        return expected

    def get(self, tokens: list[int], timeout_s: float = 20.0) -> torch.Tensor:
        """Ask storage for ``tokens`` as a new request would; the KV bytes that reached the device."""
        self._rid += 1
        req_id = f"req-{self._rid}"
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        handle = CacheRequestHandle(req_id, 0)
        self.cache.prefetch_from_storage(handle, self.cache.root_node_handle(), array("q", tokens),
                                         None, None)
        self.kit._run_prefetch_to_completion(self.cache, handle, timeout=timeout_s)
        match = self.cache.match_prefix(MatchPrefixParams(key=self._key(tokens)))
        node, root = match.last_device_node, self.cache.root_node_handle()
        if match.last_host_node not in (node, root):  # cache mode: the prefix landed on the host tier
            self.kit._load_back_node(self.cache, match.last_host_node)
            node = match.last_host_node
        if node == root:
            return self._rows(torch.empty(0, dtype=torch.int64))
        return self._rows(self.cache.path_device_indices(node))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cache.cache_controller._stop_storage_threads()
        with contextlib.suppress(Exception):
            self.cache.release_host_resources()
        self.backend.close()
        self._exit.close()


LINKER = {"linker": "HisparseLinker", "linker_module_path": "hisparse.sglang.linker"}


class LinkerEngine:
    """An SGLang cache with the direct external linker (no HiCache, no host pool) on hisparsed.

    SGLang's own plumbing: ``create_unified_cache_linker`` (backend ``dynamic``)
    builds ``hisparse.sglang.linker.HisparseLinker`` from its module path,
    ``UnifiedRadixCache.init_cache_linker`` wraps it, and the tree drives it:
    an insert's write-through offloads, ``match_prefix`` looks up, the
    wrapper's ``load_back`` queues a load, ``ready_to_load_host_cache``
    starts it, the layer counter is consumed as a forward would, and
    ``finish_loads`` reports whether every layer landed.
    """

    def __init__(self, socket: str, *, model: str = "zai-org/GLM-test", page_size: int = 64,
                 layers: int = 3, kv_lora_rank: int = 48, rope_dim: int = 16,
                 dtype: torch.dtype = torch.bfloat16, kv_size: int = 512,
                 extra: dict[str, Any] | None = None) -> None:
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

        self.kit = kit = _Kit()
        kit.cfg = CacheConfig(page_size=page_size, kv_size=kv_size, max_context_len=kv_size,
                              num_layers=layers, dtype=dtype)
        self.page_size = page_size
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                                         attn_dcp_size=1))
        server_args = ServerArgs(model_path="dummy", served_model_name=model, page_size=page_size)
        set_global_server_args_for_scheduler(server_args)
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=kv_size, device="cpu",
                                                enable_memory_saver=False)
        # DeepSeek-V3.2 / GLM-5's pool: MLA KV plus the DSA indexer's keys (a row per page)
        self.kv_pool = DSATokenToKVPool(size=kv_size, page_size=page_size, kv_lora_rank=kv_lora_rank,
                                        dtype=dtype, qk_rope_head_dim=rope_dim, layer_num=layers,
                                        device="cpu", index_head_dim=128, enable_memory_saver=False,
                                        kv_cache_dim=kv_lora_rank + rope_dim)
        self.allocator = TokenToKVPoolAllocator(size=kv_size, dtype=dtype, device="cpu",
                                                kvcache=self.kv_pool, need_sort=False)
        params = CacheInitParams(req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=page_size,
                                 disable=False, tree_components=kit.cfg.components,
                                 eviction_policy="lru")
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"), \
                mock.patch.dict(_TREE_CORE_REGISTRY,
                                {"python": lambda p, components: UnifiedTreeCoreInspector(p, components)}):
            self.cache = UnifiedRadixCache(params=params)
        self.linker = create_unified_cache_linker(
            server_args, params, backend="dynamic",
            config={**LINKER, "linker_extra_config": {"socket": socket, **(extra or {})}},
            components={ComponentType.FULL})
        self.cache.init_cache_linker(self.linker)
        self._rid = 0

    _rows = Engine._rows

    def _index_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """The indexer rows of the pages of ``indices`` in every layer: uint8 [layers, pages, bytes]."""
        pages = indices[::self.page_size].long() // self.page_size
        return torch.stack([buf[pages] for buf in self.kv_pool.index_k_with_scale_buffer])

    def put(self, tokens: list[int], seed: int, timeout_s: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute (seeded bytes) and insert ``tokens``; the write-through offload lands; (KV, indexer) bytes."""
        value = self.insert(tokens, seed)
        wrapper = self.cache.linker
        deadline = time.monotonic() + timeout_s
        while wrapper.pending_offloads:
            assert time.monotonic() < deadline, "linker offload did not complete"
            self.cache.check_hicache_events()
            time.sleep(0.01)
        return self._rows(value), self._index_rows(value)

    def insert(self, tokens: list[int], seed: int) -> torch.Tensor:
        """Compute (seeded bytes) and insert ``tokens``, queueing their offload; their device slots."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        value = self.allocator.alloc(len(tokens))
        assert value is not None, "the device pool is full"
        gen = torch.Generator().manual_seed(seed)
        for layer in range(self.kv_pool.layer_num):
            buf = self.kv_pool.kv_buffer[layer]
            noise = torch.randint(0, 256, (len(tokens), buf[0].numel() * buf.element_size()),
                                  dtype=torch.uint8, generator=gen)
            buf[value.long()] = noise.view(buf.dtype).reshape(len(tokens), *buf.shape[1:])
            index = self.kv_pool.index_k_with_scale_buffer[layer]
            pages = value[::self.page_size].long() // self.page_size
            index[pages] = torch.randint(0, 256, (len(pages), index.shape[1]), dtype=torch.uint8, generator=gen)
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
        self.offload(tokens)
        return value

    def offload(self, tokens: list[int]) -> None:
        """Write ``tokens``' node through (the insert's own write-through, else ``offload_nodes``)."""
        wrapper = self.cache.linker
        if not wrapper.pending_offloads:  # not written through by the insert itself: offload its node
            leaf = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).last_device_node
            wrapper.offload_nodes([leaf])

    def get(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Match and load ``tokens`` as the scheduler would: (KV bytes, indexer bytes, failed rids)."""
        req = self.match(tokens)
        if req is None:
            empty = torch.empty(0, dtype=torch.int64)
            return self._rows(empty), self._index_rows(empty), []
        (kv, indexer), failed = self.load([req])
        return kv[0], indexer[0], failed

    def match(self, tokens: list[int]) -> Any:
        """A new request's ``match_prefix`` (the linker's lookup): the request, or None on no hit."""
        req = self.kit._make_req(self.req_to_token_pool)
        self._rid += 1
        req.rid = f"linker-req-{self._rid}"
        self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
        if self.cache.linker.has_hit(req.rid):
            return req
        self.req_to_token_pool.free(req)  # a miss: the request would compute; its row is not needed here
        return None

    def load(self, reqs: list[Any]) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor]], list[str]]:
        """One batch: load the requests' hits, consume the layers as a forward would, finish:
        ((KV bytes per request, indexer bytes per request), failed rids)."""
        wrapper = self.cache.linker
        rows = []
        for req in reqs:
            loaded, _ = wrapper.load_back(req)
            rows.append(wrapper.private_load_indices[req.rid][:loaded])
        index = self.cache.ready_to_load_host_cache()
        counter = wrapper.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.kv_pool.layer_num):  # the forward waits on each layer
            counter.wait_until(layer)
        failed = wrapper.finish_loads()
        return ([self._rows(r) for r in rows], [self._index_rows(r) for r in rows]), failed

    def close(self) -> None:
        self.linker.close()
        self._exit.close()
