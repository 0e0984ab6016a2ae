"""vLLM HiSparse's host pool as a hisparsed namespace region: geometry, namespace, worker mapping.

vLLM 0.34 lays the HiSparse host pool out LBNHC: host layer ``l``'s
blocks form one slab ``[host_num_blocks, block_size, row]`` at
``l * host_num_blocks * page_bytes_of_one_layer``. A region with
``num_pages = host_num_blocks`` and ``KVLayout(num_layers, block_size,
row_bytes)`` is byte for byte that pool, so a host block id is a page id.

``HostGeometry`` reads what vLLM computed (``KVCacheConfig``'s host
tensors, ``hisparse_host_num_blocks``, ``hisparse_host_block_stride``) and
``check_geometry`` refuses a region that differs, naming what to change.
``RegionHostPool`` replaces ``HiSparseHostPool`` on the worker: it maps
the region and registers it with the driver in hisparse's chunks (at most
64 GiB each, cut where ``host_registration_ranges`` allows, so no block
spans two registrations).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hisparse.errors import InvalidArgument, LayoutMismatch
from hisparse.layout import KVLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

NAMESPACE_SCHEMA = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._/-]+")


class GeometryMismatch(LayoutMismatch):
    """The namespace's region is not the host pool vLLM computed for this engine."""


@dataclass(frozen=True)
class HostGeometry:
    """The host pool vLLM computed, in hisparse's terms."""

    layer_names: tuple[str, ...]
    block_tokens: int
    row_bytes: int
    num_blocks: int  # hisparse_host_num_blocks
    block_stride_bytes: int  # hisparse_host_block_stride (4096-aligned when TP ranks share)
    tensor_sizes: tuple[int, ...]  # one per host layer, in address order (HiSparseHostPool's list)
    size_bytes: int  # the host tensor size vLLM allocates

    @classmethod
    def from_kv_cache_config(cls, config: Any) -> HostGeometry:
        num_blocks = config.hisparse_host_num_blocks
        if num_blocks is None:
            raise InvalidArgument("KVCacheConfig has no HiSparse host pool (hisparse_host_num_blocks)")
        (group_id,) = config.host_group_ids
        block_tokens = int(config.kv_cache_groups[group_id].kv_cache_spec.block_size)
        host = [t for t in config.kv_cache_tensors if t.host_resident]
        if not host:
            raise InvalidArgument("KVCacheConfig has no host-resident KV tensor")
        placed = sorted((t.offset + i * t.layer_stride, t.layer_stride, name)
                        for t in host for i, name in enumerate(t.layers))
        strides = {stride for _, stride, _ in placed}
        if len(strides) != 1:
            raise InvalidArgument(f"HiSparse host layers of unequal sizes {sorted(strides)}: a hisparse "
                                  "region needs one row size for every layer")
        (layer_bytes,) = strides
        page_layer_bytes, rest = divmod(layer_bytes, num_blocks)
        row_bytes, rest2 = divmod(page_layer_bytes, block_tokens)
        if rest or rest2:
            raise InvalidArgument(f"host layer of {layer_bytes} B is not {num_blocks} blocks of "
                                  f"{block_tokens} equal rows")
        for index, (offset, _, name) in enumerate(placed):
            if offset != index * layer_bytes:
                raise InvalidArgument(f"host layer {name} sits at byte {offset}, not {index * layer_bytes}: "
                                      "the host pool is not layer-major")
        (size_bytes,) = {t.size for t in host}
        return cls(layer_names=tuple(name for _, _, name in placed), block_tokens=block_tokens,
                   row_bytes=row_bytes, num_blocks=int(num_blocks),
                   block_stride_bytes=int(config.hisparse_host_block_stride or page_layer_bytes * len(placed)),
                   tensor_sizes=tuple(layer_bytes for _ in placed), size_bytes=int(size_bytes))

    @property
    def layout(self) -> KVLayout:
        return KVLayout(num_layers=len(self.layer_names), block_tokens=self.block_tokens,
                        row_bytes=self.row_bytes)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.layout.page_bytes

    def registration_ranges(self, max_chunk_bytes: int) -> tuple[tuple[int, int], ...]:
        """vLLM's rule for cutting the pool into registrations, at hisparse's chunk size."""
        from vllm.utils.host_memory import host_registration_ranges

        total = -(-self.region_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        return host_registration_ranges(list(self.tensor_sizes), self.num_blocks, total, max_chunk_bytes)


def check_geometry(geometry: HostGeometry, region_info: dict[str, Any], namespace: str) -> None:
    """Raise ``GeometryMismatch`` unless the region is exactly the pool vLLM computed."""
    layout = geometry.layout
    want = {"num_pages": geometry.num_blocks, "num_layers": layout.num_layers,
            "block_tokens": layout.block_tokens, "row_bytes": layout.row_bytes,
            "page_bytes": layout.page_bytes, "size_bytes": geometry.region_bytes,
            "layer_stride_bytes": geometry.num_blocks * layout.layer_page_bytes}
    wrong = {k: (region_info.get(k), v) for k, v in want.items() if region_info.get(k) != v}
    if geometry.size_bytes != geometry.region_bytes:
        wrong["host tensor size_bytes"] = (geometry.size_bytes, geometry.region_bytes)
    if geometry.block_stride_bytes % mmap.PAGESIZE and geometry.block_stride_bytes != layout.page_bytes:
        wrong["host_block_stride"] = (geometry.block_stride_bytes, layout.page_bytes)
    if not wrong:
        return
    detail = ", ".join(f"{k}: region {got}, vLLM {exp}" for k, (got, exp) in wrong.items())
    region_pages = region_info.get("num_pages")
    hint = ""
    if "num_pages" in wrong and isinstance(region_pages, int):
        hint = (f". Every engine sharing {namespace!r} needs the same host pool: set host_pool_gib so "
                f"that vLLM computes {region_pages} host blocks (host_pool_gib = "
                f"{region_pages * geometry.block_stride_bytes / 2**30:.6f}), or give the namespace "
                f"{geometry.num_blocks} pages (`[namespaces.\"{namespace}\"] capacity = "
                f"\"{geometry.region_bytes}\"` in hisparsed.toml, after `hisparsectl clear`)")
    raise GeometryMismatch(f"hisparsed namespace {namespace!r} is not this engine's HiSparse host "
                           f"pool: {detail}{hint}")


def derive_namespace(*, model: str, kv_cache_dtype: str, geometry: HostGeometry, hash_algo: str,
                     tp_size: int) -> str:
    """``vllm-hisparse/<model>/<dtype>/tp<T>/<digest>``: what makes host pages interchangeable.

    The page count is left out on purpose: engines configured with another
    host_pool_gib land in the same namespace and ``check_geometry`` tells them.
    """
    fields = {"schema": NAMESPACE_SCHEMA, "engine": "vllm-hisparse", "model": model,
              "kv_cache_dtype": kv_cache_dtype, "layers": list(geometry.layer_names),
              "block_tokens": geometry.block_tokens, "row_bytes": geometry.row_bytes,
              "hash_algo": hash_algo, "tp": tp_size}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    name = _UNSAFE.sub("_", model).strip("/")[-96:] or "model"
    return f"vllm-hisparse/{name}/{_UNSAFE.sub('_', kv_cache_dtype)}/tp{tp_size}/{digest}"


class RegionShare:
    """What vLLM's HiSparse worker needs of a shared host pool, for the region.

    vLLM gives its worker ``host_pool.shared_region`` when TP ranks share one
    pool; the worker then lets TP rank 0 alone write (spills, row mirrors,
    host copies) and orders the readers on its IPC events. The region is
    that pool: ``base_tensor`` is its mapping; ``cleanup`` leaves it to the
    hisparse client, which unmaps it when the pool closes.
    """

    def __init__(self, base_tensor: torch.Tensor) -> None:
        self.base_tensor = base_tensor

    def cleanup(self) -> None:
        return


def region_host_pool_class() -> type:
    """``RegionHostPool``, a ``HiSparseHostPool`` subclass (built on first use: imports vLLM's runtime)."""
    from vllm.v1.hisparse.runtime import HiSparseHostPool

    class RegionHostPool(HiSparseHostPool):
        """The worker's host pool: the namespace's region, mapped and registered once.

        ``is_hisparse_region`` tells ``worker_pool`` it is ours. With TP > 1
        (vLLM's ``hisparse_shared_host_pool``) it carries a ``RegionShare``
        as ``shared_region``, so vLLM's one-writer rule applies.
        """

        is_hisparse_region = True

        def __init__(self, vllm_config: Any, kv_cache_config: Any, *, client: Any,
                     geometry: HostGeometry, device_index: int | None) -> None:
            super().__init__(vllm_config, kv_cache_config)
            self.client = client
            self.geometry = geometry
            self.device_index = device_index
            self.region_key: tuple[str, int] | None = None  # the region mapped, for vLLM's handshake

        def allocate(self, size: int) -> torch.Tensor:
            import torch

            if self.backing is not None:
                assert self.backing.numel() == size, "HiSparse host pool size changed."
                return self.backing
            if size != self.geometry.region_bytes:
                raise GeometryMismatch(f"vLLM asks for a {size} B host pool; the region holds "
                                       f"{self.geometry.region_bytes} B")
            session = self.client.session
            region = session.region
            # For good: the scheduler's pool must address this region (region_guard), even
            # after this client re-attaches to a new one.
            self.region_key = session.region_key
            if self.device_index is not None:
                from hisparse.client.backends import cuda

                ranges = self.geometry.registration_ranges(cuda.MAX_REGISTER_CHUNK_BYTES)
                cuda.register(region, self.device_index, ranges=ranges)
            self.registered = torch.from_numpy(region.array).view(torch.int8)
            self.backing = self.registered[:size]
            self.pinned = []  # registered for the life of the process by hisparse
            if getattr(self.kv_cache_config, "hisparse_shared_host_pool", False):
                self.shared_region = RegionShare(self.registered)
            return self.backing

        def close(self) -> None:
            """Detach from the namespace (the worker has stopped copying)."""
            self.client.close()

    return RegionHostPool
