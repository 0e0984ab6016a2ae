"""Who may attach to a namespace: a group per namespace, proven to the kernel's satisfaction.

``[namespaces."NAME"] group = "teamA"`` restricts NAME to the members of
``teamA``. Two things enforce it:

- the region file is owned by that group, mode 0660: only its members (and
  the daemon's user) can map the pages at all;
- at start the daemon writes a random key per restricted namespace to
  ``access/<tag>.key`` beside the socket, owned by the daemon's user and the
  namespace's group, mode 0640. ``hello`` on that namespace must carry the
  key. Reading the file is the proof: the kernel lets only the group's
  members (and root) read it, so no credential of the client's own making
  is trusted. ``hisparse.client`` sends the key when it can read it.

Namespaces without a group stay open to everyone who may connect to the
socket (its directory and mode decide that): the single-tenant setup needs
no configuration. ``stats`` lists a restricted namespace only to its own
sessions and to admin sessions that presented the admin token.

The key changes at every daemon start; a client reads it at each hello.
"""

from __future__ import annotations

import grp
import hmac
import logging
import os
import secrets

from hisparse.daemon.conf.config import Config
from hisparse.daemon.policy import trust
from hisparse.paths import ACCESS_DIR_NAME, access_key_path
from hisparse.protocol import ErrorCode, WireError

log = logging.getLogger(__name__)

ACCESS_DIR_MODE = 0o711  # members reach their key by name; nobody lists the directory
KEY_FILE_MODE = 0o640


class AccessControl:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.keys: dict[str, str] = {}  # namespace -> key
        self.gids: dict[str, int] = {}  # namespace -> gid of its group

    def prepare(self) -> None:
        """Write a fresh key for every restricted namespace (start-up)."""
        restricted = {n: c.group for n, c in self.config.namespaces.items() if c.group}
        directory = os.path.join(os.path.dirname(self.config.socket), ACCESS_DIR_NAME)
        if not restricted:
            return
        if not os.path.lexists(directory):
            os.mkdir(directory, ACCESS_DIR_MODE)
            os.chmod(directory, ACCESS_DIR_MODE)
        trust.private_dir(directory, "access directory (access/ beside the socket)", create=False)
        for name, group in restricted.items():
            assert group is not None
            gid = grp.getgrnam(group).gr_gid
            if os.geteuid() != 0 and gid not in os.getgroups() and gid != os.getegid():
                raise trust.UnsafePath(f'namespaces."{name}".group: hisparsed\'s user is not in group '
                                       f"{group!r}, so it cannot give that group the namespace's files: "
                                       f"add it (usermod -aG {group} USER)")
            key = secrets.token_hex(32)
            _write_group_file(access_key_path(self.config.socket, name), key + "\n", gid)
            self.keys[name] = key
            self.gids[name] = gid
        log.info("access: %d namespaces restricted to a group (%s)", len(restricted),
                 ", ".join(f"{n}: {g}" for n, g in restricted.items()))

    def restricted(self, namespace: str) -> bool:
        return namespace in self.keys

    def check(self, namespace: str, key: str | None) -> None:
        """Refuse a hello on a restricted namespace without its key (PERMISSION_DENIED)."""
        expected = self.keys.get(namespace)
        if expected is None:
            return
        if key is None or not hmac.compare_digest(key.encode(), expected.encode()):
            group = self.config.namespaces[namespace].group
            raise WireError(ErrorCode.PERMISSION_DENIED,
                            f"namespace {namespace!r} is restricted to group {group!r}: attach as a member "
                            f"(hisparse.client reads {access_key_path(self.config.socket, namespace)})")

    def gid_for(self, namespace: str) -> int | None:
        return self.gids.get(namespace)


def give_to_group(path: str, gid: int | None) -> None:
    """Make a region file its namespace's group's (0660); a no-op for an open namespace."""
    if gid is None:
        return
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
    finally:
        os.close(fd)


def _write_group_file(path: str, text: str, gid: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    trust.unlink_own(tmp)
    fd = trust.create_exclusive(tmp, 0o600)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, KEY_FILE_MODE)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
