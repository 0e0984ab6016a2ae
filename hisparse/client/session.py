"""A client's session with the daemon: ``hello``, the heartbeat, re-attaching when it is lost.

``Sessions`` owns the transport and the current ``ClientSession``. A
``ClientSession`` is replaced whole when the daemon forgets it (restart,
lease expiry): the new one says ``hello`` with the same namespace and
layout, maps the region again if it changed, and locks its own fence. The
lost session's fence is retired, so threads still copying under it keep
their hold until they are done and nobody else's pages are ever touched.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from hisparse.client.calls import Owed
from hisparse.client.fence import Fence, FenceBusy
from hisparse.client.regions import acquire_region, release_region
from hisparse.client.pending import Pending
from hisparse.client.transport import Transport
from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument, LeaseExpired, ProtocolError
from hisparse.layout import KVLayout
from hisparse.paths import read_access_key
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op
from hisparse.shm.fence import fence_dir_for
from hisparse.shm.region import RegionMap

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
LOST_SESSION_RETRIES = 2  # a store, load or pin redone after its session was lost mid-way
HELLO_TRIES = 3  # a hello whose fence another process locked first is given up for a new one


@dataclass(frozen=True, eq=False)
class ClientSession:
    """One daemon session and the region it was told about; replaced whole on re-hello."""

    id: int
    region: RegionMap
    region_key: tuple[str, int]
    lease_ttl_s: float
    fence: Fence  # locked while any thread (or a job handed to another process) may touch its pages

    @property
    def fence_path(self) -> str:
        """For another process that copies for this session: ``hisparse.client.fence.hold(path)``."""
        return self.fence.path

    @property
    def handle(self) -> str:
        """The 8 hex digits logs and ``hisparsectl`` show for this session."""
        return f"{self.id:016x}"[:8]


class Sessions:
    """The current session of one client, kept alive and replaced when lost. Thread-safe."""

    def __init__(self, namespace: str, layout: KVLayout, socket_path: str, capacity_bytes: int | None,
                 *, timeout_s: float, name: str, populate: bool,
                 on_reconnect: Callable[[], None] = lambda: None) -> None:
        self.namespace = namespace
        self.layout = layout
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._capacity_bytes = capacity_bytes
        self._populate = populate
        self._name = name
        self._on_reconnect = on_reconnect
        self._hello_lock = threading.Lock()
        self.closed = False
        self.transport = Transport(socket_path)
        self.owed = Owed(self)  # releases by tag that calls whose replies were lost still owe
        try:
            self._session = self._hello()
        except BaseException:
            self.transport.close()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"hisparse-heartbeat-{namespace[:32]}")
        self._heartbeat.start()

    def _hello(self) -> ClientSession:
        for _ in range(HELLO_TRIES - 1):
            try:
                return self._hello_once()
            except FenceBusy as exc:  # someone locked our fence first: take another session
                log.warning("hisparse: %s; attaching again with a new session", exc)
        return self._hello_once()

    def _hello_once(self) -> ClientSession:
        body = self.transport.call(Op.HELLO, self.timeout_s, namespace=self.namespace,
                                   layout=self.layout, capacity_bytes=self._capacity_bytes,
                                   client=self._name,
                                   access_key=read_access_key(self.socket_path, self.namespace))
        for warning in body.get("warnings") or ():
            log.warning("hisparsed: %s", warning)
        name = body.get("fence")
        if not isinstance(name, str) or "/" in name or not name:
            raise ProtocolError(f"hello reply names no fence file: {name!r}")
        try:
            fence = Fence(os.path.join(fence_dir_for(self.socket_path), name))
        except FenceBusy:
            self._bye_quietly(int(body["session"]))
            raise
        try:
            region, key = acquire_region(body.get("region"), self.layout, populate=self._populate)
        except BaseException:
            fence.retire()
            raise
        return ClientSession(int(body["session"]), region, key, float(body["lease_ttl_s"]), fence)

    def _bye_quietly(self, session_id: int) -> None:
        try:
            self.transport.call(Op.BYE, min(self.timeout_s, 1.0), session=session_id)
        except HisparseError as exc:
            log.debug("bye failed (%s); the lease expires instead", exc)

    def rehello(self, lost: ClientSession) -> ClientSession:
        """Replace ``lost`` by a new session (once, however many threads saw it lost)."""
        with self._hello_lock:
            if self.closed:
                raise InvalidArgument("the client is closed")
            if self._session is not lost:
                return self._session  # another thread has already reconnected
            fresh = self._hello()
            self._session = fresh
            release_region(lost.region_key)
            # Threads still copying under the lost session keep its fence until they are done.
            lost.fence.retire()
            self._on_reconnect()
            log.info("session %s on %r lost (daemon restart or lease expiry); reattached as %s",
                     lost.handle, self.namespace, fresh.handle)
            return fresh

    @property
    def session(self) -> ClientSession:
        """The current session, closed or not (for diagnostics and tests)."""
        return self._session

    def is_live(self, session: ClientSession) -> bool:
        return not self.closed and self._session is session

    def current(self) -> ClientSession:
        if self.transport.forked():  # before any lock: a parent's thread may have held it at fork
            raise DaemonUnavailable(self.transport.forked_message())
        if self.closed:
            raise InvalidArgument("the client is closed")
        return self._session

    def call_in(self, session: ClientSession, op: Op, timeout_s: float | None = None,
                **fields: Any) -> dict[str, Any]:
        """One request on ``session``; ``LeaseExpired`` when the daemon no longer knows it."""
        return self.transport.call(op, timeout_s or self.timeout_s, session=session.id, **fields)

    def submit_in(self, session: ClientSession, op: Op, **fields: Any) -> Pending:
        """``call_in`` without the wait: the request goes out at once; ``result(timeout_s)``
        waits for it. Every one must be waited for or abandoned."""
        return self.transport.submit(op, session=session.id, **fields)

    def submit_all_in(self, session: ClientSession, op: Op, requests: list[dict[str, Any]]) -> list[Pending]:
        """``submit_in`` of several requests of one op, sent together (one wake-up)."""
        return self.transport.submit_all(op, [{"session": session.id, **fields} for fields in requests])

    def call(self, op: Op, timeout_s: float | None = None,
             **fields: Any) -> tuple[dict[str, Any], ClientSession]:
        """One request on the current session, re-attaching once if the session was lost."""
        session = self.current()
        try:
            return self.call_in(session, op, timeout_s, **fields), session
        except LeaseExpired:
            session = self.rehello(session)
            return self.call_in(session, op, timeout_s, **fields), session

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._session.lease_ttl_s / 3):
            try:
                body, session = self.call(Op.HEARTBEAT,
                                          timeout_s=min(self.timeout_s, self._session.lease_ttl_s / 3))
                self._follow_lease(session, body)
            except HisparseError as exc:
                # The next beat (or the next call) tries again; calls raise on their own.
                log.debug("heartbeat on %r failed: %s", self.namespace, exc)

    def _follow_lease(self, session: ClientSession, body: dict[str, Any]) -> None:
        """Adopt the lease the daemon now grants (SIGHUP may have changed it)."""
        ttl = body.get("lease_ttl_s")
        if isinstance(ttl, (int, float)) and ttl > 0 and ttl != session.lease_ttl_s:
            log.info("hisparsed's lease is now %.1fs (was %.1fs)", ttl, session.lease_ttl_s)
            object.__setattr__(session, "lease_ttl_s", float(ttl))  # frozen for callers, not for us

    def unpin(self, session: ClientSession, page_ids: Any, tag: int | None = None) -> None:
        """Unpin by page id, as the pin replies named them (a key may sit in two pages);
        ``tag``: the pinning call's, so the daemon's record of that call forgets them too."""
        pages = [int(p) for p in page_ids]
        for start in range(0, len(pages), MAX_KEYS_PER_REQUEST):
            self.call_in(session, Op.UNPIN, pages=pages[start:start + MAX_KEYS_PER_REQUEST], tag=tag)

    def close(self) -> None:
        """Say bye (releasing the session's pins and reservations) and stop the heartbeat."""
        if self.transport.forked():  # the session, its heartbeat and its locks are the parent's
            self.closed = True
            self.transport.close()
            return
        with self._hello_lock:
            if self.closed:
                return
            self.closed = True
        self._stop.set()
        self.owed.close()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self.timeout_s)
        session = self._session
        # Let go of the fence first (unless a Pin or a copy still uses it), so
        # that the daemon frees this session's pages at once on the bye.
        session.fence.retire()
        try:
            self.call_in(session, Op.BYE, timeout_s=min(self.timeout_s, 1.0))
        except HisparseError as exc:
            log.debug("bye failed (%s); the lease expires instead", exc)
        self.transport.close()
        release_region(session.region_key)


def chunks(keys: list[bytes]) -> list[list[bytes]]:
    """``keys`` in requests of at most ``MAX_KEYS_PER_REQUEST``."""
    return [keys[i:i + MAX_KEYS_PER_REQUEST] for i in range(0, len(keys), MAX_KEYS_PER_REQUEST)]
