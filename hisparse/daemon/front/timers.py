"""The daemon's timers, tasks on its event loop beside the request path.

- the lease reaper: sessions whose lease ran out, zombies whose fences were
  let go, refusals whose time is up, and (every ``FD_RECOUNT_INTERVAL_S``) a
  real count of descriptors and the door's regulation;
- the eviction log: one line per namespace every ``EVICTION_LOG_INTERVAL_S``
  instead of one per eviction;
- the loop's lag: how late a timer fires, for the metrics;
- readiness, then systemd's watchdog, fed while the loop runs.

Each catches its own errors and goes on: a timer never stops the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from hisparse.daemon.front import notify
from hisparse.daemon.policy.limits import FD_RECOUNT_INTERVAL_S

if TYPE_CHECKING:
    from hisparse.daemon.front.connections import ConnectionGuard
    from hisparse.daemon.ops.handlers import DaemonContext

log = logging.getLogger("hisparse.daemon.front.server")  # the lines operators grep for keep their source

REAP_INTERVAL_S = 0.2
EVICTION_LOG_INTERVAL_S = 5.0
LAG_INTERVAL_S = 0.5


async def reaper(ctx: DaemonContext, guard: ConnectionGuard) -> None:
    recounted_s = time.monotonic()
    limits = guard.limits
    while True:
        await asyncio.sleep(min(REAP_INTERVAL_S, ctx.sessions.lease_ttl_s / 4))
        try:
            reap(ctx)
            guard.expire_refusals()
            if time.monotonic() - recounted_s > FD_RECOUNT_INTERVAL_S:
                recounted_s = time.monotonic()
                limits.recount_fds()
                limits.forget_idle_peers()
                guard.regulate()
        except Exception:
            log.error("error in the lease reaper; serving on", exc_info=True)


def reap(ctx: DaemonContext) -> None:
    """End the sessions whose lease ran out, and free the fences their processes let go."""
    sessions = ctx.sessions
    for session, zombie in sessions.expire():
        if zombie is None:
            log.info("lease expired: %s silent for %.1fs; its pages are free (its process "
                     "holds no fence)", session.describe(), sessions.lease_ttl_s)
        else:
            log.warning("lease expired: %s silent for %.1fs; %d reserved pages and %d pinned "
                        "pages stay fenced until its process exits or lets go",
                        session.describe(), sessions.lease_ttl_s, len(zombie.fenced_pages),
                        len(zombie.pins))
    for zombie, freed, dropped in sessions.reap_zombies():
        log.info("fence released: %s; %d fenced pages freed, %d pins dropped",
                 zombie.describe(), freed, dropped)


async def loop_lag(ctx: DaemonContext) -> None:
    """How late a timer fires: the event loop's lag, for the metrics."""
    loop = asyncio.get_running_loop()
    while True:
        due_s = loop.time() + LAG_INTERVAL_S
        await asyncio.sleep(LAG_INTERVAL_S)
        ctx.opstats.lag(max(0, int((loop.time() - due_s) * 1e9)))


async def eviction_log(ctx: DaemonContext) -> None:
    while True:
        await asyncio.sleep(EVICTION_LOG_INTERVAL_S)
        pending = ctx.evictions_since_log
        for name, count in list(pending.items()):
            log.info("evicted %d pages of %r in the last %.0fs", count, name, EVICTION_LOG_INTERVAL_S)
        pending.clear()


async def ready_then_watchdog(on_ready) -> None:
    """Announce readiness, then keep systemd's watchdog fed while this loop runs."""
    if on_ready is not None:
        await on_ready()
    interval_s = notify.watchdog_interval_s()
    while interval_s:
        notify.notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
