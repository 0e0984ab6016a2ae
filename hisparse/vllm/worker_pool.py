"""Which host pool vLLM's HiSparse worker gets: the namespace's region, in every start-up order.

vLLM 0.34 asks for the HiSparse host pool in ``init_hisparse_kv_cache``
(``vllm.v1.hisparse.binding``) through ``runtime.get_hisparse_host_pool``,
memoised per ``instance_id``. When that first happens depends on the
settings, and the connector is not always built first:

==========================================  ==========================================
settings                                    first request for the host pool
==========================================  ==========================================
extensible KV cache on (CUDA's default)     ``initialize_kv_cache(extensible=True)``,
                                            before the connector (built in
                                            ``extend_kv_cache``)
extensible off, CUDA graphs on              ``profile_cudagraph_memory``'s minimal KV
                                            cache, before the connector
extensible off, CUDA graphs off             ``initialize_kv_cache``, after the connector
==========================================  ==========================================

So the pool is installed by ``install_hook`` (``hisparse.vllm.plugin``, a
``vllm.general_plugins`` entry point that vLLM loads in every worker
process before it builds anything): vLLM's lookup is wrapped, and for an
engine configured with our ``HiSparseConnector`` the first lookup makes a
``RegionHostPool``. vLLM never allocates a private pool then.

Without the hook (the entry point not installed, or ``VLLM_PLUGINS``
leaving ``hisparse`` out), the connector calls ``adopt_or_install`` when it
is built: a private pool vLLM allocated that no layer uses any more (the
CUDA-graph profiling cache, torn down) is unregistered and dropped, and the
region takes its place; one that layers still read and write (extensible
KV cache) is refused with ``HostPoolBypassed``, naming the two ways out.

TP > 1: every rank maps the one region, and the pool presents itself to
vLLM as its shared pool (``RegionHostPool.shared_region``), so vLLM's own
rule applies: TP rank 0 writes each spill, row mirror and host copy, the
other ranks only read, ordered by its IPC events. Where vLLM does not use a
shared pool (``hisparse_shared_host_pool`` False at TP > 1), every rank
would write: refused at start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hisparse.errors import InvalidArgument
from hisparse.vllm.config import AdapterConfig
from hisparse.vllm.host_region import HostGeometry, check_geometry, derive_namespace, region_host_pool_class

log = logging.getLogger(__name__)

CONNECTOR_NAME = "HiSparseConnector"
CONNECTOR_MODULE = "hisparse.vllm.hisparse_connector"


class HostPoolBypassed(InvalidArgument):
    """vLLM bound its own private host pool before the node pool could be installed."""


def connector_entry(kv_transfer_config: Any) -> Mapping[str, Any] | None:
    """Our ``HiSparseConnector``'s ``kv_connector_extra_config``, alone or in a MultiConnector; else None."""
    if kv_transfer_config is None:
        return None
    if kv_transfer_config.kv_connector == "MultiConnector":
        entries = (kv_transfer_config.kv_connector_extra_config or {}).get("connectors", [])
    else:
        entries = [{"kv_connector": kv_transfer_config.kv_connector,
                    "kv_connector_module_path": kv_transfer_config.kv_connector_module_path,
                    "kv_connector_extra_config": kv_transfer_config.kv_connector_extra_config}]
    for entry in entries:
        if (entry.get("kv_connector") == CONNECTOR_NAME
                and entry.get("kv_connector_module_path") == CONNECTOR_MODULE):
            return entry.get("kv_connector_extra_config") or {}
    return None


def pool_namespace(vllm_config: Any, geometry: HostGeometry, settings: AdapterConfig) -> str:
    """The namespace whose region is this engine's host pool (settings' own, else derived)."""
    return settings.namespace or derive_namespace(
        model=str(vllm_config.model_config.model), kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        geometry=geometry, hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        tp_size=vllm_config.parallel_config.tensor_parallel_size)


def region_info(client: Any) -> dict[str, int]:
    """The region a client mapped, in the fields ``check_geometry`` compares."""
    g = client.session.region.geometry
    lay = g.layout
    return {"num_pages": g.num_pages, "num_layers": lay.num_layers, "block_tokens": lay.block_tokens,
            "row_bytes": lay.row_bytes, "page_bytes": lay.page_bytes, "size_bytes": g.size_bytes,
            "layer_stride_bytes": g.layer_stride_bytes}


def attach_host_region(namespace: str, geometry: HostGeometry, settings: AdapterConfig, name: str) -> Any:
    """Attach to the namespace (creating it at vLLM's host pool size) and check its geometry."""
    from hisparse.client import attach

    client = attach(namespace, geometry.layout, socket=settings.socket, capacity=geometry.region_bytes,
                    timeout_s=settings.timeout_s, name=name)
    try:
        check_geometry(geometry, region_info(client), namespace)
    except BaseException:
        client.close()
        raise
    return client


def check_one_writer(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse TP > 1 unless vLLM treats the pool as shared (then TP rank 0 alone writes)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 and not kv_cache_config.hisparse_shared_host_pool:
        raise InvalidArgument(
            f"hisparse HiSparse host pool at TP {parallel.tensor_parallel_size}: vLLM does not run this "
            "engine with a shared host pool, so every TP rank would write each spill into the node "
            "pool. vLLM shares it (one writer, TP rank 0) with --distributed-executor-backend mp, "
            "pipeline, prefill- and decode-context parallel size 1, all TP ranks on one node, and a "
            "platform whose HiSparse backend supports shared host pools (CUDA)")


def build_region_pool(vllm_config: Any, kv_cache_config: Any, settings: AdapterConfig) -> Any:
    """A ``RegionHostPool`` over this engine's namespace (attached, geometry checked, not yet mapped in)."""
    import torch

    from hisparse.vllm.versions import check_vllm_version

    check_vllm_version()
    check_one_writer(vllm_config, kv_cache_config)
    geometry = HostGeometry.from_kv_cache_config(kv_cache_config)
    namespace = pool_namespace(vllm_config, geometry, settings)
    client = attach_host_region(namespace, geometry, settings,
                                f"vllm hisparse worker {vllm_config.instance_id}")
    device_index = torch.cuda.current_device() if torch.cuda.is_available() else None
    try:
        pool = region_host_pool_class()(vllm_config, kv_cache_config, client=client, geometry=geometry,
                                        device_index=device_index)
    except BaseException:
        client.close()
        raise
    log.info("hisparse: vLLM's HiSparse host pool is namespace %r (%d pages of %d B)", namespace,
             geometry.num_blocks, geometry.layout.page_bytes)
    return pool


def is_region_pool(pool: Any) -> bool:
    return pool is not None and getattr(pool, "is_hisparse_region", False)


def pool_in_use(vllm_config: Any, pool: Any) -> bool:
    """Whether any attention layer's HiSparse runtime is bound to ``pool``."""
    context = vllm_config.compilation_config.static_forward_context
    for layer in context.values():
        cache = getattr(layer, "hisparse_cache", None)
        if cache is not None and getattr(cache.runtime, "host_pool", None) is pool:
            return True
    return False


def release_private_pool(pool: Any) -> int:
    """Unregister and drop vLLM's own pool (no layer uses it); returns the bytes it held."""
    from vllm.v1.hisparse.runtime import release_pinned_state

    held = pool.registered.numel() if pool.registered is not None else 0
    release_pinned_state(pool.pinned, pool.shared_region)
    if pool.pinned:
        raise HostPoolBypassed("vLLM's private HiSparse host pool could not be unregistered; "
                               "not starting with a second pinned pool beside the node pool")
    pool.backing = pool.registered = pool.shared_region = None
    return held


def adopt_or_install(vllm_config: Any, kv_cache_config: Any, settings: AdapterConfig) -> Any:
    """The connector's side: the region pool vLLM's worker uses, made now if the hook did not."""
    from vllm.v1.hisparse import runtime

    key = vllm_config.instance_id
    pool = runtime._host_pools.get(key)
    if is_region_pool(pool):
        return pool
    if pool is not None and pool.backing is not None:
        if pool_in_use(vllm_config, pool):
            raise HostPoolBypassed(
                "vLLM bound its own HiSparse host pool before the hisparse connector existed "
                "(the extensible KV cache, on by default on CUDA, initialises the KV cache first), "
                "so its kernels would bypass the hisparsed node pool. Load the hisparse vLLM plugin "
                "(installed with the hisparse package as the `vllm.general_plugins` entry point "
                "`hisparse`; if VLLM_PLUGINS is set it must name `hisparse`), or start vLLM with "
                "--no-enable-extensible-kv-cache")
        freed = release_private_pool(pool)
        log.info("hisparse: released vLLM's private HiSparse host pool (%d B, CUDA-graph profiling); "
                 "the node pool replaces it", freed)
    pool = build_region_pool(vllm_config, kv_cache_config, settings)
    runtime._host_pools[key] = pool
    return pool


_original_get_pool: Any = None


def install_hook() -> None:
    """Wrap vLLM's host-pool lookup so the first one makes our pool (idempotent)."""
    global _original_get_pool
    from vllm.v1.hisparse import binding, runtime

    if _original_get_pool is not None:
        return
    _original_get_pool = runtime.get_hisparse_host_pool

    def get_hisparse_host_pool(vllm_config: Any, kv_cache_config: Any) -> Any:
        pools = runtime._host_pools
        if vllm_config.instance_id not in pools:
            extra = connector_entry(vllm_config.kv_transfer_config)
            if extra is not None:
                settings = AdapterConfig.from_extra_config(extra)
                pools[vllm_config.instance_id] = build_region_pool(vllm_config, kv_cache_config, settings)
        return _original_get_pool(vllm_config, kv_cache_config)

    get_hisparse_host_pool.__wrapped__ = _original_get_pool  # type: ignore[attr-defined]
    runtime.get_hisparse_host_pool = get_hisparse_host_pool
    binding.get_hisparse_host_pool = get_hisparse_host_pool


def uninstall_hook() -> None:
    """Put vLLM's own lookup back (tests)."""
    global _original_get_pool
    from vllm.v1.hisparse import binding, runtime

    if _original_get_pool is None:
        return
    runtime.get_hisparse_host_pool = _original_get_pool
    binding.get_hisparse_host_pool = _original_get_pool
    _original_get_pool = None


def hook_installed() -> bool:
    return _original_get_pool is not None
