"""The start-up fence sweep, run a slice at a time while the daemon already serves.

An earlier run leaves one fence file per session it had (``sessions.py``):
each must be adopted (its pages stay fenced while its process may live on)
or removed. Before, all of them were swept before the socket was bound:
10,000 files from a hello flood kept the socket shut for 31 s. Now at most
``BEFORE_BIND_S`` is swept before the socket is bound (all of a usual
restart's few); the sweep takes the list of files as it was at start
(a fence made by this run is never swept) and handles them in slices of at
most ``SLICE_S`` of loop time, yielding to requests between slices.

Until it ends, a page must not be handed to anyone: a page the sweep has not
reached may still be fenced for a living process. So the ops that take or
free pages (``GATED_OPS``) wait for the sweep (at most ``MAX_WAITING`` of
them; more get ``QUOTA_EXCEEDED``) and run when it is done; everything else
(ping, hello, lookup, pin of committed pages, stats ...) is served at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from hisparse.daemon.store.sessions import SessionTable, fence_paths
from hisparse.protocol import ErrorCode, Op, WireError

log = logging.getLogger(__name__)

SLICE_S = 0.005
BEFORE_BIND_S = 0.05  # swept before the socket is bound: a usual restart's fences, all of them
MAX_WAITING = 1024
GATED_OPS = frozenset({Op.RESERVE, Op.PREFETCH, Op.CLEAR, Op.DROP, Op.EVICT_SESSION})


class FenceSweep:
    def __init__(self, sessions: SessionTable, fence_dir: str, registry: Any) -> None:
        self.sessions = sessions
        self.registry = registry
        self.paths = sorted(fence_paths(fence_dir))  # this run's fences are made after: never swept
        self.total = len(self.paths)
        self.adopted = self.removed = 0
        self.waiting = 0
        self.done: asyncio.Future | None = None

    @property
    def running(self) -> bool:
        return bool(self.paths) or (self.done is not None and not self.done.done())

    def sweep_for(self, seconds: float) -> None:
        """Sweep before the socket is bound, for at most ``seconds`` (a usual restart's few
        fences are all swept before the first request, as before)."""
        deadline = time.monotonic() + seconds
        while self.paths and time.monotonic() < deadline:
            self._one(self.paths.pop())

    def _one(self, path: str) -> None:
        if os.path.lexists(path):
            outcome = self.sessions.adopt_fence(path, self.registry)
            self.adopted += outcome == "adopted"
            self.removed += outcome == "removed"

    async def run(self) -> None:
        """Sweep every listed file, a slice at a time; then release what waited."""
        if self.done is None:
            self.done = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        try:
            while self.paths:
                deadline = time.monotonic() + SLICE_S
                while self.paths and time.monotonic() < deadline:
                    self._one(self.paths.pop())
                await asyncio.sleep(0)
        finally:
            self.done.set_result(None)
        if self.total:
            log.info("fences of the earlier run: %d, swept in %.2fs after the socket was bound; %d still held "
                     "(their pages stay fenced), %d released", self.total,
                     time.monotonic() - started, self.adopted, self.removed)

    def after(self, run: Callable[[], Any], still_valid: Callable[[], bool]) -> Any:
        """A ``Deferred`` whose reply is ``run()``'s, once the sweep is done."""
        from hisparse.daemon.ops.handlers import Deferred

        if self.waiting >= MAX_WAITING:
            raise WireError(ErrorCode.QUOTA_EXCEEDED, f"{self.waiting} requests already wait for the "
                            f"start-up fence sweep ({len(self.paths)} of {self.total} files left); retry")
        if self.done is None:
            self.done = asyncio.get_running_loop().create_future()
        self.waiting += 1
        outer = self.done.get_loop().create_future()

        def start(_: Any) -> None:
            self.waiting -= 1
            try:
                if not still_valid():
                    raise WireError(ErrorCode.UNKNOWN_SESSION, "the session ended while its request "
                                    "waited for the start-up fence sweep; send hello again")
                body = run()
            except BaseException as exc:
                outer.set_exception(exc)
                return
            if not isinstance(body, Deferred):
                outer.set_result(body)
                return
            body.future.add_done_callback(lambda f: _settle(outer, body, f))

        self.done.add_done_callback(start)
        return Deferred(outer, lambda body: body, lambda exc: exc if isinstance(exc, WireError) else None)


def _settle(outer: asyncio.Future, inner: Any, future: Any) -> None:
    """Finish ``outer`` as the server would have finished the inner ``Deferred``."""
    try:
        exc = future.exception() if not future.cancelled() else RuntimeError("cancelled")
        if exc is not None:
            raise inner.errors(exc) or exc
        outer.set_result(inner.finish(future.result()))
    except BaseException as exc:
        outer.set_exception(exc)
