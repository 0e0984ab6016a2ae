"""Fencing: no client ever reads or writes a page it no longer holds.

Each test here is one way the tier used to hand an engine bytes that were
not its own: a process stopped (SIGSTOP, as a GC pause or swap would) past
its lease or across a daemon restart, then resumed; a session id presented
on another connection; clear-then-re-pin; a call in flight across a restart.
Stalls are real: the actor processes (``tests.client.fence_actors``) stop
themselves at the worst moment and the test resumes them with SIGCONT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import hisparse
from hisparse import client
from hisparse.protocol import ErrorCode, Op
from tests.client.engine import REPO, bad_pages, chain, page_for, pages_for
from tests.rawclient import RawClient
from tests.waiting import wait_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)  # 128-byte pages
NS = "fence"


class Actor:
    """A ``tests.client.fence_actors`` process, read line by line."""

    def __init__(self, socket: str, role: str, *, capacity_pages: int = 8, **opts: Any) -> None:
        cmd = [sys.executable, "-m", "tests.client.fence_actors", role, "--socket", socket,
               "--namespace", NS, "--capacity", str(LAYOUT.page_bytes * capacity_pages),
               "--layout", f"{LAYOUT.num_layers},{LAYOUT.block_tokens},{LAYOUT.row_bytes}"]
        for name, value in opts.items():
            cmd += [f"--{name}", str(value)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def say(self, line: str = "go") -> None:
        """One line on the actor's stdin (the roles that wait for one)."""
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def until(self, at: str, timeout_s: float = 60) -> dict[str, Any]:
        """The next line whose ``at`` is ``at`` (a stalled process has printed it last)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"actor exited {self.proc.wait()}: {self.proc.stderr.read()}")
            msg = json.loads(line)
            if msg.get("at") == at:
                return msg
        raise AssertionError(f"actor never reached {at!r}")

    def stopped(self) -> bool:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    def wait_stopped(self) -> None:
        wait_for(self.stopped, "the actor to stop itself")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.send_signal(signal.SIGCONT)
            self.proc.wait(10)


@pytest.fixture
def actors():
    made: list[Actor] = []

    def make(*args: Any, **kwargs: Any) -> Actor:
        a = Actor(*args, **kwargs)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def ns_stats(socket: str) -> dict[str, Any]:
    c = RawClient(socket)
    try:
        c.hello()
        return c.call(Op.STATS)["namespaces"].get(NS, {})
    finally:
        c.close()


def committed_pages_are_their_keys(socket: str) -> list[bytes]:
    """Every committed page of the namespace holds ``page_for(key)``: the keys that do not."""
    c = RawClient(socket)
    try:
        c.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)
        bad, cursor = [], 0
        while cursor >= 0:
            body = c.call(Op.KEYS, cursor=cursor, limit=1024)
            for key, page in body["keys"]:
                if c.read_page(page) != page_for(key, LAYOUT.page_bytes).tobytes():
                    bad.append(key)
            cursor = body["next_cursor"]
        return bad
    finally:
        c.close()


def victim_store_and_check(socket: str, seed: str, n: int) -> tuple[int, list[int]]:
    """Another engine stores ``n`` keys and loads them back: (stored, indices of wrong pages)."""
    keys = chain(seed, n)
    with client.attach(NS, LAYOUT, socket=socket, timeout_s=20) as c:
        stored = c.store(keys, pages_for(keys, LAYOUT.page_bytes))
        out = np.zeros((n, LAYOUT.page_bytes), dtype=np.uint8)
        m = c.load(keys, out)
        return stored, bad_pages(keys[:m], out, LAYOUT.page_bytes)


# -- 1. a stalled writer never writes into a page someone else was given --

@pytest.mark.parametrize("how", ["lease", "restart"])
def test_a_writer_stalled_mid_copy_never_overwrites_anothers_pages(daemon_factory, actors, how):
    d = daemon_factory(lease_ttl=2.0)
    writer = actors(d.socket, "stall-writer", seed="w", count=4)
    writer.until("stalled-mid-copy")
    writer.wait_stopped()
    if how == "lease":
        wait_for(lambda: ns_stats(d.socket).get("fenced_pages") == 4, "the writer's lease to expire")
    else:
        d.restart(kill=True)
        assert ns_stats(d.socket)["fenced_pages"] == 4, "the successor re-fenced the writer's pages"
    # the region has 8 pages: the victim gets at most the 4 that are not the stalled writer's
    # (fewer only if this busy machine stalls the victim past its own lease)
    keys = chain("victim", 8)
    with client.attach(NS, LAYOUT, socket=d.socket, timeout_s=20) as victim:
        stored = victim.store(keys, pages_for(keys, LAYOUT.page_bytes))
        assert 1 <= stored <= 4, "the stalled writer's fenced pages were handed out"
        with victim.pin(keys) as pin:
            assert pin.count == stored
            writer.resume()  # the writer finishes its copy into its own (fenced) pages
            done = writer.until("done")
            out = np.zeros((stored, LAYOUT.page_bytes), dtype=np.uint8)
            assert victim.load(keys[:stored], out) == stored
            assert bad_pages(keys[:stored], out, LAYOUT.page_bytes) == [], \
                "the victim read another's bytes"
    # the writer's lost commit was refused, it stored again and reads its own bytes
    assert done.get("bad", []) == [] and done.get("error") is None, done
    assert committed_pages_are_their_keys(d.socket) == [], "a torn or foreign page was committed"


# -- 2. a stalled reader learns its pin is gone; nobody rewrote what it pinned meanwhile --

def test_a_reader_stalled_past_its_lease_sees_no_foreign_bytes(daemon_factory, actors):
    d = daemon_factory(lease_ttl=2.0)
    keys = chain("r", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8) as c:
        assert c.store(keys, pages_for(keys, LAYOUT.page_bytes)) == 4
    reader = actors(d.socket, "stall-reader", seed="r", count=4)
    pinned = reader.until("pinned")
    assert pinned["count"] == 4 and all(pinned["view_ok"])
    reader.wait_stopped()
    wait_for(lambda: ns_stats(d.socket).get("pinned_pages") == 4
             and ns_stats(d.socket).get("sessions") == 0, "the reader's lease to expire")
    # churn: 3 rounds of 8 fresh keys through an 8-page region; the fenced pins never go
    for r in range(3):
        stored, bad = victim_store_and_check(d.socket, f"churn{r}", 8)
        assert stored <= 4 and bad == [], "the stalled reader's pinned pages were handed out"
    reader.resume()
    resumed = reader.until("resumed")
    assert resumed["held"] is False, "pin.held must turn False once the lease is gone"
    assert resumed["view_error"] == "LeaseExpired"
    assert all(resumed["intact"]), "a fenced pinned page was handed to another writer"
    assert reader.proc.wait(30) == 0
    wait_for(lambda: ns_stats(d.socket).get("pinned_pages") == 0, "the fence to be released")


# -- 4. the sparse tier re-pins after a lost session, and never resolves through foreign pages --

def _sparse_engine(socket: str):
    import torch

    from hisparse.client.sparse import BlockAllocator, SparseSession

    c = client.attach("fence/sparse", LAYOUT, socket=socket, capacity=LAYOUT.page_bytes * 8,
                      timeout_s=20)
    kv = [torch.zeros((32 * LAYOUT.block_tokens, LAYOUT.row_bytes), dtype=torch.uint8)
          for _ in range(LAYOUT.num_layers)]
    alloc = BlockAllocator(32)
    session = SparseSession(c, kv, alloc, hot_rows=16, active_tail_blocks=1, max_blocks=8)
    blocks = alloc.allocate(5)
    for b, e in enumerate(blocks):
        for t in range(LAYOUT.block_tokens):
            for layer in range(LAYOUT.num_layers):
                kv[layer][e * 4 + t] = _row(layer, b * 4 + t)
    req = session.add_request("r", blocks)
    assert session.spill(req) == 4
    return c, kv, session, req


def _row(layer: int, pos: int):
    import torch

    return torch.full((LAYOUT.row_bytes,), (layer * 37 + pos) % 251, dtype=torch.uint8)


def _resolve_all(session, kv, req) -> int:
    import torch

    topk = torch.tensor([[list(range(0, 20))]], dtype=torch.int32)
    good = 0
    for layer in range(LAYOUT.num_layers):
        phys, _ = session.resolve([req], layer, topk, int(time.monotonic() * 1000))
        for pos, row in zip(range(20), phys[0, 0].tolist()):
            assert row == -1 or torch.equal(kv[layer][row], _row(layer, pos)), \
                f"layer {layer} position {pos} resolved to another's row"
            good += row >= 0
    return good


def test_the_sparse_session_repins_after_a_daemon_restart(daemon_factory):
    d = daemon_factory(lease_ttl=5)  # "another engine" is this uid too
    c, kv, session, req = _sparse_engine(d.socket)
    try:
        old_pages = list(req.host_pages)
        d.restart(kill=True)
        # another engine fills the region: only pages nobody holds can be reused
        with client.attach("fence/sparse", LAYOUT, socket=d.socket, timeout_s=20) as other:
            keys = chain("other", 8)
            other.store(keys, pages_for(keys, LAYOUT.page_bytes))
        assert _resolve_all(session, kv, req) == 20 * LAYOUT.num_layers
        assert req.host_pages == old_pages and not req.lost
        assert all(p.held for p in req.pins)
    finally:
        session.release(req)
        c.close()


def test_the_sparse_session_fails_a_request_whose_pages_are_gone(daemon_factory):
    d = daemon_factory(lease_ttl=5)
    c, kv, session, req = _sparse_engine(d.socket)
    try:
        d.restart("--fresh", kill=True)  # every page gone: nothing to pin again
        from hisparse.client.sparse import RequestsLost

        with pytest.raises(RequestsLost) as exc:
            _resolve_all(session, kv, req)
        assert exc.value.request_ids == ["r"] and req.lost
        # from now on its spilled positions resolve to -1, never to a wrong row
        assert _resolve_all(session, kv, req) == 4 * LAYOUT.num_layers  # the resident tail only
    finally:
        session.release(req)
        c.close()


# -- 5. clear, store again, pin again: pin records are per page --

def test_clear_then_repin_keeps_pin_accounting_exact(hisparsed):
    keys = chain("k", 1)
    with client.attach(NS, LAYOUT, socket=hisparsed.socket, capacity=LAYOUT.page_bytes * 8) as c:
        c.store(keys, pages_for(keys, LAYOUT.page_bytes))
        first = c.pin(keys)
        admin = RawClient(hisparsed.socket)
        admin.hello()
        admin.call(Op.CLEAR, token=hisparsed.token, namespace=NS)
        assert c.store(keys, pages_for(keys, LAYOUT.page_bytes)) == 1  # a new page for the same key
        second = c.pin(keys)
        assert int(first.page_ids[0]) != int(second.page_ids[0])
        first.release()
        second.release()
        stats = admin.call(Op.STATS)
        assert stats["namespaces"][NS]["pinned_pages"] == 0
        assert stats["daemon"]["errors"] == 0, "an unpin was refused or failed inside the daemon"
        admin.close()
    assert "INTERNAL" not in hisparsed.log() and "Traceback" not in hisparsed.log()


# -- 6. a session id works only on the connection that opened it --

def test_a_session_id_from_another_connection_is_unknown(hisparsed):
    owner, thief = RawClient(hisparsed.socket), RawClient(hisparsed.socket)
    try:
        owner.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)
        keys = chain("o", 2)
        slots = owner.call(Op.RESERVE, keys=keys)["slots"]
        pages = owner.call(Op.PIN, keys=chain("none", 1))["pages"]
        assert len(slots) == 2 and pages == []
        sid = owner.session
        for op, fields in ((Op.COMMIT, {"keys": keys}), (Op.ABORT, {"keys": keys}),
                           (Op.UNPIN, {"pages": slots}), (Op.BYE, {}), (Op.HEARTBEAT, {})):
            reply = thief.request(op, session=sid, **fields)
            assert reply.error_code == ErrorCode.UNKNOWN_SESSION.value, op
            assert str(sid) not in (reply.error_message or "")
        # the owner's reservations are untouched: it commits them itself
        for slot, key in zip(slots, keys):
            owner.write_page(slot, page_for(key, LAYOUT.page_bytes).tobytes())
        assert owner.call(Op.COMMIT, keys=keys) == {"committed": 2}
    finally:
        owner.close()
        thief.close()
    log = hisparsed.log()
    assert f"{sid:x}" not in log and str(sid) not in log, "a whole session id reached the log"
    assert f"{sid:016x}"[:8] in log


def test_reserve_without_the_fence_locked_is_refused(hisparsed):
    c = RawClient(hisparsed.socket)
    try:
        c.hello(NS, LAYOUT, LAYOUT.page_bytes * 8, fence=False)
        for op in (Op.RESERVE, Op.PIN):
            assert c.request(op, keys=chain("x", 1)).error_code == ErrorCode.NOT_FENCED.value
        assert c.call(Op.LOOKUP, keys=chain("x", 1)) == {"count": 0}  # reads need no fence
    finally:
        c.close()


# -- 7. a call in flight across a daemon restart is answered by the new daemon at once --

def test_a_call_in_flight_is_retried_on_the_restarted_daemon(daemon_factory):
    d = daemon_factory(lease_ttl=5)
    timeout_s = 60.0  # the old client waited all of this
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8,
                       timeout_s=timeout_s) as c:
        keys = chain("flight", 2)
        c.store(keys, pages_for(keys, LAYOUT.page_bytes))
        os.kill(d.pid, signal.SIGSTOP)  # the call below is sent, then the daemon dies
        result: dict[str, Any] = {}

        def call() -> None:
            started = time.monotonic()
            result["count"] = c.lookup(keys)
            result["took_s"] = time.monotonic() - started

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.2)  # let the request reach the stopped daemon's socket
        d.kill()
        d.start()
        t.join(timeout_s)
        assert result["count"] == 2, "the committed pages came back with the new daemon"
        # a restart takes a second or two on a busy machine; waiting out the call's timeout
        # is what this guards against
        assert result["took_s"] < timeout_s / 2, result


# -- an operator can see a stalled session and reclaim its pages --

def test_a_stalled_session_shows_in_stats_and_evict_session_reclaims_it(daemon_factory, actors):
    d = daemon_factory(lease_ttl=1.0)
    writer = actors(d.socket, "stall-writer", seed="stuck", count=4)
    writer.until("stalled-mid-copy")
    wait_for(lambda: ns_stats(d.socket).get("fenced_pages") == 4, "the expiry")
    ctl = [sys.executable, "-m", "hisparse.ctl", "--socket", d.socket]
    shown = json.loads(subprocess.run([*ctl, "stats", "--json"], capture_output=True, text=True,
                                      check=True, timeout=30).stdout)
    [row] = [s for s in shown["sessions"] if s["state"] == "fenced"]
    assert row["fenced_pages"] == 4 and writer.proc.pid in row["pids"]
    human = subprocess.run([*ctl, "stats"], capture_output=True, text=True, check=True, timeout=30)
    assert row["handle"] in human.stdout and "fenced" in human.stdout
    # without the token: refused; with it (hisparsectl reads it): the pages come back
    anon = RawClient(d.socket)
    anon.hello()
    assert anon.request(Op.EVICT_SESSION, token="wrong", target=row["handle"]).error_code == \
        ErrorCode.PERMISSION_DENIED.value
    anon.close()
    out = subprocess.run([*ctl, "evict-session", row["handle"]], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert ns_stats(d.socket)["fenced_pages"] == 0 and ns_stats(d.socket)["free_pages"] == 8


# -- the soak: stalls, forks, thread timeouts, resets and daemon SIGKILLs; never a wrong byte --

@pytest.mark.slow
def test_soak_random_stalls_and_restarts_never_leak_or_corrupt(daemon_factory, actors, tmp_path):
    import random

    rng = random.Random(9)
    d = daemon_factory(lease_ttl=1.0)
    until = str(tmp_path / "until")
    common = {"capacity_pages": 48, "until": until, "timeout": 15}
    writer = actors(d.socket, "soak-writer", seed="soak", count=4, **common)
    reader = actors(d.socket, "soak-reader", seed="soak", count=4, **common)
    churn = actors(d.socket, "soak-churn", count=3, **common)
    # two threads of one client on the same chains, with a timeout the daemon's stalls run past
    threads = actors(d.socket, "soak-threads", seed="soak", count=4, **{**common, "timeout": 0.5})
    forker = actors(d.socket, "soak-forker", seed="soak", count=4, **common)
    everyone = {"writer": writer, "reader": reader, "churn": churn, "threads": threads,
                "forker": forker}
    for a in everyone.values():
        a.until("attached")
    for round_ in range(20):
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment: mid-copy, mid-read or between
        if round_ % 5 == 2:  # the daemon stalls past the threads' timeout, then a reset
            os.kill(d.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.8, 1.2))
            os.kill(d.pid, signal.SIGCONT)
            admin = RawClient(d.socket)  # a new session: the stall outlived any lease
            admin.hello()
            admin.call(Op.CLEAR, token=d.token, namespace=NS)
            admin.close()
            continue
        stalled = (writer, reader, forker)[round_ % 3]
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        if round_ % 5 == 4:
            d.restart(kill=True)  # and the daemon dies while it is stopped
        time.sleep(rng.uniform(1.3, 1.8))  # past the 1 s lease
        stalled.resume()
    open(until, "w").close()
    results = {name: a.until("done") for name, a in everyone.items()}
    for a in everyone.values():
        assert a.proc.wait(30) == 0
    print("soak results", results)
    assert all(r["bad"] == 0 for r in results.values()), results
    assert results["reader"]["reads"] > 0 and results["writer"]["rounds"] > 0, results
    assert results["forker"]["forks"] > 0 and results["threads"]["rounds"] > 0, results
    assert results["threads"]["errors"] > 0, "no call of the threads ever timed out: nothing tested"
    assert committed_pages_are_their_keys(d.socket) == [], "a torn or foreign page was committed"
    # every process is gone: every page is committed or free again, nothing held, nothing fenced
    def settled() -> bool:
        ns = ns_stats(d.socket)
        return (ns["writing_pages"] == 0 and ns["pinned_pages"] == 0 and ns["fenced_pages"] == 0
                and ns["free_pages"] + ns["committed_pages"] == ns["num_pages"])
    wait_for(settled, "every page to come back")


# -- an attacker plants fence files: none may fence a page --

@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root (chown); "
                    "CI runs as root")
def test_planted_fence_files_fence_nothing(daemon_factory):
    import fcntl

    from hisparse.shm.fence import FenceFile, fence_dir_for

    d = daemon_factory(lease_ttl=5)
    raw = RawClient(d.socket)
    try:
        region = raw.hello(NS, LAYOUT, LAYOUT.page_bytes * 8)["region"]
    finally:
        raw.close()
    fences = fence_dir_for(d.socket)
    planted = []
    for name, how in (("other-user", "chown"), ("world-writable", "chmod"), ("link", "symlink")):
        # well-formed, naming this very namespace and region, every page reserved
        f = FenceFile.create(fences, f"{name}.fence", namespace=NS, region_id=region["region_id"],
                             num_pages=region["num_pages"], handle="deadbeef")
        f.add_reserved(list(range(region["num_pages"])))
        f.close(unlink=False)
        if how == "chown":
            os.chown(f.path, 4242, 4242)
        elif how == "chmod":
            os.chmod(f.path, 0o666)
        else:
            target = f.path + ".real"
            os.rename(f.path, target)
            os.symlink(target, f.path)
        fd = os.open(f.path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # and the attacker holds it, as a live client would
        planted.append(fd)
    try:
        d.restart(kill=True)  # adoption reads the fence directory
        log = d.log()
        assert log.count("not adopting fence") >= 3, log
        ns = ns_stats(d.socket)
        assert ns["fenced_pages"] == 0 and ns["pinned_pages"] == 0
        stored, bad = victim_store_and_check(d.socket, "after-plant", 8)
        assert stored == 8 and bad == [], "a planted fence kept pages from the namespace"
        assert all(os.path.lexists(os.path.join(fences, f"{n}.fence"))
                   for n in ("other-user", "world-writable", "link")), "refused files are left alone"
    finally:
        for fd in planted:
            os.close(fd)
