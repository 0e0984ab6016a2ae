"""Page arithmetic every backend shares: element sizes, runs of consecutive pages, id checks.

Imports neither torch nor CUDA at import time; ``torch_dtype`` loads torch when called.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hisparse.errors import InvalidArgument
from hisparse.extras import require


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
