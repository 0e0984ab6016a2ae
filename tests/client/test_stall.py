"""A writer stalled past half its lease never writes into its reservations."""

from __future__ import annotations

import time

import pytest
import torch

import hisparse
from hisparse import client
from hisparse.client.client import Client
from tests.client.engine import chain

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)


def test_a_store_stalled_after_reserve_aborts_and_writes_nothing(daemon_factory, monkeypatch):
    d = daemon_factory(lease_ttl=1.0)
    with client.attach("stall", LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8) as c:
        real_reserve = Client._reserve

        def stalled_reserve(self, keys):
            reply = real_reserve(self, keys)
            time.sleep(0.6)  # a GC pause, a SIGSTOP: over half the 1 s lease
            return reply

        monkeypatch.setattr(Client, "_reserve", stalled_reserve)
        keys = chain("stall", 3)
        pages = torch.full((3, LAYOUT.page_bytes), 7, dtype=torch.uint8)
        before = bytes(c.layer_rows(0).numpy())
        with pytest.raises(hisparse.Timeout, match="nothing written"):
            c.store(keys, pages)
        monkeypatch.undo()
        assert bytes(c.layer_rows(0).numpy()) == before, "no byte of the region changed"
        ns = c.stats()["namespaces"]["stall"]
        assert ns["writing_pages"] == 0 and ns["committed_pages"] == 0
        assert c.store(keys, pages) == 3  # unstalled, it goes through
