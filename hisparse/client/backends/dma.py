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
When the runs are short, that would be many tiny copies, and ``plan`` returns
``None``: the caller's gather/scatter kernel does better there.

Pure numpy: the plan is testable, and tested, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hisparse.client.backends import runs

# below this many pages per run on average, per-layer copies are too small to pay
MIN_AVERAGE_RUN = 4


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
         rows: np.ndarray, max_pitch: int) -> Plan | None:
    """The copies that move ``tensor[rows[i]]`` <-> region page ``page_ids[i]``; None: use a kernel."""
    lpb, n = layer_page_bytes, len(page_ids)
    ids = np.asarray(page_ids, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    page_bytes = num_layers * lpb
    if n == 0 or num_pages * lpb <= max_pitch:
        return Plan(tensor_offsets=rows * page_bytes, region_offsets=ids * lpb,
                    heights=np.full(n, num_layers, dtype=np.int64),
                    tensor_pitch=lpb, region_pitch=num_pages * lpb, width=lpb)
    spans = runs(ids, rows)
    if page_bytes > max_pitch or len(spans) * MIN_AVERAGE_RUN > n:
        return None
    first_rows, first_pages, lengths = (np.array(col, dtype=np.int64) for col in zip(*spans))
    layers = np.arange(num_layers, dtype=np.int64)
    # copy (run r, layer l) at index r*L + l
    tensor_offsets = (first_rows[:, None] * num_layers + layers[None, :]) * lpb
    region_offsets = (layers[None, :] * num_pages + first_pages[:, None]) * lpb
    return Plan(tensor_offsets=tensor_offsets.reshape(-1), region_offsets=region_offsets.reshape(-1),
                heights=np.repeat(lengths, num_layers), tensor_pitch=page_bytes, region_pitch=lpb,
                width=lpb)
