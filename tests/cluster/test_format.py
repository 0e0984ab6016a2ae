"""Cluster value keys and headers, and the wire fields of remote lookups and prefetch (no Mooncake)."""

from __future__ import annotations

import pytest

from hisparse import KVLayout, errors, protocol
from hisparse.cluster import format as fmt
from hisparse.protocol import ErrorCode, Op, WireError

LAYOUT = KVLayout(4, 16, 64)
KEY = b"\x07" * 36


def test_fingerprint_tells_namespaces_and_layouts_apart():
    fp = fmt.fingerprint("m", LAYOUT)
    assert len(fp) == fmt.FINGERPRINT_BYTES and fp == fmt.fingerprint("m", LAYOUT)
    assert fp != fmt.fingerprint("m2", LAYOUT)
    assert fp != fmt.fingerprint("m", KVLayout(4, 16, 32))
    key = fmt.cluster_key(fp, KEY)
    assert key == f"hs1/{fp.hex()}/{KEY.hex()}" and key != fmt.cluster_key(fp, b"\x08" * 36)


def test_header_round_trip_and_every_refusal():
    pytest.importorskip("xxhash", reason="the content hash needs the cluster extra (xxhash)")
    page = bytes(range(256)) * 16
    fp = fmt.fingerprint("m", LAYOUT)
    digest = fmt.content_hash(KEY, [page[:100], page[100:]])  # parts hash as the whole
    assert digest == fmt.content_hash(KEY, [page])
    header = fmt.pack_header(fp, len(page), digest)
    assert len(header) == fmt.HEADER_BYTES
    assert fmt.verify(header, fp, len(page), digest) is None
    assert "hash" in fmt.verify(header, fp, len(page), fmt.content_hash(b"other", [page]))
    assert "fingerprint" in fmt.verify(header, fmt.fingerprint("x", LAYOUT), len(page), digest)
    assert "bytes" in fmt.verify(header, fp, len(page) + 1, digest)
    assert "magic" in fmt.verify(b"XXXX" + header[4:], fp, len(page), digest)
    assert "version" in fmt.verify(header[:4] + b"\x09\x00" + header[6:], fp, len(page), digest)
    assert "header" in fmt.verify(header[:10], fp, len(page), digest)


def test_lookup_remote_and_prefetch_fields_round_trip_and_are_typed():
    keys = [KEY]
    plain = protocol.decode_request(protocol.encode_request(Op.LOOKUP, 1, session=2, keys=keys))
    assert (plain.remote, plain.wait) == (False, True)
    remote = protocol.decode_request(protocol.encode_request(Op.LOOKUP, 1, session=2, keys=keys,
                                                             remote=True, wait=False))
    assert (remote.remote, remote.wait) == (True, False)
    pre = protocol.decode_request(protocol.encode_request(Op.PREFETCH, 1, session=2, keys=keys, wait=False))
    assert (pre.op, pre.keys, pre.wait) == (Op.PREFETCH, (KEY,), False)
    with pytest.raises(WireError) as exc:
        protocol.decode_request(protocol.encode_request(Op.LOOKUP, 1, session=2, keys=keys, remote=1))
    assert exc.value.code is ErrorCode.PROTOCOL_ERROR
    with pytest.raises(WireError) as exc:
        protocol.decode_request(protocol.encode_request(Op.PREFETCH, 1, session=2, keys=[b""]))
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    err = protocol.error_for_code("CLUSTER_UNAVAILABLE", "down")
    assert isinstance(err, errors.ClusterUnavailable)
