"""``store`` says what became of every key: written, already there, or not stored for want of room."""

from __future__ import annotations

import logging
import pickle

import numpy as np

import hisparse
from hisparse import client
from hisparse.client import StoreResult
from tests.client.engine import chain

LAYOUT = hisparse.KVLayout(num_layers=4, block_tokens=16, row_bytes=64)  # 4 KiB pages


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes), dtype=np.uint8)


def test_a_store_into_a_full_region_counts_what_it_left_out_and_warns_once(daemon_factory, caplog):
    d = daemon_factory()  # room, not quota, is what this store runs out of
    with client.attach("results/small", LAYOUT, socket=d.socket,
                       capacity=8 * LAYOUT.page_bytes) as c, caplog.at_level(logging.WARNING):
        first = chain("first", 3)
        assert c.store(first, pages(3)) == 3
        with c.pin(first):  # 3 pages held: 5 left to write into, nothing to evict
            keys = first + chain("more", 17)
            r = c.store(keys, pages(20, seed=1))
            # int-like as before: the pages newly written
            assert r == 5 and int(r) == 5 and r + 1 == 6 and isinstance(r, int)
            assert (r.stored, r.present, r.not_stored) == (5, 3, 12) and not r.complete
            assert c.lookup(keys) == 8
            # again: the 5 unpinned pages it wrote are evicted for the next 5 keys, and
            # the 7 after them find no room: counted, but not logged a second time
            again = c.store(keys, pages(20, seed=1))
            assert (again.stored, again.present, again.not_stored) == (5, 8, 7)
    warnings = [rec.getMessage() for rec in caplog.records if "not stored" in rec.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'results/small' (8 pages): 12 of 20 keys not stored" in warnings[0]


def test_a_store_that_places_every_key_is_complete_and_quiet(hisparsed, caplog):
    with client.attach("results/roomy", LAYOUT, socket=hisparsed.socket,
                       capacity=64 * LAYOUT.page_bytes) as c, caplog.at_level(logging.WARNING):
        keys = chain("roomy", 6)
        assert c.store(keys[:2], pages(2)) == 2
        r = c.store(keys, pages(6))
        assert (r.stored, r.present, r.not_stored, r.complete) == (4, 2, 0, True)
        assert c.store([], pages(0)) == 0
    assert not [rec for rec in caplog.records if "not stored" in rec.getMessage()]


def test_store_result_behaves_as_the_int_it_was():
    r = StoreResult(5, present=3, not_stored=12)
    assert r == 5 and r * 2 == 10 and f"{r}" == "5" and sum([r, r]) == 10 and bool(StoreResult(0)) is False
    assert repr(r) == "StoreResult(stored=5, present=3, not_stored=12)"
    back = pickle.loads(pickle.dumps(r))
    assert back == 5 and (back.present, back.not_stored) == (3, 12)
