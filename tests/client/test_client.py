"""Client API against a real hisparsed: round trips, prefix semantics, pins, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import hisparse
from hisparse import client
from hisparse.client import regions
from hisparse.protocol import MAX_KEYS_PER_REQUEST
from tests.client.engine import chain, page_for, pages_for

LAYOUT = hisparse.KVLayout(num_layers=4, block_tokens=16, row_bytes=64)  # 4 KiB pages


@pytest.fixture
def c(hisparsed):
    with client.attach("test/ns", LAYOUT, socket=hisparsed.socket, capacity="4MiB", timeout_s=5) as cl:
        yield cl


def random_pages(n: int, layout: hisparse.KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.page_bytes), dtype=torch.uint8, generator=g)


def test_store_then_load_is_byte_exact(c):
    keys = chain("a", 24)
    pages = random_pages(24)
    assert c.lookup(keys) == 0
    assert c.store(keys, pages) == 24
    assert c.lookup(keys) == 24
    out = torch.zeros_like(pages)
    assert c.load(keys, out) == 24
    assert torch.equal(out, pages)


def test_pages_land_in_the_region_layer_major(c):
    # The region's layout is the contract the resolver and vLLM's pool rely on.
    keys = chain("layers", 3)
    pages = random_pages(3, seed=1)
    c.store(keys, pages)
    lay = LAYOUT
    lpb = lay.block_tokens * lay.row_bytes
    with c.pin(keys) as p:
        for i, page_id in enumerate(p.page_ids.tolist()):
            for layer in range(lay.num_layers):
                rows = c.layer_rows(layer)
                assert rows.shape == (c.num_pages * lay.block_tokens, lay.row_bytes)
                got = rows[page_id * lay.block_tokens:(page_id + 1) * lay.block_tokens].reshape(-1)
                assert torch.equal(got, pages[i, layer * lpb:(layer + 1) * lpb])
            assert torch.equal(p.view(i).reshape(-1), pages[i])


def test_scattered_page_ids_and_skipped_keys_round_trip(c):
    # Interleaved stores and out-of-order loads split the copies into many runs.
    keys = chain("scatter", 20)
    pages = random_pages(20, seed=2)
    assert c.store(keys[::2], pages[::2]) == 10  # strided source rows: copied contiguous first
    assert c.store(keys, pages) == 10  # committed keys are skipped
    order = [7, 3, 19, 0, 1, 2, 11, 10, 5]
    out = torch.zeros((len(order), LAYOUT.page_bytes), dtype=torch.uint8)
    assert c.load([keys[i] for i in order], out) == len(order)
    assert torch.equal(out, pages[order])


def test_numpy_pages_round_trip(c):
    keys = chain("numpy", 6)
    pages = pages_for(keys, LAYOUT.page_bytes)
    assert c.store(keys[:3], pages[:3]) == 3
    assert c.store(keys, pages[:, :]) == 3
    backing = np.zeros(6 * LAYOUT.page_bytes + 1, dtype=np.uint8)
    out = backing[1:].reshape(6, LAYOUT.page_bytes)  # unaligned: copied byte by byte
    assert c.load(keys[::-1], out) == 6
    assert np.array_equal(out, pages[::-1])
    with pytest.raises(hisparse.InvalidArgument):
        c.load(keys, np.zeros((12, LAYOUT.page_bytes), dtype=np.uint8)[::2])


def test_unaligned_tensors_copy_bytewise(c):
    keys = chain("unaligned", 5)
    pages = random_pages(5, seed=3)
    backing = torch.zeros(5 * LAYOUT.page_bytes + 1, dtype=torch.uint8)
    odd = backing[1:].view(5, LAYOUT.page_bytes)
    odd.copy_(pages)
    assert odd.data_ptr() % 2 == 1
    assert c.store(keys, odd) == 5
    out_backing = torch.zeros(5 * LAYOUT.page_bytes + 3, dtype=torch.uint8)
    out = out_backing[3:].view(5, LAYOUT.page_bytes)
    assert c.load(keys, out) == 5
    assert torch.equal(out, pages)


def test_load_fills_only_the_committed_prefix(c):
    keys = chain("prefix", 10)
    pages = random_pages(10, seed=4)
    c.store(keys[:6], pages[:6])
    out = torch.full((12, LAYOUT.page_bytes), 7, dtype=torch.uint8)
    assert c.load(keys, out) == 6
    assert torch.equal(out[:6], pages[:6])
    assert bool((out[6:] == 7).all())
    # a gap stops the prefix even when later keys are committed
    c.store(keys[8:], pages[8:])
    assert c.lookup(keys) == 6


def test_full_region_stores_what_fits_in_key_order(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=2)
    with client.attach("small", LAYOUT, socket=d.socket, capacity=8 * LAYOUT.page_bytes) as cl:
        assert cl.num_pages == 8
        held = chain("held", 5)
        cl.store(held, random_pages(5))
        with cl.pin(held):
            # 3 pages are free and the 5 committed ones are pinned: nothing to evict
            keys = chain("more", 6)
            assert cl.store(keys, random_pages(6, seed=5)) == 3
            assert cl.lookup(keys) == 3
        # unpinned, the old pages are evicted for the rest
        assert cl.store(keys, random_pages(6, seed=5)) == 3
        assert cl.lookup(keys) == 6


def test_pins_hold_views_and_count(c):
    keys = chain("pin", 4)
    pages = random_pages(4, seed=6)
    c.store(keys[:3], pages[:3])
    p = c.pin(keys)
    assert p.count == len(p) == 3 and p.page_ids.dtype == np.int64
    assert torch.equal(p.view(-1).reshape(-1), pages[2])
    with pytest.raises(IndexError):
        p.view(3)
    with c.pin(keys[:1]) as q:  # pins are counted: two holds on page 0
        assert q.page_ids[0] == p.page_ids[0]
    assert c.stats()["namespaces"]["test/ns"]["pinned_pages"] == 3
    p.release()
    p.release()  # idempotent
    assert c.stats()["namespaces"]["test/ns"]["pinned_pages"] == 0
    with pytest.raises(hisparse.InvalidArgument):
        p.view(0)


def test_many_keys_are_split_across_requests(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=5, extra=("--min-page-bytes", "8"))
    tiny = hisparse.KVLayout(1, 1, 8)  # below the default min_page_bytes: many keys, little memory
    n = MAX_KEYS_PER_REQUEST + 1000
    keys = [i.to_bytes(8, "little") for i in range(n)]
    pages = torch.arange(n, dtype=torch.int64).view(torch.uint8).view(n, 8)
    with client.attach("tiny", tiny, socket=d.socket, capacity=n * 8, timeout_s=20) as cl:
        assert cl.store(keys, pages) == n
        assert cl.lookup(keys) == n
        out = torch.zeros_like(pages)
        assert cl.load(keys, out) == n
        assert torch.equal(out, pages)


def test_bad_arguments_are_invalid(c):
    keys = chain("bad", 2)
    with pytest.raises(hisparse.InvalidArgument):
        c.store(keys, random_pages(3))
    with pytest.raises(hisparse.InvalidArgument):
        c.store(keys, random_pages(2).to(torch.int16))
    with pytest.raises(hisparse.InvalidArgument):
        c.store([keys[0], keys[0]], random_pages(2))
    with pytest.raises(hisparse.InvalidArgument):
        c.load(keys, torch.zeros((1, LAYOUT.page_bytes), dtype=torch.uint8))
    with pytest.raises(hisparse.InvalidArgument):
        c.load(keys, torch.zeros((LAYOUT.page_bytes, 2), dtype=torch.uint8).t())
    with pytest.raises(hisparse.InvalidArgument):  # keys are 1-64 bytes (checked before sending)
        c.lookup([b"x" * 65])
    with pytest.raises(hisparse.InvalidArgument):
        c.layer_rows(LAYOUT.num_layers)
    with pytest.raises(hisparse.InvalidArgument):
        c.store(keys, random_pages(2).to("meta"))
    assert c.lookup(keys) == 0  # nothing above reserved or committed anything


def test_attach_with_another_layout_is_a_mismatch(c, hisparsed):
    with pytest.raises(hisparse.LayoutMismatch):
        client.attach("test/ns", hisparse.KVLayout(4, 16, 32), socket=hisparsed.socket)


def test_capacity_beyond_the_daemon_is_refused(hisparsed):
    with pytest.raises(hisparse.CapacityError):
        client.attach("huge", LAYOUT, socket=hisparsed.socket, capacity="1TiB")


def test_region_is_mapped_once_per_process(hisparsed):
    before = regions.mapped_regions()
    a = client.attach("shared", LAYOUT, socket=hisparsed.socket, capacity="1MiB")
    b = client.attach("shared", LAYOUT, socket=hisparsed.socket)
    assert a._session.region is b._session.region
    assert regions.mapped_regions() == before + 1
    keys = chain("once", 2)
    a.store(keys, pages_for(keys, LAYOUT.page_bytes))
    with b.pin(keys) as p:
        assert np.array_equal(p.view(1).reshape(-1).numpy(), page_for(keys[1], LAYOUT.page_bytes))
    a.close()
    b.close()
    assert regions.mapped_regions() == before


def test_stats_and_close(hisparsed):
    cl = client.attach("stats", LAYOUT, socket=hisparsed.socket, capacity="1MiB")
    keys = chain("s", 4)
    cl.store(keys, random_pages(4))
    cl.lookup(keys + chain("t", 2))
    s = cl.stats()
    assert s["namespaces"]["stats"]["committed_pages"] == 4
    assert s["client"]["stored_pages"] == 4 and s["client"]["stored_bytes"] == 4 * LAYOUT.page_bytes
    assert s["client"]["lookup_keys"] == 6 and s["client"]["hit_keys"] == 4
    assert s["daemon"]["sessions"] >= 1
    cl.close()
    cl.close()
    with pytest.raises(hisparse.InvalidArgument):
        cl.lookup(keys)


def test_an_interrupted_copy_aborts_its_reservations(daemon_factory):
    # A real failure in the middle of a store's copy: a signal handler raising
    # between the per-run copies. What was reserved must be aborted, never committed.
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    d = daemon_factory(capacity="256MiB", lease_ttl=5)
    layout = hisparse.KVLayout(8, 64, 656)
    rng = np.random.default_rng(7)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with client.attach("abort", layout, socket=d.socket, capacity="200MiB") as cl:
            for attempt in range(50):
                keys = chain(f"abort{attempt}", 128)
                pages = pages_for(keys, layout.page_bytes)
                cl.store(keys[::2], pages[::2])  # the rest is written in 64 one-page runs
                before = cl.stats()["namespaces"]["abort"]["aborted_pages"]
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0002, 0.004))
                try:
                    cl.store(keys, pages)
                    signal.setitimer(signal.ITIMER_REAL, 0)
                except Interrupted:
                    pass
                ns = cl.stats()["namespaces"]["abort"]
                if ns["aborted_pages"] > before:
                    break
            else:
                pytest.fail("the interrupt never landed inside a copy")
            assert all(cl.lookup([k]) == 0 for k in keys[1::2])  # none of them visible
            started = time.monotonic()
            assert cl.store(keys, pages) == 64  # all free again: none left WRITING (BUSY)
            assert time.monotonic() - started < 10.0  # no key left BUSY to wait out
            out = np.zeros_like(pages)
            assert cl.load(keys, out) == 128 and np.array_equal(out, pages)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
