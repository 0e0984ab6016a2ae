"""Large stores and loads in pieces (``hisparse.client.pipeline``) against a real hisparsed.

The CUDA backend is the one whose copies overlap the daemon's requests. Here
the same path runs on CPU through ``Overlapping``: the CPU backend's real
copies, run one after another on a worker thread (as a GPU's copy engine
runs them, in the order queued), so a copy is still in flight while the
client sends requests. What is checked is what a piecewise call must keep
from a whole one: exact bytes, the same prefix stored when the region runs
out, nothing left reserved or pinned after a failure, a request only for
pages whose copy has landed, and a call that survives its session.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import hisparse
from hisparse import client
from hisparse.client import backends, pipeline
from hisparse.client.backends import cpu
from hisparse.client.session import Sessions
from hisparse.daemon.front.timers import REAP_INTERVAL_S
from hisparse.protocol import Op
from tests.client.engine import bad_pages, chain, pages_for
from tests.client.test_call_tags import ns_stats
from tests.waiting import wait_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)  # 128-byte pages
PB = LAYOUT.page_bytes
NS = "tags"  # the namespace ns_stats reads


class Copy:
    def __init__(self, future: Future, interrupted: bool = False) -> None:
        self.future, self.interrupted = future, interrupted

    def wait(self) -> None:
        if self.interrupted:  # a signal arrives in the first wait, the copy still running
            self.interrupted = False
            raise KeyboardInterrupt
        self.future.result(60)


class Overlapping(cpu.CpuBackend):
    """The CPU backend's copies on one worker thread: each call returns while its copy runs."""

    overlaps = True

    def __init__(self, *, fail_at: int | None = None, gate_at: int | None = None) -> None:
        super().__init__()
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="test-copy-engine")
        self.copies = 0
        self.landed: set[int] = set()  # page ids whose copy has landed
        self.fail_at, self.gate_at = fail_at, gate_at  # which copy (0, 1, ...) fails / waits
        self.interrupt_at: int | None = None  # which copy's first wait is interrupted
        self.gate, self.entered = threading.Event(), threading.Event()

    def _start(self, copy: Any, page_ids: np.ndarray) -> Copy:
        n, self.copies = self.copies, self.copies + 1

        def run() -> None:
            if n == self.gate_at:
                self.entered.set()
                assert self.gate.wait(60), "the test never opened the gate"
            if n == self.fail_at:
                raise RuntimeError("copy engine fault (test)")
            copy()
            self.landed.update(int(p) for p in page_ids)

        return Copy(self.engine.submit(run), interrupted=n == self.interrupt_at)

    def scatter_async(self, region, page_ids, pages, rows):  # type: ignore[override]
        return self._start(lambda: self.scatter(region, page_ids, pages, rows), page_ids)

    def gather_async(self, region, page_ids, out):  # type: ignore[override]
        return self._start(lambda: self.gather(region, page_ids, out), page_ids)


@pytest.fixture
def piecewise(monkeypatch):
    """Calls of 16 pages go in 4 pieces through an ``Overlapping`` backend; every request the
    client submits is recorded as (op, fields, page ids landed by then)."""
    monkeypatch.setattr(pipeline, "PIECE_BYTES", 4 * PB)
    backend = Overlapping()
    monkeypatch.setattr(backends, "for_tensor", lambda tensor: backend)
    sent: list[tuple[Op, dict[str, Any], set[int]]] = []
    real_one, real_all = Sessions.submit_in, Sessions.submit_all_in

    def submit_in(self, session, op, **fields):
        sent.append((op, fields, set(backend.landed)))
        return real_one(self, session, op, **fields)

    def submit_all_in(self, session, op, requests):
        sent.extend((op, fields, set(backend.landed)) for fields in requests)
        return real_all(self, session, op, requests)

    monkeypatch.setattr(Sessions, "submit_in", submit_in)
    monkeypatch.setattr(Sessions, "submit_all_in", submit_all_in)
    return backend, sent


def attach(socket: str, pages: int = 64, timeout_s: float = 20) -> client.Client:
    return client.attach(NS, LAYOUT, socket=socket, capacity=pages * PB, timeout_s=timeout_s)


def test_pieces_cover_the_call_in_order_within_one_request_each():
    assert pipeline.pieces(100, pipeline.PIECE_BYTES // 100 * 2 - 1) == [(0, 100)]  # under two pieces
    for n, page_bytes in ((81, 3_274_752), (7, 64 << 20), (100_000, 1 << 20), (3, 1 << 30)):
        bounds = pipeline.pieces(n, page_bytes)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
        assert all(b > a for a, b in bounds)
        assert all(b - a <= hisparse.protocol.MAX_KEYS_PER_REQUEST for a, b in bounds)
        assert len(bounds) <= max(pipeline.MAX_PIECES, -(-n // hisparse.protocol.MAX_KEYS_PER_REQUEST))
    assert len(pipeline.pieces(81, 3_274_752)) == pipeline.MAX_PIECES


def test_a_large_store_and_load_go_in_pieces_with_exact_bytes(hisparsed, piecewise):
    backend, sent = piecewise
    keys = chain("pieces", 16)
    with attach(hisparsed.socket) as c:
        assert c.store(keys, pages_for(keys, PB)) == 16
        ops = [op for op, _, _ in sent]
        assert ops == [Op.RESERVE] * 4 + [Op.COMMIT] * 4, ops  # every reserve before any commit
        for n, (_, fields, landed) in enumerate(sent[4:], 1):
            # copies land in the order queued: by the n-th commit, n pieces had landed
            assert len(fields["keys"]) == 4 and len(landed) >= 4 * n, (n, len(landed))
        out = np.zeros((16, PB), dtype=np.uint8)
        sent.clear()
        assert c.load(keys, out) == 16
        assert bad_pages(keys, out, PB) == []
        assert [op for op, _, _ in sent] == [Op.PIN] * 4 + [Op.UNPIN] * 4
        for op, fields, landed in sent[4:]:
            assert set(fields["pages"]) <= landed, "an unpin went out before its copy landed"
    stats = ns_stats(hisparsed.socket)
    assert stats["writing_pages"] == 0 and stats["pinned_pages"] == 0


def test_a_store_that_runs_out_of_room_keeps_the_same_prefix_as_whole(daemon_factory, piecewise):
    d = daemon_factory()
    keys = chain("room", 16)
    with attach(d.socket, pages=10) as c:
        result = c.store(keys, pages_for(keys, PB))
        assert (int(result), result.present, result.not_stored) == (10, 0, 6)
        assert c.lookup(keys) == 10  # the first ten, as one reserve of all sixteen would give
        out = np.zeros((16, PB), dtype=np.uint8)
        assert c.load(keys, out) == 10 and bad_pages(keys[:10], out, PB) == []
    stats = ns_stats(d.socket)
    assert stats["writing_pages"] == 0 and stats["pinned_pages"] == 0


def test_a_load_stops_where_the_committed_prefix_ends_and_keeps_no_pins(hisparsed, piecewise):
    keys = chain("gap", 16)
    with attach(hisparsed.socket) as c:
        c.store(keys[:9], pages_for(keys[:9], PB))
        c.store(keys[10:], pages_for(keys[10:], PB))  # key 9, in the third piece, is missing
        out = np.zeros((16, PB), dtype=np.uint8)
        assert c.load(keys, out) == 9
        assert bad_pages(keys[:9], out, PB) == []
        assert not out[9:].any(), "a page past the gap was copied"
        wait_for(lambda: ns_stats(hisparsed.socket)["pinned_pages"] == 0, "the later pieces' pins to go")


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_a_failed_copy_gives_back_every_reservation_and_keeps_what_committed(hisparsed, piecewise, fail_at):
    backend, _ = piecewise
    backend.fail_at = fail_at
    keys = chain(f"fail{fail_at}", 16)
    with attach(hisparsed.socket) as c:
        with pytest.raises(RuntimeError, match="copy engine fault"):
            c.store(keys, pages_for(keys, PB))
        stats = ns_stats(hisparsed.socket)
        assert stats["writing_pages"] == 0, "a reservation outlived the failed store"
        committed = c.lookup(keys)
        assert committed <= 4 * fail_at  # only pieces before the failed one
        out = np.zeros((16, PB), dtype=np.uint8)
        assert c.load(keys, out) == committed and bad_pages(keys[:committed], out, PB) == []
        backend.fail_at = None
        assert c.store(keys, pages_for(keys, PB)) == 16 - committed  # the daemon serves on
        backend.fail_at = backend.copies + 2  # a load's third copy fails
        with pytest.raises(RuntimeError, match="copy engine fault"):
            c.load(keys, out)
        wait_for(lambda: ns_stats(hisparsed.socket)["pinned_pages"] == 0, "the failed load's pins to go")


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_call_whose_daemon_restarts_mid_copy_finishes_on_the_new_session(daemon_factory, piecewise, call):
    backend, _ = piecewise
    d = daemon_factory(lease_ttl=5)
    keys = chain(f"restart-{call}", 16)
    pages = pages_for(keys, PB)
    with attach(d.socket) as c:
        if call == "load":
            c.store(keys, pages)
        # The first piece's copy waits: by then every request of the call is sent, and the call
        # sends nothing more until it lands (a request sent while no daemon listens fails at once).
        backend.gate_at = backend.copies
        out = np.zeros((16, PB), dtype=np.uint8)
        done: dict[str, Any] = {}

        def run() -> None:
            try:
                done["n"] = c.store(keys, pages) if call == "store" else c.load(keys, out)
            except BaseException as exc:  # noqa: BLE001 - reported below
                done["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        assert backend.entered.wait(30)
        first = c.session
        d.restart(kill=True)  # committed pages survive; the session and its holds do not
        backend.gate.set()
        t.join(60)
        assert "error" not in done, done
        assert c.session is not first
        assert c.lookup(keys) == 16
        if call == "load":
            assert done["n"] == 16 and bad_pages(keys, out, PB) == []
        out[:] = 0
        assert c.load(keys, out) == 16 and bad_pages(keys, out, PB) == []
    assert "Traceback" not in d.log()


def test_nothing_is_given_back_while_a_copy_into_it_is_still_in_flight(hisparsed, piecewise):
    backend, _ = piecewise
    backend.fail_at, backend.gate_at = 0, 1  # the first copy fails while the second still runs
    keys = chain("in-flight", 16)
    with attach(hisparsed.socket) as c:
        failed: dict[str, BaseException] = {}

        def store() -> None:
            try:
                c.store(keys, pages_for(keys, PB))
            except BaseException as exc:  # noqa: BLE001 - checked below
                failed["error"] = exc

        t = threading.Thread(target=store)
        t.start()
        assert backend.entered.wait(30)
        wait_for(lambda: ns_stats(hisparsed.socket)["writing_pages"] == 16, "every piece reserved")
        t.join(0.5)  # the failure is known; the second copy still writes into its pages
        assert t.is_alive() and ns_stats(hisparsed.socket)["writing_pages"] == 16, \
            "reservations were given back while a copy into them was in flight"
        backend.gate.set()
        t.join(30)
        assert isinstance(failed.get("error"), RuntimeError), failed
        assert ns_stats(hisparsed.socket)["writing_pages"] == 0


@pytest.mark.parametrize("call", ["store", "load"])
def test_a_wait_interrupted_while_the_last_piece_copies_lands_it_before_giving_back(hisparsed, piecewise,
                                                                                    call):
    backend, _ = piecewise
    keys = chain(f"interrupted-{call}", 16)
    held = "writing_pages" if call == "store" else "pinned_pages"
    with attach(hisparsed.socket) as c:
        if call == "load":
            assert c.store(keys, pages_for(keys, PB)) == 16  # copies 0-3
        first = backend.copies
        backend.gate_at = backend.interrupt_at = first + 3  # Ctrl-C in the wait for the last piece
        failed: dict[str, BaseException] = {}

        def run() -> None:
            try:
                if call == "store":
                    c.store(keys, pages_for(keys, PB))
                else:
                    c.load(keys, np.zeros((16, PB), dtype=np.uint8))
            except BaseException as exc:  # noqa: BLE001 - checked below
                failed["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        assert backend.entered.wait(30)
        wait_for(lambda: ns_stats(hisparsed.socket)[held] == 4, "three pieces done")
        t.join(0.5)  # interrupted by now; its last copy still moves the bytes of its 4 pages
        assert t.is_alive() and ns_stats(hisparsed.socket)[held] == 4, \
            "the last piece was given back while its copy was in flight"
        backend.gate.set()
        t.join(30)
        assert isinstance(failed.get("error"), KeyboardInterrupt), failed
        assert ns_stats(hisparsed.socket)[held] == 0
        assert c.lookup(keys) == (12 if call == "store" else 16)  # what landed and committed stays


def test_two_writers_of_one_chain_in_pieces_each_see_it_stored_once(hisparsed, piecewise):
    # TP ranks store the same chain at once: keys the other is writing are waited for (its
    # commit makes them present here), never written twice, never lost
    backend, sent = piecewise
    keys = chain("two-writers", 16)
    pages = pages_for(keys, PB)
    with attach(hisparsed.socket) as a, attach(hisparsed.socket) as b:
        backend.gate_at = backend.copies  # a's first copy waits: b meets a's reservations
        results: dict[str, Any] = {}
        t = threading.Thread(target=lambda: results.update(a=a.store(keys, pages)))
        t.start()
        assert backend.entered.wait(30)
        wait_for(lambda: ns_stats(hisparsed.socket)["writing_pages"] == 16, "a's reservations")
        other = threading.Thread(target=lambda: results.update(b=b.store(keys, pages)))
        other.start()
        wait_for(lambda: sum(op is Op.RESERVE for op, _, _ in sent) == 8, "b's reserves")
        backend.gate.set()
        t.join(30)
        other.join(30)
        a_result, b_result = results["a"], results["b"]
        assert int(a_result) + int(b_result) == 16 and a_result.present + b_result.present == 16, results
        assert int(a_result) == 16 and b_result.not_stored == 0
        out = np.zeros((16, PB), dtype=np.uint8)
        assert b.load(keys, out) == 16 and bad_pages(keys, out, PB) == []
    assert ns_stats(hisparsed.socket)["writing_pages"] == 0


def test_a_writer_stalled_past_its_lease_mid_copy_never_lands_in_anothers_pages(daemon_factory, piecewise,
                                                                               monkeypatch):
    # The writer's heartbeats stop (a stalled process) while its first piece still copies: its
    # lease ends, and another of its threads attaches again; its pages stay fenced while the copy
    # runs, another writer gets only free pages, the store finishes on the new session, and no
    # page holds another's bytes
    backend, _ = piecewise
    d = daemon_factory(lease_ttl=1.0)
    a_keys, b_keys = chain("stalled-a", 16), chain("stalled-b", 32)
    a_pages = pages_for(a_keys, PB)
    monkeypatch.setattr(backends, "for_tensor", lambda t: backend if t is a_pages else cpu.BACKEND)
    with attach(d.socket, pages=32) as a, attach(d.socket, pages=32) as b:
        backend.gate_at = backend.copies
        done: dict[str, Any] = {}
        t = threading.Thread(target=lambda: done.update(n=a.store(a_keys, a_pages)))
        t.start()
        assert backend.entered.wait(30)
        wait_for(lambda: ns_stats(d.socket)["writing_pages"] == 16, "a's reservations")
        a._sessions._stop.set()  # its heartbeat thread ends: the lease runs out
        wait_for(lambda: ns_stats(d.socket)["fenced_pages"] == 16, "a's lease to end, its pages fenced")
        assert a.lookup(a_keys) == 0  # another thread of a's attaches again: the old fence retires
        time.sleep(5 * REAP_INTERVAL_S)  # the daemon's reaper would have freed them by now
        assert ns_stats(d.socket)["fenced_pages"] == 16, "a retired fence let go of pages still copied into"
        assert b.store(b_keys, pages_for(b_keys, PB)) == 16  # the free half only
        backend.gate.set()  # a's copy lands in its own fenced pages
        t.join(30)
        assert "n" in done, "the store did not finish"
        out = np.zeros((32, PB), dtype=np.uint8)
        got_b = b.load(b_keys, out)
        assert bad_pages(b_keys[:got_b], out, PB) == [], "b's pages hold a's bytes"
        got_a = a.load(a_keys, out)
        assert got_a == a.lookup(a_keys) and bad_pages(a_keys[:got_a], out, PB) == []
    wait_for(lambda: ns_stats(d.socket)["fenced_pages"] == 0, "the fence let go")
    assert ns_stats(d.socket)["writing_pages"] == 0
