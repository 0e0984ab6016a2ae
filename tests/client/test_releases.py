"""What a client gives back however a call ends: a release whose answer was late, a store a
``clear`` voided, a worker's fence hold that another process locked exclusively.

Each case on a real hisparsed: the daemon SIGSTOPped (as a long GC pause or swap would stop
it) with this client's requests filling the wire, so that the unpin waits in the client and
ends in ``Timeout``; a real ``clear`` between a store's reserve and its commit; a real
``LOCK_EX`` on a session's fence file.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

import hisparse
from hisparse import client
from hisparse.client import fence
from hisparse.client.backends import cpu
from hisparse.errors import DaemonUnavailable, Timeout
from hisparse.protocol import Op
from tests.client.engine import chain, pages_for
from tests.client.test_call_tags import Stalled, ns_stats
from tests.rawclient import RawClient
from tests.waiting import wait_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)  # 128-byte pages
NS = "tags"  # ns_stats reads this namespace
TIMEOUT_S = 1.0


@pytest.mark.parametrize("wait", [True, False])
def test_a_pin_release_that_gets_no_answer_is_given_back_by_tag(daemon_factory, wait):
    # The unpin waits in the client behind its requests on the wire to a stalled daemon: a
    # Timeout (not DaemonUnavailable). The pin reads as released from then on, so the
    # pinning call's tag must give back what it pinned; it was left pinned for the session's life.
    from hisparse.client.transport import MAX_IN_FLIGHT

    d = daemon_factory(lease_ttl=30)
    keys = chain("rel", 4)
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=LAYOUT.page_bytes * 8,
                       timeout_s=TIMEOUT_S) as c:
        assert c.store(keys, pages_for(keys, LAYOUT.page_bytes)) == 4
        pin = c.pin(keys)
        assert ns_stats(d.socket)["pinned_pages"] == 4
        session = c.session
        with Stalled(d.pid):
            on_wire = c.transport.submit_all(Op.LOOKUP, [{"session": session.id, "keys": keys}] * MAX_IN_FLIGHT)
            started = time.monotonic()
            if wait:
                with pytest.raises((Timeout, DaemonUnavailable)):
                    pin.release()
            else:
                pin.release(wait=False)  # queued: returns without asking the stopped daemon
                assert time.monotonic() - started < TIMEOUT_S
            assert not pin.held
        wait_for(lambda: ns_stats(d.socket)["pinned_pages"] == 0, "the pins to be given back",
                 timeout_s=15)
        assert c.session is session, "released by tag, not by the session's end"
        assert all(p.result(10.0) == {"count": 4} for p in on_wire)


def test_a_store_that_a_clear_voided_counts_none_written(hisparsed, monkeypatch):
    # A clear lands between the store's reserve and its commit: the daemon frees those pages
    # at the commit and names them ``cleared``. They are not stored, and must not count.
    real = cpu.CpuBackend.scatter
    admin = RawClient(hisparsed.socket)
    admin.hello()

    def scatter_after_a_clear(self, region, page_ids, pages, rows):
        admin.call(Op.CLEAR, token=hisparsed.token, namespace=NS)
        return real(self, region, page_ids, pages, rows)

    keys = chain("clr", 4)
    try:
        with client.attach(NS, LAYOUT, socket=hisparsed.socket, capacity=LAYOUT.page_bytes * 8,
                           timeout_s=5.0) as c:
            monkeypatch.setattr(cpu.CpuBackend, "scatter", scatter_after_a_clear)
            result = c.store(keys, pages_for(keys, LAYOUT.page_bytes))
            monkeypatch.setattr(cpu.CpuBackend, "scatter", real)
            assert c.lookup(keys) == 0
            assert int(result) == 0 and result.present == 0 and result.not_stored == 4
            assert c.counters["stored_pages"] == 0
            assert c.store(keys, pages_for(keys, LAYOUT.page_bytes)) == 4  # after the clear: stored
    finally:
        admin.close()


def test_a_fence_hold_never_waits_on_an_exclusive_lock_with_its_lock_held(hisparsed):
    # hold() takes its shared lock per job. With another open file of the fence locked
    # LOCK_EX (the daemon's probe holds it for microseconds; anyone else is not the daemon),
    # it blocked in flock(LOCK_SH) forever, holding the lock every other job of the process
    # needs. Now it polls, as open_locked does, and gives up with FenceBusy.
    owner = RawClient(hisparsed.socket)
    owner.hello("held", LAYOUT, LAYOUT.page_bytes * 8, fence=False)
    path = owner.fence_path
    blocker = -1
    try:
        with fence.hold(path):  # the process's shared entry for the file is made, then unlocked
            pass
        blocker = os.open(path, os.O_RDONLY)
        fcntl.flock(blocker, fcntl.LOCK_EX | fcntl.LOCK_NB)
        outcome: list[BaseException | None] = []

        def job() -> None:
            try:
                with fence.hold(path):
                    outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the outcome is the assertion
                outcome.append(exc)

        worker = threading.Thread(target=job, daemon=True)
        worker.start()
        worker.join(8 * fence.LOCK_WAIT_S)  # several times the deadline, never the kernel's endless wait
        assert not worker.is_alive(), "hold() waited on the exclusive lock"
        assert len(outcome) == 1 and isinstance(outcome[0], fence.FenceBusy), outcome
        os.close(blocker)
        blocker = -1
        with fence.hold(path):  # once the lock is gone the same file is held again
            pass
    finally:
        if blocker >= 0:
            os.close(blocker)  # lets an old, blocked hold() go, so the test ends either way
        owner.close()

