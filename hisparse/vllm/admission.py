"""Admission to the shared host pool that accounts for growth: back-pressure before preemption.

vLLM's HiSparse spills every page of a running request to a host block, so a
request's host blocks grow with every decode step until it finishes. With a
private pool vLLM sizes the pool for at least one full-length request and
preempts (recomputes) when the pool runs out. On a hisparsed namespace every
engine of the node draws on one region, and a page another engine took is
not there to grow into. The rule here:

- **Growth is held.** Each admitted request's *final* length is known
  (prompt + ``max_tokens``, at most ``max_model_len``); the pages it still
  needs to get there are kept reserved in this engine's stock
  (``Growth.wanted_pages``), so no other engine can take them and no
  running request of this engine is ever preempted for want of a host page
  while the daemon keeps its reservations.
- **New work waits instead.** A waiting (or preempted) request is admitted
  only when the stock covers its blocks now, its own growth and the growth
  held for every running request (``DaemonHostBlockPool.admission_view``);
  else vLLM keeps it waiting (back-pressure) and the pool asks the daemon
  for the shortfall (``ensure_free``).
- **A floor.** An engine keeps at least one full-length request's pages
  (``max_model_len`` / block size), its own blocks in use included, as
  vLLM's private pool guarantees: once it has them, a long request never
  waits on other engines. It keeps them with nothing running too, idle
  included (the idle release trims the stock down to the floor, not to
  zero), so an engine that leaves the tier (``region_guard``) still has a
  full-length request's pages to serve with. The price: N idle engines hold
  N floors, and where the region is smaller than the engines' floors
  together, the engines that got none wait for pages the others keep.

Preemption stays vLLM's last resort: only what the daemon takes back (a
restart loses the stock) can make a running request short.

``reserve_before_admission`` installs the check on the host group's manager;
``account_for_growth`` tells it which requests run and how long they get.
"""

from __future__ import annotations

from typing import Any

from vllm.utils.math_utils import cdiv


class Growth:
    """The running requests of one engine and the host pages they will still need."""

    def __init__(self, host_manager: Any, *, block_size: int, max_model_len: int) -> None:
        self._manager = host_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.floor_pages = cdiv(max_model_len, block_size)
        self.final_pages: dict[str, int] = {}  # running request -> host pages at its end
        self.admitting: tuple[str, int] | None = None  # (request, its final tokens) during a check

    def final_tokens(self, request: Any) -> int:
        return min(int(request.num_prompt_tokens) + int(request.max_tokens), self.max_model_len)

    def running(self) -> bool:
        return bool(self.final_pages)

    def held_pages(self, request_id: str) -> int:
        return len(self._manager.req_to_blocks.get(request_id, ()))

    def growth_pages(self) -> int:
        """Pages the running requests still need to reach their final length."""
        # a copy: the courier's idle release reads this while vLLM's thread may admit
        return sum(max(0, final - self.held_pages(r)) for r, final in list(self.final_pages.items()))

    def wanted_pages(self) -> int:
        """Stock to keep: the running requests' growth, at least the floor less their blocks
        in use (the whole floor when none runs)."""
        in_use = sum(self.held_pages(r) for r in list(self.final_pages))
        return max(self.growth_pages(), self.floor_pages - in_use)

    def held_back(self, request_id: str, num_tokens: int) -> int:
        """Stock an admission of ``request_id`` must leave untouched: 0 for a running request;
        for a new one, the growth of the running ones and its own beyond ``num_tokens``."""
        if self.admitting is None or self.admitting[0] != request_id:
            return 0
        own = max(0, cdiv(self.admitting[1], self.block_size) - cdiv(num_tokens, self.block_size))
        return self.growth_pages() + own


def reserve_before_admission(manager: Any, pool: Any) -> None:
    """Have the host group's admission check see exactly what ``get_new_blocks`` can give.

    vLLM compares the blocks a request needs (new ones, plus hit blocks
    nobody references, which touching takes out of a free list) with
    ``get_num_free_blocks``. Here new blocks come from the stock only, hit
    blocks are pages this pool already holds (lookup pins, blocks whose
    publish is queued), and a new request must leave the running requests'
    growth untouched (``Growth``): the check gets that view for its call,
    and the pool reserves the shortfall first, one request, waiting for the
    answer only within the step's budget.
    """
    original = manager.get_num_blocks_to_allocate
    block_size = manager.block_size

    def get_num_blocks_to_allocate(request_id: str, num_tokens: int, new_computed_blocks: Any,
                                   *args: Any, **kwargs: Any) -> int:
        held = len(manager.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        held_back = pool.growth.held_back(request_id, num_tokens) if pool.growth is not None else 0
        credit = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        pool.ensure_free(max(0, cdiv(num_tokens, block_size) - held) + held_back)
        pool.admission_view(credit, held_back)
        try:
            return original(request_id, num_tokens, new_computed_blocks, *args, **kwargs)
        finally:
            pool.admission_view(0, 0)

    manager.get_num_blocks_to_allocate = get_num_blocks_to_allocate


def account_for_growth(kv_cache_manager: Any, host_manager: Any, pool: Any, *, max_model_len: int) -> Growth:
    """Follow vLLM's allocations and frees on ``kv_cache_manager`` so the pool knows which
    requests run and how long each may grow (``Growth``)."""
    growth = Growth(host_manager, block_size=host_manager.block_size, max_model_len=max_model_len)
    pool.growth = growth
    allocate = kv_cache_manager.allocate_slots
    free = kv_cache_manager.free
    pop_blocks = kv_cache_manager.pop_blocks_for_free  # a deferred free (asynchronous scheduling)

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        new = request.request_id not in growth.final_pages
        final_tokens = growth.final_tokens(request)
        growth.admitting = (request.request_id, final_tokens) if new else None
        try:
            blocks = allocate(request, *args, **kwargs)
        finally:
            growth.admitting = None
        if blocks is not None and new:
            growth.final_pages[request.request_id] = cdiv(final_tokens, growth.block_size)
        return blocks

    def free_request(request: Any) -> None:
        free(request)
        growth.final_pages.pop(request.request_id, None)

    def pop_blocks_for_free(request: Any) -> Any:
        growth.final_pages.pop(request.request_id, None)
        return pop_blocks(request)

    kv_cache_manager.allocate_slots = allocate_slots
    kv_cache_manager.free = free_request
    kv_cache_manager.pop_blocks_for_free = pop_blocks_for_free
    return growth
