"""``attach()`` and ``Client``: an engine's handle on one namespace of the node's daemon.

A ``Client`` holds one session (``hello``), keeps its lease with a heartbeat
thread, and maps the namespace's region once per process. Every call is
thread-safe. When the daemon answers ``UNKNOWN_SESSION`` (it restarted, or
the lease ran out) the client says ``hello`` again with the same namespace
and layout, remaps the region if it changed, and retries the call once; a
call made while the daemon is away raises ``DaemonUnavailable`` within the
client's timeout. Reservations and pins of a lost session are gone: ``store``
and ``load`` redo their whole reserve/pin step, a ``Pin`` raises
``LeaseExpired``.

Fencing (``hisparse.client.fence``): right after ``hello`` the client locks
its session's fence file, and every copy into or out of the region holds a
reference on it. The daemon reuses an ended session's pages only once that
lock is gone, so a thread stalled mid-copy past its lease, or across a
daemon restart, can only ever touch pages nobody else has been given; and
each path checks the fence before it trusts what it copied.

Page bytes never cross the socket: ``store`` is reserve -> copy into the
region -> commit (abort on any failure in between, so no partial page is
ever visible), ``load`` is pin -> copy out -> unpin.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hisparse.client import backends, loading
from hisparse.client.calls import new_tag
from hisparse.client.keys import check_keys
from hisparse.client.pins import Pin
from hisparse.client.results import ShortStoreWarnings, StoreResult
from hisparse.client.session import DEFAULT_TIMEOUT_S, LOST_SESSION_RETRIES, ClientSession, Sessions, chunks
from hisparse.client.storing import store_chunk
from hisparse.client.transport import Transport, default_socket_path
from hisparse.extras import require
from hisparse.errors import InvalidArgument, LeaseExpired
from hisparse.layout import KVLayout, parse_size
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "Client", "ClientSession", "StoreResult", "attach"]



def attach(namespace: str, layout: KVLayout, socket: str | None = None,
           capacity: int | str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
           name: str | None = None, populate: bool = False) -> Client:
    """Open a session on ``namespace`` and map its region.

    ``socket``: None for ``$HISPARSE_SOCKET``, else the system daemon's socket,
    else the embedded default. ``capacity`` (bytes or e.g. ``"384GiB"``) sizes
    the region if this attach creates the namespace. ``timeout_s`` bounds each
    request. ``name`` shows in the daemon's logs. ``populate`` faults the whole
    mapping in at attach instead of page by page during the first copies
    (worth it for CPU copies from a tmpfs region; CUDA registration does it
    anyway). Raises ``DaemonUnavailable``, ``LayoutMismatch``, ``CapacityError``.
    """
    capacity_bytes = None if capacity is None else parse_size(capacity)
    return Client(namespace, layout, socket or default_socket_path(), capacity_bytes,
                  timeout_s=timeout_s, name=name, populate=populate)


class Client:
    """See ``attach``. Also a context manager (``close`` on exit)."""

    def __init__(self, namespace: str, layout: KVLayout, socket_path: str,
                 capacity_bytes: int | None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 name: str | None = None, populate: bool = False) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a hisparse.KVLayout, not {type(layout).__name__}")
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be positive, not {timeout_s}")
        self.namespace = namespace
        self.layout = layout
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._counters_lock = threading.Lock()
        self.counters: dict[str, float] = dict.fromkeys(
            ("lookups", "lookup_keys", "hit_keys", "stored_pages", "stored_bytes", "store_s",
             "loaded_pages", "loaded_bytes", "load_s", "reconnects"), 0)
        self._sessions = Sessions(namespace, layout, socket_path, capacity_bytes, timeout_s=timeout_s,
                                  name=f"pid {os.getpid()} {name or 'hisparse.client'}",
                                  populate=populate, on_reconnect=lambda: self._count(reconnects=1))
        self._short_stores = ShortStoreWarnings(log, namespace)

    # -- sessions (hisparse.client.session) --

    @property
    def _session(self) -> ClientSession:
        return self._sessions.session

    @property
    def _closed(self) -> bool:
        return self._sessions.closed

    def _session_is_live(self, session: ClientSession) -> bool:
        return self._sessions.is_live(session)

    def _current(self) -> ClientSession:
        return self._sessions.current()

    def _call_in(self, session: ClientSession, op: Op, timeout_s: float | None = None,
                 **fields: Any) -> dict[str, Any]:
        return self._sessions.call_in(session, op, timeout_s, **fields)

    def _call(self, op: Op, timeout_s: float | None = None, **fields: Any) -> tuple[dict[str, Any], ClientSession]:
        return self._sessions.call(op, timeout_s, **fields)

    # -- the low-level surface --
    # For adapters that split a store or a load across steps or processes
    # (vLLM: the scheduler reserves, a worker copies, a later step commits).
    # Reservations and pins belong to the session that took them: release
    # them with ``request_in`` on that same session, which raises
    # ``LeaseExpired`` if it is gone rather than act on a new one.

    @property
    def session(self) -> ClientSession:
        """The current session (replaced whole when the client re-attaches)."""
        return self._current()

    @property
    def transport(self) -> Transport:
        """The connection every thread of this client shares (``connected``, ``silent_s()``)."""
        return self._sessions.transport

    def session_is_live(self, session: ClientSession) -> bool:
        """True while ``session`` is this client's current session."""
        return self._session_is_live(session)

    def request(self, op: Op, timeout_s: float | None = None,
                **fields: Any) -> tuple[dict[str, Any], ClientSession]:
        """One request on the current session, re-attaching once if it was lost: (body, session)."""
        return self._call(op, timeout_s, **fields)

    def request_in(self, session: ClientSession, op: Op, timeout_s: float | None = None,
                   **fields: Any) -> dict[str, Any]:
        """One request on ``session`` exactly; ``LeaseExpired`` when the daemon no longer knows it."""
        return self._call_in(session, op, timeout_s, **fields)

    def give_back(self, session: ClientSession, op: Op, **fields: Any) -> None:
        """What a call whose reply was lost owes: ``abort`` (keys, tag) or ``unpin`` (tag) on
        ``session``, sent in the background until answered (``hisparse.client.calls``)."""
        self._sessions.owed.give_back(session, op, **fields)

    def _count(self, **deltas: float) -> None:
        with self._counters_lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    # -- the API --

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys are committed."""
        keys = check_keys(keys, "lookup")
        count = 0
        for chunk in chunks(keys):
            n = int(self._call(Op.LOOKUP, keys=chunk)[0]["count"])
            count += n
            if n < len(chunk):
                break
        self._count(lookups=1, lookup_keys=len(keys), hit_keys=count)
        return count

    def lookup_remote(self, keys: list[bytes], *, wait: bool = True) -> tuple[int, int]:
        """``(local, remote)``: leading keys committed here, then how many after them the
        daemon's cluster tier holds (0 without one). ``wait=False`` answers at once from what
        the daemon already knows and lets it ask the cluster meanwhile. Looks at the first
        ``MAX_KEYS_PER_REQUEST`` keys (16,384)."""
        keys = check_keys(keys, "lookup_remote")[:MAX_KEYS_PER_REQUEST]
        body = self._call(Op.LOOKUP, keys=keys, remote=True, wait=wait)[0]
        local = int(body["count"])
        self._count(lookups=1, lookup_keys=len(keys), hit_keys=local)
        return local, int(body.get("remote", 0))

    def prefetch(self, keys: list[bytes], *, wait: bool = True) -> dict[str, Any]:
        """Promote the cluster tier's pages of ``keys`` into the namespace; later loads hit locally.

        Returns the daemon's counts (``promoted``, ``local``, ``missing``, ``refused``, ``busy``;
        ``queued`` with ``wait=False``) and ``missing_keys``. Raises ``ClusterUnavailable`` when
        the daemon has no cluster tier or the cluster did not answer within its ``cluster.timeout``.
        """
        total: dict[str, Any] = {"missing_keys": []}
        for chunk in chunks(check_keys(keys, "prefetch")):
            body = self._call(Op.PREFETCH, keys=chunk, wait=wait)[0]
            for name, value in body.items():
                if isinstance(value, list):
                    total[name].extend(value)
                else:
                    total[name] = total.get(name, 0) + int(value)
        return total

    def store(self, keys: list[bytes], pages: torch.Tensor | np.ndarray) -> StoreResult:
        """Store pages for keys not yet committed; returns how many were newly written.

        ``pages``: uint8 ``[len(keys), page_bytes]``, CPU or CUDA (or a numpy
        array, copied without torch). The result is that count as an ``int``
        (a ``StoreResult``) that also counts the keys ``present`` (already
        committed) and ``not_stored``: the region had no room from that key on
        (every page pinned or being written), which is logged as a warning (at
        most once a minute per client). Keys another session (or thread) is
        writing are waited for, bounded by ``timeout_s`` plus the lease ttl,
        then ``Timeout``.
        """
        keys = check_keys(keys, "store")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("store: a key is listed twice")
        pages = backends.check_pages(pages, len(keys), self.layout.page_bytes, "pages", exact=True)
        if not keys:
            return StoreResult(0)
        backend = backends.for_tensor(pages)
        started = time.perf_counter()
        written = present = 0
        for start in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            chunk = keys[start:start + MAX_KEYS_PER_REQUEST]
            n, there, full = store_chunk(self._sessions, chunk, pages[start:start + len(chunk)], backend)
            written += n
            present += there
            if full:
                break
        self._count(stored_pages=written, stored_bytes=written * self.layout.page_bytes,
                    store_s=time.perf_counter() - started)
        result = StoreResult(written, present, len(keys) - written - present)
        self._short_stores.note(result, self.num_pages)
        return result

    def load(self, keys: list[bytes], out: torch.Tensor | np.ndarray) -> int:
        """Fill ``out[:m]`` with the pages of the committed prefix of ``keys``; returns ``m``.

        ``out``: uint8 ``[>= len(keys), page_bytes]``, CPU or CUDA, rows contiguous.
        """
        keys = check_keys(keys, "load")
        out = backends.check_pages(out, len(keys), self.layout.page_bytes, "out", exact=False)
        if not keys:
            return 0
        started = time.perf_counter()
        m = loading.load(self._sessions, keys, out, backends.for_tensor(out))
        if m:
            self._count(loaded_pages=m, loaded_bytes=m * self.layout.page_bytes,
                        load_s=time.perf_counter() - started)
        return m

    def pin(self, keys: list[bytes]) -> Pin:
        """Pin the committed prefix of ``keys``; use as ``with c.pin(keys) as p:``."""
        keys = check_keys(keys, "pin")
        for attempt in range(LOST_SESSION_RETRIES + 1):
            tag = new_tag()
            session, pinned, page_ids = loading.pin_prefix(self._sessions, keys, tag)
            try:
                return Pin(self._sessions, session, pinned, page_ids.tolist(), tag)
            except LeaseExpired:
                # Another thread re-attached and let the session's fence go in
                # between: those pins are lost with it. Pin again.
                if attempt == LOST_SESSION_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def layer_rows(self, layer: int, device: Any = None) -> torch.Tensor:
        """uint8 ``[N*block_tokens, row_bytes]``: one layer's slab of the region (no copy).

        Host row id = ``page * block_tokens + t``. ``device="cuda"`` gives the
        slab's device-mapped (UVA) view, registering the region on first use.
        """
        torch = require("torch", "Client.layer_rows()")

        region = self._current().region
        rows = region.layer_rows(layer)
        if device is None or torch.device(device).type == "cpu":
            return torch.from_numpy(rows)
        dev = torch.device(device)
        if dev.type != "cuda":
            raise InvalidArgument(f"layer_rows: no view for device {dev}")
        from hisparse.client.backends import cuda

        g = region.geometry
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return cuda.device_view(region, index, layer * g.layer_stride_bytes,
                                (g.rows_per_layer, self.layout.row_bytes))

    def stats(self) -> dict[str, Any]:
        """The daemon's counters (``daemon``, ``namespaces``) and this client's (``client``)."""
        body = dict(self._call(Op.STATS)[0])
        with self._counters_lock:
            body["client"] = dict(self.counters)
        body["namespace"] = self.namespace
        return body

    @property
    def num_pages(self) -> int:
        return self._current().region.geometry.num_pages

    def close(self) -> None:
        """Say bye (releasing this session's pins and reservations) and stop the heartbeat."""
        self._sessions.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.namespace!r}, {self.layout}, socket={self.socket_path!r})"

