"""The shared HiSparse host pool under pressure, on vLLM's real Scheduler, with the shipped defaults.

Engines (``tests/vllm_hisparse/real_engine.py``: vLLM's ``Scheduler`` building
our ``HiSparseConnector``; a stand-in worker completes every spill) draw on
one 40-page region. Every request is a 3-block prompt that decodes to 5
blocks, so eight of them need more than the region (and the daemon's default
quotas give each engine half of it while another engine asks and gets fewer). What vLLM's private pool guarantees must
hold here too: every request finishes, nothing raises out of ``schedule()``,
and, with growth held for running requests (``hisparse.vllm.admission``), no
request is preempted; once the engines go idle they give back all but their
floor (one full-length request's pages).
"""

from __future__ import annotations

import pytest

from hisparse.vllm.courier import IDLE_RELEASE_S
from tests.vllm_hisparse.pressure import Workload, drive, make_engines
from tests.vllm_hisparse.real_engine import BLOCK_TOKENS, Engine
from tests.waiting import wait_for

REGION_PAGES = 40
WORKLOAD = Workload(requests_per_engine=8, prompt_blocks=3, final_blocks=5, max_model_len=384)


def namespace_holds(engine: Engine) -> tuple[int, int]:
    """(reserved, pinned) pages of the engine's namespace, as the daemon counts them."""
    client = engine.pool._ops.client
    stats = client.stats()["namespaces"][client.namespace]
    return int(stats["writing_pages"]), int(stats["pinned_pages"])


@pytest.mark.parametrize("count", [1, 2, 4])
def test_engines_growing_past_the_region_finish_every_request_and_preempt_none(
        hisparsed, model_dir, closing, count):
    engines = closing(make_engines(hisparsed.socket, model_dir, count, region_pages=REGION_PAGES,
                                   workload=WORKLOAD))
    assert engines[0].pool._ops.client.num_pages == REGION_PAGES
    result = drive(engines, WORKLOAD, max_steps=6000, deadline_s=600)
    assert result.exceptions == []
    assert result.finished == result.requests == 8 * count, result.row()
    # growth is held for every admitted request: back-pressure, never a preemption
    assert result.preemptions == 0 and result.recomputed_tokens == 0, result.row()
    # every page each request spilled was published, holding its tokens' bytes
    assert sum(e.pool.counters["published"] for e in engines) == 8 * count * (WORKLOAD.final_blocks - 1)


def test_idle_engines_hold_at_most_their_floor_and_send_their_unpins(hisparsed, model_dir, closing):
    engines = closing(make_engines(hisparsed.socket, model_dir, 2, region_pages=REGION_PAGES,
                                   workload=WORKLOAD))
    result = drive(engines, WORKLOAD, max_steps=6000, deadline_s=600)
    assert result.finished == result.requests
    floor_pages = WORKLOAD.max_model_len // BLOCK_TOKENS  # one full-length request
    assert all(e.pool.growth.floor_pages == floor_pages for e in engines)
    # vLLM does not step an engine without requests: nothing flushes any more, and
    # within a bounded time (a few times IDLE_RELEASE_S) each pool sends its queued
    # unpins and brings its stock to its floor, no more (kept so that an engine that
    # leaves the tier can still serve: region_guard); page 0 stays withheld by the engine
    # that drew it (one page). Before, idle engines kept their whole stock and queued unpins.
    def released() -> bool:
        reserved, pinned = namespace_holds(engines[0])
        return (pinned == 0 and reserved <= len(engines) * floor_pages + 1
                and all(e.pool.held_pages == floor_pages for e in engines))

    wait_for(released, "idle engines holding their floor, page 0 and nothing more",
             timeout_s=10 * IDLE_RELEASE_S + 10)


def test_a_lookup_that_waits_for_the_indexer_never_lends_its_pins_to_another_request(
        hisparsed, model_dir, closing):
    # MultiConnector[our HiSparseConnector, OffloadingConnector]: A's lookup pins
    # B's pages of a shared prompt, the indexer connector answers RETRY (its own pins
    # are not taken yet) so vLLM skips A's request, and in the same pass another
    # request is admitted. Its blocks must come from pages the pool can hand out,
    # not from the lookup's pins: get_new_blocks raising would kill the engine.
    workload = Workload(max_model_len=512)
    (b,) = make_engines(hisparsed.socket, model_dir, 1, region_pages=REGION_PAGES, workload=workload,
                        with_indexer=True)
    shared = list(range(5000, 5000 + 6 * BLOCK_TOKENS))
    try:
        b.add("b1", shared, max_tokens=1)
        b.run(max_steps=100)
        # steps flush what the finished request queued: its pages are published
        wait_for(lambda: b.step() is not None and b.pool.counters["published"] == 6, "B's pages published")
    finally:
        b.close()
    # another tenant of the uid takes what the daemon gives it, leaving room for the pins only
    hog = _Hog(hisparsed.socket, b, leave_pages=5)
    try:
        (a,) = closing(make_engines(hisparsed.socket, model_dir, 1, region_pages=REGION_PAGES,
                                    workload=workload, with_indexer=True))
        a.add("a-shared", shared, max_tokens=1)
        a.add("a-new", list(range(9000, 9000 + 3 * BLOCK_TOKENS)), max_tokens=1)
        for _ in range(20):
            a.step()  # raised ValueError: Cannot get 3 free blocks from the pool
            # the free count is what get_new_blocks can hand out: the stock, never the lookup pins
            assert a.pool.get_num_free_blocks() == len(a.pool._stock)
        hog.close()  # room again: both requests run
        a.run(max_steps=500)
    finally:
        hog.close()


class _Hog:
    """A session of the same uid on the engine's namespace reserving all the daemon gives it."""

    def __init__(self, socket: str, engine: Engine, *, leave_pages: int) -> None:
        from hisparse.client import attach
        from hisparse.errors import QuotaExceeded
        from hisparse.vllm.rpc import NamespaceOps

        client = engine.pool._ops.client
        self.client = attach(client.namespace, client.layout, socket, name="hog")
        self.ops = NamespaceOps(self.client)
        self.keys: list[bytes] = []
        while True:
            batch = [b"hog-%08d" % (len(self.keys) + i) for i in range(8)]
            try:
                slots, _, _ = self.ops.reserve(batch)
            except QuotaExceeded:
                break
            self.keys.extend(batch[:len(slots)])
            if len(slots) < len(batch):
                break
        self.ops.abort(self.client.session, self.keys[:leave_pages])
        self.keys = self.keys[leave_pages:]
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close()

