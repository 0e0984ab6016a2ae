"""vLLM 0.34's worker side on CPU: its real start-up order and connector step loop, no model.

Real vLLM code run here: ``Worker.initialize_from_config`` and
``Worker.extend_kv_cache`` (the two start-up orders: extensible KV cache on,
where the KV cache comes first and the connector in ``extend_kv_cache``;
off, where the connector comes first), ``GPUModelRunner.profile_cudagraph_memory``
(CUDA graphs on: vLLM's minimal profiling KV cache and its teardown),
``ExtensibleKVCache``, ``pad_kv_cache_segments``, ``extend_kv_cache``,
``ensure_kv_transfer_initialized`` (which builds our connector through
vLLM's factory), ``init_kv_cache`` -> ``init_hisparse_kv_cache`` (the host
pool lookup, allocation, views, ``bind_hisparse_kv_caches``),
``rebind_hisparse_device_caches``, ``bind_kv_caches``, ``get_kv_connector``
(``ActiveKVConnector``: ``pre_forward``, ``finish_forward``,
``post_forward``), ``create_hisparse_cache_handle`` (``HiSparseRuntime``),
``HiSparseConnectorWorker`` whole (``register_kv_caches``, ``start_step``,
restores, host copies, row mirrors, page spills, invalidation, events), and
``HiSparseCacheHandle.finish_kv_update``.

Stand-ins besides the CUDA boundary (``cpu_device``, listed there):

- ``KVRunner`` replaces ``GPUModelRunner`` around its KV cache: its
  ``initialize_kv_cache`` makes the ``ExtensibleKVCache`` and calls vLLM's
  ``init_kv_cache`` and ``get_kv_connector`` as the real one does, but
  builds no attention backends, metadata builders, CUDA-graph manager or
  model state (they need a model); ``capture_model`` captures nothing.
- ``HostBlockTables`` replaces ``BlockTables`` (UVA buffers): the two
  tensors HiSparse binds, ``input_block_tables`` and ``slot_mappings``.
- ``SparseMLALayer`` stands for an attention layer: its HiSparse cache
  handle (vLLM's) and its bound ``kv_cache``.
- ``forward``: the model's KV writes. Each scheduled token's row, in every
  layer, is ``engine.token_bytes`` of (layer, token), written at the slot
  vLLM's block table names (block id of the resident group * block size +
  offset), then each layer calls vLLM's ``finish_kv_update``.
"""

from __future__ import annotations

from contextlib import nullcontext
from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.vllm_hisparse.real_engine import BLOCK_TOKENS, MLA_HEAD, NUM_LAYERS, layer_specs

TOP_K = 64


class SparseMLALayer:
    """An attention layer as HiSparse binding and the connector worker see it."""

    kv_sharing_target_layer_name = None
    is_draft_layer = False

    def __init__(self, hisparse_cache: Any = None) -> None:
        self.hisparse_cache = hisparse_cache
        self.kv_cache = torch.tensor([])

    def bind_kv_cache(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


class HostBlockTables:
    """The two tensors of ``BlockTables`` that HiSparse binds to."""

    def __init__(self, kv_cache_config: Any, max_num_reqs: int, max_num_tokens: int, max_model_len: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.input_block_tables = [
            torch.zeros(max_num_reqs, -(-max_model_len // g.kv_cache_spec.block_size) + 1, dtype=torch.int32)
            for g in groups]
        self.slot_mappings = torch.zeros(len(groups), max_num_tokens, dtype=torch.int64)


class _GraphManager:
    pool = None
    use_breakable_cg = False
    _capture_descs: dict[Any, Any] = {}


class KVRunner:
    """``GPUModelRunner``'s KV cache part (module docstring); vLLM's functions do the work."""

    def __init__(self, vllm_config: Any, cudagraphs: bool) -> None:
        self.vllm_config = vllm_config
        self.cache_config = vllm_config.cache_config
        self.compilation_config = vllm_config.compilation_config
        self.lora_config = None
        self.speculator = None
        self.model = None
        self.device = torch.device("cpu")
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.cudagraphs = cudagraphs
        self.model_state = SimpleNamespace(supports_mm_inputs=False)
        self.eplb = SimpleNamespace(suppress=nullcontext)
        self.cudagraph_manager: Any = None
        self.extensible_kv_cache: Any = None
        self.kv_caches: list[Any] = []
        self.attn_groups: list[Any] = []
        self.kv_caches_by_layer: dict[str, Any] = {}
        self.kv_connector: Any = None
        self.init_calls: list[str] = []

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return layer_specs()

    def needs_cudagraph_capture(self) -> bool:
        return self.cudagraphs

    def capture_model(self, *, profile_only: bool = False) -> int:
        return 0

    def maybe_remove_all_loras(self, lora_config: Any) -> None:
        return

    def initialize_kv_cache(self, kv_cache_config: Any, is_profiling: bool = False,
                            kv_cache_allocation_context: Any = None, extensible: bool = False) -> None:
        from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache, kv_cache_export_handle_types
        from vllm.v1.worker.gpu.attn_utils import init_kv_cache
        from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR, get_kv_connector

        self.init_calls.append("profiling" if is_profiling else "extensible" if extensible else "full")
        kv_cache_config = deepcopy(kv_cache_config)
        self.kv_cache_config = kv_cache_config
        layout = self.cache_config.get_resolved_kv_cache_layout()
        self.extensible_kv_cache = (
            ExtensibleKVCache(kv_cache_config, self.device, layout,
                              export_handle_types=kv_cache_export_handle_types(self.vllm_config))
            if extensible else None)
        self.block_tables = HostBlockTables(kv_cache_config, self.max_num_reqs, self.max_num_tokens,
                                            self.vllm_config.model_config.max_model_len)
        self.kernel_block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.attn_groups = [[] for _ in kv_cache_config.kv_cache_groups]
        self.cudagraph_manager = _GraphManager()
        kv_caches = init_kv_cache(
            self.compilation_config.static_forward_context, kv_cache_config, self.device,
            self.kernel_block_sizes, self.vllm_config, kv_cache_allocation_context=kv_cache_allocation_context,
            block_tables=self.block_tables,
            allocate=self.extensible_kv_cache.allocate if self.extensible_kv_cache is not None else None)
        self.kv_caches = [cache for cache in kv_caches.values() if cache.device == self.device]
        if is_profiling:
            self.kv_connector = NO_OP_KV_CONNECTOR
        else:
            self.kv_caches_by_layer = kv_caches
            self.kv_connector = get_kv_connector(self.vllm_config, kv_caches)


def add_layers(vllm_config: Any) -> dict[str, SparseMLALayer]:
    """The model's attention and indexer layers, with vLLM's HiSparse cache handles, in the forward context."""
    from vllm.v1.hisparse.runtime import create_hisparse_cache_handle

    context = vllm_config.compilation_config.static_forward_context
    layers: dict[str, SparseMLALayer] = {}
    for i in range(NUM_LAYERS):
        handle = create_hisparse_cache_handle(vllm_config, TOP_K, is_index_group_leader=True, row_width=MLA_HEAD,
                                              kv_dtype=torch.bfloat16, device=torch.device("cpu"))
        layers[f"model.layers.{i}.self_attn.attn"] = SparseMLALayer(handle)
        context[f"model.layers.{i}.self_attn.indexer.k_cache"] = SparseMLALayer()
    context.update(layers)
    return layers


def make_worker(vllm_config: Any, runner: KVRunner) -> Any:
    """vLLM's ``Worker``, with what its ``__init__`` (device and distributed set-up) would have set."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)
    worker.vllm_config = vllm_config
    worker.cache_config = vllm_config.cache_config
    worker.model_config = vllm_config.model_config
    worker.parallel_config = vllm_config.parallel_config
    worker.model_runner = runner
    worker.peak_activation_memory = 0
    # The CuMem allocator pool: none, as on CUDA without sleep mode.
    worker._maybe_get_memory_pool_context = lambda tag: nullcontext()
    return worker


@dataclass
class Started:
    worker: Any
    runner: KVRunner
    layers: dict[str, SparseMLALayer]
    connector: Any  # our HiSparseConnector (worker role)
    agent: Any = None  # what vLLM built: ours, or the MultiConnector holding it


def start(vllm_config: Any, kv_cache_config: Any, *, cudagraphs: bool) -> Started:
    """Start-up as ``EngineCore`` drives the worker: profile, initialise from config, then extend.

    ``determine_available_memory``'s part that matters here is
    ``profile_cudagraph_memory`` (the model profiling run needs a model).
    """
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    kv_transfer_state._KV_CONNECTOR_AGENT = None  # each worker is its own process
    layers = add_layers(vllm_config)
    runner = KVRunner(vllm_config, cudagraphs)
    worker = make_worker(vllm_config, runner)
    if cudagraphs:
        from vllm.config import CUDAGraphMode

        # What CUDA's platform resolves (the CPU one turns graphs off); HiSparse refuses FULL.
        compilation = vllm_config.compilation_config
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        compilation.max_cudagraph_capture_size = compilation.max_cudagraph_capture_size or runner.max_num_reqs
        GPUModelRunner.profile_cudagraph_memory(runner)
    worker.initialize_from_config(kv_cache_config)
    if vllm_config.cache_config.enable_extensible_kv_cache:
        worker.extend_kv_cache(kv_cache_config.num_blocks)
    agent = kv_transfer_state._KV_CONNECTOR_AGENT
    connector = next(c for c in getattr(agent, "_connectors", [agent]) if hasattr(c, "worker_pool"))
    return Started(worker, runner, layers, connector, agent)


def host_views(started: Started) -> dict[str, tuple[int, int]]:
    """Every host view the connector worker copies into or reads from: name -> (address, bytes)."""
    worker = started.connector.connector_worker
    views: dict[str, tuple[int, int]] = {}
    for index, cache in enumerate(worker.host_caches):
        views[f"worker.host_caches[{index}]"] = (cache.data_ptr(), cache.nbytes)
    for name, layer in started.layers.items():
        runtime = layer.hisparse_cache.runtime
        views[f"{name}.runtime.host_cache"] = (runtime.host_cache.data_ptr(), runtime.host_cache.nbytes)
        views[f"{name}.runtime.registered_host_pool"] = (runtime.registered_host_pool.data_ptr(),
                                                         runtime.registered_host_pool.nbytes)
        views[f"{name}.kv_cache"] = (layer.kv_cache.data_ptr(), layer.kv_cache.nbytes)
        host = started.runner.kv_caches_by_layer[name]
        views[f"kv_caches_by_layer[{name}]"] = (host.data_ptr(), host.nbytes)
    return views


def outside(views: dict[str, tuple[int, int]], address: int, size: int) -> list[str]:
    """The views not wholly inside [address, address + size)."""
    return [name for name, (start, n) in views.items() if not (address <= start and start + n <= address + size)]


def rows_of(tokens: list[int], layer: int, row_bytes: int) -> np.ndarray:
    from tests.vllm_hisparse.engine import token_bytes

    return token_bytes(tokens, row_bytes, layer)


BLOCK = BLOCK_TOKENS

