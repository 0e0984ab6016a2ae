"""Copy engines for the worker: lists of (src, dst, size) byte copies, run without blocking the caller.

A job is one store or load: flat arrays of source addresses, destination
addresses and sizes (``PagePlan`` builds them). Jobs of one lane run in
submission order, each lane on its own thread or stream, so an expedited
load never queues behind regular loads.

- ``CpuCopyEngine``: one thread per lane, ``ctypes.memmove`` per copy. For
  CPU KV caches (tests, CPU-only engines): real copies, same addresses.
- ``CudaCopyEngine``: one CUDA stream per lane, all of a job's copies in one
  ``swap_blocks_batch`` call (vLLM's batched ``cuMemcpyBatchAsync``; one
  ``cuMemcpyAsync`` each where vLLM's compiled ops are absent), timed by a
  pair of events; the stream first waits for the engine's current
  stream, so a store reads KV only after the step that wrote it. The region
  must be registered with the driver (``hisparse.client.backends.cuda``)
  so the copies are DMA from page-locked memory. Imports nothing from CUDA
  until constructed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from vllm.v1.kv_offload.base import TransferResult

from hisparse.errors import HisparseError

log = logging.getLogger(__name__)

LANES = ("store", "load", "expedited")


class CopyEngine(Protocol):
    def submit(self, job_id: int, lane: str, src: np.ndarray, dst: np.ndarray,
               sizes: np.ndarray) -> None: ...

    def fail(self, job_id: int) -> None: ...

    def finished(self) -> list[TransferResult]: ...

    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None: ...


def _memmove_all(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> float:
    started = time.perf_counter()
    move = ctypes.memmove
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        move(d, s, n)
    return time.perf_counter() - started


@dataclass
class _CpuJob:
    job_id: int
    future: Future[float]
    num_bytes: int


class CpuCopyEngine:
    """Copies on one background thread per lane; ``submit`` only queues."""

    def __init__(self) -> None:
        self._pools = {lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hisparse-{lane}")
                       for lane in LANES}
        self._jobs: dict[str, deque[_CpuJob]] = {lane: deque() for lane in LANES}
        self._failed: list[TransferResult] = []
        self._lock = threading.Lock()

    def submit(self, job_id: int, lane: str, src: np.ndarray, dst: np.ndarray,
               sizes: np.ndarray) -> None:
        future = self._pools[lane].submit(_memmove_all, src, dst, sizes)
        with self._lock:
            self._jobs[lane].append(_CpuJob(job_id, future, int(sizes.sum())))

    def fail(self, job_id: int) -> None:
        with self._lock:
            self._failed.append(TransferResult(job_id=job_id, success=False))

    def finished(self) -> list[TransferResult]:
        with self._lock:
            results, self._failed = self._failed, []
            for queue in self._jobs.values():
                while queue and queue[0].future.done():
                    job = queue.popleft()
                    results.append(_result(job))
        return results

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futures = [job.future for q in self._jobs.values() for job in q if job.job_id in job_ids]
        for future in futures:
            future.exception()  # waits; the error is reported by finished()

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)


def _result(job: _CpuJob) -> TransferResult:
    exc = job.future.exception()
    if exc is not None:
        log.error("hisparse copy job %d failed: %s", job.job_id, exc)
        return TransferResult(job_id=job.job_id, success=False)
    return TransferResult(job_id=job.job_id, success=True, transfer_size=job.num_bytes,
                          transfer_time=job.future.result())


@dataclass
class _CudaJob:
    job_id: int
    start: Any  # torch.Event
    end: Any
    num_bytes: int
    buffers: tuple[Any, ...]  # the descriptor tensors, alive until the copy ran


class CudaCopyEngine:
    """Batched copies on one CUDA stream per lane, completion by events."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._swap = _batched_copy()
        self.device = torch.device(device)
        self._streams = {lane: torch.cuda.Stream(device=self.device) for lane in LANES}
        self._jobs: dict[str, deque[_CudaJob]] = {lane: deque() for lane in LANES}
        self._failed: list[TransferResult] = []

    def submit(self, job_id: int, lane: str, src: np.ndarray, dst: np.ndarray,
               sizes: np.ndarray) -> None:
        torch = self._torch
        # cache_kernels.cu takes int64 descriptors in host memory, pinned so the copy is async.
        buffers = tuple(torch.from_numpy(a.astype(np.int64)).pin_memory() for a in (src, dst, sizes))
        stream = self._streams[lane]
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        queue = self._jobs[lane]
        if queue:
            stream.wait_event(queue[-1].end)
        try:
            with torch.cuda.stream(stream):
                start.record(stream)
                if len(sizes):
                    # A load reads host pages no GPU stream writes: let the DMA prefetch.
                    self._swap(*buffers, stream=stream, is_src_access_order_any=lane != "store")
                end.record(stream)
        except (RuntimeError, HisparseError):
            log.exception("hisparse %s copy job %d failed to launch", lane, job_id)
            self._failed.append(TransferResult(job_id=job_id, success=False))
            return
        queue.append(_CudaJob(job_id, start, end, int(sizes.sum()), buffers))

    def fail(self, job_id: int) -> None:
        self._failed.append(TransferResult(job_id=job_id, success=False))

    def finished(self) -> list[TransferResult]:
        results, self._failed = self._failed, []
        for queue in self._jobs.values():
            while queue:
                job = queue[0]
                try:
                    if not job.end.query():
                        break
                    elapsed_s = job.start.elapsed_time(job.end) * 1e-3
                except RuntimeError:
                    log.exception("hisparse copy job %d failed", job.job_id)
                    queue.popleft()
                    results.append(TransferResult(job_id=job.job_id, success=False))
                    continue
                queue.popleft()
                results.append(TransferResult(job_id=job.job_id, success=True,
                                              transfer_size=job.num_bytes, transfer_time=elapsed_s))
        return results

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._jobs.values():
            for job in queue:
                if job.job_id in job_ids:
                    try:
                        job.end.synchronize()
                    except RuntimeError:
                        log.exception("hisparse copy job %d failed while waiting", job.job_id)

    def shutdown(self) -> None:
        for queue in self._jobs.values():
            for job in queue:
                try:
                    job.end.synchronize()
                except RuntimeError:
                    log.exception("hisparse copy job %d failed at shutdown", job.job_id)
            queue.clear()


def _batched_copy() -> Any:
    """vLLM's ``swap_blocks_batch`` (one driver call per job), else one ``cuMemcpyAsync`` per copy.

    The fallback serves a vLLM whose compiled ops cannot load (an install
    without its dependencies); it needs cuda-python, as hisparse's CUDA backend does.
    """
    try:
        from vllm import _custom_ops as ops

        swap = ops.swap_blocks_batch
    except ImportError as exc:
        log.warning("vllm._custom_ops unavailable (%s): hisparse copies with one cuMemcpyAsync "
                    "per block and layer", exc)
        return _memcpy_async_each

    def batched(src: Any, dst: Any, sizes: Any, *, stream: Any, is_src_access_order_any: bool) -> None:
        swap(src, dst, sizes, is_src_access_order_any=is_src_access_order_any)  # on the current stream

    return batched


def _memcpy_async_each(src: Any, dst: Any, sizes: Any, *, stream: Any, is_src_access_order_any: bool) -> None:
    from hisparse.client.backends.cuda import driver, check

    cu = driver()
    handle = cu.CUstream(stream.cuda_stream)
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        check(cu.cuMemcpyAsync(d, s, n, handle), "cuMemcpyAsync")
