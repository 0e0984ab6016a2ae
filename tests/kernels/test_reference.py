"""resolve_reference on hand-built cases: the contract of docs/design.md "Sparse tier".

Scene used throughout: block_tokens 4, one request unless said, 4 logical
blocks (positions 0-15). Rows 0-7 of kv_rows are two resident device blocks;
hot rows are kv rows 100+h. Host page p holds host rows 4p..4p+3, whose bytes
are all equal to the host row id, so a copied row names where it came from.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import resolve_reference
from hisparse.kernels.unfused import resolve_unfused

BT = 4


def scene(topk, resident=(-1, -1, -1, -1), pages=(0, 1, 2, 3), tags=(-1, -1), stamps=(0, 0),
          step=10, num_real=None, batch=1):
    """Keyword arguments for one request (repeated ``batch`` times)."""
    h_n = len(tags)
    topk_t = torch.tensor(topk, dtype=torch.int32)
    if topk_t.dim() == 1:
        topk_t = topk_t[None]
    return dict(
        topk=topk_t[None].repeat(batch, 1, 1),
        num_real_reqs=torch.tensor([batch if num_real is None else num_real], dtype=torch.int32),
        resident_blocks=torch.tensor([resident] * batch, dtype=torch.int32),
        host_pages=torch.tensor([pages] * batch, dtype=torch.int64),
        host_rows=torch.arange(64, dtype=torch.uint8)[:, None].repeat(1, 3),
        block_tokens=BT,
        hot_rows=torch.tensor([[100 + b * h_n + h for h in range(h_n)] for b in range(batch)], dtype=torch.int32),
        hot_tags=torch.tensor([tags] * batch, dtype=torch.int32),
        hot_stamp=torch.tensor([stamps] * batch, dtype=torch.int64),
        step=torch.tensor([step], dtype=torch.int64),
        kv_rows=torch.full((100 + batch * h_n, 3), 255, dtype=torch.uint8),
    )


def test_resident_positions_map_into_their_device_block():
    # blocks 0 and 2 resident in device blocks 1 and 0
    s = scene([[1, 9, 3]], resident=(1, -1, 0, -1))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[5, 1, 7]]]
    assert cnt.tolist() == [[3, 0, 0, 0]]
    assert s["hot_stamp"].tolist() == [[0, 0]]


def test_hot_hit_returns_the_row_and_refreshes_its_stamp():
    s = scene([[6]], tags=(-1, 6), stamps=(3, 4))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[101]]]
    assert cnt.tolist() == [[0, 1, 0, 0]]
    assert s["hot_stamp"].tolist() == [[3, 10]]


def test_fifo_hit_leaves_the_stamp():
    s = scene([[6]], tags=(-1, 6), stamps=(3, 4))
    resolve_reference(**s, policy="fifo")
    assert s["hot_stamp"].tolist() == [[3, 4]]


def test_missing_position_takes_the_oldest_row_and_copies_its_host_row():
    # position 6 is page 1, host row 1*4+2 = 6
    s = scene([[6]], tags=(5, 7), stamps=(8, 2))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[101]]]
    assert cnt.tolist() == [[0, 0, 1, 0]]
    assert s["hot_tags"].tolist() == [[5, 6]]
    assert s["hot_stamp"].tolist() == [[8, 10]]
    assert s["kv_rows"][101].tolist() == [6, 6, 6]
    assert s["kv_rows"][100].tolist() == [255, 255, 255]


def test_a_row_hit_this_step_is_never_a_victim_even_when_oldest():
    # row 0 (stamp 1) is hit by 5; 9 misses and must take row 1 (stamp 7)
    s = scene([[5, 9]], tags=(5, 2), stamps=(1, 7))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[100, 101]]]
    assert cnt.tolist() == [[0, 1, 1, 0]]
    assert s["hot_tags"].tolist() == [[5, 9]]


def test_missing_without_host_page_or_victim_is_overflow():
    # block 3 has no host page; only one victim for two loadable misses
    s = scene([[13, 1, 2]], pages=(0, 1, 2, -1), tags=(-1,), stamps=(0,))
    rows, cnt = resolve_reference(**s)
    assert cnt.tolist() == [[0, 0, 1, 2]]
    got = rows[0, 0].tolist()
    assert got[0] == -1 and sorted(got[1:]) == [-1, 100]


def test_duplicates_within_and_across_query_rows_share_one_row():
    s = scene([[6, 6, -1], [-1, 6, 2]], tags=(-1, -1), stamps=(0, 1))
    rows, cnt = resolve_reference(**s)
    r6, r2 = rows[0, 0, 0].item(), rows[0, 1, 2].item()
    assert rows.tolist() == [[[r6, r6, -1], [-1, r6, r2]]]
    assert {r6, r2} == {100, 101}
    assert cnt.tolist() == [[0, 0, 2, 0]]  # counted once per distinct position


def test_positions_beyond_the_table_are_overflow():
    s = scene([[16, 1000, 3]], resident=(0, -1, -1, -1))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[-1, -1, 3]]]
    assert cnt.tolist() == [[1, 0, 0, 2]]


def test_a_stale_hot_copy_of_a_resident_position_is_a_candidate():
    # 1 is resident now; row 0 still holds it, and is the victim for 9
    s = scene([[1, 9]], resident=(0, -1, -1, -1), tags=(1, 8), stamps=(2, 5))
    rows, cnt = resolve_reference(**s)
    assert rows.tolist() == [[[1, 100]]]
    assert cnt.tolist() == [[1, 0, 1, 0]]
    assert s["hot_tags"].tolist() == [[9, 8]]


def test_padded_requests_get_minus_one_and_keep_their_state():
    s = scene([[6, 9]], tags=(6, -1), stamps=(1, 2), batch=2, num_real=1)
    before = {k: s[k].clone() for k in ("hot_tags", "hot_stamp", "kv_rows")}
    rows, cnt = resolve_reference(**s)
    assert rows[1].tolist() == [[-1, -1]] and cnt[1].tolist() == [0, 0, 0, 0]
    assert s["hot_tags"][1].tolist() == before["hot_tags"][1].tolist()
    assert s["hot_stamp"][1].tolist() == before["hot_stamp"][1].tolist()
    assert torch.equal(s["kv_rows"][102:], before["kv_rows"][102:])
    assert cnt[0].tolist() == [0, 1, 1, 0]


def test_lru_order_over_steps_decides_the_victim():
    # step 10: 1 and 5 loaded; step 11: 1 hit again; step 12: 9 must evict 5
    s = scene([[1, 5]], tags=(-1, -1), stamps=(0, 0), step=10)
    resolve_reference(**s)
    row_of = {t: 100 + h for h, t in enumerate(s["hot_tags"][0].tolist())}
    for step, topk in ((11, [[1, -1]]), (12, [[9, 1]])):
        s.update(topk=torch.tensor([topk], dtype=torch.int32), step=torch.tensor([step]))
        rows, _ = resolve_reference(**s)
    assert rows[0, 0].tolist() == [row_of[5], row_of[1]]
    assert sorted(s["hot_tags"][0].tolist()) == [1, 9]


def test_fifo_evicts_in_load_order_where_lru_keeps_the_reused_row():
    results = {}
    for policy in ("lru", "fifo"):
        s = scene([[1, -1]], tags=(-1, -1), stamps=(0, 0), step=10)
        for step, topk in ((10, [[1, -1]]), (11, [[5, -1]]), (12, [[1, -1]]), (13, [[9, -1]])):
            s.update(topk=torch.tensor([topk], dtype=torch.int32), step=torch.tensor([step]))
            resolve_reference(**s, policy=policy)
        results[policy] = sorted(s["hot_tags"][0].tolist())
    assert results == {"lru": [1, 9], "fifo": [5, 9]}


def test_exactly_enough_hot_rows_for_the_misses():
    s = scene([[1, 6, 11]], tags=(-1, -1, -1), stamps=(0, 0, 0))
    rows, cnt = resolve_reference(**s)
    assert cnt.tolist() == [[0, 0, 3, 0]]
    assert sorted(rows[0, 0].tolist()) == [100, 101, 102]
    assert [s["kv_rows"][r, 0].item() for r in rows[0, 0].tolist()] == [1, 6, 11]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        resolve_reference(**scene([[1]]), policy="mru")


@pytest.mark.parametrize("case", [
    dict(topk=[[1, 6, 9, 6]], resident=(0, -1, -1, -1), tags=(9, -1), stamps=(3, 1)),
    dict(topk=[[13, 1, 2]], pages=(0, 1, 2, -1), tags=(-1,), stamps=(0,)),
    dict(topk=[[5, 9], [9, 14]], tags=(5, 2), stamps=(1, 7), batch=3, num_real=2),
])
def test_unfused_baseline_matches_the_reference_exactly(case):
    a, b = scene(**case), scene(**case)
    ra, ca = resolve_reference(**a)
    rb, cb = resolve_unfused(**b)
    assert torch.equal(ra, rb) and torch.equal(ca, cb)
    for k in ("hot_tags", "hot_stamp", "kv_rows"):
        assert torch.equal(a[k], b[k]), k
