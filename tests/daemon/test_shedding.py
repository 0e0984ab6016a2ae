"""Shedding a refused connection never touches the connection that reused its number (issue 38, item 10).

The daemon's own ``ConnectionGuard`` on a real ZeroMQ ROUTER, with real
unix-socket peers: libzmq accepts and closes the descriptors itself, and
the guard learns of both from monitor events it reads when it reads them.
A refused connection A closes on its own and B, within every cap, connects
and gets A's descriptor number, before the loop has read those events.
Before the fix the guard went by the number alone: A's refusal expiring
(the lease reaper's ``expire_refusals``) shut B down, and B's first request
was answered with A's refusal.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import zmq

from hisparse.daemon.conf.config import Config
from hisparse.daemon.front.connections import ConnectionGuard
from hisparse.daemon.front.shedding import socket_ino
from hisparse.daemon.policy.limits import Limits, caps_of
from tests.waiting import wait_for

# B as a ZeroMQ client in a process of its own: one request, then it waits to be ended.
DEALER = """
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect("ipc://" + sys.argv[1])
s.send(b"B's first request")
time.sleep(60)
"""


def read(guard: ConnectionGuard) -> bool:
    """Let the guard read its events, as the loop does when the monitor's fd is readable."""
    while guard.on_events():
        pass
    return True


@dataclass
class Scene:
    guard: ConnectionGuard
    number: int  # A's descriptor number in the guard's process, B's now
    a_refusal: str


@pytest.fixture
def reused(tmp_path) -> Iterator[Any]:
    """``reused(connect_b)``: A refused and closed, then B connected (``connect_b()``) on A's
    number, then the connection that kept A out closed; no event read since A's refusal."""
    path = str(tmp_path / "hisparsed.sock")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    caps = replace(caps_of(Config()), max_connections=1)  # a second connection is refused
    guard = ConnectionGuard(router, Limits(caps), path, "ipc://" + path)
    guard.bind()
    opened: list[socket.socket] = []

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        opened.append(s)
        return s

    def make(connect_b: Any) -> Scene:
        keeper = connect()
        wait_for(lambda: read(guard) and len(guard.open) == 1, what="the first connection admitted")
        (kept,) = guard.open
        kept_ino = socket_ino(kept)
        a = connect()
        wait_for(lambda: read(guard) and len(guard.refusing) == 1, what="the second refused")
        ((number, refusal),) = guard.refusing.items()
        a_ino = socket_ino(number)
        # From here the loop reads no event until the step under test.
        a.close()  # A gives up; libzmq closes its descriptor
        wait_for(lambda: socket_ino(number) != a_ino, what="libzmq to close A's descriptor")
        connect_b()
        wait_for(lambda: socket_ino(number) is not None, what="libzmq to accept B on A's number")
        keeper.close()  # B is within every cap once this close is read
        wait_for(lambda: socket_ino(kept) != kept_ino, what="libzmq to close the first connection")
        return Scene(guard, number, refusal[1])

    make.connect = connect  # type: ignore[attr-defined]
    make.path = path  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for s in opened:
            s.close()
        guard.close()
        router.close(linger=0)
        ctx.term()


def test_an_expired_refusal_spares_the_connection_on_its_number(reused):
    b: list[socket.socket] = []
    scene = reused(lambda: b.append(reused.connect()))  # B's end takes A's end's number here
    guard = scene.guard
    wait_for(lambda: time.monotonic() > guard.refusing[scene.number][0] + 0.01, what="A's refusal to expire")
    guard.expire_refusals()
    b[0].settimeout(1.0)
    received = b""
    try:
        while chunk := b[0].recv(4096):  # libzmq's greeting, then silence: B's connection is up
            received += chunk
        raise AssertionError(f"B got EOF after {received!r}: its connection was shed")
    except socket.timeout:
        pass
    wait_for(lambda: read(guard) and not guard.refusing, what="the events read")
    assert guard.open == {scene.number: os.getuid()}  # B, admitted


def test_a_request_on_the_number_of_a_refused_connection_is_not_refused(reused):
    procs: list[subprocess.Popen] = []
    fillers: list[socket.socket] = []

    def connect_b() -> None:
        # A's end here closed too: a socket takes its number, so that B's accepted descriptor
        # gets A's accepted one, as in a daemon (whose peers are other processes).
        fillers.append(socket.socket(socket.AF_UNIX))
        procs.append(subprocess.Popen([sys.executable, "-c", DEALER, reused.path]))

    try:
        scene = reused(connect_b)
        guard = scene.guard
        assert scene.a_refusal.startswith("connection refused: max_connections")
        assert guard.router.poll(30_000), "B's request never came"
        _, _, body, refusal = guard.recv()  # as the loop reads it
        assert body == [b"B's first request"]
        assert refusal is None, f"B was answered A's refusal: {refusal!r}"
        assert guard.open == {scene.number: os.getuid()}  # B, admitted
    finally:
        for proc in procs:
            proc.kill()  # by pid: the process this test started
            proc.wait(10)
        for filler in fillers:
            filler.close()
