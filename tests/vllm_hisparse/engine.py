"""A HiSparse scheduler side built from vLLM 0.34's real classes, with its host pool on hisparsed.

``SchedulerSide`` is what vLLM's ``Scheduler`` builds for a HiSparse model,
minus the model config: a real ``KVCacheManager`` over a ``KVCacheConfig``
whose groups are a host-resident HiSparse source group (MLA) and an
indexer group, the real ``HiSparseCoordinator`` (which binds vLLM's own
host pool), then ``hisparse_connector.install_daemon_pool``, ``pin_before_lookups`` and
``reserve_before_admission``, the calls our ``HiSparseConnector`` makes in
``bind_kv_cache_manager``. Requests are real ``vllm.v1.request.Request``
objects hashed with vLLM's sha256 block hasher, so two processes make the
same keys.

The worker's part (a spill of a page into its host block) is played by
``write``: it fills the host block's rows in the region, in every layer,
with bytes derived from the block's tokens, so a reader can tell whose
bytes a page holds. ``publish`` is the coordinator's publication call
(``HiSparseSourceManager.publish_blocks``, what it runs once spills
complete); ``step`` is ``HiSparseConnector.build_connector_meta``'s flush.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.request import Request, RequestStatus

from hisparse.vllm.config import AdapterConfig
from hisparse.vllm.hisparse_connector import (
    install_daemon_pool,
    pin_before_lookups,
    reserve_before_admission,
)
from hisparse.vllm.host_region import HostGeometry, derive_namespace

BLOCK_TOKENS = 4
NUM_LAYERS = 2
HEAD_BYTES = 8  # MLA head_size 8 in bf16: 16-byte rows


def kv_cache_config(num_host_blocks: int, *, num_layers: int = NUM_LAYERS,
                    block_tokens: int = BLOCK_TOKENS, head_size: int = HEAD_BYTES,
                    indexer: bool = False) -> KVCacheConfig:
    """A HiSparse ``KVCacheConfig`` as ``get_hisparse_kv_cache_config`` lays it out (host LBNHC)."""
    spec = MLAAttentionSpec(block_size=block_tokens, num_kv_heads=1, head_size=head_size,
                            dtype=torch.bfloat16)
    indexer_spec = FullAttentionSpec(block_size=block_tokens, num_kv_heads=1, head_size=4,
                                     dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    layer_bytes = num_host_blocks * spec.page_size_bytes
    host = KVCacheTensor(size=num_layers * layer_bytes, layers=layers, layer_stride=layer_bytes,
                         block_stride=spec.page_size_bytes, offset=0, host_resident=True)
    groups = [KVCacheGroupSpec(layers, spec, host_resident=True, role=KVCacheGroupRole.HISPARSE_SOURCE)]
    if indexer:
        # With the indexer group a fresh engine's hit is min(host, indexer) = 0 unless
        # the indexer's blocks come from elsewhere (docs/vllm-hisparse.md).
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.indexer" for i in range(num_layers)],
                                       indexer_spec, role=KVCacheGroupRole.HISPARSE_INDEXER))
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[host], kv_cache_groups=groups,
        hisparse_host_num_blocks=num_host_blocks,
        hisparse_host_block_stride=num_layers * spec.page_size_bytes)


def token_bytes(tokens: list[int], row_bytes: int, layer: int) -> np.ndarray:
    """The rows a worker would write for ``tokens`` in ``layer``: a digest of (layer, token)."""
    rows = np.empty((len(tokens), row_bytes), dtype=np.uint8)
    for i, token in enumerate(tokens):
        digest = hashlib.sha256(f"{layer}:{token}".encode()).digest()
        rows[i] = np.frombuffer((digest * (row_bytes // 32 + 1))[:row_bytes], dtype=np.uint8)
    return rows


@dataclass
class SchedulerSide:
    socket: str
    num_host_blocks: int = 16
    step_blocks: int = 4
    max_model_len: int = 256
    name: str = "engine"
    requests: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        self.config = kv_cache_config(self.num_host_blocks)
        self.geometry = HostGeometry.from_kv_cache_config(self.config)
        self.namespace = derive_namespace(model="org/glm-test", kv_cache_dtype="auto",
                                          geometry=self.geometry, hash_algo="sha256", tp_size=1)
        self.manager = KVCacheManager(self.config, max_model_len=self.max_model_len,
                                      scheduler_block_size=BLOCK_TOKENS, hash_block_size=BLOCK_TOKENS,
                                      enable_caching=True)
        self.coordinator = get_hisparse_coordinator(self.manager)
        self.host_manager = self.coordinator.host_manager
        settings = AdapterConfig(socket=self.socket, timeout_s=1.0, mirror_refresh_s=0.0)
        self.pool = install_daemon_pool(self.host_manager, self.namespace, self.geometry, settings,
                                        step_blocks=self.step_blocks)
        pin_before_lookups(self.manager.coordinator, self.host_manager, self.pool)
        reserve_before_admission(self.host_manager, self.pool)
        # Test scaffolding for a config of the source group alone (vLLM then builds
        # a UnitaryKVCacheCoordinator, which looks prefixes up in its own pool; the
        # hybrid one a real HiSparse model gets uses each group's pool), and for
        # admission's "does not fit" answer, which reads the resident groups' pool.
        if len(self.config.kv_cache_groups) == 1:
            self.manager.coordinator.block_pool = self.pool
        if self.coordinator.gpu_pool is None:
            self.coordinator.gpu_pool = self.manager.block_pool
        self.hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)

    @property
    def region(self) -> Any:
        return self.pool._ops.client.session.region

    def add(self, req_id: str, tokens: list[int]) -> Request:
        request = Request(req_id, list(tokens), SamplingParams(max_tokens=1), None,
                          block_hasher=self.hasher)
        self.requests[req_id] = request
        return request

    def admit(self, request: Request) -> int | None:
        """Prefix lookup and allocation of the whole prompt; the hit length, None if no room."""
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        if new is None:
            return None
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        return num_hit

    def host_blocks(self, request: Request) -> list[int]:
        gid = self.coordinator.host_group_id
        return [b.block_id for b in self.manager.get_blocks(request.request_id).blocks[gid]]

    def write(self, request: Request, start_token: int = 0) -> None:
        """The worker's spill: fill each host block from ``start_token`` on with its tokens' rows."""
        pages = self.region.pages_view()
        lay = self.geometry.layout
        for index, page in enumerate(self.host_blocks(request)):
            lo = index * BLOCK_TOKENS
            tokens = request.all_token_ids[lo:lo + BLOCK_TOKENS]
            if lo + BLOCK_TOKENS <= start_token or not tokens:
                continue
            for layer in range(lay.num_layers):
                rows = token_bytes(tokens, lay.row_bytes, layer)
                pages[layer, page, :rows.size] = rows.reshape(-1)

    def read_ok(self, request: Request, num_tokens: int) -> bool:
        """True when the bytes under the request's host blocks are the rows of its tokens."""
        pages = self.region.pages_view()
        lay = self.geometry.layout
        for index, page in enumerate(self.host_blocks(request)[:num_tokens // BLOCK_TOKENS]):
            tokens = request.all_token_ids[index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS]
            for layer in range(lay.num_layers):
                want = token_bytes(tokens, lay.row_bytes, layer).reshape(-1)
                if not np.array_equal(pages[layer, page, :want.size], want):
                    return False
        return True

    def publish(self, request: Request) -> None:
        """What the coordinator calls once the request's spills are durable."""
        self.host_manager.publish_blocks(request, request.num_tokens, replay_boundaries=())

    def finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED_STOPPED
        self.manager.free(request)
        self.requests.pop(request.request_id, None)

    def step(self) -> None:
        self.pool.flush()

    def close(self) -> None:
        self.pool.close()
