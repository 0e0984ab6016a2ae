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

Lookups pin what they report until the load reads it (``hold_s``); a hold
belongs to one lookup, so requests sharing a prefix each keep theirs
(``holds``). A load whose pins are lost in between (daemon restart) or
during its copy fails its batch, which SGLang's scheduler aborts and
recomputes (``lanes``).

SGLang calls ``lookup`` on its scheduler thread. The pins run on the
linker's lookup thread; the scheduler waits at most ``lookup_budget_s`` for
them. One that does not come back in time closes the gate (``gate``): from
then on lookups answer no hit and offloads failure without asking, until
the gate's probe hears the daemon again. Loads never ask the daemon (their
pins were taken at lookup, and let go in the background), and run on a
thread of their own, so an offload waiting on a stalled daemon never holds
up a load the forward waits for.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import resolve_hybrid_device_pool_group
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from hisparse.errors import HisparseError, Timeout
from hisparse.sglang.config import SglangConfig
from hisparse.sglang.gate import UNREACHABLE
from hisparse.sglang.holds import PinHolds
from hisparse.sglang.lanes import Lane, LoadCounter, lane_geometry, load_batch
from hisparse.sglang.namespace import derive_namespace, key_bytes
from hisparse.sglang.tier import connect_client, gate_for
from hisparse.sglang.versions import check_sglang_version

log = logging.getLogger(__name__)


class _Worker:
    """One thread running jobs in order (the linker has three: lookups, loads, offloads)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((job, future))
        return future

    def join(self) -> None:
        self._jobs.join()

    def stop(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                job, future = item
                try:
                    future.set_result(job())
                except BaseException as exc:  # the submitter decides what a failure means
                    future.set_exception(exc)
            finally:
                self._jobs.task_done()


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
        self._client_lock = threading.Lock()
        self.gate = gate_for(self.config, "sglang linker", self._attach_late)
        self.lanes: dict[Any, Lane] = {}
        for name, entry in self.pools.items():
            geometry = lane_geometry(str(name), entry, dtype)
            namespace = (f"{self.config.namespace}/{name}" if self.config.namespace
                         else derive_namespace(geometry, storage_config))
            self.lanes[name] = Lane(str(name), entry, geometry, namespace, PinHolds(self.config.hold_s))
        for lane in self.lanes.values():  # a layout mismatch raises here; an absent daemon does not
            if self.gate.allows():  # else the gate's probe attaches them once the daemon answers
                lane.client = connect_client(self.config, lane.namespace, lane.geometry, self.gate,
                                             f"sglang linker {lane.pool}")
        self.layer_done_counter = LoadCounter(self.num_layers)
        self.pending_loads: dict[str, list[PoolTransfer]] = {}
        self.offload_results: queue.Queue[bool] = queue.Queue()
        self._owners: dict[str, tuple[Hashable, float]] = {}  # rid -> its answered lookup's claims
        self._lookup_ids = itertools.count()
        self.stats = dict.fromkeys(("lookups", "hit_pages", "loaded_pages", "offloaded_pages",
                                    "late_lookups"), 0)
        self._lookups = _Worker(f"hisparse-linker-lookup-tp{tp_rank}")
        self._loads = _Worker(f"hisparse-linker-load-tp{tp_rank}")
        self._offloads = _Worker(f"hisparse-linker-offload-tp{tp_rank}")

    @property
    def namespace(self) -> str:
        return self.lanes[PoolName.KV].namespace

    def _attach_late(self) -> bool:
        """The gate probe's: attach the lanes the daemon was away for (never raises)."""
        with self._client_lock:
            for lane in self.lanes.values():
                if lane.client is None:
                    lane.client = connect_client(self.config, lane.namespace, lane.geometry, self.gate,
                                                 f"sglang linker {lane.pool}", late=True)
            return all(lane.client is not None for lane in self.lanes.values())

    def _usable(self) -> bool:
        """The gate open and every lane attached: a request may be made. Never asks the daemon."""
        return self.gate.allows() and all(lane.client is not None for lane in self.lanes.values())

    @property
    def _on_cuda(self) -> bool:
        return self.lanes[PoolName.KV].entry.kv_buffer[0].is_cuda

    # -- lookup (SGLang's scheduler thread): pin what is found in every pool, within the budget --

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        self.stats["lookups"] += 1
        if not self._usable():
            return []
        keys = [key_bytes(k) for k in kv.keys]
        owner = (rid, next(self._lookup_ids))
        job = self._lookups.submit(lambda: self._pin_lookup(owner, keys))
        try:
            n = job.result(timeout=self.config.lookup_budget_s)
        except FutureTimeout:
            # The daemon did not answer within the step's budget: this request misses, and so
            # does every lookup after it until the probe hears the daemon again. The pins, if
            # the daemon takes them late, are let go as soon as they come back.
            self.stats["late_lookups"] += 1
            self.gate.failed("lookup", Timeout(f"no pin within the step budget of "
                                               f"{self.config.lookup_budget_s:.3g} s"))
            job.add_done_callback(lambda _: self._drop(owner))
            return []
        except Exception as exc:  # nothing raises out of SGLang's scheduler
            log.warning("hisparse linker lookup failed: %s", exc)
            self._drop(owner)
            return []
        if n == 0:
            self._drop(owner)
            return []
        now = time.monotonic()
        previous = self._owners.pop(rid, None)
        if previous is not None:
            self._drop(previous[0])  # this lookup's holds replace the earlier one's
        self._owners[rid] = (owner, now)
        for stale in [r for r, (_, at) in self._owners.items() if at < now - self.config.hold_s]:
            self._drop(self._owners.pop(stale)[0])  # looked up, never loaded: expired anyway
        self.stats["hit_pages"] += n
        return list(range(1, n + 1))

    def _pin_lookup(self, owner: Hashable, keys: list[bytes]) -> int:
        """On the lookup thread: the leading pages held in every lane, each claimed by ``owner``."""
        n = len(keys)
        try:
            for lane in self.lanes.values():
                lane.holds.expire()
                held = lane.holds.claim(keys[:n], owner)
                if held < n:
                    pin = lane.client.pin(keys[held:n])
                    held += pin.count
                    lane.holds.add(pin, owner)
                n = min(n, held)
        except UNREACHABLE as exc:
            self.gate.failed("lookup", exc)
            return 0
        except HisparseError as exc:
            log.warning("hisparse linker lookup failed: %s", exc)
            return 0
        self.gate.succeeded()
        return n

    def _drop(self, owner: Hashable) -> None:
        for lane in self.lanes.values():
            lane.holds.drop(owner)

    # -- loads: queued, then run layer by layer on the load thread --

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
        owner = self._owners.pop(rid, None)
        if owner is not None:
            self._drop(owner[0])
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        ready = torch.cuda.Event() if self._on_cuda else None
        if ready is not None:
            ready.record()
        batch = []
        for rid, ts in pending.items():
            owner = self._owners.pop(rid, (None, 0.0))[0]
            batch += [(owner, t) for t in ts]
        self._loads.submit(lambda: self._load(index, batch, ready))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def _load(self, index: int, batch: list[tuple[Hashable, PoolTransfer]], ready: Any) -> None:
        def let_go() -> None:  # read (or failed): its pins go, in the background
            for owner in {owner for owner, _ in batch if owner is not None}:
                self._drop(owner)

        try:
            if ready is not None:
                ready.synchronize()
            self.stats["loaded_pages"] += load_batch(self.lanes, self.layer_done_counter, index,
                                                     self.num_layers, self.page_size, batch, let_go)
        except BaseException as exc:  # the batch's requests are aborted by SGLang
            let_go()  # before the failure is seen: nothing of the batch stays held after it
            log.warning("hisparse linker load failed: %s", exc)
            self.layer_done_counter.fail(index, exc)

    # -- offloads: on a thread of their own --

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        expanded = [t for t in self.pool_group.resolve_transfers(transfers, allow_partial=True) if t.keys]
        if not expanded:
            return False
        if not self.offload_owner:  # another rank writes the one shared copy
            self.offload_results.put(True)
            return True
        ready = self.record_offload_ready() if self._on_cuda else []
        self._offloads.submit(lambda: self.offload_results.put(self._offload_quietly(expanded, ready)))
        return True

    def _offload_quietly(self, transfers: list[PoolTransfer], ready: list[Any]) -> bool:
        try:
            return self._offload(transfers, ready)
        except Exception as exc:
            log.warning("hisparse linker offload failed: %s", exc)
            return False

    def _offload(self, transfers: list[PoolTransfer], ready: list[Any]) -> bool:
        for event in ready:
            event.synchronize()
        if not self._usable():
            return False
        done = True
        for t in transfers:
            lane = self.lanes[t.name]
            g = lane.geometry
            keys = [key_bytes(k) for k in t.keys]
            starts = t.host_indices.detach().to("cpu", torch.int64).reshape(-1, self.page_size)[:, 0].tolist()
            rows = lane.device_rows(starts, self.page_size).to(lane.entry.kv_buffer[0].device)
            layers = torch.stack([b.view(torch.uint8).view(b.shape[0], -1)[rows] for b in lane.entry.kv_buffer])
            pages = layers.view(g.num_layers, len(keys), -1).transpose(0, 1).reshape(len(keys), -1)
            try:
                written = lane.client.store(keys, pages)
                held = len(keys) if written == len(keys) else lane.client.lookup(keys)
            except UNREACHABLE as exc:
                self.gate.failed("offload", exc)
                return False
            self.stats["offloaded_pages"] += held if t.name == PoolName.KV else 0
            done = done and held == len(keys)
        self.gate.succeeded()
        return done

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    def reset(self) -> None:
        self.pending_loads.clear()
        self._loads.join()
        self._offloads.join()
        while not self.offload_results.empty():
            self.offload_results.get_nowait()
        self.layer_done_counter.reset()
        for owner, _ in list(self._owners.values()):
            self._drop(owner)
        self._owners.clear()

    def close(self) -> None:
        self.gate.close()
        self.reset()
        for worker in (self._lookups, self._loads, self._offloads):
            worker.stop(timeout_s=10)
        for lane in self.lanes.values():
            lane.holds.release_all()
            if lane.client is not None:
                lane.client.close()
