"""A daemon SIGKILLed in the middle of a promotion: what it committed survives, byte-exact;
the pages of the round it was writing are freed at the next start; promoting the rest
completes the prompt.

A promotion runs in rounds of ``cluster_promote.ROUND_BYTES`` (4 MiB: about a
thousand of these 4 KiB pages), each reserved (WRITING), fetched and
committed (256 pages at a time) before the next begins. Node B promotes six
rounds of node A's pages in the background; once some have landed and the
prompt is not complete, B is killed with no chance to clean up (in runs
here, always inside a round: 500-750 pages WRITING), and started again on
the same dirs.
B lends the cluster no segment, so the values it promotes all live on A
(a value in a killed node's own segment dies with it: ``test_failures``).
"""

from __future__ import annotations

import numpy as np

from hisparse import client
from hisparse.daemon.cluster import promote as cluster_promote
from tests.cluster.conftest import cluster_state, requires_mooncake, wait_for
from tests.cluster.test_two_nodes import LAYOUT, cluster_stats, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake

ROUND_PAGES = cluster_promote.ROUND_BYTES // LAYOUT.page_bytes  # a little more than a round holds
N = 6 * ROUND_PAGES


def test_a_daemon_killed_mid_promotion_keeps_what_it_committed_and_frees_the_rest(nodes):
    (a,) = nodes(1)
    (b,) = nodes(1, segment_size="0")  # lends the cluster nothing: every value lives on A
    keys, data = keys_for("killed-mid-promotion", N), pages(N, 41)
    with client.attach("m", LAYOUT, socket=a.socket) as ca:
        for i in range(0, N, ROUND_PAGES):  # within A's write-behind queue (4,096 pages) each time
            assert ca.store(keys[i:i + ROUND_PAGES], data[i:i + ROUND_PAGES]) == ROUND_PAGES
            wait_for("A's write-behind", lambda: cluster_stats(ca)["put_pages"] == i + ROUND_PAGES)

    seen = {"max": 0}

    def mid_promotion(cb: client.Client) -> bool:
        seen["max"] = max(seen["max"], cb.lookup(keys))
        return 0 < seen["max"] < N

    room = N * LAYOUT.page_bytes  # B's region holds the prompt and no more: a stranded page shows
    with client.attach("m", LAYOUT, socket=b.socket, capacity=room) as cb:
        assert cb.prefetch(keys, wait=False)["queued"] == N
        wait_for("a round of B's promotion committed", lambda: mid_promotion(cb), timeout_s=120)
        b.kill()  # mostly inside a round (its pages WRITING), else between two: no clean-up
    committed_before = seen["max"]
    assert 0 < committed_before < N, "the promotion ended before the test could kill it"

    b.start()
    wait_for("B's cluster tier up again", lambda: cluster_state(b.socket) == "up")
    with client.attach("m", LAYOUT, socket=b.socket, capacity=room) as cb:
        kept = cb.lookup(keys)
        # what was committed is adopted (and maybe a round more that landed before the kill) ...
        assert committed_before <= kept <= N
        ns = cb.stats()["namespaces"]["m"]
        # ... and the pages of the round being written are free, not stranded as WRITING
        assert ns["writing_pages"] == 0, ns
        assert ns["committed_pages"] == kept and ns["num_pages"] == N, ns
        out = np.zeros((kept, LAYOUT.page_bytes), dtype=np.uint8)
        assert cb.load(keys[:kept], out) == kept
        assert np.array_equal(out, data[:kept]), "an adopted page's bytes differ from A's"
        # the rest of the prompt comes from the cluster again, and the whole of it is exact
        got = cb.prefetch(keys)
        assert got["local"] == kept and got["promoted"] == N - kept, got
        assert got["refused"] == 0 and got["missing"] == 0, got
        out = np.zeros((N, LAYOUT.page_bytes), dtype=np.uint8)
        assert cb.load(keys, out) == N
        assert np.array_equal(out, data)
