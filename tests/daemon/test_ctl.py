"""``hisparsectl`` against a real hisparsed: namespaces, sessions, top, exit codes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

from hisparse import KVLayout
from hisparse.ctl import EXIT_NO_DAEMON, EXIT_PERMISSION, EXIT_REFUSED
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages


def ctl(socket_path: str, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", socket_path, *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_namespaces_sessions_and_top(daemon_factory):
    hisparsed = daemon_factory(lease_ttl=30)  # the raw client is silent through several hisparsectl runs
    c = RawClient(hisparsed.socket)
    try:
        c.hello("glm/fp8", LAYOUT, 192 * 1024)
        k = keys_for("ctl", 6)
        assert c.store(k, [bytes(192)] * 6) == 6
        c.call(Op.PIN, keys=k[:2])
        c.call(Op.RESERVE, keys=keys_for("open", 3))

        r = ctl(hisparsed.socket, "namespaces")
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("glm/fp8"))
        assert "3 x 4 x 16 B" in line and "192 B" in line and "1024" in line and "192.0 KiB" in line

        r = ctl(hisparsed.socket, "sessions")
        assert r.returncode == 0, r.stderr
        row = re.split(r"\s{2,}", next(x for x in r.stdout.splitlines() if "glm/fp8" in x))
        assert row[0] == f"{c.session:016x}"[:len(row[0])]  # the handle: a prefix of the id
        assert row[2] == f"test pid {os.getpid()}" and row[3] == "live"
        assert str(os.getpid()) in row[4].split(",")  # this process holds the session's fence
        assert row[-3:] == ["3", "2", "0"]  # reserved, pinned, fenced pages

        r = ctl(hisparsed.socket, "top", "--interval", "0.2", "--count", "2")
        assert r.returncode == 0, r.stderr
        screens = r.stdout.split("hisparsed ")[1:]
        assert len(screens) == 2
        assert "stores/s" in screens[1] and "glm/fp8" in screens[1]
        assert "1.1 KiB" in screens[1]  # 6 committed pages of 192 B
    finally:
        c.close()


def test_exit_codes_a_script_can_use(hisparsed, tmp_path):
    # 1: the daemon refused
    r = ctl(hisparsed.socket, "clear", "no-such")
    assert r.returncode == EXIT_REFUSED and "no namespace" in r.stderr
    # 4: the admin token is not this user's to read, or is the wrong one
    unreadable = tmp_path / "token"
    unreadable.write_text("x")
    os.chmod(unreadable, 0)
    if os.geteuid() != 0:
        r = ctl(hisparsed.socket, "--token-file", str(unreadable), "clear", "glm/fp8")
        assert r.returncode == EXIT_PERMISSION and "cannot read the admin token" in r.stderr
    # a missing --token-file: 4 as documented, naming the file, for any command
    for command in (("clear", "glm/fp8"), ("stats",)):
        r = ctl(hisparsed.socket, "--token-file", str(tmp_path / "wrong"), *command)
        assert r.returncode == EXIT_PERMISSION, r.stderr
        assert f"no admin token at {tmp_path / 'wrong'} (--token-file)" in r.stderr
        assert "Traceback" not in r.stderr
    (tmp_path / "wrong").write_text("not-the-token\n")
    r = ctl(hisparsed.socket, "--token-file", str(tmp_path / "wrong"), "clear", "glm/fp8")
    assert r.returncode == EXIT_PERMISSION and "wrong admin token" in r.stderr
    # 2: usage
    assert ctl(hisparsed.socket, "no-such-command").returncode == 2


def test_a_socket_nobody_listens_on_fails_fast(tmp_path):
    # What a crashed daemon leaves: a socket file with no listener.
    path = str(tmp_path / "hisparsed.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    r = ctl(path, "--timeout", "600", "stats")  # waiting out the timeout would fail the test
    assert r.returncode == EXIT_NO_DAEMON and "nothing listens on" in r.stderr


def test_top_outlives_its_admin_session(daemon_factory):
    d = daemon_factory(lease_ttl=1)
    # each refresh comes after the admin session's lease has expired
    r = ctl(d.socket, "top", "--interval", "1.5", "--count", "2")  # reaped within 1.2 s
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("refresh every 1.5s") == 2


def test_top_refuses_an_interval_that_is_not_above_zero(hisparsed):
    for interval in ("0", "-1"):
        r = ctl(hisparsed.socket, "top", "--interval", interval, "--count", "1")
        assert r.returncode == 2, (interval, r.stderr)
        assert "--interval" in r.stderr and "Traceback" not in r.stderr
    r = ctl(hisparsed.socket, "--timeout", "0", "ping")
    assert r.returncode == 2 and "--timeout" in r.stderr


def test_stats_counts_the_sessions_that_sessions_lists(hisparsed):
    # hisparsectl's own admin session is not an engine's: neither command shows it
    r = ctl(hisparsed.socket, "stats")
    assert r.returncode == 0, r.stderr
    assert ", 0 sessions, 0 fenced" in r.stdout.splitlines()[0]
    assert ctl(hisparsed.socket, "sessions").stdout.strip() == "(no sessions)"
    c = RawClient(hisparsed.socket)
    try:
        c.hello("glm/fp8", LAYOUT, 192 * 64)
        assert ", 1 sessions, 0 fenced" in ctl(hisparsed.socket, "stats").stdout.splitlines()[0]
        listed = ctl(hisparsed.socket, "sessions").stdout.splitlines()[1:]
        assert len(listed) == 1 and "glm/fp8" in listed[0]
        # stats --json: a running total of reservations, named as one, beside counts of now
        c.call(Op.RESERVE, keys=keys_for("open", 2))
        c.call(Op.ABORT, keys=keys_for("open", 2))
        ns = json.loads(ctl(hisparsed.socket, "stats", "--json").stdout)["namespaces"]["glm/fp8"]
        assert "reserved_pages" not in ns
        assert (ns["reserved_total"], ns["writing_pages"]) == (2, 0)
    finally:
        c.close()


def test_drop_force_says_its_clients_come_back(hisparsed):
    c = RawClient(hisparsed.socket)
    try:
        c.hello("glm/fp8", LAYOUT, 192 * 64)
        r = ctl(hisparsed.socket, "drop", "--force", "glm/fp8")
        assert r.returncode == 0, r.stderr
        assert "1 sessions ended" in r.stdout and "re-create the namespace" in r.stdout
    finally:
        c.close()
