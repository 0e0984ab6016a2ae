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
from hisparse.daemon.proclocks import lock_holders

if TYPE_CHECKING:
    from hisparse.daemon.handlers import DaemonContext
    from hisparse.daemon.sessions import Session
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
        "sessions": len(ctx.sessions.sessions),
        "sessions_expired": ctx.sessions.expired_total,
        "lease_ttl_s": ctx.sessions.lease_ttl_s,
        "metrics_address": ctx.config.metrics_endpoint,
        "requests": ctx.requests_total, "errors": ctx.errors_total,
        "evicted_pages": sum(ns.index.counters.evicted_pages for ns in ctx.registry.namespaces.values()),
        "fenced_sessions": len(ctx.sessions.zombies),
        "fenced_sessions_released": ctx.sessions.zombies_released_total,
    }
    daemon.update(ctx.registry.stats())
    daemon.update(ctx.transport_stats())
    daemon["cluster"] = ctx.cluster.stats() if ctx.cluster is not None else {"backend": "none"}
    body: dict[str, Any] = {"daemon": daemon, "namespaces": namespaces}
    if session is not None and session.namespace is None:  # hisparsectl: who holds what, stalled ones included
        body["sessions"] = [row for row in _session_rows(ctx) if row["namespace"] in namespaces]
    return body


def _session_rows(ctx: DaemonContext) -> list[dict[str, Any]]:
    now_s, now_unix = time.monotonic(), time.time()
    holders = lock_holders()
    rows: list[dict[str, Any]] = []
    for s in ctx.sessions.sessions.values():
        if s.namespace is None or s.fence is None:
            continue
        rows.append({"handle": s.handle, "namespace": s.namespace.name, "client": s.client,
                     "state": "live", "pids": holders.get(s.fence.inode(), []),
                     "age_s": now_s - s.opened_s, "idle_s": now_s - s.last_seen_s,
                     "reserved_pages": len(s.reservations), "pinned_pages": s.pinned_pages,
                     "fenced_pages": 0})
    for z in ctx.sessions.zombies.values():
        rows.append({"handle": z.handle, "namespace": z.namespace.name, "client": z.client,
                     "state": "fenced", "reason": z.reason,
                     "pids": holders.get(z.fence.inode(), []),
                     "age_s": max(0.0, now_unix - z.opened_unix_s), "idle_s": now_s - z.ended_s,
                     "reserved_pages": 0, "pinned_pages": len(z.pins),
                     "fenced_pages": len(z.fenced_pages)})
    return rows
