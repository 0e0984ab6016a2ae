"""A private ``hisparsed`` for demos and benchmarks: a temporary socket and shm dir.

``start_daemon`` runs the real daemon in a subprocess, waits until a ping is
answered, and stops it and removes its files on exit. (The tests have their
own fixture, which can also kill and restart the daemon.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class DaemonProcess:
    socket: str
    shm_dir: str
    proc: subprocess.Popen
    pid: int


def shm_base() -> str:
    """/dev/shm where it is writable, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@contextmanager
def start_daemon(capacity: str, *, lease_ttl_s: float = 10.0, log_level: str = "WARNING",
                 timeout_s: float = 30.0, extra: tuple[str, ...] = ()) -> Iterator[DaemonProcess]:
    """A private ``hisparsed`` on a temporary socket and shm dir; stopped and removed on exit."""
    from hisparse.client.transport import wait_for_daemon

    run_dir = tempfile.mkdtemp(prefix="hisparse-")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-", dir=shm_base())
    socket = os.path.join(run_dir, "hisparsed.sock")
    log_path = os.path.join(run_dir, "hisparsed.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse.daemon.main", "--socket", socket, "--shm-dir", shm_dir,
             "--capacity", capacity, "--lease-ttl", str(lease_ttl_s), "--log-level", log_level,
             *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env_with_package())
    try:
        try:
            pong = wait_for_daemon(socket, timeout_s)
        except Exception:
            with open(log_path, errors="replace") as f:
                sys.stderr.write(f.read())
            raise
        yield DaemonProcess(socket, shm_dir, proc, int(pong["pid"]))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def env_with_package() -> dict[str, str]:
    """The environment for child processes, able to import this very hisparse."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
