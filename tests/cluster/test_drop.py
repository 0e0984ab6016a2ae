"""A namespace dropped with the cluster tier on gives its memory back: the tier unmaps its region.

Before: the tier kept its mapping (and its transfer-engine registration) of
the dropped region, so tmpfs kept the memory while stats counted it freed.
"""

from __future__ import annotations

import subprocess
import sys

from tests.cluster.conftest import cluster_stats as cluster, requires_mooncake, wait_for
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import RawClient, keys_for

pytestmark = requires_mooncake


def maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_dropped_namespace_is_unmapped_by_the_cluster_tier(nodes):
    (a,) = nodes(1)
    c = RawClient(a.socket)
    try:
        region = c.hello("m", LAYOUT, 64 * LAYOUT.page_bytes)["region"]["path"]
        keys = keys_for("drop", 8)
        assert c.store(keys, [p.tobytes() for p in pages(8, 5)]) == 8
    finally:
        c.close()
    wait_for("write-behind", lambda: cluster(a.socket)["put_pages"] == 8)
    assert region in maps(a.pid), "the tier maps the region it writes behind"
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", a.socket, "drop", "m", "--force"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    wait_for("the tier's mapping of the dropped region gone", lambda: region not in maps(a.pid))
    # the tier serves on: the namespace made again is written behind into its new region
    c = RawClient(a.socket)
    try:
        c.hello("m", LAYOUT, 64 * LAYOUT.page_bytes)
        assert c.store(keys_for("again", 4), [p.tobytes() for p in pages(4, 6)]) == 4
    finally:
        c.close()
    wait_for("write-behind after the drop", lambda: cluster(a.socket)["put_pages"] == 12)
