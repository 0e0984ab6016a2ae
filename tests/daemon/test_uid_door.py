"""A storm of refused connections shuts the socket's door to the storming uid alone.

A real unix socket, real other users (``tests.tenants``: needs root) and the
kernel's own permission check: the door is a POSIX ACL entry on the socket file.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile

from hisparse.daemon.front.door import MODE_LOCK
from hisparse.daemon.front.uid_door import MAX_REFUSALS_PER_S, UidDoors, acl_denying
from tests.tenants import ATTACKER_UID, OTHER_UID, as_user, needs_root
from tests.waiting import wait_for

MODE = 0o660


def _connect(path: str) -> int:
    """0, or the errno of a connect to ``path``."""
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return 0
    except OSError as exc:
        return exc.errno
    finally:
        s.close()


def _listening(tmp_path) -> tuple[socket.socket, str]:
    """A socket other users can reach: in /tmp (pytest's own directories are 0700)."""
    run_dir = tempfile.mkdtemp(prefix="hisparse-door-", dir="/tmp")
    os.chmod(run_dir, 0o711)
    path = os.path.join(run_dir, "door.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    os.chmod(path, MODE)
    return server, path


def test_the_acl_keeps_the_mode_and_names_each_uid_sorted():
    acl = acl_denying(0o600, [7, 3], MODE)  # the door shut to all meanwhile: mask 0
    assert acl[:4] == (2).to_bytes(4, "little")
    entries = [(int.from_bytes(acl[i:i + 2], "little"), int.from_bytes(acl[i + 2:i + 4], "little"),
                int.from_bytes(acl[i + 4:i + 8], "little")) for i in range(4, len(acl), 8)]
    undefined = 0xFFFFFFFF
    assert entries == [(0x01, 6, undefined), (0x02, 0, 3), (0x02, 0, 7), (0x04, 6, undefined),
                       (0x10, 0, undefined), (0x20, 0, undefined)]


@needs_root
def test_a_storming_uid_is_shut_out_alone_and_let_back_in(tmp_path):
    server, path = _listening(tmp_path)
    doors = UidDoors(path, MODE)
    try:
        assert as_user(ATTACKER_UID, lambda: _connect(path)) == {"ok": 0}
        for _ in range(MAX_REFUSALS_PER_S):
            doors.refused(ATTACKER_UID)
        assert not doors.is_shut(ATTACKER_UID)  # the rate, not yet past it
        doors.refused(ATTACKER_UID)
        assert doors.is_shut(ATTACKER_UID) and doors.closures == 1
        assert as_user(ATTACKER_UID, lambda: _connect(path)) == {"ok": errno.EACCES}
        assert as_user(OTHER_UID, lambda: _connect(path)) == {"ok": 0}  # every other uid connects
        assert _connect(path) == 0  # and root (never shut out: it ignores permissions)
        # the door shut to all (descriptors) and opened again: the other uid's entry is kept
        with MODE_LOCK:
            os.chmod(path, 0)
        assert as_user(OTHER_UID, lambda: _connect(path)) == {"ok": errno.EACCES}
        os.chmod(path, MODE)
        assert as_user(OTHER_UID, lambda: _connect(path)) == {"ok": 0}
        assert as_user(ATTACKER_UID, lambda: _connect(path)) == {"ok": errno.EACCES}

        def reopened() -> bool:
            doors.reopen_due()
            return not doors.is_shut(ATTACKER_UID)
        wait_for(reopened, "the attacker's door to open again")
        assert as_user(ATTACKER_UID, lambda: _connect(path)) == {"ok": 0}
        assert stat.S_IMODE(os.stat(path).st_mode) == MODE
        assert "system.posix_acl_access" not in os.listxattr(path)  # the mode alone again
    finally:
        server.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_root_and_the_daemons_own_uid_are_never_shut_out(tmp_path):
    server, path = _listening(tmp_path)
    doors = UidDoors(path, MODE)
    try:
        for _ in range(3 * MAX_REFUSALS_PER_S):
            doors.refused(os.geteuid())
            doors.refused(0)
            doors.refused(None)
        assert not doors.shut and doors.closures == 0
        assert _connect(path) == 0
    finally:
        server.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@needs_root
def test_shutting_a_uid_out_never_reopens_a_door_shut_to_all(tmp_path):
    """The descriptor budget shut the door to every uid (mode 0); a storm's ACL written then
    keeps it shut, and the door opening again (mode back) lets the others in, not the stormer."""
    server, path = _listening(tmp_path)
    doors = UidDoors(path, MODE)
    try:
        with MODE_LOCK:
            os.chmod(path, 0)
        for _ in range(MAX_REFUSALS_PER_S + 1):
            doors.refused(ATTACKER_UID)
        assert doors.is_shut(ATTACKER_UID)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0
        assert as_user(OTHER_UID, lambda: _connect(path)) == {"ok": errno.EACCES}
        with MODE_LOCK:
            os.chmod(path, MODE)
        assert as_user(OTHER_UID, lambda: _connect(path)) == {"ok": 0}
        assert as_user(ATTACKER_UID, lambda: _connect(path)) == {"ok": errno.EACCES}
    finally:
        server.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
