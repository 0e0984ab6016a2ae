"""The sparse session against a real hisparsed: spilled rows come back exact.

A request's KV lives in an engine-style cache (uint8 rows per layer). Each
position's row holds bytes derived from (layer, position), written once at
"prefill". Old blocks are spilled (stored, pinned, their engine blocks
handed back), and then every row the resolver returns for a position must
hold exactly the bytes first written for it, whether resident, hot or
pulled from the host slab.
"""

from __future__ import annotations

import pytest
import torch

import hisparse
from hisparse import client
from hisparse.client.sparse import BlockAllocator, SparseSession

LAYOUT = hisparse.KVLayout(num_layers=3, block_tokens=4, row_bytes=16)
NUM_ENGINE_BLOCKS = 64


def row_bytes_for(layer: int, pos: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layer * 1_000_003 + pos)
    return torch.randint(0, 256, (LAYOUT.row_bytes,), dtype=torch.uint8, generator=g)


@pytest.fixture
def engine(hisparsed):
    c = client.attach("test/sparse", LAYOUT, socket=hisparsed.socket, capacity=LAYOUT.page_bytes * 32)
    kv = [torch.zeros((NUM_ENGINE_BLOCKS * LAYOUT.block_tokens, LAYOUT.row_bytes), dtype=torch.uint8)
          for _ in range(LAYOUT.num_layers)]
    alloc = BlockAllocator(NUM_ENGINE_BLOCKS)
    yield c, kv, alloc
    c.close()


def prefill(session: SparseSession, kv, alloc, request_id: str, num_blocks: int):
    blocks = alloc.allocate(num_blocks)
    bt = LAYOUT.block_tokens
    for b, e in enumerate(blocks):
        for t in range(bt):
            for layer in range(LAYOUT.num_layers):
                kv[layer][e * bt + t] = row_bytes_for(layer, b * bt + t)
    return session.add_request(request_id, blocks)


def check_rows(kv, layer: int, topk: torch.Tensor, phys: torch.Tensor) -> int:
    """Every returned row holds its position's bytes; returns how many rows were checked."""
    checked = 0
    for b in range(topk.shape[0]):
        for pos, row in zip(topk[b].reshape(-1).tolist(), phys[b].reshape(-1).tolist()):
            if pos < 0:
                assert row == -1
                continue
            assert row >= 0, f"position {pos} overflowed"
            assert torch.equal(kv[layer][row], row_bytes_for(layer, pos)), (layer, pos, row)
            checked += 1
    return checked


def test_spilled_rows_come_back_exact(engine):
    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=12, active_tail_blocks=2, max_blocks=16)
    req = prefill(session, kv, alloc, "r0", 10)
    free_before = alloc.num_free
    assert session.spill(req) == 8
    assert alloc.num_free == free_before + 8, "spilled blocks go back to the engine's allocator"
    assert req.num_spilled == 8 and req.blocks[:8] == [-1] * 8
    # another request reuses the handed-back blocks and overwrites them
    for e in alloc.allocate(8):
        for layer in range(LAYOUT.num_layers):
            kv[layer][e * 4:(e + 1) * 4] = 0xEE
    positions = [0, 5, 9, 13, 31, 38, 39, -1, 5]  # spilled, spilled..., resident tail, pad, dup
    topk = torch.tensor([[positions]], dtype=torch.int32)
    for step in (1, 2):
        for layer in range(LAYOUT.num_layers):
            phys, counters = session.resolve([req], layer, topk, step)
            assert check_rows(kv, layer, topk, phys) == 8
            if step == 1:
                assert counters[0].tolist() == [2, 0, 5, 0]  # resident, hot, missing, overflow
            else:
                assert counters[0].tolist() == [2, 5, 0, 0]  # now all hot


def test_lru_hot_rows_and_overflow_never_give_a_wrong_row(engine):
    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=4, active_tail_blocks=1, max_blocks=16)
    req = prefill(session, kv, alloc, "r1", 8)
    session.spill(req)
    topk = torch.tensor([[[0, 1, 2, 3, 4, 5]]], dtype=torch.int32)  # 6 missing, 4 hot rows
    phys, counters = session.resolve([req], 0, topk, 1)
    assert counters[0].tolist() == [0, 0, 4, 2]
    assert (phys == -1).sum() == 2
    check_rows(kv, 0, torch.where(phys >= 0, topk, -1), phys)


def test_release_unpins_and_frees_every_block(engine, hisparsed):
    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=8, active_tail_blocks=1, max_blocks=16)
    req = prefill(session, kv, alloc, "r2", 6)
    session.spill(req)
    ns = c.stats()["namespaces"]["test/sparse"]
    assert ns["pinned_pages"] == 5
    session.release(req)
    assert alloc.num_free == NUM_ENGINE_BLOCKS
    assert c.stats()["namespaces"]["test/sparse"]["pinned_pages"] == 0
    assert c.lookup(req.keys[:5]) == 5, "released pages stay cached until evicted"


def test_triton_resolver_agrees_through_the_session(engine):
    from hisparse import kernels  # interpreted on CPU: tests/conftest.py sets TRITON_INTERPRET

    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=8, active_tail_blocks=1, max_blocks=8,
                            resolver=kernels.resolve)
    req = prefill(session, kv, alloc, "r3", 6)
    session.spill(req)
    topk = torch.tensor([[[1, 6, 22, 17, 1, -1]]], dtype=torch.int32)
    phys, counters = session.resolve([req], 1, topk, 1)
    assert counters[0].tolist() == [1, 0, 3, 0]  # 22 is in the resident tail block
    check_rows(kv, 1, topk, phys)


def test_ending_a_request_compacts_the_slots_and_keeps_state(engine):
    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=8, active_tail_blocks=1, max_blocks=8, max_reqs=4)
    r0, r1 = prefill(session, kv, alloc, "a", 4), prefill(session, kv, alloc, "b", 4)
    for req in (r0, r1):
        session.spill(req)
    topk = torch.tensor([[[0, 5, 14]], [[1, 6, 15]], [[-1, -1, -1]]], dtype=torch.int32)  # one pad row
    phys, counters = session.resolve(session.batch, 0, topk, 1)
    assert counters[:2, 2].tolist() == [2, 2] and counters[2].tolist() == [0, 0, 0, 0]
    check_rows(kv, 0, topk, phys)
    session.release(r0)
    assert session.batch == [r1] and r1.slot == 0 and int(session.num_real_reqs) == 1
    # r1 moved to slot 0 with its hot rows: what was missing before is hot now
    phys, counters = session.resolve(session.batch, 0, topk[1:2], 2)
    assert counters[0].tolist() == [1, 2, 0, 0]
    check_rows(kv, 0, topk[1:2], phys)
    assert (session.resident_blocks[1] == -1).all() and (session.hot_tags[:, 1] == -1).all()


def test_a_step_reads_and_writes_only_persistent_tensors(engine):
    from hisparse import kernels

    c, kv, alloc = engine
    session = SparseSession(c, kv, alloc, hot_rows=8, active_tail_blocks=1, max_blocks=8, max_reqs=2,
                            resolver=kernels.resolve)
    req = prefill(session, kv, alloc, "g", 5)
    session.spill(req)
    topk = torch.tensor([[[0, 9, 17]], [[-1, -1, -1]]], dtype=torch.int32)
    step = torch.ones(1, dtype=torch.int64)
    out = (torch.empty((2, 1, 3), dtype=torch.int32), torch.empty((2, 4), dtype=torch.int32))
    tags_before = session.hot_tags[2].data_ptr()
    for expect in ([1, 0, 2, 0], [1, 2, 0, 0]):
        phys, counters = session.resolve(session.batch, 2, topk, step, out=out)
        assert phys.data_ptr() == out[0].data_ptr() and counters.data_ptr() == out[1].data_ptr()
        assert counters[0].tolist() == expect
        check_rows(kv, 2, topk, phys)
        step += 1  # in place, as a captured graph's caller would
    assert session.hot_tags[2].data_ptr() == tags_before
    assert int((session.hot_tags[2, 0] >= 0).sum()) == 2
