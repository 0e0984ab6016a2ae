"""A daemon without [cluster]: no Mooncake needed, remote lookups say 0, prefetch is refused."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse import ClusterUnavailable, KVLayout, client
from hisparse.ctlviews import format_cluster
from tests.rawclient import keys_for

LAYOUT = KVLayout(2, 4, 32)


def test_without_a_cluster_tier_remote_is_zero_and_prefetch_is_refused(hisparsed):
    keys = keys_for("off", 4)
    with client.attach("m", LAYOUT, socket=hisparsed.socket, capacity="1MiB") as c:
        c.store(keys[:2], np.ones((2, LAYOUT.page_bytes), dtype=np.uint8))
        assert c.lookup_remote(keys) == (2, 0)
        with pytest.raises(ClusterUnavailable, match=r"\[cluster\] backend"):
            c.prefetch(keys)
        assert c.stats()["daemon"]["cluster"] == {"backend": "none"}
        assert format_cluster(c.stats()["daemon"]["cluster"]) == "cluster: off"
