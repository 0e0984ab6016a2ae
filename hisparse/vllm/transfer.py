"""Copy engines for the worker: lists of (src, dst, size) byte copies, run without blocking the caller.

A job is one store or load: flat arrays of source addresses, destination
addresses and sizes (``PagePlan`` builds them). Jobs of one lane run in
submission order, each lane on its own thread or stream, so an expedited
load never queues behind regular loads.

Fencing: a job names the fence of the scheduler's session that reserved or
pinned its pages, and copies only while holding it
(``hisparse.client.fence.hold``: the daemon reuses none of those pages
meanwhile). A hold that is lost (``LeaseExpired``: the lease ran out or the
daemon restarted) fails the job: a store then writes nothing, and a load
whose hold was lost before its copy finished is reported failed, so vLLM
recomputes instead of using bytes it cannot trust.

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
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from vllm.v1.kv_offload.base import TransferResult

from hisparse.client.fence import hold
from hisparse.errors import HisparseError, LeaseExpired

log = logging.getLogger(__name__)

LANES = ("store", "load", "expedited")


class CopyEngine(Protocol):
    def submit(self, job_id: int, lane: str, src: np.ndarray, dst: np.ndarray,
               sizes: np.ndarray, fence_path: str | None = None) -> None: ...

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


def _fenced_copy(lane: str, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                 fence_path: str | None) -> float:
    """The copy, under the fence; ``LeaseExpired`` when the hold is (or got) lost."""
    if fence_path is None:
        return _memmove_all(src, dst, sizes)
    with hold(fence_path, f"{lane} copy"):
        elapsed_s = _memmove_all(src, dst, sizes)
        if lane != "store":
            check_fence(fence_path, lane)  # lost mid-copy: the bytes read are not trusted
    return elapsed_s


def check_fence(fence_path: str, what: str) -> None:
    """``LeaseExpired`` unless the fence's holds are live (a nested hold checks it)."""
    with hold(fence_path, what):
        pass


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
               sizes: np.ndarray, fence_path: str | None = None) -> None:
        future = self._pools[lane].submit(_fenced_copy, lane, src, dst, sizes, fence_path)
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
        level = logging.WARNING if isinstance(exc, LeaseExpired) else logging.ERROR
        log.log(level, "hisparse copy job %d failed: %s", job.job_id, exc)
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
    lane: str = "load"
    fence: ExitStack | None = None  # the hold on the pages' fence, until the copy ran
    fence_path: str | None = None

    def let_go(self) -> bool:
        """Release the hold; False when it was lost before the copy finished (a load is then failed)."""
        if self.fence is None:
            return True
        try:
            if self.lane != "store" and self.fence_path is not None:
                check_fence(self.fence_path, self.lane)
            return True
        except LeaseExpired as exc:
            log.warning("hisparse %s job %d: %s", self.lane, self.job_id, exc)
            return False
        finally:
            self.fence.close()
            self.fence = None


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
               sizes: np.ndarray, fence_path: str | None = None) -> None:
        torch = self._torch
        fence = None
        if fence_path is not None:
            fence = ExitStack()
            try:
                fence.enter_context(hold(fence_path, f"{lane} copy"))  # until the copy has run
            except LeaseExpired as exc:
                log.warning("hisparse %s job %d not copied: %s", lane, job_id, exc)
                self._failed.append(TransferResult(job_id=job_id, success=False))
                return
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
            if fence is not None:
                fence.close()
            self._failed.append(TransferResult(job_id=job_id, success=False))
            return
        queue.append(_CudaJob(job_id, start, end, int(sizes.sum()), buffers, lane, fence, fence_path))

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
                    job.let_go()
                    results.append(TransferResult(job_id=job.job_id, success=False))
                    continue
                queue.popleft()
                if not job.let_go():
                    results.append(TransferResult(job_id=job.job_id, success=False))
                    continue
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
                job.let_go()
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
