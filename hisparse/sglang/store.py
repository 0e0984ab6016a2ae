"""``HisparseStore``: hisparsed as SGLang's HiCache storage (``--hicache-storage-backend dynamic``).

SGLang builds the class from ``--hicache-storage-backend-extra-config``::

    {"backend_name": "hisparse", "module_path": "hisparse.sglang.store",
     "class_name": "HisparseStore", "interface_v1": 1}

as ``HisparseStore(storage_config, {})``, before any host pool exists; the
pools arrive through ``register_mem_pool_host`` (the KV pool) and
``register_mem_host_pool_v2`` (sidecars: the DSA indexer, ...), and each
becomes a ``PoolTier`` on a namespace of its own. The KV pool is served by
the v1 calls (``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``),
sidecars by the v2 calls (``PoolTransfer`` lists). Run it with
``--hicache-host-memory-mode buffer_only``: the node tier is then the
lasting host tier and SGLang's own host pool only stages pages between GPU
and the region. See docs/sglang.md.

Only ``interface_v1`` is supported: the deprecated flat-copy calls
(``get`` / ``batch_get`` / ``set`` / ``batch_set``) hand pages over in the
host pool's layout with no slot index, which is neither zero-copy nor
layout-stable, so the backend refuses to start without ``"interface_v1": 1``.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from hisparse.errors import HisparseError, InvalidArgument, LayoutMismatch
from hisparse.sglang.config import SglangConfig
from hisparse.sglang.namespace import derive_namespace, pool_geometry
from hisparse.sglang.tier import PoolTier
from hisparse.sglang.versions import check_sglang_version

log = logging.getLogger(__name__)

KV_POOL = "kv"


class HisparseStore(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.sglang_version = check_sglang_version()
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise InvalidArgument('hisparse.sglang.store.HisparseStore needs "interface_v1": 1 in '
                                  "--hicache-storage-backend-extra-config (the zero-copy calls)")
        self.storage_config = storage_config
        self.config = SglangConfig.parse(extra)
        self.tiers: dict[str, PoolTier] = {}

    # -- pools --

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.add_pool(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.add_pool(str(host_pool_name), host_pool)

    def namespace_for(self, pool: str, host_pool: Any) -> str:
        if self.config.namespace:
            return f"{self.config.namespace}/{pool}"
        return derive_namespace(pool_geometry(host_pool, pool), self.storage_config)

    def add_pool(self, pool: str, host_pool: Any) -> PoolTier:
        """The pool's tier, attached now (a layout mismatch raises; an absent daemon does not)."""
        tier = self.tiers.get(pool)
        if tier is not None:
            return tier
        c = self.storage_config
        geometry = pool_geometry(host_pool, pool)
        namespace = self.namespace_for(pool, host_pool)
        # MLA KV is one copy for every TP rank: only the storage writer stores it.
        writer = c.is_storage_writer or not (c.is_mla_model and pool == KV_POOL)
        tier = PoolTier(self.config, host_pool, geometry, namespace, writer=writer,
                        name=f"sglang {pool} tp{c.tp_rank}")
        try:
            tier.connect()
        except LayoutMismatch as exc:
            raise LayoutMismatch(
                f"layout mismatch: hisparsed namespace {namespace!r} holds pages of another layout "
                f"than this engine's {pool} pool ({geometry.layout}, {geometry.pool_class} "
                f"{geometry.host_layout} {geometry.dtype}); {exc}") from exc
        self.tiers[pool] = tier
        return tier

    def _tier(self, pool: str) -> PoolTier:
        tier = self.tiers.get(pool)
        if tier is None:
            raise InvalidArgument(f"hisparse.sglang: no host pool {pool!r} was registered")
        return tier

    # -- v1: the KV pool --

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._tier(KV_POOL).exists(list(keys))

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._tier(KV_POOL).get(list(keys), host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._tier(KV_POOL).set(list(keys), host_indices)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v2: sidecar pools (the DSA indexer), and the KV pool when it comes this way --

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        kv = self._tier(KV_POOL).exists(list(keys))
        hits: dict[str, int] = {KV_POOL: kv} if kv else {}
        final = kv
        for transfer in pool_transfers or ():
            if final == 0:
                break
            name = str(transfer.name)
            tier = self.tiers.get(name)
            if tier is None:
                final = 0
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                found = tier.exists(list(keys[:final]))
                final = min(final, found)
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                tail = list(transfer.keys or keys[final - 1:final])
                found = len(tail) if tier.exists(tail) == len(tail) else 0
                final = final if found else 0
            else:
                log.warning("hisparse.sglang: pool %s asks for hit policy %s, not supported; "
                            "its prefix is a miss", name, transfer.hit_policy)
                found, final = 0, 0
            if found:
                hits[name] = found
        return PoolTransferResult(final, hits, list(range(1, final + 1)))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): self._tier(str(t.name)).get(list(t.keys or ()), t.host_indices)
                for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): self._tier(str(t.name)).set(list(t.keys or ()), t.host_indices)
                for t in transfers}

    # -- the deprecated flat-copy interface: refused (see the module docstring) --

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError('HisparseStore serves the v1/v2 calls only ("interface_v1": 1)')

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError('HisparseStore serves the v1/v2 calls only ("interface_v1": 1)')

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError('HisparseStore serves the v1/v2 calls only ("interface_v1": 1)')

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError('HisparseStore serves the v1/v2 calls only ("interface_v1": 1)')

    # -- the rest --

    def clear(self) -> None:
        # The node tier outlives engines by design; clearing a namespace is an admin op.
        log.info("hisparse.sglang: clear() leaves the node tier as it is (hisparsectl clear NAMESPACE)")

    def get_stats(self) -> dict[str, Any]:
        return {pool: {**tier.counters, "held_pages": len(tier.holds), "gate_up": tier.gate.up,
                       "namespace": tier.namespace} for pool, tier in self.tiers.items()}

    def close(self) -> None:
        for tier in self.tiers.values():
            try:
                tier.close()
            except HisparseError as exc:
                log.debug("closing %s: %s", tier.namespace, exc)
