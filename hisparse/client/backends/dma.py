"""Copy plans for the GPU's copy engines: a store or a load as a few 2D copies.

A page of the caller's tensor is ``L`` layer runs of ``lpb`` bytes back to
back. In the region (layer-major, page ``p`` of layer ``l`` at
``(l*N + p)*lpb``) the same runs sit one layer slab apart. So one page is one
2D copy of ``L`` rows of ``lpb`` bytes, tensor pitch ``lpb``, region pitch
``N*lpb``, wherever the page lands: a store or load of ``n`` pages is ``n``
copies, each a few MiB, which the copy engines move at full PCIe speed without
taking a single SM from the model.

A copy's pitch is capped by the device (``CU_DEVICE_ATTRIBUTE_MAX_PITCH``,
2 GiB - 1 on current GPUs), and a large region's layer slab is larger. Then
the plan goes by runs of consecutive pages (the daemon hands out free pages in
order, so runs are the common case): one 2D copy per layer of each run, ``k``
rows of ``lpb`` bytes, tensor pitch ``L*lpb``, the region side contiguous.
When copies would be small (short runs, or small pages: under
``MIN_COPY_BYTES`` each on average), ``plan`` returns ``None``: the caller's
gather/scatter kernel does better there.

A region registered in several pieces (over 64 GiB, or vLLM's block-safe
ranges) is planned the per-run way too, each copy cut where a piece ends:
no copy spans two registrations, so every one is a DMA from one page-locked
range. A row across a cut would need two, and the plan leaves it to the kernel.

Pure numpy: the plan is testable, and tested, without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hisparse.client.backends.geometry import runs

# Issuing one copy takes the host about 6 us (an H200's machine: 81 copies in 494 us), in which
# the engines move about 320 KiB: smaller copies on average leave them waiting, and the kernel
# (one launch for every page) does better.
MIN_COPY_BYTES = 320 << 10


@dataclass(frozen=True)
class Plan:
    """2D copies between a tensor of pages and the region, as byte offsets from each base.

    Copy ``i`` moves ``heights[i]`` rows of ``width`` bytes, row ``j`` from
    ``tensor_offsets[i] + j*tensor_pitch`` in the tensor to (or from)
    ``region_offsets[i] + j*region_pitch`` in the region.
    """

    tensor_offsets: np.ndarray
    region_offsets: np.ndarray
    heights: np.ndarray
    tensor_pitch: int
    region_pitch: int
    width: int

    def __len__(self) -> int:
        return len(self.tensor_offsets)


def plan(num_layers: int, num_pages: int, layer_page_bytes: int, page_ids: np.ndarray,
         rows: np.ndarray, max_pitch: int, cuts: Sequence[int] = (),
         min_copy_bytes: int = MIN_COPY_BYTES) -> Plan | None:
    """The copies that move ``tensor[rows[i]]`` <-> region page ``page_ids[i]``; None: use a kernel.

    ``cuts``: byte offsets in the region where one registration ends and the next begins.
    """
    lpb, n = layer_page_bytes, len(page_ids)
    ids = np.asarray(page_ids, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    page_bytes = num_layers * lpb
    if n == 0 or (not len(cuts) and num_pages * lpb <= max_pitch and page_bytes >= min_copy_bytes):
        return Plan(tensor_offsets=rows * page_bytes, region_offsets=ids * lpb,
                    heights=np.full(n, num_layers, dtype=np.int64),
                    tensor_pitch=lpb, region_pitch=num_pages * lpb, width=lpb)
    spans = runs(ids, rows)
    if page_bytes > max_pitch or n * lpb < len(spans) * min_copy_bytes:  # copies of one run and layer
        return None
    first_rows, first_pages, lengths = (np.array(col, dtype=np.int64) for col in zip(*spans))
    layers = np.arange(num_layers, dtype=np.int64)
    # copy (run r, layer l) at index r*L + l
    tensor_offsets = (first_rows[:, None] * num_layers + layers[None, :]) * lpb
    region_offsets = (layers[None, :] * num_pages + first_pages[:, None]) * lpb
    by_run = Plan(tensor_offsets=tensor_offsets.reshape(-1), region_offsets=region_offsets.reshape(-1),
                  heights=np.repeat(lengths, num_layers), tensor_pitch=page_bytes, region_pitch=lpb,
                  width=lpb)
    return _cut(by_run, np.asarray(sorted(cuts), dtype=np.int64)) if len(cuts) else by_run


def _cut(p: Plan, cuts: np.ndarray) -> Plan | None:
    """A per-run plan (rows contiguous in the region) with each copy split where a cut falls
    inside it; None when a cut falls inside a row."""
    starts = p.region_offsets
    ends = starts + p.heights * p.width
    first = np.searchsorted(cuts, starts, side="right")  # the first cut after each start
    crossing = np.flatnonzero((first < len(cuts)) & (cuts[np.minimum(first, len(cuts) - 1)] < ends))
    if not len(crossing):
        return p
    t_offs, r_offs, heights = [p.tensor_offsets], [p.region_offsets], [p.heights]
    keep = np.ones(len(p), dtype=bool)
    keep[crossing] = False
    for i in crossing.tolist():
        start, end, t_off = int(starts[i]), int(ends[i]), int(p.tensor_offsets[i])
        inside = cuts[(cuts > start) & (cuts < end)].tolist()
        for lo, hi in zip([start, *inside], [*inside, end]):
            if (lo - start) % p.width:
                return None
            row = (lo - start) // p.width
            t_offs.append(np.array([t_off + row * p.tensor_pitch]))
            r_offs.append(np.array([lo]))
            heights.append(np.array([-(-(hi - lo) // p.width)]))
    t_offs[0], r_offs[0], heights[0] = t_offs[0][keep], r_offs[0][keep], heights[0][keep]
    return Plan(tensor_offsets=np.concatenate(t_offs), region_offsets=np.concatenate(r_offs),
                heights=np.concatenate(heights).astype(np.int64), tensor_pitch=p.tensor_pitch,
                region_pitch=p.region_pitch, width=p.width)
