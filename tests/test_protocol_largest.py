"""The largest frames the protocol allows decode to what was sent, and their near misses are
refused by name: the scan's fast passes (keys of mixed lengths, page ids) prove what the
decoder then skips checking, so every edge of what they accept is pinned here."""

from __future__ import annotations

import random

import msgpack
import pytest

from hisparse import protocol
from hisparse.protocol import ErrorCode, Op, WireError
from hisparse.protocol.scan import UNSCANNED_LIST_ITEMS, scan_frame

N = protocol.MAX_KEYS_PER_REQUEST
V = protocol.VERSION


def mixed_keys(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    keys = [rng.randbytes(rng.randint(protocol.MIN_KEY_BYTES, protocol.MAX_KEY_BYTES)) for _ in range(N)]
    keys[0], keys[-1] = b"\xc4", b"\xc4" * protocol.MAX_KEY_BYTES  # both ends; payloads like headers
    return keys


def refusal(frame: bytes) -> WireError:
    with pytest.raises(WireError) as exc:
        protocol.decode_request(frame)
    return exc.value


def test_the_largest_publish_decodes_to_its_keys():
    keys, as_keys = mixed_keys(1), mixed_keys(2)
    frame = protocol.encode_request(Op.PUBLISH, 9, session=4, keys=keys, as_keys=as_keys, pin=True)
    assert len(frame) < protocol.MAX_FRAME_BYTES
    assert scan_frame(frame) == (9, frozenset({"keys", "as_keys"}))  # proven: the decoder skips them
    req = protocol.decode_request(frame)
    assert isinstance(req, protocol.PublishRequest)
    assert (req.id, req.session, req.pin) == (9, 4, True)
    assert req.keys == tuple(keys) and req.as_keys == tuple(as_keys)
    # the largest by bytes: every key of the longest length
    longest = [bytes([i % 256]) * protocol.MAX_KEY_BYTES for i in range(N)]
    req = protocol.decode_request(protocol.encode_request(Op.PUBLISH, 9, session=4, keys=longest,
                                                          as_keys=longest[::-1]))
    assert req.keys == tuple(longest) and req.as_keys == tuple(longest[::-1])


def test_the_largest_unpin_decodes_to_its_pages():
    rng = random.Random(3)
    edges = [0, 127, 128, 255, 256, 65535, 65536, protocol.MAX_PAGE_ID]
    pages = edges + [rng.choice((rng.randrange(128), rng.randrange(1 << 16), rng.randrange(1 << 31)))
                     for _ in range(N - len(edges))]
    frame = protocol.encode_request(Op.UNPIN, 5, session=4, pages=pages)
    assert scan_frame(frame)[1] == {"pages"}
    assert protocol.decode_request(frame).pages == tuple(pages)


@pytest.mark.parametrize("i", [0, 7_000, N - 1])
def test_a_bad_key_anywhere_in_a_large_list_is_named(i):
    keys = mixed_keys(4)
    keys[i] = b"x" * (protocol.MAX_KEY_BYTES + 1)  # a legal bin, not a key
    exc = refusal(protocol.encode_request(Op.LOOKUP, 11, session=4, keys=keys))
    assert exc.code is ErrorCode.INVALID_ARGUMENT and f"keys[{i}] is 65 bytes" in exc.message
    assert exc.rid == 11
    keys[i] = "text"
    exc = refusal(protocol.encode_request(Op.LOOKUP, 11, session=4, keys=keys))
    assert exc.code is ErrorCode.PROTOCOL_ERROR and f"keys[{i}] must be bytes" in exc.message


def test_a_page_id_out_of_range_in_a_large_list_is_named():
    pages = list(range(N))
    pages[-1] = protocol.MAX_PAGE_ID + 1  # a uint32 with its top bit set
    exc = refusal(protocol.encode_request(Op.UNPIN, 12, session=4, pages=pages))
    assert exc.code is ErrorCode.INVALID_ARGUMENT and f"pages[{N - 1}]" in exc.message
    pages[-1] = True
    assert refusal(protocol.encode_request(Op.UNPIN, 12, session=4, pages=pages)).code is ErrorCode.PROTOCOL_ERROR


def test_a_field_named_twice_is_proven_only_when_both_copies_are():
    good = msgpack.packb(mixed_keys(5))
    bad = msgpack.packb(mixed_keys(6)[:-1] + [b""])  # an empty key: last, after the proven copy
    head = msgpack.packb({"v": V, "id": 13, "op": "lookup", "session": 4})
    frame = bytes([head[0] + 2]) + head[1:] + msgpack.packb("keys") + good + msgpack.packb("keys") + bad
    assert scan_frame(frame)[1] == frozenset()
    assert refusal(frame).code is ErrorCode.INVALID_ARGUMENT  # msgpack keeps the last copy


def test_a_truncated_key_list_is_refused_with_its_id():
    frame = protocol.encode_request(Op.LOOKUP, 14, session=4, keys=mixed_keys(7))
    for cut in (1, 2, 40):
        exc = refusal(frame[:-cut])
        assert exc.code is ErrorCode.PROTOCOL_ERROR and exc.rid == 14, exc.message


def test_small_frames_of_nested_array_headers_are_refused_by_the_scan():
    # msgpack allocates each list's slots on its header: ~680 nested ones in 2 KiB cost ~15 ms
    head = msgpack.packb({"v": V, "id": 15, "op": "ping"})
    for size in (2 << 10, 8 << 10):
        for header in (b"\xdc" + (size - 64).to_bytes(2, "big"), b"\xdd" + (size - 64).to_bytes(4, "big"),
                       b"\xdc" + UNSCANNED_LIST_ITEMS.to_bytes(2, "big")):
            frame = bytes([head[0] + 1]) + head[1:] + msgpack.packb("padding") + header * ((size - 64) // 5)
            exc = refusal(frame)
            assert exc.code is ErrorCode.PROTOCOL_ERROR and "refused unread" in exc.message and exc.rid == 15


@pytest.mark.parametrize("n", [UNSCANNED_LIST_ITEMS, UNSCANNED_LIST_ITEMS + 1, 500])
def test_small_frames_with_longer_lists_decode_through_the_scan(n):
    keys = [bytes([0xdc, 0xdd, i % 256]) * 4 for i in range(n)]  # payloads like array headers
    frame = protocol.encode_request(Op.LOOKUP, 16, session=4, keys=keys)
    assert len(frame) <= 8 << 10
    assert protocol.decode_request(frame).keys == tuple(keys)
    pages = list(range(n * 5))
    assert protocol.decode_request(protocol.encode_request(Op.UNPIN, 17, session=4, pages=pages)).pages == \
        tuple(pages)
