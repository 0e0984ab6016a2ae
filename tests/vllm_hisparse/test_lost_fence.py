"""A host-pool page whose session's fence was already let go is never handed to vLLM.

``SessionFences.hold`` used to return quietly when the fence of the session
a reply came on had been let go (another thread re-attached in between, after
a daemon restart): the pool then put pages nobody fenced any more into block
tables. Here the daemon restarts and the client re-attaches right after the
pin reply (or the reserve reply) and before the pool takes its hold, the
worst moment: those pages must be a miss, never a block.
"""

from __future__ import annotations

from tests.client.engine import chain
from tests.vllm_hisparse.engine import SchedulerSide
from tests.waiting import wait_for

PROMPT = list(range(200, 224))


def _restart_right_after(side: SchedulerSide, daemon, name: str) -> None:
    """Wrap one ``NamespaceOps`` call: the daemon restarts and the client re-attaches after it."""
    ops = side.pool._ops
    real = getattr(ops, name)

    def call(*args, **kwargs):
        result = real(*args, **kwargs)
        setattr(ops, name, real)
        lost = ops.client.session
        daemon.kill()
        daemon.start()
        ops.client.lookup(chain("any", 1))  # re-attaches: the lost session's fence is let go
        assert ops.client.session is not lost and not lost.fence.live
        return result

    setattr(ops, name, call)


def test_pins_of_a_session_whose_fence_was_let_go_are_a_miss(daemon_factory):
    daemon = daemon_factory(lease_ttl=1)
    a = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4, name="A")
    b = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4, name="B")
    try:
        ra = a.add("ra", PROMPT)
        assert a.admit(ra) == 0
        a.write(ra)
        a.publish(ra)
        a.step()
        assert a.pool.counters["published"] == 6
        _restart_right_after(b, daemon, "pin_each")
        rb = b.add("rb", PROMPT)
        hit = b.admit(rb)
        # the restart outlasts the step's budget: not admitted yet (None), or admitted with no hit
        assert hit in (0, None), "pages of a session whose fence was let go went into a block table"
        wait_for(lambda: b.pool.answering, "the pool's courier hears from the daemon again")
        b.step()  # the late pin answer is applied: its session's fence is gone, so no lookup pin
        assert b.pool.counters["lookup_pins"] == 0
    finally:
        a.close()
        b.close()


def test_reservations_of_a_session_whose_fence_was_let_go_never_join_the_stock(daemon_factory):
    daemon = daemon_factory(lease_ttl=1)
    b = SchedulerSide(daemon.socket, num_host_blocks=32, step_blocks=4, name="B")
    try:
        _restart_right_after(b, daemon, "reserve")
        assert b.pool._refill(8) == 0
        assert b.pool._stock == []
        wait_for(lambda: b.pool._refill(8) > 0, "a refill on the new session")
        assert all(s is b.pool._ops.client.session for s, _ in b.pool._reserved.values())
    finally:
        b.close()
