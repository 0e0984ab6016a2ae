"""``HiSparseConnector``: vLLM 0.34's own HiSparse, with its host pool on a hisparsed namespace.

Opt in with one flag set (the class keeps vLLM's name, which vLLM's config
checks look for; ``kv_connector_module_path`` makes vLLM load ours), beside
the OffloadingConnector that shares the indexer group's blocks::

    --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"connectors":[
        {"kv_connector":"HiSparseConnector","kv_role":"kv_both",
         "kv_connector_module_path":"hisparse.vllm.hisparse_connector",
         "kv_connector_extra_config":{"host_pool_gib":64}},
        {"kv_connector":"OffloadingConnector","kv_role":"kv_both",
         "kv_connector_extra_config":{"spec_name":"HiSparseOffloadingSpec",
                                      "spec_module_path":"hisparse.vllm"}}]}}'

Every engine of the node that runs one model with this flag set draws its
host blocks from one namespace (``host_region.derive_namespace``) through
the daemon. Scheduler side: ``bind_kv_cache_manager`` lets vLLM build its
coordinator, then swaps the host group's ``BlockPool`` for a
``DaemonHostBlockPool`` and has every prefix lookup pin the other engines'
pages it may hit first, and admission hold each running request's growth
(``admission``); ``build_connector_meta`` flushes the step's daemon work
(one batch, sent by the pool's own thread: ``courier``) and names the fence
files the step's pages need. Worker
side: vLLM's host pool is a ``RegionHostPool`` over the region, so vLLM's
HiSparse kernels and copies read and write the node's pages. It is made at
vLLM's first request for the pool by the hook that ``hisparse.vllm.plugin``
(a ``vllm.general_plugins`` entry point) installs, because under vLLM's
defaults (extensible KV cache, CUDA graphs) that request comes *before* this
connector is built; the connector adopts it, or, without the plugin,
replaces a private pool no layer uses or refuses to start
(``worker_pool``). ``start_load_kv`` locks the step's fence files first
(``fences.WorkerFences``). At vLLM's handshake each worker reports the
region it mapped (``RegionHandshake``) and the scheduler's pool checks it
is the one it is bound to (``region_guard``).

Extra config keys besides vLLM's ``host_pool_gib``: ``socket``,
``namespace``, ``timeout_s``, ``hash_algo``, ``mirror_refresh_s``
(``hisparse.vllm.config.AdapterConfig``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector as VllmHiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnectorMetadata
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes

from hisparse.vllm.admission import account_for_growth, reserve_before_admission
from hisparse.vllm.config import AdapterConfig
from hisparse.vllm.fences import WorkerFences
from hisparse.vllm.host_region import HostGeometry
from hisparse.vllm.rpc import NamespaceOps
from hisparse.vllm.versions import check_vllm_version
from hisparse.vllm.worker_pool import (
    adopt_or_install,
    attach_host_region,
    pool_namespace,
    region_info,
)

log = logging.getLogger(__name__)

# worker_pool's attach_host_region and region_info: public here too (re-exported on purpose)
__all__ = ["HiSparseConnector", "HiSparsePoolMetadata", "account_for_growth", "attach_host_region",
           "install_daemon_pool", "pin_before_lookups", "region_info", "reserve_before_admission"]


@dataclass(frozen=True)
class RegionHandshake(KVConnectorHandshakeMetadata):
    """What a worker reports at vLLM's handshake: the region it mapped (``region_guard``)."""

    path: str
    region_id: int


@dataclass
class HiSparsePoolMetadata(HiSparseConnectorMetadata):
    """vLLM's step metadata plus the fence files whose pages the step may touch."""

    fence_paths: tuple[str, ...] = ()


class HiSparseConnector(VllmHiSparseConnector):
    """vLLM's ``HiSparseConnector`` over a hisparsed namespace (module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = AdapterConfig.from_extra_config(transfer.kv_connector_extra_config or {})
        self.geometry = HostGeometry.from_kv_cache_config(kv_cache_config)
        self.namespace = pool_namespace(vllm_config, self.geometry, self.settings)
        self.host_pool: Any = None
        self.worker_pool: Any = None
        self._worker_fences = WorkerFences()
        if role == KVConnectorRole.WORKER:
            # The hook (hisparse.vllm.plugin) normally made the pool already, at vLLM's
            # first request for it; else it is made, or vLLM's own one replaced, here.
            self.worker_pool = adopt_or_install(vllm_config, kv_cache_config, self.settings)
        log.info("hisparse HiSparse host pool: namespace %r, %d pages of %d B", self.namespace,
                 self.geometry.num_blocks, self.geometry.layout.page_bytes)

    # -- scheduler --

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.connector_scheduler is not None and self.connector_scheduler.coordinator is not None
        manager = self.connector_scheduler.coordinator.host_manager
        assert manager is not None
        # No spare stock beyond what admitted requests hold for their growth (admission
        # module): under pressure a spare page idle here is a page another engine waits for.
        self.host_pool = install_daemon_pool(manager, self.namespace, self.geometry, self.settings,
                                             step_blocks=0)
        pin_before_lookups(kv_cache_manager.coordinator, manager, self.host_pool)
        reserve_before_admission(manager, self.host_pool)
        account_for_growth(kv_cache_manager, manager, self.host_pool,
                           max_model_len=int(self._vllm_config.model_config.max_model_len))

    def get_handshake_metadata(self) -> RegionHandshake | None:
        key = getattr(self.worker_pool, "region_key", None)
        return None if key is None else RegionHandshake(*key)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        # Before the first request: every worker must map the region the pool is bound to.
        super().set_xfer_handshake_metadata(metadata)
        if self.host_pool is not None:
            self.host_pool.bind_worker_regions([(m.path, m.region_id) for m in metadata.values()
                                                if isinstance(m, RegionHandshake)])

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self.host_pool is None:
            return meta
        self.host_pool.flush()
        return HiSparsePoolMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)},
                                    fence_paths=self.host_pool.fence_paths())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Before this step's kernels touch the region: its pages stay fenced even
        # if the scheduler process dies while the step runs.
        meta = self._get_connector_metadata()
        self._worker_fences.update(getattr(meta, "fence_paths", ()))
        super().start_load_kv(forward_context, **kwargs)

    def shutdown(self) -> None:
        super().shutdown()
        if self.host_pool is not None:
            self.host_pool.close()
        if self.worker_pool is not None:
            from vllm.v1.hisparse import runtime

            if runtime._host_pools.get(self._vllm_config.instance_id) is self.worker_pool:
                del runtime._host_pools[self._vllm_config.instance_id]
            self.worker_pool.close()
        self._worker_fences.close()


def install_daemon_pool(manager: Any, namespace: str, geometry: HostGeometry, settings: AdapterConfig,
                        *, step_blocks: int) -> Any:
    """Replace the ``SharedEventQueueBlockPool`` ``bind_host_pool`` gave ``manager`` by ours."""
    from hisparse.vllm.hisparse_pool import DaemonHostBlockPool

    old = manager.block_pool
    if any(block.ref_cnt for block in old.blocks[1:]):
        raise RuntimeError("the HiSparse host pool is already in use; swap it before the first request")
    client = attach_host_region(namespace, geometry, settings, "vllm hisparse scheduler")
    try:
        pool = DaemonHostBlockPool(
            NamespaceOps(client), num_blocks=old.num_gpu_blocks, step_blocks=step_blocks,
            block_size=manager.block_size, enable_caching=old.enable_caching,
            hash_block_size=old.hash_block_size, enable_kv_cache_events=old.enable_kv_cache_events,
            event_owner=old._event_owner, metrics_collector=old.metrics_collector,
            mirror_refresh_s=settings.mirror_refresh_s)
    except BaseException:
        client.close()
        raise
    manager.block_pool = pool
    manager._null_block = pool.null_block
    return pool


def pin_before_lookups(kv_coordinator: Any, manager: Any, pool: Any) -> None:
    """Have every prefix lookup pin the host pages of other engines it may hit, first.

    vLLM walks a request's block hashes in ``find_longest_cache_hit``; the
    host group's keys are those hashes at its block size plus its group id.
    """
    original = kv_coordinator.find_longest_cache_hit
    group_id = manager.kv_cache_group_id
    block_size = manager.block_size
    hash_block_size = pool.hash_block_size

    def find_longest_cache_hit(block_hashes: Any, max_cache_hit_length: int) -> Any:
        hashes = resolve_block_hashes(block_hashes, hash_block_size, block_size)
        count = min(len(hashes), max_cache_hit_length // block_size)
        if count:
            pool.pin_prefix([make_block_hash_with_group_id(hashes[i], group_id) for i in range(count)])
        return original(block_hashes, max_cache_hit_length)

    kv_coordinator.find_longest_cache_hit = find_longest_cache_hit
