"""``clear`` is a barrier: a reservation taken before it is never committed after it."""

from __future__ import annotations

import hisparse
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)


def test_a_commit_after_a_clear_aborts_what_was_reserved_before_it(hisparsed):
    writer, admin = RawClient(hisparsed.socket), RawClient(hisparsed.socket)
    try:
        writer.hello("barrier", LAYOUT, LAYOUT.page_bytes * 8)
        admin.hello()
        before, after = keys_for("before", 2), keys_for("after", 2)
        assert len(writer.call(Op.RESERVE, keys=before)["slots"]) == 2
        admin.call(Op.CLEAR, token=hisparsed.token, namespace="barrier")
        assert len(writer.call(Op.RESERVE, keys=after)["slots"]) == 2
        assert writer.call(Op.COMMIT, keys=before + after) == {"committed": 2, "cleared": before}
        assert writer.call(Op.LOOKUP, keys=before) == {"count": 0}
        assert writer.call(Op.LOOKUP, keys=after) == {"count": 2}
        ns = admin.call(Op.STATS)["namespaces"]["barrier"]
        assert ns["writing_pages"] == 0 and ns["committed_pages"] == 2
        # the keys may be stored again, after the clear
        assert writer.store(before, [bytes(LAYOUT.page_bytes)] * 2) == 2
    finally:
        writer.close()
        admin.close()


def test_a_publish_after_a_clear_keeps_what_was_reserved_before_it_unpublished(hisparsed):
    """vLLM's host pool may still use the block it reserved: the reservation stays held (-1),
    unseen; the page's next block, written after the clear, is published."""
    writer, admin = RawClient(hisparsed.socket), RawClient(hisparsed.socket)
    try:
        writer.hello("barrier", LAYOUT, LAYOUT.page_bytes * 8)
        admin.hello()
        before, after = keys_for("placeholder-before", 2), keys_for("placeholder-after", 1)
        hashes = keys_for("hash", 3)
        writer.call(Op.RESERVE, keys=before)
        admin.call(Op.CLEAR, token=hisparsed.token, namespace="barrier")
        slot = writer.call(Op.RESERVE, keys=after)["slots"][0]
        assert writer.call(Op.PUBLISH, keys=before + after, as_keys=hashes, pin=True) == {"pages": [-1, -1, slot]}
        assert writer.call(Op.LOOKUP, keys=hashes[:2]) == {"count": 0}
        assert writer.call(Op.LOOKUP, keys=hashes[2:]) == {"count": 1}
        ns = admin.call(Op.STATS)["namespaces"]["barrier"]
        assert ns["writing_pages"] == 2 and ns["pinned_pages"] == 1
        # the pool reuses the page for a block written after the clear: that one is published
        again = keys_for("hash-after", 1)
        assert writer.call(Op.PUBLISH, keys=before[:1], as_keys=again)["pages"][0] >= 0
        assert writer.call(Op.LOOKUP, keys=again) == {"count": 1}
        assert writer.call(Op.ABORT, keys=before[1:]) == {"aborted": 1}
    finally:
        writer.close()
        admin.close()
