"""A flood costs only the flooder: another uid's ping on a new connection (``hisparsectl
ping``'s path) and lookup on its own connection stay answered within tens of milliseconds,
and the daemon's memory within its stated bound, while one uid floods; and a flooding
process of an engine's own uid (one service user runs every engine) does not lock the
uid's other processes out.

The attackers are ``benchmarks/bounds_peer.py``'s, forked as a real other user
(``tests.tenants``) or run as a process of the test's own uid; the daemon runs on the
shipped defaults.
"""

from __future__ import annotations

import time

import pytest

from benchmarks.hostile_probe import (BOUNDS_PEER, forked_bounds_peers, fresh_pings, fresh_pings_as, hostile_peers,
                                      peak_rss_bytes)
from hisparse import KVLayout, protocol
from hisparse.daemon.policy.backoff import UID_PROCESSES, Backoffs
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for
from tests.tenants import ATTACKER_UID, OTHER_UID, needs_root
from tests.tenants import tenant_daemon  # noqa: F401 - a fixture

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)
# What libzmq may hold for one connection before the daemon reads a frame of it: RCVHWM (2)
# queued and one being read, each at most MAX_FRAME_BYTES (docs/governance.md states the bound).
PER_CONNECTION_BYTES = 3 * protocol.MAX_FRAME_BYTES
# Expected: tens of ms on a busy 2-core box. Far above it, well below what a lost reply costs
# (fresh_pings counts one as 5 s; before the fix a junk flood lost new connections' pings).
SLOW_S = 1.0

FLOODS = {  # kinds, connections, whether its refused connects surely storm (its uid's door shuts)
    "malformed frames from 4 connections": (["junk", "4"], 4, False),
    "hello storm": (["hellos"], 0, True),
    # its reconnects are shed at accept during its backoff: a storm or not, as timing has it
    "48 connections of frames just under the limit": (["frames", "48", str(protocol.MAX_FRAME_BYTES)], 48, False),
}


@needs_root
@pytest.mark.parametrize("flood", list(FLOODS))
def test_a_flood_of_one_uid_costs_another_uid_nothing(tenant_daemon, flood):
    """The new connections ping as a third uid, not root: root ignores the socket file's
    permissions, so only another user meets a door shut (a storm shut it to every uid)."""
    kinds, connections, storms = FLOODS[flood]
    d = tenant_daemon()
    engine = RawClient(d.socket)
    try:
        engine.hello("ns", LAYOUT, LAYOUT.page_bytes * 64)
        keys = keys_for("engine", 8)
        assert engine.store(keys, [b"e" * LAYOUT.page_bytes] * 8) == 8
        idle_rss = peak_rss_bytes(d.pid)
        with forked_bounds_peers(d.socket, [kinds], ATTACKER_UID):
            fresh = fresh_pings_as(OTHER_UID, d.socket, 200)
            lookups = []
            for _ in range(40):
                t0 = time.perf_counter()
                assert engine.call(Op.LOOKUP, keys=keys)["count"] == 8
                lookups.append(time.perf_counter() - t0)
            peak = peak_rss_bytes(d.pid)
            shut = engine.call(Op.STATS)["daemon"]["uid_door_closures"]
        assert max(fresh) < SLOW_S, f"{flood}: a new connection's ping took {max(fresh):.3f} s"
        assert max(lookups) < SLOW_S, f"{flood}: a lookup took {max(lookups):.3f} s"
        # the daemon's memory: at most what libzmq may hold for each flooding connection, and
        # for the hello storm, sessions (each a few KB) up to max_sessions_per_uid
        bound = (64 << 20) + connections * PER_CONNECTION_BYTES
        assert peak - idle_rss < bound, f"{flood}: {(peak - idle_rss) >> 20} MiB more than idle"
        if storms:
            assert shut > 0, f"{flood}: the attacker's uid was never shut out"
        assert engine.call(Op.PING)  # and the daemon serves on
    finally:
        engine.close()


OWN_UID_FLOODS = {
    "malformed frames from 4 connections": ["junk", "4"],
    "48 connections of frames just under the limit": ["frames", "48", str(protocol.MAX_FRAME_BYTES)],
}


@pytest.mark.parametrize("flood", list(OWN_UID_FLOODS))
def test_a_flooding_process_does_not_lock_out_its_uids_other_processes(hisparsed, flood):
    """The backoff after refused large frames is the sending process's: another process of the
    same uid (here the test) connects, pings and looks up throughout. A uid-wide backoff shed
    every new connection of the uid for 1-2 s, again and again while the flood went on."""
    engine = RawClient(hisparsed.socket)
    try:
        engine.hello("ns", LAYOUT, LAYOUT.page_bytes * 64)
        keys = keys_for("engine", 8)
        assert engine.store(keys, [b"e" * LAYOUT.page_bytes] * 8) == 8
        with hostile_peers(hisparsed.socket, [OWN_UID_FLOODS[flood]], BOUNDS_PEER):
            fresh = fresh_pings(hisparsed.socket, 60, timeout_s=2.0,
                                keepalive=lambda: engine.call(Op.HEARTBEAT, session=engine.session))
            for _ in range(20):
                assert engine.call(Op.LOOKUP, keys=keys)["count"] == 8
        assert max(fresh) < SLOW_S, f"{flood}: a new connection's ping took {max(fresh):.3f} s"
    finally:
        engine.close()


def test_a_backoff_is_a_process_s_until_enough_of_its_uid_s_processes_back_off():
    backoffs = Backoffs()
    assert backoffs.start(1000, 10) == 1.0
    assert backoffs.holds(1000, 10) and not backoffs.holds(1000, 11) and not backoffs.holds(1001, 10)
    assert backoffs.start(1000, 10) == 2.0  # doubling while it keeps at it
    for pid in range(11, 9 + UID_PROCESSES):
        backoffs.start(1000, pid)
    assert not backoffs.holds(1000, 99)  # UID_PROCESSES - 1 processes: the rest of the uid goes on
    backoffs.start(1000, 9 + UID_PROCESSES)
    assert backoffs.holds(1000, 99) and not backoffs.holds(1001, 99)  # a forking flooder: its uid
    assert backoffs.uid_wide(1000) and not backoffs.uid_wide(1001)
