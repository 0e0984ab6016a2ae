"""The daemon's page metadata table: the source of truth for what a region holds.

One file per namespace, beside its region but mode 0600 and never named to a
client. It is a ``MAP_SHARED`` mapping, so every write is in the page cache
the moment it is made: a daemon killed with SIGKILL loses nothing it wrote,
and its successor rebuilds the index from the table alone.

File layout::

    [0, 4096)          header: magic, format, geometry, region id, namespace
    [4096 + 72*p, ...) record of page p: state u8 | key_len u8 | pad u16 |
                       generation u32 | key 64 B

A record's state byte is written last, so a half-written record is never
read as COMMITTED: a torn reserve is WRITING (freed on adoption) and a torn
commit is WRITING too.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from hisparse.errors import InvalidArgument
from hisparse.layout import KVLayout
from hisparse.shm.region import RegionGeometry, create_file, map_fd, map_file

MAGIC = b"HSPMETA1"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
RECORD_BYTES = 72
KEY_OFFSET = 8
MAX_KEY_BYTES = 64
TABLE_FILE_MODE = 0o600

FREE = 0
WRITING = 1
COMMITTED = 2

# magic, format, record bytes, num pages, layers, block tokens, row bytes,
# region id, namespace length, region file name length
_HEADER = struct.Struct("<8sIIQIIIQHH")
_NAME_OFFSET = 512
_NAME_BYTES = 1024
_REGION_NAME_OFFSET = _NAME_OFFSET + _NAME_BYTES
_REGION_NAME_BYTES = 1024

RECORD_DTYPE = np.dtype([("state", "u1"), ("key_len", "u1"), ("pad", "<u2"),
                         ("generation", "<u4"), ("key", "V64")])
assert RECORD_DTYPE.itemsize == RECORD_BYTES


@dataclass(frozen=True)
class TableHeader:
    namespace: str
    geometry: RegionGeometry
    region_id: int
    region_file: str  # base name of the region file, in the same shm_dir


def table_size(num_pages: int) -> int:
    return HEADER_BYTES + num_pages * RECORD_BYTES


class MetaTable:
    """A mapped metadata table. Writes are plain stores into shared memory."""

    def __init__(self, path: str, header: TableHeader, mm: mmap.mmap) -> None:
        self.path = path
        self.header = header
        self._mm = mm
        self.records = np.frombuffer(mm, dtype=RECORD_DTYPE, count=header.geometry.num_pages,
                                     offset=HEADER_BYTES)

    @classmethod
    def create(cls, path: str, header: TableHeader) -> MetaTable:
        num_pages = header.geometry.num_pages
        create_file(path, table_size(num_pages), mode=TABLE_FILE_MODE)
        mm = map_file(path, table_size(num_pages))
        name = header.namespace.encode()
        region = header.region_file.encode()
        if len(name) > _NAME_BYTES or len(region) > _REGION_NAME_BYTES:
            raise InvalidArgument("namespace or region file name too long for the table header")
        mm[_NAME_OFFSET:_NAME_OFFSET + len(name)] = name
        mm[_REGION_NAME_OFFSET:_REGION_NAME_OFFSET + len(region)] = region
        lay = header.geometry.layout
        # The magic goes in last: a table without it is never adopted.
        mm[: _HEADER.size] = _HEADER.pack(b"\0" * 8, FORMAT_VERSION, RECORD_BYTES, num_pages,
                                          lay.num_layers, lay.block_tokens, lay.row_bytes,
                                          header.region_id, len(name), len(region))
        mm[:8] = MAGIC
        return cls(path, header, mm)

    @classmethod
    def open(cls, path: str, check=None) -> MetaTable:
        """Map an existing table; raises ``InvalidArgument`` when it is not one of ours.

        Opened ``O_NOFOLLOW``; ``check(fd, path)`` (the daemon's ownership
        check) runs on the open file before a byte of it is read.
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if check is not None:
                check(fd, path)
            return cls._open_fd(fd, path)
        finally:
            os.close(fd)

    @classmethod
    def _open_fd(cls, fd: int, path: str) -> MetaTable:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise InvalidArgument(f"{path}: too small for a metadata table")
        head = os.pread(fd, HEADER_BYTES, 0)
        (magic, fmt, rec, num_pages, layers, bt, rb, region_id, name_len,
         region_len) = _HEADER.unpack_from(head)
        if magic != MAGIC or fmt != FORMAT_VERSION or rec != RECORD_BYTES:
            raise InvalidArgument(f"{path}: not a hisparse metadata table of format {FORMAT_VERSION}")
        if size < table_size(num_pages):
            raise InvalidArgument(f"{path}: truncated ({size} B for {num_pages} pages)")
        try:
            namespace = head[_NAME_OFFSET:_NAME_OFFSET + name_len].decode()
            region = head[_REGION_NAME_OFFSET:_REGION_NAME_OFFSET + region_len].decode()
            geometry = RegionGeometry(KVLayout(layers, bt, rb), num_pages)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidArgument(f"{path}: a damaged header: {exc}") from None
        header = TableHeader(namespace, geometry, region_id, region)
        return cls(path, header, map_fd(fd, path, table_size(num_pages)))

    # -- record writes (the hot path: plain slice stores into the mapping) --

    def set_writing(self, page: int, key: bytes, generation: int) -> None:
        off = HEADER_BYTES + page * RECORD_BYTES
        mm = self._mm
        mm[off] = WRITING  # first: an interrupted rewrite never reads as the old COMMITTED key
        mm[off + 1] = len(key)
        mm[off + 4:off + 8] = (generation & 0xFFFFFFFF).to_bytes(4, "little")
        mm[off + KEY_OFFSET:off + KEY_OFFSET + len(key)] = key

    def set_state(self, page: int, state: int) -> None:
        self._mm[HEADER_BYTES + page * RECORD_BYTES] = state

    def key_of(self, page: int) -> bytes:
        off = HEADER_BYTES + page * RECORD_BYTES
        n = self._mm[off + 1]
        return self._mm[off + KEY_OFFSET:off + KEY_OFFSET + n]

    def generation_of(self, page: int) -> int:
        off = HEADER_BYTES + page * RECORD_BYTES
        return int.from_bytes(self._mm[off + 4:off + 8], "little")

    # -- adoption --

    def scan(self) -> tuple[np.ndarray, np.ndarray]:
        """Page ids that are COMMITTED and that are WRITING (vectorised)."""
        states = self.records["state"]
        return np.flatnonzero(states == COMMITTED), np.flatnonzero(states == WRITING)

    def committed_keys(self, pages: np.ndarray) -> list[bytes]:
        """The keys of ``pages``, in order (adoption: vectorised where keys share a length)."""
        lens = self.records["key_len"][pages]
        raw = self.records["key"][pages].tobytes()
        if len(lens) and (lens == lens[0]).all():
            n = int(lens[0])
            return [raw[i:i + n] for i in range(0, len(raw), MAX_KEY_BYTES)]
        return [raw[i * MAX_KEY_BYTES:i * MAX_KEY_BYTES + int(n)] for i, n in enumerate(lens)]

    def flush(self) -> None:
        self._mm.flush()

    def close(self) -> None:
        self.records = np.empty(0, dtype=RECORD_DTYPE)
        try:
            self._mm.close()
        except BufferError:
            pass
