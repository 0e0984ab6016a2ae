"""A vLLM engine without a model: vLLM's real ``Scheduler`` and a WORKER-role ``OffloadingConnector``.

``VllmEngine`` builds what ``vllm serve`` builds around the KV cache, from
the local model config in ``tests/vllm/model`` (no weights):
``VllmConfig`` with ``--kv-transfer-config`` naming ``HiSparseOffloadingSpec``,
a ``KVCacheConfig`` from vLLM's own planner, the ``Scheduler`` (which creates
the SCHEDULER-role ``OffloadingConnector`` through its factory), a
WORKER-role ``OffloadingConnector``, and CPU KV caches from vLLM's own
allocator registered with it.

``step()`` is one engine step: ``schedule()``, the worker connector's half
(as vLLM's CPU model runner drives it), a deterministic "forward pass",
``update_from_output``. The forward pass writes each token's KV as a
function of the token ids up to it, and before writing checks that every
token the scheduler counts as computed (recomputed, cached, or loaded from
hisparsed) holds exactly the KV that function gives: a wrong byte loaded
from the tier shows up in ``mismatches``.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import os
import time
from collections import Counter
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
BLOCK_SIZE = 16
NUM_LAYERS = 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
VOCAB = 1000

_model_config: ModelConfig | None = None


def model_config() -> ModelConfig:
    """One ModelConfig per process (vLLM inspects the architecture once)."""
    global _model_config
    if _model_config is None:
        _model_config = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float16",
                                    max_model_len=1024, seed=0)
    return _model_config


def extra_config(socket: str, **extra: Any) -> dict[str, Any]:
    return {"spec_name": "HiSparseOffloadingSpec", "spec_module_path": "hisparse.vllm",
            "socket": socket, "capacity": "4MiB", "timeout_s": 2.0, "deadline_s": 2.0, **extra}


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """``length`` token ids: ``prefix`` then ids drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    head = list(prefix or [])
    tail = torch.randint(1, VOCAB, (max(0, length - len(head)),), generator=gen).tolist()
    return (head + tail)[:length]


def token_kv(tokens: list[int], position: int, layer: int) -> bytes:
    """The KV of ``tokens[position]`` in ``layer``: a function of ``tokens[:position + 1]``."""
    h = hashlib.sha256(repr((layer, tokens[:position + 1])).encode()).digest()
    return h * 4  # 128 bytes: 2 heads x 32 fp16 values


atexit.register(gc.unfreeze)  # what the engines froze is freed at exit, as vLLM's shutdown does


class VllmEngine:
    """One engine: scheduler, worker connector, CPU KV caches, a deterministic forward pass."""

    def __init__(self, socket: str, *, engine_id: str = "engine-0", num_blocks: int = 64,
                 policy: str | None = None, events: bool = False, hash_algo: str = "sha256",
                 **extra: Any) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(hash_fn)
        transfer: dict[str, Any] = dict(kv_connector="OffloadingConnector", kv_role="kv_both",
                                        engine_id=engine_id,
                                        kv_connector_extra_config=extra_config(socket, **extra))
        if policy is not None:
            transfer["kv_load_failure_policy"] = policy
        cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True,
                            prefix_caching_hash_algo=hash_algo)
        cache.kv_cache_layout = KVCacheLayout.LBNHC.name  # what the engine core resolves for CPU
        kwargs: dict[str, Any] = {}
        if events:
            from vllm.config import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        self.vllm_config = VllmConfig(
            model_config=model_config(),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                             enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=cache, kv_transfer_config=KVTransferConfig(**transfer),
            device_config=DeviceConfig("cpu"), **kwargs)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16)
        groups = get_kv_cache_groups(self.vllm_config, {name: spec for name in LAYER_NAMES})
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.vllm_config, groups, num_blocks * NUM_LAYERS * spec.page_size_bytes)
        cache.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK_SIZE, log_stats=True)
        self.worker = KVConnectorFactory.create_connector(config=self.vllm_config, role=KVConnectorRole.WORKER,
                                                          kv_cache_config=self.kv_cache_config)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBNHC)
        self.worker.register_kv_caches(self.kv_caches)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.computed: Counter[str] = Counter()  # tokens the forward pass computed, per request
        self.mismatches: list[tuple[str, int]] = []  # (request, position) holding wrong KV
        self.finished: dict[str, FinishReason] = {}
        self.hits_by_source: Counter[str] = Counter()  # the scheduler's external-hit metrics
        self.schedule_s: list[float] = []
        self.kv_events: list[Any] = []  # what the scheduler published (GPU and offloaded tiers)
        publisher = self.scheduler.kv_event_publisher
        publish = publisher.publish

        def record(batch: Any) -> None:
            self.kv_events.extend(batch.events)
            publish(batch)

        publisher.publish = record
        # As vLLM's EngineCore does once its scheduler is built: the start-up heap (vLLM, torch:
        # some 500k objects) leaves the collector, or each full collection pauses the engine
        # 0.1-0.3 s (and a reserve in flight misses its deadline_s, as a benchmark showed).
        freeze_gc_heap()

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def manager(self) -> Any:
        """The HiSparseOffloadingManager vLLM's connector created."""
        return self.scheduler.connector.scheduler.manager

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(req_id, tokens, params, None, block_hasher=self._hasher))

    def step(self, before_worker: Any = None) -> Any:
        """One engine step; ``before_worker()`` runs between ``schedule()`` and the worker's half."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.schedule_s.append(time.perf_counter() - t0)
        if before_worker is not None:
            before_worker()
        return self.finish_step(out)

    def finish_step(self, out: Any) -> Any:
        """The rest of a step after ``schedule()``: the worker's half, the forward pass, the update."""
        meta = out.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        sampled = self._forward(out.num_scheduled_tokens)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_cache_events=worker.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[sampled[r] for r in req_ids],
                                          kv_connector_output=connector_output)
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            stats = outputs.scheduler_stats
            connector_stats = stats.connector_prefix_cache_stats if stats is not None else None
            if connector_stats is not None:
                for source, tokens in connector_stats.hits_by_source.items():
                    self.hits_by_source[str(source)] += tokens
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
        return out

    def run(self, req_ids: list[str], timeout_s: float = 30.0) -> None:
        """Step until every request in ``req_ids`` finished."""
        deadline = time.monotonic() + timeout_s
        while not set(req_ids) <= self.finished.keys():
            if time.monotonic() > deadline:
                raise AssertionError(f"requests {set(req_ids) - self.finished.keys()} never finished")
            self.step()
            if not self.scheduler.has_requests():
                time.sleep(0.001)

    def drain(self, steps: int = 3, timeout_s: float = 10.0) -> None:
        """Keep stepping with nothing to run until the offloads in flight are committed."""
        deadline = time.monotonic() + timeout_s
        for _ in range(steps):
            self.step()
        manager = self.manager
        while True:
            with manager.lock:
                snap = manager.stats_snapshot()
            if snap["pending_jobs"] == 0 and snap["writing_keys"] == 0:
                self.step()  # publishes the events of the commits just made
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"offloads never settled: {snap}")
            self.step()
            time.sleep(0.002)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    # -- the forward pass --

    def _forward(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id, n in scheduled.items():
            request = self.scheduler.requests[req_id]
            tokens = list(request.all_token_ids)
            end = request.num_computed_tokens  # schedule() already counts this step's tokens
            start = end - n
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for position in range(start):
                if self._read(blocks, position, 0) != token_kv(tokens, position, 0) or \
                        self._read(blocks, position, 1) != token_kv(tokens, position, 1):
                    self.mismatches.append((req_id, position))
            for position in range(start, min(end, len(tokens))):
                for layer in range(NUM_LAYERS):
                    self._write(blocks, position, layer, token_kv(tokens, position, layer))
            self.computed[req_id] += n
            done = end >= request.num_tokens
            sampled[req_id] = [int.from_bytes(token_kv(tokens, end - 1, 0)[:2], "little") % VOCAB] if done else []
        return sampled

    def _slot(self, blocks: list[int], position: int, layer: int) -> torch.Tensor:
        cache = self.kv_caches[LAYER_NAMES[layer]]  # [B, H, N, C], LBNHC: [H, C] of a token is contiguous
        return cache[blocks[position // BLOCK_SIZE], :, position % BLOCK_SIZE, :]

    def _read(self, blocks: list[int], position: int, layer: int) -> bytes:
        return self._slot(blocks, position, layer).contiguous().view(torch.uint8).numpy().tobytes()

    def _write(self, blocks: list[int], position: int, layer: int, kv: bytes) -> None:
        slot = self._slot(blocks, position, layer)
        slot.copy_(torch.frombuffer(bytearray(kv), dtype=torch.float16).view(slot.shape))
