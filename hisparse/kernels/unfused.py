"""The resolve step from ordinary torch ops, batched over requests: the baseline.

This is what one writes without a fused kernel: ``unique`` for the union,
``searchsorted`` for hot hits, a sort for LRU victims, ``index_copy_`` for the
rows. It launches a few dozen kernels and synchronises with the host
(``nonzero``, ``.item()``), so it cannot be captured in a CUDA graph;
``benchmarks/resolve_gpu.py`` times ``resolve`` against it. Results follow the
contract (``resolve_reference``): same victims even, since both take the
oldest rows in ``(stamp, h)`` order for missing positions in increasing order.

Requests are folded into one key space, ``b * span + pos``, so that one
``unique`` and one sort serve the whole batch.
"""

from __future__ import annotations

import torch


def resolve_unfused(
    *,
    topk: torch.Tensor,
    num_real_reqs: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_pages: torch.Tensor,
    host_rows: torch.Tensor,
    block_tokens: int,
    hot_rows: torch.Tensor,
    hot_tags: torch.Tensor,
    hot_stamp: torch.Tensor,
    step: torch.Tensor,
    kv_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``resolve_reference``; returns ``(phys_rows, counters)``."""
    dev = topk.device
    batch, q_rows, k = topk.shape
    nb, h_n, bt = resident_blocks.shape[1], hot_tags.shape[1], block_tokens
    num_real = min(int(num_real_reqs[0].item()), batch)  # host sync: fine for a baseline
    phys_rows = torch.full(topk.shape, -1, dtype=torch.int32, device=dev)
    counters = torch.zeros((batch, 4), dtype=torch.int32, device=dev)
    if num_real == 0:
        return phys_rows, counters
    if not hot_stamp.is_contiguous() or not hot_tags.is_contiguous():
        raise ValueError("resolve_unfused needs contiguous hot_tags and hot_stamp")
    step_now = step.reshape(1)
    span = (1 << 32)  # positions are int32, so b * span + pos never collides

    # The union U of every real request, as keys b * span + pos.
    pos = topk[:num_real].reshape(num_real, -1).to(torch.int64)
    req = torch.arange(num_real, device=dev)[:, None].expand_as(pos)
    valid = pos >= 0
    keys, inverse = torch.unique((req * span + pos)[valid], return_inverse=True)
    u_req, u_pos = keys // span, keys % span
    block, offset = u_pos // bt, u_pos % bt
    in_table = block < nb
    safe = torch.where(in_table, block, 0)

    res_block = torch.where(in_table, resident_blocks[u_req, safe].to(torch.int64), -1)
    resident = res_block >= 0
    row = torch.where(resident, res_block * bt + offset, -1)
    lookup = in_table & ~resident

    # Hot hits: search every key among the batch's tags, keyed the same way.
    tag_keys = torch.where(hot_tags[:num_real] >= 0,
                           torch.arange(num_real, device=dev)[:, None] * span + hot_tags[:num_real].to(torch.int64),
                           -1).reshape(-1)
    if h_n:
        sorted_tags, order = torch.sort(tag_keys, stable=True)  # stable: smallest h first
        at = torch.searchsorted(sorted_tags, keys).clamp(max=tag_keys.numel() - 1)
        hit = lookup & (sorted_tags[at] == keys)
        hit_flat = order[at][hit]  # b * H + h of each hit row
    else:
        hit = torch.zeros_like(lookup)
        hit_flat = torch.zeros(0, dtype=torch.int64, device=dev)
    row[hit] = hot_rows[:num_real].reshape(-1)[hit_flat].to(torch.int64)
    stamp_flat = hot_stamp[:num_real].reshape(-1)  # a view: writes land in hot_stamp
    stamp_flat[hit_flat] = step_now.expand(hit_flat.numel())

    # Victims: rows not hit, per request oldest first; the i-th missing
    # position of a request (in position order) takes its i-th victim.
    not_hit = torch.ones(num_real * h_n, dtype=torch.bool, device=dev)
    not_hit[hit_flat] = False
    v_order = torch.argsort(torch.where(not_hit, stamp_flat, torch.iinfo(torch.int64).max).reshape(num_real, h_n),
                            dim=1, stable=True)
    n_cand = not_hit.reshape(num_real, h_n).sum(1)
    page = torch.where(lookup & ~hit, host_pages[u_req, safe], -1)
    wants = lookup & ~hit & (page >= 0)
    want_req = u_req[wants]
    # rank within the request: keys are sorted by (request, position).
    start = torch.searchsorted(want_req, torch.arange(num_real, device=dev))
    rank = torch.arange(want_req.numel(), device=dev) - start[want_req]
    ok = rank < n_cand[want_req]
    want_idx = torch.nonzero(wants).flatten()[ok]
    take_req, take_rank = want_req[ok], rank[ok]
    take_h = v_order[take_req, take_rank]
    take_flat = take_req * h_n + take_h
    dst = hot_rows[:num_real].reshape(-1)[take_flat].to(torch.int64)
    src = page[want_idx] * bt + offset[want_idx]
    kv_rows.index_copy_(0, dst, host_rows.index_select(0, src).to(kv_rows.device))
    hot_tags[:num_real].reshape(-1)[take_flat] = u_pos[want_idx].to(hot_tags.dtype)
    stamp_flat[take_flat] = step_now.expand(take_flat.numel())
    row[want_idx] = dst

    kind = torch.full_like(keys, 3)  # overflow unless classified below
    kind[resident] = 0
    kind[hit] = 1
    kind[want_idx] = 2
    counts = torch.zeros(num_real * 4, dtype=torch.int64, device=dev)
    counts.index_add_(0, u_req * 4 + kind, torch.ones_like(kind))
    counters[:num_real] = counts.reshape(num_real, 4).to(torch.int32)
    rows_of_entries = torch.full_like(pos, -1)
    rows_of_entries[valid] = row[inverse]
    phys_rows[:num_real] = rows_of_entries.reshape(num_real, q_rows, k).to(torch.int32)
    return phys_rows, counters
