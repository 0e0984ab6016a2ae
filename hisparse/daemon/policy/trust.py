"""Which files and directories the daemon may trust: its own, and nobody else's.

The daemon shares a machine with users it must not trust. A file it reads
back (a metadata table, a region it adopts, its lock) is trusted only when
the daemon's user owns it, no one else may write it, and it is not a
symbolic link: every open here is ``O_NOFOLLOW``, every create ``O_EXCL``.

Directories:

- private (metadata, fences, the socket's and the token's directory): a
  real directory owned by the daemon's user (or root, for the socket's),
  with no group or other write bit;
- shared (``shm_dir``, often ``/dev/shm``): may be writable by others only
  when sticky, so no one else can rename or remove the daemon's files.

A directory that fails is refused at start with a message naming the
directory, what is wrong and what to change.
"""

from __future__ import annotations

import errno
import os
import stat

from hisparse.errors import HisparseError

PRIVATE_DIR_MODE = 0o700
GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafePath(HisparseError):
    """A file or directory the daemon would have to trust is not safe to trust."""


def _describe_owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def private_dir(path: str, what: str, *, allow_root_owner: bool = False, create: bool = True) -> None:
    """Check (and create, mode 0700) a directory only the daemon's user may write.

    ``what`` names the setting that chose the directory, for the message.
    """
    if create and not os.path.lexists(path):
        try:
            os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePath(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} {path} is a symbolic link; point {what} at the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me and not (allow_root_owner and st.st_uid == 0):
        raise UnsafePath(
            f"{what} {path} is owned by {_describe_owner(st.st_uid)}, not by hisparsed's user "
            f"{_describe_owner(me)}: remove it, or choose another {what}")
    if st.st_mode & GROUP_OTHER_WRITE:
        raise UnsafePath(
            f"{what} {path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"run `chmod go-w {path}`, or choose another {what}")


def shared_dir(path: str, what: str) -> None:
    """Check a directory others may share (``/dev/shm``): writable by others only when sticky."""
    try:
        st = os.stat(path)  # /dev/shm may be a symlink to /run/shm on old systems: follow it
    except FileNotFoundError:
        raise UnsafePath(f"{what} {path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    me = os.geteuid()
    if st.st_mode & GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"{what} {path} is writable by others without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), so they could replace hisparsed's files: run "
            f"`chmod +t {path}` or `chmod go-w {path}`, or choose another {what}")
    if st.st_uid not in (me, 0):
        raise UnsafePath(f"{what} {path} is owned by {_describe_owner(st.st_uid)}, neither root nor "
                         f"hisparsed's user {_describe_owner(me)}: choose another {what}")


def check_owned(fd: int, path: str, *, allowed_write: int = 0) -> os.stat_result:
    """``fd`` is a regular file of the daemon's user that no one else may write.

    ``allowed_write``: write bits that are fine besides the owner's (a
    region file is 0660: its group maps it writable).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} is owned by {_describe_owner(st.st_uid)}, not by hisparsed's user")
    if st.st_mode & GROUP_OTHER_WRITE & ~allowed_write:
        raise UnsafePath(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
    return st


def open_owned(path: str, flags: int, *, allowed_write: int = 0) -> int:
    """Open an existing file with ``O_NOFOLLOW`` and check it is the daemon's own."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link") from None
        raise
    try:
        check_owned(fd, path, allowed_write=allowed_write)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(path: str, mode: int) -> int:
    """Create a new file (``O_EXCL | O_NOFOLLOW``): fails if anything is already there."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    os.fchmod(fd, mode)  # the umask must not narrow it
    return fd


def write_private_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600) by an exclusive temp file and a rename.

    The directory is private (``private_dir``), so nobody else can race the
    rename; the temp file is created ``O_EXCL``, so nothing planted is written through.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = create_exclusive(tmp, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def unlink_own(path: str) -> bool:
    """Remove ``path`` only if it is the daemon's own file (never another user's); True if removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != os.geteuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
