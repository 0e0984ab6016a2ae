"""Each daemon's own region directory under ``shm_dir``: its regions share its tables' lifetime.

Region files live in ``<shm_dir>/hisparsed-<id>/``, where ``<id>`` is a
random 64-bit id that the daemon keeps in its metadata directory
(``meta_dir/regions``). So the directory is named by the same meta dir as
the tables that name its files: a second daemon with its own meta dir
sharing the same ``shm_dir`` gets a directory of its own and never looks
inside anyone else's, and ``--fresh`` only ever empties the directory its
own meta dir names.

The directory is created 0750 (engines of the daemon's group traverse it to
map regions; the files keep their own 0660 / group modes), and checked as
every private directory is (``trust.private_dir``: a real directory, the
daemon's user's, no group or other write bit). While a daemon runs it holds
``flock(LOCK_EX)`` on ``hisparsed.lock`` inside it, and an empty file
``owner-<hash>`` records which meta dir made it: the hash of its path, the
mount namespace and the root directory (empty, because hugetlbfs files take
no ``write``).

A directory whose meta dir is gone (a logout removed ``$XDG_RUNTIME_DIR``,
an operator removed ``meta/``) is an orphan: no table will ever name its
files again. A daemon removes such a directory only when it is provably its
own and unused: owned by its user, its ``owner`` record names this very
meta dir as this process sees it (same path, same mount namespace, same
root), that meta dir (locked by this daemon, so nobody else uses it) names
another directory, and its lock is free (no daemon runs on it: a daemon
still running on a removed meta dir keeps its directory). Anything else is
left alone, unread beyond its ``owner`` record.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import logging
import os
import re
import secrets
import stat

from hisparse.daemon.policy import trust
from hisparse.layout import format_size

log = logging.getLogger(__name__)

ID_FILE = "regions"  # in meta_dir: the name of this daemon's region directory
PREFIX = "hisparsed-"
NAME_RE = re.compile(r"^hisparsed-[0-9a-f]{16}$")
REGION_DIR_MODE = 0o750
LOCK_FILE = "hisparsed.lock"
OWNER_PREFIX = "owner-"


def _owner_name(meta_dir: str) -> str | None:
    """Who made a region directory: the meta dir as this process reaches it (None: unknown)."""
    try:
        mnt = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None
    root = os.stat("/")
    identity = f"{os.path.realpath(meta_dir)}\0{mnt}\0{root.st_dev}:{root.st_ino}"
    return OWNER_PREFIX + hashlib.sha256(identity.encode()).hexdigest()[:32]


class RegionDir:
    """This daemon's region directory, locked until the daemon's process exits."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self.lock_fd = lock_fd


def open_region_dir(shm_dir: str, meta_dir: str) -> RegionDir:
    """The region directory ``meta_dir`` names (made on first use); locked, checked, recorded.

    The caller holds the meta dir's lock, so no other daemon reads or writes
    its ``regions`` file meanwhile.
    """
    name = _read_name(meta_dir)
    if name is None:
        name = f"{PREFIX}{secrets.randbits(64):016x}"
        trust.write_private_file(os.path.join(meta_dir, ID_FILE), name + "\n")
        log.info("region directory of this meta dir: %s", os.path.join(shm_dir, name))
    path = os.path.join(shm_dir, name)
    try:
        os.mkdir(path, REGION_DIR_MODE)
        os.chmod(path, REGION_DIR_MODE)  # the umask must not narrow what engines may traverse
    except FileExistsError:
        pass  # ours from an earlier run, or planted: the check below tells
    trust.private_dir(path, f"region directory (named by {meta_dir}/{ID_FILE})", create=False)
    lock_fd = _open_lock(path)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise trust.UnsafePath(f"another hisparsed holds {path}/{LOCK_FILE}: its meta dir names "
                               f"the same region directory as {meta_dir} (a copied meta dir?)") from None
    _record_owner(path, _owner_name(meta_dir))
    return RegionDir(path, lock_fd)


def _record_owner(path: str, owner: str | None) -> None:
    for name in os.listdir(path):
        if name.startswith(OWNER_PREFIX) and name != owner:
            trust.unlink_own(os.path.join(path, name))  # made for this meta dir at another path
    if owner is not None and not os.path.lexists(os.path.join(path, owner)):
        os.close(trust.create_exclusive(os.path.join(path, owner), 0o600))


def _read_name(meta_dir: str) -> str | None:
    try:
        fd = trust.open_owned(os.path.join(meta_dir, ID_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        name = os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not NAME_RE.match(name):
        raise trust.UnsafePath(f"{meta_dir}/{ID_FILE} does not name a region directory "
                               f"({name[:40]!r}): remove it (the regions it named are lost)")
    return name


def _open_lock(directory: str) -> int:
    path = os.path.join(directory, LOCK_FILE)
    try:
        return trust.create_exclusive(path, 0o600)
    except FileExistsError:
        return trust.open_owned(path, os.O_RDWR)


def reclaim_orphans(shm_dir: str, meta_dir: str, mine: RegionDir) -> None:
    """Remove region directories that are provably this daemon's and unused (module docstring)."""
    me = _owner_name(meta_dir)
    if me is None:
        return  # without our own identity nothing is provably ours
    for path in sorted(glob.glob(os.path.join(shm_dir, f"{PREFIX}*"))):
        if path == mine.path or not NAME_RE.match(os.path.basename(path)):
            continue
        why = _not_ours(path, me)
        if why is not None:
            log.info("region directory %s left alone: %s", path, why)
            continue
        lock_fd = _try_lock(path)
        if lock_fd is None:
            log.info("region directory %s left alone: a hisparsed still runs on it", path)
            continue
        try:
            freed = _empty(path)
            os.rmdir(path)
        except OSError as exc:
            log.warning("region directory %s not fully removed: %s", path, exc)
            continue
        finally:
            os.close(lock_fd)
        log.warning("removed region directory %s (%s): made for this meta dir %s, which no longer "
                    "names it (the meta dir was removed, e.g. at logout), and no daemon uses it",
                    path, format_size(freed), meta_dir)


def _not_ours(path: str, owner: str) -> str | None:
    """Why ``path`` is not provably this daemon's, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & trust.GROUP_OTHER_WRITE:
        return "not a directory of hisparsed's user that only it may write"
    try:
        os.close(trust.open_owned(os.path.join(path, owner), os.O_RDONLY))
    except FileNotFoundError:
        return "made for another meta dir (another hisparsed's, or one in another mount namespace)"
    except (OSError, trust.UnsafePath) as exc:
        return f"its owner record is not hisparsed's own: {exc}"
    return None


def _try_lock(path: str) -> int | None:
    try:
        fd = trust.open_owned(os.path.join(path, LOCK_FILE), os.O_RDWR)
    except FileNotFoundError:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # never locked: no daemon
    except (OSError, trust.UnsafePath):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _empty(path: str) -> int:
    """Unlink the daemon's own files in ``path``; the bytes they held."""
    freed = 0
    for name in os.listdir(path):
        file = os.path.join(path, name)
        try:
            size = os.lstat(file).st_size
        except FileNotFoundError:
            continue
        if trust.unlink_own(file):
            freed += size
    return freed
