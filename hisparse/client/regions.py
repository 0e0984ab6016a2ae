"""Region mappings shared by every ``Client`` of a process.

A namespace's region is mapped once per process however many clients attach
to it (TP ranks in threads, a re-attach after a daemon restart), keyed by its
path and ``region_id`` (which changes only when the daemon re-created the
file). A mapping is unmapped when its last client lets go, unless the CUDA
backend registered it: registrations live as long as the process.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from typing import Any

from hisparse.errors import ProtocolError
from hisparse.layout import KVLayout
from hisparse.shm.region import RegionGeometry, RegionMap

log = logging.getLogger(__name__)

RegionKey = tuple[str, int]
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it

_LOCK = threading.Lock()
_MAPS: dict[RegionKey, list[Any]] = {}  # key -> [RegionMap, clients holding it]


def _geometry(info: Any, layout: KVLayout) -> tuple[str, RegionKey, RegionGeometry]:
    if not isinstance(info, dict):
        raise ProtocolError("hello reply has no region for a namespace session")
    try:
        path, region_id, num_pages = str(info["path"]), int(info["region_id"]), int(info["num_pages"])
        geometry = RegionGeometry(layout, num_pages)
        expected = {"page_bytes": layout.page_bytes, "size_bytes": geometry.size_bytes,
                    "layer_stride_bytes": geometry.layer_stride_bytes}
        for field, value in expected.items():
            if int(info[field]) != value:
                raise ProtocolError(f"hello reply: region {field} is {info[field]}, the layout gives {value}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"hello reply: malformed region {info!r}: {exc}") from None
    return path, (path, region_id), geometry


def acquire_region(info: Any, layout: KVLayout, *, populate: bool = False) -> tuple[RegionMap, RegionKey]:
    """The process's mapping of the region a hello reply describes (mapped on first use)."""
    path, key, geometry = _geometry(info, layout)
    with _LOCK:
        held = _MAPS.get(key)
        if held is None:
            held = _MAPS[key] = [RegionMap(path, geometry), 0]
            if populate:
                populate_region(held[0])
        held[1] += 1
        return held[0], key


def populate_region(region: RegionMap) -> None:
    """Fault in the whole mapping now, so that first copies run at memory speed.

    A fresh mapping of a tmpfs file pays a page fault per 4 KiB on first touch
    (hugetlbfs: per 2 MiB); this pays them all at once, at attach.
    """
    started = time.monotonic()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(region.address, region.geometry.size_bytes, MADV_POPULATE_WRITE) != 0:
        # Older kernels: read-touch every page (maps them; writes then only upgrade).
        region.array[::mmap.PAGESIZE].max()
    log.debug("populated %s in %.3f s", region.path, time.monotonic() - started)


def release_region(key: RegionKey) -> None:
    """One client lets go; the last one unmaps (views handed out keep their pages alive)."""
    from hisparse.client.backends import cuda

    with _LOCK:
        held = _MAPS.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _MAPS[key]
        region = held[0]
    if not cuda.is_registered(region):
        region.close()


def mapped_regions() -> int:
    """How many regions this process maps (for tests: one per namespace, not per client)."""
    with _LOCK:
        return len(_MAPS)
