"""A call whose reply was lost gives back what it took, and only that (``hisparse.client.calls``).

The daemon is stopped for real (SIGSTOP, as a long GC pause or swap would
stop it) past a call's timeout, then resumed: it then handles the request
whose reply nobody waits for any more, and the release the caller sent after
it. Another thread's reservation of the same keys must survive that release;
the pins of a call whose reply was lost must not outlive it.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

import hisparse
from hisparse import client
from hisparse.client.backends import cpu
from hisparse.errors import DaemonUnavailable
from hisparse.protocol import ErrorCode, Op
from tests.client.engine import bad_pages, chain, pages_for
from tests.rawclient import RawClient
from tests.waiting import wait_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)  # 128-byte pages
NS = "tags"
TIMEOUT_S = 1.0


def ns_stats(socket: str) -> dict[str, Any]:
    c = RawClient(socket)
    try:
        c.hello()
        stats = c.call(Op.STATS)["namespaces"].get(NS, {})
        c.call(Op.BYE)  # a poll of many of these must not hold a session each until its lease ends
        return stats
    finally:
        c.close()


class Stalled:
    """The daemon SIGSTOPped for as long as the ``with`` block lasts."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> Stalled:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def gated_scatter(monkeypatch):
    """The first CPU scatter of the test waits for ``gate`` once its pages are reserved."""
    real = cpu.CpuBackend.scatter
    gate, entered = threading.Event(), threading.Event()

    def scatter(self, region, page_ids, pages, rows):
        if not entered.is_set():
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
        return real(self, region, page_ids, pages, rows)

    monkeypatch.setattr(cpu.CpuBackend, "scatter", scatter)
    return gate, entered


def test_a_lost_reserve_reply_never_aborts_another_threads_reservation(daemon_factory, gated_scatter):
    gate, entered = gated_scatter
    d = daemon_factory(lease_ttl=30)  # one uid fills the region
    keys = chain("t1", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8,
                       timeout_s=TIMEOUT_S) as c:
        # T1 reserves the 4 keys and is copying into its pages
        t1: dict[str, Any] = {}
        writer = threading.Thread(target=lambda: t1.update(n=_store(c, keys)))
        writer.start()
        assert entered.wait(30)
        # T2 stores the same keys while the daemon is stopped: no reply within its timeout
        with Stalled(d.pid):
            with pytest.raises(DaemonUnavailable):
                c.store(keys, pages_for(keys, LAYOUT.page_bytes))
        # the daemon answers T2's reserve (BUSY: T1 writes them), then T2's abort by tag
        wait_for(lambda: c._sessions.owed.pending() == 0, "T2's give-back to be answered")
        assert ns_stats(d.socket)["writing_pages"] == 4, "T2's abort freed T1's reservations"
        # B fills the region: it gets only the 4 pages nobody holds
        b_keys = chain("b", 8)
        with client.attach(NS, LAYOUT, socket=d.socket, timeout_s=20) as b:
            assert b.store(b_keys, pages_for(b_keys, LAYOUT.page_bytes)) == 4
            gate.set()  # T1 finishes its copy and commits
            writer.join(30)
            assert t1.get("n") == 4, t1
            out = np.zeros((8, LAYOUT.page_bytes), dtype=np.uint8)
            assert b.load(b_keys, out) == 4
            assert bad_pages(b_keys[:4], out, LAYOUT.page_bytes) == [], "B's pages hold T1's bytes"
        out = np.zeros((4, LAYOUT.page_bytes), dtype=np.uint8)
        assert c.load(keys, out) == 4 and bad_pages(keys, out, LAYOUT.page_bytes) == []
    assert "Traceback" not in d.log()


def _store(c: client.Client, keys: list[bytes]) -> int:
    return c.store(keys, pages_for(keys, LAYOUT.page_bytes))


def test_abort_by_tag_frees_only_what_that_tag_reserved(daemon_factory):
    c = RawClient(daemon_factory().socket)  # one session takes 4 of 8 pages
    try:
        c.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)
        mine, theirs = chain("mine", 2), chain("theirs", 2)
        assert len(c.call(Op.RESERVE, keys=mine, tag=1)["slots"]) == 2
        assert len(c.call(Op.RESERVE, keys=theirs, tag=2)["slots"]) == 2
        assert c.call(Op.RESERVE, keys=mine, tag=3)["slots"] == [-2, -2]  # busy: tag 1 holds them
        assert c.call(Op.ABORT, keys=mine + theirs, tag=3) == {"aborted": 0}
        assert c.call(Op.ABORT, keys=mine + theirs, tag=1) == {"aborted": 2}
        # a request of a call already given up takes nothing
        assert c.request(Op.RESERVE, keys=mine, tag=1).error_code == ErrorCode.INVALID_ARGUMENT.value
        assert c.call(Op.COMMIT, keys=theirs) == {"committed": 2}
        assert c.request(Op.RESERVE, keys=mine, tag=-1).error_code == ErrorCode.INVALID_ARGUMENT.value
        assert c.request(Op.RESERVE, keys=mine, tag="x").error_code == ErrorCode.PROTOCOL_ERROR.value
    finally:
        c.close()


@pytest.mark.parametrize("path", ["load", "vllm-pin"])
def test_a_pin_whose_reply_was_lost_is_released_without_the_session_ending(daemon_factory, path):
    from hisparse.vllm.rpc import NamespaceOps  # the pin path of the vLLM syncer and host pool

    d = daemon_factory(lease_ttl=30)  # one uid fills the region
    keys = chain("p", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8,
                       timeout_s=TIMEOUT_S) as c:
        assert _store(c, keys) == 4
        handle = c.session.handle
        out = np.zeros((4, LAYOUT.page_bytes), dtype=np.uint8)
        with Stalled(d.pid), pytest.raises(DaemonUnavailable):
            if path == "load":
                c.load(keys, out)
            else:
                NamespaceOps(c).pin_each(keys)
        # the resumed daemon pins for a call that gave up; that call's release follows
        assert c.lookup(keys) == 4
        wait_for(lambda: ns_stats(d.socket)["pinned_pages"] == 0, "the lost pins to be released",
                 timeout_s=15)
        assert c.session.handle == handle and ns_stats(d.socket)["sessions"] == 1, \
            "released by the session's end, not by the call"
        assert c.load(keys, out) == 4 and bad_pages(keys, out, LAYOUT.page_bytes) == []
        assert ns_stats(d.socket)["pinned_pages"] == 0


def test_unpin_by_tag_releases_only_that_calls_pins(hisparsed):
    c = RawClient(hisparsed.socket)
    try:
        c.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)
        keys = chain("u", 3)
        c.store(keys, [bytes(LAYOUT.page_bytes)] * 3)
        assert c.call(Op.PIN, keys=keys, tag=7)["count"] == 3
        mine = c.call(Op.PIN, keys=keys[:2], tag=8)["pages"]
        theirs = c.call(Op.PIN, keys=keys, tag=9)["pages"]
        assert c.call(Op.UNPIN, pages=theirs[:1], tag=9) == {"unpinned": 1}  # off 9's record too
        assert c.call(Op.UNPIN, tag=8) == {"unpinned": 2}
        assert c.call(Op.UNPIN, tag=8) == {"unpinned": 0}  # idempotent
        assert c.request(Op.PIN, keys=keys, tag=8).error_code == ErrorCode.INVALID_ARGUMENT.value
        assert c.call(Op.UNPIN, tag=9) == {"unpinned": 2}
        assert c.call(Op.UNPIN, tag=7) == {"unpinned": 3}
        assert ns_stats(hisparsed.socket)["pinned_pages"] == 0
        assert mine == theirs[:2]
    finally:
        c.close()


def test_unpin_of_no_pages_under_a_tag_releases_nothing(hisparsed):
    c = RawClient(hisparsed.socket)
    try:
        c.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)
        keys = chain("e", 1)
        c.store(keys, [bytes(LAYOUT.page_bytes)])
        assert c.call(Op.PIN, keys=keys, tag=5)["count"] == 1
        assert c.call(Op.UNPIN, pages=[], tag=5) == {"unpinned": 0}  # pages given: only those
        assert ns_stats(hisparsed.socket)["pinned_pages"] == 1
        assert c.call(Op.UNPIN, tag=5) == {"unpinned": 1}
    finally:
        c.close()


def test_a_release_not_answered_in_time_is_sent_again_not_dropped(daemon_factory):
    # A release by tag that times out (here: held in the client behind its requests on the wire
    # to a stalled daemon, a Timeout) is sent again until answered, as a DaemonUnavailable one is:
    # dropping it left the call's pins held until the session ended.
    from hisparse.client.transport import MAX_IN_FLIGHT

    d = daemon_factory(lease_ttl=30)
    keys = chain("r", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8,
                       timeout_s=TIMEOUT_S) as c:
        assert _store(c, keys) == 4
        pin = c.pin(keys)
        assert ns_stats(d.socket)["pinned_pages"] == 4
        session, owed = c.session, c._sessions.owed
        with Stalled(d.pid):
            on_wire = c.transport.submit_all(Op.LOOKUP, [{"session": session.id, "keys": keys}] * MAX_IN_FLIGHT)
            owed.give_back(session, Op.UNPIN, tag=pin._tag)
            wait_for(lambda: owed.pending() == 1, "the release to be queued")
            threading.Event().wait(2.5 * TIMEOUT_S)  # two attempts time out meanwhile
            assert owed.pending() == 1  # still owed, not given up
        wait_for(lambda: owed.pending() == 0, "the release to be answered", timeout_s=15)
        assert ns_stats(d.socket)["pinned_pages"] == 0
        assert all(p.result(10.0) == {"count": 4} for p in on_wire)
