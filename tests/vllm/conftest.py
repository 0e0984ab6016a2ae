"""Engines for the vLLM adapter tests: vLLM's real classes against a real hisparsed.

``engines(**overrides)`` builds an ``OffloadingConfig`` the way vLLM's
connector would (``OffloadingSpecFactory.create_spec`` on it) and returns
an ``Engine``: its spec, its manager, and workers over CPU KV caches it
allocates. Every engine is shut down at the end of the test, so no session
outlives it.

Default geometry: one cache group of 2 layers, 4 tokens per block, 64 bytes
per layer per block (16-byte rows), so one page is 128 bytes and
``capacity_pages`` sizes the namespace's region in pages.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: E402

import hisparse.vllm.spec  # noqa: E402,F401  (registers the spec with vLLM's factory)
from hisparse.vllm.spec import HiSparseOffloadingSpec  # noqa: E402


NUM_GPU_BLOCKS = 32


def to_key(i: int, group: int = 0) -> OffloadKey:
    """A sha256-sized OffloadKey, as vLLM's default hash makes them."""
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), group)


def to_keys(ints: list[int], group: int = 0) -> list[OffloadKey]:
    return [to_key(i, group) for i in ints]


def req(req_id: str = "r") -> ReqContext:
    return ReqContext(req_id=req_id)


def offloading_config(socket: str, *, model: str = "org/model-a", dtype: str = "bfloat16",
                      groups: tuple[tuple[int, int], ...] = ((2, 4),), layer_block_bytes: int = 64,
                      worker_kv_bytes_per_block: int | None = None, blocks_per_chunk: int = 1,
                      world_size: int = 1, rank: int = 0, replicated: bool = False,
                      engine_id: str = "engine-0", enable_events: bool = True,
                      capacity_pages: int | None = 8, page_bytes: int | None = None,
                      extra: dict[str, Any] | None = None) -> OffloadingConfig:
    """``groups``: (num_layers, tokens_per_block) per cache group."""
    group_configs = tuple(
        OffloadingGroupConfig(tokens_per_block=tpb, group_id=g,
                              layer_names=tuple(f"model.layers.{i}.attn.g{g}" for i in range(n)))
        for g, (n, tpb) in enumerate(groups))
    if worker_kv_bytes_per_block is None:
        worker_kv_bytes_per_block = max(n for n, _ in groups) * layer_block_bytes
    config = OffloadingConfig(
        groups=group_configs, worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_events, extra_config={}, engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=groups[0][1], blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
        replicated_layout=replicated)
    ec: dict[str, Any] = {"spec_name": "HiSparseOffloadingSpec", "spec_module_path": "hisparse.vllm",
                          "socket": socket, "timeout_s": 2.0, "deadline_s": 2.0,
                          "mirror_refresh_s": 0}
    if capacity_pages is not None:
        from hisparse.vllm.namespace import derive_layout

        ec["capacity"] = capacity_pages * (page_bytes or derive_layout(config).page_bytes)
    ec.update(extra or {})
    return _with_extra(config, ec)


def _with_extra(config: OffloadingConfig, extra: dict[str, Any]) -> OffloadingConfig:
    from dataclasses import replace

    return replace(config, extra_config=extra)


class Locked:
    """The manager as vLLM calls it: every call under ``manager.lock`` (its syncer thread takes it too)."""

    def __init__(self, manager: Any) -> None:
        self.raw = manager

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.raw.lock:
                result = attr(*args, **kwargs)
                return list(result) if name == "take_events" else result

        return call


def wait_until(predicate: Any, timeout_s: float = 30.0, what: str = "condition",
               describe: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {describe()}" if describe else ""))
        time.sleep(0.002)


def settled_lookups(manager: Any, keys: list[OffloadKey], ctx: ReqContext | None = None,
                    timeout_s: float = 30.0) -> list[LookupResult]:
    """Look ``keys`` up as the scheduler does, step after step, until no answer is RETRY.

    A committed key answers RETRY until the background thread has pinned it;
    the next look says HIT.
    """
    ctx = ctx or ReqContext(req_id="r")
    results: list[LookupResult] = []

    def settled() -> bool:
        results[:] = [manager.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY in results:
            manager.on_schedule_end(ScheduleEndContext((), ()))
            return False
        return True

    wait_until(settled, timeout_s, f"lookups of {len(keys)} keys to settle")
    return results


def settle(manager: Any, timeout_s: float = 10.0) -> None:
    """Wait until the background thread has run every queued commit, abort and unpin."""
    wait_until(lambda: manager.stats_snapshot()["pending_jobs"] == 0
               and manager.stats_snapshot()["writing_keys"] == 0, timeout_s, "queued daemon jobs")


@dataclass
class Engine:
    """One engine's spec, with its manager and CPU workers made on demand."""

    spec: HiSparseOffloadingSpec
    workers: list[Any] = field(default_factory=list)

    @property
    def manager(self) -> Any:
        return Locked(self.spec.get_manager())

    def kv_caches(self, layer_sizes: list[list[int]] | None = None, seed: int = 0) -> CanonicalKVCaches:
        """CPU KV caches, one int8 ``[NUM_GPU_BLOCKS, size]`` tensor per layer, filled at random."""
        if layer_sizes is None:
            layer_sizes = [[64] * len(g.layer_names) for g in self.spec.config.groups]
        gen = torch.Generator().manual_seed(seed)
        tensors: list[CanonicalKVCacheTensor] = []
        refs: list[list[CanonicalKVCacheRef]] = []
        for sizes in layer_sizes:
            group_refs = []
            for size in sizes:
                t = torch.randint(-128, 128, (NUM_GPU_BLOCKS, size), dtype=torch.int8, generator=gen)
                tensors.append(CanonicalKVCacheTensor(tensor=t, page_size_bytes=size))
                group_refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1, page_size_bytes=size))
            refs.append(group_refs)
        return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)

    @staticmethod
    def block_bytes(kv_caches: CanonicalKVCaches, block_id: int) -> bytes:
        """Every layer's bytes of one block of group 0."""
        return b"".join(block_bytes(kv_caches, 0, ref, block_id)
                        for ref in range(len(kv_caches.group_data_refs[0])))

    def worker(self, kv_caches: CanonicalKVCaches) -> Any:
        # One worker per spec, as in vLLM. It copies to and from whatever
        # pointers a job names, so other caches of the same shape work too.
        worker = self.spec.get_worker(kv_caches)
        if worker not in self.workers:
            self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.spec._manager is not None:
            self.spec._manager.shutdown()


def device_pointers(kv_caches: CanonicalKVCaches, block_ids: list[int], group_sizes: list[int] | None = None,
                    block_indices: list[int] | None = None) -> Any:
    """vLLM's own pointer resolution for some GPU blocks of these caches."""
    groups = len(kv_caches.group_data_refs)
    spec = GPULoadStoreSpec(block_ids, group_sizes=group_sizes or [len(block_ids)] + [0] * (groups - 1),
                            block_indices=block_indices or [0] * groups)
    return resolve_device_pointers(spec, kv_caches)


def block_bytes(kv_caches: CanonicalKVCaches, group: int, ref: int, block_id: int) -> bytes:
    r = kv_caches.group_data_refs[group][ref]
    t = kv_caches.tensors[r.tensor_idx].tensor
    return t[block_id, :r.page_size_bytes].numpy().tobytes()


def run_jobs(worker: Any, job_ids: set[int]) -> dict[int, bool]:
    """Wait for jobs and collect their results (success per job id)."""
    worker.wait(job_ids)
    results: dict[int, bool] = {}

    def done() -> bool:
        for r in worker.get_finished():
            results[r.job_id] = r.success
        return job_ids <= results.keys()

    wait_until(done, 30.0, f"jobs {sorted(job_ids)}")
    return results


@pytest.fixture
def hisparsed(daemon_factory: Any) -> Any:
    """The root fixture's daemon with a 10 s lease: on a loaded CI machine a test
    process can stall past a 2 s lease, and nothing here tests lease expiry."""
    return daemon_factory(lease_ttl=10)


@pytest.fixture
def engines(hisparsed: Any) -> Iterator[Any]:
    """``engines(**offloading_config overrides)`` -> Engine on the test's daemon."""
    made: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        config = offloading_config(hisparsed.socket, **overrides)
        spec = OffloadingSpecFactory.create_spec(config)
        assert isinstance(spec, HiSparseOffloadingSpec)
        engine = Engine(spec)
        made.append(engine)
        return engine

    make.daemon = hisparsed  # type: ignore[attr-defined]
    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def vllm_engines(hisparsed: Any) -> Iterator[Any]:
    """``vllm_engines(**VllmEngine keywords)`` -> vLLM's real Scheduler over the test's daemon
    (``tests.vllm.harness``), shut down at the end of the test."""
    from tests.vllm.harness import VllmEngine  # builds vLLM's whole scheduler: only where used

    made: list[VllmEngine] = []

    def make(**kw: Any) -> VllmEngine:
        engine = VllmEngine(hisparsed.socket, **kw)
        made.append(engine)
        return engine

    make.daemon = hisparsed  # type: ignore[attr-defined]
    yield make
    for engine in made:
        engine.shutdown()
