"""The host pool's lookups: other engines' pages, pinned before vLLM may hit them.

``LookupPins`` is a mixin of ``hisparse_pool.DaemonHostBlockPool``. vLLM
walks a request's block hashes on its scheduler thread; a page another
engine published is a hit only once this engine pins it, so the walk first
pins the run of keys the key mirror (``mirror.KeyMirror``) shows committed,
in one ``pin`` request. The mirror's refresh and the pin go through the
pool's courier, and the walk waits for their answers only within the step's
budget while the daemon answers: a late answer becomes lookup pins that the
next flush drops, and no answer is a miss (a recompute), never a wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hisparse.vllm.courier import Job
from hisparse.vllm.host_batches import NULL_PAGE

Session = Any  # hisparse.client.client.ClientSession


class LookupPins:
    """See the module docstring; state lives in the pool (``_lookup``, ``_pinned``, ...)."""

    _lookup: set[int]
    _pinned: dict[int, tuple[Session, bytes]]
    _reserved: dict[int, tuple[Session, bytes]]
    _orphans: set[int]
    _unpins_next: list[tuple[Session, int]]
    _mirror: Any
    _ops: Any
    _courier: Any
    _fences: Any
    _lock: Any
    _budget_s: float
    counters: dict[str, int]
    blocks: list[Any]
    block_size: int
    cached_block_hash_to_block: Any
    # and, from DaemonHostBlockPool and vLLM's BlockPool: _submit, _wait, _collect,
    # _forget_hash, _insert_block_hash
    _submit: Callable[..., Job]
    _wait: Callable[[Job, float], bool]
    _collect: Callable[[], None]
    _forget_hash: Callable[[Any], None]
    _insert_block_hash: Callable[..., None]
    _addresses_worker_region: Callable[[Any], bool]
    tier_left: str | None

    def pin_prefix(self, keys: Sequence[bytes]) -> int:
        """Pin the pages of another engine that continue this engine's prefix of ``keys``.

        ``keys``: the request's host-group keys (block hash + group id), in
        order. Keys this pool already holds are skipped; the run after them
        that the mirror shows committed is pinned in one request, and those
        pages become hits for ``get_cached_block`` until the next flush
        (or for as long as a request holds them). Returns the pages pinned
        in time: an answer later than the step's budget becomes lookup pins
        the next flush drops. Nothing while the daemon does not answer.
        """
        if not self._courier.answering or self.tier_left is not None:
            return 0
        if self._mirror.due():
            job = self._submit(self._mirror.fetch, lambda done: done.error or self._mirror.apply(done.result))
            self._wait(job, self._budget_s)
        with self._lock:
            self._collect()
            todo: list[tuple[int, bytes]] = []
            for i, key in enumerate(keys):
                if self.cached_block_hash_to_block.get_one_block(key) is not None:
                    if todo:
                        break
                    continue
                page = self._mirror.get(key)
                if page is None or page == NULL_PAGE:
                    break
                todo.append((i, key))
        if not todo or not self._courier.answering:
            return 0
        pinned: list[int] = []
        job = self._submit(lambda: self._ops.pin_each([key for _, key in todo]),
                           lambda done: pinned.append(self._apply_pins(todo, done)))
        self._wait(job, self._budget_s)
        with self._lock:
            self._collect()
        return pinned[0] if pinned else 0

    def _apply_pins(self, todo: list[tuple[int, bytes]], job: Job) -> int:
        if job.error is not None:
            return 0
        pages, session = job.result
        self.counters["pin_requests"] += 1
        if not self._addresses_worker_region(session):
            return 0  # pages of a new region: the pool left the tier (region_guard)
        if not self._fences.hold(session):
            return 0  # its fence was let go: those pages may be anyone's now (fences.SessionFences)
        pinned = 0
        hole = False
        for (i, key), page in zip(todo, pages):
            if page < 0:
                self.counters["lookup_pin_misses"] += 1
                self._mirror.pages.pop(key, None)
                hole = True
                continue
            if (hole or page == NULL_PAGE or page in self._reserved or page in self._pinned
                    or page in self._orphans or self.blocks[page].block_hash is not None):
                self._unpins_next.append((session, page))  # past a hole, or already ours
                continue
            block = self.blocks[page]
            assert block.ref_cnt == 0, block
            self._insert_block_hash(key, block, num_tokens=(i + 1) * self.block_size)
            self._pinned[page] = (session, key)
            self._lookup.add(page)
            pinned += 1
        self.counters["lookup_pins"] += pinned
        return pinned

    def _drop_lookup_pins(self) -> None:
        """Lookup pins no request took by now are released (a step later)."""
        for page in self._lookup:
            session, _ = self._pinned.pop(page)
            self._unpins_next.append((session, page))
            self._forget_hash(self.blocks[page])
        self._lookup.clear()
