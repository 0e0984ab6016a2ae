"""The linker's data path: lanes (device pools on namespaces) and the layer-by-layer load.

SGLang's assembler resolves the device pools a linker serves (the MLA KV,
a region row per token; the DSA indexer, a region row per page). Each is a
lane: its geometry in hisparse's layout (layer-major, region rows = device
rows), its namespace, its client and the pins its lookups took. An entry
that packs several buffers per layer has no such layout and is refused at
start by name.

A load copies layer by layer out of the pinned pages into the device rows
and reports a layer complete only once its copy has landed (on a GPU: an
event after the layer's copies, synchronized) and every pin it read from is
still held; pins are never released mid-copy by this process, so a pin
still held after the copy means its pages were ours throughout and the bytes
are what was committed. A pin lost before (daemon restart, lease expiry, a
release) fails the batch from that layer on, and ``LoadCounter`` makes the
batch read as failed even if earlier layers completed: SGLang aborts its
requests and they recompute, never on someone else's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter

from hisparse.errors import InvalidArgument, LeaseExpired
from hisparse.sglang.namespace import key_bytes
from hisparse.sglang.holds import PinHolds
from hisparse.sglang.namespace import PoolGeometry


@dataclass
class Lane:
    """One device pool entry on its namespace: KV (a row per token) or the DSA indexer (a row per page)."""

    pool: str
    entry: Any
    geometry: PoolGeometry
    namespace: str
    holds: PinHolds
    client: Any = None

    def device_rows(self, starts: list[int], page_size: int) -> torch.Tensor:
        """The device rows of the pages starting at token slots ``starts``."""
        if self.geometry.page_size == 1:  # rows are pages
            return torch.tensor([s // page_size for s in starts], dtype=torch.int64)
        return torch.cat([s + torch.arange(page_size) for s in starts])

    def region_rows(self, region_pages: list[int]) -> torch.Tensor:
        """The rows of ``region_pages`` in one layer's slab of the region."""
        block = self.geometry.page_size
        return torch.cat([p * block + torch.arange(block) for p in region_pages])


def lane_geometry(pool: str, entry: Any, dtype: str) -> PoolGeometry:
    """An entry's pages in hisparse's layout: layer-major, region rows = device rows."""
    buffers = entry.kv_buffer
    if len(entry.components) != 1:
        raise InvalidArgument(f"HisparseLinker: device pool {pool} packs several buffers per layer; "
                              "not supported")
    rows = buffers[0]
    row_bytes = rows.stride(0) * rows.element_size()
    if rows.nbytes != rows.shape[0] * row_bytes or any(b.shape != rows.shape for b in buffers):
        raise InvalidArgument(f"HisparseLinker: device pool {pool} rows are not uniform and contiguous")
    block = entry.page_size if entry._row_span == entry.page_size else 1
    layers = len(buffers)
    return PoolGeometry(pool, "device", "device", dtype, layers, 0, block, row_bytes,
                        layers * block * row_bytes, canonical=True)


class LoadCounter(LayerWiseLoadCounter):
    """SGLang's layer counter, where a failed batch reads as failed whatever had completed.

    SGLang's ``fail`` only fails the layers not yet complete, so a batch that failed after
    its last layer completed (or whose failure raced its completions) read as landed.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.failed: set[int] = set()

    def fail(self, index: int, error: BaseException) -> None:
        self.failed.add(index)  # before the futures: finish() sees it once they resolve
        super().fail(index, error)

    def finish(self, index: int) -> bool:
        landed = super().finish(index)
        failed = index in self.failed
        self.failed.discard(index)
        return landed and not failed

    def reset(self) -> None:
        super().reset()
        self.failed.clear()


def load_batch(lanes: dict[Any, Lane], counter: LoadCounter, index: int, num_layers: int, page_size: int,
               transfers: list[tuple[Hashable, PoolTransfer]], landed: Callable[[], None]) -> int:
    """Copy a batch's pages layer by layer, completing ``counter``'s layers as they land
    with their pins still held; ``LeaseExpired`` otherwise. ``landed`` runs once every
    layer has landed and been checked, before the last one completes (the pins may go:
    the scheduler that waits on that layer then finds them let go). Returns the pages loaded."""
    plans = []  # (lane, region rows, device rows) per transfer
    pins: dict[int, Any] = {}  # every pin read from, by id
    for _, t in transfers:
        lane = lanes[t.name]
        region_pages = []
        for key in t.keys:
            held = lane.holds.get(key_bytes(key))
            if held is None:
                raise LeaseExpired(f"HisparseLinker: {t.name} page {key[:16]}... is no longer held "
                                   "(evicted, or its session lost since lookup); the request recomputes")
            pins[id(held[0])] = held[0]
            region_pages.append(int(held[0].page_ids[held[1]]))
        starts = t.host_indices.detach().to("cpu", torch.int64).reshape(-1, page_size)[:, 0].tolist()
        plans.append((lane, lane.region_rows(region_pages), lane.device_rows(starts, page_size)))
    first = next(iter(lanes.values()))
    device = first.entry.kv_buffer[0].device
    on_cuda = device.type == "cuda"
    for layer in range(num_layers):
        for lane, region_rows, dev_rows in plans:
            src = lane.client.layer_rows(layer, device=device if on_cuda else None)
            dst = lane.entry.kv_buffer[layer]
            dst.view(torch.uint8).view(dst.shape[0], -1)[dev_rows.to(device)] = src[region_rows.to(device)]
        if on_cuda:  # queued is not landed: the layer is complete once its copies ran
            landed = torch.cuda.Event()
            landed.record()
            landed.synchronize()
        lost = sum(1 for pin in pins.values() if not pin.held)
        if lost:  # copied under a hold that is gone: never trusted, from this layer on
            raise LeaseExpired(f"HisparseLinker: {lost} pins were lost during the load (layer {layer})")
        if layer == num_layers - 1:
            landed()
        counter.complete(index, layer)
    return sum(len(t.keys) for _, t in transfers)
