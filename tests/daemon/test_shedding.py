"""Shedding a refused connection never touches the connection that reused its number (issue 38, item 10).

The daemon's own ``ConnectionGuard`` on a real ZeroMQ ROUTER, with real
unix-socket peers: libzmq accepts and closes the descriptors itself, and
the guard learns of both from monitor events it reads when it reads them.
A refused connection A closes on its own, B connects and gets A's descriptor
number, and A's refusal expires (the lease reaper's ``expire_refusals``)
before the loop has read those events: before the fix the guard shut the
number down, and B, admitted within every cap, got EOF.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

import zmq

from hisparse.daemon.conf.config import Config
from hisparse.daemon.front.connections import ConnectionGuard
from hisparse.daemon.front.shedding import socket_ino
from hisparse.daemon.policy.limits import Limits, caps_of
from tests.waiting import wait_for


def read(guard: ConnectionGuard) -> bool:
    """Let the guard read its events, as the loop does when the monitor's fd is readable."""
    while guard.on_events():
        pass
    return True


def test_shedding_a_closed_refused_connection_spares_the_next_on_its_number(tmp_path):
    path = str(tmp_path / "hisparsed.sock")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    caps = replace(caps_of(Config()), max_connections=1)  # a second connection is refused
    guard = ConnectionGuard(router, Limits(caps), path, "ipc://" + path)
    guard.bind()
    peers: list[socket.socket] = []

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        peers.append(s)
        return s

    try:
        keeper = connect()
        wait_for(lambda: read(guard) and len(guard.open) == 1, what="the first connection admitted")
        a = connect()
        wait_for(lambda: read(guard) and len(guard.refusing) == 1, what="the second refused")
        (number,) = guard.refusing
        a_ino = socket_ino(number)
        # From here the loop reads no event until the reaper's expire_refusals.
        a.close()  # A gives up; libzmq closes its descriptor
        wait_for(lambda: socket_ino(number) != a_ino, what="libzmq to close A's descriptor")
        b = connect()  # B: the lowest free number, A's
        wait_for(lambda: socket_ino(number) is not None, what="libzmq to accept B")
        keeper.close()  # B is within every cap once this close is read
        wait_for(lambda: time.monotonic() > guard.refusing[number][0] + 0.01,
                 what="A's refusal to expire")
        guard.expire_refusals()
        b.settimeout(1.0)
        received = b""
        try:
            while chunk := b.recv(4096):  # libzmq's greeting, then silence: B's connection is up
                received += chunk
            raise AssertionError(f"B got EOF after {received!r}: its connection was shed")
        except socket.timeout:
            pass
        wait_for(lambda: read(guard) and not guard.refusing, what="the events read")
        assert guard.open == {number: os.getuid()}  # B, admitted
    finally:
        for s in peers:
            s.close()
        guard.close()
        router.close(linger=0)
        ctx.term()
