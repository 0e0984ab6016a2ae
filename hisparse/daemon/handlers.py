"""One handler per op, and the table that dispatches to them.

A handler takes the daemon's context, the caller's session (None for
``hello`` and ``ping``) and the decoded request, and returns the ``ok``
body of the reply (protocol.REPLY_FIELDS lists each). Expected refusals
raise ``WireError`` with a code; anything else is a bug that the server
turns into ``INTERNAL`` and a logged traceback.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import hisparse
from hisparse.daemon.config import Config
from hisparse.daemon.namespaces import Registry
from hisparse.daemon.sessions import Session, SessionTable
from hisparse.errors import CapacityError, InvalidArgument, LayoutMismatch
from hisparse.protocol import (
    VERSION,
    AdminRequest,
    ErrorCode,
    EventsRequest,
    HelloRequest,
    KeysPageRequest,
    KeysRequest,
    Op,
    Request,
    WireError,
)

log = logging.getLogger(__name__)


@dataclass
class DaemonContext:
    config: Config
    registry: Registry
    sessions: SessionTable
    admin_token: str
    started_s: float = field(default_factory=time.monotonic)
    request_shutdown: Callable[[str], None] = lambda reason: None
    evictions_since_log: dict[str, int] = field(default_factory=dict)
    cluster: Any = None  # hisparse.daemon.cluster.ClusterTier when [cluster] is on
    requests_total: int = 0
    errors_total: int = 0


# A handler answers with the reply's ok body, or with a Future of it that the
# cluster worker resolves (the server sends the reply when it is done).
Handler = Callable[[DaemonContext, Any, Any], "dict[str, Any] | Future"]


def _ns(session: Session):
    if session.namespace is None:
        raise WireError(ErrorCode.NOT_ATTACHED, "this session has no namespace (hello without one)")
    return session.namespace


# -- session-less ops --

def handle_hello(ctx: DaemonContext, _: None, req: HelloRequest) -> dict[str, Any]:
    ns = None
    if req.namespace is not None:
        assert req.layout is not None
        try:
            ns = ctx.registry.get_or_create(req.namespace, req.layout, req.capacity_bytes)
        except LayoutMismatch as exc:
            raise WireError(ErrorCode.LAYOUT_MISMATCH, str(exc)) from None
        except CapacityError as exc:
            raise WireError(ErrorCode.CAPACITY, str(exc)) from None
        except InvalidArgument as exc:
            raise WireError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
    session = ctx.sessions.open(ns, req.client)
    if ns is not None:
        log.info("attach: %s", session.describe())
    else:
        log.debug("attach: %s", session.describe())
    return {
        "session": session.id,
        "lease_ttl_s": ctx.sessions.lease_ttl_s,
        "daemon_pid": os.getpid(),
        "daemon_version": hisparse.__version__,
        "region": ns.region_info() if ns else None,
        "events_seq": ns.index.events.last_seq if ns else 0,
    }


def handle_ping(ctx: DaemonContext, _: None, req: Request) -> dict[str, Any]:
    return {"version": hisparse.__version__, "protocol": VERSION,
            "uptime_s": time.monotonic() - ctx.started_s, "pid": os.getpid()}


# -- data ops --

def handle_lookup(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Future:
    ns = _ns(session)
    count = ns.index.lookup(req.keys)
    if not req.remote:
        return {"count": count}
    if ctx.cluster is None or count == len(req.keys):
        return {"count": count, "remote": 0}
    remote = ctx.cluster.remote_prefix(ns, req.keys[count:], req.wait)
    if isinstance(remote, Future):
        return _then(remote, lambda n: {"count": count, "remote": n})
    return {"count": count, "remote": remote}


def handle_prefetch(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Future:
    if ctx.cluster is None:
        raise WireError(ErrorCode.CLUSTER_UNAVAILABLE,
                        "this hisparsed has no cluster tier: set [cluster] backend in its config")
    return ctx.cluster.prefetch(_ns(session), req.keys, req.wait)


def _then(fut: Future, fn: Callable[[Any], dict[str, Any]]) -> Future:
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fn(f.result()))
    fut.add_done_callback(done)
    return out


def handle_reserve(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    ns = _ns(session)
    slots, evicted = ns.index.reserve(req.keys, session.reservations)
    if evicted:
        ctx.evictions_since_log[ns.name] = ctx.evictions_since_log.get(ns.name, 0) + len(evicted)
    if ctx.cluster is not None:
        ctx.cluster.reserved(ns)
    return {"slots": slots, "evicted": evicted}


def _held(session: Session, keys: tuple[bytes, ...], what: str) -> list[int]:
    """The pages of ``keys`` that ``session`` reserved; all or nothing."""
    pages = []
    for i, key in enumerate(keys):
        page = session.reservations.get(key)
        if page is None:
            raise WireError(ErrorCode.NOT_HELD,
                            f"{what}: keys[{i}] is not reserved by this session (nothing changed)")
        pages.append(page)
    if len(set(keys)) != len(keys):
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"{what}: a key is listed twice (nothing changed)")
    return pages


def _settle(session: Session, req: KeysRequest, what: str, apply) -> int:
    """Commit or abort reservations this session holds: all of ``req.keys`` or none."""
    for key, page in zip(req.keys, _held(session, req.keys, what)):
        del session.reservations[key]
        apply(key, page)
    return len(req.keys)


def handle_commit(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    ns = _ns(session)
    if ctx.cluster is None:
        return {"committed": _settle(session, req, "commit", ns.index.commit)}
    done: list[tuple[bytes, int]] = []

    def commit(key: bytes, page: int) -> None:
        ns.index.commit(key, page)
        done.append((key, page))
    committed = _settle(session, req, "commit", commit)
    ctx.cluster.committed(ns, done)
    return {"committed": committed}


def handle_abort(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    index = _ns(session).index
    if req.missing_ok:
        held = [key for key in dict.fromkeys(req.keys) if key in session.reservations]
        for key in held:
            index.abort(key, session.reservations.pop(key))
        return {"aborted": len(held)}
    return {"aborted": _settle(session, req, "abort", index.abort)}


def handle_pin(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    pages = _ns(session).index.pin(req.keys)
    pins = session.pins
    for key, page in zip(req.keys, pages):
        held = pins.get(key)
        if held is None:
            pins[key] = [page, 1]
        else:
            held[1] += 1
    return {"count": len(pages), "pages": pages}


def handle_unpin(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    index = _ns(session).index
    need: dict[bytes, int] = {}
    for i, key in enumerate(req.keys):
        need[key] = need.get(key, 0) + 1
        held = session.pins.get(key)
        if held is None or held[1] < need[key]:
            raise WireError(ErrorCode.NOT_HELD,
                            f"unpin: keys[{i}] is not pinned by this session (nothing changed)")
    for key in req.keys:
        held = session.pins[key]
        index.unpin(held[0])
        held[1] -= 1
        if held[1] == 0:
            del session.pins[key]
    return {"unpinned": len(req.keys)}


def handle_heartbeat(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    return {"lease_ttl_s": ctx.sessions.lease_ttl_s}


def handle_bye(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    aborted, released = ctx.sessions.close(session)
    if session.namespace is not None:
        log.info("detach: %s (aborted %d reservations, released %d pins)",
                 session.describe(), aborted, released)
    return {}


def handle_stats(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    namespaces = {}
    for name, ns in ctx.registry.namespaces.items():
        snap: dict[str, Any] = dict(ns.index.snapshot())
        snap.update(page_bytes=ns.layout.page_bytes, size_bytes=ns.geometry.size_bytes,
                    committed_bytes=snap["committed_pages"] * ns.layout.page_bytes,
                    sessions=ctx.sessions.count_for(ns),
                    layout=ns.layout.to_wire())
        namespaces[name] = snap
    daemon: dict[str, Any] = {
        "version": hisparse.__version__, "pid": os.getpid(),
        "uptime_s": time.monotonic() - ctx.started_s,
        "sessions": len(ctx.sessions.sessions),
        "sessions_expired": ctx.sessions.expired_total,
        "lease_ttl_s": ctx.sessions.lease_ttl_s,
        "requests": ctx.requests_total, "errors": ctx.errors_total,
        "evicted_pages": sum(ns.index.counters.evicted_pages for ns in ctx.registry.namespaces.values()),
    }
    daemon.update(ctx.registry.stats())
    daemon["cluster"] = ctx.cluster.stats() if ctx.cluster is not None else {"backend": "none"}
    return {"daemon": daemon, "namespaces": namespaces}


def handle_events(ctx: DaemonContext, session: Session, req: EventsRequest) -> dict[str, Any]:
    events, seq, reset = _ns(session).index.events.since(req.after, req.limit)
    return {"seq": seq, "events": [list(e) for e in events], "reset": reset}


def handle_keys(ctx: DaemonContext, session: Session, req: KeysPageRequest) -> dict[str, Any]:
    index = _ns(session).index
    seq = index.events.last_seq
    index.events.enabled = True
    keys, cursor = index.committed_page(req.cursor, req.limit)
    return {"keys": [list(k) for k in keys], "next_cursor": cursor, "seq": seq}


# -- admin ops --

def _authorize(ctx: DaemonContext, req: AdminRequest) -> None:
    if not hmac.compare_digest(req.token.encode(), ctx.admin_token.encode()):
        raise WireError(ErrorCode.PERMISSION_DENIED, f"{req.op.value}: wrong admin token")


def handle_clear(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    _authorize(ctx, req)
    assert req.namespace is not None
    ns = ctx.registry.namespaces.get(req.namespace)
    if ns is None:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"no namespace {req.namespace!r}")
    freed, doomed = ns.index.clear()
    log.info("clear %r by %s: %d pages freed, %d freed on their last unpin",
             ns.name, session.describe(), freed, doomed)
    return {"freed_pages": freed, "doomed_pages": doomed}


def handle_shutdown(ctx: DaemonContext, session: Session, req: AdminRequest) -> dict[str, Any]:
    _authorize(ctx, req)
    ctx.request_shutdown(f"shutdown requested by {session.describe()}")
    return {}


HANDLERS: dict[Op, Handler] = {
    Op.HELLO: handle_hello,
    Op.PING: handle_ping,
    Op.LOOKUP: handle_lookup,
    Op.RESERVE: handle_reserve,
    Op.COMMIT: handle_commit,
    Op.ABORT: handle_abort,
    Op.PIN: handle_pin,
    Op.UNPIN: handle_unpin,
    Op.HEARTBEAT: handle_heartbeat,
    Op.STATS: handle_stats,
    Op.EVENTS: handle_events,
    Op.KEYS: handle_keys,
    Op.CLEAR: handle_clear,
    Op.SHUTDOWN: handle_shutdown,
    Op.BYE: handle_bye,
    Op.PREFETCH: handle_prefetch,
}
assert set(HANDLERS) == set(Op), "every op needs a handler"
