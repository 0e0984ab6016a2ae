"""A P/D import into the node pool: an external connector lands KV in reserved pages, the commit shares it.

Stands for vLLM's import path on a decode node whose host pool is a
hisparsed namespace (docs/cluster.md): the decode engine allocates host
blocks (reservations), the P/D connector (here a bare Mooncake client, as
Mooncake's store connector would be) writes the prefill node's KV straight
into those region pages, and the publication (commit) makes it every
engine's on the node.
"""

from __future__ import annotations

import numpy as np

from hisparse import client
from hisparse.protocol import Op
from tests.cluster.conftest import requires_mooncake
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake


def test_an_imported_page_is_published_to_every_engine_of_the_decode_node(nodes, planter):
    (decode_node,) = nodes(1)  # its daemon lends the segment the prefill side's values land in
    keys, data = keys_for("import", 3), pages(3, 21)
    for i in range(3):  # the prefill node's connector publishes its KV in its own format
        planter(f"prefill/req-1/{i}", data[i].tobytes())
    with client.attach("m", LAYOUT, socket=decode_node.socket) as engine0, \
            client.attach("m", LAYOUT, socket=decode_node.socket) as engine1:
        # allocate host blocks for the external hit: reservations
        body, session = engine0.request(Op.RESERVE, keys=keys)
        slots = body["slots"]
        assert all(s >= 0 for s in slots)
        assert engine1.lookup(keys) == 0  # nothing visible while the import is in flight
        # the connector writes into the reserved pages, layer run by layer run
        region = session.region
        g = region.geometry
        store = planter.store
        assert store.register_buffer(region.address, g.size_bytes) == 0
        lpb = LAYOUT.layer_page_bytes
        ptrs = [[region.address + layer * g.layer_stride_bytes + page * lpb
                 for layer in range(LAYOUT.num_layers)] for page in slots]
        got = store.batch_get_into_multi_buffers([f"prefill/req-1/{i}" for i in range(3)], ptrs,
                                                 [[lpb] * LAYOUT.num_layers] * 3)
        assert got == [LAYOUT.page_bytes] * 3
        # complete_host_import -> publication: committed, shared by every engine of the node
        assert engine0.request_in(session, Op.COMMIT, keys=keys)["committed"] == 3
        out = np.zeros_like(data)
        assert engine1.load(keys, out) == 3 and np.array_equal(out, data)
        assert store.unregister_buffer(region.address) == 0
