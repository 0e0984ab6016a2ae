"""``resolve``: the fused sparse-tier resolver as one Triton kernel.

Same signature and results as ``reference.resolve_reference`` (which victim a
missing position takes, and the order among equal stamps, may differ). One
program per request does the whole step with no host synchronisation:

1. dedup: sort the ``Q*K`` entries as packed keys ``pos << E_BITS | entry``;
   an entry is the first of its position when it differs from its left
   neighbour. Duplicates need no gather-back: each sorted slot resolves its
   own position, and ranks below come from a prefix sum over first slots.
2. resident: one load from ``resident_blocks``.
3. hot: sort the tags as ``tag << H_BITS | h`` and binary-search every
   position among them (``log2 H`` register gathers). A hit writes
   ``hot_stamp = step``; since ``step`` is above every stamp, after a barrier
   "stamp == step" marks exactly the rows hit this step.
4. victims: sort ``stamp << H_BITS | h`` over the rows not hit; the i-th
   missing position (prefix sum over first slots that have a host page)
   takes the i-th oldest row. Tags and stamps of victims are written, and the
   position of rank i is parked in ``phys_rows[b]`` (as scratch: there are
   never more missing positions than entries) for the copy loop.
5. copy: loop over the victims in tiles of ``COPY_ROWS`` rows; each row is
   ``row_bytes`` moved as masked words (656 B rows are no power of two).
6. scatter every entry's row to ``phys_rows`` (overwriting the scratch),
   write the counters.

Requests ``>= num_real_reqs[0]`` (read on device) only write ``-1`` and zero
counters. Positions beyond the block table are overflow. Stamps must fit in
``63 - log2(H)`` bits (step numbers do).

With ``out=(phys_rows, counters)`` the launch allocates nothing, so it can be
captured in a CUDA graph; ``step`` and ``num_real_reqs`` are device tensors
read by the kernel, so a replay sees their current values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_POS_SENT = 1 << 32  # above every int32 position (and typed int64): invalid keys sort last
_I64_MAX = (1 << 63) - 1
_MIN_BLOCK = 16


@triton.jit
def _resolve_kernel(
    topk_ptr, nreal_ptr, res_ptr, pages_ptr, host_ptr, hrows_ptr, tags_ptr, stamp_ptr,
    step_ptr, kv_ptr, phys_ptr, cnt_ptr,
    QK, K, NB, H, bt,
    s_tb, s_tq, s_tk, s_rb, s_rn, s_pb, s_pn,
    s_hrb, s_hrh, s_tgb, s_tgh, s_stb, s_sth, s_cb,
    HOST_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr,
    ROW_WORDS: tl.constexpr, ROW_BLOCK: tl.constexpr, COPY_ROWS: tl.constexpr,
    E_BLOCK: tl.constexpr, E_BITS: tl.constexpr, H_BLOCK: tl.constexpr, H_BITS: tl.constexpr,
    POS_SENT: tl.constexpr, I64_MAX: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nreal = tl.load(nreal_ptr)
    e = tl.arange(0, E_BLOCK)
    e_ok = e < QK
    c4 = tl.arange(0, 4)
    phys_b = phys_ptr + b * QK  # phys_rows is contiguous: entry e of request b
    if b >= nreal:
        tl.store(phys_b + e, tl.full([E_BLOCK], -1, tl.int32), mask=e_ok)
        tl.store(cnt_ptr + b * s_cb + c4, tl.zeros([4], tl.int32))
    else:
        # 1. dedup by sorting (position, entry) keys; invalid entries sort last
        # but keep their entry index, so the final scatter writes their -1.
        pos = tl.load(topk_ptr + b * s_tb + (e // K) * s_tq + (e % K) * s_tk, mask=e_ok, other=-1)
        key = (tl.where(pos >= 0, pos.to(tl.int64), POS_SENT) << E_BITS) | e
        key = tl.sort(key)
        spos = key >> E_BITS
        ent = (key & (E_BLOCK - 1)).to(tl.int32)
        valid = spos < POS_SENT
        prev = tl.gather(spos, tl.maximum(e - 1, 0), 0)
        first = valid & ((e == 0) | (spos != prev))
        blk = spos // bt
        in_table = valid & (blk < NB)

        # 2. resident
        rblk = tl.load(res_ptr + b * s_rb + blk * s_rn, mask=in_table, other=-1).to(tl.int64)
        resident = rblk >= 0
        row = tl.where(resident, rblk * bt + spos % bt, -1)
        lookup = in_table & ~resident

        # 3. hot: lower bound of each position among the sorted tags.
        h = tl.arange(0, H_BLOCK)
        h_ok = h < H
        tag = tl.load(tags_ptr + b * s_tgb + h * s_tgh, mask=h_ok, other=-1)
        tkey = (tl.where(h_ok & (tag >= 0), tag.to(tl.int64), POS_SENT) << H_BITS) | h
        tkey = tl.sort(tkey)
        stag = tkey >> H_BITS
        lo = tl.zeros([E_BLOCK], tl.int32)
        for i in tl.static_range(H_BITS):
            probe = tl.gather(stag, lo + ((H_BLOCK >> (i + 1)) - 1), 0)
            lo = tl.where(probe < spos, lo + (H_BLOCK >> (i + 1)), lo)
        hkey = tl.gather(tkey, lo, 0)
        hit = lookup & ((hkey >> H_BITS) == spos)
        hit_h = (hkey & (H_BLOCK - 1)).to(tl.int32)
        hot_row = tl.load(hrows_ptr + b * s_hrb + hit_h * s_hrh, mask=hit, other=-1)
        row = tl.where(hit, hot_row.to(tl.int64), row)
        step = tl.load(step_ptr)
        stamp_b = stamp_ptr + b * s_stb
        tl.store(stamp_b + hit_h * s_sth, tl.zeros([E_BLOCK], tl.int64) + step, mask=hit & first)
        tl.debug_barrier()  # the hit stamps above must be seen by every thread below

        # 4. victims: rows not hit, oldest first.
        stamp = tl.load(stamp_b + h * s_sth, mask=h_ok, other=0, cache_modifier=".cg")
        cand = h_ok & (stamp != step)
        vkey = tl.sort(tl.where(cand, (stamp << H_BITS) | h, I64_MAX))
        vic_sorted = (vkey & (H_BLOCK - 1)).to(tl.int32)
        n_cand = tl.sum(cand.to(tl.int32), 0)
        page = tl.load(pages_ptr + b * s_pb + blk * s_pn, mask=lookup & ~hit, other=-1)
        wants = lookup & ~hit & (page >= 0)
        rank = tl.cumsum((wants & first).to(tl.int32), 0) - 1
        take = wants & (rank < n_cand)
        vic = tl.gather(vic_sorted, tl.minimum(tl.maximum(rank, 0), H_BLOCK - 1), 0)
        vrow = tl.load(hrows_ptr + b * s_hrb + vic * s_hrh, mask=take, other=-1)
        row = tl.where(take, vrow.to(tl.int64), row)
        owner = take & first
        tl.store(tags_ptr + b * s_tgb + vic * s_tgh, spos.to(tl.int32), mask=owner)
        tl.store(stamp_b + vic * s_sth, tl.zeros([E_BLOCK], tl.int64) + step, mask=owner)
        tl.store(phys_b + rank, spos.to(tl.int32), mask=owner)
        n_take = tl.minimum(tl.sum((wants & first).to(tl.int32), 0), n_cand)
        tl.debug_barrier()  # the parked positions must be seen by the copy loop

        # 5. copy host rows into the victims' rows.
        r = tl.arange(0, COPY_ROWS)
        w = tl.arange(0, ROW_BLOCK)
        w_ok = w < ROW_WORDS
        for r0 in range(0, n_take, COPY_ROWS):
            ri = r0 + r
            r_ok = ri < n_take
            p = tl.load(phys_b + ri, mask=r_ok, other=0, cache_modifier=".cg").to(tl.int64)
            hv = tl.gather(vic_sorted, tl.minimum(ri, H_BLOCK - 1), 0)
            dst = tl.load(hrows_ptr + b * s_hrb + hv * s_hrh, mask=r_ok, other=0).to(tl.int64)
            src_page = tl.load(pages_ptr + b * s_pb + (p // bt) * s_pn, mask=r_ok, other=0)
            src = src_page.to(tl.int64) * bt + p % bt
            m2 = r_ok[:, None] & w_ok[None, :]
            words = tl.load(host_ptr + src[:, None] * HOST_STRIDE + w[None, :], mask=m2)
            tl.store(kv_ptr + dst[:, None] * KV_STRIDE + w[None, :], words, mask=m2)
        tl.debug_barrier()  # the copy loop's reads of the scratch come first

        # 6. rows to every entry, then counters over first slots.
        tl.store(phys_b + ent, row.to(tl.int32), mask=ent < QK)
        n_res = tl.sum((first & resident).to(tl.int32), 0)
        n_hot = tl.sum((first & hit).to(tl.int32), 0)
        n_all = tl.sum(first.to(tl.int32), 0)
        n_ovf = n_all - n_res - n_hot - n_take
        cnt = tl.where(c4 == 0, n_res, tl.where(c4 == 1, n_hot, tl.where(c4 == 2, n_take, n_ovf)))
        tl.store(cnt_ptr + b * s_cb + c4, cnt)


def _words(t: torch.Tensor) -> torch.Tensor:
    """View a row-major uint8 ``[rows, row_bytes]`` table as int32 words when aligned.

    Wider accesses mean fewer instructions per byte; with the row stride a
    multiple of 4 words the compiler can also prove 16-byte alignment.
    """
    assert t.dtype == torch.uint8 and t.dim() == 2 and t.stride(1) == 1
    if t.shape[1] % 4 == 0 and t.stride(0) % 4 == 0 and t.data_ptr() % 4 == 0:
        return t.view(torch.int32)
    return t


def _interpreting() -> bool:
    return type(_resolve_kernel).__name__ == "InterpretedFunction"


def _block(n: int) -> int:
    return max(_MIN_BLOCK, triton.next_power_of_2(max(n, 1)))


def resolve(
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
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    copy_rows: int = 32,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Resolve ``topk`` into physical rows (see the module docstring and docs/design.md).

    ``out=(phys_rows, counters)``: contiguous int32 ``[B, Q, K]`` and ``[B, 4]``
    written in place, so that the launch allocates nothing.
    """
    batch, q_rows, k = topk.shape
    assert topk.dtype == torch.int32
    assert resident_blocks.dtype == torch.int32 and host_pages.dtype == torch.int64
    assert resident_blocks.shape == host_pages.shape and resident_blocks.shape[0] == batch
    assert hot_rows.shape == hot_tags.shape == hot_stamp.shape and hot_rows.shape[0] == batch
    assert hot_rows.dtype == torch.int32 and hot_tags.dtype == torch.int32
    assert hot_stamp.dtype == torch.int64 and step.dtype == torch.int64
    assert num_real_reqs.dtype == torch.int32
    assert host_rows.shape[1] == kv_rows.shape[1], "host and device rows differ in size"
    qk = q_rows * k
    assert qk <= 1 << 16, "more than 65536 entries per request"
    if out is None:
        phys_rows = torch.empty((batch, q_rows, k), dtype=torch.int32, device=topk.device)
        counters = torch.empty((batch, 4), dtype=torch.int32, device=topk.device)
    else:
        phys_rows, counters = out
        assert phys_rows.shape == topk.shape and phys_rows.dtype == torch.int32
        assert phys_rows.is_contiguous(), "phys_rows doubles as per-request scratch"
        assert counters.shape == (batch, 4) and counters.dtype == torch.int32
        assert counters.is_contiguous()
    if batch == 0:
        return phys_rows, counters
    if topk.device.type == "cpu" and not _interpreting():
        raise RuntimeError("resolve on CPU tensors runs only under Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before triton is imported")

    host_w, kv_w = _words(host_rows), _words(kv_rows)
    if host_w.dtype != kv_w.dtype:  # both tables must be moved in the same unit
        host_w, kv_w = host_rows, kv_rows
    row_words = host_w.shape[1]
    row_block = triton.next_power_of_2(row_words)
    # A copy tile of at most 8K elements keeps it in registers; the byte-wise
    # fallback (rows not a multiple of 4 bytes) gets fewer rows per tile.
    assert copy_rows > 0 and copy_rows & (copy_rows - 1) == 0, "copy_rows must be a power of two"
    copy_rows = max(1, min(copy_rows, 8192 // row_block))
    e_block, h_block = _block(qk), _block(hot_rows.shape[1])
    if num_warps is None:
        num_warps = 16 if e_block >= 8192 else 8 if e_block >= 2048 else 4
    _resolve_kernel[(batch,)](
        topk, num_real_reqs, resident_blocks, host_pages, host_w, hot_rows, hot_tags, hot_stamp,
        step, kv_w, phys_rows, counters,
        qk, k, resident_blocks.shape[1], hot_rows.shape[1], block_tokens,
        topk.stride(0), topk.stride(1), topk.stride(2),
        resident_blocks.stride(0), resident_blocks.stride(1),
        host_pages.stride(0), host_pages.stride(1),
        hot_rows.stride(0), hot_rows.stride(1), hot_tags.stride(0), hot_tags.stride(1),
        hot_stamp.stride(0), hot_stamp.stride(1), counters.stride(0),
        HOST_STRIDE=host_w.stride(0), KV_STRIDE=kv_w.stride(0),
        ROW_WORDS=row_words, ROW_BLOCK=row_block, COPY_ROWS=copy_rows,
        E_BLOCK=e_block, E_BITS=e_block.bit_length() - 1,
        H_BLOCK=h_block, H_BITS=h_block.bit_length() - 1,
        POS_SENT=_POS_SENT, I64_MAX=_I64_MAX,
        num_warps=num_warps,
    )
    return phys_rows, counters
