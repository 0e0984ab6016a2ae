"""The host pool's region binding: the scheduler addresses the region its worker maps, or leaves the tier.

vLLM's HiSparse worker maps the namespace's region once
(``RegionHostPool.allocate``), registers it with the driver and may
capture its addresses in CUDA graphs: it cannot follow the namespace to
another region. The scheduler's client can: after ``hisparsectl drop
--force``, a ``--fresh`` restart or a restart that resizes the namespace,
its next request re-attaches and the daemon hands it a new region (a new
``region_id``). A page id there is not the page the worker wrote, so a
publish would commit another region's bytes (zeros) under this engine's
keys, and a pin would have the worker read bytes it never loaded.

The rule (``RegionBinding``, a mixin of ``DaemonHostBlockPool``):

- the pool is bound to one region: its first session's, which vLLM's
  handshake checks against the region every worker mapped
  (``bind_worker_regions``; a change between the worker's start and the
  scheduler's refuses the start: ``RegionChanged``);
- every session that enters the pool (a reserve, a pin) and every pruning
  of lost sessions is checked first, so a change is noticed before any
  page of the new region is used or published;
- on a change the pool leaves the tier for the rest of the process: no
  daemon request any more (nothing published, pinned, looked up or
  reserved), its client closed in the background (the bye gives back what
  it held on the new region), one warning, ``counters["region_changes"]``
  and ``tier_left`` say so. Re-binding is not possible: the worker's
  mapping is registered and captured.
- The engine keeps serving on the pages it held in the old region, which
  the daemon no longer hands out and no other process writes: its
  reservations (the stock and blocks in use) go back to a private stock
  when freed; pages committed there (its own published ones, others' it
  pinned) stay readable while a block uses them and are never reused
  (another engine may still read them). Admission is then bounded by those
  pages; restarting the engine puts it on the tier again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from hisparse.errors import InvalidArgument

log = logging.getLogger(__name__)

RegionKey = tuple[str, int]  # (region file path, region_id), as hisparse.client.regions keys mappings;
# region_id (random, new whenever the daemon creates the file) is what identifies the region
Session = Any  # hisparse.client.client.ClientSession


class RegionChanged(InvalidArgument):
    """The worker maps another region of the namespace than the scheduler's client attached to."""


class RegionBinding:
    """See the module docstring; works on ``DaemonHostBlockPool``'s records."""

    _ops: Any
    _to_publish: dict[int, bytes]
    _duplicates: set[int]
    _unpins_now: list[tuple[Session, int]]
    _unpins_next: list[tuple[Session, int]]
    _withheld: list[tuple[Session, int]]
    _reserved: dict[int, tuple[Session, bytes]]
    _pinned: dict[int, tuple[Session, bytes]]
    _fences: Any
    counters: dict[str, int]
    blocks: list[Any]
    # and, from DaemonHostBlockPool: _release(page)

    def _bind_region(self) -> None:
        """Bind to the current session's region (at construction, before any request)."""
        self._bound_region: RegionKey = tuple(self._ops.session().region_key)  # type: ignore[assignment]
        self.tier_left: str | None = None  # why the pool left the tier, once it has
        self.counters.setdefault("region_changes", 0)

    def bind_worker_regions(self, worker_regions: Iterable[RegionKey]) -> None:
        """vLLM's handshake: the region each worker mapped must be the one this pool is bound to.

        Raises ``RegionChanged`` when one differs: the namespace got a new region
        between the worker's start and the scheduler's, and none of this engine's
        pages could be published or loaded. Called again later (a wake-up), it
        changes nothing: the workers' mappings never move.
        """
        wrong = {tuple(key) for key in worker_regions if key[1] != self._bound_region[1]}
        if wrong:
            raise RegionChanged(
                f"hisparsed namespace {self._ops.client.namespace!r}: the worker maps region "
                f"{_describe(sorted(wrong))}, the scheduler attached to {_describe([self._bound_region])} "
                "(dropped or re-created while the engine started); start the engine again")

    def _region_moved(self) -> bool:
        """True once the client's current session maps another region (the pool then leaves the tier)."""
        return self.tier_left is not None or not self._addresses_worker_region(self._ops.session())

    def _addresses_worker_region(self, session: Session) -> bool:
        """Whether ``session`` maps the worker's region; if not, the pool leaves the tier now."""
        if self.tier_left is not None:
            return False
        if session.region_key[1] == self._bound_region[1]:
            return True  # the same region_id: the same file (a legacy one moved into its directory too)
        self._leave_tier(tuple(session.region_key))
        return False

    def _leave_tier(self, now: RegionKey) -> None:
        held = len(self._reserved)
        self.tier_left = (f"the namespace's region changed from {_describe([self._bound_region])} to "
                          f"{_describe([now])} (hisparsectl drop --force, a --fresh restart or a resize); "
                          "the worker maps the old one: restart this engine to use the tier again")
        self.counters["region_changes"] += 1
        log.warning("hisparse host pool leaves the tier: %s. Until then nothing is published or "
                    "loaded; the engine serves on the %d host pages it reserved there",
                    self.tier_left, held)
        # Never published: these blocks' bytes are in the old region only. Those freed while
        # their publish was queued go back to the stock; the others when they are freed.
        waiting, self._to_publish = self._to_publish, {}
        self._duplicates.clear()  # plain reservations now
        for page in waiting:
            if self.blocks[page].ref_cnt == 0:
                self._release(page)
        # Lookup pins stay: their pages are committed in the old region (a request of this very
        # pass may touch them), and the flush lets them go as usual.
        for queue in (self._unpins_now, self._unpins_next, self._withheld):
            queue.clear()  # releases of the old region's sessions: the daemon forgot them
        # The daemon hands out none of the old region's pages any more: no fence is needed,
        # and the worker stops locking them (fence_paths() is empty from now on).
        self._fences.close()
        # The bye gives back what the client holds on the new region (the reserve or pin that
        # showed the change); off the scheduler's thread, which must not wait on the daemon.
        threading.Thread(target=self._ops.client.close, name="hisparse-leave-tier", daemon=True).start()


def _describe(keys: list[Any]) -> str:
    return ", ".join(f"{int(region_id):016x} ({path})" for path, region_id in keys)
