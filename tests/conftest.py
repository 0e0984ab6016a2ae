"""Fixtures shared by every test layer.

``hisparsed`` starts the real daemon in a subprocess on a temporary socket
and shared-memory directory, and waits until a ping is answered (never a
sleep). ``zmq_sockets`` tracks raw sockets and closes them with linger 0.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
import zmq

from hisparse import protocol

# Triton picks interpreter or compiler when it is first imported, by this
# variable: on a machine without a GPU every test that runs a kernel (the
# kernels' own, the sparse session's) runs it on CPU tensors, interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

READY_TIMEOUT_S = 20.0


def pytest_collection_finish(session) -> None:
    # What every test module imported (torch, vLLM, Triton: some 770k objects) is frozen out
    # of the collector, as vLLM's EngineCore freezes its start-up heap (freeze_gc_heap):
    # otherwise each full collection in this one long process pauses it 0.4-0.6 s, and a
    # test that bounds a scheduler step (test_engine.py's outage) measures the collector.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session) -> None:
    gc.unfreeze()  # freed at exit as usual (frozen, Triton's bindings report them leaked)


def _shm_base() -> str:
    # /dev/shm is what production uses; fall back where a sandbox lacks it.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def ping(socket_path: str, timeout_s: float = 0.5) -> dict | None:
    """The ping reply's body, or None when nothing answered in time."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect("ipc://" + socket_path)
        sock.send(protocol.encode_request(protocol.Op.PING, 1))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return protocol.decode_reply(sock.recv()).result()
    finally:
        sock.close(linger=0)


@dataclass
class Daemon:
    """A real hisparsed subprocess, restartable on the same socket and shm dir."""

    socket: str
    shm_dir: str
    args: list[str]
    env: dict[str, str]
    log_path: str
    proc: subprocess.Popen | None = None
    history: list[subprocess.Popen] = field(default_factory=list)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def token(self) -> str:
        with open(os.path.join(os.path.dirname(self.socket), "hisparsed.token")) as f:
            return f.read().strip()

    def start(self, *extra: str, wait: bool = True) -> Daemon:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse.daemon.main", "--socket", self.socket,
             "--shm-dir", self.shm_dir, *self.args, *extra],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.history.append(self.proc)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"hisparsed exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket) and ping(self.socket, 0.2) is not None:
                return
            time.sleep(0.02)
        raise TimeoutError(f"hisparsed did not answer ping in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no flush, no clean-up; what survives is what the design keeps."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def restart(self, *extra: str, kill: bool = False) -> Daemon:
        self.kill() if kill else self.stop()
        return self.start(*extra)


@pytest.fixture
def daemon_factory(tmp_path) -> Iterator:
    """Make daemons with ``daemon_factory(capacity="64MiB", lease_ttl=2, ...)``."""
    made: list[Daemon] = []
    shm_dirs: list[str] = []

    def make(*, capacity: str = "256MiB", lease_ttl: float | None = None, start: bool = True,
             extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Daemon:
        n = len(made)
        shm_dir = tempfile.mkdtemp(prefix="hisparse-test-", dir=_shm_base())
        shm_dirs.append(shm_dir)
        args = ["--capacity", capacity, *extra]
        if lease_ttl is not None:
            args += ["--lease-ttl", str(lease_ttl)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "NOTIFY_SOCKET" not in (env or {}):
            full_env.pop("NOTIFY_SOCKET", None)  # only tests that ask for systemd get it
        d = Daemon(str(tmp_path / f"d{n}" / "hisparsed.sock"), shm_dir, args, full_env,
                   str(tmp_path / f"hisparsed-{n}.log"))
        os.makedirs(os.path.dirname(d.socket), exist_ok=True)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        for proc in d.history:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
    for shm_dir in shm_dirs:
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture
def hisparsed(daemon_factory) -> Daemon:
    """One running daemon: 256 MiB, lease ttl 10 s.

    Long enough that a test's bare protocol client (no heartbeat) keeps its
    session while a busy machine starts subprocesses; tests about expiry
    make their own daemon with a short lease.
    """
    return daemon_factory(lease_ttl=10)


@pytest.fixture
def zmq_sockets() -> Iterator:
    """``zmq_sockets(kind, endpoint)`` connects a raw socket, closed with linger 0 afterwards."""
    ctx = zmq.Context.instance()
    made: list[zmq.Socket] = []

    def make(kind: int, endpoint: str) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)
