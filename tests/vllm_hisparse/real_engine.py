"""vLLM 0.34's real ``Scheduler`` for a HiSparse model on CPU, with our ``HiSparseConnector`` loaded by vLLM.

What is vLLM's own here: ``ModelConfig`` (from a tiny DeepSeek-V3.2 config
written by transformers into a directory: no download), ``VllmConfig``
(with ``platform.install``'s two classmethods), the KV cache layout
resolution, ``get_hisparse_kv_cache_groups`` and
``get_kv_cache_config_from_groups`` (vLLM's HiSparse layout: host source,
indexer, resident and hot groups), ``generate_scheduler_kv_cache_config``,
the ``Scheduler`` (which builds our connector through
``kv_connector_module_path`` and binds it to its ``KVCacheManager``), the
``HiSparseCoordinator`` planning spills and publishing, ``Request``.

What stands in for the GPU worker: ``Engine.step`` reads the step's
``HiSparsePoolMetadata`` and performs its page transfers by writing each
spilled page's rows into the region at the host block vLLM chose (bytes
derived from the page's tokens, as ``engine.token_bytes``), then reports
them complete in a ``HiSparseConnectorWorkerMetadata``, as the worker does.
"""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.vllm_hisparse import platform

atexit.register(gc.unfreeze)  # what the engines froze is freed at exit, as vLLM's shutdown does

BLOCK_TOKENS = 64
MLA_HEAD = 48  # kv_lora_rank 32 + rope 16: 96-byte bf16 rows
NUM_LAYERS = 2


def write_model_dir(path: str) -> str:
    """A DeepSeek-V3.2 config small enough to plan for (no weights: the scheduler needs none)."""
    from transformers.models.deepseek_v32 import DeepseekV32Config

    config = DeepseekV32Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_topk=64,
        max_position_embeddings=4096, first_k_dense_replace=1)
    config.architectures = ["DeepseekV32ForCausalLM"]
    config.save_pretrained(path)
    return path


def layer_specs() -> dict[str, Any]:
    """Per-layer KV specs as the model runner reports them: sparse MLA and its indexer."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs: dict[str, Any] = {}
    for i in range(NUM_LAYERS):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=66, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER)
    return specs


def make_configs(socket: str, model_dir: str, *, host_pool_gib: float = 0.01, extra: dict[str, Any] | None = None,
                 with_indexer: bool = False, extensible: bool = False, max_model_len: int = 2048,
                 own_pool: bool = False) -> tuple[Any, Any]:
    """vLLM's ``VllmConfig`` for the tiny model with our connector(s), and the worker's ``KVCacheConfig``.

    ``own_pool``: vLLM's own ``HiSparseConnector`` and its private host pool instead of ours."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    platform.install()
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.hisparse.layout import get_hisparse_kv_cache_groups

    hisparse = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "hisparse.vllm.hisparse_connector",
                "kv_connector_extra_config": {"host_pool_gib": host_pool_gib, "socket": socket,
                                              **(extra or {})}}
    if own_pool:
        hisparse = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"host_pool_gib": host_pool_gib}}
    if with_indexer:
        indexer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"spec_name": "HiSparseOffloadingSpec",
                                                 "spec_module_path": "hisparse.vllm",
                                                 "socket": socket, "capacity": "8MiB",
                                                 "mirror_refresh_s": 0.0}}
        transfer = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"connectors": [hisparse, indexer]})
    else:
        transfer = KVTransferConfig(**hisparse)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len),
        kv_transfer_config=transfer, device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True,
                                 enable_extensible_kv_cache=False),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8,
                                         max_model_len=max_model_len, is_encoder_decoder=False))
    # CUDA's default; the CPU platform refuses it at validation, the worker code runs it
    vllm_config.cache_config.enable_extensible_kv_cache = extensible
    specs = layer_specs()
    resolve_kv_cache_layout(vllm_config, [["BLHNC"]], specs.values())
    groups = get_hisparse_kv_cache_groups(vllm_config, specs)
    worker_config = get_kv_cache_config_from_groups(vllm_config, groups, 64 << 20)
    register_all_kvcache_specs(vllm_config)
    init_none_hash(sha256)
    return vllm_config, worker_config


@dataclass
class Engine:
    """One engine's scheduler process: vLLM's Scheduler, our connector, the worker stand-in."""

    socket: str
    model_dir: str
    host_pool_gib: float = 0.01
    extra: dict[str, Any] = field(default_factory=dict)
    # MultiConnector[our HiSparseConnector, OffloadingConnector(HiSparseOffloadingSpec)]:
    # the indexer group's blocks through hisparsed too (docs/vllm-hisparse.md)
    with_indexer: bool = False
    max_model_len: int = 2048
    own_pool: bool = False  # vLLM's own HiSparseConnector with its private host pool (a baseline)

    def __post_init__(self) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_request_block_hasher
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        vllm_config, worker_config = make_configs(self.socket, self.model_dir, host_pool_gib=self.host_pool_gib,
                                                  extra=self.extra, with_indexer=self.with_indexer,
                                                  max_model_len=self.max_model_len, own_pool=self.own_pool)
        self.kv_cache_config = generate_scheduler_kv_cache_config([worker_config])
        vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.vllm_config = vllm_config
        self.scheduler = Scheduler(vllm_config, self.kv_cache_config, StructuredOutputManager(vllm_config),
                                   block_size=BLOCK_TOKENS)
        self.multi = self.scheduler.connector if self.with_indexer else None
        self.connector = self.multi._connectors[0] if self.multi is not None else self.scheduler.connector
        self.pool = getattr(self.connector, "host_pool", None)  # None: vLLM's own pool
        self.coordinator = self.connector.connector_scheduler.coordinator
        self.hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self.fence_paths: tuple[str, ...] = ()
        # As vLLM's EngineCore does once its scheduler is built: the start-up heap leaves the
        # collector, or a full collection pauses a step 0.3-1 s (tests/vllm/harness.py too).
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> dict[str, int]:
        """One engine step; the tokens scheduled per request."""
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
            HiSparseConnectorWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        metas = meta.metadata if self.multi is not None else (meta,)
        hs = metas[0]
        self.fence_paths = getattr(hs, "fence_paths", ())  # vLLM's own connector: none
        transfers = hs.command.page_transfers if hs.command is not None else []
        for transfer in transfers:
            self._spill(transfer)
        ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[7] if requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
                    >= requests[r].num_tokens else [] for r in ids]
        done = {t.transfer_id: 1 for t in transfers}
        worker: Any = HiSparseConnectorWorkerMetadata(done, done) if done else None
        recving: set[str] = set()
        if self.multi is not None:
            # The offloading worker's part: every store and load job of the step completes
            # (the indexer bytes themselves are the OffloadingConnector adapter's, tested in tests/vllm).
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
                MultiKVConnectorWorkerMetadata,
            )
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )

            jobs = {**metas[1].load_jobs, **metas[1].store_jobs}
            offload = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in jobs}) if jobs else None
            recving = {job.req_id for job in metas[1].load_jobs.values()}
            worker = MultiKVConnectorWorkerMetadata((worker, offload)) if worker or offload else None
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker,
                                                  finished_recving=recving or None)))
        return dict(out.num_scheduled_tokens)

    def run(self, max_steps: int = 50) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"requests still running after {max_steps} steps")

    def _spill(self, transfer: Any) -> None:
        """The worker's device-to-host copy of one page, into the host block vLLM chose."""
        from tests.vllm_hisparse.engine import token_bytes

        if self.pool is None:
            return  # vLLM's own pool: no region to write

        request_id, page_index = self.coordinator.pending_spills[transfer.transfer_id].page
        request = self.scheduler.requests[request_id]
        tokens = request.all_token_ids[page_index * BLOCK_TOKENS:(page_index + 1) * BLOCK_TOKENS]
        pages = self.region.pages_view()
        row_bytes = self.region.geometry.layout.row_bytes
        for layer in range(NUM_LAYERS):
            rows = token_bytes(tokens, row_bytes, layer).reshape(-1)
            pages[layer, transfer.host_block_id, :rows.size] = rows

    @property
    def region(self) -> Any:
        return self.pool._ops.client.session.region

    def host_lookup(self, tokens: list[int]) -> list[int]:
        """The host group's own prefix lookup (pins first, as in a scheduling pass): its pages."""
        from vllm.v1.request import Request
        from vllm.sampling_params import SamplingParams

        probe = Request("probe", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        manager = self.coordinator.host_manager
        coordinator = self.scheduler.kv_cache_manager.coordinator
        group = manager.kv_cache_group_id
        coordinator.find_longest_cache_hit(probe.block_hashes, probe.num_tokens - 1)  # pins
        blocks, _ = type(manager).find_longest_cache_hit(
            block_hashes=probe.block_hashes, max_length=probe.num_tokens - 1, kv_cache_group_ids=[group],
            block_pool=manager.block_pool, kv_cache_spec=manager.kv_cache_spec, drop_eagle_block=False,
            alignment_tokens=BLOCK_TOKENS)
        return [b.block_id for b in blocks[0]]

    def bytes_ok(self, tokens: list[int], pages: list[int]) -> bool:
        from tests.vllm_hisparse.engine import token_bytes

        view = self.region.pages_view()
        row_bytes = self.region.geometry.layout.row_bytes
        for index, page in enumerate(pages):
            chunk = tokens[index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS]
            for layer in range(NUM_LAYERS):
                want = token_bytes(chunk, row_bytes, layer).reshape(-1)
                if not (view[layer, page, :want.size] == want).all():
                    return False
        return True

    def close(self) -> None:
        (self.multi or self.connector).shutdown()


def run_plan(socket: str, model_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    """One engine (MultiConnector with the indexer) in this process: serve ``prompts`` one by one.

    Reports per request the prefix vLLM took from elsewhere (``external``:
    the tokens it waited for, host pages and indexer blocks) and the tokens
    it computed, and whether the bytes under its host blocks are its tokens'.
    """
    engine = Engine(socket, model_dir, with_indexer=True)
    report: dict[str, Any] = {"requests": []}
    try:
        for index, tokens in enumerate(prompts):
            request = engine.add(f"r{index}", tokens)
            computed = external = passes = 0
            host_pages: list[int] = []
            for _ in range(50):
                if not engine.scheduler.requests:
                    break
                before = request.num_computed_tokens
                scheduled = engine.step()
                passes += 1
                if not host_pages and request.request_id in engine.scheduler.requests:
                    host_pages = [b.block_id for b in engine.scheduler.kv_cache_manager.get_blocks(
                        request.request_id).blocks[engine.coordinator.host_group_id]]
                if not scheduled.get(request.request_id) and request.num_computed_tokens > before:
                    external += request.num_computed_tokens - before
                computed += scheduled.get(request.request_id, 0)
            report["requests"].append({
                "external": external, "computed": computed, "host_pages": host_pages,
                "passes": passes,
                "bytes_ok": engine.bytes_ok(tokens, host_pages[:len(tokens) // BLOCK_TOKENS])})
        report["counters"] = dict(engine.pool.counters)
    finally:
        engine.close()
    return report


if __name__ == "__main__":
    import json
    import sys

    result = run_plan(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
    print(json.dumps({"done": result}), flush=True)
