"""Mooncake Store as the cluster tier's backend: one client, used from one thread.

``MooncakeDistributedStore`` (``pip install 'hisparse[cluster]'``: the
``mooncake-transfer-engine-non-cuda`` wheel, or ``mooncake-transfer-engine``
on CUDA nodes; Debian's ``libibverbs1``) is imported on first use, so
nothing else in hisparse needs it. Every call blocks; the daemon makes them
from its cluster worker thread, never from its event loop.

A page moves as one value made of many buffers (``batch_put_from_multi_buffers``
/ ``batch_get_into_multi_buffers``): the header, then the page's slice of
every layer straight from (or into) the region, which is registered with
the transfer engine, so no staging copy is made on this side.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from hisparse.errors import HisparseError

# Mooncake logs through glog; its INFO lines would flood the daemon's log.
QUIET_ENV = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}


class ClusterUnavailableError(HisparseError):
    """The Mooncake wheel is missing, or its client could not reach the master."""


def load() -> Any:
    """The Mooncake module, or ``ClusterUnavailableError`` saying what to install."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    try:
        import xxhash  # noqa: F401  (the content hash of every value)
        from mooncake import store
    except ImportError as exc:
        raise ClusterUnavailableError(
            f"[cluster] backend = \"mooncake\" needs the Mooncake wheel and xxhash: "
            f"pip install 'hisparse[cluster]' (and apt-get install libibverbs1): {exc}") from None
    return store


def reachable(address: str, timeout_s: float = 0.5) -> None:
    """Raise ``ClusterUnavailableError`` unless ``host:port`` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ClusterUnavailableError(f"{address} does not answer: {exc}") from None


class MooncakeBackend:
    """Thin, typed calls on one ``MooncakeDistributedStore``; not thread-safe by design."""

    def __init__(self, *, local_hostname: str, metadata_server: str, master: str, protocol: str,
                 rdma_devices: str, segment_size_bytes: int, buffer_size_bytes: int,
                 replicas: int) -> None:
        self._module = load()
        self._args = (local_hostname, metadata_server, segment_size_bytes, buffer_size_bytes,
                      protocol, rdma_devices, master)
        self._store: Any = None
        self._replicate = self._module.ReplicateConfig()
        self._replicate.replica_num = replicas
        self.registered: set[tuple[int, int]] = set()

    @property
    def connected(self) -> bool:
        return self._store is not None

    def connect(self) -> None:
        # ``setup`` holds the GIL while it waits for an unreachable master (about 90 s,
        # freezing the daemon's event loop with it), so it is called only once the
        # master and the metadata server accept a connection.
        master, metadata = self._args[-1], self._args[1]
        reachable(master)
        if metadata.startswith(("http://", "https://")):
            parts = urlsplit(metadata)
            reachable(f"{parts.hostname}:{parts.port or 80}")
        store = self._module.MooncakeDistributedStore()
        rc = store.setup(*self._args)
        if rc != 0:
            raise ClusterUnavailableError(f"Mooncake setup returned {rc} (master {self._args[-1]}, "
                                          f"metadata {self._args[1]})")
        self._store = store
        self.registered.clear()

    def reachable(self) -> None:
        """Raise unless the master accepts a TCP connection: refused at once while it is dead,
        where a store call would wait out Mooncake's own retries (about 4 s)."""
        reachable(self._args[-1])

    def register(self, address: int, size_bytes: int) -> None:
        """Register memory with the transfer engine once (RDMA needs it; TCP takes it as a hint)."""
        if (address, size_bytes) in self.registered:
            return
        rc = self._store.register_buffer(address, size_bytes)
        if rc != 0:
            raise ClusterUnavailableError(f"register_buffer of {size_bytes} B returned {rc}")
        self.registered.add((address, size_bytes))

    def unregister(self, address: int, size_bytes: int) -> None:
        """Forget memory registered with ``register`` (a dropped namespace's region)."""
        if (address, size_bytes) not in self.registered:
            return
        self.registered.discard((address, size_bytes))
        rc = self._store.unregister_buffer(address)
        if rc != 0:
            raise ClusterUnavailableError(f"unregister_buffer of {size_bytes} B returned {rc}")

    def put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """0 per stored key, a negative Mooncake error code otherwise."""
        return list(self._store.batch_put_from_multi_buffers(keys, ptrs, sizes, self._replicate))

    def get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Bytes read per key (the value's whole size), or a negative Mooncake error code."""
        return list(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes))

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``get`` of whole values, each into one contiguous buffer."""
        return list(self._store.batch_get_into(keys, ptrs, sizes))

    def exist(self, keys: list[str]) -> list[int]:
        """1 held, 0 not held, negative: the master could not answer."""
        return list(self._store.batch_is_exist(keys))

    def size(self, key: str) -> int:
        """The value's size in bytes, or a negative Mooncake error code."""
        return int(self._store.get_size(key))

    def remove(self, keys: list[str]) -> None:
        self._store.batch_remove(keys, True)

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            finally:
                self._store = None
