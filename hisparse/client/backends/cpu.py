"""CPU backend: strided copies between host tensors and views of the mapped region.

Pages come as torch CPU tensors or numpy arrays (a torch-free path for
tools). A page's logical bytes ``[L, bt*rb]`` sit in the region as ``L`` runs of
``bt*rb`` bytes, ``N*bt*rb`` apart. A run of ``k`` pages with consecutive ids
(the usual case: the daemon hands out free pages in order) is therefore one
``copy_`` between a ``[L, k, bt*rb]`` view of the region and the transposed
``[k, L, bt*rb]`` block of the tensor: ``L`` memcpy-sized rows per call.

Why runs of ``copy_`` rather than ``index_copy_``/``index_select``: on CPU
torch's indexed kernels move one element at a time (about 0.8x of a plain
``copy_`` here), while ``copy_`` on views keeps a contiguous inner loop and
torch's intra-op threads (about 0.95x).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from hisparse.client.backends.geometry import check_page_ids, copy_itemsize, runs, torch_dtype

if TYPE_CHECKING:
    from hisparse.shm.region import RegionMap

Pages = Any  # torch.Tensor or np.ndarray: uint8 [n, page_bytes] with contiguous rows


class CpuBackend:
    name = "cpu"
    # A copy here is the host's CPU (torch's intra-op threads): daemon work beside it slows
    # it down as much as it hides (measured: 0.85 -> 0.75 of copy_ in pieces on 2 cores).
    overlaps = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # One view per region and element size; weak, so an unmapped region is
        # not kept alive by the cache.
        self._views: weakref.WeakKeyDictionary[RegionMap, dict[tuple[bool, int], Any]] = (
            weakref.WeakKeyDictionary())

    def region_view(self, region: RegionMap, itemsize: int, as_torch: bool) -> Any:
        """``[L, N, bt*rb / itemsize]`` view of the whole region (no copy), torch or numpy."""
        with self._lock:
            per_region = self._views.setdefault(region, {})
            view = per_region.get((as_torch, itemsize))
            if view is None:
                g = region.geometry
                shape = (g.layout.num_layers, g.num_pages, -1)
                if as_torch:
                    import torch

                    view = torch.from_numpy(region.array).view(torch_dtype(itemsize)).view(shape)
                else:
                    view = region.array.view(f"u{itemsize}").reshape(shape)
                per_region[(as_torch, itemsize)] = view
            return view

    def _shapes(self, region: RegionMap, pages: Pages) -> tuple[Any, Any]:
        layout = region.geometry.layout
        n = pages.shape[0]
        if isinstance(pages, np.ndarray):
            size = copy_itemsize(layout.layer_page_bytes, region.address, pages.ctypes.data)
            view = self.region_view(region, size, as_torch=False)
            return view, pages.view(f"u{size}").reshape(n, layout.num_layers, -1)
        size = copy_itemsize(layout.layer_page_bytes, region.address, pages.data_ptr())
        view = self.region_view(region, size, as_torch=True)
        return view, pages.view(torch_dtype(size)).view(n, layout.num_layers, -1)

    def scatter(self, region: RegionMap, page_ids: np.ndarray, pages: Pages,
                rows: np.ndarray) -> None:
        ids = check_page_ids(page_ids, region.geometry.num_pages)
        view, src = self._shapes(region, pages)
        for row, page, k in runs(ids, rows):
            _copy(view[:, page:page + k, :], src[row:row + k].transpose(1, 0, 2)
                  if isinstance(src, np.ndarray) else src[row:row + k].transpose(0, 1))

    def gather(self, region: RegionMap, page_ids: np.ndarray, out: Pages) -> None:
        ids = check_page_ids(page_ids, region.geometry.num_pages)
        view, dst = self._shapes(region, out)
        for row, page, k in runs(ids, np.arange(len(ids))):
            block = dst[row:row + k]
            _copy(block.transpose(1, 0, 2) if isinstance(block, np.ndarray) else block.transpose(0, 1),
                  view[:, page:page + k, :])


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


BACKEND = CpuBackend()
