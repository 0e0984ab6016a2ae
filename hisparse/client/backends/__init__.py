"""Device backends: how page bytes move between a tensor and a mapped region.

A backend does two things, both between a tensor of logical pages
(``[n, page_bytes]``, each page layer-major) and the region's layer-major
layout (page ``p`` of layer ``l`` at ``l*N*bt*rb + p*bt*rb``):

- ``scatter(region, page_ids, pages, rows)``: ``pages[rows[i]]`` -> page ``page_ids[i]``
  (the copy inside ``store``, between reserve and commit);
- ``gather(region, page_ids, out)``: page ``page_ids[i]`` -> ``out[i]``
  (the copy inside ``load``, between pin and unpin).

Both return only once the bytes have landed: ``store`` commits right after,
``load`` unpins right after. A backend whose copies leave the host's CPU
free (``overlaps``) also has ``scatter_async`` and ``gather_async``, which
return a ``Landing`` whose ``wait()`` does: a large call keeps two pieces'
copies queued (``hisparse.client.pipeline``).

``cpu`` copies through views of the mapping; ``cuda`` (cuda-python)
registers the mapping with the driver and copies on the GPU's copy engines,
one 2D copy per page (``dma``), or where no such plan fits, with one
gather/scatter kernel over its device-mapped (UVA) address.

This module imports neither torch nor CUDA: the backends load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hisparse.client.backends.geometry import check_page_ids, copy_itemsize, runs, torch_dtype  # noqa: F401 (re-exported)
from hisparse.errors import InvalidArgument
from hisparse.extras import require

if TYPE_CHECKING:
    import torch

    from hisparse.shm.region import RegionMap


class Landing(Protocol):
    """A copy on its way: ``wait()`` returns once its bytes have landed (or raises)."""

    def wait(self) -> None: ...


class Backend(Protocol):
    name: str
    # True when a copy leaves the host's CPU free (a GPU's copy engines): a large call then
    # goes in pieces, its daemon requests overlapping the copies (``hisparse.client.pipeline``);
    # such a backend is an ``OverlappingBackend``.
    overlaps: bool

    def scatter(self, region: RegionMap, page_ids: np.ndarray, pages: torch.Tensor,
                rows: np.ndarray) -> None: ...

    def gather(self, region: RegionMap, page_ids: np.ndarray, out: torch.Tensor) -> None: ...


class OverlappingBackend(Backend, Protocol):
    """A backend with ``overlaps`` true: its copies can be queued and waited for later."""

    def scatter_async(self, region: RegionMap, page_ids: np.ndarray, pages: torch.Tensor,
                      rows: np.ndarray) -> Landing: ...

    def gather_async(self, region: RegionMap, page_ids: np.ndarray, out: torch.Tensor) -> Landing: ...


def for_tensor(tensor: Any) -> Backend:
    """The backend for a tensor's device (numpy arrays are host memory: ``cpu``)."""
    if isinstance(tensor, np.ndarray):
        from hisparse.client.backends import cpu

        return cpu.BACKEND
    kind = tensor.device.type
    if kind == "cpu":
        from hisparse.client.backends import cpu

        return cpu.BACKEND
    if kind == "cuda":
        from hisparse.client.backends import cuda

        return cuda.backend_for(tensor.device.index)
    raise InvalidArgument(f"no hisparse backend for tensors on {tensor.device}")


def check_pages(pages: Any, n: int, page_bytes: int, name: str, *, exact: bool) -> Any:
    """A uint8 ``[rows, page_bytes]`` tensor (or numpy array) with contiguous rows.

    Numpy arrays stay numpy: the CPU backend copies them without importing torch.
    """
    if isinstance(pages, np.ndarray):
        dtype, shape, strides = pages.dtype, pages.shape, pages.strides
        ok_type = dtype == np.uint8
    else:
        torch = require("torch", f"{name} other than a numpy array")
        if not isinstance(pages, torch.Tensor):
            raise InvalidArgument(f"{name} must be a torch.Tensor, not {type(pages).__name__}")
        dtype, shape, strides = pages.dtype, tuple(pages.shape), pages.stride()
        ok_type = dtype == torch.uint8
    if not ok_type or len(shape) != 2 or shape[1] != page_bytes:
        raise InvalidArgument(f"{name} must be uint8 [rows, {page_bytes}], not {dtype} {list(shape)}")
    if (shape[0] != n) if exact else (shape[0] < n):
        want = f"{n}" if exact else f"at least {n}"
        raise InvalidArgument(f"{name} has {shape[0]} rows for {n} keys; it needs {want}")
    if shape[0] and ((shape[0] > 1 and strides[0] != page_bytes) or strides[1] != 1):
        if not exact:
            raise InvalidArgument(f"{name} must have contiguous rows to be written in place")
        # a copy: stores of strided pages pay for it
        pages = np.ascontiguousarray(pages) if isinstance(pages, np.ndarray) else pages.contiguous()
    if not exact and isinstance(pages, np.ndarray) and not pages.flags.writeable:
        raise InvalidArgument(f"{name} is read-only")
    return pages
