"""The cluster failing never costs the local tier a store, a load or a committed page."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hisparse import ClusterUnavailable, client
from hisparse.cluster import format as fmt
from tests.cluster.conftest import requires_mooncake, wait_for
from tests.cluster.test_two_nodes import LAYOUT, cluster_stats, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake


def test_master_killed_mid_run_local_tier_serves_and_write_behind_resumes(nodes, master):
    a, b = nodes(2)
    before, during = keys_for("before", 16), keys_for("during", 16)
    data = pages(32, 6)
    with client.attach("m", LAYOUT, socket=a.socket) as ca, client.attach("m", LAYOUT, socket=b.socket) as cb:
        assert ca.store(before, data[:16]) == 16
        wait_for("write-behind", lambda: cluster_stats(ca)["put_pages"] == 16)
        master.kill()
        # every store and load still succeeds, locally
        assert ca.store(during, data[16:]) == 16
        out = np.zeros_like(data)
        assert ca.load(before + during, out) == 32 and np.array_equal(out, data)
        wait_for("the tier notices", lambda: cluster_stats(ca)["state"] == "down")
        assert cluster_stats(ca)["put_pages"] == 16  # the new pages wait in the queue
        # a waited lookup answers (remote 0) and a waited prefetch fails typed, both promptly
        started = time.monotonic()
        assert cb.lookup_remote(during) == (0, 0)
        with pytest.raises(ClusterUnavailable):
            cb.prefetch(during)
        assert time.monotonic() - started < 4 * 5.0
        master.start()
        # the Mooncake clients mount their segments again; the queue drains
        wait_for("write-behind resumes", lambda: cluster_stats(ca)["put_pages"] == 32, timeout_s=60)
        assert cluster_stats(ca)["state"] == "up"
        # B's tier fails fast until its own down window ends (its failed prefetch above set it)
        got: dict = {}
        wait_for("B's waited prefetch succeeds", lambda: got.update(_prefetch_or_nothing(cb, during)) or got)
        assert got["promoted"] == 16
        assert cb.load(during, out) == 16 and np.array_equal(out[:16], data[16:])
        # nothing A committed was lost
        assert ca.lookup(before + during) == 32


def _prefetch_or_nothing(c, keys: list[bytes]) -> dict:
    try:
        return c.prefetch(keys)
    except ClusterUnavailable:
        return {}


def _value(fp: bytes, key: bytes, page: bytes, *, digest: bytes | None = None) -> bytes:
    return fmt.pack_header(fp, len(page), digest or fmt.content_hash(key, [page])) + page


def test_values_planted_with_a_wrong_hash_fingerprint_or_size_are_refused(nodes, planter):
    (b,) = nodes(1)
    keys = keys_for("planted", 4)
    page = pages(1, 7)[0].tobytes()
    fp = fmt.fingerprint("m", LAYOUT)
    other = fmt.fingerprint("another model", LAYOUT)
    planter(fmt.cluster_key(fp, keys[0]), _value(fp, keys[0], page, digest=b"\0" * 16))  # wrong hash
    planter(fmt.cluster_key(fp, keys[1]), _value(other, keys[1], page))  # another namespace's value
    planter(fmt.cluster_key(fp, keys[2]), _value(fp, keys[2], page)[:-100])  # short
    planter(fmt.cluster_key(fp, keys[3]), _value(fp, keys[0], page))  # copied from another key
    with client.attach("m", LAYOUT, socket=b.socket) as cb:
        assert cb.lookup_remote(keys) == (0, 4)
        got = cb.prefetch(keys)
        assert got["refused"] == 4 and got["promoted"] == 0
        # never committed, and dropped from the cluster
        assert cb.lookup(keys) == 0
        assert cluster_stats(cb)["refused_pages"] == 4
        assert planter.store.batch_is_exist([fmt.cluster_key(fp, k) for k in keys]) == [0] * 4
        # a good value under the same key is taken
        planter(fmt.cluster_key(fp, keys[0]), _value(fp, keys[0], page))
        assert cb.prefetch(keys[:1])["promoted"] == 1
        out = np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8)
        assert cb.load(keys[:1], out) == 1 and out[0].tobytes() == page


def test_a_full_write_behind_queue_drops_pages_and_counts_them(nodes, master):
    (a,) = nodes(1, queue_pages="8")
    master.kill()  # nothing drains the queue
    with client.attach("m", LAYOUT, socket=a.socket) as ca:
        assert ca.store(keys_for("q", 40), pages(40, 8)) == 40
        wait_for("drops counted", lambda: cluster_stats(ca)["dropped_pages"] >= 32)
        assert cluster_stats(ca)["queue_depth"] <= 8


def test_a_peer_killed_costs_its_values_not_the_other_node(nodes):
    a, b = nodes(2)
    keys, data = keys_for("peer", 16), pages(16, 12)
    with client.attach("m", LAYOUT, socket=a.socket) as ca:
        ca.store(keys, data)
        wait_for("write-behind", lambda: cluster_stats(ca)["put_pages"] == 16)
    a.kill()  # SIGKILL: A's segment (and the values in it) goes with it
    with client.attach("m", LAYOUT, socket=b.socket) as cb:
        started = time.monotonic()
        try:
            got = cb.prefetch(keys)
        except ClusterUnavailable:
            got = {"promoted": 0}  # every value was in A's segment, and the get timed out
        assert time.monotonic() - started < 4 * 5.0
        # what came is A's bytes; what did not is simply not here
        promoted = [k for k in keys if cb.lookup([k]) == 1]
        assert len(promoted) == got["promoted"]
        out = np.zeros((1, LAYOUT.page_bytes), dtype=np.uint8)
        for k in promoted:
            assert cb.load([k], out) == 1 and np.array_equal(out[0], data[keys.index(k)])
        # B's own tier serves on at once
        own = keys_for("own", 4)
        assert cb.store(own, pages(4, 13)) == 4 and cb.lookup(own) == 4
        wait_for("B's write-behind", lambda: cluster_stats(cb)["put_pages"] == 4, timeout_s=30)
