"""A direct cluster get that timed out never writes into its page after the page was reused.

Suspected in issue 19: the worker aborts the pages of a failed get, another
writer gets them, and the get's bytes land later. Over TCP (Mooncake
0.3.13) this does not happen: a transfer without progress for
``MC_TCP_PROGRESS_TIMEOUT_SEC`` drops its connection before the get returns,
so the peer's late reply finds a closed socket (its write fails, "broken
pipe") and nothing reaches the page. Not shown for RDMA (no NIC here; see
docs/fencing.md).

The peer holding the values is a real Mooncake client in another process,
SIGSTOPped while the daemon's tier (in this process, direct path: no staging
buffer) gets from it; the TCP timeouts are 1 s instead of 30 s.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hisparse.cluster import mooncake
from hisparse.daemon.cluster import promote as cluster_promote
from hisparse.shm.region import RegionMap
from hisparse.shm.table import WRITING
from tests.cluster.conftest import requires_mooncake
from tests.cluster.inprocess import registry_and_tier
from tests.cluster.test_loop_calls import until
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake

PEER = textwrap.dedent("""
    import sys
    import numpy as np
    from hisparse.cluster import format as fmt, mooncake
    from tests.cluster.test_two_nodes import LAYOUT, pages
    from tests.rawclient import keys_for
    master, metadata = sys.argv[1:3]
    s = mooncake.load().MooncakeDistributedStore()
    assert s.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "", master) == 0
    fp = fmt.fingerprint("m", LAYOUT)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    s.register_buffer(buf.ctypes.data, buf.nbytes)
    for key, page in zip(keys_for("late-get", 4), pages(4, 21)):
        value = fmt.pack_header(fp, LAYOUT.page_bytes, fmt.content_hash(key, [page])) + page.tobytes()
        buf[:len(value)] = np.frombuffer(value, dtype=np.uint8)
        assert s.batch_put_from([fmt.cluster_key(fp, key)], [buf.ctypes.data], [len(value)]) == [0]
    print("ready", flush=True)
    for line in sys.stdin:  # answers once it runs again
        print(line.strip(), flush=True)
""")


@pytest.fixture
def peer(master):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", PEER, master.address, master.metadata], cwd=root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root, **mooncake.QUIET_ENV})
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_timed_out_direct_get_never_lands_in_a_reused_page(master, peer, tmp_path, monkeypatch):
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "1")
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "1")
    monkeypatch.setattr(cluster_promote, "STAGE_BYTES", 0)  # every get direct, as over RDMA
    keys = keys_for("late-get", 4)
    mine = pages(8, 99)  # what a local writer stores into the reused pages

    async def scenario() -> list[bytes]:
        tier.start(asyncio.get_running_loop())
        await until(lambda: tier.state == "up", "the tier up")
        os.kill(peer.pid, signal.SIGSTOP)  # the peer holding the values stalls mid-get
        tier.prefetch(ns, tuple(keys), wait=False)
        # (the tier itself may stay up: a get that fails while the master answers fails its
        # keys, not the tier)
        await until(lambda: any(s == WRITING for s in ns.index.state), "the get's pages reserved")
        await until(lambda: not any(s == WRITING for s in ns.index.state),
                    "the get timed out and its pages were aborted")
        # a local writer takes every page of the region, the aborted ones among them
        held: dict[bytes, int] = {}
        ns.index.reserve(tuple(keys_for("local", 8)), held)
        assert len(held) == 8
        region = RegionMap(ns.region_path, ns.geometry).pages_view()
        for i, page in enumerate(held.values()):
            region[:, page, :] = mine[i].reshape(LAYOUT.num_layers, -1)
        for key, page in held.items():
            ns.index.commit(key, page)
        os.kill(peer.pid, signal.SIGCONT)  # its late reply to the stalled get goes out now
        # the peer runs again; its transfer engine answered the stalled request within a
        # millisecond of SIGCONT when measured (its write failed: "broken pipe"); 0.5 s is ample
        peer.stdin.write("ping\n")
        peer.stdin.flush()
        assert await asyncio.to_thread(peer.stdout.readline) == "ping\n"
        await asyncio.sleep(0.5)
        return [region[:, page, :].tobytes() for page in held.values()]

    with registry_and_tier(master, tmp_path, 8, timeout_s=5.0) as (_, ns, tier):
        after = asyncio.run(scenario())
    assert after == [page.tobytes() for page in mine], "a late get wrote into a reused page"


def test_a_daemon_stopped_mid_get_keeps_its_meta_dir_until_it_exits(master, peer, daemon_factory):
    """SIGTERM while a get is in flight: the worker outlives the stop, and may still copy the
    value into its pages; no successor may adopt (and hand out) those pages before this
    process is gone, so the meta dir's lock goes with the process, not with the stop."""
    from hisparse import client
    from tests.cluster.conftest import cluster_env, cluster_state, wait_for

    d = daemon_factory(capacity="128MiB", lease_ttl=5, env={
        **cluster_env(master), "MC_TCP_PROGRESS_TIMEOUT_SEC": "14", "MC_TCP_STATUS_TIMEOUT_SEC": "14"})
    wait_for("the cluster tier up", lambda: cluster_state(d.socket) == "up")
    with client.attach("m", LAYOUT, socket=d.socket, capacity="1MiB") as c:
        os.kill(peer.pid, signal.SIGSTOP)
        c.prefetch(keys_for("late-get", 4), wait=False)
        wait_for("the tier's get under way", lambda: c.stats()["namespaces"]["m"]["writing_pages"] == 4)
    d.proc.send_signal(signal.SIGTERM)
    wait_for("the daemon's stop (its worker still in the get)", lambda: "stopped (" in d.log())
    lock = os.open(os.path.join(os.path.dirname(d.socket), "meta", "hisparsed.lock"), os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:  # free: then the process must be all but gone, not copying for seconds more
            d.proc.wait(2)
        except subprocess.TimeoutExpired:
            pytest.fail("the meta dir's lock was free while the stopped daemon ran on, its get in flight")
    except BlockingIOError:
        d.proc.wait(60)  # held until the process exits
    finally:
        os.close(lock)
