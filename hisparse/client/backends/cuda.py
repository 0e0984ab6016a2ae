"""CUDA backend on cuda-python: copies between GPU tensors and the registered region.

The region is registered with the driver once per process (``cudadriver``,
whose names this module re-exports). Copies run on the GPU's copy engines:
one 2D copy per page (``dma.plan``), ``cuMemcpy2DAsync`` between the tensor
and the registered region, on a dedicated stream that waits for the
caller's current stream. Where no plan fits (copies that would be small:
small pages, short runs of pages, see ``dma``), one ``index_copy_`` (store)
or ``index_select`` (load) kernel moves the pages through the region's
device address (UVA, ``device_view``), on the same stream.

``scatter_async`` and ``gather_async`` return once the copies are queued,
with a ``Copying`` whose ``wait()`` returns once they have landed: a store
commits, and a load unpins, only after that (``hisparse.client.pipeline``
queues the next piece's copies meanwhile). A copy that fails while queuing
waits for what it had queued before it raises: nothing the call holds is
given back while a DMA may still move its bytes. ``scatter`` and ``gather``
wait at once.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hisparse.client.backends import dma
from hisparse.client.backends.cudadriver import (
    MAX_REGISTER_CHUNK_BYTES,
    CudaError,
    Registration,
    check,
    describe,
    device_view,
    driver,
    init_driver,
    is_registered,
    register,
    register_chunks,
)
from hisparse.client.backends.geometry import check_page_ids, copy_itemsize, torch_dtype

if TYPE_CHECKING:
    import torch

    from hisparse.shm.region import RegionMap

log = logging.getLogger(__name__)

__all__ = ["MAX_REGISTER_CHUNK_BYTES", "CudaBackend", "CudaError", "Copying", "Registration", "backend_for",
           "check", "describe", "device_ids", "device_view", "driver", "init_driver", "is_registered",
           "issue_2d", "register", "register_chunks"]


class CudaBackend:
    name = "cuda"
    overlaps = True  # the copy engines (or a kernel) copy while the host waits on an event

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()
        # False: every copy runs as a kernel (what a plan cannot cover does anyway)
        self.copy_engines = True
        self.max_pitch: int | None = None  # the device's, read on first use

    def _copy_stream(self) -> torch.cuda.Stream:
        import torch

        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device_index)
            return self._stream

    def _shapes(self, region: RegionMap, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = region.geometry
        size = copy_itemsize(g.layout.layer_page_bytes, region.address, tensor.data_ptr())
        dtype = torch_dtype(size)
        width = g.layout.layer_page_bytes // size
        view = device_view(region, self.device_index, 0, (g.layout.num_layers, g.num_pages, width), size)
        pages = tensor.view(dtype).view(tensor.shape[0], g.layout.num_layers, width)
        return view, pages

    def _plan(self, region: RegionMap, page_ids: np.ndarray, rows: np.ndarray) -> dma.Plan | None:
        if not self.copy_engines:
            return None
        if self.max_pitch is None:
            init_driver(self.device_index)
            cu = driver()
            dev = check(cu.cuDeviceGet(self.device_index), "cuDeviceGet")
            self.max_pitch = int(check(cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev), "cuDeviceGetAttribute"))
        g = region.geometry
        reg = register(region, self.device_index)  # its pieces: no copy may span two
        return dma.plan(g.layout.num_layers, g.num_pages, g.layout.layer_page_bytes, page_ids, rows,
                        self.max_pitch, [address - reg.address for address, _ in reg.chunks[1:]])

    def _run(self, plan: dma.Plan, region: RegionMap, tensor: torch.Tensor, to_region: bool,
             stream: torch.cuda.Stream) -> None:
        # the region is registered (``_plan`` did it): the engines copy it directly
        init_driver(self.device_index)  # driver calls need the context current on this thread
        issue_2d(plan, region.address, tensor.data_ptr(), to_region, stream.cuda_stream)

    def scatter(self, region: RegionMap, page_ids: np.ndarray, pages: torch.Tensor,
                rows: np.ndarray) -> None:
        self.scatter_async(region, page_ids, pages, rows).wait()

    def gather(self, region: RegionMap, page_ids: np.ndarray, out: torch.Tensor) -> None:
        self.gather_async(region, page_ids, out).wait()

    def scatter_async(self, region: RegionMap, page_ids: np.ndarray, pages: torch.Tensor,
                      rows: np.ndarray) -> Copying:

        ids = check_page_ids(page_ids, region.geometry.num_pages)

        def kernel(slabs: torch.Tensor, src: torch.Tensor, dev_ids: torch.Tensor) -> None:
            if not np.array_equal(rows, np.arange(len(ids))):
                src = src.index_select(0, device_ids(rows, pages.device))
            elif len(ids) != src.shape[0]:
                src = src[:len(ids)]
            slabs.index_copy_(0, dev_ids, src)

        return self._copy(region, ids, rows, pages, True, kernel)

    def gather_async(self, region: RegionMap, page_ids: np.ndarray, out: torch.Tensor) -> Copying:
        import torch

        ids = check_page_ids(page_ids, region.geometry.num_pages)
        return self._copy(region, ids, np.arange(len(ids), dtype=np.int64), out, False,
                          lambda slabs, dst, dev_ids: torch.index_select(slabs, 0, dev_ids, out=dst[:len(ids)]))

    def _copy(self, region: RegionMap, ids: np.ndarray, rows: np.ndarray, tensor: torch.Tensor,
              to_region: bool, kernel: Any) -> Copying:
        """On the copy stream (after the caller's): the plan's 2D copies, else ``kernel(slabs
        [pages, layers, ...] of the region's UVA view, tensor [rows, layers, ...], device ids)``;
        returns at once, with the event that tells when the bytes have landed."""
        import torch

        # This GPU's context current on this thread, whichever device the thread was on:
        # the driver's copies go on this device's stream.
        with torch.cuda.device(self.device_index):
            plan = self._plan(region, ids, rows)
            stream = self._copy_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device_index))
            try:
                if plan is not None:
                    self._run(plan, region, tensor, to_region, stream)
                else:
                    view, shaped = self._shapes(region, tensor)
                    with torch.cuda.stream(stream):
                        kernel(view.transpose(0, 1), shaped, device_ids(ids, tensor.device))
                return Copying(stream)
            except BaseException:
                # Copies queued before the failure have no event to wait on: they land before
                # the caller gives back the pages they write (or read).
                _settle(stream)
                raise


class Copying:
    """Copies queued on the copy stream: ``wait()`` returns once they have landed."""

    __slots__ = ("_event",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(stream)

    def wait(self) -> None:
        self._event.synchronize()  # without the GIL: the transport's thread reads replies meanwhile


def device_ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Indices on ``device``, copied on the current stream without holding up the host (from
    a pinned buffer, which torch keeps until that copy has run)."""
    import torch

    return torch.from_numpy(np.asarray(ids, dtype=np.int64)).pin_memory().to(device, non_blocking=True)


def _settle(stream: torch.cuda.Stream) -> None:
    try:
        stream.synchronize()
    except Exception:  # the error being raised is the one to report
        log.warning("the copy stream failed too while a failed copy waited for it", exc_info=True)


def issue_2d(plan: dma.Plan, host_base: int, device_base: int, to_host: bool, stream: int) -> None:
    """Queue a plan's 2D copies on ``stream``: ``host_base`` is the region side, page-locked."""
    cu = driver()
    copy = cu.CUDA_MEMCPY2D()
    host, device = cu.CUmemorytype.CU_MEMORYTYPE_HOST, cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    if to_host:
        copy.srcMemoryType, copy.srcPitch = device, plan.tensor_pitch
        copy.dstMemoryType, copy.dstPitch = host, plan.region_pitch
    else:
        copy.srcMemoryType, copy.srcPitch = host, plan.region_pitch
        copy.dstMemoryType, copy.dstPitch = device, plan.tensor_pitch
    copy.WidthInBytes = plan.width
    handle = cu.CUstream(stream)
    for t_off, r_off, height in zip(plan.tensor_offsets.tolist(), plan.region_offsets.tolist(),
                                    plan.heights.tolist()):
        if to_host:
            copy.srcDevice, copy.dstHost = device_base + t_off, host_base + r_off
        else:
            copy.srcHost, copy.dstDevice = host_base + r_off, device_base + t_off
        copy.Height = height
        check(cu.cuMemcpy2DAsync(copy, handle), "cuMemcpy2DAsync")


_BACKENDS: dict[int, CudaBackend] = {}


def backend_for(device_index: int | None) -> CudaBackend:
    if device_index is None:
        import torch

        device_index = torch.cuda.current_device()
    backend = _BACKENDS.get(device_index)
    if backend is None:
        backend = _BACKENDS.setdefault(device_index, CudaBackend(device_index))
    return backend
