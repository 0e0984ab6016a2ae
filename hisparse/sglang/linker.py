"""``HisparseLinker``: SGLang's direct external linker on the node tier (no SGLang host pool at all).

SGLang builds it per worker from::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker":"HisparseLinker",
      "linker_module_path":"hisparse.sglang.linker","linker_extra_config":{...}}'

and drives it from the radix tree (``UnifiedCacheLinkerWrapper``): ``lookup``
at match time, ``load`` + ``start_layer_wise_loading`` for a hit, ``offload``
on write-through. Pages move between the device KV pool and the region
directly: a load indexes the region's layer slab (``Client.layer_rows``: on a
GPU its device-mapped view of the registered region, the registration the
vLLM worker path uses) into the device rows, layer by layer, completing
SGLang's ``LayerWiseLoadCounter`` as each layer lands; an offload gathers the
device rows of a page and stores it (``Client.store``, CUDA tensors through
``hisparse.client.backends.cuda``). One copy in the region serves every TP
rank and engine of the namespace; only the offload owner (TP rank 0 for MLA)
writes.

The KV lane's namespace and page layout are derived as the HiCache
backend's are (``namespace``: layer-major, KV rows as region rows). The
indexer lane's layout (a region row per page) differs from the backend's
flat indexer pages, so a DSA engine on the linker and one on
``HisparseStore`` do not share hits; engines on the same path do.

Each device pool entry SGLang's assembler resolves is a lane on a namespace
of its own: the KV pool (a region row per token) and, for DeepSeek-V3.2 /
GLM-5 (``DSATokenToKVPool``), the DSA indexer (a region row per page). An
entry that packs several buffers per layer is refused at start by name.

Lookups pin what they report until the load reads it (``hold_s``), as in
the backend; a load whose pages are lost in between (daemon restart) fails
its batch, which SGLang's scheduler aborts and recomputes. While the daemon
is away (``gate``) lookups answer no hit and offloads report failure at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import resolve_hybrid_device_pool_group
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from hisparse.errors import HisparseError, InvalidArgument, LeaseExpired
from hisparse.sglang.config import SglangConfig
from hisparse.sglang.gate import UNREACHABLE, Gate
from hisparse.sglang.holds import PinHolds
from hisparse.sglang.namespace import PoolGeometry, derive_namespace, key_bytes
from hisparse.sglang.tier import connect_client
from hisparse.sglang.versions import check_sglang_version

log = logging.getLogger(__name__)


@dataclass
class _Lane:
    """One device pool entry on its namespace: KV (a row per token) or the DSA indexer (a row per page)."""

    pool: str
    entry: Any
    geometry: PoolGeometry
    namespace: str
    holds: PinHolds
    client: Any = None

    def device_rows(self, starts: list[int], page_size: int) -> torch.Tensor:
        if self.geometry.page_size == 1:  # rows are pages
            return torch.tensor([s // page_size for s in starts], dtype=torch.int64)
        return torch.cat([s + torch.arange(page_size) for s in starts])


def _geometry(pool: str, entry: Any, dtype: str) -> PoolGeometry:
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


class HisparseLinker(UnifiedCacheLinker):
    def __init__(self, server_args: Any, params: Any, *, components: Any, extra_config: Any = None,
                 forward_stream: Any = None) -> None:
        self.sglang_version = check_sglang_version()
        self.config = SglangConfig.parse(extra_config)
        self.forward_stream = forward_stream
        self.page_size = params.page_size
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pool_group = resolve_hybrid_device_pool_group(kvcache=kvcache, page_size=self.page_size,
                                                           params=params, components=components)
        self.pools = self.pool_group.entry_map
        self.num_layers = self.pool_group.num_layers
        tp_rank = int(getattr(params, "tp_rank", 0) or 0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_rank = torch.distributed.get_rank(group=params.attn_tp_cache_group or params.tp_cache_group)
        replicated = bool(self.pool_group.rank_replicated)
        self.offload_owner = not replicated or tp_rank == 0
        storage_config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=1, pp_rank=params.pp_rank, pp_size=params.pp_size,
            attn_cp_rank=params.attn_cp_rank, attn_cp_size=params.attn_cp_size,
            is_mla_model=replicated, enable_storage_metrics=False, is_page_first_layout=False,
            model_name=getattr(server_args, "served_model_name", None) or server_args.model_path)
        dtype = str(kvcache.dtype).removeprefix("torch.")
        self.gate = Gate(self.config.down_s, "sglang linker")
        self.lanes: dict[Any, _Lane] = {}
        for name, entry in self.pools.items():
            geometry = _geometry(str(name), entry, dtype)
            namespace = (f"{self.config.namespace}/{name}" if self.config.namespace
                         else derive_namespace(geometry, storage_config))
            lane = _Lane(str(name), entry, geometry, namespace, PinHolds(self.config.hold_s))
            lane.client = connect_client(self.config, namespace, geometry, self.gate, f"sglang linker {name}")
            self.lanes[name] = lane
        self._client_lock = threading.Lock()
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self.pending_loads: dict[str, list[PoolTransfer]] = {}
        self.offload_results: queue.Queue[bool] = queue.Queue()
        self._work: queue.Queue[Any] = queue.Queue()
        self.stats = dict.fromkeys(("lookups", "hit_pages", "loaded_pages", "offloaded_pages"), 0)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"hisparse-linker-tp{tp_rank}")
        self._thread.start()

    @property
    def namespace(self) -> str:
        return self.lanes[PoolName.KV].namespace

    def _clients(self) -> bool:
        """Every lane attached (attaching late if needed) and the gate open."""
        if not self.gate.allows():
            return False
        with self._client_lock:
            for lane in self.lanes.values():
                if lane.client is None:
                    lane.client = connect_client(self.config, lane.namespace, lane.geometry, self.gate,
                                                 f"sglang linker {lane.pool}", late=True)
                    if lane.client is None:
                        return False
        return True

    @property
    def _on_cuda(self) -> bool:
        return self.lanes[PoolName.KV].entry.kv_buffer[0].is_cuda

    # -- lookup: pin what is found, in every pool --

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        keys = [key_bytes(k) for k in kv.keys]
        self.stats["lookups"] += 1
        if not self._clients():
            return []
        n = len(keys)
        try:
            for lane in self.lanes.values():
                lane.holds.expire()
                held = lane.holds.leading(keys[:n])
                if held < n:
                    pin = lane.client.pin(keys[held:n])
                    held += pin.count
                    lane.holds.add(pin)
                n = min(n, held)
        except UNREACHABLE as exc:
            self.gate.failed("lookup", exc)
            return []
        except HisparseError as exc:
            log.warning("hisparse linker lookup failed: %s", exc)
            return []
        self.gate.succeeded()
        self.stats["hit_pages"] += n
        return list(range(1, n + 1))

    # -- loads: queued, then run layer by layer on the linker's thread --

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        expanded = [t for t in self.pool_group.resolve_transfers(transfers, allow_partial=True,
                                                                 allow_missing_kv=True) if t.keys]
        if not expanded:
            return False
        if rid in self.pending_loads:
            raise RuntimeError(f"HisparseLinker: a load for rid={rid} is already queued")
        self.pending_loads[rid] = expanded
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        ready = torch.cuda.Event() if self._on_cuda else None
        if ready is not None:
            ready.record()
        self._work.put(("load", index, [t for ts in pending.values() for t in ts], ready))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def _starts(self, transfer: PoolTransfer) -> list[int]:
        return transfer.host_indices.detach().to("cpu", torch.int64).reshape(-1, self.page_size)[:, 0].tolist()

    def _load(self, index: int, transfers: list[PoolTransfer], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        ps = self.page_size
        plans = []  # per lane: (lane, pins used, region rows, device rows)
        for t in transfers:
            lane = self.lanes[t.name]
            pins, region_pages = [], []
            for key in t.keys:
                held = lane.holds.get(key_bytes(key))
                if held is None:
                    raise LeaseExpired(f"HisparseLinker: {t.name} page {key[:16]}... is no longer held "
                                       "(evicted, or its session lost since lookup); the request recomputes")
                pins.append((key_bytes(key), held[0]))
                region_pages.append(int(held[0].page_ids[held[1]]))
            block = lane.geometry.page_size
            region_rows = torch.cat([p * block + torch.arange(block) for p in region_pages])
            plans.append((lane, pins, region_rows, lane.device_rows(self._starts(t), ps)))
        device = self.lanes[PoolName.KV].entry.kv_buffer[0].device
        for layer in range(self.num_layers):
            for lane, _, region_rows, dev_rows in plans:
                src = lane.client.layer_rows(layer, device=None if device.type == "cpu" else device)
                dst = lane.entry.kv_buffer[layer]
                dst.view(torch.uint8).view(dst.shape[0], -1)[dev_rows.to(device)] = src[region_rows.to(device)]
            self.layer_done_counter.complete(index, layer)
        if self._on_cuda:
            torch.cuda.current_stream().synchronize()
        lost = 0
        for lane, pins, _, _ in plans:
            for key, pin in pins:
                lost += not pin.held
                lane.holds.done(key)
        if lost:  # copied under a hold that is gone: never trusted
            raise LeaseExpired(f"HisparseLinker: {lost} pages lost their pins during the load")
        self.stats["loaded_pages"] += sum(len(p[1]) for p in plans)

    # -- offloads --

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        expanded = [t for t in self.pool_group.resolve_transfers(transfers, allow_partial=True) if t.keys]
        if not expanded:
            return False
        if not self.offload_owner:  # another rank writes the one shared copy
            self.offload_results.put(True)
            return True
        ready = self.record_offload_ready() if self._on_cuda else []
        self._work.put(("offload", expanded, ready))
        return True

    def _offload(self, transfers: list[PoolTransfer], ready: list[Any]) -> bool:
        for event in ready:
            event.synchronize()
        if not self._clients():
            return False
        done = True
        for t in transfers:
            lane = self.lanes[t.name]
            g = lane.geometry
            keys = [key_bytes(k) for k in t.keys]
            rows = lane.device_rows(self._starts(t), self.page_size).to(lane.entry.kv_buffer[0].device)
            layers = torch.stack([b.view(torch.uint8).view(b.shape[0], -1)[rows] for b in lane.entry.kv_buffer])
            pages = layers.view(g.num_layers, len(keys), -1).transpose(0, 1).reshape(len(keys), -1)
            try:
                lane.client.store(keys, pages)
                held = lane.client.lookup(keys)
            except UNREACHABLE as exc:
                self.gate.failed("offload", exc)
                return False
            self.stats["offloaded_pages"] += held if t.name == PoolName.KV else 0
            done = done and held == len(keys)
        self.gate.succeeded()
        return done

    def _run(self) -> None:
        while True:
            task = self._work.get()
            try:
                if task is None:
                    return
                if task[0] == "load":
                    _, index, transfers, ready = task
                    try:
                        self._load(index, transfers, ready)
                    except BaseException as exc:  # the batch's requests are aborted by SGLang
                        log.warning("hisparse linker load failed: %s", exc)
                        self.layer_done_counter.fail(index, exc)
                else:
                    try:
                        ok = self._offload(task[1], task[2])
                    except HisparseError as exc:
                        log.warning("hisparse linker offload failed: %s", exc)
                        ok = False
                    self.offload_results.put(ok)
            finally:
                self._work.task_done()

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    def reset(self) -> None:
        self.pending_loads.clear()
        self._work.join()
        while not self.offload_results.empty():
            self.offload_results.get_nowait()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._work.put(None)
        self._thread.join(timeout=10)
        for lane in self.lanes.values():
            lane.holds.release_all()
            if lane.client is not None:
                lane.client.close()
