"""Fence files: who may still touch a session's pages, vouched for by the kernel.

A lease says when a session was last heard from; it cannot say whether its
process is dead or only stalled (SIGSTOP, a GC pause, swap). A fence can.
For each namespace session the daemon creates one file in the fence
directory (``fences/`` beside the socket). The client holds ``flock(LOCK_SH)``
on it for as long as any of its threads may touch the session's pages, and
every other process that touches them for it (a vLLM worker copying for the
scheduler's session) holds ``LOCK_SH`` while it does. The kernel drops a
process's locks when it dies, in whatever PID namespace it lives, so the
daemon knows the pages are untouched once ``flock(LOCK_EX | LOCK_NB)``
succeeds on its own descriptor. Until then an expired session's pages stay
out of everyone's reach.

The file is also the record that survives a daemon SIGKILL: the daemon
writes each hold into it before replying, so a successor fences the same
pages. Layout::

    [0, 4096)        header: magic, format, state, region id, num pages,
                     created (unix s), handle (8 hex digits), namespace
    [4096 + 4*p, ..) u32 hold of page p: bit 31 = reserved (WRITING) by
                     this session, bits 0-30 = pins taken by this session

``state`` is LIVE while the session is, LOST once its lease expired or its
daemon died (its holds are gone; its pages stay fenced), RELEASED when the
daemon has freed them. Any process that may read the file checks a hold
with one memory read. The file is sparse: only pages ever held cost memory.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass

import numpy as np

from hisparse.errors import InvalidArgument

MAGIC = b"HSPFENC1"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
HOLD_BYTES = 4
FENCE_SUFFIX = ".fence"
FENCE_DIR_NAME = "fences"
FENCE_FILE_MODE = 0o640  # the daemon writes; clients of its group open it to lock it
# Group may traverse, not list: a fence's name (128 random bits) is told only to the
# connection that opened its session, so no other tenant can find a fence to lock it.
FENCE_DIR_MODE = 0o710

LIVE = 1
LOST = 2
RELEASED = 3
STATE_NAMES = {LIVE: "live", LOST: "lost", RELEASED: "released"}

RESERVED_BIT = np.uint32(1 << 31)
PIN_MASK = np.uint32((1 << 31) - 1)

# magic, format, state, region id, num pages, created, handle, namespace length
_HEADER = struct.Struct("<8sIIQQd8sH")
_STATE_OFFSET = 12
_OWNER_OFFSET = 256  # u32: the session's uid + 1 (0: unknown), so a successor knows whose it was
_NAME_OFFSET = 512
_NAME_BYTES = 1024


def fence_dir_for(socket_path: str) -> str:
    """The fence directory of the daemon listening on ``socket_path``: ``fences/`` beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), FENCE_DIR_NAME)


def file_bytes(num_pages: int) -> int:
    return HEADER_BYTES + num_pages * HOLD_BYTES


@dataclass(frozen=True)
class FenceHeader:
    state: int
    region_id: int
    num_pages: int
    created_unix_s: float
    handle: str
    namespace: str
    owner_uid: int | None = None  # the uid of the process that opened the session (SO_PEERCRED)


def _parse_header(head: bytes, path: str) -> FenceHeader:
    if len(head) < HEADER_BYTES:
        raise InvalidArgument(f"{path}: too small for a fence file")
    magic, fmt, state, region_id, num_pages, created, handle, name_len = _HEADER.unpack_from(head)
    if magic != MAGIC or fmt != FORMAT_VERSION or state not in STATE_NAMES or name_len > _NAME_BYTES:
        raise InvalidArgument(f"{path}: not a hisparse fence file of format {FORMAT_VERSION}")
    try:
        namespace = head[_NAME_OFFSET:_NAME_OFFSET + name_len].decode()
        handle_str = handle.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path}: not a hisparse fence file (bad text)") from None
    owner = int.from_bytes(head[_OWNER_OFFSET:_OWNER_OFFSET + 4], "little")
    return FenceHeader(state, region_id, num_pages, created, handle_str, namespace,
                       owner - 1 if owner else None)


class FenceFile:
    """The daemon's side of one fence: its own descriptor, the mapped holds, the probe."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, header: FenceHeader) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self._fd = fd
        self._mm = mm
        self.header = header
        self.holds = np.frombuffer(mm, dtype=np.uint32, count=header.num_pages, offset=HEADER_BYTES)

    @classmethod
    def create(cls, directory: str, name: str, *, namespace: str, region_id: int,
               num_pages: int, handle: str, owner_uid: int | None = None) -> FenceFile:
        """A new LIVE fence ``directory/name``; refuses to follow or reuse an existing path."""
        path = os.path.join(directory, name)
        encoded = namespace.encode()
        if len(encoded) > _NAME_BYTES:
            raise InvalidArgument("namespace too long for a fence header")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FENCE_FILE_MODE)
        try:
            os.fchmod(fd, FENCE_FILE_MODE)  # whatever the umask
            os.ftruncate(fd, file_bytes(num_pages))  # sparse: holds cost only where taken
            mm = mmap.mmap(fd, file_bytes(num_pages), mmap.MAP_SHARED)
            created = time.time()
            mm[_NAME_OFFSET:_NAME_OFFSET + len(encoded)] = encoded
            if owner_uid is not None:
                mm[_OWNER_OFFSET:_OWNER_OFFSET + 4] = (owner_uid + 1).to_bytes(4, "little")
            mm[:_HEADER.size] = _HEADER.pack(b"\0" * 8, FORMAT_VERSION, LIVE, region_id, num_pages,
                                             created, handle.encode("ascii")[:8], len(encoded))
            mm[:8] = MAGIC  # last: a file without it is never adopted
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return cls(path, fd, mm, FenceHeader(LIVE, region_id, num_pages, created, handle, namespace,
                                             owner_uid))

    @classmethod
    def adopt(cls, path: str, *, owner_uid: int) -> FenceFile:
        """Open a fence an earlier daemon run left; ``InvalidArgument`` when it is not trustworthy."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner_uid or st.st_mode & 0o022:
                raise InvalidArgument(f"{path}: not a regular file of uid {owner_uid} without "
                                      "group/other write bits")
            header = _parse_header(os.pread(fd, HEADER_BYTES, 0), path)
            if st.st_size < file_bytes(header.num_pages):
                raise InvalidArgument(f"{path}: truncated")
            mm = mmap.mmap(fd, file_bytes(header.num_pages), mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, header)

    # -- the kernel's word --

    def holder_gone(self) -> bool:
        """True when no process holds the file's lock any more (all holders exited or let go).

        Probes with ``LOCK_EX | LOCK_NB`` on the daemon's own descriptor and lets
        go at once, so a client that locks late (between hello and its first
        reserve) is not locked out.
        """
        if not self.take_if_free():
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def take_if_free(self) -> bool:
        """Take ``LOCK_EX`` if no process holds the lock, and keep it: True when taken.

        For releasing the fence: with the lock kept until ``close(unlink=True)``
        has written RELEASED and removed the file, no process can lock it in
        between and believe the pages it names are still held (``holder_gone``
        lets go at once, so a probe followed by a release leaves that window).
        A process blocked in ``flock(LOCK_SH)`` meanwhile gets the lock on the
        removed file afterwards and reads RELEASED.
        """
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True

    def inode(self) -> tuple[int, int, int]:
        """(major, minor, inode) of the file, as /proc/locks names it."""
        st = os.fstat(self._fd)
        return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino

    # -- holds (written before the reply that grants them) --

    @property
    def state(self) -> int:
        return read_state(self._mm)

    def set_state(self, state: int) -> None:
        self._mm[_STATE_OFFSET:_STATE_OFFSET + 4] = state.to_bytes(4, "little")

    def add_reserved(self, pages: list[int]) -> None:
        if pages:
            self.holds[pages] |= RESERVED_BIT

    def clear_reserved(self, pages: list[int]) -> None:
        if pages:
            self.holds[pages] &= PIN_MASK

    def add_pins(self, pages: list[int]) -> None:
        if pages:
            np.add.at(self.holds, np.asarray(pages, dtype=np.int64), np.uint32(1))

    def remove_pins(self, pages: list[int]) -> None:
        if pages:
            np.subtract.at(self.holds, np.asarray(pages, dtype=np.int64), np.uint32(1))

    def held_pages(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pages, reserved flags, pin counts) of every page this fence holds."""
        pages = np.flatnonzero(self.holds)
        holds = self.holds[pages]
        return pages, (holds & RESERVED_BIT) != 0, (holds & PIN_MASK).astype(np.int64)

    def close(self, *, unlink: bool) -> None:
        """Forget the fence; ``unlink`` once its pages are free (state RELEASED first)."""
        if unlink:
            try:
                self.set_state(RELEASED)
            except ValueError:
                pass
            _unlink(self.path)
        self.holds = np.empty(0, dtype=np.uint32)
        try:
            self._mm.close()
        except BufferError:
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass


def read_state(mm: mmap.mmap) -> int:
    """The state word of a mapped fence header (clients map the header read-only)."""
    return int.from_bytes(mm[_STATE_OFFSET:_STATE_OFFSET + 4], "little")


def read_header(fd: int, path: str) -> FenceHeader:
    return _parse_header(os.pread(fd, HEADER_BYTES, 0), path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
