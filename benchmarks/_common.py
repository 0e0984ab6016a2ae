"""Helpers shared by the benchmark programs: a daemon subprocess and percentiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator

import zmq

from hisparse import protocol


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _answers(socket_path: str) -> bool:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect("ipc://" + socket_path)
        sock.send(protocol.encode_request(protocol.Op.PING, 1))
        return bool(sock.poll(200))
    finally:
        sock.close(linger=0)


@contextmanager
def running_daemon(capacity: str = "1GiB", *extra: str) -> Iterator[str]:
    """A real hisparsed on a temporary socket; yields the socket path."""
    work = tempfile.mkdtemp(prefix="hisparse-bench-")
    shm_base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else work
    shm = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base)
    sock = os.path.join(work, "hisparsed.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.daemon.main", "--socket", sock,
                             "--shm-dir", shm, "--capacity", capacity, "--log-level", "WARNING", *extra],
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(sock) and _answers(sock)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("hisparsed did not start")
            time.sleep(0.02)
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
