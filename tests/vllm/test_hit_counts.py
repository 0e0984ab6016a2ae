"""hisparsectl stats and the metrics count the vLLM adapter's hits (issue 41, item 6).

The adapter's lookups answer from a local mirror and never reach the daemon;
what does is the pin of the keys they found. Each such pin carries the keys
the mirror missed since the last one, so the namespace counts lookups, hits
(the keys pinned) and misses: before, a vLLM namespace serving hits showed
"hit rate 0.0%".
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from hisparse import protocol
from hisparse.protocol import Op
from tests.vllm.conftest import req, settle, settled_lookups, to_keys
from tests.vllm.test_manager import namespace_stats, store


def test_an_engines_hits_and_misses_count_in_the_namespaces_stats(engines: Any) -> None:
    a, b = engines(engine_id="a"), engines(engine_id="b")
    store(a.manager, [1, 2, 3])
    assert namespace_stats(b)["hit_keys"] == 0
    # b's scheduler: three keys found (pinned, then HIT), two keys nobody stored
    assert settled_lookups(b.manager, to_keys([1, 2, 3]), req("r")) == [LookupResult.HIT] * 3
    assert [b.manager.lookup(k, req("r")) for k in to_keys([8, 9])] == [LookupResult.MISS] * 2
    b.manager.on_request_finished(req("r"))
    settle(b.manager)
    # the misses go with b's next pin (here: of one more key a stores)
    store(a.manager, [4])
    assert settled_lookups(b.manager, to_keys([4]), req("s")) == [LookupResult.HIT]
    ns = namespace_stats(b)
    assert ns["hit_keys"] == 4  # every key pinned for a lookup
    # every miss b's mirror answered (the two above, and any while its mirror had not seen a commit)
    assert ns["lookup_keys"] - ns["hit_keys"] == b.manager.stats_snapshot()["lookup_misses"] >= 2
    assert ns["hit_rate"] > 0


def test_missed_must_be_a_count() -> None:
    frame = protocol.encode_request(Op.PIN, 1, session=1, keys=[b"k"], missed=-1)
    try:
        protocol.decode_request(frame)
    except protocol.WireError as exc:
        assert exc.code == protocol.ErrorCode.INVALID_ARGUMENT
    else:
        raise AssertionError("a negative missed count was accepted")
    assert protocol.decode_request(protocol.encode_request(Op.PIN, 1, session=1, keys=[b"k"], missed=3)).missed == 3
    assert protocol.decode_request(protocol.encode_request(Op.PIN, 1, session=1, keys=[b"k"])).missed is None
