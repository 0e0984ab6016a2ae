"""``HiSparseOffloadingSpec``: hisparsed as the tier of vLLM's ``OffloadingConnector``.

vLLM builds one spec per process from the same ``OffloadingConfig``: the
scheduler asks it for a manager, each worker for a worker. Both attach to the
daemon with the namespace and layout derived here, so a page id the
scheduler hands out means the same bytes to every worker::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"HiSparseOffloadingSpec",
      "spec_module_path":"hisparse.vllm"}}'

Construction fails early and clearly for what would otherwise fail quietly
later: a hash algorithm whose keys no other process can match, a sync-load
budget (``engine``), vLLM's canonical layout (not supported), an engine
without KV blocks to size pages by, or no daemon on the socket. It also
makes the engine recompute a load that fails (``engine.prepare_engine``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hisparse.vllm.compat import ConfigInfo  # first: refuses an unsupported vLLM by name

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from hisparse.errors import DaemonUnavailable, InvalidArgument
from hisparse.vllm.compat.adapters import manager_class, worker_class
from hisparse.vllm.config import AdapterConfig
from hisparse.vllm.engine import check_extra_config, find_vllm_config, prepare_engine
from hisparse.vllm.manager import HiSparseOffloadingManager
from hisparse.vllm.metrics import metric_definitions
from hisparse.vllm.namespace import derive_layout, derive_namespace, num_copies
from hisparse.vllm.rpc import NamespaceOps
from hisparse.vllm.transfer import CopyEngine, CpuCopyEngine, CudaCopyEngine
from hisparse.vllm.worker import HiSparseOffloadingWorker, PagePlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiSparseInfo(ConfigInfo):
    """Static facts of the hisparse tier, one series per engine."""

    # The namespace this engine's pages live in.
    hisparse_namespace: str
    # Pages in the namespace's region (one page per offloaded chunk).
    hisparse_num_pages: int
    # Bytes of one page.
    hisparse_page_bytes: int
    # The daemon's socket.
    hisparse_socket: str


class HiSparseOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return HiSparseInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.adapter_config = AdapterConfig.from_extra_config(config.extra_config)
        if config.canonical_layout:
            raise InvalidArgument("HiSparseOffloadingSpec does not support canonical_layout: "
                                  "remove it from kv_connector_extra_config")
        check_extra_config(config.extra_config)
        prepare_engine(self.adapter_config, find_vllm_config())
        # Replicated (MLA under TP): one copy per block, written by rank 0 and
        # read by every rank; vLLM gates the other ranks' stores on this flag.
        self.replicated_layout = config.replicated_layout
        self.layout = derive_layout(config)
        self.namespace = self.adapter_config.namespace or derive_namespace(
            config, self.layout, self.adapter_config.hash_algo)
        self._manager: HiSparseOffloadingManager | None = None
        self._worker: HiSparseOffloadingWorker | None = None
        log.info("hisparse: namespace %r, %s, socket %s", self.namespace, self.layout,
                 self.adapter_config.socket or "(default)")

    def _ops(self, role: str) -> NamespaceOps:
        from hisparse.client import attach

        cfg = self.adapter_config
        try:
            client = attach(self.namespace, self.layout, socket=cfg.socket, capacity=cfg.capacity_bytes,
                            timeout_s=cfg.timeout_s,
                            name=f"vllm {role} engine {self.config.engine_id} rank {self.config.parallel.rank}")
        except DaemonUnavailable as exc:
            raise DaemonUnavailable(
                f"HiSparseOffloadingSpec: no hisparsed answers ({exc}). Start it before the engine "
                "(`systemctl start hisparsed`, or `hisparsed` as the engine's user), or point "
                "kv_connector_extra_config.socket at the socket it listens on") from exc
        return NamespaceOps(client)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            ops = self._ops("scheduler")
            ops.mirror_lookups = True  # its pins report its lookups: the daemon's hit rate counts them
            info = HiSparseInfo(hisparse_namespace=self.namespace, hisparse_num_pages=ops.client.num_pages,
                                hisparse_page_bytes=self.layout.page_bytes,
                                hisparse_socket=ops.client.socket_path)
            self._manager = manager_class()(
                ops, self.adapter_config, enable_events=self.kv_events_config.enable_kv_cache_events,
                info=info.as_config_info())
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            copies = num_copies(self.config)
            plan = PagePlan.for_kv_caches(self.layout, kv_caches, self.blocks_per_chunk, copies,
                                          self.config.parallel.rank if copies > 1 else 0)
            device = kv_caches.tensors[0].tensor.device if kv_caches.tensors else None
            engine: CopyEngine
            cuda_device = None
            if device is None or device.type == "cpu":
                engine = CpuCopyEngine()
            elif device.type == "cuda":
                engine = CudaCopyEngine(device)
                cuda_device = device.index if device.index is not None else 0
            else:
                raise InvalidArgument(f"HiSparseOffloadingSpec has no copy engine for {device}")
            ops = self._ops("worker")
            try:
                self._worker = worker_class()(ops, plan, engine, cuda_device=cuda_device, kv_caches=kv_caches)
            except BaseException:
                ops.client.close()
                engine.shutdown()
                raise
        return self._worker


def _register() -> None:
    """Put the spec in vLLM's registry under its own name, resolved through ``hisparse.vllm``.

    vLLM reaches us through ``spec_module_path`` first; once this module is
    imported, later ``create_spec`` calls (further engines in the process,
    tests) resolve the name from the registry, the same class either way.
    """
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        OffloadingSpecFactory.register_spec("HiSparseOffloadingSpec", "hisparse.vllm", "HiSparseOffloadingSpec")
    except ValueError:
        pass  # already registered (a re-import)


_register()
