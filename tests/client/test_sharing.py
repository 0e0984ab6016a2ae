"""Engines in separate processes sharing one daemon: prefix sharing, racing ranks, crashes, pins.

Every engine is a real process (``tests.client.engine``) attached with
``hisparse.client.attach``; page bytes are a function of their key, so each
process checks what it loads without bytes being passed around.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import torch

import hisparse
from hisparse import client
from tests.client.engine import chain, finish, page_for, pages_for, spawn

SMALL = hisparse.KVLayout(num_layers=4, block_tokens=16, row_bytes=64)  # 4 KiB pages
MEDIUM = hisparse.KVLayout(num_layers=8, block_tokens=64, row_bytes=656)  # 328 KiB pages


def test_engines_share_a_prefix_and_namespaces_are_apart(hisparsed):
    # A stores a chain; B, another process, finds and loads the same bytes
    a = finish(spawn(hisparsed.socket, "store", "model-x", SMALL, seed="sys", count=32, capacity="2MiB"))
    # (numpy pages: an engine process that never imports torch)
    assert a == {"written": 32, "loaded": 32, "bad": [], "torch": False}
    b = finish(spawn(hisparsed.socket, "load", "model-x", SMALL, seed="sys", count=40))
    assert b == {"lookup": 32, "loaded": 32, "bad": []}
    # C, in another namespace with the same keys and layout, sees nothing
    c = finish(spawn(hisparsed.socket, "lookup", "model-y", SMALL, seed="sys", count=32, capacity="1MiB"))
    assert c == {"count": 0}


def test_eight_ranks_store_one_chain_at_once(hisparsed, tmp_path):
    n = 48
    go = tmp_path / "go"
    procs = [spawn(hisparsed.socket, "store", "tp8", SMALL, seed="rank-chain", count=n,
                   capacity="2MiB", ready=tmp_path / f"ready{i}", go=go) for i in range(8)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(8)):
        assert time.monotonic() < deadline, "engines did not start"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    go.touch()
    results = [finish(p) for p in procs]
    # one committed copy of each page, written by exactly one rank; all read it back intact
    assert sum(r["written"] for r in results) == n
    assert all(r["loaded"] == n and r["bad"] == [] for r in results), results
    with client.attach("tp8", SMALL, socket=hisparsed.socket) as cl:
        ns = cl.stats()["namespaces"]["tp8"]
        assert ns["committed_pages"] == n and ns["writing_pages"] == 0


def test_writer_killed_mid_store_leaves_only_exact_pages(daemon_factory):
    d = daemon_factory(capacity="512MiB", lease_ttl=1.5)
    n, chunk = 400, 25
    keys = chain("big", n)
    writer = spawn(d.socket, "store-chunks", "crash", MEDIUM, seed="big", count=n, chunk=chunk,
                   capacity="256MiB")
    # kill it while it is copying: after a few chunks have landed, at an odd moment
    assert writer.stdout is not None
    for line in writer.stdout:
        if json.loads(line).get("stored", 0) >= 3 * chunk:
            break
    time.sleep(np.random.default_rng().uniform(0, 0.02))
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    with client.attach("crash", MEDIUM, socket=d.socket, timeout_s=5) as cl:
        visible = cl.lookup(keys)
        assert 3 * chunk <= visible < n
        out = torch.zeros((n, MEDIUM.page_bytes), dtype=torch.uint8)
        assert cl.load(keys, out) == visible
        for i in range(visible):
            assert np.array_equal(out[i].numpy(), page_for(keys[i], MEDIUM.page_bytes)), i
        # its half-written pages were never visible; they free up when its lease
        # expires, and the store below waits for that instead of failing
        assert cl.store(keys, pages_for(keys, MEDIUM.page_bytes)) == n - visible
        out.zero_()
        assert cl.load(keys, out) == n
        bad = [i for i in range(n) if not np.array_equal(out[i].numpy(), page_for(keys[i], MEDIUM.page_bytes))]
        assert bad == []
        assert cl.stats()["namespaces"]["crash"]["writing_pages"] == 0


def test_eviction_never_touches_a_pinned_page(daemon_factory, tmp_path):
    d = daemon_factory(capacity="64MiB", lease_ttl=2)  # the churners are this uid
    with client.attach("churn", SMALL, socket=d.socket, capacity=40 * SMALL.page_bytes) as cl:
        keys = chain("pinned", 8)
        expected = pages_for(keys, SMALL.page_bytes)
        assert cl.store(keys, expected) == 8
        with cl.pin(keys) as pin:
            go = tmp_path / "go"
            churners = [spawn(d.socket, "churn", "churn", SMALL, seed=f"churn{i}", chunk=16, rounds=25,
                              go=go) for i in range(2)]
            go.touch()
            checks = 0
            while any(p.poll() is None for p in churners) or checks == 0:
                for i in range(len(pin)):
                    assert np.array_equal(pin.view(i).reshape(-1).numpy(), expected[i]), f"pinned page {i} changed"
                checks += 1
                time.sleep(0.005)
            written = sum(finish(p)["written"] for p in churners)
            assert written > 40  # the churn went round the region more than once
            for i in range(len(pin)):
                assert np.array_equal(pin.view(i).reshape(-1).numpy(), expected[i])
            assert cl.lookup(keys) == 8
            assert cl.stats()["namespaces"]["churn"]["evicted_pages"] > 0
        # unpinned, the same churn is free to evict them
        finish(spawn(d.socket, "churn", "churn", SMALL, seed="after", chunk=16, rounds=4))
        assert cl.lookup(keys) < 8


def test_daemon_restart_under_a_live_client(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=2)
    keys = chain("warm", 10)
    pages = torch.from_numpy(pages_for(keys, SMALL.page_bytes))
    with client.attach("restart", SMALL, socket=d.socket, capacity="1MiB", timeout_s=1.0) as cl:
        assert cl.store(keys, pages) == 10
        pin = cl.pin(keys[:2])
        d.kill()
        # while it is away: a typed error within the call's timeout, never a hang
        started = time.monotonic()
        try:
            cl.lookup(keys)
            raise AssertionError("lookup answered with no daemon")
        except hisparse.DaemonUnavailable:
            pass
        assert time.monotonic() - started < 1.0 * 10  # within its timeout, generously: not a hang
        d.start()
        # back: calls work again within 5 s, without a new attach
        started = time.monotonic()
        while True:
            try:
                assert cl.lookup(keys) == 10  # the restarted daemon adopted the warm pages
                break
            except hisparse.DaemonUnavailable:
                assert time.monotonic() - started < 30.0
        assert time.monotonic() - started < 30.0
        out = torch.zeros_like(pages)
        assert cl.load(keys, out) == 10 and torch.equal(out, pages)
        more = chain("warm", 14)
        assert cl.store(more, pages_for(more, SMALL.page_bytes)) == 4
        # the pin died with the old session: its view must not be trusted
        try:
            pin.view(0)
            raise AssertionError("a pin of a lost session handed out a view")
        except hisparse.LeaseExpired:
            pass
        pin.release()
        assert cl.stats()["client"]["reconnects"] >= 1


def test_sigterm_restart_keeps_the_client_working(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=2)
    keys = chain("term", 4)
    with client.attach("term", SMALL, socket=d.socket, capacity="1MiB", timeout_s=1.0) as cl:
        cl.store(keys, pages_for(keys, SMALL.page_bytes))
        d.restart()  # SIGTERM: drains, flushes, exits 0; then a new daemon
        deadline = time.monotonic() + 5.0
        while True:
            try:
                assert cl.lookup(keys) == 4
                break
            except hisparse.DaemonUnavailable:
                assert time.monotonic() < deadline
        assert os.path.exists(d.socket)
