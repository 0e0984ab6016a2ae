"""Which SGLang engines share pages: a pool's namespace and page geometry, and its page codec.

Two engines (or TP ranks) may share a namespace exactly when the bytes one
of them stores for a page hash are what the other would store: the same
served model, KV dtype, row width, layer range, page size and pool, the
same key scheme (SGLang's SHA-256 page chain), and for pools whose bytes
differ per rank (every non-MLA pool under TP, DCP shards) the same rank.
SGLang's page hashes carry none of this (the ``file`` backend appends
suffixes); here it is the namespace, so pages of other pools, models or
ranks are not merely keyed apart but invisible.

An MLA KV pool's pages are stored in hisparse's logical layout whatever the
host pool's layout: layer-major, the row of (layer ``l``, token ``t``) at
``(l*page_size + t)*row_bytes`` with ``row_bytes = kv_cache_dim*itemsize``.
So ``layer_first``, ``page_first`` and ``page_first_direct`` engines share
one namespace, and a region row is a KV row (what HiSparse reads). Other
pools (the DSA indexer, MHA) keep SGLang's flat page bytes as they are and
put the host layout in the namespace.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from hisparse.errors import InvalidArgument
from hisparse.layout import KVLayout

NAMESPACE_SCHEMA = 1  # bump when the page placement changes: old pages become unreadable
KEY_SCHEME = "sglang-sha256-page-chain"  # hicache_storage.get_hash_str / get_storage_hash_str
KEY_BYTES = 32
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MODEL_CHARS = 80
CANONICAL_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolGeometry:
    """Everything about one host pool that decides its page bytes."""

    pool: str              # SGLang's PoolName value ("kv", "indexer", ...)
    pool_class: str        # the host pool's class, e.g. MLATokenToKVPoolHost
    host_layout: str       # "layer_first" / "page_first" / "page_first_direct" ...
    dtype: str
    num_layers: int
    start_layer: int
    page_size: int
    row_bytes: int         # canonical: kv_cache_dim * itemsize; opaque: the page's bytes / (layers * page_size)
    page_bytes: int
    canonical: bool        # pages are stored layer-major (MLA KV), so host layouts share

    @property
    def layout(self) -> KVLayout:
        if self.canonical:
            return KVLayout(num_layers=self.num_layers, block_tokens=self.page_size, row_bytes=self.row_bytes)
        return KVLayout(num_layers=1, block_tokens=1, row_bytes=self.page_bytes)


def is_mla_kv_pool(host_pool: Any) -> bool:
    return (type(host_pool).__name__ == "MLATokenToKVPoolHost"
            and getattr(host_pool, "kv_buffer", None) is not None
            and host_pool.layout in CANONICAL_LAYOUTS)


def pool_geometry(host_pool: Any, pool: str) -> PoolGeometry:
    """Read a registered SGLang host pool's geometry."""
    flat = host_pool.get_data_page(0, flat=True)
    page_bytes = int(flat.numel() * flat.element_size())
    layers = int(getattr(host_pool, "layer_num", 1) or 1)
    page_size = int(getattr(host_pool, "page_size", 1) or 1)
    dtype = str(flat.dtype).removeprefix("torch.")
    start = int(getattr(host_pool, "start_layer", 0) or 0)
    if is_mla_kv_pool(host_pool):
        row = int(host_pool.kv_cache_dim) * host_pool.dtype.itemsize
        if row * layers * page_size != page_bytes:
            raise InvalidArgument(f"MLA host pool page is {page_bytes} B, not layers*page_size*row "
                                  f"= {layers}*{page_size}*{row}")
        return PoolGeometry(pool, type(host_pool).__name__, host_pool.layout, dtype, layers, start,
                            page_size, row, page_bytes, canonical=True)
    return PoolGeometry(pool, type(host_pool).__name__, str(getattr(host_pool, "layout", "?")), dtype,
                        layers, start, page_size, page_bytes, page_bytes, canonical=False)


def compatibility_fields(geometry: PoolGeometry, storage_config: Any) -> dict[str, Any]:
    """Everything that decides a page's bytes for a key; equal fields, equal pages."""
    c = storage_config
    fields = asdict(geometry)
    if geometry.canonical:
        # Stored layer-major, rows = KV rows: every host layout, and the linker's device
        # pool, reads the same bytes (the PP stage is in "pp").
        for name in ("host_layout", "pool_class", "start_layer"):
            fields.pop(name)
    per_rank = not c.is_mla_model or geometry.pool not in ("kv",)
    dcp = int(getattr(c, "dcp_size", 1) or 1)
    return {
        "schema": NAMESPACE_SCHEMA,
        "engine": "sglang",
        "keys": KEY_SCHEME,
        "model": c.model_name or "",
        "geometry": fields,
        "pp": [int(c.pp_rank), int(c.pp_size)],
        # MLA KV is the same on every TP rank: one copy, one writer (is_storage_writer).
        "tp": [int(c.tp_rank), int(c.tp_size)] if per_rank else None,
        "cp": [int(c.attn_cp_rank), int(c.attn_cp_size)] if int(c.attn_cp_size) > 1 else None,
        "dcp": [int(c.dcp_rank), dcp, c.logical_page_size] if dcp > 1 else None,
    }


def derive_namespace(geometry: PoolGeometry, storage_config: Any) -> str:
    """``sglang/<model>/<dtype>/<pool>/<digest>``: readable in ``hisparsectl stats``, exact by digest."""
    fields = compatibility_fields(geometry, storage_config)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    model = _UNSAFE.sub("_", (storage_config.model_name or "model").replace("/", "--")) or "model"
    model = model[-_MODEL_CHARS:]
    return f"sglang/{model}/{geometry.dtype}/{geometry.pool}/{digest}"


def key_bytes(key: str) -> bytes:
    """SGLang's page hash (64 hex digits) as the daemon's 32-byte key."""
    if isinstance(key, str) and len(key) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    raise InvalidArgument(
        f"hash mismatch: {str(key)[:80]!r} is not an SGLang page hash ({KEY_SCHEME}: 64 hex "
        "digits of SHA-256); this backend only stores pages keyed by SGLang's own page hashes")
