"""The daemon bounded by construction: decode bombs, hello floods, descriptor starvation, a
start with a directory full of stale fences. Each against a real ``hisparsed``."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import msgpack

from prometheus_client.parser import text_string_to_metric_families

from hisparse import KVLayout, protocol
from hisparse.ctlviews import scrape
from hisparse.daemon.policy.limits import CAP_KEYS
from hisparse.protocol import ErrorCode, Op
from hisparse.shm.fence import FenceFile, fence_dir_for
from tests.conftest import Daemon, _shm_base
from tests.rawclient import RawClient, keys_for
from tests.waiting import wait_for

LAYOUT = KVLayout(2, 4, 64)
CAP = LAYOUT.page_bytes * 64


def bomb(field: str) -> bytes:
    """A ~4 MB ping whose ``field`` holds 1.4M one-element arrays (~1.5 s to decode unbounded)."""
    inner = b"\xdc" + (16_384).to_bytes(2, "big") + b"\x91\xc0" * 16_384
    n = (3 << 20) // len(inner)
    head = msgpack.packb({"v": protocol.VERSION, "id": 77, "op": "ping"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(field) + b"\xdc" + n.to_bytes(2, "big") + inner * n


def test_decode_bombs_get_a_typed_error_fast_and_the_daemon_serves_on(hisparsed):
    """Each bomb a typed error, addressed though never decoded, fast; a connection that sent
    none is served throughout. A large frame that is no request at all (junk) sheds its
    connection: no client sends one."""
    keeper = RawClient(hisparsed.socket, timeout_s=30)
    bombers = [RawClient(hisparsed.socket, timeout_s=30) for _ in range(4)]
    try:
        for c in (keeper, *bombers):  # all connected before the first bomb
            assert c.call(Op.PING)["pid"] == hisparsed.pid
        replies = []
        started = time.monotonic()
        for bomber, field in zip(bombers, ("keys", "padding", "pages")):
            bomber.sock.send(bomb(field))
            assert bomber.sock.poll(30_000)
            replies.append(protocol.decode_reply(bomber.sock.recv()))
            assert keeper.call(Op.PING)["pid"] == hisparsed.pid
        elapsed = time.monotonic() - started
        assert all(r.error_code in (ErrorCode.PROTOCOL_ERROR.value, ErrorCode.INVALID_ARGUMENT.value)
                   for r in replies), replies
        assert all(r.id == 77 for r in replies)
        # unbounded, each costs ~1.5 s of loop; scanned, a few ms
        assert elapsed < 3.0, elapsed
        junk = bombers[3]
        junk.sock.send(b"\x81" + b"\0" * (300 << 10))
        junk.sock.send(b"\x81" + b"\0" * (300 << 10))
        assert junk.sock.poll(30_000)
        assert protocol.decode_reply(junk.sock.recv()).error_code == ErrorCode.PROTOCOL_ERROR.value
        assert not junk.sock.poll(300)  # shed: the second is never answered
        assert keeper.call(Op.PING)["pid"] == hisparsed.pid
    finally:
        keeper.close()
        for b in bombers:
            b.close()


def test_a_hello_flood_on_one_connection_stops_at_the_session_cap(hisparsed):
    c = RawClient(hisparsed.socket, timeout_s=30)
    try:
        n = 100
        for i in range(n):  # pipelined, replies never awaited in between
            c.sock.send(protocol.encode_request(Op.HELLO, 1000 + i, namespace="flood", layout=LAYOUT,
                                                capacity_bytes=LAYOUT.page_bytes * 64, client="flood"))
        replies = []
        for _ in range(n):
            assert c.sock.poll(30_000)
            replies.append(protocol.decode_reply(c.sock.recv()))
        ok = [r for r in replies if r.ok is not None]
        refused = [r for r in replies if r.error_code == ErrorCode.QUOTA_EXCEEDED.value]
        assert len(ok) == 16 and len(refused) == n - 16, [r.error_message for r in replies[:3]]
        assert "max_sessions_per_connection (16)" in refused[0].error_message
        # another connection of the same peer is not this one's cap
        other = RawClient(hisparsed.socket)
        try:
            assert other.call(Op.HELLO, namespace="flood", layout=LAYOUT, capacity_bytes=CAP)["session"]
        finally:
            other.close()
    finally:
        c.close()


def test_sessions_per_uid_and_in_total_are_capped_by_name(daemon_factory):
    d = daemon_factory(env={"HISPARSED_MAX_SESSIONS_PER_UID": "10", "HISPARSED_MAX_SESSIONS": "12",
                            "HISPARSED_MAX_SESSIONS_PER_CONNECTION": "4"})
    clients = [RawClient(d.socket) for _ in range(3)]
    try:
        codes = []
        for c in clients:
            for _ in range(4):
                codes.append(c.request(Op.HELLO, namespace="ns", layout=LAYOUT, capacity_bytes=CAP))
        refused = [r for r in codes if r.ok is None]
        assert len(refused) == 2 and all(r.error_code == "QUOTA_EXCEEDED" for r in refused)
        assert "max_sessions_per_uid (10)" in refused[0].error_message  # every test peer is one uid
        # bye gives the room back at once
        first = codes[0].ok["session"]
        clients[0].call(Op.BYE, session=first)
        assert clients[2].request(Op.HELLO, namespace="ns", layout=LAYOUT, capacity_bytes=CAP).ok is not None
    finally:
        for c in clients:
            c.close()



def test_large_senders_past_the_budget_are_refused_and_their_uid_backs_off(daemon_factory):
    """Room for two large senders (12 MiB each), one per uid: the second connection of the
    same uid is refused naming the cap and shed; that uid's new connections are then shed at
    accept, before libzmq reads their frames into memory; after the backoff they are served."""
    d = daemon_factory(env={"HISPARSED_MAX_REQUEST_BYTES_IN_FLIGHT": "24MiB"})
    first, second = RawClient(d.socket), RawClient(d.socket)
    keys = keys_for("large", 10_000)  # 380 KB: over 256 KiB
    later = None
    try:
        first.hello("ns", LAYOUT, CAP)
        second.hello("ns", LAYOUT, CAP)
        r0 = first.send_raw(protocol.encode_request(Op.LOOKUP, 1, session=first.session, keys=keys))
        assert r0 is not None and r0.ok is not None, r0  # admitted: a large sender
        reply = second.send_raw(protocol.encode_request(Op.LOOKUP, 2, session=second.session, keys=keys))
        assert reply is not None and reply.error_code == ErrorCode.QUOTA_EXCEEDED.value, reply
        assert reply.id == 2  # unread, but its id read from the frame's head: the caller hears it
        assert "max_request_bytes_in_flight" in reply.error_message and "uid" in reply.error_message
        later = RawClient(d.socket, timeout_s=0.5)  # inside the backoff: shed, at most told why
        reply = later.send_raw(protocol.encode_request(Op.PING, 1))
        assert reply is None or "max_request_bytes_in_flight" in (reply.error_message or ""), reply
        later.close()
        later = None  # the backoff ends (1 s): a new connection is answered again
        wait_for(lambda: _served(d.socket), "a connection after the backoff to be served", timeout_s=30)
        assert first.request(Op.LOOKUP, keys=keys).ok is not None  # the admitted one served on
    finally:
        for c in (first, second, later):
            if c is not None:
                c.close()


def _refusals(address: str) -> dict[str, float]:
    """{cap: refusals} and the caps' gauges of one scrape of the metrics endpoint."""
    out = {}
    for family in text_string_to_metric_families(scrape(address)):
        for sample in family.samples:
            out[sample.labels.get("cap", "") + ":" + sample.name if "cap" in sample.labels else sample.name] \
                = sample.value
    return out


def _served(socket_path: str) -> bool:
    c = RawClient(socket_path, timeout_s=0.5)
    try:
        reply = c.send_raw(protocol.encode_request(Op.PING, 1))
        return reply is not None and reply.ok is not None
    finally:
        c.close()


def test_caps_set_by_flag_count_their_refusals_in_metrics_and_stats(daemon_factory):
    d = daemon_factory(extra=("--max-sessions-per-connection", "2", "--max-sessions-per-uid", "3",
                              "--max-connections", "3", "--max-request-bytes-in-flight", "12MiB"))
    address = os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock")
    m = _refusals(address)
    assert all(m[f"{cap}:hisparse_cap_refusals_total"] == 0 for cap in CAP_KEYS), m
    assert m["max_connections:hisparse_cap_limit"] == 3 and m["max_sessions:hisparse_cap_limit"] == 2048
    wait_for(lambda: _refusals(address)["hisparse_connections_open"] == 0, "the ready probe's end")
    a, b, c = (RawClient(d.socket) for _ in range(3))
    e = None
    try:
        hellos = [a.request(Op.HELLO, namespace="ns", layout=LAYOUT, capacity_bytes=CAP) for _ in range(3)]
        assert "max_sessions_per_connection (2)" in hellos[2].error_message
        a.session = hellos[0].ok["session"]
        assert b.request(Op.HELLO, namespace="ns", layout=LAYOUT, capacity_bytes=CAP).ok
        assert "max_sessions_per_uid (3)" in b.request(Op.HELLO, namespace="ns", layout=LAYOUT).error_message
        for client in (a, b, c):  # all three admitted before a fourth connects
            assert client.call(Op.PING)
        e = RawClient(d.socket, timeout_s=1)

        def refused() -> bool:  # a request read before the guard saw the connection is served
            reply = e.send_raw(protocol.encode_request(Op.PING, 1))
            return reply is not None and "max_connections (3)" in (reply.error_message or "")
        wait_for(refused, "the fourth connection refused by max_connections")
        # two large senders at once: 2 x 12 MiB (what libzmq may hold for each) is past the cap
        big = protocol.encode_request(Op.PING, 2, padding=b"x" * 200, keys=[b"k" * 32] * 9000)
        assert a.send_raw(big).ok  # admitted: a ping answers whatever else it carries
        stats = a.call(Op.STATS)["daemon"]  # within the second a counts as a large sender
        assert stats["request_bytes_in_flight"] == 12 << 20
        assert "max_request_bytes_in_flight" in b.send_raw(big).error_message
        m = _refusals(address)
        for cap in ("max_sessions_per_connection", "max_sessions_per_uid", "max_request_bytes_in_flight"):
            assert m[f"{cap}:hisparse_cap_refusals_total"] == 1, (cap, m)
        assert m["max_connections:hisparse_cap_refusals_total"] >= 1  # a refused DEALER reconnects
        assert m["hisparse_sessions_open"] == 3 and m["hisparse_connections_open"] <= 3
        assert 0 < m["hisparse_file_descriptors"] < m["hisparse_file_descriptors_budget"] \
            < m["hisparse_file_descriptors_limit"]
        stats = a.call(Op.STATS)["daemon"]
        assert stats["caps"]["max_sessions_per_uid"] == 3
        assert stats["cap_refusals"]["max_sessions_per_uid"] == 1 and stats["sessions_refused"] == 2
        for other in (b, c, e):
            other.close()
        wait_for(lambda: _refusals(address)["hisparse_connections_open"] == 1, "the others' ends")
        a.call(Op.BYE, session=hellos[1].ok["session"])  # room for hisparsectl's own session
        wait_for(lambda: _served(d.socket), "the uid's large-sender backoff to end")  # new connections
        out = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, "stats"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("caps: "))
        assert "/3 connections" in line and "refused: max_sessions_per_connection 1, max_sessions_per_uid 1" in line
    finally:
        for client in (a, b, c, e):
            if client is not None:
                client.close()

FLOOD = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
    except OSError:
        s.close()
        continue
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()  # held open until the test lets go
"""


def _as_other_user() -> dict:
    """Run a peer as nobody when the tests run as root (root ignores the socket's mode)."""
    if os.geteuid() != 0:
        return {}

    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)
    return {"preexec_fn": drop, "cwd": "/"}


def test_a_descriptor_starved_daemon_refuses_instead_of_aborting(tmp_path_factory):
    base = tempfile.mkdtemp(prefix="hisparse-starved-")
    os.chmod(base, 0o755)  # another user's peer must reach the socket (the daemon's dir stays private)
    shm = tempfile.mkdtemp(prefix="hisparse-starved-", dir=_shm_base())
    d = Daemon(os.path.join(base, "hisparsed.sock"), shm, ["--capacity", "64MiB"],
               {**os.environ, "PYTHONUNBUFFERED": "1"}, os.path.join(base, "log"))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # 128 of them kept free

    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([sys.executable, "-m", "hisparse.daemon.main", "--socket", d.socket,
                                   "--shm-dir", shm, *d.args], stdout=log, stderr=subprocess.STDOUT,
                                  env=d.env, preexec_fn=limit)
    d.wait_ready()
    os.chmod(d.socket, 0o666)  # open to the other user too (as a group would be)
    keeper = RawClient(d.socket, timeout_s=10)
    flood = RawClient(d.socket, timeout_s=30)
    peer = None
    try:
        keeper.hello()  # an admin session: it reads stats
        # sessions: each holds a fence file open; refused by name before EMFILE
        for i in range(200):
            flood.sock.send(protocol.encode_request(Op.HELLO, i + 1, namespace="ns", layout=LAYOUT,
                                                    capacity_bytes=CAP))
        replies = [protocol.decode_reply(flood.sock.recv()) for _ in range(200) if flood.sock.poll(30_000)]
        assert len(replies) == 200
        refused = [r.error_message for r in replies if r.ok is None]
        assert refused and all("fd_headroom" in m or "max_sessions_per_connection" in m for m in refused)
        flood.close()
        # connections: far more than the descriptors left, as fast as one process connects
        peer = subprocess.Popen(["/usr/bin/python3", "-c", FLOOD, d.socket, "3000"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, **_as_other_user())
        assert peer.stdout is not None and int(peer.stdout.readline()) < 3000
        assert d.proc.poll() is None, d.log()
        assert keeper.call(Op.PING)["pid"] == d.proc.pid  # an open connection is served on
        daemon = keeper.call(Op.STATS)["daemon"]  # refused, or kept out by the shut door
        assert daemon["connections_refused"] > 0 or daemon["socket_closures"] > 0
        peer.communicate("", timeout=30)
        # with the flood gone, a new engine gets in again
        wait_for(lambda: _hello_ok(d.socket), "a session after the flood", timeout_s=30)
        assert d.proc.poll() is None and "Too many open files" not in d.log()
    finally:
        if peer is not None and peer.poll() is None:
            peer.kill()
        keeper.close()
        flood.close()
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _hello_ok(socket_path: str) -> bool:
    c = RawClient(socket_path, timeout_s=2)
    try:
        return c.send_raw(protocol.encode_request(Op.HELLO, 1, namespace="ns", layout=LAYOUT)) is not None
    finally:
        c.close()


def test_a_start_on_many_stale_fences_serves_before_the_sweep_ends(daemon_factory):
    d = daemon_factory(start=False)
    fence_dir = fence_dir_for(d.socket)
    os.makedirs(os.path.dirname(fence_dir), mode=0o700, exist_ok=True)
    os.makedirs(fence_dir, mode=0o750, exist_ok=True)
    n = 6000
    for i in range(n):  # an earlier run's sessions on a namespace that is gone: all stale
        FenceFile.create(fence_dir, f"{i:032x}.fence", namespace="gone", region_id=1, num_pages=8,
                         handle=f"{i:08x}").close(unlink=False)
    d.start()
    c = RawClient(d.socket, timeout_s=30)
    try:
        assert c.call(Op.PING)["pid"] == d.pid
        # a reserve waits for the sweep (no page is handed out before), then is served
        c.hello("ns", LAYOUT, capacity_bytes=LAYOUT.page_bytes * 8)
        assert len(c.call(Op.RESERVE, keys=[b"k" * 32])["slots"]) == 1
        wait_for(lambda: "swept in" in d.log(), "the sweep's end")
        log = d.log()
        assert log.index("ready: serving on") < log.index("swept in"), log[-2000:]
        wait_for(lambda: len(os.listdir(fence_dir)) <= 1, "stale fences removed")
    finally:
        c.close()


def test_a_client_refused_a_large_request_hears_it_at_once_and_serves_on(daemon_factory):
    """Through the real client: the refusal names the call (its id read from the frame's head),
    so the caller gets QuotaExceeded, not its whole timeout; the shed connection comes back."""
    import hisparse
    from hisparse import client

    d = daemon_factory(env={"HISPARSED_MAX_REQUEST_BYTES_IN_FLIGHT": "24MiB"})
    keys = keys_for("large", 10_000)
    with client.attach("ns", LAYOUT, socket=d.socket, capacity=CAP, timeout_s=30.0) as first, \
            client.attach("ns", LAYOUT, socket=d.socket, capacity=CAP, timeout_s=30.0) as second:
        assert first.lookup(keys) == 0  # admitted: the uid's one large sender
        started = time.monotonic()
        try:
            second.lookup(keys)
        except hisparse.QuotaExceeded as exc:
            assert "max_request_bytes_in_flight" in str(exc)
        else:
            raise AssertionError("a second large sender of one uid was served")
        assert time.monotonic() - started < 10.0  # answered, not the 30 s timeout
        # Its connection was shed, and its uid's new connections are for a backoff (1 s):
        # then small requests go on, on a new connection and session.
        wait_for(lambda: _looks_up(second, keys[:3]), "the refused client to be served again", timeout_s=30)
        assert first.lookup(keys) == 0  # the admitted one served on


def _looks_up(cl, keys) -> bool:
    import hisparse

    try:
        return cl.lookup(keys) == 0
    except hisparse.DaemonUnavailable:
        return False  # shed while its uid backs off
