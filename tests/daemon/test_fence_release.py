"""A free fence is released under the daemon's exclusive lock: nobody locks it in between.

The daemon frees an ended session's pages once no process holds its fence
(``flock(LOCK_EX | LOCK_NB)`` succeeds). If it let go of that probe before
writing RELEASED and removing the file, a worker could lock the fence in
between, read LIVE (a fence adopted after a restart) and copy into pages
the daemon is freeing. Here a worker tries to lock at exactly that moment.
"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from hisparse.client.fence import hold
from hisparse.daemon.store.sessions import SessionTable
from hisparse.errors import LeaseExpired
from hisparse.shm import fence as shm_fence
from tests.daemon.test_sessions import Clock, hold_some, make_namespace
from tests.rawclient import keys_for


@pytest.fixture
def fence_dir(tmp_path):
    d = tmp_path / "fences"
    d.mkdir()
    return str(d)


@pytest.fixture
def worker_at_release(monkeypatch):
    """At each release of a fence (``close(unlink=True)``), a worker tries to lock it first."""
    tried: list[bool] = []  # True: the worker got the lock while the daemon was releasing
    real = shm_fence.FenceFile.close

    def close(self, *, unlink: bool) -> None:
        if unlink:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                tried.append(True)
            except OSError as exc:
                assert exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                tried.append(False)
            finally:
                os.close(fd)
        real(self, unlink=unlink)

    monkeypatch.setattr(shm_fence.FenceFile, "close", close)
    return tried


@pytest.mark.parametrize("how", ["adoption", "reaper"])
def test_no_worker_locks_a_fence_between_the_probe_and_its_release(tmp_path, fence_dir,
                                                                  worker_at_release, how):
    clock = Clock()
    table = SessionTable(lease_ttl_s=2.0, clock=clock)
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    path = s.fence.path
    hold_some(ns, s, keys_for("r", 3))

    class Reg:
        namespaces = {"ns": ns}

    if how == "adoption":  # the daemon died: its successor finds the fence reading LIVE, unheld
        assert SessionTable(2.0).adopt_fences(fence_dir, Reg()) == (0, 1)  # type: ignore[arg-type]
    else:  # the lease ended while a worker held the fence; the worker let go
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        clock.now += 10
        [(_, zombie)] = table.expire()
        assert zombie is not None
        os.close(fd)
        assert len(table.reap_zombies()) == 1
    assert worker_at_release == [False], "a worker locked the fence while its pages were freed"
    with pytest.raises(LeaseExpired):
        with hold(path):
            pass


def test_a_lock_taken_on_a_released_fence_holds_nothing(tmp_path, fence_dir):
    from hisparse.client.fence import open_locked

    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    fd = os.open(s.fence.path, os.O_RDONLY)  # a worker opened it before the release...
    s.fence.set_state(shm_fence.RELEASED)
    os.close(fd)
    with pytest.raises(LeaseExpired, match="released"):
        open_locked(s.fence.path)  # ...and locks it after: it holds nothing
