"""One SGLang host pool on the node tier: its namespace's client, pins, gate and page codec.

``exists`` / ``get`` / ``set`` are what the storage backend's v1 and v2
calls do for one pool (the KV pool, the DSA indexer pool, ...). Keys are
SGLang's page hashes; page ``i`` of a call sits at host slot
``host_indices[i * page_size]``. Each call is answered from the daemon
within the client's ``timeout_s`` (one unanswered request, never a second
wait for its clean-up), or as a miss while the gate is closed (``gate``);
none raises for an unreachable daemon.

The client is attached when the pool is registered (a layout mismatch is a
configuration error and raised there); when the daemon is not up then, the
gate's probe attaches it once the daemon answers, off SGLang's threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from hisparse.client import Client, attach
from hisparse.client.transport import default_socket_path, ping
from hisparse.errors import ClusterUnavailable, HisparseError, LeaseExpired
from hisparse.sglang.codec import PageCodec
from hisparse.sglang.config import SglangConfig
from hisparse.sglang.gate import UNREACHABLE, Gate
from hisparse.sglang.holds import PinHolds
from hisparse.sglang.namespace import PoolGeometry, key_bytes

log = logging.getLogger(__name__)


def connect_client(config: SglangConfig, namespace: str, geometry: PoolGeometry, gate: Gate, name: str,
                   *, late: bool = False) -> Client | None:
    """Attach to ``namespace``; None (and the gate closed) when the daemon does not answer.

    Any other refusal (``LayoutMismatch``, ``CapacityError``) is a configuration error:
    raised at start, and logged (the gate closed) on a ``late`` attach from an IO thread.
    """
    try:
        client = attach(namespace, geometry.layout, socket=config.socket, capacity=config.capacity,
                        timeout_s=config.timeout_s, name=name)
    except UNREACHABLE as exc:
        gate.failed("attach", exc)
        return None
    except HisparseError as exc:
        if not late:
            raise
        log.error("hisparse attach to %s failed: %s", namespace, exc)
        gate.failed("attach", exc)
        return None
    log.info("SGLang %s on hisparsed namespace %r (%s)", geometry.pool, namespace, geometry.layout)
    gate.succeeded()
    return client


def gate_for(config: SglangConfig, name: str, on_up: Callable[[], bool]) -> Gate:
    """An outage gate whose probe pings the daemon of ``config`` within ``timeout_s``."""
    socket = config.socket or default_socket_path()

    def probe() -> bool:
        try:
            ping(socket, config.timeout_s)
        except HisparseError:
            return False
        return True

    return Gate(config.down_s, name, probe=probe, on_up=on_up)


class PoolTier:
    def __init__(self, config: SglangConfig, host_pool: Any, geometry: PoolGeometry, namespace: str,
                 *, writer: bool, name: str) -> None:
        self.config = config
        self.geometry = geometry
        self.namespace = namespace
        self.writer = writer  # False: another TP rank stores this pool's pages (MLA KV)
        self.codec = PageCodec(host_pool, geometry)
        self.gate = gate_for(config, f"{name} ({namespace})", self._attach_late)
        self.holds = PinHolds(config.hold_s)
        self._name = name
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._staging: dict[str, torch.Tensor] = {}  # per direction: one IO thread each in SGLang
        self.counters = dict.fromkeys(("exists_pages", "hit_pages", "get_pages", "got_pages",
                                       "got_pinned", "set_pages", "stored_pages", "promoted_pages",
                                       "skipped_calls"), 0)

    # -- the client --

    def connect(self) -> Client | None:
        """The attached client, attaching now if needed; None while the daemon is away."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = connect_client(self.config, self.namespace, self.geometry, self.gate,
                                                  self._name)
        return self._client

    def _attach_late(self) -> bool:
        """The probe's: attach if the daemon was away at start (never raises); True when attached."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = connect_client(self.config, self.namespace, self.geometry,
                                                  self.gate, self._name, late=True)
        return self._client is not None

    def _usable(self) -> Client | None:
        if not self.gate.allows() or self._client is None:
            self.counters["skipped_calls"] += 1
            return None
        return self._client

    def close(self) -> None:
        self.gate.close()
        self.holds.release_all()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- the calls --

    def exists(self, keys: list[str]) -> int:
        """Leading pages committed, each pinned until ``get`` reads it (or ``hold_s`` passes)."""
        kb = [key_bytes(k) for k in keys]
        self.counters["exists_pages"] += len(kb)
        client = self._usable()
        if client is None:
            return 0
        self.holds.expire()
        owner = self.holds.new_owner()  # batch_get_v1 reads what this reports: its claims
        n = self.holds.claim(kb, owner)
        try:
            if n < len(kb):
                n += self._pin(client, kb[n:], owner)
            if n < len(kb) and self.config.cluster:
                n += self._promote(client, kb[n:], owner)
        except UNREACHABLE as exc:
            self.gate.failed("exists", exc)
            self.holds.drop(owner)
            return 0
        except HisparseError as exc:  # a quota, a session lost twice: this call misses
            log.warning("hisparse exists on %s failed: %s", self.namespace, exc)
            return n
        self.gate.succeeded()
        self.counters["hit_pages"] += n
        return n

    def _pin(self, client: Client, keys: list[bytes], owner: Hashable) -> int:
        pin = client.pin(keys)
        count = pin.count
        self.holds.add(pin, owner)
        return count

    def _promote(self, client: Client, keys: list[bytes], owner: Hashable) -> int:
        """Pages after the local prefix that the cluster tier (or a P/D peer) holds: promote, pin."""
        try:
            _, remote = client.lookup_remote(keys, wait=True)
            if remote <= 0:
                return 0
            client.prefetch(keys[:remote], wait=True)
        except ClusterUnavailable as exc:
            log.debug("cluster tier unavailable for %s: %s", self.namespace, exc)
            return 0
        n = self._pin(client, keys, owner)
        self.counters["promoted_pages"] += n
        return n

    def get(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Copy the leading pages found into host slots; True per page copied."""
        results = [False] * len(keys)
        self.counters["get_pages"] += len(keys)
        client = self._usable()
        if client is None:
            return results
        kb = [key_bytes(k) for k in keys]
        slots = _page_starts(host_indices, self.geometry.page_size, len(keys))
        try:
            i = self._get_pinned(kb, slots)
            results[:i] = [True] * i
            if i < len(kb):
                m = self._load(client, kb[i:], slots[i:])
                results[i:i + m] = [True] * m
        except UNREACHABLE as exc:
            self.gate.failed("get", exc)
            return results
        except HisparseError as exc:
            log.warning("hisparse get on %s failed: %s", self.namespace, exc)
            return results
        self.gate.succeeded()
        self.counters["got_pages"] += sum(results)
        return results

    def _get_pinned(self, keys: list[bytes], slots: list[int]) -> int:
        """Copy the leading pages ``batch_exists`` pinned; how many are good.

        Each pin is checked once, after every copy out of it: a pin still held means
        its fence was ours throughout, so the bytes are what was committed.
        """
        copied: dict[int, tuple[Any, int]] = {}  # id(pin) -> (pin, first page copied from it)
        n = 0
        for key, slot in zip(keys, slots):
            held = self.holds.get(key)
            if held is None:
                break
            pin, j = held
            try:
                self.codec.write(slot, pin.view(j))
            except LeaseExpired:
                break
            copied.setdefault(id(pin), (pin, n))
            n += 1
        good = min((first for pin, first in copied.values() if not pin.held), default=n)
        for key in keys[:n]:
            self.holds.done(key)
        self.counters["got_pinned"] += good
        return good

    def _stage(self, direction: str, n: int) -> torch.Tensor:
        """A staging tensor of ``n`` pages, kept between calls (fresh memory costs page faults)."""
        buf = self._staging.get(direction)
        if buf is None or buf.shape[0] < n:
            buf = self._staging[direction] = torch.empty((n, self.geometry.page_bytes), dtype=torch.uint8)
        return buf[:n]

    def _load(self, client: Client, keys: list[bytes], slots: list[int]) -> int:
        out = self._stage("get", len(keys))
        m = client.load(keys, out)
        for j in range(m):
            self.codec.write(slots[j], out[j])
        return m

    def set(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Store pages from host slots; True per page the namespace now holds."""
        n = len(keys)
        self.counters["set_pages"] += n
        if not self.writer:
            return [True] * n  # the writer rank stores this copy; every rank reads it
        client = self._usable()
        if client is None:
            return [False] * n
        kb = [key_bytes(k) for k in keys]
        pages = self._stage("set", n)
        for i, slot in enumerate(_page_starts(host_indices, self.geometry.page_size, n)):
            self.codec.read_into(slot, pages[i])
        try:
            written = client.store(kb, pages)
            held = n if written == n else client.lookup(kb)
        except UNREACHABLE as exc:
            self.gate.failed("set", exc)
            return [False] * n
        except HisparseError as exc:
            log.warning("hisparse set on %s failed: %s", self.namespace, exc)
            return [False] * n
        self.gate.succeeded()
        self.counters["stored_pages"] += written
        return [True] * held + [False] * (n - held)


def _page_starts(host_indices: torch.Tensor, page_size: int, n: int) -> list[int]:
    """Page ``i`` of a call starts at host slot ``host_indices[i * page_size]``."""
    return host_indices[::page_size][:n].tolist()
