"""Cluster keys and the header every cluster value carries.

A page stored in the cluster (Mooncake Store) is one value under the key
``hs1/<fingerprint hex>/<page key hex>``. The fingerprint names the
namespace's page format: the namespace name (for vLLM namespaces it already
embeds a digest of model, KV dtype, cache layout, parallel split and hash
algorithm: ``hisparse.vllm.namespace``) together with its ``KVLayout``, so
two models or two layouts never share a value, even under equal page keys.

The value is ``header (64 B) + page bytes (layer-major, logical order)``::

    0   magic   b"HSPC"
    4   u16     format version (1)
    6   u16     flags (0)
    8   u64     page bytes that follow
    16  16 B    namespace fingerprint
    32  16 B    content hash: XXH3-128 of (page key || page bytes)
    48  16 B    zero

The content hash covers the page key too, so a value copied under another
key is refused like a corrupt one. A get is committed only when all of it
matches (``verify``); anything else is counted and dropped.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable

from hisparse.layout import KVLayout

MAGIC = b"HSPC"
FORMAT_VERSION = 1
HEADER_BYTES = 64
FINGERPRINT_BYTES = 16
KEY_PREFIX = "hs1"
_HEADER = struct.Struct("<4sHHQ16s16s16x")
assert _HEADER.size == HEADER_BYTES


def fingerprint(namespace: str, layout: KVLayout) -> bytes:
    """16 bytes naming the namespace's page format (see the module docstring)."""
    doc = json.dumps({"schema": FORMAT_VERSION, "namespace": namespace, "layout": layout.to_wire()},
                     sort_keys=True)
    return hashlib.blake2b(doc.encode(), digest_size=FINGERPRINT_BYTES).digest()


def cluster_key(fp: bytes, key: bytes) -> str:
    return f"{KEY_PREFIX}/{fp.hex()}/{key.hex()}"


def content_hash(key: bytes, parts: Iterable[memoryview | bytes]) -> bytes:
    """XXH3-128 of the page key followed by the page's bytes, part by part (no copy)."""
    import xxhash  # the cluster extra; the daemon without [cluster] never gets here

    h = xxhash.xxh3_128()
    h.update(key)
    for part in parts:
        h.update(part)
    return h.digest()


def pack_header(fp: bytes, page_bytes: int, digest: bytes) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, page_bytes, fp, digest)


def verify(header: bytes, fp: bytes, page_bytes: int, digest: bytes) -> str | None:
    """None when ``header`` announces exactly this page; else what does not match."""
    if len(header) != HEADER_BYTES:
        return f"header is {len(header)} bytes"
    magic, version, _flags, size, got_fp, got_digest = _HEADER.unpack(header)
    if magic != MAGIC:
        return "not a hisparse value (magic)"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if got_fp != fp:
        return "namespace fingerprint differs"
    if size != page_bytes:
        return f"page of {size} bytes, expected {page_bytes}"
    if got_digest != digest:
        return "content hash differs"
    return None
