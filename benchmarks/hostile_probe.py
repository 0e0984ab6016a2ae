"""What the hostile benchmarks share: a well-behaved client, its probes, the attackers' processes.

- ``WellBehaved``: ping and lookup round trips on one connection, one at a time;
- ``fresh_pings``: a ping on a new connection each (``hisparsectl ping``'s path),
  ``fresh_pings_as`` the same from a forked child running as another uid (a
  non-root tenant meets the socket file's permissions; root ignores them);
- ``hostile_peers`` (``hostile_peer.py``) and ``forked_bounds_peers``
  (``bounds_peer.py`` as another uid): attackers, each flooding once it yields;
- the daemon's peak resident set (``VmHWM``) and its reset.

Used by ``hostile.py``, ``hostile_bounds.py`` and ``tests/daemon/test_floods.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.local import env_with_package  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_peer.py")
BOUNDS_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bounds_peer.py")
SMALL = KVLayout(num_layers=2, block_tokens=4, row_bytes=64)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM): no sample can miss a spike."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM over from the current RSS (Linux >= 4.0; needs the right to write it)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class WellBehaved:
    """A client on its own namespace: ping and lookup round trips, one at a time."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + socket_path)
        self.timeout_ms = int(timeout_s * 1000)
        self.rid = 0
        self.session = self.call(Op.HELLO, namespace="well-behaved", layout=SMALL,
                                 capacity_bytes=SMALL.page_bytes * 256, client="well-behaved")["session"]
        self.keys = [i.to_bytes(8, "little") * 4 for i in range(16)]

    def call(self, op: Op, **fields) -> dict:
        self.rid += 1
        self.sock.send(protocol.encode_request(op, self.rid, **fields))
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no reply to {op.value} in {self.timeout_ms} ms")
            reply = protocol.decode_reply(self.sock.recv())
            if reply.id == self.rid:
                return reply.result()

    def round_trips(self, seconds: float, stop: threading.Event | None = None) -> tuple[list[float], list[float]]:
        """(ping seconds, lookup seconds) for ``seconds`` or until ``stop`` is set."""
        pings, lookups = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            t0 = time.perf_counter()
            self.call(Op.PING)
            t1 = time.perf_counter()
            self.call(Op.LOOKUP, session=self.session, keys=self.keys)
            t2 = time.perf_counter()
            pings.append(t1 - t0)
            lookups.append(t2 - t1)
        return pings, lookups

    def close(self) -> None:
        self.sock.close(linger=0)


@contextmanager
def hostile_peers(socket_path: str, kinds: list[list[str]], script: str = PEER) -> Iterator[list[subprocess.Popen]]:
    """Start one ``script`` (``hostile_peer.py``) per entry of ``kinds``; each is flooding once this yields."""
    procs = [subprocess.Popen([sys.executable, script, socket_path, *kind], stdout=subprocess.PIPE,
                              text=True, env=env_with_package()) for kind in kinds]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "flooding"
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@contextmanager
def forked_bounds_peers(socket_path: str, kinds: list[list[str]], uid: int) -> Iterator[list[int]]:
    """``bounds_peer.py``'s attacks in forked children running as ``uid`` (in the daemon's
    group, as an engine of another tenant would be); each is flooding once this yields."""
    from benchmarks import bounds_peer  # imported here: that uid may not read this checkout
    import hisparse.shm.fence  # noqa: F401 - what bounds_peer imports as it runs

    pids, reads = [], []
    os.chmod(os.path.dirname(socket_path), 0o755)  # the other uid reaches the socket by its group
    for kind in kinds:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # no exec: the interpreter may not be readable by that uid
            try:
                os.close(r)
                os.dup2(w, 1)
                sys.stdout = os.fdopen(1, "w")  # fd 1 itself, also where a harness captured sys.stdout
                os.setgroups([])
                os.setgid(os.getgid())
                os.setuid(uid)
                bounds_peer.main([socket_path, *kind])
            finally:
                os._exit(1)
        os.close(w)
        pids.append(pid)
        reads.append(os.fdopen(r))
    try:
        for f in reads:
            assert f.readline().strip() == "flooding"
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for f in reads:
            f.close()


def fresh_pings(socket_path: str, count: int, timeout_s: float = 5.0, keepalive=None) -> list[float]:
    """Seconds to a ping's reply on a new connection each (``hisparsectl ping``'s path): a
    reply lost counts as ``timeout_s``. ``keepalive()`` runs between two (a client's lease:
    lost replies may take longer than it)."""
    out = []
    for rid in range(1, count + 1):
        if keepalive is not None:
            keepalive()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        t0 = time.perf_counter()
        sock.connect("ipc://" + socket_path)
        sock.send(protocol.encode_request(Op.PING, rid))
        out.append(time.perf_counter() - t0 if sock.poll(int(timeout_s * 1000)) else timeout_s)
        sock.close()
        time.sleep(0.02)
    return out


def fresh_pings_as(uid: int, socket_path: str, count: int, timeout_s: float = 5.0) -> list[float]:
    """``fresh_pings`` from a forked child running as ``uid`` (in the daemon's group, as an
    engine of another tenant would be; needs root)."""
    os.chmod(os.path.dirname(socket_path), 0o755)  # that uid reaches the socket by its group
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # no exec: the interpreter may not be readable by that uid
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(os.getgid())
            os.setuid(uid)
            os.write(write, json.dumps(fresh_pings(socket_path, count, timeout_s)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)
