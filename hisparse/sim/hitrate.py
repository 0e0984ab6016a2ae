"""The sparse tier's miss rate on generated top-k traces, for the capacity planner.

Runs ``TopkTrace`` selections through ``resolve_reference`` with hot-row
state exactly as the sparse session keeps it (all blocks but the active tail
spilled to host pages), but with 1-byte rows and no daemon: which rows miss
depends only on tags and stamps, not on the bytes. ``benchmarks/hit_rate.py``
measures the same through a real ``SparseSession`` and hisparsed.

The rate is missing positions over distinct selected positions per request
and step, the quantity ``PerfModel.miss_rate`` stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
try:
    import torch
except ImportError as _exc:
    from hisparse.extras import missing

    raise missing("torch", "the measured miss rate (hisparse plan --measure-miss-rate)") from _exc

from hisparse.kernels import resolve_reference
from hisparse.sim.trace import TopkTrace, TraceParams

BLOCK_TOKENS = 64
TAIL_BLOCKS = 1


@dataclass(frozen=True)
class MissRate:
    miss_rate: float  # missing / distinct selected positions
    hot_hit_rate: float  # hot / (hot + missing)
    overflow_rate: float  # overflow / distinct selected positions
    steps: int
    requests: int


def measure_miss_rate(*, topk: int = 2048, hot_factor: float = 2.0, overlap: float = 0.90,
                      context_tokens: int = 80_000, mtp: int = 0, requests: int = 2,
                      warmup_steps: int = 40, steps: int = 120, seed: int = 7) -> MissRate:
    """Measure on a trace: ``hot_factor * topk`` hot rows per request, LRU victims."""
    params = TraceParams(num_requests=requests, context_tokens=context_tokens, topk=topk, mtp=mtp,
                         target_overlap=overlap, seed=seed)
    trace = TopkTrace(params)
    total = warmup_steps + steps
    max_tokens = context_tokens + total * params.growth + params.q_rows
    nb = -(-max_tokens // BLOCK_TOKENS)
    hot = int(hot_factor * topk)
    # Host pages: every block, at its own page id (the bytes are never read back).
    host_rows = torch.zeros((requests * nb * BLOCK_TOKENS, 1), dtype=torch.uint8)
    host_pages = (torch.arange(requests * nb, dtype=torch.int64).view(requests, nb))
    resident = torch.full((requests, nb), -1, dtype=torch.int32)
    kv_rows = torch.zeros((requests * (hot + (TAIL_BLOCKS + 1) * BLOCK_TOKENS), 1), dtype=torch.uint8)
    hot_rows = torch.arange(requests * hot, dtype=torch.int32).view(requests, hot)
    tail_base = requests * hot
    hot_tags = torch.full((requests, hot), -1, dtype=torch.int32)
    hot_stamp = torch.zeros((requests, hot), dtype=torch.int64)
    sums = np.zeros(4)
    for step in range(total):
        # The active tail stays resident (in engine rows after the hot rows).
        resident.fill_(-1)
        for r, ctx in enumerate(trace.context_tokens.tolist()):
            last = (int(ctx) + params.q_rows - 1) // BLOCK_TOKENS
            for i, b in enumerate(range(max(0, last - TAIL_BLOCKS), last + 1)):
                resident[r, b] = tail_base // BLOCK_TOKENS + r * (TAIL_BLOCKS + 1) + i
        topk_t = torch.from_numpy(trace.step()[:, 0].astype(np.int32))
        _, counters = resolve_reference(
            topk=topk_t, num_real_reqs=torch.tensor([requests], dtype=torch.int32),
            resident_blocks=resident, host_pages=host_pages, host_rows=host_rows,
            block_tokens=BLOCK_TOKENS, hot_rows=hot_rows, hot_tags=hot_tags, hot_stamp=hot_stamp,
            step=torch.tensor([step + 1], dtype=torch.int64), kv_rows=kv_rows)
        if step >= warmup_steps:
            sums += counters.sum(0).numpy()
    resident_n, hot_n, missing_n, overflow_n = sums
    distinct = max(sums.sum(), 1.0)
    return MissRate(miss_rate=float(missing_n / distinct),
                    hot_hit_rate=float(hot_n / max(hot_n + missing_n, 1.0)),
                    overflow_rate=float(overflow_n / distinct), steps=steps, requests=requests)
