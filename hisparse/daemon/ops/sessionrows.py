"""The admin's view of sessions (``hisparsectl stats`` / ``sessions``): who holds what, and which pids.

``pids`` are the processes the kernel shows holding each session's fence
(``proclocks``: a forked child of a dead engine too); ``pids_unverified``
the lockers ``/proc/locks`` names whose holders the daemon cannot see.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hisparse.daemon.policy.proclocks import FenceHolders

if TYPE_CHECKING:
    from hisparse.daemon.ops.context import DaemonContext

_FENCE_HOLDERS = FenceHolders()


def session_rows(ctx: DaemonContext) -> list[dict[str, Any]]:
    now_s, now_unix = time.monotonic(), time.time()
    # every process that holds each fence, a forked child of a dead engine too
    fences = [s.fence for s in ctx.sessions.sessions.values() if s.namespace is not None and s.fence]
    fences += [z.fence for z in ctx.sessions.zombies.values()]
    holders = _FENCE_HOLDERS.of({f.inode() for f in fences})
    rows: list[dict[str, Any]] = []
    for s in ctx.sessions.sessions.values():
        if s.namespace is None or s.fence is None:
            continue
        rows.append({"handle": s.handle, "namespace": s.namespace.name, "client": s.client,
                     "state": "live", **_pids(holders, s.fence.inode()),
                     "age_s": now_s - s.opened_s, "idle_s": now_s - s.last_seen_s,
                     "reserved_pages": len(s.reservations), "pinned_pages": s.pinned_pages,
                     "fenced_pages": 0})
    for z in ctx.sessions.zombies.values():
        rows.append({"handle": z.handle, "namespace": z.namespace.name, "client": z.client,
                     "state": "fenced", "reason": z.reason,
                     **_pids(holders, z.fence.inode()),
                     "age_s": max(0.0, now_unix - z.opened_unix_s), "idle_s": now_s - z.ended_s,
                     "reserved_pages": 0, "pinned_pages": len(z.pins),
                     "fenced_pages": len(z.fenced_pages)})
    return rows


def _pids(holders: dict, inode: tuple[int, int, int]) -> dict[str, list[int]]:
    found = holders.get(inode)
    return {"pids": found.pids if found else [], "pids_unverified": found.unverified if found else []}
