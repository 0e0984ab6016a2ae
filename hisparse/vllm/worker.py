"""``HiSparseOffloadingWorker``: copies between vLLM's KV blocks and region pages.

Placement (``PagePlan``). A key is one chunk (``blocks_per_chunk`` vLLM
blocks) of one cache group, and owns one region page. vLLM describes a
worker's blocks as per-group lists of data refs (``CanonicalKVCaches``:
usually one ref per layer), each ref ``s`` bytes per block. Worker copy
``c`` of ``copies`` (its rank when each rank holds distinct bytes, else 0)
owns the page's logical bytes ``[c*share, (c+1)*share)``, ``share =
page_bytes // copies``, and packs its refs there ref-major::

    offset(ref d, block j of the chunk) = c*share + bpc*(s_0 + ... + s_{d-1}) + j*s_d

A page's logical bytes are layer-major (``hisparse.layout``): logical offset
``o`` is region layer ``o // (bt*rb)``, at ``o % (bt*rb)`` inside that layer's
slice of the page, so a copy that crosses a layer slice splits in two. For
one group of equal layers and one copy, ``bt*rb == bpc*s`` and ref ``d`` is
exactly region layer ``d``: vLLM's layer ``l`` lives in region layer ``l``,
one vLLM block per ``s`` bytes. Engines that share a namespace have the
same refs, so they agree on every offset.

Fencing: each job's spec names the fence of the scheduler's session that
reserved or pinned its pages (``HiSparseLoadStoreSpec.fence_path``); the copy
engine copies only under ``hisparse.client.fence.hold`` on it, and a lost hold
fails the job (``hisparse.vllm.transfer``). A load spec with a page ``-1``
(a key the scheduler does not hold) fails its job without copying.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from hisparse.errors import InvalidArgument
from hisparse.vllm.compat import DevicePointers, iter_pointer_groups
from hisparse.layout import KVLayout
from hisparse.vllm.rpc import NamespaceOps
from hisparse.vllm.transfer import CopyEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pieces:
    """Where the ``s`` bytes of one (ref, block-in-chunk) go: one or more runs inside a page."""

    src_offset: np.ndarray  # uint64: offset inside the vLLM block
    layer: np.ndarray  # uint64: region layer
    within: np.ndarray  # uint64: offset inside that layer's slice of the page
    size: np.ndarray  # uint64


class PagePlan:
    """This worker's placement of its blocks inside a page (see the module docstring)."""

    def __init__(self, layout: KVLayout, ref_sizes: list[list[int]], blocks_per_chunk: int,
                 copies: int, copy_index: int) -> None:
        if not 0 <= copy_index < copies:
            raise InvalidArgument(f"copy {copy_index} of {copies}")
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        layer_bytes = layout.layer_page_bytes
        share = layout.page_bytes // copies
        self.pieces: list[list[list[Pieces]]] = []  # [group][ref][block in chunk]
        for g, sizes in enumerate(ref_sizes):
            need = blocks_per_chunk * sum(sizes)
            if need > share:
                raise InvalidArgument(
                    f"cache group {g} needs {need} B per chunk and copy, but a page of {layout} "
                    f"gives each of {copies} copies {share} B: the namespace's layout does not match "
                    "this worker's KV cache (see hisparse.vllm.namespace.derive_layout)")
            group: list[list[Pieces]] = []
            offset = copy_index * share
            for s in sizes:
                group.append([_split(offset + j * s, s, layer_bytes) for j in range(blocks_per_chunk)])
                offset += blocks_per_chunk * s
            self.pieces.append(group)

    @classmethod
    def for_kv_caches(cls, layout: KVLayout, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                      copies: int, copy_index: int) -> PagePlan:
        sizes = [[ref.page_size_bytes for ref in refs] for refs in kv_caches.group_data_refs]
        return cls(layout, sizes, blocks_per_chunk, copies, copy_index)

    def descriptors(self, device_ptrs: DevicePointers, page_ids: np.ndarray, region_address: int,
                    num_pages: int, to_region: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, size) uint64 arrays moving ``device_ptrs``'s blocks to/from ``page_ids``."""
        layer_bytes = np.uint64(self.layout.layer_page_bytes)
        layer_stride = np.uint64(num_pages * self.layout.layer_page_bytes)
        base = np.uint64(region_address)
        pages = np.asarray(page_ids, dtype=np.int64)
        if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
            raise InvalidArgument(f"page ids out of range 0..{num_pages - 1}: {pages.min()}..{pages.max()}")
        dev_out: list[np.ndarray] = []
        host_out: list[np.ndarray] = []
        size_out: list[np.ndarray] = []
        chunk_offset = 0
        bpc = self.blocks_per_chunk
        for info in iter_pointer_groups(device_ptrs, bpc):
            k = info.skip + np.arange(info.group_size)
            chunk_pages = pages[chunk_offset:chunk_offset + info.n_chunks].astype(np.uint64)
            if len(chunk_pages) != info.n_chunks:
                raise InvalidArgument(f"group {info.group_idx} needs {info.n_chunks} pages, "
                                      f"the spec has {len(chunk_pages)} left")
            block_page = chunk_pages[k // bpc] * layer_bytes  # page start inside each layer slice
            j_of = k % bpc
            refs = self.pieces[info.group_idx]
            if info.n_data_refs != len(refs):
                raise InvalidArgument(f"group {info.group_idx} has {info.n_data_refs} refs in the "
                                      f"pointers, {len(refs)} in the worker's KV caches")
            for d, per_block in enumerate(refs):
                start = info.dev_ptr_offset + d * info.group_size
                ptrs = device_ptrs.ptrs[start:start + info.group_size].astype(np.uint64)
                for j in range(bpc):
                    mask = j_of == j
                    if not mask.any():
                        continue
                    p = per_block[j]
                    dev_out.append((ptrs[mask][:, None] + p.src_offset[None, :]).ravel())
                    host = (base + p.layer * layer_stride + p.within)[None, :] + block_page[mask][:, None]
                    host_out.append(host.ravel())
                    size_out.append(np.broadcast_to(p.size, (int(mask.sum()), len(p.size))).ravel())
            chunk_offset += info.n_chunks
        if chunk_offset != len(pages):
            raise InvalidArgument(f"the spec has {len(pages)} pages, the pointers use {chunk_offset}")
        if not dev_out:
            empty = np.empty(0, dtype=np.uint64)
            return empty, empty, empty
        dev, host, size = np.concatenate(dev_out), np.concatenate(host_out), np.concatenate(size_out)
        return (dev, host, size) if to_region else (host, dev, size)


def _split(offset: int, size: int, layer_bytes: int) -> Pieces:
    """The runs of logical ``[offset, offset+size)``, cut where a layer's slice of the page ends."""
    src, layer, within, sizes = [], [], [], []
    done = 0
    while done < size:
        o = offset + done
        n = min(size - done, layer_bytes - o % layer_bytes)
        src.append(done)
        layer.append(o // layer_bytes)
        within.append(o % layer_bytes)
        sizes.append(n)
        done += n
    return Pieces(*(np.array(v, dtype=np.uint64) for v in (src, layer, within, sizes)))


class HiSparseOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV caches and the namespace's region; never blocks on submit."""

    def __init__(self, ops: NamespaceOps, plan: PagePlan, engine: CopyEngine,
                 cuda_device: int | None = None, kv_caches: CanonicalKVCaches | None = None) -> None:
        self._ops = ops
        self.kv_caches = kv_caches  # what block ids address, on releases that pass them (compat)
        self._plan = plan
        self._engine = engine
        self._cuda_device = cuda_device  # register the region with this GPU before copying
        self._registered: set[int] = set()
        self._region()  # a failed CUDA registration fails the engine's start, not every job

    def _region(self) -> tuple[int, int]:
        # Looked up per job: after a daemon restart the client may have remapped it.
        region = self._ops.region()
        if self._cuda_device is not None and region.address not in self._registered:
            from hisparse.client.backends import cuda

            cuda.register(region, self._cuda_device)  # once per mapping; raises rather than copy pageable
            self._registered.add(region.address)
        return region.address, region.geometry.num_pages

    def submit_store(self, job_id: int, device_ptrs: DevicePointers, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        return self._submit(job_id, "store", device_ptrs, dst_spec.block_ids, to_region=True,
                            fence_path=getattr(dst_spec, "fence_path", None))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs: DevicePointers,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        if (src_spec.block_ids < 0).any():
            # The manager could not pin every key (evicted since lookup): vLLM recomputes.
            self._engine.fail(job_id)
            return True
        lane = "expedited" if expedited else "load"
        return self._submit(job_id, lane, device_ptrs, src_spec.block_ids, to_region=False,
                            fence_path=getattr(src_spec, "fence_path", None))

    def _submit(self, job_id: int, lane: str, device_ptrs: DevicePointers, page_ids: np.ndarray,
                to_region: bool, fence_path: str | None) -> bool:
        try:
            address, num_pages = self._region()
            src, dst, sizes = self._plan.descriptors(device_ptrs, page_ids, address, num_pages, to_region)
        except Exception:
            # A failed job, not a dead worker: vLLM drops the store or recomputes the load.
            log.exception("hisparse %s job %d could not be planned", lane, job_id)
            self._engine.fail(job_id)
            return True
        self._engine.submit(job_id, lane, src, dst, sizes, fence_path)
        return True

    def get_finished(self) -> list[TransferResult]:
        return self._engine.finished()

    def wait(self, job_ids: set[int]) -> None:
        self._engine.wait(job_ids)

    def shutdown(self) -> None:
        self._engine.shutdown()
        self._ops.client.close()
