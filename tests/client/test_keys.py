"""Bad keys are refused on the client, before any request: with the key's index, the limit, the fix."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import hisparse
from hisparse import client

LAYOUT = hisparse.KVLayout(num_layers=4, block_tokens=16, row_bytes=64)


def daemon_counts(c: client.Client) -> tuple[int, int]:
    s = c.stats()
    return s["daemon"]["errors"], s["namespaces"]["keys/ns"]["writing_pages"]


def test_an_oversized_key_is_refused_before_any_request(hisparsed, caplog):
    good = [bytes([i]) * 32 for i in range(3)]
    with client.attach("keys/ns", LAYOUT, socket=hisparsed.socket, capacity="1MiB") as c, \
            caplog.at_level(logging.DEBUG, logger="hisparse"):
        before = daemon_counts(c)
        keys = [*good, b"k" * 65]
        page = np.zeros((4, LAYOUT.page_bytes), dtype=np.uint8)
        calls = {"store": lambda: c.store(keys, page), "lookup": lambda: c.lookup(keys),
                 "load": lambda: c.load(keys, page), "pin": lambda: c.pin(keys),
                 "prefetch": lambda: c.prefetch(keys), "lookup_remote": lambda: c.lookup_remote(keys)}
        for name, call in calls.items():
            with pytest.raises(hisparse.InvalidArgument) as got:
                call()
            assert f"{name}: keys[3] is 65 bytes" in str(got.value) and "1-64 bytes" in str(got.value)
        # the daemon answered no error (nothing reached it) and holds no reservation
        assert daemon_counts(c) == before
        assert c.lookup(good) == 0
    logged = " ".join(rec.getMessage() for rec in caplog.records)
    assert "abort" not in logged and "lost reserve reply" not in logged


def test_a_str_key_is_a_type_error_that_names_bytes(hisparsed):
    with client.attach("keys/ns", LAYOUT, socket=hisparsed.socket, capacity="1MiB") as c:
        before = daemon_counts(c)
        for call in (lambda: c.lookup(["a" * 32]), lambda: c.pin([b"x" * 32, "a"]),
                     lambda: c.store(["a"], np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8))):
            with pytest.raises(TypeError) as got:
                call()
            assert isinstance(got.value, hisparse.InvalidArgument)
            assert "is a str; keys are bytes" in str(got.value) and "encode" in str(got.value)
        with pytest.raises(TypeError, match=r"a list of keys, not one bytes"):
            c.lookup(b"x" * 32)  # one key where a list was meant
        assert daemon_counts(c) == before
