"""A cluster worker's call on the event loop that it gave up on never takes effect later.

The worker asks the loop for every index change (``ClusterTier._on_loop``)
and gives up after ``LOOP_CALL_TIMEOUT_S`` when the loop does not answer (a
stalled daemon: SIGSTOP, swap, a loop blocked). Before the fix the call still
ran once the loop came back: a reservation no one settled (pages WRITING,
keys BUSY for good) or a hold no one released.

The tier runs in this process on a real event loop, with the real Mooncake
client against a real ``mooncake_master`` on loopback; the stall is the
loop's own thread blocked until the worker has given up, and the worker's
patience is shortened from 10 s to 0.3 s so the test waits seconds, not
minutes.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from hisparse.cluster import format as fmt
from hisparse.daemon.cluster import state as cluster_state
from hisparse.shm.region import RegionMap
from hisparse.shm.table import WRITING
from tests.cluster.conftest import requires_mooncake
from tests.cluster.inprocess import registry_and_tier
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake


async def until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def tier_on(master, tmp_path, monkeypatch):
    """A namespace of an in-process registry and a cluster tier on the master; the worker's
    patience with the loop shortened to 0.3 s."""
    monkeypatch.setattr(cluster_state, "LOOP_CALL_TIMEOUT_S", 0.3)
    with registry_and_tier(master, tmp_path, 64, segment_size_bytes=32 << 20, timeout_s=5.0) as (_, ns, tier):
        yield ns, tier


def stall_until_the_worker_gives_up(tier) -> None:
    """The loop's thread blocked (a stalled daemon) until the worker has given up on it."""
    deadline = time.monotonic() + 30
    while tier.state != "down":
        assert time.monotonic() < deadline, "the worker never gave up"
        time.sleep(0.02)


def test_a_reserve_the_worker_gave_up_on_never_runs_late(tier_on, planter):
    ns, tier = tier_on
    keys = keys_for("late", 4)
    data = pages(4, 11)

    async def scenario() -> dict:
        tier.start(asyncio.get_running_loop())
        await until(lambda: tier.state == "up", "the tier up (its segment lent)")
        fp = fmt.fingerprint("m", LAYOUT)
        for key, page in zip(keys, data):
            planter(fmt.cluster_key(fp, key),
                    fmt.pack_header(fp, LAYOUT.page_bytes, fmt.content_hash(key, [page])) + page.tobytes())
        tier.prefetch(ns, tuple(keys), wait=False)  # the worker asks the loop to reserve pages
        stall_until_the_worker_gives_up(tier)
        await asyncio.sleep(0.2)  # the loop runs what was queued meanwhile
        after = {"writing": sum(1 for s in ns.index.state if s == WRITING),
                 "held": dict(tier._spaces["m"].held)}
        # the tier comes back and promotes the same keys: none is BUSY
        await until(lambda: not tier.health.down(time.monotonic()), "the back-off over")
        after["promoted"] = await asyncio.wrap_future(tier.prefetch(ns, tuple(keys), wait=True))
        return after

    after = asyncio.run(scenario())
    assert after["writing"] == 0 and after["held"] == {}, f"the reserve ran after the worker gave up: {after}"
    assert after["promoted"]["promoted"] == 4 and after["promoted"]["busy"] == 0, after["promoted"]
    # and the promoted pages hold the cluster's bytes
    region = RegionMap(ns.region_path, ns.geometry, writable=False).pages_view()
    for key, page in zip(keys, data):
        assert region[:, ns.index.keys[key], :].tobytes() == page.tobytes()


def test_a_hold_the_worker_gave_up_on_never_pins_a_page_for_good(tier_on):
    ns, tier = tier_on
    keys = keys_for("behind", 4)

    async def scenario() -> dict:
        tier.start(asyncio.get_running_loop())
        await until(lambda: tier.state == "up", "the tier up (its segment lent)")
        held: dict[bytes, int] = {}
        ns.index.reserve(tuple(keys), held)
        for key, page in held.items():
            ns.index.commit(key, page)
        tier.committed(ns, list(held.items()))  # write-behind: the worker asks the loop to hold them
        stall_until_the_worker_gives_up(tier)
        await asyncio.sleep(0.2)
        pins = [ns.index.pins[p] for p in held.values()]
        # back up: the pages go behind after all, and nothing stays pinned
        await until(lambda: tier.counters["put_pages"] == 4, "the write-behind put")
        await asyncio.sleep(0.2)
        return {"pins_after_giving_up": pins, "pins_at_the_end": [ns.index.pins[p] for p in held.values()]}

    after = asyncio.run(scenario())
    assert after == {"pins_after_giving_up": [0] * 4, "pins_at_the_end": [0] * 4}, after
