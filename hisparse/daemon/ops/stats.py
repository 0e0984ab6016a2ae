"""The ``stats`` op: every namespace's counters and the daemon's, as the caller may see them.

A group-restricted namespace shows only to its own sessions and to admin
sessions that presented the admin token (``access``); an admin session also
gets one row per session, live and fenced, with the pids that hold its fence.
The metrics endpoint (session None) gets every namespace and filters by who
scrapes (``metrics.take_snapshot``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import hisparse
from hisparse.daemon.ops.sessionrows import session_rows

if TYPE_CHECKING:
    from hisparse.daemon.ops.context import DaemonContext
    from hisparse.daemon.store.sessions import Session
    from hisparse.protocol import Request


def handle_stats(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    namespaces = {}
    ctx.privileged &= ctx.sessions.sessions.keys()
    # session None: the metrics endpoint (metrics.take_snapshot filters by who scrapes)
    sees_all = session is None or session.id in ctx.privileged or ctx.access is None
    for name, ns in ctx.registry.namespaces.items():
        if not sees_all and ctx.access.restricted(name) and session.namespace is not ns:  # type: ignore[union-attr]
            continue  # a group's namespace: shown to its own sessions and to the admin
        snap: dict[str, Any] = dict(ns.index.snapshot())
        snap.update(page_bytes=ns.layout.page_bytes, size_bytes=ns.geometry.size_bytes,
                    committed_bytes=snap["committed_pages"] * ns.layout.page_bytes,
                    sessions=ctx.sessions.count_for(ns),
                    layout=ns.layout.to_wire(),
                    # who created it: uid/gid/pid (the kernel's word) and the hello's client text;
                    # None for a namespace adopted from an earlier run
                    creator=ns.creator)
        namespaces[name] = snap
    daemon: dict[str, Any] = {
        "version": hisparse.__version__, "pid": os.getpid(),
        "uptime_s": time.monotonic() - ctx.started_s,
        # Engines' sessions (those `hisparsectl sessions` lists); hisparsectl's own, and any
        # other session without a namespace, apart.
        "sessions": sum(1 for s in ctx.sessions.sessions.values() if s.namespace is not None),
        "control_sessions": sum(1 for s in ctx.sessions.sessions.values() if s.namespace is None),
        "sessions_expired": ctx.sessions.expired_total,
        "lease_ttl_s": ctx.sessions.lease_ttl_s,
        "metrics_address": ctx.config.metrics_endpoint,
        "requests": ctx.requests_total, "errors": ctx.errors_total,
        "requests_in_slices": ctx.requests_in_slices, "request_slices": ctx.request_slices_total,
        "evicted_pages": sum(ns.index.counters.evicted_pages for ns in ctx.registry.namespaces.values()),
        "fenced_sessions": len(ctx.sessions.zombies),
        "fenced_sessions_released": ctx.sessions.zombies_released_total,
    }
    daemon.update(ctx.registry.stats())
    daemon.update(ctx.transport_stats())
    daemon["cluster"] = ctx.cluster.stats() if ctx.cluster is not None else {"backend": "none"}
    body: dict[str, Any] = {"daemon": daemon, "namespaces": namespaces}
    if session is not None and session.namespace is None:  # hisparsectl: who holds what, stalled ones included
        body["sessions"] = [row for row in session_rows(ctx) if row["namespace"] in namespaces]
    return body

