"""The CUDA boundary of vLLM's HiSparse worker, replaced for a CPU-only machine.

Everything here stands for something the GPU (or its driver) does; each
piece is written from the documented semantics of what it replaces, and
``install`` applies all of them through pytest's ``monkeypatch`` (undone
after the test). The patches, one by one:

1. ``torch.Event`` / ``torch.Stream`` -> ``CpuEvent`` / ``CpuStream``. CPU
   copies finish before the call returns, so every event is complete once
   recorded and waits are no-ops.
2. ``torch.accelerator.current_stream`` / ``synchronize`` /
   ``current_device_index`` / ``empty_cache`` -> one ``CpuStream``, no-ops, 0.
3. ``torch.empty`` / ``torch.tensor`` with ``pin_memory=True`` -> the same
   allocation unpinned (CPU torch has no pinned allocator).
4. The platform's HiSparse backend (``platform.install``'s classmethod, here
   pointed at ``CpuHiSparseBackend``): ``pin_tensor``/``unpin_tensor`` fault
   in every page and record the range (what ``cudaHostRegister`` does to host
   memory), ``swap_blocks_batch`` copies each (src, dst, size) descriptor with
   ``memmove`` (vLLM's ``swap_blocks_batch``: one async copy per descriptor),
   IPC events are ``CpuEvent`` objects passed by handle between simulated TP
   ranks, and ``create_cache_ops`` gives ``CpuCacheOps``.
5. ``CpuCacheOps``: the ``_C_cache_ops`` kernel the connector worker's step
   loop calls, ``hisparse_invalidate_written_slots`` (semantics in its
   docstring); the attention-side kernels (residency resolution, swap-in
   gathers) raise, as nothing here runs attention.
6. vLLM's TP group (``parallel_state._TP``) -> ``TpGroup`` (barrier, object
   broadcast from rank 0, rank and size) for the simulated ranks.
7. ``gpu_worker.granule_size`` (the CUDA VMM granule) -> 2 MiB;
   ``gpu_worker._min_across_ranks`` (an all-reduce) -> the value itself;
   ``extensible_kv_cache.ExtensibleTensor`` (CUDA VMM reservation) ->
   ``CpuExtensibleTensor``; ``extensible_kv_cache.device_memory_info`` -> a
   fixed free/total; the platform's ``graph_pool_handle`` -> a token.
8. ``kv_transfer_state._KV_CONNECTOR_AGENT`` starts empty (one worker
   process per test).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from vllm.v1.hisparse.backend import HiSparseBackend

PAGE_BYTES = 4096


class CpuEvent:
    """A CUDA event on a machine where every copy completes synchronously."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return

    def wait(self, stream: Any = None) -> None:
        return


class CpuStream:
    """A CUDA stream whose work has always finished."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return

    def wait_event(self, event: Any) -> None:
        return

    def wait_stream(self, stream: Any) -> None:
        return

    def synchronize(self) -> None:
        return

    def record_event(self, event: Any = None) -> Any:
        event = event or CpuEvent()
        event.record(self)
        return event

    def __enter__(self) -> CpuStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return


@dataclass
class DeviceLog:
    """What the replaced device did: registrations, copies (per simulated rank), fence checks."""

    pinned: list[tuple[int, int]] = field(default_factory=list)  # registered now
    pin_history: list[int] = field(default_factory=list)  # bytes of every registration made
    unpin_history: list[int] = field(default_factory=list)  # bytes of every one undone
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)  # (rank, src, dst, size)
    rank: int = 0
    on_copy: Callable[[int, int, int], None] | None = None  # (dst, size, rank) before each copy
    events: dict[int, CpuEvent] = field(default_factory=dict)


LOG = DeviceLog()


class CpuCacheOps:
    """CPU versions of the ``_C_cache_ops`` HiSparse kernels the connector worker calls."""

    @staticmethod
    def hisparse_invalidate_written_slots(group_table: torch.Tensor, request_state_indices: torch.Tensor,
                                          req_id_per_token: torch.Tensor, written_slots: torch.Tensor,
                                          num_state_rows: int, region_stride: int) -> None:
        """For each written token: in every index group's slot map (``group_table``: addresses of int32
        ``[num_state_rows, region_stride]`` tables), the request's hot copy of that host slot is dropped
        (entries equal to the slot in the request's state row become -1)."""
        states = request_state_indices.cpu().numpy()
        reqs = req_id_per_token.cpu().numpy()
        slots = written_slots.cpu().numpy()
        for address in group_table.cpu().tolist():
            table = np.ctypeslib.as_array(
                (ctypes.c_int32 * (num_state_rows * region_stride)).from_address(int(address)))
            table = table.reshape(num_state_rows, region_stride)
            for req, slot in zip(reqs, slots):
                if req < 0 or req >= states.size or slot < 0:
                    continue
                row = states[req]
                if row >= 0:
                    table[row][table[row] == slot] = -1

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(f"{name}: not needed by the connector worker's step loop on CPU")


class CpuHiSparseBackend(HiSparseBackend):
    """vLLM's CUDA HiSparse backend, with the device replaced (module docstring, item 4)."""

    supports_shared_host_pool = True

    def check_available(self) -> None:
        return

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        raw = tensor.view(torch.uint8).reshape(-1)
        raw[::PAGE_BYTES] = raw[::PAGE_BYTES].clone()  # fault every page in, as registration locks it
        LOG.pinned.append((tensor.data_ptr(), tensor.nbytes))
        LOG.pin_history.append(tensor.nbytes)

    def unpin_tensor(self, tensor: torch.Tensor) -> None:
        LOG.pinned.remove((tensor.data_ptr(), tensor.nbytes))
        LOG.unpin_history.append(tensor.nbytes)

    def create_cache_ops(self, runtime: Any) -> Any:
        return CpuCacheOps()

    def create_ipc_event(self) -> Any:
        return CpuEvent()

    def export_event(self, event: Any) -> Any:
        LOG.events[id(event)] = event
        return id(event)

    def import_event(self, device: torch.device, handle: Any) -> Any:
        return LOG.events[handle]

    def is_current_stream_capturing(self) -> bool:
        return False

    def swap_blocks_batch(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            if LOG.on_copy is not None:
                LOG.on_copy(d, n, LOG.rank)
            LOG.copies.append((LOG.rank, s, d, n))
            ctypes.memmove(d, s, n)


class TpGroup:
    """vLLM's TP ``GroupCoordinator`` for ranks simulated one after another in this process."""

    def __init__(self, rank: int, world_size: int, shared: dict[str, Any]) -> None:
        self.rank_in_group = rank
        self.world_size = world_size
        self.rank = rank
        self._shared = shared
        self._broadcasts = 0

    def barrier(self) -> None:
        return

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """The ``n``-th broadcast of every rank gets rank ``src``'s ``n``-th object (it runs first)."""
        sent = self._shared.setdefault("objects", [])
        index = self._broadcasts
        self._broadcasts += 1
        if self.rank_in_group == src:
            sent.append(obj)
            return obj
        return sent[index]


class CpuExtensibleTensor:
    """vLLM's ``ExtensibleTensor`` (a CUDA VMM reservation committed in segments), in host memory."""

    granularity = 2 << 20

    def __init__(self, size: int, *, device: Any, segment_capacities: list[int],
                 export_handle_types: int = 0) -> None:
        self.device = torch.device("cpu")
        self.buffer = torch.zeros(size, dtype=torch.int8)
        self.offsets = list(itertools.accumulate([0, *segment_capacities[:-1]]))
        self.capacities = segment_capacities
        self.committed = [0] * len(segment_capacities)

    def full_view(self) -> torch.Tensor:
        return self.buffer

    def segment_view(self, index: int) -> torch.Tensor:
        start = self.offsets[index]
        return self.buffer[start:start + self.committed[index]]

    def resize_segments_(self, sizes: list[int], zero_new: bool = True) -> None:
        for index, size in enumerate(sizes):
            start = self.offsets[index]
            if zero_new and size > self.committed[index]:
                self.buffer[start + self.committed[index]:start + size].zero_()
            self.committed[index] = size

    def segments_backed_by_one_chunk(self, sizes: list[int]) -> list[bool]:
        return [True] * len(sizes)

    def release_physical(self) -> None:
        self.committed = [0] * len(self.committed)

    @property
    def physical_bytes(self) -> int:
        return sum(-(-n // self.granularity) * self.granularity for n in self.committed)

    def free(self) -> None:
        self.release_physical()


def strip_pin(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return fn(*args, **kwargs)

    return call


def install(mp: Any) -> DeviceLog:
    """Apply every patch of the module docstring with ``mp`` (pytest's monkeypatch); a fresh log."""
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.platforms import current_platform
    from vllm.v1.worker import extensible_kv_cache, gpu_worker

    from tests.vllm_hisparse import platform

    global LOG
    LOG = DeviceLog()
    platform.install()
    mp.setattr(platform, "install", lambda: None)  # configs made later keep this backend
    cls = type(current_platform)
    mp.setattr(cls, "get_hisparse_backend_cls",
               classmethod(lambda c: "tests.vllm_hisparse.cpu_device.CpuHiSparseBackend"))
    mp.setattr(cls, "graph_pool_handle", lambda self: object(), raising=False)
    stream = CpuStream()
    mp.setattr(torch, "Event", CpuEvent)
    mp.setattr(torch, "Stream", CpuStream)
    mp.setattr(torch.accelerator, "current_stream", lambda *a, **k: stream)
    mp.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    mp.setattr(torch.accelerator, "current_device_index", lambda *a, **k: 0)
    mp.setattr(torch.accelerator, "empty_cache", lambda *a, **k: None)
    mp.setattr(torch, "empty", strip_pin(torch.empty))
    mp.setattr(torch, "tensor", strip_pin(torch.tensor))
    mp.setattr(gpu_worker, "granule_size", lambda index: CpuExtensibleTensor.granularity)
    mp.setattr(gpu_worker, "_min_across_ranks", lambda value: value)
    mp.setattr(extensible_kv_cache, "ExtensibleTensor", CpuExtensibleTensor)
    mp.setattr(extensible_kv_cache, "device_memory_info", lambda device: (8 << 30, 8 << 30))
    mp.setattr(parallel_state, "_TP", TpGroup(0, 1, {}))
    mp.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)  # one worker per test, as per process
    return LOG
