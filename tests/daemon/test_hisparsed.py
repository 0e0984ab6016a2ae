"""The real ``hisparsed`` in a subprocess: bad input, dead clients, restarts, systemd.

Every test here talks to the daemon over its real socket, with raw frames
where the test is about the wire, and maps the real region files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from hisparse import KVLayout, protocol
from hisparse.protocol import ErrorCode, Op
from tests.conftest import ping
from tests.rawclient import RawClient, keys_for
from tests.waiting import wait_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def clients():
    made: list[RawClient] = []

    def make(d, namespace: str | None = "ns", layout: KVLayout = LAYOUT,
             capacity_bytes: int | None = 192 * 64) -> RawClient:
        c = RawClient(d.socket)
        made.append(c)
        if namespace is not None:
            c.hello(namespace, layout, capacity_bytes)
        return c

    yield make
    for c in made:
        c.close()


def page_bytes(tag: str, i: int) -> bytes:
    import hashlib

    seed = hashlib.sha256(f"{tag}{i}".encode()).digest()
    return (seed * (LAYOUT.page_bytes // 32 + 1))[:LAYOUT.page_bytes]


def pack(**msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def test_bad_input_gets_typed_errors_and_nobody_notices(hisparsed, clients):
    victim, bystander = clients(hisparsed), clients(hisparsed)
    k = keys_for("bystander", 4)
    assert bystander.store(k, [page_bytes("b", i) for i in range(4)]) == 4
    sid = victim.session
    # (a frame over MAX_FRAME_BYTES is dropped unread with its connection: test_bounds.py)
    cases = [
        (b"", ErrorCode.PROTOCOL_ERROR),
        (b"\xc1\x00garbage", ErrorCode.PROTOCOL_ERROR),
        (msgpack.packb([1, 2, 3]), ErrorCode.PROTOCOL_ERROR),
        (pack(v=protocol.VERSION, id=1, op="lookup", session=sid), ErrorCode.PROTOCOL_ERROR),  # missing keys
        (pack(v=protocol.VERSION, id=1, op="lookup", session=sid, keys=[1, 2]), ErrorCode.PROTOCOL_ERROR),
        (pack(v=protocol.VERSION, id="x", op="ping"), ErrorCode.PROTOCOL_ERROR),
        (pack(v=protocol.VERSION, id=1, op="defragment", session=sid), ErrorCode.UNKNOWN_OP),
        (pack(v=99, id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
        (pack(v=protocol.VERSION, id=1, op="lookup", session=sid, keys=[b""]), ErrorCode.INVALID_ARGUMENT),
        (pack(v=protocol.VERSION, id=1, op="lookup", session=sid, keys=[b"k" * 65]), ErrorCode.INVALID_ARGUMENT),
        (pack(v=protocol.VERSION, id=1, op="lookup", session=sid, keys=[b"k"] * 1_000_000),
         ErrorCode.INVALID_ARGUMENT),
        (pack(v=protocol.VERSION, id=1, op="commit", session=sid, keys=[k[0]]), ErrorCode.NOT_HELD),
        (pack(v=protocol.VERSION, id=1, op="abort", session=sid, keys=[k[0]]), ErrorCode.NOT_HELD),
        (pack(v=protocol.VERSION, id=1, op="unpin", session=sid, pages=[0]), ErrorCode.NOT_HELD),
        (pack(v=protocol.VERSION, id=1, op="lookup", keys=[k[0]]), ErrorCode.PROTOCOL_ERROR),  # no session
        (pack(v=protocol.VERSION, id=1, op="lookup", session=12345, keys=[k[0]]), ErrorCode.UNKNOWN_SESSION),
        (pack(v=protocol.VERSION, id=1, op="clear", session=sid, namespace="ns"), ErrorCode.PERMISSION_DENIED),
        (pack(v=protocol.VERSION, id=1, op="clear", session=sid, namespace="ns", token="guess"),
         ErrorCode.PERMISSION_DENIED),
        (pack(v=protocol.VERSION, id=1, op="shutdown", session=sid), ErrorCode.PERMISSION_DENIED),
        (pack(v=protocol.VERSION, id=1, op="shutdown", session=sid, token=""), ErrorCode.PERMISSION_DENIED),
        (pack(v=protocol.VERSION, id=1, op="hello", namespace="ns", layout=KVLayout(3, 4, 8).to_wire()),
         ErrorCode.LAYOUT_MISMATCH),
    ]
    for frame, code in cases:
        reply = victim.send_raw(frame)
        assert reply is not None, f"no reply to {frame[:40]!r}"
        assert reply.error_code == code.value, (frame[:40], reply)
        # the same session goes on
        assert victim.call(Op.LOOKUP, keys=k) == {"count": 4}
    assert victim.send_raw([b"two", b"frames"]).error_code == ErrorCode.PROTOCOL_ERROR.value
    # the other session never noticed, and nothing committed was lost
    assert bystander.call(Op.LOOKUP, keys=k) == {"count": 4}
    for i in range(4):
        pages = bystander.call(Op.PIN, keys=[k[i]])["pages"]
        assert bystander.read_page(pages[0]) == page_bytes("b", i)
    assert hisparsed.proc.poll() is None


def test_namespaces_are_isolated_and_admin_sessions_see_no_region(hisparsed, clients):
    a, b = clients(hisparsed, "model-a"), clients(hisparsed, "model-b")
    k = keys_for("shared", 3)
    a.store(k, [page_bytes("a", i) for i in range(3)])
    assert b.call(Op.LOOKUP, keys=k) == {"count": 0}
    assert a.hello_reply["region"]["path"] != b.hello_reply["region"]["path"]
    admin = clients(hisparsed, None)
    reply = admin.hello()
    assert reply["region"] is None
    assert admin.request(Op.LOOKUP, keys=k).error_code == ErrorCode.NOT_ATTACHED.value
    stats = admin.call(Op.STATS)
    assert stats["namespaces"]["model-a"]["committed_pages"] == 3
    assert "path" not in json.dumps(stats), "only a namespace's own clients learn its region path"


def test_capacity_is_shared_and_enforced(daemon_factory, clients):
    d = daemon_factory(capacity="1MiB", extra=("--default-namespace-capacity", "8KiB"))
    big = clients(d, "big", capacity_bytes=400 * 1024)
    pages = 400 * 1024 // LAYOUT.page_bytes
    assert big.hello_reply["region"]["num_pages"] == pages
    # charged: region, metadata table (4 KiB + 72 B a page) and index (208 B a page)
    charged = 400 * 1024 + 4096 + 72 * pages + 208 * pages
    assert big.call(Op.STATS)["daemon"]["allocated_bytes"] == charged
    c = RawClient(d.socket)
    try:
        reply = c.request(Op.HELLO, namespace="too-big", layout=LAYOUT, capacity_bytes=200 * 1024)
        assert reply.error_code == ErrorCode.CAPACITY.value
        assert "region, table and index" in reply.error_message
        # unsized: default_namespace_capacity, never everything that is left
        rest = c.call(Op.HELLO, namespace="rest", layout=LAYOUT)
        assert rest["region"]["num_pages"] == 8 * 1024 // LAYOUT.page_bytes
    finally:
        c.close()


def test_store_writes_what_fits_and_never_evicts_pinned_or_writing(daemon_factory, clients):
    # one session filling its whole region: the defaults let a lone session (test_shares.py)
    c = clients(daemon_factory(), capacity_bytes=192 * 4)
    a = keys_for("a", 4)
    c.store(a[:2], [page_bytes("a", i) for i in range(2)])
    c.call(Op.PIN, keys=a[:1])
    body = c.call(Op.RESERVE, keys=keys_for("b", 6))
    # 2 free pages + 1 evictable (a[1]); a[0] is pinned
    assert len(body["slots"]) == 3 and all(s >= 0 for s in body["slots"])
    assert body["evicted"] == [a[1]]
    assert c.call(Op.LOOKUP, keys=a[:1]) == {"count": 1}
    full = c.call(Op.RESERVE, keys=keys_for("c", 1))
    assert full["slots"] == [] and full["shortfall"]["by"] == "room", "the reply says why it is short"


_DOOMED_CLIENT = r"""
import sys, time
sys.path.insert(0, {repo!r})
from tests.rawclient import RawClient, keys_for
from hisparse import KVLayout
from hisparse.protocol import Op
c = RawClient({sock!r})
c.hello("ns", KVLayout(3, 4, 16), 192 * 64)
k = keys_for("dead", 6)
c.store(k[:3], [bytes([i]) * 192 for i in range(3)])
c.call(Op.PIN, keys=k[:3])
c.call(Op.RESERVE, keys=k[3:])
print("holding", flush=True)
time.sleep(600)
"""


def test_sigkilled_client_releases_within_lease(daemon_factory, clients):
    d = daemon_factory(lease_ttl=1.0)
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT.format(repo=REPO, sock=d.socket)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        observer = clients(d)
        ns = observer.call(Op.STATS)["namespaces"]["ns"]
        assert (ns["pinned_pages"], ns["writing_pages"]) == (3, 3)
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(10)
        while True:
            ns = observer.call(Op.STATS)["namespaces"]["ns"]
            if ns["pinned_pages"] == 0 and ns["writing_pages"] == 0:
                break
            # lease 1 s + a reaper tick; the bound is loose for a busy CI machine
            assert time.monotonic() - killed_at < 1.0 + 10.0, "not released after the lease"
            time.sleep(0.05)
        k = keys_for("dead", 6)
        assert observer.call(Op.LOOKUP, keys=k) == {"count": 3}, "committed pages stay"
        assert observer.store(k[3:], [bytes([9]) * 192] * 3) == 3, "the aborted keys can be stored again"
        # a dead process holds no fence: nothing of it stays fenced
        stats = observer.call(Op.STATS)
        assert stats["namespaces"]["ns"]["fenced_pages"] == 0
        assert stats["daemon"]["fenced_sessions"] == 0
        assert "lease expired" in d.log()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkilled_daemon_restarts_with_every_committed_page(daemon_factory, clients):
    d = daemon_factory(lease_ttl=5)
    c = clients(d)
    k = keys_for("keep", 20)
    pages = [page_bytes("keep", i) for i in range(20)]
    c.store(k, pages)
    c.call(Op.RESERVE, keys=keys_for("torn", 5))  # WRITING at the kill: must come back FREE
    old_session = c.session
    d.restart(kill=True)
    assert "adopted namespace 'ns': 64 pages, 20 committed, 5 WRITING freed" in d.log()
    # ... but c's process lives and may still be writing them: they stay fenced
    assert "fenced 5 pages and 0 pins of session" in d.log()
    c2 = clients(d)
    assert c2.hello_reply["region"]["created"] is False
    assert c2.hello_reply["region"]["region_id"] == c.hello_reply["region"]["region_id"]
    assert c2.call(Op.LOOKUP, keys=k) == {"count": 20}
    got = c2.call(Op.PIN, keys=k)["pages"]
    for i, page in enumerate(got):
        assert c2.read_page(page) == pages[i], f"page {i} changed across the restart"
    ns = c2.call(Op.STATS)["namespaces"]["ns"]
    assert ns["writing_pages"] == 0 and ns["fenced_pages"] == 5 and ns["free_pages"] == 64 - 25
    c.release_fence()  # c lets go (or exits): its pages come back
    wait_for(lambda: c2.call(Op.STATS)["namespaces"]["ns"]["free_pages"] == 64 - 20, "fence release")
    # the old session belongs to the earlier run
    assert c2.request(Op.LOOKUP, session=old_session, keys=k).error_code == ErrorCode.UNKNOWN_SESSION.value


def test_clean_stop_exits_zero_and_fresh_starts_empty(daemon_factory, clients):
    d = daemon_factory()
    c = clients(d)
    k = keys_for("x", 3)
    c.store(k, [page_bytes("x", i) for i in range(3)])
    assert d.stop(signal.SIGTERM) == 0
    assert not os.path.exists(d.socket)
    d.start()
    assert clients(d).call(Op.LOOKUP, keys=k) == {"count": 3}
    d.restart("--fresh")
    c3 = clients(d)
    assert c3.hello_reply["region"]["created"] is True
    assert c3.call(Op.LOOKUP, keys=k) == {"count": 0}


def test_a_second_daemon_on_the_same_socket_or_dir_is_refused(daemon_factory, tmp_path):
    d = daemon_factory()
    dup = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--socket", d.socket,
                          "--shm-dir", d.shm_dir + "-other", "--meta-dir", str(tmp_path / "other-meta")],
                         capture_output=True, text=True, timeout=30)
    assert dup.returncode == 1 and "another hisparsed is serving" in dup.stderr
    # the same metadata directory: the lock names the daemon that holds it
    dup = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--socket", d.socket + "2",
                          "--shm-dir", d.shm_dir], capture_output=True, text=True, timeout=30)
    assert dup.returncode == 1 and "hisparsed.lock" in dup.stderr
    assert f"pid {d.pid}, socket {d.socket}" in dup.stderr
    shutil.rmtree(d.shm_dir + "-other", ignore_errors=True)
    assert ping(d.socket) is not None


def test_bad_config_names_the_key_and_exits_2(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("lease_ttl = 0.1\n")
    r = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--config", str(f)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "lease_ttl" in r.stderr


def test_ready_is_sent_only_once_ping_answers(daemon_factory, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    try:
        d = daemon_factory(start=False, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
        d.start(wait=False)
        message = sock.recv(4096).decode()
        assert "READY=1" in message and f"MAINPID={d.pid}" in message
        assert ping(d.socket, timeout_s=0.2) is not None, "READY=1 before the socket answered"
        assert sock.recv(4096) == b"WATCHDOG=1"
        d.stop()
        assert b"STOPPING=1" in sock.recv(4096)
    finally:
        sock.close()


def test_sighup_reloads_lease_ttl_and_log_level(daemon_factory, tmp_path, clients):
    cfg = tmp_path / "h.toml"
    cfg.write_text("lease_ttl = 7\n")
    d = daemon_factory(extra=("--config", str(cfg)))
    c = clients(d)
    assert c.hello_reply["lease_ttl_s"] == 7.0
    cfg.write_text('lease_ttl = 3\nlog_level = "DEBUG"\n')
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while c.call(Op.HEARTBEAT)["lease_ttl_s"] != 3.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "SIGHUP: reloaded lease_ttl=3.0s log_level=DEBUG" in d.log()


def hisparsectl(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=30)


def test_hisparsectl_ping_stats_clear(daemon_factory, clients):
    # each hisparsectl run takes about a second here: a lease longer than the test
    hisparsed = daemon_factory(lease_ttl=30)
    c = clients(hisparsed, "glm/fp8")
    k = keys_for("ctl", 5)
    c.store(k, [page_bytes("c", i) for i in range(5)])
    c.call(Op.LOOKUP, keys=k)
    r = hisparsectl(hisparsed, "ping")
    assert r.returncode == 0 and f"pid {hisparsed.pid}" in r.stdout
    r = hisparsectl(hisparsed, "stats")
    assert r.returncode == 0
    assert "glm/fp8" in r.stdout and "hit rate" in r.stdout and "evictions" in r.stdout
    stats = json.loads(hisparsectl(hisparsed, "stats", "--json").stdout)
    assert stats["namespaces"]["glm/fp8"]["committed_pages"] == 5
    assert stats["namespaces"]["glm/fp8"]["hit_rate"] == 1.0
    r = hisparsectl(hisparsed, "clear", "glm/fp8")
    assert r.returncode == 0 and "5 pages freed" in r.stdout
    assert c.call(Op.LOOKUP, keys=k) == {"count": 0}
    r = hisparsectl(hisparsed, "clear", "no-such")
    assert r.returncode == 1 and "no namespace" in r.stderr


def test_hisparsectl_reports_an_absent_daemon(tmp_path):
    # A --timeout longer than the subprocess's own: only failing fast passes.
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", str(tmp_path / "none.sock"),
                        "--timeout", "600", "ping"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and "no hisparsed socket at" in r.stderr


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: install Debian's systemd package (.ci/run does)")
    unit = open(os.path.join(REPO, "systemd", "hisparsed.service")).read()
    assert "Type=notify" in unit and "RuntimeDirectory=hisparsed" in unit
    assert "\nLimitMEMLOCK" not in unit  # the daemon locks nothing; engines do (docs/deploy.md)
    binary = shutil.which("hisparsed") or os.path.join(os.path.dirname(sys.executable), "hisparsed")
    # Only the binary's path is changed: verify checks that ExecStart is executable.
    (tmp_path / "hisparsed.service").write_text(unit.replace("/opt/hisparse/venv/bin/hisparsed", binary))
    r = subprocess.run([analyze, "verify", str(tmp_path / "hisparsed.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "hisparsed.service" not in r.stderr, r.stderr


def test_unwritable_socket_directory_is_one_clear_line(tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    r = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--socket",
                        str(blocked / "hisparsed.sock"), "--shm-dir", str(tmp_path / "shm")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot start" in r.stderr and "Traceback" not in r.stderr


def test_abort_missing_ok_releases_what_a_lost_reserve_took(hisparsed, clients):
    c = clients(hisparsed)
    k = keys_for("lost", 4)
    c.call(Op.RESERVE, keys=k[:2])  # pretend this reply never arrived
    assert c.request(Op.ABORT, keys=k).error_code == ErrorCode.NOT_HELD.value, "strict by default"
    assert c.call(Op.ABORT, keys=k, missing_ok=True) == {"aborted": 2}
    ns = c.call(Op.STATS)["namespaces"]["ns"]
    assert ns["writing_pages"] == 0 and ns["free_pages"] == ns["num_pages"]
    assert c.request(Op.ABORT, keys=k, missing_ok="yes").error_code == ErrorCode.PROTOCOL_ERROR.value


def test_an_expired_writers_pages_stay_fenced_while_its_process_lives(daemon_factory, clients):
    d = daemon_factory(lease_ttl=2.0, extra=("--session-reserve-share", "1", "--session-pin-share", "1"))  # one writer fills the region
    stalled = clients(d, capacity_bytes=192 * 2)
    slots = stalled.call(Op.RESERVE, keys=keys_for("stalled", 2))["slots"]
    assert len(slots) == 2  # the region is now full of this writer's reservations
    # the writer stalls (no heartbeat, fence still locked); another keeps its lease alive
    other = clients(d)
    wait_for(lambda: other.call(Op.STATS)["namespaces"]["ns"]["fenced_pages"] == 2, "the expiry")
    # expired, but its pages are not handed out while its process might still write (one uid
    # here: its fenced pages also still count against that uid's quota, so the refusal may be either)
    def nothing_for(c) -> bool:
        reply = c.request(Op.RESERVE, keys=keys_for("next", 2))
        return reply.error_code == "QUOTA_EXCEEDED" or reply.ok["slots"] == []
    assert nothing_for(other)
    with open(stalled.fence_path, "rb") as f:
        assert f.read(16)[12] == 2, "the fence says LOST"
    # many reaper ticks later (other keeps its own lease), still fenced: silence alone
    # never frees a page
    for _ in range(10):
        time.sleep(0.1)
        assert nothing_for(other)
    assert other.call(Op.STATS)["daemon"]["fenced_sessions"] == 1
    stalled.release_fence()  # the process comes back and gives up its holds (or exits)
    def two_slots() -> bool:
        reply = other.request(Op.RESERVE, keys=keys_for("next", 2))
        return reply.ok is not None and len(reply.ok["slots"]) == 2
    wait_for(two_slots, "release")
    ns = other.call(Op.STATS)["namespaces"]["ns"]
    assert ns["fenced_pages"] == 0 and ns["writing_pages"] == 2


def test_publish_commits_a_reservation_under_its_late_key_once(daemon_factory, clients):
    # vLLM HiSparse: a block is handed out (reserved under a placeholder) before
    # its tokens, hence its hash, exist; publish commits it under the hash
    d = daemon_factory(lease_ttl=5)
    a, b = clients(d), clients(d)
    placeholders, hashes = keys_for("placeholder-a", 3), keys_for("hash", 3)
    slots = a.call(Op.RESERVE, keys=placeholders)["slots"]
    for i, page in enumerate(slots):
        a.write_page(page, page_bytes("hash", i))
    got = a.call(Op.PUBLISH, keys=placeholders, as_keys=hashes, pin=True)["pages"]
    assert got == slots
    assert b.call(Op.LOOKUP, keys=hashes) == {"count": 3}
    assert b.call(Op.LOOKUP, keys=placeholders) == {"count": 0}
    # a second engine's block with the same hash is not published twice: it stays its reservation
    other = keys_for("placeholder-b", 1)
    (b_page,) = b.call(Op.RESERVE, keys=other)["slots"]
    assert b.call(Op.PUBLISH, keys=other, as_keys=hashes[:1], pin=False)["pages"] == [-1]
    assert b.call(Op.ABORT, keys=other) == {"aborted": 1}
    # publishing what this session does not hold changes nothing
    reply = b.request(Op.PUBLISH, keys=placeholders, as_keys=keys_for("x", 3), pin=False)
    assert reply.error_code == ErrorCode.NOT_HELD.value
    # a's pin holds the pages; unpinned, they are ordinary committed pages
    assert a.call(Op.UNPIN, pages=slots) == {"unpinned": 3}
    # the renamed key is what the metadata table keeps: it survives a SIGKILL
    d.restart(kill=True)
    c = clients(d)
    assert c.call(Op.LOOKUP, keys=hashes) == {"count": 3}
    pinned = c.call(Op.PIN, keys=hashes)["pages"]
    assert [c.read_page(p) for p in pinned] == [page_bytes("hash", i) for i in range(3)]
