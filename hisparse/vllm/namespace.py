"""Which engines share pages: the namespace and page geometry derived from ``OffloadingConfig``.

Two engines may share a namespace exactly when a page one of them writes
for a key is what the other would write: same model, KV dtype and cache
layout, same cache groups and block sizes, same parallel split of a block's
bytes, same hash algorithm (so equal keys mean equal tokens). Everything
else (engine id, data-parallel index, rank, max_model_len, event settings)
is left out, so DP replicas, restarted engines and separately launched
engines of one model all land in one namespace. Both the scheduler and every
worker compute the namespace from the same inputs, so they always agree.

Page geometry (``derive_layout``): one key is one chunk of one cache group:
``blocks_per_chunk`` vLLM blocks of one group's layers, as held by every
worker that writes a copy (``copies``: 1 when vLLM marks the layout
replicated, e.g. MLA under TP, else ``world_size``). With ``L`` the largest
group's layer count and ``bt = tokens_per_block * blocks_per_chunk``::

    KVLayout(num_layers=L, block_tokens=bt,
             row_bytes=ceil(worker_kv_bytes_per_block * blocks_per_chunk * copies / (L * bt)))

so a page holds the largest group's chunk from every copy. How a worker
places its blocks inside that page is ``hisparse.vllm.worker.PagePlan``;
for one group of equal-sized layers and one copy it puts vLLM layer ``l`` in
region layer ``l`` and token ``t`` of the chunk in row ``t`` (for MLA,
whose per-layer block is ``[tokens, row]``, region rows are KV rows).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from hisparse.errors import InvalidArgument
from hisparse.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

NAMESPACE_SCHEMA = 1  # bump when the page placement changes: old pages become unreadable
_MODEL_CHARS = 96
_UNSAFE = re.compile(r"[^A-Za-z0-9._/-]+")


def num_copies(config: OffloadingConfig) -> int:
    """How many workers write distinct bytes of each block into the page."""
    return 1 if config.replicated_layout else max(1, config.parallel.world_size)


def derive_layout(config: OffloadingConfig) -> KVLayout:
    """The KVLayout of this engine's pages (see the module docstring)."""
    if not config.groups:
        raise InvalidArgument("OffloadingConfig has no cache groups to offload")
    if config.worker_kv_bytes_per_block <= 0:
        raise InvalidArgument("OffloadingConfig.worker_kv_bytes_per_block is 0: vLLM allocated no KV "
                              "cache blocks, so there is nothing to size hisparse pages by")
    blocks_per_chunk = config.cache.blocks_per_chunk
    num_layers = max(len(group.layer_names) for group in config.groups)
    block_tokens = max(group.tokens_per_block for group in config.groups) * blocks_per_chunk
    page_bytes = config.worker_kv_bytes_per_block * blocks_per_chunk * num_copies(config)
    row_bytes = -(-page_bytes // (num_layers * block_tokens))
    return KVLayout(num_layers=max(1, num_layers), block_tokens=block_tokens, row_bytes=row_bytes)


def compatibility_fields(config: OffloadingConfig, layout: KVLayout, hash_algo: str) -> dict[str, Any]:
    """Everything that decides a page's bytes for a key; equal fields, equal pages."""
    from hisparse.vllm.compat import group_window

    p = config.parallel
    return {
        "schema": NAMESPACE_SCHEMA,
        "model": config.model.name,
        "dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "groups": [
            {"group_id": g.group_id, "tokens_per_block": g.tokens_per_block,
             "layer_names": list(g.layer_names),
             "sliding_window_size_in_chunks": group_window(g)}
            for g in config.groups
        ],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "parallel": {"world_size": p.world_size, "tp": p.tp_size, "pp": p.pp_size,
                     "pcp": p.pcp_size, "dcp": p.dcp_size},
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "hash_algo": hash_algo,
        "layout": layout.to_wire(),
    }


def derive_namespace(config: OffloadingConfig, layout: KVLayout, hash_algo: str) -> str:
    """``vllm/<model>/<dtype>/tp<T>pp<P>/<digest>``: readable in ``hisparsectl stats``, exact by digest."""
    fields = compatibility_fields(config, layout, hash_algo)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    model = _UNSAFE.sub("_", config.model.name).strip("/") or "model"
    if len(model) > _MODEL_CHARS:
        model = model[-_MODEL_CHARS:]  # the tail names the model; the head is often a mount path
    dtype = _UNSAFE.sub("_", config.model.dtype) or "dtype"
    p = config.parallel
    return f"vllm/{model}/{dtype}/tp{p.tp_size}pp{p.pp_size}/{digest}"
