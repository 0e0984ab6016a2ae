"""Fence files are no lever for another tenant: it cannot find them, cannot hang an attach
on one, and its lock on a dead session's fence holds no page.

The attacker is a real other user of the daemon's group (``tests.tenants``), given a
fence's name as if it had leaked: the directory itself lets it list nothing.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time

from hisparse import KVLayout
from hisparse.protocol import Op
from hisparse.shm.fence import fence_dir_for
from tests.rawclient import RawClient, keys_for
from tests.tenants import ATTACKER_UID, as_user, holding_as_user, needs_root
from tests.tenants import tenant_daemon  # noqa: F401 - a fixture
from tests.waiting import wait_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages


def _list(directory: str) -> str:
    try:
        return f"listed {len(os.listdir(directory))}"
    except PermissionError:
        return "denied"


def _lock(path: str, how: int) -> str:
    fd = os.open(path, os.O_RDONLY)  # kept open (and locked) until the child exits
    fcntl.flock(fd, how | fcntl.LOCK_NB)
    return "locked"


@needs_root
def test_another_user_can_neither_list_fences_nor_hang_an_attach(tenant_daemon):
    from hisparse.client.fence import FenceBusy, open_locked

    d = tenant_daemon()
    victim = RawClient(d.socket)
    try:
        victim.hello("ns", LAYOUT, 192 * 8, fence=False)
        fences = fence_dir_for(d.socket)
        assert stat.S_IMODE(os.stat(fences).st_mode) == 0o710
        assert as_user(ATTACKER_UID, lambda: _list(fences)) == {"ok": "denied"}
        # the name leaked anyway: the attacker locks the fence exclusively before its client does
        with holding_as_user(ATTACKER_UID, lambda: _lock(victim.fence_path, fcntl.LOCK_EX)) as held:
            assert held == {"ok": "locked"}, held
            outcome: list[str] = []

            def attach_lock() -> None:
                try:
                    fd, mm = open_locked(victim.fence_path)
                    mm.close()
                    os.close(fd)
                    outcome.append("locked")
                except FenceBusy as exc:
                    outcome.append(f"busy: {exc}")

            started = time.monotonic()
            t = threading.Thread(target=attach_lock, daemon=True)
            t.start()
            t.join(15)  # LOCK_WAIT_S is 2 s: several times that, never the kernel's endless wait
            assert not t.is_alive(), "the client waited on another user's exclusive lock"
            assert outcome and outcome[0].startswith("busy") and "held exclusively" in outcome[0]
            assert time.monotonic() - started < 15
    finally:
        victim.close()


@needs_root
def test_another_users_lock_on_a_dead_sessions_fence_holds_no_page(tenant_daemon):
    d = tenant_daemon()
    owner, observer = RawClient(d.socket), RawClient(d.socket)
    try:
        # the owner locks its fence only after the fork: the attacker inherits no lock of its own
        owner.hello("ns", LAYOUT, 192 * 8, fence=False)
        observer.hello()
        keys = keys_for("dead", 2)
        with holding_as_user(ATTACKER_UID, lambda: _lock(owner.fence_path, fcntl.LOCK_SH)) as held:
            assert held == {"ok": "locked"}, held
            owner.fence_fd = os.open(owner.fence_path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(owner.fence_fd, fcntl.LOCK_SH)
            assert owner.store(keys, [b"d" * 192, b"e" * 192]) == 2
            owner.call(Op.PIN, keys=keys)
            owner.release_fence()  # the session's own process lets go and says bye
            owner.call(Op.BYE)
            # the attacker still holds its lock: the daemon ignores it (another uid's process)
            wait_for(lambda: observer.call(Op.STATS)["namespaces"]["ns"]["pinned_pages"] == 0,
                     "the dead session's pins to be dropped despite the foreign lock", timeout_s=15)
            assert observer.call(Op.STATS)["daemon"]["fenced_sessions"] == 0
            assert "held only by processes of other users" in d.log()
    finally:
        owner.close()
        observer.close()


@needs_root
def test_after_a_restart_another_users_lock_on_an_old_fence_holds_no_page(tenant_daemon):
    d = tenant_daemon()
    owner = RawClient(d.socket)
    try:
        owner.hello("ns", LAYOUT, 192 * 8, fence=False)
        keys = keys_for("old", 2)
        with holding_as_user(ATTACKER_UID, lambda: _lock(owner.fence_path, fcntl.LOCK_SH)) as held:
            assert held == {"ok": "locked"}, held
            owner.fence_fd = os.open(owner.fence_path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(owner.fence_fd, fcntl.LOCK_SH)
            assert owner.store(keys, [b"o" * 192, b"p" * 192]) == 2
            owner.call(Op.PIN, keys=keys)
            d.restart(kill=True)  # the successor adopts the fence, and whose it was (its header says)
            observer = RawClient(d.socket)
            try:
                observer.hello()
                assert observer.call(Op.STATS)["namespaces"]["ns"]["pinned_pages"] == 2, "still fenced"
                owner.release_fence()  # the session's own process lets go; the attacker does not
                wait_for(lambda: observer.call(Op.STATS)["namespaces"]["ns"]["pinned_pages"] == 0,
                         "the old session's pins to be dropped despite the foreign lock", timeout_s=15)
            finally:
                observer.close()
    finally:
        owner.close()
