"""Random resolve inputs with a chosen mix of resident, hot and missing positions.

Shared by the interpreter tests (small shapes, hypothesis) and by
``benchmarks/resolve_gpu.py`` (64 requests x 2048 top-k at a set miss rate).
Rows are laid out as an engine's KV cache would be: resident blocks first,
then each request's hot rows, disjoint across requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CaseSpec:
    """What one random resolve call looks like."""

    batch: int = 2              # requests in the batch, padding included
    num_real: int = 2           # requests < num_real are real
    q_rows: int = 1             # query rows per request (1 + MTP drafts)
    topk: int = 8               # entries per query row
    block_tokens: int = 4
    num_blocks: int = 8         # logical blocks per request (the table's width NB)
    hot: int = 8                # hot rows per request (H)
    row_bytes: int = 8
    resident_frac: float = 0.2  # fraction of logical blocks resident on the device
    host_frac: float = 0.9      # fraction of non-resident blocks with a host page
    hot_frac: float = 0.5       # fraction of selected non-resident positions already hot
    pad_frac: float = 0.1       # fraction of entries that are -1
    row_overlap: float = 0.5    # fraction of a query row copied from row 0 (MTP duplicates)
    beyond_frac: float = 0.0    # fraction of entries past the block table
    host_pages: int = 16        # pages in the host slab
    step: int = 100             # this step; stamps are drawn below it
    seed: int = 0


def make_case(spec: CaseSpec, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Keyword arguments for ``resolve``/``resolve_reference`` built from ``spec``."""
    g = torch.Generator().manual_seed(spec.seed)
    b_n, q_n, k_n, bt, nb, h_n = spec.batch, spec.q_rows, spec.topk, spec.block_tokens, spec.num_blocks, spec.hot
    ctx = nb * bt
    resident = torch.rand(b_n, nb, generator=g) < spec.resident_frac
    resident_pool = max(1, int(resident.sum()))  # device blocks, each resident block its own
    resident_blocks = torch.full((b_n, nb), -1, dtype=torch.int32)
    resident_blocks[resident] = torch.randperm(resident_pool, generator=g)[: int(resident.sum())].to(torch.int32)
    has_page = ~resident & (torch.rand(b_n, nb, generator=g) < spec.host_frac)
    page_ids = torch.randint(0, spec.host_pages, (b_n, nb), generator=g)
    host_pages = torch.where(has_page, page_ids, -1).to(torch.int64)

    topk = torch.empty(b_n, q_n, k_n, dtype=torch.int32)
    for b in range(b_n):
        topk[b] = _request_topk(g, spec, ctx)
    hot_base = resident_pool * bt
    hot_rows = (hot_base + torch.arange(b_n * h_n)).reshape(b_n, h_n)
    hot_rows = hot_rows[:, torch.randperm(h_n, generator=g)] if h_n else hot_rows
    hot_tags = torch.full((b_n, h_n), -1, dtype=torch.int32)
    for b in range(b_n):
        hot_tags[b] = _request_tags(g, spec, topk[b], resident_blocks[b], ctx)
    hot_stamp = torch.randint(0, spec.step, (b_n, h_n), generator=g, dtype=torch.int64)
    num_rows = hot_base + b_n * h_n
    args: dict[str, Any] = dict(
        topk=topk,
        num_real_reqs=torch.tensor([spec.num_real], dtype=torch.int32),
        resident_blocks=resident_blocks,
        host_pages=host_pages,
        host_rows=torch.randint(0, 256, (spec.host_pages * bt, spec.row_bytes), generator=g, dtype=torch.uint8),
        block_tokens=bt,
        hot_rows=hot_rows.to(torch.int32),
        hot_tags=hot_tags,
        hot_stamp=hot_stamp,
        step=torch.tensor([spec.step], dtype=torch.int64),
        kv_rows=torch.randint(0, 256, (num_rows, spec.row_bytes), generator=g, dtype=torch.uint8),
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _request_topk(g: torch.Generator, spec: CaseSpec, ctx: int) -> torch.Tensor:
    """``[Q, K]`` positions: distinct within a row, rows sharing part of row 0."""
    k_n = spec.topk
    rows = []
    for q in range(spec.q_rows):
        row = torch.randperm(ctx, generator=g)[:k_n]
        if len(row) < k_n:  # a context smaller than top-k leaves the tail empty
            row = torch.cat([row, torch.full((k_n - len(row),), -1, dtype=row.dtype)])
        if q > 0:
            keep = torch.rand(k_n, generator=g) < spec.row_overlap
            row = torch.where(keep, rows[0], row)
        rows.append(row)
    out = torch.stack(rows)
    beyond = torch.rand(out.shape, generator=g) < spec.beyond_frac
    out = torch.where(beyond, ctx + torch.randint(0, 4 * ctx, out.shape, generator=g), out)
    pad = torch.rand(out.shape, generator=g) < spec.pad_frac
    return torch.where(pad, -1, out).to(torch.int32)


def _request_tags(g: torch.Generator, spec: CaseSpec, topk: torch.Tensor,
                  resident_blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """Distinct tags: some selected non-resident positions, the rest other positions or -1."""
    h_n, bt = spec.hot, spec.block_tokens
    sel = torch.unique(topk[(topk >= 0) & (topk < ctx)].long())
    sel = sel[resident_blocks[sel // bt] < 0]
    hot_sel = sel[torch.rand(sel.numel(), generator=g) < spec.hot_frac][:h_n]
    others = torch.randperm(ctx, generator=g)
    others = others[~torch.isin(others, sel)]
    tags = torch.cat([hot_sel, others])[:h_n]
    tags = torch.cat([tags, torch.full((h_n - tags.numel(),), -1, dtype=tags.dtype)])
    empty = torch.rand(h_n, generator=g) < 0.2  # some rows never used yet
    tags = torch.where(empty & ~torch.isin(tags, hot_sel), -1, tags)
    return tags[torch.randperm(h_n, generator=g)].to(torch.int32)
