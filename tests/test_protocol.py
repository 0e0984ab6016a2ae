"""Protocol round trips and rejections: every malformed frame gets its typed code."""

from __future__ import annotations

import msgpack
import pytest

from hisparse import KVLayout, errors, protocol
from hisparse.protocol import ErrorCode, Op, WireError

V = protocol.VERSION


def pack(**msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def code_of(frame: bytes) -> ErrorCode:
    with pytest.raises(WireError) as exc:
        protocol.decode_request(frame)
    return exc.value.code


def test_every_op_round_trips():
    layout = KVLayout(78, 64, 656)
    hello = protocol.decode_request(protocol.encode_request(Op.HELLO, 1, namespace="m", layout=layout,
                                                            capacity_bytes=1 << 30, client="x"))
    assert (hello.namespace, hello.layout, hello.capacity_bytes) == ("m", layout, 1 << 30)
    keys = [b"\x01" * 36, b"\x02"]
    for op in (Op.LOOKUP, Op.RESERVE, Op.COMMIT, Op.ABORT, Op.PIN):
        req = protocol.decode_request(protocol.encode_request(op, 5, session=9, keys=keys))
        assert (req.op, req.id, req.session, req.keys) == (op, 5, 9, tuple(keys))
    unpin = protocol.decode_request(protocol.encode_request(Op.UNPIN, 5, session=9, pages=[3, 3, 0]))
    assert unpin.pages == (3, 3, 0)  # by page: a page pinned twice is unpinned twice
    evict = protocol.decode_request(protocol.encode_request(Op.EVICT_SESSION, 1, session=3, token="t",
                                                            target="0123ABCD"))
    assert (evict.token, evict.target) == ("t", "0123abcd")
    pub = protocol.decode_request(protocol.encode_request(Op.PUBLISH, 4, session=9, keys=keys,
                                                          as_keys=keys[::-1], pin=True))
    assert (pub.keys, pub.as_keys, pub.pin) == (tuple(keys), tuple(keys[::-1]), True)
    for op in (Op.HEARTBEAT, Op.STATS, Op.BYE):
        assert protocol.decode_request(protocol.encode_request(op, 2, session=3)).session == 3
    ev = protocol.decode_request(protocol.encode_request(Op.EVENTS, 1, session=3, after=7, limit=10))
    assert (ev.after, ev.limit) == (7, 10)
    clear = protocol.decode_request(protocol.encode_request(Op.CLEAR, 1, session=3, token="t",
                                                            namespace="m"))
    assert (clear.token, clear.namespace) == ("t", "m")
    assert set(protocol.REPLY_FIELDS) == set(Op)
    alias = protocol.decode_request(pack(v=V, id=1, op="hello", namespace="m", layout=layout.to_wire(),
                                         capacity="2GiB"))
    assert alias.capacity_bytes == 2 << 30


@pytest.mark.parametrize("frame, code", [
    (b"", ErrorCode.PROTOCOL_ERROR),
    (b"\xc1\xff", ErrorCode.PROTOCOL_ERROR),
    (msgpack.packb([1, 2]), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1), ErrorCode.PROTOCOL_ERROR),  # no op
    (pack(v=V + 1, id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
    (pack(v=float(V), id=1, op="ping"), ErrorCode.VERSION_MISMATCH),  # 2.0 is not version 2
    (pack(id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
    (pack(v=True, id=1, op="ping"), ErrorCode.VERSION_MISMATCH),
    (pack(v=V, id="1", op="ping"), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="explode"), ErrorCode.UNKNOWN_OP),
    (pack(v=V, id=1, op=7), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="lookup", keys=[b"k"]), ErrorCode.PROTOCOL_ERROR),  # no session
    (pack(v=V, id=1, op="lookup", session="s", keys=[b"k"]), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="lookup", session=1, keys=b"k"), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="lookup", session=1, keys=["text"]), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="lookup", session=1, keys=[b""]), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="lookup", session=1, keys=[b"x" * 65]), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="lookup", session=1, keys=[b"x"] * (protocol.MAX_KEYS_PER_REQUEST + 1)),
     ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="clear", session=1, namespace="m"), ErrorCode.PERMISSION_DENIED),
    (pack(v=V, id=1, op="shutdown"), ErrorCode.PERMISSION_DENIED),
    (pack(v=V, id=1, op="hello", namespace="m"), ErrorCode.PROTOCOL_ERROR),  # no layout
    (pack(v=V, id=1, op="hello", namespace="m", layout={"num_layers": 0, "block_tokens": 1,
                                                         "row_bytes": 1}), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="hello", namespace="", layout={}), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="events", session=1, after=0, limit=0), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="hello", namespace="m", layout={"num_layers": 1, "block_tokens": 1,
                                                         "row_bytes": 1}, capacity="lots"),
     ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="keys", session=1, cursor=-1), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="unpin", session=1, keys=[b"k"]), ErrorCode.PROTOCOL_ERROR),  # pages, not keys
    (pack(v=V, id=1, op="unpin", session=1, pages=[-1]), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="unpin", session=1, pages=[1 << 40]), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="unpin", session=1, pages=[True]), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="evict_session", session=1, token="t", target="xyz"), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="publish", session=1, keys=[b"k"], as_keys=[]), ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="publish", session=1, keys=[b"k"]), ErrorCode.PROTOCOL_ERROR),  # no as_keys
    (pack(v=V, id=1, op="publish", session=1, keys=[b"k"], as_keys=[b"x" * 65]),
     ErrorCode.INVALID_ARGUMENT),
    (pack(v=V, id=1, op="publish", session=1, keys=[b"k"], as_keys=[b"h"], pin=1), ErrorCode.PROTOCOL_ERROR),
    (pack(v=V, id=1, op="evict_session", session=1, target="01234567"), ErrorCode.PERMISSION_DENIED),
])
def test_rejections_have_typed_codes(frame, code):
    assert code_of(frame) == code


def test_keys_of_every_allowed_length_decode_and_a_long_one_is_named():
    """A small frame is decoded with bins held to a key's length; a longer key sends it to the
    scan and the decoder names it, in a frame of any size."""
    keys = [b"a", b"x" * protocol.MAX_KEY_BYTES, b"k" * 36]
    assert protocol.decode_request(pack(v=V, id=1, op="lookup", session=1, keys=keys)).keys == tuple(keys)
    for pad in (0, 400):  # unscanned, then scanned (over SCAN_ABOVE_BYTES)
        bad = keys * pad + [b"k" * 36, b"x" * (protocol.MAX_KEY_BYTES + 1)]
        with pytest.raises(WireError) as exc:
            protocol.decode_request(pack(v=V, id=1, op="lookup", session=1, keys=bad))
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT
        assert f"keys[{len(bad) - 1}] is {protocol.MAX_KEY_BYTES + 1} bytes" in exc.value.message


def test_oversized_frame_is_refused_before_decoding():
    frame = b"\x00" * (protocol.MAX_FRAME_BYTES + 1)
    assert code_of(frame) == ErrorCode.FRAME_TOO_LARGE
    assert protocol.request_id(frame) is None


def test_request_id_is_recovered_from_bad_requests():
    assert protocol.request_id(pack(v=V, id=42, op="nope")) == 42
    assert protocol.request_id(b"\xc1") is None


def test_error_codes_map_to_the_contract_classes():
    cases = {
        ErrorCode.PROTOCOL_ERROR: errors.ProtocolError,
        ErrorCode.LAYOUT_MISMATCH: errors.LayoutMismatch,
        ErrorCode.CAPACITY: errors.CapacityError,
        ErrorCode.INVALID_ARGUMENT: errors.InvalidArgument,
        ErrorCode.NOT_HELD: errors.InvalidArgument,
        ErrorCode.NOT_FENCED: errors.InvalidArgument,
        ErrorCode.UNKNOWN_SESSION: errors.LeaseExpired,
        ErrorCode.SHUTTING_DOWN: errors.DaemonUnavailable,
    }
    for code, cls in cases.items():
        reply = protocol.decode_reply(protocol.encode_error(1, code, "m"))
        with pytest.raises(cls):
            reply.result()
    assert isinstance(protocol.error_for_code("???", "m"), errors.ProtocolError)


def test_replies_decode():
    assert protocol.decode_reply(protocol.encode_ok(3, {"count": 2})).result() == {"count": 2}
    with pytest.raises(errors.ProtocolError):
        protocol.decode_reply(b"\xc1")


def test_a_refused_frames_id_is_read_from_its_head_whatever_its_size():
    keys = [bytes([i % 256]) * 36 for i in range(100_000)]  # ~3.8 MB
    big = protocol.encode_request(Op.LOOKUP, 4242, session=3, keys=keys)
    assert protocol.leading_id(big) == 4242
    assert protocol.leading_id(big[:20]) == 4242  # only the head is read
    assert protocol.leading_id(protocol.encode_request(Op.PING, 1 << 40)) == 1 << 40
    # not where a client puts it, not an int, or no request map: unaddressed
    assert protocol.leading_id(msgpack.packb({"a": 1, "b": 2, "c": 3, "d": 4, "id": 9})) is None
    assert protocol.leading_id(msgpack.packb({"keys": [b"x"], "id": 9})) is None
    assert protocol.leading_id(msgpack.packb({"v": 2, "id": "nine"})) is None
    assert protocol.leading_id(msgpack.packb({"v": 2, "id": -1})) is None
    for junk in (b"", b"\x81", b"\x93\x01\x02\x03", b"\xc1" * 64, b"\x82\xa2id"):
        assert protocol.leading_id(junk) is None
