"""Tenants sharing one daemon: quotas, drop, sizing, limits, reload, range checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest

from hisparse import KVLayout, protocol
from hisparse.protocol import ErrorCode, Op
from tests.rawclient import RawClient, keys_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages


@pytest.fixture
def raw():
    made: list[RawClient] = []

    def make(d, namespace: str | None = "ns", capacity_bytes: int | None = 192 * 8) -> RawClient:
        c = RawClient(d.socket)
        made.append(c)
        if namespace is not None:
            c.hello(namespace, LAYOUT, capacity_bytes)
        return c

    yield make
    for c in made:
        c.close()


def ctl(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=30)


def test_one_session_can_neither_hoard_reservations_nor_pin_everything(daemon_factory, raw):
    # per session: hog and victim are one uid here, so the peer shares (their sum) are lifted
    d = daemon_factory(extra=("--session-reserve-share", "0.25", "--session-pin-share", "0.5",
                              "--peer-reserve-share", "1", "--peer-pin-share", "1"))
    hog, victim = raw(d), raw(d)  # 8 pages: 2 reservations, 4 pins a session
    # the victim asks for more than the region holds: short, it contends, and the session shares bind
    assert len(victim.call(Op.RESERVE, keys=keys_for("v0", 9))["slots"]) == 8
    victim.call(Op.ABORT, keys=keys_for("v0", 8))
    k = keys_for("hog", 8)
    # a reserve beyond the share is cut short; one with the share used up is refused, typed
    assert len(hog.call(Op.RESERVE, keys=k[:4])["slots"]) == 2
    reply = hog.request(Op.RESERVE, keys=k[2:4])
    assert reply.error_code == ErrorCode.QUOTA_EXCEEDED.value
    assert "session_reserve_share" in reply.error_message
    # the hoarder heartbeats, and the victim can still write
    assert hog.call(Op.HEARTBEAT)
    assert victim.store(keys_for("v", 2), [b"v" * 192] * 2) == 2
    hog.call(Op.COMMIT, keys=k[:2])
    assert hog.store(k[2:4], [b"h" * 192] * 2) == 2
    assert hog.store(k[4:6], [b"h" * 192] * 2) == 2
    reply = hog.request(Op.PIN, keys=k[:6])
    assert reply.error_code == ErrorCode.QUOTA_EXCEEDED.value and "session_pin_share" in reply.error_message
    assert hog.call(Op.STATS)["namespaces"]["ns"]["pinned_pages"] == 0, "a refused pin pins nothing"
    assert hog.call(Op.PIN, keys=k[:4])["count"] == 4
    # 4 of 8 pages pinned by the hog: the victim still stores (evicting unpinned pages)
    assert victim.store(keys_for("w", 2), [b"w" * 192] * 2) == 2


def test_quota_exceeded_is_a_typed_client_error():
    from hisparse import CapacityError, QuotaExceeded

    err = protocol.error_for_code("QUOTA_EXCEEDED", "pin: ... session_pin_share ...")
    assert isinstance(err, QuotaExceeded) and isinstance(err, CapacityError)


def test_drop_frees_a_namespace_and_needs_token_and_force(daemon_factory, raw):
    d = daemon_factory(capacity="1MiB")
    a = raw(d, "tenant-a", 192 * 1000)
    a.store(keys_for("a", 3), [b"a" * 192] * 3)
    region = a.hello_reply["region"]["path"]
    admin = raw(d, None)
    admin.hello()
    used = admin.call(Op.STATS)["daemon"]["allocated_bytes"]
    assert used > 192 * 1000
    assert admin.request(Op.DROP, namespace="tenant-a", token="guess").error_code == "PERMISSION_DENIED"
    r = ctl(d, "drop", "tenant-a")
    assert r.returncode == 1 and "1 attached sessions" in r.stderr and "--force" in r.stderr
    r = ctl(d, "drop", "tenant-a", "--force")
    assert r.returncode == 0 and "back to the capacity, 1 sessions ended" in r.stdout, r.stderr
    assert admin.call(Op.STATS)["daemon"]["allocated_bytes"] == 0
    assert not os.path.exists(region)
    assert a.request(Op.LOOKUP, keys=keys_for("a", 3)).error_code == ErrorCode.UNKNOWN_SESSION.value
    # attach again: a new, empty region
    again = a.hello("tenant-a", LAYOUT, 192 * 1000)
    assert again["region"]["created"] is True and again["region"]["path"] != region
    assert a.call(Op.LOOKUP, keys=keys_for("a", 3)) == {"count": 0}
    r = ctl(d, "drop", "no-such")
    assert r.returncode == 1 and "no namespace" in r.stderr


def test_sizes_unsized_attach_and_a_differing_capacity(daemon_factory, raw):
    d = daemon_factory(capacity="1MiB", extra=("--default-namespace-capacity", "19200"))
    c = raw(d, "ns", None)
    assert c.hello_reply["region"]["num_pages"] == 100 and c.hello_reply["warnings"] == []
    other = raw(d, None)
    reply = other.hello("ns", LAYOUT, 192 * 50)
    assert reply["region"]["num_pages"] == 100
    assert len(reply["warnings"]) == 1 and "is ignored" in reply["warnings"][0]
    assert "the requested" in d.log()


def test_layout_and_namespace_limits_are_typed_refusals(daemon_factory, raw):
    d = daemon_factory(extra=("--max-namespaces", "2"))
    c = raw(d, None)
    reply = c.request(Op.HELLO, namespace="tiny", layout=KVLayout(1, 1, 1), capacity_bytes=16 << 20)
    assert reply.error_code == ErrorCode.INVALID_ARGUMENT.value and "min_page_bytes" in reply.error_message
    raw(d, "one")
    raw(d, "two")
    reply = c.request(Op.HELLO, namespace="three", layout=LAYOUT, capacity_bytes=192 * 8)
    assert reply.error_code == ErrorCode.CAPACITY.value and "max_namespaces (2)" in reply.error_message


def test_a_namespace_resized_by_the_config_is_recreated_at_start(daemon_factory, tmp_path, raw):
    cfg = tmp_path / "h.toml"
    cfg.write_text('[namespaces."ns"]\ncapacity = 12288\n')  # 64 pages
    d = daemon_factory(extra=("--config", str(cfg)))
    c = raw(d, "ns", None)
    assert c.hello_reply["region"]["num_pages"] == 64
    c.store(keys_for("r", 2), [b"r" * 192] * 2)
    c.close()
    cfg.write_text('[namespaces."ns"]\ncapacity = 6144\n')  # 32 pages
    d.restart()
    assert "resized by the config: 64 pages now 32" in d.log()
    assert raw(d, "ns", None).hello_reply["region"]["num_pages"] == 32


def test_sighup_keeps_what_flags_and_environment_set(daemon_factory, tmp_path, raw):
    cfg = tmp_path / "h.toml"
    cfg.write_text('lease_ttl = 7\nlog_level = "WARNING"\n')
    d = daemon_factory(extra=("--config", str(cfg), "--lease-ttl", "60"),
                       env={"HISPARSED_LOG_LEVEL": "INFO"})
    c = raw(d)
    assert c.hello_reply["lease_ttl_s"] == 60.0
    cfg.write_text('lease_ttl = 3\nlog_level = "DEBUG"\nsession_pin_share = 0.5\n')
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "SIGHUP: reloaded" not in d.log():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.call(Op.HEARTBEAT)["lease_ttl_s"] == 60.0, "the flag still wins over the file"
    assert "SIGHUP: reloaded lease_ttl=60.0s log_level=INFO" in d.log(), "and so does the environment"
    assert "request heartbeat" not in d.log()


def test_client_follows_the_lease_the_daemon_grants(daemon_factory, tmp_path):
    from hisparse import client

    cfg = tmp_path / "h.toml"
    cfg.write_text("lease_ttl = 3\n")
    d = daemon_factory(extra=("--config", str(cfg)))
    with client.attach("lease", LAYOUT, socket=d.socket, capacity=192 * 8) as cl:
        assert cl.session.lease_ttl_s == 3.0
        cfg.write_text("lease_ttl = 1.2\n")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while cl.session.lease_ttl_s != 1.2:
            assert time.monotonic() < deadline, "the client never adopted the new lease"
            time.sleep(0.05)
        # learned from a heartbeat reply, not by losing the session to the shorter lease
        assert cl.counters["reconnects"] == 0
        session = cl.session
        time.sleep(2 * 1.2)  # two new leases: the heartbeat keeps the session at the new pace
        assert cl.session is session and cl.counters["reconnects"] == 0


def test_every_client_number_is_range_checked(hisparsed, raw):
    c = raw(hisparsed, None)
    v = protocol.VERSION
    cases = [
        (dict(v=v, id=1, op="hello", namespace="n", layout=LAYOUT.to_wire(), capacity="9" * 400),
         ErrorCode.INVALID_ARGUMENT),
        (dict(v=v, id=1, op="hello", namespace="n", layout=LAYOUT.to_wire(), capacity_bytes=2**63),
         ErrorCode.INVALID_ARGUMENT),
        (dict(v=float(v), id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
        (dict(v=True, id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
        (dict(v=v, id=-1, op="ping"), ErrorCode.INVALID_ARGUMENT),
        (dict(v=v, id=1, op="keys", session=-5, cursor=0), ErrorCode.INVALID_ARGUMENT),
        (dict(v=v, id=1, op="events", session=1, after=-1), ErrorCode.INVALID_ARGUMENT),
    ]
    for msg, code in cases:
        reply = c.send_raw(msgpack.packb(msg, use_bin_type=True))
        assert reply is not None and reply.error_code == code.value, (msg, reply)
    assert "Traceback" not in hisparsed.log() and "INTERNAL" not in hisparsed.log()
    r = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--capacity", "9" * 400,
                        "--socket", hisparsed.socket + "x"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "capacity" in r.stderr and "Traceback" not in r.stderr


def test_start_warns_when_capacity_exceeds_free_shared_memory(daemon_factory):
    d = daemon_factory(capacity="1PiB")
    assert "has only" in d.log() and "lower --capacity" in d.log()


def test_a_region_that_cannot_be_allocated_is_logged_refused_and_uncharged(daemon_factory, raw):
    import resource

    d = daemon_factory()
    # the daemon may write no file over 1 MiB: allocating a 4 MiB region fails (EFBIG)
    resource.prlimit(d.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    c = raw(d, None)
    reply = c.request(Op.HELLO, namespace="big", layout=LAYOUT, capacity_bytes=4 << 20)
    assert reply.error_code == ErrorCode.CAPACITY.value and "could not be created" in reply.error_message
    assert "region of namespace 'big'" in d.log() and "not allocated" in d.log()
    c.hello()
    assert c.call(Op.STATS)["daemon"]["allocated_bytes"] == 0, "the failed namespace is not charged"
    assert raw(d, "small", 192 * 8).hello_reply["region"]["num_pages"] == 8
    assert d.proc.poll() is None
