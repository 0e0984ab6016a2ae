"""A dropped namespace leaves the cluster tier: its queue entries, its registration, its mapping.

The tier maps every region it serves (and registers it with the transfer
engine: pinned memory under RDMA). A dropped namespace's region file is
unlinked, but its memory comes back only once every mapping of it is gone,
the tier's included. So a drop (``Registry.on_drop``, on the loop) forgets
the namespace's queued pages at once and hands its space to the worker,
which unregisters and unmaps it between two jobs (a promotion's rounds are
jobs apart: ``cluster_promote.promote``), when no put or get is using it,
whether the cluster is up or not.
"""

from __future__ import annotations

import logging
from collections import deque

from hisparse.daemon.cluster.state import Space, TierState
from hisparse.daemon.store.namespaces import Namespace

log = logging.getLogger(__name__)


def dropped(tier: TierState, ns: Namespace) -> None:
    """The loop side: ``ns`` was dropped; its space is unmapped by the worker before its next job."""
    space = tier._spaces.get(ns.name)
    if space is None or space.ns is not ns:
        return
    del tier._spaces[ns.name]
    retire(tier, space, unmap=True)


def retire(tier: TierState, space: Space, unmap: bool = False) -> None:
    """The loop side: ``space``'s namespace is gone (dropped, or dropped and made again). Its
    queued puts are forgotten, the index calls asked of the loop for it do nothing, and its
    promotion stops at the next round; with ``unmap``, the worker unmaps it before its next
    job (else its mapping goes with the last job still using it, never under one)."""
    space.dropped = True
    with tier._cond:
        tier._queue = deque(e for e in tier._queue if e[0] is not space)
        space.queued.clear()
        if unmap:
            tier._forget.append(space)
            tier._cond.notify()


def forget(tier: TierState, space: Space) -> None:
    """The worker side, between jobs: unregister the region and unmap it."""
    backend = tier._backend
    if backend is not None:
        try:
            backend.unregister(space.region.address, space.ns.geometry.size_bytes)
        except Exception as exc:  # a cluster that is down: the registration goes with the connection
            log.warning("unregistering the region of dropped namespace %r: %s", space.ns.name, exc)
    space.held.clear()
    space.region.close()
    log.info("cluster tier: dropped namespace %r unmapped", space.ns.name)
