"""A fence hold belongs to the process that took it: a forked child neither drops nor extends it.

``flock`` belongs to the open file description, and ``fork`` shares it. A
worker (``hisparse.client.fence.hold``) that forks must keep its hold however
the child holds, lets go or exits; the child's own hold must count on its own.
The processes are real (``tests.client.fence_actors``): the owner of the
session is SIGKILLed, its lease ends, and only a real hold keeps its pages.
"""

from __future__ import annotations

import pytest

from hisparse import client
from tests.client.engine import chain, pages_for
from tests.client.test_fencing import LAYOUT, NS, actors, ns_stats  # noqa: F401  (actors: the fixture)
from tests.waiting import wait_for


@pytest.mark.parametrize("variant", ["after", "during"])
def test_a_forked_childs_hold_never_drops_or_shares_its_parents(daemon_factory, actors, variant):
    d = daemon_factory(lease_ttl=1.0)
    keys = chain("fork", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8) as c:
        assert c.store(keys, pages_for(keys, LAYOUT.page_bytes)) == 4
    owner = actors(d.socket, "pin-owner", seed="fork", count=4)
    fence = owner.until("pinned")["fence"]
    # after: the worker holds, its child held and exited; during: the child holds, the worker let go
    worker = actors(d.socket, "fork-holder", fence=fence, variant=variant)
    worker.until("holding")
    owner.kill()
    wait_for(lambda: ns_stats(d.socket).get("sessions") == 0, "the owner's lease to end")
    ns = ns_stats(d.socket)
    assert ns["pinned_pages"] == 4, "the pages were freed while a process still held the fence"
    worker.say()
    worker.until("released")
    assert worker.proc.wait(30) == 0
    wait_for(lambda: ns_stats(d.socket).get("pinned_pages") == 0, "the fence to be let go")
