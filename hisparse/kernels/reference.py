"""The executable definition of one sparse-tier resolve step (docs/design.md, "Sparse tier").

``resolve_reference`` is plain torch, one request at a time, written to be read
rather than to be fast. The Triton kernel (``resolve``) and the unfused torch
baseline (``unfused.resolve_unfused``) are checked against it.

For each real request ``b`` (``b < num_real_reqs[0]``), with ``U`` the distinct
valid positions (``>= 0``) of ``topk[b]`` over all query rows and
``bt = block_tokens``, every position of ``U`` is classified once:

1. resident: ``resident_blocks[b, pos // bt] >= 0``; its row is
   ``resident_blocks[b, pos // bt] * bt + pos % bt``;
2. hot: some hot row ``h`` holds it (``hot_tags[b, h] == pos``); its row is
   ``hot_rows[b, h]``, and with the LRU policy ``hot_stamp[b, h] = step``.
   Should two hot rows hold the same tag (a state the resolver never makes),
   the smallest ``h`` wins and the other is an ordinary victim candidate;
3. missing: the victims are hot rows not hit in 2, least recently used first
   (smallest stamp; ties by smallest ``h`` here, free in general). Missing
   positions that have a host page take victims in increasing position order
   here (free in general): the host row is copied into ``kv_rows``, the row's
   tag becomes the position and its stamp ``step``;
4. overflow: a missing position without a host page, or with no victim left,
   gets ``-1``. So does a position beyond the block table
   (``pos // bt >= NB``): it cannot be resident nor have a host page, and is
   counted as overflow instead of indexing out of bounds.

Counters per request are ``[resident, hot, missing, overflow]`` over ``U``
(missing counts the positions that were loaded, so the four add up to
``|U|``). Padded requests get ``-1`` everywhere, zero counters and untouched
state.

``policy="fifo"`` (reference only, for the hit-rate benchmark) leaves a hit
row's stamp alone, so rows are evicted in load order instead of use order.
"""

from __future__ import annotations

import torch

RESIDENT, HOT, MISSING, OVERFLOW = range(4)

_POLICIES = ("lru", "fifo")


def resolve_reference(
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
    policy: str = "lru",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resolve ``topk`` into physical rows; updates hot state and ``kv_rows`` in place.

    Returns ``(phys_rows int32 [B, Q, K], counters int32 [B, 4])``.
    """
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, not {policy!r}")
    assert topk.dim() == 3, "topk is [B, Q, K]"
    batch = topk.shape[0]
    assert resident_blocks.shape[0] == host_pages.shape[0] == batch
    assert resident_blocks.shape == host_pages.shape
    assert hot_rows.shape == hot_tags.shape == hot_stamp.shape and hot_rows.shape[0] == batch
    assert block_tokens > 0

    phys_rows = torch.full(topk.shape, -1, dtype=torch.int32, device=topk.device)
    counters = torch.zeros((batch, 4), dtype=torch.int32, device=topk.device)
    num_real = min(int(num_real_reqs.reshape(-1)[0]), batch)
    step_now = int(step.reshape(-1)[0])
    for b in range(num_real):
        rows_of_u, counts = _resolve_one(
            b, topk[b].reshape(-1), resident_blocks[b], host_pages[b], host_rows,
            block_tokens, hot_rows[b], hot_tags[b], hot_stamp[b], step_now, kv_rows, policy,
        )
        phys_rows[b] = rows_of_u.to(torch.int32).reshape(topk.shape[1:])
        counters[b] = torch.tensor(counts, dtype=torch.int32)
    return phys_rows, counters


def _resolve_one(
    b: int,
    entries: torch.Tensor,
    resident_blocks: torch.Tensor,
    host_pages: torch.Tensor,
    host_rows: torch.Tensor,
    bt: int,
    hot_rows: torch.Tensor,
    hot_tags: torch.Tensor,
    hot_stamp: torch.Tensor,
    step_now: int,
    kv_rows: torch.Tensor,
    policy: str,
) -> tuple[torch.Tensor, list[int]]:
    """One request: returns the row of every entry and the four counters."""
    entries = entries.to(torch.int64)
    valid = entries >= 0
    # inverse maps each valid entry to its position in U, so every occurrence
    # of a position gets the one row decided for it.
    u, inverse = torch.unique(entries[valid], sorted=True, return_inverse=True)
    nb = resident_blocks.shape[0]
    block = u // bt
    offset = u % bt
    in_table = block < nb
    safe_block = torch.where(in_table, block, torch.zeros_like(block))

    res_block = torch.where(in_table, resident_blocks[safe_block].to(torch.int64), -1)
    resident = res_block >= 0
    row = torch.where(resident, res_block * bt + offset, torch.full_like(u, -1))
    kind = torch.full_like(u, OVERFLOW)
    kind[resident] = RESIDENT

    # Hot hits: only positions inside the table and not resident may be hot.
    lookup = in_table & ~resident
    hit_h = _find_tags(u, hot_tags.to(torch.int64))
    hit = lookup & (hit_h >= 0)
    row[hit] = hot_rows[hit_h[hit]].to(torch.int64)
    kind[hit] = HOT
    hit_mask = torch.zeros(hot_tags.shape[0], dtype=torch.bool, device=u.device)
    hit_mask[hit_h[hit]] = True
    if policy == "lru":
        hot_stamp[hit_h[hit]] = step_now

    # Misses with a host page take victims, lowest position first.
    page = torch.where(lookup, host_pages[safe_block].to(torch.int64), -1)
    wants = lookup & ~hit & (page >= 0)
    victims = _lru_victims(hot_stamp, ~hit_mask)
    want_idx = torch.nonzero(wants).flatten()
    n_take = min(want_idx.numel(), victims.numel())
    take_idx, take_h = want_idx[:n_take], victims[:n_take]
    src = page[take_idx] * bt + offset[take_idx]
    dst = hot_rows[take_h].to(torch.int64)
    kv_rows[dst] = host_rows[src].to(kv_rows.device)
    hot_tags[take_h] = u[take_idx].to(hot_tags.dtype)
    hot_stamp[take_h] = step_now
    row[take_idx] = dst
    kind[take_idx] = MISSING

    rows_of_entries = torch.full_like(entries, -1)
    rows_of_entries[valid] = row[inverse]
    counts = [int((kind == k).sum()) for k in (RESIDENT, HOT, MISSING, OVERFLOW)]
    return rows_of_entries, counts


def _find_tags(u: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """For each position of ``u``: the smallest ``h`` with ``tags[h] == pos``, else -1."""
    if tags.numel() == 0 or u.numel() == 0:
        return torch.full_like(u, -1)
    sorted_tags, order = torch.sort(tags, stable=True)
    at = torch.searchsorted(sorted_tags, u).clamp(max=tags.numel() - 1)
    found = sorted_tags[at] == u
    return torch.where(found, order[at], torch.full_like(u, -1))


def _lru_victims(stamp: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Candidate hot rows, oldest stamp first (ties: smallest ``h``)."""
    idx = torch.nonzero(candidate).flatten()
    order = torch.sort(stamp[idx], stable=True).indices
    return idx[order]
