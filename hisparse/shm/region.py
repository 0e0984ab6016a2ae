"""Namespace regions: one shared-memory file of ``N`` pages, laid out layer-major.

With ``bt = block_tokens`` and ``rb = row_bytes``, the row of (layer ``l``,
page ``p``, token ``t``) is at byte ``l*N*bt*rb + p*bt*rb + t*rb``: each
layer's rows form one contiguous ``[N*bt, rb]`` slab, and a host row id is
``p*bt + t`` in every layer. That is the host layout of vLLM's HiSparse pool,
so a region can serve as its pool, and a resolver addresses a layer's rows
from one base pointer.

The daemon creates and sizes region files (allocated, not sparse, mode 0660);
clients only map them. Neither side imports torch here.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from hisparse.errors import CapacityError, InvalidArgument
from hisparse.layout import KVLayout

REGION_FILE_MODE = 0o660


@dataclass(frozen=True)
class RegionGeometry:
    """Where every byte of a region is."""

    layout: KVLayout
    num_pages: int

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise InvalidArgument(f"a region needs at least one page, not {self.num_pages}")

    @property
    def size_bytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    @property
    def layer_stride_bytes(self) -> int:
        """Bytes from one layer's slab to the next: ``N * bt * rb``."""
        return self.num_pages * self.layout.layer_page_bytes

    @property
    def rows_per_layer(self) -> int:
        return self.num_pages * self.layout.block_tokens

    def row_offset(self, layer: int, page: int, token: int) -> int:
        lay = self.layout
        return layer * self.layer_stride_bytes + (page * lay.block_tokens + token) * lay.row_bytes

    @classmethod
    def for_capacity(cls, layout: KVLayout, capacity_bytes: int) -> RegionGeometry:
        num_pages = capacity_bytes // layout.page_bytes
        if num_pages < 1:
            raise CapacityError(
                f"capacity {capacity_bytes} B holds no page of {layout.page_bytes} B")
        return cls(layout, num_pages)


def _block_size(directory: str) -> int:
    """The allocation unit of the file system: 4 KiB on tmpfs, 2 MiB or 1 GiB on hugetlbfs."""
    try:
        return max(os.statvfs(directory).f_bsize, mmap.PAGESIZE)
    except OSError:
        return mmap.PAGESIZE


def file_size_for(directory: str, size_bytes: int) -> int:
    """``size_bytes`` rounded up to the directory's allocation unit (hugetlbfs needs it)."""
    unit = _block_size(directory)
    return -(-size_bytes // unit) * unit


def create_file(path: str, size_bytes: int, mode: int = REGION_FILE_MODE) -> int:
    """Create ``path`` (it must not exist), sized and allocated; returns the file size.

    The blocks are allocated now, so running out of shared memory fails here
    with a ``CapacityError`` instead of as a SIGBUS in a client later.
    """
    directory = os.path.dirname(path) or "."
    file_bytes = file_size_for(directory, size_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow what clients may open
        os.ftruncate(fd, file_bytes)
        try:
            os.posix_fallocate(fd, 0, file_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CapacityError(
                    f"no room for {file_bytes} B in {directory}: {exc.strerror}") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV):
                raise
            # Some file systems cannot fallocate: touch every block instead.
            _populate(fd, file_bytes)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    os.close(fd)
    return file_bytes


def _populate(fd: int, file_bytes: int) -> None:
    mm = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        view[:: mmap.PAGESIZE] = 0
        del view
    finally:
        mm.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_file(path: str, size_bytes: int, *, writable: bool = True) -> mmap.mmap:
    """Map the first ``size_bytes`` of ``path`` ``MAP_SHARED``; checks the file is large enough.

    ``O_NOFOLLOW``: a region or table is never a symbolic link.
    """
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return map_fd(fd, path, size_bytes, writable=writable)
    finally:
        os.close(fd)


def map_fd(fd: int, path: str, size_bytes: int, *, writable: bool = True) -> mmap.mmap:
    """Map the first ``size_bytes`` of an open file ``MAP_SHARED`` (the fd may be closed after)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is not a regular file")
    if st.st_size < size_bytes:
        raise InvalidArgument(f"{path} holds {st.st_size} B, fewer than the {size_bytes} B expected")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, prot)


class RegionMap:
    """A mapped region and numpy views of it (no copies)."""

    def __init__(self, path: str, geometry: RegionGeometry, *, writable: bool = True) -> None:
        self.path = path
        self.geometry = geometry
        self._mmap = map_file(path, geometry.size_bytes, writable=writable)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        if not writable:
            self.array.flags.writeable = False

    @property
    def address(self) -> int:
        """The mapping's virtual address (for cuMemHostRegister)."""
        return int(self.array.ctypes.data)

    def pages_view(self) -> np.ndarray:
        """``[num_layers, N, bt*rb]`` view: ``[:, p, :]`` is page ``p`` (strided)."""
        g = self.geometry
        return self.array.reshape(g.layout.num_layers, g.num_pages, g.layout.layer_page_bytes)

    def layer_rows(self, layer: int) -> np.ndarray:
        """``[N*bt, rb]`` view of one layer's slab."""
        g = self.geometry
        if not 0 <= layer < g.layout.num_layers:
            raise InvalidArgument(f"layer {layer} out of range 0..{g.layout.num_layers - 1}")
        start = layer * g.layer_stride_bytes
        slab = self.array[start:start + g.layer_stride_bytes]
        return slab.reshape(g.rows_per_layer, g.layout.row_bytes)

    def close(self) -> None:
        """Unmap. Views handed out keep the mapping alive until they are dropped."""
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # A view (numpy or torch) still exports the buffer; the mapping
            # goes away with the last of them.
            pass
