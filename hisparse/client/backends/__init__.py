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


def copy_itemsize(layer_page_bytes: int, *addresses: int) -> int:
    """The widest element size (8, 4, 2 or 1 bytes) that tiles a page's layer rows.

    Copy loops and kernels move 8-byte elements several times faster than
    bytes; every address involved and the per-layer run must be multiples of
    the element size, else bytes it is.
    """
    for size in (8, 4, 2):
        if layer_page_bytes % size == 0 and all(a % size == 0 for a in addresses):
            return size
    return 1


def torch_dtype(itemsize: int) -> Any:
    torch = require("torch", "a tensor copy")

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[itemsize]


def runs(page_ids: np.ndarray, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Split a copy into runs where both page ids and tensor rows are consecutive.

    Returns ``(first_row, first_page, length)`` triples. Pages reserved
    together are usually consecutive (the daemon hands out free pages in
    order), and a run of ``k`` pages is one strided copy of ``L`` rows of
    ``k*bt*rb`` bytes instead of ``k`` copies.
    """
    n = len(page_ids)
    if n == 0:
        return []
    page_ids = np.asarray(page_ids, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(page_ids) != 1) | (np.diff(rows) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(rows[s]), int(page_ids[s]), int(e - s)) for s, e in zip(starts, ends)]


def check_page_ids(page_ids: np.ndarray, num_pages: int) -> np.ndarray:
    """Page ids as int64, every one inside the region (a bad id is a daemon bug)."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= num_pages):
        raise InvalidArgument(f"page id out of range 0..{num_pages - 1}: {ids.min()}..{ids.max()}")
    return ids


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
