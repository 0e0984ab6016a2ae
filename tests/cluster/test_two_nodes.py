"""A page stored on node A is found, promoted and loaded byte-exact on node B."""

from __future__ import annotations

import numpy as np

from hisparse import KVLayout, client
from tests.cluster.conftest import wait_for
from tests.rawclient import keys_for

LAYOUT = KVLayout(4, 16, 64)  # 4 KiB pages: 4 layer slices each


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_bytes), dtype=np.uint8)


def cluster_stats(c: client.Client) -> dict:
    return c.stats()["daemon"]["cluster"]


def test_b_finds_a_pages_remote_prefetches_and_loads_them_byte_exact(nodes):
    a, b = nodes(2)
    keys, data = keys_for("ab", 24), pages(24, 1)
    with client.attach("m", LAYOUT, socket=a.socket) as ca, client.attach("m", LAYOUT, socket=b.socket) as cb:
        assert ca.store(keys, data) == 24
        # write-behind: A's worker puts every committed page into the cluster
        wait_for("A's write-behind", lambda: cluster_stats(ca)["put_pages"] == 24)
        assert cb.lookup(keys) == 0
        assert cb.lookup_remote(keys) == (0, 24)
        got = cb.prefetch(keys)
        assert got["promoted"] == 24 and got["refused"] == 0 and got["missing"] == 0
        # B's own later hits are local
        assert cb.lookup(keys) == 24
        assert cb.lookup_remote(keys) == (24, 0)
        out = np.zeros_like(data)
        assert cb.load(keys, out) == 24
        assert np.array_equal(out, data)
        # promoted pages are not written back again
        assert cluster_stats(cb)["put_pages"] == 0
        assert cluster_stats(cb)["promoted_pages"] == 24
