"""One handler per op, and the table that dispatches to them.

A handler takes the daemon's context, the caller's session (None for
``hello`` and ``ping``) and the decoded request, and returns the ``ok``
body of the reply (protocol.REPLY_FIELDS lists each). Expected refusals
raise ``WireError`` with a code; anything else is a bug that the server
turns into ``INTERNAL`` and a logged traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import hisparse
from hisparse.daemon.ops.admin import handle_clear, handle_evict_session, handle_shutdown
from hisparse.daemon.ops.context import DaemonContext, Deferred, Handler, ns_of
from hisparse.daemon.ops.governance import handle_drop
from hisparse.daemon.ops.hello import handle_hello
from hisparse.daemon.ops.stats import handle_stats
from hisparse.daemon.ops.writes import (
    handle_abort,
    handle_commit,
    handle_pin,
    handle_publish,
    handle_reserve,
    handle_unpin,
)
from hisparse.daemon.store.sessions import Session
from hisparse.protocol import (
    MAX_REPLY_ENTRIES,
    VERSION,
    ErrorCode,
    EventsRequest,
    KeysPageRequest,
    KeysRequest,
    Op,
    Request,
    WireError,
)

log = logging.getLogger(__name__)


# -- session-less ops --

def handle_ping(ctx: DaemonContext, _: None, req: Request) -> dict[str, Any]:
    return {"version": hisparse.__version__, "protocol": VERSION,
            "uptime_s": time.monotonic() - ctx.started_s, "pid": os.getpid()}


# -- data ops --

def handle_lookup(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Deferred:
    ns = ns_of(session)
    count = ns.index.lookup(req.keys)
    if not req.remote:
        return {"count": count}
    if ctx.cluster is None or count == len(req.keys):
        return {"count": count, "remote": 0}
    remote = ctx.cluster.remote_prefix(ns, req.keys[count:], req.wait)
    if isinstance(remote, Future):  # the cluster worker answers (within cluster.timeout)
        return Deferred(asyncio.wrap_future(remote), lambda n: {"count": count, "remote": n},
                        _cluster_errors)
    return {"count": count, "remote": remote}


def handle_prefetch(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Deferred:
    if ctx.cluster is None:
        raise WireError(ErrorCode.CLUSTER_UNAVAILABLE,
                        "this hisparsed has no cluster tier: set [cluster] backend in its config")
    body = ctx.cluster.prefetch(ns_of(session), req.keys, req.wait)
    if isinstance(body, Future):
        return Deferred(asyncio.wrap_future(body), lambda done: done, _cluster_errors)
    return body


def _cluster_errors(exc: BaseException) -> WireError | None:
    return exc if isinstance(exc, WireError) else None


def handle_heartbeat(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    return {"lease_ttl_s": ctx.sessions.lease_ttl_s}


def handle_bye(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    reserved, pinned = len(session.reservations), session.pinned_pages
    zombie = ctx.sessions.end(session, "bye")
    if session.namespace is not None:
        log.info("detach: %s (aborted %d reservations, released %d pinned pages%s)",
                 session.describe(), reserved, pinned,
                 "; fenced until its process lets go" if zombie else "")
    return {}


def handle_events(ctx: DaemonContext, session: Session, req: EventsRequest) -> dict[str, Any]:
    events, seq, reset = ns_of(session).index.events.since(req.after, min(req.limit, MAX_REPLY_ENTRIES))
    return {"seq": seq, "events": events, "reset": reset}  # (kind, key, page) tuples: msgpack arrays


def handle_keys(ctx: DaemonContext, session: Session, req: KeysPageRequest) -> dict[str, Any]:
    index = ns_of(session).index
    seq = index.events.last_seq
    index.events.enabled = True
    keys, cursor = index.committed_page(req.cursor, min(req.limit, MAX_REPLY_ENTRIES))
    return {"keys": keys, "next_cursor": cursor, "seq": seq}  # (key, page) tuples: msgpack arrays


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
    Op.EVICT_SESSION: handle_evict_session,
    Op.DROP: handle_drop,
    Op.PUBLISH: handle_publish,
    Op.PREFETCH: handle_prefetch,
}
assert set(HANDLERS) == set(Op), "every op needs a handler"
