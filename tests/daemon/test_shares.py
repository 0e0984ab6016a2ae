"""Work-conserving shares, with the shipped defaults: a lone engine (or the engines of one uid)
may use its whole namespace; another uid gets its share once it is attached, whatever the
first did before, and a hostile uid that pins all it can leaves it that share.

Real daemon, real clients; other uids are real other users (``tests.tenants``).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hisparse import KVLayout, QuotaExceeded, client
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for
from tests.tenants import ATTACKER_UID, OTHER_UID, holding_as_user, needs_root
from tests.tenants import tenant_daemon  # noqa: F401 - a fixture
from tests.waiting import wait_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
PAGES = 16


def _pages(tag: str, n: int, page_bytes: int = 192) -> list[bytes]:
    return [(f"{tag}{i}".encode() * page_bytes)[:page_bytes] for i in range(n)]


def test_a_lone_engine_fills_its_namespace_and_the_engines_of_one_uid_all_of_it(daemon_factory):
    d = daemon_factory()  # the shipped defaults: shares of 0.5 that bind only under contention
    layout = KVLayout(num_layers=2, block_tokens=4, row_bytes=32)  # 256-byte pages
    n = 48
    keys = [bytes([i]) * 32 for i in range(n)]
    pages = np.random.default_rng(0).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
    with client.attach("lone", layout, socket=d.socket, capacity=layout.page_bytes * n) as a:
        stored = a.store(keys, pages)
        assert stored == n and stored.complete, f"one engine alone stores its whole namespace: {stored!r}"
        out = np.zeros_like(pages)
        assert a.load(keys, out) == n and (out == pages).all(), "and loads it back, every page pinned at once"
        with client.attach("lone", layout, socket=d.socket) as b, a.pin(keys[:40]) as held:
            # a second engine of the uid: the first pins 40 of 48 pages, the second stores into the rest
            assert held.count == 40
            more = [bytes([100 + i]) * 32 for i in range(8)]
            assert b.store(more, pages[:8]) == 8
            assert b.lookup(more) == 8 and a.lookup(keys[:40]) == 40


def _fill_then_keep_loading(socket: str, stop_after_s: float) -> dict:
    """uid A alone: one store of the whole region, every page pinned; then, in the background,
    an engine that keeps reloading its prefix (unpin all, pin all it may) until told to stop."""
    c = RawClient(socket)
    c.hello("ns", LAYOUT, 192 * PAGES)
    keys = keys_for("a", PAGES)
    stored = c.store(keys, _pages("a", PAGES))
    pinned = c.call(Op.PIN, keys=keys)["pages"]

    def reload() -> None:
        held = pinned
        deadline = time.monotonic() + stop_after_s
        while time.monotonic() < deadline:
            if held:
                c.call(Op.UNPIN, pages=held)
            reply = c.request(Op.PIN, keys=keys)
            if reply.error_code == "QUOTA_EXCEEDED":  # contended: its share of the prefix only
                reply = c.request(Op.PIN, keys=keys[:PAGES // 2])
            held = reply.ok["pages"] if reply.ok else []
            time.sleep(0.01)

    threading.Thread(target=reload, daemon=True).start()
    return {"stored": stored, "pinned": len(pinned)}


@needs_root
def test_the_second_uid_gets_its_share_after_the_first_filled_and_pinned_the_region(tenant_daemon):
    d = tenant_daemon()
    with holding_as_user(ATTACKER_UID, lambda: _fill_then_keep_loading(d.socket, 120.0)) as first:
        # alone, uid A stored the whole region in one store and pinned all of it
        assert first == {"ok": {"stored": PAGES, "pinned": PAGES}}, first
        second = RawClient(d.socket)
        try:
            second.hello("ns", LAYOUT, 192 * PAGES)
            keys, data = keys_for("b", PAGES // 2), _pages("b", PAGES // 2)
            # A's pins are never taken back, but A pins no more than its share now that B is here:
            # B's share frees as A's loads go round, within a bound (A reloads every few ms)
            got: list[int] = []

            def stored() -> bool:
                got.append(second.store(keys[sum(got):], data[sum(got):]))
                return sum(got) == len(keys)
            wait_for(stored, "uid B storing its half of the region", timeout_s=30)
            pinned = second.call(Op.PIN, keys=keys)["pages"]
            assert [second.read_page(p) for p in pinned] == data
        finally:
            second.close()


def _hog_all(socket: str, sessions: int = 4) -> dict:
    """One process, many sessions: store, reserve and pin everything it can."""
    clients = [RawClient(socket) for _ in range(sessions)]
    for c in clients:
        c.hello("ns", LAYOUT, 192 * PAGES)
    keys = keys_for("hog", PAGES)
    stored = pinned = 0
    for c in clients:
        stored += c.store(keys[stored:], _pages("h", PAGES)[stored:]) if stored < PAGES else 0
    for c in clients:
        reply = c.request(Op.PIN, keys=keys)
        if reply.ok is not None:
            pinned = max(pinned, reply.ok["count"])
        reply = c.request(Op.RESERVE, keys=keys_for(f"more{id(c)}", PAGES))
    return {"stored": stored, "pinned": pinned}


@needs_root
def test_a_hostile_uid_pinning_everything_leaves_another_its_share(tenant_daemon):
    d = tenant_daemon()
    engine = RawClient(d.socket)
    try:
        engine.hello("ns", LAYOUT, 192 * PAGES)
        # alone, the engine stores its whole region in one store (the defaults cost it nothing)
        assert engine.store(keys_for("e", PAGES), _pages("e", PAGES)) == PAGES
        with holding_as_user(OTHER_UID, lambda: _hog_all(d.socket)) as hog:
            assert "ok" in hog, hog
            assert hog["ok"]["pinned"] <= PAGES // 2, hog  # the hostile uid's share, no more
            keys, data = keys_for("e2", PAGES // 2), _pages("e2", PAGES // 2)
            assert engine.store(keys, data) == PAGES // 2, "the engine still stores its half"
            pinned = engine.call(Op.PIN, keys=keys)["pages"]
            assert [engine.read_page(p) for p in pinned] == data
    finally:
        engine.close()


def test_a_share_refused_under_contention_is_typed(daemon_factory):
    # two sessions of one uid: the second asks for more than is left (short), so the first's
    # new pins past its session share are refused, typed; what it held before stays held
    d = daemon_factory()
    with client.attach("ns", LAYOUT, socket=d.socket, capacity=192 * PAGES) as a, \
            client.attach("ns", LAYOUT, socket=d.socket) as b:
        keys = [bytes([i]) * 16 for i in range(PAGES)]
        pages = np.frombuffer(b"".join(_pages("p", PAGES)), dtype=np.uint8).reshape(PAGES, 192)
        assert a.store(keys, pages) == PAGES  # alone: the whole region
        with a.pin(keys[:12]) as held:  # uncontended: 12 of 16 pinned
            assert held.count == 12
            theirs = [bytes([200 + i]) * 16 for i in range(6)]
            assert b.store(theirs, pages[:6]) == 4  # short: 4 evictable pages left
            try:
                with a.pin(theirs[:4]):
                    raise AssertionError("a pin past the session share went through under contention")
            except QuotaExceeded as exc:
                assert "session_pin_share" in str(exc)
            assert held.count == 12 and a.lookup(keys[:12]) == 12  # what it held before stays held
