"""Tenants as real other users: a forked child drops to another uid before it talks to the daemon.

Needs root (CI runs as root); tests that use it skip elsewhere, saying so.
``as_user`` runs a function and returns its JSON result; ``holding_as_user``
runs one and keeps the child (its sockets, locks and pins) alive until the
``with`` block ends, as a tenant that keeps attacking would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import Daemon

ATTACKER_UID = 4301
OTHER_UID = 4302

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="tenants are other users: needs root (CI has it)")


def _child(uid: int, groups: list[int], fn: Callable[[], Any], write: int, hold: int | None) -> None:
    try:
        os.setgroups(groups)
        os.setgid(groups[0])
        os.setuid(uid)
        out = {"ok": fn()}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out = {"error": f"{type(exc).__name__}: {exc}"}
    os.write(write, json.dumps(out).encode() + b"\n")
    if hold is not None:
        os.read(hold, 1)  # until the parent closes its end: then exit, dropping everything
    os._exit(0)


def as_user(uid: int, fn: Callable[[], Any], groups: list[int] | None = None) -> Any:
    with holding_as_user(uid, fn, groups, hold=False) as result:
        return result


@contextlib.contextmanager
def holding_as_user(uid: int, fn: Callable[[], Any], groups: list[int] | None = None,
                    hold: bool = True) -> Iterator[Any]:
    """Run ``fn`` as ``uid`` in a forked child; yield its JSON result while the child lives on."""
    read, write = os.pipe()
    hold_r, hold_w = os.pipe() if hold else (None, None)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        if hold_w is not None:
            os.close(hold_w)
        _child(uid, groups or [0], fn, write, hold_r)
    os.close(write)
    if hold_r is not None:
        os.close(hold_r)
    try:
        with os.fdopen(read) as f:
            line = f.readline()
        yield json.loads(line) if line else {"error": "the child said nothing"}
    finally:
        if hold_w is not None:
            os.close(hold_w)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


@pytest.fixture
def tenant_daemon(tmp_path) -> Iterator[Callable[..., Daemon]]:
    """``tenant_daemon(*args)``: a daemon whose socket other users of its group (root) can reach."""
    made: list[tuple[Daemon, str, str]] = []

    def make(*args: str) -> Daemon:
        run_dir = tempfile.mkdtemp(prefix="hisparse-ten-", dir="/tmp")
        shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        shm_dir = tempfile.mkdtemp(prefix="hisparse-ten-", dir=shm_base)
        os.chmod(run_dir, 0o711)
        os.chmod(shm_dir, 0o711)
        d = Daemon(os.path.join(run_dir, "hisparsed.sock"), shm_dir, ["--capacity", "64MiB", *args],
                   {**os.environ, "PYTHONUNBUFFERED": "1"}, str(tmp_path / f"tenant-{len(made)}.log"))
        made.append((d, run_dir, shm_dir))
        return d.start()

    yield make
    for d, run_dir, shm_dir in made:
        for proc in d.history:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
